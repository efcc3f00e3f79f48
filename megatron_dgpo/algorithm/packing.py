"""Sequence packing: variable-length samples into token-budget micro-batches.

RL batches are long-tailed (most responses short, a few near the maximum length): padding each
micro-batch to its longest sample wastes most of the compute. Here samples are grouped by
first-fit-decreasing under a token budget and concatenated into one row per micro-batch.
Attention stays within each sample: a block-diagonal causal mask on the local attention path,
or THD ``PackedSeqParams`` (``cu_seqlens``) with Transformer-Engine. Position ids restart at 0
for every sample, as in the rollout engine; targets are shifted within each sample, so no
position is trained to predict the next sample's first token.

Shapes: a sample is 1-D ``tokens`` [L_i] with ``response_start`` (index of its first response
token) and per-response-token tensors [L_i - response_start]; a packed row, the ``MicroBatch``
that goes unchanged into ``train_step``, is [S] with S = sum of the padded lengths and carries
its boundaries as host ``cu_seqlens``. Rows stay whole on the host; under context parallelism
each rank's forward takes ``MicroBatch.cp_shard`` (Megatron's zigzag THD split,
``cp_zigzag_indices``), samples padded to a multiple of 2 x CP x TP. ``cu_seqlens`` are these
padded widths, not the real lengths: real lengths need ``cu_seqlens_q_padded``, i.e. padding
between sequences, which Transformer-Engine's FlashAttention-2 refuses, so a CP run on an A100
(no cuDNN THD before sm90) would have no fused attention left. The padding is a sample's own
tail, outside the loss.

Routing replay (``algorithm.routing_replay: r3``, ``megatron_dgpo.training.routing_replay``): a sample
may carry the rollout engine's expert choices, ``routed_experts`` [L - 1, layers, topk] (the
input positions whose output is read: every token but the last); its row then carries
[S, layers, topk] aligned with ``tokens``, where padding and each sample's last position hold
the valid filler ids 0..topk-1 (nothing reads their outputs, and packed attention keeps them
from the other samples). Rows without it carry None.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

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
    routed_experts: Tensor | None = None
    """[L - 1, layers, topk] integer global expert ids the rollout engine routed input
    position t (token t) to, per layer (routing replay; module docstring). None: not recorded."""


LOSS_FIELDS = ("advantages", "old_logprobs", "rollout_logprobs", "loss_weights",
               "behaviour_weights")
"""The per-token fields a micro-batch carries (``Sample.per_token`` keys)."""


@dataclass
class MicroBatch:
    """One packed row: what ``train_step``/``forward_logprobs`` run on (one micro-batch).

    All per-token tensors are [S] and aligned with ``targets``: position t predicts
    ``targets[t]`` (the next token of its sample) from ``tokens[:t + 1]`` of the same sample;
    values under ``loss_mask == False`` are 0 (any finite value is allowed there).
    """

    tokens: Tensor
    """[S] int64 input ids (padding: 0)."""
    position_ids: Tensor
    """[S] int64, restarting at 0 for every sample."""
    targets: Tensor
    """[S] int64: the token position t predicts, in [0, vocab) everywhere."""
    loss_mask: Tensor
    """[S] bool: True where ``targets[t]`` is a response token of a real sample."""
    cu_seqlens: Tensor
    """[k + 1] int32 on the host: boundaries of the k samples (padded lengths), THD convention;
    ``cu_seqlens[-1] == S``."""
    advantages: Tensor | None = None
    """[S] float: the advantage of each target token."""
    old_logprobs: Tensor | None = None
    """[S] float: log pi_old(targets) (the trainer's forward before the updates)."""
    rollout_logprobs: Tensor | None = None
    """[S] float: the rollout engine's log-probs of the targets."""
    loss_weights: Tensor | None = None
    """[S] float64: each token's aggregation weight c_t (``losses.sample_loss_weights``; 0 =
    left out of the update). None: every weight 1 (``token_mean``)."""
    behaviour_weights: Tensor | None = None
    """[S] float64: each token's behaviour weight v_t (``losses.behaviour_weights``), set by
    ``train_step`` from the whole row. None: v = 1."""
    sample_indices: list[int] = field(default_factory=list)
    """Which samples (indices into the packed list) this row holds, in order."""
    routed_experts: Tensor | None = None
    """[S, layers, topk] int16 on the host: the engine's expert ids per input position and
    layer, replayed by ``routing_replay.RoutingReplay`` (module docstring); None without replay."""
    cp_rank: int = 0
    cp_size: int = 1
    """A context-parallel shard (``cp_shard``) when ``cp_size`` > 1: the per-token tensors are
    rank ``cp_rank``'s [S / cp_size] positions (``cp_zigzag_indices``), ``cu_seqlens`` stays
    the whole row's."""

    def __post_init__(self):
        if self.tokens.dim() != 1:
            raise ValueError(f"MicroBatch.tokens must be 1-D [S], got {tuple(self.tokens.shape)}")
        for name in ("position_ids", "targets", "loss_mask") + LOSS_FIELDS:
            value = getattr(self, name)
            if value is not None and value.shape != self.tokens.shape:
                raise ValueError(f"MicroBatch.{name} has shape {tuple(value.shape)}, tokens "
                                 f"has {tuple(self.tokens.shape)}")
        if self.routed_experts is not None and (self.routed_experts.dim() != 3
                                                or len(self.routed_experts) != len(self.tokens)):
            raise ValueError(f"MicroBatch.routed_experts must be [S, layers, topk] with S = "
                             f"{len(self.tokens)}, got {tuple(self.routed_experts.shape)}")
        row = len(self.tokens) * self.cp_size
        if self.cu_seqlens.device.type != "cpu" or int(self.cu_seqlens[-1]) != row:
            raise ValueError(f"MicroBatch.cu_seqlens must be a host tensor ending at "
                             f"{row}, got {self.cu_seqlens.tolist()}")

    def to(self, device) -> MicroBatch:
        """The tensors on ``device``; ``cu_seqlens`` and ``routed_experts`` stay on the host (the
        replay moves one layer's ids at a time)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("tokens", "position_ids", "targets", "loss_mask") + LOSS_FIELDS:
            if moved[name] is not None:
                moved[name] = moved[name].to(device)
        return MicroBatch(**moved)

    def cp_shard(self, rank: int, size: int) -> MicroBatch:
        """Context-parallel rank ``rank``'s part of this (whole) row: every per-token field at
        ``cp_zigzag_indices(cu_seqlens, rank, size)``, ``cu_seqlens`` the row's (Megatron's
        THD ``PackedSeqParams`` take the global boundaries). ``targets`` were shifted on the
        whole row before the split, so no position needs its neighbour from another rank: no
        boundary patch. ``size`` 1: the row itself."""
        if size == 1:
            return self
        if self.cp_size != 1:
            raise ValueError("MicroBatch.cp_shard: already a context-parallel shard")
        index = cp_zigzag_indices(self.cu_seqlens, rank, size)
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("tokens", "position_ids", "targets", "loss_mask", "routed_experts") \
                + LOSS_FIELDS:
            if moved[name] is not None:
                moved[name] = moved[name][index.to(moved[name].device)]
        return MicroBatch(**{**moved, "cp_rank": rank, "cp_size": size})

    def attention_mask(self) -> Tensor:
        """[1, 1, S, S] bool block-diagonal causal mask, True = masked (Megatron convention)."""
        if self.cp_size != 1:
            raise ValueError("MicroBatch.attention_mask: a context-parallel shard runs as THD "
                             "(PackedSeqParams), not with a dense mask")
        return block_causal_mask(self.cu_seqlens, device=self.tokens.device)

    def sample_ids(self) -> Tensor:
        """[S] int64 on the host: which of the row's samples (0 .. k - 1, ``cu_seqlens``) each
        position belongs to; for a context-parallel shard, each of its positions'."""
        positions = cp_zigzag_indices(self.cu_seqlens, self.cp_rank, self.cp_size)
        return torch.searchsorted(self.cu_seqlens[1:].long(), positions, right=True)

    def max_seqlen(self) -> int:
        """The longest sample (padded), from the host ``cu_seqlens``."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


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


def pack(samples: list[Sample], budget: int, pad_multiple: int = 1) -> list[MicroBatch]:
    """Pack ``samples`` into rows of at most ``budget`` tokens (each sample padded to
    ``pad_multiple``). Every sample lands in exactly one row."""
    for index, sample in enumerate(samples):
        _check_sample(index, sample)
    lengths = [padded_length(len(s.tokens), pad_multiple) for s in samples]
    return [_build_row([samples[i] for i in group], group, pad_multiple)
            for group in first_fit_decreasing(lengths, budget)]


def pad_rows(samples: list[Sample], rows_per_batch: int) -> list[MicroBatch]:
    """The unpacked baseline: ``rows_per_batch`` samples per micro-batch, in order, each padded
    to the batch's longest (returned as rows of independent sequences for comparison)."""
    batches = []
    for start in range(0, len(samples), rows_per_batch):
        group = list(range(start, min(start + rows_per_batch, len(samples))))
        longest = max(len(samples[i].tokens) for i in group)
        batches.append(_build_row([samples[i] for i in group], group, longest))
    return batches


def cp_zigzag_indices(cu_seqlens: Tensor, rank: int, size: int) -> Tensor:
    """[S / size] int64: the row positions context-parallel rank ``rank`` of ``size`` holds, in
    Megatron's load-balanced THD layout. Each sample (padded width w, a multiple of 2 size, from
    the host ``cu_seqlens``) is cut into 2 size chunks of w / (2 size); rank r holds chunks r and
    2 size - 1 - r, in that order, samples in row order (Transformer-Engine's
    ``thd_get_partitioned_indices``, Megatron's ``_get_thd_freqs_on_this_cp_rank`` for RoPE).
    ``size`` 1: every position."""
    if not 0 <= rank < size:
        raise ValueError(f"context-parallel rank {rank} outside [0, {size})")
    bounds = [int(b) for b in cu_seqlens]
    if size == 1:
        return torch.arange(bounds[-1])
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        width = end - start
        if width % (2 * size):
            raise ValueError(f"a packed sample of width {width} does not split into 2 x "
                             f"context_parallel = {2 * size} chunks: pad samples to "
                             f"gpu_flags.pad_multiple(tp, cp)")
        chunk = width // (2 * size)
        for part in (rank, 2 * size - 1 - rank):
            pieces.append(torch.arange(start + part * chunk, start + (part + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def block_causal_mask(cu_seqlens: Tensor, device=None) -> Tensor:
    """[1, 1, S, S] bool from the host boundaries ``cu_seqlens`` [k + 1]: True where query i may
    NOT attend key j (j > i, or j before the start of i's sample). Megatron's convention."""
    widths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    start = torch.repeat_interleave(cu_seqlens[:-1].long(), widths).to(device)  # [S]
    seq = int(cu_seqlens[-1])
    keys = torch.arange(seq, device=device)
    return ((keys[None, :] > keys[:, None]) | (keys[None, :] < start[:, None]))[None, None]


def _check_sample(index: int, sample: Sample) -> None:
    length = len(sample.tokens)
    if sample.tokens.dim() != 1 or length == 0:
        raise ValueError(f"sample {index}: tokens must be a non-empty 1-D tensor, got shape "
                         f"{tuple(sample.tokens.shape)}")
    if not 1 <= sample.response_start < length:
        raise ValueError(f"sample {index}: response_start {sample.response_start} must lie in "
                         f"[1, {length - 1}] (at least one prompt and one response token)")
    expected = length - sample.response_start
    ids = sample.routed_experts
    if ids is not None and (ids.dim() != 3 or len(ids) != length - 1):
        raise ValueError(f"sample {index}: routed_experts has shape {tuple(ids.shape)}, expected "
                         f"({length - 1}, layers, topk) = one row per input position but the last")
    for name, value in sample.per_token.items():
        if name not in LOSS_FIELDS:
            raise ValueError(f"sample {index}: per_token[{name!r}] is not a micro-batch field "
                             f"(one of {', '.join(LOSS_FIELDS)})")
        if value.shape != (expected,):
            raise ValueError(f"sample {index}: per_token[{name!r}] has shape "
                             f"{tuple(value.shape)}, expected ({expected},) = one value per "
                             f"response token")


def _build_row(group: list[Sample], indices: list[int], pad_multiple: int) -> MicroBatch:
    padded = [padded_length(len(s.tokens), pad_multiple) for s in group]
    total = sum(padded)
    tokens = torch.zeros(total, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    positions = torch.zeros(total, dtype=torch.long)
    loss_mask = torch.zeros(total, dtype=torch.bool)
    fields = {name: torch.zeros(total, dtype=value.dtype)
              for name, value in group[0].per_token.items()}
    routed = _routed_experts_row(group, total)
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
        if routed is not None:
            routed[offset:offset + length - 1] = sample.routed_experts
        offset += width
    cu_seqlens = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return MicroBatch(tokens=tokens, position_ids=positions, targets=targets,
                      loss_mask=loss_mask, cu_seqlens=cu_seqlens, sample_indices=list(indices),
                      routed_experts=routed, **fields)


def filler_routed_experts(count: int, layers: int, topk: int) -> Tensor:
    """[count, layers, topk] int16 holding the valid, distinct ids 0..topk-1 on every row: the
    routing of positions whose output nobody reads (module docstring)."""
    return torch.arange(topk, dtype=torch.int16).expand(count, layers, topk).clone()


def _routed_experts_row(group: list[Sample], total: int) -> Tensor | None:
    """The row's [total, layers, topk] ids filled with ``filler_routed_experts``, or None when
    no sample carries routing; samples with and without it cannot share a row."""
    carried = [s.routed_experts is not None for s in group]
    if not any(carried):
        return None
    if not all(carried):
        raise ValueError("some samples carry routed_experts and some do not (routing replay "
                         "needs every sample's routing)")
    shapes = {tuple(s.routed_experts.shape[1:]) for s in group}
    if len(shapes) > 1:
        raise ValueError(f"samples carry routed_experts of different [layers, topk]: {sorted(shapes)}")
    layers, topk = shapes.pop()
    return filler_routed_experts(total, layers, topk)


def padded_micro_batch(sequences: list[Tensor], loss_masks: list[Tensor],
                       old_logprobs: list[Tensor] | None = None,
                       advantages: list[Tensor] | None = None, *, pad_id: int = 0) -> MicroBatch:
    """The unpacked layout as a micro-batch: each sequence right-padded to the longest.

    sequences[i]: [L_i] token ids (prompt + response). loss_masks[i]: [L_i] bool, True on
    tokens that are predicted in the loss (response tokens; position 0 is never predicted).
    old_logprobs[i], advantages[i]: [L_i], aligned with the tokens they score (entry 0 unused;
    default 0). Sequence i occupies positions [i W, (i + 1) W) with W = max L_i; targets are
    shifted to the predicting position.
    """
    rows, width = len(sequences), max(len(s) for s in sequences)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    targets = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    old = torch.zeros(rows, width)
    adv = torch.zeros(rows, width)
    for i, seq in enumerate(sequences):
        n = len(seq)
        if len(loss_masks[i]) != n:
            raise ValueError(f"loss_masks[{i}] has length {len(loss_masks[i])}, sequence {n}")
        tokens[i, :n] = seq
        targets[i, :n - 1] = seq[1:]
        mask[i, :n - 1] = loss_masks[i][1:].bool()
        if old_logprobs is not None:
            old[i, :n - 1] = old_logprobs[i][1:]
        if advantages is not None:
            adv[i, :n - 1] = advantages[i][1:]
    return MicroBatch(tokens=tokens.flatten(), position_ids=torch.arange(width).repeat(rows),
                      targets=targets.flatten(), loss_mask=mask.flatten(),
                      cu_seqlens=torch.arange(rows + 1, dtype=torch.int32) * width,
                      old_logprobs=old.flatten(), advantages=adv.flatten(),
                      sample_indices=list(range(rows)))
