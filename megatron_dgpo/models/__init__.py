"""The models: one description of every supported decoder family, and the Megatron-Core builder.

Everything that depends on *which* decoder family a Hugging Face ``config.json`` describes lives
here, once, and is read by the model builder (``megatron_dgpo.models.builder``), the converter
(``megatron_dgpo.convert``) and the memory planner (``megatron_dgpo.planner``):

    families.py   ``Family``: architectures, quirks (QKV / MLP bias, refused fields, q/k norms,
                  mixture of experts) and the HF <-> Megatron tensor name map with its fused
                  groups; ``FAMILIES``, ``family_for``, ``megatron_param_key`` (live parameter
                  -> map, layer, expert), ``iter_params`` and ``fused_groups`` (export order)
    describe.py   ``describe(hf_config) -> ModelDescription`` (family, ``ModelDims`` incl.
                  experts, RoPE, norm eps, tying, MoE ``Router``), ``padded_vocab_size``
                  (Megatron's vocabulary padding), ``group_hf_tensors`` (an HF state dict in
                  the export's groups)
    builder.py    Megatron-Core ``GPTModel`` chunks from a described HF config:
                  ``TransformerConfig``, layer spec, DDP wrapping

Adding a family is one ``Family(...)`` entry in ``families.py``. The names re-exported here (the
description) import neither torch nor Megatron-Core, so the planner stays light; the builder is
imported by its own path.
"""

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
