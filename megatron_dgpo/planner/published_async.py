"""Published speed-ups of asynchronous RL beside the step-time model's prediction for a comparable
setting (``PUBLISHED_SPEEDUPS``, ``predict_speedup``) and docs/planner.md's table of them
(``speedup_table``); none fitted a constant."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.inputs import GIB
from megatron_dgpo.planner.parameters import param_count
from megatron_dgpo.planner.steptime import (HARDWARE, Hardware, StepShape, generation_terms,
                                            partial_generation_terms, refit_terms, training_terms)

PUBLISHED_HARDWARE = {
    "h100": (HARDWARE["h100"], 80),
    "h800": (replace(HARDWARE["h100"], name="H800-80GB", nvlink_gb_per_s=200), 80),
    "h20": (Hardware("H20-96GB", peak_tflops=148, hbm_gb_per_s=4000, nvlink_gb_per_s=450,
                     network_gb_per_s=50, pcie_gb_per_s=50, compute_capability=(9, 0)), 96),
}
"""(peaks, GiB) of the GPUs the sources ran: an H800 is an H100 with half its NVLink; an H20
has 148 dense bf16 TFLOP/s and 4.0 TB/s of HBM (NVIDIA's datasheets)."""


@dataclass(frozen=True)
class PublishedSpeedup:
    """A published speed-up of an asynchronous schedule over a synchronous colocated one and the
    setting it was measured in; ``assumed`` names what the source does not say."""

    label: str
    source: str
    published: float
    """The published ratio (synchronous time / asynchronous time)."""
    measure: str
    """What the ratio is of: "end to end" (hours of a run), "step", "rollout throughput",
    "learning speed"."""
    schedule: str
    """What the model prices against synchronous colocated: "one-step-off", "partial"
    (re-prefilling at each refit), "partial, KV kept" (in-flight updates that keep the stale
    KV cache) or "colocated partial" (generation alone, APRIL's over-provisioned sync step)."""
    model: str
    """Hub id of ``catalogue.PUBLISHED`` (the 7B Qwen2.5 models have R1-Distill-7B's dims)."""
    hardware: str
    gpus: int
    prompts: int
    group_size: int
    max_response: int
    mean_response: float
    assumed: str
    truncated: float | None = None
    rollout_gpus: int | None = None
    """The published split; None: the model's fastest split in whole nodes."""
    engine_tp: int = 1
    max_num_seqs: int = 256
    updates: int = 4
    mean_prompt: float = 128.0
    recompute: bool = True
    in_flight: float | None = None
    """Responses an engine holds at once under partial rollouts, as a multiple of its share of
    the batch (over-provisioning); None: as many as fit."""


PUBLISHED_SPEEDUPS: tuple[PublishedSpeedup, ...] = (
    PublishedSpeedup(
        "AReaL, R1-Distill-Qwen-1.5B, 16 x 8 H800", "AReaL v0.3 blog, Table 2 (41.0 h -> 14.8 h)",
        41.0 / 14.8, "end to end", "partial", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "h800", 128, 512, 16, 27648, 0.35 * 27648, truncated=0.04,
        assumed="mean response 35% of the 27k cap, 4% truncated (the blog: below 5%), the split"),
    PublishedSpeedup(
        "AReaL, R1-Distill-Qwen-7B, 24 x 8 H800", "AReaL v0.3 blog, Table 2 (57.7 h -> 25.4 h)",
        57.7 / 25.4, "end to end", "partial", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "h800", 192, 512, 16, 27648, 0.35 * 27648, truncated=0.04,
        assumed="mean response 35% of the 27k cap, 4% truncated, the split"),
    PublishedSpeedup(
        "verl, Qwen2.5-Math-7B, 128 H20: streaming, 64 + 64",
        "verl docs/advance/fully_async.md (step 356.30 s -> 231.34 s)", 356.30 / 231.34, "step",
        "one-step-off", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "h20", 128, 512, 16, 28672,
        2000, rollout_gpus=64, updates=16, recompute=False,
        assumed="mean response 2000 of the 28k cap, what the published synchronous phases "
                "imply (``VERL_SYNC_PHASES``)"),
    PublishedSpeedup(
        "verl, Qwen2.5-Math-7B, 128 H20: + staleness + partial, 64 + 64",
        "verl docs/advance/fully_async.md (step 356.30 s -> 150.63 s; 400 steps 2.35x)",
        356.30 / 150.63, "step", "partial", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "h20",
        128, 512, 16, 28672, 2000, rollout_gpus=64, updates=16, recompute=False,
        assumed="as above"),
    PublishedSpeedup(
        "PipelineRL, Qwen2.5-7B, 128 H100, 64 + 64", "PipelineRL paper (~2x)", 2.0,
        "learning speed", "partial, KV kept", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "h100",
        128, 512, 16, 8192, 1500, rollout_gpus=64, max_num_seqs=64,
        assumed="batch 512 x 16 and mean response 1500 of 8192 (its conf/base.yaml: 8192 "
                "tokens, 64 sequences per 1-GPU engine, half the GPUs generating)"),
    PublishedSpeedup(
        "slime APRIL, 7B, 8 H100 colocated", "APRIL paper (up to +44%, 22.5% on average)", 1.44,
        "rollout throughput", "colocated partial", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "h100", 8, 32, 8, 8192, 0.5 * 8192, in_flight=2.0,
        assumed="a 7B on one node, slime's usual batch (32 x 8, over-sampling 64 prompts: 2x "
                "in flight), mean response half the 8k cap"),
)
"""The published ratios issue 43 names; every row's setting is stated, and ``assumed`` names
what the source does not give."""

VERL_SYNC_PHASES = dict(generation=177.85, old_log_prob=53.92, update_actor=113.81)
"""verl's colocated synchronous step on 128 H20 (the rows above), seconds: the model's
generation and update at the assumed mean response are checked against them."""

SYNC_MEMORY_UTILIZATION = 0.6
DEDICATED_MEMORY_UTILIZATION = 0.85
"""vLLM's reserve on colocated GPUs (shared with training) and on dedicated ones."""


def _kv_room(row: PublishedSpeedup, utilization: float) -> float:
    hw, gib = PUBLISHED_HARDWARE[row.hardware]
    desc = PUBLISHED[row.model].description
    return max(utilization * gib * GIB - 2 * param_count(desc) / row.engine_tp, 0.0)


def predict_speedup(row: PublishedSpeedup) -> dict:
    """The model on ``row``'s setting, ``{"sync_s", "async_s", "ratio", "rollout_gpus"}``: the
    synchronous colocated step (its generation for "colocated partial") against the row's."""
    hw, _ = PUBLISHED_HARDWARE[row.hardware]
    desc = PUBLISHED[row.model].description
    shape = StepShape(prompts=row.prompts, group_size=row.group_size,
                      max_response_tokens=row.max_response, mean_prompt_tokens=row.mean_prompt,
                      mean_response_tokens=row.mean_response, max_num_seqs=row.max_num_seqs,
                      recompute=row.recompute, updates=row.updates,
                      truncated_fraction=row.truncated)
    colocated = dict(engines=row.gpus // row.engine_tp, engine_tp=row.engine_tp,
                     kv_cache_bytes_per_engine_gpu=_kv_room(row, SYNC_MEMORY_UTILIZATION))
    sync_gen = generation_terms(desc, shape, hw, **colocated)["total"]
    per_engine = row.prompts * row.group_size / colocated["engines"]
    if row.schedule == "colocated partial":
        partial = partial_generation_terms(desc, shape, hw, in_flight=row.in_flight and
                                           row.in_flight * per_engine, **colocated)["total"]
        return dict(sync_s=sync_gen, async_s=partial, ratio=sync_gen / partial, rollout_gpus=0)
    sync = (sync_gen + training_terms(desc, shape, hw, gpus=row.gpus)["total"]
            + refit_terms(desc, shape, hw, dedicated=False)["total"])
    best = None
    splits = [row.rollout_gpus] if row.rollout_gpus else range(8, row.gpus, 8)
    for gpus in splits:
        engines = dict(engines=gpus // row.engine_tp, engine_tp=row.engine_tp,
                       kv_cache_bytes_per_engine_gpu=_kv_room(row, DEDICATED_MEMORY_UTILIZATION))
        gen = (generation_terms(desc, shape, hw, **engines) if row.schedule == "one-step-off"
               else partial_generation_terms(desc, shape, hw, reprefill=row.schedule == "partial",
                                             **engines))["total"]
        step = (max(gen, training_terms(desc, shape, hw, gpus=row.gpus - gpus)["total"])
                + refit_terms(desc, shape, hw, dedicated=True)["total"])
        if best is None or step < best[0]:
            best = (step, gpus)
    return dict(sync_s=sync, async_s=best[0], ratio=sync / best[0], rollout_gpus=best[1])


def speedup_table() -> list[str]:
    """docs/planner.md's table: one markdown line per ``PUBLISHED_SPEEDUPS`` row."""
    lines = ["| setting | source | measure | published | model: schedule | model: sync / async | "
             "model | assumed |", "|" + " --- |" * 8]
    for row in PUBLISHED_SPEEDUPS:
        pred = predict_speedup(row)
        split = (f", {pred['rollout_gpus']} rollout GPUs" if pred["rollout_gpus"] else "")
        lines.append(f"| {row.label} | {row.source} | {row.measure} | {row.published:.2f}x | "
                     f"{row.schedule}{split} | {pred['sync_s']:.0f} s / {pred['async_s']:.0f} s | "
                     f"{pred['ratio']:.2f}x | {row.assumed} |")
    return lines

