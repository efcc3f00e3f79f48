"""A rank that hangs rather than dies ends the job in minutes, not at the collective timeout.

A dead rank ends a torchrun job at once (torchrun sees the exit and stops the others). A rank that
is stopped (SIGSTOP, a frozen node, a process stuck in the kernel) does not exit: every other
rank waits in its next collective until ``parallel.timeout_minutes`` (2 hours by default, since
one rank may legitimately generate for a long time while the others wait). The watchdog tells
the two apart with heartbeats that do not depend on the training work: each rank's background
thread bumps a counter in torchrun's store every ``watchdog_minutes / 10`` and watches the
counter of the next rank in a ring (2 store operations per rank and beat, whatever the world
size). A rank whose counter has not moved for ``parallel.watchdog_minutes`` is hung: its watcher
prints which rank and exits its own process with ``EXIT_PEER_HUNG``; torchrun then stops the
job (SIGTERM, SIGKILL after its ``--shutdown-timeout``), or restarts it with ``--max-restarts``.
Bound: a hang ends the job within ``watchdog_minutes`` + one beat + torchrun's shutdown timeout.

A rank that is only slow (generating, saving, waiting in a collective) keeps beating: its thread
runs whenever the main thread is in C code that releases the GIL, which torch, gloo, NCCL and
vLLM's kernels do.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_PEER_HUNG = 76
"""Exit status of a rank that ended itself because another rank stopped beating."""


def start_heartbeat(store, rank: int, world_size: int, timeout_s: float) -> threading.Event:
    """Start this rank's heartbeat and ring watcher on ``store`` (a daemon thread); returns the
    event that stops it."""
    stop = threading.Event()
    thread = threading.Thread(target=_beat_and_watch, name="dgpo-watchdog", daemon=True,
                              args=(store, rank, world_size, timeout_s, stop))
    thread.start()
    return stop


def _beat_and_watch(store, rank: int, world_size: int, timeout_s: float, stop: threading.Event):
    peer = (rank + 1) % world_size
    interval = timeout_s / 10
    last_seen, last_change = None, time.monotonic()
    while not stop.wait(interval):
        try:
            store.add(f"heartbeat/{rank}", 1)
            seen = store.add(f"heartbeat/{peer}", 0)  # reads the counter (0 if never set)
        except Exception:  # the store's host (torchrun's agent) is gone: the job is ending
            return
        now = time.monotonic()
        if seen != last_seen:
            last_seen, last_change = seen, now
        elif now - last_change > timeout_s:
            print(f"[megatron-dgpo] watchdog: rank {peer} has not beaten for {now - last_change:.0f} s "
                  f"(parallel.watchdog_minutes={timeout_s / 60:g}): it is stopped or its node is "
                  f"gone; rank {rank} exits ({EXIT_PEER_HUNG}) so that the launcher ends the job",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_PEER_HUNG)  # the main thread may be blocked in that rank's collective
