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

``PeerGroup`` is the one group outside the default world: a DP replica's leader and the ranks
of its dedicated rollout engines (``rollout.placement: dedicated``), which live in two different
default worlds (the trainer's and the engines'). It carries objects (host-pickled, on gloo)
and weight buckets (on the device's backend: NCCL with CUDA tensors on GPUs, gloo on CPU),
and its creation ends with one checked broadcast on the latter (the link is tried at start).
A ``Channel`` on it carries objects in the background (sent without waiting, received into a
queue), for engines that keep generating while the trainer trains.
"""

from __future__ import annotations

import io
import pickle
import queue
import threading
import zlib
from datetime import timedelta

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


def all_reduce_as_megatron(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                           async_op: bool = False):
    """``torch.distributed.all_reduce`` with Megatron's arguments (a ``ReduceOp``; a work
    handle when ``async_op``), for ``megatron_dgpo.runtime.cpu``'s gloo stand-ins of Megatron's
    bucket collectives; inside Megatron's coalescing manager it is queued like Megatron's own."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_(shards: list[torch.Tensor], shard: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``shard`` into ``shards`` (preallocated, one per rank), in rank order."""
    if size(group) > 1:
        _check_device(shard, group)
        dist.all_gather(shards, shard, group=group)
    else:
        shards[0].copy_(shard)
    return shards


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group, ctx.rank, ctx.length = group, dist.get_rank(group), tensor.shape[0]
        shards = [torch.empty_like(tensor) for _ in range(size(group))]
        dist.all_gather(shards, tensor.contiguous(), group=group)
        return torch.cat(shards)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's loss reads every rank's shard
        return grad[ctx.rank * ctx.length:(ctx.rank + 1) * ctx.length], None


def all_gather_with_grad(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order, differentiable: the
    gradient of each rank's part returns to its owner, summed over the ranks (an all-reduce of
    the whole gradient, then this rank's slice: exact, and gloo has no reduce-scatter). All
    ranks pass the same shape. Context-parallel attention's keys and values."""
    if size(group) == 1:
        return tensor
    _check_device(tensor, group)
    return _AllGatherWithGrad.apply(tensor, group)


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


OBJECT_CHUNK_BYTES = 256 << 20
"""Largest single message of a pickled object on a ``PeerGroup``: a long rollout batch's samples
(hundreds of MB of token lists) go in pieces, so no message approaches a transport's limit."""


class PeerGroup:
    """A process group of ``size`` ranks outside the default world, formed through ``store``
    (torchrun's store of this attempt) under the key prefix ``name``; this rank is ``index``.

    Two channels: objects always on gloo (pickled with tensors on the host, ``host_pickle``),
    and tensors on ``device_backend`` (``"nccl"``: CUDA tensors; ``"gloo"``: the same group as
    the objects, CPU tensors). Construction is collective: it returns once every member has
    joined (within ``timeout``, which also bounds every later wait, e.g. an engine waiting for
    the trainer's next command while it trains) and one broadcast from member 0 has crossed
    the tensor channel with the value member 0 sent (``_warm_up``)."""

    def __init__(self, store, name: str, index: int, size: int, *, device_backend: str,
                 timeout: timedelta):
        if not 0 <= index < size:
            raise ValueError(f"PeerGroup {name}: index {index} outside [0, {size})")
        self.name, self.index, self.size = name, index, size
        self._store, self._timeout = store, timeout
        self._objects = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/objects/", store),
                                              index, size, timeout)
        if device_backend == "nccl":  # GPU only: never run here
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._tensors = dist.ProcessGroupNCCL(dist.PrefixStore(f"{name}/tensors/", store),
                                                  index, size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif device_backend == "gloo":
            self._tensors, self.device = self._objects, torch.device("cpu")
        else:
            raise ValueError(f"PeerGroup {name}: device_backend must be nccl or gloo, got "
                             f"{device_backend!r}")
        self._warm_up()

    def _warm_up(self) -> None:
        """One small broadcast from member 0 on the tensor channel, its value checked.

        NCCL opens its communicator at a group's first collective: without this, a broken link
        between trainer and engine nodes would show only at the first refit, after the
        collective timeout, in the middle of a step (NeMo-RL warms its refit group up the same
        way). gloo runs the same code, so the CPU tests cover it."""
        token = torch.tensor([self.size, zlib.crc32(self.name.encode())], dtype=torch.int64)
        tensor = (token.clone() if self.index == 0 else torch.zeros_like(token)).to(self.device)
        rank = f", global rank {dist.get_rank()}" if dist.is_initialized() else ""
        where = (f"PeerGroup {self.name} (member {self.index} of {self.size}{rank}; member 0 is "
                 f"the trainer's replica leader)")
        try:
            got = self.broadcast_(tensor, root=0).cpu()
        except Exception as exc:
            raise RuntimeError(f"{where}: the warm-up broadcast from member 0 on {self.device.type} "
                               f"failed: {exc}") from exc
        if not torch.equal(got, token):
            raise RuntimeError(f"{where}: the warm-up broadcast from member 0 delivered "
                               f"{got.tolist()}, expected [size, crc32(name)] = {token.tolist()}: "
                               f"the members disagree on the group or the link corrupts data")

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In place: member ``root``'s ``tensor`` on every member (on ``self.device``)."""
        if tensor.device.type != self.device.type:
            raise RuntimeError(f"PeerGroup {self.name}: tensors travel on {self.device.type}, "
                               f"got one on {tensor.device}")
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._tensors.broadcast([tensor], options).wait()
        return tensor

    def broadcast_object(self, obj, root: int = 0):
        """Member ``root``'s ``obj`` on every member (others pass anything, e.g. None)."""
        payload = host_pickle(obj) if self.index == root else b""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        self._broadcast_host(length, root)
        buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.index == root
                  else torch.empty(int(length), dtype=torch.uint8))
        for piece in _chunks(buffer):
            self._broadcast_host(piece, root)
        return obj if self.index == root else pickle.loads(buffer.numpy().tobytes())

    def send_object(self, obj, dst: int) -> None:
        """``obj`` to member ``dst`` (which calls ``recv_object(src=this index)``)."""
        _send_object(self._objects, obj, dst)

    def recv_object(self, src: int):
        """The object member ``src`` sends with ``send_object``."""
        return _recv_object(self._objects, src)

    def open_channel(self, name: str, peers) -> Channel:
        """Collective over the members: a ``Channel`` between this member and ``peers`` (member
        indices; each of them lists this one)."""
        return Channel(self._store, f"{self.name}/{name}", self.index, self.size,
                       peers=peers, timeout=self._timeout)

    def _broadcast_host(self, tensor: torch.Tensor, root: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._objects.broadcast([tensor], options).wait()


def _send_object(group, obj, dst: int) -> None:
    payload = host_pickle(obj)
    group.send([torch.tensor([len(payload)], dtype=torch.int64)], dst, 0).wait()
    for piece in _chunks(torch.frombuffer(bytearray(payload), dtype=torch.uint8)):
        group.send([piece], dst, 0).wait()


def _recv_object(group, src: int):
    length = torch.empty(1, dtype=torch.int64)
    group.recv([length], src, 0).wait()
    buffer = torch.empty(int(length), dtype=torch.uint8)
    for piece in _chunks(buffer):
        group.recv([piece], src, 0).wait()
    return pickle.loads(buffer.numpy().tobytes())


_CLOSED = "megatron_dgpo.comm.Channel: closed"


class Channel:
    """Objects between the members of a ``PeerGroup`` in the background, on a gloo group of its
    own (so it never meets the group's broadcasts): ``send`` queues an object and returns at
    once (one thread sends, in order); what they send this member arrives in a queue (one
    thread per peer), read by ``receive`` with or without waiting. Objects from one member
    arrive in the order sent. Only ``peers`` (member indices, each of which lists this one)
    talk to this member. Construction is collective over all the members. ``close`` ends this
    member's side: its peers stop listening to it once they have received what it sent."""

    def __init__(self, store, name: str, index: int, size: int, *, peers, timeout: timedelta):
        self.name, self.index = name, index
        self._group = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/", store), index, size, timeout)
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._peers = sorted(peers)
        self._error: BaseException | None = None
        self._receivers = [threading.Thread(target=self._receive_from, args=(src,), daemon=True,
                                            name=f"{name} <- {src}") for src in self._peers]
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name=f"{name} send")
        for thread in (*self._receivers, self._sender):
            thread.start()

    def send(self, obj, dst: int) -> None:
        """Queue ``obj`` for member ``dst``; returns at once (raises a failed earlier send's error)."""
        if self._error is not None:
            raise RuntimeError(f"Channel {self.name}: a send failed: {self._error}") from self._error
        if dst not in self._peers:
            raise ValueError(f"Channel {self.name}: member {dst} is not a peer of {self.index}")
        self._outbox.put((obj, dst))

    def receive(self, timeout: float | None = None):
        """``(source, obj)``: the next object received, waiting up to ``timeout`` seconds (None:
        for ever), or None when nothing came in that time. Raises a receiver's error."""
        try:
            src, obj = (self._inbox.get(timeout=timeout) if timeout is None or timeout > 0
                        else self._inbox.get_nowait())
        except queue.Empty:
            return None
        if isinstance(obj, BaseException):
            raise RuntimeError(f"Channel {self.name}: receiving from member {src} failed: {obj}") from obj
        return src, obj

    @property
    def listening(self) -> bool:
        """Some peer has not closed its side yet."""
        return any(thread.is_alive() for thread in self._receivers)

    def close(self) -> None:
        """Tell the peers this member is done, and wait until everything queued has been sent
        (they receive it). Idempotent."""
        if self._sender.is_alive():
            for dst in self._peers:
                self._outbox.put((_CLOSED, dst))
            self._outbox.put(None)
            self._sender.join()

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            try:
                _send_object(self._group, *item)
            except BaseException as exc:  # noqa: BLE001 - raised by the next send
                self._error = exc
                return

    def _receive_from(self, src: int) -> None:
        while True:
            try:
                obj = _recv_object(self._group, src)
            except BaseException as exc:  # noqa: BLE001 - raised by receive
                self._inbox.put((src, exc))
                return
            if isinstance(obj, str) and obj == _CLOSED:
                return
            self._inbox.put((src, obj))


def _chunks(buffer: torch.Tensor) -> list[torch.Tensor]:
    """Views of a flat uint8 buffer, each at most ``OBJECT_CHUNK_BYTES`` (none if it is empty)."""
    return [buffer[i:i + OBJECT_CHUNK_BYTES] for i in range(0, buffer.numel(), OBJECT_CHUNK_BYTES)]
