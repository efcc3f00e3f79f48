"""dgpo-plan with dedicated rollout engines (``rollout.placement: dedicated``) and its step-time
model (megatron_dgpo.planner.steptime): the trainer planned on the GPUs the engines leave, the engines'
own GPU, the step-time formulas recomputed by hand from round hardware numbers, and the CLI on
the 14B recipes."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest

from megatron_dgpo.models import describe
from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.cli import main
from megatron_dgpo.planner.inputs import GIB, Cluster, Layout, Workload
from megatron_dgpo.planner.memory_terms import kv_cache_bytes_per_token, nccl_bytes
from megatron_dgpo.planner.parameters import param_count
from megatron_dgpo.planner.peak import dedicated_engine_estimate, estimate
from megatron_dgpo.planner.search import candidate_layouts, make_plan, step_time_estimate
from megatron_dgpo.planner.steptime import (Hardware, StepShape, StepTime, active_params,
                                            generation_seconds, refit_seconds, step_times,
                                            training_seconds, weight_tensors)
from megatron_dgpo.recipe import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_14B = os.path.join(ROOT, "recipes", "dgpo_14b.yaml")
RECIPE_14B_ASYNC = os.path.join(ROOT, "recipes", "dgpo_14b_async.yaml")
R1_14B = PUBLISHED["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"]

# h=64, L=4, a=4 heads of d=16, g=2 KV groups, f=96, V=1000, untied, QKV bias (Qwen2)
SMALL = describe(dict(model_type="qwen2", hidden_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                      vocab_size=1000, tie_word_embeddings=False))
# round numbers, so that the expected seconds below are arithmetic on the page
ROUND = Hardware("round", peak_tflops=100, hbm_gb_per_s=1000, nvlink_gb_per_s=100,
                 network_gb_per_s=10, pcie_gb_per_s=20, train_mfu=0.5,
                 decode_hbm_efficiency=0.5, decode_mfu=0.5, prefill_mfu=0.5, wake_sleep_s=3.0,
                 decode_step_overhead_s=0.001, refit_gb_per_s=10, refit_s_per_tensor=0.001,
                 sampling_s_per_row_vocab=1e-9, seeded_sampling_s_per_row_vocab=1e-8)


def _dedicated_work(**changes) -> Workload:
    base = dict(micro_batch_tokens=4096, responses_per_update=64, max_sequence=1024,
                colocated_rollout=False, rollout_placement="dedicated",
                rollout_tp=2, gpu_memory_utilization=0.85, overhead_bytes=GIB)
    base.update(changes)
    return Workload(**base)


# --------------------------------------------------------------------------- memory


def test_dedicated_trainer_has_no_vllm_and_the_engine_gpu_is_estimated_by_hand():
    """The trainer's GPUs hold no engine (no vLLM reserve, no graph pool, nothing asleep), its
    world is the GPUs the engines leave, and stage 0 (the replica's leader) holds the refit
    link; an engine GPU holds vLLM's reserve and its TP + refit-link communicators."""
    cluster = Cluster(gpus_per_node=8, nodes=4, gpu_memory_gb=80, rollout_gpus=8)
    assert (cluster.gpus, cluster.world) == (32, 24)
    work = _dedicated_work()
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


def test_dp_must_divide_the_dedicated_engines():
    """Each DP replica refits and samples with its own share of the engines
    (``rollout.placement.DedicatedLayout``): layouts whose DP does not divide them are not
    candidates, and when none is left the hint says why."""
    cluster = Cluster(gpus_per_node=8, nodes=30, gpu_memory_gb=80, rollout_gpus=80)
    work = _dedicated_work(rollout_tp=4, responses_per_update=256)
    dps = {lay.dp for lay in candidate_layouts(R1_14B, cluster, work)}
    assert dps and all(20 % d == 0 for d in dps) and 20 in dps and 40 not in dps
    none_left = make_plan(R1_14B, replace(cluster, rollout_gpus=64), work)
    assert none_left.pick is None and "DP must divide the 16 dedicated engines" in none_left.hint


# --------------------------------------------------------------------------- step time


def test_step_time_formulas_by_hand():
    """Generation, training and refit of SMALL on ``ROUND`` hardware, from the docstring's
    formulas written out here; then how the placements combine them."""
    n = active_params(SMALL)
    assert n == param_count(SMALL) - 1000 * 64  # the input embedding is a lookup
    kv = kv_cache_bytes_per_token(SMALL)
    assert kv == 4 * 2 * 2 * 16 * 2  # L x (K, V) x g x d x bf16
    shape = StepShape(prompts=8, group_size=4, max_response_tokens=1000, mean_prompt_tokens=100,
                      mean_response_tokens=400, max_num_seqs=4)
    # 2 engines of 1 GPU: 16 responses each, 4 at a time (max_num_seqs; the KV room holds more):
    # 1200 bulk steps of 4 running, then the longest response's 1000-step tail with 4 x 400 /
    # 1000 = 1.6 running on average; every step reads the weights and its sequences' KV
    # (mean context 100 + 400 / 2), or is compute-bound; plus its fixed cost and the sampler
    # (seeded: 1e-8 s per row and vocabulary entry)

    def step(c, per_row=1e-8):
        return (max((2 * n + c * 300 * kv) / (1000e9 * 0.5), 2 * n * c / (100e12 * 0.5))
                + 0.001 + c * 1000 * per_row)
    prefill = 2 * n * 16 * 100 / (100e12 * 0.5)
    expected = prefill + 1200 * step(4) + 1000 * step(1.6)
    assert 1200 * 4 + 1000 * 1.6 == 16 * 400  # every response token decoded once
    got = generation_seconds(SMALL, shape, ROUND, engines=2, engine_tp=1,
                             kv_cache_bytes_per_engine_gpu=1e12)
    assert got == pytest.approx(expected, rel=1e-12)
    # unseeded requests: the batched draw's 1e-9 per row and vocabulary entry
    batched = generation_seconds(SMALL, replace(shape, seeded_sampling=False), ROUND, engines=2,
                                 engine_tp=1, kv_cache_bytes_per_engine_gpu=1e12)
    assert batched == pytest.approx(prefill + 1200 * step(4, 1e-9) + 1000 * step(1.6, 1e-9),
                                    rel=1e-12)
    assert got - batched == pytest.approx((1200 * 4 + 1000 * 1.6) * 1000 * 9e-9, rel=1e-9)
    # a KV cache of 2 responses' room halves the concurrency: more steps
    tight = generation_seconds(SMALL, shape, ROUND, engines=2, engine_tp=1,
                               kv_cache_bytes_per_engine_gpu=2 * 500 * kv)
    assert tight == pytest.approx(prefill + 2800 * step(2) + 1000 * step(1), rel=1e-12)
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

    colocated, dedicated, one_step_off = step_times(
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


def test_step_time_estimate_of_the_14b_recipes():
    """The async 14B recipe on the paper's 30 nodes: one-step-off beats colocated (the tail),
    and its 80 rollout GPUs are the balanced split; the synchronous dedicated step is the sum.
    A recipe without dedicated engines is refused, naming the field."""
    run = load_recipe(RECIPE_14B_ASYNC)
    est = step_time_estimate(run, Cluster(gpus_per_node=8, nodes=30, gpu_memory_gb=80))
    col, sync, off, bal = (est[k] for k in ("colocated", "synchronous", "one_step_off", "balanced"))
    assert (col["trainer_gpus"], sync["trainer_gpus"], sync["rollout_gpus"]) == (240, 160, 80)
    assert sync["step_s"] == pytest.approx(sync["generation_s"] + sync["training_s"] + sync["refit_s"])
    assert off["step_s"] == pytest.approx(max(off["generation_s"], off["training_s"]) + off["refit_s"])
    assert off["step_s"] < col["step_s"] / 1.2 and off["step_s"] < sync["step_s"] / 1.8
    assert bal["rollout_gpus"] == 80 and bal["step_s"] == pytest.approx(off["step_s"])
    with pytest.raises(ValueError, match="rollout.placement: dedicated"):
        step_time_estimate(load_recipe(RECIPE_14B), Cluster(8, 4, 80))


# --------------------------------------------------------------------------- CLI


def test_cli_plans_the_async_recipe_and_the_colocated_one(capsys):
    """dgpo-plan on recipes/dgpo_14b_async.yaml (30 nodes): the trainer's pick on 160 GPUs with
    the recipe's own layout, the engines' GPU, and the step-time table; on dgpo_14b.yaml (4
    nodes) the balanced one-step-off is slower than colocated, and the table says so."""
    run = load_recipe(RECIPE_14B_ASYNC)
    args = ["--gpus-per-node", "8", "--nodes", "30", "--gpu-memory-gb", "80"]
    assert main([RECIPE_14B_ASYNC, *args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    lay = plan["pick"]["layout"]
    assert (lay["tp"], lay["pp"]) == (run.parallel.tensor_parallel, run.parallel.pipeline_parallel)
    assert lay["tp"] * lay["pp"] * lay["dp"] == 160 and plan["pick"]["gib"]["vllm"] == 0
    eng = plan["dedicated_engine"]
    assert (eng["engines"], eng["engine_tp"], eng["fits"]) == (20, 4, True)
    assert [t["placement"] for t in plan["step_times"]] == ["colocated", "dedicated", "one-step-off"]
    assert plan["balanced_one_step_off"]["rollout_gpus"] == 80

    assert main([RECIPE_14B_ASYNC, *args]) == 0
    text = capsys.readouterr().out
    assert "20 dedicated vLLM engine(s) of 4 GPU(s) on the last 80 GPUs" in text
    assert "one-step-off is fastest with rollout.num_gpus=80" in text

    assert main([RECIPE_14B, "--gpus-per-node", "8", "--nodes", "4", "--gpu-memory-gb", "80",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    colocated = plan["step_times"][0]
    assert len(plan["step_times"]) == 1 and colocated["placement"] == "colocated"
    assert plan["balanced_one_step_off"]["step_s"] > colocated["step_s"]
    # H100: every phase faster
    assert main([RECIPE_14B, "--gpus-per-node", "8", "--nodes", "4", "--gpu-memory-gb", "80",
                 "--json", "--hardware", "h100"]) == 0
    assert json.loads(capsys.readouterr().out)["step_times"][0]["step_s"] < colocated["step_s"]


def test_cli_refuses_a_rollout_that_leaves_no_trainer_and_engines_that_do_not_fit(capsys):
    args = ["--gpus-per-node", "8", "--nodes", "2", "--gpu-memory-gb", "80"]
    assert main([RECIPE_14B_ASYNC, "rollout.num_gpus=16", *args]) == 2
    assert "rollout.num_gpus=16 leaves no GPU for the trainer on 2 x 8 GPUs" in capsys.readouterr().err
    assert main([RECIPE_14B_ASYNC, "rollout.num_gpus=8", "rollout.kv_cache_memory_bytes=85899345920",
                 *args]) == 1
    assert "DOES NOT FIT (lower rollout.gpu_memory_utilization)" in capsys.readouterr().out
    # the 4-node 14B recipe with one rollout node: its TP 4 gives 6 replicas for 2 engines
    assert main([RECIPE_14B, "rollout.placement=dedicated", "rollout.num_gpus=8",
                 "--gpus-per-node", "8", "--nodes", "4", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "the recipe's own layout TP4 PP1 has 6 DP replicas, which cannot share 2 dedicated" in out
    assert "pick: TP4 PP3 CP1 DP2" in out
    with pytest.raises(SystemExit) as exc:  # argparse's own exit
        main([RECIPE_14B_ASYNC, "--mean-response-fraction", "0", *args])
    assert exc.value.code == 2
    assert "--mean-response-fraction must be in (0, 1]" in capsys.readouterr().err


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


def test_bench_async_prints_the_planner_rows(capsys):
    """benchmarks/bench_async.py --planner-only: the 14B rows of benchmarks/README.md's table,
    one-step-off's speedup over the synchronous dedicated step as the estimate says."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_async", os.path.join(ROOT, "benchmarks",
                                                                              "bench_async.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--planner-only"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| planner")]
    assert [r.split(" | ")[1] for r in rows] == ["synchronous", "one-step-off",
                                                 "colocated, all 240 GPUs"]
    est = step_time_estimate(load_recipe(RECIPE_14B_ASYNC), Cluster(8, 30, 80))
    speedup = est["synchronous"]["step_s"] / est["one_step_off"]["step_s"]
    assert f"| {speedup:.2f}x |" in rows[1]
