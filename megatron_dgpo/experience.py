"""From one rollout batch to packed, data-parallel-sharded micro-batches: the trainer's plumbing.

    order = prompt_order(num_prompts, seed)              # deterministic, epoch by epoch
    batch = Experience(...)                              # rank 0 fills it, broadcast to all
    updates = plan_updates(batch, num_updates, dp_rank, dp_size, seed, step)
    rows = pack_update(batch, indices, budget, pad_multiple)   # this DP rank's packed rows

Every function is a pure function of its arguments (seeds included), so every rank computes
the same plan and a resumed run the same batches as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dgpo.packing import MicroBatch, Sample, pack


def prompt_order(num_prompts: int, seed: int, start: int, count: int) -> list[int]:
    """Prompt indices ``start .. start+count-1`` of an endless stream that visits every prompt
    once per epoch, in an order shuffled with ``seed + epoch``."""
    if num_prompts < 1:
        raise ValueError("the prompt dataset is empty")
    out, permutations = [], {}
    for position in range(start, start + count):
        epoch, offset = divmod(position, num_prompts)
        if epoch not in permutations:
            generator = torch.Generator().manual_seed(seed + epoch)
            permutations[epoch] = torch.randperm(num_prompts, generator=generator).tolist()
        out.append(permutations[epoch][offset])
    return out


@dataclass
class Experience:
    """One rollout batch, flattened: sample i = response ``i % G`` of prompt ``i // G``.

    prompt_tokens[i]: [P_i] ids; response_tokens[i]: [R_i] ids; rollout_logprobs[i]: [R_i] the
    engine's log-probs of those tokens; rewards: [N]; truncated: [N] bool (finish "length").
    advantages ([N]) are filled by the trainer after the broadcast, and so are loss_weights
    ([N] float64 per-sample aggregation weights, ``losses.sample_loss_weights``; None: all 1).
    """

    prompt_tokens: list[list[int]]
    response_tokens: list[list[int]]
    rollout_logprobs: list[list[float]]
    rewards: list[float]
    truncated: list[bool]
    advantages: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.response_tokens)

    def broadcast(self, src: int = 0) -> Experience:
        """The rank-``src`` batch on every rank (one pickled object broadcast)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self
        box = [self if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def sample(self, i: int) -> Sample:
        """Sample i for ``packing.pack``: per response token the rollout log-prob and the
        sequence's advantage."""
        prompt, response = self.prompt_tokens[i], self.response_tokens[i]
        n = len(response)
        per_token = {"rollout_logprobs": torch.tensor(self.rollout_logprobs[i]),
                     "advantages": torch.full((n,), float(self.advantages[i]))}
        if self.loss_weights is not None:  # issue 14: aggregation weight / dropped group (0)
            per_token["loss_weights"] = torch.full((n,), float(self.loss_weights[i]),
                                                   dtype=torch.float64)
        return Sample(tokens=torch.tensor(prompt + response, dtype=torch.long),
                      response_start=len(prompt), per_token=per_token)


def plan_updates(num_samples: int, num_updates: int, dp_rank: int, dp_size: int, *,
                 seed: int, step: int, lengths: list[int]) -> list[list[int]]:
    """This DP rank's sample indices for each of ``num_updates`` mini-batches.

    The batch is shuffled (seeded by ``seed`` and ``step``) and cut into equal mini-batches;
    each mini-batch's samples are dealt to DP ranks longest-first, round-robin, so ranks get
    similar token counts. Every rank gets at least one sample per mini-batch.
    """
    if num_samples % num_updates:
        raise ValueError(f"{num_samples} samples do not split into {num_updates} mini-batches")
    size = num_samples // num_updates
    if size < dp_size:
        raise ValueError(f"a mini-batch of {size} samples cannot feed {dp_size} data-parallel "
                         f"ranks: raise train.mini_batch_prompts or rollout.group_size")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    order = torch.randperm(num_samples, generator=generator).tolist()
    plan = []
    for u in range(num_updates):
        members = sorted(order[u * size:(u + 1) * size], key=lambda i: (-lengths[i], i))
        plan.append(members[dp_rank::dp_size])
    return plan


def pack_update(batch: Experience, indices: list[int], budget: int,
                pad_multiple: int) -> list[MicroBatch]:
    """Samples ``indices`` packed into rows of at most ``budget`` tokens."""
    return pack([batch.sample(i) for i in indices], budget, pad_multiple)


def rollout_metrics(batch: Experience, group_size: int) -> dict[str, float]:
    """Reward, accuracy (+1 rewards), lengths, truncation and Pass@G of the batch."""
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    lengths = torch.tensor([len(r) for r in batch.response_tokens], dtype=torch.float64)
    correct = rewards > 0
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/accuracy": float(correct.double().mean()),
        "rollout/pass_at_group": float(correct.view(-1, group_size).any(dim=1).double().mean()),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/truncated_frac": float(torch.tensor(batch.truncated).double().mean()),
        "rollout/num_samples": float(len(batch)),
    }
