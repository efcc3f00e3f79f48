"""Megatron-Core ``GPTModel`` from a Hugging Face config: Qwen2 (DeepSeek-R1-Distill-Qwen) and Llama.

Architecture mapping (HF field -> Megatron ``TransformerConfig`` / ``GPTModel`` argument):

    num_hidden_layers -> num_layers           hidden_size -> hidden_size
    num_attention_heads -> num_attention_heads num_key_value_heads -> num_query_groups (GQA)
    head_dim (or hidden/heads) -> kv_channels  intermediate_size -> ffn_hidden_size
    rms_norm_eps -> layernorm_epsilon (normalization="RMSNorm")
    hidden_act "silu" -> gated_linear_unit=True, activation_func=F.silu (SwiGLU)
    Qwen2: QKV bias, no other bias; Llama: attention_bias -> add_qkv_bias, mlp_bias must be False
    rope theta (``rope_theta`` or ``rope_parameters["rope_theta"]``) -> rotary_base
    rope scaling: none/"default", or Llama-3 ("llama3") with Megatron's fixed constants
        (low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192);
        anything else is refused
    tie_word_embeddings -> share_embeddings_and_output_weights
    vocab_size -> padded_vocab_size(vocab_size, TP) (rows past vocab_size are padding)

The model is built with ``parallel_output=True``: the last pipeline stage returns logits
[B, S, V_padded / TP], this rank's contiguous vocab shard. Padded columns (global index >=
``hf vocab_size``) are not part of the distribution: pass ``vocab_size`` to
``vocab_parallel.logprobs_and_entropy`` to exclude them.

Layer spec: Transformer-Engine (``get_gpt_layer_with_transformer_engine_spec``) when TE is
importable and CUDA is available, else Megatron's local spec (``get_gpt_layer_local_spec``,
RMSNorm). Parameter names differ between the two only in the fused norms: local
``decoder.layers.{i}.input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` are TE's
``self_attention.linear_qkv.layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight``.
``decoder.layers.{i}`` numbers layers locally per (virtual) pipeline stage; the global index is
``layer.layer_number - 1``. With tied embeddings and PP > 1 the last stage holds
``output_layer.weight`` as a copy of ``embedding.word_embeddings.weight`` (Megatron keeps them
in sync by summing their gradients over the embedding group).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_ARCHITECTURES = {
    "qwen2": ("Qwen2ForCausalLM",),
    "llama": ("LlamaForCausalLM",),
}
_VOCAB_DIVISOR = 128  # Megatron's default --make-vocab-size-divisible-by


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = _VOCAB_DIVISOR) -> int:
    """Smallest multiple of ``divisible_by * tp`` that is >= ``vocab_size`` (Megatron's rule)."""
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"vocab_size, tp and divisible_by must be positive, got "
                         f"{vocab_size}, {tp}, {divisible_by}")
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def hf_config_dict(hf_config: Any) -> dict:
    """A plain dict from a transformers ``PretrainedConfig``, a dict, a config.json or its folder."""
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.fspath(hf_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"hf_config must be a PretrainedConfig, a dict or a path to config.json, got "
                    f"{type(hf_config).__name__}")


@dataclass(frozen=True)
class ModelSpec:
    """What the HF config says that ``TransformerConfig`` does not carry."""

    family: str
    """"qwen2" or "llama"."""
    vocab_size: int
    """The HF vocabulary size: logits columns >= this are TP padding."""
    max_position_embeddings: int
    rotary_base: float
    rope_scaling: bool
    rope_scaling_factor: float
    tie_word_embeddings: bool


def _family(cfg: dict) -> str:
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    for family, names in SUPPORTED_ARCHITECTURES.items():
        if any(a in names for a in archs):
            return family
    supported = ", ".join(f"{k} ({', '.join(v)})" for k, v in SUPPORTED_ARCHITECTURES.items())
    raise ValueError(f"unsupported architecture: model_type={model_type!r}, architectures="
                     f"{archs!r}; supported model_type (architectures): {supported}")


def _rope(cfg: dict) -> tuple[float, bool, float]:
    """(theta, llama3 scaling on/off, factor) from legacy or transformers>=5 rope fields."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or scaling.get("rope_type") \
        or scaling.get("type") or "default"
    fields = {**scaling, **params}
    if rope_type == "default":
        return float(theta), False, 1.0
    if rope_type == "llama3":
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
        for key, value in fixed.items():
            if key in fields and float(fields[key]) != value:
                raise ValueError(f"rope_scaling.{key}={fields[key]!r} is not supported: "
                                 f"Megatron-Core's llama3 RoPE scaling fixes it to {value}")
        return float(theta), True, float(fields.get("factor", 8.0))
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}: supported are 'default' "
                     f"(none) and 'llama3'")


def _require(cfg: dict, key: str):
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"HF config lacks the field {key!r}")
    return cfg[key]


def transformer_config_from_hf(hf_config: Any, **overrides):
    """``(TransformerConfig, ModelSpec)`` for a Qwen2 or Llama HF config.

    Defaults chosen for RL training: no dropout, ``calculate_per_token_loss=True`` (the train
    step's normalisation relies on it), ``variable_seq_lengths=True`` (micro-batches of unequal
    lengths under PP), ``use_cpu_initialization`` and fusions off without a GPU. ``overrides``
    are ``TransformerConfig`` fields (e.g. ``tensor_model_parallel_size``, ``params_dtype``,
    ``bf16``, ``pipeline_dtype``, ``recompute_granularity``) and win over everything.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    cfg = hf_config_dict(hf_config)
    family = _family(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (silu only)")
    if cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported")
    if family == "llama" and cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    head_dim = cfg.get("head_dim") or hidden // heads
    qkv_bias = True if family == "qwen2" else bool(cfg.get("attention_bias", False))
    theta, rope_scaling, rope_factor = _rope(cfg)
    gpu = torch.cuda.is_available()

    tp = overrides.get("tensor_model_parallel_size")
    pp = overrides.get("pipeline_model_parallel_size")
    vpp = overrides.get("virtual_pipeline_model_parallel_size")
    if parallel_state.model_parallel_is_initialized():
        tp = tp or parallel_state.get_tensor_model_parallel_world_size()
        pp = pp or parallel_state.get_pipeline_model_parallel_world_size()
        vpp = vpp or parallel_state.get_virtual_pipeline_model_parallel_world_size()

    dtype = overrides.get("params_dtype", torch.float32)
    kwargs = dict(
        num_layers=int(_require(cfg, "num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        kv_channels=int(head_dim),
        ffn_hidden_size=int(_require(cfg, "intermediate_size")),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        tensor_model_parallel_size=tp or 1,
        pipeline_model_parallel_size=pp or 1,
        virtual_pipeline_model_parallel_size=vpp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # 0.16 needs it for variable_seq_lengths
        use_cpu_initialization=not gpu,
        bias_activation_fusion=gpu,
        bias_dropout_fusion=gpu,
        masked_softmax_fusion=gpu,
        persist_layer_norm=gpu,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        attention_softmax_in_fp32=True,
    )
    kwargs.update(overrides)
    spec = ModelSpec(
        family=family,
        vocab_size=int(_require(cfg, "vocab_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rotary_base=theta,
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_factor,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    return TransformerConfig(**kwargs), spec


def unwrap_model(model):
    """The ``GPTModel`` inside Megatron's wrappers (``DistributedDataParallel``,
    ``Float16Module``): every wrapper keeps what it wraps in ``.module``; GPTModel has none."""
    while hasattr(model, "module"):
        model = model.module
    return model


def use_transformer_engine() -> bool:
    """True when Transformer-Engine is importable and a GPU is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(config=None):
    """TE layer spec with TE and CUDA, Megatron's local RMSNorm spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def build_model(hf_config: Any, *, dtype: torch.dtype = torch.float32, seed: int | None = None,
                **overrides) -> list:
    """This rank's model chunks: ``list[GPTModel]``, one per virtual pipeline stage (one w/o VPP).

    Needs Megatron's parallel state initialised (``megatron_dgpo.parallel.initialize_parallel``);
    TP/PP/VPP sizes are read from it. Each chunk gets ``pre_process`` / ``post_process`` for its
    (virtual) stage, ``vp_stage`` under VPP, ``parallel_output=True`` and the vocabulary padded
    with ``padded_vocab_size(vocab_size, TP)``. Weights are freshly initialised (use the
    converters to load a checkpoint); ``seed`` re-seeds the model-parallel RNG first so every
    TP/PP layout of the same seed starts from ``torch.manual_seed(seed)``.

    Returns chunks on the current CUDA device (GPU) or the CPU; ``chunk.hf_spec`` holds the
    ``ModelSpec`` (HF vocab size, RoPE, tying) and ``chunk.config`` the ``TransformerConfig``.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_dgpo.cpu import apply_cpu_compat, seed_model_parallel_rng

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised: call "
                           "megatron_dgpo.parallel.initialize_parallel first")
    apply_cpu_compat()
    if seed is not None:
        seed_model_parallel_rng(seed)
    overrides.setdefault("params_dtype", dtype)
    config, spec = transformer_config_from_hf(hf_config, **overrides)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config),
            vocab_size=padded_vocab_size(spec.vocab_size, tp),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=spec.rotary_base,
            rope_scaling=spec.rope_scaling,
            rope_scaling_factor=spec.rope_scaling_factor,
            vp_stage=stage,
        )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        model.hf_spec = spec
        chunks.append(model)
    return chunks


def load_model(path, **kwargs) -> list:
    """Build the model on the current parallel state and load an HF directory or a converted
    (torch_dist) checkpoint into it, resharding to the current TP/PP/VPP; see
    ``megatron_dgpo.convert.loading.load_model`` for the arguments."""
    from megatron_dgpo.convert.loading import load_model as _load  # convert imports this module

    return _load(path, **kwargs)


# ------------------------------------------------------------------ the policy of a training job

def wrap_ddp(models: list, *, grad_reduce_in_fp32: bool = True, overlap_grad_reduce: bool = False,
             use_distributed_optimizer: bool = False, bucket_size: int | None = None) -> list:
    """Wrap model chunks in Megatron's ``DistributedDataParallel`` (gradients in ``main_grad``).

    Chunks after the first skip bucketing, as Megatron's training loop does for VPP.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer, bucket_size=bucket_size)
    return [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m,
                                    disable_bucketing=i > 0) for i, m in enumerate(models)]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype of a recipe's dtype name (``model.dtype``, ``checkpoint.export_dtype``)."""
    return _DTYPES[name]


def initial_model(config, run_dir, seed: int):
    """Collective: the HF folder (``Path``) of the initial policy of ``config`` (a recipe's
    ``ModelConfig``). ``model.tiny`` creates one once under ``<run_dir>/initial_model`` (kept for
    resuming); a hub id is downloaded on rank 0; a folder is used as it is."""
    import torch.distributed as dist
    from pathlib import Path

    target = _materialise_model(config, Path(run_dir), seed) if dist.get_rank() == 0 else None
    box = [str(target) if target else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _materialise_model(config, run_dir, seed: int):
    import shutil
    from pathlib import Path

    if config.tiny is not None:
        from megatron_dgpo.tiny import make_tiny_model

        target = run_dir / "initial_model"
        if not (target / "config.json").is_file():
            staging = run_dir / ".initial_model.incomplete"
            shutil.rmtree(staging, ignore_errors=True)
            make_tiny_model(staging, **{"seed": seed, **config.tiny})
            os.replace(staging, target)
        return target
    if Path(config.path).is_dir():
        if not (Path(config.path) / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {config.path} has no config.json")
        return Path(config.path)
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"model.path: {config.path} is not a folder and HF_HUB_OFFLINE=1")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(config.path, allow_patterns=["*.json", "*.safetensors",
                                                                "*.model", "*.txt", "*.jinja"]))


def build_policy(config, hf_dir, *, use_distributed_optimizer: bool):
    """Collective: ``(models, hf_config, dtype)``: this rank's DDP-wrapped chunks of the policy
    loaded from ``hf_dir`` as ``config`` (a recipe's ``ModelConfig``) says, the HF config and
    the parameter dtype. bf16 models get Megatron's Float16Module (fp32 logits out)."""
    from megatron_dgpo.convert.safetensors_io import read_hf_config

    dtype = dtype_named(config.dtype)
    overrides = {"bf16": True} if dtype == torch.bfloat16 else {}
    if config.recompute_activations:
        overrides.update(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    chunks = load_model(str(hf_dir), dtype=dtype, **overrides)
    if dtype == torch.bfloat16:
        from megatron.core.transformer.module import Float16Module

        wrapped = []
        for chunk in chunks:
            wrapper = Float16Module(chunk.config, chunk)
            wrapper.hf_spec = chunk.hf_spec
            wrapped.append(wrapper)
        chunks = wrapped
    models = wrap_ddp(chunks, use_distributed_optimizer=use_distributed_optimizer)
    return models, read_hf_config(str(hf_dir)), dtype


def count_parameters(hf_dir) -> float:
    """Parameters of the HF checkpoint in ``hf_dir`` (for ``optimizer.lr: auto`` without
    ``model.nominal_params``), read from the safetensors headers."""
    from megatron_dgpo.convert.safetensors_io import LazyHFReader

    reader = LazyHFReader(str(hf_dir))
    return float(sum(math.prod(reader.shape_dtype(name)[0]) for name in reader.names()))


def padded_vocab_of(models: list) -> int:
    """The (TP-padded) vocabulary size the live model was built with."""
    return int(unwrap_model(models[0]).vocab_size)
