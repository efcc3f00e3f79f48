"""Every cross-rank operation of the package: reductions, gathers, broadcasts, point-to-point,
barriers. No other module calls a ``torch.distributed`` collective (a test reads the source);
``parallel`` and ``convert.writing`` only create and destroy process groups.

Why one home: NCCL reduces only CUDA tensors ("No backend type associated with device type
cpu"), gloo only CPU ones, and objects pickled across ranks with CUDA tensors inside unpickle
onto the sender's device index. So:

* ``reduce_values`` takes statistics built anywhere (host lists of sums, counts, maxima), runs
  the reduction on the device of the group's backend (``device_of``: CUDA for NCCL, CPU for
  gloo) and hands back a CPU tensor;
* the in-place ``*_`` operations take tensors that already live with the model (gradients,
  logits shards, weights) and check that their device is the backend's;
* ``gather_objects`` / ``broadcast_object`` pickle the object with its tensors moved to the CPU
  (``host_pickle``), so no object crossing ranks carries a device tensor.

Every function is a no-op (returns its input) when torch.distributed is not initialised or the
group has one rank, so single-process code paths need no branches.
"""

from __future__ import annotations

import io
import pickle

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def size(group=None) -> int:
    """Ranks in ``group`` (default: the world); 1 without torch.distributed."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def device_of(group=None) -> torch.device:
    """Where a collective on ``group`` (default: the world) must keep its tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_values(values, op: str = "sum", group=None) -> torch.Tensor:
    """``values`` (a tensor or a list of numbers; float64 kept) reduced elementwise over
    ``group`` with ``op`` (sum, max, min), as a CPU tensor."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64)
    if size(group) == 1:
        return tensor.detach().cpu()
    on_device = tensor.detach().to(device_of(group), copy=True)
    dist.all_reduce(on_device, op=_OPS[op], group=group)
    return on_device.cpu()


def any_rank(flag: bool, group=None) -> bool:
    """Collective: True on every rank of ``group`` if ``flag`` is True on any of them."""
    return bool(reduce_values([1.0 if flag else 0.0], "max", group)[0])


def all_reduce_(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In-place all-reduce of a tensor that lives on the backend's device (model tensors)."""
    if size(group) > 1:
        _check_device(tensor, group)
        dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def all_gather_(shards: list[torch.Tensor], shard: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``shard`` into ``shards`` (preallocated, one per rank), in rank order."""
    if size(group) > 1:
        _check_device(shard, group)
        dist.all_gather(shards, shard, group=group)
    else:
        shards[0].copy_(shard)
    return shards


def broadcast_(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In place: ``tensor`` of global rank ``src`` on every rank of ``group``."""
    if size(group) > 1:
        _check_device(tensor, group)
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    _check_device(tensor, group)
    dist.send(tensor, dst=dst, group=group)


def recv_(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    _check_device(tensor, group)
    dist.recv(tensor, src=src, group=group)
    return tensor


def barrier(group=None) -> None:
    if size(group) > 1:
        dist.barrier(group=group)


def gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` (tensors inside moved to the CPU first), in rank order."""
    if size(group) == 1:
        return [obj]
    pieces = [None] * size(group)
    dist.all_gather_object(pieces, host_pickle(obj), group=group)
    return [pickle.loads(piece) for piece in pieces]


def broadcast_object(obj, src: int, group=None):
    """Global rank ``src``'s ``obj`` (tensors inside moved to the CPU) on every rank of ``group``."""
    if size(group) == 1:
        return obj
    box = [host_pickle(obj) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return pickle.loads(box[0])


class _HostPickler(pickle.Pickler):
    def reducer_override(self, obj):  # not called for ints, floats, strings: cheap on token lists
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def host_pickle(obj) -> bytes:
    """``obj`` pickled with every tensor inside on the CPU, whatever the container."""
    buffer = io.BytesIO()
    _HostPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _check_device(tensor: torch.Tensor, group) -> None:
    want = device_of(group)
    if tensor.device.type != want.type:
        raise RuntimeError(f"a {dist.get_backend(group)} collective needs tensors on {want.type}, got "
                           f"one on {tensor.device} (build it with comm.device_of(group))")
