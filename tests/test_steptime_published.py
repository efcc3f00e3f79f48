"""The step-time model (megatron_dgpo.planner.steptime) against published step times: issue 30's nine
NeMo-RL rows on H100 (every total within 25%, every published phase within 35% but the two
named misses), published rows no constant was fitted to, the table in docs/planner.md, the
MoE decode's touched experts, the seeded sampler's switch, and ``dgpo-plan --explain``'s
step-time terms."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.cli import main
from megatron_dgpo.planner.inputs import GIB
from megatron_dgpo.planner.published_steps import (HELD_OUT_STEPS, PUBLISHED_STEPS,
                                                   predict_published, published_table)
from megatron_dgpo.planner.steptime import (HARDWARE, StepShape, experts_touched_share,
                                            generation_terms, routed_expert_params,
                                            shared_params)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_MOE = PUBLISHED["Qwen/Qwen3-30B-A3B"].description

KNOWN_MISSES = {("Llama-3.3-70B, 16k, 128 GPUs TP4 PP4 CP4", "training"),
                ("Llama-3.3-70B, 16k, 128 GPUs TP4 PP4 CP4", "logprobs")}
"""Published phases the model misses by more than 35%: NeMo-RL's 16k-token, CP 4 training and
log-probs run at a third of the 4k rows' efficiency (log-probs slower than training), which
FLOPs do not explain and the planner never needs (the trainer has no context parallelism)."""
HELD_OUT_MISSES = {"Qwen3-30B-A3B, 16 + 16 one-step-off", "Qwen3-235B-A22B, 128 GPUs, vLLM TP16"}
"""Held-out rows outside 25%: NeMo-RL v0.5's MoE training on 16 GPUs is faster than its own
32-GPU colocated row implies (1.7x), and a vLLM engine of TP 16 spans two nodes, whose
all-reduces the model does not charge (0.70)."""


def _ratios(row):
    pred = predict_published(row)
    return {k: pred[k] / v for k, v in row.published.items()}


@pytest.mark.parametrize("row", PUBLISHED_STEPS, ids=lambda r: r.label)
def test_issue_30_rows_within_25_percent_total_and_35_percent_per_phase(row):
    ratios = _ratios(row)
    assert 0.75 <= ratios["step"] <= 1.25, ratios
    for phase, ratio in ratios.items():
        if (row.label, phase) in KNOWN_MISSES:
            assert not 0.65 <= ratio <= 1.35, f"{phase} now fits: drop it from KNOWN_MISSES"
        else:
            assert 0.65 <= ratio <= 1.35, (phase, ratios)


def test_held_out_rows():
    """Rows of the same performance pages that no constant was fitted to (other placements,
    engine TPs, releases and a 235B MoE): at least three within 25%, the misses named."""
    assert all(not row.fitted for row in HELD_OUT_STEPS)
    within = []
    for row in HELD_OUT_STEPS:
        ratio = _ratios(row)["step"]
        if row.label in HELD_OUT_MISSES:
            assert not 0.75 <= ratio <= 1.25, f"{row.label} now fits: drop it from HELD_OUT_MISSES"
            assert 0.65 <= ratio <= 1.75
        else:
            assert 0.75 <= ratio <= 1.25, (row.label, ratio)
            within.append(row.label)
    assert len(within) >= 3
    # fitted rows are few: four of the nine, none held out
    assert sum(row.fitted for row in PUBLISHED_STEPS) == 4


def test_docs_table_is_the_models_output():
    """docs/planner.md#published-step-times shows exactly what the model predicts now."""
    with open(os.path.join(ROOT, "docs", "planner.md"), encoding="utf-8") as handle:
        docs = handle.read()
    for line in published_table():
        assert line in docs, f"docs/planner.md lacks or has stale: {line}"


def test_moe_decode_reads_the_experts_its_sequences_touch():
    """share(c) = 1 - (1 - k/E)^c: one sequence reads k of E experts, 128 read nearly all;
    an engine of 128 running sequences reads ~all 30.5B parameters per step, not the 3.3B
    active ones."""
    k_over_e = 8 / 128
    assert experts_touched_share(QWEN3_MOE, 1) == pytest.approx(k_over_e)
    assert experts_touched_share(QWEN3_MOE, 16) == pytest.approx(1 - (1 - k_over_e) ** 16)
    assert experts_touched_share(QWEN3_MOE, 128) > 0.9997
    assert experts_touched_share(PUBLISHED["Qwen/Qwen3-32B"].description, 1) == 1.0
    shape = StepShape(prompts=64, group_size=32, max_response_tokens=3968, mean_prompt_tokens=128,
                      mean_response_tokens=3000, max_num_seqs=1024, seeded_sampling=False)
    hw = HARDWARE["h100"]
    terms = generation_terms(QWEN3_MOE, shape, hw, engines=32, engine_tp=2,
                             kv_cache_bytes_per_engine_gpu=20 * GIB)
    assert terms["concurrent"] == 64
    weights = 2 * (shared_params(QWEN3_MOE) + routed_expert_params(QWEN3_MOE)
                   * experts_touched_share(QWEN3_MOE, 64))
    assert weights > 2 * 0.98 * 30e9  # ~every expert at 64 running sequences
    # more engines with fewer sequences each touch fewer experts per step
    few = generation_terms(QWEN3_MOE, replace(shape, prompts=2), hw, engines=32, engine_tp=2,
                           kv_cache_bytes_per_engine_gpu=20 * GIB)
    assert few["concurrent"] == 2 and few["tail_step_s"] < terms["tail_step_s"]


def test_seeded_sampling_term_and_its_switch():
    """Seeded requests cost vLLM's per-row draw (8.9 ms for 1024 rows of 152064 on an H200)
    instead of the batched one (0.88 ms) on every decode step; the switch removes it."""
    desc = PUBLISHED["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"].description
    shape = StepShape(prompts=128, group_size=8, max_response_tokens=8192, mean_prompt_tokens=200,
                      mean_response_tokens=4096, max_num_seqs=1024)
    hw = HARDWARE["h100"]
    kw = dict(engines=1, engine_tp=4, kv_cache_bytes_per_engine_gpu=60 * GIB)
    seeded = generation_terms(desc, shape, hw, **kw)
    batched = generation_terms(desc, replace(shape, seeded_sampling=False), hw, **kw)
    rows = seeded["bulk_steps"] * seeded["concurrent"] + seeded["tail_steps"] * seeded["tail_running"]
    assert seeded["sampling_s"] == pytest.approx(rows * desc.dims.vocab * 8.9e-3 / (1024 * 152064))
    assert seeded["total"] - batched["total"] == pytest.approx(
        rows * desc.dims.vocab * (8.9e-3 - 0.88e-3) / (1024 * 152064))
    # 1024 seeded rows at vocab 152064: 8.9 ms a step
    per_step = seeded["bulk_step_s"] - batched["bulk_step_s"]
    assert per_step == pytest.approx(seeded["concurrent"] * (8.9e-3 - 0.88e-3) / 1024
                                     * desc.dims.vocab / 152064)


def test_explain_prints_the_step_time_terms(capsys):
    """``dgpo-plan --explain``: each placement's step with the phase that dominates, and every
    generation, training and refit term."""
    recipe = os.path.join(ROOT, "recipes", "dgpo_14b_async.yaml")
    assert main([recipe, "--gpus-per-node", "8", "--nodes", "30", "--gpu-memory-gb", "80",
                 "--hardware", "h100", "--explain"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("step-time terms"):]
    for placement in ("colocated (240 trainer GPUs)", "dedicated (160 trainer GPUs, 80 rollout GPUs)",
                      "one-step-off (160 trainer GPUs, 80 rollout GPUs)"):
        assert placement in section
    for term in ("prefill", "bulk", "tail", "step overhead", "sampler", "update", "log-probs",
                 "mfu", "pipeline", "TP communication", "refit", "fixed", "bytes", "tensors",
                 "network", "dominates"):
        assert term in section, term
