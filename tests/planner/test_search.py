"""megatron_dgpo/planner/search.py: the paper's 14B recipe on 8 x 80 GB and the layout picked,
DP dividing the dedicated engines, MoE candidates' expert parallelism, CP layouts searched and
priced for 32k responses, and the step-time
estimate of the 14B recipes (as benchmarks/bench_async.py prints it)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.inputs import GIB, Cluster, Workload
from megatron_dgpo.planner.parameters import param_count
from megatron_dgpo.planner.peak import estimate
from megatron_dgpo.planner.search import candidate_layouts, make_plan, step_time_estimate
from megatron_dgpo.recipe import load_recipe
from tests.planner._inputs import (R1_14B, RECIPE_14B, RECIPE_14B_ASYNC, ROOT, dedicated_work,
                                   run_main, small_work)


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

    code, out, _ = run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--nodes", "1",
                                      "--gpu-memory-gb", "80"])
    assert code == 0
    assert f"{lay}" in out and "<- pick" in out and "pick: " in out
    assert f"parallel.tensor_parallel={lay.tp} parallel.pipeline_parallel={lay.pp}" in out

    code, out, _ = run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--gpu-memory-gb",
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
    # context parallelism is searched too: with the recipe's engines of 4 GPUs inside a TP
    # group (TP 4 or 8) a node leaves room for CP 2
    assert {row["layout"]["cp"] for row in data["layouts"]} == {1, 2}


def test_dp_must_divide_the_dedicated_engines():
    """Each DP replica refits and samples with its own share of the engines
    (``rollout.placement.DedicatedLayout``): layouts whose DP does not divide them are not
    candidates, and when none is left the hint says why."""
    cluster = Cluster(gpus_per_node=8, nodes=30, gpu_memory_gb=80, rollout_gpus=80)
    work = dedicated_work(rollout_tp=4, responses_per_update=256)
    dps = {lay.dp for lay in candidate_layouts(R1_14B, cluster, work)}
    assert dps and all(20 % d == 0 for d in dps) and 20 in dps and 40 not in dps
    none_left = make_plan(R1_14B, replace(cluster, rollout_gpus=64), work)
    assert none_left.pick is None and "DP must divide the 16 dedicated engines" in none_left.hint


def test_moe_plan_searches_expert_parallelism_and_the_cli_fixes_it(capsys):
    """Every MoE candidate has EP | experts and EP x ETP | GPUs per stage; --expert-parallel
    fixes EP; the published 30B-A3B needs EP to fit 80 GB; dense models refuse the flags."""
    from megatron_dgpo.planner.search import candidate_layouts

    arch = PUBLISHED["Qwen/Qwen3-30B-A3B"]
    cluster = Cluster(gpus_per_node=8, nodes=2, gpu_memory_gb=80)
    work = small_work(rollout_tp=None)
    layouts = candidate_layouts(arch, cluster, work)
    experts = arch.description.dims.experts
    assert layouts and all(experts % lay.ep == 0 and (16 // lay.pp) % (lay.ep * lay.etp) == 0
                           and lay.etp in (1, lay.tp) for lay in layouts)
    assert {lay.ep for lay in candidate_layouts(arch, cluster, work, expert_parallel=4)} == {4}
    recipe = os.path.join(ROOT, "recipes", "qwen3_30b_a3b.yaml")
    code, out, _ = run_main(capsys, [recipe, "--gpus-per-node", "8", "--nodes", "2",
                                      "--gpu-memory-gb", "80", "--expert-parallel", "4",
                                      "--json"])
    assert {lay["layout"]["ep"] for lay in json.loads(out)["layouts"]} == {4}
    code, _, err = run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--gpu-memory-gb",
                                      "80", "--expert-parallel", "2"])
    assert code == 2 and "need an MoE model" in err


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


def test_the_14b_recipe_fits_with_flash_attention_but_not_with_the_unfused_one():
    """The 14B recipe on 4 nodes of A100 80GB at its 16384-token rows, without recompute: TP4
    PP1 DP8 fits with FlashAttention, what ``auto`` runs on an A100 of the image; with
    ``model.attention_backend=unfused`` the same layout keeps every layer's [S, S] tensors
    (47 x 8.0 + 11.9 GiB) and nothing fits without recompute."""
    from megatron_dgpo.planner.inputs import Layout
    from megatron_dgpo.planner.search import plan_attention
    from megatron_dgpo.planner.steptime import HARDWARE

    cluster, layout = Cluster(8, 4, 80), Layout(4, 1, 1, 8)
    a100 = HARDWARE["a100"]
    plans = {}
    for backend in ("auto", "unfused"):
        run = load_recipe(RECIPE_14B, ["model.recompute_activations=false",
                                       f"model.attention_backend={backend}"])
        work, basis, refusal = plan_attention(Workload.from_recipe(run), a100)
        assert not refusal and "A100-80GB, sm80, flash-attn 2.8.3" in basis
        plans[work.attention] = (estimate(PUBLISHED[run.model.path], cluster, layout, work),
                                 make_plan(PUBLISHED[run.model.path], cluster, work,
                                           recipe_tp=4))
    flash, flash_plan = plans["flash"]
    unfused, unfused_plan = plans["unfused"]
    assert flash.fits and flash.attention_scores == 0
    assert flash_plan.pick.layout == layout and flash_plan.required_overrides == []
    assert not unfused.fits
    assert unfused.attention_scores == 416_913_817_600  # test_memory_terms' hand numbers
    assert unfused.activations - flash.activations == 48 * 197_132_288 * 2 // 4 + 416_913_817_600
    # the plan then needs recompute (one layer's [S, S] tensors at a time), and says why
    assert unfused_plan.required_overrides == ["model.recompute_activations=true"]
    assert "no layout fits" in unfused_plan.as_configured
    assert unfused_plan.pick.attention_scores == 12_792_627_200


@pytest.mark.parametrize("recipe", ["dgpo_1.5b", "dgpo_14b", "dgpo_32b", "qwen3_30b_a3b",
                                    "tiny_gpu"])
def test_shipped_recipes_plan_as_before_on_the_image(recipe):
    """The GPU recipes run ``auto`` on the pinned image: FlashAttention on an A100, cuDNN fused
    on an H100, both linear in tokens, so their plans are those of the linear model (the
    workload's default backend) term for term, with no [s, s] tensors."""
    from megatron_dgpo.plan import tiny_model_config
    from megatron_dgpo.planner.catalogue import architecture_for
    from megatron_dgpo.planner.search import plan_attention
    from megatron_dgpo.planner.steptime import HARDWARE

    run = load_recipe(os.path.join(ROOT, "recipes", f"{recipe}.yaml"))
    model = architecture_for(run, tiny_model_config(run))
    cluster, linear = Cluster(8, 4, 80), Workload.from_recipe(run)
    before = make_plan(model, cluster, linear).as_dict()["layouts"]
    for hardware, backend in (("a100", "flash"), ("h100", "fused")):
        work, _, refusal = plan_attention(linear, HARDWARE[hardware])
        assert (work.attention, refusal) == (backend, "")
        after = make_plan(model, cluster, work).as_dict()["layouts"]
        assert after == before and all(row["attention_scores_gib"] == 0 for row in after)


def test_cp_layouts_are_searched_and_priced_for_32k_responses():
    """Qwen3-32B with 32k-token responses on 8 x 8 A100-80GB (the 32k recipes' rows and
    engines, no recompute): CP layouts are candidates, a CP layout holds less than CP 1 at the same
    TP x PP (activations and logits over c, weights and gradients whole, the optimizer over
    D c), nothing without CP leaves headroom, so the step-time model picks among all, and the
    pick's CP is printed."""
    from megatron_dgpo.planner.steptime import HARDWARE, StepShape

    model = PUBLISHED["Qwen/Qwen3-32B"]
    cluster = Cluster(gpus_per_node=8, nodes=8, gpu_memory_gb=80)
    work = Workload(micro_batch_tokens=34816, responses_per_update=256, max_sequence=34816,
                    recompute=False, rollout_tp=8, gpu_memory_utilization=0.7,
                    offload_training_state=True)
    layouts = candidate_layouts(model, cluster, work)
    assert {lay.cp for lay in layouts} == {1, 2, 4, 8}
    by_layout = {(e.layout.tp, e.layout.pp, e.layout.cp): e
                 for e in (estimate(model, cluster, lay, work) for lay in layouts)}
    cp1, cp2 = by_layout[(8, 1, 1)], by_layout[(8, 1, 2)]
    assert cp2.total < cp1.total and cp2.activations < cp1.activations
    assert (cp2.weights, cp2.grads) == (cp1.weights, cp1.grads)
    assert cp2.optimizer == cp1.optimizer  # D c = 4 x 2 = 8, as D = 8 at CP 1
    assert "CP" in cp2.communicators and "DP x CP" in cp2.communicators

    shape = StepShape(prompts=512, group_size=8, max_response_tokens=32768,
                      mean_prompt_tokens=200, mean_response_tokens=16384, updates=16,
                      micro_batch_tokens=34816)
    plan = make_plan(model, cluster, work, recipe_tp=8, shape=shape, hw=HARDWARE["a100"])
    assert not any(e.fits_with(0.1) for e in plan.estimates if e.layout.cp == 1)
    assert plan.pick.layout.cp > 1 and plan.pick.fits_with(0.1)
    assert plan.layout_step_s and str(plan.pick.layout) in plan.layout_step_s
    assert "By the step-time model" in plan.explanation
    from megatron_dgpo.planner.report import format_table

    assert f"parallel.context_parallel={plan.pick.layout.cp}" in format_table(plan, 0.1)


def _recipe_plan(recipe: str, overrides: list[str], nodes: int, max_cp: int = 8):
    """``dgpo-plan``'s pick and colocated step on 8 x 80 GB A100 nodes, without its console."""
    from megatron_dgpo.planner.catalogue import architecture_for
    from megatron_dgpo.planner.search import estimate_step_times, plan_attention
    from megatron_dgpo.planner.steptime import HARDWARE, StepShape

    run, hw = load_recipe(os.path.join(ROOT, "recipes", recipe), overrides), HARDWARE["a100"]
    work = plan_attention(Workload.from_recipe(run), hw)[0]
    shape = StepShape.from_recipe(run)
    plan = make_plan(architecture_for(run), Cluster(8, nodes, 80), work, max_cp=max_cp,
                     shape=shape, hw=hw)
    return plan, estimate_step_times(plan, shape, hw)[0]


def test_docs_cp_figures_are_the_codes():
    """docs/planner.md#context-parallelism's Qwen3-32B at 32k on 64 A100s, before CP (c = 1, as
    ``--max-cp 1``) and after, and benchmarks/README.md's table of the 32k recipes."""
    doc = " ".join((open(os.path.join(ROOT, "docs", "planner.md")).read()).split())
    bench = open(os.path.join(ROOT, "benchmarks", "README.md")).read()
    qwen = ["model.path=Qwen/Qwen3-32B", "rollout.max_response_tokens=32768",
            "train.micro_batch_tokens=34816"]
    no_offload = qwen + ["train.offload_training_state=false"]
    before, before_step = _recipe_plan("qwen3_8b.yaml", no_offload, 8, max_cp=1)
    after, after_step = _recipe_plan("qwen3_8b.yaml", no_offload, 8)
    assert f"{before.pick.layout} at {before.pick.total / GIB:.1f} of 80 GiB" in doc
    assert not before.pick.fits_with(0.1) and after.pick.layout.cp > 1
    assert (f"picks {after.pick.layout} at {after.pick.total / GIB:.1f} GiB, "
            f"{after_step.step_s:.0f} s per step against {before.pick.layout}'s "
            f"{before_step.step_s:.0f} s") in doc
    cp, cp_step = _recipe_plan("dgpo_32b.yaml", qwen + ["model.recompute_activations=false"], 8)
    full, full_step = _recipe_plan("dgpo_32b.yaml", qwen, 8)
    assert (f"{cp.pick.layout} fits at {cp.pick.total / GIB:.1f} GiB, {cp_step.step_s:.0f} s per "
            f"step against {full_step.step_s:.0f} s for {full.pick.layout} with full recompute "
            f"({full.pick.total / GIB:.1f} GiB)") in doc
    for name in ("qwen3_8b_32k", "dgpo_14b_32k", "dgpo_32b_32k"):
        plan, step = _recipe_plan(f"{name}.yaml", [], 4)
        cells = (f"| {name} | {plan.pick.layout} | off | {plan.pick.total / GIB:.1f} | "
                 f"{step.step_s:.0f} ({step.generation_s:.0f} / {step.training_s:.0f} / "
                 f"{step.refit_s:.0f}) |")
        assert cells in bench, cells
