"""The most loaded GPU of a layout (``estimate``: every memory term of each pipeline stage,
the largest total) and a dedicated engine's GPU (``dedicated_engine_estimate``); the engines a
layout runs. Notation: ``megatron_dgpo.planner``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from megatron_dgpo.planner.inputs import GIB, Cluster, Layout, PlannedModel, Workload
from megatron_dgpo.planner.memory_terms import (activation_bytes, allocator_cache_bytes,
                                                attention_score_bytes, dispatcher_bytes,
                                                engine_reserve, grad_bytes,
                                                logits_bytes, logprob_workspace_bytes,
                                                nccl_bytes, nccl_communicators, optimizer_bytes,
                                                vllm_bytes, weight_bytes)
from megatron_dgpo.planner.parameters import padded_vocab, stage_expert_params, stage_params


TERMS = ("weights", "grads", "optimizer", "activations", "dispatch", "logits", "cache", "vllm",
         "graphs", "nccl", "overhead")
"""``Estimate``'s memory terms, in the order the table prints them."""


@dataclass
class Estimate:
    """Peak bytes on the most loaded GPU of a layout, term by term."""

    layout: Layout
    stage: str
    """Which GPU is the peak: "first" (stage 0, with the embedding, p micro-batches in flight
    and vLLM), "last" (output layer and logits), a middle stage's index, or "only" (p = 1)."""
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    vllm: int
    overhead: int
    gpu_bytes: int
    nccl: int = 0
    """NCCL communicators' buffers (``nccl_bytes``): resident all job long."""
    graphs: int = 0
    """A sleeping engine's CUDA-graph pool: resident while training runs (awake, it is inside
    the vLLM reserve)."""
    cache: int = 0
    """The allocator's cached memory at training's peak (``allocator_cache_bytes``)."""
    dispatch: int = 0
    """The MoE token dispatcher's buffers of one layer (``dispatcher_bytes``); 0 when dense."""
    expert_params: int = 0
    """The routed-expert parameters among this GPU's (``stage_expert_params``)."""
    notes: list[str] = field(default_factory=list)
    vllm_sleeps: bool = False
    """vLLM is asleep while training runs: the peak holds max(vllm, activations + logits)."""
    engines: int = 0
    """vLLM engines in the job for this layout."""
    offloaded: bool = False
    """Gradients and optimizer state are off the GPU while vLLM is awake (only matters when it
    sleeps during training)."""
    communicators: list[str] = field(default_factory=list)
    """The NCCL communicators counted in ``nccl`` (``nccl_communicators``)."""
    attention_scores: int = 0
    """Of ``activations``, the attention's [s, s] tensors (``attention_score_bytes``): 0 with
    flash or fused attention."""

    @property
    def total(self) -> int:
        """weights + NCCL + overhead + the larger phase when vLLM sleeps during training (training:
        grads + optimizer + activations + dispatch + logits + cache + graphs; rollout: vLLM, plus
        grads + optimizer unless offloaded), else every term at once."""
        state = self.grads + self.optimizer
        training = self.activations + self.dispatch + self.logits + self.cache
        if self.vllm_sleeps:
            phases = max(state + training + self.graphs,
                         self.vllm + (0 if self.offloaded else state))
        else:
            phases = state + training + self.vllm
        return self.weights + self.nccl + phases + self.overhead

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def fits_with(self, headroom: float) -> bool:
        """total <= (1 - headroom) GPU memory."""
        return self.total <= (1.0 - headroom) * self.gpu_bytes

    def as_dict(self) -> dict:
        terms = {k: getattr(self, k) / GIB for k in TERMS}
        layout = asdict(self.layout)
        if not self.layout.moe:  # a dense layout has no expert grid
            del layout["ep"], layout["etp"]
        return dict(layout=layout, peak_stage=self.stage,
                    gib={**terms, "total": self.total / GIB, "gpu": self.gpu_bytes / GIB},
                    fits=self.fits, notes=list(self.notes), vllm_sleeps=self.vllm_sleeps,
                    offloaded=self.offloaded, engines=self.engines,
                    nccl_communicators=list(self.communicators),
                    attention_scores_gib=self.attention_scores / GIB)


def micro_batches_per_update(work: Workload, dp: int) -> int:
    """Upper bound of packed micro-batches per DP rank and update:
    ceil(ceil(responses / D) max_sequence / s) (every response at full length)."""
    per_rank = -(-work.responses_per_update // dp)
    return max(1, -(-per_rank * work.max_sequence // work.micro_batch_tokens))


def engine_tp(work: Workload, layout: Layout) -> int:
    """GPUs per vLLM engine for ``layout`` (``rollout.tensor_parallel_size`` resolved as the
    trainer does, ``rollout.placement.engine_tensor_parallel``)."""
    from megatron_dgpo.rollout.placement import engine_tensor_parallel

    return engine_tensor_parallel(work.rollout_tp, tensor_parallel=layout.tp,
                                  pipeline_parallel=layout.pp, data_parallel=layout.dp)


def dedicated_engines(cluster: Cluster, work: Workload) -> int:
    """E = ``rollout.num_gpus`` / ``rollout.tensor_parallel_size``: the dedicated engines."""
    return cluster.rollout_gpus // (work.rollout_tp or 1)


def dedicated_split_problem(cluster: Cluster, work: Workload, dp: int) -> str | None:
    """Why the trainer would refuse to share the dedicated engines out over ``dp`` replicas
    (``rollout.placement.DedicatedLayout``'s own check), None when it would not (or when there
    are no dedicated engines)."""
    from megatron_dgpo.rollout.placement import dedicated_split_problem as trainer_check

    return trainer_check(cluster.rollout_gpus, work.rollout_tp or 1, dp) if cluster.rollout_gpus \
        else None


def estimate(model: PlannedModel, cluster: Cluster, layout: Layout, work: Workload) -> Estimate:
    """The peak GPU of ``layout``: the ``Estimate`` of its pipeline stage with the largest ``total``
    (stage k: min(p - k, micro-batches) in flight, stage 0 the embedding, the last stage the output
    layer and logits; vLLM where the placement puts an engine; with CP c, s / c tokens per row).
    Raises ``ValueError`` when the layout's MoE-ness is not the model's. The rules:
    docs/planner.md#candidates-and-the-choice."""
    desc = model.description
    if desc.dims.moe != layout.moe:
        raise ValueError(f"layout {layout} is {'an MoE' if layout.moe else 'a dense'} layout "
                         f"but {model.name} is {'an MoE' if desc.dims.moe else 'a dense'} model")
    t, p, c, d = layout.tp, layout.pp, layout.cp, layout.dp
    e, u = layout.ep, layout.expert_tp
    tokens = -(-work.micro_batch_tokens // c)
    rows = padded_vocab(desc.dims.vocab, t)
    micro_batches = micro_batches_per_update(work, d)
    t_r = engine_tp(work, layout)
    work = replace(work, rollout_tp=t_r)
    vllm, vllm_notes = vllm_bytes(desc, cluster, work)
    gpus_per_stage = cluster.world // p
    colocated = work.colocated_rollout and work.rollout_placement == "colocated"
    sleeps = colocated and work.sleep_mode
    engines = (cluster.world // t_r if colocated else d if work.colocated_rollout else 0)

    def stage_estimate(stage: int) -> Estimate:
        params = stage_params(desc, t, p, stage, e, u)
        experts = stage_expert_params(desc, p, e, u)
        last = stage == p - 1
        has_vllm = work.colocated_rollout and (colocated or stage * gpus_per_stage < t_r)
        name = "only" if p == 1 else "first" if stage == 0 else "last" if last else f"{stage}"
        in_flight = min(p - stage, micro_batches)
        activations = activation_bytes(desc, tokens, desc.dims.layers // p, in_flight, t,
                                       work.recompute, work.dtype_bytes, etp=u,
                                       attention=work.attention,
                                       max_sequence=work.max_sequence)
        dispatch = dispatcher_bytes(desc, tokens, t, e, u, work.moe_dispatcher, work.dtype_bytes)
        logits = (logits_bytes(tokens, rows, t, work.logits_dtype_bytes or work.dtype_bytes)
                  + logprob_workspace_bytes(tokens, rows, t, work.log_prob_chunk_size)
                  if last else 0)
        communicators = nccl_communicators(
            layout, tied=desc.tie_word_embeddings, engine_tp=t_r, has_engine=has_vllm,
            refit_link=work.rollout_placement == "dedicated" and stage == 0)
        return Estimate(
            layout=layout, stage=name,
            weights=weight_bytes(params, work.dtype_bytes),
            grads=grad_bytes(params, work.grad_dtype_bytes),
            # CP ranks hold the same weights: Megatron shards the optimizer over DP x CP;
            # expert DP already counts CP in
            optimizer=(optimizer_bytes(params - experts, d * c, work.distributed_optimizer)
                       + optimizer_bytes(experts, layout.expert_dp, work.distributed_optimizer)),
            activations=activations, dispatch=dispatch, expert_params=experts, logits=logits,
            vllm=vllm if has_vllm else 0,
            overhead=work.overhead_bytes, gpu_bytes=cluster.gpu_bytes,
            nccl=nccl_bytes(len(communicators), work.nccl_channels),
            graphs=(work.cuda_graph_bytes if has_vllm and sleeps and not work.enforce_eager
                    else 0),
            cache=allocator_cache_bytes(activations + dispatch + logits, work.allocator_slack),
            notes=list(vllm_notes) if has_vllm else [], vllm_sleeps=sleeps, engines=engines,
            offloaded=sleeps and work.offload_training_state, communicators=communicators,
            attention_scores=attention_score_bytes(
                desc, work.attention, tokens, desc.dims.layers // p, in_flight, t,
                work.recompute, work.dtype_bytes, max_sequence=work.max_sequence))

    # ties go to the earlier stage (the one with vLLM and the most micro-batches in flight)
    peak = max((stage_estimate(k) for k in range(p)), key=lambda e: e.total)
    return peak


@dataclass
class EngineEstimate:
    """One GPU of a dedicated engine (``dedicated_engine_estimate``)."""

    engines: int
    engine_tp: int
    reserve: int
    """vLLM's reserve on each of its GPUs (``vllm_bytes``): weights, KV cache, activations,
    CUDA graphs, its CUDA context."""
    weights: int
    """The engine's weights per GPU, N b_r / t_r."""
    nccl: int
    """The engine's TP communicator and the refit link, beside vLLM's reserve."""
    gpu_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.reserve + self.nccl

    @property
    def kv_cache(self) -> int:
        return max(self.reserve - self.weights, 0)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def as_dict(self) -> dict:
        return dict(engines=self.engines, engine_tp=self.engine_tp,
                    gib=dict(reserve=self.reserve / GIB, weights=self.weights / GIB,
                             kv_cache=self.kv_cache / GIB, nccl=self.nccl / GIB,
                             total=self.total / GIB, gpu=self.gpu_bytes / GIB),
                    fits=self.fits, notes=list(self.notes))


def dedicated_engine_estimate(model: PlannedModel, cluster: Cluster, work: Workload
                              ) -> EngineEstimate | None:
    """A dedicated engine's GPU: vLLM's reserve (``vllm_bytes``, t_r =
    ``rollout.tensor_parallel_size``, default 1) plus its TP and refit-link NCCL buffers; None
    without dedicated engines."""
    if work.rollout_placement != "dedicated" or not cluster.rollout_gpus:
        return None
    t_r = work.rollout_tp or 1
    reserve, weights, notes = engine_reserve(model.description, cluster, work, t_r)
    return EngineEstimate(
        engines=dedicated_engines(cluster, work), engine_tp=t_r, reserve=reserve, weights=weights,
        nccl=nccl_bytes(1 + int(t_r > 1), work.nccl_channels), gpu_bytes=cluster.gpu_bytes,
        notes=notes)
