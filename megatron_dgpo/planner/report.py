"""``dgpo-plan``'s text: every layout's memory terms with the pick and its reasons
(``format_table``), and ``--explain``'s terms of memory and step time (``explain``,
``explain_step_time``)."""

from __future__ import annotations

from megatron_dgpo.planner.inputs import GIB, Cluster
from megatron_dgpo.planner.lengths import ResponseLengths
from megatron_dgpo.planner.memory_terms import (SCORE_BACKENDS,
                                                activation_elements_per_token_layer,
                                                score_layer_bytes, score_row)
from megatron_dgpo.planner.parameters import padded_vocab, param_count, stage_params
from megatron_dgpo.planner.peak import TERMS, EngineEstimate, Estimate
from megatron_dgpo.planner.search import Plan, preference
from megatron_dgpo.planner.steptime import StepTime


def _stage_index(e: Estimate) -> int:
    return {"only": 0, "first": 0, "last": e.layout.pp - 1}.get(e.stage) \
        if not e.stage.isdigit() else int(e.stage)


def explain(plan: Plan, e: Estimate | None = None) -> str:
    """``dgpo-plan --explain``: every term of one estimate (default: the pick) as ``term  formula =
    value  why``, with ``e``'s own values."""
    e = e or plan.pick
    desc, work, lay = plan.model.description, plan.workload, e.layout
    dims = desc.dims
    t, p, d, c = lay.tp, lay.pp, lay.dp, lay.cp
    shards = d * c  # the distributed optimizer's DP x CP group
    n = stage_params(desc, t, p, _stage_index(e), lay.ep, lay.expert_tp)
    n_e = e.expert_params
    rows = padded_vocab(dims.vocab, t)
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    recompute = "full recompute: each layer's input kept, one layer recomputed" \
        if work.recompute else "no recompute"
    lines = [f"{lay}, {e.stage} pipeline stage GPU: {gib(e.total)} of {gib(e.gpu_bytes)}",
             f"  weights      b N = {work.dtype_bytes} x {n:,} = {gib(e.weights)}"
             f"   (N: this stage's parameters, V_pad = {rows}"
             + (f"; of them N_e = {n_e:,} routed-expert parameters: (L / p) (E / EP) 3 f_e h / "
                f"ETP, {dims.experts // lay.ep} of {dims.experts} experts per layer at EP "
                f"{lay.ep}, ETP {lay.expert_tp})" if lay.moe else ")"),
             f"  grads        4 N = {gib(e.grads)}   (fp32 main_grad for every local "
             f"parameter: grad_reduce_in_fp32)",
             (f"  optimizer    12 (N - N_e) / {shards if work.distributed_optimizer else 1} + "
              f"12 N_e / {lay.expert_dp if work.distributed_optimizer else 1} = "
              if lay.moe else
              f"  optimizer    12 N / {shards if work.distributed_optimizer else 1} = ")
             + f"{gib(e.optimizer)}   (fp32 master + Adam m, v"
             + ((", the dense parameters sharded over DP, the experts over expert DP = "
                 "world / (PP EP ETP) by the distributed optimizer)" if lay.moe else
                 ", sharded over DP x CP by the distributed optimizer)")
                if work.distributed_optimizer else ", not sharded)"),
             f"  activations  m (L / p) (s / c) E b / t"
             + (" + [s, s] attention tensors" if work.attention in SCORE_BACKENDS else "")
             + f" = {gib(e.activations)}   (s = "
             f"{work.micro_batch_tokens} tokens"
             + (f", s / c = {-(-work.micro_batch_tokens // c)} per CP rank" if c > 1 else "")
             + ", E = "
             f"{activation_elements_per_token_layer(desc, lay.expert_tp):,} elements per "
             f"token and layer"
             + (f" incl. the routed copies' k (ETP h + 3 f_e) = {dims.topk} x ({lay.expert_tp} x "
                f"{dims.hidden} + 3 x {dims.moe_ffn})" if lay.moe else "")
             + (f", sequence parallel over TP {t}" if work.attention != "local"
                else ", no sequence parallelism (local spec)")
             + f"; {recompute}; {work.attention} attention"
             + (_scores_text(plan, e) if work.attention in SCORE_BACKENDS else "") + ")",
             (f"  dispatch     {_dispatch_formula(work.moe_dispatcher)} = {gib(e.dispatch)}   "
              f"({work.moe_dispatcher} token dispatcher, one MoE layer's transient buffers: "
              f"T = s / t = {-(-work.micro_batch_tokens // t)} tokens, k = {dims.topk}, EP "
              f"{lay.ep}, ETP {lay.expert_tp}; megatron/core/transformer/moe/"
              f"token_dispatcher.py)" if lay.moe else
              f"  dispatch     0 = {gib(0)}   (dense model: no token dispatcher)"),
             f"  logits       2 (s / c) (V_pad / t) b + 2 chunk (V_pad / t) 4 = {gib(e.logits)}   "
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


def _scores_text(plan: Plan, e: Estimate) -> str:
    """``--explain``'s words for the [s, s] attention tensors of ``e`` (``score_row``,
    ``score_layer_bytes``, ``attention_score_bytes``)."""
    work, lay = plan.workload, e.layout
    rows, seq = score_row(work.attention, -(-work.micro_batch_tokens // lay.cp),
                          work.max_sequence, lay.tp)
    heads = plan.model.description.dims.heads // lay.tp
    saved, live = score_layer_bytes(work.attention, rows, seq, heads, work.dtype_bytes)
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    return (f": {rows} sequence(s) padded to S = {seq}, a / t = {heads} heads, per layer "
            f"{gib(saved)} saved for backward and {gib(live)} while it runs; "
            f"[s, s] tensors in all {gib(e.attention_scores)}")


def explain_step_time(times: list[StepTime], lengths: ResponseLengths | None = None) -> str:
    """``dgpo-plan --explain``: the response lengths, then every term of each schedule's step
    time (``steptime``'s generation, training and refit terms), seconds."""
    lines = []
    if lengths is not None:
        lines.append(f"response lengths  min(L, {lengths.cap:.0f}), ln L ~ Normal({lengths.mu:.2f}, "
                     f"{lengths.sigma:.2f}): mean {lengths.mean:.0f}, {lengths.truncated:.1%} at the "
                     f"cap, E[X^2] / (2 E[X]) = {lengths.running_age:.0f} tokens decoded by a "
                     f"running response on average (docs/planner.md#response-lengths)")
    for t in times:
        g, tr, r = (t.terms.get(k, {}) for k in ("generation", "training", "refit"))
        lines.append(f"{t.label} ({t.trainer_gpus} trainer GPUs"
                     + (f", {t.rollout_gpus} rollout GPUs" if t.rollout_gpus else "")
                     + f"): step {t.step_s:.1f} s, {t.dominant} dominates")
        if "tail_steps" in g:
            lines += [
                f"  generation   {g['total']:.1f} s = prefill {g['prefill_s']:.1f} + bulk "
                f"{g['bulk_steps']:.0f} steps x {g['bulk_step_s'] * 1e3:.1f} ms + tail "
                f"{g['tail_steps']:.0f} steps x {g['tail_step_s'] * 1e3:.1f} ms   ({g['responses']} "
                f"responses per engine, {g['concurrent']} at once, {g['tail_running']:.1f} running "
                f"in the tail: the longest of the last {g['last_wave']} responses, "
                f"{g['tail_steps'] / g['mean_response']:.2f}x the mean)"]
        elif g:
            lines += [
                f"  generation   {g['total']:.1f} s = prefill {g['prefill_s']:.1f} + decode "
                f"{g['decode_steps']:.0f} steps x {g['decode_step_s'] * 1e3:.1f} ms + re-prefill "
                f"{g['reprefill_s']:.1f}   ({g['responses']} responses per engine, "
                f"{g['concurrent']} always in flight at a mean context of {g['context']:.0f})",
                f"    re-prefill each refit recomputes the KV of the {g['concurrent']} interrupted "
                f"responses (prompt + partial response): {g['reprefill_tokens']:,.0f} tokens per "
                f"engine",
                f"    staleness  a refit every {g['tokens_per_refit']:.0f} decode steps interrupts "
                f"{g['interrupted']:.0%} of the responses ({g['segments']:.2f} segments each); "
                f"k >= {g['min_staleness']} admits a cap-length one; at k = {g['staleness']}, "
                f"{g['over_bound']:.1%} are older"]
        if g:
            lines.append(f"    of it      step overhead {g['overhead_s']:.1f} s (o per decode step), "
                         f"sampler {g['sampling_s']:.1f} s (per row x vocabulary: one kernel for the "
                         f"batch on vLLM's Model Runner V2, seeded requests included)")
        if tr:
            lines.append(f"  training     {tr['total']:.1f} s = update {tr['update_s']:.1f} + "
                         f"log-probs {tr['logprobs_s']:.1f}   (mfu {tr['mfu']:.3f} x pipeline "
                         f"{tr['pipeline_efficiency']:.2f} x TP communication "
                         f"{tr['tp_efficiency']:.2f} x CP communication "
                         f"{tr.get('cp_efficiency', 1.0):.2f})")
            if tr.get("cp_comm_ms"):
                lines.append(f"    CP ring    per layer and row: K/V {tr['cp_comm_ms']:.2f} ms over "
                             f"{tr['cp_link']} against attention {tr['cp_attention_ms']:.2f} ms "
                             f"(overlapped; the rest exposed)")
            if tr.get("grad_reduce_s"):
                lines.append(f"    DP x CP    gradient reduce + parameter gather "
                             f"{tr['grad_reduce_s']:.2f} s per update, "
                             f"{tr['grad_reduce_exposed_s']:.2f} s exposed beyond backward")
        if r:
            lines.append(f"  refit        {r['total']:.1f} s = fixed {r['fixed_s']:.1f} + bytes "
                         f"{r['bytes_s']:.1f} + tensors {r['tensors_s']:.1f}"
                         + (f" + network {r['network_s']:.1f}" if r['network_s'] else "")
                         + (f" + offloaded state {r['offload_s']:.1f}" if r['offload_s'] else ""))
    return "\n".join(lines)


def _dispatch_formula(dispatcher: str) -> str:
    """``memory_terms.dispatcher_bytes``'s formula for ``dispatcher``."""
    return "T h b (ETP EP + 2 ETP k)" if dispatcher == "allgather" else "T k h b (1 + 2 ETP)"


def format_table(plan: Plan, headroom: float) -> str:
    """The human-readable report: one row per layout (GiB on its peak GPU), then the pick."""
    model, cl, work = plan.model, plan.cluster, plan.workload
    desc = model.description
    dims = desc.dims
    lines = [f"{model.name}: {param_count(desc) / 1e9:.2f}B parameters (h={dims.hidden}, "
             f"L={dims.layers}, heads={dims.heads}, kv={dims.kv_heads}, f={dims.ffn}, "
             f"V={dims.vocab}, tied={desc.tie_word_embeddings}"
             + (f", {dims.experts} experts of f_e={dims.moe_ffn}, top-{dims.topk}, "
                f"{work.moe_dispatcher} dispatcher" if dims.moe else "") + ")",
             f"cluster: {cl.nodes} node(s) x {cl.gpus_per_node} GPUs x {cl.gpu_memory_gb:g} GiB; "
             f"micro-batch {work.micro_batch_tokens} tokens, recompute={work.recompute}, "
             f"distributed optimizer={work.distributed_optimizer}, "
             f"vLLM placement="
             + (f"dedicated ({cl.rollout_gpus} of the {cl.gpus} GPUs; the trainer's world is the "
                f"other {cl.world})" if work.rollout_placement == "dedicated"
                else work.rollout_placement if work.colocated_rollout else "none"),
             "attention: " + (f"refused for model.attention_backend={work.attention_backend}"
                              if plan.attention_refusal else _attention_text(work))
             + (f" on {plan.attention_basis}" if plan.attention_basis else ""),
             ""]
    if plan.attention_refusal:
        lines.append("DOES NOT RUN: the trainer would stop at start-up with: "
                     + plan.attention_refusal)
        return "\n".join(lines)
    if plan.required_overrides:
        lines[-1:] = [f"as configured, {plan.as_configured[0].lower()}{plan.as_configured[1:]}",
                      f"planned with {' '.join(plan.required_overrides)}:", ""]
    head = ["layout", "stage"] + list(TERMS) + ["total", "fits"]
    rows = []
    for e in sorted(plan.estimates, key=preference):
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
                     f" parallel.context_parallel={lay.cp}"
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


def _attention_text(work) -> str:
    """The backend the activations are counted for, and how it grows with the row."""
    how = ("[s, s] tensors per layer" if work.attention in SCORE_BACKENDS
           else "activations linear in tokens")
    requested = ("model.without_transformer_engine=true" if work.without_transformer_engine
                 else f"model.attention_backend={work.attention_backend}")
    return f"{work.attention} ({requested}; {how})"


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
    """Every schedule's step (seconds) and speed-up over the synchronous colocated one, the
    fastest splits, what partial rollouts cost and the staleness they need."""
    head = ["schedule", "trainer GPUs", "rollout GPUs", "generation", "training", "refit",
            "step", "speed-up", "trainer idle", "engine idle", ""]
    base, priced = plan.step_times[0].step_s, plan.priced
    rows = [[t.label + ("" if split == "recipe" else ", fastest split"), str(t.trainer_gpus),
             str(t.rollout_gpus or "-")]
            + [f"{v:.0f}" for v in (t.generation_s, t.training_s, t.refit_s, t.step_s)]
            + [f"{base / t.step_s:.2f}x", f"{t.trainer_idle_s:.0f}", f"{t.engine_idle_s:.0f}",
               "<- " + _schedule_words(plan) if t is priced else ""]
            for t, split in plan.schedules()]
    lines = [f"step time in seconds ({plan.step_time_basis}; a roofline model, "
             f"docs/planner.md#step-time; speed-up against the synchronous colocated step):"]
    lines += [line.rstrip() for line in _aligned(head, rows)]
    sync = plan.step_times[1] if len(plan.step_times) > 1 else plan.step_times[0]
    g = sync.terms.get("generation", {})
    if g:
        lines.append(f"the batch's tail ({sync.label}): the longest of the last {g['last_wave']} "
                     f"responses is expected at {g['tail_steps']:.0f} tokens, "
                     f"{g['tail_steps'] / g['mean_response']:.1f}x the mean; through it an "
                     f"engine decodes {g['tail_running']:.0f} of {g['concurrent']} sequences on "
                     f"average")
    for name in ("one-step-off", "partial"):
        b = plan.balanced.get(name)
        if b is not None:
            lines.append(f"{'one-step-off is' if name == 'one-step-off' else 'partial rollouts are'}"
                         f" fastest with rollout.num_gpus={b.rollout_gpus} ({b.step_s:.0f} s "
                         f"per step: {base / b.step_s:.2f}x the colocated step; generation "
                         f"{b.generation_s:.0f} s beside training {b.training_s:.0f} s)")
    partial = priced if priced is not None and priced.placement == "partial" else next(
        (t for t, _ in plan.schedules() if t.placement == "partial"), None)
    if partial is not None:
        g = partial.terms["generation"]
        lines.append(f"partial rollouts ({partial.rollout_gpus} rollout GPUs): {g['concurrent']} "
                     f"responses in flight per engine; a refit every {g['tokens_per_refit']:.0f} "
                     f"decode steps interrupts {g['interrupted']:.0%} of the responses "
                     f"({g['segments']:.1f} segments each) and re-prefills "
                     f"{g['reprefill_tokens'] / 1e3:.0f}k tokens per engine ({g['reprefill_s']:.0f} "
                     f"s); max_staleness >= {g['min_staleness']} admits every response"
                     + (f"; at k = {g['staleness']}, {g['over_bound']:.0%} of them would be "
                        f"older" if g["over_bound"] > 0 else ""))
    k, with_partial = plan.schedule
    if k >= 2 and not with_partial:
        lines.append(f"k = {k} without partial rollouts is priced as one-step-off: without them "
                     f"every refit waits for the responses in flight")
    return "\n".join(lines)


def _schedule_words(plan: Plan) -> str:
    k, partial = plan.schedule
    return f"rollout.max_staleness={k}" + (" with rollout.partial" if partial else "")
