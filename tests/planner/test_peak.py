"""megatron_dgpo/planner/peak.py: a layout's most loaded GPU term by term, computed by hand
(colocated, separate and dedicated engines, sleeping or awake, offloaded state, MoE expert
parallelism), and a dedicated engine's GPU."""

from __future__ import annotations

from dataclasses import replace

from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.inputs import GIB, Cluster, Layout, Workload
from megatron_dgpo.planner.memory_terms import (activation_bytes, kv_cache_bytes_per_token,
                                                nccl_bytes, vllm_bytes)
from megatron_dgpo.planner.parameters import param_count, stage_params
from megatron_dgpo.planner.peak import dedicated_engine_estimate, estimate
from megatron_dgpo.planner.search import make_plan
from tests.planner._inputs import (R1_14B, RECIPE_14B, SMALL, SMALL_MODEL, SMALL_MOE,
                                   dedicated_work, moe_estimate, small_work)


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
    first = estimate(SMALL_MODEL, cluster, layout, small_work(rollout_placement="separate"))
    assert first.stage == "first" and not first.vllm_sleeps and first.engines == 2
    assert first.weights == 2 * first_params
    assert first.grads == 4 * first_params
    assert first.optimizer == 12 * first_params // (2 * 2)  # sharded over DP x CP
    assert first.activations == in_flight * 2 * tokens * act_token_layer
    assert first.logits == 0 and first.vllm == vllm
    # NCCL: TP, DP x CP (the distributed optimizer's group with CP), CP (the K/V ring), PP,
    # model-parallel (grad norm), world; SMALL is untied, so no embedding group; the engine has
    # 1 GPU, so no vLLM TP group. 32 channels x (4 MiB Simple + 4.69 MiB LL128 + 0.5 MiB LL) each
    assert first.communicators == ["TP", "DP x CP", "CP", "PP", "model-parallel", "world"]
    channel = 4 * 2**20 + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
    assert first.nccl == 6 * 32 * channel
    assert first.cache == int(0.1 * first.activations)  # the allocator's slack
    assert first.graphs == 0  # an awake engine's graphs are inside its reserve
    assert first.total == (2 + 4) * first_params + 12 * first_params // 4 \
        + 2 * 2 * tokens * act_token_layer + first.cache + vllm + first.nccl

    # colocated (the default): an engine of rollout_tp=1 GPU in each of the 16 ranks, on every
    # stage, asleep while training, so a stage holds max(vLLM, activations + logits)
    colocated = [estimate(SMALL_MODEL, cluster, layout, small_work(sleep_mode=s))
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
    eager = estimate(SMALL_MODEL, cluster, layout, small_work(enforce_eager=True))
    assert eager.graphs == 0 and eager.vllm_sleeps
    default_tp = estimate(SMALL_MODEL, cluster, layout, small_work(rollout_tp=None))
    assert default_tp.engines == 16 // 2  # PP 2 with DP 2: one engine of TP GPUs per stage
    assert estimate(SMALL_MODEL, cluster, Layout(tp=8, pp=2, cp=1, dp=1),
                    small_work(rollout_tp=None)).engines == 1  # DP 1: TP x PP per engine

    last = estimate(SMALL_MODEL, cluster, layout, small_work(colocated_rollout=False))
    assert last.stage == "last"
    logits = 2 * tokens * (1024 // 2) * 2  # logits + gradient, bf16, V_pad / TP columns
    workspace = 2 * 256 * 512 * 4  # two float32 [chunk 256, 512] buffers
    assert (last.weights, last.grads, last.optimizer) == \
        (2 * last_params, 4 * last_params, 12 * last_params // 4)
    assert last.activations == 1 * 2 * tokens * act_token_layer  # one micro-batch in flight
    assert last.logits == logits + workspace and last.vllm == 0
    assert last.cache == int(0.1 * (last.activations + logits + workspace)) and last.graphs == 0
    assert last.total == 8_832_960 + last.cache + 6 * 32 * channel  # the six groups above

    # full recompute: each layer's input (h per token) for 2 micro-batches x 2 layers, plus one
    # layer's whole activations while it is recomputed
    assert activation_bytes(SMALL, tokens, 2, 2, 2, recompute=True) == \
        2 * 2 * tokens * 64 * 2 // 2 + tokens * act_token_layer
    # vLLM's reserve from gpu_memory_utilization, and the KV cache it would need:
    # 2 (K, V) x 4 layers x 32 x 2 bytes per token, 4 sequences of 1024 tokens
    reserve, notes = vllm_bytes(SMALL, cluster, small_work(kv_cache_memory_bytes=None,
                                                           max_num_seqs=10 ** 6))
    assert reserve == 40 * GIB
    assert notes and "not max_num_seqs=1000000" in notes[0]
    assert vllm_bytes(SMALL, cluster, small_work(kv_cache_memory_bytes=None))[1] == []
    needed = 4 * 1024 * (2 * 4 * 32 * 2)
    tight, notes = vllm_bytes(SMALL, cluster, small_work(kv_cache_memory_bytes=needed - 1))
    assert tight == 251968 * 2 + needed - 1 and "holds ~3 full-length" in notes[0]


def test_logits_bytes_follow_the_logits_dtype():
    """The logits term uses the dtype the logits reach the kernel in: the model's by default
    (the trainer keeps bf16 logits), fp32 when asked (Float16Module's default output)."""
    cluster = Cluster(gpus_per_node=8, nodes=1, gpu_memory_gb=80)
    layout = Layout(tp=2, pp=1, cp=1, dp=4)
    workspace = 2 * 256 * 512 * 4
    bf16 = estimate(SMALL_MODEL, cluster, layout, small_work(colocated_rollout=False))
    fp32 = estimate(SMALL_MODEL, cluster, layout, small_work(colocated_rollout=False,
                                                        logits_dtype_bytes=4))
    assert bf16.logits == 2 * 4096 * 512 * 2 + workspace
    assert fp32.logits == 2 * 4096 * 512 * 4 + workspace


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


def test_moe_memory_terms_follow_expert_parallelism():
    """Doubling EP halves the expert parameters per GPU and their weights, gradients and
    optimizer state (sharded over expert DP = world / (PP EP ETP)); the dense part stays."""
    from megatron_dgpo.planner.parameters import stage_expert_params

    small, large = (moe_estimate(Layout(tp=2, pp=1, cp=1, dp=8, ep=e, etp=1)) for e in (2, 4))
    assert small.expert_params == 2 * large.expert_params == stage_expert_params(SMALL_MOE, 1, 2)
    dense = stage_params(SMALL_MOE, 2, 1, 0, 2, 1) - small.expert_params
    assert small.weights - large.weights == 2 * large.expert_params
    assert small.grads - large.grads == 4 * large.expert_params
    # expert DP: 16 GPUs / (EP 2) = 8 and / (EP 4) = 4 replicas, dense DP 8
    assert small.optimizer == 12 * dense // 8 + 12 * small.expert_params // 8
    assert large.optimizer == 12 * dense // 8 + 12 * large.expert_params // 4
    assert "EP" in small.communicators and "expert-DP" in small.communicators


def test_dedicated_trainer_has_no_vllm_and_the_engine_gpu_is_estimated_by_hand():
    """The trainer's GPUs hold no engine (no vLLM reserve, no graph pool, nothing asleep), its
    world is the GPUs the engines leave, and stage 0 (the replica's leader) holds the refit
    link; an engine GPU holds vLLM's reserve and its TP + refit-link communicators."""
    cluster = Cluster(gpus_per_node=8, nodes=4, gpu_memory_gb=80, rollout_gpus=8)
    assert (cluster.gpus, cluster.world) == (32, 24)
    work = dedicated_work()
    lay = Layout(tp=4, pp=2, cp=1, dp=3)
    e = estimate(R1_14B, cluster, lay, work)
    assert (e.vllm, e.graphs, e.vllm_sleeps, e.engines) == (0, 0, False, 0)
    assert e.total == (e.weights + e.grads + e.optimizer + e.activations + e.logits + e.cache
                       + e.nccl + e.overhead)
    colocated = estimate(R1_14B, replace(cluster, rollout_gpus=0), lay,
                         replace(work, colocated_rollout=True, rollout_placement="colocated",
                                 rollout_tp=None))
    assert "refit link" not in colocated.communicators and colocated.vllm > 0
    if e.stage == "first":
        assert "refit link" in e.communicators

    eng = dedicated_engine_estimate(R1_14B, cluster, work)
    weights = param_count(R1_14B.description) * 2 // 2
    assert (eng.engines, eng.engine_tp) == (4, 2)
    assert eng.reserve == int(0.85 * 80 * GIB) and eng.weights == weights
    assert eng.kv_cache == int(0.85 * 80 * GIB) - weights
    assert eng.nccl == nccl_bytes(2, 32) and eng.total == eng.reserve + eng.nccl and eng.fits
    # a reserve that cannot hold the weights and one full-length sequence is counted at the
    # least the engine needs, with a note; a reserve above the GPU does not fit
    tiny = dedicated_engine_estimate(R1_14B, cluster, replace(work, gpu_memory_utilization=0.05))
    per_seq = 1024 * kv_cache_bytes_per_token(R1_14B.description) // 2
    assert tiny.reserve == weights + per_seq and "would not start" in tiny.notes[0]
    huge = dedicated_engine_estimate(R1_14B, cluster, replace(work, kv_cache_memory_bytes=90 * GIB))
    assert not huge.fits
    assert dedicated_engine_estimate(R1_14B, cluster, replace(work, rollout_placement="colocated")) is None
    assert dedicated_engine_estimate(R1_14B, replace(cluster, rollout_gpus=0), work) is None
