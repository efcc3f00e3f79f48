"""Stopping a run on a signal without losing a completed step.

Clusters end jobs with signals: SLURM sends SIGTERM at a time limit, ``scancel`` or
``scontrol requeue``, and ``sbatch --signal=USR1@<s>`` sends SIGUSR1 ahead of the limit; a user
presses Ctrl-C (SIGINT). ``stop_requests()`` turns the first of these into a request: the handler
only records it, the loop finishes the step in flight, all ranks agree at the step boundary
(``StopRequests.agreed``: a MAX all-reduce, so one rank's signal stops every rank at the same
step, as Megatron-LM's ``dist_signal_handler``), a checkpoint is written and the process exits
with ``EXIT_STOPPED``. A second signal stops at once: ``KeyboardInterrupt`` for SIGINT,
``SystemExit(128 + signum)`` otherwise, so ``finally`` blocks still close engines and workers
(the same signal again within ``REPEAT_WINDOW_SECONDS`` is a duplicate delivery, not a second
signal)::

    with stop_requests() as stop:            # the trainer, around its loop
        for step in ...:
            ...                              # a step; the save, if scheduled
            if stop.agreed(budget_exceeded):
                ...                          # save (unless just saved), then leave the loop

Signals during a save: the first one lets the save finish and publish; a second raises, and the
save block (``checkpoint.save_checkpoint`` nests a ``stop_requests()``) publishes nothing.

Ctrl-C is never lost. A signal that lands while the process forks (vLLM and the reward pool
start workers; megatron-core 0.16's checkpoint writers forked, 0.19's are threads) makes Python raise inside an at-fork hook, where
CPython prints "Exception ignored" and DROPS the exception. The first signal raises nothing, so
there is nothing to drop; a second one's exception can be dropped, and ``check()`` (and leaving
the block) raises it again from the record.

Helper processes must outlive a stop signal: SLURM sends it to every process of a job step,
so a grader worker or the result queue's manager of Megatron's checkpoint writers would die of
it and the save in flight would break. ``children_keep_running()``
starts such children with the stop signals blocked; the mask is inherited across fork and exec,
so they never see them (the parent closes them), while the parent's signals stay pending until
the block ends, or reach another thread of it, and are not lost.

Blocks nest: an inner block shares the outer one's record. Handlers are installed only in the
main thread and only over the default disposition: a signal the parent set to ignored (a
``nohup``, a shell without job control for SIGINT) stays ignored, and another program's own
handler is left alone (the block then records nothing for that signal).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""Signals that ask the run to stop at the next step boundary."""

REPEAT_WINDOW_SECONDS = 2.0
"""A signal repeated within this many seconds of the first is the same request: SLURM sends
SIGTERM to every process of a step and torchrun forwards the same signal to its workers, so a
trainer under both receives it twice within milliseconds."""

EXIT_STOPPED = 75
"""Exit status of a run stopped early by a signal or by its time budget after saving a
checkpoint (sysexits' EX_TEMPFAIL: "try again later"): re-running the same command continues it
(``checkpoint.resume: auto``). ``slurm/train.sbatch`` requeues the job on it."""


class StopRequests:
    """The record of stop signals received while a ``stop_requests`` block is active."""

    def __init__(self):
        self.received: list[int] = []
        self._first_at = 0.0

    @property
    def requested(self) -> bool:
        """A stop signal arrived on this rank."""
        return bool(self.received)

    @property
    def reason(self) -> str:
        return signal.Signals(self.received[0]).name if self.received else ""

    def check(self) -> None:
        """Raise the exception of a second signal if a fork hook dropped it."""
        if len(self.received) >= 2:
            raise _stop_now(self.received[-1])

    def agreed(self, local_reason: bool = False, group=None) -> bool:
        """Collective over ``group`` (default: the world): whether any rank received a stop
        signal or has ``local_reason`` (e.g. its time budget) to stop after this step. Every
        rank gets the same answer, so all stop at the same step."""
        from megatron_dgpo.runtime.comm import any_rank

        self.check()
        return any_rank(self.requested or local_reason, group=group)

    def _on_signal(self, signum, frame):
        now = time.monotonic()
        if self.received and signum == self.received[0] and now - self._first_at < REPEAT_WINDOW_SECONDS:
            return  # the same request delivered twice (REPEAT_WINDOW_SECONDS)
        self.received.append(signum)
        if len(self.received) >= 2:
            raise _stop_now(signum)
        self._first_at = now
        print(f"[megatron-dgpo] {signal.Signals(signum).name} received: stopping after the step in "
              f"flight with a checkpoint; send it again to stop at once", file=sys.stderr, flush=True)


def _stop_now(signum: int) -> BaseException:
    if signum == signal.SIGINT:
        return KeyboardInterrupt("a second stop signal: stopping at once")
    return SystemExit(128 + signum)


def _is_default(signum: int, handler) -> bool:
    return handler is signal.SIG_DFL or (signum == signal.SIGINT and handler is signal.default_int_handler)


@contextmanager
def stop_requests():
    """Yield a ``StopRequests`` recording stop signals during the block (module docstring)."""
    current = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    outer = next((getattr(h, "__self__", None) for h in current.values()
                  if isinstance(getattr(h, "__self__", None), StopRequests)), None)
    if outer is not None:  # nested: share the outer record and handlers
        yield outer
        outer.check()
        return
    record = StopRequests()
    if threading.current_thread() is not threading.main_thread():
        yield record  # only the main thread handles signals: nothing is recorded
        return
    ours = [s for s, handler in current.items() if _is_default(s, handler)]
    for signum in ours:
        signal.signal(signum, record._on_signal)
    try:
        yield record
    finally:
        for signum in ours:
            signal.signal(signum, current[signum])
    record.check()


class TimeBudget:
    """A run's own time limit (``train.max_minutes``), counted from its creation: ``exceeded``
    says whether another step and a save would likely overrun it."""

    def __init__(self, minutes: float | None):
        self.deadline = None if minutes is None else time.monotonic() + 60.0 * minutes

    def exceeded(self, step_seconds: float, save_seconds: float = 0.0) -> bool:
        return self.deadline is not None and time.monotonic() + step_seconds + save_seconds > self.deadline


@contextmanager
def children_keep_running():
    """Processes started in this block ignore the stop signals (they stay blocked in them); in
    this thread the signals wait until the block ends (module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # multiprocessing starts its resource tracker on first use and UNBLOCKS SIGINT and SIGTERM
    # afterwards (resource_tracker.ensure_running): start it before blocking
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
