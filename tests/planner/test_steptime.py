"""megatron_dgpo/planner/steptime.py: the step-time formulas recomputed by hand from round
hardware numbers (synchronous, one-step-off, partial rollouts), the staleness terms against a
simulation, the tail partial rollouts avoid, the generation tail's floor, monotonicity in the
lengths, the MoE decode's touched experts and the seeded sampler's term."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.inputs import GIB
from megatron_dgpo.planner.memory_terms import kv_cache_bytes_per_token
from megatron_dgpo.planner.parameters import param_count
from megatron_dgpo.planner.steptime import (HARDWARE, StepShape, StepTime, active_params,
                                            experts_touched_share, generation_seconds,
                                            generation_terms, partial_generation_terms,
                                            refit_seconds, routed_expert_params, shared_params,
                                            staleness_terms, step_times, training_seconds,
                                            weight_tensors)
from tests.planner._inputs import R1_14B, ROUND, SMALL


def test_step_time_formulas_by_hand():
    """Generation, training and refit of SMALL on ``ROUND`` hardware, from the docstring's
    formulas written out here; then how the placements combine them."""
    n = active_params(SMALL)
    assert n == param_count(SMALL) - 1000 * 64  # the input embedding is a lookup
    kv = kv_cache_bytes_per_token(SMALL)
    assert kv == 4 * 2 * 2 * 16 * 2  # L x (K, V) x g x d x bf16
    shape = StepShape(prompts=8, group_size=4, max_response_tokens=1000, mean_prompt_tokens=100,
                      mean_response_tokens=400, max_num_seqs=4, per_request_seeded_draw=True)
    # 2 engines of 1 GPU: 16 responses each, 4 at a time (max_num_seqs; the KV room holds more):
    # 1200 bulk steps of 4 running, then the tail: the longest of the last wave's 2 x 4
    # responses (``lengths.expected_max``, checked against a Monte Carlo in test_lengths.py)
    # with 4 x 400 / tail running on average; every step reads the weights and its sequences'
    # KV (mean context 100 + E[X^2] / (2 E[X]): a long response is read at more steps), or is
    # compute-bound; plus its fixed cost and the sampler (each seeded request's own kernel:
    # 1e-8 s per row and vocabulary entry)
    lengths = shape.lengths
    context, tail = 100 + lengths.second_moment / 800, lengths.expected_max(8)
    assert 400 < tail < 1000 and context > 100 + 400 / 2

    def step(c, per_row=1e-8):
        return (max((2 * n + c * context * kv) / (1000e9 * 0.5), 2 * n * c / (100e12 * 0.5))
                + 0.001 + c * 1000 * per_row)
    prefill = 2 * n * 16 * 100 / (100e12 * 0.5)
    expected = prefill + 1200 * step(4) + tail * step(1600 / tail)
    got = generation_seconds(SMALL, shape, ROUND, engines=2, engine_tp=1,
                             kv_cache_bytes_per_engine_gpu=1e12)
    assert got == pytest.approx(expected, rel=1e-12)
    # one kernel for the batch (Model Runner V2, seeded or not): 1e-9 per row and vocabulary entry
    batched = generation_seconds(SMALL, replace(shape, per_request_seeded_draw=False), ROUND, engines=2,
                                 engine_tp=1, kv_cache_bytes_per_engine_gpu=1e12)
    assert batched == pytest.approx(prefill + 1200 * step(4, 1e-9) + tail * step(1600 / tail, 1e-9),
                                    rel=1e-12)
    # every response token decoded once: 1200 x 4 + tail x 1600 / tail = 16 x 400 rows sampled
    assert got - batched == pytest.approx(16 * 400 * 1000 * 9e-9, rel=1e-9)
    # a KV cache of 2 responses' room halves the concurrency: more steps, a wave of 2 x 2
    tight = generation_seconds(SMALL, shape, ROUND, engines=2, engine_tp=1,
                               kv_cache_bytes_per_engine_gpu=2 * 500 * kv)
    tail = lengths.expected_max(4)
    assert tight == pytest.approx(prefill + 2800 * step(2) + tail * step(max(1, 800 / tail)),
                                  rel=1e-12)
    # training: 32 responses of 500 tokens, 5 passes (fwd, 2x bwd, recompute, old log-probs)
    shape_rc = replace(shape, recompute=True)
    per_token = 5 * (2 * n + 4 * 4 * 64 * 500 / 2)
    assert training_seconds(SMALL, shape_rc, ROUND, gpus=4) == pytest.approx(
        32 * 500 * per_token / (4 * 100e12 * 0.5), rel=1e-12)
    assert training_seconds(SMALL, shape, ROUND, gpus=4) == pytest.approx(
        32 * 500 * 4 * (2 * n + 4 * 4 * 64 * 250) / (4 * 100e12 * 0.5), rel=1e-12)
    # refit: a fixed cost + the whole model's bytes at the refit bandwidth + a cost per HF
    # tensor (4 layers x (Q, K, V, O, 3 biases, 2 norms, gate, up, down) + embedding, final
    # norm, output = 51); colocated the offloaded state both ways over PCIe, dedicated the
    # broadcast at one NIC's bandwidth
    w = 2 * param_count(SMALL)
    assert weight_tensors(SMALL) == 51
    offl = replace(shape, offloaded_state_bytes_per_gpu=10**9)
    assert refit_seconds(SMALL, offl, ROUND, dedicated=False, engine_tp=2) == pytest.approx(
        3.0 + w / 10e9 + 51 * 0.001 + 2 * 1e9 / 20e9, rel=1e-12)
    assert refit_seconds(SMALL, offl, ROUND, dedicated=True, engine_tp=2) == pytest.approx(
        3.0 + w / 10e9 + 51 * 0.001 + w / 10e9, rel=1e-12)

    colocated, dedicated, one_step_off, partial = step_times(
        SMALL, shape, ROUND, world=8, rollout_gpus=2, engine_tp=1, kv_cache_bytes_per_engine_gpu=1e12)
    assert (colocated.trainer_gpus, dedicated.trainer_gpus, dedicated.rollout_gpus) == (8, 6, 2)
    assert colocated.generation_s == pytest.approx(generation_seconds(
        SMALL, shape, ROUND, engines=8, engine_tp=1, kv_cache_bytes_per_engine_gpu=1e12))
    assert dedicated.generation_s == pytest.approx(got)
    assert dedicated.training_s == pytest.approx(training_seconds(SMALL, shape, ROUND, gpus=6))
    for t in (colocated, dedicated):
        assert t.step_s == pytest.approx(t.generation_s + t.training_s + t.refit_s)
    assert (colocated.trainer_idle_s, colocated.engine_idle_s) == (0.0, 0.0)
    assert (dedicated.trainer_idle_s, dedicated.engine_idle_s) == (dedicated.generation_s,
                                                                  dedicated.training_s)
    gen, train = one_step_off.generation_s, one_step_off.training_s
    assert one_step_off.step_s == pytest.approx(max(gen, train) + one_step_off.refit_s)
    assert one_step_off.trainer_idle_s == max(0.0, gen - train)
    assert one_step_off.engine_idle_s == max(0.0, train - gen)
    assert min(one_step_off.trainer_idle_s, one_step_off.engine_idle_s) == 0.0
    # partial rollouts overlap as one-step-off does, with their own generation
    assert (partial.placement, partial.staleness, partial.training_s) == (
        "partial", 2, one_step_off.training_s)
    assert partial.generation_s == pytest.approx(partial_generation_terms(
        SMALL, shape, ROUND, engines=2, engine_tp=1, kv_cache_bytes_per_engine_gpu=1e12)["total"])
    assert partial.step_s == pytest.approx(max(partial.generation_s, train) + partial.refit_s)
    assert [t.label for t in (colocated, dedicated, one_step_off, partial)] == [
        "synchronous, colocated", "synchronous, dedicated", "one-step-off, k=1",
        "partial rollouts, k=2"]


def test_partial_rollouts_by_hand():
    """Engines that never wait for a batch's tail: 16 responses per engine through 4 slots that
    never empty, 16 x 400 / 4 = 1600 decode steps of 4 at the mean context 100 + E[X^2] / (2
    E[X]); the new prompts' prefill; at each refit the 4 responses in flight re-prefilled
    (prompt + partial response: linear and attention FLOPs). A refit every 1600 decode steps
    against a 1000-token cap: a response crosses at most one, a quarter of them (E[X] / 1600)
    do, so k >= 2 admits all and at k = 1 that quarter is too old."""
    shape = StepShape(prompts=8, group_size=4, max_response_tokens=1000, mean_prompt_tokens=100,
                      mean_response_tokens=400, max_num_seqs=4)
    n, kv = active_params(SMALL), kv_cache_bytes_per_token(SMALL)
    context = 100 + shape.lengths.running_age
    kw = dict(engines=2, engine_tp=1, kv_cache_bytes_per_engine_gpu=1e12)
    terms = partial_generation_terms(SMALL, shape, ROUND, **kw)
    step = (max((2 * n + 4 * context * kv) / (1000e9 * 0.5), 2 * n * 4 / (100e12 * 0.5))
            + 0.001 + 4 * 1000 * 1e-9)
    prefill = 2 * n * 16 * 100 / (100e12 * 0.5)
    reprefill = 4 * context * (2 * n + 2 * 4 * 64 * context) / (100e12 * 0.5)
    assert (terms["concurrent"], terms["decode_steps"]) == (4, 1600)
    assert terms["reprefill_tokens"] == pytest.approx(4 * context)
    assert terms["total"] == pytest.approx(prefill + 1600 * step + reprefill, rel=1e-12)
    assert (terms["staleness"], terms["min_staleness"]) == (2, 2)
    assert terms["interrupted"] == pytest.approx(0.25) and terms["segments"] == pytest.approx(1.25)
    assert terms["over_bound"] == 0.0
    at_one = partial_generation_terms(SMALL, shape, ROUND, staleness=1, **kw)
    assert at_one["over_bound"] == pytest.approx(0.25) and at_one["total"] == terms["total"]
    # the KV cache kept across refits (PipelineRL): no re-prefill
    kept = partial_generation_terms(SMALL, shape, ROUND, reprefill=False, **kw)
    assert kept["reprefill_s"] == 0 and kept["total"] == pytest.approx(prefill + 1600 * step)
    # two responses in flight (over-provisioning) or KV room for two: 3200 decode steps of 2
    for bound in (dict(in_flight=2), dict(kv_cache_bytes_per_engine_gpu=2.5 * context * kv)):
        narrow = partial_generation_terms(SMALL, shape, ROUND, **{**kw, **bound})
        assert (narrow["concurrent"], narrow["decode_steps"]) == (2, 3200)


def test_staleness_terms_against_a_simulation():
    """Responses of the capped lognormal started at a uniform phase of a refit every y decode
    steps: the share interrupted, the segments per response, the largest staleness and the
    share older than k, counted over 200,000 simulated responses."""
    lengths = StepShape(prompts=1, group_size=1, max_response_tokens=8192, mean_prompt_tokens=1,
                        mean_response_tokens=4096).lengths
    rng = np.random.default_rng(0)
    x = np.minimum(np.exp(rng.normal(lengths.mu, lengths.sigma, 200_000)), lengths.cap)
    for y in (1500.0, 3280.0, 10000.0):
        crossed = np.floor((rng.uniform(0, y, x.size) + x) / y)  # refits inside the response
        for k in (1, 2, 4):
            terms = staleness_terms(lengths, y, k)
            assert terms["interrupted"] == pytest.approx((crossed >= 1).mean(), abs=0.005)
            assert terms["segments"] == pytest.approx(1 + crossed.mean(), rel=0.005)
            assert terms["over_bound"] == pytest.approx((1 + crossed > k).mean(), abs=0.005)
        assert terms["min_staleness"] == 1 + crossed.max()


def test_partial_rollouts_decode_the_mean_not_the_tail():
    """At the same mean response a wider spread lengthens the synchronous engines' tail (the
    longest of the batch, up to the cap) while engines running partial rollouts decode n r / c
    steps whatever the spread; on A100s they are faster once the tail reaches past twice the
    mean, and always without the re-prefill."""
    desc, hw = R1_14B.description, HARDWARE["a100"]
    kw = dict(engines=20, engine_tp=4, kv_cache_bytes_per_engine_gpu=60 * GIB)
    tails = []
    for sigma in (0.1, 0.4, 0.6, 1.0):
        shape = StepShape(prompts=512, group_size=8, max_response_tokens=8192,
                          mean_prompt_tokens=200, mean_response_tokens=2048, length_sigma=sigma)
        sync = generation_terms(desc, shape, hw, **kw)
        partial = partial_generation_terms(desc, shape, hw, **kw)
        kept = partial_generation_terms(desc, shape, hw, reprefill=False, **kw)
        assert partial["decode_steps"] == pytest.approx(205 * 2048 / 256)
        assert sync["tail_steps"] == pytest.approx(shape.lengths.expected_max(4100))
        tails.append(sync["tail_steps"])
        assert kept["total"] < sync["total"]
        if sync["tail_steps"] > 2 * 2048:
            assert partial["total"] < sync["total"]
    assert tails == sorted(tails) and tails[0] < 2 * 2048 and tails[-1] == pytest.approx(8192)


def test_generation_has_a_tail_floor_that_more_engines_do_not_shorten():
    """With fewer responses per engine than it decodes at once, every engine still decodes the
    longest response's R steps, each reading all its weights: more engines stop helping, which
    is what makes dedicated engines pay at scale."""
    shape = StepShape(prompts=64, group_size=8, max_response_tokens=8192, mean_prompt_tokens=200,
                      mean_response_tokens=4096, max_num_seqs=256)
    desc = R1_14B.description
    times = [generation_seconds(desc, shape, ROUND, engines=e, engine_tp=4,
                                kv_cache_bytes_per_engine_gpu=60 * GIB) for e in (1, 2, 4, 64, 128)]
    assert times[0] > times[1] > times[2] > times[3] >= times[4]
    floor = 8192 * (2 * active_params(desc) / 4 / (1000e9 * 0.5) + 0.001)
    assert times[4] > floor and times[4] < 1.5 * floor
    # training, in contrast, keeps scaling with its GPUs
    assert training_seconds(desc, shape, ROUND, gpus=64) == pytest.approx(
        training_seconds(desc, shape, ROUND, gpus=32) / 2)


def test_step_times_are_monotonic_in_the_lengths():
    """Longer responses cost more generation and training; a shorter prompt less prefill."""
    base = StepShape(prompts=512, group_size=8, max_response_tokens=8192, mean_prompt_tokens=200,
                     mean_response_tokens=4096, recompute=True)
    longer = replace(base, mean_response_tokens=6000)

    desc = R1_14B.description

    def total(shape):
        return sum(t.step_s for t in step_times(desc, shape, ROUND, world=32, rollout_gpus=8,
                                                  engine_tp=4, kv_cache_bytes_per_engine_gpu=60 * GIB))
    assert total(longer) > total(base) > total(replace(base, mean_prompt_tokens=50))
    assert math.isfinite(total(base))
    assert isinstance(step_times(desc, base, ROUND, world=32, rollout_gpus=0, engine_tp=4,
                                 kv_cache_bytes_per_engine_gpu=GIB)[0], StepTime)


QWEN3_MOE = PUBLISHED["Qwen/Qwen3-30B-A3B"].description


def test_moe_decode_reads_the_experts_its_sequences_touch():
    """share(c) = 1 - (1 - k/E)^c: one sequence reads k of E experts, 128 read nearly all;
    an engine of 128 running sequences reads ~all 30.5B parameters per step, not the 3.3B
    active ones."""
    k_over_e = 8 / 128
    assert experts_touched_share(QWEN3_MOE, 1) == pytest.approx(k_over_e)
    assert experts_touched_share(QWEN3_MOE, 16) == pytest.approx(1 - (1 - k_over_e) ** 16)
    assert experts_touched_share(QWEN3_MOE, 128) > 0.9997
    assert experts_touched_share(PUBLISHED["Qwen/Qwen3-32B"].description, 1) == 1.0
    shape = StepShape(prompts=64, group_size=32, max_response_tokens=3968, mean_prompt_tokens=128,
                      mean_response_tokens=3000, max_num_seqs=1024)
    hw = HARDWARE["h100"]
    terms = generation_terms(QWEN3_MOE, shape, hw, engines=32, engine_tp=2,
                             kv_cache_bytes_per_engine_gpu=20 * GIB)
    assert terms["concurrent"] == 64
    weights = 2 * (shared_params(QWEN3_MOE) + routed_expert_params(QWEN3_MOE)
                   * experts_touched_share(QWEN3_MOE, 64))
    assert weights > 2 * 0.98 * 30e9  # ~every expert at 64 running sequences
    # more engines with fewer sequences each touch fewer experts per step
    few = generation_terms(QWEN3_MOE, replace(shape, prompts=2), hw, engines=32, engine_tp=2,
                           kv_cache_bytes_per_engine_gpu=20 * GIB)
    assert few["concurrent"] == 2 and few["tail_step_s"] < terms["tail_step_s"]


def test_seeded_sampling_term_and_its_switch():
    """Seeded requests drawn one kernel each (vLLM's Model Runner V1: 8.9 ms for 1024 rows of
    152064 on an H200) instead of in one kernel for the batch (0.88 ms; Model Runner V2, vLLM
    0.32's default on CUDA, and the planner's default) cost that on every decode step."""
    desc = PUBLISHED["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"].description
    shape = StepShape(prompts=128, group_size=8, max_response_tokens=8192, mean_prompt_tokens=200,
                      mean_response_tokens=4096, max_num_seqs=1024)
    hw = HARDWARE["h100"]
    kw = dict(engines=1, engine_tp=4, kv_cache_bytes_per_engine_gpu=60 * GIB)
    batched = generation_terms(desc, shape, hw, **kw)
    seeded = generation_terms(desc, replace(shape, per_request_seeded_draw=True), hw, **kw)
    rows = seeded["bulk_steps"] * seeded["concurrent"] + seeded["tail_steps"] * seeded["tail_running"]
    assert seeded["sampling_s"] == pytest.approx(rows * desc.dims.vocab * 8.9e-3 / (1024 * 152064))
    assert seeded["total"] - batched["total"] == pytest.approx(
        rows * desc.dims.vocab * (8.9e-3 - 0.88e-3) / (1024 * 152064))
    # 1024 seeded rows at vocab 152064: 8.9 ms a step
    per_step = seeded["bulk_step_s"] - batched["bulk_step_s"]
    assert per_step == pytest.approx(seeded["concurrent"] * (8.9e-3 - 0.88e-3) / 1024
                                     * desc.dims.vocab / 152064)


def test_cp_ring_by_hand_and_where_it_crosses_nodes():
    """``cp_exchange_terms`` on round hardware: (c - 1) / c of a row's K and V of this TP rank's
    KV heads per layer, over NVLink while t c fits a node, else the network; only what the
    attention's own FLOPs do not hide slows the layer. Grows with c; 0 at c = 1."""
    from megatron_dgpo.planner.steptime import cp_exchange_terms

    desc = PUBLISHED["Qwen/Qwen3-32B"].description  # g d = 8 x 128, a d = 64 x 128, L = 64
    row, seq = 32768, 16384.0
    terms = {c: cp_exchange_terms(desc, ROUND, row_tokens=row, mean_sequence=seq, tp=4, cp=c)
             for c in (1, 2, 4)}
    assert terms[1]["comm_s"] == 0 and terms[1]["cp_efficiency"] == 1
    # c = 2 at TP 4: half the row's K and V of 2 KV heads, bf16, over NVLink (t c = 8)
    assert terms[2]["comm_s"] == pytest.approx(0.5 * row * 2 * 1024 / 4 * 2 / 100e9)
    assert terms[2]["link"] == "nvlink" and terms[4]["link"] == "network"
    flops = 100e12 * 0.5
    assert terms[2]["attention_s"] == pytest.approx(row * 2 * 8192 * seq / 8 / flops)
    comms = [terms[c]["comm_s"] for c in (1, 2, 4)]
    assert comms == sorted(comms) and comms[0] < comms[1] < comms[2]
    # at TP 4 x CP 4 the ring crosses nodes (10 GB/s): the exposed part costs efficiency
    exposed = max(0.0, terms[4]["comm_s"] - terms[4]["attention_s"])
    assert terms[4]["cp_efficiency"] == pytest.approx(1 / (1 + exposed / terms[4]["layer_s"]))
    assert terms[4]["cp_efficiency"] <= terms[2]["cp_efficiency"] <= 1


def test_training_with_cp_divides_the_work_and_charges_the_ring():
    """The same GPUs at TP 4 x CP 2 and TP 8 x CP 1: FLOPs divide over all of them either
    way; CP's ring over NVLink is cheaper than TP 8's all-gathers for a GQA model; the DP x CP
    gradient reduce hides behind backward."""
    from megatron_dgpo.planner.steptime import training_terms

    desc = PUBLISHED["Qwen/Qwen3-32B"].description
    shape = StepShape(prompts=512, group_size=8, max_response_tokens=32768,
                      mean_prompt_tokens=200, mean_response_tokens=16384, updates=16,
                      micro_batch_tokens=34816)
    hw = HARDWARE["a100"]
    cp2 = training_terms(desc, shape, hw, gpus=64, tp=4, pp=1, cp=2)
    tp8 = training_terms(desc, shape, hw, gpus=64, tp=8, pp=1, cp=1)
    assert 0 < cp2["cp_comm_ms"] and cp2["cp_link"] == "nvlink"
    assert 0.9 < cp2["cp_efficiency"] <= 1 and tp8["cp_efficiency"] == 1
    assert cp2["total"] < tp8["total"]
    assert cp2["grad_reduce_s"] > 0 and cp2["grad_reduce_exposed_s"] == 0
