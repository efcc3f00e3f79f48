"""``dgpo-plan``'s search: every layout the trainer can run on a cluster (``candidate_layouts``),
each estimated, the one to pick and why (``make_plan``: a ``Plan``), the step time of its
schedules (``estimate_step_times``) and the fastest dedicated splits (``balanced_schedules``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from megatron_dgpo.planner.catalogue import architecture_for
from megatron_dgpo.planner.inputs import GIB, Cluster, Layout, PlannedModel, Workload
from megatron_dgpo.planner.memory_terms import (SCORE_BACKENDS, attention_basis, engine_reserve,
                                                planned_platform, resolve_attention)
from megatron_dgpo.planner.parameters import param_count
from megatron_dgpo.planner.peak import (EngineEstimate, Estimate, dedicated_engine_estimate,
                                        dedicated_engines, dedicated_split_problem, engine_tp,
                                        estimate)
from megatron_dgpo.planner.steptime import HARDWARE, Hardware, StepShape, StepTime, step_times

CP_SIZES = (1, 2, 4, 8)
"""Context-parallel sizes searched (``dgpo-plan --max-cp`` caps them): Megatron splits each
packed sequence into 2 c chunks, and c beyond a node's 8 GPUs is not a layout anyone runs."""


def candidate_layouts(model: PlannedModel, cluster: Cluster, work: Workload, *,
                      expert_parallel: int | None = None,
                      expert_tensor_parallel: int | None = None,
                      max_cp: int = max(CP_SIZES)) -> list[Layout]:
    """The layouts the trainer can run: t | gpus_per_node, a, g and (dense) f; p | L; c in
    ``CP_SIZES`` up to ``max_cp`` (1 with the unfused and local backends); D = world / (t p c) <=
    responses per update; engines that fit the layout (``_engine_fits``, D | dedicated engines). MoE
    adds e | E and u | f_e with e u | world / p, u in {1, t} and e searched unless
    ``expert_tensor_parallel`` / ``expert_parallel`` fix them; allgather needs p = 1
    (docs/planner.md#candidates-and-the-choice)."""
    dims, out = model.description.dims, []
    cps = [c for c in CP_SIZES if c <= max_cp and (c == 1 or work.attention not in SCORE_BACKENDS)]
    for t in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % t or dims.heads % t or dims.kv_heads % t \
                or (not dims.moe and dims.ffn % t):
            continue
        for p in range(1, dims.layers + 1):
            if dims.layers % p or cluster.world % (t * p):
                continue
            if dims.moe and work.moe_dispatcher == "allgather" and p > 1:
                continue
            for c in cps:
                if cluster.world % (t * p * c):
                    continue
                d = cluster.world // (t * p * c)
                if d > work.responses_per_update or not _engine_fits(work, t, p, d, c):
                    continue
                if dedicated_split_problem(cluster, work, d):
                    continue
                if not dims.moe:
                    out.append(Layout(t, p, c, d))
                    continue
                per_stage = cluster.world // p
                etps = [expert_tensor_parallel] if expert_tensor_parallel else sorted({1, t})
                eps = [expert_parallel] if expert_parallel else range(1, dims.experts + 1)
                out += [Layout(t, p, c, d, e, u) for u in etps for e in eps
                        if dims.experts % e == 0 and dims.moe_ffn % u == 0
                        and per_stage % (u * e) == 0]
    return out


def _engine_fits(work: Workload, t: int, p: int, d: int, c: int = 1) -> bool:
    """Whether colocated engines of ``rollout.tensor_parallel_size`` GPUs each lie in one DP
    replica's TP x PP ranks (Megatron orders ranks TP innermost, PP outermost); with CP
    (between TP and DP in Megatron's order) in one TP group: t_r | t."""
    t_r = work.rollout_tp
    if not work.colocated_rollout or work.rollout_placement != "colocated":
        return True
    if t_r is None:  # the trainer's default: TP x PP (one engine per replica) or TP
        return c == 1 or p == 1 or d > 1
    return t % t_r == 0 or (c == 1 and d == 1 and (t * p) % t_r == 0)


def preference(e: Estimate) -> tuple:
    """Sort key of the memory choice: the smallest model-parallel size t p, then the smaller p,
    then (MoE) the smallest expert-parallel group e u and the smaller u, then the lowest peak
    (docs/planner.md#candidates-and-the-choice says why)."""
    lay = e.layout
    return (lay.model_parallel, lay.pp, lay.ep * lay.expert_tp, lay.expert_tp, e.total)


def choose(estimates: list[Estimate], headroom: float) -> tuple[Estimate | None, str]:
    """The preferred layout among those within (1 - headroom) of GPU memory, else among those
    that fit at all; None when nothing fits. Returns it with the explanation."""
    roomy = sorted((e for e in estimates if e.fits_with(headroom)), key=preference)
    tight = sorted((e for e in estimates if e.fits), key=preference)
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
                   and preference(e) < preference(pick)] if roomy else []
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



@dataclass
class Plan:
    """Everything ``dgpo-plan`` prints."""

    model: PlannedModel
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
    """``estimate_step_times``: colocated, and with dedicated engines synchronous, one-step-off
    and partial rollouts."""
    balanced: dict = field(default_factory=dict)
    """``balanced_schedules``: "one-step-off" and "partial" on the dedicated GPUs that make each
    fastest (None where no split fits)."""
    schedule: tuple[int, bool] = (0, False)
    """The schedule priced as the run's: (``rollout.max_staleness``, ``rollout.partial``), from
    the recipe or ``dgpo-plan --staleness`` / ``--partial``."""
    step_time_basis: str = ""
    """The hardware and lengths behind ``step_times``."""
    layout_step_s: dict = field(default_factory=dict)
    """``by_step_time``: the step-time model's seconds per step of each layout that leaves
    headroom, by its ``str`` (empty when no step shape was given)."""
    attention_basis: str = ""
    """The GPU and FlashAttention the attention backend (``workload.attention``) was decided
    on (``memory_terms.attention_basis``); empty when the workload's backend was set by hand."""
    attention_refusal: str = ""
    """Why the recipe's attention backend cannot run on the plan's GPUs (the trainer's start-up
    refusal, ``refused_plan``): then no layout is estimated."""

    @property
    def attention(self) -> dict:
        """``--json``'s "attention": the recipe's request, the backend the activations are
        counted for (None when refused), what decided it, and the refusal."""
        work = self.workload
        return dict(requested=work.attention_backend,
                    without_transformer_engine=work.without_transformer_engine,
                    backend=None if self.attention_refusal else work.attention,
                    basis=self.attention_basis, refusal=self.attention_refusal)

    @property
    def fits(self) -> bool:
        """The trainer has a layout and dedicated engines (if any) fit their GPUs."""
        return self.pick is not None and (self.engine is None or self.engine.fits)

    def as_dict(self) -> dict:
        return dict(
            model=self.model.as_dict(), params=param_count(self.model.description),
            cluster=asdict(self.cluster), workload=asdict(self.workload),
            layouts=[e.as_dict() for e in self.estimates],
            pick=self.pick.as_dict() if self.pick else None, explanation=self.explanation,
            recipe_layout=self.recipe_layout.as_dict() if self.recipe_layout else None,
            hint=self.hint, required_overrides=list(self.required_overrides),
            as_configured=self.as_configured,
            dedicated_engine=self.engine.as_dict() if self.engine else None,
            step_times=[t.as_dict() for t in self.step_times],
            schedules=[dict(t.as_dict(), speed_up=self.step_times[0].step_s / t.step_s,
                            split=split, priced=t is self.priced, **_partial_terms(t))
                       for t, split in self.schedules()],
            schedule=dict(max_staleness=self.schedule[0], partial=self.schedule[1]),
            balanced_one_step_off=_as_dict(self.balanced.get("one-step-off")),
            balanced_partial=_as_dict(self.balanced.get("partial")),
            step_time_basis=self.step_time_basis, attention=self.attention,
            layout_step_s=dict(self.layout_step_s))

    def schedules(self) -> list[tuple[StepTime, str]]:
        """Every schedule priced, with where its engines are: "recipe" (the plan's own GPUs), then
        "fastest split" for one-step-off and partial rollouts where that is not the recipe's."""
        own = {(t.placement, t.rollout_gpus) for t in self.step_times}
        return [(t, "recipe") for t in self.step_times] + [
            (t, "fastest split") for t in self.balanced.values()
            if t is not None and (t.placement, t.rollout_gpus) not in own]

    @property
    def priced(self) -> StepTime | None:
        """The run's schedule (``schedule``: k = 0 synchronous, k >= 1 one-step-off, or partial
        rollouts) on the recipe's dedicated GPUs, else on the fastest split."""
        k, partial = self.schedule
        want = "partial" if partial else "one-step-off" if k >= 1 else (
            "dedicated" if self.cluster.rollout_gpus else "colocated")
        return next((t for t, _ in self.schedules() if t.placement == want), None)


def _as_dict(t: StepTime | None) -> dict | None:
    return t.as_dict() if t is not None else None


PARTIAL_TERMS = ("concurrent", "reprefill_tokens", "reprefill_s", "tokens_per_refit",
                 "interrupted", "segments", "min_staleness", "over_bound")
"""``--json``'s terms of a partial-rollout schedule (``steptime.partial_generation_terms``)."""


def _partial_terms(t: StepTime) -> dict:
    g = t.terms.get("generation", {})
    return {k: g[k] for k in PARTIAL_TERMS} if t.placement == "partial" else {}


CP_WHEN = ("Layouts with CP are not weighed: one without it leaves headroom (the one "
           "published CP run trained 3x slower than the step-time model predicts; "
           "docs/planner.md#context-parallelism).")
"""Why ``make_plan`` keeps CP 1 where a layout without CP leaves headroom: the step-time model
prices CP's K/V ring at a few percent, but the one published CP run (NeMo-RL's Llama-3.3-70B
at 16k, CP 4) trained at a third of the model's rate."""

STEP_TIME_TIE = 0.01
"""``by_step_time``: layouts within 1% of the fastest count as equally fast (the memory
preference decides among them): the step-time model is not that precise."""


def layout_step_seconds(model: PlannedModel, cluster: Cluster, work: Workload, e: Estimate,
                        shape: StepShape, hw: Hardware) -> float:
    """Seconds per step with ``e``'s layout: the colocated step (engines of its resolved TP,
    training at its TP x PP x CP), or with dedicated engines the synchronous one."""
    plan = Plan(model, cluster, work, [e], e, "", None,
                engine=dedicated_engine_estimate(model, cluster, work))
    times = estimate_step_times(plan, shape, hw)
    return (times[1] if cluster.rollout_gpus and len(times) > 1 else times[0]).step_s


def by_step_time(plan: Plan, headroom: float, shape: StepShape, hw: Hardware) -> None:
    """Re-choose ``plan.pick``: among the layouts that leave ``headroom`` (all that fit when none
    does), the fastest (``layout_step_seconds``), the memory ``preference`` deciding within
    ``STEP_TIME_TIE``; the explanation says what was weighed."""
    pool = [e for e in plan.estimates if e.fits_with(headroom)] or \
        [e for e in plan.estimates if e.fits]
    if plan.pick is None or not pool:
        return
    seconds = {id(e): layout_step_seconds(plan.model, plan.cluster, plan.workload, e, shape, hw)
               for e in pool}
    plan.layout_step_s = {str(e.layout): seconds[id(e)] for e in pool}
    fastest = min(seconds.values())
    pick = min((e for e in pool if seconds[id(e)] <= (1 + STEP_TIME_TIE) * fastest),
               key=preference)
    first = plan.pick
    text = (f"By the step-time model ({hw.name}, docs/planner.md#step-time) {pick.layout} "
            f"takes {seconds[id(pick)]:.0f} s per step")
    if pick is not first:
        plan.pick = pick
        plan.explanation = (f"{pick.layout} peaks at {pick.total / GIB:.1f} of "
                            f"{pick.gpu_bytes / GIB:.0f} GiB on the {pick.stage} pipeline stage "
                            f"GPU. {text}, the fastest of the {len(pool)} layouts that fit "
                            f"(the memory rule's {first.layout}, {first.total / GIB:.1f} GiB, "
                            f"takes {seconds[id(first)]:.0f} s). By memory alone: "
                            + plan.explanation)
        return
    others = sorted((e for e in pool if e is not pick and e.layout.cp != pick.layout.cp),
                    key=lambda e: seconds[id(e)])
    if others:
        best = others[0]
        text += (f"; the fastest with other context parallelism, {best.layout} "
                 f"({best.total / GIB:.1f} GiB), {seconds[id(best)]:.0f} s")
    plan.explanation += " " + text + "."


def make_plan(model: PlannedModel, cluster: Cluster, work: Workload, *, headroom: float = 0.1,
              recipe_tp: int = 1, recipe_pp: int = 1, recipe_ep: int = 1,
              recipe_etp: int | None = None, expert_parallel: int | None = None,
              expert_tensor_parallel: int | None = None, recipe_cp: int = 1,
              max_cp: int = max(CP_SIZES), shape: StepShape | None = None,
              hw: Hardware | None = None) -> Plan:
    """Estimate every candidate layout and choose one (``choose``) among those with CP 1; where
    none leaves headroom (``CP_WHEN``) among all, by the step-time model (``by_step_time``) when
    ``shape`` and ``hw`` are given. When nothing fits and the recipe does not recompute, plan again
    with full recompute and name the switch in ``required_overrides``. ``expert_parallel`` /
    ``expert_tensor_parallel`` fix EP / expert TP (None: searched), ``max_cp`` caps CP,
    ``recipe_*`` name the recipe's own layout (``recipe_etp`` None = its TP)."""
    layouts = candidate_layouts(model, cluster, work, expert_parallel=expert_parallel,
                                expert_tensor_parallel=expert_tensor_parallel, max_cp=max_cp)
    estimates = [estimate(model, cluster, lay, work) for lay in layouts]
    # CP only where no layout without it leaves headroom (``CP_WHEN``)
    pick, why = choose([e for e in estimates if e.layout.cp == 1], headroom)
    cp_weighed = pick is None or not pick.fits_with(headroom)
    if cp_weighed:
        pick, why = choose(estimates, headroom)
    moe = model.description.dims.moe
    recipe = (recipe_tp, recipe_pp, recipe_cp) + (
        (recipe_ep, recipe_etp or recipe_tp) if moe else ())
    own = next((e for e in estimates if (e.layout.tp, e.layout.pp, e.layout.cp) + (
        (e.layout.ep, e.layout.expert_tp) if moe else ()) == recipe), None)
    plan = Plan(model, cluster, work, estimates, pick, why, own,
                engine=dedicated_engine_estimate(model, cluster, work))
    if pick is not None:
        plain = [e for e in estimates if e.layout.cp == 1]
        if cp_weighed and plain and any(e.layout.cp > 1 for e in estimates):
            least = min(plain, key=lambda e: e.total)
            plan.explanation += (f" No layout without CP leaves {headroom:.0%} headroom (the "
                                 f"least, {least.layout}, needs {least.total / GIB:.1f} GiB), "
                                 f"so CP layouts are weighed too.")
        if cp_weighed and shape is not None and hw is not None:
            by_step_time(plan, headroom, shape, hw)
        elif not cp_weighed and any(e.layout.cp > 1 for e in estimates):
            plan.explanation += " " + CP_WHEN
        return plan
    plan.hint = _no_fit_text(model, cluster, estimates, engines=dedicated_engines(cluster, work))
    if not work.recompute and estimates:
        retry = make_plan(model, cluster, replace(work, recompute=True), headroom=headroom,
                          recipe_tp=recipe_tp, recipe_pp=recipe_pp, recipe_ep=recipe_ep,
                          recipe_etp=recipe_etp, expert_parallel=expert_parallel,
                          expert_tensor_parallel=expert_tensor_parallel, recipe_cp=recipe_cp,
                          max_cp=max_cp, hw=hw,
                          shape=None if shape is None else replace(shape, recompute=True))
        if retry.pick is not None:
            retry.required_overrides = ["model.recompute_activations=true"]
            retry.as_configured = plan.hint
            retry.explanation = ("Nothing fits without activation recompute, so this plan "
                                 "turns on model.recompute_activations (full recompute, ~1/3 "
                                 "more compute). " + retry.explanation)
            return retry
        plan.hint += " Full activation recompute does not make any layout fit either."
    plan.hint += " Use more GPUs, GPUs with more memory, or shorter micro-batches."
    if work.attention in SCORE_BACKENDS and estimates:
        least = min(estimates, key=lambda e: e.total)
        plan.hint += (f" The {work.attention} attention's [s, s] tensors are "
                      f"{least.attention_scores / GIB:.1f} GiB of {least.layout}'s peak: an "
                      f"attention backend linear in tokens (model.attention_backend=auto with "
                      f"Transformer-Engine and FlashAttention or cuDNN) has none.")
    return plan


def plan_attention(work: Workload, hw: Hardware, flash_attn: str = "image"
                   ) -> tuple[Workload, str, str]:
    """``(work, basis, refusal)``: ``work`` with the backend the recipe runs on ``hw``'s GPUs with
    the FlashAttention ``flash_attn`` names (``memory_terms.resolve_attention``), what decided it,
    and "" or the trainer's refusal where it cannot run there (``work`` then unchanged)."""
    platform = planned_platform(hw.name, hw.compute_capability, flash_attn)
    basis = attention_basis(platform, flash_attn)
    try:
        return resolve_attention(work, platform), basis, ""
    except ValueError as exc:
        return work, basis, str(exc)


def refused_plan(model: PlannedModel, cluster: Cluster, work: Workload, refusal: str, *,
                 basis: str = "") -> Plan:
    """The plan of a recipe whose attention backend cannot run on the plan's GPUs: no layout, the
    trainer's ``refusal`` (its start-up message and fix) instead."""
    return Plan(model, cluster, work, [], None, "", None, hint=refusal,
                attention_basis=basis, attention_refusal=refusal)


def rollout_tensor_parallel(plan: Plan) -> int:
    """GPUs per vLLM engine: dedicated, ``rollout.tensor_parallel_size`` (default 1); colocated,
    as the trainer resolves it for the pick's layout."""
    work = plan.workload
    if work.rollout_placement == "dedicated" or plan.pick is None:
        return work.rollout_tp or 1
    return engine_tp(work, plan.pick.layout)


def estimate_step_times(plan: Plan, shape: StepShape, hw: Hardware, *,
                        staleness: int | None = None) -> list[StepTime]:
    """``steptime.step_times`` for the plan: engines colocated on all the job's GPUs and, with
    dedicated engines, on ``rollout_gpus``; the trainer at the pick's TP x PP x CP, its state moved
    to the host and back at a colocated refit when ``train.offload_training_state``."""
    model, cluster, work = plan.model, plan.cluster, plan.workload
    t_r = rollout_tensor_parallel(plan)
    reserve, weights, _ = engine_reserve(model.description, cluster, work, t_r)
    colocated_kv = max(reserve - weights, 0)
    offloaded = (plan.pick.grads + plan.pick.optimizer
                 if plan.pick is not None and work.offload_training_state else 0)
    lay = plan.pick.layout if plan.pick is not None else None
    layout = (lay.tp, lay.pp, lay.cp) if lay is not None else (1, 1, 1)
    return step_times(model.description, replace(shape, offloaded_state_bytes_per_gpu=offloaded),
                      hw, world=cluster.gpus, rollout_gpus=cluster.rollout_gpus, engine_tp=t_r,
                      kv_cache_bytes_per_engine_gpu=plan.engine.kv_cache if plan.engine
                      else colocated_kv, colocated_kv_cache_bytes_per_gpu=colocated_kv,
                      train_layout=layout, gpus_per_node=cluster.gpus_per_node,
                      staleness=staleness)


def balanced_schedules(plan: Plan, shape: StepShape, hw: Hardware, *, headroom: float = 0.1,
                       staleness: int | None = None) -> dict[str, StepTime | None]:
    """{"one-step-off" | "partial": the step on the dedicated GPUs (whole nodes, or whole engines on
    one node) that make it fastest, where the trainer still has a layout and the engines fit}; None
    where no split fits."""
    model, cluster, work = plan.model, plan.cluster, plan.workload
    t_r = rollout_tensor_parallel(plan)
    unit = math.lcm(cluster.gpus_per_node if cluster.nodes > 1 else 1, t_r)
    best: dict[str, StepTime | None] = {"one-step-off": None, "partial": None}
    for gpus in range(unit, cluster.gpus, unit):
        trial = make_plan(model, replace(cluster, rollout_gpus=gpus),
                          replace(work, rollout_placement="dedicated", colocated_rollout=False,
                                  rollout_tp=t_r), headroom=headroom)
        if not trial.fits:
            continue
        for t in estimate_step_times(trial, shape, hw, staleness=staleness):
            if t.placement in best and (best[t.placement] is None
                                        or t.step_s < best[t.placement].step_s):
                best[t.placement] = t
    return best


def step_time_estimate(run, cluster: Cluster, hardware: str = "a100", *,
                       mean_prompt_tokens: float = 200.0, mean_response_fraction: float = 0.5,
                       headroom: float = 0.1, hf_config: str | dict | None = None
                       ) -> dict[str, dict]:
    """A recipe with dedicated engines on ``cluster``: ``{"colocated" | "synchronous" |
    "one_step_off" | "partial": StepTime.as_dict()}``, the last three on ``rollout.num_gpus``, and
    ``"balanced"`` / ``"balanced_partial"`` on the fastest splits (``benchmarks/bench_async.py``),
    the attention backend the recipe runs on ``hardware`` (``resolve_attention``'s ``ValueError``
    where none does). ``hf_config``: ``catalogue.architecture_for``'s."""
    if run.rollout.placement != "dedicated":
        raise ValueError(f"step_time_estimate needs rollout.placement: dedicated, got "
                         f"{run.rollout.placement!r}")
    hw = HARDWARE[hardware]
    work = resolve_attention(Workload.from_recipe(run),
                             planned_platform(hw.name, hw.compute_capability))
    cluster = replace(cluster, rollout_gpus=run.rollout.num_gpus)
    plan = make_plan(architecture_for(run, hf_config), cluster, work, headroom=headroom,
                     recipe_tp=run.parallel.tensor_parallel, recipe_pp=run.parallel.pipeline_parallel,
                     recipe_cp=run.parallel.context_parallel)
    shape = StepShape.from_recipe(run, mean_prompt_tokens=mean_prompt_tokens,
                                  mean_response_fraction=mean_response_fraction)
    colocated, synchronous, one_step_off, partial = estimate_step_times(plan, shape, hw)
    balanced = balanced_schedules(plan, shape, hw, headroom=headroom)
    return {"colocated": colocated.as_dict(), "synchronous": synchronous.as_dict(),
            "one_step_off": one_step_off.as_dict(), "partial": partial.as_dict(),
            "balanced": _as_dict(balanced["one-step-off"]),
            "balanced_partial": _as_dict(balanced["partial"])}


def _no_fit_text(model: PlannedModel, cluster: Cluster, estimates: list[Estimate], *,
                 engines: int = 0) -> str:
    where = (f"{model.name} on {cluster.nodes} x {cluster.gpus_per_node} GPUs of "
             f"{cluster.gpu_memory_gb:g} GiB"
             + (f" ({cluster.world} for the trainer, {cluster.rollout_gpus} for dedicated engines)"
                if cluster.rollout_gpus else ""))
    if not estimates:
        dims = model.description.dims
        return (f"no layout of {where} is possible: TP must divide {cluster.gpus_per_node} "
                f"GPUs per node, {dims.heads} heads and {dims.kv_heads} KV groups, PP must "
                f"divide {dims.layers} layers, and TP x PP the world size"
                + (f"; EP must divide {dims.experts} experts and EP x ETP the GPUs per "
                   f"pipeline stage" if dims.moe else "")
                + (f"; DP must divide the {engines} dedicated engines (each replica refits "
                   f"and samples with its own share)" if engines else ""))
    least = min(estimates, key=lambda e: e.total)
    return (f"no layout fits {where}: the smallest peak is {least.total / GIB:.1f} GiB "
            f"({least.layout}).")
