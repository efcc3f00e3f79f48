"""Megatron-Core on a machine without a GPU (CPU tensors, gloo): the few CUDA-only spots.

``apply_cpu_compat()`` redirects the calls Megatron-Core makes that would raise "Torch not
compiled with CUDA enabled" on the CPU code path to their CPU equivalents, and only when
``torch.cuda.is_available()`` is False: on a GPU it returns without touching anything, so
clusters run Megatron-Core untouched. Nothing that works on a CPU-only torch changes
behaviour; every patch is idempotent, process-wide and never undone.
``seed_model_parallel_rng`` seeds the CPU RNG tracker that replaces Megatron's CUDA one. The
patches, numbered as the code's comments name them (the distributed optimizer's are 11 and 12,
the async save's writer 13, the local attention under context parallelism 15): docs/install.md, "Megatron-Core on CPU".
"""

from __future__ import annotations

import functools
import types

import torch

from megatron_dgpo.runtime import comm

_APPLIED = False


def cpu_only() -> bool:
    """True when no CUDA device is usable: the case this module exists for."""
    return not torch.cuda.is_available()


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen by a Megatron module: identical, except that the factory functions
    given ``device="cuda"`` (or a CUDA device) allocate on the CPU."""

    _FACTORIES = ("tensor", "zeros", "empty", "ones", "full")

    def __init__(self, real):
        super().__init__("torch")
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in self._FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args, device=None, **kwargs):
            if device is not None and torch.device(device).type == "cuda":
                device = "cpu"
            return attr(*args, device=device, **kwargs)

        return factory


class _NoStream:
    """A CUDA stream / event stand-in: CPU work is already ordered and complete."""

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None) -> "_NoStream":
        return self

    def wait_event(self, event) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def __enter__(self) -> "_NoStream":
        return self

    def __exit__(self, *exc) -> None:
        return None


class _CudaStreamsOnCpu(types.ModuleType):
    """``torch.cuda`` whose streams are ``_NoStream`` (the alltoall dispatcher's side stream)."""

    _STREAM = _NoStream()

    def __init__(self, real):
        super().__init__("torch.cuda")
        self._real = real

    def Stream(self, *args, **kwargs) -> _NoStream:  # noqa: N802  (torch.cuda's name)
        return self._STREAM

    def current_stream(self, device=None) -> _NoStream:
        return self._STREAM

    def stream(self, stream) -> _NoStream:
        return self._STREAM

    def __getattr__(self, name):
        return getattr(self._real, name)


class _TorchWithCpuStreams(_TorchOnCpu):
    """``_TorchOnCpu`` whose ``cuda`` is ``_CudaStreamsOnCpu``."""

    def __init__(self, real):
        super().__init__(real)
        self.cuda = _CudaStreamsOnCpu(real.cuda)


def _to_host(move):
    """``moe_utils.maybe_move_tensor_to_cpu`` that also gives CPU tensors as numpy when asked."""

    @functools.wraps(move)
    def wrapper(tensor, as_numpy: bool = False, record_stream: bool = False):
        tensor = move(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(tensor):
            tensor = tensor.numpy()
        return tensor

    return wrapper


def _no_cuda_rng_state(*args, **kwargs):
    return None


def _apply_moe_compat() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not isinstance(token_dispatcher.torch, _TorchWithCpuStreams):
        token_dispatcher.torch = _TorchWithCpuStreams(torch)
    if not hasattr(token_dispatcher.maybe_move_tensor_to_cpu, "__wrapped__"):
        token_dispatcher.maybe_move_tensor_to_cpu = _to_host(
            token_dispatcher.maybe_move_tensor_to_cpu)


def _cuda_named(original):
    """``Tensor.type`` for which a CPU tensor's name (no argument) reads as its CUDA name."""

    def type_(self, dtype=None, non_blocking=False, **rest):
        if dtype is None and not rest and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **rest)

    return type_


def _shard_offset(shard: torch.Tensor, whole: torch.Tensor) -> int:
    """Where ``shard`` (a view) starts inside the contiguous 1-D ``whole``."""
    offset = shard.storage_offset() - whole.storage_offset()
    if (shard.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
            or offset < 0 or offset + shard.numel() > whole.numel()):
        raise NotImplementedError("cpu.py: the gloo stand-in for reduce-scatter / all-gather needs "
                                  "the shard to be a view of the whole buffer, as Megatron's "
                                  "gradient and parameter buckets are")
    return offset


def _reduce_scatter_by_all_reduce(output, input, op=torch.distributed.ReduceOp.SUM, group=None,
                                  async_op=False):
    """Megatron's bucket reduce-scatter over gloo: the whole bucket all-reduced in place, so its
    shard ``output`` holds the reduced sum (the other shards too, where NCCL leaves partial sums
    that nothing reads)."""
    _shard_offset(output, input)
    return comm.all_reduce_as_megatron(input, op=op, group=group, async_op=async_op)


def _all_gather_by_all_reduce(output, input, group=None, async_op=False):
    """Megatron's bucket all-gather over gloo: every part but this rank's shard ``input`` zeroed,
    then the bucket all-reduced (a sum of one value and zeros: every rank's values, exactly)."""
    _shard_offset(input, output)
    own = input.clone()
    output.zero_()
    input.copy_(own)
    return comm.all_reduce_as_megatron(output, group=group, async_op=async_op)


def _apply_distributed_optimizer_compat() -> None:
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not getattr(DistributedOptimizer.__init__, "_dgpo_cpu_compat", False):
        DistributedOptimizer.__init__ = _cuda_type_names(DistributedOptimizer.__init__)
    gather = DistributedOptimizer.get_parameter_state_dp_zero
    if not getattr(gather, "_dgpo_cpu_compat", False):
        DistributedOptimizer.get_parameter_state_dp_zero = _tensor_cuda_is_identity(gather)
    param_and_grad_buffer.dist_reduce_scatter_func = _reduce_scatter_by_all_reduce
    param_and_grad_buffer.dist_all_gather_func = _all_gather_by_all_reduce


def _apply_grad_sync_compat() -> None:
    from megatron.core.distributed import param_and_grad_buffer

    if not isinstance(param_and_grad_buffer.torch, _TorchWithCpuStreams):
        param_and_grad_buffer.torch = _TorchWithCpuStreams(torch)


def _async_save_worker_on_cpu(*args, **kwargs):
    """``PersistentAsyncCaller.async_loop`` in a spawned CPU process: no CUDA device to select."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 1
    torch.cuda.synchronize = _no_synchronize  # before staging the tensors it writes
    # Megatron's loop: the class is unpatched in the child unless its main module patched it
    loop = getattr(PersistentAsyncCaller, "_dgpo_async_loop", PersistentAsyncCaller.async_loop)
    return loop(*args, **kwargs)


def _staged_copies(write_buckets, non_blocking=True):
    """``FileSystemWriterAsync.preload_tensors`` on CPU: each tensor to write as a copy, taken
    while the trainer waits for the staging (module level: the writer process unpickles it)."""
    return [(name, key, (data, [(item, tensor.detach().clone()) for item, tensor in tensors]))
            for name, key, (data, tensors) in write_buckets]


def _apply_async_save_compat() -> None:
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    # The parent starts the worker with target=PersistentAsyncCaller.async_loop; the spawned
    # child unpickles this function by name.
    if not hasattr(PersistentAsyncCaller, "_dgpo_async_loop"):
        PersistentAsyncCaller._dgpo_async_loop = PersistentAsyncCaller.async_loop
        PersistentAsyncCaller.async_loop = staticmethod(_async_save_worker_on_cpu)
    # Megatron stages the tensors to write with tensor.to("cpu"): a copy on a GPU, on CPU the
    # live tensor itself, shared with the persistent writer, which the next optimizer step then
    # changes under it (a torn checkpoint, caught by its checksum). Staged as copies instead.
    FileSystemWriterAsync.preload_tensors = staticmethod(_staged_copies)


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`` for CPU tensors."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    coefficient = max_norm / (total_norm + 1.0e-6)
    if grads and coefficient < 1.0:
        torch._foreach_mul_(grads, coefficient)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _no_synchronize(device=None) -> None:
    return None


def _tensor_method_during(name: str, replacement):
    """A decorator: while the decorated function runs, ``torch.Tensor.<name>`` is
    ``replacement(the original method)``."""

    def decorate(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, replacement(original))
            try:
                return method(*args, **kwargs)
            finally:
                setattr(torch.Tensor, name, original)

        wrapper._dgpo_cpu_compat = True
        return wrapper

    return decorate


_tensor_cuda_is_identity = _tensor_method_during("cuda", lambda original: lambda self, *a, **k: self)
_cuda_type_names = _tensor_method_during("type", _cuda_named)


def _local_attention_init_with_cp(init):
    """``DotProductAttention.__init__`` that builds under context parallelism (Megatron asserts
    CP = 1 there): the assertion sees CP = 1, the config keeps its size."""

    @functools.wraps(init)
    def wrapper(self, config, *args, **kwargs):
        size = config.context_parallel_size
        config.context_parallel_size = 1
        try:
            init(self, config, *args, **kwargs)
        finally:
            config.context_parallel_size = size

    wrapper._dgpo_cpu_compat = True
    return wrapper


def _local_attention_forward_thd(forward):
    """``DotProductAttention.forward`` that takes THD ``packed_seq_params`` (patch 15)."""

    @functools.wraps(forward)
    def wrapper(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                           attention_bias=attention_bias, packed_seq_params=None)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
            raise NotImplementedError("cpu.py: the local attention takes packed rows as THD "
                                      "PackedSeqParams without attention bias")
        return thd_attention(self, query, key, value, packed_seq_params.cu_seqlens_q)

    wrapper._dgpo_cpu_compat = True
    return wrapper


def thd_attention(module, query, key, value, cu_seqlens) -> torch.Tensor:
    """Exact (dense, not fast) causal attention of one packed THD row under context
    parallelism: ``query`` [t, heads, d], ``key`` / ``value`` [t, groups, d] hold this CP
    rank's t = S / CP positions (``packing.cp_zigzag_indices``; RoPE already applied by
    Megatron), ``cu_seqlens`` the whole row's boundaries. Keys and values are all-gathered over
    the CP group (their gradients return to their owners), put in row order, and each query
    attends the keys of its own sample at positions <= its own. Returns [t, heads * d]."""
    from megatron.core import tensor_parallel

    # the CP group Megatron's attention hands its core attention, the one its THD RoPE splits by
    group = module.pg_collection.cp
    rank, size = group.rank(), group.size()
    bounds = cu_seqlens.detach().cpu()
    if size > 1:
        layout = torch.cat([_cp_positions(bounds, r, size) for r in range(size)])
        row_order = torch.argsort(layout).to(key.device)
        key = comm.all_gather_with_grad(key, group)[row_order]
        value = comm.all_gather_with_grad(value, group)[row_order]
    positions = _cp_positions(bounds, rank, size).to(query.device)  # the queries'
    widths = (bounds[1:] - bounds[:-1]).long()
    sample = torch.repeat_interleave(torch.arange(len(widths)), widths).to(query.device)
    keys = torch.arange(int(bounds[-1]), device=query.device)
    allowed = (sample[positions][:, None] == sample[None, :]) & (keys[None, :] <= positions[:, None])
    repeat = query.shape[1] // key.shape[1]  # grouped-query attention
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    dtype = torch.float32 if module.config.attention_softmax_in_fp32 else query.dtype
    scores = torch.einsum("qhd,khd->hqk", query, key).to(dtype) * module.softmax_scale
    probs = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        probs = module.attention_dropout(probs.to(query.dtype))
    context = torch.einsum("hqk,khd->qhd", probs, value)
    return context.reshape(context.shape[0], -1)


def _cp_positions(bounds: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The row positions CP rank ``rank`` holds, as Megatron's THD RoPE reads them
    (``_get_thd_freqs_on_this_cp_rank`` applied to the positions themselves), so that the mask
    and the rotary phases agree by construction (``packing.cp_zigzag_indices`` is the host
    side's; a test checks the two agree)."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    everything = torch.arange(int(bounds[-1]))
    if size == 1:
        return everything
    starts, ends = bounds[:-1].tolist(), bounds[1:].tolist()
    return torch.cat([_get_thd_freqs_on_this_cp_rank(rank, size, everything[:(end - start) // size],
                                                     everything, start)
                      for start, end in zip(starts, ends)])


def _apply_context_parallel_attention_compat() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if not getattr(DotProductAttention.__init__, "_dgpo_cpu_compat", False):
        DotProductAttention.__init__ = _local_attention_init_with_cp(DotProductAttention.__init__)
    if not getattr(DotProductAttention.forward, "_dgpo_cpu_compat", False):
        DotProductAttention.forward = _local_attention_forward_thd(DotProductAttention.forward)


def apply_cpu_compat() -> bool:
    """Apply the patches above once, only without a GPU. Returns True if they are active."""
    global _APPLIED
    if not cpu_only():
        return False
    if _APPLIED:
        return True
    import megatron.core.utils as core_utils
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules

    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _no_synchronize
    for module in (schedules, optimizer, clip_grads, core_utils):
        if not isinstance(module.torch, _TorchOnCpu):
            module.torch = _TorchOnCpu(torch)
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    setup = LanguageModule.setup_embeddings_and_output_layer
    if not getattr(setup, "_dgpo_cpu_compat", False):
        LanguageModule.setup_embeddings_and_output_layer = _tensor_cuda_is_identity(setup)
    _apply_moe_compat()
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _no_cuda_rng_state
    tp_random._set_cuda_rng_state = _no_cuda_rng_state
    _apply_distributed_optimizer_compat()
    _apply_async_save_compat()
    _apply_grad_sync_compat()
    _apply_context_parallel_attention_compat()  # patch 15
    _APPLIED = True
    return True


def seed_model_parallel_rng(seed: int) -> None:
    """Seed torch and Megatron's model-parallel RNG tracker, on GPU or CPU.

    GPU: ``model_parallel_cuda_manual_seed(seed)`` (Megatron's own, with per-TP-rank states).
    CPU: the same call with ``inference_rng_tracker=True`` (CUDA RNG states do not exist);
    ``torch.manual_seed(seed)`` makes ``use_cpu_initialization`` weights identical on all ranks
    of a model-parallel group, as Megatron's CPU initialisation slices one master weight.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if cpu_only():
        apply_cpu_compat()
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=True, force_reset_rng=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
