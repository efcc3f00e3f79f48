"""Rollout-vs-trainer log-prob mismatch, measured every step.

Given, for the same sampled tokens, the log-probs the rollout engine reported (``rollout_lp``)
and the ones the trainer recomputes with the same weights (``trainer_lp``), both [B, T] with a
validity ``mask`` [B, T] (1 on response tokens), and d_t = trainer_lp_t - rollout_lp_t:

    mean_abs_diff   = sum_t m_t |d_t| / sum_t m_t
    max_abs_diff    = max_t m_t |d_t|
    mean_diff       = sum_t m_t d_t / sum_t m_t                      (signed bias)
    token_mult_error = exp(mean_abs_diff) - 1
        the geometric-mean per-token probability error: on average a token's probability ratio
        pi_trainer / pi_rollout lies within a factor (1 + token_mult_error) of 1;
    seq_mult_error   = mean over sequences b of  exp(sum_t m_bt |d_bt|) - 1
        the bound on the relative error of a whole sequence's probability ratio (it is what an
        importance weight over the full response would be off by, at worst); it grows with
        length, so compare it at equal response lengths. sum |d| is capped at 80 before exp.

All in float64; sequences with no valid token are ignored by the per-sequence mean.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

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
        return {prefix + k: float(v) for k, v in asdict(self).items()}


def logprob_mismatch(rollout_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor) -> MismatchStats:
    """Mismatch statistics (module docstring) of [B, T] log-probs under a [B, T] mask."""
    if rollout_lp.shape != trainer_lp.shape or rollout_lp.shape != mask.shape:
        raise ValueError(
            f"shapes differ: rollout_lp {tuple(rollout_lp.shape)}, trainer_lp {tuple(trainer_lp.shape)}, mask {tuple(mask.shape)}"
        )
    if rollout_lp.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got {rollout_lp.dim()} dims")
    m = mask.to(torch.float64)
    d = (trainer_lp.to(torch.float64) - rollout_lp.to(torch.float64)) * m
    d = torch.where(m > 0, d, torch.zeros_like(d))  # masked positions may hold inf/nan padding
    n = m.sum()
    if n == 0:
        return MismatchStats(0.0, 0.0, 0.0, 0.0, 0.0, 0)
    absd = d.abs()
    mean_abs = absd.sum() / n
    seq_sum = absd.sum(dim=1)
    has_tokens = m.sum(dim=1) > 0
    seq_err = torch.expm1(seq_sum.clamp(max=_LOG_CAP))[has_tokens].mean()
    return MismatchStats(
        mean_abs_diff=float(mean_abs),
        max_abs_diff=float(absd.max()),
        mean_diff=float(d.sum() / n),
        token_mult_error=float(torch.expm1(mean_abs)),
        seq_mult_error=float(seq_err),
        num_tokens=int(n),
    )
