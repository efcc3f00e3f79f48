"""Helper processes die with the process that started them, whatever ends it (SIGKILL too).

``children_die_with_this_process()`` (process-wide, idempotent; Linux) makes every child this
process starts afterwards through ``multiprocessing``, spawned (reward workers, Megatron's
checkpoint writer and its result queue's manager, vLLM's engine processes) or forked from the
main thread, ask the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), first
thing (a spawned child in the ``-c`` program multiprocessing runs, before any import), and
exit at once if the parent is already gone. A child started from another thread is left as it
is: the kernel would kill it when that thread ends. The resource tracker exits by itself once
every process holding its pipe is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
_installed = False
_fork: list = []  # (forking from the main thread, the forking process's pid)


def _die_with_parent(parent: int) -> None:
    """In a child: SIGKILL when ``parent`` dies; gone already when it has."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _spawn_command_line(original):
    def get_command_line(**kwargs):
        argv = original(**kwargs)
        if threading.current_thread() is not threading.main_thread():
            return argv  # the death signal follows the starting thread (below)
        at = argv.index("-c") + 1
        argv[at] = (f"import ctypes,os;ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG},"
                    f"{int(signal.SIGKILL)});os.getppid()=={os.getpid()} or os._exit(1);"
                    + argv[at])
        return argv

    get_command_line._dgpo_dies_with_parent = True
    return get_command_line


def _before_fork() -> None:
    _fork[:] = [threading.current_thread() is threading.main_thread(), os.getpid()]


def _after_fork_in_child() -> None:
    # the death signal follows the forking thread: only the main thread lives as long as we do
    if _fork and _fork[0]:
        _die_with_parent(_fork[1])


def children_die_with_this_process() -> None:
    """From now on, children started through ``multiprocessing`` die with this process."""
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    from multiprocessing import spawn

    if not getattr(spawn.get_command_line, "_dgpo_dies_with_parent", False):
        spawn.get_command_line = _spawn_command_line(spawn.get_command_line)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _installed = True
