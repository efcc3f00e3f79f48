"""HF -> Megatron-Core: write an HF checkpoint folder as a ``torch_dist`` checkpoint, streaming,
in this project's container or in Megatron-Bridge's (``bridge.py``).

The model is built on the ``meta`` device (no weights in memory), and a save planner computes
each checkpoint chunk when the writer asks for it, from the few HF rows it needs
(``hf_source.HFSource.box``). Peak memory: about one chunk. Big non-layer tensors are stored as
row chunks of <= 64 MiB so that reading them back is bounded too.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dgpo.convert import _megatron_compat as compat
from megatron_dgpo.convert.bridge import (COMMON_STATE, CONTENT_METADATA, FIRST_ITERATION,
                                          write_bridge_files)
from megatron_dgpo.convert.checkpoint_format import model_sharded_state_dict, write_metadata
from megatron_dgpo.convert.guards import (check_layout, check_output, discard, fresh_staging,
                                          publish, staging_dir)
from megatron_dgpo.convert.hf_source import HFSource, conversion_overrides
from megatron_dgpo.models.builder import build_model
from megatron_dgpo.runtime import comm
from megatron_dgpo.runtime.cpu import cpu_only
from megatron_dgpo.runtime.errors import InputError
from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

_CHUNK_BYTES = 64 * 1024**2  # largest stored chunk of embeddings / lm_head written by us
FORMATS = ("dgpo", "bridge")
"""Containers ``hf_to_megatron`` writes: this project's (``dgpo_convert.json``) or
Megatron-Bridge's (``iter_0000000/`` with ``run_config.yaml``)."""


def _streaming_save_strategy(source: HFSource, progress: bool = False):
    """A ``torch_dist`` save strategy whose tensor data come from ``source`` chunk by chunk."""
    by_key = {pm.key(): pm for pm in source.params}

    def chunk(fqn: str, offsets, sizes, dtype) -> torch.Tensor:
        if fqn not in by_key:
            raise KeyError(f"Megatron tensor {fqn!r} has no HF mapping in family "
                           f"{source.family.name!r}")
        pm = by_key[fqn]
        box = tuple((o, o + s) for o, s in zip(offsets, sizes))
        if pm.per_layer:  # leading checkpoint axis = global layer
            (layer, stop), box = box[0], box[1:]
            assert stop == layer + 1, (fqn, offsets, sizes)
            return source.box(pm, layer, box).to(dtype).unsqueeze(0)
        return source.box(pm, None, box).to(dtype)

    class _LazyPlanner(compat.mcore_save_planner_class()):
        bar = None
        previous = None

        def resolve_data(self, write_item):
            if compat.is_bytes_item(write_item):
                return super().resolve_data(write_item)
            # torch's FileSystemWriter keeps every written tensor referenced until the file is
            # done; the previous chunk is on disk by now, so release its memory ourselves.
            if self.previous is not None:
                self.previous.untyped_storage().resize_(0)
                self.previous = None
            if progress and self.bar is None:
                from tqdm import tqdm

                total = sum(not compat.is_bytes_item(i) for i in self.plan.items)
                self.bar = tqdm(total=total, desc=f"hf-to-megatron rank {dist.get_rank()}",
                                unit="chunk")
            meta = write_item.tensor_data
            data = chunk(write_item.index.fqn, meta.chunk.offsets, meta.chunk.sizes,
                         meta.properties.dtype)
            storage = data.untyped_storage()
            if storage.nbytes() != data.nbytes or not storage.resizable():
                data = data.clone()  # own, exactly-sized storage (the writer would clone anyway)
            self.previous = data
            if self.bar is not None:
                self.bar.update(1)
            return data

    class _Strategy(compat.torch_dist_save_strategy_class()):
        def save(self, sharded_state_dict, checkpoint_dir):
            # One chunk resolved and written at a time (no copy-ahead, which a GPU would
            # otherwise enable): _LazyPlanner relies on that order.
            compat.save_serially(sharded_state_dict, checkpoint_dir, self.keep_only_main_replica,
                                 _LazyPlanner(dedup_replicated_tensors=False,
                                              flatten_state_dict=False))

    return _Strategy("torch_dist", 1)


def _split_large(sharded: dict, max_bytes: int) -> dict:
    """Store big non-layer tensors (embeddings, lm_head) as several row chunks of <= max_bytes.

    The stored chunking is invisible to loading (dist_checkpointing reads whatever chunks
    overlap), but it bounds the memory of writing and of reading one chunk.
    """
    def split(sh):
        rows = sh.local_shape[0]
        row_bytes = sh.data.element_size() * (sh.data.numel() // max(rows, 1))
        if rows * row_bytes <= max_bytes:
            return sh
        parts = next((k for k in range(2, rows + 1)
                      if rows % k == 0 and rows // k * row_bytes <= max_bytes), 1)
        return compat.split_rows(sh, parts)

    out = {}
    for key, value in sharded.items():
        if isinstance(value, dict):
            out[key] = _split_large(value, max_bytes)
        elif compat.plain_row_sharded(value):
            out[key] = split(value)
        else:
            out[key] = value
    return out


def _layout(tp: int, pp: int, ep: int) -> ParallelConfig:
    """The converter's layout: experts whole per rank (expert TP 1) when EP > 1."""
    return ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                          expert_tensor_parallel=1 if ep > 1 else None)


def _unpadded_vocab(sharded: dict, source: HFSource) -> dict:
    """Bridge's layout: the embedding and output layer store the HF vocabulary's rows only."""
    vocab = {pm.key() for pm in source.params if pm.kind == "vocab"}
    return {name: compat.trim_rows(value, source.dims.vocab)
            if getattr(value, "key", None) in vocab else value for name, value in sharded.items()}


def _convert_collective(hf_dir: str, out: Path, tp: int, pp: int, ep: int,
                        dtype: torch.dtype | None, progress: bool = False,
                        format: str = "dgpo") -> None:
    """HF -> torch_dist on the current process group (world = a multiple of the layout's),
    written into ``staging_dir(out)`` and published as ``out`` once every rank has written."""
    from megatron.core import dist_checkpointing

    from megatron_dgpo.runtime import parallel

    own_state = not parallel.parallel_initialized()
    if own_state:
        initialize_parallel(_layout(tp, pp, ep))
    else:
        have = (parallel.tensor_parallel_size(), parallel.pipeline_parallel_size(),
                parallel.expert_parallel_size())
        if have != (tp, pp, ep):
            raise InputError(f"hf_to_megatron(tp={tp}, pp={pp}, ep={ep}) called under an "
                             f"initialised parallel state with (tp, pp, ep) = {have}")
    try:
        source = HFSource(hf_dir, tp=tp)
        dtype = dtype or source.dtype
        # Weights never materialise on CPU: the planner produces every chunk on demand.
        with torch.device("meta") if cpu_only() else contextlib.nullcontext():
            chunks = build_model(source.config, dtype=dtype, perform_initialization=False,
                                 **conversion_overrides(source.config))
        sharded, extra = model_sharded_state_dict(chunks), {}
        staging = staging_dir(out)
        folder = staging
        if format == "bridge":
            folder = staging / FIRST_ITERATION
            sharded = {**_unpadded_vocab(sharded, source), **COMMON_STATE}
            extra = {"content_metadata": CONTENT_METADATA}
        if dist.get_rank() == 0:
            fresh_staging(out)
            folder.mkdir(exist_ok=True)
        comm.barrier()
        dist_checkpointing.save(_split_large(sharded, _CHUNK_BYTES), str(folder),
                                sharded_strategy=_streaming_save_strategy(
                                    source, progress and dist.get_rank() == 0), **extra)
        if dist.get_rank() == 0 and format == "bridge":
            write_bridge_files(str(staging), str(folder), source.config, dtype, hf_dir=hf_dir,
                               final_dir=str(out))
        elif dist.get_rank() == 0:
            write_metadata(str(staging), source.config, source.dims.padded_vocab, dtype,
                           hf_dir=hf_dir, saved_tp=tp, saved_pp=pp, saved_ep=ep)
        comm.barrier()
        if dist.get_rank() == 0:
            publish(staging, out)
        comm.barrier()
    finally:
        if own_state:
            destroy_parallel()


def _spawned_convert(rank: int, world: int, port: int, hf_dir, out, tp, pp, ep, dtype,
                     progress):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _convert_collective(hf_dir, out, tp, pp, ep, dtype, progress)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def single_process_group():
    """A private 1-rank gloo group when torch.distributed is not initialised (else a no-op)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def hf_to_megatron(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, *, ep: int = 1,
                   dtype: torch.dtype | None = None, progress: bool = False,
                   format: str = "dgpo", overwrite: bool = False) -> str:
    """Convert an HF checkpoint folder into a torch_dist checkpoint laid out for (tp, pp, ep).

    Under an initialised ``torch.distributed`` (e.g. torchrun) this is collective over the world
    (a multiple of max(tp, ep) * pp ranks). Otherwise it runs in this process for a 1-rank
    layout and spawns max(tp, ep) * pp local gloo processes for larger ones. The layout only
    decides which rank writes which chunk: the checkpoint loads at any TP/PP/EP (``ep``: expert
    parallelism of an MoE model, experts whole per rank). ``dtype`` defaults to the HF tensors'
    dtype.
    ``format="bridge"`` writes Megatron-Bridge's container instead of this project's
    (``bridge.py``: ``iter_0000000/`` with ``run_config.yaml``, the vocabulary unpadded), in one
    process at (tp, pp, ep) = 1, which Bridge's loader reshards like any other.
    ``out_dir`` appears whole or not at all (``guards``); a non-empty one is replaced only with
    ``overwrite``, a training run's checkpoints never.
    Raises ``InputError`` before any rank starts on an unsupported architecture, a missing file
    or tensor, a tensor whose shape disagrees with config.json, a layout the model does not
    divide into (``guards.check_layout``) or a refused output folder.
    """
    if format not in FORMATS:
        raise InputError(f"hf_to_megatron: format must be one of {FORMATS}, got {format!r}")
    if format == "bridge" and (tp, pp, ep) != (1, 1, 1):
        raise InputError(f"--format bridge writes at --tp 1 --pp 1 --ep 1 (Bridge stores the "
                         f"vocabulary unpadded, which one process writes whole), got --tp {tp} "
                         f"--pp {pp} --ep {ep}; Bridge loads it at any layout")
    source = HFSource(hf_dir)  # validate in the caller's process: errors surface here
    world = check_layout(source.dims, tp=tp, pp=pp, ep=ep,
                         world=dist.get_world_size() if dist.is_initialized() else None)
    out = check_output(out_dir, overwrite=overwrite, inputs=(hf_dir,))
    try:
        if dist.is_initialized():
            _convert_collective(hf_dir, out, tp, pp, ep, dtype, progress, format)
        elif world == 1:
            with single_process_group():
                _convert_collective(hf_dir, out, tp, pp, ep, dtype, progress, format)
        else:
            import torch.multiprocessing as mp

            from megatron_dgpo.runtime.lifetime import children_die_with_this_process
            from megatron_dgpo.runtime.parallel import free_port

            children_die_with_this_process()  # a killed dgpo-convert leaves no rank behind
            mp.spawn(_spawned_convert,
                     args=(world, free_port(), hf_dir, out, tp, pp, ep, dtype, progress),
                     nprocs=world, join=True)
    except BaseException:
        if not dist.is_initialized() or dist.get_rank() == 0:
            discard(staging_dir(out))
        raise
    return out_dir
