"""HF <-> Megatron-Core conversion on top of the model builder, and ``load_model``.

On disk the Megatron side is a Megatron-Core distributed checkpoint (``torch_dist``) of
``model.sharded_state_dict()``, loadable at any TP/PP (dist_checkpointing reshards), plus
``dgpo_convert.json`` (format version, source HF config, true and padded vocab, dtype) and the
source's tokenizer / generation-config files under ``hf_assets/``.

Streaming:
    HF -> Megatron: the model is built on the ``meta`` device (no weights in memory), and a
        save planner computes each checkpoint chunk when the writer asks for it, from the few HF
        rows it needs (``transforms.megatron_box``). Peak memory: about one chunk.
    Megatron -> HF: ``export_from_checkpoint`` loads one (layer, tensor) at a time through
        dist_checkpointing; ``export_hf_weights`` does the same from a live model (TP gather,
        PP transfer), collective over the model-parallel group. Both feed the sharded
        safetensors writer (or the vLLM refit) pair by pair.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_dgpo.convert.safetensors_io import (LazyHFReader, TensorBlocks, copy_side_files,
                                                  read_hf_config, write_hf_checkpoint)
from megatron_dgpo.convert.transforms import (hf_from_megatron, hf_shapes, megatron_box,
                                              megatron_shape, tp_shard_boxes, tp_unshard)
from megatron_dgpo.model import unwrap_model
from megatron_dgpo.models import (Family, ParamMap, describe, family_for, hf_config_dict,
                                   megatron_param_key)

METADATA_FILE = "dgpo_convert.json"
ASSETS_DIR = "hf_assets"
FORMAT = "megatron-dgpo/torch_dist"
FORMAT_VERSION = 1
_CHUNK_BYTES = 64 * 1024**2  # largest stored chunk of embeddings / lm_head written by us


# ----------------------------------------------------------------------------- HF source

class HFSource:
    """An HF checkpoint folder seen as global Megatron tensors (validated against its config)."""

    def __init__(self, hf_dir: str, padded_vocab: int | None = None, tp: int = 1):
        self.hf_dir = hf_dir
        self.config = read_hf_config(hf_dir)
        description = describe(self.config, tp=tp, padded_vocab=padded_vocab)
        self.family, self.dims = description.family, description.dims
        self.reader = LazyHFReader(hf_dir)
        self.params = self.family.active(self.config)
        self._validate()

    def _validate(self) -> None:
        """Refuse unsupported configs, missing or unmapped tensors and shape mismatches before
        anything is written."""
        from megatron_dgpo.model import transformer_config_from_hf

        transformer_config_from_hf(self.config)  # the builder's refusals (RoPE scaling, act, ...)
        consumed = set()
        for pm, layer in iter_params(self.params, self.dims.layers):
            for name, expected in zip(pm.hf_names(layer), hf_shapes(pm, self.dims)):
                consumed.add(name)
                if name not in self.reader:
                    raise KeyError(f"tensor {name!r} is missing from the HF checkpoint "
                                   f"{self.hf_dir}")
                shape, _ = self.reader.shape_dtype(name)
                if tuple(shape) != tuple(expected):
                    raise ValueError(f"shape mismatch for tensor {name!r}: the checkpoint has "
                                     f"{tuple(shape)}, config.json implies {tuple(expected)}")
        # Tensors nothing maps would be dropped silently (e.g. mlp biases): refuse them. Tolerated:
        # RoPE caches, and a redundant lm_head.weight in checkpoints with tied embeddings.
        ignorable = ("lm_head.weight",) if self.config.get("tie_word_embeddings") else ()
        unmapped = sorted(n for n in self.reader.names() if n not in consumed
                          and n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
        if unmapped:
            raise ValueError(f"the HF checkpoint {self.hf_dir} has {len(unmapped)} tensor(s) the "
                             f"{self.family.name} map does not convert, e.g. {unmapped[:5]}")

    @property
    def dtype(self) -> torch.dtype:
        return self.reader.shape_dtype(self.params[0].hf_names(None)[0])[1]

    def box(self, pm: ParamMap, layer: int | None, box) -> torch.Tensor:
        return megatron_box(pm, layer, box, self.reader.read, self.dims)


def iter_params(params: Sequence[ParamMap], num_layers: int):
    """(map, global layer) in HF order: embeddings, layer 0 .. L-1, final norm, lm_head."""
    for pm in params:
        if not pm.per_layer and pm.megatron.startswith("embedding"):
            yield pm, None
    for layer in range(num_layers):
        for pm in params:
            if pm.per_layer:
                yield pm, layer
    for pm in params:
        if not pm.per_layer and not pm.megatron.startswith("embedding"):
            yield pm, None


# ----------------------------------------------------------------------------- streaming save

def _streaming_save_strategy(source: HFSource, progress: bool = False):
    """A ``torch_dist`` save strategy whose tensor data come from ``source`` chunk by chunk."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType

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

    class _LazyPlanner(MCoreSavePlanner):
        bar = None
        previous = None

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            # torch's FileSystemWriter keeps every written tensor referenced until the file is
            # done; the previous chunk is on disk by now, so release its memory ourselves.
            if self.previous is not None:
                self.previous.untyped_storage().resize_(0)
                self.previous = None
            if progress and self.bar is None:
                from tqdm import tqdm

                total = sum(i.type != WriteItemType.BYTE_IO for i in self.plan.items)
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

    class _Strategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            # Serial, single-thread writer that resolves and writes one chunk at a time (no
            # copy-ahead, which a GPU would otherwise enable): _LazyPlanner relies on that order.
            writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=True, thread_count=1,
                                      per_thread_copy_ahead=0)
            dcp.save(mcore_to_pyt_state_dict(state, False), storage_writer=writer,
                     planner=_LazyPlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    return _Strategy("torch_dist", 1)


def _split_large(sharded: dict, max_bytes: int) -> dict:
    """Store big non-layer tensors (embeddings, lm_head) as several row chunks of <= max_bytes.

    The stored chunking is invisible to loading (dist_checkpointing reads whatever chunks
    overlap), but it bounds the memory of writing and of reading one chunk.
    """
    import dataclasses

    from megatron.core.dist_checkpointing import ShardedTensor

    def split(sh):
        rows = sh.local_shape[0]
        row_bytes = sh.data.element_size() * (sh.data.numel() // max(rows, 1))
        if sh.prepend_axis_num or sh.flattened_range is not None or rows * row_bytes <= max_bytes:
            return sh
        parts = next((k for k in range(2, rows + 1)
                      if rows % k == 0 and rows // k * row_bytes <= max_bytes), 1)
        step = rows // parts
        return [dataclasses.replace(
            sh, data=sh.data[j * step:(j + 1) * step], local_shape=(step,) + sh.local_shape[1:],
            global_offset=(sh.global_offset[0] + j * step,) + sh.global_offset[1:],
            axis_fragmentations=(sh.axis_fragmentations[0] * parts,) + sh.axis_fragmentations[1:])
            for j in range(parts)]

    out = {}
    for key, value in sharded.items():
        if isinstance(value, dict):
            out[key] = _split_large(value, max_bytes)
        elif isinstance(value, ShardedTensor):
            out[key] = split(value)
        else:
            out[key] = value
    return out


def model_sharded_state_dict(chunks) -> dict:
    """The model's sharded state dict in the layout every checkpoint of this project uses:
    one chunk's keys at the top level, or ``model0``, ``model1``, ... under VPP."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _convert_collective(hf_dir: str, out_dir: str, tp: int, pp: int,
                        dtype: torch.dtype | None, progress: bool = False) -> None:
    """HF -> torch_dist on the current process group (world = a multiple of tp * pp)."""
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_dgpo.cpu import cpu_only
    from megatron_dgpo.model import build_model
    from megatron_dgpo.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        initialize_parallel(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp))
    else:
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"hf_to_megatron(tp={tp}, pp={pp}) called under an initialised "
                             f"parallel state with (tp, pp) = {have}")
    try:
        source = HFSource(hf_dir, tp=tp)
        dtype = dtype or source.dtype
        # Weights never materialise on CPU: the planner produces every chunk on demand.
        with torch.device("meta") if cpu_only() else contextlib.nullcontext():
            chunks = build_model(source.config, dtype=dtype, perform_initialization=False)
        if dist.get_rank() == 0:
            os.makedirs(out_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(_split_large(model_sharded_state_dict(chunks), _CHUNK_BYTES), out_dir,
                                sharded_strategy=_streaming_save_strategy(
                                    source, progress and dist.get_rank() == 0))
        if dist.get_rank() == 0:
            write_metadata(out_dir, source.config, source.dims.padded_vocab, dtype, hf_dir=hf_dir,
                           saved_tp=tp, saved_pp=pp)
        dist.barrier()
    finally:
        if own_state:
            destroy_parallel()


def _spawned_convert(rank: int, world: int, port: int, hf_dir, out_dir, tp, pp, dtype, progress):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _convert_collective(hf_dir, out_dir, tp, pp, dtype, progress)
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


def hf_to_megatron(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, *,
                   dtype: torch.dtype | None = None, progress: bool = False) -> str:
    """Convert an HF checkpoint folder into a torch_dist checkpoint laid out for (tp, pp).

    Under an initialised ``torch.distributed`` (e.g. torchrun) this is collective over the world
    (a multiple of tp * pp ranks). Otherwise it runs in this process for tp * pp == 1 and spawns
    tp * pp local gloo processes for larger layouts. The layout only decides which rank writes
    which chunk: the checkpoint loads at any TP/PP. ``dtype`` defaults to the HF tensors' dtype.
    Raises before writing anything on an unsupported architecture, a missing file or tensor, or
    a tensor whose shape disagrees with config.json.
    """
    HFSource(hf_dir, tp=tp)  # validate in the caller's process: errors surface here, clearly
    if dist.is_initialized():
        _convert_collective(hf_dir, out_dir, tp, pp, dtype, progress)
    elif tp * pp == 1:
        with single_process_group():
            _convert_collective(hf_dir, out_dir, tp, pp, dtype, progress)
    else:
        import torch.multiprocessing as mp

        from megatron_dgpo.convert._spawn import free_port

        mp.spawn(_spawned_convert,
                 args=(tp * pp, free_port(), hf_dir, out_dir, tp, pp, dtype, progress),
                 nprocs=tp * pp, join=True)
    return out_dir


# ----------------------------------------------------------------------------- checkpoint reading

def write_metadata(ckpt_dir: str, hf_config, padded_vocab_size: int, dtype: torch.dtype, *,
                   hf_dir: str | None = None, **extra) -> None:
    """Write ``dgpo_convert.json`` (+ tokenizer / generation-config files from ``hf_dir`` under
    ``hf_assets/``) next to a torch_dist model checkpoint, e.g. one saved by training, so that
    ``megatron_to_hf`` and ``load_model`` can read it. Call on one rank."""
    cfg = hf_config_dict(hf_config)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "family": family_for(cfg).name,
            "vocab_size": int(cfg["vocab_size"]), "padded_vocab_size": int(padded_vocab_size),
            "dtype": str(dtype).replace("torch.", ""), "hf_config": cfg, **extra}
    with open(os.path.join(ckpt_dir, METADATA_FILE), "w", encoding="utf-8") as handle:
        json.dump(meta, handle, indent=2, sort_keys=True)
    if hf_dir is not None:
        copy_side_files(hf_dir, os.path.join(ckpt_dir, ASSETS_DIR))


def read_metadata(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing file: {path} (not a checkpoint written by "
                                f"megatron_dgpo.convert.hf_to_megatron; for another torch_dist "
                                f"model checkpoint call convert.write_metadata first)")
    with open(path, encoding="utf-8") as handle:
        meta = json.load(handle)
    if meta.get("format") != FORMAT or int(meta.get("format_version", -1)) > FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported format {meta.get('format')!r} version "
                         f"{meta.get('format_version')!r} (this code reads {FORMAT} <= "
                         f"{FORMAT_VERSION})")
    return meta


@functools.lru_cache(maxsize=None)
def _box_planner_class():
    """DCP's default load planner, restricted to one key read into one box (built once: a class
    made per call would keep its buffer alive in a reference cycle until the next gc)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import _create_read_items

    class _BoxPlanner(DefaultLoadPlanner):
        def __init__(self, key: str, buffer: torch.Tensor):
            super().__init__()
            self.key, self.buffer = key, buffer

        def create_local_plan(self):
            md = self.metadata.state_dict_metadata[self.key]
            return LoadPlan(_create_read_items(self.key, md, self.buffer))

    return _BoxPlanner


def _read_box(reader, key: str, offsets: tuple[int, ...], shape: tuple[int, ...],
              dtype: torch.dtype) -> torch.Tensor:
    """The sub-tensor of stored tensor ``key`` at ``offsets`` of size ``shape``, read alone.

    torch.distributed.checkpoint reads only the stored chunks that overlap the box (DCP's
    ``__create_chunk_list__`` protocol describes the box; the planner is otherwise DCP's own).
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    buffer = torch.empty(shape, dtype=dtype)
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=buffer.size())
    buffer.__create_chunk_list__ = lambda: [chunk]
    buffer.__get_tensor_shard__ = functools.partial(_identity, buffer)
    dcp_load({key: buffer}, storage_reader=reader, planner=_box_planner_class()(key, buffer),
             no_dist=True)
    del buffer.__create_chunk_list__, buffer.__get_tensor_shard__  # break the reference cycle
    return buffer


def _identity(tensor, _index):
    return tensor


def _row_blocks(reader, key: str, bounds: list[int], shape: tuple[int, ...], dtype):
    """Rows [bounds[i], bounds[i+1]) of stored tensor ``key``, one block at a time."""
    for lo, hi in zip(bounds, bounds[1:]):
        yield _read_box(reader, key, (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:],
                        dtype)


def export_from_checkpoint(ckpt_dir: str, *, row_blocks: bool = False
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs of a converted checkpoint, one Megatron tensor in memory at a time.

    Runs in one process without torch.distributed (reads with torch.distributed.checkpoint).
    With ``row_blocks``, embeddings and lm_head stored in several row chunks come as
    ``TensorBlocks`` (one stored chunk in memory at a time) for ``write_hf_checkpoint``.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_metadata(ckpt_dir)
    cfg = meta["hf_config"]
    family = family_for(cfg)
    dims = describe(cfg, padded_vocab=meta["padded_vocab_size"]).dims
    reader = FileSystemReader(ckpt_dir)
    stored = reader.read_metadata().state_dict_metadata
    for pm, layer in iter_params(family.active(cfg), dims.layers):
        key = pm.key()
        if key not in stored or not isinstance(stored[key], TensorStorageMetadata):
            raise KeyError(f"tensor {key!r} is missing from the checkpoint {ckpt_dir}")
        shape = megatron_shape(pm, dims)
        full = ((dims.layers,) if pm.per_layer else ()) + shape
        if tuple(stored[key].size) != full:
            raise ValueError(f"shape mismatch for tensor {key!r}: the checkpoint has "
                             f"{tuple(stored[key].size)}, its config implies {full}")
        dtype = stored[key].properties.dtype
        starts = sorted({int(c.offsets[0]) for c in stored[key].chunks})
        if row_blocks and not pm.per_layer and pm.kind in ("copy", "vocab") and len(starts) > 1:
            rows = dims.vocab if pm.kind == "vocab" else shape[0]
            bounds = [b for b in starts if b < rows] + [rows]
            blocks = _row_blocks(reader, key, bounds, shape, dtype)
            yield pm.hf_names(None)[0], TensorBlocks((rows,) + shape[1:], dtype, blocks)
            continue
        if pm.per_layer:
            offsets = (layer,) + (0,) * len(shape)
            tensor = _read_box(reader, key, offsets, (1,) + shape, dtype)[0]
        else:
            tensor = _read_box(reader, key, (0,) * len(shape), shape, dtype)
        yield from hf_from_megatron(pm, layer, tensor, dims)
        del tensor  # before reading the next one


def megatron_to_hf(ckpt_dir: str, out_dir: str, dtype: torch.dtype | None = None, *,
                   max_shard_bytes: int = 5 * 1024**3, progress: bool = False) -> str:
    """Convert a checkpoint written by ``hf_to_megatron`` (or saved by training) to an HF folder.

    ``dtype`` defaults to the converted HF checkpoint's dtype. Writes sharded safetensors
    (+ index), config.json (``torch_dtype`` updated when ``dtype`` is given), generation config and tokenizer files. Streams: one tensor in memory at a time.
    Runs in one process, without torch.distributed.
    """
    meta = read_metadata(ckpt_dir)
    cfg = dict(meta["hf_config"])
    if dtype is None:  # the source's dtype (Megatron may keep e.g. norms in float32)
        dtype = getattr(torch, meta["dtype"])
    else:
        name = str(dtype).replace("torch.", "")
        cfg.update({key: name for key in ("torch_dtype", "dtype") if key in cfg} or
                   {"torch_dtype": name})
    bar = None
    if progress:
        from tqdm import tqdm

        family = family_for(cfg)
        total = sum(len(pm.hf) for pm, _ in iter_params(family.active(cfg),
                                                        int(cfg["num_hidden_layers"])))
        bar = tqdm(total=total, desc="megatron-to-hf", unit="tensor")
    write_hf_checkpoint(export_from_checkpoint(ckpt_dir, row_blocks=True), out_dir, dtype=dtype,
                        max_shard_bytes=max_shard_bytes, progress=bar)
    if bar is not None:
        bar.close()
    copy_side_files(os.path.join(ckpt_dir, ASSETS_DIR), out_dir, config=cfg)
    return out_dir


# ----------------------------------------------------------------------------- live models

def _local_params(chunks, family: Family, tied: bool):
    """{(checkpoint key, global layer or None): parameter} of this rank's chunks."""
    out = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            found = megatron_param_key(family, name)
            if found is None:
                raise KeyError(f"parameter {name!r} has no HF mapping in family {family.name!r}")
            pm, local = found
            if tied and pm.megatron == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding
            layer = None if local is None else chunk.decoder.layers[local].layer_number - 1
            out[(pm.key(), layer)] = (pm, param)
    return out


def load_hf_into(chunks, hf_dir: str) -> None:
    """Copy an HF checkpoint into this rank's model chunks (its TP shards, its PP layers)."""
    from megatron.core import parallel_state

    chunks = [unwrap_model(c) for c in chunks]
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    padded = chunks[0].vocab_size
    source = HFSource(hf_dir, padded_vocab=padded)
    by_key = {pm.key(): pm for pm in source.params}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            found = megatron_param_key(source.family, name)
            if found is None:
                raise KeyError(f"parameter {name!r} has no HF mapping in family "
                               f"{source.family.name!r}")
            pm, local = found
            if pm.megatron == "output_layer.weight" and pm.key() not in by_key:
                pm = by_key["embedding.word_embeddings.weight"]  # tied: last stage's copy
            layer = None if local is None else chunk.decoder.layers[local].layer_number - 1
            boxes = tp_shard_boxes(pm, megatron_shape(pm, source.dims), tp_rank, tp_size)
            shard = torch.cat([source.box(pm, layer, box) for box in boxes])
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for parameter {name!r}: the HF checkpoint gives "
                                 f"{tuple(shard.shape)}, the model has {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(shard)


def load_model(path: str, *, dtype: torch.dtype = torch.float32, **overrides) -> list:
    """This rank's model chunks (``list[GPTModel]``) on the current parallel state, loaded from
    an HF folder (config.json + safetensors) or a checkpoint written by ``hf_to_megatron``.

    ``overrides`` go to ``megatron_dgpo.model.build_model`` (TransformerConfig fields).
    Collective over the world when loading a torch_dist checkpoint.
    """
    from megatron.core import dist_checkpointing

    from megatron_dgpo.model import build_model

    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        meta = read_metadata(path)
        chunks = build_model(meta["hf_config"], dtype=dtype, **overrides)
        state = dist_checkpointing.load(model_sharded_state_dict(chunks), path)
        if len(chunks) == 1:
            state = {"model0": state}
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{i}"], strict=True)
        return chunks
    if os.path.isfile(os.path.join(path, "config.json")):
        chunks = build_model(read_hf_config(path), dtype=dtype, **overrides)
        load_hf_into(chunks, path)
        return chunks
    raise FileNotFoundError(f"missing files: {path} holds neither {METADATA_FILE} (a converted "
                            f"checkpoint) nor config.json (an HF checkpoint)")


def export_hf_weights(model_chunks, *, consumer: str = "all", dtype: torch.dtype | None = None,
                      hf_config: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` pairs of a live model, in HF order, one tensor at a time.

    Collective over the model-parallel group: *every* rank of it must exhaust the generator.
    Per tensor, the pipeline stage that owns it all-gathers its TP shards (undoing the QKV /
    gate-up / vocab-padding layouts via the family map) and, for ``consumer="all"``, broadcasts
    it over the pipeline group: every model-parallel rank then receives every pair. With
    ``consumer="first"`` only model-parallel rank 0 (TP 0, PP 0) receives pairs (a point-to-point
    send from the owning stage); the others yield nothing. Tensors are on the model's device,
    in each parameter's dtype unless ``dtype`` is given (floating tensors are cast to it).
    They may be views of per-step buffers: copy what you keep.
    ``hf_config`` is only needed for models not built by ``megatron_dgpo.model.build_model``.
    """
    from megatron.core import parallel_state

    if consumer not in ("all", "first"):
        raise ValueError(f"consumer must be 'all' or 'first', got {consumer!r}")
    chunks = [unwrap_model(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple))
                                   else [model_chunks])]
    cfg = hf_config or chunks[0].hf_spec.hf_config
    description = describe(cfg, padded_vocab=chunks[0].vocab_size)
    family, dims = description.family, description.dims
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    tp_size = dist.get_world_size(tp_group)
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    pp_ranks = dist.get_process_group_ranks(pp_group)
    first = parallel_state.get_tensor_model_parallel_rank() == 0 and pp_rank == 0
    params = family.active(cfg)
    local = _local_params(chunks, family, description.tie_word_embeddings)
    owned = [None] * pp_size
    mine = sorted((key, str(param.dtype)) for key, (_, param) in local.items())
    dist.all_gather_object(owned, mine, group=pp_group)
    owner, dtypes = {}, {}
    for stage, keys in enumerate(owned):
        for key, dtype_name in keys:
            owner.setdefault(tuple(key), stage)
            dtypes[tuple(key)] = getattr(torch, dtype_name.replace("torch.", ""))
    device = next(iter(local.values()))[1].device
    for pm, layer in iter_params(params, dims.layers):
        src = owner.get((pm.key(), layer))
        if src is None:
            raise KeyError(f"no pipeline stage holds {pm.key()!r} (layer {layer})")
        full = None
        if pp_rank == src:
            shard = local[(pm.key(), layer)][1].detach().contiguous()
            if tp_size > 1:
                shards = [torch.empty_like(shard) for _ in range(tp_size)]
                dist.all_gather(shards, shard, group=tp_group)
            else:
                shards = [shard]
            full = tp_unshard(pm, shards)
        if pp_size > 1 and consumer == "all":
            if full is None:
                full = torch.empty(megatron_shape(pm, dims), dtype=dtypes[(pm.key(), layer)],
                                   device=device)
            dist.broadcast(full, src=pp_ranks[src], group=pp_group)
        elif pp_size > 1 and src != 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
            if pp_rank == src:
                dist.send(full.contiguous(), dst=pp_ranks[0], group=pp_group)
            elif pp_rank == 0:
                full = torch.empty(megatron_shape(pm, dims), dtype=dtypes[(pm.key(), layer)],
                                   device=device)
                dist.recv(full, src=pp_ranks[src], group=pp_group)
        if consumer == "all" or first:
            for name, tensor in hf_from_megatron(pm, layer, full, dims):
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                yield name, tensor
