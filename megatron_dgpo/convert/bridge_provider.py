"""Megatron-Bridge's ``GPTModelProvider`` (``run_config.yaml``'s ``model`` section) and the HF
config, both ways: ``hf_config_from_provider`` reads one, ``provider_fields`` writes one.

Every field is judged against an allow-list of Megatron-Bridge 0.6.2's provider fields: read
into the HF config (``_READ``), required at the value this project's builder makes
(``_REQUIRED``), or without effect on what the weights compute (``_NO_EFFECT``: how Bridge ran,
and settings of features a required field keeps off). Any other field, or value, is refused by
name: a field this code has not judged may change the model (docs/checkpoints.md).
"""

from __future__ import annotations

import math

import torch

from megatron_dgpo.convert.guards import described
from megatron_dgpo.models import describe, family_for, hf_config_dict
from megatron_dgpo.runtime.errors import InputError

PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
_ACTIVATION = "torch.nn.functional.silu"
_SPECS = tuple(f"megatron.bridge.models.gpt_provider.{name}" for name in (
    "default_layer_spec", "transformer_engine_layer_spec", "transformer_engine_full_layer_spec",
    "local_layer_spec"))

_READ = frozenset("""
    num_layers hidden_size ffn_hidden_size num_attention_heads num_query_groups kv_channels
    vocab_size seq_length layernorm_epsilon init_method_std attention_dropout
    share_embeddings_and_output_weights add_qkv_bias qk_layernorm activation_func rotary_base
    rope_scaling rope_scaling_factor params_dtype bf16 fp16 num_moe_experts moe_ffn_hidden_size
    moe_router_topk moe_router_pre_softmax moe_aux_loss_coeff hf_model_id hf_model_revision
""".split())
"""Fields ``hf_config_from_provider`` turns into the HF config (and where the original is)."""

# field -> (the values the builder's model allows, the first being its own; what that means)
_REQUIRED = {
    "_target_": ((PROVIDER,), "the GPT models of Bridge's GPTModelProvider"),
    "transformer_layer_spec": (_SPECS, "Bridge's GPT layer specs (TE or local: the same math)"),
    "normalization": (("RMSNorm",), "RMSNorm layer norms"),
    "layernorm_zero_centered_gamma": ((False,), "plain norm weights"),
    "apply_residual_connection_post_layernorm": ((False,), "pre-norm residuals"),
    "gated_linear_unit": ((True,), "a SwiGLU MLP"),
    "glu_linear_offset": ((0.0,), "a SwiGLU without offset"),
    "activation_func_clamp_value": ((None,), "an unclamped activation"),
    "add_bias_linear": ((False,), "no linear-layer biases besides Q/K/V"),
    "position_embedding_type": (("rope",), "RoPE"),
    "rotary_percent": ((1.0,), "RoPE over the whole head"),
    "rotary_interleaved": ((False,), "RoPE over halves, not interleaved pairs"),
    "rotary_scaling_factor": ((None,), "no RoPE scaling but Llama-3's"),
    "seq_len_interpolation_factor": ((None,), "no linear RoPE interpolation"),
    "no_rope_freq": ((None,), "RoPE in every layer"),
    "mrope_section": ((None,), "one-dimensional RoPE"),
    "softmax_scale": ((None,), "attention scaled by 1/sqrt(head_dim)"),
    "softmax_type": (("vanilla",), "a plain softmax"),
    "multi_latent_attention": ((False,), "standard attention, not MLA"),
    "experimental_attention_variant": ((None,), "standard attention"),
    "linear_attention_freq": ((None,), "no linear-attention layers"),
    "window_size": ((None,), "full attention, no sliding window"),
    "attention_output_gate": ((False,), "no attention output gate"),
    "qk_l2_norm": ((False,), "no L2 q/k norm"),
    "is_hybrid_model": ((False,), "a transformer, no Mamba layers"),
    "heterogeneous_block_specs": ((False,), "identical layers"),
    "hetereogenous_dist_checkpoint": ((False,), "identical layers"),
    "mtp_num_layers": ((None,), "no multi-token prediction layers"),
    "mtp_enabled": ((False,), "no multi-token prediction layers"),
    "use_mup": ((False,), "standard parametrisation, not muP"),
    "mup_embedding_mult": ((1.0,), "unscaled embeddings"),
    "mup_output_mult": ((1.0,), "unscaled logits"),
    "fp8_param": ((False,), "parameters stored in full precision"),
    "fp4_param": ((False,), "parameters stored in full precision"),
    "restore_modelopt_state": ((False,), "no ModelOpt quantisation, sparsity or pruning"),
    "moe_layer_freq": ((1,), "every layer an MoE layer"),
    "moe_shared_expert_intermediate_size": ((None,), "no shared expert"),
    "moe_latent_size": ((None,), "no MoE latent projections"),
    "moe_mlp_glu_interleave_size": ((None,), "gate and up halves, not interleaved blocks"),
    "moe_single_grouped_weight": ((False,), "one weight per expert"),
    "moe_single_grouped_bias": ((False,), "no expert biases"),
    "moe_apply_probs_on_input": ((False,), "expert weights applied to the expert outputs"),
    "moe_router_score_function": (("softmax",), "a softmax router"),
    "moe_router_load_balancing_type": (("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
                                       "top-k routing (balancing losses train only)"),
    "moe_router_topk_scaling_factor": ((None,), "unscaled expert weights"),
    "moe_router_enable_expert_bias": ((False,), "no expert bias"),
    "moe_router_num_groups": ((None,), "no grouped routing"),
    "moe_router_topk_limited_devices": ((None,), "no device-limited routing"),
    "moe_router_force_load_balancing": ((False,), "routing by the router's logits"),
    "moe_router_force_biased": ((None,), "routing by the router's logits"),
    "moe_expert_capacity_factor": ((None,), "no dropped tokens"),
    "moe_expert_rank_capacity_factor": ((None,), "no dropped tokens"),
    "moe_token_dropping": ((False,), "no dropped tokens"),
    **{name: ((None,), "no YaRN RoPE") for name in (
        "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
        "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
        "yarn_correction_range_round_to_int")},
}
_BRIDGE_DEFAULTS = {"normalization": "LayerNorm", "gated_linear_unit": False,
                    "add_bias_linear": True, "position_embedding_type": "learned_absolute"}
"""Bridge's defaults that differ from the builder: what a field left out of the file means."""

_NO_EFFECT = frozenset("""
    tensor_model_parallel_size tensor_parallel_num_weight_shards gtp_weight_remat_size
    pipeline_model_parallel_size pipeline_model_parallel_comm_backend
    pipeline_model_parallel_layout virtual_pipeline_model_parallel_size
    num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage
    account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
    microbatch_group_size_per_vp_stage sequence_parallel context_parallel_size
    hierarchical_context_parallel_sizes hybrid_context_parallel max_seqlen_per_dp_cp_rank
    cp_comm_type expert_model_parallel_size expert_tensor_parallel_size
    expert_tensor_parallel_num_weight_shards expert_gtp_weight_remat_size mtp_standalone
    pipeline_dtype variable_seq_lengths parallel_output scatter_embedding_sequence_parallel
    clone_scatter_output_in_embedding deallocate_pipeline_outputs batch_p2p_comm batch_p2p_sync
    use_ring_exchange_p2p overlap_p2p_comm overlap_p2p_comm_warmup_flush
    defer_embedding_wgrad_compute wgrad_deferral_limit delay_wgrad_compute
    overlap_dispatch_backward_with_experts_wgrad overlap_moe_expert_parallel_comm
    ep_overlap_early_attn_memory_release high_priority_a2a_comm_stream tp_comm_overlap
    tp_comm_overlap_cfg tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag
    tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_atomic_ag
    tp_comm_split_rs tp_comm_atomic_rs tp_comm_overlap_disable_qkv tp_comm_overlap_disable_fc1
    tp_comm_bootstrap_backend symmetric_ar_type moe_token_dispatcher_type moe_enable_deepep
    moe_flex_dispatcher_backend moe_flex_dispatcher_num_sms moe_deepep_num_sms
    moe_hybridep_num_sms moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute
    moe_hybridep_num_sms_preprocessing moe_hybridep_pad_uneven_dispatch_inputs
    moe_permute_fusion_into_hybridep moe_ncclep_static_shape moe_ncclep_zero_copy
    should_pad_vocab make_vocab_size_divisible_by
""".split()) | frozenset("""
    transformer_impl attention_backend flash_attention_version
    use_transformer_engine_full_layer_spec use_transformer_engine_op_fuser
    use_te_activation_func use_kitchen use_kitchen_attention kitchen_attention_backend
    bias_activation_fusion bias_dropout_fusion masked_softmax_fusion persist_layer_norm
    memory_efficient_layer_norm apply_rope_fusion fused_single_qkv_rope fused_residual_rmsnorm
    gradient_accumulation_fusion cross_entropy_loss_fusion cross_entropy_fusion_impl
    fp16_lm_cross_entropy moe_grouped_gemm moe_permute_fusion moe_router_fusion
    dense_grouped_gemm use_grouped_gemm_for_dense_mlp moe_router_padding_for_quantization
    moe_router_padding_for_fp8 disable_parameter_transpose_cache use_arbitrary_attention_mask
    cuda_graph_impl cuda_graph_modules cuda_graph_scope cuda_graph_retain_backward_graph
    cuda_graph_use_single_mempool cuda_graph_warmup_steps enable_cuda_graph external_cuda_graph
    batch_invariant_mode deterministic_mode mlp_chunks_for_training mlp_chunks_for_prefill
""".split()) | frozenset("""
    fp8 fp8_recipe fp8_margin fp8_interval fp8_amax_history_len fp8_amax_compute_algo fp8_wgrad
    fp8_dot_product_attention fp8_multi_head_attention fp8_output_proj fp8_quantizer_factory
    tp_only_amax_red first_last_layers_bf16 num_layers_at_start_in_bf16
    num_layers_at_end_in_bf16 fp4 fp4_recipe fp4_quantizer_factory quant_recipe
    activation_func_fp8_input_store attention_softmax_in_fp32 apply_query_key_layer_scaling
    fp32_residual_connection disable_bf16_reduced_precision_matmul moe_router_dtype
    autocast_dtype enable_autocast
""".split()) | frozenset("""
    recompute_granularity recompute_method recompute_num_layers recompute_modules
    distribute_saved_activations num_microbatches_with_partial_activation_checkpoints
    moe_layer_recompute cpu_offloading cpu_offloading_num_layers cpu_offloading_activations
    cpu_offloading_weights cpu_offloading_double_buffering
    cpu_offloading_retain_pinned_cpu_buffers fine_grained_activation_offloading
    fine_grained_offloading_max_inflight_offloads offload_modules min_offloaded_tensor_size
    delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks
    activation_offload_fraction moe_paged_stash moe_paged_stash_page_size
    moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_buffer_size_factor_cpu
    init_model_with_meta_device use_cpu_initialization perform_initialization
""".split()) | frozenset("""
    init_method output_layer_init_method embedding_init_method embedding_init_method_std
    hidden_dropout calculate_per_token_loss moe_z_loss_coeff moe_input_jitter_eps
    moe_per_layer_logging moe_enable_routing_replay qk_clip qk_clip_alpha qk_clip_threshold
    log_max_attention_logit finalize_model_grads_func grad_scale_func moe_grad_scale_func
    mtp_grad_scale_func no_sync_func grad_sync_func param_sync_func timers barrier_with_L1_time
    config_logger_dir test_mode use_te_rng_tracker inference_rng_tracker flash_decode
    inference_sampling_seed inference_cuda_graph_scope inference_disable_triton_nvls_kernels
    inference_fuse_tp_communication inference_grouped_gemm_backend
    inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type
    use_inference_optimized_layers nccl_all_reduce_for_prefill
    moe_pad_experts_for_cuda_graph_inference
""".split()) | frozenset("""
    dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_topk_freq
    dsa_indexer_skip_topk_offset dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss
    dsa_kernel_backend dsa_indexer_rope_interleaved dsa_indexer_rotate_activation
    dsa_indexer_scoring_relu dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32
    experimental_attention_variant_loss_scale_func linear_conv_kernel_dim linear_key_head_dim
    linear_value_head_dim linear_num_key_heads linear_num_value_heads mamba_state_dim
    mamba_head_dim mamba_num_groups mamba_num_heads mamba_training_ssm_states_dtype
    use_mamba_mem_eff_path mtp_loss_scaling_factor mtp_use_repeated_layer mtp_detach_heads
    mtp_hybrid_override_pattern mup_width_mult mup_base_hidden_size mup_base_head_dim
    mup_attn_scale_power window_attn_skip_freq moe_shared_expert_gate moe_shared_expert_overlap
    use_grouped_gemm_for_shared_expert moe_shared_expert_glu_interleave_size
    moe_pad_expert_input_to_capacity moe_token_drop_policy moe_router_bias_update_rate
    moe_router_quantile_balancing_ema moe_router_group_topk use_fused_weighted_squared_relu
""".split())
"""Fields that leave what the weights compute as it is, any value: the parallel layout and its
communication (the checkpoint reshards), kernels and fusions of the same math, the arithmetic's
precision, recomputation and offloading, training-only settings (initialisation, dropout,
auxiliary losses, hooks), Megatron's own inference engine; then the settings of features a
``_REQUIRED`` field keeps off (DSA, linear attention, Mamba, MTP, muP, sliding windows, shared
experts, capacity, expert bias, grouped routing, squared ReLU)."""


def _target(value):
    return value.get("_target_") if isinstance(value, dict) else value


def _allowed(name: str, value, allowed: tuple, model: dict) -> bool:
    if isinstance(value, list) and name == "moe_router_load_balancing_type":
        return all(_target(v) in allowed for v in value)
    if name == "softmax_scale" and isinstance(value, (int, float)) and model.get("kv_channels"):
        return math.isclose(value, float(model["kv_channels"]) ** -0.5, rel_tol=1e-6)
    return _target(value) in allowed


def judge_provider(model: dict, where: str) -> None:
    """``InputError`` naming the first field of ``model`` (a provider's fields) that is not on
    the allow-list, or whose value the builder's model does not have (a field left out is
    Bridge's default)."""
    for name, (allowed, meaning) in _REQUIRED.items():
        value = model.get(name, _BRIDGE_DEFAULTS.get(name, allowed[0]))
        if not _allowed(name, value, allowed, model):
            raise InputError(f"{where}: model.{name}={value!r} is not supported (this project "
                             f"builds {meaning}: {name}={allowed[0]!r})")
    unknown = sorted(set(model) - _READ - _REQUIRED.keys() - _NO_EFFECT)
    if unknown:
        raise InputError(f"{where}: model.{unknown[0]} is a field this project has not judged "
                         f"(Megatron-Bridge 0.6.2's GPTModelProvider has no such field; "
                         f"{len(unknown)} in all: {unknown[:5]}): it may change what the weights "
                         f"compute. Export the checkpoint with the Bridge that wrote it "
                         f"(AutoBridge ... save_hf_pretrained) and start from that HF folder")


def _dtype_name(model: dict) -> str:
    target = _target(model.get("params_dtype")) or ""
    name = target.rsplit(".", 1)[-1]
    if name in ("float32", "bfloat16", "float16"):
        return name
    return "bfloat16" if model.get("bf16") else "float16" if model.get("fp16") else "float32"


def hf_config_from_provider(model: dict, where: str) -> dict:
    """The HF ``config.json`` dict of a Bridge GPTModelProvider (``run_config.yaml``'s ``model``
    section, ``where``): Qwen3-MoE with routed experts, Qwen3 with q/k norms, Qwen2 with Q/K/V
    biases, Llama otherwise. ``InputError`` naming the field (and ``where``) for a field off the
    allow-list (``judge_provider``), a value the builder cannot reproduce or a missing field."""
    def field(name):
        if model.get(name) is None:
            raise InputError(f"{where}: model.{name} is missing (a Megatron-Bridge "
                             f"GPTModelProvider field)")
        return model[name]

    judge_provider(model, where)
    activation = _target(model.get("activation_func")) or _ACTIVATION
    if activation != _ACTIVATION:
        raise InputError(f"{where}: model.activation_func={activation!r} is not supported (silu "
                         f"only)")
    qk_norm, qkv_bias = bool(model.get("qk_layernorm")), bool(model.get("add_qkv_bias"))
    experts = model.get("num_moe_experts")
    if qk_norm and qkv_bias:
        raise InputError(f"{where}: model.qk_layernorm and model.add_qkv_bias both set: no "
                         f"supported family has both (Qwen3 has q/k norms, Qwen2 Q/K/V biases)")
    if experts and not qk_norm:
        raise InputError(f"{where}: model.num_moe_experts={experts} without model.qk_layernorm: "
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
    described(cfg, where)  # the builder's own refusals, before anything is read
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
