"""megatron_dgpo/planner/published_steps.py: the step-time model against published step times:
the nine NeMo-RL rows on H100 of ``PUBLISHED_STEPS`` (every total within 25%, every published
phase within 35% but the two named misses), published rows no constant was fitted to, and the table in
docs/planner.md."""

from __future__ import annotations

import os

import pytest

from megatron_dgpo.planner.published_steps import (HELD_OUT_STEPS, PUBLISHED_STEPS,
                                                   predict_published, published_table)
from tests.planner._inputs import ROOT


KNOWN_MISSES = {("Llama-3.3-70B, 16k, 128 GPUs TP4 PP4 CP4", "training"),
                ("Llama-3.3-70B, 16k, 128 GPUs TP4 PP4 CP4", "logprobs")}
"""Published phases the model misses by more than 35%: NeMo-RL's 16k-token, CP 4 training and
log-probs run at a third of the 4k rows' efficiency (log-probs slower than training), which
FLOPs do not explain, nor CP's K/V ring as the model prices it (5%; docs/planner.md)."""

HELD_OUT_MISSES = {"Qwen3-30B-A3B, 16 + 16 one-step-off", "Qwen3-235B-A22B, 128 GPUs, vLLM TP16"}
"""Held-out rows outside 25% (docs/planner.md#published-step-times): NeMo-RL v0.5's MoE
training on 16 GPUs needs an MFU of at least 0.115 where v0.3's implies 0.048 and one constant
(0.065) serves both (1.71), and a vLLM engine of TP 16 spans two nodes, whose all-reduces the
model does not charge (0.70: 16 ms per decode step missing)."""


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
