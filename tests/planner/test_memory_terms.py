"""megatron_dgpo/planner/memory_terms.py: activations with and without sequence parallelism, the
published bytes-per-parameter figures, the MoE dispatcher's buffers and routed activations, and
vLLM's reserve for an MoE engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.inputs import GIB, Cluster, Layout
from megatron_dgpo.planner.memory_terms import (activation_bytes, grad_bytes, optimizer_bytes,
                                                vllm_bytes, weight_bytes)
from megatron_dgpo.planner.parameters import param_count
from tests.planner._inputs import SMALL, SMALL_MOE, moe_estimate, small_work, with_dims


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


def test_moe_dispatcher_buffers_and_expert_activations():
    """alltoall: T k h b (1 + 2 ETP) with T = s / TP, linear in top-k; allgather gathers the EP
    group's tokens; the routed copies' MLP activations are k (ETP h + 3 f_e) per token."""
    from megatron_dgpo.planner.memory_terms import (activation_elements_per_token_layer,
                                                    dispatcher_bytes)

    lay = Layout(tp=2, pp=1, cp=1, dp=8, ep=4, etp=1)
    one = moe_estimate(lay)
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
    assert one.total > moe_estimate(lay, micro_batch_tokens=2048).total


def test_moe_engine_holds_every_expert_and_too_small_an_engine_does_not_fit():
    """A colocated engine holds the whole model (every expert) / its TP; a reserve that cannot
    hold one full-length sequence beside the weights is counted at what vLLM would need."""
    cluster = Cluster(gpus_per_node=8, nodes=1, gpu_memory_gb=80)
    work = small_work(kv_cache_memory_bytes=None, gpu_memory_utilization=0.5)
    reserve, notes = vllm_bytes(SMALL_MOE, cluster, work)
    assert reserve == 40 * GIB and not notes
    huge = PUBLISHED["Qwen/Qwen3-235B-A22B"].description
    reserve, notes = vllm_bytes(huge, cluster, replace(work, rollout_tp=4,
                                                            gpu_memory_utilization=0.75))
    weights = param_count(huge) * 2 // 4
    assert reserve > weights > 60 * GIB and "would not start" in notes[0]
