"""Rewards: format rule, math-verify equivalence on every item of the six benchmarks, the
conservative evaluation grader, and the grading pool's deadlines and crash recovery."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

from megatron_dgpo.tasks.prompts import benchmark_files, find_benchmarks_dir, load_benchmark
from megatron_dgpo.tasks.rewards import (RewardPool, eval_correct, last_boxed, math_reward,
                                         normalize_ground_truth, scan_boxed)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=4.0) as p:
        yield p


def test_boxed_extraction_rules():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed {x^{2}}") == "x^{2}"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"  # escaped braces are not structure
    assert last_boxed(r"\boxed{\boxed{3}}") == r"\boxed{3}"  # nested box belongs to the outer one
    assert last_boxed(r"\boxed{1} and finally \boxed{2") is None  # truncated last box: no answer
    assert last_boxed(r"\boxed 5") is None  # brace-less form is not accepted (documented)
    assert last_boxed("no box at all") is None
    assert scan_boxed(r"\boxed{a}\boxed{b}x").answers == ("a", "b")


def test_normalize_ground_truth_layouts():
    assert normalize_ground_truth(27.0) == "27"
    assert normalize_ground_truth(0.5) == "0.5"
    assert normalize_ground_truth(" 70 ") == "70"
    assert normalize_ground_truth(["$69$,$84$"]) == "69,84"
    assert normalize_ground_truth(["$2$", "$3$"]) == "2, 3"
    # an escaped dollar is a currency sign, not a delimiter: it stays for math-verify to read
    assert normalize_ground_truth(r"\$18.90") == r"\$18.90"
    assert normalize_ground_truth(r"\$32,\!348") == r"\$32,\!348"
    assert normalize_ground_truth(["$(-\\infty, 0) \\cup\\{1\\}$."]) == r"(-\infty, 0) \cup\{1\}"  # sentence period
    assert normalize_ground_truth(r"x+$ $\dot{x}") == r"x+ \dot{x}"
    for bad in ("", [], True, None, float("nan")):
        with pytest.raises((TypeError, ValueError)):
            normalize_ground_truth(bad)


def test_training_reward_and_eval_grader_differ_as_documented():
    assert math_reward(r"so $x=\boxed{\frac{3}{4}}$", "0.75") == 1.0
    assert math_reward(r"\boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert math_reward("the answer is 4", "4") == -1.0  # no box
    assert math_reward(r"\boxed{5}", "4") == -1.0
    assert math_reward(r"\boxed{3*x}", "3x") == 1.0  # plain-expression reading (training only)
    # hedging: the training reward reads the last box, the evaluation grader rejects it
    assert math_reward(r"\boxed{3} or maybe \boxed{4}", "4") == 1.0
    assert eval_correct(r"\boxed{3} or maybe \boxed{4}", "4") is False
    assert eval_correct(r"\boxed{4}, I repeat \boxed{4}", "4") is True
    # precision: 6 decimals in training, 10 in evaluation
    assert math_reward(r"\boxed{0.3333333}", r"\frac{1}{3}") == 1.0
    assert eval_correct(r"\boxed{0.3333333}", r"\frac{1}{3}") is False
    assert eval_correct(r"\boxed{\frac{1}{3}}", r"\frac{1}{3}") is True


# (reference as published, boxed answer, equivalent?) - MATH-500's currency, thousands-separator
# and text-unit references; the currency ones scored -1 even when boxed verbatim.
REFERENCE_FORMS = [
    (r"\$18.90", r"\$18.90", True),
    (r"\$18.90", "18.9", True),
    (r"\$18.90", "19.80", False),
    (r"\$32,\!348", r"\$32,\!348", True),
    (r"\$32,\!348", "32348", True),
    (r"\$32,\!348", "32,348", True),
    (r"\$32,\!348", "32,349", False),
    (r"\$36", r"\$36", True),
    (r"\$36", "36", True),
    (r"\$36", r"\$37", False),
    (r"10,\!080", "10080", True),
    (r"11,\! 111,\! 111,\! 100", "11111111100", True),
    ("58,500", "58500", True),
    ("58,500", "58,501", False),
    (r"5.4 \text{ cents}", r"5.4 \text{ cents}", True),
    (r"5.4 \text{ cents}", "5.4", True),
    (r"5.4 \text{ cents}", "5.5", False),
    (r"864 \mbox{ inches}^2", "864", True),
    (r"15\mbox{ cm}^2", "16", False),
    (r"\frac{270}7\text{ degrees}", r"\frac{270}{7}", True),
    (r"\text{(C)}", r"\text{(D)}", False),
    (r"$(-\infty, 0) \cup\{1\}$.", r"(-\infty,0)\cup\{1\}", True),
    (r"$(-\infty, 0) \cup\{1\}$.", r"(-\infty,0)\cup\{2\}", False),
]


@pytest.mark.parametrize("reference,boxed,equivalent", REFERENCE_FORMS)
def test_currency_thousands_and_unit_references(reference, boxed, equivalent):
    response = f"Reasoning.\n\nThe answer is $\\boxed{{{boxed}}}$."
    assert math_reward(response, reference) == (1.0 if equivalent else -1.0)
    assert eval_correct(response, reference) is equivalent
    assert math_reward(f"The answer is {boxed}", reference) == -1.0  # unboxed


def test_math_reward_outside_main_thread():
    out = {}
    t = threading.Thread(target=lambda: out.update(r=math_reward(r"\boxed{\frac{6}{8}}", "3/4")))
    t.start()
    t.join(30)
    assert out["r"] == 1.0


def _wrong(gt: str) -> str:
    """A different answer: the first integer of gt incremented (or a number if gt has none)."""
    m = re.search(r"\d+", gt)
    if not m:
        return "987654321"
    return gt[: m.start()] + str(int(m.group()) + 1) + gt[m.end():]


def _published_references(path) -> list:
    """The raw reference answers of one benchmark file, read straight from its published layout
    (../shared/benchmarks/README.md), independently of prompts.py's loader."""
    refs = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "final_answer" in row:  # olympiadbench: a list of LaTeX strings
            refs.append(row["final_answer"])
        elif "answer" in row:  # aime24/25 (string), amc23 (float), math500 (LaTeX)
            refs.append(row["answer"])
        else:  # minerva_math: the last \boxed{} of the solution
            refs.append(last_boxed(row["solution"]))
    return refs


def test_every_benchmark_item_graded_right_and_wrong(pool):
    """A response boxing the reference exactly as published scores +1 (both graders), for every
    item of the six benchmarks; a different answer and an unboxed answer score -1."""
    bench_dir = find_benchmarks_dir()
    if bench_dir is None:
        pytest.skip("benchmark folder ../shared/benchmarks (or $DGPO_BENCHMARKS_DIR) is absent")
    files = benchmark_files(bench_dir)
    assert set(files) == {"aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench"}
    records = [r for name, path in files.items() for r in load_benchmark(path, name)]
    assert len(records) == 30 + 30 + 40 + 500 + 272 + 675
    items = [(name, ref) for name, path in files.items() for ref in _published_references(path)]
    assert len(items) == len(records)
    responses, gts = [], []
    for _, ref in items:
        text = ", ".join(ref) if isinstance(ref, list) else str(ref)
        responses += [f"Reasoning.\n\nThe answer is \\boxed{{{text}}}", f"So \\boxed{{{_wrong(text)}}}", f"The answer is {text}"]
        gts += [ref] * 3
    scores = pool.score(responses, gts, grader="train")
    right = pool.score(responses[::3], gts[::3], grader="eval")
    failures = [(items[i // 3][0], responses[i]) for i, s in enumerate(scores) if s != (1.0 if i % 3 == 0 else -1.0)]
    failures += [(items[i][0], "eval", responses[3 * i]) for i, s in enumerate(right) if s != 1.0]
    per_benchmark = {name: sum(1 for f in failures if f[0] == name) for name in files}
    assert not failures, (per_benchmark, failures[:5])
    # the loader's normalised ground truth grades the same verbatim answers right
    assert pool.score(responses[::3], [r.ground_truth for r in records], grader="eval") == [1.0] * len(records)


HOSTILE = [
    r"Let me compute \boxed{9^{9^{9^{9}}}}",
    "x" * (1 << 20) + r" \boxed{2}",  # 1 MB of text
    r"\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",  # deeply nested braces
    r"\boxed{" + "(" * 60 + "1" + ")" * 60 + "}",  # deeply nested parentheses
    r"\boxed{" + "9^" * 400 + "9}",
    r"\boxed{" + "{" * 200000,  # unclosed
]


def test_hostile_responses_cost_minus_one_fast(pool):
    for h in HOSTILE:
        t0 = time.monotonic()
        assert pool.score([h], ["1"]) == [-1.0]
        assert time.monotonic() - t0 < 5.0, h[:40]
    # a batch mixing hostile and legit items: the legit ones are still graded
    t0 = time.monotonic()
    scores = pool.score([HOSTILE[0], r"\boxed{7}", HOSTILE[4], r"\boxed{\frac{1}{2}}"], ["1", "7", "1", "0.5"])
    assert scores == [-1.0, 1.0, -1.0, 1.0]
    assert time.monotonic() - t0 < 10.0


def test_crashed_worker_costs_one_sample():
    with RewardPool(num_workers=1, timeout_s=30.0) as p:
        assert p.score([r"\boxed{2}"], ["2"]) == [1.0]  # worker is up
        pid = p._workers[0].proc.pid
        threading.Timer(1.0, os.kill, args=(pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        assert p.score([HOSTILE[0]], ["1"]) == [-1.0]  # its worker dies mid-item
        assert time.monotonic() - t0 < 10.0
        assert p.stats.crashes == 1 and p.stats.restarts == 1
        assert p.score([r"\boxed{3}", r"\boxed{4}"], ["3", "5"]) == [1.0, -1.0]  # the pool recovered


def test_pool_argument_errors(pool):
    with pytest.raises(ValueError, match="ground truths"):
        pool.score(["a"], [])
    with pytest.raises(ValueError, match="grader"):
        pool.score(["a"], ["1"], grader="lenient")
