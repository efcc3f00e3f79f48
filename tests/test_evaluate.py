"""Evaluation metrics against brute-force enumeration, the evaluate() pipeline with a scripted
engine (known answers) and with the session's vLLM engine, the dgpo-eval CLI end to end, and the
evaluation during training's split over replicas (1 and 2 gloo ranks give the same numbers)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_dgpo.evaluate import evaluate, format_table, ks_up_to, pass_at_k
from megatron_dgpo.rollout.base import Completion
from megatron_dgpo.tasks.prompts import builtin_prompts, find_benchmarks_dir, load_benchmark
from megatron_dgpo.tasks.rewards import RewardPool
from tests._rank_fns_eval import GenerateOnlyEngine

REPO = Path(__file__).resolve().parents[1]


def _brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_matches_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)
    assert pass_at_k(32, 3, 1) == pytest.approx(3 / 32)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert ks_up_to(32) == [1, 2, 4, 8, 16, 32] and ks_up_to(6) == [1, 2, 4, 6] and ks_up_to(1) == [1]


class ScriptedEngine(GenerateOnlyEngine):
    """Answers problem i correctly in its first plan[i] samples, wrongly in the others."""

    def __init__(self, tokenizer, answers, plan):
        self.tok, self.answers, self.plan, self.offset = tokenizer, answers, plan, 0

    def generate(self, prompts_token_ids, *, n=1, temperature=1.0, top_p=1.0, max_tokens=256, seed=None, seeds=None):
        out = []
        for j in range(len(prompts_token_ids)):
            i = self.offset + j
            texts = [f"so \\boxed{{{self.answers[i] if s < self.plan[i] else 'wrong'}}}" for s in range(n)]
            out.append([Completion(j, self.tok(t, add_special_tokens=False)["input_ids"], [0.0] * len(self.tok(t)["input_ids"]), "stop") for t in texts])
        self.offset += len(prompts_token_ids)
        return out


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2) as p:
        yield p


def test_evaluate_pipeline_with_known_answers(tiny_tokenizer, pool):
    records = builtin_prompts(["add"])[:5] + builtin_prompts(["frac"])[:3]
    plan = [0, 1, 2, 4, 4, 3, 0, 1]
    engine = ScriptedEngine(tiny_tokenizer, [r.ground_truth for r in records], plan)
    res = evaluate(engine, tiny_tokenizer, {"a": records[:5], "b": records[5:]}, n=4, pool=pool, prompts_per_call=3, progress=False)
    a, b = res["benchmarks"]["a"], res["benchmarks"]["b"]
    assert a["correct_per_problem"] == plan[:5] and b["correct_per_problem"] == plan[5:]
    assert a["avg@4"] == pytest.approx(sum(plan[:5]) / 20)
    for k in (1, 2, 4):
        ref_a = sum(_brute_pass_at_k(4, c, k) for c in plan[:5]) / 5
        ref_b = sum(_brute_pass_at_k(4, c, k) for c in plan[5:]) / 3
        assert a["pass@k"][str(k)] == pytest.approx(float(ref_a))
        assert res["average"]["pass@k"][str(k)] == pytest.approx(float(ref_a + ref_b) / 2)
    table = format_table(res)
    assert "Avg@4" in table and "Pass@4" in table and f"{100 * a['avg@4']:.1f}" in table


def _bench_file(tmp_path) -> Path:
    bench = find_benchmarks_dir()
    if bench is not None:
        return bench / "aime24.jsonl"
    path = tmp_path / "aime24.jsonl"  # same layout as the published aime24 copy
    path.write_text("\n".join(json.dumps({"id": i, "problem": f"What is {i}+{i}?", "answer": str(2 * i)}) for i in range(3)))
    return path


def test_evaluate_with_vllm_engine(vllm_engine, tiny_tokenizer, pool, tmp_path):
    records = load_benchmark(_bench_file(tmp_path), limit=3)
    res = evaluate(vllm_engine, tiny_tokenizer, {"aime24": records}, n=4, max_tokens=8, pool=pool, progress=False)
    r = res["benchmarks"]["aime24"]
    assert r["num_problems"] == 3 and all(0 <= c <= 4 for c in r["correct_per_problem"])
    assert 1 <= r["mean_response_tokens"] <= 8
    pk = [r["pass@k"][str(k)] for k in (1, 2, 4)]
    assert pk == sorted(pk) and pk[0] == pytest.approx(r["avg@4"])


def test_dgpo_eval_cli_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "eval.json"
    cmd = [sys.executable, str(REPO / "tools" / "dgpo_eval.py"), "--model", str(tiny_model_dir), "--engine", "hf",
           "--benchmarks", str(_bench_file(tmp_path)), "--n", "4", "--max-tokens", "8", "--limit", "2",
           "--out", str(out), "--workers", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Avg@4" in proc.stdout and "Pass@2" in proc.stdout and "average" in proc.stdout
    result = json.loads(out.read_text())
    r = result["benchmarks"]["aime24"]
    assert r["num_problems"] == 2 and set(r["pass@k"]) == {"1", "2", "4"}
    assert result["config"]["n"] == 4 and result["config"]["engine"] == "hf"
    bad = subprocess.run(cmd[:-4] + ["--benchmarks", "no_such_bench"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode != 0 and "no_such_bench" in bad.stderr
    no_model = subprocess.run(cmd[:2] + ["--model", str(tmp_path / "absent")] + cmd[4:],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
    assert no_model.returncode == 2 and "no config.json there" in no_model.stderr


def test_benchmarks_resolve_by_name_or_file_and_errors_name_the_spec(tmp_path):
    from megatron_dgpo.tasks.prompts import resolve_benchmarks

    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "amc23.jsonl").write_text(json.dumps({"problem": "What is 1+1?", "answer": "2.0"}) + "\n")
    held = tmp_path / "held_out.json"
    held.write_text(json.dumps([{"problem": f"What is {i}+1?", "answer": str(i + 1)} for i in range(5)]))
    got = resolve_benchmarks(["amc23", str(held)], folder, limit=3)
    assert list(got) == ["amc23", "held_out"] and [len(v) for v in got.values()] == [1, 3]
    with pytest.raises(ValueError, match="'aime24' is neither a dataset file .* found in .*bench: amc23"):
        resolve_benchmarks(["aime24"], folder)
    with pytest.raises(ValueError, match="two benchmarks are named 'amc23'"):
        resolve_benchmarks(["amc23", str(folder / "amc23.jsonl")], folder)
    with pytest.raises(ValueError, match="missing.jsonl"):
        resolve_benchmarks([str(tmp_path / "missing.jsonl")], folder)


def test_evaluation_split_over_replicas_equals_the_whole(tiny_model_dir):
    """The evaluation during training (``HeldOutEvaluation.run``): each replica samples its share
    of each benchmark's problems and fills their slots; one sum over the ranks gives every rank
    the whole benchmark's counts. Hand-made counts on 1 and 2 gloo ranks: the same combined
    counts and the same metrics, equal to score_benchmark on the whole benchmark; every problem
    sampled once, with seed eval.seed + i n whatever replica took it."""
    from megatron_dgpo.rollout.evaluation import score_benchmark
    from tests import _rank_fns_eval as fns
    from tests.distributed import run_ranks

    one = fns.evaluate_replicas(0, 1, str(tiny_model_dir))  # no process group: a world of one
    two = run_ranks(fns.evaluate_replicas, 2, str(tiny_model_dir))
    whole = fns.PLAN["a"] + fns.PLAN["b"]
    assert two[0]["mine"] == list(range(6)) and two[1]["mine"] == list(range(6, 11))
    assert one["combined"] == two[0]["combined"] == two[1]["combined"] == whole
    want = {}
    for name, counts in fns.PLAN.items():
        result = score_benchmark(name, counts, fns.N)
        want[f"eval/{name}/avg@{fns.N}"] = result.avg
        want.update({f"eval/{name}/pass@{k}": v for k, v in result.pass_at.items()})
    assert sorted(want) == sorted(one["names"])
    assert one["metrics"] == two[0]["metrics"] == two[1]["metrics"] == want
    assert want["eval/a/avg@4"] == pytest.approx(14 / 28) and want["eval/b/pass@4"] == 0.75
    seeds = {**two[0]["seeds"], **two[1]["seeds"]}
    assert len(seeds) == len(two[0]["seeds"]) + len(two[1]["seeds"]) == 11  # each problem once
    assert seeds == one["seeds"] == {(b, i): fns.SEED + i * fns.N
                                     for b, counts in fns.PLAN.items() for i in range(len(counts))}
    assert one["calls"] == 4 and two[0]["calls"] == two[1]["calls"] == 2  # 3 problems per call
