"""HF folder or Megatron checkpoint -> this rank's live model chunks (``load_model``).

An HF folder is copied tensor by tensor into each rank's TP shards and PP layers
(``load_hf_into``); a model checkpoint (converted, training or Megatron-Bridge's,
``checkpoint_format.find_model_checkpoint``) is loaded by Megatron-Core's dist_checkpointing,
which reshards it to the current TP/PP/VPP and vocabulary padding.
"""

from __future__ import annotations

import os

import torch

from megatron_dgpo.convert import _megatron_compat as compat
from megatron_dgpo.convert.bridge import RUN_CONFIG, TRACKER
from megatron_dgpo.convert.checkpoint_format import (METADATA_FILE, find_model_checkpoint,
                                                     model_sharded_state_dict)
from megatron_dgpo.convert.hf_source import HFSource
from megatron_dgpo.convert.safetensors_io import read_hf_config
from megatron_dgpo.convert.transforms import expert_shape, megatron_shape, tp_shard_boxes
from megatron_dgpo.models import megatron_param_key
from megatron_dgpo.models.builder import build_model, unwrap_model
from megatron_dgpo.runtime.errors import MissingInputError


def load_hf_into(chunks, hf_dir: str) -> None:
    """Copy an HF checkpoint into this rank's model chunks (its TP shards, its PP layers, its
    experts and their expert-TP shards)."""
    from megatron_dgpo.runtime import parallel

    chunks = [unwrap_model(c) for c in chunks]
    tp = (parallel.tensor_parallel_rank(), parallel.tensor_parallel_size())
    padded = chunks[0].vocab_size
    source = HFSource(hf_dir, padded_vocab=padded)
    by_key = {pm.key(): pm for pm in source.params}
    if source.dims.moe:
        expert_tp = (parallel.expert_tensor_parallel_rank(), parallel.expert_tensor_parallel_size())
        first_expert = (parallel.expert_parallel_rank() * source.dims.experts
                        // parallel.expert_parallel_size())
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            found = megatron_param_key(source.family, name)
            if found is None:
                raise KeyError(f"parameter {name!r} has no HF mapping in family "
                               f"{source.family.name!r}")
            pm, local, local_expert = found
            if pm.megatron == "output_layer.weight" and pm.key() not in by_key:
                pm = by_key["embedding.word_embeddings.weight"]  # tied: last stage's copy
            layer = None if local is None else chunk.decoder.layers[local].layer_number - 1
            if pm.expert:  # one expert: its leading axis of 1 dropped
                boxes = tp_shard_boxes(pm, expert_shape(pm, source.dims), *expert_tp,
                                       expert=first_expert + local_expert)
                shard = torch.cat([source.box(pm, layer, box) for box in boxes], dim=1)[0]
            else:
                boxes = tp_shard_boxes(pm, megatron_shape(pm, source.dims), *tp)
                shard = torch.cat([source.box(pm, layer, box) for box in boxes])
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for parameter {name!r}: the HF checkpoint gives "
                                 f"{tuple(shard.shape)}, the model has {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(shard)


def load_model(path: str, *, dtype: torch.dtype = torch.float32, **overrides) -> list:
    """This rank's model chunks (``list[GPTModel]``) on the current parallel state, loaded from
    an HF folder (config.json + safetensors) or a torch_dist model checkpoint: one written by
    ``hf_to_megatron`` or saved by training, or Megatron-Bridge's (an ``iter_*`` folder or its
    parent, whose latest iteration is loaded).

    A checkpoint's model tensors only are read, at its vocabulary padding or none (the rows
    past the HF vocabulary are zero); its common state (this project's, Bridge's or
    Megatron-LM's) and any optimizer or RNG state are left alone. ``overrides`` go to
    ``megatron_dgpo.models.builder.build_model`` (TransformerConfig fields). Collective over the
    world when loading a torch_dist checkpoint.
    """
    from megatron.core import dist_checkpointing

    checkpoint = find_model_checkpoint(path)
    if checkpoint is not None:
        chunks = build_model(checkpoint.meta["hf_config"], dtype=dtype, **overrides)
        sharded = model_sharded_state_dict(chunks)
        per_chunk = [sharded] if len(chunks) == 1 else [sharded[f"model{i}"]
                                                        for i in range(len(chunks))]
        wanted = [set(keys) for keys in per_chunk]
        compat.rename_keys(sharded, checkpoint.renamed)
        state = dist_checkpointing.load(sharded, checkpoint.dir)
        states = [state] if len(chunks) == 1 else [state[f"model{i}"] for i in range(len(chunks))]
        for chunk, loaded, keys in zip(chunks, states, wanted):
            # the loaded dict holds the checkpoint's common state too: the model's keys only
            chunk.load_state_dict({k: v for k, v in loaded.items() if k in keys}, strict=True)
        return chunks
    if os.path.isfile(os.path.join(path, "config.json")):
        chunks = build_model(read_hf_config(path), dtype=dtype, **overrides)
        load_hf_into(chunks, path)
        return chunks
    raise MissingInputError(f"missing files: {path} holds neither {METADATA_FILE} (a converted "
                            f"checkpoint), {RUN_CONFIG} or {TRACKER} (a Megatron-Bridge "
                            f"checkpoint) nor config.json (an HF checkpoint)")
