"""Helpers and rank functions for the Megatron model tests (run on gloo ranks).

Weights are copied from a transformers Qwen2/Llama model by hand here, independently of the
project's converters, so that the tests check the builder against transformers' own model.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

TINY_QWEN2 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=300,
                  hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
                  tie_word_embeddings=False)


def hf_model(cfg: dict, seed: int = 0):
    """A transformers CausalLM of ``cfg`` with random float32 weights (biases non-zero)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**cfg)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # HF inits them to 0 / 1: perturb
                param.add_(0.1 * torch.randn_like(param))
    return model.float().eval()


def hf_to_megatron_full(hf_state: dict, cfg: dict) -> dict:
    """Megatron (local spec, TP1/PP1, unpadded vocab, global layer index) names -> tensors."""
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["hidden_size"] // heads
    per_group = heads // groups
    out = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_state["model.norm.weight"]}
    if not cfg.get("tie_word_embeddings"):
        out["output_layer.weight"] = hf_state["lm_head.weight"]

    def interleave(q, k, v):
        q = q.reshape(groups, per_group * dim, *q.shape[1:])
        k = k.reshape(groups, dim, *k.shape[1:])
        v = v.reshape(groups, dim, *v.shape[1:])
        return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])

    for i in range(cfg["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mg + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            names = [f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if all(n in hf_state for n in names):
                out[mg + f"self_attention.linear_qkv.{kind}"] = interleave(
                    *(hf_state[n] for n in names))
        out[mg + "self_attention.linear_proj.weight"] = hf_state[hf + "self_attn.o_proj.weight"]
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]])
        out[mg + "mlp.linear_fc2.weight"] = hf_state[hf + "mlp.down_proj.weight"]
    return out


def global_name(model, name: str) -> str:
    """``decoder.layers.{local}.`` -> ``decoder.layers.{global}.`` using the layer's number."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not match:
        return name
    layer = model.decoder.layers[int(match.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"


def _is_vocab(name: str) -> bool:
    return name in ("embedding.word_embeddings.weight", "output_layer.weight")


def _tp():
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def shard_tensor(name: str, full: torch.Tensor, param) -> torch.Tensor:
    """This TP rank's slice of ``full`` for ``param`` (pads vocab rows with zeros first)."""
    rank, size = _tp()
    if _is_vocab(name):
        rows = param.shape[0] * size
        full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):  # [gate; up]: each half is split separately
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=dim)[rank]


def gather_tensor(name: str, local: torch.Tensor, param, vocab_size: int) -> torch.Tensor:
    """Inverse of ``shard_tensor``: full-shape tensor (vocab rows cut to ``vocab_size``)."""
    from megatron.core import parallel_state as ps

    rank, size = _tp()
    if getattr(param, "tensor_model_parallel", False) and size > 1:
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        if name.endswith("linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            local = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            local = torch.cat(parts, dim=param.partition_dim)
    if _is_vocab(name):
        local = local[:vocab_size]
    return local


def load_full_state(chunks, full: dict) -> None:
    """Copy a full TP1/PP1 state (``hf_to_megatron_full``) into this rank's model chunks."""
    with torch.no_grad():
        for chunk in chunks:
            module = getattr(chunk, "module", chunk)
            for name, param in module.named_parameters():
                gname = global_name(module, name)
                if gname == "output_layer.weight" and gname not in full:  # tied, last stage
                    gname = "embedding.word_embeddings.weight"
                param.copy_(shard_tensor(gname, full[gname], param))


def causal_mask(seq: int) -> torch.Tensor:
    """[1, 1, S, S] bool, True where attention is masked (Megatron's convention)."""
    return torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]


def parity_fn(rank, world_size):
    """Megatron logits vs transformers' logits, TP=2 then TP=1 (DP=2), tied and untied."""
    from megatron.core import parallel_state as ps

    from megatron_dgpo.models.builder import (build_model, padded_vocab_size,
                                              transformer_config_from_hf)
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    results = {}
    torch.manual_seed(1)
    tokens = torch.randint(0, TINY_QWEN2["vocab_size"], (2, 24))
    positions = torch.arange(24).expand(2, -1)
    for tp in (2, 1):
        initialize_parallel(ParallelConfig(tensor_parallel=tp), seed=3)
        for tied in (False, True):
            cfg = dict(TINY_QWEN2, tie_word_embeddings=tied)
            reference = hf_model(cfg)
            with torch.no_grad():
                want = reference(tokens).logits
            chunks = build_model(cfg)
            model = chunks[0]
            load_full_state(chunks, hf_to_megatron_full(reference.state_dict(), cfg))
            with torch.no_grad():
                local = model(tokens, positions, causal_mask(24))
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            got = torch.cat(parts, dim=-1)
            results[(tp, tied)] = dict(
                local_shape=tuple(local.shape),
                padded=padded_vocab_size(cfg["vocab_size"], tp),
                max_err=float((got[..., :cfg["vocab_size"]] - want).abs().max()),
                scale=float(want.abs().max()),
                # exact: the output layer's padded rows are zeros: a padded logit is a sum of h * 0
                pad_cols_zero=bool((got[..., cfg["vocab_size"]:] == 0).all()),
                names=sorted(n for n, _ in model.named_parameters()),
                qkv_bias=model.config.add_qkv_bias,
                tied=model.share_embeddings_and_output_weights,
            )
        destroy_parallel()
    tc, spec = transformer_config_from_hf(dict(TINY_QWEN2, rope_theta=1e6))
    results["rope"] = (spec.rotary_base, tc.num_query_groups, tc.kv_channels)
    return results
