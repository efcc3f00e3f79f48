"""Ctrl-C that is never lost.

A SIGINT that lands while the process forks (Megatron's checkpoint writers fork one process per
bucket; vLLM and the reward pool start workers) makes Python raise ``KeyboardInterrupt`` inside
an at-fork hook (``logging._releaseLock``), where CPython prints "Exception ignored" and DROPS
it: the run went on training as if Ctrl-C had never been pressed (seen in tests/test_trainer.py
under load, the SIGINT landing in a save's fork or elsewhere). ``ctrl_c_not_lost()`` installs a
SIGINT handler that records the signal before raising as Python's default handler does; its
``check()`` raises ``KeyboardInterrupt`` at a safe point if a SIGINT was recorded (its own
``KeyboardInterrupt`` can only still be pending there if it was dropped), and so does leaving
the block normally::

    with ctrl_c_not_lost() as ctrl_c:      # the trainer, around its loop
        for step in ...:
            ctrl_c.check()                  # a dropped Ctrl-C stops the run here
            ...

Blocks nest: an inner block shares the outer one's record, so a save inside the loop still
refuses to publish after a dropped Ctrl-C. Only the main thread handles signals, and another
program's own SIGINT handler is left alone (the block then does nothing).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class CtrlC:
    """The record of SIGINTs received while a ``ctrl_c_not_lost`` block is active."""

    def __init__(self):
        self.received = 0

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if a SIGINT arrived (and its exception was dropped)."""
        if self.received:
            raise KeyboardInterrupt("Ctrl-C (its KeyboardInterrupt was dropped in a fork hook)")

    def _on_sigint(self, signum, frame):
        self.received += 1
        signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as without the block


@contextmanager
def ctrl_c_not_lost():
    """Yield a ``CtrlC`` recording SIGINTs during the block; ``check()`` it at safe points. A
    block left normally after a SIGINT raises ``KeyboardInterrupt`` (module docstring)."""
    current = signal.getsignal(signal.SIGINT)
    outer = getattr(current, "__self__", None)
    if isinstance(outer, CtrlC):  # nested: share the outer record and handler
        yield outer
        outer.check()
        return
    guard = CtrlC()
    if threading.current_thread() is not threading.main_thread() or current is not signal.default_int_handler:
        yield guard  # no handler of ours: check() never fires
        return
    signal.signal(signal.SIGINT, guard._on_sigint)
    try:
        yield guard
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    guard.check()
