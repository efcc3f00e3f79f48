"""Cross-rank arithmetic that knows the backend's device.

NCCL reduces only CUDA tensors ("No backend type associated with device type cpu"); gloo takes
CPU tensors. Every helper here builds its tensor on the device of the group's backend and hands
back a host value, so no caller needs to know which backend runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def device_of(group=None) -> torch.device:
    """Where a collective on ``group`` (default: the world) must keep its tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool, group=None) -> bool:
    """Collective: True on every rank of ``group`` if ``flag`` is True on any of them."""
    if not dist.is_initialized():
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=device_of(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
