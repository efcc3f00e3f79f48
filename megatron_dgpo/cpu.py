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

Not patched (the trainer avoids them on CPU): Megatron's optimizer (allocates on "cuda";
``clip_grad`` asserts CUDA tensors) - use a torch optimizer with a model-parallel grad-norm
clip on CPU, Megatron's optimizer on GPU.
"""

from __future__ import annotations

import functools
import types

import torch

_APPLIED = False


def cpu_only() -> bool:
    """True when no CUDA device is usable: the case this module exists for."""
    return not torch.cuda.is_available()


class _TorchWithCpuZeros(types.ModuleType):
    """``torch`` as seen by Megatron's schedules: identical except ``zeros(device="cuda")``."""

    def __init__(self, real):
        super().__init__("torch")
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def zeros(self, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return self._real.zeros(*args, device=device, **kwargs)


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
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules

    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _no_synchronize
    if not isinstance(schedules.torch, _TorchWithCpuZeros):
        schedules.torch = _TorchWithCpuZeros(torch)
    setup = LanguageModule.setup_embeddings_and_output_layer
    if not getattr(setup, "_dgpo_cpu_compat", False):
        LanguageModule.setup_embeddings_and_output_layer = _tensor_cuda_is_identity(setup)
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
