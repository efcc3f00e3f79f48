"""From one rollout batch (``batch.Experience``, this replica's groups only) to packed
micro-batches, each DP replica on its own share: the trainer's plumbing.

    updates = plan_updates(first_prompt, num_prompts, group_size, num_updates, lengths)
    rows = pack_update(batch, indices, budget, pad_multiple)   # this replica's packed rows
    rollout_metrics(batch, group_size, dp_group)         # batch-wide numbers from reduced sums

No rank holds the whole batch: a replica keeps the prompt groups it sampled; what must be
global (the loss's token count N, metrics, group statistics) is all-reduced as tensors. The
planning functions are pure functions of their arguments, so a resumed run forms the same
mini-batches as an uninterrupted one.
"""

from __future__ import annotations

import torch

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.algorithm.packing import MicroBatch, pack
from megatron_dgpo.runtime import comm


def plan_updates(first_prompt: int, num_prompts: int, group_size: int, num_updates: int,
                 lengths: list[int]) -> list[list[int]]:
    """This DP replica's local sample indices for each of ``num_updates`` mini-batches.

    The replica holds the step's prompt groups at batch positions ``first_prompt ..
    first_prompt + num_prompts - 1`` (local sample ``k * group_size + j`` is response j of its
    k-th prompt). Mini-batch u takes the whole groups at positions p with ``p % num_updates ==
    u`` (the batch is already in a shuffled order, ``prompts.prompt_order``), so a mini-batch's
    samples are the same whatever the number of replicas or engines: the update is the
    single-replica one, with N all-reduced in ``train_step``. Members are listed longest first.
    Every replica needs at least one group per mini-batch.
    """
    if num_prompts < num_updates:
        raise ValueError(f"a data-parallel replica holds {num_prompts} prompt groups, fewer than "
                         f"the {num_updates} mini-batches per step: raise "
                         f"train.rollout_batch_prompts or train.mini_batch_prompts, or use fewer "
                         f"data-parallel replicas")
    plan = []
    for u in range(num_updates):
        members = [k * group_size + j for k in range(num_prompts)
                   if (first_prompt + k) % num_updates == u for j in range(group_size)]
        plan.append(sorted(members, key=lambda i: (-lengths[i], i)))
    return plan


def pack_update(batch: Experience, indices: list[int], budget: int,
                pad_multiple: int) -> list[MicroBatch]:
    """Samples ``indices`` packed into rows of at most ``budget`` tokens."""
    return pack([batch.sample(i) for i in indices], budget, pad_multiple)


def rollout_metrics(batch: Experience, group_size: int, group=None) -> dict[str, float]:
    """Reward, accuracy (+1 rewards), lengths, truncation and Pass@G of the step's whole batch,
    from this replica's ``batch`` and sums all-reduced over ``group`` (the DP group: one rank
    per replica), so they equal the numbers of one engine sampling the whole batch."""
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    lengths = torch.tensor([len(r) for r in batch.response_tokens], dtype=torch.float64)
    correct = rewards > 0
    sums = torch.stack([rewards.sum(), correct.double().sum(),
                        correct.view(-1, group_size).any(dim=1).double().sum(),
                        torch.tensor(rewards.numel() / group_size, dtype=torch.float64),
                        lengths.sum(), torch.tensor(batch.truncated, dtype=torch.float64).sum(),
                        torch.tensor(float(len(batch)), dtype=torch.float64)])
    longest = lengths.max() if len(lengths) else torch.tensor(0.0, dtype=torch.float64)
    if group is not None:
        sums, longest = comm.reduce_values(sums, "sum", group), comm.reduce_values(longest, "max", group)
    reward, right, passed, groups, length, truncated, n = sums.tolist()
    return {
        "rollout/reward_mean": reward / n,
        "rollout/accuracy": right / n,
        "rollout/pass_at_group": passed / groups,
        "rollout/response_length_mean": length / n,
        "rollout/response_length_max": float(longest),
        "rollout/truncated_frac": truncated / n,
        "rollout/num_samples": n,
    }


def reduce_group_stats(stats: dict[str, float], group=None) -> dict[str, float]:
    """Per-replica group statistics (``AdvantageStats.as_dict()``) made batch-wide: ``*num_*``
    counts are summed over ``group``; every other value is a mean over the replica's groups
    (all of size G), so it is averaged weighted by the replica's ``num_groups``."""
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
