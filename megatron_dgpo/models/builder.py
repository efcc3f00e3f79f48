"""Megatron-Core ``GPTModel`` from a Hugging Face config of a registered family (Qwen2, Llama,
Qwen3, Qwen3-MoE).

The HF config is read once, by ``megatron_dgpo.models.describe`` (family quirks, dimensions,
RoPE; see ``megatron_dgpo/models``). This module maps that description onto Megatron:

    dims.layers / hidden / heads / kv_heads / head_dim / ffn -> num_layers / hidden_size /
        num_attention_heads / num_query_groups (GQA) / kv_channels / ffn_hidden_size
    norm_eps -> layernorm_epsilon (normalization="RMSNorm"); SwiGLU: gated_linear_unit=True,
        activation_func=F.silu; qkv_bias -> add_qkv_bias, no other bias
    rope.theta / scaling / factor -> rotary_base / rope_scaling / rope_scaling_factor
    tie_word_embeddings -> share_embeddings_and_output_weights
    vocab_size -> padded_vocab_size(vocab_size, TP) (rows past vocab_size are padding)
    qk_norm (Qwen3) -> qk_layernorm (RMSNorm per query / key head, in the layer spec too)

Mixture of experts (Qwen3-MoE, ``dims.experts > 0``), every layer an MoE layer:

    dims.experts / topk / moe_ffn -> num_moe_experts / moe_router_topk / moe_ffn_hidden_size
    router.norm_topk_prob -> moe_router_pre_softmax = not norm_topk_prob, score function
        softmax, router in fp32 (HF's semantics; a wrong setting moves logits by ~0.4)
    load balancing: none with ``moe_aux_loss_coeff`` 0 (RL's default), else aux_loss
    expert parallelism / expert TP: from Megatron's parallel state (``ParallelConfig``)
    experts: TEGroupedMLP (``moe_grouped_gemm``, fused permutation ``moe_permute_fusion``) with
        Transformer-Engine, else SequentialMLP
    optimizer: experts always in their own (chained) optimizer, at EP = 1 too, so that the
        optimizer checkpoint is the same at every EP (``_experts_in_their_own_optimizer``)
    token dispatcher: ``moe_token_dispatcher_type`` (alltoall by default; allgather needs
        fixed sequence lengths, which only PP = 1 affords)
    TP > 1: Megatron requires sequence parallelism with MoE, on here only with CUDA (gloo has
        no reduce-scatter), so an MoE model on CPU runs at TP 1 (EP and DP instead); an
        explicit ``sequence_parallel`` override skips that refusal (the converter's models at
        TP > 1 on CPU, which never run forward)

Context parallelism: ``context_parallel_size`` from Megatron's parallel state; on a GPU
``cp_comm_type="p2p"`` (Megatron-LM's default, TE's ring attention); on CPU the local attention
takes it through ``runtime/cpu.py``'s patch 15.

The model is built with ``parallel_output=True``: the last pipeline stage returns logits
[B, S, V_padded / TP], this rank's contiguous vocab shard. Padded columns (global index >=
``hf vocab_size``) are not part of the distribution: pass ``vocab_size`` to
``vocab_parallel.logprobs_and_entropy`` to exclude them.

Layer spec: Transformer-Engine (``get_gpt_layer_with_transformer_engine_spec``) when TE is
importable and CUDA is available, else Megatron's local spec (``get_gpt_layer_local_spec``,
RMSNorm). Parameter names differ between the two only in the fused norms: local
``decoder.layers.{i}.input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` are TE's
``self_attention.linear_qkv.layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight``.
``decoder.layers.{i}`` numbers layers locally per (virtual) pipeline stage; the global index is
``layer.layer_number - 1``. With tied embeddings and PP > 1 the last stage holds
``output_layer.weight`` as a copy of ``embedding.word_embeddings.weight`` (Megatron keeps them
in sync by summing their gradients over the embedding group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from megatron_dgpo.models import describe, hf_config_dict, padded_vocab_size
from megatron_dgpo.runtime.gpu_flags import Platform, sequence_parallel, transformer_flags


@dataclass(frozen=True)
class ModelSpec:
    """What the HF config says that ``TransformerConfig`` does not carry."""

    family: str
    """The HF ``model_type`` of a family in ``megatron_dgpo.models.FAMILIES``."""
    vocab_size: int
    """The HF vocabulary size: logits columns >= this are TP padding."""
    max_position_embeddings: int
    rotary_base: float
    rope_scaling: bool
    rope_scaling_factor: float
    tie_word_embeddings: bool
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)
    """The HF config the model was built from (the converter's export reads its family map)."""


def transformer_config_from_hf(hf_config: Any, *, platform: Platform | None = None,
                               **overrides):
    """``(TransformerConfig, ModelSpec)`` for an HF config of a family in
    ``megatron_dgpo.models.FAMILIES`` (dimensions and quirks come from ``models.describe``).

    Defaults chosen for RL training: no dropout, ``calculate_per_token_loss=True`` (the train
    step's normalisation relies on it), ``variable_seq_lengths=True`` (micro-batches of unequal
    lengths under PP). The machine-dependent settings come from
    ``gpu_flags.transformer_flags(platform, TP)``: on a GPU sequence parallelism with TP > 1,
    fused RoPE with Transformer-Engine, gradient-accumulation fusion with apex, the bias /
    softmax / norm fusions and GPU initialisation; all off on CPU. ``platform`` defaults to
    ``Platform.detect()`` (pass one to build a GPU layout's config on CPU). ``overrides`` are
    ``TransformerConfig`` fields (e.g. ``tensor_model_parallel_size``, ``params_dtype``,
    ``bf16``, ``pipeline_dtype``, ``recompute_granularity``) and win over everything.
    """
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**transformer_kwargs(hf_config, platform=platform, **overrides)), \
        model_spec(hf_config)


def model_spec(hf_config: Any) -> ModelSpec:
    """What the HF config says that ``TransformerConfig`` does not carry."""
    cfg = hf_config_dict(hf_config)
    desc = describe(cfg)
    return ModelSpec(
        family=desc.family.name,
        vocab_size=desc.dims.vocab,
        max_position_embeddings=desc.max_position_embeddings,
        rotary_base=desc.rope.theta,
        rope_scaling=desc.rope.scaling,
        rope_scaling_factor=desc.rope.factor,
        tie_word_embeddings=desc.tie_word_embeddings,
        hf_config=cfg,
    )


def transformer_kwargs(hf_config: Any, *, platform: Platform | None = None,
                       **overrides) -> dict:
    """The ``TransformerConfig`` keyword arguments ``transformer_config_from_hf`` builds with
    (a pure function of the HF config, the platform, the parallel sizes and ``overrides``:
    tests check a GPU layout's choices on CPU with it, where ``TransformerConfig`` itself would
    refuse e.g. ``apply_rope_fusion`` without Transformer-Engine)."""
    from megatron_dgpo.runtime import parallel

    desc = describe(hf_config_dict(hf_config))
    dims = desc.dims
    platform = Platform.detect() if platform is None else platform

    tp = overrides.get("tensor_model_parallel_size")
    pp = overrides.get("pipeline_model_parallel_size")
    vpp = overrides.get("virtual_pipeline_model_parallel_size")
    cp = overrides.get("context_parallel_size")
    if parallel.parallel_initialized():
        tp = tp or parallel.tensor_parallel_size()
        pp = pp or parallel.pipeline_parallel_size()
        vpp = vpp or parallel.virtual_pipeline_parallel_size()
        cp = cp or parallel.context_parallel_size()
    cp = cp or 1

    dtype = overrides.get("params_dtype", torch.float32)
    moe = moe_kwargs(desc, platform, tp=tp or 1, pp=pp or 1, **overrides) if dims.moe else {}
    kwargs = dict(
        num_layers=dims.layers,
        hidden_size=dims.hidden,
        num_attention_heads=dims.heads,
        num_query_groups=dims.kv_heads,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=desc.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=desc.qkv_bias,
        qk_layernorm=desc.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=desc.attention_dropout,
        init_method_std=desc.init_std,
        tensor_model_parallel_size=tp or 1,
        pipeline_model_parallel_size=pp or 1,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # 0.16 needs it for variable_seq_lengths
        attention_softmax_in_fp32=True,
        attention_backend=_default_attention_backend(platform),
        **transformer_flags(platform, tp or 1),
    )
    if cp > 1 and platform.cuda:
        kwargs["cp_comm_type"] = "p2p"  # Megatron-LM's default: TE's ring attention
    kwargs.update(moe)
    kwargs.update(overrides)
    return kwargs


def _default_attention_backend(platform: Platform):
    """Megatron's ``local`` attention for its local spec (as Megatron-LM pairs
    ``--attention-backend local`` with ``--spec local``), its ``auto`` for the TE spec; the
    trainer passes the backend ``gpu_flags.attention_backend`` chose (``policy.attention_overrides``).
    The backend also sets TE's ``NVTE_*_ATTN`` switches in the process environment
    (``LanguageModule._set_attention_backend``), and Megatron asserts they agree with any value
    already there: a local-spec build leaves what a TE choice made under ``NVTE_FUSED_ATTN=0``
    consistent."""
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend.auto if platform.transformer_engine else AttnBackend.local


MOE_DISPATCHERS = ("alltoall", "allgather", "flex")
"""Megatron's token dispatchers: alltoall (default; any layout), allgather (PP = 1 only: it
needs fixed sequence lengths), flex (DeepEP / HybridEP kernels, GPU only)."""


def moe_kwargs(desc, platform: Platform, *, tp: int, pp: int, **overrides) -> dict:
    """The MoE fields of ``TransformerConfig`` for an MoE description (module docstring).
    Expert-parallel sizes come from Megatron's parallel state when it is initialised."""
    from megatron_dgpo.runtime import parallel

    dims, router = desc.dims, desc.router
    dispatcher = overrides.get("moe_token_dispatcher_type", "alltoall")
    if dispatcher not in MOE_DISPATCHERS:
        raise ValueError(f"model.moe_token_dispatcher must be one of {MOE_DISPATCHERS}, got "
                         f"{dispatcher!r}")
    if dispatcher == "allgather" and pp > 1:
        raise ValueError("model.moe_token_dispatcher 'allgather' needs pipeline_parallel 1 "
                         "(Megatron refuses it with the variable sequence lengths PP uses); "
                         "use 'alltoall'")
    if dispatcher == "flex" and not platform.cuda:
        raise ValueError("model.moe_token_dispatcher 'flex' needs a GPU (DeepEP / HybridEP)")
    # An explicit sequence_parallel is the caller's choice, e.g. the converter's, whose models
    # never run forward: Megatron builds an MoE at TP > 1 without SP and refuses only its
    # training forward (MoELayer.forward).
    if tp > 1 and "sequence_parallel" not in overrides and not sequence_parallel(tp, platform):
        raise ValueError(f"an MoE model at tensor_parallel={tp} needs Megatron's sequence "
                         f"parallelism, which runs here on GPUs with Transformer-Engine only "
                         f"(the local spec's torch norms refuse it): without them use "
                         f"tensor_parallel 1 with expert_parallel and data parallelism")
    coeff = float(overrides.get("moe_aux_loss_coeff", 0.0))
    kwargs = dict(
        num_moe_experts=dims.experts,
        moe_router_topk=dims.topk,
        moe_ffn_hidden_size=dims.moe_ffn,
        moe_router_pre_softmax=not router.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        moe_aux_loss_coeff=coeff,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=platform.transformer_engine,
        # TE's fused token permute / unpermute, as Megatron-LM's MoE recipes enable on GPUs
        moe_permute_fusion=platform.transformer_engine,
        variable_seq_lengths=dispatcher != "allgather",
    )
    if parallel.parallel_initialized():
        kwargs.update(expert_model_parallel_size=parallel.expert_parallel_size(),
                      expert_tensor_parallel_size=parallel.expert_tensor_parallel_size())
    return kwargs


def unwrap_model(model):
    """The ``GPTModel`` inside Megatron's wrappers (``DistributedDataParallel``,
    ``Float16Module``): every wrapper keeps what it wraps in ``.module``; GPTModel has none."""
    while hasattr(model, "module"):
        model = model.module
    return model


def layer_spec(config=None, *, platform: Platform | None = None):
    """TE layer spec with TE and CUDA, Megatron's local RMSNorm spec otherwise; q/k norms and
    experts as ``config`` says."""
    from megatron.core.models.gpt import gpt_layer_specs

    platform = Platform.detect() if platform is None else platform
    shape = dict(num_experts=getattr(config, "num_moe_experts", None),
                 moe_grouped_gemm=bool(getattr(config, "moe_grouped_gemm", False)),
                 qk_layernorm=bool(getattr(config, "qk_layernorm", False)))
    if platform.transformer_engine:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**shape)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **shape)
    # Packed rows reach the local attention as a block-diagonal causal mask (train_step), which
    # the spec's default "causal" type lets Megatron's fused softmax ignore: with
    # masked_softmax_fusion it runs the upper-triangular kernel, and every sample would attend
    # to the ones packed before it. "arbitrary" makes both softmax paths apply the mask.
    from megatron.core.transformer.enums import AttnMaskType

    attention = spec.submodules.self_attention
    attention.params = {**attention.params, "attn_mask_type": AttnMaskType.arbitrary}
    if shape["num_experts"]:
        # The local spec stores the pre-MLP norm under TE's fused name even when it precedes
        # a router (mlp.linear_fc1.layer_norm_weight), the TE spec as pre_mlp_layernorm.weight:
        # keep TE's, so that an MoE checkpoint is the same whichever spec wrote it.
        keys = dict(spec.submodules.sharded_state_dict_keys_map)
        keys.pop("pre_mlp_layernorm.", None)
        spec.submodules.sharded_state_dict_keys_map = keys
    return spec


def build_model(hf_config: Any, *, dtype: torch.dtype = torch.float32, seed: int | None = None,
                platform: Platform | None = None, **overrides) -> list:
    """This rank's model chunks: ``list[GPTModel]``, one per virtual pipeline stage (one w/o VPP).

    Needs Megatron's parallel state initialised (``megatron_dgpo.runtime.parallel.initialize_parallel``);
    TP/PP/VPP sizes are read from it. Each chunk gets ``pre_process`` / ``post_process`` for its
    (virtual) stage, ``vp_stage`` under VPP, ``parallel_output=True`` and the vocabulary padded
    with ``padded_vocab_size(vocab_size, TP)``. Weights are freshly initialised (use the
    converters to load a checkpoint); ``seed`` re-seeds the model-parallel RNG first so every
    TP/PP layout of the same seed starts from ``torch.manual_seed(seed)``.

    Returns chunks on the current CUDA device (GPU) or the CPU; ``chunk.hf_spec`` holds the
    ``ModelSpec`` (HF vocab size, RoPE, tying), ``chunk.config`` the ``TransformerConfig`` and
    ``chunk.transformer_engine`` whether it has TE's layers (packed rows then go in as THD).
    ``platform`` (default ``Platform.detect()``) decides the layer spec and the GPU flags
    (``gpu_flags``); e.g. ``Platform(cuda=True)`` builds the local spec on a GPU.
    """
    from megatron.core.models.gpt import GPTModel

    from megatron_dgpo.runtime import parallel
    from megatron_dgpo.runtime.cpu import apply_cpu_compat, seed_model_parallel_rng

    if not parallel.parallel_initialized():
        raise RuntimeError("Megatron parallel state is not initialised: call "
                           "megatron_dgpo.runtime.parallel.initialize_parallel first")
    apply_cpu_compat()
    if seed is not None:
        seed_model_parallel_rng(seed)
    overrides.setdefault("params_dtype", dtype)
    platform = Platform.detect() if platform is None else platform
    config, spec = transformer_config_from_hf(hf_config, platform=platform, **overrides)
    tp = parallel.tensor_parallel_size()
    vpp = parallel.virtual_pipeline_parallel_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, platform=platform),
            vocab_size=padded_vocab_size(spec.vocab_size, tp),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=parallel.is_first_pipeline_stage(vp_stage=stage),
            post_process=parallel.is_last_pipeline_stage(vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=spec.rotary_base,
            rope_scaling=spec.rope_scaling,
            rope_scaling_factor=spec.rope_scaling_factor,
            vp_stage=stage,
        )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if config.num_moe_experts:
            _experts_in_their_own_optimizer(model)
        model.hf_spec = spec
        # the spec decides how packed rows reach attention (train_step): THD with TE,
        # a block-diagonal mask with the local spec
        model.transformer_engine = platform.transformer_engine
        chunks.append(model)
    return chunks



def _experts_in_their_own_optimizer(model) -> None:
    """Mark routed-expert weights expert-parallel (``allreduce=False``) at EP = 1 too.

    Megatron gives them their own optimizer (a ``ChainedOptimizer`` of dense + experts, whose
    checkpoint keys carry ``chained_0.`` / ``chained_1.``) only when EP > 1; at EP = 1 they join
    the dense one. The optimizer state saved at EP = 2 would then not load at EP = 1 or back.
    With the mark, every EP has the same two optimizers; at EP = 1 the experts' gradients are
    reduced over the expert-DP group, which then is the DP group."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def padded_vocab_of(models: list) -> int:
    """The (TP-padded) vocabulary size the live model was built with."""
    return int(unwrap_model(models[0]).vocab_size)
