"""``dgpo-plan``: which TP x PP x DP (x EP for MoE) layout fits a recipe's model on a cluster,
and how long a step takes with generation colocated or on dedicated engines.

    python -m megatron_dgpo.plan recipes/dgpo_14b.yaml --gpus-per-node 8 --nodes 1 \\
        --gpu-memory-gb 80 [key=value overrides] [--json]

For every layout the trainer can run (TP within a node, TP | heads, KV groups and FFN width,
PP | layers, DP = world / (TP PP); for an MoE model EP | experts and EP x expert TP | the ranks
of a stage; no context parallelism, which the trainer does not have) it
estimates the peak memory of one GPU, term by term (``megatron_dgpo.memory``), prints them all
in a table, marks which fit and picks one, saying why. With ``rollout.placement: dedicated`` the
trainer is planned on the GPUs left after ``rollout.num_gpus`` and the engines' own GPU is
estimated beside it. For vLLM rollout it then estimates a step's time (``megatron_dgpo.steptime``)
colocated, on dedicated engines and one-step-off, and the engines' share of the GPUs that
balances one-step-off. The formulas and their checks are in ``docs/planner.md``. Memory is printed in GiB (2^30 bytes: an "80 GB" A100/H100 has ~80 GiB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field, replace

from megatron_dgpo.memory import (GIB, PUBLISHED, TERMS, Architecture, Cluster, EngineEstimate,
                                  Estimate, Layout, Workload, activation_elements_per_token_layer,
                                  dedicated_engine_estimate, dedicated_engines,
                                  dedicated_split_problem, engine_reserve, engine_tp, estimate,
                                  padded_vocab, param_count, stage_params)
from megatron_dgpo.steptime import HARDWARE, Hardware, StepShape, StepTime, step_times


def candidate_layouts(arch: Architecture, cluster: Cluster, work: Workload, *,
                      expert_parallel: int | None = None,
                      expert_tensor_parallel: int | None = None) -> list[Layout]:
    """The layouts the trainer can run: t | gpus_per_node, t | a, t | g, t | f (a dense
    model's MLP); p | L; t p | world; c = 1 (the trainer has no context parallelism); and
    D = world / (t p) <= responses per update (every DP rank gets at least one response).

    An MoE model's layouts add EP e and expert TP u (``expert_parallel`` /
    ``expert_tensor_parallel`` fix them, else they are searched): e | E, u | f_e, u e | world
    / p (Megatron's expert grid decomposes each stage's ranks again), u in {1, t} unless
    fixed (whole experts per rank, or experts split like the dense layers: the two settings
    Megatron users run); the allgather dispatcher needs p = 1. A colocated engine of a set
    ``rollout.tensor_parallel_size`` t_r must lie in one replica's model-parallel group, as
    the trainer requires (``rollout.placement.rollout_role``): t_r | t, or t_r | t p with
    D = 1. Dedicated engines (``cluster.rollout_gpus`` of them, ``rollout_gpus / t_r``
    engines) are shared out evenly over the DP replicas: D | engines."""
    out = []
    for t in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % t or arch.heads % t or arch.kv_heads % t \
                or (not arch.moe and arch.intermediate % t):
            continue
        for p in range(1, arch.layers + 1):
            if arch.layers % p or cluster.world % (t * p):
                continue
            if arch.moe and work.moe_dispatcher == "allgather" and p > 1:
                continue
            d = cluster.world // (t * p)
            if d > work.responses_per_update or not _engine_fits(work, t, p, d):
                continue
            if dedicated_split_problem(cluster, work, d):
                continue
            if not arch.moe:
                out.append(Layout(t, p, 1, d))
                continue
            per_stage = cluster.world // p
            etps = [expert_tensor_parallel] if expert_tensor_parallel else sorted({1, t})
            eps = [expert_parallel] if expert_parallel else range(1, arch.experts + 1)
            out += [Layout(t, p, 1, d, e, u) for u in etps for e in eps
                    if arch.experts % e == 0 and arch.moe_ffn % u == 0
                    and per_stage % (u * e) == 0]
    return out


def _engine_fits(work: Workload, t: int, p: int, d: int) -> bool:
    """Whether colocated engines of ``rollout.tensor_parallel_size`` GPUs each lie in one DP
    replica's TP x PP ranks (Megatron orders ranks TP innermost, PP outermost)."""
    t_r = work.rollout_tp
    if t_r is None or not work.colocated_rollout or work.rollout_placement != "colocated":
        return True
    return t % t_r == 0 or (d == 1 and (t * p) % t_r == 0)


def _preference(e: Estimate) -> tuple:
    """Smallest model-parallel size first; then PP after TP (TP stays on NVLink; PP adds
    bubbles and holds p micro-batches on stage 0); for MoE then the smallest expert-parallel
    group e u (fewer all-to-all peers, more tokens per expert GEMM; a group within a node
    comes first as the smallest), at equal size whole experts first (smaller u: no expert-TP
    collectives around GEMMs of f_e / u columns), then the lowest peak."""
    lay = e.layout
    return (lay.model_parallel, lay.pp, lay.ep * lay.expert_tp, lay.expert_tp, e.total)


def choose(estimates: list[Estimate], headroom: float) -> tuple[Estimate | None, str]:
    """The preferred layout among those within (1 - headroom) of GPU memory, else among those
    that fit at all; None when nothing fits. Returns it with the explanation."""
    roomy = sorted((e for e in estimates if e.fits_with(headroom)), key=_preference)
    tight = sorted((e for e in estimates if e.fits), key=_preference)
    pick = roomy[0] if roomy else (tight[0] if tight else None)
    if pick is None:
        return None, ""
    lay = pick.layout
    smaller = [e for e in estimates if e.layout.model_parallel < lay.model_parallel]
    why = [f"{lay} (model-parallel size {lay.model_parallel}, {lay.dp} data-parallel "
           f"replica{'s' if lay.dp > 1 else ''}) peaks at {pick.total / GIB:.1f} of "
           f"{pick.gpu_bytes / GIB:.0f} GiB on "
           f"the {pick.stage} pipeline stage GPU."]
    if lay.moe:
        why.append(_experts_text(pick, estimates, headroom))
    if roomy:
        why.append(f"It is the smallest model-parallel size that leaves {headroom:.0%} "
                   f"headroom;")
    else:
        why.append(f"No layout leaves {headroom:.0%} headroom; this is the smallest that fits "
                   f"at all, so expect little margin for fragmentation;")
    passed_over = [e for e in tight if e.layout.model_parallel == lay.model_parallel
                   and _preference(e) < _preference(pick)] if roomy else []
    if passed_over:
        other = passed_over[0]
        why.append(f"{other.layout} is as small and preferred by the rules below, but its "
                   f"{other.total / GIB:.1f} GiB leaves less than {headroom:.0%} headroom;")
    if smaller:
        best_smaller = min(smaller, key=lambda e: e.total)
        why.append(f"every smaller one needs at least {best_smaller.total / GIB:.1f} GiB "
                   f"({best_smaller.layout}).")
    else:
        why.append("no smaller layout exists.")
    why.append("Fewer model-parallel GPUs mean more data-parallel replicas and less "
               "communication per token. At equal size, TP is preferred to PP (TP's all-reduces "
               "stay on NVLink within a node, PP adds pipeline bubbles and keeps up to PP "
               "micro-batches of activations on the first stage).")
    if pick.vllm:
        where = ("Every GPU also holds its colocated vLLM engine's" if pick.engines > lay.dp
                 or pick.vllm_sleeps else "GPU 0 also holds vLLM's")
        why.append(f"{where} {pick.vllm / GIB:.1f} GiB"
                   + (" (asleep while training: counted against activations + logits, not "
                      "added" + ("; gradients and optimizer state are offloaded while it is awake"
                                 if pick.offloaded else "") + ")." if pick.vllm_sleeps else "."))
    return pick, " ".join(why)


def _experts_text(pick: Estimate, estimates: list[Estimate], headroom: float) -> str:
    """Why this expert layout: what each GPU holds of the experts, and what the smaller
    expert-parallel groups of the same TP x PP would need."""
    lay = pick.layout
    text = (f"Experts: EP {lay.ep} x expert TP {lay.expert_tp}, "
            f"{pick.expert_params / 1e9:.2f}B expert parameters per GPU "
            f"({lay.expert_dp} expert data-parallel replica{'s' if lay.expert_dp > 1 else ''} "
            f"shard their optimizer state); the smallest expert-parallel group that leaves "
            f"{headroom:.0%} headroom at this TP x PP")
    smaller = [e for e in estimates if (e.layout.tp, e.layout.pp) == (lay.tp, lay.pp)
               and e.layout.ep * e.layout.expert_tp < lay.ep * lay.expert_tp]
    if smaller:
        best = min(smaller, key=lambda e: e.total)
        text += f" (the best smaller one, {best.layout}, needs {best.total / GIB:.1f} GiB)"
    return text + "."


# --------------------------------------------------------------------------- recipe & CLI


def architecture_for(run, hf_config: str | None = None) -> Architecture:
    """The recipe's model shape: ``hf_config`` (a config.json or its folder) if given; else
    ``model.tiny`` (the tiny Qwen2 of ``megatron_dgpo.tiny``); else ``model.path`` when it is a
    local folder with config.json; else the built-in table ``PUBLISHED`` keyed by hub id."""
    if hf_config:
        return Architecture.from_hf_config(_read_config(hf_config, "--hf-config"),
                                           name=os.path.basename(hf_config.rstrip("/")))
    if run.model.tiny is not None:
        from megatron_dgpo.tiny import TINY_CONFIG

        kwargs = {k: v for k, v in run.model.tiny.items() if k != "seed"}
        cfg = {"model_type": "qwen2", "vocab_size": kwargs.pop("vocab_size", 512),
               **TINY_CONFIG, **kwargs}
        return Architecture.from_hf_config(cfg, name="tiny")
    path = run.model.path
    if os.path.isfile(os.path.join(path, "config.json")):
        return Architecture.from_hf_config(_read_config(path, "model.path"),
                                           name=os.path.basename(path.rstrip("/")))
    if path in PUBLISHED:
        return PUBLISHED[path]
    raise ValueError(f"model.path {path!r} is neither a local HF folder with config.json nor "
                     f"a hub id the planner knows ({', '.join(sorted(PUBLISHED))}); pass its "
                     f"config.json with --hf-config")


def _read_config(path: str, flag: str) -> dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {file}: {exc}") from None


@dataclass
class Plan:
    """Everything ``dgpo-plan`` prints."""

    architecture: Architecture
    cluster: Cluster
    workload: Workload
    estimates: list[Estimate]
    pick: Estimate | None
    explanation: str
    recipe_layout: Estimate | None
    """The recipe's own parallel.* layout, when it is a candidate."""
    hint: str = ""
    """Why nothing fits (when ``pick`` is None)."""
    required_overrides: list[str] = field(default_factory=list)
    """Recipe overrides the pick needs (full recompute when nothing fits without it)."""
    as_configured: str = ""
    """When ``required_overrides`` is set: the best the recipe as written can do."""
    engine: EngineEstimate | None = None
    """A dedicated engine's GPU (``rollout.placement: dedicated``)."""
    step_times: list[StepTime] = field(default_factory=list)
    """``estimate_step_times``: colocated, and with dedicated engines synchronous and one-step-off."""
    balanced: StepTime | None = None
    """The one-step-off step with the dedicated GPUs that make it fastest
    (``balanced_rollout_gpus``)."""
    step_time_basis: str = ""
    """The hardware and lengths behind ``step_times``."""

    @property
    def fits(self) -> bool:
        """The trainer has a layout and dedicated engines (if any) fit their GPUs."""
        return self.pick is not None and (self.engine is None or self.engine.fits)

    def as_dict(self) -> dict:
        return dict(
            model=asdict(self.architecture), params=param_count(self.architecture),
            cluster=asdict(self.cluster), workload=asdict(self.workload),
            layouts=[e.as_dict() for e in self.estimates],
            pick=self.pick.as_dict() if self.pick else None, explanation=self.explanation,
            recipe_layout=self.recipe_layout.as_dict() if self.recipe_layout else None,
            hint=self.hint, required_overrides=list(self.required_overrides),
            as_configured=self.as_configured,
            dedicated_engine=self.engine.as_dict() if self.engine else None,
            step_times=[t.as_dict() for t in self.step_times],
            balanced_one_step_off=self.balanced.as_dict() if self.balanced else None,
            step_time_basis=self.step_time_basis)


def make_plan(arch: Architecture, cluster: Cluster, work: Workload, *, headroom: float = 0.1,
              recipe_tp: int = 1, recipe_pp: int = 1, recipe_ep: int = 1,
              recipe_etp: int | None = None, expert_parallel: int | None = None,
              expert_tensor_parallel: int | None = None) -> Plan:
    """Estimate every candidate layout and choose one (``choose``). When nothing fits and the
    recipe does not recompute activations, plan again with full recompute: if a layout fits
    then, that plan is returned with ``required_overrides`` naming the switch.
    ``expert_parallel`` / ``expert_tensor_parallel`` fix an MoE model's EP / expert TP (None:
    searched); ``recipe_*`` name the recipe's own layout (``recipe_etp`` None = its TP)."""
    layouts = candidate_layouts(arch, cluster, work, expert_parallel=expert_parallel,
                                expert_tensor_parallel=expert_tensor_parallel)
    estimates = [estimate(arch, cluster, lay, work) for lay in layouts]
    pick, why = choose(estimates, headroom)
    recipe = (recipe_tp, recipe_pp) + ((recipe_ep, recipe_etp or recipe_tp) if arch.moe else ())
    own = next((e for e in estimates if (e.layout.tp, e.layout.pp) + (
        (e.layout.ep, e.layout.expert_tp) if arch.moe else ()) == recipe), None)
    plan = Plan(arch, cluster, work, estimates, pick, why, own,
                engine=dedicated_engine_estimate(arch, cluster, work))
    if pick is not None:
        return plan
    plan.hint = _no_fit_text(arch, cluster, estimates, engines=dedicated_engines(cluster, work))
    if not work.recompute and estimates:
        retry = make_plan(arch, cluster, replace(work, recompute=True), headroom=headroom,
                          recipe_tp=recipe_tp, recipe_pp=recipe_pp, recipe_ep=recipe_ep,
                          recipe_etp=recipe_etp, expert_parallel=expert_parallel,
                          expert_tensor_parallel=expert_tensor_parallel)
        if retry.pick is not None:
            retry.required_overrides = ["model.recompute_activations=true"]
            retry.as_configured = plan.hint
            retry.explanation = ("Nothing fits without activation recompute, so this plan "
                                 "turns on model.recompute_activations (full recompute, ~1/3 "
                                 "more compute). " + retry.explanation)
            return retry
        plan.hint += " Full activation recompute does not make any layout fit either."
    plan.hint += " Use more GPUs, GPUs with more memory, or shorter micro-batches."
    return plan


def rollout_tensor_parallel(plan: Plan) -> int:
    """GPUs per vLLM engine: dedicated, ``rollout.tensor_parallel_size`` (default 1); colocated,
    as the trainer resolves it for the pick's layout."""
    work = plan.workload
    if work.rollout_placement == "dedicated" or plan.pick is None:
        return work.rollout_tp or 1
    return engine_tp(work, plan.pick.layout)


def estimate_step_times(plan: Plan, shape: StepShape, hw: Hardware) -> list[StepTime]:
    """``steptime.step_times`` for the plan: engines colocated on all the job's GPUs and, with
    dedicated engines, on the plan's ``rollout_gpus`` (synchronous and one-step-off). The
    colocated refit moves the pick's gradients and optimizer state to the host and back when
    ``train.offload_training_state``. The trainer's TP x PP is the pick's (its TP
    communication and pipeline bubble)."""
    arch, cluster, work = plan.architecture, plan.cluster, plan.workload
    t_r = rollout_tensor_parallel(plan)
    reserve, weights, _ = engine_reserve(arch, cluster, work, t_r)
    colocated_kv = max(reserve - weights, 0)
    offloaded = (plan.pick.grads + plan.pick.optimizer
                 if plan.pick is not None and work.offload_training_state else 0)
    layout = (plan.pick.layout.tp, plan.pick.layout.pp) if plan.pick is not None else (1, 1)
    return step_times(arch, replace(shape, offloaded_state_bytes_per_gpu=offloaded), hw,
                      world=cluster.gpus, rollout_gpus=cluster.rollout_gpus, engine_tp=t_r,
                      kv_cache_bytes_per_engine_gpu=plan.engine.kv_cache if plan.engine
                      else colocated_kv, colocated_kv_cache_bytes_per_gpu=colocated_kv,
                      train_layout=layout)


def balanced_rollout_gpus(plan: Plan, shape: StepShape, hw: Hardware, *,
                          headroom: float = 0.1) -> StepTime | None:
    """The one-step-off step with the dedicated GPUs (whole nodes on several nodes, whole
    engines on one) that make it fastest, among those where the trainer still has a layout
    and the engines fit: generation and training are as long as each other there."""
    arch, cluster, work = plan.architecture, plan.cluster, plan.workload
    t_r = rollout_tensor_parallel(plan)
    unit = math.lcm(cluster.gpus_per_node if cluster.nodes > 1 else 1, t_r)
    best = None
    for gpus in range(unit, cluster.gpus, unit):
        trial = make_plan(arch, replace(cluster, rollout_gpus=gpus),
                          replace(work, rollout_placement="dedicated", colocated_rollout=False,
                                  rollout_tp=t_r), headroom=headroom)
        if not trial.fits:
            continue
        one_step_off = estimate_step_times(trial, shape, hw)[-1]
        if best is None or one_step_off.step_s < best.step_s:
            best = one_step_off
    return best


def step_time_estimate(run, cluster: Cluster, hardware: str = "a100", *,
                       mean_prompt_tokens: float = 200.0, mean_response_fraction: float = 0.5,
                       headroom: float = 0.1) -> dict[str, dict]:
    """A recipe with dedicated engines (``rollout.placement: dedicated``) on ``cluster``:
    ``{"colocated" | "synchronous" | "one_step_off": StepTime.as_dict()}``, the latter two on
    the recipe's ``rollout.num_gpus``, and ``"balanced"``, one-step-off on the dedicated GPUs
    that make it fastest (``benchmarks/bench_async.py``)."""
    if run.rollout.placement != "dedicated":
        raise ValueError(f"step_time_estimate needs rollout.placement: dedicated, got "
                         f"{run.rollout.placement!r}")
    work = Workload.from_recipe(run)
    cluster = replace(cluster, rollout_gpus=run.rollout.num_gpus)
    plan = make_plan(architecture_for(run), cluster, work, headroom=headroom,
                     recipe_tp=run.parallel.tensor_parallel, recipe_pp=run.parallel.pipeline_parallel)
    shape = StepShape.from_recipe(run, mean_prompt_tokens=mean_prompt_tokens,
                                  mean_response_fraction=mean_response_fraction)
    hw = HARDWARE[hardware]
    colocated, synchronous, one_step_off = estimate_step_times(plan, shape, hw)
    balanced = balanced_rollout_gpus(plan, shape, hw, headroom=headroom)
    return {"colocated": colocated.as_dict(), "synchronous": synchronous.as_dict(),
            "one_step_off": one_step_off.as_dict(),
            "balanced": balanced.as_dict() if balanced else None}


def _stage_index(e: Estimate) -> int:
    return {"only": 0, "first": 0, "last": e.layout.pp - 1}.get(e.stage) \
        if not e.stage.isdigit() else int(e.stage)


def explain(plan: Plan, e: Estimate | None = None) -> str:
    """``dgpo-plan --explain``: every term of one estimate (default: the pick) as a line
    ``term  formula = value  why``, the values those of ``e`` itself (docs/planner.md has the
    same rows with their sources)."""
    e = e or plan.pick
    arch, work, lay = plan.architecture, plan.workload, e.layout
    t, p, d = lay.tp, lay.pp, lay.dp
    n = stage_params(arch, t, p, _stage_index(e), lay.ep, lay.expert_tp)
    n_e = e.expert_params
    rows = padded_vocab(arch.vocab, t)
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    recompute = "full recompute: each layer's input kept, one layer recomputed" \
        if work.recompute else "no recompute"
    lines = [f"{lay}, {e.stage} pipeline stage GPU: {gib(e.total)} of {gib(e.gpu_bytes)}",
             f"  weights      b N = {work.dtype_bytes} x {n:,} = {gib(e.weights)}"
             f"   (N: this stage's parameters, V_pad = {rows}"
             + (f"; of them N_e = {n_e:,} routed-expert parameters: (L / p) (E / EP) 3 f_e h / "
                f"ETP, {arch.experts // lay.ep} of {arch.experts} experts per layer at EP "
                f"{lay.ep}, ETP {lay.expert_tp})" if lay.moe else ")"),
             f"  grads        4 N = {gib(e.grads)}   (fp32 main_grad for every local "
             f"parameter: grad_reduce_in_fp32)",
             (f"  optimizer    12 (N - N_e) / {d if work.distributed_optimizer else 1} + "
              f"12 N_e / {lay.expert_dp if work.distributed_optimizer else 1} = "
              if lay.moe else
              f"  optimizer    12 N / {d if work.distributed_optimizer else 1} = ")
             + f"{gib(e.optimizer)}   (fp32 master + Adam m, v"
             + ((", the dense parameters sharded over DP, the experts over expert DP = "
                 "world / (PP EP ETP) by the distributed optimizer)" if lay.moe else
                 ", sharded over DP by the distributed optimizer)")
                if work.distributed_optimizer else ", not sharded)"),
             f"  activations  m (L / p) s E b / t = {gib(e.activations)}   (s = "
             f"{work.micro_batch_tokens} tokens, E = "
             f"{activation_elements_per_token_layer(arch, lay.expert_tp):,} elements per "
             f"token and layer"
             + (f" incl. the routed copies' k (ETP h + 3 f_e) = {arch.topk} x ({lay.expert_tp} x "
                f"{arch.hidden} + 3 x {arch.moe_ffn})" if lay.moe else "")
             + f", sequence parallel over TP {t}; {recompute})",
             (f"  dispatch     {_dispatch_formula(work.moe_dispatcher)} = {gib(e.dispatch)}   "
              f"({work.moe_dispatcher} token dispatcher, one MoE layer's transient buffers: "
              f"T = s / t = {-(-work.micro_batch_tokens // t)} tokens, k = {arch.topk}, EP "
              f"{lay.ep}, ETP {lay.expert_tp}; megatron/core/transformer/moe/"
              f"token_dispatcher.py)" if lay.moe else
              f"  dispatch     0 = {gib(0)}   (dense model: no token dispatcher)"),
             f"  logits       2 s (V_pad / t) b + 2 chunk (V_pad / t) 4 = {gib(e.logits)}   "
             + ("(last stage: the logits the log-prob kernel saves and their gradient, plus "
                "its float32 chunks; no third copy: the logits leave Float16Module in bf16 and "
                "packed rows are one sequence, so GPTModel's transpose copies nothing "
                "(benchmarks/bench_logits_copies.py))" if e.logits else "(not on this stage)"),
             f"  cache        {work.allocator_slack:g} (activations + dispatch + logits) = "
             f"{gib(e.cache)}   "
             f"(PyTorch's caching allocator: blocks freed by one micro-batch that the next "
             f"cannot reuse; --allocator-slack)",
             ]
    if e.vllm:
        how = (f"{work.gpu_memory_utilization:g} x GPU memory" if work.kv_cache_memory_bytes
               is None else "weights / t_r + rollout.kv_cache_memory_bytes")
        lines.append(f"  vllm         {how} = {gib(e.vllm)}   (the engine's reserve while it "
                     f"generates: weights, KV cache, activations and, since vLLM 0.21, its "
                     f"CUDA graphs; "
                     + ("asleep while training runs)" if e.vllm_sleeps else "awake all along)"))
    else:
        lines.append("  vllm         0   (no engine on this GPU)")
    lines.append(f"  graphs       --cuda-graph-gb = {gib(e.graphs)}   "
                 + ("(the sleeping engine's CUDA-graph pool: sleep mode does not free it, so "
                    "it stays through training)" if e.graphs else
                    "(none held through training: " + ("rollout.enforce_eager" if
                                                       work.enforce_eager and e.vllm_sleeps
                                                       else "no sleeping engine here") + ")"))
    comms = ", ".join(e.communicators) or "none"
    lines.append(f"  nccl         {len(e.communicators)} communicators x {work.nccl_channels} "
                 f"channels x 9.19 MiB = {gib(e.nccl)}   ({comms}; ring buffers of NCCL's "
                 f"default sizes; --nccl-channels)")
    lines.append(f"  overhead     --overhead-gb = {gib(e.overhead)}   (CUDA context, cuBLAS "
                 f"and TE workspaces)")
    state = e.grads + e.optimizer
    training = state + e.activations + e.dispatch + e.logits + e.cache
    if e.vllm_sleeps:
        rollout = e.vllm + (0 if e.offloaded else state)
        lines.append(f"  total        weights + nccl + overhead + max(training {gib(training + e.graphs)}"
                     f" = grads + optimizer + activations + dispatch + logits + cache + graphs, "
                     f"rollout {gib(rollout)} = vllm"
                     + (" (grads and optimizer offloaded)" if e.offloaded else
                        " + grads + optimizer") + f") = {gib(e.total)}")
    else:
        lines.append(f"  total        every term at once = {gib(e.total)}")
    return "\n".join(lines)


def explain_step_time(times: list[StepTime]) -> str:
    """``dgpo-plan --explain``: every term of each placement's step time (``steptime``'s
    generation, training and refit terms), seconds."""
    lines = []
    for t in times:
        g, tr, r = (t.terms.get(k, {}) for k in ("generation", "training", "refit"))
        lines.append(f"{t.placement} ({t.trainer_gpus} trainer GPUs"
                     + (f", {t.rollout_gpus} rollout GPUs" if t.rollout_gpus else "")
                     + f"): step {t.step_s:.1f} s, {t.dominant} dominates")
        if g:
            lines += [
                f"  generation   {g['total']:.1f} s = prefill {g['prefill_s']:.1f} + bulk "
                f"{g['bulk_steps']:.0f} steps x {g['bulk_step_s'] * 1e3:.1f} ms + tail "
                f"{g['tail_steps']:.0f} steps x {g['tail_step_s'] * 1e3:.1f} ms   ({g['responses']} "
                f"responses per engine, {g['concurrent']} at once, {g['tail_running']:.1f} running "
                f"in the tail)",
                f"    of it      step overhead {g['overhead_s']:.1f} s (o per decode step), "
                f"sampler {g['sampling_s']:.1f} s (per row x vocabulary; seeded rows drawn one "
                f"at a time)"]
        if tr:
            lines.append(f"  training     {tr['total']:.1f} s = update {tr['update_s']:.1f} + "
                         f"log-probs {tr['logprobs_s']:.1f}   (mfu {tr['mfu']:.3f} x pipeline "
                         f"{tr['pipeline_efficiency']:.2f} x TP communication "
                         f"{tr['tp_efficiency']:.2f})")
        if r:
            lines.append(f"  refit        {r['total']:.1f} s = fixed {r['fixed_s']:.1f} + bytes "
                         f"{r['bytes_s']:.1f} + tensors {r['tensors_s']:.1f}"
                         + (f" + network {r['network_s']:.1f}" if r['network_s'] else "")
                         + (f" + offloaded state {r['offload_s']:.1f}" if r['offload_s'] else ""))
    return "\n".join(lines)


def _dispatch_formula(dispatcher: str) -> str:
    """``memory.dispatcher_bytes``'s formula for ``dispatcher``."""
    return "T h b (ETP EP + 2 ETP k)" if dispatcher == "allgather" else "T k h b (1 + 2 ETP)"


def _no_fit_text(arch: Architecture, cluster: Cluster, estimates: list[Estimate], *,
                 engines: int = 0) -> str:
    where = (f"{arch.name} on {cluster.nodes} x {cluster.gpus_per_node} GPUs of "
             f"{cluster.gpu_memory_gb:g} GiB"
             + (f" ({cluster.world} for the trainer, {cluster.rollout_gpus} for dedicated engines)"
                if cluster.rollout_gpus else ""))
    if not estimates:
        return (f"no layout of {where} is possible: TP must divide {cluster.gpus_per_node} "
                f"GPUs per node, {arch.heads} heads and {arch.kv_heads} KV groups, PP must "
                f"divide {arch.layers} layers, and TP x PP the world size"
                + (f"; EP must divide {arch.experts} experts and EP x ETP the GPUs per "
                   f"pipeline stage" if arch.moe else "")
                + (f"; DP must divide the {engines} dedicated engines (each replica refits "
                   f"and samples with its own share)" if engines else ""))
    least = min(estimates, key=lambda e: e.total)
    return (f"no layout fits {where}: the smallest peak is {least.total / GIB:.1f} GiB "
            f"({least.layout}).")


def format_table(plan: Plan, headroom: float) -> str:
    """The human-readable report: one row per layout (GiB on its peak GPU), then the pick."""
    arch, cl, work = plan.architecture, plan.cluster, plan.workload
    lines = [f"{arch.name}: {param_count(arch) / 1e9:.2f}B parameters (h={arch.hidden}, "
             f"L={arch.layers}, heads={arch.heads}, kv={arch.kv_heads}, f={arch.intermediate}, "
             f"V={arch.vocab}, tied={arch.tie_word_embeddings}"
             + (f", {arch.experts} experts of f_e={arch.moe_ffn}, top-{arch.topk}, "
                f"{work.moe_dispatcher} dispatcher" if arch.moe else "") + ")",
             f"cluster: {cl.nodes} node(s) x {cl.gpus_per_node} GPUs x {cl.gpu_memory_gb:g} GiB; "
             f"micro-batch {work.micro_batch_tokens} tokens, recompute={work.recompute}, "
             f"distributed optimizer={work.distributed_optimizer}, "
             f"vLLM placement="
             + (f"dedicated ({cl.rollout_gpus} of the {cl.gpus} GPUs; the trainer's world is the "
                f"other {cl.world})" if work.rollout_placement == "dedicated"
                else work.rollout_placement if work.colocated_rollout else "none"),
             ""]
    if plan.required_overrides:
        lines[-1:] = [f"as configured, {plan.as_configured[0].lower()}{plan.as_configured[1:]}",
                      f"planned with {' '.join(plan.required_overrides)}:", ""]
    head = ["layout", "stage"] + list(TERMS) + ["total", "fits"]
    rows = []
    for e in sorted(plan.estimates, key=_preference):
        mark = ("yes" if e.fits_with(headroom) else "tight") if e.fits else "no"
        if plan.pick is e:
            mark += " <- pick"
        rows.append([str(e.layout), e.stage] + [f"{getattr(e, k) / GIB:.1f}" for k in TERMS]
                    + [f"{e.total / GIB:.1f}", mark])
    lines += _aligned(head, rows)
    lines.append(f"(GiB on each layout's most loaded GPU; 'tight' fits but with less than "
                 f"{headroom:.0%} headroom)")
    lines.append("")
    if plan.pick:
        lines.append("pick: " + plan.explanation)
        lay = plan.pick.layout
        lines.append(f"set: parallel.tensor_parallel={lay.tp} parallel.pipeline_parallel={lay.pp}"
                     + (f" parallel.expert_parallel={lay.ep} parallel.expert_tensor_parallel="
                        f"{lay.expert_tp}" if lay.moe else "")
                     + "".join(f" {o}" for o in plan.required_overrides))
        engine_gpus = (cl.world // max(plan.pick.engines, 1)
                       if work.rollout_placement == "colocated" else work.rollout_tp or 1)
        if plan.engine is not None:
            lines.append(_engine_text(plan.engine, cl))
        elif work.colocated_rollout:
            lines.append(f"rollout: {plan.pick.engines} vLLM engine(s) of {engine_gpus} GPU(s) "
                         f"({work.rollout_placement}"
                         + (", sleep mode: KV cache freed and weights offloaded during training)"
                            if plan.pick.vllm_sleeps else ")"))
        else:
            lines.append("rollout: transformers engine on each DP replica leader")
        for note in plan.pick.notes:
            lines.append("note: " + note)
    else:
        lines.append("DOES NOT FIT: " + plan.hint)
        if plan.engine is not None:
            lines.append(_engine_text(plan.engine, cl))
    if plan.recipe_layout is not None and plan.recipe_layout is not plan.pick:
        own = plan.recipe_layout
        verdict = (("fits" if own.fits_with(headroom) else "fits, but tight") if own.fits
                   else "does NOT fit")
        lines.append(f"the recipe's own layout {own.layout}: {own.total / GIB:.1f} GiB, {verdict}")
    if plan.step_times:
        lines += ["", _step_time_table(plan)]
    return "\n".join(lines)


def _aligned(head: list[str], rows: list[list[str]]) -> list[str]:
    """The header and rows as lines of left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]


def _engine_text(engine: EngineEstimate, cluster: Cluster) -> str:
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    text = (f"rollout: {engine.engines} dedicated vLLM engine(s) of {engine.engine_tp} GPU(s) on "
            f"the last {cluster.rollout_gpus} GPUs, outside the trainer's world; each of their "
            f"GPUs holds vLLM's {gib(engine.reserve)} GiB reserve (weights {gib(engine.weights)}, "
            f"KV cache and the rest {gib(engine.kv_cache)}) + NCCL {gib(engine.nccl)} = "
            f"{gib(engine.total)} of {gib(engine.gpu_bytes)} GiB: "
            + ("fits" if engine.fits else "DOES NOT FIT (lower rollout.gpu_memory_utilization)"))
    return "\n".join([text] + ["note: " + n for n in engine.notes])


def _step_time_table(plan: Plan) -> str:
    """The step-time rows (seconds) and the balanced one-step-off split."""
    head = ["step time", "trainer GPUs", "rollout GPUs", "generation", "training", "refit",
            "step", "trainer idle", "engine idle"]
    rows = [[t.placement, str(t.trainer_gpus), str(t.rollout_gpus or "-")]
            + [f"{v:.0f}" for v in (t.generation_s, t.training_s, t.refit_s, t.step_s,
                                     t.trainer_idle_s, t.engine_idle_s)] for t in plan.step_times]
    lines = [f"step time in seconds ({plan.step_time_basis}; a roofline model, "
             f"docs/planner.md#step-time):"] + _aligned(head, rows)
    colocated = plan.step_times[0]
    if plan.balanced is not None:
        b = plan.balanced
        lines.append(f"one-step-off is fastest with rollout.num_gpus={b.rollout_gpus} "
                     f"({b.step_s:.0f} s per step: {colocated.step_s / b.step_s:.2f}x the "
                     f"colocated step; generation {b.generation_s:.0f} s beside training "
                     f"{b.training_s:.0f} s)")
    return "\n".join(lines)


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
        description="Per-GPU memory of every TP x PP x DP layout of a recipe on a "
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
    ap.add_argument("--hardware", choices=sorted(HARDWARE), default="a100",
                    help="GPU type of the step-time estimate (default a100, the paper's)")
    ap.add_argument("--mean-prompt-tokens", default=200.0,
                    type=_float_in("--mean-prompt-tokens", 1.0, math.inf, ">= 1"),
                    help="step time: the mean prompt in tokens (default 200, at most "
                         "rollout.max_prompt_tokens)")
    ap.add_argument("--mean-response-fraction", default=0.5,
                    type=_float_in("--mean-response-fraction", 1e-9, 1.0 + 1e-9, "in (0, 1]"),
                    help="step time: the mean response as a fraction of "
                         "rollout.max_response_tokens (default 0.5)")
    ap.add_argument("--explain", action="store_true",
                    help="after the table, every term of the pick with its formula")
    ap.add_argument("--hf-config", help="config.json (or its folder) giving the architecture, "
                                        "instead of model.path")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    """``dgpo-plan``: 0 when a layout fits (and dedicated engines their GPUs), 1 when not, 2 on
    bad input."""
    from megatron_dgpo.config import ConfigError
    from megatron_dgpo.recipe import load_recipe

    ap = _parser()
    args = ap.parse_intermixed_args(argv)
    try:
        run = load_recipe(args.recipe, args.overrides)
        arch = architecture_for(run, args.hf_config)
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
    if not arch.moe and (args.expert_parallel or args.expert_tensor_parallel):
        print(f"dgpo-plan: error: --expert-parallel / --expert-tensor-parallel need an MoE "
              f"model; {arch.name} is dense", file=sys.stderr)
        return 2
    plan = make_plan(arch, cluster, work, headroom=args.headroom, recipe_tp=run.parallel.tensor_parallel,
                     recipe_pp=run.parallel.pipeline_parallel,
                     recipe_ep=run.parallel.expert_parallel, recipe_etp=run.parallel.etp,
                     expert_parallel=args.expert_parallel,
                     expert_tensor_parallel=args.expert_tensor_parallel)
    if run.rollout.engine == "vllm" and plan.pick is not None:
        shape = StepShape.from_recipe(run, mean_prompt_tokens=args.mean_prompt_tokens,
                                      mean_response_fraction=args.mean_response_fraction)
        hw = HARDWARE[args.hardware]
        plan.step_times = estimate_step_times(plan, shape, hw)
        plan.balanced = balanced_rollout_gpus(plan, shape, hw, headroom=args.headroom)
        plan.step_time_basis = (f"{hw.name}, mean prompt {shape.mean_prompt_tokens:.0f} + "
                                f"response {shape.mean_response_tokens:.0f} of at most "
                                f"{shape.max_response_tokens} tokens")
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(format_table(plan, args.headroom))
        own_mp = run.parallel.tensor_parallel * run.parallel.pipeline_parallel
        own_dp = cluster.world // own_mp
        if cluster.world % own_mp == 0 and dedicated_split_problem(cluster, work, own_dp):
            print(f"the recipe's own layout TP{run.parallel.tensor_parallel} "
                  f"PP{run.parallel.pipeline_parallel} has {own_dp} DP replicas, which cannot "
                  f"share {dedicated_engines(cluster, work)} dedicated engines evenly: the "
                  f"trainer would refuse it")
        if args.explain and plan.pick is not None:
            print("\nterms of the pick (docs/planner.md):\n" + explain(plan))
            if plan.step_times:
                print("\nstep-time terms (docs/planner.md#step-time):\n"
                      + explain_step_time(plan.step_times))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
