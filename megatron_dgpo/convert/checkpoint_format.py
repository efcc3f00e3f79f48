"""The on-disk format of a converted (or training) model checkpoint, besides the tensors.

A Megatron-Core distributed checkpoint (``torch_dist``) of ``model_sharded_state_dict(chunks)``,
loadable at any TP/PP, plus ``dgpo_convert.json`` (format version, source HF config, true and
padded vocab, dtype) and the source's tokenizer / generation-config files under ``hf_assets/``.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_dgpo.convert.safetensors_io import copy_side_files
from megatron_dgpo.models import family_for, hf_config_dict

METADATA_FILE = "dgpo_convert.json"
ASSETS_DIR = "hf_assets"
FORMAT = "megatron-dgpo/torch_dist"
FORMAT_VERSION = 1


def model_sharded_state_dict(chunks) -> dict:
    """The model's sharded state dict in the layout every checkpoint of this project uses:
    one chunk's keys at the top level, or ``model0``, ``model1``, ... under VPP."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


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
