"""The few tensor transforms between HF and Megatron-Core layouts.

Everything is expressed on *boxes* of the global (TP-unsharded) Megatron tensor, so the same code
serves a distributed-checkpoint chunk, a TP shard of a live model and a whole tensor, and reads
only the HF rows it needs. A box is a tuple of ``(start, stop)`` per dimension.

Layouts (global Megatron tensor, for one layer):
    qkv      [G * (hpg + 2) * d, H]: per query group g: q heads of g (hpg * d rows), k_g (d), v_g (d);
             hpg = heads / groups. TP splits whole groups, so a TP shard is a contiguous row range.
             Biases are the same with the trailing H dropped.
    gate_up  [2 * I, H] = [gate; up]; the TP shard r is [gate rows of r; up rows of r].
    vocab    [V_pad, H]: rows >= V are zero padding (added on import, trimmed on export).
    experts  [E, *one expert's layout]: a layer's routed experts stacked on a leading expert
             axis (``ParamMap.expert``); kind and TP axis apply to each expert's tensor (expert
             TP), expert parallelism splits the expert axis.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from megatron_dgpo.models import ModelDims, ParamMap

Box = tuple[tuple[int, int], ...]
Reader = Callable[[str, Box], torch.Tensor]
"""``read(hf_name, box)``: the sub-tensor ``hf[box]`` of an HF tensor."""


def _ffn(pm: ParamMap, dims: ModelDims) -> int:
    return dims.moe_ffn if pm.expert else dims.ffn


def _experts(pm: ParamMap, dims: ModelDims) -> range:
    return range(dims.experts) if pm.expert else range(1)


def hf_shapes(pm: ParamMap, dims: ModelDims) -> tuple[tuple[int, ...], ...]:
    """Expected shape of each HF tensor of ``pm`` (of one expert for an expert map)."""
    h, d = dims.hidden, dims.head_dim
    if pm.kind == "qkv":
        rows = (dims.heads * d, dims.kv_heads * d, dims.kv_heads * d)
        return tuple((r, h) if pm.megatron.endswith("weight") else (r,) for r in rows)
    if pm.kind == "gate_up":
        return ((_ffn(pm, dims), h), (_ffn(pm, dims), h))
    if pm.kind == "vocab":
        return ((dims.vocab, h),)
    return (expert_shape(pm, dims),)


def hf_tensors(pm: ParamMap, layer: int | None, dims: ModelDims) -> list[tuple[str, tuple]]:
    """``(HF name, expected shape)`` of every HF tensor ``pm`` is made of at ``layer`` (all
    experts' for an expert map), in HF order."""
    shapes = hf_shapes(pm, dims)
    return [(name, shape) for e in _experts(pm, dims)
            for name, shape in zip(pm.hf_names(layer, e if pm.expert else None), shapes)]


def expert_shape(pm: ParamMap, dims: ModelDims) -> tuple[int, ...]:
    """Global Megatron shape of one tensor, of one expert for an expert map (one layer:
    without the checkpoint's layer axis)."""
    h, d = dims.hidden, dims.head_dim
    name = pm.megatron
    if pm.kind == "vocab":
        return (dims.padded_vocab, h)
    if pm.kind == "qkv":
        rows = (dims.heads + 2 * dims.kv_heads) * d
        return (rows, h) if name.endswith("weight") else (rows,)
    if pm.kind == "gate_up":
        return (2 * _ffn(pm, dims), h)
    if name.endswith("linear_proj.weight"):
        return (h, dims.heads * d)
    if name.endswith("linear_fc2.weight"):
        return (h, _ffn(pm, dims))
    if name.endswith("router.weight"):
        return (dims.experts, h)
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return (d,)
    return (h,)  # norms


def megatron_shape(pm: ParamMap, dims: ModelDims) -> tuple[int, ...]:
    """Global Megatron shape of one tensor (one layer: without the checkpoint's layer axis;
    an expert map's with the expert axis first)."""
    return ((dims.experts,) if pm.expert else ()) + expert_shape(pm, dims)


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def megatron_box(pm: ParamMap, layer: int | None, box: Box, read: Reader, dims: ModelDims) -> torch.Tensor:
    """``M[box]`` where M is the global Megatron tensor of ``pm`` (at ``layer``), from HF tensors.

    Only the HF rows that intersect the box are read. Returns a new contiguous tensor in the
    HF dtype. For an expert map the box's first range selects experts.
    """
    if pm.expert:
        (first, last), inner = box[0], tuple(box[1:])
        return torch.stack([_one_box(pm, pm.hf_names(layer, e), inner, read, dims)
                            for e in range(first, last)])
    return _one_box(pm, pm.hf_names(layer), box, read, dims)


def _one_box(pm: ParamMap, names: tuple[str, ...], box: Box, read: Reader,
             dims: ModelDims) -> torch.Tensor:
    (a, b), rest = box[0], tuple(box[1:])
    if pm.kind == "copy":
        return read(names[0], box)
    if pm.kind == "vocab":
        parts = []
        if a < dims.vocab:
            parts.append(read(names[0], ((a, min(b, dims.vocab)),) + rest))
        if b > dims.vocab:
            like = parts[0] if parts else read(names[0], ((0, 0),) + rest)
            pad_shape = (b - max(a, dims.vocab),) + tuple(s - r for r, s in rest)
            parts.append(torch.zeros(pad_shape, dtype=like.dtype))
        return _cat(parts)
    if pm.kind == "gate_up":
        n, parts = _ffn(pm, dims), []
        if a < n:
            parts.append(read(names[0], ((a, min(b, n)),) + rest))
        if b > n:
            parts.append(read(names[1], ((max(a, n) - n, b - n),) + rest))
        return _cat(parts)
    if pm.kind == "qkv":
        d, hpg = dims.head_dim, dims.heads_per_group
        rows = (hpg + 2) * d
        parts = []
        for g in range(a // rows, -(-b // rows)):
            q = read(names[0], ((g * hpg * d, (g + 1) * hpg * d),) + rest)
            k = read(names[1], ((g * d, (g + 1) * d),) + rest)
            v = read(names[2], ((g * d, (g + 1) * d),) + rest)
            block = torch.cat([q, k, v])
            lo, hi = max(a, g * rows) - g * rows, min(b, (g + 1) * rows) - g * rows
            parts.append(block[lo:hi] if (lo, hi) != (0, rows) else block)
        return _cat(parts)
    raise ValueError(f"unknown transform kind {pm.kind!r} for {pm.megatron}")


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)


def hf_from_megatron(pm: ParamMap, layer: int | None, tensor: torch.Tensor,
                     dims: ModelDims) -> list[tuple[str, torch.Tensor]]:
    """The HF ``(name, tensor)`` pairs of one global Megatron tensor (inverse of ``megatron_box``).

    Returned tensors are views of ``tensor`` where the layout allows (rows of it). An expert
    map's tensor is [E, ...]: its pairs come expert by expert.
    """
    if pm.expert:
        return [pair for e in range(tensor.shape[0])
                for pair in _hf_of_one(pm, pm.hf_names(layer, e), tensor[e], dims)]
    return _hf_of_one(pm, pm.hf_names(layer), tensor, dims)


def _hf_of_one(pm: ParamMap, names: tuple[str, ...], tensor: torch.Tensor,
               dims: ModelDims) -> list[tuple[str, torch.Tensor]]:
    if pm.kind == "copy":
        return [(names[0], tensor)]
    if pm.kind == "vocab":
        return [(names[0], tensor[: dims.vocab])]
    if pm.kind == "gate_up":
        n = _ffn(pm, dims)
        return [(names[0], tensor[:n]), (names[1], tensor[n:])]
    if pm.kind == "qkv":
        d, hpg = dims.head_dim, dims.heads_per_group
        grouped = tensor.reshape((dims.kv_heads, (hpg + 2) * d) + tuple(tensor.shape[1:]))
        q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
        tail = tuple(tensor.shape[1:])
        return [(names[0], q.reshape((dims.heads * d,) + tail)),
                (names[1], k.reshape((dims.kv_heads * d,) + tail)),
                (names[2], v.reshape((dims.kv_heads * d,) + tail))]
    raise ValueError(f"unknown transform kind {pm.kind!r} for {pm.megatron}")


def tp_shard_boxes(pm: ParamMap, shape: Sequence[int], rank: int, size: int,
                   expert: int | None = None) -> list[Box]:
    """Boxes of the global tensor that make up TP rank ``rank``'s shard (concatenated on dim 0).

    For an expert map pass the per-expert ``shape`` and the global ``expert``: the boxes then
    select that expert (a leading axis of 1) and its expert-TP shard."""
    if pm.expert:
        one = dataclasses.replace(pm, expert=False)
        return [((expert, expert + 1),) + box for box in tp_shard_boxes(one, shape, rank, size)]
    full = full_box(shape)
    if pm.tp_axis is None or size == 1:
        return [full]
    axis = pm.tp_axis
    if pm.kind == "gate_up":
        half = shape[0] // 2
        step = half // size
        return [((off + rank * step, off + (rank + 1) * step),) + full[1:] for off in (0, half)]
    step = shape[axis] // size
    box = list(full)
    box[axis] = (rank * step, (rank + 1) * step)
    return [tuple(box)]


def tp_unshard(pm: ParamMap, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Global tensor from all TP ranks' shards (inverse of ``tp_shard_boxes``); an expert map's
    shards are [experts, *one expert's shard] and are joined expert by expert."""
    if pm.tp_axis is None or len(shards) == 1:
        return shards[0]
    axis = pm.tp_axis + (1 if pm.expert else 0)
    if pm.kind == "gate_up":
        half = shards[0].shape[axis] // 2
        return torch.cat([s.narrow(axis, 0, half) for s in shards]
                         + [s.narrow(axis, half, half) for s in shards], dim=axis)
    return torch.cat(list(shards), dim=axis)

