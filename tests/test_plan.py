"""dgpo-plan and its memory formulas (megatron_dgpo.planner): memory terms computed by hand, parameter counts against Megatron-Core's built model
and the published totals, the published bytes-per-parameter figures, the paper's 14B recipe on
8 x 80 GB, and the CLI's errors."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_dgpo.models import describe
from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.cli import main
from megatron_dgpo.planner.inputs import GIB, Cluster, Layout, PlannedModel, Workload
from megatron_dgpo.planner.memory_terms import (activation_bytes, grad_bytes, optimizer_bytes,
                                                vllm_bytes, weight_bytes)
from megatron_dgpo.planner.parameters import padded_vocab, param_count, stage_params
from megatron_dgpo.planner.peak import estimate
from megatron_dgpo.planner.search import make_plan
from tests._rank_fns_model import TINY_QWEN2
from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_14B = os.path.join(ROOT, "recipes", "dgpo_14b.yaml")

TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=300,
                  hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                  attention_bias=False, tie_word_embeddings=True)
TINY_CONFIGS = {"qwen2_untied": TINY_QWEN2,
                "qwen2_tied": dict(TINY_QWEN2, tie_word_embeddings=True),
                "llama_tied_mha": TINY_LLAMA}

# h=64, L=4, a=4 heads of d=16, g=2 KV groups, f=96, V=1000, untied, QKV bias (Qwen2)
SMALL = describe(dict(model_type="qwen2", hidden_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                      vocab_size=1000, tie_word_embeddings=False))
SMALL_MODEL = PlannedModel("small", SMALL)


# --------------------------------------------------------------------------- by hand


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


def with_dims(desc, **changes):
    """``desc`` with some of its dimensions changed (a what-if)."""
    return replace(desc, dims=replace(desc.dims, **changes))


def _small_work(**changes) -> Workload:
    base = dict(micro_batch_tokens=4096, responses_per_update=64, max_sequence=1024,
                recompute=False, distributed_optimizer=True, dtype_bytes=2, grad_dtype_bytes=4,
                log_prob_chunk_size=256, colocated_rollout=True, rollout_tp=1,
                rollout_dtype_bytes=2, gpu_memory_utilization=0.5,
                kv_cache_memory_bytes=1 << 30, max_num_seqs=4, overhead_bytes=0)
    base.update(changes)
    return Workload(**base)


def test_memory_terms_by_hand():
    """TP2 PP2 CP2 DP2 on 16 GPUs: every term of both pipeline stages computed here."""
    cluster = Cluster(gpus_per_node=8, nodes=2, gpu_memory_gb=80)
    layout = Layout(tp=2, pp=2, cp=2, dp=2)
    tokens = 4096 // 2  # CP halves the micro-batch
    # 64 responses / 2 DP ranks x 1024 tokens = 32768 tokens = 8 micro-batches >= PP: 2 in flight
    in_flight = 2
    # saved per token and layer (elements): norm in h, QKV in h, Q h, K 32, V 32, attention out
    # h, norm in h, fc1 in h, fc1 out 2f, fc2 in f; bf16, sequence parallel over TP 2
    act_token_layer = (64 + 64 + 64 + 32 + 32 + 64 + 64 + 64 + 192 + 96) * 2 // 2
    first_params, last_params = 63872, 63936  # the stage_params values checked above
    assert (stage_params(SMALL, 2, 2, 0), stage_params(SMALL, 2, 2, 1)) == (63872, 63936)
    vllm = 251968 * 2 + (1 << 30)  # all weights in bf16 on vLLM's one GPU + its KV cache

    # a separate engine on global rank 0's GPU (stage 0), awake through training: added
    first = estimate(SMALL_MODEL, cluster, layout, _small_work(rollout_placement="separate"))
    assert first.stage == "first" and not first.vllm_sleeps and first.engines == 2
    assert first.weights == 2 * first_params
    assert first.grads == 4 * first_params
    assert first.optimizer == 12 * first_params // (2 * 2)  # sharded over DP x CP
    assert first.activations == in_flight * 2 * tokens * act_token_layer
    assert first.logits == 0 and first.vllm == vllm
    # NCCL: TP, DP, PP, model-parallel (grad norm), world; SMALL is untied, so no embedding
    # group; the engine has 1 GPU, so no vLLM TP group. 32 channels x (4 MiB Simple + 4.69 MiB
    # LL128 + 0.5 MiB LL) each
    assert first.communicators == ["TP", "DP", "PP", "model-parallel", "world"]
    channel = 4 * 2**20 + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
    assert first.nccl == 5 * 32 * channel
    assert first.cache == int(0.1 * first.activations)  # the allocator's slack
    assert first.graphs == 0  # an awake engine's graphs are inside its reserve
    assert first.total == (2 + 4) * first_params + 12 * first_params // 4 \
        + 2 * 2 * tokens * act_token_layer + first.cache + vllm + first.nccl

    # colocated (the default): an engine of rollout_tp=1 GPU in each of the 16 ranks, on every
    # stage, asleep while training, so a stage holds max(vLLM, activations + logits)
    colocated = [estimate(SMALL_MODEL, cluster, layout, _small_work(sleep_mode=s))
                 for s in (True, False)]
    assert [(e.engines, e.vllm, e.vllm_sleeps) for e in colocated] == [(16, vllm, True),
                                                                        (16, vllm, False)]
    static = {e.stage: e.weights + e.grads + e.optimizer + e.nccl for e in colocated}
    asleep, awake = colocated
    # asleep: its CUDA-graph pool (1 GiB by default) stays through training
    assert asleep.graphs == GIB and awake.graphs == 0
    assert asleep.total == static[asleep.stage] + max(
        vllm, asleep.activations + asleep.logits + asleep.cache + GIB)
    assert awake.total == static[awake.stage] + vllm + \
        awake.activations + awake.logits + awake.cache
    eager = estimate(SMALL_MODEL, cluster, layout, _small_work(enforce_eager=True))
    assert eager.graphs == 0 and eager.vllm_sleeps
    default_tp = estimate(SMALL_MODEL, cluster, layout, _small_work(rollout_tp=None))
    assert default_tp.engines == 16 // 2  # PP 2 with DP 2: one engine of TP GPUs per stage
    assert estimate(SMALL_MODEL, cluster, Layout(tp=8, pp=2, cp=1, dp=1),
                    _small_work(rollout_tp=None)).engines == 1  # DP 1: TP x PP per engine

    last = estimate(SMALL_MODEL, cluster, layout, _small_work(colocated_rollout=False))
    assert last.stage == "last"
    logits = 2 * tokens * (1024 // 2) * 2  # logits + gradient, bf16, V_pad / TP columns
    workspace = 2 * 256 * 512 * 4  # two float32 [chunk 256, 512] buffers
    assert (last.weights, last.grads, last.optimizer) == \
        (2 * last_params, 4 * last_params, 12 * last_params // 4)
    assert last.activations == 1 * 2 * tokens * act_token_layer  # one micro-batch in flight
    assert last.logits == logits + workspace and last.vllm == 0
    assert last.cache == int(0.1 * (last.activations + logits + workspace)) and last.graphs == 0
    assert last.total == 8_832_960 + last.cache + 5 * 32 * channel

    # full recompute: each layer's input (h per token) for 2 micro-batches x 2 layers, plus one
    # layer's whole activations while it is recomputed
    assert activation_bytes(SMALL, tokens, 2, 2, 2, recompute=True) == \
        2 * 2 * tokens * 64 * 2 // 2 + tokens * act_token_layer
    # vLLM's reserve from gpu_memory_utilization, and the KV cache it would need:
    # 2 (K, V) x 4 layers x 32 x 2 bytes per token, 4 sequences of 1024 tokens
    reserve, notes = vllm_bytes(SMALL, cluster, _small_work(kv_cache_memory_bytes=None,
                                                           max_num_seqs=10 ** 6))
    assert reserve == 40 * GIB
    assert notes and "not max_num_seqs=1000000" in notes[0]
    assert vllm_bytes(SMALL, cluster, _small_work(kv_cache_memory_bytes=None))[1] == []
    needed = 4 * 1024 * (2 * 4 * 32 * 2)
    tight, notes = vllm_bytes(SMALL, cluster, _small_work(kv_cache_memory_bytes=needed - 1))
    assert tight == 251968 * 2 + needed - 1 and "holds ~3 full-length" in notes[0]


def test_activations_follow_sequence_parallelism_by_hand():
    """Without sequence parallelism the two norm inputs and the QKV and fc1 inputs (4 h per
    token and layer) and, under recompute, the layer inputs stay whole on every TP rank; the
    planner's default is what the trainer runs on a GPU: sequence parallel whenever TP > 1."""
    tokens, layers, in_flight, tp = 2048, 2, 2, 2
    whole = 4 * 64  # norm in, QKV in, norm in, fc1 in
    sharded = 64 + 32 + 32 + 64 + 192 + 96  # Q, K, V, attention out, fc1 out, fc2 in
    assert activation_bytes(SMALL, tokens, layers, in_flight, tp, recompute=False,
                            sequence_parallel=False) == \
        in_flight * layers * tokens * (whole * 2 + sharded * 2 // tp)
    assert activation_bytes(SMALL, tokens, layers, in_flight, tp, recompute=True,
                            sequence_parallel=False) == \
        in_flight * layers * tokens * 64 * 2 + tokens * (whole * 2 + sharded * 2 // tp)
    for recompute in (False, True):
        on = activation_bytes(SMALL, tokens, layers, in_flight, tp, recompute,
                              sequence_parallel=True)
        assert activation_bytes(SMALL, tokens, layers, in_flight, tp, recompute) == on
        # TP 1: nothing to shard, the flag changes nothing
        assert activation_bytes(SMALL, tokens, layers, in_flight, 1, recompute,
                                sequence_parallel=False) == \
            activation_bytes(SMALL, tokens, layers, in_flight, 1, recompute)
    # the 14B recipe at TP4, 16k-token rows, full recompute: 8.5 GiB without sequence
    # parallelism (the trainer before it was on), 2.4 GiB with it
    qwen14 = PUBLISHED["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"].description
    off = activation_bytes(qwen14, 16384, 48, 1, 4, True, sequence_parallel=False) / GIB
    on = activation_bytes(qwen14, 16384, 48, 1, 4, True) / GIB
    assert (round(off, 2), round(on, 2)) == (8.54, 2.44)


def test_logits_bytes_follow_the_logits_dtype():
    """The logits term uses the dtype the logits reach the kernel in: the model's by default
    (the trainer keeps bf16 logits), fp32 when asked (Float16Module's default output)."""
    cluster = Cluster(gpus_per_node=8, nodes=1, gpu_memory_gb=80)
    layout = Layout(tp=2, pp=1, cp=1, dp=4)
    workspace = 2 * 256 * 512 * 4
    bf16 = estimate(SMALL_MODEL, cluster, layout, _small_work(colocated_rollout=False))
    fp32 = estimate(SMALL_MODEL, cluster, layout, _small_work(colocated_rollout=False,
                                                        logits_dtype_bytes=4))
    assert bf16.logits == 2 * 4096 * 512 * 2 + workspace
    assert fp32.logits == 2 * 4096 * 512 * 4 + workspace


def test_published_bytes_per_parameter():
    """Megatron-Core's distributed-optimizer guide: bf16 params with fp32 grads take 18 bytes
    per parameter without it, 6 + 12/d with it; ZeRO (Rajbhandari et al. 2020, Fig. 1): 7.5B
    parameters, 16-bit gradients, 64 GPUs: 120 GB baseline, 31.4 GB with P_os."""
    n = 10 ** 9
    static = weight_bytes(n) + grad_bytes(n) + optimizer_bytes(n, 8, distributed=False)
    assert static / n == 18
    for d in (1, 8, 64):
        with_dist = weight_bytes(n) + grad_bytes(n) + optimizer_bytes(n, d, distributed=True)
        assert with_dist / n == pytest.approx(6 + 12 / d)
    psi = 7_500_000_000
    baseline = weight_bytes(psi) + grad_bytes(psi, 2) + optimizer_bytes(psi, 64, False)
    zero1 = weight_bytes(psi) + grad_bytes(psi, 2) + optimizer_bytes(psi, 64, True)
    assert round(baseline / 1e9, 1) == 120.0 and round(zero1 / 1e9, 1) == 31.4


@pytest.mark.parametrize("hub_id, published", [
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1.78e9),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 7.62e9),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", 14.8e9),   # 14.77B
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", 32.8e9),   # 32.76B
    ("meta-llama/Llama-3.1-70B", 70.6e9),                  # 70.55B
])
def test_formula_counts_match_published_totals(hub_id, published):
    """Model-card totals (safetensors parameter counts) to 3 significant digits."""
    count = param_count(PUBLISHED[hub_id].description)
    digits = 10 ** (len(str(count)) - 3)
    assert round(count / digits) * digits == published


# --------------------------------------------------------------------------- Megatron-Core


def count_params_fn(rank, world_size):
    """On 4 gloo ranks: Megatron's per-rank parameter counts at TP2 x PP2 and whole-model
    counts at TP1 x PP1, for each tiny config; fp32 main_grad buffers of Megatron DDP."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_dgpo.model import build_model
    from megatron_dgpo.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_dgpo.model import wrap_ddp

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


# --------------------------------------------------------------------------- recipes & CLI


def _run_main(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_14b_recipe_fits_8x80gb_with_the_proposed_layout(capsys):
    from megatron_dgpo.recipe import load_recipe

    run = load_recipe(RECIPE_14B)
    arch = PUBLISHED[run.model.path]
    cluster = Cluster(gpus_per_node=8, nodes=1, gpu_memory_gb=80)
    plan = make_plan(arch, cluster, Workload.from_recipe(run),
                     recipe_tp=run.parallel.tensor_parallel,
                     recipe_pp=run.parallel.pipeline_parallel)
    assert plan.pick is not None and plan.pick.fits and plan.required_overrides == []
    lay = plan.pick.layout
    assert lay.tp * lay.pp * lay.cp * lay.dp == 8 and lay.tp <= 8
    assert plan.pick.total <= 80 * GIB
    # the pick is re-estimated identically from its layout, and nothing smaller fits with room
    assert estimate(arch, cluster, lay, plan.workload).total == plan.pick.total
    assert not any(e.fits_with(0.1) for e in plan.estimates
                   if e.layout.model_parallel < lay.model_parallel)

    code, out, _ = _run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--nodes", "1",
                                      "--gpu-memory-gb", "80"])
    assert code == 0
    assert f"{lay}" in out and "<- pick" in out and "pick: " in out
    assert f"parallel.tensor_parallel={lay.tp} parallel.pipeline_parallel={lay.pp}" in out

    code, out, _ = _run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--gpu-memory-gb",
                                      "80", "--json"])
    data = json.loads(out)
    assert code == 0 and data["pick"]["layout"] == dict(tp=lay.tp, pp=lay.pp, cp=lay.cp,
                                                        dp=lay.dp)
    for row in data["layouts"]:
        g = row["gib"]
        state = g["grads"] + g["optimizer"]
        training = g["activations"] + g["logits"] + g["cache"]
        if row["vllm_sleeps"]:  # vLLM asleep during training: the larger phase, not the sum
            phases = max(state + training + g["graphs"],
                         g["vllm"] + (0 if row["offloaded"] else state))
        else:
            phases = state + training + g["vllm"]
        assert g["weights"] + g["nccl"] + phases + g["overhead"] == pytest.approx(g["total"])
        assert len(row["nccl_communicators"]) * 32 * 9.1875 / 1024 == pytest.approx(g["nccl"])
        assert row["fits"] == (row["gib"]["total"] <= 80)
    assert data["params"] == param_count(arch.description)
    # only layouts the trainer can run: no context parallelism
    assert {row["layout"]["cp"] for row in data["layouts"]} == {1}


def test_14b_on_one_24gb_gpu_does_not_fit(capsys):
    code, out, _ = _run_main(capsys, [RECIPE_14B, "rollout.tensor_parallel_size=1",
                                      "--gpus-per-node", "1", "--gpu-memory-gb", "24"])
    assert code == 1
    assert "DOES NOT FIT" in out and "no layout fits DeepSeek-R1-Distill-Qwen-14B" in out
    assert "TP1 PP1 CP1 DP1" in out  # the only layout, shown with its terms
    assert "<- pick" not in out


def test_recompute_is_proposed_when_nothing_fits_without_it(capsys):
    """Without recompute the 14B recipe's activations do not fit a node; the plan says so and
    proposes the recompute switch with a layout that fits."""
    # a separate engine stays awake on GPU 0 beside the activations (a sleeping colocated one
    # would make room for them)
    code, out, _ = _run_main(capsys, [RECIPE_14B, "model.recompute_activations=false",
                                      "rollout.placement=separate",
                                      "rollout.gpu_memory_utilization=0.3",
                                      "--gpus-per-node", "8", "--gpu-memory-gb", "64"])
    assert code == 0
    assert "as configured, no layout fits" in out
    assert "model.recompute_activations=true" in out.split("set:")[1]


def test_architecture_from_local_hf_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_QWEN2, num_key_value_heads=1)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: {tmp_path}\n")
    code, out, _ = _run_main(capsys, [str(recipe), "--gpus-per-node", "4", "--gpu-memory-gb",
                                      "16", "--json"])
    data = json.loads(out)
    assert code == 0
    assert data["model"]["kv_heads"] == 1 and data["model"]["qkv_bias"] is True
    # KV groups = 1: TP must stay 1
    assert {row["layout"]["tp"] for row in data["layouts"]} == {1}


@pytest.mark.parametrize("args, flag", [
    (["--gpus-per-node", "0", "--gpu-memory-gb", "80"], "--gpus-per-node"),
    (["--gpus-per-node", "eight", "--gpu-memory-gb", "80"], "--gpus-per-node"),
    (["--gpus-per-node", "8", "--gpu-memory-gb", "-1"], "--gpu-memory-gb"),
    (["--gpus-per-node", "8", "--gpu-memory-gb", "80", "--nodes", "0"], "--nodes"),
    (["--gpus-per-node", "8", "--gpu-memory-gb", "80", "--headroom", "1.5"], "--headroom"),
    (["--gpus-per-node", "8", "--gpu-memory-gb", "80", "--max-cp", "3"], "--max-cp"),
    (["--gpus-per-node", "8", "--gpu-memory-gb", "80", "--overhead-gb", "-2"], "--overhead-gb"),
    (["--gpu-memory-gb", "80"], "--gpus-per-node"),
])
def test_bad_flags_are_named(capsys, args, flag):
    with pytest.raises(SystemExit) as exc:
        main([RECIPE_14B] + args)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_bad_recipe_input_is_named(capsys, tmp_path):
    base = ["--gpus-per-node", "8", "--gpu-memory-gb", "80"]
    code, _, err = _run_main(capsys, [RECIPE_14B, "train.micro_batch_tokns=4"] + base)
    assert code == 2 and "train.micro_batch_tokns" in err and "micro_batch_tokens" in err
    code, _, err = _run_main(capsys, [RECIPE_14B, "model.path=org/unknown-7B"] + base)
    assert code == 2 and "model.path 'org/unknown-7B'" in err and "--hf-config" in err
    code, _, err = _run_main(capsys, [str(tmp_path / "missing.yaml")] + base)
    assert code == 2 and "missing.yaml" in err
    code, _, err = _run_main(capsys, [RECIPE_14B, "--hf-config", str(tmp_path)] + base)
    assert code == 2 and "--hf-config" in err
    code, _, err = _run_main(capsys, [RECIPE_14B, "rollout.tensor_parallel_size=16"] + base)
    assert code == 2 and "rollout.tensor_parallel_size=16" in err


def test_offloaded_training_state_is_counted_only_while_vllm_is_awake():
    """train.offload_training_state: the rollout phase no longer holds gradients and optimizer
    state, so the peak drops to max(training, weights + vLLM) and smaller layouts fit."""
    from megatron_dgpo.recipe import load_recipe

    run = load_recipe(RECIPE_14B)
    arch, cluster = PUBLISHED[run.model.path], Cluster(gpus_per_node=8, nodes=4, gpu_memory_gb=80)
    assert Workload.from_recipe(run).offload_training_state is True  # the 14B recipe's choice
    # at the vLLM share the recipe had without offloading
    work = replace(Workload.from_recipe(run), gpu_memory_utilization=0.3)
    lay = Layout(tp=2, pp=1, cp=1, dp=16)
    kept, offloaded = (estimate(arch, cluster, lay, replace(work, offload_training_state=o)) for o in (False, True))
    state = kept.grads + kept.optimizer
    assert kept.vllm_sleeps and offloaded.offloaded and not kept.offloaded
    fixed = kept.weights + kept.nccl + kept.overhead
    training = fixed + state + kept.activations + kept.logits + kept.cache + kept.graphs
    rollout = fixed + kept.vllm
    assert kept.total == max(training, rollout + state)
    assert offloaded.total == max(training, rollout) < kept.total
    # a separate engine never sleeps: offloading changes nothing there
    sep = replace(work, rollout_placement="separate", offload_training_state=True)
    assert not estimate(arch, cluster, lay, sep).offloaded
    # the planner then picks a smaller model-parallel layout for the 14B recipe on 4 nodes
    # (engines of the trainer's TP x PP: a 4-GPU engine cannot run in a TP 2 replica)
    picks = [make_plan(arch, cluster, replace(work, offload_training_state=o, rollout_tp=None)
                       ).pick.layout.model_parallel for o in (False, True)]
    assert picks[1] < picks[0]


def test_explain_prints_every_term_with_its_value(capsys):
    """``dgpo-plan --explain``: one line per memory term of the pick, each value the estimate's
    own, the total their combination; every term has its row in docs/planner.md."""
    import re

    from megatron_dgpo.planner.peak import TERMS

    code, out, _ = _run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--nodes", "4",
                                      "--gpu-memory-gb", "80", "--explain"])
    assert code == 0
    text = out.split("terms of the pick")[1]
    values = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^  (\w+) .*?= ([0-9.]+) GiB", text, re.M)}
    assert set(values) == set(TERMS) | {"total"}

    from megatron_dgpo.recipe import load_recipe

    run = load_recipe(RECIPE_14B)
    plan = make_plan(PUBLISHED[run.model.path], Cluster(8, 4, 80), Workload.from_recipe(run),
                     recipe_tp=4)
    pick = plan.pick
    for term in TERMS:
        assert values[term] == pytest.approx(getattr(pick, term) / GIB, abs=0.006), term
    assert values["total"] == pytest.approx(pick.total / GIB, abs=0.006)
    # the 14B recipe offloads and sleeps: the terms combine as the docs say
    assert pick.vllm_sleeps and pick.offloaded and pick.graphs == GIB
    training = pick.grads + pick.optimizer + pick.activations + pick.logits + pick.cache + pick.graphs
    assert pick.total == pick.weights + pick.nccl + pick.overhead + max(training, pick.vllm)
    assert "TP, DP, model-parallel, world, vLLM TP" in text
    doc = (Path(__file__).parent.parent / "docs" / "planner.md").read_text()
    rows = set(re.findall(r"^\| (\w+) \|", doc, re.M))
    assert set(TERMS) <= rows, set(TERMS) - rows


# --------------------------------------------------------------------------- mixture of experts

# h=64, L=4, a=4 of d=16, g=2, E=8 experts of f_e=32, top-2, untied, q/k norms, no QKV bias
# (Qwen3-MoE)
SMALL_MOE = describe(dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                          vocab_size=1000, tie_word_embeddings=False, num_experts=8,
                          moe_intermediate_size=32, num_experts_per_tok=2))
SMALL_MOE_MODEL = PlannedModel("small_moe", SMALL_MOE)


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


def _moe_estimate(layout: Layout, **work):
    return estimate(SMALL_MOE_MODEL, Cluster(gpus_per_node=8, nodes=2, gpu_memory_gb=80), layout,
                    _small_work(colocated_rollout=False, **work))


def test_moe_memory_terms_follow_expert_parallelism():
    """Doubling EP halves the expert parameters per GPU and their weights, gradients and
    optimizer state (sharded over expert DP = world / (PP EP ETP)); the dense part stays."""
    from megatron_dgpo.planner.parameters import stage_expert_params

    small, large = (_moe_estimate(Layout(tp=2, pp=1, cp=1, dp=8, ep=e, etp=1)) for e in (2, 4))
    assert small.expert_params == 2 * large.expert_params == stage_expert_params(SMALL_MOE, 1, 2)
    dense = stage_params(SMALL_MOE, 2, 1, 0, 2, 1) - small.expert_params
    assert small.weights - large.weights == 2 * large.expert_params
    assert small.grads - large.grads == 4 * large.expert_params
    # expert DP: 16 GPUs / (EP 2) = 8 and / (EP 4) = 4 replicas, dense DP 8
    assert small.optimizer == 12 * dense // 8 + 12 * small.expert_params // 8
    assert large.optimizer == 12 * dense // 8 + 12 * large.expert_params // 4
    assert "EP" in small.communicators and "expert-DP" in small.communicators


def test_moe_dispatcher_buffers_and_expert_activations():
    """alltoall: T k h b (1 + 2 ETP) with T = s / TP, linear in top-k; allgather gathers the EP
    group's tokens; the routed copies' MLP activations are k (ETP h + 3 f_e) per token."""
    from megatron_dgpo.planner.memory_terms import (activation_elements_per_token_layer,
                                                    dispatcher_bytes)

    lay = Layout(tp=2, pp=1, cp=1, dp=8, ep=4, etp=1)
    one = _moe_estimate(lay)
    assert one.dispatch == 4096 // 2 * 2 * 64 * 2 * (1 + 2)
    top4 = with_dims(SMALL_MOE, topk=4)
    assert dispatcher_bytes(top4, 4096, 2, 4, 1) == 2 * one.dispatch
    assert dispatcher_bytes(SMALL_MOE, 4096, 2, 4, 2) == 4096 // 2 * 2 * 64 * 2 * (1 + 4)
    assert dispatcher_bytes(SMALL_MOE, 4096, 2, 4, 1, "allgather") == \
        4096 // 2 * 64 * 2 * (4 + 2 * 2)
    assert dispatcher_bytes(with_dims(SMALL_MOE, experts=0, moe_ffn=0, topk=0), 4096, 2, 1, 1) == 0
    # attention (4 h + 2 a d + 2 g d) + q/k norm inputs (a d + g d) + k (ETP h + 3 f_e)
    assert activation_elements_per_token_layer(SMALL_MOE) == \
        4 * 64 + 2 * 64 + 2 * 32 + (64 + 32) + 2 * (64 + 3 * 32)
    assert one.activations == 1 * 4 * 4096 * activation_elements_per_token_layer(SMALL_MOE) * 2 // 2
    assert one.total > _moe_estimate(lay, micro_batch_tokens=2048).total


def test_moe_engine_holds_every_expert_and_too_small_an_engine_does_not_fit():
    """A colocated engine holds the whole model (every expert) / its TP; a reserve that cannot
    hold one full-length sequence beside the weights is counted at what vLLM would need."""
    cluster = Cluster(gpus_per_node=8, nodes=1, gpu_memory_gb=80)
    work = _small_work(kv_cache_memory_bytes=None, gpu_memory_utilization=0.5)
    reserve, notes = vllm_bytes(SMALL_MOE, cluster, work)
    assert reserve == 40 * GIB and not notes
    huge = PUBLISHED["Qwen/Qwen3-235B-A22B"].description
    reserve, notes = vllm_bytes(huge, cluster, replace_work(work, rollout_tp=4,
                                                            gpu_memory_utilization=0.75))
    weights = param_count(huge) * 2 // 4
    assert reserve > weights > 60 * GIB and "would not start" in notes[0]


def replace_work(work: Workload, **changes) -> Workload:
    return replace(work, **changes)


def test_moe_plan_searches_expert_parallelism_and_the_cli_fixes_it(capsys):
    """Every MoE candidate has EP | experts and EP x ETP | GPUs per stage; --expert-parallel
    fixes EP; the published 30B-A3B needs EP to fit 80 GB; dense models refuse the flags."""
    from megatron_dgpo.planner.search import candidate_layouts

    arch = PUBLISHED["Qwen/Qwen3-30B-A3B"]
    cluster = Cluster(gpus_per_node=8, nodes=2, gpu_memory_gb=80)
    work = _small_work(rollout_tp=None)
    layouts = candidate_layouts(arch, cluster, work)
    experts = arch.description.dims.experts
    assert layouts and all(experts % lay.ep == 0 and (16 // lay.pp) % (lay.ep * lay.etp) == 0
                           and lay.etp in (1, lay.tp) for lay in layouts)
    assert {lay.ep for lay in candidate_layouts(arch, cluster, work, expert_parallel=4)} == {4}
    recipe = os.path.join(ROOT, "recipes", "qwen3_30b_a3b.yaml")
    code, out, _ = _run_main(capsys, [recipe, "--gpus-per-node", "8", "--nodes", "2",
                                      "--gpu-memory-gb", "80", "--expert-parallel", "4",
                                      "--json"])
    assert {lay["layout"]["ep"] for lay in json.loads(out)["layouts"]} == {4}
    code, _, err = _run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--gpu-memory-gb",
                                      "80", "--expert-parallel", "2"])
    assert code == 2 and "need an MoE model" in err
