"""The Megatron-Core settings of the GPU path, as pure functions of a ``Platform`` (what the
machine offers: ``Platform.detect()`` on the live machine, ``Platform(cuda=True, ...)`` in tests),
and the checks that refuse a GPU run without the stack it needs (``require_gpu_stack``,
``require_usable_cuda``, ``attention_backend``):

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
| ``attention_backend`` (TransformerConfig)         | per GPU generation: ``attention_backend`` |

Why each condition: docs/training.md, "The GPU settings".
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field

from megatron_dgpo.runtime.errors import InputError


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
    compute_capability: tuple[int, int] | None = None
    """The GPU generation: (8, 0) A100, (8, 6) A10/A40, (8, 9) L40/L4, (9, 0) H100/H200,
    (10, 0) B200. None on CPU, and where a GPU platform is described without one (``GPU``)."""
    device_name: str = ""
    """The GPU's name (``torch.cuda.get_device_name``), for messages."""
    cudnn: tuple[int, int, int] | None = None
    """The cuDNN torch loads (TE's fused attention runs on it), e.g. (9, 20, 0)."""
    flash_attention: str = ""
    """The FlashAttention Transformer-Engine would run on this GPU, e.g. ``"flash-attn 2.8.3"``:
    flash-attn 2.x within the range TE accepts (``flash_attention_status``), or flash-attn-3 on
    sm90. Empty when there is none."""
    flash_attention_error: str = field(default="", compare=False)
    """Why ``flash_attention`` is empty (not installed, a version TE refuses), for messages."""
    transformer_engine_error: str = field(default="", compare=False)
    """Why ``transformer_engine.pytorch`` did not import on a CUDA machine (``detect``), for
    the message of ``require_gpu_stack``."""

    def __post_init__(self):
        if not self.cuda and (self.transformer_engine or self.apex_gradient_fusion
                              or self.softmax_kernels or self.compute_capability):
            raise ValueError("Platform: transformer_engine, apex_gradient_fusion, "
                             "softmax_kernels and compute_capability need cuda")

    @property
    def gpu(self) -> str:
        """The GPU for messages: "NVIDIA A100-SXM4-80GB, sm80"."""
        arch = f"sm{self.compute_capability[0]}{self.compute_capability[1]}" \
            if self.compute_capability else "compute capability unknown"
        return f"{self.device_name or 'this GPU'}, {arch}"

    @classmethod
    def detect(cls) -> "Platform":
        """This machine: CUDA, the GPU's generation and cuDNN from torch; TE, apex's extension
        and Megatron's kernels by import; FlashAttention by its installed version, judged as
        Transformer-Engine judges it."""
        import torch

        if not torch.cuda.is_available():
            return cls(cuda=False)
        # the PyTorch extension, not the top-level package: a TE built for another torch or
        # CUDA imports at the top level and fails here
        te_error = _import_error("transformer_engine.pytorch")
        capability = tuple(torch.cuda.get_device_capability())
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        flash, flash_error = flash_attention_status(
            distribution_version("flash-attn"), capability,
            flash_attn_3=distribution_version("flash-attn-3"))
        return cls(cuda=True, transformer_engine=te_error is None, transformer_engine_error=te_error or "",
                   apex_gradient_fusion=_import_error("fused_weight_gradient_mlp_cuda") is None,
                   softmax_kernels=_import_error("scaled_masked_softmax_cuda") is None,
                   compute_capability=capability, device_name=torch.cuda.get_device_name(),
                   cudnn=None if cudnn is None else (cudnn // 10000, cudnn // 100 % 100, cudnn % 100),
                   flash_attention=flash, flash_attention_error=flash_error)


CPU = Platform(cuda=False)
"""The CPU path: every GPU choice off (what the CPU tests run)."""
GPU = Platform(cuda=True, transformer_engine=True, apex_gradient_fusion=True, softmax_kernels=True,
               cudnn=(9, 20, 0), flash_attention="flash-attn 2.8.3")
"""A GPU node as the recipes assume it (the pinned GPU stack of ``docker/Dockerfile``: TE, apex
with its kernels, flash-attn 2.8.3, torch's cuDNN 9.20), of no particular generation; the
planner's (it sets ``compute_capability`` from ``--hardware``)."""


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


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None (what Transformer-Engine reads
    to decide whether it may use a FlashAttention package)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


FLASH_ATTN_PIN = "2.8.3"
"""The flash-attn of the image (``constraints-gpu.txt``): the newest 2.x Transformer-Engine
2.17.1 accepts."""
TE_FLASH_ATTN_RANGE = ("2.1.1", "2.8.3")
"""Transformer-Engine 2.17.1's accepted flash-attn 2.x versions, both ends included
(``FlashAttentionUtils.version_required`` and ``max_version``); on sm100 and newer from 2.7.3
(``version_required_blackwell``). A post release (2.8.3.post1) is above 2.8.3: TE refuses it."""
TE_FLASH_ATTN_BLACKWELL_MIN = "2.7.3"


def flash_attention_status(flash_attn: str | None, capability: tuple[int, int] | None, *,
                           flash_attn_3: str | None = None) -> tuple[str, str]:
    """``(found, why_not)``: which FlashAttention Transformer-Engine 2.17.1 would run on a GPU
    of ``capability`` with the distributions ``flash-attn`` (version ``flash_attn``) and
    ``flash-attn-3`` installed, or ``("", reason)``. TE's own rule
    (``dot_product_attention/backends.py``): flash-attn 2.x counts only inside
    ``TE_FLASH_ATTN_RANGE`` (sm100+: from 2.7.3), on sm80 and newer; flash-attn-3 only on sm90.
    Outside its range TE logs one warning and runs as if none were installed."""
    from packaging.version import Version

    if capability is not None and capability < (8, 0):
        return "", f"FlashAttention needs sm80 or newer (this GPU is sm{capability[0]}{capability[1]})"
    if flash_attn_3 is not None and capability == (9, 0):
        return f"flash-attn-3 {flash_attn_3}", ""
    if flash_attn is None:
        return "", "flash-attn is not installed"
    low, high = TE_FLASH_ATTN_RANGE
    if capability is not None and capability >= (10, 0):
        low = TE_FLASH_ATTN_BLACKWELL_MIN
    version = Version(Version(flash_attn).public)
    if not Version(low) <= version <= Version(high):
        return "", (f"flash-attn {flash_attn} is installed, but Transformer-Engine 2.17.1 uses only "
                    f"{low} to {high} (a .post release counts as newer) and ignores it")
    return f"flash-attn {flash_attn}", ""


INSTALL_HELP = "docs/install.md, 'GPU clusters: the pinned GPU stack'"


def require_gpu_stack(platform: Platform, *, without_transformer_engine: bool = False,
                      context_parallel: int = 1) -> None:
    """Refuse a GPU run without Transformer-Engine, with the fix in the message: without it
    Megatron's local layer spec builds a dense [S, S] attention mask per layer (about 10 GB of
    scores per layer at S = 16384 and TP = 4: an out-of-memory error on the first long row) and
    RoPE takes the unfused path with a host sync per layer. ``model.without_transformer_engine``
    opts out (short rows). Nothing to check on CPU (the local spec is the CPU path). Which
    attention backend TE then runs is ``attention_backend``'s. Context parallelism
    (``context_parallel`` > 1) on a GPU runs in TE's attention only: refused without it, the
    opt-out included (the CPU runs it in ``cpu.py``'s patch 15)."""
    if platform.cuda and context_parallel > 1 and (without_transformer_engine
                                                   or not platform.transformer_engine):
        why = ("model.without_transformer_engine=true builds Megatron's local attention"
               if without_transformer_engine else
               f"Transformer-Engine does not import ({platform.transformer_engine_error or 'not found'})")
        raise RuntimeError(
            f"parallel.context_parallel={context_parallel} needs Transformer-Engine's attention on "
            f"a GPU (Megatron-Core runs context parallelism nowhere else), and {why}: install the "
            f"pinned GPU stack ({INSTALL_HELP}) and leave model.without_transformer_engine false, "
            f"or set parallel.context_parallel=1")
    if platform.cuda and not platform.transformer_engine and not without_transformer_engine:
        raise RuntimeError(
            "Transformer-Engine is required on a GPU run and does not import "
            f"({platform.transformer_engine_error or 'not found'}): install the pinned GPU stack "
            f"({INSTALL_HELP}: TE built against this torch with --no-build-isolation), or set "
            "model.without_transformer_engine=true for short sequences only (dense attention masks)")


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused")
"""``model.attention_backend``: ``auto`` (``attention_backend`` picks per GPU generation) or one
of Transformer-Engine's backends, by Megatron-Core's names (``AttnBackend``)."""

ATTENTION_HELP = "docs/install.md, 'Attention backends'"
FUSED_THD_CUDNN = (9, 6, 0)
"""cuDNN from which TE's fused attention takes packed rows with grouped-query attention
(9.1 without it); every recipe's model is GQA."""


def _half(dtype) -> bool:
    import torch

    return dtype in (torch.bfloat16, torch.float16)


def _fused_thd_refusal(platform: Platform, dtype, environ) -> str:
    """Why cuDNN fused attention cannot take this run's packed (THD) rows, or "" if it can
    (TE 2.17.1, ``nvte_get_fused_attn_backend``: THD only on sm90 and newer, cuDNN >= 9.6 with
    GQA, >= 9.7 on sm100, >= 9.18.1 on sm120)."""
    capability, cudnn = platform.compute_capability, platform.cudnn
    if environ.get("NVTE_FUSED_ATTN") == "0":
        return "NVTE_FUSED_ATTN=0 is set in the environment"
    if not _half(dtype):
        return f"it takes bfloat16 or float16, not {str(dtype).removeprefix('torch.')}"
    if capability is None or capability < (9, 0):
        return "cuDNN fused attention takes packed (THD) rows only on sm90 and newer"
    wanted = ((9, 18, 1) if capability == (12, 0) else (9, 7, 0) if capability >= (10, 0)
              else FUSED_THD_CUDNN)
    if cudnn is None or cudnn < wanted:
        found = "no cuDNN" if cudnn is None else "cuDNN " + ".".join(map(str, cudnn))
        return f"packed rows need cuDNN {'.'.join(map(str, wanted))} or newer ({found})"
    return ""


def _flash_refusal(platform: Platform, dtype, environ) -> str:
    """Why FlashAttention cannot take this run's packed rows, or "" if it can."""
    if environ.get("NVTE_FLASH_ATTN") == "0":
        return "NVTE_FLASH_ATTN=0 is set in the environment"
    if not _half(dtype):
        return f"it takes bfloat16 or float16, not {str(dtype).removeprefix('torch.')}"
    if _before_ampere(platform):
        return "FlashAttention needs sm80 or newer"
    return "" if platform.flash_attention else platform.flash_attention_error or "no FlashAttention"


def _before_ampere(platform: Platform) -> bool:
    return platform.compute_capability is not None and platform.compute_capability < (8, 0)


FLASH_ATTN_ARCHS = {8: "80", 9: "90", 10: "100", 12: "120"}
"""The ``FLASH_ATTN_CUDA_ARCHS`` flash-attn 2.8.3's setup.py builds, by major compute capability
(its sm80 code runs on sm86/89 too; it ignores any other value, and nothing before sm80)."""


def flash_attention_fix(capability: tuple[int, int] | None) -> str:
    """How to install the FlashAttention TE uses, and how to check it (for refusals on sm80 and
    newer; before sm80 there is none to install)."""
    arch = FLASH_ATTN_ARCHS.get(capability[0], "80") if capability else "80"
    return (f"install flash-attn=={FLASH_ATTN_PIN} built against this torch "
            f"(`MAX_JOBS=4 FLASH_ATTN_CUDA_ARCHS={arch} FLASH_ATTENTION_FORCE_BUILD=TRUE pip install "
            f"--no-build-isolation flash-attn=={FLASH_ATTN_PIN}`; Transformer-Engine 2.17.1 takes "
            f"{TE_FLASH_ATTN_RANGE[0]} to {TE_FLASH_ATTN_RANGE[1]}, no .post release), check it with "
            f"`python -c \"import flash_attn_2_cuda, flash_attn; print(flash_attn.__version__)\"` "
            f"({ATTENTION_HELP})")


def attention_backend(platform: Platform, requested: str = "auto", *, dtype,
                      without_transformer_engine: bool = False, environ=None) -> str:
    """The attention backend of a training run's packed (THD) rows: Megatron-Core's
    ``AttnBackend`` name for ``TransformerConfig.attention_backend`` (``"flash"``, ``"fused"``,
    ``"unfused"``), or ``"local"`` where Megatron's local spec runs (CPU,
    ``model.without_transformer_engine``). Raises ``InputError`` naming
    ``model.attention_backend`` (or ``model.dtype``), the GPU and the fix where the run would
    otherwise degrade or fail, or naming the ``NVTE_*_ATTN`` variable exported against the
    backend chosen (Megatron asserts on it at the model's build: ``attention_switches``).

    ``requested`` (``model.attention_backend``, one of ``ATTENTION_BACKENDS``): ``"auto"`` takes
    cuDNN fused attention on sm90 and newer, FlashAttention where fused cannot take packed rows
    (sm80/86/89, or sm90+ with ``NVTE_FUSED_ATTN=0`` or an old cuDNN), and refuses the rest: TE
    would run them on ``UnfusedDotProductAttention``, which pads every packed sequence to the
    longest and allocates [b h, s, s] scores per layer, after a whole generation phase. A named
    backend is taken as asked when this GPU runs it, else refused. ``unfused`` is the only
    float32 backend (dense scores: short rows). Megatron then forbids the other backends
    (``NVTE_*_ATTN`` set by ``LanguageModule._set_attention_backend``), so TE fails loudly
    rather than fall back. ``environ`` (default ``os.environ``): ``NVTE_FLASH_ATTN=0`` /
    ``NVTE_FUSED_ATTN=0`` rule a backend out (``benchmarks/gpu_check.py --profile a100`` runs a
    Hopper GPU as an A100 that way); ``NVTE_UNFUSED_ATTN=0`` rules out ``unfused``."""
    import os

    environ = os.environ if environ is None else environ
    backend = _chosen_backend(platform, requested, dtype=dtype,
                              without_transformer_engine=without_transformer_engine,
                              environ=environ)
    for key, wanted in attention_switches(backend).items():
        exported = environ.get(key)
        if exported is not None and exported != wanted:
            raise InputError(
                f"{key}={exported} is exported, but this run's packed rows take {backend} "
                f"attention (model.attention_backend={requested} on "
                f"{platform.gpu if platform.cuda else 'the CPU'}), for which Megatron-Core sets "
                f"{key}={wanted} and stops at start-up on another value: unset {key} "
                f"(model.attention_backend chooses the backend; {ATTENTION_HELP})")
    return backend


def _chosen_backend(platform: Platform, requested: str, *, dtype, without_transformer_engine: bool,
                    environ) -> str:
    """``attention_backend``'s choice, before the environment's switches are compared."""
    from megatron_dgpo.runtime.config import require_choice

    require_choice("model.attention_backend", requested, ATTENTION_BACKENDS)
    if not platform.cuda:
        return "local"  # the CPU path: Megatron's local spec, the recipe's choice has no effect
    if without_transformer_engine or not platform.transformer_engine:
        if requested != "auto":
            raise InputError(
                f"model.attention_backend={requested} is a Transformer-Engine backend; "
                f"model.without_transformer_engine=true builds Megatron's local attention "
                f"(dense masks): set model.attention_backend=auto")
        return "local"
    gpu = platform.gpu
    if requested == "unfused":
        if environ.get("NVTE_UNFUSED_ATTN") == "0":
            raise InputError("model.attention_backend=unfused, but NVTE_UNFUSED_ATTN=0 is set "
                             "in the environment: unset it or choose another backend")
        return "unfused"
    fused_refusal = _fused_thd_refusal(platform, dtype, environ)
    flash_refusal = _flash_refusal(platform, dtype, environ)
    if requested == "fused":
        if fused_refusal:
            raise InputError(f"model.attention_backend=fused on {gpu}: {fused_refusal}. Use "
                             f"model.attention_backend=auto ({ATTENTION_HELP})")
        return "fused"
    if requested == "flash":
        if flash_refusal and _before_ampere(platform):  # no flash-attn build runs there
            raise InputError(f"model.attention_backend=flash on {gpu}: {flash_refusal} (no "
                             f"flash-attn release builds for it); use "
                             f"model.attention_backend=unfused for short rows only "
                             f"({ATTENTION_HELP})")
        if flash_refusal:
            raise InputError(f"model.attention_backend=flash on {gpu}: {flash_refusal}; "
                             + flash_attention_fix(platform.compute_capability))
        return "flash"
    if not fused_refusal:
        return "fused"
    if not flash_refusal:
        return "flash"
    if not _half(dtype):
        raise InputError(
            f"model.dtype: {str(dtype).removeprefix('torch.')} on a GPU with Transformer-Engine: "
            f"its flash and fused attention take bfloat16 or float16, and the unfused one pads "
            f"each packed sequence to the longest with [s, s] scores per layer; use "
            f"model.dtype=bfloat16 (fp32 main weights stay in the optimizer), or "
            f"model.attention_backend=unfused for short rows only")
    if platform.compute_capability is not None and platform.compute_capability < (8, 0):
        raise InputError(
            f"model.attention_backend=auto on {gpu}: packed rows have no fused or flash "
            f"attention before sm80, and TE's unfused one allocates [s, s] scores per layer; "
            f"set model.attention_backend=unfused for short rows only ({ATTENTION_HELP})")
    raise InputError(
        f"model.attention_backend=auto on {gpu}: packed rows need FlashAttention here "
        f"({fused_refusal}; FlashAttention: {flash_refusal}). Without it Transformer-Engine "
        f"falls back to its unfused attention, which pads every packed sequence to the longest "
        f"and allocates [s, s] scores per layer (out of memory at long rows, after a whole "
        f"generation phase). Fix: " + flash_attention_fix(platform.compute_capability)
        + "; or model.attention_backend=unfused for short rows only")


NVTE_SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
"""Transformer-Engine's attention switches (1: allowed, its default; 0: ruled out)."""


def attention_switches(backend: str) -> dict[str, str]:
    """What Megatron-Core sets the ``NVTE_SWITCHES`` to when it builds a model of ``backend``
    (``LanguageModule._set_attention_backend``: the chosen one 1, the others 0; all 0 for
    ``local``), asserting that any value already exported is the same. An exported 1 means
    "allowed" to Transformer-Engine, not "use this one", so the trainer does not read it as a
    choice (the run's attention would follow the environment, not the recipe saved in
    config.yaml): ``attention_backend`` refuses it by name instead."""
    chosen = {"flash": "NVTE_FLASH_ATTN", "fused": "NVTE_FUSED_ATTN",
              "unfused": "NVTE_UNFUSED_ATTN"}.get(backend)
    return {key: "1" if key == chosen else "0" for key in NVTE_SWITCHES}


def cuda_launch_env(tensor_parallel: int, context_parallel: int = 1) -> dict[str, str]:
    """Environment a GPU rank needs before its CUDA context exists: with TP > 1 (sequence
    parallelism) or CP > 1 (the K/V ring of context parallelism), ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    so that communication kernels are queued before the GEMMs or attention they overlap (one
    hardware queue keeps issue order). Megatron-LM's ``validate_args`` requires it for TP > 1
    or CP > 1 before Blackwell (set here on every generation: the context does not exist yet to
    ask); verl's Megatron workers set it too. Empty with TP = CP = 1."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tensor_parallel > 1 or context_parallel > 1 \
        else {}


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
