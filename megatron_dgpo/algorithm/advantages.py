"""GRPO group-normalised advantages (the DGPO paper, Preliminary: A_i = (r_i - mu_R) / sigma_R).

For each prompt group {r_1..r_G} of rewards:

    A_i = (r_i - mean(r)) / (std(r) + eps)

std: the paper does not say which; we default to the SAMPLE standard deviation
(``unbiased=True``, divisor G - 1), as GRPO's reference implementations do (``torch.std``
in TRL and verl). ``unbiased=False`` gives the population std (divisor G). With rewards in
{-1, +1} the two differ by the factor sqrt(G / (G - 1)) (1.03 for G = 16).

Degenerate groups, where every reward is equal (all right or all wrong) or G = 1, carry no
learning signal: their advantages are exactly 0 (not 0 / eps noise), and they are counted in
the returned stats (``num_degenerate``, ``frac_degenerate``), the number dynamic-sampling
methods filter on. ``batch_advantages`` forms a batch's advantages and loss weights from a
recipe's ``algorithm`` section; ``reduce_group_stats`` makes a replica's statistics batch-wide.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.algorithm.losses import sample_loss_weights
from megatron_dgpo.runtime import comm


@dataclass(frozen=True)
class AdvantageStats:
    num_groups: int
    num_degenerate: int
    frac_degenerate: float
    reward_mean: float
    adv_abs_mean: float

    def as_dict(self, prefix: str = "adv/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in asdict(self).items()}


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> tuple[torch.Tensor, AdvantageStats]:
    """Advantages [N] of rewards [N] laid out as N / group_size consecutive groups.

    rewards[g * group_size + j] is sample j of prompt g (the order ``RolloutEngine.generate``
    returns, flattened). Returns float32 advantages and ``AdvantageStats``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    r = rewards.to(torch.float64).view(-1, group_size)  # [groups, G]
    mean = r.mean(dim=1, keepdim=True)
    degenerate = _degenerate(r)  # [groups]
    if group_size > 1:
        std = r.std(dim=1, unbiased=unbiased, keepdim=True)
    else:
        std = torch.ones_like(mean)
    adv = (r - mean) / (std + eps)
    adv = torch.where(degenerate[:, None], torch.zeros_like(adv), adv)
    n_deg = int(degenerate.sum())
    stats = AdvantageStats(
        num_groups=r.shape[0],
        num_degenerate=n_deg,
        frac_degenerate=n_deg / r.shape[0],
        reward_mean=float(r.mean()),
        adv_abs_mean=float(adv.abs().mean()),
    )
    return adv.view(-1).to(torch.float32), stats


def _degenerate(grouped: torch.Tensor) -> torch.Tensor:
    """[groups] bool: every reward of the group [groups, G] is equal."""
    return (grouped == grouped[:, :1]).all(dim=1)


@dataclass(frozen=True)
class KeptGroups:
    """What ``drop_degenerate_groups`` keeps: ``keep`` [N] bool per sample, ``indices`` the
    kept samples' indices, ``num_dropped`` the groups left out."""

    keep: torch.Tensor
    indices: list[int]
    num_dropped: int

    def as_dict(self, prefix: str = "adv/") -> dict[str, float]:
        return {prefix + "num_dropped_groups": float(self.num_dropped)}


def drop_degenerate_groups(rewards, group_size: int) -> KeptGroups:
    """DAPO's filter: groups whose rewards are all equal (no learning signal, advantage 0) are
    left out of the update. ``rewards`` [N] in consecutive groups of ``group_size``, as for
    ``group_advantages``. Pure: the trainer gives the kept samples' tokens to the loss (and N)
    and the dropped ones weight 0 (``losses.sample_loss_weights(..., keep=...)``)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"{group_size}")
    degenerate = _degenerate(rewards.view(-1, group_size))
    keep = (~degenerate).repeat_interleave(group_size)
    return KeptGroups(keep=keep, indices=keep.nonzero().flatten().tolist(),
                      num_dropped=int(degenerate.sum()))


def overlong_penalty(response_lengths, max_tokens: int, window: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13) [N] float64, added to each
    sample's task reward before its group's advantages are formed. With L_max = ``max_tokens``
    (the rollout's response cap), L_cache = ``window`` and |y| a response's length in tokens:

        R_length(y) = 0                                  |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                      -1                                 |y| > L_max

    times ``factor`` (verl's ``overlong_buffer.penalty_factor``; NeMo-RL's
    ``overlong_buffer_penalty``): linear from 0 to -factor over the last ``window`` tokens
    below the cap. A response cut at the cap has |y| = L_max and gets -factor. Needs
    1 <= window < max_tokens and a finite factor >= 0 (the recipe checks both)."""
    if not 0 < window < max_tokens:
        raise ValueError(f"overlong penalty window {window} must lie in [1, {max_tokens}) "
                         f"(the response cap)")
    lengths = torch.as_tensor(response_lengths, dtype=torch.float64)
    excess = (lengths - (max_tokens - window)).clamp(min=0.0, max=float(window))
    # (L_max - L_cache - |y|) / L_cache with integers exact in float64; + 0.0: no -0.0
    return -(excess / window) * float(factor) + 0.0


def reduce_group_stats(stats: dict[str, float], group=None) -> dict[str, float]:
    """Per-replica group statistics (``AdvantageStats.as_dict()``, with ``KeptGroups.as_dict()``'s)
    made batch-wide over ``group`` (the DP group): ``*num_*`` counts are summed; every other
    value is a mean over the replica's groups (all of size G), so it is averaged weighted by
    the replica's ``num_groups``."""
    if group is None or comm.size(group) == 1:
        return dict(stats)
    keys = sorted(stats)
    weight_key = next(k for k in keys if k.endswith("num_groups"))
    groups = stats[weight_key]
    values = torch.tensor([stats[k] if "num_" in k else stats[k] * groups for k in keys],
                          dtype=torch.float64)
    values = comm.reduce_values(values, "sum", group)
    total = values[keys.index(weight_key)].item()
    return {k: v if "num_" in k else v / max(total, 1.0) for k, v in zip(keys, values.tolist())}


class AdvantageSettings(Protocol):
    """What ``batch_advantages`` reads of a recipe's ``algorithm`` section
    (``recipe.AlgorithmConfig``, whose keys document each)."""

    loss_aggregation: str
    advantage_eps: float
    advantage_unbiased_std: bool
    drop_degenerate_groups: bool
    overlong_filter: bool
    overlong_penalty_window: int
    overlong_penalty_factor: float


@dataclass(frozen=True)
class BatchAdvantages:
    """``advantages`` [N] float32 per sample, ``loss_weights`` [N] float64 per-sample aggregation
    weights (0: left out; None: all 1) and the replica's group statistics ``stats``."""

    advantages: torch.Tensor
    loss_weights: torch.Tensor | None
    stats: dict[str, float]


def batch_advantages(batch: Experience, config: AdvantageSettings, *, group_size: int,
                     max_response_tokens: int | None = None) -> BatchAdvantages:
    """The advantages and loss weights of ``batch`` (this replica's whole groups, before packing
    splits them), in order (docs/losses.md, "Overlong filtering"):

    1. DAPO's soft overlong punishment (``overlong_penalty_window`` > 0; L_max =
       ``max_response_tokens``) added to each task reward; ``batch.rewards`` keep the task
       rewards, which the filter and the accuracy judge.
    2. Group advantages of those rewards (``group_advantages``).
    3. Loss weights (``losses.sample_loss_weights``) with degenerate groups
       (``drop_degenerate_groups``) and truncated samples (``overlong_filter``) at 0; a filtered
       sample still counts in its group's mean and std.

    ``stats``: ``AdvantageStats`` (its ``reward_mean`` the penalised reward's), and
    ``adv/num_dropped_groups``, ``adv/overlong_filtered_frac``, ``adv/overlong_penalty_mean``,
    ``adv/overlong_penalized_frac`` with the options that make them.
    """
    lengths = [len(r) for r in batch.response_tokens]
    truncated = torch.tensor(batch.truncated, dtype=torch.bool)
    n = max(len(batch), 1)
    stats: dict[str, float] = {}
    rewards = torch.tensor(batch.rewards)
    if config.overlong_penalty_window:
        if max_response_tokens is None:
            raise ValueError("the overlong penalty needs max_response_tokens (L_max)")
        penalty = overlong_penalty(lengths, max_response_tokens, config.overlong_penalty_window,
                                   config.overlong_penalty_factor)
        rewards = torch.tensor(batch.rewards, dtype=torch.float64) + penalty
        stats["adv/overlong_penalty_mean"] = float(penalty.sum()) / n
        stats["adv/overlong_penalized_frac"] = float((penalty < 0).sum()) / n
    advantages, adv_stats = group_advantages(rewards, group_size, eps=config.advantage_eps,
                                             unbiased=config.advantage_unbiased_std)
    keep = None
    if config.drop_degenerate_groups:
        kept = drop_degenerate_groups(batch.rewards, group_size)
        keep = kept.keep
        stats.update(kept.as_dict())
    if config.overlong_filter:
        keep = ~truncated if keep is None else keep & ~truncated
        stats["adv/overlong_filtered_frac"] = float(truncated.sum()) / n
    weights = sample_loss_weights(lengths, group_size, config.loss_aggregation, keep)
    return BatchAdvantages(advantages, weights, {**adv_stats.as_dict(), **stats})
