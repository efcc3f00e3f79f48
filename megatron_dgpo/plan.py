"""``dgpo-plan`` (``python -m megatron_dgpo.plan``): the TP x PP x CP x DP (x EP) layouts a
recipe's trainer can run on a cluster, each GPU's peak memory term by term, the pick and why
(``megatron_dgpo.planner``); for vLLM rollout every schedule's step time and speed-up
(``--staleness`` / ``--partial`` price one other than the recipe's). Exit status: 0 fits, 1 not (or the attention
backend cannot run there), 2 bad input. The formulas: docs/planner.md.

    dgpo-plan recipes/dgpo_14b.yaml --gpus-per-node 8 --nodes 4 --gpu-memory-gb 80 [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from megatron_dgpo.planner.catalogue import architecture_for
from megatron_dgpo.planner.inputs import GIB, Cluster, Workload
from megatron_dgpo.planner.memory_terms import FLASH_ATTN_SOURCES
from megatron_dgpo.planner.peak import dedicated_engines, dedicated_split_problem
from megatron_dgpo.planner.report import explain, explain_step_time, format_table
from megatron_dgpo.planner.search import (balanced_schedules, estimate_step_times, make_plan,
                                          plan_attention, refused_plan)
from megatron_dgpo.planner.steptime import HARDWARE, StepShape
from megatron_dgpo.runtime.errors import reported_as


def _positive_int(flag):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {text!r}")
        return value
    return parse


def _non_negative_int(flag):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 0, got {text!r}")
        return value
    return parse


def _float_in(flag, low, high, what):
    """argparse type: a float with low <= value < high (``what`` says so in the error)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value < high:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dgpo-plan",
        description="Per-GPU memory of every TP x PP x CP x DP layout of a recipe on a "
                    "cluster, and the layout to use (formulas: docs/planner.md).")
    ap.add_argument("recipe", help="recipe YAML (as for dgpo-train)")
    ap.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    ap.add_argument("--gpus-per-node", type=_positive_int("--gpus-per-node"), required=True)
    ap.add_argument("--nodes", type=_positive_int("--nodes"), default=1)
    ap.add_argument("--gpu-memory-gb", required=True,
                    type=_float_in("--gpu-memory-gb", 1e-9, math.inf, "a positive number"),
                    help="memory of one GPU in GiB (80 for an A100/H100 80GB)")
    ap.add_argument("--headroom", type=_float_in("--headroom", 0.0, 1.0, "in [0, 1)"), default=0.1,
                    help="fraction of GPU memory to keep free in the preferred layout")
    ap.add_argument("--overhead-gb", type=_float_in("--overhead-gb", 0.0, math.inf, ">= 0"),
                    default=1.0,
                    help="per-GPU allowance for the CUDA context and the cuBLAS/TE workspaces "
                         "(GiB)")
    ap.add_argument("--cuda-graph-gb", type=_float_in("--cuda-graph-gb", 0.0, math.inf, ">= 0"),
                    default=1.0, help="a vLLM engine's CUDA-graph pool per GPU (GiB), kept "
                                      "while it sleeps")
    ap.add_argument("--nccl-channels", type=_positive_int("--nccl-channels"), default=32,
                    help="NCCL channels per communicator (32: NVLink)")
    ap.add_argument("--allocator-slack", default=0.1,
                    type=_float_in("--allocator-slack", 0.0, 1.0, "in [0, 1)"),
                    help="the caching allocator's share on top of activations + logits")
    ap.add_argument("--expert-parallel", type=_positive_int("--expert-parallel"),
                    help="MoE: plan only this expert-parallel size (default: search the sizes "
                         "that divide the experts and the GPUs per pipeline stage)")
    ap.add_argument("--expert-tensor-parallel", type=_positive_int("--expert-tensor-parallel"),
                    help="MoE: plan only this expert tensor-parallel size (default: search 1 "
                         "and the layout's TP)")
    ap.add_argument("--max-cp", type=int, choices=[1, 2, 4, 8], default=8,
                    help="the largest context-parallel size searched (default 8; 1: no CP)")
    ap.add_argument("--hardware", choices=sorted(HARDWARE), default="a100",
                    help="GPU type (default a100, the paper's): the step-time estimate's peaks "
                         "and the generation that decides the attention backend of the "
                         "training rows (a100 sm80: FlashAttention; h100 sm90: cuDNN fused)")
    ap.add_argument("--flash-attn", choices=list(FLASH_ATTN_SOURCES), default="image",
                    help="the flash-attn of the training GPUs, for the attention backend "
                         "(model.attention_backend): image (default) the pinned image's "
                         "flash-attn 2.8.3; here the one installed where dgpo-plan runs, judged "
                         "as Transformer-Engine 2.17.1 judges it; none a cluster without it. A "
                         "backend that cannot run there is refused as the trainer refuses it; "
                         "the unfused and local backends add [s, s] tensors per layer")
    ap.add_argument("--mean-prompt-tokens", default=200.0,
                    type=_float_in("--mean-prompt-tokens", 1.0, math.inf, ">= 1"),
                    help="step time: the mean prompt in tokens (default 200, at most "
                         "rollout.max_prompt_tokens)")
    ap.add_argument("--mean-response-fraction", default=0.5,
                    type=_float_in("--mean-response-fraction", 1e-9, 1.0, "in (0, 1)"),
                    help="step time: the mean response as a fraction of "
                         "rollout.max_response_tokens (default 0.5)")
    ap.add_argument("--truncated-fraction",
                    type=_float_in("--truncated-fraction", 1e-9, 1.0, "in (0, 1)"),
                    help="step time: the share of responses cut at rollout.max_response_tokens "
                         "(a run's rollout/truncated_frac; below the mean response fraction). "
                         "Default: a log-space spread of 0.6 (docs/planner.md#response-lengths)")
    ap.add_argument("--staleness", type=_non_negative_int("--staleness"),
                    help="step time: price rollout.max_staleness=K instead of the recipe's "
                         "schedule (0 synchronous, 1 one-step-off; partial rollouts only with "
                         "--partial, at this bound)")
    ap.add_argument("--partial", action="store_true", default=None,
                    help="step time: price partial rollouts (rollout.partial) whatever the "
                         "recipe says")
    ap.add_argument("--explain", action="store_true",
                    help="after the table, every term of the pick with its formula")
    ap.add_argument("--hf-config", help="config.json (or its folder) giving the architecture, "
                                        "instead of model.path")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


@reported_as("dgpo-plan")
def main(argv: list[str] | None = None) -> int:
    """``dgpo-plan``: 0 when a layout fits (and dedicated engines their GPUs), 1 when not or
    when the recipe's attention backend cannot run on ``--hardware`` with ``--flash-attn``'s
    FlashAttention (the trainer's refusal is the report), 2 on bad input."""
    from megatron_dgpo.recipe import load_recipe
    from megatron_dgpo.runtime.config import ConfigError

    ap = _parser()
    args = ap.parse_intermixed_args(argv)
    try:
        run = load_recipe(args.recipe, args.overrides)
        model = architecture_for(run, args.hf_config or tiny_model_config(run))
    except (ConfigError, ValueError) as exc:
        print(f"dgpo-plan: error: {exc}", file=sys.stderr)
        return 2
    work = replace(Workload.from_recipe(run), overhead_bytes=int(args.overhead_gb * GIB),
                   cuda_graph_bytes=int(args.cuda_graph_gb * GIB),
                   nccl_channels=args.nccl_channels, allocator_slack=args.allocator_slack)
    # rollout.num_gpus is 0 unless placement is dedicated (the recipe's own validation)
    cluster = Cluster(args.gpus_per_node, args.nodes, args.gpu_memory_gb,
                      rollout_gpus=run.rollout.num_gpus)
    if cluster.rollout_gpus >= cluster.gpus:
        print(f"dgpo-plan: error: rollout.num_gpus={cluster.rollout_gpus} leaves no GPU for the "
              f"trainer on {cluster.nodes} x {cluster.gpus_per_node} GPUs", file=sys.stderr)
        return 2
    if (work.colocated_rollout or cluster.rollout_gpus) and (work.rollout_tp or 1) > cluster.gpus_per_node:
        print(f"dgpo-plan: error: rollout.tensor_parallel_size={work.rollout_tp} exceeds "
              f"--gpus-per-node {cluster.gpus_per_node}", file=sys.stderr)
        return 2
    if not model.description.dims.moe and (args.expert_parallel or args.expert_tensor_parallel):
        print(f"dgpo-plan: error: --expert-parallel / --expert-tensor-parallel need an MoE "
              f"model; {model.name} is dense", file=sys.stderr)
        return 2
    hw = HARDWARE[args.hardware]
    work, basis, refusal = plan_attention(work, hw, args.flash_attn)
    try:
        shape = (StepShape.from_recipe(run, mean_prompt_tokens=args.mean_prompt_tokens,
                                       mean_response_fraction=args.mean_response_fraction,
                                       truncated_fraction=args.truncated_fraction)
                 if run.rollout.engine == "vllm" else None)
    except ValueError as exc:
        print(f"dgpo-plan: error: --truncated-fraction / --mean-response-fraction: {exc}",
              file=sys.stderr)
        return 2
    schedule = run_schedule(run, args.staleness, args.partial)
    if schedule == (0, True):
        print("dgpo-plan: error: --partial needs --staleness K >= 1 (k = 0 is synchronous; the "
              "table's partial-rollout row shows the least k that admits every response)",
              file=sys.stderr)
        return 2
    if refusal:
        plan = refused_plan(model, cluster, work, refusal, basis=basis)
    else:
        plan = make_plan(model, cluster, work, headroom=args.headroom,
                         recipe_tp=run.parallel.tensor_parallel,
                         recipe_pp=run.parallel.pipeline_parallel,
                         recipe_ep=run.parallel.expert_parallel, recipe_etp=run.parallel.etp,
                         expert_parallel=args.expert_parallel,
                         expert_tensor_parallel=args.expert_tensor_parallel,
                         recipe_cp=run.parallel.context_parallel, max_cp=args.max_cp,
                         shape=shape, hw=hw)
        plan.attention_basis = basis
    if shape is not None and plan.pick is not None:
        if plan.required_overrides:
            shape = replace(shape, recompute=plan.workload.recompute)
        staleness = schedule[0] if schedule[1] else None  # None: the least k that admits all
        plan.schedule = schedule
        plan.step_times = estimate_step_times(plan, shape, hw, staleness=staleness)
        plan.balanced = balanced_schedules(plan, shape, hw, headroom=args.headroom,
                                           staleness=staleness)
        lengths = shape.lengths
        plan.step_time_basis = (f"{hw.name}, mean prompt {shape.mean_prompt_tokens:.0f} + "
                                f"response {shape.mean_response_tokens:.0f} of at most "
                                f"{shape.max_response_tokens} tokens, "
                                f"{lengths.truncated:.1%} of them at the cap")
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(format_table(plan, args.headroom))
        own = run.parallel  # a replica: TP x CP x PP ranks
        own_replica = own.tensor_parallel * own.context_parallel * own.pipeline_parallel
        own_dp = cluster.world // own_replica
        if not refusal and cluster.world % own_replica == 0 \
                and dedicated_split_problem(cluster, work, own_dp):
            cp = f" CP{own.context_parallel}" if own.context_parallel > 1 else ""
            print(f"the recipe's own layout TP{own.tensor_parallel}{cp} "
                  f"PP{own.pipeline_parallel} has {own_dp} DP replicas, which cannot "
                  f"share {dedicated_engines(cluster, work)} dedicated engines evenly: the "
                  f"trainer would refuse it")
        if args.explain and plan.pick is not None:
            print("\nterms of the pick (docs/planner.md):\n" + explain(plan))
            if plan.step_times:
                print("\nstep-time terms (docs/planner.md#step-time):\n"
                      + explain_step_time([t for t, _ in plan.schedules()], shape.lengths))
    return 0 if plan.fits else 1



def run_schedule(run, staleness: int | None = None, partial: bool | None = None
                 ) -> tuple[int, bool]:
    """(k, partial) to price: the recipe's ``rollout.max_staleness`` and ``rollout.partial``;
    ``staleness`` (``--staleness``) names another schedule whole (partial only with
    ``partial``); ``partial`` alone turns partial rollouts on at the recipe's k."""
    if staleness is not None:
        return int(staleness), bool(partial)
    return run.rollout.max_staleness, bool(run.rollout.partial if partial is None else partial)


def tiny_model_config(run) -> dict | None:
    """The HF config of the model ``model.tiny`` creates at start (``tasks.tiny.tiny_config``),
    or None for a recipe that loads its model."""
    if run.model.tiny is None:
        return None
    from megatron_dgpo.tasks.tiny import tiny_config

    return tiny_config(**run.model.tiny)


if __name__ == "__main__":
    sys.exit(main())
