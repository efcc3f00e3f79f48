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


SAMPLE_FIELDS = ("prompt_tokens", "response_tokens", "rollout_logprobs", "rewards", "truncated")
OPTIONAL_SAMPLE_FIELDS = ("routed_experts", "prompt_indices", "positions", "segments")


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
    weights; with several, the oldest), set by the rollout; the step that trains on the batch
    logs its staleness.
    prompt_indices[i]: the prompt's index in the dataset; positions[i]: its global position in
    the prompt stream (``prompts.prompt_order``); segments[i]: [(version, tokens), ...] the
    weight version that sampled each run of the response's tokens, in order (one segment per
    refit the response lived through: ``rollout.partial``). Each None when the rollout set none;
    ``segments_of`` then reads one segment of ``policy_version``.
    stale_before: tokens sampled with a version below it get loss weight 0 (the streaming
    schedule's ``rollout.mask_stale_segments``); None: none masked.
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
    prompt_indices: list[int] | None = None
    positions: list[int] | None = None
    segments: list[list[tuple[int, int]]] | None = None
    stale_before: int | None = None

    def __len__(self) -> int:
        return len(self.response_tokens)

    def _per_sample(self) -> tuple[str, ...]:
        """The per-sample fields this batch carries (the optional ones only when set)."""
        return SAMPLE_FIELDS + tuple(n for n in OPTIONAL_SAMPLE_FIELDS if getattr(self, n) is not None)

    def segments_of(self, i: int) -> list[tuple[int, int]]:
        """Sample i's [(version, tokens), ...]: ``segments[i]``, else one segment of
        ``policy_version`` (None when the rollout set no version)."""
        if self.segments is not None:
            return [tuple(s) for s in self.segments[i]]
        return [(self.policy_version, len(self.response_tokens[i]))]

    @staticmethod
    def join(pieces: list[Experience | None]) -> Experience:
        """The pieces (None ones skipped) concatenated in order; ``policy_version`` the oldest."""
        pieces = [p for p in pieces if p is not None]
        joined = Experience(*(sum((getattr(p, name) for p in pieces), []) for name in SAMPLE_FIELDS))
        # an optional field (routing replay, the ledger's indices, segments): every sample's or
        # none (an empty piece carries nothing)
        for name in OPTIONAL_SAMPLE_FIELDS:
            recorded = {getattr(p, name) is not None for p in pieces if len(p)}
            if len(recorded) > 1:
                raise ValueError(f"Experience.join: some pieces carry {name} and some do not")
            if recorded == {True}:
                setattr(joined, name, sum((getattr(p, name) for p in pieces if len(p)), []))
        versions = [p.policy_version for p in pieces if p.policy_version is not None]
        joined.policy_version = min(versions) if versions else None
        return joined

    def select(self, indices) -> Experience:
        """The samples ``indices``, in that order, with every per-sample field and the version."""
        picked = Experience(**{name: [getattr(self, name)[i] for i in indices]
                               for name in self._per_sample()})
        picked.policy_version = self.policy_version
        return picked

    def replace_groups(self, groups: list[int], other: Experience, group_size: int) -> Experience:
        """A copy in which group ``groups[k]`` (samples ``groups[k] * group_size`` onwards) is
        ``other``'s k-th group (DAPO refill: a degenerate group sampled again)."""
        fields = self._per_sample()
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

    def ledger(self, step: int, group_size: int, group=None) -> list[dict]:
        """One record per response trained at ``step`` (``logging.samples``): its prompt's
        dataset index and stream position, its sample index in the group, its segments'
        versions and lengths, its length, finish reason and reward; the replicas' records
        gathered over ``group`` (the DP group), in replica order."""
        records = [{"step": int(step),
                    "prompt_index": None if self.prompt_indices is None else self.prompt_indices[i],
                    "position": None if self.positions is None else self.positions[i],
                    "sample": i % group_size,
                    "versions": [v for v, _ in self.segments_of(i)],
                    "segments": [n for _, n in self.segments_of(i)],
                    "length": len(self.response_tokens[i]),
                    "finish_reason": "length" if self.truncated[i] else "stop",
                    "reward": float(self.rewards[i])} for i in range(len(self))]
        return [r for piece in comm.gather_objects(records, group) for r in piece]

    def staleness_metrics(self, step: int, group=None, *, segments: bool = False) -> dict[str, float]:
        """How many updates the tokens trained at ``step`` lag the policy that starts it
        (version ``step - 1``): ``rollout/staleness_mean`` and ``_max`` per token, summed over
        ``group`` (the DP group); with ``segments``, the share of responses sampled across a
        refit (``rollout/partial_frac``), the segments per response and, when stale tokens are
        masked, their share (``rollout/masked_tokens_frac``)."""
        sums = torch.zeros(6, dtype=torch.float64)  # lag sum, tokens, partial, segments, n, masked
        longest = torch.zeros(1, dtype=torch.float64)
        for i in range(len(self)):
            runs = self.segments_of(i)
            for version, count in runs:
                lag = step - 1 - version
                sums[0] += lag * count
                sums[1] += count
                longest[0] = max(float(longest[0]), float(lag))
                if self.stale_before is not None and version < self.stale_before:
                    sums[5] += count
            sums[2] += len(runs) > 1
            sums[3] += len(runs)
            sums[4] += 1
        if group is not None:
            sums, longest = comm.reduce_values(sums, "sum", group), comm.reduce_values(longest, "max", group)
        out = {"rollout/staleness_mean": float(sums[0] / max(float(sums[1]), 1.0)),
               "rollout/staleness_max": float(longest[0])}
        if segments:
            n = max(float(sums[4]), 1.0)
            out.update({"rollout/partial_frac": float(sums[2]) / n,
                        "rollout/segments_per_response": float(sums[3]) / n,
                        "rollout/masked_tokens_frac": float(sums[5] / max(float(sums[1]), 1.0))})
        return out

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
        if self.stale_before is not None:  # tokens older than the bound leave the loss
            weights = per_token.get("loss_weights", torch.ones(n, dtype=torch.float64))
            per_token["loss_weights"] = weights * torch.cat(
                [torch.full((count,), float(version >= self.stale_before), dtype=torch.float64)
                 for version, count in self.segments_of(i)])
        return Sample(tokens=torch.tensor(prompt + response, dtype=torch.long),
                      response_start=len(prompt), per_token=per_token,
                      routed_experts=(self.routed_experts[i] if self.routed_experts is not None
                                      else None))
