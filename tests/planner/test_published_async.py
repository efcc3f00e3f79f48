"""megatron_dgpo/planner/published_async.py: the published asynchronous speed-ups beside the
step-time model's, the table in docs/planner.md, and verl's synchronous phases the assumed
mean response rests on."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.published_async import (DEDICATED_MEMORY_UTILIZATION,
                                                   PUBLISHED_HARDWARE, PUBLISHED_SPEEDUPS,
                                                   SYNC_MEMORY_UTILIZATION, VERL_SYNC_PHASES,
                                                   _kv_room, predict_speedup, speedup_table)
from megatron_dgpo.planner.steptime import (StepShape, generation_terms,
                                            partial_generation_terms, training_terms)
from tests.planner._inputs import ROOT


def test_docs_table_is_the_models_output():
    """docs/planner.md#published-asynchronous-speed-ups shows what the model predicts now."""
    with open(os.path.join(ROOT, "docs", "planner.md"), encoding="utf-8") as handle:
        docs = handle.read()
    for line in speedup_table():
        assert line in docs, f"docs/planner.md lacks or has stale: {line}"


def test_verl_synchronous_phases_at_the_assumed_mean_response():
    """verl's colocated synchronous step on 128 H20 (no constant was fitted to it): at the
    assumed 2000-token mean response the model's generation is within 10% of the published
    177.85 s and its policy update within 15% of 113.81 s; the published log-prob forward
    (53.92 s) is slower than the model's, which prices it as a third of the update."""
    row = next(r for r in PUBLISHED_SPEEDUPS if r.label.startswith("verl") and
               r.schedule == "partial")
    hw, _ = PUBLISHED_HARDWARE[row.hardware]
    desc = PUBLISHED[row.model].description
    shape = StepShape(prompts=row.prompts, group_size=row.group_size,
                      max_response_tokens=row.max_response, mean_prompt_tokens=row.mean_prompt,
                      mean_response_tokens=row.mean_response, recompute=row.recompute,
                      updates=row.updates)
    gen = generation_terms(desc, shape, hw, engines=row.gpus, engine_tp=1,
                           kv_cache_bytes_per_engine_gpu=_kv_room(row, SYNC_MEMORY_UTILIZATION))
    train = training_terms(desc, shape, hw, gpus=row.gpus)
    assert gen["total"] == pytest.approx(VERL_SYNC_PHASES["generation"], rel=0.10)
    assert train["update_s"] == pytest.approx(VERL_SYNC_PHASES["update_actor"], rel=0.15)
    assert train["logprobs_s"] < VERL_SYNC_PHASES["old_log_prob"]
    # the model's sync step is its phases and a refit; the asynchronous one on the published split
    pred = predict_speedup(row)
    assert pred["sync_s"] > gen["total"] + train["total"] and pred["rollout_gpus"] == 64
    partial = partial_generation_terms(desc, shape, hw, engines=64, engine_tp=1,
                                       kv_cache_bytes_per_engine_gpu=_kv_room(
                                           row, DEDICATED_MEMORY_UTILIZATION))
    assert pred["async_s"] > max(partial["total"], training_terms(desc, shape, hw, gpus=64)["total"])


@pytest.mark.parametrize("row", [r for r in PUBLISHED_SPEEDUPS if r.schedule != "colocated partial"],
                         ids=lambda r: r.label)
def test_every_asynchronous_schedule_is_priced_on_its_split(row):
    """Each row's asynchronous step is faster than its synchronous colocated one, and keeping the
    KV cache across refits (PipelineRL) is never slower than re-prefilling it (AReaL, verl)."""
    pred = predict_speedup(row)
    assert pred["ratio"] > 1 and 0 < pred["rollout_gpus"] < row.gpus
    kept = predict_speedup(replace(row, schedule="partial, KV kept"))
    refilled = predict_speedup(replace(row, schedule="partial"))
    assert kept["ratio"] >= refilled["ratio"]
