"""Shared by the cluster-life tests (``make test-cluster``): the uninterrupted reference run, a
2-rank DP=2 tiny job under torchrun on this host, whose metrics every interrupted, restarted or
SLURM-run job must reproduce."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dgpo.telemetry import read_metrics
from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
QUIET = ["logging.progress_bar=false", "logging.tensorboard=false"]
REFERENCE_STEPS = 100
VARYING = ("time", "time/", "throughput/", "refit/seconds")
"""Wall-clock measurements; everything else in a metrics line is a function of the config."""


def deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VARYING)}


def assert_same_run(records: list[dict], reference: list[dict]) -> None:
    """``records`` are steps 1..n of the reference run, bit for bit (but wall-clock keys)."""
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    for got, want in zip(records, reference):
        assert deterministic(got) == deterministic(want), got["step"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "megatron_dgpo.train", str(RECIPE),
           f"run_dir={run_dir}", *QUIET, f"train.steps={REFERENCE_STEPS}",
           # no scheduled saves: they change no compared metric (the SLURM jobs save on another
           # schedule and equal it), and 50 of them cost this 100-step run minutes
           "checkpoint.save_every=0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=1200, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(run_dir)
    assert len(records) == REFERENCE_STEPS
    return records
