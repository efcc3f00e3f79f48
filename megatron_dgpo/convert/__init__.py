"""HF <-> Megatron-Core checkpoint conversion: declarative per-family name maps, streaming I/O.

Public API:
    hf_to_megatron(hf_dir, out_dir, tp=1, pp=1, *, dtype=None)   HF folder -> torch_dist checkpoint
    megatron_to_hf(ckpt_dir, out_dir, dtype=None)                 torch_dist checkpoint -> HF folder
    load_model(path, *, dtype=torch.float32, **overrides)         GPTModel chunks from either
    export_hf_weights(model_chunks, *, consumer="all")            live model -> (hf_name, tensor)
    export_from_checkpoint(ckpt_dir)                              checkpoint -> (hf_name, tensor)
    write_hf_checkpoint(pairs, out_dir, *, dtype=None)            pairs -> sharded safetensors
    write_metadata(ckpt_dir, hf_config, padded_vocab_size, dtype)  make a training checkpoint
                                                                  readable by the above
"""

from megatron_dgpo.convert.loading import (export_from_checkpoint, export_hf_weights,
                                           hf_to_megatron, load_hf_into, load_model,
                                           megatron_to_hf, model_sharded_state_dict,
                                           read_metadata, single_process_group, write_metadata)
from megatron_dgpo.convert.safetensors_io import (LazyHFReader, ShardedSafetensorsWriter,
                                                  copy_side_files, write_hf_checkpoint)
from megatron_dgpo.models import FAMILIES, family_for, supported_architectures

__all__ = ["FAMILIES", "family_for", "supported_architectures", "export_from_checkpoint",
           "export_hf_weights", "hf_to_megatron", "load_hf_into", "load_model", "megatron_to_hf",
           "model_sharded_state_dict", "read_metadata", "single_process_group", "write_metadata", "LazyHFReader", "ShardedSafetensorsWriter",
           "copy_side_files", "write_hf_checkpoint"]
