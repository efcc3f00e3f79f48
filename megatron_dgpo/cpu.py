"""Megatron-Core on a machine without a GPU (CPU tensors, gloo): the few CUDA-only spots.

Megatron-Core assumes CUDA in a handful of places that the CPU code path still reaches (facts
measured in ``shared/notes/megatron-core-on-cpu.md``). ``apply_cpu_compat()`` redirects exactly
those, and only when ``torch.cuda.is_available()`` is False: on a GPU it returns without
touching anything, so clusters run Megatron-Core untouched. Every patch turns a call that
would raise "Torch not compiled with CUDA enabled" into its CPU equivalent; nothing that works
on a CPU-only torch changes behaviour.

Patched (all idempotent, process-wide, never undone):

1. ``torch.cuda.current_device()`` -> ``torch.device("cpu")``: Megatron passes it as
   ``device=`` to ~40 allocations (global memory buffer, TP gather/scatter outputs, p2p
   buffers, RoPE frequencies).
2. ``torch.cuda.synchronize()`` -> no-op (p2p, variable-length shape exchange, checkpoints).
3. The schedules' ``torch.zeros(..., device="cuda")`` token counter: the schedules module sees
   a ``torch`` whose ``zeros`` maps ``device="cuda"`` to the CPU.
4. ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied embedding with
   ``weight.data.cuda()`` when PP > 1: during that call ``Tensor.cuda`` returns the tensor.
5. RNG: ``model_parallel_cuda_manual_seed`` needs CUDA generators; on CPU use
   ``seed_model_parallel_rng`` below (an inference-style tracker whose ``fork`` is a no-op, so
   dropout inside TP regions draws from the CPU generator; RL fine-tuning runs without dropout).

6. Megatron's (non-distributed) optimizer: ``megatron.core.optimizer.optimizer``,
   ``.clip_grads`` and ``megatron.core.utils`` allocate their scalars (found-inf flag, loss
   scale, grad-norm accumulators) with ``device="cuda"``: those modules see the same CPU-mapping
   ``torch``; ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` gradients and
   is replaced by the same scaling (``grads *= max_norm / (total_norm + 1e-6)`` when < 1) on
   CPU tensors. One optimizer and one checkpoint format then serve CPU and GPU. Megatron's
   distributed optimizer refuses CPU tensors outright: on CPU the trainer uses the plain one.

Mixture of experts (``shared/notes/qwen3-moe-on-cpu.md``; SequentialMLP experts, both the
allgather and the alltoall token dispatcher over gloo):

7. Router gating calls ``moe_utils.te_general_gemm`` when it is not None, but 0.16.1's
   import fallback never defines it (``NameError``): without TE it is set to None, the torch
   path.
8. The alltoall dispatcher builds a ``torch.cuda.Stream`` for its device-to-host copies and
   synchronises on it: the ``token_dispatcher`` module sees a ``torch`` whose ``cuda`` streams
   are no-ops (CPU work is synchronous anyway).
9. The same dispatcher hands its split sizes to ``all_to_all_single`` as numpy arrays through
   ``maybe_move_tensor_to_cpu(as_numpy=True)``, which converts CUDA tensors only (gloo then
   gets tensors: ``TypeError``): the module's copy also converts CPU tensors.

10. Activation recomputation (``model.recompute_activations``): Megatron's checkpoint function
    saves and restores the CUDA generator's state around each recomputed layer ("Torch not
    compiled with CUDA enabled"); without CUDA there is none, and the CPU generator's state,
    which it restores too, is all there is.
"""

from __future__ import annotations

import functools
import types

import torch

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


def _tensor_cuda_is_identity(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    wrapper._dgpo_cpu_compat = True
    return wrapper


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
