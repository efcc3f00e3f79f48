"""The policy of a training job: where its initial weights come from and how this rank holds it.

Sits above ``model`` (building) and ``convert`` (loading HF weights into the built chunks), so
neither of those imports the other through it.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

import torch

from megatron_dgpo.convert import find_model_checkpoint, load_model, megatron_to_hf
from megatron_dgpo.convert.safetensors_io import LazyHFReader, read_hf_config
from megatron_dgpo.models import describe
from megatron_dgpo.runtime.config import Bounds, check_bounds, require_choice
from megatron_dgpo.runtime.gpu_flags import (ATTENTION_BACKENDS, Platform, attention_backend,
                                             ddp_flags, require_gpu_stack)
from megatron_dgpo.runtime.hub import HUB_FILES, snapshot_of
from megatron_dgpo.runtime.parallel import context_parallel_size
from megatron_dgpo.training.routing_replay import ROUTING_REPLAYS, clear_instances

log = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    """The initial policy."""

    path: str = ""
    """The initial policy: an HF model folder (config.json + safetensors + tokenizer), a hub
    id, or a Megatron checkpoint (Megatron-Bridge's ``iter_*`` folder or its parent, or one
    written by ``dgpo-convert`` or a training run), converted once to an HF folder in
    ``<run_dir>/initial_model``. Relative paths are resolved against the working directory.
    Ignored when ``tiny`` is set."""
    tiny: dict[str, Any] | None = None
    """Create a tiny random Qwen2 and its tokenizer at start instead of loading ``path``
    (``megatron_dgpo.tasks.tiny.make_tiny_model`` keyword arguments, e.g. {seed: 0,
    num_hidden_layers: 2}); written to ``<run_dir>/initial_model``. No download."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter dtype of the trained model. bfloat16 on GPU (fp32 main weights live in the
    optimizer); float32 on CPU (bf16 matmuls are slow there and vLLM's CPU log-probs are fp32)."""
    nominal_params: Annotated[float | None, Bounds(gt=0)] = None
    """The model's size as its name states it (1.5e9 for a "1.5B" model), used by
    ``optimizer.lr: auto``. None: the parameter count of the built model."""
    recompute_activations: bool = False
    """Full-layer activation recomputation (Megatron ``recompute_granularity="full"``,
    uniform method, one layer per block): trades ~33% more compute for O(layers) activations."""
    without_transformer_engine: bool = False
    """On a GPU, run without Transformer-Engine (Megatron's local layer spec). A GPU run stops
    at start when TE does not import, because the local spec builds a dense [S, S] attention
    mask per layer (~10 GB of scores per layer at 16k tokens, TP 4); set this only for short
    sequences (and to train in float32 on a GPU). No effect on CPU."""
    attention_backend: Literal["auto", "flash", "fused", "unfused"] = "auto"
    """On a GPU with Transformer-Engine, the attention of the packed (THD) training rows
    (Megatron's ``attention_backend``). ``auto``: cuDNN fused attention on sm90 and newer
    (H100, H200, B200), FlashAttention-2 on sm80/86/89 (A100, A10, L40; needs flash-attn
    2.8.3, which the image has), and a refusal at start-up, with the fix, where neither can
    run (rather than TE's silent fallback to its unfused attention, whose [s, s] scores per
    layer run out of memory at long rows). ``flash``, ``fused``: that backend or a refusal
    naming this GPU. ``unfused``: TE's dense attention (any dtype, float32 included; short
    rows only). No effect on CPU or with ``without_transformer_engine``. docs/install.md,
    "Attention backends"."""
    moe_token_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """MoE models (Qwen3-MoE): how tokens reach their experts across expert-parallel ranks
    (Megatron's ``moe_token_dispatcher_type``). ``alltoall``: routed tokens only, any layout;
    ``allgather``: every rank gathers all tokens of its EP group, needs
    ``parallel.pipeline_parallel: 1`` (it refuses the variable sequence lengths pipelining
    uses); ``flex``: DeepEP / HybridEP kernels, a GPU with DeepEP installed only. Dense models
    ignore it."""
    moe_aux_loss_coeff: Annotated[float, Bounds(ge=0)] = 0.0
    """MoE models: weight of Megatron's load-balancing loss (``moe_aux_loss_coeff``; > 0 turns
    on ``aux_loss`` balancing). 0 (off) by default: RL fine-tunes a pre-trained router, and the
    extra loss term would change the policy gradient (HF's ``router_aux_loss_coef`` is the
    pre-training value). Dense models ignore it."""

    def __post_init__(self):
        check_bounds(self)
        require_choice("model.attention_backend", self.attention_backend, ATTENTION_BACKENDS)

    def require_source(self) -> None:
        """Raise unless the policy has a source (``path`` or ``tiny``); called by the run
        configs that need one (a bare ``ModelConfig()`` is their default)."""
        if not self.tiny and not self.path:
            raise ValueError("model: set model.path (an HF folder, hub id or Megatron checkpoint) "
                             "or model.tiny")


def initial_model(config, run_dir, seed: int, *, make_tiny=None, download=None):
    """Collective over the default world: the HF folder (``Path``) of the initial policy of
    ``config`` (a recipe's ``ModelConfig``) as this rank's node sees it, holding a config.json.
    Every rank returns or every rank raises: a rank that has no such folder makes all of them
    raise one error naming each failing rank, its node (host name) and, for a hub id, the repo
    id and revision.

    * ``model.tiny``: created once by global rank 0 under ``<run_dir>/initial_model`` (kept for
      resuming) with ``make_tiny(folder, seed=seed, **model.tiny)`` (the driver passes
      ``tasks.tiny.make_tiny_model``); every rank reads it there, so ``run_dir`` must be storage
      every node sees (docs/launching.md asks it of every run: all ranks write checkpoints
      into it).
    * an HF folder: used as it is; every node must see it at that path.
    * a Megatron checkpoint (``convert.find_model_checkpoint``: Megatron-Bridge's, or
      this project's): converted once by global rank 0 to an HF folder under
      ``<run_dir>/initial_model`` (kept for resuming), read there as a tiny model is. The
      engines, the tokenizer and the checkpoints' side files all read an HF folder, so one
      lossless conversion serves them all.
    * a hub id (``model.path`` is no folder): global rank 0 downloads it and fixes the commit
      it got; then one rank per node (``LOCAL_RANK`` 0, as torchrun sets it) downloads that
      commit into its node's HF cache (``HF_HOME``): a no-op on a shared cache, and
      huggingface_hub locks concurrent downloads. Without ``LOCAL_RANK`` no node layout is
      known, so each rank is its own node and downloads for itself. After a barrier every rank
      takes that commit's snapshot folder from its own node's cache (``local_files_only``).
      So every node starts from the same weights even if the hub repo moves during start-up,
      and no rank is handed a path that exists only on rank 0's node. ``HF_HUB_OFFLINE=1``
      is refused (no download is possible).

    ``download``: ``huggingface_hub.snapshot_download`` (the default) or a function with its
    signature; called with ``allow_patterns=HUB_FILES``, by rank 0 first without a revision,
    then with ``revision=<commit>``, then with that revision and ``local_files_only=True``."""
    from pathlib import Path

    import torch.distributed as dist

    from megatron_dgpo.runtime import comm

    if download is None:
        from huggingface_hub import snapshot_download as download
    rank = dist.get_rank() if dist.is_initialized() else 0
    made, error = None, None
    if rank == 0:
        try:
            made = _materialise_model(config, Path(run_dir), seed, download, make_tiny)
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = exc
    made = comm.broadcast_object(made if error is None else _cause(error), src=0)
    if error is not None:
        raise error
    if isinstance(made, str):
        raise RuntimeError(f"initial model: rank 0 could not provide {_source_of(config)}: {made}")
    folder, revision = made
    failure = None
    if revision is not None:
        folder, failure, error = _hub_model_on_this_node(config.path, revision, download, rank)
    if failure is None and not (folder / "config.json").is_file():
        failure = (f"{_this_node(rank)} sees no {folder / 'config.json'} ({_source_of(config)}): "
                   f"model folders and run_dir must be storage every node sees")
    failures = [f for f in comm.gather_objects(failure) if f is not None]
    if failures:
        raise RuntimeError("initial model: " + "; ".join(failures)) from error
    return folder


def _materialise_model(config, run_dir, seed: int, download, make_tiny):
    """Rank 0's part of ``initial_model``: ``(folder, revision)``, revision the commit of a hub
    id (folder then being rank 0's snapshot of it), None for a tiny model or a folder."""
    import shutil
    from pathlib import Path

    def made_once(make) -> Path:  # <run_dir>/initial_model, written once, atomically
        target = run_dir / "initial_model"
        if not (target / "config.json").is_file():
            staging = run_dir / ".initial_model.incomplete"
            shutil.rmtree(staging, ignore_errors=True)
            make(staging)
            os.replace(staging, target)
        return target

    if config.tiny is not None:
        if make_tiny is None:
            raise ValueError("model.tiny: initial_model was given no make_tiny to create it with")
        return made_once(lambda out: make_tiny(out, **{"seed": seed, **config.tiny})), None
    if Path(config.path).is_dir():
        if find_model_checkpoint(config.path) is not None:
            return made_once(lambda out: megatron_to_hf(config.path, str(out))), None
        if not (Path(config.path) / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {config.path} has no config.json (an HF folder) "
                                    f"and is no Megatron checkpoint (dgpo_convert.json, or "
                                    f"Megatron-Bridge's run_config.yaml or "
                                    f"latest_checkpointed_iteration.txt)")
        return Path(config.path), None
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"model.path: {config.path} is not a folder and HF_HUB_OFFLINE=1")
    snapshot = Path(download(config.path, allow_patterns=HUB_FILES))
    hub_snapshot = snapshot_of(snapshot)  # huggingface_hub names a snapshot by its commit
    if hub_snapshot is None:
        raise ValueError(f"model.path: the download of {config.path} gave {snapshot}, not a "
                         f"snapshot folder named by its commit (huggingface_hub's cache layout)")
    return snapshot, hub_snapshot.revision


def _hub_model_on_this_node(repo_id: str, revision: str, download, rank: int):
    """``(folder, failure, error)``: commit ``revision`` of ``repo_id`` in this node's HF cache,
    downloaded first when this rank is its node's downloader (``initial_model``); on failure
    folder is None and ``failure`` says where and what (``error`` the exception). Collective:
    the barrier holds every rank until its node's download has ended."""
    from pathlib import Path

    from megatron_dgpo.runtime import comm

    local_rank = os.environ.get("LOCAL_RANK")
    failure = error = folder = None
    what = f"{repo_id} at revision {revision}"
    if rank != 0 and local_rank in (None, "0"):  # rank 0 downloaded it already
        try:
            download(repo_id, revision=revision, allow_patterns=HUB_FILES)
        except Exception as exc:  # noqa: BLE001 - reported by every rank (initial_model)
            failure, error = f"{_this_node(rank)} could not download {what}: {_cause(exc)}", exc
    comm.barrier()
    if failure is None:
        try:
            folder = Path(download(repo_id, revision=revision, allow_patterns=HUB_FILES,
                                   local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - reported by every rank (initial_model)
            failure, error = (f"{_this_node(rank)} finds no {what} in its node's HF cache after "
                              f"the node's download: {_cause(exc)}"), exc
    return folder, failure, error


def _this_node(rank: int) -> str:
    import socket

    return (f"node {socket.gethostname()} (rank {rank}, LOCAL_RANK "
            f"{os.environ.get('LOCAL_RANK', 'unset')})")


def _source_of(config) -> str:
    return "model.tiny" if config.tiny is not None else f"model.path {config.path}"


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def model_overrides(config, hf_config=None, *, routing_replay: str = "off") -> dict:
    """``TransformerConfig`` overrides that ``config`` (a recipe's ``ModelConfig``) asks for:
    bf16, full-layer recomputation (uniform, one layer per checkpoint) and, when ``hf_config``
    (a dict, config.json or its folder) is an MoE model, the token dispatcher and the
    load-balancing loss weight (``model.moe_token_dispatcher``, ``model.moe_aux_loss_coeff``).
    A dense model gets neither: its config keeps the alltoall dispatcher that
    ``variable_seq_lengths`` needs, which ``allgather`` would break.
    ``routing_replay`` (``algorithm.routing_replay``): ``r3`` adds
    ``moe_enable_routing_replay`` (each router gets a Megatron ``RouterReplay``) and refuses a
    dense model; ``off`` adds nothing."""
    overrides = {"bf16": True} if dtype_named(config.dtype) == torch.bfloat16 else {}
    if config.recompute_activations:
        overrides.update(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    moe = hf_config is not None and describe(hf_config).dims.moe
    if moe:
        overrides.update(moe_token_dispatcher_type=config.moe_token_dispatcher,
                         moe_aux_loss_coeff=float(config.moe_aux_loss_coeff))
    require_choice("algorithm.routing_replay", routing_replay, ROUTING_REPLAYS)
    if routing_replay == "r3":
        if not moe:
            raise ValueError("algorithm.routing_replay: r3 replays the expert choices of MoE "
                             "layers; this model is dense (no routed experts): set "
                             "algorithm.routing_replay: off")
        overrides["moe_enable_routing_replay"] = True
    return overrides


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype of a recipe's dtype name (``model.dtype``, ``checkpoint.export_dtype``)."""
    return _DTYPES[name]


def wrap_ddp(models: list, *, grad_reduce_in_fp32: bool = True, overlap_grad_reduce: bool = False,
             use_distributed_optimizer: bool = False, overlap_param_gather: bool = False,
             bucket_size: int | None = None) -> list:
    """Model chunks wrapped in Megatron's ``DistributedDataParallel`` (gradients in
    ``main_grad``); chunks after the first skip bucketing, as Megatron's training loop does for
    VPP. ``wrap_policy`` passes ``gpu_flags.ddp_flags`` (overlapped grad reduce and param
    gather on a GPU; ``train_step`` then gives the schedules ``gpu_flags.schedule_sync_hooks``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_param_gather=overlap_param_gather, bucket_size=bucket_size)
    return [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m,
                                    disable_bucketing=i > 0) for i, m in enumerate(models)]


def wrap_policy(chunks: list, *, use_distributed_optimizer: bool,
                platform: Platform | None = None) -> list:
    """Collective: built model chunks as the trainer trains them. bf16 chunks go into Megatron's
    Float16Module (``train_step`` asks it for logits in bf16, ``fp32_output=False``); then
    Megatron DDP with ``gpu_flags.ddp_flags`` of this machine (overlapped grad reduce, and
    param gather with the distributed optimizer, on a GPU). ``platform``: default
    ``Platform.detect()``."""
    if chunks and chunks[0].config.bf16:
        from megatron.core.transformer.module import Float16Module

        wrapped = []
        for chunk in chunks:
            wrapper = Float16Module(chunk.config, chunk)
            wrapper.hf_spec = chunk.hf_spec
            wrapped.append(wrapper)
        chunks = wrapped
    return wrap_ddp(chunks, **ddp_flags(platform or Platform.detect(),
                                        use_distributed_optimizer=use_distributed_optimizer))


def attention_overrides(config, platform: Platform, dtype) -> dict:
    """The ``TransformerConfig`` override of ``config``'s (a recipe's ``ModelConfig``)
    attention on ``platform`` in ``dtype``: ``{"attention_backend": AttnBackend.<name>}`` for a
    Transformer-Engine backend (``gpu_flags.attention_backend``, which refuses a run that would
    degrade), nothing for Megatron's local spec (CPU, ``model.without_transformer_engine``)."""
    backend = attention_backend(platform, config.attention_backend, dtype=dtype,
                                without_transformer_engine=config.without_transformer_engine)
    if backend == "local":
        return {}
    from megatron.core.transformer.enums import AttnBackend

    log.info("attention: %s on %s%s", backend, platform.gpu,
             f" ({platform.flash_attention})" if backend == "flash" else "")
    return {"attention_backend": AttnBackend[backend]}


def build_policy(config, hf_dir, *, use_distributed_optimizer: bool,
                 routing_replay: str = "off"):
    """Collective: ``(models, hf_config, dtype)``: this rank's chunks of the policy loaded from
    ``hf_dir`` as ``config`` (a recipe's ``ModelConfig``) says, wrapped by ``wrap_policy``, the
    HF config and the parameter dtype. A GPU run without the stack it needs, or whose packed
    rows would reach Transformer-Engine's unfused attention, is refused here, before a weight is
    read (``gpu_flags.require_gpu_stack``, ``attention_overrides``). ``routing_replay``:
    ``model_overrides``'; Megatron's class-level list of ``RouterReplay`` instances is emptied
    first, so it holds this policy's routers only."""
    dtype = dtype_named(config.dtype)
    platform = Platform.detect()
    require_gpu_stack(platform, without_transformer_engine=config.without_transformer_engine,
                      context_parallel=context_parallel_size())
    attention = attention_overrides(config, platform, dtype)
    if config.without_transformer_engine:
        platform = replace(platform, transformer_engine=False)
    hf_config = read_hf_config(str(hf_dir))
    overrides = {**model_overrides(config, hf_config, routing_replay=routing_replay), **attention}
    clear_instances()
    chunks = load_model(str(hf_dir), dtype=dtype, platform=platform, **overrides)
    models = wrap_policy(chunks, use_distributed_optimizer=use_distributed_optimizer,
                         platform=platform)
    return models, hf_config, dtype


def count_parameters(hf_dir) -> float:
    """Parameters of the HF checkpoint in ``hf_dir`` (for ``optimizer.lr: auto`` without
    ``model.nominal_params``), read from the safetensors headers."""
    reader = LazyHFReader(str(hf_dir))
    return float(sum(math.prod(reader.shape_dtype(name)[0]) for name in reader.names()))
