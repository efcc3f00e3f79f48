"""Published GRPO step times on H100s (``PUBLISHED_STEPS``: nine NeMo-RL rows, four of them fitted
``steptime``'s constants; ``HELD_OUT_STEPS``: none fitted), the model on each row's workload
(``predict_published``) and docs/planner.md's table of them (``published_table``)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dgpo.models import ModelDescription
from megatron_dgpo.planner.catalogue import LLAMA31_8B, PUBLISHED
from megatron_dgpo.planner.inputs import GIB
from megatron_dgpo.planner.parameters import param_count
from megatron_dgpo.planner.steptime import (HARDWARE, Hardware, StepShape, generation_terms,
                                            refit_terms, training_terms)

NEMO_RL_BLOG_V03 = "NeMo-RL v0.3 blog (nvidia-nemo.github.io/blog/2025/07/21/nemo-rl-v0.3)"
NEMO_RL_PERF_V04 = "NeMo-RL docs/about/performance-summary.md, v0.4 (H100 BF16)"
NEMO_RL_PERF_V05 = "NeMo-RL docs/about/performance-summary.md, v0.5 (H100 BF16)"


@dataclass(frozen=True)
class PublishedStep:
    """One published GRPO step time on H100s and the workload NeMo-RL ran it with (64 prompts x 32
    samples unless stated); the workload's fixed parts and what is assumed where the sources are
    silent: docs/planner.md#published-step-times."""

    label: str
    source: str
    model: str
    """Hub id (``catalogue.PUBLISHED``) or "meta-llama/Llama-3.1-8B"."""
    gpus: int
    engine_tp: int
    train_tp: int
    train_pp: int
    mean_response: float
    """The published mean generated tokens (v0.3: "avg. generated tokens per sample"; v0.4+:
    "G-Average Seq len", which the published tokens/s/GPU show to be the response alone)."""
    published: dict
    """{"step", and where published "generation", "training", "logprobs", "refit"}: seconds."""
    fitted: bool
    """Used to fit a constant above (else held out: a check of the model)."""
    train_cp: int = 1
    """Context parallelism (``steptime.cp_exchange_terms`` prices its K/V ring)."""
    rollout_gpus: int = 0
    """Dedicated engines' GPUs (one-step-off rows: NeMo-RL's async GRPO, half the nodes)."""
    max_sequence: int = 4096
    prompts: int = 64
    group_size: int = 32
    updates: int = 4
    recompute: bool = False
    truncated: float = 0.002
    """The share of responses at the cap (``steptime.StepShape.truncated_fraction``): assumed, the
    sources being silent; 1 in 500 puts the longest of a batch of 2048 at the cap."""

    @property
    def description(self) -> ModelDescription:
        """The model's description (``catalogue``)."""
        named = LLAMA31_8B if self.model == "meta-llama/Llama-3.1-8B" else PUBLISHED[self.model]
        return named.description


PUBLISHED_STEPS: tuple[PublishedStep, ...] = (
    PublishedStep("Llama-3.1-8B, 8 GPUs colocated", NEMO_RL_BLOG_V03, "meta-llama/Llama-3.1-8B",
                  8, 1, 1, 1, 795, dict(step=112, generation=58, training=28, logprobs=18,
                                        refit=5), fitted=True),
    PublishedStep("Llama-3.1-70B, 64 GPUs TP4 PP4", NEMO_RL_BLOG_V03, "meta-llama/Llama-3.1-70B",
                  64, 4, 4, 4, 398, dict(step=147, generation=84, training=28, logprobs=18,
                                         refit=14), fitted=True),
    PublishedStep("Qwen3-32B, 64 GPUs TP4 PP2", NEMO_RL_BLOG_V03, "Qwen/Qwen3-32B",
                  64, 4, 4, 2, 3283, dict(step=213, generation=96, training=68, logprobs=40,
                                          refit=7), fitted=False),
    PublishedStep("Qwen3-30B-A3B, 64 GPUs TP2 EP8", NEMO_RL_BLOG_V03, "Qwen/Qwen3-30B-A3B",
                  64, 2, 2, 1, 3251, dict(step=167, generation=78, training=50, logprobs=23,
                                          refit=12), fitted=True),
    PublishedStep("Llama-3.3-70B, 16k, 128 GPUs TP4 PP4 CP4", NEMO_RL_BLOG_V03,
                  "meta-llama/Llama-3.3-70B-Instruct", 128, 4, 4, 4, 749,
                  dict(step=445, generation=287, training=64, logprobs=75, refit=17),
                  fitted=False, train_cp=4, max_sequence=16384),
    PublishedStep("Llama-3.1-8B, 16 GPUs colocated PP2", NEMO_RL_PERF_V05,
                  "meta-llama/Llama-3.1-8B", 16, 1, 1, 2, 1019, dict(step=92.8), fitted=False,
                  recompute=True),
    PublishedStep("Llama-3.1-8B, 8 + 8 one-step-off", NEMO_RL_PERF_V05, "meta-llama/Llama-3.1-8B",
                  16, 1, 1, 1, 1123, dict(step=64.8), fitted=False, rollout_gpus=8,
                  recompute=True),
    PublishedStep("Qwen3-30B-A3B, 32 GPUs colocated, vLLM TP2", NEMO_RL_PERF_V05,
                  "Qwen/Qwen3-30B-A3B", 32, 2, 1, 1, 3196, dict(step=198), fitted=True),
    PublishedStep("Qwen3-32B, 32 GPUs colocated TP4 PP4", NEMO_RL_PERF_V05, "Qwen/Qwen3-32B",
                  32, 4, 4, 4, 3251, dict(step=376), fitted=False),
)
"""The nine rows the model was built against (``fitted`` marks the four that set the
constants; the other five are checks)."""

HELD_OUT_STEPS: tuple[PublishedStep, ...] = (
    PublishedStep("Qwen3-32B, 32 + 32 one-step-off", NEMO_RL_PERF_V05, "Qwen/Qwen3-32B",
                  64, 4, 4, 4, 3252, dict(step=200), fitted=False, rollout_gpus=32),
    PublishedStep("Qwen3-30B-A3B, 16 + 16 one-step-off", NEMO_RL_PERF_V05, "Qwen/Qwen3-30B-A3B",
                  32, 2, 1, 2, 3201, dict(step=154), fitted=False, rollout_gpus=16),
    PublishedStep("Qwen3-30B-A3B, 32 GPUs colocated, vLLM TP4", NEMO_RL_PERF_V04,
                  "Qwen/Qwen3-30B-A3B", 32, 4, 2, 1, 3154, dict(step=225), fitted=False),
    PublishedStep("Qwen3-235B-A22B, 128 GPUs, vLLM TP16", NEMO_RL_PERF_V05,
                  "Qwen/Qwen3-235B-A22B", 128, 16, 2, 8, 5700, dict(step=431), fitted=False,
                  train_cp=2, max_sequence=8192, prompts=16, group_size=32, updates=1),
    PublishedStep("Llama-3.1-8B, 16 GPUs colocated PP2", NEMO_RL_PERF_V04,
                  "meta-llama/Llama-3.1-8B", 16, 1, 1, 2, 1060, dict(step=97.7), fitted=False,
                  recompute=True),
)
"""Published rows outside those nine, none used for fitting: other layouts, placements,
engine TPs and models of the same performance pages."""

PUBLISHED_MEAN_PROMPT = 128.0
PUBLISHED_GPU_GIB = 80.0
PUBLISHED_GPUS_PER_NODE = 8
"""NeMo-RL's H100 performance runs: 8 GPUs per node (their recipes' ``cluster.gpus_per_node``),
which decides whether TP x CP (the K/V ring) and DP x CP (the gradient reduce) cross nodes."""


def predict_published(row: PublishedStep, hw: Hardware | None = None) -> dict[str, float]:
    """The model on a published row's workload (NeMo-RL's, reference forward included):
    {"step", "generation", "training" (the update), "logprobs", "refit"}, seconds."""
    hw = hw or HARDWARE["h100"]
    desc = row.description
    p = PUBLISHED_MEAN_PROMPT
    shape = StepShape(prompts=row.prompts, group_size=row.group_size,
                      max_response_tokens=int(row.max_sequence - p), mean_prompt_tokens=p,
                      mean_response_tokens=row.mean_response, max_num_seqs=1024,
                      recompute=row.recompute, reference_forward=True,
                      updates=row.updates, micro_batch_tokens=row.max_sequence,
                      truncated_fraction=row.truncated)
    utilization = 0.8 if row.rollout_gpus else 0.6
    kv = utilization * PUBLISHED_GPU_GIB * GIB - 2 * param_count(desc) / row.engine_tp
    engine_gpus = row.rollout_gpus or row.gpus
    trainer_gpus = row.gpus - row.rollout_gpus
    gen = generation_terms(desc, shape, hw, engines=engine_gpus // row.engine_tp,
                           engine_tp=row.engine_tp, kv_cache_bytes_per_engine_gpu=kv)
    train = training_terms(desc, shape, hw, gpus=trainer_gpus, tp=row.train_tp,
                           pp=row.train_pp, cp=row.train_cp,
                           gpus_per_node=PUBLISHED_GPUS_PER_NODE)
    refit = refit_terms(desc, shape, hw, dedicated=bool(row.rollout_gpus))
    if row.rollout_gpus:
        step = max(gen["total"], train["total"]) + refit["total"]
    else:
        step = gen["total"] + train["total"] + refit["total"]
    return dict(step=step, generation=gen["total"], training=train["update_s"],
                logprobs=train["logprobs_s"], refit=refit["total"])


def published_table(hw: Hardware | None = None) -> list[str]:
    """docs/planner.md's table of the published rows (``PUBLISHED_STEPS``, then the held-out ones):
    one markdown line per row, each published phase as "model / published = ratio"."""
    phases = ("step", "generation", "training", "logprobs", "refit")
    lines = ["| row | source | fit | " + " | ".join(phases) + " |",
             "|" + " --- |" * (3 + len(phases))]
    for row in PUBLISHED_STEPS + HELD_OUT_STEPS:
        pred = predict_published(row, hw)
        cells = [f"{pred[k]:.0f} / {row.published[k]:g} = {pred[k] / row.published[k]:.2f}"
                 if k in row.published else f"({pred[k]:.0f})" for k in phases]
        fit = "fitted" if row.fitted else ("held out" if row in HELD_OUT_STEPS else "check")
        lines.append(f"| {row.label} | {row.source.split(' (')[0]} | {fit} | "
                     + " | ".join(cells) + " |")
    return lines
