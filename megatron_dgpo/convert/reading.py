"""Megatron-Core ``torch_dist`` checkpoint -> HF: read a converted, training or Megatron-Bridge
checkpoint one (layer, tensor) box at a time with torch.distributed.checkpoint, in one process,
without torch.distributed, and write it as sharded safetensors (``megatron_to_hf``).
"""

from __future__ import annotations

from typing import Iterator

import torch

from megatron_dgpo.convert import _megatron_compat as compat
from megatron_dgpo.convert.bridge import adopt_original_generation
from megatron_dgpo.convert.checkpoint_format import BRIDGE_FORMAT, open_model_checkpoint
from megatron_dgpo.convert.guards import check_output, discard, fresh_staging, publish
from megatron_dgpo.convert.hf_source import iter_params
from megatron_dgpo.convert.safetensors_io import (TensorBlocks, copy_side_files,
                                                  write_hf_checkpoint)
from megatron_dgpo.convert.transforms import hf_from_megatron, hf_tensors, megatron_shape
from megatron_dgpo.models import describe, family_for
from megatron_dgpo.runtime.errors import InputError


def _read_box(reader, where: str, key: str, offsets, sizes, dtype) -> torch.Tensor:
    """``compat.read_box``; a stored file that cannot be read is an ``InputError`` naming the
    tensor (a damaged or truncated shard, found only when its bytes are read)."""
    try:
        return compat.read_box(reader, key, offsets, sizes, dtype)
    except compat.read_failures() as exc:  # whatever the reader hit in the user's files
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise InputError(f"the checkpoint {where}: tensor {key!r} could not be read "
                         f"({(lines[-1] if lines else type(exc).__name__)[:160]}): a file is "
                         f"damaged or incomplete") from exc


def _row_blocks(reader, where: str, key: str, bounds: list[int], shape: tuple[int, ...], dtype):
    """Rows [bounds[i], bounds[i+1]) of stored tensor ``key``, one block at a time."""
    for lo, hi in zip(bounds, bounds[1:]):
        yield _read_box(reader, where, key, (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:],
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
            blocks = _row_blocks(reader, checkpoint.dir, key, bounds, shape, dtype)
            yield pm.hf_names(None)[0], TensorBlocks((rows,) + shape[1:], dtype, blocks)
            continue
        if pm.per_layer:
            offsets = (layer,) + (0,) * len(shape)
            tensor = _read_box(reader, checkpoint.dir, key, offsets, (1,) + shape, dtype)[0]
        else:
            tensor = _read_box(reader, checkpoint.dir, key, (0,) * len(shape), shape, dtype)
        yield from hf_from_megatron(pm, layer, tensor, dims)
        del tensor  # before reading the next one


def megatron_to_hf(ckpt_dir: str, out_dir: str, dtype: torch.dtype | None = None, *,
                   max_shard_bytes: int = 5 * 1024**3, progress: bool = False,
                   overwrite: bool = False) -> str:
    """Convert a checkpoint written by ``hf_to_megatron``, saved by training or written by
    Megatron-Bridge (an ``iter_*`` folder or its parent) to an HF folder.

    ``dtype`` defaults to the converted HF checkpoint's dtype. Writes sharded safetensors
    (+ index), config.json (``torch_dtype`` updated when ``dtype`` is given), generation config
    and tokenizer files; a Bridge checkpoint's generation config comes from its HF original
    (``bridge.adopt_original_generation``). Streams: one tensor in memory at a time. Runs in
    one process, without torch.distributed. ``out_dir`` appears whole or not at all
    (``guards``); a non-empty one is replaced only with ``overwrite``, a training run's
    checkpoints never (``InputError``, as for a wrong input, before anything is written).
    """
    if not max_shard_bytes > 0:
        raise InputError(f"--max-shard-gb must be > 0, got {max_shard_bytes / 1024**3:g}")
    checkpoint = open_model_checkpoint(ckpt_dir)
    out = check_output(out_dir, overwrite=overwrite, inputs=(ckpt_dir,))
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
    staging = fresh_staging(out)
    try:
        write_hf_checkpoint(export_from_checkpoint(ckpt_dir, row_blocks=True), str(staging),
                            dtype=dtype, max_shard_bytes=max_shard_bytes, progress=bar)
        copy_side_files(checkpoint.assets, str(staging), config=cfg)
        if (checkpoint.meta["format"] == BRIDGE_FORMAT
                and not (staging / "generation_config.json").is_file()):
            adopt_original_generation(checkpoint.dir, staging, out)
        publish(staging, out)
    except BaseException:
        discard(staging)
        raise
    finally:
        if bar is not None:
            bar.close()
    return out_dir
