"""Megatron-Core ``GPTModel`` chunks from an HF config of a registered family, read once by
``models.describe``: its ``TransformerConfig`` and layer spec (TE's with Transformer-Engine and
CUDA, else Megatron's local RMSNorm spec). How each field maps, the specs' parameter names and the
MoE settings: docs/training.md#the-model-an-hf-config-on-megatron-core and docs/moe.md."""

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
    """``(TransformerConfig, ModelSpec)`` for an HF config of a family in ``FAMILIES``: RL's
    defaults and the machine's flags (``gpu_flags.transformer_flags`` on ``platform``, default
    ``Platform.detect()``; pass one to build a GPU layout's config on CPU), ``overrides``
    (``TransformerConfig`` fields) over everything. Raises ``ValueError`` on what it cannot
    build."""
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
    """``transformer_config_from_hf``'s keyword arguments, a pure function of its inputs and the
    parallel sizes (tests check GPU layouts on CPU with it, where ``TransformerConfig`` would
    refuse)."""
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
    """Megatron's ``local`` attention for the local spec, ``auto`` for TE's; the trainer overrides
    it (docs/training.md#the-model-an-hf-config-on-megatron-core)."""
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend.auto if platform.transformer_engine else AttnBackend.local


MOE_DISPATCHERS = ("alltoall", "allgather", "flex")
"""Megatron's token dispatchers: alltoall (default; any layout), allgather (PP = 1 only: it
needs fixed sequence lengths), flex (DeepEP / HybridEP kernels, GPU only)."""


def moe_kwargs(desc, platform: Platform, *, tp: int, pp: int, **overrides) -> dict:
    """The MoE fields of ``TransformerConfig`` for an MoE description (docs/moe.md), EP sizes from
    Megatron's parallel state when initialised. Raises ``ValueError`` naming
    ``model.moe_token_dispatcher`` or TP where the layout cannot run."""
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
    """The ``GPTModel`` inside Megatron's wrappers (each keeps what it wraps in ``.module``)."""
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
    """This rank's model chunks, ``list[GPTModel]``, one per virtual pipeline stage, freshly
    initialised on the current CUDA device or the CPU. Needs Megatron's parallel state (TP/PP/VPP;
    ``RuntimeError`` otherwise). ``seed`` re-seeds the model-parallel RNG first (every layout of one
    seed starts alike); ``platform`` (default ``Platform.detect()``) decides spec and flags. Each
    chunk carries ``hf_spec`` (``ModelSpec``), ``config`` and ``transformer_engine`` (THD input)."""
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
    """Mark routed-expert weights expert-parallel (``allreduce=False``) at EP = 1 too, so that every
    EP has the same two chained optimizers (why: docs/moe.md, "Optimizer and checkpoints")."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def padded_vocab_of(models: list) -> int:
    """The (TP-padded) vocabulary size the live model was built with."""
    return int(unwrap_model(models[0]).vocab_size)
