"""The recipe's ``rollout`` section: the engines, where they run and how they sample. Every rollout
module takes it; ``recipe.RunConfig`` composes it with the other sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from megatron_dgpo.runtime.config import Bounds, check_bounds, require_choice


@dataclass
class RolloutConfig:
    """Generation of the responses (vLLM, or transformers as a fallback)."""

    engine: Literal["vllm", "hf"] = "vllm"
    """``vllm`` (the real engine, CPU or GPU) or ``hf`` (transformers' generate: slow, for
    machines where vLLM does not run)."""
    group_size: Annotated[int, Bounds(ge=2, why="a group of one has no advantage (every group is "
                                              "degenerate) and trains nothing")] = 8
    """Responses sampled per prompt (G): the group whose rewards are normalised into
    advantages. The paper does not state it; 8 is the common choice (DAPO uses 16). At least 2:
    a group of one has no spread, so its advantage is 0 and it trains nothing."""
    temperature: Annotated[float, Bounds(gt=0)] = 1.0
    """Sampling temperature. The trainer divides logits by the same value, so the old and new
    log-probs are of the distribution the tokens were drawn from."""
    top_p: Annotated[float, Bounds(gt=0, le=1)] = 1.0
    """Nucleus sampling mass. Values < 1 make the sampled log-probs those of the truncated
    distribution (vLLM's processed log-probs), which the trainer cannot reproduce: keep 1.0."""
    max_response_tokens: Annotated[int, Bounds(ge=1)] = 8192
    """Maximum response length; longer responses are cut (finish reason "length")."""
    max_prompt_tokens: Annotated[int, Bounds(ge=1)] = 2048
    """Prompts longer than this (chat template included) are dropped from the dataset."""
    dtype: str = "auto"
    """vLLM weights dtype: "auto" follows the checkpoint; "float32" gives exact log-probs."""
    tensor_parallel_size: Annotated[int | None, Bounds(ge=1)] = None
    """vLLM's own tensor parallelism: ranks (GPUs) per engine. None = the trainer's
    ``parallel.tensor_parallel`` x ``parallel.pipeline_parallel`` (each DP replica owns one
    engine on its own GPUs, one per CP rank under context parallelism; with PP > 1 and DP > 1:
    ``parallel.tensor_parallel``). With ``placement: colocated`` (CPU too) an engine spans this
    many consecutive trainer ranks, which must lie in one DP replica's TP x CP x PP ranks (it
    divides ``parallel.tensor_parallel``, or divides TP x CP x PP when PP = 1 or DP = 1); the
    replica's
    prompts are split over its engines. ``separate``: the GPUs of each replica leader's engine.
    ``dedicated``: GPUs per engine among the ``num_gpus`` rollout GPUs (None = 1)."""
    gpu_memory_utilization: Annotated[float, Bounds(gt=0, le=1)] = 0.5
    """Fraction of GPU memory vLLM may take for weights + KV cache (GPU). Colocated engines
    share it with training; dedicated engines own their GPUs (0.85-0.9 is usual there)."""
    kv_cache_memory_bytes: Annotated[int | None, Bounds(ge=1)] = None
    """KV-cache size in bytes; required by vLLM on CPU (default there 256 MiB)."""
    max_num_seqs: Annotated[int, Bounds(ge=1)] = 256
    """Sequences vLLM decodes at once."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Any other ``vllm.LLM`` keyword argument."""
    placement: Literal["colocated", "separate", "dedicated"] = "colocated"
    """Where vLLM runs (engine ``vllm`` only). ``colocated``: inside the trainer's ranks
    (``external_launcher``), one engine per ``tensor_parallel_size`` consecutive ranks, sharing
    their GPUs (sleep mode frees its memory during training on GPU). ``separate``: an engine in
    its own process on the replica leader's GPUs, for machines or vLLM versions where
    colocation does not work. ``dedicated``: engines on GPUs of their own, the last
    ``num_gpus`` ranks of the torchrun world, outside the trainer's (Megatron's) world; each
    DP replica's leader drives its share of the engines and refits them by a weight broadcast
    (NCCL on GPU, gloo on CPU); with ``max_staleness: 1`` generation overlaps training
    (``megatron_dgpo.rollout.dedicated``)."""
    num_gpus: Annotated[int, Bounds(ge=0)] = 0
    """``placement: dedicated`` only: GPUs (on CPU, processes) of the rollout engines, taken
    from the end of the torchrun world (the SLURM script's ``ROLLOUT_NODES``); the trainer's
    world is the rest. Engines are ``num_gpus / tensor_parallel_size`` (``tensor_parallel_size``
    None: 1 GPU per engine); their count must be a multiple of the trainer's DP replicas (each
    replica drives its own engines, so samples never cross DP)."""
    max_staleness: Annotated[int, Bounds(ge=0)] = 0
    """k: a token sampled with the weights of step v trains at step s only if s - 1 - v <= k.
    0: synchronous. 1 (``placement: dedicated``): one-step-off, batch s+1 is generated while
    step s trains. >= 2 (dedicated): the streaming schedule, the engines up to k + 1 batches
    ahead (docs/rollout.md, "Staleness and partial rollouts"). pi_old stays the trainer's policy
    at the step's start; ``algorithm.rollout_correction: tis`` is recommended at 1, required
    from 2 on."""
    partial: bool = False
    """Partial rollouts (dedicated, ``max_staleness`` >= 1, the streaming schedule): a refit
    interrupts generation; the unfinished responses continue under the new weights by
    re-prefilling prompt + response so far, each segment with its weight version and its own
    seed stream. False: a refit lets the started responses finish."""
    mask_stale_segments: bool = False
    """The streaming schedule: a group whose oldest tokens are more than k updates old still
    trains, those tokens with loss weight 0, instead of its stale responses starting over."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs. None: eager on CPU (required there), CUDA graphs on GPU; true
    saves the graphs' memory pool and capture time at some decode speed."""
    sleep_mode: bool | None = None
    """Free the engine's GPU memory while training runs (vLLM sleep mode). None: on for
    colocated engines on GPU (they share the trainer's GPUs), off otherwise; CPU: never (vLLM
    refuses it there)."""
    sleep_level: Literal[1, 2] = 2
    """What sleep does with the weights: 2 drops them (every wake is followed by the refit,
    which reloads every weight), 1 keeps a copy in pinned host memory (~2 bytes per parameter
    of the engine's shard, copied out and back every step for nothing when refitting)."""
    dummy_weights: bool | None = None
    """Start colocated engines from random weights that the trainer's first refit replaces,
    instead of every rank reading the whole HF checkpoint (verl does the same). None: on for
    colocated engines on GPU, off otherwise."""
    refit_bucket_bytes: Annotated[int, Bounds(ge=1, lt=(1 << 32) - 1)] = 512 << 20
    """Largest weight payload of one in-place reload when the trainer refits the engine (512
    MiB, as slime). Buckets never split a layer's fused q/k/v or gate/up tensors (a larger
    group goes alone); must stay below 4 GiB (vLLM's message limit for ``separate``)."""

    def __post_init__(self):
        check_bounds(self)
        require_choice("placement", self.placement, ("colocated", "separate", "dedicated"))
        require_choice("sleep_level", self.sleep_level, (1, 2))
        if self.placement == "dedicated":
            if self.engine != "vllm":
                raise ValueError(f"placement: dedicated needs engine: vllm, got {self.engine!r}")
            tp = self.tensor_parallel_size or 1
            if self.num_gpus < 1 or self.num_gpus % tp:
                raise ValueError(f"num_gpus must be a positive multiple of tensor_parallel_size "
                                 f"({tp}) with placement: dedicated (the engines' GPUs), got "
                                 f"{self.num_gpus!r}")
        elif self.num_gpus:
            raise ValueError(f"num_gpus={self.num_gpus} is for placement: dedicated (engines on "
                             f"GPUs of their own); placement is {self.placement!r}")
        if self.max_staleness and self.placement != "dedicated":
            raise ValueError(f"max_staleness: {self.max_staleness} needs placement: dedicated "
                             f"(generation overlaps training only on GPUs of its own); placement "
                             f"is {self.placement!r}")
        if self.partial and not self.max_staleness:
            raise ValueError("partial: true needs max_staleness >= 1 (a synchronous step never "
                             "refits while it generates)")
        if self.mask_stale_segments and not self.streaming:
            raise ValueError("mask_stale_segments needs the streaming schedule: max_staleness "
                             ">= 2, or partial: true")

    @property
    def streaming(self) -> bool:
        """The engines stream groups into a buffer (``max_staleness`` >= 2 or ``partial``),
        rather than sampling whole batches (synchronous, one-step-off)."""
        return self.max_staleness >= 2 or self.partial
