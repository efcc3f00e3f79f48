"""Run a function on several gloo ranks (CPU) and collect what each rank returns.

Launching costs seconds (process start, imports), so a test puts several checks into one
``run_ranks`` call. The function must be importable (module level) and its return value
picklable; an exception on any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    path = os.path.join(result_dir, f"rank{rank}.pt")
    started = False
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        started = True
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        error = traceback.format_exc()
        # free_port() only finds a port free at that moment: another process may take it before
        # rank 0 binds the rendezvous store. Only such a failure is retried with a new port.
        port_taken = not started and "EADDRINUSE" in error
        torch.save({"ok": False, "error": error, "port_taken": port_taken}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 600.0, attempts: int = 3) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.
    A launch whose rendezvous port was taken by another process before ``fn`` ran is repeated
    on a new port (at most ``attempts`` launches)."""
    for attempt in range(1, attempts + 1):
        results, errors, port_taken = _launch(fn, world_size, args, timeout)
        if not errors:
            return results
        if not (port_taken and attempt < attempts):
            raise AssertionError("\n".join(errors))
    raise AssertionError("unreachable")


def _launch(fn, world_size: int, args, timeout: float) -> tuple[list, list[str], bool]:
    with tempfile.TemporaryDirectory() as result_dir:
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), fn, args, result_dir),
                                 nprocs=world_size, join=False, start_method="spawn")
        errors, port_taken = [], False
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=2.0):
                if time.monotonic() > deadline:
                    for process in ctx.processes:
                        process.kill()
                    errors.append(f"ranks still running after {timeout:.0f} s: killed")
                    break
        except Exception as exc:  # noqa: BLE001 - collect the ranks' own tracebacks below
            errors.append(str(exc))
        results = []
        for rank in range(world_size):
            path = os.path.join(result_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank} wrote no result")
                continue
            record = torch.load(path, weights_only=False)
            if record["ok"]:
                results.append(record["result"])
            else:
                port_taken |= record.get("port_taken", False)
                errors.append(f"rank {rank} failed:\n{record['error']}")
        return results, errors, port_taken
