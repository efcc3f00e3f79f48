"""The GPU path's Megatron settings (megatron_dgpo.runtime.gpu_flags), decided for a GPU layout and
checked on CPU: each flag is on exactly when its requirement holds, Megatron-Core accepts the
combination, and the CPU path keeps every one of them off."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from megatron_dgpo.models.builder import transformer_config_from_hf, transformer_kwargs
from megatron_dgpo.runtime.gpu_flags import (CPU, GPU, Platform, ddp_flags, pad_multiple,
                                             sequence_parallel, transformer_flags)
from tests._rank_fns_model import TINY_QWEN2

GPU_FLAGS = ("sequence_parallel", "apply_rope_fusion", "gradient_accumulation_fusion",
             "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
             "persist_layer_norm")


def test_this_machine_is_the_cpu_platform():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: benchmarks/gpu_check.py covers it")
    assert Platform.detect() == CPU
    with pytest.raises(ValueError, match="need cuda"):
        Platform(cuda=False, transformer_engine=True)


def test_cpu_path_keeps_every_gpu_choice_off():
    for tp in (1, 2, 4):
        kwargs = transformer_kwargs(TINY_QWEN2, platform=CPU, tensor_model_parallel_size=tp)
        assert not any(kwargs[name] for name in GPU_FLAGS)
        assert kwargs["use_cpu_initialization"] is True
    config, _ = transformer_config_from_hf(TINY_QWEN2, platform=CPU, tensor_model_parallel_size=2)
    assert not config.sequence_parallel and not config.apply_rope_fusion
    assert ddp_flags(CPU, use_distributed_optimizer=False) == dict(
        grad_reduce_in_fp32=True, use_distributed_optimizer=False, overlap_grad_reduce=False,
        overlap_param_gather=False)


def test_gpu_layout_gets_megatron_users_flags():
    """TP 4 on a GPU node with TE and apex: sequence parallel, fused RoPE, fused weight-gradient
    accumulation, the bias/softmax fusions, GPU initialisation (never the persistent LayerNorm
    kernel: every family is RMSNorm, which neither spec builds with it)."""
    kwargs = transformer_kwargs(TINY_QWEN2, platform=GPU, tensor_model_parallel_size=4)
    assert all(kwargs[name] for name in GPU_FLAGS if name != "persist_layer_norm")
    assert kwargs["persist_layer_norm"] is False
    assert kwargs["use_cpu_initialization"] is False
    assert kwargs["calculate_per_token_loss"] and kwargs["variable_seq_lengths"]
    # TP 1: nothing to split the sequence over (Megatron refuses SP without TP)
    assert transformer_kwargs(TINY_QWEN2, platform=GPU)["sequence_parallel"] is False
    assert sequence_parallel(1, GPU) is False and sequence_parallel(2, GPU) is True
    # each extension decides its own flag
    no_te = Platform(cuda=True, transformer_engine=False, apex_gradient_fusion=True)
    no_apex = Platform(cuda=True, transformer_engine=True, apex_gradient_fusion=False)
    assert transformer_flags(no_te, 4)["apply_rope_fusion"] is False
    assert transformer_flags(no_te, 4)["gradient_accumulation_fusion"] is True
    assert transformer_flags(no_apex, 4)["gradient_accumulation_fusion"] is False
    assert transformer_flags(no_apex, 4)["apply_rope_fusion"] is True
    # Megatron's softmax kernels decide the fused masked softmax; TE's spec decides SP
    assert transformer_flags(replace(GPU, softmax_kernels=False), 4)["masked_softmax_fusion"] is False
    assert transformer_flags(no_te, 4)["sequence_parallel"] is False and sequence_parallel(4, no_te) is False
    # explicit overrides still win
    assert transformer_kwargs(TINY_QWEN2, platform=GPU, tensor_model_parallel_size=4,
                              sequence_parallel=False)["sequence_parallel"] is False


def test_a_gpu_node_with_only_torch_and_megatron_core_builds_the_local_spec():
    """The first GPU run (issue 29): a GPU node without TE, apex or Megatron's compiled kernels
    (``model.without_transformer_engine``). The flags were on with CUDA alone, and Megatron's
    local spec refused them: its torch norms assert ``persist_layer_norm`` and
    ``sequence_parallel`` off at build, and the fused masked softmax imports
    ``scaled_masked_softmax_cuda`` at the first forward. Built here on CPU with exactly those
    flags (the device aside): the norms accept them, the attention takes torch's softmax."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    bare = Platform(cuda=True)
    for tp in (1, 4):
        flags = transformer_flags(bare, tp)
        assert not (flags["persist_layer_norm"] or flags["sequence_parallel"]
                    or flags["masked_softmax_fusion"])
        config, _ = transformer_config_from_hf(TINY_QWEN2, platform=bare,
                                               tensor_model_parallel_size=tp,
                                               use_cpu_initialization=True)
        WrappedTorchNorm(config, hidden_size=config.hidden_size)  # asserted before the fix
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType

    softmax = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True,
                                    attn_mask_type=AttnMaskType.causal,
                                    scaled_masked_softmax_fusion=config.masked_softmax_fusion,
                                    mask_func=lambda scores, mask: scores.masked_fill(mask, -1e4),
                                    softmax_in_fp32=True, scale=None)
    # the shape the fused kernel takes (sk <= 4096, multiple of 4): only the flag keeps it away
    assert not softmax.is_kernel_available(None, 2, 4, 128, 128)


def test_megatron_accepts_the_gpu_config_and_enforces_the_requirements():
    """Megatron-Core's own checks on the GPU layout's config: it accepts sequence parallel with
    TP 4 and gradient-accumulation fusion (the extension is checked when the output layer is
    built), refuses RoPE fusion without TE's kernels (why that flag follows TE) and sequence
    parallelism without TP (why it follows TP > 1)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import TransformerConfig

    kwargs = transformer_kwargs(TINY_QWEN2, platform=GPU, tensor_model_parallel_size=4,
                                params_dtype=torch.bfloat16)
    have_te_rope = rope_utils.fused_apply_rotary_pos_emb_thd is not None
    if not have_te_rope:
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
            TransformerConfig(**kwargs)
    config = TransformerConfig(**{**kwargs, "apply_rope_fusion": have_te_rope})
    assert config.sequence_parallel and config.gradient_accumulation_fusion and config.bf16
    with pytest.raises(ValueError, match="sequence parallelism without tensor parallelism"):
        TransformerConfig(**{**kwargs, "apply_rope_fusion": have_te_rope,
                             "tensor_model_parallel_size": 1})


def test_ddp_overlap_follows_cuda_and_the_distributed_optimizer():
    from megatron.core.distributed import DistributedDataParallelConfig

    with_dist_opt = ddp_flags(GPU, use_distributed_optimizer=True)
    assert with_dist_opt["overlap_grad_reduce"] and with_dist_opt["overlap_param_gather"]
    # Megatron gathers parameters only with the distributed optimizer
    plain = ddp_flags(GPU, use_distributed_optimizer=False)
    assert plain["overlap_grad_reduce"] and not plain["overlap_param_gather"]
    for flags in (with_dist_opt, plain):
        assert flags["grad_reduce_in_fp32"]
        DistributedDataParallelConfig(**flags)  # Megatron accepts the combination


def test_packed_samples_are_padded_to_tp_multiples():
    """Sequence parallel splits the packed row over TP; context parallel splits every THD
    sequence into 2 CP chunks, each again over TP."""
    assert [pad_multiple(tp) for tp in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert pad_multiple(4, cp=2) == 16 and pad_multiple(1, cp=2) == 4


def test_a_gpu_run_without_transformer_engine_or_in_fp32_with_it_stops_at_start(monkeypatch, tmp_path):
    from megatron_dgpo.recipe import ModelConfig
    from megatron_dgpo.runtime.gpu_flags import require_gpu_stack
    from megatron_dgpo.training import policy

    broken = Platform(cuda=True, transformer_engine_error="import transformer_engine.pytorch failed: "
                      "OSError: libcudnn.so.9 missing")
    with pytest.raises(RuntimeError, match="(?s)Transformer-Engine is required.*libcudnn.so.9.*"
                                           "docs/install.md.*model.without_transformer_engine"):
        require_gpu_stack(broken, dtype=torch.bfloat16)
    require_gpu_stack(broken, dtype=torch.float32, without_transformer_engine=True)  # opted out
    with pytest.raises(ValueError, match="model.dtype: float32 .*THD"):
        require_gpu_stack(GPU, dtype=torch.float32)
    require_gpu_stack(GPU, dtype=torch.bfloat16)
    require_gpu_stack(CPU, dtype=torch.float32)  # the CPU path: local spec, fp32
    # the trainer's policy asks before reading a single weight
    monkeypatch.setattr(Platform, "detect", classmethod(lambda cls: broken))
    with pytest.raises(RuntimeError, match="Transformer-Engine is required"):
        policy.build_policy(ModelConfig(path=str(tmp_path / "absent"), dtype="bfloat16"), tmp_path / "absent",
                            use_distributed_optimizer=False)


def test_detect_reads_the_pytorch_extension_and_keeps_why_it_failed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    platform = Platform.detect()  # no TE and no apex on this machine
    assert platform.cuda and not platform.transformer_engine and not platform.apex_gradient_fusion
    assert platform.transformer_engine_error == "transformer_engine is not installed"
    assert platform == Platform(cuda=True)  # the reason does not change what the platform is


def test_cuda_device_max_connections_is_set_for_tensor_parallel_and_a_users_value_kept(monkeypatch):
    from megatron_dgpo.runtime.gpu_flags import cuda_launch_env
    from megatron_dgpo.runtime.parallel import _set_cuda_launch_env

    assert cuda_launch_env(1) == {}
    assert cuda_launch_env(2) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    _set_cuda_launch_env(1)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    _set_cuda_launch_env(4)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # e.g. TE's TP-overlap userbuffers
    _set_cuda_launch_env(4)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
