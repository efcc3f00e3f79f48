"""The model-family registry: one ``Family`` per supported HF decoder family (architectures, quirks,
its HF <-> Megatron-Core tensor map of ``ParamMap``s); ``FAMILIES``, ``family_for``,
``megatron_param_key`` (a live parameter -> map, layer, expert), ``iter_params`` and
``fused_groups`` (the export order). The map's conventions:
docs/training.md#checkpoint-conversion."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Sequence

LAYER_PREFIX = "decoder.layers."


@dataclass(frozen=True)
class ParamMap:
    """One Megatron tensor and the HF tensors it is made of."""

    megatron: str
    """Checkpoint key; per-layer keys are the suffix after ``decoder.layers.``."""
    hf: tuple[str, ...]
    """HF names; per-layer ones contain ``{i}`` (the global layer number)."""
    kind: str
    tp_axis: int | None
    per_layer: bool = False
    local_name: str | None = None
    """Local-spec parameter suffix when it differs from the TE/checkpoint name."""
    enabled: Callable[[dict], bool] = lambda cfg: True
    """Whether this tensor exists for an HF config (biases, untied lm_head)."""
    expert: bool = False
    """One tensor per routed expert: HF names contain ``{e}``; the layer's Megatron tensor is
    the experts stacked, [E, *per-expert shape] (the checkpoint's [L, E, ...] minus the layer
    axis), and ``kind`` / ``tp_axis`` describe one expert's tensor (expert TP splits it)."""
    fused: str | None = None
    """The module this tensor is fused into with the other maps of its layer that carry the
    same name (q/k/v weights and biases: ``qkv``; gate/up: ``gate_up``; a layer's routed
    experts: ``experts``), as Megatron and vLLM both hold them: an engine reloads such a
    group whole or not at all (``fused_groups``). None: a tensor of its own."""

    def key(self) -> str:
        """Distributed-checkpoint key (``decoder.layers.`` + suffix for per-layer tensors)."""
        return LAYER_PREFIX + self.megatron if self.per_layer else self.megatron

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> tuple[str, ...]:
        """HF names of one tensor (for an expert map: of expert ``expert``)."""
        return tuple(name.format(i=layer, e=expert) for name in self.hf)


@dataclass(frozen=True)
class Family:
    """One HF decoder family, its quirks and its tensor map."""

    name: str
    """HF ``model_type``."""
    architectures: tuple[str, ...]
    """HF ``architectures`` entries that mean this family."""
    qkv_bias: Callable[[dict], bool]
    """Whether the Q, K, V projections carry biases, for an HF config."""
    refused_fields: tuple[str, ...] = ()
    """HF fields the builder cannot honour: a truthy value is refused (e.g. Llama's mlp_bias)."""
    norm_eps_field: str = "rms_norm_eps"
    """HF field of the RMSNorm epsilon."""
    tied_by_default: bool = False
    """``tie_word_embeddings`` when the config omits it (the family's config class default)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head (Qwen3's q_norm / k_norm)."""
    moe: bool = False
    """Every layer's MLP is a router and routed experts (Qwen3-MoE)."""
    params: tuple[ParamMap, ...] = ()
    """HF <-> Megatron tensor map; empty: the Llama-style decoder (``_decoder_params``)."""

    def __post_init__(self):
        if not self.params:
            object.__setattr__(self, "params", _decoder_params(self.qkv_bias, self.qk_norm,
                                                               self.moe))

    def active(self, cfg: dict) -> tuple[ParamMap, ...]:
        """The maps that exist for this HF config."""
        return tuple(p for p in self.params if p.enabled(cfg))


def _untied(cfg: dict) -> bool:
    return not cfg.get("tie_word_embeddings", False)


_LAYER = "model.layers.{i}."


def _attention(qkv_bias: Callable[[dict], bool], qk_norm: bool) -> tuple[ParamMap, ...]:
    attn = _LAYER + "self_attn."
    maps = (
        ParamMap("self_attention.linear_qkv.layer_norm_weight",
                 (_LAYER + "input_layernorm.weight",), "copy", None, per_layer=True,
                 local_name="input_layernorm.weight"),
        ParamMap("self_attention.linear_qkv.weight",
                 (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                 "qkv", 0, per_layer=True, fused="qkv"),
        ParamMap("self_attention.linear_qkv.bias",
                 (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                 "qkv", 0, per_layer=True, enabled=qkv_bias, fused="qkv"),
    )
    if qk_norm:  # one [head_dim] weight shared by all heads: replicated over TP
        maps += (ParamMap("self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "copy",
                          None, per_layer=True),
                 ParamMap("self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "copy",
                          None, per_layer=True))
    return maps + (ParamMap("self_attention.linear_proj.weight", (attn + "o_proj.weight",),
                            "copy", 1, per_layer=True),)


def _dense_mlp() -> tuple[ParamMap, ...]:
    mlp = _LAYER + "mlp."
    return (
        ParamMap("mlp.linear_fc1.layer_norm_weight", (_LAYER + "post_attention_layernorm.weight",),
                 "copy", None, per_layer=True, local_name="pre_mlp_layernorm.weight"),
        ParamMap("mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                 "gate_up", 0, per_layer=True, fused="gate_up"),
        ParamMap("mlp.linear_fc2.weight", (mlp + "down_proj.weight",), "copy", 1, per_layer=True),
    )


def _moe_mlp() -> tuple[ParamMap, ...]:
    """Router + routed experts. The norm before an MoE MLP is never fused into a linear layer,
    so its name is the same for the local and the TE spec."""
    expert = _LAYER + "mlp.experts.{e}."
    return (
        ParamMap("pre_mlp_layernorm.weight", (_LAYER + "post_attention_layernorm.weight",),
                 "copy", None, per_layer=True),
        ParamMap("mlp.router.weight", (_LAYER + "mlp.gate.weight",), "copy", None,
                 per_layer=True),
        ParamMap("mlp.experts.experts.linear_fc1.weight",
                 (expert + "gate_proj.weight", expert + "up_proj.weight"), "gate_up", 0,
                 per_layer=True, expert=True, fused="experts"),
        ParamMap("mlp.experts.experts.linear_fc2.weight", (expert + "down_proj.weight",), "copy",
                 1, per_layer=True, expert=True, fused="experts"),
    )


def _decoder_params(qkv_bias: Callable[[dict], bool], qk_norm: bool = False,
                    moe: bool = False) -> tuple[ParamMap, ...]:
    """The Llama-style decoder's tensor map: families differ in the QKV bias, Qwen3's q/k
    norms and the MLP (dense SwiGLU or router + experts)."""
    return (
        (ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0),)
        + _attention(qkv_bias, qk_norm) + (_moe_mlp() if moe else _dense_mlp())
        + (ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None),
           ParamMap("output_layer.weight", ("lm_head.weight",), "vocab", 0, enabled=_untied)))


QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=lambda cfg: True)
# transformers' Llama ``attention_bias`` biases o_proj as well as q/k/v: Megatron's add_qkv_bias
# covers only the latter (and add_bias_linear would add MLP biases too), so it is refused.
LLAMA = Family("llama", ("LlamaForCausalLM",), qkv_bias=lambda cfg: False,
               refused_fields=("attention_bias", "mlp_bias"))
# Qwen3's attention_bias, like Llama's, would bias o_proj too; its released models have none.
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), qkv_bias=lambda cfg: False,
               refused_fields=("attention_bias",), qk_norm=True)
QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), qkv_bias=lambda cfg: False,
                   refused_fields=("attention_bias",), qk_norm=True, moe=True)
FAMILIES = {f.name: f for f in (QWEN2, LLAMA, QWEN3, QWEN3_MOE)}


def iter_params(params: Sequence[ParamMap], num_layers: int):
    """(map, global layer) in HF order: embeddings, layer 0 .. L-1, final norm, lm_head."""
    for pm in params:
        if not pm.per_layer and pm.megatron.startswith("embedding"):
            yield pm, None
    for layer in range(num_layers):
        for pm in params:
            if pm.per_layer:
                yield pm, layer
    for pm in params:
        if not pm.per_layer and not pm.megatron.startswith("embedding"):
            yield pm, None


def fused_groups(params: Sequence[ParamMap], num_layers: int
                 ) -> Iterator[list[tuple[ParamMap, int | None]]]:
    """``iter_params``' (map, layer) pairs as an engine must reload them: one layer's maps that
    share a ``fused`` name together, at the first one's place; every other map alone."""
    order = list(iter_params(params, num_layers))
    members: dict[tuple, list] = {}
    for pm, layer in order:
        if pm.fused is not None:
            members.setdefault((layer, pm.fused), []).append((pm, layer))
    for pm, layer in order:
        if pm.fused is None:
            yield [(pm, layer)]
        elif members[(layer, pm.fused)][0][0] is pm:
            yield members[(layer, pm.fused)]


def supported_architectures() -> str:
    return ", ".join(f"{f.name} ({', '.join(f.architectures)})" for f in FAMILIES.values())


def family_for(cfg: dict) -> Family:
    """The family of an HF config dict; ``ValueError`` listing the supported ones otherwise."""
    model_type = cfg.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    archs = cfg.get("architectures") or []
    for family in FAMILIES.values():
        if any(a in family.architectures for a in archs):
            return family
    raise ValueError(f"unsupported architecture: model_type={model_type!r}, architectures="
                     f"{archs!r}; supported model_type (architectures): "
                     f"{supported_architectures()}")


_LOCAL_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# A live expert's name -> (its map's checkpoint suffix, local expert index): SequentialMLP
# (local spec) numbers experts in the module path, TEGroupedMLP (GPU) in the parameter name.
_LIVE_EXPERT_RES = (re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$"),
                    re.compile(r"^mlp\.experts\.(linear_fc[12]\.weight)(\d+)$"))


class LiveParam(NamedTuple):
    """Where a live model's parameter sits in the family map."""

    map: ParamMap
    layer: int | None
    """Layer index within its (virtual) pipeline chunk; None for non-layer tensors."""
    expert: int | None = None
    """Local expert index on this expert-parallel rank; None for non-expert tensors."""


def _live_expert(suffix: str) -> tuple[str, int] | None:
    sequential, grouped = (pattern.match(suffix) for pattern in _LIVE_EXPERT_RES)
    if sequential:
        return "mlp.experts.experts." + sequential.group(2), int(sequential.group(1))
    if grouped:
        return "mlp.experts.experts." + grouped.group(1), int(grouped.group(2))
    return None


def megatron_param_key(family: Family, name: str) -> LiveParam | None:
    """Where a live model's parameter name (local or TE spec) sits in the family map.

    ``None`` for names that carry no weights (``_extra_state``) or are not in the family map.
    """
    match = _LOCAL_LAYER_RE.match(name)
    suffix, expert = (match.group(2), None) if match else (None, None)
    if match and family.moe and (found := _live_expert(suffix)) is not None:
        suffix, expert = found
    for pm in family.params:
        if match and pm.per_layer:
            if suffix in (pm.megatron, pm.local_name):
                return LiveParam(pm, int(match.group(1)), expert)
        elif not match and not pm.per_layer and name == pm.megatron:
            return LiveParam(pm, None)
    return None
