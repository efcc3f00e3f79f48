"""The models: one description of every supported decoder family (``families``, ``describe``), read
by the builder, the converter and the planner, and the Megatron-Core builder (``models.builder``,
imported by its own path). The names re-exported here import neither torch nor Megatron-Core, so
the planner stays light. Adding a family is one ``Family`` entry in ``families.py``; how a config
becomes a model: docs/training.md#the-model-an-hf-config-on-megatron-core."""

from megatron_dgpo.models.describe import (VOCAB_DIVISOR, ModelDescription, ModelDims, Rope, Router,
                                           describe, group_hf_tensors, hf_config_dict,
                                           padded_vocab_size)
from megatron_dgpo.models.families import (FAMILIES, Family, LiveParam, ParamMap, family_for,
                                           fused_groups, iter_params, megatron_param_key,
                                           supported_architectures)

__all__ = ["VOCAB_DIVISOR", "ModelDescription", "ModelDims", "Rope", "Router", "describe",
           "group_hf_tensors", "hf_config_dict", "padded_vocab_size", "FAMILIES", "Family",
           "LiveParam", "ParamMap", "family_for", "fused_groups", "iter_params",
           "megatron_param_key", "supported_architectures"]
