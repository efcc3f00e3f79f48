"""megatron_dgpo/plan.py: ``dgpo-plan``'s exit status and messages: a recipe that does not
fit, the recompute switch it proposes, bad flags and recipe input, dedicated engines on the
14B recipes, and the attention backend (refused as the trainer refuses it, in the report and
``--json``)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from megatron_dgpo.plan import main
from megatron_dgpo.recipe import load_recipe
from tests.planner._inputs import RECIPE_14B, RECIPE_14B_ASYNC, ROOT, run_main


def test_14b_on_one_24gb_gpu_does_not_fit(capsys):
    code, out, _ = run_main(capsys, [RECIPE_14B, "rollout.tensor_parallel_size=1",
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
    code, out, _ = run_main(capsys, [RECIPE_14B, "model.recompute_activations=false",
                                      "rollout.placement=separate",
                                      "rollout.gpu_memory_utilization=0.3",
                                      "--gpus-per-node", "8", "--gpu-memory-gb", "64"])
    assert code == 0
    assert "as configured, no layout fits" in out
    assert "model.recompute_activations=true" in out.split("set:")[1]


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
    code, _, err = run_main(capsys, [RECIPE_14B, "train.micro_batch_tokns=4"] + base)
    assert code == 2 and "train.micro_batch_tokns" in err and "micro_batch_tokens" in err
    code, _, err = run_main(capsys, [RECIPE_14B, "model.path=org/unknown-7B"] + base)
    assert code == 2 and "model.path 'org/unknown-7B'" in err and "--hf-config" in err
    code, _, err = run_main(capsys, [str(tmp_path / "missing.yaml")] + base)
    assert code == 2 and "missing.yaml" in err
    code, _, err = run_main(capsys, [RECIPE_14B, "--hf-config", str(tmp_path)] + base)
    assert code == 2 and "--hf-config" in err
    code, _, err = run_main(capsys, [RECIPE_14B, "rollout.tensor_parallel_size=16"] + base)
    assert code == 2 and "rollout.tensor_parallel_size=16" in err


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
    assert [t["placement"] for t in plan["step_times"]] == ["colocated", "dedicated",
                                                            "one-step-off", "partial"]
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
    assert "--mean-response-fraction must be in (0, 1)" in capsys.readouterr().err


@pytest.mark.parametrize("recipe, code, verdict", [
    ("recipes/tiny_gpu.yaml", 0, "<- pick"), (RECIPE_14B, 1, "DOES NOT FIT")])
def test_the_module_path_users_type_runs_the_command_line(recipe, code, verdict):
    """``python -m megatron_dgpo.plan`` (README, docs/planner.md) is dgpo-plan itself: its table
    and its exit status, not a module that imports and exits 0 silently."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "megatron_dgpo.plan", os.path.join(ROOT, recipe),
                           "rollout.tensor_parallel_size=1", "--gpus-per-node", "1",
                           "--gpu-memory-gb", "80"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert verdict in proc.stdout and "TP1 PP1 CP1 DP1" in proc.stdout


def _trainer_refusal(capability, requested="auto", **stack):
    """What ``gpu_flags.attention_backend`` raises for the 14B recipe (bf16) on the image's
    stack with this GPU generation: the trainer's own start-up message."""
    import torch

    from megatron_dgpo.runtime.gpu_flags import GPU, attention_backend

    platform = replace(GPU, compute_capability=capability, device_name="A100-80GB", **stack)
    with pytest.raises(ValueError) as refused:
        attention_backend(platform, requested, dtype=torch.bfloat16, environ={})
    return str(refused.value)


def test_an_attention_backend_the_gpus_cannot_run_is_refused_not_planned(capsys):
    """``auto`` on an A100 without flash-attn (``--flash-attn none``) and ``fused`` on an A100:
    the trainer would stop at start-up, so no layout is picked (nor estimated: none would run);
    the report is the trainer's own message with its fix, and the exit status 1."""
    args = [RECIPE_14B, "--gpus-per-node", "8", "--nodes", "4", "--gpu-memory-gb", "80"]
    code, out, _ = run_main(capsys, args + ["--flash-attn", "none"])
    expected = _trainer_refusal((8, 0), flash_attention="",
                                flash_attention_error="flash-attn is not installed")
    assert code == 1 and "<- pick" not in out and "TP4 PP1" not in out
    assert f"DOES NOT RUN: the trainer would stop at start-up with: {expected}" in out
    for needed in ("flash-attn==2.8.3", "FLASH_ATTN_CUDA_ARCHS=80",
                   "model.attention_backend=unfused"):
        assert needed in expected
    assert main(args + ["--flash-attn", "none", "--json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["pick"] is None and plan["layouts"] == [] and plan["step_times"] == []
    assert plan["attention"]["backend"] is None and plan["attention"]["refusal"] == expected
    assert plan["attention"]["requested"] == "auto"

    code, out, _ = run_main(capsys, args + ["model.attention_backend=fused"])
    assert code == 1 and _trainer_refusal((8, 0), "fused") in out
    assert "cuDNN fused attention takes packed (THD) rows only on sm90" in out
    # an H100 runs cuDNN's fused attention without flash-attn
    assert main(args + ["--flash-attn", "none", "--hardware", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"]["backend"] == "fused"


def test_json_and_header_carry_the_attention_backend(capsys):
    """``--json``'s "attention": the request, the backend the activations are counted for and
    the GPU it was decided on; the table's header says it; ``--flash-attn here`` judges this
    environment's flash-attn as Transformer-Engine would."""
    from megatron_dgpo.runtime.gpu_flags import distribution_version, flash_attention_status

    args = [RECIPE_14B, "--gpus-per-node", "8", "--nodes", "4", "--gpu-memory-gb", "80"]
    for extra, backend in (([], "flash"), (["--hardware", "h100"], "fused"),
                           (["model.attention_backend=unfused"], "unfused"),
                           (["model.without_transformer_engine=true"], "local")):
        assert main(args + extra + ["--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["attention"]["backend"] == backend and plan["attention"]["refusal"] == ""
        assert plan["workload"]["attention"] == backend
        gpu = "H100-80GB-SXM, sm90" if "h100" in extra else "A100-80GB, sm80"
        assert plan["attention"]["basis"].startswith(f"{gpu}, flash-attn 2.8.3 (--flash-attn image")
        scores = plan["pick"]["attention_scores_gib"]
        assert (scores > 0) == (backend in ("unfused", "local"))
    # the local spec's dense [S, S] per layer: the recipe's TP 4 no longer fits (docs/planner.md)
    own, tp = plan["recipe_layout"]["gib"]["total"], plan["pick"]["layout"]["tp"]
    doc = " ".join(open(os.path.join(ROOT, "docs", "planner.md")).read().split())
    assert own > 80 and f"TP 4 ({own:.1f} GiB) no longer fits and the pick is TP {tp}." in doc
    code, out, _ = run_main(capsys, args + ["model.attention_backend=unfused", "--explain"])
    assert code == 0
    assert "attention: unfused (model.attention_backend=unfused; [s, s] tensors per layer) on " \
           "A100-80GB, sm80" in out
    assert "2 sequence(s) padded to S = 10240, a / t = 10 heads" in out

    found, _ = flash_attention_status(distribution_version("flash-attn"), (8, 0),
                                      flash_attn_3=distribution_version("flash-attn-3"))
    code, out, _ = run_main(capsys, args + ["--flash-attn", "here"])
    assert code == (0 if found else 1)
    assert ("attention: flash" in out) == bool(found) and ("DOES NOT RUN" in out) != bool(found)


def test_cli_prices_a_schedule_other_than_the_recipes(capsys):
    """``--staleness K --partial`` marks partial rollouts at k = K as the run's schedule, with its
    speed-up over the synchronous colocated step, and names the share of responses older than K
    below the least k that admits them all; ``--staleness 0`` marks the synchronous dedicated
    step, ``--staleness 3`` without ``--partial`` one-step-off (and says why). On the colocated
    4-node recipe the marked row is on its fastest split. ``--truncated-fraction`` sets the
    share at the cap; one no distribution has exits 2 naming the flag."""
    args = [RECIPE_14B_ASYNC, "--gpus-per-node", "8", "--nodes", "30", "--gpu-memory-gb", "80"]
    assert main(args + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {s["label"]: s for s in plan["schedules"]}
    priced = [s for s in plan["schedules"] if s["priced"]]
    assert [s["placement"] for s in priced] == ["partial"]  # the recipe's k = 4 with partial
    assert plan["schedule"] == {"max_staleness": 4, "partial": True}
    base = rows["synchronous, colocated"]["step_s"]
    for s in plan["schedules"]:
        assert s["speed_up"] == pytest.approx(base / s["step_s"])
    partial = next(s for s in plan["schedules"] if s["placement"] == "partial")
    k_min = partial["staleness"]
    assert k_min >= 2 and partial["step_s"] < rows["one-step-off, k=1"]["step_s"]

    code, out, _ = run_main(capsys, args + ["--staleness", "2", "--partial"])
    marked = _marked(out)
    assert code == 0 and len(marked) == 1
    assert marked[0].startswith("partial rollouts, k=2") and \
        marked[0].endswith("<- rollout.max_staleness=2 with rollout.partial")
    assert f"max_staleness >= {k_min} admits every response; at k = 2" in out
    code, out, _ = run_main(capsys, args + ["--staleness", "0"])
    assert [line.split("  ")[0] for line in _marked(out)] == \
        ["synchronous, dedicated"]
    code, out, _ = run_main(capsys, args + ["--staleness", "3"])
    assert "k = 3 without partial rollouts is priced as one-step-off" in out
    assert [line.split("  ")[0] for line in _marked(out)] == \
        ["one-step-off, k=1"]

    code, out, _ = run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--nodes", "4",
                                      "--gpu-memory-gb", "80", "--staleness", "2", "--partial"])
    assert code == 0
    assert [line.split("  ")[0] for line in _marked(out)] == \
        ["partial rollouts, k=2, fastest split"]

    assert main(args + ["--truncated-fraction", "0.02", "--json"]) == 0
    assert "2.0% of them at the cap" in json.loads(capsys.readouterr().out)["step_time_basis"]
    code, _, err = run_main(capsys, args + ["--truncated-fraction", "0.6"])
    assert code == 2 and "--truncated-fraction" in err and "mean / cap" in err
    code, _, err = run_main(capsys, [RECIPE_14B, "--gpus-per-node", "8", "--nodes", "4",
                                      "--gpu-memory-gb", "80", "--partial"])
    assert code == 2 and "--partial needs --staleness K >= 1" in err


def _marked(out: str) -> list[str]:
    """The step-time rows marked as the run's schedule."""
    return [line for line in out.splitlines() if "<- rollout.max_staleness" in line]


def test_the_schedule_is_the_recipes_unless_the_flags_name_another():
    """``run_schedule``: the recipe's ``rollout.max_staleness`` and ``rollout.partial``;
    ``--staleness K`` names another schedule whole (partial only with ``--partial``), and
    ``--partial`` alone turns partial rollouts on at the recipe's k."""
    from megatron_dgpo.plan import run_schedule

    async_ = load_recipe(RECIPE_14B_ASYNC)
    assert run_schedule(async_) == (4, True)
    assert run_schedule(async_, 2) == (2, False) and run_schedule(async_, 2, True) == (2, True)
    assert run_schedule(async_, partial=False) == (4, False)
    one_step_off = load_recipe(RECIPE_14B_ASYNC, ["rollout.max_staleness=1", "rollout.partial=false"])
    assert run_schedule(one_step_off, partial=True) == (1, True)
    assert run_schedule(load_recipe(RECIPE_14B)) == (0, False)


def test_benchmarks_readme_has_plan_schedules_rows():
    """benchmarks/plan_schedules.py's rows (dgpo-plan --json's "schedules" for the 14B and 32B
    recipes on A100s) are benchmarks/README.md's table, and the 14B recipe on 30 nodes gains from
    partial rollouts over one-step-off as docs/planner.md#schedules says."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plan_schedules", os.path.join(ROOT, "benchmarks", "plan_schedules.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    readme = open(os.path.join(ROOT, "benchmarks", "README.md")).read()
    for recipe, nodes in bench.CASES:
        for row in bench.rows(recipe, nodes):
            assert row in readme, row
    own = {s["placement"]: s for s in bench.schedules("dgpo_14b_async", 30, "a100")}
    assert own["partial"]["speed_up"] > own["one-step-off"]["speed_up"] > 1
    assert own["partial"]["over_bound"] == 0 and own["partial"]["staleness"] == \
        own["partial"]["min_staleness"]
