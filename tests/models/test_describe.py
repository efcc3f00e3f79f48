"""One model description: the family registry (megatron_dgpo.models) gives the model builder,
the converter and the planner the same dimensions and quirks, for the tiny test configs and
the paper's published configs, checked against transformers' own model of each config (built
on the meta device: names, shapes and parameter counts without allocating weights). A family
added to the registry alone (a Mistral-like entry) reaches all three."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_dgpo.convert.hf_source import iter_params
from megatron_dgpo.convert.transforms import hf_tensors, megatron_shape
from megatron_dgpo.models import FAMILIES, Family, describe
from megatron_dgpo.models.builder import transformer_config_from_hf
from megatron_dgpo.planner.catalogue import PUBLISHED_CONFIGS
from megatron_dgpo.planner.inputs import PlannedModel
from megatron_dgpo.planner.parameters import padded_vocab, param_count
from tests._rank_fns_model import TINY_QWEN2

TINY_LLAMA_GQA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=300,
                      hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      attention_bias=False, tie_word_embeddings=True)
# head_dim 64 != hidden / heads on purpose (as Qwen3-32B's 128 != 5120 / 64)
TINY_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=300,
                  hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  attention_bias=False, tie_word_embeddings=False)
TINY_QWEN3_MOE = dict(TINY_QWEN3, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
CONFIGS = {"tiny_qwen2": TINY_QWEN2, "tiny_qwen2_tied": dict(TINY_QWEN2, tie_word_embeddings=True),
           "tiny_llama_gqa_head_dim": TINY_LLAMA_GQA, "tiny_qwen3": TINY_QWEN3,
           "tiny_qwen3_tied": dict(TINY_QWEN3, tie_word_embeddings=True),
           "tiny_qwen3_moe": TINY_QWEN3_MOE}
for _hub_id in ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
                "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", "meta-llama/Llama-3.1-70B",
                "Qwen/Qwen3-8B", "Qwen/Qwen3-32B"):
    CONFIGS[_hub_id] = PUBLISHED_CONFIGS[_hub_id]


def _transformers_model(cfg: dict, device: str = "meta"):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"],
                                                                     **fields))


def _transformers_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of transformers' model of ``cfg`` as its checkpoint holds them
    (tied weights once). Dense models: the parameters of the model built on the meta device.
    MoE models: transformers 5 holds each layer's experts fused in memory
    (``mlp.experts.gate_up_proj`` [E, 2 f_e, h]) but ``save_pretrained`` writes them one per
    expert, the names the converter reads and writes: so the (tiny) model is saved and the
    safetensors headers are read."""
    if cfg["model_type"] != "qwen3_moe":
        return {name: tuple(p.shape) for name, p in _transformers_model(cfg).named_parameters()}
    import tempfile

    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as folder:
        _transformers_model(cfg, "cpu").save_pretrained(folder)
        shapes = {}
        for file in sorted(os.listdir(folder)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(folder, file), "pt") as handle:
                    shapes.update({name: tuple(handle.get_slice(name).get_shape())
                                   for name in handle.keys()})
    return shapes


@pytest.mark.parametrize("hub_id", ["Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B"])
def test_planner_counts_published_moe_models_as_transformers_does(hub_id):
    """The published MoE configs: the planner's count (router, every expert, q/k norms) equals
    the parameters of transformers' model of the config (meta device: fused experts, same
    count), and the model card's size."""
    cfg = PUBLISHED_CONFIGS[hub_id]
    ours = param_count(PlannedModel.from_hf_config(cfg).description)
    assert ours == sum(p.numel() for p in _transformers_model(cfg).parameters())
    assert f"{ours / 1e9:.1f}" == {"Qwen/Qwen3-30B-A3B": "30.5",
                                   "Qwen/Qwen3-235B-A22B": "235.1"}[hub_id]


def _check_one_description(cfg: dict, tp: int = 2) -> None:
    desc = describe(cfg, tp=tp)
    d = desc.dims
    # the builder
    tc, spec = transformer_config_from_hf(cfg)
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads, tc.num_query_groups,
            tc.kv_channels, tc.ffn_hidden_size) == (d.layers, d.hidden, d.heads, d.kv_heads,
                                                    d.head_dim, d.ffn)
    assert tc.add_qkv_bias == desc.qkv_bias and not tc.add_bias_linear
    assert (spec.family, spec.vocab_size, spec.tie_word_embeddings) == \
        (desc.family.name, d.vocab, desc.tie_word_embeddings)
    # the planner holds this very description (read at TP 1: it pads the vocabulary per layout)
    planned = PlannedModel.from_hf_config(cfg).description
    assert planned == describe(cfg)
    assert padded_vocab(d.vocab, tp) == d.padded_vocab
    # the converter's HF side against transformers' own model of the config
    reference = _transformers_shapes(cfg)
    params = desc.family.active(cfg)
    ours = {name: shape for pm, layer in iter_params(params, d.layers)
            for name, shape in hf_tensors(pm, layer, d)}
    assert ours == reference
    assert param_count(planned) == sum(torch.Size(s).numel() for s in reference.values())
    # the converter's Megatron side against the planner's count at the padded vocabulary
    megatron = sum(torch.Size(megatron_shape(pm, d)).numel() * (d.layers if pm.per_layer else 1)
                   for pm in params)
    assert megatron == param_count(planned, vocab_rows=d.padded_vocab)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_builder_converter_and_planner_read_one_description(name):
    _check_one_description(CONFIGS[name])


def test_a_refused_quirk_is_refused_by_all_readers():
    """Llama's attention_bias also biases o_proj (transformers), which Megatron's QKV bias
    does not cover: builder, converter (via describe) and planner all refuse it."""
    assert "model.layers.0.self_attn.o_proj.bias" in _transformers_shapes(
        dict(TINY_LLAMA_GQA, attention_bias=True))
    for reader in (describe, transformer_config_from_hf, PlannedModel.from_hf_config):
        with pytest.raises(ValueError, match="attention_bias=True is not supported"):
            reader(dict(TINY_LLAMA_GQA, attention_bias=True))


def test_a_family_is_one_registry_entry(monkeypatch):
    """A Mistral-like family registered in FAMILIES only: the builder, the converter and the
    planner all accept it and agree with transformers' MistralForCausalLM; its refused field
    is refused by all three."""
    mistral = Family("mistral", ("MistralForCausalLM",), qkv_bias=lambda cfg: False,
                     refused_fields=("sliding_window",))
    monkeypatch.setitem(FAMILIES, "mistral", mistral)
    cfg = dict(model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=300,
               hidden_size=128, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
               tie_word_embeddings=False)
    _check_one_description(cfg)
    windowed = dict(cfg, sliding_window=4096)
    for reader in (describe, transformer_config_from_hf, PlannedModel.from_hf_config):
        with pytest.raises(ValueError, match="sliding_window=4096 is not supported"):
            reader(windowed)
    monkeypatch.delitem(FAMILIES, "mistral")
    with pytest.raises(ValueError, match="unsupported architecture: model_type='mistral'"):
        describe(cfg)
