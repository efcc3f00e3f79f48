"""Megatron-Core ``torch_dist`` checkpoint -> HF: read a converted, training or Megatron-Bridge
checkpoint one (layer, tensor) box at a time with torch.distributed.checkpoint, in one process,
without torch.distributed, and write it as sharded safetensors (``megatron_to_hf``).
"""

from __future__ import annotations

from typing import Iterator

import torch

from megatron_dgpo.convert import _megatron_compat as compat
from megatron_dgpo.convert.checkpoint_format import open_model_checkpoint
from megatron_dgpo.convert.hf_source import iter_params
from megatron_dgpo.convert.safetensors_io import (TensorBlocks, copy_side_files,
                                                  write_hf_checkpoint)
from megatron_dgpo.convert.transforms import hf_from_megatron, hf_tensors, megatron_shape
from megatron_dgpo.models import describe, family_for


def _row_blocks(reader, key: str, bounds: list[int], shape: tuple[int, ...], dtype):
    """Rows [bounds[i], bounds[i+1]) of stored tensor ``key``, one block at a time."""
    for lo, hi in zip(bounds, bounds[1:]):
        yield compat.read_box(reader, key, (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:],
                        dtype)


def export_from_checkpoint(ckpt_dir: str, *, row_blocks: bool = False
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs of a model checkpoint (``checkpoint_format.
    open_model_checkpoint``: converted, training or Megatron-Bridge's), one Megatron tensor in
    memory at a time.

    Runs in one process without torch.distributed (reads with torch.distributed.checkpoint).
    With ``row_blocks``, embeddings and lm_head stored in several row chunks come as
    ``TensorBlocks`` (one stored chunk in memory at a time) for ``write_hf_checkpoint``.
    """
    checkpoint = open_model_checkpoint(ckpt_dir)
    cfg = checkpoint.meta["hf_config"]
    family = family_for(cfg)
    dims = describe(cfg, padded_vocab=checkpoint.meta["padded_vocab_size"]).dims
    reader = compat.checkpoint_reader(checkpoint.dir)
    stored = compat.stored_tensors(reader)
    for pm, layer in iter_params(family.active(cfg), dims.layers):
        key = checkpoint.stored_key(pm.key())  # shapes checked by open_model_checkpoint
        shape = megatron_shape(pm, dims)
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
            tensor = compat.read_box(reader, key, offsets, (1,) + shape, dtype)[0]
        else:
            tensor = compat.read_box(reader, key, (0,) * len(shape), shape, dtype)
        yield from hf_from_megatron(pm, layer, tensor, dims)
        del tensor  # before reading the next one


def megatron_to_hf(ckpt_dir: str, out_dir: str, dtype: torch.dtype | None = None, *,
                   max_shard_bytes: int = 5 * 1024**3, progress: bool = False) -> str:
    """Convert a checkpoint written by ``hf_to_megatron``, saved by training or written by
    Megatron-Bridge (an ``iter_*`` folder or its parent) to an HF folder.

    ``dtype`` defaults to the converted HF checkpoint's dtype. Writes sharded safetensors
    (+ index), config.json (``torch_dtype`` updated when ``dtype`` is given), generation config and tokenizer files. Streams: one tensor in memory at a time.
    Runs in one process, without torch.distributed.
    """
    checkpoint = open_model_checkpoint(ckpt_dir)
    cfg = dict(checkpoint.meta["hf_config"])
    if dtype is None:  # the source's dtype (Megatron may keep e.g. norms in float32)
        dtype = getattr(torch, checkpoint.meta["dtype"])
    else:
        name = str(dtype).replace("torch.", "")
        cfg.update({key: name for key in ("torch_dtype", "dtype") if key in cfg} or
                   {"torch_dtype": name})
    bar = None
    if progress:
        from tqdm import tqdm

        dims = describe(cfg).dims
        total = sum(len(hf_tensors(pm, layer, dims))
                    for pm, layer in iter_params(family_for(cfg).active(cfg), dims.layers))
        bar = tqdm(total=total, desc="megatron-to-hf", unit="tensor")
    write_hf_checkpoint(export_from_checkpoint(ckpt_dir, row_blocks=True), out_dir, dtype=dtype,
                        max_shard_bytes=max_shard_bytes, progress=bar)
    if bar is not None:
        bar.close()
    copy_side_files(checkpoint.assets, out_dir, config=cfg)
    return out_dir
