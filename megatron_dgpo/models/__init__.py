"""The one model description: family registry, HF config -> dimensions, padded vocabulary.

Everything that depends on *which* decoder family a Hugging Face ``config.json`` describes lives
here, once, and is read by the model builder (``megatron_dgpo.model``), the converter
(``megatron_dgpo.convert``) and the memory planner (``megatron_dgpo.planner``):

    families.py   ``Family``: architectures, quirks (QKV / MLP bias, refused fields, q/k norms,
                  mixture of experts) and the HF <-> Megatron tensor name map; ``FAMILIES``,
                  ``family_for``, ``megatron_param_key`` (live parameter -> map, layer, expert)
    describe.py   ``describe(hf_config) -> ModelDescription`` (family, ``ModelDims`` incl.
                  experts, RoPE, norm eps, tying, MoE ``Router``) and ``padded_vocab_size``
                  (Megatron's vocabulary padding)

Adding a family is one ``Family(...)`` entry in ``families.py``. This package imports neither
torch nor Megatron-Core, so the planner stays light and nothing here can form an import cycle.
"""

from megatron_dgpo.models.describe import (VOCAB_DIVISOR, ModelDescription, ModelDims, Rope,
                                           Router, describe, hf_config_dict, padded_vocab_size)
from megatron_dgpo.models.families import (FAMILIES, Family, LiveParam, ParamMap, family_for,
                                           megatron_param_key, supported_architectures)

__all__ = ["VOCAB_DIVISOR", "ModelDescription", "ModelDims", "Rope", "Router", "describe",
           "hf_config_dict", "padded_vocab_size", "FAMILIES", "Family", "LiveParam", "ParamMap",
           "family_for", "megatron_param_key", "supported_architectures"]
