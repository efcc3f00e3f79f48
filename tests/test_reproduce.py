"""benchmarks/reproduce.py end to end at smoke size (the README's study command, shrunk): the
supervised warm start learns (its loss falls, it beats the random policy on held-out problems),
one RL cell runs and evaluates, the report is written, and the study run again reuses the
finished cell and gives the same row."""

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dgpo.telemetry import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--methods", "gppo", "--seeds", "3", "--settings", "paper", "--steps", "2",
         "--sft-steps", "300", "--eval-n", "4", "--eval-limit", "40",
         "--jobs", "2"]  # the random policy's evaluation beside the warm start (CI has 2 cores)


def _reproduce(out: Path) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reproduce.py"), "--out", str(out),
                           *SMOKE], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _rows(out: Path) -> list[dict]:
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # ~3-8 min: `make test-slow`
def test_reproduce_smoke_warm_start_cell_report_and_rerun(tmp_path):
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reproduce import COLUMNS

    out = tmp_path / "study"
    _reproduce(out)
    sft = read_metrics(out / "sft")
    assert len(sft) == 300
    first, last = (sum(r["sft/loss"] for r in part) / 10 for part in (sft[:10], sft[-10:]))
    assert last < 0.5 * first, (first, last)
    initial, warm = (json.loads((out / "eval" / f"{name}.json").read_text())["average"]["avg@4"]
                     for name in ("initial", "warm_start"))
    assert warm > initial + 0.05, (initial, warm)  # ~0.25 vs 0 (300 steps; 400 give ~0.6)

    (row,) = _rows(out)
    assert tuple(row) == COLUMNS and (row["setting"], row["method"], row["seed"]) == ("paper", "gppo", "3")
    for key in ("final_accuracy", "eval_avg_at_k", "eval_pass_at_k", "entropy_start", "entropy_end",
                "max_grad_norm", "clipped_token_frac", "truncated_frac"):
        assert math.isfinite(float(row[key])), key
    assert 0 <= float(row["eval_avg_at_k"]) <= float(row["eval_pass_at_k"]) <= 1
    cell = out / "runs" / "paper" / "gppo" / "seed3"
    assert len(read_metrics(cell)) == 2 and (cell / "hf" / "config.json").is_file()
    table = (out / "results.md").read_text()
    assert "| paper | gppo | 1 |" in table and "warm_start" in table
    assert (out / "results.png").stat().st_size > 10_000

    # the study again without its table: the finished cell and the evaluations are reused (no
    # training, no sampling: the study resumes where it stopped) and give the same row. That a
    # cell run again from scratch gives the same numbers is the trainer's determinism
    # (tests/test_trainer.py, tests/cluster) and dgpo-eval's (tests/test_evaluate.py).
    (out / "results.csv").unlink()
    trained = (cell / "metrics.jsonl").stat().st_mtime_ns
    _reproduce(out)
    (again,) = _rows(out)
    assert (cell / "metrics.jsonl").stat().st_mtime_ns == trained
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in row.items() if k != "seconds"}
