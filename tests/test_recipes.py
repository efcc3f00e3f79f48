"""The paper's recipes (and the 32B/70B ones beyond it) load, carry Appendix B's settings, and
their layouts fit the models they name.

References are independent of the code under test: the paper's numbers (Appendix B, Table 5)
written here, and the public architectures of the five DeepSeek-R1-Distill models.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_dgpo.algorithm.losses import TOKEN_METHODS
from megatron_dgpo.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

# name -> (hub id, DGPO n, m, paper LR or None where the paper has none,
#          layers, attention heads, KV heads) of the model's public config.json
PAPER = {
    "dgpo_1.5b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 2, 2, 1.0e-6, 28, 12, 2),
    "dgpo_7b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 1, 2, 4.63e-7, 28, 28, 4),
    "dgpo_14b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", 1, 2, 3.27e-7, 48, 40, 8),
    "dgpo_32b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", 1, 2, None, 64, 40, 8),
    "dgpo_70b": ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", 1, 2, None, 80, 64, 8),
}
GPUS_PER_NODE = 8  # the 8 x 80 GB nodes the recipes are laid out for


def _path(name: str) -> Path:
    return RECIPES / f"{name}.yaml"


def _sig3(x: float) -> str:
    return f"{x:.2e}"  # three significant digits


def test_the_five_recipes_exist():
    assert sorted(p.stem for p in RECIPES.glob("dgpo_*.yaml")
                  if not p.stem.endswith(("_async", "_32k"))) == sorted(PAPER)


def test_async_14b_recipe_is_the_14b_run_with_dedicated_engines_and_partial_rollouts(capsys):
    """recipes/dgpo_14b_async.yaml: every setting of dgpo_14b.yaml but where and when it
    generates (and what that changes: the layout, no offloading, the behaviour weight), laid out
    for the paper's 30 nodes, where dgpo-plan fits it with the recipe's own layout, its 10
    rollout nodes are the balanced split, and partial rollouts at the recipe's k are the fastest
    schedule and the least staleness that admits every response."""
    import json

    from megatron_dgpo.plan import main as dgpo_plan

    sync, async_ = load_recipe(_path("dgpo_14b")), load_recipe(_path("dgpo_14b_async"))
    ro = async_.rollout
    assert (ro.placement, ro.num_gpus, ro.max_staleness, ro.partial) == ("dedicated", 80, 4, True)
    assert async_.algorithm.rollout_correction == "tis" and not async_.train.offload_training_state
    assert async_.algorithm.loss == sync.algorithm.loss and async_.optimizer == sync.optimizer
    assert async_.data == sync.data and async_.model == sync.model
    assert replace(async_.train, offload_training_state=True) == sync.train
    assert replace(ro, placement="colocated", num_gpus=0, max_staleness=0, partial=False,
                   tensor_parallel_size=4, gpu_memory_utilization=0.75) == sync.rollout
    header = _path("dgpo_14b_async").read_text().split("\n\n")[0]
    assert "RECIPE=recipes/dgpo_14b_async.yaml sbatch --nodes=30 slurm/train.sbatch" in header
    assert "tools/launch.py" in header and "-m megatron_dgpo.train recipes/dgpo_14b_async.yaml" in header
    assert dgpo_plan([str(_path("dgpo_14b_async")), "--gpus-per-node", "8", "--nodes", "30",
                      "--gpu-memory-gb", "80", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    lay = out["pick"]["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"]) == (async_.parallel.tensor_parallel,
                                                 async_.parallel.pipeline_parallel, 20)
    assert out["dedicated_engine"]["fits"] and out["balanced_one_step_off"]["rollout_gpus"] == 80
    fastest = min(out["schedules"], key=lambda s: s["step_s"])
    assert (fastest["placement"], fastest["staleness"], fastest["priced"]) == ("partial", 4, True)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_recipe_has_the_papers_settings(name):
    hub, n, m, _, _, _, _ = PAPER[name]
    cfg = load_recipe(_path(name))
    assert cfg.model.path == hub and cfg.model.tiny is None
    assert cfg.model.dtype == "bfloat16"
    assert cfg.algorithm.method == "dgpo"
    loss = cfg.algorithm.loss
    assert (loss.eps_low, loss.eps_high, loss.n, loss.m) == (0.2, 0.2, n, m)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_response_tokens) == (1.0, 1.0, 8192)
    assert cfg.rollout.engine == "vllm"
    opt = cfg.optimizer
    assert (opt.adam_beta1, opt.adam_beta2, opt.clip_grad) == (0.9, 0.95, 1.0)
    assert cfg.train.seed == 42
    # 512 prompts per rollout batch, 32 per mini-batch: the paper's 16 updates per rollout batch
    assert (cfg.train.rollout_batch_prompts, cfg.train.mini_batch_prompts) == (512, 32)
    assert cfg.train.rollout_batch_prompts // cfg.train.mini_batch_prompts == 16
    assert cfg.train.micro_batch_tokens >= cfg.rollout.max_response_tokens + cfg.rollout.max_prompt_tokens
    assert Path(cfg.data.source).name == "dapo-math-17k.parquet"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_recipe_header_says_how_to_launch_and_what_is_not_from_the_paper(name):
    text = _path(name).read_text()
    header = text.split("\n\n")[0]
    assert f"RECIPE=recipes/{name}.yaml sbatch" in header and "slurm/train.sbatch" in header
    assert "tools/launch.py" in header and f"recipes/{name}.yaml" in header
    assert "torchrun" in header and "-m megatron_dgpo.train" in header
    assert "algorithm.method=grpo" in header
    group_line = next(line for line in text.splitlines() if "group_size:" in line)
    assert "NOT stated by the paper" in group_line
    assert "hf download BytedTsinghua-SIA/DAPO-Math-17k" in text


@pytest.mark.parametrize("name", ["dgpo_7b", "dgpo_14b"])
def test_lr_auto_reproduces_the_papers_learning_rate(name):
    cfg = load_recipe(_path(name))
    assert cfg.optimizer.lr == "auto", "the rule, not a copied number, must give the paper's LR"
    lr = cfg.optimizer.learning_rate(cfg.model.nominal_params)
    assert _sig3(lr) == _sig3(PAPER[name][3])  # 4.63e-07, 3.27e-07
    # the same rule in float64 from the paper's own numbers (1e-6 at 1.5B, sqrt(N_ref / N))
    assert lr == pytest.approx(1e-6 * math.sqrt(1.5e9 / cfg.model.nominal_params), rel=1e-12)


def test_1p5b_uses_the_reference_lr_and_larger_models_follow_the_rule():
    assert load_recipe(_path("dgpo_1.5b")).optimizer.lr == pytest.approx(1e-6)
    for name, size in (("dgpo_32b", 32e9), ("dgpo_70b", 70e9)):
        cfg = load_recipe(_path(name))
        assert cfg.optimizer.lr == "auto" and cfg.model.nominal_params == size
        assert cfg.optimizer.learning_rate(size) < load_recipe(_path("dgpo_14b")).optimizer.learning_rate(14e9)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_each_baseline_is_one_override(name):
    base = load_recipe(_path(name))
    for method in TOKEN_METHODS:  # the paper's six; GSPO also takes its aggregation (below)
        cfg = load_recipe(_path(name), [f"algorithm.method={method}"])
        assert cfg.algorithm.method == method
        assert cfg.algorithm.loss == base.algorithm.loss and cfg.train == base.train
    gspo = load_recipe(_path(name), ["algorithm.method=gspo",
                                     "algorithm.loss_aggregation=seq_mean_token_mean"])
    assert gspo.algorithm.loss == base.algorithm.loss and gspo.train == base.train
    loss = base.algorithm.loss  # the paper's CE-GPPO and ASPO constants, with no extra override
    assert (loss.beta1, loss.beta2, loss.aspo_eps_low, loss.aspo_eps_high) == (0.75, 1.0, 0.33, 3.0)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_layout_fits_the_model_and_the_nodes_the_header_asks_for(name):
    _, _, _, _, layers, heads, kv_heads = PAPER[name]
    cfg = load_recipe(_path(name))
    tp, pp, rollout_tp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, cfg.rollout.tensor_parallel_size
    assert tp <= GPUS_PER_NODE and heads % tp == 0 and kv_heads % tp == 0, "TP stays inside a node"
    assert layers % pp == 0
    assert rollout_tp <= GPUS_PER_NODE and heads % rollout_tp == 0
    nodes = int(re.search(r"sbatch --nodes=(\d+)", _path(name).read_text()).group(1))
    world = nodes * GPUS_PER_NODE
    assert world % (tp * pp) == 0
    dp = world // (tp * pp)
    responses = cfg.train.mini_batch_prompts * cfg.rollout.group_size
    assert responses >= dp, "the trainer needs one response per DP rank and mini-batch"
    assert responses % dp == 0, f"a mini-batch's {responses} responses split evenly over DP={dp}"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_layout_is_what_dgpo_plan_picks_for_the_headers_node_count(name, capsys):
    """The recipe and the planner agree: at the node count the header launches with, on
    8 x 80 GB nodes, dgpo-plan picks exactly the recipe's TP x PP (and no CP)."""
    import json

    from megatron_dgpo.plan import main as dgpo_plan

    cfg = load_recipe(_path(name))
    nodes = int(re.search(r"sbatch --nodes=(\d+)", _path(name).read_text()).group(1))
    assert dgpo_plan([str(_path(name)), "--gpus-per-node", str(GPUS_PER_NODE), "--nodes", str(nodes),
                      "--gpu-memory-gb", "80", "--json"]) == 0
    pick = json.loads(capsys.readouterr().out)["pick"]
    assert pick["fits"]
    assert (pick["layout"]["tp"], pick["layout"]["pp"], pick["layout"]["cp"]) == (
        cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, 1)


def test_tiny_gpu_recipe_is_a_five_step_bf16_gpu_run(capsys):
    """recipes/tiny_gpu.yaml (gpu_check.py's end-to-end run): 5 steps, bf16 training and vLLM,
    the distributed optimizer and async saves, at least one save before the end; it fits one
    80 GB GPU with room to spare by the planner."""
    import json

    from megatron_dgpo.plan import main as dgpo_plan

    cfg = load_recipe(RECIPES / "tiny_gpu.yaml")
    assert cfg.train.steps == 5 and cfg.checkpoint.save_every < cfg.train.steps
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.dtype == "bfloat16"
    assert cfg.rollout.engine == "vllm" and cfg.optimizer.use_distributed_optimizer is True
    assert cfg.checkpoint.async_save is True
    assert cfg.model.tiny["hidden_size"] // cfg.model.tiny["num_attention_heads"] % 16 == 0, \
        "TE's fused attention wants a head size that is a multiple of 16"
    assert dgpo_plan([str(RECIPES / "tiny_gpu.yaml"), "--gpus-per-node", "1", "--nodes", "1",
                      "--gpu-memory-gb", "80", "--json"]) == 0
    pick = json.loads(capsys.readouterr().out)["pick"]
    assert pick["fits"] and pick["gib"]["total"] < 0.5 * 80


def test_arithmetic_recipes_chain_task_warm_start_and_rl():
    """recipes/sft_arithmetic.yaml trains on the task's pairs from its initial model and exports
    where recipes/arithmetic_cpu.yaml starts; RL uses the task's prompts, 16 updates per batch
    and the paper's learning-rate rule."""
    from megatron_dgpo.sft import load_sft_recipe

    sft = load_sft_recipe(RECIPES / "sft_arithmetic.yaml")
    rl = load_recipe(RECIPES / "arithmetic_cpu.yaml")
    task = Path(sft.sft.data).parent
    assert Path(sft.model.path) == task / "initial_model"
    assert Path(rl.model.path) == Path(sft.run_dir) / "hf" and sft.checkpoint.export_hf
    assert Path(rl.data.source) == task / "train.jsonl"
    assert rl.train.rollout_batch_prompts // rl.train.mini_batch_prompts == 16
    assert rl.optimizer.lr == "auto" and rl.optimizer.lr_reference == 1e-6


# Qwen3 recipes beyond the paper: name -> (hub id, layers, heads, KV heads, experts or 0)
QWEN3 = {"qwen3_8b": ("Qwen/Qwen3-8B", 36, 32, 8, 0),
         "qwen3_30b_a3b": ("Qwen/Qwen3-30B-A3B", 48, 32, 4, 128)}


@pytest.mark.parametrize("name", sorted(QWEN3))
def test_qwen3_recipe_loads_launches_and_is_what_dgpo_plan_picks(name, capsys):
    """The Qwen3 recipes keep the paper's loss settings, say how to launch, and at the header's
    node count on 8 x 80 GB nodes dgpo-plan picks exactly their TP x PP (x EP x expert TP)."""
    import json

    from megatron_dgpo.plan import main as dgpo_plan

    hub, layers, heads, kv_heads, experts = QWEN3[name]
    cfg = load_recipe(_path(name))
    assert cfg.model.path == hub and cfg.model.dtype == "bfloat16"
    loss = cfg.algorithm.loss
    assert (loss.eps_low, loss.eps_high, loss.n, loss.m) == (0.2, 0.2, 1, 2)
    assert (cfg.train.rollout_batch_prompts, cfg.train.mini_batch_prompts) == (512, 32)
    text = _path(name).read_text()
    header = text.split("\n\n")[0]
    assert f"RECIPE=recipes/{name}.yaml sbatch" in header and "tools/launch.py" in header
    assert "torchrun" in header and "algorithm.method=grpo" in header
    par = cfg.parallel
    assert heads % par.tensor_parallel == 0 and kv_heads % par.tensor_parallel == 0
    assert layers % par.pipeline_parallel == 0
    if experts:
        assert experts % par.expert_parallel == 0 and par.expert_parallel > 1
        assert cfg.model.moe_token_dispatcher == "alltoall" and cfg.model.moe_aux_loss_coeff == 0
    nodes = int(re.search(r"sbatch --nodes=(\d+)", text).group(1))
    assert dgpo_plan([str(_path(name)), "--gpus-per-node", str(GPUS_PER_NODE), "--nodes",
                      str(nodes), "--gpu-memory-gb", "80", "--json"]) == 0
    pick = json.loads(capsys.readouterr().out)["pick"]
    assert pick["fits"] and pick["gib"]["total"] <= 0.9 * 80
    lay = pick["layout"]
    assert (lay["tp"], lay["pp"], lay["cp"]) == (par.tensor_parallel, par.pipeline_parallel, 1)
    if experts:
        assert (lay["ep"], lay["etp"]) == (par.expert_parallel, par.etp)


def test_moe_model_keys_are_checked_and_reach_only_moe_models():
    """model.moe_token_dispatcher / moe_aux_loss_coeff: a bad value names the key; the policy
    passes them as TransformerConfig overrides for an MoE config only (a dense model keeps the
    alltoall dispatcher its variable sequence lengths need, and still builds)."""
    from megatron_dgpo.models.builder import transformer_config_from_hf
    from megatron_dgpo.runtime.config import ConfigError
    from megatron_dgpo.training.policy import model_overrides
    from tests._rank_fns_model import TINY_QWEN2
    from tests.models.test_describe import TINY_QWEN3_MOE

    for bad in ("model.moe_token_dispatcher=ring", "model.moe_aux_loss_coeff=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[1]):
            load_recipe(_path("qwen3_30b_a3b"), [bad])
    cfg = load_recipe(_path("qwen3_30b_a3b"), ["model.moe_token_dispatcher=allgather",
                                               "model.moe_aux_loss_coeff=0.01"]).model
    moe = model_overrides(cfg, TINY_QWEN3_MOE)
    assert (moe["moe_token_dispatcher_type"], moe["moe_aux_loss_coeff"]) == ("allgather", 0.01)
    dense = model_overrides(cfg, TINY_QWEN2)
    assert not any(key.startswith("moe_") for key in dense)
    tc, _ = transformer_config_from_hf(TINY_QWEN2, **dense)
    assert tc.num_moe_experts is None and tc.moe_token_dispatcher_type == "alltoall"
    tc, _ = transformer_config_from_hf(TINY_QWEN3_MOE, **moe)
    assert (tc.moe_token_dispatcher_type, tc.moe_aux_loss_coeff) == ("allgather", 0.01)
    assert tc.moe_router_load_balancing_type == "aux_loss"


# recipes with 32k-token responses: name -> parent
LONG = {"qwen3_8b_32k": "qwen3_8b", "dgpo_14b_32k": "dgpo_14b", "dgpo_32b_32k": "dgpo_32b"}


@pytest.mark.parametrize("name", sorted(LONG))
def test_32k_recipe_is_its_parent_with_the_planners_layout(name):
    """recipes/*_32k.yaml: the parent with 32768-token responses, rows that hold them, DAPO's
    soft overlong punishment over the last 4096 tokens, and
    dgpo-plan's pick at the header's node count on 8 x 80 GB A100s: its TP x PP x CP with
    10% headroom, and its recompute setting the faster of the two by the step-time model."""
    from megatron_dgpo.planner.catalogue import architecture_for
    from megatron_dgpo.planner.inputs import Cluster, Workload
    from megatron_dgpo.planner.search import estimate_step_times, make_plan, plan_attention
    from megatron_dgpo.planner.steptime import HARDWARE, StepShape

    cfg = load_recipe(_path(name))
    par, text = cfg.parallel, _path(name).read_text()
    assert f"RECIPE=recipes/{name}.yaml sbatch" in text.split("\n\n")[0]
    assert cfg.rollout.max_response_tokens == 32768
    assert cfg.train.micro_batch_tokens >= cfg.rollout.max_prompt_tokens + 32768
    parent = load_recipe(_path(LONG[name]), [
        f"run_dir={cfg.run_dir}", "rollout.max_response_tokens=32768",
        f"rollout.max_prompt_tokens={cfg.rollout.max_prompt_tokens}",
        f"train.micro_batch_tokens={cfg.train.micro_batch_tokens}",
        f"model.recompute_activations={str(cfg.model.recompute_activations).lower()}",
        f"parallel.tensor_parallel={par.tensor_parallel}",
        f"parallel.pipeline_parallel={par.pipeline_parallel}",
        f"parallel.context_parallel={par.context_parallel}",
        "algorithm.overlong_penalty_window=4096"])
    assert parent == cfg, ("everything but the lengths, the layout, recompute and DAPO's overlong "
                           "penalty is the parent's")

    nodes = int(re.search(r"sbatch --nodes=(\d+)", text).group(1))
    hw = HARDWARE["a100"]
    cluster = Cluster(GPUS_PER_NODE, nodes, 80)
    model = architecture_for(cfg)

    def step(recompute: bool):
        work = replace(plan_attention(Workload.from_recipe(cfg), hw)[0], recompute=recompute)
        shape = replace(StepShape.from_recipe(cfg), recompute=recompute)
        plan = make_plan(model, cluster, work, shape=shape, hw=hw)
        return plan, estimate_step_times(plan, shape, hw)[0].step_s

    plan, seconds = step(cfg.model.recompute_activations)
    lay = plan.pick.layout
    assert plan.pick.fits_with(0.1) and not plan.required_overrides
    assert (lay.tp, lay.pp, lay.cp) == (par.tensor_parallel, par.pipeline_parallel,
                                        par.context_parallel)
    other, other_seconds = step(not cfg.model.recompute_activations)
    assert other.pick is None or other_seconds >= seconds


def test_gspo_30b_recipe_is_its_parent_with_gspo():
    """recipes/qwen3_30b_a3b_gspo.yaml: the Qwen3-30B-A3B recipe but for GSPO with its paper's
    epsilons and spread; it names its launch."""
    cfg = load_recipe(_path("qwen3_30b_a3b_gspo"))
    assert (cfg.algorithm.method, cfg.algorithm.loss_aggregation) == ("gspo", "seq_mean_token_mean")
    assert (cfg.algorithm.loss.gspo_eps_low, cfg.algorithm.loss.gspo_eps_high) == (3e-4, 4e-4)
    parent = load_recipe(_path("qwen3_30b_a3b"), [
        f"run_dir={cfg.run_dir}", "algorithm.method=gspo",
        "algorithm.loss_aggregation=seq_mean_token_mean"])
    assert parent == cfg
    header = _path("qwen3_30b_a3b_gspo").read_text().split("\n\n")[0]
    assert "RECIPE=recipes/qwen3_30b_a3b_gspo.yaml sbatch" in header
