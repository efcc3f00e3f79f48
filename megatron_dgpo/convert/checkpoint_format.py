"""The on-disk format of a converted (or training) model checkpoint, besides the tensors, and
the model checkpoints this project reads (``open_model_checkpoint``).

A Megatron-Core distributed checkpoint (``torch_dist``) of ``model_sharded_state_dict(chunks)``,
loadable at any TP/PP, plus ``dgpo_convert.json`` (format version, source HF config, true and
padded vocab, dtype) and the source's tokenizer / generation-config files under ``hf_assets/``.
Megatron-Bridge's checkpoints hold the same tensors in another container (``bridge.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from megatron_dgpo.convert import _megatron_compat as compat
from megatron_dgpo.convert.bridge import (RUN_CONFIG, TOKENIZER_DIR, bridge_iteration,
                                          read_run_config)
from megatron_dgpo.convert.bridge_provider import hf_config_from_provider
from megatron_dgpo.convert.guards import described
from megatron_dgpo.convert.safetensors_io import copy_side_files
from megatron_dgpo.convert.transforms import megatron_shape
from megatron_dgpo.models import describe, family_for, hf_config_dict
from megatron_dgpo.runtime.errors import InputError, MissingInputError

METADATA_FILE = "dgpo_convert.json"
ASSETS_DIR = "hf_assets"
FORMAT = "megatron-dgpo/torch_dist"
FORMAT_VERSION = 1
BRIDGE_FORMAT = "megatron-bridge/torch_dist"
KEY_ALIASES = {"decoder.layers.pre_mlp_layernorm.weight":
               ("decoder.layers.mlp.linear_fc1.layer_norm_weight",)}
"""Other names a checkpoint may store a tensor of the family map under: an MoE layer's pre-MLP
norm under TE's fused name, as Megatron-Core's local layer spec (Megatron-Bridge on a CPU)
stores it."""


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
        raise MissingInputError(f"missing file: {path} (not a checkpoint written by "
                                f"megatron_dgpo.convert.hf_to_megatron; for another torch_dist "
                                f"model checkpoint call convert.write_metadata first)")
    try:
        with open(path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except ValueError as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or int(meta.get("format_version", -1)) > FORMAT_VERSION:
        meta = meta if isinstance(meta, dict) else {}
        raise InputError(f"{path}: unsupported format {meta.get('format')!r} version "
                         f"{meta.get('format_version')!r} (this code reads {FORMAT} <= "
                         f"{FORMAT_VERSION})")
    missing = [key for key in ("hf_config", "padded_vocab_size", "dtype") if key not in meta]
    if missing:
        raise InputError(f"{path}: no {missing[0]!r} field (write_metadata writes it)")
    return meta


_MODEL_PREFIXES = ("embedding", "decoder", "output_layer")


@dataclass(frozen=True)
class ModelCheckpoint:
    """A torch_dist model checkpoint this project reads (``open_model_checkpoint``)."""

    dir: str
    """The folder of the torch_dist files (a Bridge checkpoint's iteration folder)."""
    meta: dict
    """``dgpo_convert.json``'s fields; for Bridge's, derived from ``run_config.yaml`` (the HF
    config) and the stored tensors (``padded_vocab_size``: the vocabulary rows stored)."""
    assets: str
    """The folder of the tokenizer and generation-config files (it may not exist)."""
    renamed: dict = field(default_factory=dict)
    """{key in the family map: key stored} where the checkpoint stores another name."""

    def stored_key(self, key: str) -> str:
        return self.renamed.get(key, key)


def _bridge_metadata(iteration: str, stored: dict) -> dict:
    cfg = hf_config_from_provider(read_run_config(iteration)["model"],
                                  os.path.join(iteration, RUN_CONFIG))
    embedding = stored.get("embedding.word_embeddings.weight")
    rows = int(embedding.size[0]) if embedding is not None else int(cfg["vocab_size"])
    return {"format": BRIDGE_FORMAT, "family": family_for(cfg).name,
            "vocab_size": int(cfg["vocab_size"]), "padded_vocab_size": rows,
            "dtype": cfg["dtype"], "hf_config": cfg}


def find_model_checkpoint(path: str) -> ModelCheckpoint | None:
    """The model checkpoint at ``path``: one with ``dgpo_convert.json`` (``hf_to_megatron``, a
    training run, or ``write_metadata``), or Megatron-Bridge's (an ``iter_*`` folder or its
    parent, ``bridge.bridge_iteration``); None for a folder that is neither (e.g. an HF one).

    Validated before any tensor is read: every tensor of the family map is stored (under its
    key or a ``KEY_ALIASES`` name) with the shape the config implies, the vocabulary rows as
    stored (padded or not, at least the HF vocabulary). A wrong or partial folder raises
    naming what is missing or what differs. Common state (ours, Bridge's, Megatron-LM's) is
    never read.
    """
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        folder, meta, assets = path, read_metadata(path), os.path.join(path, ASSETS_DIR)
        described(meta.get("hf_config") or {}, os.path.join(path, METADATA_FILE))
        stored = _stored(folder)
    else:
        folder = bridge_iteration(path)
        if folder is None:
            return None
        stored = _stored(folder)
        meta, assets = _bridge_metadata(folder, stored), os.path.join(folder, TOKENIZER_DIR)
    checkpoint = ModelCheckpoint(folder, meta, assets, _renamed(meta, stored))
    _check_stored(checkpoint, stored)
    return checkpoint


def open_model_checkpoint(path: str) -> ModelCheckpoint:
    """``find_model_checkpoint``, raising ``MissingInputError`` for a folder that is neither."""
    checkpoint = find_model_checkpoint(path)
    if checkpoint is None:
        raise MissingInputError(
            f"missing file: {os.path.join(path, METADATA_FILE)} ({path} is not a checkpoint "
            f"written by megatron_dgpo.convert.hf_to_megatron or by training, nor a "
            f"Megatron-Bridge checkpoint ({RUN_CONFIG}, latest_checkpointed_iteration.txt); for "
            f"another torch_dist model checkpoint call convert.write_metadata first)")
    return checkpoint


def _stored(folder: str) -> dict:
    """The tensors a torch_dist folder's index lists; ``InputError`` when there is no readable
    index."""
    index = os.path.join(folder, ".metadata")
    if not os.path.isfile(index):
        raise MissingInputError(f"missing file: {index} (the torch_dist index of the "
                                f"checkpoint's tensors)")
    try:
        return compat.stored_tensors(compat.checkpoint_reader(folder))
    except Exception as exc:  # noqa: BLE001 - any failure to read it: a damaged file
        raise InputError(f"{index}: unreadable ({type(exc).__name__}: {exc}): the checkpoint "
                         f"is damaged or incomplete") from exc


def _renamed(meta: dict, stored: dict) -> dict:
    renamed = {}
    for pm in family_for(meta["hf_config"]).active(meta["hf_config"]):
        if pm.key() not in stored:
            alias = next((a for a in KEY_ALIASES.get(pm.key(), ()) if a in stored), None)
            if alias is not None:
                renamed[pm.key()] = alias
    return renamed


def _check_stored(checkpoint: ModelCheckpoint, stored: dict) -> None:
    cfg = checkpoint.meta["hf_config"]
    dims = describe(cfg, padded_vocab=checkpoint.meta["padded_vocab_size"]).dims
    if dims.padded_vocab < dims.vocab:
        raise InputError(f"the checkpoint {checkpoint.dir} stores {dims.padded_vocab} vocabulary "
                         f"rows, its config says vocab_size {dims.vocab}")
    read = set()
    for pm in family_for(cfg).active(cfg):
        key = checkpoint.stored_key(pm.key())
        if key not in stored:
            raise InputError(f"tensor {pm.key()!r} is missing from the checkpoint "
                             f"{checkpoint.dir}")
        full = ((dims.layers,) if pm.per_layer else ()) + megatron_shape(pm, dims)
        if tuple(stored[key].size) != full:
            raise InputError(f"shape mismatch for tensor {key!r}: the checkpoint has "
                             f"{tuple(stored[key].size)}, its config implies {full}")
        read.add(key)
    # Model tensors its config does not account for would be dropped silently (a config that
    # is not the checkpoint's): refuse them. Optimizer and RNG state are not model tensors.
    unread = sorted(k for k in stored if k.split(".")[0] in _MODEL_PREFIXES and k not in read)
    if unread:
        raise InputError(f"the checkpoint {checkpoint.dir} has {len(unread)} model tensor(s) its "
                         f"config ({checkpoint.meta['family']}) does not account for, e.g. "
                         f"{unread[:5]}")
