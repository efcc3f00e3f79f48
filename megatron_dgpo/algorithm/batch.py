"""``Experience``: one rollout batch as it travels from the engines to the trainer.

Each engine's leader grades its share of a step's prompts into a piece; a DAPO refill replaces
degenerate groups by fresh ones (``replace_groups``); the pieces of a DP replica are joined
in batch-position order on every rank of its replica group (``gather``: samples never
cross replicas); the trainer turns each sample into a ``packing.Sample`` (``sample``) and
reports the batch-wide rollout metrics (``rollout_metrics``); before packing, the trainer sets
its advantages and loss weights, formed from whole groups by ``advantages.batch_advantages``.
Both the rollout and the trainer hold it, so it sits below both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dgpo.algorithm.packing import Sample
from megatron_dgpo.runtime import comm


@dataclass
class Experience:
    """One rollout batch, flattened: sample i = response ``i % G`` of prompt ``i // G``.

    prompt_tokens[i]: [P_i] ids; response_tokens[i]: [R_i] ids; rollout_logprobs[i]: [R_i] the
    engine's log-probs of those tokens; rewards: [N]; truncated: [N] bool (finish "length").
    advantages ([N]) and loss_weights ([N] float64 per-sample aggregation weights, 0 for a
    sample left out; None: all 1) are set by the trainer (``advantages.batch_advantages``, on
    the replica that holds the groups). routed_experts[i] ([P_i + R_i - 1, layers,
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
        """Every rank of ``group`` (a DP replica's TP x CP x PP ranks) contributes its piece
        (None where the rank graded nothing); all get the pieces joined in rank order. Only the
        replica's own share crosses, and only inside the replica."""
        if group is None or comm.size(group) == 1:
            return self
        return Experience.join(comm.gather_objects(self, group))

    def rollout_metrics(self, group_size: int, group=None) -> dict[str, float]:
        """Reward, accuracy (+1 rewards), lengths, truncation and Pass@G of the step's whole
        batch, from this replica's samples and sums all-reduced over ``group`` (the DP group:
        one rank per replica), so they equal the numbers of one engine sampling the whole
        batch."""
        rewards = torch.tensor(self.rewards, dtype=torch.float64)
        lengths = torch.tensor([len(r) for r in self.response_tokens], dtype=torch.float64)
        correct = rewards > 0
        sums = torch.stack([rewards.sum(), correct.double().sum(),
                            correct.view(-1, group_size).any(dim=1).double().sum(),
                            torch.tensor(rewards.numel() / group_size, dtype=torch.float64),
                            lengths.sum(), torch.tensor(self.truncated, dtype=torch.float64).sum(),
                            torch.tensor(float(len(self)), dtype=torch.float64)])
        longest = lengths.max() if len(lengths) else torch.tensor(0.0, dtype=torch.float64)
        if group is not None:
            sums = comm.reduce_values(sums, "sum", group)
            longest = comm.reduce_values(longest, "max", group)
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
