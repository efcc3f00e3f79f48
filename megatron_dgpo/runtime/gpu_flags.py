"""The Megatron-Core settings of the GPU path, as pure functions of what the machine offers.

A Megatron user expects a 14B run to have sequence parallelism, fused RoPE, fused weight-gradient
accumulation and overlapped gradient reduction / parameter gathering. Each of those needs CUDA
and some an extension; this module decides them from a ``Platform`` (``Platform.detect()`` on
the live machine; tests pass ``Platform(cuda=True, ...)`` to check the GPU decisions on CPU):

| setting (where it goes)                           | on when                                   |
| ------------------------------------------------- | ----------------------------------------- |
| ``sequence_parallel`` (TransformerConfig)         | CUDA, Transformer-Engine and TP > 1       |
| ``apply_rope_fusion`` (TransformerConfig)         | CUDA and Transformer-Engine               |
| ``gradient_accumulation_fusion`` (Transformer...) | CUDA and apex's fused_weight_gradient_mlp |
| ``masked_softmax_fusion`` (TransformerConfig)     | CUDA and Megatron's softmax kernels       |
| ``persist_layer_norm`` (TransformerConfig)        | never (RMSNorm families)                  |
| bias-activation / bias-dropout fusions, GPU init  | CUDA                                      |
| ``overlap_grad_reduce`` (DDP config)              | CUDA                                      |
| ``overlap_param_gather`` (DDP + optimizer config) | CUDA and the distributed optimizer        |
| logits dtype into ``logprobs_and_entropy``        | the model's dtype (bf16: no fp32 copy)    |

Why each condition (Megatron-Core 0.16 and 0.19):

* Sequence parallelism shards the norm inputs, the layer inputs and every tensor the linear
  layers save over the TP ranks (activations / t instead of ~4 h unsharded per token and
  layer). It needs the packed row length divisible by t: samples are padded to ``pad_multiple``
  (t; 2 c t with context parallelism, which Megatron's THD split needs). Off on CPU: the CPU
  path keeps the configuration its tests were written against (and memory is no issue there).
  Without Transformer-Engine the model is Megatron's local spec, whose torch norms
  (``WrappedTorchNorm``) refuse sequence parallelism.
* Softmax fusion: only the local spec's attention reads ``masked_softmax_fusion``, and then
  imports Megatron's compiled ``scaled_masked_softmax_cuda`` kernel, which the megatron-core
  wheel does not ship (apex's build or Megatron-LM's ``fused_kernels`` does): on only when it
  imports ("No module named 'scaled_masked_softmax_cuda'" at the first forward otherwise).
* ``persist_layer_norm`` selects apex's persistent LayerNorm kernel; every family here is
  RMSNorm, which both specs build without it (TE's norms; the local spec's torch norms, which
  assert it is off), so it stays off (on, the local spec does not build on a GPU).
* RoPE fusion: without it THD RoPE takes Megatron's unfused path, which reads ``cu_seqlens``
  with ``.tolist()`` in every attention layer (a host sync per layer and micro-batch). The
  fused kernels (``fused_apply_rotary_pos_emb[_thd]``) come from Transformer-Engine only;
  ``TransformerConfig`` refuses the flag without them.
* Gradient-accumulation fusion accumulates weight gradients straight into the fp32
  ``main_grad`` from the GEMM. TE's linear layers do it natively, but ``GPTModel``'s output
  layer is Megatron's own ``ColumnParallelLinear``, which raises unless apex's
  ``fused_weight_gradient_mlp_cuda`` extension imports (``docker/Dockerfile`` builds it).
  It needs ``main_grad``: models trained with it must be wrapped in Megatron's DDP (they are).
* Overlapped grad reduce launches each bucket's all-reduce / reduce-scatter during backward;
  the schedule must then be told to hold it until the last micro-batch
  (``schedule_sync_hooks``). Overlapped param gather (distributed optimizer only) defers the
  all-gather of the updated parameters to the next forward: anything that reads weights
  directly after ``optimizer.step()`` (refit, checkpoint) first calls
  ``optimizer.sync_params``.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Platform:
    """What the machine offers the GPU path."""

    cuda: bool
    """A CUDA device is present."""
    transformer_engine: bool = False
    """Transformer-Engine imports (its layer spec, THD attention and the fused RoPE kernels)."""
    apex_gradient_fusion: bool = False
    """apex's ``fused_weight_gradient_mlp_cuda`` extension imports."""
    softmax_kernels: bool = False
    """Megatron's compiled ``scaled_masked_softmax_cuda`` kernel imports (the local spec's fused
    masked softmax)."""
    transformer_engine_error: str = field(default="", compare=False)
    """Why ``transformer_engine.pytorch`` did not import on a CUDA machine (``detect``), for
    the message of ``require_gpu_stack``."""

    def __post_init__(self):
        if not self.cuda and (self.transformer_engine or self.apex_gradient_fusion
                              or self.softmax_kernels):
            raise ValueError("Platform: transformer_engine, apex_gradient_fusion and "
                             "softmax_kernels need cuda")

    @classmethod
    def detect(cls) -> "Platform":
        """This machine: CUDA from torch, TE and apex's extension by import."""
        import torch

        if not torch.cuda.is_available():
            return cls(cuda=False)
        # the PyTorch extension, not the top-level package: a TE built for another torch or
        # CUDA imports at the top level and fails here
        te_error = _import_error("transformer_engine.pytorch")
        return cls(cuda=True, transformer_engine=te_error is None, transformer_engine_error=te_error or "",
                   apex_gradient_fusion=_import_error("fused_weight_gradient_mlp_cuda") is None,
                   softmax_kernels=_import_error("scaled_masked_softmax_cuda") is None)


CPU = Platform(cuda=False)
"""The CPU path: every GPU choice off (what the CPU tests run)."""
GPU = Platform(cuda=True, transformer_engine=True, apex_gradient_fusion=True, softmax_kernels=True)
"""A GPU node as the recipes assume it (the pinned GPU stack of ``docker/Dockerfile``: TE and
apex with its kernels); the planner's."""


def _import_error(module: str) -> str | None:
    """None if ``module`` imports; otherwise why not (a broken extension, built for another
    CUDA or torch, counts as absent)."""
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{module.split('.')[0]} is not installed"
        importlib.import_module(module)
    except Exception as error:
        return f"import {module} failed: {type(error).__name__}: {error}"
    return None


INSTALL_HELP = "docs/install.md, 'GPU stack'"


def require_gpu_stack(platform: Platform, *, dtype, without_transformer_engine: bool = False) -> None:
    """Refuse a GPU run that would fail or degrade later, with the fix in the message.

    * Transformer-Engine must import on CUDA: without it Megatron's local layer spec builds a
      dense [S, S] attention mask per layer (about 10 GB of scores per layer at S = 16384 and
      TP = 4: an out-of-memory error on the first long row) and RoPE takes the unfused path
      with a host sync per layer. ``model.without_transformer_engine`` opts out (short rows).
    * float32 with TE: TE's packed-sequence (THD) attention has no float32 backend (its flash
      and cuDNN kernels take fp16/bf16, the unfused one no THD): "no dot product attention
      backend" at the first forward. Train in bfloat16 (the fp32 main weights live in the
      optimizer) or opt out of TE.
    Nothing to check on CPU (the local spec and fp32 are the CPU path)."""
    import torch

    if not platform.cuda:
        return
    if not platform.transformer_engine and not without_transformer_engine:
        raise RuntimeError(
            "Transformer-Engine is required on a GPU run and does not import "
            f"({platform.transformer_engine_error or 'not found'}): install the pinned GPU stack "
            f"({INSTALL_HELP}: TE built against this torch with --no-build-isolation), or set "
            "model.without_transformer_engine=true for short sequences only (dense attention masks)")
    if platform.transformer_engine and not without_transformer_engine and dtype == torch.float32:
        raise ValueError(
            "model.dtype: float32 on a GPU with Transformer-Engine: TE's packed-sequence (THD) "
            "attention has no float32 backend; use model.dtype=bfloat16 (fp32 main weights stay "
            "in the optimizer)")


def cuda_launch_env(tensor_parallel: int) -> dict[str, str]:
    """Environment a GPU rank needs before its CUDA context exists: with TP > 1 (sequence
    parallelism) Megatron needs ``CUDA_DEVICE_MAX_CONNECTIONS=1`` so that its TP communication
    kernels are queued before the GEMMs they overlap (one hardware queue keeps issue order);
    Megatron-LM's launch scripts and verl's Megatron workers set it. Empty with TP = 1."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tensor_parallel > 1 else {}


def sequence_parallel(tp: int, platform: Platform) -> bool:
    """Megatron sequence parallelism: on with CUDA and Transformer-Engine (its layer spec)
    whenever TP > 1."""
    return platform.cuda and platform.transformer_engine and tp > 1


def pad_multiple(tp: int, cp: int = 1) -> int:
    """Every packed sample is padded to a multiple of this: t (sequence parallelism splits the
    row over the TP ranks; on CPU, without it, the padding is merely harmless, and keeping it
    makes the CPU and GPU runs pack alike), 2 c t with context parallelism (Megatron splits
    each THD sequence into 2 c chunks, each again over TP)."""
    return tp * (2 * cp if cp > 1 else 1)


def transformer_flags(platform: Platform, tp: int) -> dict:
    """``TransformerConfig`` keyword arguments that depend on the machine (module docstring)."""
    gpu = platform.cuda
    return dict(
        use_cpu_initialization=not gpu,
        bias_activation_fusion=gpu,
        bias_dropout_fusion=gpu,
        masked_softmax_fusion=gpu and platform.softmax_kernels,
        persist_layer_norm=False,
        sequence_parallel=sequence_parallel(tp, platform),
        apply_rope_fusion=gpu and platform.transformer_engine,
        gradient_accumulation_fusion=gpu and platform.apex_gradient_fusion,
    )


def ddp_flags(platform: Platform, *, use_distributed_optimizer: bool) -> dict:
    """``DistributedDataParallelConfig`` keyword arguments: fp32 gradient reduction always;
    overlapped grad reduce with CUDA; overlapped param gather with CUDA and the distributed
    optimizer (Megatron allows it only there)."""
    return dict(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=platform.cuda,
        overlap_param_gather=platform.cuda and use_distributed_optimizer,
    )


def schedule_sync_hooks(models: list) -> dict:
    """The ``TransformerConfig`` attributes Megatron's schedules read for overlapped reduction
    (as Megatron-LM's training loop sets them), for the DDP-wrapped ``models``:

    * ``no_sync_func``: gradients of all but the last micro-batch are only accumulated (without
      it, overlapped reduction would start after the first micro-batch's backward);
    * ``grad_sync_func``: start each chunk's reduction as soon as its last backward is done
      (pipeline schedules call it per chunk);
    * ``param_sync_func``: with overlapped param gather, started by the schedule per chunk.

    Empty without overlap (the schedules then reduce once in ``finalize_model_grads``).
    """
    ddp = getattr(models[0], "ddp_config", None)
    hooks = {}
    if ddp is None:
        return hooks

    def one_or_list(fns):
        return fns[0] if len(fns) == 1 else fns

    if ddp.overlap_grad_reduce:
        hooks["no_sync_func"] = one_or_list([m.no_sync for m in models])
        hooks["grad_sync_func"] = one_or_list([m.start_grad_sync for m in models])
    if ddp.overlap_param_gather and ddp.align_param_gather:
        hooks["param_sync_func"] = one_or_list([m.start_param_sync for m in models])
    return hooks


CUDA_DRIVER_HELP = "docs/install.md, 'The NVIDIA driver (CUDA 13 needs R580)'"


def nvidia_device_files(dev: str = "/dev") -> list[str]:
    """The NVIDIA GPU device files under ``dev`` (``nvidia0``, ``nvidia1``, ...; not
    ``nvidiactl`` or ``nvidia-uvm``): what marks a GPU node for ``require_usable_cuda``.

    Device files, not ``/proc/driver/nvidia/gpus``: procfs' driver entries are the host's even
    in a container started without GPUs, whereas a container runtime creates the device files
    only for the GPUs it hands in. And not ``CUDA_VISIBLE_DEVICES``: a value inherited from a
    login shell or a launcher says nothing about this machine."""
    from pathlib import Path

    return sorted((p.name for p in Path(dev).glob("nvidia[0-9]*") if p.name[6:].isdigit()),
                  key=lambda name: int(name[6:]))


def cpu_requested(environ) -> bool:
    """``CUDA_VISIBLE_DEVICES`` set to nothing (or to ``-1`` first, which CUDA reads as "no
    device" too): the user hides the GPUs on purpose, the way to run on the CPU on a GPU node."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.split(",")[0].strip() in ("", "-1")


def require_usable_cuda(*, dev: str = "/dev", environ=None, cuda_available=None,
                        cuda_init=None, cuda_build=None) -> None:
    """Refuse to run on a GPU node where torch cannot use CUDA, with torch's own reason.

    Without this, ``torch.cuda.is_available()`` is merely False on such a node (e.g. torch's
    CUDA 13 wheels on an R535 or R570 driver, which supports CUDA 12 at most), and everything
    downstream takes the CPU path in silence: gloo, CPU tensors, the CPU patches of
    ``megatron_dgpo.runtime.cpu``, and a 14B job crawling on host memory or failing far from its
    cause. A
    GPU node is one with NVIDIA device files (``nvidia_device_files``); nothing is
    checked where ``CUDA_VISIBLE_DEVICES`` hides the GPUs on purpose (``cpu_requested``), the
    one way to ask for the CPU there (no other switch: a recipe key or variable that silences
    this would be set once and forgotten on the GPU nodes it exists for).

    The reason comes from initialising CUDA (``torch.cuda.init()``), whose exception carries
    torch's diagnosis of the driver ("The NVIDIA driver on your system is too old (found version
    12020)..."); a CPU build of torch (``torch.version.cuda`` None) is named as such.

    The probes are parameters so that tests can stand in a GPU node on a CPU machine: ``dev``
    (the folder of device files), ``environ`` (default ``os.environ``), ``cuda_available``,
    ``cuda_init`` and ``cuda_build`` (callables; default torch's ``cuda.is_available``,
    ``cuda.init`` and ``version.cuda``)."""
    import os

    import torch

    environ = os.environ if environ is None else environ
    if cpu_requested(environ):
        return
    devices = nvidia_device_files(dev)
    if not devices:
        return
    if (cuda_available or torch.cuda.is_available)():
        return
    build = cuda_build() if cuda_build is not None else torch.version.cuda
    node = f"this is a GPU node ({', '.join(f'{dev}/{d}' for d in devices[:4])}" + \
        (", ..." if len(devices) > 4 else "") + ")"
    cpu_hint = "to run on the CPU on purpose, set CUDA_VISIBLE_DEVICES= (empty)"
    if build is None:
        raise RuntimeError(
            f"{node}, but a CPU build of torch is installed (torch {torch.__version__}, "
            f"torch.version.cuda is None): install the GPU stack ({INSTALL_HELP}); {cpu_hint}")
    try:
        (cuda_init or torch.cuda.init)()
    except Exception as error:  # torch's words about the driver are the diagnosis
        reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
    else:
        reason = "torch.cuda.is_available() is False although CUDA initialised without an error"
    raise RuntimeError(
        f"{node}, but torch {torch.__version__} (built for CUDA {build}) cannot use CUDA: "
        f"{reason}. torch's CUDA {build} needs an NVIDIA driver that supports it (CUDA 13: the "
        f"R580 branch or newer; an older data-center driver only with the CUDA "
        f"forward-compatibility package): see {CUDA_DRIVER_HELP}, and check with "
        f"`python benchmarks/gpu_check.py`; {cpu_hint}")
