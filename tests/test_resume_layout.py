"""Resume at another parallel layout, end to end through the trainer CLI (real vLLM, gloo).

A tiny run saved at TP=2 resumes at TP=1 (one process) and at PP=2 (two ranks); the step after
the resume equals the TP=2 run's own next step within 1e-5. The TP=2 run is uninterrupted: a
same-layout resume equals the uninterrupted run exactly (tests/test_trainer.py, the killed-mid-save
test), so it stands for the same-layout resume here. The checkpoint written after each resume
records the new layout, and the resume logs that RNG states were not carried over.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dgpo.telemetry import read_metrics
from megatron_dgpo.training.checkpoint import latest_checkpoint
from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
COMMON = ["logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_every=1",
          "checkpoint.keep_last=2", "checkpoint.export_hf=false", "train.steps=2",
          "train.rollout_batch_prompts=16"]  # two updates of 8 prompts per step
WALL_CLOCK = ("time", "time/", "throughput/", "refit/seconds")  # everything else in a line is a function of the config


def _launch(run_dir: Path, *overrides: str, ranks: int, resume: bool = False) -> subprocess.Popen:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                     "--master-port", str(free_port())]
    cmd = launcher + ["-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}", *COMMON,
                      *overrides] + (["--resume"] if resume else [])
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}"
    return err


def _fork_at(source: Path, target: Path, step: int) -> Path:
    """A copy of run ``source`` whose newest checkpoint is ``step`` (as if it stopped there)."""
    shutil.copytree(source, target)
    checkpoints = target / "checkpoints"
    for later in checkpoints.glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (checkpoints / "latest").write_text(f"step_{step:06d}\n")
    return target


def _assert_close(got: dict, want: dict, tol: float) -> None:
    got = {k: v for k, v in got.items() if not k.startswith(WALL_CLOCK)}
    want = {k: v for k, v in want.items() if not k.startswith(WALL_CLOCK)}
    assert got.keys() == want.keys()
    for key, b in want.items():
        a = got[key]
        assert (a is b) if a is None or b is None else math.isclose(a, b, rel_tol=tol, abs_tol=tol), \
            (key, a, b)


def _layout(run_dir: Path) -> dict:
    latest = latest_checkpoint(run_dir / "checkpoints")
    return json.loads((latest / "trainer_state.json").read_text())["extra"]["layout"]


@pytest.mark.slow  # ~40 s: `make test-slow`
def test_saved_at_tp2_resumes_at_tp1_and_pp2(tmp_path):
    tp2 = tmp_path / "tp2"
    _finish(_launch(tp2, "parallel.tensor_parallel=2", ranks=2))
    reference = read_metrics(tp2)
    assert [r["step"] for r in reference] == [1, 2]
    assert _layout(tp2) == {"tensor_parallel": 2, "pipeline_parallel": 1, "context_parallel": 1,
                            "data_parallel": 1, "expert_parallel": 1}

    # Both resumes at once (they share nothing but the CPU).
    tp1, pp2 = _fork_at(tp2, tmp_path / "tp1", 1), _fork_at(tp2, tmp_path / "pp2", 1)
    jobs = [_launch(tp1, ranks=1, resume=True),
            _launch(pp2, "parallel.pipeline_parallel=2", ranks=2, resume=True)]
    errs = [_finish(job) for job in jobs]

    for run_dir, err, layout in ((tp1, errs[0], (1, 1)), (pp2, errs[1], (1, 2))):
        records = read_metrics(run_dir)
        assert [r["step"] for r in records] == [1, 2]
        _assert_close(records[-1], reference[-1], tol=1e-5)  # measured: <= 7e-7
        assert f"saved at TP=2 PP=1, resuming at TP={layout[0]} PP={layout[1]}" in err, err[-3000:]
        assert "RNG states are not restored" in err
        # the checkpoint written after the resume records the layout it was written at
        assert latest_checkpoint(run_dir / "checkpoints").name == "step_000002"
        assert _layout(run_dir) == {"tensor_parallel": layout[0], "pipeline_parallel": layout[1],
                                    "context_parallel": 1, "data_parallel": 1,
                                    "expert_parallel": 1}
