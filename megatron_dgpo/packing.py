"""Sequence packing: variable-length samples into token-budget micro-batches.

RL batches are long-tailed (most responses short, a few near the maximum length): padding each
micro-batch to its longest sample wastes most of the compute. Here samples are grouped by
first-fit-decreasing under a token budget and concatenated into one row per micro-batch.
Attention stays within each sample: a block-diagonal causal mask on the local attention path,
or THD ``PackedSeqParams`` (``cu_seqlens``) with Transformer-Engine. Position ids restart at 0
for every sample, as in the rollout engine; targets are shifted within each sample, so no
position is trained to predict the next sample's first token.

Shapes: a sample is 1-D ``tokens`` [L_i] with ``response_start`` (index of its first response
token) and per-response-token tensors [L_i - response_start]; a packed row is [S] with
S = sum of the padded lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Sample:
    """One prompt+response sequence as the trainer sees it."""

    tokens: Tensor
    """[L] int64: prompt ids followed by response ids."""
    response_start: int
    """Index in ``tokens`` of the first response token (= prompt length)."""
    per_token: dict[str, Tensor]
    """Per response token [L - response_start] tensors, e.g. old_logprobs, advantages."""


@dataclass
class PackedRow:
    """Samples concatenated into one micro-batch row."""

    tokens: Tensor
    """[S] int64 input ids (padding: 0)."""
    position_ids: Tensor
    """[S] int64, restarting at 0 for every sample."""
    targets: Tensor
    """[S] int64: ``targets[t]`` is the token that position t predicts (next in its sample)."""
    loss_mask: Tensor
    """[S] bool: True where ``targets[t]`` is a response token of a real sample."""
    cu_seqlens: Tensor
    """[k + 1] int32 boundaries of the k samples (padded lengths), THD convention."""
    per_token: dict[str, Tensor]
    """Each sample field aligned with ``targets`` [S] (0 where ``loss_mask`` is False)."""
    sample_indices: list[int]
    """Which samples (indices into the packed list) this row holds, in order."""

    def segment_ids(self) -> Tensor:
        """[S] int64: index of the sample each position belongs to (padding included)."""
        widths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        return torch.repeat_interleave(torch.arange(len(widths)), widths)

    def attention_mask(self) -> Tensor:
        """[1, 1, S, S] bool block-diagonal causal mask, True = masked (Megatron convention)."""
        return block_causal_mask(self.segment_ids()[None])


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sample indices into bins whose total length is <= ``budget``.

    Longest first, each into the first bin with room (FFD uses at most 11/9 OPT + 6/9 bins).
    Bins come back longest-first and each lists its samples in decreasing length.
    """
    if budget <= 0:
        raise ValueError(f"token budget must be positive, got {budget}")
    for index, length in enumerate(lengths):
        if length > budget:
            raise ValueError(f"sample {index} has {length} tokens, more than the micro-batch "
                             f"token budget {budget}: raise the budget to at least the "
                             f"maximum sequence length")
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[index] <= free:
                bins[b].append(index)
                room[b] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(budget - lengths[index])
    return bins


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to ``multiple`` (TP sequence parallel and CP need divisibility)."""
    return -(-length // multiple) * multiple


def pack(samples: list[Sample], budget: int, pad_multiple: int = 1) -> list[PackedRow]:
    """Pack ``samples`` into rows of at most ``budget`` tokens (each sample padded to
    ``pad_multiple``). Every sample lands in exactly one row."""
    for index, sample in enumerate(samples):
        _check_sample(index, sample)
    lengths = [padded_length(len(s.tokens), pad_multiple) for s in samples]
    return [_build_row([samples[i] for i in group], group, pad_multiple)
            for group in first_fit_decreasing(lengths, budget)]


def pad_rows(samples: list[Sample], rows_per_batch: int) -> list[PackedRow]:
    """The unpacked baseline: ``rows_per_batch`` samples per micro-batch, in order, each padded
    to the batch's longest (returned as rows of independent sequences for comparison)."""
    batches = []
    for start in range(0, len(samples), rows_per_batch):
        group = list(range(start, min(start + rows_per_batch, len(samples))))
        longest = max(len(samples[i].tokens) for i in group)
        batches.append(_build_row([samples[i] for i in group], group, longest))
    return batches


def block_causal_mask(segment_ids: Tensor) -> Tensor:
    """[B, 1, S, S] bool from [B, S] segment ids: True where query i may NOT attend key j
    (j > i, or j in another segment). Megatron's convention; the train step uses it too."""
    seq = segment_ids.shape[-1]
    future = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).triu(1)
    other = segment_ids[:, :, None] != segment_ids[:, None, :]
    return (future[None] | other)[:, None]


def _check_sample(index: int, sample: Sample) -> None:
    length = len(sample.tokens)
    if sample.tokens.dim() != 1 or length == 0:
        raise ValueError(f"sample {index}: tokens must be a non-empty 1-D tensor, got shape "
                         f"{tuple(sample.tokens.shape)}")
    if not 1 <= sample.response_start < length:
        raise ValueError(f"sample {index}: response_start {sample.response_start} must lie in "
                         f"[1, {length - 1}] (at least one prompt and one response token)")
    expected = length - sample.response_start
    for name, value in sample.per_token.items():
        if value.shape != (expected,):
            raise ValueError(f"sample {index}: per_token[{name!r}] has shape "
                             f"{tuple(value.shape)}, expected ({expected},) = one value per "
                             f"response token")


def _build_row(group: list[Sample], indices: list[int], pad_multiple: int) -> PackedRow:
    padded = [padded_length(len(s.tokens), pad_multiple) for s in group]
    total = sum(padded)
    tokens = torch.zeros(total, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    positions = torch.zeros(total, dtype=torch.long)
    loss_mask = torch.zeros(total, dtype=torch.bool)
    fields = {name: torch.zeros(total, dtype=value.dtype)
              for name, value in group[0].per_token.items()}
    offset = 0
    for sample, width in zip(group, padded):
        length, start = len(sample.tokens), sample.response_start
        tokens[offset:offset + length] = sample.tokens
        positions[offset:offset + width] = torch.arange(width)
        # position t predicts tokens[t + 1]; response token j sits at start + j, so it is
        # predicted from position offset + start + j - 1.
        targets[offset:offset + length - 1] = sample.tokens[1:]
        first, last = offset + start - 1, offset + length - 1
        loss_mask[first:last] = True
        for name, value in sample.per_token.items():
            fields[name][first:last] = value
        offset += width
    cu_seqlens = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedRow(tokens=tokens, position_ids=positions, targets=targets,
                     loss_mask=loss_mask, cu_seqlens=cu_seqlens, per_token=fields,
                     sample_indices=list(indices))


def to_micro_batch(row: PackedRow, *, old_logprobs: str = "old_logprobs",
                   advantages: str = "advantages"):
    """A ``train_step.MicroBatch`` [1, S] of one packed row (segments attend only within)."""
    from megatron_dgpo.train_step import MicroBatch

    optional = {name: row.per_token[key][None].float()
                for name, key in (("old_logprobs", old_logprobs), ("advantages", advantages))
                if key in row.per_token}
    return MicroBatch(tokens=row.tokens[None], labels=row.targets[None],
                      loss_mask=row.loss_mask[None], position_ids=row.position_ids[None],
                      segment_ids=row.segment_ids()[None], **optional)
