"""An HF checkpoint folder seen as global Megatron-Core tensors, validated against its config.

``HFSource(hf_dir).box(pm, layer, box)`` is ``M[box]`` of the global (TP-unsharded) Megatron
tensor of map ``pm`` (``transforms.megatron_box``), read lazily from the safetensors. Used by
the HF -> Megatron writer and by the HF -> live-model load.
"""

from __future__ import annotations

import os

import torch

from megatron_dgpo.convert.guards import described
from megatron_dgpo.convert.safetensors_io import LazyHFReader, read_hf_config
from megatron_dgpo.convert.transforms import hf_tensors, megatron_box
from megatron_dgpo.models import ParamMap, describe
from megatron_dgpo.models.families import iter_params  # noqa: F401 - re-exported: readers of the map
from megatron_dgpo.models.builder import transformer_config_from_hf
from megatron_dgpo.runtime.errors import InputError


class HFSource:
    """An HF checkpoint folder seen as global Megatron tensors (validated against its config)."""

    def __init__(self, hf_dir: str, padded_vocab: int | None = None, tp: int = 1):
        self.hf_dir = hf_dir
        self.config = read_hf_config(hf_dir)
        self.where = os.path.join(hf_dir, "config.json")
        description = described(self.config, self.where, tp=tp, padded_vocab=padded_vocab)
        self.family, self.dims = description.family, description.dims
        self.reader = LazyHFReader(hf_dir)
        self.params = self.family.active(self.config)
        self._validate()

    def _validate(self) -> None:
        """Refuse unsupported configs, missing or unmapped tensors and shape mismatches before
        anything is written."""
        try:  # the builder's refusals (RoPE scaling, act, ...)
            transformer_config_from_hf(self.config, **conversion_overrides(self.config))
        except ValueError as exc:
            raise InputError(f"{self.where}: {exc}") from exc
        consumed = set()
        for pm, layer in iter_params(self.params, self.dims.layers):
            for name, expected in hf_tensors(pm, layer, self.dims):
                consumed.add(name)
                if name not in self.reader:
                    raise InputError(f"tensor {name!r} is missing from the HF checkpoint "
                                   f"{self.hf_dir}")
                shape, _ = self.reader.shape_dtype(name)
                if tuple(shape) != tuple(expected):
                    raise InputError(f"shape mismatch for tensor {name!r}: the checkpoint has "
                                     f"{tuple(shape)}, config.json implies {tuple(expected)}")
        # Tensors nothing maps would be dropped silently (e.g. mlp biases): refuse them. Tolerated:
        # RoPE caches, and a redundant lm_head.weight in checkpoints with tied embeddings.
        ignorable = ("lm_head.weight",) if self.config.get("tie_word_embeddings") else ()
        unmapped = sorted(n for n in self.reader.names() if n not in consumed
                          and n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
        if unmapped:
            raise InputError(f"the HF checkpoint {self.hf_dir} has {len(unmapped)} tensor(s) the "
                             f"{self.family.name} map does not convert, e.g. {unmapped[:5]}")

    @property
    def dtype(self) -> torch.dtype:
        return self.reader.shape_dtype(self.params[0].hf_names(None)[0])[1]

    def box(self, pm: ParamMap, layer: int | None, box) -> torch.Tensor:
        return megatron_box(pm, layer, box, self.reader.read, self.dims)


def conversion_overrides(hf_config) -> dict:
    """``TransformerConfig`` overrides for a model the converter builds but never runs forward,
    at the TP of Megatron's parallel state (1 when it is not initialised).

    An MoE at TP > 1: sequence parallelism as the platform gives it (on with CUDA), but stated
    explicitly. Without CUDA it is off, and ``builder.moe_kwargs`` refuses that for training (gloo
    has no reduce-scatter, and Megatron refuses an MoE's training forward at TP > 1 without
    SP); building the model and slicing tensors need no SP, and SP changes neither the
    parameters nor their checkpoint layout, so the explicit value skips that refusal."""
    from megatron_dgpo.runtime import parallel
    from megatron_dgpo.runtime.gpu_flags import Platform, sequence_parallel

    tp = parallel.tensor_parallel_size() if parallel.parallel_initialized() else 1
    if tp > 1 and describe(hf_config).dims.moe:
        return {"sequence_parallel": sequence_parallel(tp, Platform.detect())}
    return {}
