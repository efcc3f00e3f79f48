"""Rank failure under torchrun, at 2 gloo ranks with colocated vLLM engines (``make test-cluster``):

* a rank killed with -9 and ``--max-restarts 1``: torchrun restarts the job, which resumes from its
  last checkpoint by itself (``checkpoint.resume: auto``) and ends with exactly the metrics of an
  uninterrupted run, with static and with c10d rendezvous (each attempt's process group has its
  own store prefix: ``parallel._attempt_store``);
* without restarts a dead rank ends the job within seconds, nothing left running;
* a rank that hangs (SIGSTOP) is caught by the heartbeat watchdog well before the collective
  timeout, and the job ends with nothing left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_dgpo.telemetry import read_metrics
from tests.cluster.conftest import QUIET, RECIPE, ROOT, assert_same_run
from tests.distributed import free_port


def _torchrun(rdzv: str, *, restarts: int) -> list[str]:
    port = str(free_port())
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--max-restarts", str(restarts), "--monitor-interval", "0.5"]
    if rdzv == "c10d":
        return launcher + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return launcher + ["--master-port", port]  # static rendezvous


def _job(run_dir: Path, rdzv: str = "static", *, restarts: int = 0, overrides=()):
    cmd = _torchrun(rdzv, restarts=restarts) + [
        "-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}", *QUIET,
        "train.steps=4", "checkpoint.save_every=2", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(proc, ready, what: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return
        time.sleep(0.05)
    out = proc.communicate()[1][-3000:] if proc.poll() is not None else ""
    pytest.fail(f"never saw {what}: exit {proc.poll()}\n{out}")


def _rank(proc, rank: int):
    return next(p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == str(rank))


def _finish(proc, timeout: float = 600):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"job still running after {timeout} s:\n{err[-3000:]}")
    return err


def _logged(run_dir: Path, steps: int):
    return lambda: (run_dir / "metrics.jsonl").exists() and len(
        (run_dir / "metrics.jsonl").read_text().splitlines()) >= steps


def _saved(run_dir: Path, name: str):
    latest = run_dir / "checkpoints" / "latest"
    return lambda: latest.exists() and latest.read_text().strip() == name


def _nothing_left(processes) -> None:
    _, alive = psutil.wait_procs(processes, timeout=30)
    running = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not running, running


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_killed_rank_is_restarted_and_resumes_exactly(reference, tmp_path, rdzv):
    run_dir = tmp_path / rdzv
    proc = _job(run_dir, rdzv, restarts=1)
    _wait_for(proc, _saved(run_dir, "step_000002"), "the step-2 checkpoint")
    _rank(proc, 1).kill()
    err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    # the dead attempt's logged tail is replaced; the restarted attempt continued bit for bit
    assert_same_run(read_metrics(run_dir), reference[:4])
    assert len(read_metrics(run_dir)) == 4


def test_dead_rank_ends_the_job_in_seconds_and_a_hung_rank_is_caught_by_the_watchdog(tmp_path):
    # A dead rank, no restarts: torchrun ends the job at once, nothing is left running.
    run_dir = tmp_path / "dead"
    proc = _job(run_dir)
    _wait_for(proc, _logged(run_dir, 1), "step 1")
    everything = psutil.Process(proc.pid).children(recursive=True)
    _rank(proc, 1).kill()
    killed = time.monotonic()
    err = _finish(proc, timeout=120)
    dead_seconds = time.monotonic() - killed
    assert proc.returncode != 0 and dead_seconds < 20, (dead_seconds, err[-2000:])
    _nothing_left(everything)

    # A hung rank (SIGSTOP): the other rank's watcher sees its heartbeat stop after
    # watchdog_minutes (15 s here) and ends itself; torchrun SIGKILLs the stopped one after its
    # shutdown timeout. Without the watchdog the job would wait parallel.timeout_minutes (2 h).
    run_dir = tmp_path / "hung"
    proc = _job(run_dir, overrides=["parallel.watchdog_minutes=0.25"])
    _wait_for(proc, _logged(run_dir, 1), "step 1")
    everything = psutil.Process(proc.pid).children(recursive=True)
    os.kill(_rank(proc, 1).pid, signal.SIGSTOP)
    stopped = time.monotonic()
    err = _finish(proc, timeout=300)
    hung_seconds = time.monotonic() - stopped
    assert proc.returncode != 0, err[-3000:]
    assert "watchdog: rank 1 has not beaten" in err, err[-3000:]
    assert hung_seconds < 15 + 1.5 + 30 + 15, hung_seconds  # watchdog + a beat + torchrun's SIGKILL
    _nothing_left(everything)
    print(f"dead rank: job ended {dead_seconds:.1f} s after kill -9; hung rank: {hung_seconds:.1f} s after SIGSTOP")
