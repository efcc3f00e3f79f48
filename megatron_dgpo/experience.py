"""From one rollout batch to packed micro-batches, each DP replica on its own share: the
trainer's plumbing.

    order = prompt_order(num_prompts, seed)              # deterministic, epoch by epoch
    batch = Experience.join(pieces)                      # this replica's groups only
    updates = plan_updates(first_prompt, num_prompts, group_size, num_updates, lengths)
    rows = pack_update(batch, indices, budget, pad_multiple)   # this replica's packed rows
    rollout_metrics(batch, group_size, dp_group)         # batch-wide numbers from reduced sums

No rank holds the whole batch: a replica keeps the prompt groups it sampled; what must be
global (the loss's token count N, metrics, group statistics) is all-reduced as tensors. The
planning functions are pure functions of their arguments, so a resumed run forms the same
mini-batches as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dgpo import comm
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
    advantages ([N]) are filled by the trainer (per group, so on the replica that holds it),
    and so are loss_weights ([N] float64 per-sample aggregation weights,
    ``losses.sample_loss_weights``; None: all 1). routed_experts[i] ([P_i + R_i - 1, layers,
    topk] int16, routing replay): the engine's global expert ids per input position (prompt and
    response but the last token) and layer; None when the engine recorded none.
    policy_version: the trainer step whose weights the engine sampled with (0: the initial
    weights), set by the rollout; the step that trains on the batch logs its staleness.
    """

    prompt_tokens: list[list[int]]
    response_tokens: list[list[int]]
    rollout_logprobs: list[list[float]]
    rewards: list[float]
    truncated: list[bool]
    advantages: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None
    routed_experts: list[torch.Tensor] | None = None
    policy_version: int | None = None

    def __len__(self) -> int:
        return len(self.response_tokens)

    @staticmethod
    def join(pieces: list[Experience | None]) -> Experience:
        """The pieces (None ones skipped) concatenated in order."""
        pieces = [p for p in pieces if p is not None]
        joined = Experience(*(sum((getattr(p, name) for p in pieces), [])
                              for name in ("prompt_tokens", "response_tokens", "rollout_logprobs",
                                           "rewards", "truncated")))
        # routing replay: every sample's routing or none (an empty piece carries nothing)
        recorded = {p.routed_experts is not None for p in pieces if len(p)}
        if len(recorded) > 1:
            raise ValueError("Experience.join: some pieces carry routed_experts and some do not")
        if recorded == {True}:
            joined.routed_experts = sum((p.routed_experts for p in pieces if len(p)), [])
        return joined

    def replace_groups(self, groups: list[int], other: Experience, group_size: int) -> Experience:
        """A copy in which group ``groups[k]`` (samples ``groups[k] * group_size`` onwards) is
        ``other``'s k-th group (DAPO refill: a degenerate group sampled again)."""
        fields = ("prompt_tokens", "response_tokens", "rollout_logprobs", "rewards", "truncated")
        if self.routed_experts is not None:
            fields += ("routed_experts",)
        out = {name: list(getattr(self, name)) for name in fields}
        for k, g in enumerate(groups):
            mine, theirs = slice(g * group_size, (g + 1) * group_size), \
                slice(k * group_size, (k + 1) * group_size)
            for name in fields:
                out[name][mine] = getattr(other, name)[theirs]
        return Experience(**out)

    def gather(self, group) -> Experience:
        """Every rank of ``group`` (a DP replica's model-parallel group) contributes its piece
        (None where the rank graded nothing); all get the pieces joined in rank order. Only the
        replica's own share crosses, and only inside the replica."""
        if group is None or comm.size(group) == 1:
            return self
        return Experience.join(comm.gather_objects(self, group))

    def sample(self, i: int) -> Sample:
        """Sample i for ``packing.pack``: per response token the rollout log-prob and the
        sequence's advantage."""
        prompt, response = self.prompt_tokens[i], self.response_tokens[i]
        n = len(response)
        per_token = {"rollout_logprobs": torch.tensor(self.rollout_logprobs[i]),
                     "advantages": torch.full((n,), float(self.advantages[i]))}
        if self.loss_weights is not None:  # aggregation weight; 0 for a dropped group
            per_token["loss_weights"] = torch.full((n,), float(self.loss_weights[i]),
                                                   dtype=torch.float64)
        return Sample(tokens=torch.tensor(prompt + response, dtype=torch.long),
                      response_start=len(prompt), per_token=per_token,
                      routed_experts=(self.routed_experts[i] if self.routed_experts is not None
                                      else None))


def plan_updates(first_prompt: int, num_prompts: int, group_size: int, num_updates: int,
                 lengths: list[int]) -> list[list[int]]:
    """This DP replica's local sample indices for each of ``num_updates`` mini-batches.

    The replica holds the step's prompt groups at batch positions ``first_prompt ..
    first_prompt + num_prompts - 1`` (local sample ``k * group_size + j`` is response j of its
    k-th prompt). Mini-batch u takes the whole groups at positions p with ``p % num_updates ==
    u`` (the batch is already in a shuffled order, ``prompt_order``), so a mini-batch's samples
    are the same whatever the number of replicas or engines: the update is the single-replica
    one, with N all-reduced in ``train_step``. Members are listed longest first. Every replica
    needs at least one group per mini-batch.
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
