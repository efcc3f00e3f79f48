"""HF folder or converted checkpoint -> this rank's live model chunks (``load_model``).

An HF folder is copied tensor by tensor into each rank's TP shards and PP layers
(``load_hf_into``); a converted checkpoint is loaded by Megatron-Core's dist_checkpointing,
which reshards it to the current TP/PP/VPP.
"""

from __future__ import annotations

import os

import torch

from megatron_dgpo.convert.checkpoint_format import (METADATA_FILE, model_sharded_state_dict,
                                                     read_metadata)
from megatron_dgpo.convert.hf_source import HFSource
from megatron_dgpo.convert.safetensors_io import read_hf_config
from megatron_dgpo.convert.transforms import expert_shape, megatron_shape, tp_shard_boxes
from megatron_dgpo.models import megatron_param_key
from megatron_dgpo.models.builder import build_model, unwrap_model


def load_hf_into(chunks, hf_dir: str) -> None:
    """Copy an HF checkpoint into this rank's model chunks (its TP shards, its PP layers, its
    experts and their expert-TP shards)."""
    from megatron.core import parallel_state

    chunks = [unwrap_model(c) for c in chunks]
    tp = (parallel_state.get_tensor_model_parallel_rank(),
          parallel_state.get_tensor_model_parallel_world_size())
    padded = chunks[0].vocab_size
    source = HFSource(hf_dir, padded_vocab=padded)
    by_key = {pm.key(): pm for pm in source.params}
    if source.dims.moe:
        expert_tp = (parallel_state.get_expert_tensor_parallel_rank(),
                     parallel_state.get_expert_tensor_parallel_world_size())
        first_expert = (parallel_state.get_expert_model_parallel_rank() * source.dims.experts
                        // parallel_state.get_expert_model_parallel_world_size())
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
    an HF folder (config.json + safetensors) or a checkpoint written by ``hf_to_megatron``.

    ``overrides`` go to ``megatron_dgpo.models.builder.build_model`` (TransformerConfig fields).
    Collective over the world when loading a torch_dist checkpoint.
    """
    from megatron.core import dist_checkpointing

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
