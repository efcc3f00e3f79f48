"""What a plan is for: the model (``PlannedModel``), the cluster (``Cluster``), what the recipe says
that decides memory (``Workload``), one layout (``Layout``); ``GIB``, the unit of memory."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dgpo.models import ModelDescription, describe

GIB = 1 << 30


@dataclass(frozen=True)
class PlannedModel:
    """The model a plan is for: a name for messages and the ``ModelDescription`` the builder and the
    converter use, dense (Qwen2, Llama, Qwen3) or Qwen3-MoE (``from_hf_config`` builds it)."""

    name: str
    description: ModelDescription

    def __post_init__(self):
        d = self.description.dims
        for field in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab"):
            value = getattr(d, field)
            if not (isinstance(value, int) and value >= 1):
                label = "intermediate" if field == "ffn" else field  # dgpo-plan's word for f
                raise ValueError(f"architecture {self.name}: {label} must be a positive int, "
                                 f"got {value!r}")
        if d.heads % d.kv_heads:
            raise ValueError(f"architecture {self.name}: heads ({d.heads}) must be a "
                             f"multiple of kv_heads ({d.kv_heads})")
        if d.experts and not (d.moe_ffn >= 1 and 1 <= d.topk <= d.experts):
            raise ValueError(f"architecture {self.name}: an MoE model needs moe_ffn >= 1 and "
                             f"1 <= topk <= experts ({d.experts}), got moe_ffn="
                             f"{d.moe_ffn!r}, topk={d.topk!r}")

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "") -> "PlannedModel":
        """From an HF ``config.json`` dict of a registered family (``megatron_dgpo.models``); errors
        name the missing or unsupported field."""
        try:
            desc = describe(cfg)
        except ValueError as exc:
            raise ValueError(f"{name or 'the model'}: {exc}") from None
        return cls(name=name or cfg.get("model_type") or "model", description=desc)

    def as_dict(self) -> dict:
        """``dgpo-plan --json``'s "model": the name, the dimensions and the flags."""
        d, desc = self.description.dims, self.description
        return dict(name=self.name, hidden=d.hidden, layers=d.layers, heads=d.heads,
                    kv_heads=d.kv_heads, intermediate=d.ffn, vocab=d.vocab,
                    tie_word_embeddings=desc.tie_word_embeddings, qkv_bias=desc.qkv_bias,
                    head_dim=d.head_dim, qk_norm=desc.qk_norm, experts=d.experts,
                    moe_ffn=d.moe_ffn, topk=d.topk)


@dataclass(frozen=True)
class Cluster:
    """The cluster shape: ``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gb`` GiB each."""

    gpus_per_node: int
    nodes: int
    gpu_memory_gb: float
    rollout_gpus: int = 0
    """GPUs of dedicated rollout engines (``rollout.placement: dedicated``, ``rollout.num_gpus``):
    the last ones of the job, outside the trainer's world."""

    @property
    def gpus(self) -> int:
        """Every GPU of the job."""
        return self.gpus_per_node * self.nodes

    @property
    def world(self) -> int:
        """The trainer's (Megatron's) world: every GPU but the dedicated engines'."""
        return self.gpus - self.rollout_gpus

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gb * GIB)


@dataclass(frozen=True)
class Workload:
    """What a recipe says that decides memory (see ``Workload.from_recipe``)."""

    micro_batch_tokens: int
    """s: tokens of one packed micro-batch row."""
    responses_per_update: int
    """mini_batch_prompts x group_size: the responses of one optimizer update."""
    max_sequence: int
    """max_prompt_tokens + max_response_tokens."""
    recompute: bool = False
    distributed_optimizer: bool = True
    dtype_bytes: int = 2
    grad_dtype_bytes: int = 4
    logits_dtype_bytes: int | None = None
    """Bytes per logit into the log-prob kernel; None: ``dtype_bytes`` (the trainer keeps the
    logits in the model's dtype)."""
    log_prob_chunk_size: int | None = None
    colocated_rollout: bool = True
    """vLLM lives on the training GPUs: with ``rollout.placement: colocated`` an engine in every
    rank (one per ``rollout_tp`` GPUs); with ``separate``, one per DP replica leader (its
    ``rollout_tp`` GPUs counted from the first of the node). False for the transformers engine
    and for dedicated engines (``Cluster.rollout_gpus`` of them)."""
    rollout_placement: str = "colocated"
    """With "dedicated", each DP replica's leader holds one more communicator, the refit link to
    its engines (``dedicated_engine_estimate``)."""
    rollout_tp: int | None = None
    """GPUs per engine; None = the layout's TP x PP (TP when PP > 1 and DP > 1)."""
    sleep_mode: bool = True
    """A colocated engine sleeps during training (vLLM sleep mode: KV cache freed, weights
    dropped), so its memory and training's activations/logits never coexist: the GPU peak
    counts max(vLLM, activations + logits)."""
    offload_training_state: bool = False
    """``train.offload_training_state``: gradients and optimizer state leave the GPU while a
    sleeping colocated engine is awake, so the peak is max(training, vLLM) over them too."""
    moe_dispatcher: str = "alltoall"
    """``model.moe_token_dispatcher`` (``dispatcher_bytes``; allgather needs PP 1)."""
    rollout_dtype_bytes: int = 2
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    enforce_eager: bool = False
    """``rollout.enforce_eager``: no CUDA graphs, so a sleeping engine keeps no graph pool."""
    cuda_graph_bytes: int = GIB
    """A vLLM engine's CUDA-graph pool per GPU (``--cuda-graph-gb``). Since vLLM 0.21 it is
    profiled inside ``gpu_memory_utilization`` while the engine is awake, but sleep mode does
    not release it, so it stays through training. Published captures: 0.13 GiB (0.5B model,
    decode sizes to 256), 0.36 GiB (piecewise sizes to 16), 1.4 GiB (a 1T MoE at TP 8, sizes
    to 512); vLLM's older warning said 1-3 GiB."""
    nccl_channels: int = 32
    """C of ``nccl_bytes`` (``--nccl-channels``)."""
    allocator_slack: float = 0.1
    """``allocator_cache_bytes``'s slack (``--allocator-slack``)."""
    overhead_bytes: int = GIB
    """The CUDA context (~0.5 GiB with lazy module loading) and the cuBLAS / TE workspaces: a
    flat allowance per GPU (``--overhead-gb``); NCCL, CUDA graphs and the allocator's cache
    are their own terms."""
    attention_backend: str = "auto"
    """``model.attention_backend``: what the recipe asks for (``gpu_flags.ATTENTION_BACKENDS``)."""
    without_transformer_engine: bool = False
    """``model.without_transformer_engine``: Megatron's local layer spec (dense row masks)."""
    attention: str = "flash"
    """The attention backend the activations are counted for: "flash" or "fused" (linear in
    tokens), "unfused" (Transformer-Engine's, [s, s] tensors per layer) or "local" (Megatron's
    local spec, [S, S] over the whole row): ``memory_terms.resolve_attention``'s answer for the
    two fields above on the plan's GPUs, which ``dgpo-plan`` sets. ``from_recipe`` leaves the
    default, "flash" (what ``auto`` runs on an A100 of the pinned image)."""

    @classmethod
    def from_recipe(cls, run) -> "Workload":
        """The memory-relevant fields of a ``RunConfig``, ``None`` read as on a GPU: distributed
        optimizer and sleep mode on, ``enforce_eager`` off; bf16 unless ``model.dtype: float32``;
        the recipe's attention request (which backend runs: ``memory_terms.resolve_attention``)."""
        dist_opt = run.optimizer.use_distributed_optimizer
        return cls(
            micro_batch_tokens=run.train.micro_batch_tokens,
            responses_per_update=run.train.mini_batch_prompts * run.rollout.group_size,
            max_sequence=run.rollout.max_prompt_tokens + run.rollout.max_response_tokens,
            recompute=run.model.recompute_activations,
            moe_dispatcher=run.model.moe_token_dispatcher,
            distributed_optimizer=True if dist_opt is None else bool(dist_opt),
            dtype_bytes=4 if run.model.dtype == "float32" else 2,
            log_prob_chunk_size=run.train.log_prob_chunk_size,
            colocated_rollout=run.rollout.engine == "vllm" and run.rollout.placement != "dedicated",
            rollout_placement=run.rollout.placement,
            rollout_tp=run.rollout.tensor_parallel_size,
            rollout_dtype_bytes=4 if run.rollout.dtype in ("float32", "float") else 2,
            gpu_memory_utilization=run.rollout.gpu_memory_utilization,
            kv_cache_memory_bytes=run.rollout.kv_cache_memory_bytes,
            max_num_seqs=run.rollout.max_num_seqs,
            offload_training_state=run.train.offload_training_state,
            sleep_mode=run.rollout.sleep_mode is not False,
            enforce_eager=bool(run.rollout.enforce_eager),
            attention_backend=run.model.attention_backend,
            without_transformer_engine=run.model.without_transformer_engine,
        )


@dataclass(frozen=True)
class Layout:
    """TP x PP x CP x DP (x EP, expert TP); Megatron's rank order tp-cp-ep-dp-pp puts TP innermost
    (within a node) and ``cp`` (``parallel.context_parallel``) between TP and DP."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int = 1
    """Expert parallel (MoE): each layer's experts split over e ranks of a stage."""
    etp: int | None = None
    """Expert TP u (MoE); None for a dense layout (then ``expert_tp`` is TP, as Megatron's
    default)."""

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def moe(self) -> bool:
        return self.etp is not None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """D_e = world / (p e u): the ranks holding the same experts (the expert grid
        ``etp-ep-edp`` decomposes each pipeline stage's t c D ranks again)."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    def __str__(self) -> str:
        dense = f"TP{self.tp} PP{self.pp} CP{self.cp} DP{self.dp}"
        return dense + (f" EP{self.ep} ETP{self.etp}" if self.moe else "")
