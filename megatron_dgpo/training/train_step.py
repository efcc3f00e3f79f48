"""One policy-gradient forward/backward on a mini-batch with Megatron's schedules, split-invariant.

    result = train_step(models, micro_batches, loss_config, temperature=t)  # gradients final
    optimizer.step()
    outputs = forward_logprobs(models, micro_batches)   # [(logprobs [S], entropy [S])], no grad
    fill_old_logprobs(models, micro_batches)            # pi_prox into row.old_logprobs
    loss, n = sft_step(models, micro_batches)           # the supervised warm start's NLL

``models`` are this rank's chunks wrapped by ``policy.wrap_ddp``; ``micro_batches`` are
``packing.MicroBatch`` rows (any count and shapes per rank). The loss is averaged over the N
valid tokens of the WHOLE mini-batch, every micro-batch of every data-parallel rank,

    L = -(1/N) sum_{all DP ranks, micro-batches, tokens t} mask_t s_t,     N = sum mask_t,

(or over W = sum_t c_t with the per-token weights c_t of ``losses.sample_loss_weights``; each
term times its behaviour weight v_t, ``losses.behaviour_weights``), so the gradient does not
depend on TP, PP, DP or on how a rank's rows are cut into micro-batches. On
return the gradients in ``param.main_grad`` are final (DP-reduced, tied embeddings synchronised,
scaled by 1/N) and every rank returns the same numbers. Context parallelism: every rank of a
CP group passes the same whole rows; each runs its ``MicroBatch.cp_shard`` (THD), N, W and the
metrics are counted over DP x CP, ``forward_logprobs`` gathers whole rows back; v_t is taken on
the whole rows and GSPO's sample ratio sums a sample's shards over the CP group. How
Megatron's own averaging is neutralised, the weighted aggregations, the metrics' reduction, packed rows with and without
Transformer-Engine, the logits dtype, routing replay and overlapped reduction: docs/training.md,
"How the train step normalises" (and "Context parallelism").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import Tensor

from megatron_dgpo.algorithm.losses import (SEQUENCE_METHODS, LossConfig, LossMetrics, Segments,
                                            behaviour_weights, effective_sample_size,
                                            merge_metrics, policy_loss, reduce_metrics,
                                            summarize_metrics)
from megatron_dgpo.algorithm.packing import MicroBatch, cp_zigzag_indices
from megatron_dgpo.algorithm.vocab_parallel import logprobs_and_entropy
from megatron_dgpo.models.builder import unwrap_model
from megatron_dgpo.runtime import comm
from megatron_dgpo.runtime.gpu_flags import schedule_sync_hooks
from megatron_dgpo.runtime.parallel import (context_parallel_group, context_parallel_rank,
                                            context_parallel_size, data_parallel_group,
                                            is_last_pipeline_stage, pipeline_last_rank,
                                            pipeline_parallel_group, pipeline_parallel_size)


@dataclass
class StepResult:
    """What one ``train_step`` returns, identical on every rank.

    loss: L of the module docstring (float). num_tokens: N (kept valid tokens; 0 when every
    token of the mini-batch is filtered out: the gradients are zero and the caller should not
    step). metrics: the reduced ``losses.LossMetrics`` (``losses.loss_metrics`` + sums
    ``entropy_sum``, ``loss_sum`` (= L * W), ``weight_sum`` when weighted, TIS's when on).
    """

    loss: float
    num_tokens: int
    metrics: LossMetrics

    @property
    def summary(self) -> dict[str, float]:
        """Readable numbers: ``losses.summarize_metrics`` of ``metrics`` (with ``entropy`` and
        ``loss`` per token)."""
        return summarize_metrics(self.metrics)


def _packed_seq_params(mb: MicroBatch, device):
    """THD ``PackedSeqParams`` of one packed micro-batch, from its host ``cu_seqlens`` (the
    longest sample is read on the host: no device sync); for a context-parallel shard the
    whole row's (Megatron splits each sequence by them).

    Transformer-Engine's fused attention ignores arbitrary masks (its causal kernel would let a
    sample see the previous one); with cu_seqlens each sample is its own causal sequence.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = mb.cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    longest = mb.max_seqlen()
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _forward_kwargs(model) -> dict:
    """``{"fp32_output": False}`` when ``model`` (or a wrapper inside it) is Megatron's
    ``Float16Module``: logits stay in the model's dtype (docs/training.md); else nothing."""
    from megatron.core.transformer.module import Float16Module

    while True:
        if isinstance(model, Float16Module):
            return {"fp32_output": False}
        if not hasattr(model, "module"):
            return {}
        model = model.module


def _device(models) -> torch.device:
    return next(unwrap_model(models[0]).parameters()).device


def _pp_info():
    return (pipeline_parallel_group(), pipeline_parallel_size(), is_last_pipeline_stage(),
            pipeline_last_rank())


def _local(mb: MicroBatch) -> MicroBatch:
    """This context-parallel rank's shard of the whole row ``mb`` (the row itself at CP 1)."""
    return mb.cp_shard(context_parallel_rank(), context_parallel_size())


def _run_schedule(models, micro_batches, loss_fn, forward_only: bool, routing_replay=None):
    """Megatron's forward-backward over ``micro_batches`` with ``loss_fn(mb, output)``; with
    ``routing_replay`` each micro-batch's recorded routing is set before its forward. Under
    context parallelism the model and ``loss_fn`` see this CP rank's shard of each row (THD)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("micro_batches is empty")
    device = _device(models)

    cp = context_parallel_size()
    thd = unwrap_model(models[0]).transformer_engine or cp > 1  # CPU: cpu.py patch 15
    extra = _forward_kwargs(models[0])

    def forward_step(data_iterator, model):
        mb = _local(next(data_iterator)).to(device)
        if routing_replay is not None:
            routing_replay.set(model, mb)
        if thd:
            output = model(mb.tokens[None], mb.position_ids[None], None,
                           packed_seq_params=_packed_seq_params(mb, device), **extra)
        else:
            output = model(mb.tokens[None], mb.position_ids[None], mb.attention_mask(), **extra)
        return output, partial(loss_fn, mb)

    iterators = [iter(micro_batches) for _ in models]
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(models) > 1 else iterators[0],
            model=models if len(models) > 1 else models[0],
            num_microbatches=len(micro_batches),
            seq_length=max(len(mb.tokens) for mb in micro_batches) // cp,
            micro_batch_size=1,
            forward_only=forward_only,
        )
    finally:
        if routing_replay is not None:
            routing_replay.done()


def _dp_group():
    """DP x CP: each CP rank counts and measures its own tokens, Megatron's DDP reduces the
    gradients and ``finalize_model_grads`` the token count over this group."""
    return data_parallel_group(with_context_parallel=True)


def _check_micro_batch(mb: MicroBatch, index: int, need_loss_inputs: bool,
                       loss: LossConfig | None = None) -> None:
    if need_loss_inputs and (mb.old_logprobs is None or mb.advantages is None):
        raise ValueError(f"micro_batches[{index}] lacks old_logprobs or advantages")
    if loss is None:
        return
    if loss.loss_aggregation != "token_mean" and mb.loss_weights is None:
        raise ValueError(f"micro_batches[{index}] lacks loss_weights, which aggregation "
                         f"{loss.loss_aggregation!r} needs (losses.sample_loss_weights per sample)")
    if loss.rollout_correction != "none" and mb.rollout_logprobs is None:
        raise ValueError(f"micro_batches[{index}] lacks rollout_logprobs, which "
                         f"rollout_correction {loss.rollout_correction!r} needs")


def _valid_and_weights(mb: MicroBatch) -> tuple[Tensor, Tensor | None]:
    """The tokens in the loss ([S] bool: loss_mask and, when weighted, weight > 0) and the
    aggregation weights ([S] float64, or None on the unweighted path)."""
    if mb.loss_weights is None:
        return mb.loss_mask.bool(), None
    weights = mb.loss_weights.double()
    return mb.loss_mask.bool() & (weights > 0), weights


def train_step(models: list, micro_batches: list[MicroBatch], loss: LossConfig, *,
               temperature: float = 1.0, chunk_size: int | None = None,
               vocab_size: int | None = None, zero_grad: bool = True,
               routing_replay=None) -> StepResult:
    """Forward + backward of the policy loss on one mini-batch; gradients final on return.

    Args:
        models: this rank's model chunks wrapped by ``wrap_ddp`` (one per VPP stage).
        micro_batches: this DP rank's micro-batches (every TP/PP rank of the DP rank passes
            the same list); any count, any shapes; N is counted over all DP ranks.
        loss: the policy loss (``losses.LossConfig``: a recipe's ``algorithm`` section).
        temperature: the sampling temperature; logits are divided by it, as in the sampler.
        chunk_size: tokens per chunk in ``logprobs_and_entropy`` (default:
            ``vocab_parallel.default_chunk_size``).
        vocab_size: the HF vocabulary size (logit columns past it are TP padding); default
            ``models[0].hf_spec.vocab_size`` when built by ``builder.build_model``.
        zero_grad: zero the DDP gradient buffers first (set False to accumulate).
        routing_replay: a ``routing_replay.RoutingReplay``: the routers replay each
            micro-batch's ``routed_experts`` (docs/training.md); None: free routing.

    Returns:
        ``StepResult`` (same on every rank). Gradients are in ``param.main_grad``, already
        DP-reduced, tied-embedding-synchronised and scaled by 1/N (module docstring).
    """
    _check_models(models)
    for i, mb in enumerate(micro_batches):
        _check_micro_batch(mb, i, need_loss_inputs=True, loss=loss)
    weighted = {mb.loss_weights is not None for mb in micro_batches}
    if len(weighted) > 1:
        raise ValueError("some micro_batches carry loss_weights and some do not")
    weighted = weighted == {True}
    vocab_size = vocab_size or unwrap_model(models[0]).hf_spec.vocab_size
    device = _device(models)
    micro_batches, correction = _with_behaviour_weights(micro_batches, loss)

    # N (valid tokens) and, when weighted, W = sum_t c_t, both over every DP rank: Megatron
    # divides the gradients by N, so each micro-batch's loss sum is scaled by N / W.
    counts = [0.0, 0.0]
    for mb in micro_batches:
        valid, weights = _valid_and_weights(_local(mb))
        counts[0] += float(valid.sum())
        if weighted:
            counts[1] += float(torch.where(valid, weights, 0.0).sum())
    total = _count_over_dp(counts if weighted else counts[:1], device)
    num_tokens = int(total[0])
    weight_sum = float(total[1]) if weighted else float(num_tokens)
    # policy_loss divides its sum by ``scale``; Megatron then by N: the total is 1 / W.
    scale = weight_sum / num_tokens if weighted and num_tokens else 1.0

    seen = _prepare_backward(models, num_tokens, zero_grad)
    parts: list[dict] = []

    def loss_fn(mb: MicroBatch, logits: Tensor):
        logp, entropy = logprobs_and_entropy(logits, mb.targets[None], temperature=temperature,
                                             chunk_size=chunk_size, vocab_size=vocab_size)
        valid, weights = _valid_and_weights(mb)
        token_weights = weights
        if mb.behaviour_weights is not None:
            token_weights = mb.behaviour_weights * (weights if weights is not None else 1.0)
        loss_sum, metrics = policy_loss(
            loss.method, logp, mb.old_logprobs[None], mb.advantages[None], valid[None], loss.loss,
            num_tokens=scale, weights=None if token_weights is None else token_weights[None],
            segments=_segments(mb, batched=True) if loss.method in SEQUENCE_METHODS else None)
        metrics.sums["entropy_sum"] = torch.where(valid, entropy[0].double(), 0.0).sum()
        metrics.sums["loss_sum"] = loss_sum.detach().double() * scale
        if weighted:
            metrics.sums["weight_sum"] = torch.where(valid, weights, 0.0).sum()
        parts.append(metrics)
        return loss_sum, valid.sum().to(torch.int), {}

    _run_schedule(models, micro_batches, loss_fn, forward_only=False,
                  routing_replay=routing_replay)
    _check_token_count(seen, num_tokens)

    merged = _metrics_from_last_stage(merge_metrics(parts) if parts else None)
    reduced = reduce_metrics(merged, group=_dp_group())
    if correction is not None:
        reduced = merge_metrics([reduced, correction])
    loss_value = float(reduced["loss_sum"]) / weight_sum if num_tokens else 0.0
    return StepResult(loss=loss_value, num_tokens=num_tokens, metrics=reduced)


def _with_behaviour_weights(micro_batches: list[MicroBatch], loss: LossConfig):
    """The rows with their behaviour weights v (``losses.behaviour_weights``; a sample's
    statistics over its whole response, from the whole row every CP rank holds), and the
    weights' metrics over the whole mini-batch (reduced over DP: every CP, TP and PP rank of
    a replica computed the same), with the effective sample size; ``(rows, None)`` when
    ``loss.rollout_correction`` is ``none``."""
    if loss.rollout_correction == "none":
        return micro_batches, None
    rows, parts = [], []
    for mb in micro_batches:
        valid, _ = _valid_and_weights(mb)
        weights, metrics = behaviour_weights(loss, mb.old_logprobs, mb.rollout_logprobs, valid,
                                             _segments(mb))
        rows.append(replace(mb, behaviour_weights=weights))
        parts.append(metrics)
    reduced = reduce_metrics(merge_metrics(parts), group=data_parallel_group())
    return rows, merge_metrics([reduced, effective_sample_size(reduced)])


def _segments(mb: MicroBatch, batched: bool = False) -> Segments:
    """The samples of row (or CP shard) ``mb`` (ids [S], or [1, S] when ``batched``); a shard's
    per-sample totals are summed over the CP group, so each is over the sample's whole
    response."""
    group = context_parallel_group() if mb.cp_size > 1 else None
    ids = mb.sample_ids().to(mb.tokens.device)
    return Segments(ids[None] if batched else ids, len(mb.cu_seqlens) - 1,
                    reduce=None if group is None else partial(_sum_over, group=group))


def _sum_over(values: Tensor, group) -> Tensor:
    return comm.reduce_values(values, "sum", group).to(values.device)


def _check_models(models: list) -> None:
    config = unwrap_model(models[0]).config
    if not config.calculate_per_token_loss:
        raise ValueError("the model config must have calculate_per_token_loss=True (the train "
                         "step's 1/N normalisation relies on it); build it with "
                         "megatron_dgpo.models.builder.build_model")
    if not all(hasattr(m, "zero_grad_buffer") for m in models):
        raise TypeError("train_step needs models wrapped by training.policy.wrap_ddp")


def _count_over_dp(values: list[float], device) -> list[float]:
    return comm.reduce_values(torch.tensor(values, dtype=torch.float64), "sum", _dp_group()).tolist()


def _prepare_backward(models: list, num_tokens: int, zero_grad: bool) -> dict:
    """Set up one backward of Megatron's schedule normalised by ``num_tokens`` (module
    docstring): Megatron's ``finalize_model_grads`` as the config's finalize function, DDP's
    sync hooks, and (``zero_grad``) clean gradient buffers. Returns the dict in which the
    finalize step records the token count Megatron used (``_check_token_count``)."""
    from megatron.core.distributed import finalize_model_grads

    config = unwrap_model(models[0]).config
    seen = {}

    def finalize(model_chunks, tokens, **kwargs):
        # no kept token anywhere (every group of the mini-batch filtered out): the gradients
        # are exact zeros; 1/0 would turn them into NaN
        finalize_model_grads(model_chunks, tokens if num_tokens else None, **kwargs)
        seen["megatron_tokens"] = int(tokens.item()) if tokens is not None else None

    config.finalize_model_grads_func = finalize
    for name, hook in schedule_sync_hooks(models).items():
        setattr(config, name, hook)
    for model in models:
        if zero_grad:
            model.zero_grad_buffer()
        # Megatron's optimizer leaves param.grad aliasing main_grad after a step; autograd would
        # then accumulate into main_grad AND the DDP hook add the same gradient again (2x).
        for param in model.parameters():
            param.grad = None
    return seen


def _check_token_count(seen: dict, num_tokens: int) -> None:
    if seen.get("megatron_tokens") not in (None, num_tokens):
        raise RuntimeError(f"Megatron normalised by {seen['megatron_tokens']} tokens, the "
                           f"mini-batch has {num_tokens}: micro-batches differ across ranks?")


def sft_step(models: list, micro_batches: list[MicroBatch], *, vocab_size: int | None = None,
             chunk_size: int | None = None, zero_grad: bool = True) -> tuple[float, int]:
    """Forward + backward of the supervised (negative log-likelihood) loss on one batch:

        L = -(1/N) sum_{all DP ranks, micro-batches, t} mask_t log pi_theta(targets_t),

    N the valid (response) tokens of the whole batch, normalised exactly as ``train_step``'s
    token mean (module docstring), so the gradient does not depend on TP, PP, DP or the
    micro-batch split. Micro-batches need only tokens, targets and ``loss_mask``. Returns
    ``(L, N)``, the same on every rank; gradients are final in ``param.main_grad``.
    """
    _check_models(models)
    vocab_size = vocab_size or unwrap_model(models[0]).hf_spec.vocab_size
    device = _device(models)
    num_tokens = int(_count_over_dp([float(sum(int(_local(mb).loss_mask.sum())
                                               for mb in micro_batches))], device)[0])
    if not num_tokens:
        raise ValueError("sft_step: the batch has no response token (every loss_mask is False)")
    seen = _prepare_backward(models, num_tokens, zero_grad)
    nll_sums: list[Tensor] = []

    def loss_fn(mb: MicroBatch, logits: Tensor):
        logp, _ = logprobs_and_entropy(logits, mb.targets[None], chunk_size=chunk_size,
                                       vocab_size=vocab_size)
        valid = mb.loss_mask.bool()[None]
        nll = -torch.where(valid, logp.float(), 0.0).sum()
        nll_sums.append(nll.detach().double())
        return nll, valid.sum().to(torch.int), {}

    _run_schedule(models, micro_batches, loss_fn, forward_only=False)
    _check_token_count(seen, num_tokens)
    local = {"nll_sum": torch.stack(nll_sums).sum()} if nll_sums else None
    nll_sum = comm.reduce_values(_metrics_from_last_stage(local)["nll_sum"], "sum", _dp_group())
    return float(nll_sum) / num_tokens, num_tokens


def _metrics_from_last_stage(merged):
    """The last pipeline stage's merged metrics (a ``LossMetrics`` or a dict of scalar
    tensors) on every stage. They cross PP as plain floats, read from the device in one
    transfer per group: no tensor travels in the broadcast object (pickled device tensors
    come back on the sender's device index); every stage rebuilds float64 CPU tensors, which
    ``reduce_metrics`` / ``comm.reduce_values`` then place for the DP reduction."""
    pp_group, pp_size, last, last_rank = _pp_info()
    if pp_size == 1:
        return merged
    host = _host_floats(merged) if last else None
    return _from_host_floats(comm.broadcast_object(host, src=last_rank, group=pp_group))


def _host_floats(metrics) -> tuple | None:
    """``metrics`` as ``(kind, {group: {name: float}})``: nothing but Python floats."""
    if metrics is None:
        return None
    if isinstance(metrics, LossMetrics):
        kind, groups = "loss", {"sums": metrics.sums, "mins": metrics.mins, "maxs": metrics.maxs}
    else:
        kind, groups = "dict", {"values": metrics}

    def floats(group: dict) -> dict:
        keys = sorted(group)
        values = torch.stack([group[k].detach().double() for k in keys]).tolist() if keys else []
        return dict(zip(keys, values))

    return kind, {name: floats(group) for name, group in groups.items()}


def _from_host_floats(host):
    if host is None:
        return None
    kind, groups = host
    tensors = {name: {k: torch.tensor(v, dtype=torch.float64) for k, v in group.items()}
               for name, group in groups.items()}
    return LossMetrics(**tensors) if kind == "loss" else tensors["values"]


def forward_logprobs(models: list, micro_batches: list[MicroBatch], *, temperature: float = 1.0,
                     vocab_size: int | None = None, chunk_size: int | None = None,
                     all_stages: bool = True,
                     routing_replay=None) -> list[tuple[Tensor, Tensor]] | None:
    """Per-token log pi(labels) and entropy for each micro-batch, without gradients.

    Returns ``[(logprobs [S], entropy [S]), ...]`` float32 on CPU, one pair per
    micro-batch (values under ``loss_mask == 0`` are computed too but meaningless for
    padding). With PP > 1 the pairs are broadcast from the last stage to every stage unless
    ``all_stages=False`` (then other stages get None). Models may be DDP-wrapped or not.
    ``routing_replay``: as in ``train_step``.
    """
    if vocab_size is None:
        vocab_size = unwrap_model(models[0]).hf_spec.vocab_size
    outputs: list[tuple[Tensor, Tensor]] = []

    def loss_fn(mb: MicroBatch, logits: Tensor):
        logp, entropy = logprobs_and_entropy(logits, mb.targets[None], temperature=temperature,
                                             chunk_size=chunk_size, vocab_size=vocab_size)
        outputs.append(torch.stack([logp[0].detach().float(), entropy[0].detach().float()]))
        zero = torch.zeros((), device=logits.device)
        return zero, torch.zeros((), dtype=torch.int, device=logits.device), {}

    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        with torch.no_grad():
            _run_schedule(models, micro_batches, loss_fn, forward_only=True,
                          routing_replay=routing_replay)
    finally:
        for m, mode in zip(models, was_training):
            m.train(mode)

    if context_parallel_size() > 1:
        outputs = [_whole_row(both, mb) for both, mb in zip(outputs, micro_batches)]
    pp_group, pp_size, last, last_rank = _pp_info()
    if pp_size == 1 or (not all_stages and last):
        return [(both[0].cpu(), both[1].cpu()) for both in outputs]
    if not all_stages:
        return None
    device = _device(models)
    result = []
    for i, mb in enumerate(micro_batches):
        both = (outputs[i].to(device) if last
                else torch.empty(2, *mb.tokens.shape, dtype=torch.float32, device=device))
        comm.broadcast_(both, src=last_rank, group=pp_group)
        both = both.cpu()
        result.append((both[0], both[1]))
    return result


def prox_logprobs(models: list, rows: list[MicroBatch], *, temperature: float = 1.0,
                  chunk_size: int | None = None, routing_replay=None) -> list[Tensor]:
    """log pi_prox of every row's targets: the policy as it is now (the start of a step), by a
    forward without gradients (``forward_logprobs``); [S] float32 on CPU, 0 off the loss mask."""
    outputs = forward_logprobs(models, rows, temperature=temperature, chunk_size=chunk_size,
                               routing_replay=routing_replay)
    return [torch.where(row.loss_mask, logp, 0.0) for row, (logp, _) in zip(rows, outputs)]


def fill_old_logprobs(models: list, rows: list[MicroBatch], source: str = "trainer",
                      **forward) -> None:
    """pi_old of the step's loss (pi_prox of the decoupled objective) into every row's
    ``old_logprobs``: ``trainer``, ``prox_logprobs`` (``forward``: its keyword arguments);
    ``rollout``, the engine's log-probs (the bypass: no forward). Collective for ``trainer``."""
    if source not in ("trainer", "rollout"):
        raise ValueError(f"old log-probs come from 'trainer' or 'rollout', got {source!r}")
    if source == "rollout":
        for row in rows:
            row.old_logprobs = row.rollout_logprobs
        return
    for row, logp in zip(rows, prox_logprobs(models, rows, **forward)):
        row.old_logprobs = logp


def _whole_row(local: Tensor, mb: MicroBatch) -> Tensor:
    """[2, S] log-probs and entropy of the whole row ``mb`` from every CP rank's [2, S / CP]
    (``local`` this rank's): all-gathered over the CP group, put back in row order."""
    group, size = context_parallel_group(), context_parallel_size()
    local = local.to(comm.device_of(group)).contiguous()
    shards = comm.all_gather_([torch.empty_like(local) for _ in range(size)], local, group)
    whole = torch.empty(2, len(mb.tokens), dtype=local.dtype, device=local.device)
    for rank, shard in enumerate(shards):
        whole[:, cp_zigzag_indices(mb.cu_seqlens, rank, size).to(local.device)] = shard
    return whole
