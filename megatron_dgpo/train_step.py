"""One policy-gradient forward/backward on a mini-batch with Megatron's schedules, split-invariant.

The trainer calls, per mini-batch (after ``models = wrap_ddp(build_model(...))``)::

    result = train_step(models, micro_batches, LossConfig(method="dgpo"), vocab_size=V)
    optimizer.step()          # the trainer's (Megatron's optimizer on GPU)

and, for old log-probs or evaluation::

    outputs = forward_logprobs(models, micro_batches, vocab_size=V)   # [B, S] per micro-batch

Normalisation. The loss is the DGPO estimator averaged over the N valid tokens of the WHOLE
mini-batch: all micro-batches of this rank and of every data-parallel rank,

    L = -(1/N) sum_{all DP ranks, micro-batches, tokens t} mask_t s_t,     N = sum mask_t,

so the gradient does not depend on TP, PP, DP sizes or on how a rank's rows are cut into
micro-batches. How Megatron's own averaging is neutralised: the model config has
``calculate_per_token_loss=True`` (``model.transformer_config_from_hf`` sets it; checked here),
and the loss function returns the triple ``(-sum_t mask_t s_t, n_valid_tokens, logs)``
(``policy_loss(..., num_tokens=1)``). With that flag

* the schedule does not divide the loss by ``num_microbatches`` (it only sums the token counts),
* Megatron DDP sums gradients over DP instead of averaging (``gradient_scaling_factor = 1``),
* ``finalize_model_grads(models, total_tokens)`` broadcasts the count from the last pipeline
  stage, all-reduces it over DP and scales every gradient by ``1/N``.

So the gradients left in ``param.main_grad`` are exactly dL/dtheta. N is also all-reduced over DP
here before the schedule runs (every rank knows its masks) and checked against the count
Megatron used. ``finalize_model_grads`` (DP all-reduce, tied-embedding gradient sum across the
first and last pipeline stages, 1/N scaling) runs inside ``train_step``: afterwards the
gradients are final and the optimizer may step.

Metrics (``policy_loss`` metrics + entropy as token-weighted ``entropy_sum`` and the loss sum)
are merged exactly over micro-batches on the last stage (``losses.merge_metrics``), broadcast
to the other pipeline stages, and reduced over DP (``losses.reduce_metrics``): every rank
returns the same numbers.

Micro-batch rows are right-padded or packed. Megatron's RoPE uses positions 0..S-1 of each row
(``position_ids`` only matter for learned absolute embeddings), so rows must be right-padded,
and packed segments rely on RoPE being relative; a packed row carries ``segment_ids`` and gets a
block-diagonal causal mask with the local spec; with Transformer-Engine (GPU) a packed row goes
in as THD ``PackedSeqParams`` (cu_seqlens from the segment ids), because TE's causal kernel
ignores arbitrary masks. The THD path needs a GPU with TE and is not exercised by the CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dgpo.losses import (LossHyperparams, LossMetrics, merge_metrics, policy_loss,
                                  reduce_metrics, summarize_metrics)
from megatron_dgpo.model import unwrap_model, use_transformer_engine
from megatron_dgpo.packing import block_causal_mask
from megatron_dgpo.vocab_parallel import logprobs_and_entropy


@dataclass
class MicroBatch:
    """One micro-batch of B rows of S tokens. Position s of ``labels``/``loss_mask``/
    ``old_logprobs``/``advantages`` refers to predicting ``labels[b, s]`` from ``tokens[b, :s+1]``
    (so ``labels[b, s] = tokens[b, s+1]`` inside a sequence).

    tokens: [B, S] int64 input ids (right-padded, or packed segments).
    labels: [B, S] int64 next-token ids, in [0, vocab_size) everywhere (use any id under mask 0).
    loss_mask: [B, S] bool/0-1, 1 on response tokens that enter the loss.
    old_logprobs: [B, S] float32 log pi_old(labels) (any finite value under mask 0).
    advantages: [B, S] float32 per-token advantages.
    position_ids: [B, S] int64, optional (default 0..S-1 per row; see module docstring).
    segment_ids: [B, S] int64, optional: packed rows; tokens attend only within their segment.
    attention_mask: [B or 1, 1, S, S] bool, optional, True = masked (overrides segment_ids).
    """

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    old_logprobs: Tensor | None = None
    advantages: Tensor | None = None
    position_ids: Tensor | None = None
    segment_ids: Tensor | None = None
    attention_mask: Tensor | None = None

    def __post_init__(self):
        if self.tokens.dim() != 2:
            raise ValueError(f"MicroBatch.tokens must be [B, S], got {tuple(self.tokens.shape)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "attention_mask" or value is None:
                continue
            if tuple(value.shape) != tuple(self.tokens.shape):
                raise ValueError(f"MicroBatch.{f.name} has shape {tuple(value.shape)}, tokens "
                                 f"has {tuple(self.tokens.shape)}")

    def to(self, device) -> MicroBatch:
        moved = {f.name: (getattr(self, f.name).to(device) if getattr(self, f.name) is not None
                          else None) for f in fields(self)}
        return MicroBatch(**moved)


def padded_micro_batch(sequences: list[Tensor], loss_masks: list[Tensor],
                       old_logprobs: list[Tensor] | None = None,
                       advantages: list[Tensor] | None = None, *, pad_id: int = 0) -> MicroBatch:
    """Right-padded ``MicroBatch`` from whole sequences.

    sequences[i]: [L_i] token ids (prompt + response). loss_masks[i]: [L_i] bool, True on
    tokens that are predicted in the loss (response tokens; position 0 is never predicted).
    old_logprobs[i], advantages[i]: [L_i], aligned with the tokens they score (entry 0 unused).
    Rows are padded to max L_i; targets are shifted to the predicting position.
    """
    rows, width = len(sequences), max(len(s) for s in sequences)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    old = torch.zeros(rows, width)
    adv = torch.zeros(rows, width)
    for i, seq in enumerate(sequences):
        n = len(seq)
        if len(loss_masks[i]) != n:
            raise ValueError(f"loss_masks[{i}] has length {len(loss_masks[i])}, sequence {n}")
        tokens[i, :n] = seq
        labels[i, :n - 1] = seq[1:]
        mask[i, :n - 1] = loss_masks[i][1:].bool()
        if old_logprobs is not None:
            old[i, :n - 1] = old_logprobs[i][1:]
        if advantages is not None:
            adv[i, :n - 1] = advantages[i][1:]
    return MicroBatch(tokens=tokens, labels=labels, loss_mask=mask, old_logprobs=old,
                      advantages=adv)


@dataclass(frozen=True)
class LossConfig:
    """Loss settings of a train step (``losses.policy_loss`` arguments plus temperature)."""

    method: str = "dgpo"
    temperature: float = 1.0
    """Sampling temperature: logits are divided by it, as in the rollout sampler."""
    hyperparams: LossHyperparams = field(default_factory=LossHyperparams)
    """The loss's hyper-parameters (a recipe's ``algorithm.loss``)."""
    chunk_size: int | None = None
    """Tokens per chunk in ``logprobs_and_entropy`` (default: ``vocab_parallel.default_chunk_size``)."""


@dataclass
class StepResult:
    """What one ``train_step`` returns, identical on every rank.

    loss: L of the module docstring (float). num_tokens: N. metrics: the reduced
    ``losses.LossMetrics`` (``losses.loss_metrics`` + sums ``entropy_sum``, ``loss_sum``).
    """

    loss: float
    num_tokens: int
    metrics: LossMetrics

    @property
    def summary(self) -> dict[str, float]:
        """Readable numbers: ``losses.summarize_metrics`` of ``metrics`` (with ``entropy`` and
        ``loss`` per token)."""
        return summarize_metrics(self.metrics)


def _attention_mask(mb: MicroBatch) -> Tensor:
    """[B or 1, 1, S, S] bool, True = masked: causal, block-diagonal within segments."""
    if mb.attention_mask is not None:
        return mb.attention_mask
    if mb.segment_ids is None:  # one segment per row: plain causal
        return block_causal_mask(torch.zeros_like(mb.tokens[:1]))
    return block_causal_mask(mb.segment_ids)


def _packed_seq_params(segment_ids: Tensor):
    """THD ``PackedSeqParams`` of one packed row [1, S]: cu_seqlens at the segment boundaries.

    Transformer-Engine's fused attention ignores arbitrary masks (its causal kernel would let a
    segment see the previous one); with cu_seqlens each segment is its own causal sequence.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if segment_ids.shape[0] != 1:
        raise ValueError(f"THD packing needs one packed row per micro-batch, got "
                         f"{segment_ids.shape[0]} rows")
    row = segment_ids[0]
    starts = torch.nonzero(row[1:] != row[:-1]).flatten() + 1
    edges = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), row.numel())])
    cu_seqlens = edges.to(torch.int32)
    longest = int((edges[1:] - edges[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _positions(mb: MicroBatch) -> Tensor:
    if mb.position_ids is not None:
        return mb.position_ids
    rows, seq = mb.tokens.shape
    return torch.arange(seq, device=mb.tokens.device).expand(rows, seq)


def _device(models) -> torch.device:
    return next(unwrap_model(models[0]).parameters()).device


def _pp_info():
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size(),
            ps.is_pipeline_last_stage(ignore_virtual=True),
            ps.get_pipeline_model_parallel_last_rank())


def _run_schedule(models, micro_batches, loss_fn, forward_only: bool):
    """Megatron's forward-backward over ``micro_batches`` with ``loss_fn(mb, output)``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("micro_batches is empty")
    device = _device(models)

    thd = use_transformer_engine()

    def forward_step(data_iterator, model):
        mb = next(data_iterator).to(device)
        if thd and mb.segment_ids is not None and mb.attention_mask is None:
            output = model(mb.tokens, _positions(mb), None,
                           packed_seq_params=_packed_seq_params(mb.segment_ids))
        else:
            output = model(mb.tokens, _positions(mb), _attention_mask(mb))
        return output, partial(loss_fn, mb)

    iterators = [iter(micro_batches) for _ in models]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(models) > 1 else iterators[0],
        model=models if len(models) > 1 else models[0],
        num_microbatches=len(micro_batches),
        seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
        micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
        forward_only=forward_only,
    )


def _dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def _check_micro_batch(mb: MicroBatch, index: int, need_loss_inputs: bool) -> None:
    if need_loss_inputs and (mb.old_logprobs is None or mb.advantages is None):
        raise ValueError(f"micro_batches[{index}] lacks old_logprobs or advantages")


def train_step(models: list, micro_batches: list[MicroBatch], loss: LossConfig, *,
               vocab_size: int | None = None, zero_grad: bool = True) -> StepResult:
    """Forward + backward of the policy loss on one mini-batch; gradients final on return.

    Args:
        models: this rank's model chunks wrapped by ``wrap_ddp`` (one per VPP stage).
        micro_batches: this DP rank's micro-batches (every TP/PP rank of the DP rank passes
            the same list); any count, any shapes; N is counted over all DP ranks.
        loss: method, temperature, hyper-parameters.
        vocab_size: the HF vocabulary size (logit columns past it are TP padding); default
            ``models[0].hf_spec.vocab_size`` when built by ``model.build_model``.
        zero_grad: zero the DDP gradient buffers first (set False to accumulate).

    Returns:
        ``StepResult`` (same on every rank). Gradients are in ``param.main_grad``, already
        DP-reduced, tied-embedding-synchronised and scaled by 1/N (module docstring).
    """
    from megatron.core.distributed import finalize_model_grads

    config = unwrap_model(models[0]).config
    if not config.calculate_per_token_loss:
        raise ValueError("the model config must have calculate_per_token_loss=True (the train "
                         "step's 1/N normalisation relies on it); build it with "
                         "megatron_dgpo.model.build_model")
    if not all(hasattr(m, "zero_grad_buffer") for m in models):
        raise TypeError("train_step needs models wrapped by model.wrap_ddp")
    for i, mb in enumerate(micro_batches):
        _check_micro_batch(mb, i, need_loss_inputs=True)
    vocab_size = vocab_size or unwrap_model(models[0]).hf_spec.vocab_size
    device = _device(models)

    local_tokens = sum(int(mb.loss_mask.bool().sum()) for mb in micro_batches)
    total = torch.tensor(float(local_tokens), dtype=torch.float64, device=device)
    dist.all_reduce(total, group=_dp_group())
    num_tokens = int(total.item())

    seen = {}

    def finalize(model_chunks, tokens, **kwargs):
        finalize_model_grads(model_chunks, tokens, **kwargs)
        seen["megatron_tokens"] = int(tokens.item()) if tokens is not None else None

    config.finalize_model_grads_func = finalize
    for model in models:
        if zero_grad:
            model.zero_grad_buffer()
        # Megatron's optimizer leaves param.grad aliasing main_grad after a step; autograd would
        # then accumulate into main_grad AND the DDP hook add the same gradient again (2x).
        for param in model.parameters():
            param.grad = None

    parts: list[dict] = []

    def loss_fn(mb: MicroBatch, logits: Tensor):
        logp, entropy = logprobs_and_entropy(logits, mb.labels, temperature=loss.temperature,
                                             chunk_size=loss.chunk_size, vocab_size=vocab_size)
        loss_sum, metrics = policy_loss(loss.method, logp, mb.old_logprobs, mb.advantages,
                                        mb.loss_mask, loss.hyperparams, num_tokens=1.0)
        valid = mb.loss_mask.bool()
        metrics.sums["entropy_sum"] = torch.where(valid, entropy.double(), 0.0).sum()
        metrics.sums["loss_sum"] = loss_sum.detach().double()
        parts.append(metrics)
        return loss_sum, valid.sum().to(torch.int), {}

    _run_schedule(models, micro_batches, loss_fn, forward_only=False)
    if seen.get("megatron_tokens") not in (None, num_tokens):
        raise RuntimeError(f"Megatron normalised by {seen['megatron_tokens']} tokens, the "
                           f"mini-batch has {num_tokens}: micro-batches differ across ranks?")

    merged = _metrics_from_last_stage(merge_metrics(parts) if parts else None)
    reduced = reduce_metrics(merged, group=_dp_group())
    loss_value = float(reduced["loss_sum"]) / num_tokens if num_tokens else 0.0
    return StepResult(loss=loss_value, num_tokens=num_tokens, metrics=reduced)


def _metrics_from_last_stage(merged: dict | None) -> dict:
    """The last pipeline stage's merged metrics on every stage (broadcast over PP)."""
    pp_group, pp_size, last, last_rank = _pp_info()
    if pp_size == 1:
        return merged
    box = [merged if last else None]
    dist.broadcast_object_list(box, src=last_rank, group=pp_group)
    return box[0]


def forward_logprobs(models: list, micro_batches: list[MicroBatch], *, temperature: float = 1.0,
                     vocab_size: int | None = None, chunk_size: int | None = None,
                     all_stages: bool = True) -> list[tuple[Tensor, Tensor]] | None:
    """Per-token log pi(labels) and entropy for each micro-batch, without gradients.

    Returns ``[(logprobs [B, S], entropy [B, S]), ...]`` float32 on CPU, one pair per
    micro-batch (values under ``loss_mask == 0`` are computed too but meaningless for
    padding). With PP > 1 the pairs are broadcast from the last stage to every stage unless
    ``all_stages=False`` (then other stages get None). Models may be DDP-wrapped or not.
    """
    if vocab_size is None:
        vocab_size = unwrap_model(models[0]).hf_spec.vocab_size
    outputs: list[tuple[Tensor, Tensor]] = []

    def loss_fn(mb: MicroBatch, logits: Tensor):
        logp, entropy = logprobs_and_entropy(logits, mb.labels, temperature=temperature,
                                             chunk_size=chunk_size, vocab_size=vocab_size)
        outputs.append((logp.detach().cpu(), entropy.detach().cpu()))
        zero = torch.zeros((), device=logits.device)
        return zero, torch.zeros((), dtype=torch.int, device=logits.device), {}

    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        with torch.no_grad():
            _run_schedule(models, micro_batches, loss_fn, forward_only=True)
    finally:
        for m, mode in zip(models, was_training):
            m.train(mode)

    pp_group, pp_size, last, last_rank = _pp_info()
    if pp_size == 1:
        return outputs
    if not all_stages:
        return outputs if last else None
    device = _device(models)
    result = []
    for i, mb in enumerate(micro_batches):
        both = (torch.stack(outputs[i]).to(device) if last
                else torch.empty(2, *mb.tokens.shape, dtype=torch.float32, device=device))
        dist.broadcast(both, src=last_rank, group=pp_group)
        both = both.cpu()
        result.append((both[0], both[1]))
    return result
