"""megatron_dgpo.runtime.interrupt: a first stop signal is a request; a second stops at once, even when
its exception is dropped in a fork hook; the time budget."""

import os
import signal
import threading
import time

import pytest

from megatron_dgpo.runtime.interrupt import (REPEAT_WINDOW_SECONDS, TimeBudget,
                                             children_keep_running, stop_requests)


def _signal_in_fork(signum):
    """``signum`` delivered inside an at-fork hook, where CPython drops the handler's exception
    (the situation of a Ctrl-C landing in os.fork)."""
    armed = [True]

    def hook():
        if armed:
            armed.clear()
            signal.raise_signal(signum)

    os.register_at_fork(after_in_parent=hook)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


@pytest.fixture
def default_dispositions():
    """The default dispositions during the test (an earlier test of the session may have left
    another handler installed; the block leaves a foreign handler alone by design)."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                signal.SIGUSR1: signal.SIG_DFL}
    previous = {s: signal.signal(s, h) for s, h in defaults.items()}
    yield defaults
    for s, h in previous.items():
        signal.signal(s, h)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_first_signal_is_a_request_second_stops_at_once(default_dispositions, signum):
    with stop_requests() as stop:
        assert not stop.requested and not stop.agreed()  # no process group: this rank decides
        signal.raise_signal(signum)  # recorded, nothing raised: the step in flight finishes
        assert stop.requested and stop.reason == signal.Signals(signum).name
        assert stop.agreed() and stop.agreed(local_reason=False)
        signal.raise_signal(signum)  # the same signal at once: a duplicate delivery (SLURM + torchrun)
        assert len(stop.received) == 1
        time.sleep(REPEAT_WINDOW_SECONDS)
        with pytest.raises(KeyboardInterrupt if signum == signal.SIGINT else SystemExit) as err:
            signal.raise_signal(signum)
        if signum != signal.SIGINT:
            assert err.value.code == 128 + signum  # as a process killed by the signal reports
        stop.received.clear()
    for s, handler in default_dispositions.items():
        assert signal.getsignal(s) is handler  # restored


def test_second_signal_dropped_in_a_fork_raises_at_check_and_at_block_end_even_nested(default_dispositions):
    with pytest.raises(SystemExit):
        with stop_requests() as outer:
            outer.check()  # nothing received yet: no-op
            signal.raise_signal(signal.SIGINT)  # the first: a request
            with pytest.raises(SystemExit):  # the inner block (a save) refuses to finish
                with stop_requests() as inner:
                    assert inner is outer
                    _signal_in_fork(signal.SIGTERM)  # the second: its exception is dropped
                    assert len(outer.received) == 2
            outer.check()  # the loop's safe point raises too
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    # A first signal in a fork is kept too: it is only a record.
    with stop_requests() as stop:
        _signal_in_fork(signal.SIGTERM)
        assert stop.requested and stop.reason == "SIGTERM"
        stop.received.clear()


def test_ignored_and_foreign_dispositions_are_left_alone(default_dispositions):
    def foreign(signum, frame):
        pass

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # e.g. nohup, or a parent that ignores it
    signal.signal(signal.SIGUSR1, foreign)
    with stop_requests() as stop:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) is foreign
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGUSR1)
        assert not stop.requested
    assert signal.getsignal(signal.SIGUSR1) is foreign


def test_time_budget():
    assert not TimeBudget(None).exceeded(1e9, 1e9)
    budget = TimeBudget(1.0)  # one minute from now
    assert not budget.exceeded(step_seconds=10.0, save_seconds=5.0)
    assert budget.exceeded(step_seconds=50.0, save_seconds=15.0)
    short = TimeBudget(0.5 / 60)  # half a second
    time.sleep(0.6)
    assert short.exceeded(0.0)


def _sleep_forever():
    time.sleep(600)


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_children_started_in_the_block_outlive_stop_signals_and_the_parent_keeps_its_own(
        default_dispositions, start_method):
    """SLURM signals every process of a step: a helper started in ``children_keep_running``
    survives SIGTERM/SIGUSR1/SIGINT (it is closed by its parent), one started outside does not;
    a signal sent to the parent during the block is recorded when the block ends."""
    import multiprocessing as mp

    ctx = mp.get_context(start_method)
    with stop_requests() as stop:
        with children_keep_running():
            kept = ctx.Process(target=_sleep_forever, daemon=True)
            kept.start()
            # to this thread: a process-directed signal may go to another thread (gloo's,
            # a pool's) that does not block it, and is then handled at once
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            assert not stop.requested
        assert stop.requested and stop.reason == "SIGUSR1"
        stop.received.clear()
    plain = ctx.Process(target=_sleep_forever, daemon=True)
    plain.start()
    time.sleep(1.0 if start_method == "spawn" else 0.2)  # let the spawned interpreters start
    try:
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            os.kill(kept.pid, signum)
        os.kill(plain.pid, signal.SIGTERM)
        plain.join(10)
        kept.join(1.0)
        assert plain.exitcode == -signal.SIGTERM
        assert kept.is_alive()
    finally:
        kept.kill()
        plain.kill()
