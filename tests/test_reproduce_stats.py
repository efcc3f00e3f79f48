"""benchmarks/reproduce.py's statistics and its results file, against closed forms (fast)."""

import csv
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import reproduce  # noqa: E402


def test_student_t_against_closed_forms_and_tables():
    # df 1 (Cauchy) and df 2 have closed-form tails
    for t in (0.3, 1.0, 2.5, 12.0):
        assert reproduce.t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-10)
        assert reproduce.t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-10)
    for x in (0.1, 0.5, 0.93):  # I_x(a, 1) = x^a
        assert reproduce.incomplete_beta(3.5, 1.0, x) == pytest.approx(x ** 3.5, rel=1e-10)
    # two-sided 95% critical values from the t table
    for df, want in ((1, 12.7062), (4, 2.7764), (9, 2.2622), (19, 2.0930), (39, 2.0227)):
        assert reproduce.t_quantile(0.975, df) == pytest.approx(want, abs=1e-4)


def test_sign_flip_p_by_enumeration():
    assert reproduce.sign_flip_p([1.0, 1.0, 1.0]) == 2 / 8  # only all-plus and all-minus reach 3
    # [1, 2, 3, 4]: |sum| >= 10 only for all-plus / all-minus
    assert reproduce.sign_flip_p([1.0, 2.0, 3.0, 4.0]) == 2 / 16
    # [3, -1]: sums 2, 4, -4, -2: |s| >= 2 always
    assert reproduce.sign_flip_p([3.0, -1.0]) == 1.0
    with pytest.raises(ValueError, match="1..20"):
        reproduce.sign_flip_p([0.1] * 21)


def _rows(diffs_by_warm: dict[int, list[float]], base: float = 0.5) -> list[dict]:
    rows = []
    for warm, diffs in diffs_by_warm.items():
        for seed, d in enumerate(diffs):
            rows.append(dict(setting="paper_early", method="grpo", seed=seed, warm_start=warm,
                             eval_avg_at_k=base))
            rows.append(dict(setting="paper_early", method="dgpo", seed=seed, warm_start=warm,
                             eval_avg_at_k=base + d))
    rows.append(dict(setting="paper_early", method="dgpo", seed=99, warm_start=0,
                     eval_avg_at_k=0.0))  # no GRPO partner: not paired
    return rows


def test_paired_comparison_and_verdict():
    lead = {0: [0.04, 0.03, 0.05, 0.02, 0.04], 1: [0.03, 0.05, 0.02, 0.04, 0.03]}
    c = reproduce.paired(_rows(lead), "paper_early", "dgpo", "grpo")
    diffs = lead[0] + lead[1]
    assert c.differences == pytest.approx(diffs) and set(c.by_warm_start) == {0, 1}
    mean, sd = sum(diffs) / 10, math.sqrt(sum((d - 0.035) ** 2 for d in diffs) / 9)
    assert c.mean == pytest.approx(mean) and c.t == pytest.approx(mean / (sd / math.sqrt(10)))
    low, high = c.interval()
    assert (high - low) / 2 == pytest.approx(2.2622 * sd / math.sqrt(10), rel=1e-4)
    text = reproduce.verdict(c)
    assert "**Reproduced at this scale**" in text and "+3.5 points over 10 pairs" in text
    # ahead overall and significant, but behind in one warm start: not reproduced
    mixed = {0: [0.08, 0.09, 0.07, 0.08, 0.09], 1: [-0.01, -0.02, -0.01, -0.02, -0.01]}
    assert "**Not reproduced" in reproduce.verdict(reproduce.paired(_rows(mixed), "paper_early", "dgpo", "grpo"))
    assert reproduce.paired(_rows({0: [0.1, 0.2]}), "paper_early", "dgpo", "grpo") is None  # < 3 pairs


def test_old_results_file_reads_as_warm_start_0_and_is_migrated(tmp_path):
    old_columns = [c for c in reproduce.COLUMNS if c != "warm_start"]
    path = tmp_path / "results.csv"
    row = {c: 1 for c in old_columns} | {"setting": "paper", "method": "dgpo", "seed": 3}
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old_columns)
        writer.writeheader()
        writer.writerow(row)
    (old,) = reproduce.read_results(path)
    assert old["warm_start"] == 0 and old["seed"] == 3
    reproduce.append_result(path, {**{c: 2 for c in reproduce.COLUMNS}, "setting": "paper",
                                   "method": "grpo", "seed": 3, "warm_start": 1})
    with open(path) as f:
        assert tuple(next(csv.reader(f))) == reproduce.COLUMNS
    rows = reproduce.read_results(path)
    assert [(r["method"], r["warm_start"]) for r in rows] == [("dgpo", 0), ("grpo", 1)]
