"""HF ``config.json`` -> one ``ModelDescription``: family, dimensions, RoPE, norm, tying, an MoE's
router. The only place that reads an HF config's architecture fields; pure Python (the planner
imports it). The field mapping and what is refused:
docs/training.md#the-model-an-hf-config-on-megatron-core, docs/moe.md for MoE fields."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from megatron_dgpo.models.families import Family, family_for, fused_groups

T = TypeVar("T")

VOCAB_DIVISOR = 128
"""Megatron's default ``--make-vocab-size-divisible-by``."""
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
"""The Llama-3 RoPE-scaling constants Megatron-Core 0.16 hard-codes (only ``factor`` is free)."""


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISOR) -> int:
    """Smallest multiple of ``divisible_by * tp`` that is >= ``vocab_size`` (Megatron's rule)."""
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"vocab_size, tp and divisible_by must be positive, got "
                         f"{vocab_size}, {tp}, {divisible_by}")
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def hf_config_dict(hf_config: Any) -> dict:
    """A plain dict from a transformers ``PretrainedConfig``, a dict, a config.json or its folder."""
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.fspath(hf_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"hf_config must be a PretrainedConfig, a dict or a path to config.json, got "
                    f"{type(hf_config).__name__}")


@dataclass(frozen=True)
class ModelDims:
    """Tensor dimensions of a dense decoder (Megatron names in parentheses)."""

    hidden: int
    """h (hidden_size)."""
    layers: int
    """L (num_layers)."""
    heads: int
    """a, query heads (num_attention_heads)."""
    kv_heads: int
    """g, KV groups (num_query_groups); g = a without GQA."""
    head_dim: int
    """d (kv_channels)."""
    ffn: int
    """f, SwiGLU width (ffn_hidden_size): fc1 is [2f, h], fc2 [h, f]."""
    vocab: int
    """V as the HF config states it."""
    padded_vocab: int
    """Rows of the embedding / output layer: ``padded_vocab_size(V, TP)`` or as stored."""
    experts: int = 0
    """E, routed experts per MoE layer (num_moe_experts); 0 for a dense model."""
    moe_ffn: int = 0
    """Each expert's SwiGLU width (moe_ffn_hidden_size): its fc1 is [2 moe_ffn, h]."""
    topk: int = 0
    """Experts each token is routed to (moe_router_topk)."""

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def q_dim(self) -> int:
        """a d: the width of Q (= h for the Qwen2 and Llama models, not for every Qwen3)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """g d: the width of K (and of V)."""
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: bool
    """Llama-3 RoPE scaling on (Megatron's ``rope_scaling``)."""
    factor: float
    """Megatron's ``rope_scaling_factor`` (1.0 without scaling)."""


@dataclass(frozen=True)
class Router:
    """How an MoE model's router turns logits into expert weights (HF semantics)."""

    norm_topk_prob: bool
    """True: softmax over all experts, keep the top k, renormalise them to sum 1 (equivalently
    a softmax over the top-k logits: Megatron's ``moe_router_pre_softmax=False``); False: keep
    the top-k softmax probabilities as they are (``moe_router_pre_softmax=True``)."""
    hf_aux_loss_coef: float
    """HF's ``router_aux_loss_coef`` (pre-training's load-balancing loss weight). Not applied
    here by default: RL fine-tuning runs without it (``model.moe_aux_loss_coeff``)."""


@dataclass(frozen=True)
class ModelDescription:
    """Everything the builder, converter and planner need to know about one HF config."""

    family: Family
    dims: ModelDims
    qkv_bias: bool
    tie_word_embeddings: bool
    rope: Rope
    norm_eps: float
    max_position_embeddings: int
    init_std: float
    attention_dropout: float
    qk_norm: bool = False
    """RMSNorm over each query / key head before RoPE (Qwen3: q_norm, k_norm [head_dim])."""
    router: Router | None = None
    """The MoE router's semantics; None for a dense model."""


def _require(cfg: dict, key: str) -> int:
    if cfg.get(key) is None:
        raise ValueError(f"HF config lacks the field {key!r}")
    return int(cfg[key])


def rope_of(cfg: dict) -> Rope:
    """RoPE from legacy (``rope_theta``, ``rope_scaling``) or transformers>=5
    (``rope_parameters``) fields; ``ValueError`` on a scaling Megatron-Core cannot reproduce."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or scaling.get("rope_type") \
        or scaling.get("type") or "default"
    fields = {**scaling, **params}
    if rope_type == "default":
        return Rope(theta, False, 1.0)
    if rope_type == "llama3":
        for key, value in _LLAMA3_ROPE.items():
            if key in fields and float(fields[key]) != value:
                raise ValueError(f"rope_scaling.{key}={fields[key]!r} is not supported: "
                                 f"Megatron-Core's llama3 RoPE scaling fixes it to {value}")
        return Rope(theta, True, float(fields.get("factor", 8.0)))
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}: supported are 'default' "
                     f"(none) and 'llama3'")


def describe(hf_config: Any, *, tp: int = 1, padded_vocab: int | None = None) -> ModelDescription:
    """The model an HF config describes (``padded_vocab`` default ``padded_vocab_size(vocab_size,
    tp)``); ``ValueError`` naming the field on anything the builder cannot reproduce."""
    cfg = hf_config_dict(hf_config)
    family = family_for(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (silu only)")
    for key in ("use_sliding_window",) + family.refused_fields:
        if cfg.get(key):
            raise ValueError(f"{key}={cfg[key]!r} is not supported")
    moe = _moe_of(cfg, family) if family.moe else None
    hidden = _require(cfg, "hidden_size")
    heads = _require(cfg, "num_attention_heads")
    vocab = _require(cfg, "vocab_size")
    dims = ModelDims(
        hidden=hidden, layers=_require(cfg, "num_hidden_layers"), heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn=_require(cfg, "intermediate_size"), vocab=vocab,
        padded_vocab=int(padded_vocab or padded_vocab_size(vocab, tp)),
        **(moe[0] if moe else {}))
    return ModelDescription(
        family=family, dims=dims, qkv_bias=family.qkv_bias(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tied_by_default)),
        rope=rope_of(cfg), norm_eps=float(cfg.get(family.norm_eps_field, 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        init_std=float(cfg.get("initializer_range", 0.02)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        qk_norm=family.qk_norm, router=moe[1] if moe else None)


def _moe_of(cfg: dict, family: Family) -> tuple[dict, Router]:
    """(MoE fields of ``ModelDims``, ``Router``) of an MoE family's config; errors name the
    field."""
    if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
        raise ValueError(f"decoder_sparse_step={cfg.get('decoder_sparse_step')!r} / "
                         f"mlp_only_layers={cfg.get('mlp_only_layers')!r} is not supported: "
                         f"every layer must be an MoE layer (decoder_sparse_step 1, "
                         f"mlp_only_layers [])")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(f"shared_expert_intermediate_size="
                         f"{cfg['shared_expert_intermediate_size']!r} is not supported "
                         f"({family.name} has no shared expert)")
    # transformers 5 writes num_local_experts (its attribute map's name); released configs
    # (Qwen3-30B-A3B) say num_experts
    experts_field = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    experts, topk = _require(cfg, experts_field), _require(cfg, "num_experts_per_tok")
    if not 1 <= topk <= experts:
        raise ValueError(f"num_experts_per_tok={topk} must be between 1 and num_experts="
                         f"{experts}")
    dims = dict(experts=experts, topk=topk, moe_ffn=_require(cfg, "moe_intermediate_size"))
    return dims, Router(norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                        hf_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)))


def group_hf_tensors(hf_config: Any, tensors: Mapping[str, T]) -> list[list[tuple[str, T]]]:
    """``tensors`` (HF name -> tensor of ``hf_config``'s model) in the groups a live export yields:
    one list per ``families.fused_groups`` group, in export order, absent names left out. Raises
    ``KeyError`` naming a tensor the family map does not know."""
    description = describe(hf_config)
    cfg, dims = hf_config_dict(hf_config), description.dims
    groups, known = [], set()
    for members in fused_groups(description.family.active(cfg), dims.layers):
        names = [name for pm, layer in members
                 for e in (range(dims.experts) if pm.expert else (None,))
                 for name in pm.hf_names(layer, e)]
        known.update(names)
        if group := [(name, tensors[name]) for name in names if name in tensors]:
            groups.append(group)
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise KeyError(f"{unknown[0]!r} ({len(unknown)} tensors) is not in the "
                       f"{description.family.name!r} family's tensor map")
    return groups
