"""megatron_dgpo/planner/report.py: ``dgpo-plan --explain``'s memory terms of the pick and its
step-time terms."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_dgpo.plan import main
from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.inputs import GIB, Cluster, Workload
from megatron_dgpo.planner.search import make_plan
from tests.planner._inputs import RECIPE_14B, ROOT, run_main


def test_explain_prints_every_term_with_its_value(capsys):
    """``dgpo-plan --explain``: one line per memory term of the pick, each value the estimate's
    own, the total their combination; every term has its row in docs/planner.md."""
    import re

    from megatron_dgpo.planner.peak import TERMS

    code, out, _ = run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--nodes", "4",
                                      "--gpu-memory-gb", "80", "--explain"])
    assert code == 0
    text = out.split("terms of the pick")[1]
    values = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^  (\w+) .*?= ([0-9.]+) GiB", text, re.M)}
    assert set(values) == set(TERMS) | {"total"}

    from megatron_dgpo.recipe import load_recipe

    run = load_recipe(RECIPE_14B)
    plan = make_plan(PUBLISHED[run.model.path], Cluster(8, 4, 80), Workload.from_recipe(run),
                     recipe_tp=4)
    pick = plan.pick
    for term in TERMS:
        assert values[term] == pytest.approx(getattr(pick, term) / GIB, abs=0.006), term
    assert values["total"] == pytest.approx(pick.total / GIB, abs=0.006)
    # the 14B recipe offloads and sleeps: the terms combine as the docs say
    assert pick.vllm_sleeps and pick.offloaded and pick.graphs == GIB
    training = pick.grads + pick.optimizer + pick.activations + pick.logits + pick.cache + pick.graphs
    assert pick.total == pick.weights + pick.nccl + pick.overhead + max(training, pick.vllm)
    assert "TP, DP, model-parallel, world, vLLM TP" in text
    doc = (Path(ROOT) / "docs" / "planner.md").read_text()
    rows = set(re.findall(r"^\| (\w+) \|", doc, re.M))
    assert set(TERMS) <= rows, set(TERMS) - rows


def test_explain_prints_the_step_time_terms(capsys):
    """``dgpo-plan --explain``: each placement's step with the phase that dominates, and every
    generation, training and refit term."""
    recipe = os.path.join(ROOT, "recipes", "dgpo_14b_async.yaml")
    assert main([recipe, "--gpus-per-node", "8", "--nodes", "30", "--gpu-memory-gb", "80",
                 "--hardware", "h100", "--explain"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("step-time terms"):]
    for placement in ("synchronous, colocated (240 trainer GPUs)",
                      "synchronous, dedicated (160 trainer GPUs, 80 rollout GPUs)",
                      "one-step-off, k=1 (160 trainer GPUs, 80 rollout GPUs)",
                      "partial rollouts, k="):
        assert placement in section
    for term in ("response lengths", "at the cap", "prefill", "bulk", "tail", "the longest of",
                 "step overhead", "sampler", "update", "log-probs", "mfu", "pipeline",
                 "TP communication", "refit", "fixed", "bytes", "tensors", "network",
                 "dominates", "decode", "re-prefill", "in flight", "interrupts", "segments",
                 "admits"):
        assert term in section, term
