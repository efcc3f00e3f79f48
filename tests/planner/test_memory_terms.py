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


QWEN14 = PUBLISHED["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"].description  # a = 40, g = 8, d = 128


def test_unfused_attention_tensors_by_hand():
    """Transformer-Engine's unfused attention on the 14B model at TP 4 (a / t = 10 heads),
    16384-token rows of samples up to 10240 tokens: the row holds b = 2 sequences padded to
    S = 10240, n = b (a / t) S^2 = 2 x 10 x 10240^2 = 2,097,152,000 score elements, the padding
    mask b S^2 = 209,715,200 bytes. S < 16384 and b a / t = 20: TE's softmax kernel runs, so a
    layer saves its bf16 probabilities and their masked copy (4 n + mask) and holds the scores
    too while it runs (6 n + mask)."""
    from megatron_dgpo.planner.memory_terms import (attention_score_bytes, score_layer_bytes,
                                                    score_row)

    assert score_row("unfused", 16384, 10240, 4) == (2, 10240)
    assert score_row("flash", 16384, 10240, 4) == score_row("fused", 16384, 10240, 4) == (0, 0)
    saved, live = 8_598_323_200, 12_792_627_200
    assert score_layer_bytes("unfused", 2, 10240, 10) == (saved, live)
    # all 48 layers' saved tensors at peak without recompute, one layer's with it
    assert attention_score_bytes(QWEN14, "unfused", 16384, 48, 1, 4, False,
                                 max_sequence=10240) == 47 * saved + live == 416_913_817_600
    assert attention_score_bytes(QWEN14, "unfused", 16384, 48, 1, 4, True,
                                 max_sequence=10240) == live
    assert attention_score_bytes(QWEN14, "unfused", 16384, 24, 2, 4, False,
                                 max_sequence=10240) == 47 * saved + live  # 2 in flight x 24
    for linear in ("flash", "fused"):
        assert attention_score_bytes(QWEN14, linear, 16384, 48, 1, 4, False,
                                     max_sequence=10240) == 0
    # TP 8: b a / t = 10 is not a multiple of 4, so torch's float32 softmax runs: the fp32
    # probabilities and the masked bf16 ones are saved, (4 + 2) n + mask with n = 1,048,576,000;
    # while running also the scores, their fp32 copy and the bf16 cast, (8 + 4) n + mask
    assert score_layer_bytes("unfused", 2, 10240, 5) == (6_501_171_200, 12_792_627_200)
    # one 16384-token sample: S = 16384 is past the kernel's range, n = 10 x 16384^2
    assert score_row("unfused", 16384, 20000, 4) == (1, 16384)
    assert score_layer_bytes("unfused", 1, 16384, 10) == (16_374_562_816, 32_480_690_176)
    # float32 (unfused is its only TE backend): no casts, 2 b_e n saved, 3 b_e n live
    assert score_layer_bytes("unfused", 1, 16384, 10, 4) == (8 * 2_684_354_560 + 268_435_456,
                                                             12 * 2_684_354_560 + 268_435_456)
    # samples are padded to TP's multiple first: 10239 tokens at TP 4 are 10240
    assert score_row("unfused", 16384, 10239, 4) == (2, 10240)


def test_unfused_activations_add_padded_qkv_and_the_scores():
    """Beside the [S, S] tensors, the unfused attention keeps Q and K, V repeated to every
    query head on the b S padded tokens (3 a d = 15,360 elements each) instead of E's
    a d + 2 g d = 7,168 per token: 3 x 5120 x 20480 - 7168 x 16384 = 197,132,288 elements per
    row and layer, bf16 and sharded over TP 4."""
    flash = activation_bytes(QWEN14, 16384, 48, 1, 4, recompute=True)
    unfused = activation_bytes(QWEN14, 16384, 48, 1, 4, recompute=True, attention="unfused",
                               max_sequence=10240)
    assert unfused - flash == 197_132_288 * 2 // 4 + 12_792_627_200
    no_recompute = activation_bytes(QWEN14, 16384, 48, 1, 4, recompute=False,
                                    attention="unfused", max_sequence=10240)
    assert no_recompute - activation_bytes(QWEN14, 16384, 48, 1, 4, recompute=False) == \
        48 * 197_132_288 * 2 // 4 + 416_913_817_600
    fused = activation_bytes(QWEN14, 16384, 48, 1, 4, recompute=True, attention="fused",
                             max_sequence=10240)
    assert fused == flash  # both linear in tokens: today's model


def test_local_attention_tensors_by_hand():
    """Megatron's local spec (``model.without_transformer_engine``): the whole 16384-token
    row is one [S, S] problem at a / t = 10 heads, n = 10 x 16384^2 = 2,684,354,560. S > 4096:
    torch's float32 softmax, so a layer saves the fp32 probabilities and their bf16 cast
    (6 n) and holds the scores and their fp32 copy too (12 n); each micro-batch keeps its
    [1, 1, S, S] bool row mask (S^2 = 268,435,456 bytes), the GPU Megatron's global score buffer
    (2 n). No sequence parallelism: the local spec's norms refuse it."""
    from megatron_dgpo.planner.memory_terms import (attention_score_bytes,
                                                    megatron_softmax_kernel, score_layer_bytes,
                                                    score_row)

    n = 2_684_354_560
    assert score_row("local", 16384, 10240, 4) == (1, 16384)
    assert score_layer_bytes("local", 1, 16384, 10) == (6 * n, 12 * n)
    assert attention_score_bytes(QWEN14, "local", 16384, 48, 1, 4, True) == \
        12 * n + 268_435_456 + 2 * n
    assert attention_score_bytes(QWEN14, "local", 16384, 24, 2, 4, False) == \
        47 * 6 * n + 12 * n + 2 * 268_435_456 + 2 * n
    # short rows take Megatron's causal softmax kernel: bf16 probabilities only
    assert megatron_softmax_kernel(4096, 8, 2, True)
    assert not megatron_softmax_kernel(4100, 8, 2, True)  # past 4096
    assert not megatron_softmax_kernel(4096, 8, 2, False)  # the kernels did not import
    assert not megatron_softmax_kernel(4096, 10, 2, True)  # heads not a multiple of 4
    assert score_layer_bytes("local", 1, 4096, 8) == (2 * 8 * 4096 ** 2, 4 * 8 * 4096 ** 2)
    # the linear part: no sequence parallelism (the 4 h norm and QKV / fc1 inputs whole on
    # every TP rank, 8.54 GiB under recompute as in the test above), Q, K, V repeated to 40
    # heads (3 a d - (a d + 2 g d) = 8,192 more elements per token, sharded over TP)
    local = activation_bytes(QWEN14, 16384, 48, 1, 4, recompute=True, attention="local")
    no_sp = activation_bytes(QWEN14, 16384, 48, 1, 4, recompute=True, sequence_parallel=False)
    assert local - no_sp == 16384 * 8192 * 2 // 4 + 12 * n + 268_435_456 + 2 * n


def test_te_softmax_kernel_range():
    """Transformer-Engine's ``is_kernel_available`` for the unfused attention's padding-causal
    softmax: 16-bit, 16 < S < 16384, S a multiple of 8, b a / t a multiple of 4."""
    from megatron_dgpo.planner.memory_terms import te_softmax_kernel

    assert te_softmax_kernel(10240, 20, 2)
    assert not te_softmax_kernel(16384, 20, 2)  # S must stay below 16384
    assert not te_softmax_kernel(10244, 20, 2)  # S a multiple of 8
    assert not te_softmax_kernel(10240, 10, 2)  # b a / t a multiple of 4
    assert not te_softmax_kernel(10240, 20, 4)  # float32 scores
    assert te_softmax_kernel(24, 4, 2) and not te_softmax_kernel(16, 4, 2)


def test_docs_quote_the_attention_numbers():
    """docs/planner.md's attention-backend figures for the 14B recipe are the code's."""
    from pathlib import Path

    from megatron_dgpo.planner.memory_terms import attention_score_bytes, score_layer_bytes
    from tests.planner._inputs import ROOT

    doc = " ".join((Path(ROOT) / "docs" / "planner.md").read_text().split())
    saved, live = score_layer_bytes("unfused", 2, 10240, 10)
    held = attention_score_bytes(QWEN14, "unfused", 16384, 48, 1, 4, False, max_sequence=10240)
    tp8_saved, _ = score_layer_bytes("unfused", 2, 10240, 5)
    local = activation_bytes(QWEN14, 16384, 48, 1, 4, True, attention="local")
    assert (f"a layer saves {saved / GIB:.2f} GiB and holds {live / GIB:.2f} GiB while it runs; "
            f"without recompute its 48 layers hold {held / GIB:.1f} GiB") in doc
    assert f"torch's float32 softmax runs: {tp8_saved / GIB:.2f} GiB saved per layer" in doc
    assert f"{local / GIB:.2f} GiB of activations, so on 4 nodes TP 4" in doc
