"""HF <-> Megatron-Core checkpoint conversion: streaming I/O over the family maps of
``megatron_dgpo.models``.

Modules (one job each):
    hf_source.py          an HF folder as global Megatron tensors, validated
    transforms.py         the HF <-> Megatron tensor layouts (QKV, gate/up, vocab padding, TP)
    writing.py            HF -> torch_dist checkpoint, streaming (``hf_to_megatron``)
    reading.py            torch_dist checkpoint -> HF, box by box (``megatron_to_hf``)
    checkpoint_format.py  dgpo_convert.json + the model's sharded-state-dict layout; the model
                          checkpoints read (``find_model_checkpoint``: ours, Megatron-Bridge's)
    bridge.py             Megatron-Bridge's container (iter_*, run_config.yaml), both ways
    bridge_provider.py    Bridge's GPTModelProvider <-> HF config, every field judged
    guards.py             checks before any work (layout, output folder); whole-folder output
    live_load.py          HF folder / checkpoint -> live model chunks (``load_model``)
    live_export.py        live model -> HF pairs, by fused group for refit (``export_hf_groups``)
    safetensors_io.py     lazy safetensors reads, sharded writes, side files
    _megatron_compat.py   every private DCP / Megatron-Core API, behind version checks

Public API:
    hf_to_megatron(hf_dir, out_dir, tp=1, pp=1, *, dtype=None,    HF folder -> torch_dist checkpoint
                   format="dgpo", overwrite=False)                ("bridge": Bridge's container)
    megatron_to_hf(ckpt_dir, out_dir, dtype=None, *,              torch_dist checkpoint (ours or
                   overwrite=False)                               Bridge's) -> HF folder
    load_model(path, *, dtype=torch.float32, **overrides)         GPTModel chunks from any of them
    find_model_checkpoint(path)                                   the model checkpoint at path or None
    export_hf_weights(model_chunks, *, consumer="all")            live model -> (hf_name, tensor)
    export_hf_groups(model_chunks, *, consumer="all")             the same pairs, a list per fused group
    export_from_checkpoint(ckpt_dir)                              checkpoint -> (hf_name, tensor)
    write_hf_checkpoint(pairs, out_dir, *, dtype=None)            pairs -> sharded safetensors
    write_metadata(ckpt_dir, hf_config, padded_vocab_size, dtype)  make a training checkpoint
                                                                  readable by the above
"""

from megatron_dgpo.convert.checkpoint_format import (find_model_checkpoint,
                                                     model_sharded_state_dict, read_metadata,
                                                     write_metadata)
from megatron_dgpo.convert.live_export import export_hf_groups, export_hf_weights
from megatron_dgpo.convert.live_load import load_hf_into, load_model
from megatron_dgpo.convert.reading import export_from_checkpoint, megatron_to_hf
from megatron_dgpo.convert.safetensors_io import (LazyHFReader, ShardedSafetensorsWriter,
                                                  copy_side_files, write_hf_checkpoint)
from megatron_dgpo.convert.writing import hf_to_megatron, single_process_group
from megatron_dgpo.models import FAMILIES, family_for, supported_architectures

__all__ = ["FAMILIES", "family_for", "supported_architectures", "export_from_checkpoint",
           "export_hf_groups", "export_hf_weights", "find_model_checkpoint", "hf_to_megatron",
           "load_hf_into", "load_model", "megatron_to_hf", "model_sharded_state_dict",
           "read_metadata", "single_process_group", "write_metadata", "LazyHFReader",
           "ShardedSafetensorsWriter", "copy_side_files", "write_hf_checkpoint"]
