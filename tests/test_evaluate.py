"""Evaluation metrics against brute-force enumeration, the evaluate() pipeline with a scripted
engine (known answers) and with the session's vLLM engine, and the dgpo-eval CLI end to end."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_dgpo.data import builtin_prompts, find_benchmarks_dir, load_benchmark
from megatron_dgpo.evaluate import evaluate, format_table, ks_up_to, pass_at_k
from megatron_dgpo.rewards import RewardPool
from megatron_dgpo.rollout.base import RolloutEngine, Completion

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


class ScriptedEngine(RolloutEngine):
    """Answers problem i correctly in its first plan[i] samples, wrongly in the others."""

    def __init__(self, tokenizer, answers, plan):
        self.tok, self.answers, self.plan, self.offset = tokenizer, answers, plan, 0

    def generate(self, prompts_token_ids, *, n=1, temperature=1.0, top_p=1.0, max_tokens=256, seed=None):
        out = []
        for j in range(len(prompts_token_ids)):
            i = self.offset + j
            texts = [f"so \\boxed{{{self.answers[i] if s < self.plan[i] else 'wrong'}}}" for s in range(n)]
            out.append([Completion(j, self.tok(t, add_special_tokens=False)["input_ids"], [0.0] * len(self.tok(t)["input_ids"]), "stop") for t in texts])
        self.offset += len(prompts_token_ids)
        return out

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def update_weights_from_dir(self, hf_dir):
        raise NotImplementedError

    def shutdown(self):
        pass


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
