"""megatron_dgpo.interrupt: a Ctrl-C whose KeyboardInterrupt a fork hook drops still stops the run."""

import os
import signal

import pytest

from megatron_dgpo.interrupt import ctrl_c_not_lost


def _sigint_dropped_in_fork():
    """A SIGINT delivered inside an at-fork hook, where CPython drops the KeyboardInterrupt (the
    situation of a Ctrl-C landing in os.fork)."""
    armed = [True]

    def hook():
        if armed:
            armed.clear()
            signal.raise_signal(signal.SIGINT)

    os.register_at_fork(after_in_parent=hook)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler during the test (an earlier test of the session may have
    left another one installed; the guard leaves a foreign handler alone by design)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_dropped_ctrl_c_raises_at_check_and_at_block_end_even_nested(default_sigint):
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_not_lost() as outer:
            outer.check()  # nothing received yet: no-op
            with pytest.raises(KeyboardInterrupt):  # the inner block (a save) refuses to finish
                with ctrl_c_not_lost() as inner:
                    assert inner is outer
                    _sigint_dropped_in_fork()  # no exception reaches here
                    assert outer.received == 1
            outer.check()  # the loop's safe point raises too
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored

    # without the guard the same Ctrl-C is lost: the code simply continues
    _sigint_dropped_in_fork()
    with ctrl_c_not_lost() as guard:
        guard.check()
