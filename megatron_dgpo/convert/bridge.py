"""Megatron-Bridge's Megatron checkpoints (what NeMo-RL, verl and Miles write): found, described
as this project's checkpoints are, and written for Bridge's loader.

A Bridge checkpoint folder (``save_megatron_model`` or Bridge's training loop)::

    <dir>/latest_checkpointed_iteration.txt   the latest iteration (Megatron-LM's tracker)
    <dir>/latest_train_state.pt
    <dir>/iter_0000100/                       one iteration: torch_dist files of the model
        run_config.yaml    Bridge's ConfigContainer; ``model`` is the GPTModelProvider
        train_state.pt
        tokenizer/         the HF tokenizer's files (when saved with one)

Its tensors are this project's (same Megatron-Core keys and layouts, ``checkpoint_format``);
what differs, and how it is settled:

* the container: ``bridge_iteration`` finds the ``iter_*`` folder of an iteration folder or of
  its parent (the tracker's iteration); ``hf_config_from_provider`` reads the HF architecture
  from ``run_config.yaml``'s ``model`` section (a provider this project cannot build is refused
  naming the field), which ``checkpoint_format.find_model_checkpoint`` describes as it does
  ``dgpo_convert.json``;
* the vocabulary: Bridge stores the HF vocabulary unpadded (``should_pad_vocab: false``); this
  project pads to a multiple of 128 x TP with zero rows. Loading takes either (dist_checkpointing
  reads the rows that exist, the padding stays zero); exporting trims to the HF vocabulary;
* an MoE layer's pre-MLP norm: Bridge's local (non-TE) layer spec stores it under TE's fused
  name ``mlp.linear_fc1.layer_norm_weight``, the TE spec and this project as
  ``pre_mlp_layernorm.weight`` (``checkpoint_format.KEY_ALIASES``: whichever is stored is read);
* common state: ``checkpoint_version``, ``iteration``, ``content_metadata``: the model loaders
  keep only the model's keys.

Writing (``dgpo-convert hf-to-megatron --format bridge``): ``iter_0000000`` with Bridge's
common state, ``run_config.yaml`` holding what Bridge's loaders read (``provider_fields``; the
parallel sizes and the ``checkpoint`` flags its training resume checks), both train-state files,
the tracker and ``tokenizer/``; the vocabulary unpadded and the MoE norm under the TE spec's
name, Bridge's default spec.
"""

from __future__ import annotations

import os
import re

import torch

from megatron_dgpo.models import describe, family_for, hf_config_dict

RUN_CONFIG = "run_config.yaml"
TRACKER = "latest_checkpointed_iteration.txt"
TOKENIZER_DIR = "tokenizer"
TRAIN_STATE = "train_state.pt"
FIRST_ITERATION = "iter_0000000"
"""The iteration folder ``save_megatron_model`` writes, and ``dgpo-convert --format bridge``."""
PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
COMMON_STATE = {"checkpoint_version": 3.0, "iteration": 0}
"""What Bridge's saver puts in a checkpoint's common state (its ``generate_state_dict``)."""
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""The sharded-state-dict metadata Bridge records (and passes back to ``sharded_state_dict``)."""
_ITER = re.compile(r"^iter_(\d{7})$")

# run_config.yaml model fields whose other values this project's builder cannot reproduce:
# field -> (the value it needs, what that means)
_REQUIRED = {
    "normalization": ("RMSNorm", "RMSNorm layer norms"),
    "gated_linear_unit": (True, "a SwiGLU MLP"),
    "add_bias_linear": (False, "no linear-layer biases besides Q/K/V"),
    "position_embedding_type": ("rope", "RoPE"),
    "rotary_percent": (1.0, "RoPE over the whole head"),
    "rotary_interleaved": (False, "RoPE over halves, not interleaved pairs"),
    "multi_latent_attention": (False, "standard attention, not MLA"),
    "window_size": (None, "full attention, no sliding window"),
    "softmax_type": ("vanilla", "a plain softmax"),
    "attention_output_gate": (False, "no attention output gate"),
    "apply_residual_connection_post_layernorm": (False, "pre-norm residuals"),
    "layernorm_zero_centered_gamma": (False, "plain norm weights"),
    "qk_l2_norm": (False, "no L2 q/k norm"),
    "mtp_num_layers": (None, "no multi-token prediction layers"),
    "seq_len_interpolation_factor": (None, "no linear RoPE interpolation"),
    "yarn_rotary_scaling_factor": (None, "no YaRN RoPE scaling"),
    "moe_shared_expert_intermediate_size": (None, "no shared expert"),
    "moe_layer_freq": (1, "every layer an MoE layer"),
    "moe_router_score_function": ("softmax", "a softmax router"),
    "moe_router_topk_scaling_factor": (None, "unscaled expert weights"),
    "moe_router_enable_expert_bias": (False, "no expert bias"),
    "moe_router_num_groups": (None, "no grouped routing"),
}
_ACTIVATION = "torch.nn.functional.silu"


def _iteration_dir(folder: str, tracker: str) -> str:
    with open(tracker, encoding="utf-8") as handle:
        text = handle.read().strip()
    if text == "release":
        return os.path.join(folder, "release")
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
    return os.path.join(folder, f"iter_{int(text):07d}")


def bridge_iteration(path: str) -> str | None:
    """The iteration folder of a Megatron-Bridge checkpoint at ``path`` (an ``iter_*`` folder, or
    its parent: the iteration ``latest_checkpointed_iteration.txt`` names), or None when
    ``path`` is no Bridge checkpoint (no ``run_config.yaml``, no tracker, no ``iter_*`` folder).

    Raises ``FileNotFoundError`` naming what is missing for a partial one: a parent without
    the tracker, a tracker naming an absent iteration, an iteration without ``run_config.yaml``.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, RUN_CONFIG)):
        return path
    tracker = os.path.join(path, TRACKER)
    iterations = sorted(n for n in os.listdir(path) if _ITER.match(n) or n == "release")
    if os.path.isfile(tracker):
        folder = _iteration_dir(path, tracker)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"missing folder: {folder} ({tracker} names it; the checkpoint "
                                    f"holds {iterations or 'no iteration folder'})")
    elif iterations:
        raise FileNotFoundError(f"missing file: {tracker} (a Megatron-Bridge checkpoint folder "
                                f"names its latest iteration there; it holds {iterations}: pass "
                                f"one of them instead)")
    elif (_ITER.match(os.path.basename(os.path.normpath(path)))
          and os.path.isfile(os.path.join(path, "metadata.json"))):
        folder = path  # a torch_dist iteration folder without its run_config.yaml
    else:
        return None
    if not os.path.isfile(os.path.join(folder, RUN_CONFIG)):
        raise FileNotFoundError(f"missing file: {os.path.join(folder, RUN_CONFIG)} (Megatron-"
                                f"Bridge's model config; a Megatron-LM checkpoint has none: "
                                f"describe it with megatron_dgpo.convert.write_metadata)")
    return folder


def read_run_config(iteration_dir: str) -> dict:
    """``run_config.yaml`` of an iteration folder as a plain dict (``_target_`` entries kept)."""
    import yaml

    path = os.path.join(iteration_dir, RUN_CONFIG)
    with open(path, encoding="utf-8") as handle:
        config = yaml.safe_load(handle)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError(f"{path}: no 'model' section (Megatron-Bridge writes the model's "
                         f"provider there)")
    return config


def _target(value) -> str | None:
    return value.get("_target_") if isinstance(value, dict) else value


def _dtype_name(model: dict) -> str:
    target = _target(model.get("params_dtype")) or ""
    name = target.rsplit(".", 1)[-1]
    if name in ("float32", "bfloat16", "float16"):
        return name
    return "bfloat16" if model.get("bf16") else "float16" if model.get("fp16") else "float32"


def hf_config_from_provider(model: dict, where: str = RUN_CONFIG) -> dict:
    """The HF ``config.json`` dict of a Bridge GPTModelProvider (``run_config.yaml``'s ``model``
    section): Qwen3-MoE with routed experts, Qwen3 with q/k norms, Qwen2 with Q/K/V biases,
    Llama otherwise. ``ValueError`` naming the field (and ``where``) for anything this project's
    builder cannot reproduce, or a missing field."""
    def field(name):
        if model.get(name) is None:
            raise ValueError(f"{where}: model.{name} is missing (a Megatron-Bridge "
                             f"GPTModelProvider field)")
        return model[name]

    for name, (value, meaning) in _REQUIRED.items():
        if model.get(name, value) != value:
            raise ValueError(f"{where}: model.{name}={model[name]!r} is not supported (this "
                             f"project builds {meaning}: {name}={value!r})")
    activation = _target(model.get("activation_func")) or _ACTIVATION
    if activation != _ACTIVATION:
        raise ValueError(f"{where}: model.activation_func={activation!r} is not supported (silu "
                         f"only)")
    qk_norm, qkv_bias = bool(model.get("qk_layernorm")), bool(model.get("add_qkv_bias"))
    experts = model.get("num_moe_experts")
    if qk_norm and qkv_bias:
        raise ValueError(f"{where}: model.qk_layernorm and model.add_qkv_bias both set: no "
                         f"supported family has both (Qwen3 has q/k norms, Qwen2 Q/K/V biases)")
    if experts and not qk_norm:
        raise ValueError(f"{where}: model.num_moe_experts={experts} without model.qk_layernorm: "
                         f"the supported MoE family, Qwen3-MoE, has q/k norms")
    model_type = ("qwen3_moe" if experts else "qwen3" if qk_norm else "qwen2" if qkv_bias
                  else "llama")
    architecture = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]
    rope = {"rope_type": "default", "rope_theta": float(field("rotary_base"))}
    if model.get("rope_scaling"):
        rope = {"rope_type": "llama3", "rope_theta": rope["rope_theta"],
                "factor": float(model.get("rope_scaling_factor", 8.0)), "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    dtype = _dtype_name(model)
    cfg = {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
           "hidden_size": int(field("hidden_size")), "num_hidden_layers": int(field("num_layers")),
           "intermediate_size": int(field("ffn_hidden_size")),
           "num_attention_heads": int(field("num_attention_heads")),
           "num_key_value_heads": int(model.get("num_query_groups")
                                      or field("num_attention_heads")),
           "head_dim": int(model.get("kv_channels")
                           or int(field("hidden_size")) // int(field("num_attention_heads"))),
           "vocab_size": int(field("vocab_size")),
           "max_position_embeddings": int(field("seq_length")),
           "rms_norm_eps": float(field("layernorm_epsilon")),
           "initializer_range": float(model.get("init_method_std", 0.02)),
           "attention_dropout": float(model.get("attention_dropout", 0.0)),
           "tie_word_embeddings": bool(field("share_embeddings_and_output_weights")),
           "rope_theta": rope["rope_theta"], "rope_parameters": rope, "use_sliding_window": False,
           "dtype": dtype}
    if model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if experts:
        cfg.update(num_experts=int(experts), num_experts_per_tok=int(field("moe_router_topk")),
                   moe_intermediate_size=int(field("moe_ffn_hidden_size")),
                   norm_topk_prob=not bool(model.get("moe_router_pre_softmax", False)),
                   router_aux_loss_coef=float(model.get("moe_aux_loss_coeff") or 0.0),
                   decoder_sparse_step=1, mlp_only_layers=[])
    describe(cfg)  # the builder's own refusals, before anything is read
    return cfg


def provider_fields(hf_config, dtype: torch.dtype, *, hf_model_id: str | None = None) -> dict:
    """``run_config.yaml``'s ``model`` section for an HF config: the GPTModelProvider Bridge's
    own HF import builds for it (architecture, dtype, the fusions Bridge turns on), unpadded
    vocabulary, one rank's layout. Inverse of ``hf_config_from_provider``."""
    cfg = hf_config_dict(hf_config)
    description = describe(cfg)
    dims, rope = description.dims, description.rope
    name = str(dtype).replace("torch.", "")
    fields = {
        "_target_": PROVIDER,
        "num_layers": dims.layers, "hidden_size": dims.hidden, "ffn_hidden_size": dims.ffn,
        "num_attention_heads": dims.heads, "num_query_groups": dims.kv_heads,
        "kv_channels": dims.head_dim, "vocab_size": dims.vocab, "should_pad_vocab": False,
        "seq_length": description.max_position_embeddings,
        "layernorm_epsilon": description.norm_eps, "init_method_std": description.init_std,
        "attention_dropout": description.attention_dropout, "hidden_dropout": 0.0,
        "share_embeddings_and_output_weights": description.tie_word_embeddings,
        "add_qkv_bias": description.qkv_bias, "add_bias_linear": False,
        "qk_layernorm": description.qk_norm, "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": {"_target_": _ACTIVATION, "_call_": False},
        "position_embedding_type": "rope", "rotary_base": rope.theta, "rotary_percent": 1.0,
        "rope_scaling": rope.scaling, "rope_scaling_factor": rope.factor,
        "params_dtype": {"_target_": f"torch.{name}", "_call_": False},
        "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16,
        "autocast_dtype": {"_target_": "torch.bfloat16", "_call_": False},
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "hf_model_id": hf_model_id,
    }
    if dims.moe:
        fields.update(num_moe_experts=dims.experts, moe_ffn_hidden_size=dims.moe_ffn,
                      moe_router_topk=dims.topk,
                      moe_router_pre_softmax=not description.router.norm_topk_prob,
                      moe_aux_loss_coeff=description.router.hf_aux_loss_coef,
                      moe_router_load_balancing_type="aux_loss", moe_grouped_gemm=True,
                      moe_token_dispatcher_type="alltoall", moe_permute_fusion=True)
    if family_for(cfg).name == "llama":
        fields.update(bias_activation_fusion=True, masked_softmax_fusion=True,
                      persist_layer_norm=True, bias_dropout_fusion=True, apply_rope_fusion=True)
    return fields


def write_bridge_files(out_dir: str, iteration_dir: str, hf_config, dtype: torch.dtype, *,
                       hf_dir: str | None = None) -> None:
    """Everything of a Bridge checkpoint folder besides the torch_dist files of
    ``iteration_dir`` (a folder under ``out_dir``): ``run_config.yaml``, both train-state files,
    the tracker and ``tokenizer/`` (the tokenizer and generation-config files of ``hf_dir``).
    Call on one rank."""
    import yaml

    from megatron_dgpo.convert.safetensors_io import SIDE_FILES, copy_side_files

    tokenizer = os.path.join(iteration_dir, TOKENIZER_DIR)
    has_tokenizer = hf_dir is not None and any(
        os.path.isfile(os.path.join(hf_dir, n)) for n in SIDE_FILES if n.startswith("tokenizer"))
    run_config = {
        "model": provider_fields(hf_config, dtype, hf_model_id=hf_dir),
        # what Bridge's training resume reads (_load_checkpoint_from_path)
        "checkpoint": {"ckpt_format": "torch_dist", "save_optim": False, "save_rng": False,
                       "fully_parallel_save": True},
        "tokenizer": None,
    }
    if has_tokenizer:
        # config.json too: AutoTokenizer takes the tokenizer's class from its model_type
        copy_side_files(hf_dir, tokenizer)
        run_config["tokenizer"] = {
            "_target_": "megatron.bridge.training.tokenizers.config.TokenizerConfig",
            "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": os.path.abspath(tokenizer)}
    with open(os.path.join(iteration_dir, RUN_CONFIG), "w", encoding="utf-8") as handle:
        yaml.safe_dump(run_config, handle, sort_keys=False)
    zero = torch.tensor(0)
    train_state = {"step": zero, "consumed_train_samples": zero, "skipped_train_samples": zero,
                   "consumed_valid_samples": zero,
                   "floating_point_operations_so_far": torch.tensor(0.0),
                   "do_train": torch.tensor(False), "do_valid": torch.tensor(False),
                   "do_test": torch.tensor(False)}
    torch.save(train_state, os.path.join(iteration_dir, TRAIN_STATE))
    torch.save(train_state, os.path.join(out_dir, f"latest_{TRAIN_STATE}"))
    iteration = _ITER.match(os.path.basename(iteration_dir))
    with open(os.path.join(out_dir, TRACKER), "w", encoding="utf-8") as handle:
        handle.write(str(int(iteration.group(1))))
