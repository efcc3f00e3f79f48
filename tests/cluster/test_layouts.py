"""A 4-rank layout (TP2 x DP2: two colocated TP=2 engines) of the tiny trainer against the 1-rank
run (``make test-cluster``): step 1's samples are token-identical (same rollout metrics, from
the same seeds per global prompt index), the training metrics agree to float32 rounding over
two steps, and the tokens each engine sampled are the batch's two halves.
``benchmarks/bench_layouts.py`` runs all six layouts up to 8 ranks."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

from megatron_dgpo.telemetry import read_metrics
from tests.cluster.conftest import QUIET, RECIPE, ROOT
from tests.distributed import free_port


def _train(run_dir, ranks: int, *overrides: str) -> str:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                 "--master-port", str(free_port())] if ranks > 1 else [sys.executable])
    proc = subprocess.run(launcher + ["-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}", *QUIET,
                                      "train.steps=2", "checkpoint.save_every=0", *overrides],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=1200, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_tp2_dp2_equals_one_rank(tiny_first_steps, tmp_path):
    """The 1-rank run is ``tiny_first_steps`` (tests/conftest.py: a run of fewer steps is the
    longer run's beginning)."""
    err = _train(tmp_path / "tp2dp2", 4, "parallel.tensor_parallel=2")
    shares = sorted((int(a), int(b)) for a, b in re.findall(r"samples batch positions (\d+)\.\.(\d+) of 32", err))
    assert shares == [(0, 15), (16, 31)]  # one TP=2 engine per replica, whole groups each
    one, four = tiny_first_steps[:2], read_metrics(tmp_path / "tp2dp2")
    assert [r["step"] for r in four] == [r["step"] for r in one] == [1, 2]
    rollout = lambda r: {k: v for k, v in r.items() if k.startswith("rollout/") and k != "rollout/engines"}  # noqa: E731
    assert rollout(four[0]) == rollout(one[0])  # step 1: the same tokens sampled
    assert four[0]["rollout/engines"] == 2 and one[0]["rollout/engines"] == 1
    for got, want in zip(four, one):
        for key in (k for k in want if k.startswith("train/")):
            a, b = got[key], want[key]
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), (key, a, b)
