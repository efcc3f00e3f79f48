"""The link between a DP replica's leader and its dedicated engines: who is on it
(``dedicated_layout``, ``open_link``) and the wire format of a weight bucket (``send_bucket``,
``receive_bucket``): its tensors' names, shapes and dtypes as an object, then its bytes as one
tensor broadcast on the device's backend (NCCL with CUDA buffers, gloo with CPU ones)."""

from __future__ import annotations

from datetime import timedelta

import torch

from megatron_dgpo.rollout.placement import DedicatedLayout
from megatron_dgpo.runtime import comm

_ALIGN = 16  # bytes: each tensor of a broadcast bucket starts aligned for any dtype's view


def dedicated_layout(rollout_config, parallel, trainer_size: int) -> DedicatedLayout:
    """The dedicated engines of ``rollout_config`` shared out over the DP replicas of a trainer
    of ``trainer_size`` ranks at the ``parallel`` layout."""
    replica = parallel.tensor_parallel * parallel.context_parallel * parallel.pipeline_parallel
    return DedicatedLayout(rollout_config.num_gpus, rollout_config.tensor_parallel_size or 1,
                           trainer_size // replica)


def open_link(layout: DedicatedLayout, replica: int, index: int,
              timeout_minutes: float) -> comm.PeerGroup:
    """Member ``index`` (0: the replica's leader, then its engines' ranks) of ``replica``'s link,
    on torchrun's store; its first broadcast tries the weight channel."""
    from megatron_dgpo.runtime.parallel import launch_store

    return comm.PeerGroup(launch_store(timeout_minutes), layout.link_name(replica), index,
                          layout.link_size, device_backend=_device_backend(),
                          timeout=timedelta(minutes=timeout_minutes))


def _device_backend() -> str:
    return "gloo" if comm.device_of().type == "cpu" else "nccl"


def _bucket_layout(meta: list) -> tuple[list[int], int]:
    """Byte offsets of a bucket's tensors in its flat buffer (each aligned) and its size."""
    offsets, size = [], 0
    for _, shape, dtype in meta:
        offsets.append(size)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=_dtype(dtype)).element_size()
        size += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, size


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def send_bucket(link, bucket: list[tuple[str, torch.Tensor]]) -> None:
    """Leader: one bucket of HF tensors to every engine rank: its names, shapes and dtypes as an
    object, then its bytes as one tensor broadcast on the device's backend."""
    meta = [(name, tuple(t.shape), str(t.dtype)) for name, t in bucket]
    link.broadcast_object({"kind": "bucket", "tensors": meta})
    offsets, size = _bucket_layout(meta)
    flat = torch.empty(size, dtype=torch.uint8, device=link.device)
    for (_, tensor), offset in zip(bucket, offsets):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[offset:offset + raw.numel()].copy_(raw)
    link.broadcast_(flat, 0)


def receive_bucket(link, meta: list) -> list[tuple[str, torch.Tensor]]:
    """Engine rank: the bucket ``send_bucket`` broadcasts, as (name, tensor) views of one buffer
    on this rank's device."""
    offsets, size = _bucket_layout(meta)
    flat = link.broadcast_(torch.empty(size, dtype=torch.uint8, device=link.device), 0)
    pairs = []
    for (name, shape, dtype), offset in zip(meta, offsets):
        dtype = _dtype(dtype)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        pairs.append((name, flat[offset:offset + nbytes].view(dtype).view(shape)))
    return pairs
