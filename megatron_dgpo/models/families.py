"""The model-family registry: one ``Family`` entry per supported HF decoder family.

A family says which HF architectures it covers, its quirks (QKV bias, fields the Megatron
builder cannot honour, the norm-epsilon field, tying default) and its declarative
HF <-> Megatron-Core tensor name map. The builder (``megatron_dgpo.model``), the converter
(``megatron_dgpo.convert``) and the planner (``megatron_dgpo.plan``) all read it through
``megatron_dgpo.models.describe``; adding a family is one entry in ``FAMILIES`` below.

Each ``ParamMap`` ties one Megatron tensor to the HF tensor(s) it is made of and names the
transform between them (``transforms.py``). Names on the Megatron side are the
*distributed-checkpoint keys* of Megatron-Core 0.16 (identical for the local and the
Transformer-Engine layer specs): per-layer tensors live under ``decoder.layers.<suffix>`` with a
leading layer axis in the checkpoint, and the fused-norm (TE) names are used for the layer norms.
A live model's parameter names are mapped onto these keys by ``megatron_param_key``:

    local spec                               TE spec / checkpoint key
    decoder.layers.{i}.input_layernorm.weight    decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight
    decoder.layers.{i}.pre_mlp_layernorm.weight  decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight

``{i}`` in a live model is the layer index *within its (virtual) pipeline chunk*; the global HF
layer number is ``chunk.decoder.layers[i].layer_number - 1``.

Transform kinds (``kind``):
    copy     one HF tensor, same layout
    vocab    one HF tensor [V, H]; Megatron pads rows to the padded vocabulary [V_pad, H]
    qkv      (q, k, v) -> rows interleaved per query group [q_g0, k_g0, v_g0, q_g1, ...]
    gate_up  (gate, up) -> [gate; up] rows (each TP rank holds [gate_shard; up_shard])

``tp_axis``: the axis Megatron splits across tensor-parallel ranks (None: replicated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

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

    def key(self) -> str:
        """Distributed-checkpoint key (``decoder.layers.`` + suffix for per-layer tensors)."""
        return LAYER_PREFIX + self.megatron if self.per_layer else self.megatron

    def hf_names(self, layer: int | None = None) -> tuple[str, ...]:
        return tuple(name.format(i=layer) for name in self.hf)


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
    params: tuple[ParamMap, ...] = ()
    """HF <-> Megatron tensor map; empty: the Llama-style decoder (``_decoder_params``)."""

    def __post_init__(self):
        if not self.params:
            object.__setattr__(self, "params", _decoder_params(self.qkv_bias))

    def active(self, cfg: dict) -> tuple[ParamMap, ...]:
        """The maps that exist for this HF config."""
        return tuple(p for p in self.params if p.enabled(cfg))


def _untied(cfg: dict) -> bool:
    return not cfg.get("tie_word_embeddings", False)


def _decoder_params(qkv_bias: Callable[[dict], bool]) -> tuple[ParamMap, ...]:
    """The Llama-style decoder's tensor map (Qwen2, Llama); families differ in the QKV bias."""
    layer = "model.layers.{i}."
    attn = layer + "self_attn."
    mlp = layer + "mlp."
    return (
        ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0),
        ParamMap("self_attention.linear_qkv.layer_norm_weight", (layer + "input_layernorm.weight",),
                 "copy", None, per_layer=True, local_name="input_layernorm.weight"),
        ParamMap("self_attention.linear_qkv.weight",
                 (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                 "qkv", 0, per_layer=True),
        ParamMap("self_attention.linear_qkv.bias",
                 (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                 "qkv", 0, per_layer=True, enabled=qkv_bias),
        ParamMap("self_attention.linear_proj.weight", (attn + "o_proj.weight",), "copy", 1,
                 per_layer=True),
        ParamMap("mlp.linear_fc1.layer_norm_weight", (layer + "post_attention_layernorm.weight",),
                 "copy", None, per_layer=True, local_name="pre_mlp_layernorm.weight"),
        ParamMap("mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                 "gate_up", 0, per_layer=True),
        ParamMap("mlp.linear_fc2.weight", (mlp + "down_proj.weight",), "copy", 1, per_layer=True),
        ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None),
        ParamMap("output_layer.weight", ("lm_head.weight",), "vocab", 0, enabled=_untied),
    )


QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=lambda cfg: True)
# transformers' Llama ``attention_bias`` biases o_proj as well as q/k/v: Megatron's add_qkv_bias
# covers only the latter (and add_bias_linear would add MLP biases too), so it is refused.
LLAMA = Family("llama", ("LlamaForCausalLM",), qkv_bias=lambda cfg: False,
               refused_fields=("attention_bias", "mlp_bias"))
FAMILIES = {f.name: f for f in (QWEN2, LLAMA)}


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


def megatron_param_key(family: Family, name: str) -> tuple[ParamMap, int | None] | None:
    """(map, local layer index or None) for a live model's parameter name, local or TE spec.

    ``None`` for names that carry no weights (``_extra_state``) or are not in the family map.
    """
    match = _LOCAL_LAYER_RE.match(name)
    for pm in family.params:
        if match and pm.per_layer:
            if match.group(2) in (pm.megatron, pm.local_name):
                return pm, int(match.group(1))
        elif not match and not pm.per_layer and name == pm.megatron:
            return pm, None
    return None
