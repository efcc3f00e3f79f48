"""How long an RL step takes where generation runs: a roofline model of generation, training and
refit, and how each schedule combines them (``step_times``: ``StepTime`` rows) for a
``StepShape`` on a ``Hardware``; each phase's ``*_terms`` gives its terms. The formulas and the
constants' sources: docs/planner.md#step-time and #schedules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_dgpo.models import ModelDescription
from megatron_dgpo.planner.lengths import ResponseLengths
from megatron_dgpo.planner.memory_terms import kv_cache_bytes_per_token
from megatron_dgpo.planner.parameters import param_count

# --------------------------------------------------------------------------- constants

# The constants' sources: docs/planner.md#published-step-times ("Constants").
DENSE_TRAIN_MFU = 0.40
"""Dense training's share of F before pipeline bubbles and TP communication (fitted)."""
MOE_TRAIN_MFU = 0.065
"""MoE training's share of F for the active parameters' FLOPs (fitted)."""
DECODE_HBM_EFFICIENCY = 0.6
"""eta: the share of B_hbm a decode step's weight and KV reads reach (typical, not fitted)."""
DECODE_STEP_OVERHEAD_S = 0.0045
"""o: a decode step's fixed cost beyond its kernels and the sampler, seconds (fitted)."""
PREFILL_MFU = 0.5
DECODE_MFU = 0.5
SAMPLING_S_PER_ROW_VOCAB = 0.88e-3 / (1024 * 152064)
"""The sampler's batched draw per row and vocabulary entry (measured on an H200)."""
SEEDED_SAMPLING_S_PER_ROW_VOCAB = 8.9e-3 / (1024 * 152064)
"""The same with a kernel per seeded request (vLLM's Model Runner V1; measured on an H200)."""
REFIT_FIXED_S = 3.85
"""A refit's fixed cost (sleep/wake, IPC handles, cache resets), seconds (fitted)."""
REFIT_GB_PER_S = 13.9
"""The whole model's bf16 weights into the engines, effective GB/s (fitted)."""
REFIT_S_PER_TENSOR = 2.0e-4
"""A refit's cost per HF-layout weight tensor, seconds (fitted)."""


@dataclass(frozen=True)
class Hardware:
    """One GPU type's published peaks and the shares of them RL phases reach (the module's
    constants by default, each field named after one)."""

    name: str
    peak_tflops: float
    """F: dense bf16 tensor-core TFLOP/s (A100 312, H100 SXM 989)."""
    hbm_gb_per_s: float
    """B_hbm: HBM bandwidth, GB/s (A100 80GB 2039, H100 SXM 3350)."""
    nvlink_gb_per_s: float
    """B_nvlink: one direction of one GPU's NVLink, GB/s (A100 300, H100 450)."""
    network_gb_per_s: float
    """B_net: one GPU's share of the inter-node fabric, GB/s (one 200 Gb/s HDR NIC per A100:
    25; 400 Gb/s NDR per H100: 50)."""
    pcie_gb_per_s: float
    """Host <-> GPU copies of offloaded training state, GB/s (PCIe 4 x16: 25; PCIe 5: 50)."""
    train_mfu: float = DENSE_TRAIN_MFU
    moe_train_mfu: float = MOE_TRAIN_MFU
    decode_hbm_efficiency: float = DECODE_HBM_EFFICIENCY
    decode_mfu: float = DECODE_MFU
    decode_step_overhead_s: float = DECODE_STEP_OVERHEAD_S
    prefill_mfu: float = PREFILL_MFU
    wake_sleep_s: float = REFIT_FIXED_S
    refit_gb_per_s: float = REFIT_GB_PER_S
    refit_s_per_tensor: float = REFIT_S_PER_TENSOR
    sampling_s_per_row_vocab: float = SAMPLING_S_PER_ROW_VOCAB
    seeded_sampling_s_per_row_vocab: float = SEEDED_SAMPLING_S_PER_ROW_VOCAB
    compute_capability: tuple[int, int] | None = None
    """The GPU generation, (8, 0) A100, (9, 0) H100: it decides the attention backend of the
    packed training rows (``memory_terms.resolve_attention``). None: not a real GPU type."""


HARDWARE = {
    "a100": Hardware("A100-80GB", peak_tflops=312, hbm_gb_per_s=2039, nvlink_gb_per_s=300,
                     network_gb_per_s=25, pcie_gb_per_s=25, compute_capability=(8, 0)),
    "h100": Hardware("H100-80GB-SXM", peak_tflops=989, hbm_gb_per_s=3350, nvlink_gb_per_s=450,
                     network_gb_per_s=50, pcie_gb_per_s=50, compute_capability=(9, 0)),
}
"""``dgpo-plan --hardware``: the step time's peaks and the attention backend's GPU generation;
the paper ran on A100 80GB (Appendix B). The published rows are H100."""


@dataclass(frozen=True)
class StepShape:
    """What a recipe says about one step's tokens, plus the two lengths it cannot say."""

    prompts: int
    """P: ``train.rollout_batch_prompts``."""
    group_size: int
    """G: ``rollout.group_size``."""
    max_response_tokens: int
    """R: the longest response (``rollout.max_response_tokens``)."""
    mean_prompt_tokens: float
    """p: the mean prompt (DAPO-Math-17k's prompts with their chat template: ~150-250)."""
    mean_response_tokens: float
    """r: the mean response (reasoning models at an 8k cap: about half of it)."""
    max_num_seqs: int = 256
    recompute: bool = False
    """``model.recompute_activations``: one more forward per token."""
    offloaded_state_bytes_per_gpu: int = 0
    """Colocated with ``train.offload_training_state``: gradients + optimizer state that leave
    each GPU and come back every step."""
    per_request_seeded_draw: bool = False
    """A kernel per seeded request (``SEEDED_SAMPLING_S_PER_ROW_VOCAB``): vLLM's Model Runner
    V1, where ``VLLMEngine.seeded_draw`` says "per request"; vLLM 0.32's V2 on CUDA draws the
    batch in one kernel (False)."""
    reference_forward: bool = False
    """A reference model's forward in the log-prob phase (NeMo-RL's GRPO with a KL penalty;
    DGPO has no reference model)."""
    updates: int = 1
    """Optimizer updates per step (``rollout_batch_prompts / mini_batch_prompts``): the
    micro-batches of one update fill the pipeline once."""
    micro_batch_tokens: int = 0
    """One packed micro-batch row (``train.micro_batch_tokens``); 0: no pipeline bubble counted."""
    length_sigma: float | None = None
    """The response lengths' log-space spread (``lengths.ResponseLengths``; None: its default)."""
    truncated_fraction: float | None = None
    """The share of responses at the cap (``rollout/truncated_frac``); when set, it fixes the
    spread instead of ``length_sigma``."""

    def __post_init__(self):
        # ValueError here for a mean or truncated share no distribution has
        object.__setattr__(self, "_lengths", ResponseLengths.fit(
            self.max_response_tokens, self.mean_response_tokens, sigma=self.length_sigma,
            truncated=self.truncated_fraction))

    @property
    def lengths(self) -> ResponseLengths:
        """The response-length distribution: capped lognormal of mean ``mean_response_tokens``."""
        return self._lengths

    @classmethod
    def from_recipe(cls, run, *, mean_prompt_tokens: float = 200.0,
                    mean_response_fraction: float = 0.5,
                    truncated_fraction: float | None = None) -> "StepShape":
        if not 0 < mean_response_fraction < 1:
            raise ValueError(f"mean_response_fraction must be in (0, 1), got "
                             f"{mean_response_fraction!r}")
        return cls(prompts=run.train.rollout_batch_prompts, group_size=run.rollout.group_size,
                   max_response_tokens=run.rollout.max_response_tokens,
                   mean_prompt_tokens=min(mean_prompt_tokens, run.rollout.max_prompt_tokens),
                   mean_response_tokens=mean_response_fraction * run.rollout.max_response_tokens,
                   max_num_seqs=run.rollout.max_num_seqs, recompute=run.model.recompute_activations,
                   updates=max(1, run.train.rollout_batch_prompts // run.train.mini_batch_prompts),
                   micro_batch_tokens=run.train.micro_batch_tokens,
                   truncated_fraction=truncated_fraction)


# --------------------------------------------------------------------------- parameters


def routed_expert_params(desc: ModelDescription) -> int:
    """N_x: all routed experts' parameters (0 for a dense model)."""
    d = desc.dims
    return d.layers * d.experts * 3 * d.hidden * d.moe_ffn if d.moe else 0


def active_params(desc: ModelDescription) -> int:
    """N: the parameters one token's matmuls touch: all but the input embedding (a tied output layer
    still multiplies), an MoE layer's top-k routed experts rather than all E."""
    d = desc.dims
    n = param_count(desc) - (0 if desc.tie_word_embeddings else d.vocab * d.hidden)
    if d.moe:
        n -= d.layers * (d.experts - d.topk) * 3 * d.hidden * d.moe_ffn
    return n


def shared_params(desc: ModelDescription) -> int:
    """N_d: what every decode step reads whatever the batch: N without the routed experts."""
    d = desc.dims
    return active_params(desc) - (d.layers * d.topk * 3 * d.hidden * d.moe_ffn if d.moe else 0)


def experts_touched_share(desc: ModelDescription, running: float) -> float:
    """share(c) = 1 - (1 - k / E)^c: the expected share of a layer's experts that ``running``
    sequences, each routed to k of E (independently, uniformly), touch in one decode step."""
    d = desc.dims
    if not d.moe:
        return 1.0
    return 1.0 - (1.0 - d.topk / d.experts) ** max(running, 1.0)


def weight_tensors(desc: ModelDescription) -> int:
    """The HF-layout tensors a refit hands over: per layer Q, K, V, O (+ biases), norms (+ q/k
    norms), gate, up, down (MoE: a router and 3 per expert); embedding, final norm, output layer."""
    per_layer = 4 + (3 if desc.qkv_bias else 0) + 2 + (2 if desc.qk_norm else 0)
    per_layer += 1 + 3 * desc.dims.experts if desc.dims.moe else 3
    return desc.dims.layers * per_layer + 2 + (0 if desc.tie_word_embeddings else 1)


# --------------------------------------------------------------------------- phases


def decode_step_seconds(desc: ModelDescription, hw: Hardware, *, running: float, context: float,
                        engine_tp: int, seeded: bool) -> dict[str, float]:
    """One decode step of an engine with ``running`` sequences of mean context ``context``:
    ``{"memory" | "compute" | "overhead" | "sampling" | "total": seconds}``
    (docs/planner.md#step-time)."""
    kv = running * context * kv_cache_bytes_per_token(desc)
    weights = 2 * (shared_params(desc) + routed_expert_params(desc)
                   * experts_touched_share(desc, running))
    memory = (weights + kv) / engine_tp / (hw.hbm_gb_per_s * 1e9 * hw.decode_hbm_efficiency)
    compute = 2 * active_params(desc) * running / engine_tp / (hw.peak_tflops * 1e12
                                                                * hw.decode_mfu)
    per_row = hw.seeded_sampling_s_per_row_vocab if seeded else hw.sampling_s_per_row_vocab
    sampling = running * desc.dims.vocab * per_row
    return dict(memory=memory, compute=compute, overhead=hw.decode_step_overhead_s,
                sampling=sampling,
                total=max(memory, compute) + hw.decode_step_overhead_s + sampling)


def generation_terms(desc: ModelDescription, shape: StepShape, hw: Hardware, *, engines: int,
                     engine_tp: int, kv_cache_bytes_per_engine_gpu: float) -> dict[str, float]:
    """One rollout batch on ``engines`` engines of ``engine_tp`` GPUs, each waiting for its longest
    response: the per-engine counts (responses, concurrent, bulk and tail steps, ...) and seconds
    (prefill, bulk, tail, the fixed cost's and the sampler's shares), ``total`` their sum."""
    per_engine = math.ceil(shape.prompts * shape.group_size / engines)
    lengths = shape.lengths
    p, r = shape.mean_prompt_tokens, shape.mean_response_tokens
    kv_token = kv_cache_bytes_per_token(desc)
    kv_room_tokens = max(kv_cache_bytes_per_engine_gpu, 0) * engine_tp / kv_token
    concurrent = max(1, min(shape.max_num_seqs, per_engine, int(kv_room_tokens // (p + r))))
    bulk_steps = max(0, per_engine - concurrent) * r / concurrent
    wave = min(concurrent, per_engine)
    tail_len = lengths.expected_max(wave * engines)
    tail_running = max(1.0, wave * r / tail_len)
    context = p + lengths.running_age
    step = dict(engine_tp=engine_tp, context=context, seeded=shape.per_request_seeded_draw)
    bulk = decode_step_seconds(desc, hw, running=concurrent, **step)
    tail = decode_step_seconds(desc, hw, running=tail_running, **step)
    prefill = 2 * active_params(desc) * per_engine * p / engine_tp / (hw.peak_tflops * 1e12
                                                                       * hw.prefill_mfu)
    return dict(responses=per_engine, concurrent=concurrent, bulk_steps=bulk_steps,
                tail_steps=tail_len, tail_running=tail_running, last_wave=wave * engines,
                mean_response=r,
                context=context, prefill_s=prefill, bulk_s=bulk_steps * bulk["total"],
                tail_s=tail_len * tail["total"],
                overhead_s=(bulk_steps + tail_len) * hw.decode_step_overhead_s,
                sampling_s=bulk_steps * bulk["sampling"] + tail_len * tail["sampling"],
                bulk_step_s=bulk["total"], tail_step_s=tail["total"],
                total=prefill + bulk_steps * bulk["total"] + tail_len * tail["total"])


def generation_seconds(desc: ModelDescription, shape: StepShape, hw: Hardware, *, engines: int,
                       engine_tp: int, kv_cache_bytes_per_engine_gpu: float) -> float:
    """One rollout batch on ``engines`` engines of ``engine_tp`` GPUs (``generation_terms``'s
    total)."""
    return generation_terms(desc, shape, hw, engines=engines, engine_tp=engine_tp,
                            kv_cache_bytes_per_engine_gpu=kv_cache_bytes_per_engine_gpu)["total"]


def staleness_terms(lengths: ResponseLengths, tokens_per_refit: float,
                    staleness: int) -> dict[str, float]:
    """Partial rollouts refitted every y = ``tokens_per_refit`` decode steps, for responses of
    ``lengths``: ``interrupted`` E[min(X, y)] / y, ``segments`` 1 + E[X] / y, ``min_staleness``
    1 + ceil(cap / y), ``over_bound`` (E[min(X, k y)] - E[min(X, (k-1) y)]) / y at k =
    ``staleness`` (docs/planner.md#schedules)."""
    y = tokens_per_refit
    k = max(staleness, 0)
    return dict(staleness=k, tokens_per_refit=y, interrupted=lengths.mean_below(y) / y,
                segments=1 + lengths.mean / y,
                min_staleness=1 + math.ceil(lengths.cap / y - 1e-9),
                over_bound=(lengths.mean_below(k * y) - lengths.mean_below((k - 1) * y)) / y
                if k >= 1 else 1.0)


def partial_generation_terms(desc: ModelDescription, shape: StepShape, hw: Hardware, *,
                             engines: int, engine_tp: int, kv_cache_bytes_per_engine_gpu: float,
                             staleness: int | None = None, reprefill: bool = True,
                             in_flight: float | None = None) -> dict[str, float]:
    """One step's responses (P G / E per engine) on engines that never wait for a batch's tail
    (partial rollouts, a refit every step), term by term, ``total`` the seconds. ``reprefill``
    False: the KV cache is kept across the refit; ``in_flight``: responses an engine may hold
    (None: as many as fit); ``staleness``: as ``staleness_terms`` (None: its ``min_staleness``)."""
    per_engine = math.ceil(shape.prompts * shape.group_size / engines)
    lengths = shape.lengths
    p, r = shape.mean_prompt_tokens, shape.mean_response_tokens
    context = p + lengths.running_age
    kv_room_tokens = (max(kv_cache_bytes_per_engine_gpu, 0) * engine_tp
                      / kv_cache_bytes_per_token(desc))
    concurrent = max(1, min(shape.max_num_seqs, int(kv_room_tokens // context),
                             int(in_flight or shape.max_num_seqs)))
    decode_steps = per_engine * r / concurrent
    step = decode_step_seconds(desc, hw, running=concurrent, context=context, engine_tp=engine_tp,
                               seeded=shape.per_request_seeded_draw)
    flops = engine_tp * hw.peak_tflops * 1e12 * hw.prefill_mfu
    prefill = 2 * active_params(desc) * per_engine * p / flops
    reprefill_tokens = concurrent * context if reprefill else 0.0
    reprefill_s = reprefill_tokens * (2 * active_params(desc)
                                      + 2 * desc.dims.layers * desc.dims.q_dim * context) / flops
    decode = decode_steps * step["total"]
    stale = staleness_terms(lengths, decode_steps, staleness or 0)
    if staleness is None:
        stale = staleness_terms(lengths, decode_steps, stale["min_staleness"])
    return dict(responses=per_engine, concurrent=concurrent, context=context,
                decode_steps=decode_steps, decode_step_s=step["total"], prefill_s=prefill,
                decode_s=decode, reprefill_tokens=reprefill_tokens, reprefill_s=reprefill_s,
                overhead_s=decode_steps * hw.decode_step_overhead_s,
                sampling_s=decode_steps * step["sampling"],
                longest_decode_s=lengths.cap * step["total"],
                total=prefill + decode + reprefill_s, **stale)


def cp_exchange_terms(desc: ModelDescription, hw: Hardware, *, row_tokens: float,
                      mean_sequence: float, tp: int, cp: int, gpus_per_node: int = 8,
                      mfu: float | None = None, dtype_bytes: int = 2) -> dict[str, float]:
    """Context parallelism's K/V ring (TE's ``p2p``) for one layer's forward of one packed row of
    ``row_tokens`` on one rank: ``comm_s``, ``attention_s`` (what hides it), ``layer_s``,
    ``exposed_s``, ``link`` and ``cp_efficiency`` = 1 / (1 + exposed / layer)
    (docs/planner.md#context-parallelism)."""
    d = desc.dims
    mfu = mfu if mfu is not None else (hw.moe_train_mfu if d.moe else hw.train_mfu)
    flops = hw.peak_tflops * 1e12 * mfu
    link = (hw.nvlink_gb_per_s if tp * cp <= gpus_per_node else hw.network_gb_per_s) * 1e9
    comm = (cp - 1) / cp * row_tokens * 2 * d.kv_dim / tp * dtype_bytes / link if cp > 1 else 0.0
    attn = row_tokens * 2 * d.q_dim * mean_sequence / (tp * cp) / flops
    layer = row_tokens * (2 * active_params(desc) / d.layers
                          + 2 * d.q_dim * mean_sequence) / (tp * cp) / flops
    exposed = max(0.0, comm - attn)
    return dict(comm_s=comm, attention_s=attn, layer_s=layer, exposed_s=exposed,
                link="nvlink" if tp * cp <= gpus_per_node else "network",
                cp_efficiency=1 / (1 + exposed / layer))


def grad_reduce_terms(desc: ModelDescription, hw: Hardware, *, gpus: int, tp: int, pp: int,
                      cp: int, gpus_per_node: int, backward_s: float) -> dict[str, float]:
    """One optimizer update's gradient reduce-scatter and parameter all-gather over the D c
    ranks of the distributed optimizer, seconds: ``comm_s`` and ``exposed_s`` = max(0, comm -
    ``backward_s``), the part overlapping does not hide (docs/planner.md#context-parallelism)."""
    replicas = max(1, gpus // (tp * pp))  # D c
    if replicas == 1:
        return dict(comm_s=0.0, exposed_s=0.0)
    link = (hw.nvlink_gb_per_s if gpus // pp <= gpus_per_node else hw.network_gb_per_s) * 1e9
    comm = 6 * param_count(desc) / (tp * pp) * (replicas - 1) / replicas / link
    return dict(comm_s=comm, exposed_s=max(0.0, comm - backward_s))


def training_terms(desc: ModelDescription, shape: StepShape, hw: Hardware, *, gpus: int,
                   tp: int = 1, pp: int = 1, cp: int = 1,
                   gpus_per_node: int = 8) -> dict[str, float]:
    """The trainer's phases on ``gpus`` GPUs at TP ``tp`` x PP ``pp`` x CP ``cp``: ``update_s``
    (forward, backward, recompute and the exposed DP x CP gradient reduce), ``logprobs_s`` (the old
    log-probs' forward, plus the reference model's when ``shape.reference_forward``), the pipeline,
    TP and CP efficiency factors, and ``total``."""
    seq = shape.mean_prompt_tokens + shape.mean_response_tokens
    tokens = shape.prompts * shape.group_size * seq
    n = active_params(desc)
    d = desc.dims
    per_pass = 2 * n + 4 * d.layers * d.q_dim * seq / 2
    mfu = hw.moe_train_mfu if d.moe else hw.train_mfu
    dp = max(1, gpus // (tp * pp * cp))
    if pp > 1 and shape.micro_batch_tokens:
        micro = max(1, math.ceil(tokens / shape.updates / dp / shape.micro_batch_tokens))
        pipe = micro / (micro + pp - 1)
    else:
        pipe = 1.0
    if tp > 1:
        comm = 8 * d.hidden * (tp - 1) / tp / (hw.nvlink_gb_per_s * 1e9)
        compute = 2 * n / d.layers / tp / (hw.peak_tflops * 1e12 * mfu)
        tp_eff = 1 / (1 + comm / compute)
    else:
        tp_eff = 1.0
    ring = cp_exchange_terms(desc, hw, row_tokens=shape.micro_batch_tokens or seq,
                             mean_sequence=seq, tp=tp, cp=cp, gpus_per_node=gpus_per_node,
                             mfu=mfu)
    rate = gpus * hw.peak_tflops * 1e12 * mfu * pipe * tp_eff * ring["cp_efficiency"]
    passes = 3 + int(shape.recompute)
    compute_s = tokens * passes * per_pass / rate
    reduce = grad_reduce_terms(desc, hw, gpus=gpus, tp=tp, pp=pp, cp=cp,
                               gpus_per_node=gpus_per_node,
                               backward_s=compute_s * 2 / passes / shape.updates)
    update = compute_s + shape.updates * reduce["exposed_s"]
    logprobs = tokens * (1 + int(shape.reference_forward)) * per_pass / rate
    return dict(update_s=update, logprobs_s=logprobs, mfu=mfu, pipeline_efficiency=pipe,
                tp_efficiency=tp_eff, cp_efficiency=ring["cp_efficiency"],
                cp_comm_ms=ring["comm_s"] * 1e3, cp_attention_ms=ring["attention_s"] * 1e3,
                cp_link=ring["link"], grad_reduce_s=reduce["comm_s"],
                grad_reduce_exposed_s=reduce["exposed_s"], total=update + logprobs)


def training_seconds(desc: ModelDescription, shape: StepShape, hw: Hardware, *, gpus: int,
                     tp: int = 1, pp: int = 1, cp: int = 1, gpus_per_node: int = 8) -> float:
    """Forward + backward (+ recompute) of every token, and the old log-probs' forward, on
    ``gpus`` trainer GPUs (``training_terms``)."""
    return training_terms(desc, shape, hw, gpus=gpus, tp=tp, pp=pp, cp=cp,
                          gpus_per_node=gpus_per_node)["total"]


def refit_terms(desc: ModelDescription, shape: StepShape, hw: Hardware, *,
                dedicated: bool) -> dict[str, float]:
    """The trained weights into the engines, term by term (docs/planner.md#step-time)."""
    weights = 2 * param_count(desc)
    out = dict(fixed_s=hw.wake_sleep_s, bytes_s=weights / (hw.refit_gb_per_s * 1e9),
               tensors_s=weight_tensors(desc) * hw.refit_s_per_tensor,
               network_s=weights / (hw.network_gb_per_s * 1e9) if dedicated else 0.0,
               offload_s=0.0 if dedicated else
               2 * shape.offloaded_state_bytes_per_gpu / (hw.pcie_gb_per_s * 1e9))
    out["total"] = sum(out.values())
    return out


def refit_seconds(desc: ModelDescription, shape: StepShape, hw: Hardware, *, dedicated: bool,
                  engine_tp: int = 1) -> float:
    """The trained weights into the engines, seconds (``refit_terms``; ``engine_tp`` is kept for
    callers: the calibrated path moves the whole model whatever the engine's TP)."""
    return refit_terms(desc, shape, hw, dedicated=dedicated)["total"]


OVERLAPPED = ("one-step-off", "partial")
"""The schedules whose generation overlaps the previous step's training (dedicated engines)."""


@dataclass(frozen=True)
class StepTime:
    """One schedule's step, seconds: the phases and who waits."""

    placement: str
    """"colocated", "dedicated" (synchronous), "one-step-off" or "partial" (partial rollouts at
    ``staleness``)."""
    trainer_gpus: int
    rollout_gpus: int
    """GPUs of dedicated engines (0: colocated, the engines share the trainer's GPUs)."""
    generation_s: float
    training_s: float
    refit_s: float
    terms: dict = field(default_factory=dict, compare=False, repr=False)
    """The phases' terms (``generation_terms`` or ``partial_generation_terms``,
    ``training_terms``, ``refit_terms``)."""
    staleness: int = 0
    """k: 0 synchronous, 1 one-step-off, the bound priced for partial rollouts."""

    @property
    def label(self) -> str:
        """The schedule in words: "synchronous, colocated", ..., "partial rollouts, k=2"."""
        return {"colocated": "synchronous, colocated", "dedicated": "synchronous, dedicated",
                "one-step-off": "one-step-off, k=1"}.get(self.placement,
                                                         f"partial rollouts, k={self.staleness}")

    @property
    def step_s(self) -> float:
        if self.placement in OVERLAPPED:
            return max(self.generation_s, self.training_s) + self.refit_s
        return self.generation_s + self.training_s + self.refit_s

    @property
    def dominant(self) -> str:
        """The longest phase: "generation", "training" or "refit"."""
        phases = dict(generation=self.generation_s, training=self.training_s, refit=self.refit_s)
        return max(phases, key=phases.get)

    @property
    def trainer_idle_s(self) -> float:
        """Seconds per step the trainer's GPUs wait for samples (colocated: they generate)."""
        return self._waiting(self.generation_s, self.training_s)

    @property
    def engine_idle_s(self) -> float:
        """Seconds per step dedicated engines wait for the trainer."""
        return self._waiting(self.training_s, self.generation_s)

    def _waiting(self, other: float, own: float) -> float:
        """What a side waits for the other's ``other`` seconds beside its ``own``: nothing
        colocated, all of it synchronous, the difference when generation overlaps training."""
        if self.placement == "colocated":
            return 0.0
        if self.placement in OVERLAPPED:
            return max(0.0, other - own)
        return other

    def as_dict(self) -> dict:
        return dict(placement=self.placement, staleness=self.staleness, label=self.label,
                    trainer_gpus=self.trainer_gpus,
                    rollout_gpus=self.rollout_gpus, step_s=self.step_s,
                    generation_s=self.generation_s, training_s=self.training_s,
                    refit_s=self.refit_s, trainer_idle_s=self.trainer_idle_s,
                    engine_idle_s=self.engine_idle_s, dominant=self.dominant)


def step_times(desc: ModelDescription, shape: StepShape, hw: Hardware, *, world: int,
               rollout_gpus: int, engine_tp: int, kv_cache_bytes_per_engine_gpu: float,
               colocated_kv_cache_bytes_per_gpu: float | None = None,
               train_layout: tuple[int, ...] = (1, 1),
               dedicated_train_layout: tuple[int, ...] | None = None,
               gpus_per_node: int = 8, staleness: int | None = None) -> list[StepTime]:
    """Colocated engines of ``engine_tp`` GPUs on all ``world`` GPUs, then (``rollout_gpus`` > 0)
    dedicated engines on ``rollout_gpus`` of them: synchronous, one-step-off, partial rollouts at
    ``staleness`` (None: the least k admitting every response). ``train_layout``: (TP, PP[, CP])
    on all GPUs, ``dedicated_train_layout`` on the rest (default the same); ``gpus_per_node``:
    which links TP x CP and DP x CP cross; ``colocated_kv_cache_bytes_per_gpu`` default: the
    dedicated engines' KV room."""
    colocated_kv = (kv_cache_bytes_per_engine_gpu if colocated_kv_cache_bytes_per_gpu is None
                    else colocated_kv_cache_bytes_per_gpu)
    tp, pp, cp = (tuple(train_layout) + (1,))[:3]
    gen = generation_terms(desc, shape, hw, engines=world // engine_tp, engine_tp=engine_tp,
                           kv_cache_bytes_per_engine_gpu=colocated_kv)
    train = training_terms(desc, shape, hw, gpus=world, tp=tp, pp=pp, cp=cp,
                           gpus_per_node=gpus_per_node)
    refit = refit_terms(desc, shape, hw, dedicated=False)
    out = [StepTime("colocated", world, 0, gen["total"], train["total"], refit["total"],
                    dict(generation=gen, training=train, refit=refit))]
    if rollout_gpus:
        trainer = world - rollout_gpus
        tp, pp, cp = (tuple(dedicated_train_layout or train_layout) + (1,))[:3]
        engines = dict(engines=rollout_gpus // engine_tp, engine_tp=engine_tp,
                       kv_cache_bytes_per_engine_gpu=kv_cache_bytes_per_engine_gpu)
        gen = generation_terms(desc, shape, hw, **engines)
        partial = partial_generation_terms(desc, shape, hw, staleness=staleness, **engines)
        train = training_terms(desc, shape, hw, gpus=trainer, tp=tp, pp=pp, cp=cp,
                               gpus_per_node=gpus_per_node)
        refit = refit_terms(desc, shape, hw, dedicated=True)
        out += [StepTime(mode, trainer, rollout_gpus, g["total"], train["total"], refit["total"],
                         dict(generation=g, training=train, refit=refit), k)
                for mode, g, k in (("dedicated", gen, 0), ("one-step-off", gen, 1),
                                   ("partial", partial, partial["staleness"]))]
    return out
