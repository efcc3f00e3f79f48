"""megatron_dgpo/planner/parameters.py: parameter counts by hand (dense and MoE, per TP x PP
stage and per expert grid) and against Megatron-Core's built model of three tiny configs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_dgpo.planner.inputs import PlannedModel
from megatron_dgpo.planner.parameters import padded_vocab, param_count, stage_params
from tests._rank_fns_model import TINY_QWEN2
from tests.distributed import run_ranks
from tests.planner._inputs import SMALL, SMALL_MOE

TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=300,
                  hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                  attention_bias=False, tie_word_embeddings=True)

TINY_CONFIGS = {"qwen2_untied": TINY_QWEN2,
                "qwen2_tied": dict(TINY_QWEN2, tie_word_embeddings=True),
                "llama_tied_mha": TINY_LLAMA}


def test_parameter_counts_by_hand():
    q, k, v, o = 64 * 64, 64 * 32, 64 * 32, 64 * 64
    bias = 64 + 32 + 32
    gate, up, down = 96 * 64, 96 * 64, 64 * 96
    norms = 64 + 64
    layer = q + k + v + bias + o + gate + up + down + norms  # 30976
    assert param_count(SMALL) == 1000 * 64 + 4 * layer + 64 + 1000 * 64
    assert param_count(replace(SMALL, tie_word_embeddings=True)) == \
        1000 * 64 + 4 * layer + 64
    assert padded_vocab(1000, 1) == 1024 and padded_vocab(1000, 2) == 1024
    assert padded_vocab(1000, 8) == 1024 and padded_vocab(1100, 8) == 2048
    # TP2 x PP2: each GPU has 2 layers with matrices and biases halved, norms whole, and one
    # half of the padded 1024-row vocabulary matrix (embedding on stage 0, output on stage 1)
    layer_tp2 = (layer - norms) // 2 + norms
    assert stage_params(SMALL, 2, 2, 0) == 2 * layer_tp2 + 1024 * 64 // 2
    assert stage_params(SMALL, 2, 2, 1) == 2 * layer_tp2 + 64 + 1024 * 64 // 2
    # tied at PP1: no output matrix; tied at PP2: the last stage keeps its copy
    tied = replace(SMALL, tie_word_embeddings=True)
    assert stage_params(tied, 1, 1, 0) == 4 * layer + 64 + 1024 * 64
    assert stage_params(tied, 1, 2, 1) == 2 * layer + 64 + 1024 * 64
    with pytest.raises(ValueError, match="pipeline_parallel 3 does not divide 4 layers"):
        stage_params(SMALL, 1, 3, 0)


def test_moe_parameter_counts_by_hand():
    """An MoE layer: attention + norms + q/k norms + the router [E, h] (replicated over TP),
    no dense MLP; the experts (E x 3 f_e h) split over EP x expert TP."""
    from megatron_dgpo.planner.parameters import stage_expert_params

    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64
    replicated = 2 * 64 + 2 * 16 + 8 * 64
    experts = 8 * 3 * 32 * 64
    assert param_count(SMALL_MOE) == 2 * 1000 * 64 + 4 * (attention + replicated + experts) + 64
    for ep, etp in ((1, 1), (2, 1), (4, 1), (2, 2), (8, 2)):
        assert stage_expert_params(SMALL_MOE, 2, ep, etp) == 2 * experts // (ep * etp)
        assert stage_params(SMALL_MOE, 2, 2, 0, ep, etp) == \
            2 * (attention // 2 + replicated) + 2 * experts // (ep * etp) + 1024 * 64 // 2
    with pytest.raises(ValueError, match="expert_parallel 3 does not divide 8 experts"):
        stage_expert_params(SMALL_MOE, 1, 3)


def count_params_fn(rank, world_size):
    """On 4 gloo ranks: Megatron's per-rank parameter counts at TP2 x PP2 and whole-model
    counts at TP1 x PP1, for each tiny config; fp32 main_grad buffers of Megatron DDP."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.training.policy import wrap_ddp
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    out = {}
    for tp, pp in ((2, 2), (1, 1)):
        initialize_parallel(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp))
        for name, cfg in TINY_CONFIGS.items():
            chunks = build_model(cfg)
            count = sum(p.numel() for c in chunks for p in c.parameters())
            out[(tp, pp, name)] = dict(stage=ps.get_pipeline_model_parallel_rank(), count=count)
            if (tp, pp) == (1, 1) and name == "qwen2_untied":
                ddp = wrap_ddp(chunks, grad_reduce_in_fp32=True)
                grads = [p.main_grad for c in ddp for p in c.module.parameters()]
                out["main_grad"] = dict(fp32=all(g.dtype == torch.float32 for g in grads),
                                        numel=sum(g.numel() for g in grads), count=count)
        destroy_parallel()
    return out


def test_formula_counts_equal_megatron_built_model():
    results = run_ranks(count_params_fn, 4)
    for rank, result in enumerate(results):
        for name, cfg in TINY_CONFIGS.items():
            desc = PlannedModel.from_hf_config(cfg, name=name).description
            assert desc.qkv_bias == (cfg["model_type"] == "qwen2")
            whole = result[(1, 1, name)]
            assert whole["count"] == param_count(desc, padded_vocab(cfg["vocab_size"], 1)), name
            sharded = result[(2, 2, name)]
            assert sharded["count"] == stage_params(desc, 2, 2, sharded["stage"]), (name, rank)
        grads = result["main_grad"]
        assert grads["fp32"] and grads["numel"] == grads["count"]  # 4 bytes per parameter
    # ranks 0, 1 are stage 0 and ranks 2, 3 stage 1 (Megatron's order: TP innermost, PP outermost)
    assert [r[(2, 2, "qwen2_untied")]["stage"] for r in results] == [0, 0, 1, 1]
