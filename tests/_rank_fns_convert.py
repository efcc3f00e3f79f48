"""Tiny HF checkpoints and rank functions for the converter tests (run on gloo ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests._rank_fns_model import causal_mask, hf_model

_BASE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
             rope_theta=10000.0, hidden_act="silu")
CASES = {
    # Qwen2 untied, QKV bias, GQA (4 heads, 2 groups)
    "qwen2": dict(_BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                  vocab_size=512, tie_word_embeddings=False),
    "qwen2_tied": dict(_BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                       vocab_size=384, tie_word_embeddings=True),
    # Llama stored in bfloat16 (dtype must survive the round trip)
    "llama": dict(_BASE, model_type="llama", architectures=["LlamaForCausalLM"],
                  vocab_size=512, tie_word_embeddings=False),
    # 300 is not a multiple of TP * 128: padded to 512 at TP2, 384 at TP1
    "qwen2_vocab300": dict(_BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                           vocab_size=300, tie_word_embeddings=False),
}
DTYPES = {"llama": torch.bfloat16}


def save_hf(case: str, path: str):
    """Save the tiny model of ``case`` to ``path``; returns the fp32 transformers model."""
    model = hf_model(CASES[case])
    dtype = DTYPES.get(case, torch.float32)
    if dtype != torch.float32:
        model.to(dtype).save_pretrained(path)
        model.float()
    else:
        model.save_pretrained(path)
    return model


def _full_logits(chunks, tokens) -> torch.Tensor | None:
    """Full-vocabulary logits [B, S, V_pad] on the last stage (manual PP send/recv), else None."""
    from megatron.core import parallel_state as ps

    model = chunks[0]
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    mask = causal_mask(tokens.shape[1])
    pp_rank = ps.get_pipeline_model_parallel_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    pp_group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(pp_group)
    hidden_shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)
    with torch.no_grad():
        if pp_rank > 0:
            hidden = torch.empty(hidden_shape)
            dist.recv(hidden, src=ranks[pp_rank - 1], group=pp_group)
            model.set_input_tensor(hidden)
        out = model(tokens, positions, mask)
        if pp_rank < pp_size - 1:
            dist.send(out.contiguous(), dst=ranks[pp_rank + 1], group=pp_group)
            return None
    tp = ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def tp2pp2_fn(rank, world_size, dirs: dict):
    """TP2 x PP2: convert every case, export from the loaded checkpoint and from the HF folder."""
    from megatron_dgpo.convert import export_hf_weights, hf_to_megatron, load_model
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(tensor_parallel=2, pipeline_parallel=2))
    out = {}
    for case, (hf_dir, mg_dir) in dirs.items():
        hf_to_megatron(hf_dir, mg_dir, tp=2, pp=2)
        dtype = DTYPES.get(case, torch.float32)
        from_ckpt = dict(export_hf_weights(load_model(mg_dir, dtype=dtype), dtype=dtype))
        out[case] = {"ckpt": {k: v.clone() for k, v in from_ckpt.items()}}
        if case == "qwen2":  # loading straight from HF, and the single-consumer mode
            chunks = load_model(hf_dir, dtype=dtype)
            out[case]["hf"] = {k: v.clone() for k, v in export_hf_weights(chunks)}
            out[case]["first"] = {k: v.clone()
                                  for k, v in export_hf_weights(chunks, consumer="first")}
    destroy_parallel()
    return out


def tp2_fn(rank, world_size, dirs: dict, tokens, bridge_dir: str):
    """TP2 (PP1): logits from the TP2xPP2 checkpoints, from the TP2 x PP1 one, and from a
    checkpoint Megatron-Bridge wrote (its unpadded vocabulary resharded over TP)."""
    from megatron_dgpo.convert import load_model  # the public entry point
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(tensor_parallel=2))
    out = {}
    for case, (hf_dir, mg_dir) in dirs.items():
        out[case] = _full_logits(load_model(mg_dir), tokens)
    hf_dir, _ = dirs["qwen2_vocab300"]
    out["saved_tp2pp1"] = _full_logits(load_model(hf_dir + "_tp2pp1"), tokens)
    out["bridge"] = _full_logits(load_model(bridge_dir), tokens % 160)
    destroy_parallel()
    return out


def tp1_fn(rank, world_size, dirs: dict, tokens):
    """TP1 (DP2): logits of the TP2xPP2 checkpoints; then TP1 x PP2 from the TP2 x PP1 one."""
    from megatron_dgpo.convert import load_model
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(tensor_parallel=1))
    out = {case: _full_logits(load_model(mg_dir), tokens) for case, (_, mg_dir) in dirs.items()}
    destroy_parallel()
    initialize_parallel(ParallelConfig(tensor_parallel=1, pipeline_parallel=2))
    hf_dir, _ = dirs["qwen2_vocab300"]
    out["resharded_tp1pp2"] = _full_logits(load_model(hf_dir + "_tp2pp1"), tokens)
    destroy_parallel()
    # interleaved pipeline (VPP 2): 4 layers as 4 chunks over 2 stages; global layer numbers
    initialize_parallel(ParallelConfig(tensor_parallel=1, pipeline_parallel=2,
                                       virtual_pipeline_parallel=2))
    from megatron_dgpo.convert import export_hf_weights

    chunks = load_model(dirs["qwen2"][1])
    out["vpp_layers"] = [[layer.layer_number for layer in c.decoder.layers] for c in chunks]
    out["vpp_export"] = {k: v.clone() for k, v in export_hf_weights(chunks)}
    destroy_parallel()
    # `dgpo-convert` under torchrun (this launch's world of 2): collective at --tp 2; a layout
    # this world is no multiple of (--tp 2 --pp 2: 4 ranks), and megatron-to-hf (one process),
    # refused on every rank before anything is written
    from megatron_dgpo.convert.cli import main

    hf_dir = dirs["qwen2"][0]
    out["cli"] = [main(["hf-to-megatron", hf_dir, hf_dir + "_cli_tp2pp2", "--tp", "2", "--pp", "2"]),
                  main(["megatron-to-hf", dirs["qwen2"][1], hf_dir + "_cli_hf"]),
                  main(["hf-to-megatron", hf_dir, hf_dir + "_cli_tp2", "--tp", "2"])]
    return out
