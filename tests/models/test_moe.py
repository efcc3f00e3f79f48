"""Qwen3 dense and Qwen3-MoE in Megatron-Core against transformers: logits, gradients, the
converter at TP/EP layouts, and training split over expert parallelism (2 gloo ranks)."""

from __future__ import annotations

import os

import pytest
import torch

from tests._rank_fns_moe import (LR, QWEN3_MOE, convert_fn, hf_reference, parity_fn,
                                 read_safetensors, save_models, train_fn)
from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    dirs = save_models(str(root))
    references = {name: [hf_reference(path, index) for index in (0, 1)]
                  for name, path in dirs.items()}
    return dirs, references


def test_logits_and_gradients_equal_transformers_at_ep1_ep2_both_dispatchers(models):
    dirs, references = models
    results = run_ranks(parity_fn, 2, dirs, references)
    for rank_results in results:
        for r in rank_results:
            label = f"{r['name']} tp={r['tp']} ep={r['ep']} {r['overrides']}"
            assert r["names_equal"], label
            if "moe_router_pre_softmax" in r["overrides"]:  # the wrong router
                assert r["logits_err"] > 1e-2, label
                continue
            assert r["logits_err"] < 1e-5, label  # measured: 0.0 dense, <= 4e-7 MoE
            assert r["grad_rel"] < 1e-5, label
            if "moe" in r["name"]:
                assert r["expert_grad_rel"] < 1e-5, label
                # 2 layers x (fc1, fc2) x this rank's experts
                assert r["local_experts"] == 2 * 2 * 8 // r["ep"], label
        assert {r["dispatcher"] for r in rank_results} == {"alltoall", "allgather"}


def test_converter_round_trips_bitwise_at_tp_and_ep_layouts(models, tmp_path):
    from megatron_dgpo.convert import megatron_to_hf

    dirs, _ = models
    results = run_ranks(convert_fn, 2, dirs, str(tmp_path))
    for rank_results in results:
        assert len(rank_results) == 14
        assert all(rank_results.values()), [k for k, ok in rank_results.items() if not ok]
    # and back to HF files, in one process (label: the checkpoint, name: its HF original)
    for label, name in (("qwen3_moe", "qwen3_moe"), ("qwen3_moe_tp2", "qwen3_moe"),
                        ("qwen3", "qwen3")):
        out = megatron_to_hf(str(tmp_path / f"{label}_mcore"), str(tmp_path / f"{label}_hf"))
        back, original = read_safetensors(out), read_safetensors(dirs[name])
        assert set(back) == set(original)
        # exact: conversion and sharding copy the weights (no arithmetic)
        assert all(torch.equal(back[k], v) for k, v in original.items()), label


def test_training_split_over_expert_parallelism_and_resumed_across_ep(models, tmp_path):
    """MoE: three steps, EP=2 x DP=2, resumed at EP=1 x DP=2, resumed at EP=2, each from the
    last checkpoint; dense Qwen3: one step at TP=2. Against the same steps on one rank."""
    dirs, _ = models
    single = run_ranks(train_fn, 1, dirs, str(tmp_path / "one"))[0]
    split = run_ranks(train_fn, 2, dirs, str(tmp_path / "two"))
    for rank_result in split:
        assert len(rank_result["steps"]) == len(single["steps"]) == 4
        for (loss, norm), (want_loss, want_norm) in zip(rank_result["steps"], single["steps"]):
            assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
            assert norm == pytest.approx(want_norm, rel=1e-5)
        # Adam's first steps are nearly sign(g) * lr: an element whose gradient is ~0 moves by
        # up to lr on float noise alone, so the bound is per element a share of lr, and on
        # average far below what a lost optimizer state would give (~lr / 3 per element).
        # Measured: max 1.6e-5 (lr 1e-3), mean 2e-9.
        for model, want_weights in single["weights"].items():
            total, count = 0.0, 0
            for name, want in want_weights.items():
                diff = (rank_result["weights"][model][name] - want).abs()
                assert float(diff.max()) < 0.05 * LR, (model, name)
                total, count = total + float(diff.sum()), count + diff.numel()
            assert total / count < 1e-3 * LR, model
    # the steps did move the experts and the q/k norms (else the comparison would be vacuous)
    for model, mark in (("qwen3_moe", ".experts."), ("qwen3", "_norm.")):
        original = read_safetensors(dirs[model])
        marked = [k for k in original if mark in k]
        moved = [k for k in marked
                 if not torch.allclose(single["weights"][model][k], original[k], atol=1e-4)]
        assert len(moved) > len(marked) // 2, model


def test_describe_refuses_what_megatron_cannot_build():
    from megatron_dgpo.models import describe

    desc = describe(QWEN3_MOE)
    assert (desc.dims.experts, desc.dims.topk, desc.dims.moe_ffn, desc.qk_norm) == (8, 2, 64, True)
    assert desc.router.norm_topk_prob
    renamed = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    assert describe(dict(renamed, num_local_experts=8)).dims.experts == 8  # transformers 5
    for field, value, message in (("mlp_only_layers", [1], "mlp_only_layers"),
                                  ("decoder_sparse_step", 2, "decoder_sparse_step"),
                                  ("num_experts_per_tok", 9, "num_experts_per_tok"),
                                  ("attention_bias", True, "attention_bias")):
        with pytest.raises(ValueError, match=message):
            describe(dict(QWEN3_MOE, **{field: value}))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        describe({k: v for k, v in QWEN3_MOE.items() if k != "moe_intermediate_size"})


def test_moe_transformer_config_choices():
    from megatron_dgpo.models.builder import transformer_kwargs
    from megatron_dgpo.runtime.gpu_flags import Platform

    cpu, gpu = Platform(cuda=False), Platform(cuda=True, transformer_engine=True)
    kwargs = transformer_kwargs(QWEN3_MOE, platform=cpu)
    assert (kwargs["num_moe_experts"], kwargs["moe_router_topk"], kwargs["moe_ffn_hidden_size"],
            kwargs["moe_router_pre_softmax"], kwargs["moe_router_load_balancing_type"],
            kwargs["qk_layernorm"], kwargs["moe_grouped_gemm"]) == (8, 2, 64, False, "none",
                                                                   True, False)
    assert transformer_kwargs(dict(QWEN3_MOE, norm_topk_prob=False),
                              platform=cpu)["moe_router_pre_softmax"] is True
    on_gpu = transformer_kwargs(QWEN3_MOE, platform=gpu)
    assert on_gpu["moe_grouped_gemm"] is True and on_gpu["moe_permute_fusion"] is True
    assert kwargs["moe_permute_fusion"] is False
    aux = transformer_kwargs(QWEN3_MOE, platform=cpu, moe_aux_loss_coeff=1e-3)
    assert aux["moe_router_load_balancing_type"] == "aux_loss"
    allgather = transformer_kwargs(QWEN3_MOE, platform=cpu,
                                   moe_token_dispatcher_type="allgather")
    assert allgather["variable_seq_lengths"] is False
    with pytest.raises(ValueError, match="pipeline_parallel 1"):
        transformer_kwargs(QWEN3_MOE, platform=cpu, moe_token_dispatcher_type="allgather",
                           pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="sequence parallelism"):
        transformer_kwargs(QWEN3_MOE, platform=cpu, tensor_model_parallel_size=2)
    # the converter's explicit choice (its models never run forward) is not refused
    assert transformer_kwargs(QWEN3_MOE, platform=cpu, tensor_model_parallel_size=2,
                              sequence_parallel=False)["sequence_parallel"] is False
    gpu_tp2 = transformer_kwargs(QWEN3_MOE, platform=gpu, tensor_model_parallel_size=2)
    assert gpu_tp2["sequence_parallel"] is True
    with pytest.raises(ValueError, match="needs a GPU"):
        transformer_kwargs(QWEN3_MOE, platform=cpu, moe_token_dispatcher_type="flex")
    with pytest.raises(ValueError, match="moe_token_dispatcher"):
        transformer_kwargs(QWEN3_MOE, platform=cpu, moe_token_dispatcher_type="deepep")
    dense = transformer_kwargs({k: v for k, v in QWEN3_MOE.items()
                                if k not in ("num_experts",)} | {"model_type": "qwen3",
                                                                 "architectures": []},
                               platform=cpu)
    assert "num_moe_experts" not in dense and dense["qk_layernorm"] is True


def test_parallel_config_expert_sizes():
    from megatron_dgpo.runtime.parallel import ParallelConfig

    assert ParallelConfig(tensor_parallel=2).etp == 2
    assert ParallelConfig(tensor_parallel=2, expert_tensor_parallel=1).etp == 1
    for bad in (dict(expert_parallel=0), dict(expert_tensor_parallel=0),
                dict(expert_parallel="2")):
        with pytest.raises(ValueError, match="expert"):
            ParallelConfig(**bad)


def test_hf_to_megatron_refuses_an_ep_that_does_not_divide_the_experts(models, tmp_path):
    from megatron_dgpo.convert import hf_to_megatron

    dirs, _ = models
    with pytest.raises(ValueError, match="--ep 3 does not divide the model.s 8 experts"):
        hf_to_megatron(dirs["qwen3_moe"], str(tmp_path / "x"), ep=3)
    assert not os.path.exists(tmp_path / "x")


def test_dgpo_convert_command_writes_and_reads_an_expert_parallel_layout(models, tmp_path):
    """`dgpo-convert hf-to-megatron ... --tp 2 --ep 2` (two spawned CPU ranks; TP 2 as in
    recipes/qwen3_30b_a3b.yaml, a layout the CPU trainer refuses for an MoE) and back,
    bitwise."""
    from megatron_dgpo.convert import read_metadata
    from megatron_dgpo.convert.cli import main

    dirs, _ = models
    assert main(["hf-to-megatron", dirs["qwen3_moe"], str(tmp_path / "mcore"),
                 "--tp", "2", "--ep", "2"]) == 0
    meta = read_metadata(str(tmp_path / "mcore"))
    assert (meta["saved_tp"], meta["saved_ep"]) == (2, 2)
    assert main(["megatron-to-hf", str(tmp_path / "mcore"), str(tmp_path / "hf")]) == 0
    back, original = read_safetensors(str(tmp_path / "hf")), read_safetensors(dirs["qwen3_moe"])
    assert set(back) == set(original)
    # exact: conversion and sharding copy the weights (no arithmetic)
    assert all(torch.equal(back[k], v) for k, v in original.items())


def test_live_parameter_names_of_both_specs_map_to_one_checkpoint_key():
    """SequentialMLP (CPU) numbers experts in the module path, TE's grouped GEMM (GPU) in the
    parameter name: both resolve to the same map, layer and local expert."""
    from megatron_dgpo.models import FAMILIES, megatron_param_key

    family = FAMILIES["qwen3_moe"]
    local = megatron_param_key(family,
                               "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
    grouped = megatron_param_key(family, "decoder.layers.1.mlp.experts.linear_fc1.weight3")
    assert local == grouped
    assert (local.map.key(), local.layer, local.expert) == (
        "decoder.layers.mlp.experts.experts.linear_fc1.weight", 1, 3)
    router = megatron_param_key(family, "decoder.layers.0.mlp.router.weight")
    assert (router.map.hf_names(0), router.expert) == (("model.layers.0.mlp.gate.weight",), None)
    norm = megatron_param_key(family, "decoder.layers.0.pre_mlp_layernorm.weight")
    assert norm.map.hf_names(0) == ("model.layers.0.post_attention_layernorm.weight",)
    q_norm = megatron_param_key(FAMILIES["qwen3"],
                                "decoder.layers.0.self_attention.q_layernorm.weight")
    assert q_norm.map.hf_names(0) == ("model.layers.0.self_attn.q_norm.weight",)
    assert megatron_param_key(family,
                              "decoder.layers.0.mlp.experts.linear_fc1._extra_state") is None
