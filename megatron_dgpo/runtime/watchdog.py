"""A rank that hangs rather than dies ends the job in minutes, not at the collective timeout: each
rank's daemon thread beats a counter in torchrun's store every ``watchdog_minutes / 10`` and
watches the next rank's in a ring; one still for ``parallel.watchdog_minutes`` makes the watcher
name that rank and exit with ``EXIT_PEER_HUNG``, so torchrun stops (or restarts) the job.
Why and the bound: docs/training.md#resuming-stop-signals-and-time-limits."""

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
