"""From one rollout batch (``batch.Experience``, this replica's groups only) to packed
micro-batches, each DP replica on its own share: the trainer's plumbing.

    updates = plan_updates(first_prompt, num_prompts, group_size, num_updates, lengths)
    rows = pack_update(batch, indices, budget, pad_multiple)   # this replica's packed rows

No rank holds the whole batch: a replica keeps the prompt groups it sampled (the loss's token
count N is all-reduced in ``train_step``). The planning functions are pure functions of their
arguments, so a resumed run forms the same mini-batches as an uninterrupted one.
"""

from __future__ import annotations

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.algorithm.packing import MicroBatch, pack


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
