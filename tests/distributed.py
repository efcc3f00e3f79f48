"""Run a function on several gloo ranks (CPU) and collect what each rank returns.

Launching costs seconds (process start, imports), so a test puts several checks into one
``run_ranks`` call. The function must be importable (module level) and its return value
picklable; an exception on any rank fails the call with that rank's traceback.

The ranks are forked from one server process per test session (multiprocessing's
``forkserver``), started by the first launch, which has imported torch, Megatron-Core and
transformers once (``PRELOAD``): a rank then starts in well under a second instead of
importing them again in a fresh interpreter (~5 s of CPU per rank, ~40 launches in
``make test``). Nothing of this project is preloaded: each rank imports ``megatron_dgpo`` (and
applies its CPU patches) itself, as before. A rank gets the caller's environment and its
arguments by value, as a spawned one did.

A forked rank ends with ``os._exit``: no atexit handler and no static destructor of a C++
library runs. vLLM's CPU engines unlink their shared-memory segments (``/dev/shm/*cpushm*``,
whose names are the same for every engine of a TP size) only there, so a rank that starts a
vLLM engine must be a fresh interpreter: ``run_ranks(..., start_method="spawn")``; a forked rank
that imported vLLM fails the launch and says so.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.pipeline_parallel", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "transformers", "safetensors.torch"]
"""What the rank server imports once (third-party only; an import that fails is left to the
ranks)."""
multiprocessing.set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, payload, environ, result_dir, forked):
    # the caller's environment (the server's is the one it had when the first launch started it)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    path = os.path.join(result_dir, f"rank{rank}.pt")
    started = False
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        started = True
        result = fn(rank, world_size, *args)
        if forked and "vllm" in sys.modules:
            raise RuntimeError(f"{fn.__module__}.{fn.__name__} imported vLLM in a forked rank, which "
                               "ends without vLLM's cleanup (its /dev/shm segments stay and the next "
                               "engine of that TP size fails): run_ranks(..., start_method='spawn')")
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


def run_ranks(fn, world_size: int, *args, timeout: float = 600.0, attempts: int = 3,
              start_method: str = "forkserver") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.
    A launch whose rendezvous port was taken by another process before ``fn`` ran is repeated
    on a new port (at most ``attempts`` launches). ``start_method``: "forkserver" (ranks forked
    from the session's preloaded server) or "spawn" (fresh interpreters: ranks that start vLLM
    engines)."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    for attempt in range(1, attempts + 1):
        results, errors, port_taken = _launch(fn, world_size, args, timeout, start_method)
        if not errors:
            return results
        if not (port_taken and attempt < attempts):
            raise AssertionError("\n".join(errors))
    raise AssertionError("unreachable")


def _launch(fn, world_size: int, args, timeout: float, start_method: str) -> tuple[list, list[str], bool]:
    # the function and its arguments by value (plain pickle: tensors are copied, not shared
    # through file descriptors, which a fork server passes at most 256 of)
    payload = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory() as result_dir:
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), payload, dict(os.environ), result_dir,
                                                start_method == "forkserver"),
                                 nprocs=world_size, join=False, start_method=start_method)
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
