"""Rollout-vs-trainer log-prob mismatch, measured every step on the trainer's packed rows,
which hold both sides (``MicroBatch.old_logprobs`` and ``rollout_logprobs``).

Given, for the same sampled tokens, the log-probs the rollout engine reported (``rollout_lp``)
and the ones the trainer recomputes with the same weights (``trainer_lp``), on the valid
(response) tokens t of sequences b, and d_t = trainer_lp_t - rollout_lp_t:

    mean_abs_diff   = sum_t |d_t| / #tokens
    max_abs_diff    = max_t |d_t|
    mean_diff       = sum_t d_t / #tokens                             (signed bias)
    token_mult_error = exp(mean_abs_diff) - 1
        the geometric-mean per-token probability error: on average a token's probability ratio
        pi_trainer / pi_rollout lies within a factor (1 + token_mult_error) of 1;
    seq_mult_error   = mean over sequences b of  exp(sum_{t in b} |d_t|) - 1
        the bound on the relative error of a whole sequence's probability ratio (it is what an
        importance weight over the full response would be off by, at worst); it grows with
        length, so compare it at equal response lengths. sum |d| is capped at 80 before exp.

All in float64; sequences with no valid token are ignored by the per-sequence mean. One
formula, two inputs: ``mismatch_metrics`` reads the trainer's packed micro-batches (sequences
delimited by ``cu_seqlens``) and reduces over a process group (the DP group in a job);
``logprob_mismatch`` takes plain [B, T] tensors (one sequence per row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_dgpo.runtime import comm

_LOG_CAP = 80.0


@dataclass(frozen=True)
class MismatchStats:
    mean_abs_diff: float
    max_abs_diff: float
    mean_diff: float
    token_mult_error: float
    seq_mult_error: float
    num_tokens: int

    def as_dict(self, prefix: str = "mismatch/") -> dict[str, float]:
        """The five statistics as metrics (the token count is not one)."""
        return {prefix + name: float(getattr(self, name)) for name in
                ("mean_abs_diff", "max_abs_diff", "mean_diff", "token_mult_error",
                 "seq_mult_error")}


def _partial_sums(d: torch.Tensor, valid: torch.Tensor, sequence: torch.Tensor,
                  num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mergeable sums of flat float64 differences ``d`` [n] under ``valid`` [n], position i in
    sequence ``sequence[i]``: (sum|d|, sum d, tokens, sum_b seq error, sequences), max|d|."""
    d = torch.where(valid, d, 0.0)  # masked positions may hold inf/nan padding
    per_seq = torch.zeros(num_sequences, dtype=torch.float64).scatter_add_(0, sequence, d.abs())
    has_tokens = torch.zeros(num_sequences, dtype=torch.float64).scatter_add_(
        0, sequence, valid.double()) > 0
    sums = torch.stack([d.abs().sum(), d.sum(), valid.sum().double(),
                        torch.expm1(per_seq.clamp(max=_LOG_CAP))[has_tokens].sum(),
                        has_tokens.sum().double()])
    largest = d.abs().max().reshape(1) if d.numel() else torch.zeros(1, dtype=torch.float64)
    return sums, largest


def _stats(sums: torch.Tensor, largest: torch.Tensor) -> MismatchStats:
    abs_sum, signed_sum, tokens, seq_err, sequences = sums.tolist()
    if tokens == 0:
        return MismatchStats(0.0, 0.0, 0.0, 0.0, 0.0, 0)
    mean_abs = abs_sum / tokens
    return MismatchStats(mean_abs_diff=mean_abs, max_abs_diff=float(largest.item()),
                         mean_diff=signed_sum / tokens,
                         token_mult_error=math.expm1(mean_abs),
                         seq_mult_error=seq_err / sequences, num_tokens=int(tokens))


def mismatch_metrics(micro_batches, group=None) -> MismatchStats:
    """Collective over ``group`` (None: this process only): the statistics of the module
    docstring over packed micro-batches, each with 1-D ``old_logprobs`` (the trainer's),
    ``rollout_logprobs``, ``loss_mask`` [S] and host ``cu_seqlens`` [k + 1] (its sequences)."""
    sums = torch.zeros(5, dtype=torch.float64)
    largest = torch.zeros(1, dtype=torch.float64)
    for mb in micro_batches:
        d = mb.old_logprobs.double() - mb.rollout_logprobs.double()
        widths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long()
        sequence = torch.repeat_interleave(torch.arange(len(widths)), widths)
        part, top = _partial_sums(d, mb.loss_mask.bool(), sequence, len(widths))
        sums, largest = sums + part, torch.maximum(largest, top)
    if group is not None:
        sums, largest = comm.reduce_values(sums, "sum", group), comm.reduce_values(largest, "max", group)
    return _stats(sums, largest)


def logprob_mismatch(rollout_lp: torch.Tensor, trainer_lp: torch.Tensor,
                     mask: torch.Tensor) -> MismatchStats:
    """The statistics of [B, T] log-probs under a [B, T] mask (row b = sequence b)."""
    if rollout_lp.shape != trainer_lp.shape or rollout_lp.shape != mask.shape:
        raise ValueError(f"shapes differ: rollout_lp {tuple(rollout_lp.shape)}, trainer_lp "
                         f"{tuple(trainer_lp.shape)}, mask {tuple(mask.shape)}")
    if rollout_lp.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got {rollout_lp.dim()} dims")
    rows, width = rollout_lp.shape
    d = trainer_lp.double().flatten() - rollout_lp.double().flatten()
    sequence = torch.arange(rows).repeat_interleave(width)
    return _stats(*_partial_sums(d, mask.bool().flatten(), sequence, rows))
