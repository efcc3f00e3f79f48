"""The GPU path's Megatron settings (megatron_dgpo.runtime.gpu_flags), decided for a GPU layout and
checked on CPU: each flag is on exactly when its requirement holds, Megatron-Core accepts the
combination, and the CPU path keeps every one of them off."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from megatron_dgpo.models.builder import transformer_config_from_hf, transformer_kwargs
from megatron_dgpo.runtime.gpu_flags import (CPU, GPU, Platform, ddp_flags,
                                             flash_attention_status, pad_multiple,
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
    """The first GPU run: a GPU node without TE, apex or Megatron's compiled kernels
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


def test_a_gpu_run_without_transformer_engine_stops_at_start(monkeypatch, tmp_path):
    from megatron_dgpo.recipe import ModelConfig
    from megatron_dgpo.runtime.gpu_flags import require_gpu_stack
    from megatron_dgpo.training import policy

    broken = Platform(cuda=True, transformer_engine_error="import transformer_engine.pytorch failed: "
                      "OSError: libcudnn.so.9 missing")
    with pytest.raises(RuntimeError, match="(?s)Transformer-Engine is required.*libcudnn.so.9.*"
                                           "docs/install.md.*model.without_transformer_engine"):
        require_gpu_stack(broken)
    require_gpu_stack(broken, without_transformer_engine=True)  # opted out
    require_gpu_stack(GPU)
    require_gpu_stack(CPU)  # the CPU path: the local spec
    # the trainer's policy asks before reading a single weight
    monkeypatch.setattr(Platform, "detect", classmethod(lambda cls: broken))
    with pytest.raises(RuntimeError, match="Transformer-Engine is required"):
        policy.build_policy(ModelConfig(path=str(tmp_path / "absent"), dtype="bfloat16"), tmp_path / "absent",
                            use_distributed_optimizer=False)

def test_detect_reads_the_pytorch_extension_and_keeps_why_it_failed(monkeypatch):
    """A stand-in A100 (the device queries patched): TE, apex, flash-attn found absent by import
    and by distribution, as on this machine; the generation and cuDNN read from torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    platform = Platform.detect()  # no TE, apex or flash-attn on this machine
    assert platform.cuda and not platform.transformer_engine and not platform.apex_gradient_fusion
    assert platform.transformer_engine_error == "transformer_engine is not installed"
    assert not platform.flash_attention and platform.flash_attention_error == "flash-attn is not installed"
    cudnn = torch.backends.cudnn.version()
    assert platform.cudnn == (cudnn // 10000, cudnn // 100 % 100, cudnn % 100)
    assert platform.gpu == "NVIDIA A100-SXM4-80GB, sm80"
    # the reasons do not change what the platform is
    assert platform == Platform(cuda=True, compute_capability=(8, 0), cudnn=platform.cudnn,
                                device_name="NVIDIA A100-SXM4-80GB")


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
    # context parallelism at TP = 1: Megatron-LM requires it too (before Blackwell), for the
    # K/V ring to overlap attention (on the old code only TP > 1 set it)
    assert cuda_launch_env(1, 2) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    _set_cuda_launch_env(1, 4)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # e.g. TE's TP-overlap userbuffers
    _set_cuda_launch_env(4)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


# ------------------------------------------------------------ the attention backend of packed rows
# The trainer always packs its rows (THD with Transformer-Engine), so every case below is the
# packed case; the GPUs are stood in by ``Platform``s (no GPU here), the rules are TE 2.17.1's.

A100 = replace(GPU, compute_capability=(8, 0), device_name="NVIDIA A100-SXM4-80GB")
H100 = replace(GPU, compute_capability=(9, 0), device_name="NVIDIA H100 80GB HBM3")
NO_FLASH = dict(flash_attention="", flash_attention_error="flash-attn is not installed")


def _backend(platform, requested="auto", dtype=torch.bfloat16, environ=None, **kwargs):
    from megatron_dgpo.runtime.gpu_flags import attention_backend

    return attention_backend(platform, requested, dtype=dtype, environ=environ or {}, **kwargs)


def test_auto_takes_cudnn_fused_on_hopper_and_flash_on_ampere():
    assert _backend(H100) == "fused"
    assert _backend(A100) == "flash"  # cuDNN fused attention has no THD before sm90
    assert _backend(replace(A100, compute_capability=(8, 6))) == "flash"
    # Hopper without cuDNN attention (as an A100 runs): flash, its fallback
    assert _backend(H100, environ={"NVTE_FUSED_ATTN": "0"}) == "flash"
    assert _backend(replace(H100, cudnn=(9, 5, 1))) == "flash"  # GQA THD needs cuDNN 9.6
    b200 = replace(H100, compute_capability=(10, 0), device_name="NVIDIA B200")
    assert _backend(b200) == "fused" and _backend(replace(b200, cudnn=(9, 6, 0))) == "flash"
    assert _backend(replace(H100, **NO_FLASH)) == "fused"  # flash-attn is not needed there
    # the CPU path and the local spec take no TE backend, whatever the recipe's key says
    assert _backend(CPU, dtype=torch.float32) == "local"
    assert _backend(CPU, "flash", dtype=torch.float32) == "local"
    assert _backend(A100, without_transformer_engine=True) == "local"


def test_a_packed_run_that_would_reach_the_unfused_attention_is_refused_with_the_fix():
    """Without flash-attn an A100's packed rows would run TE's unfused attention: refused with
    the package, the version, how to check it and the GPU; the same for a Hopper GPU run as an
    A100 (cuDNN attention off), and for an A100 whose flash-attn is a version TE ignores."""
    for platform, environ in ((replace(A100, **NO_FLASH), {}),
                              (replace(H100, **NO_FLASH), {"NVTE_FUSED_ATTN": "0"})):
        with pytest.raises(ValueError) as refused:
            _backend(platform, environ=environ)
        message = str(refused.value)
        for needed in ("model.attention_backend=auto", platform.device_name, "flash-attn==2.8.3",
                       "--no-build-isolation", "import flash_attn_2_cuda", "unfused",
                       "docs/install.md, 'Attention backends'", "flash-attn is not installed"):
            assert needed in message, (needed, message)
    assert "sm80" in str(pytest.raises(ValueError, _backend, replace(A100, **NO_FLASH)).value)
    assert "NVTE_FUSED_ATTN=0" in str(pytest.raises(
        ValueError, _backend, replace(H100, **NO_FLASH), environ={"NVTE_FUSED_ATTN": "0"}).value)
    post = replace(A100, flash_attention="", flash_attention_error=flash_attention_status(
        "2.8.3.post1", (8, 0))[1])
    with pytest.raises(ValueError, match=r"(?s)2\.8\.3\.post1 is installed.*2\.1\.1 to 2\.8\.3"):
        _backend(post)
    with pytest.raises(ValueError, match="before sm80"):  # no flash, no fused: only dense
        _backend(replace(GPU, compute_capability=(7, 0), **NO_FLASH))


def test_float32_with_transformer_engine_has_only_the_unfused_attention():
    for platform in (A100, H100):
        with pytest.raises(ValueError, match="model.dtype: float32 .*unfused"):
            _backend(platform, dtype=torch.float32)
        assert _backend(platform, "unfused", dtype=torch.float32) == "unfused"  # asked for
    assert _backend(A100, dtype=torch.float32, without_transformer_engine=True) == "local"


def test_a_named_backend_this_gpu_cannot_run_is_refused_naming_the_key_and_the_gpu():
    assert _backend(A100, "flash") == "flash" and _backend(H100, "flash") == "flash"
    assert _backend(H100, "fused") == "fused" and _backend(A100, "unfused") == "unfused"
    with pytest.raises(ValueError, match="model.attention_backend=fused on NVIDIA A100-SXM4-80GB, "
                                         "sm80: cuDNN fused attention takes packed .THD. rows only on sm90"):
        _backend(A100, "fused")
    with pytest.raises(ValueError, match="(?s)model.attention_backend=flash on NVIDIA H100.*sm90: "
                                         "flash-attn is not installed.*flash-attn==2.8.3"):
        _backend(replace(H100, **NO_FLASH), "flash")
    with pytest.raises(ValueError, match="model.attention_backend=flash .*NVTE_FLASH_ATTN=0"):
        _backend(A100, "flash", environ={"NVTE_FLASH_ATTN": "0"})
    with pytest.raises(ValueError, match="NVTE_UNFUSED_ATTN=0"):
        _backend(A100, "unfused", environ={"NVTE_UNFUSED_ATTN": "0"})
    with pytest.raises(ValueError, match="model.attention_backend=flash is a Transformer-Engine "
                                         "backend; model.without_transformer_engine=true"):
        _backend(A100, "flash", without_transformer_engine=True)
    with pytest.raises(ValueError, match="model.attention_backend must be one of"):
        _backend(A100, "flash3")


def test_flash_before_ampere_is_refused_without_a_flash_attn_build_to_install():
    """A V100 (sm70) has no FlashAttention-2 at all: the refusal of
    ``model.attention_backend=flash`` says so and points at ``unfused``, instead of a
    flash-attn build command for sm70 (which flash-attn does not support, as the old code
    suggested); on sm86 the build command names flash-attn's sm80 target, the one it knows."""
    v100 = replace(GPU, compute_capability=(7, 0), device_name="Tesla V100-SXM2-32GB", **NO_FLASH)
    with pytest.raises(ValueError) as refused:
        _backend(v100, "flash")
    message = str(refused.value)
    assert "sm80 or newer" in message and "model.attention_backend=unfused" in message
    assert "FLASH_ATTN_CUDA_ARCHS" not in message and "pip install" not in message
    a10 = replace(A100, compute_capability=(8, 6), device_name="NVIDIA A10", **NO_FLASH)
    assert "FLASH_ATTN_CUDA_ARCHS=80 " in str(pytest.raises(ValueError, _backend, a10, "flash").value)
    assert "FLASH_ATTN_CUDA_ARCHS=90 " in str(pytest.raises(
        ValueError, _backend, replace(H100, **NO_FLASH), "flash").value)


def test_exported_attention_switches_against_the_choice_are_refused_as_megatron_would_assert(monkeypatch):
    """Cluster scripts export NVTE_FLASH_ATTN=1 or NVTE_FUSED_ATTN=1. To Transformer-Engine a 1
    means "allowed"; Megatron-Core sets the chosen backend's switch to 1 and the others to 0 at
    the model's build and asserts on any other exported value, after start-up. The trainer
    refuses that environment first, naming the variable; a value that agrees passes. The
    reference is Megatron's own ``LanguageModule._set_attention_backend``, run on CPU."""
    from types import SimpleNamespace

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.enums import AttnBackend

    from megatron_dgpo.runtime.errors import InputError
    from megatron_dgpo.runtime.gpu_flags import NVTE_SWITCHES, attention_switches

    def megatron_accepts(backend, environ) -> bool:
        for key in NVTE_SWITCHES:
            monkeypatch.delenv(key, raising=False)
        for key, value in environ.items():
            monkeypatch.setenv(key, value)
        stub = SimpleNamespace(config=SimpleNamespace(attention_backend=AttnBackend[backend],
                                                      flash_attention_version=None))
        try:
            LanguageModule._set_attention_backend(stub)
        except AssertionError:
            return False
        assert {k: os.environ[k] for k in NVTE_SWITCHES} == attention_switches(backend)
        return True

    cases = [(H100, {"NVTE_FLASH_ATTN": "1"}), (A100, {"NVTE_FUSED_ATTN": "1"}),
             (H100, {"NVTE_FUSED_ATTN": "1"}), (A100, {"NVTE_FLASH_ATTN": "1"}),
             (H100, {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1"}), (A100, {}),
             (CPU, {"NVTE_FLASH_ATTN": "1"}), (CPU, {"NVTE_FUSED_ATTN": "0"})]
    for platform, environ in cases:
        dtype = torch.bfloat16 if platform.cuda else torch.float32
        chosen = _backend(platform, dtype=dtype)  # what the trainer picks in a clean environment
        accepted = megatron_accepts(chosen, environ)
        if accepted:
            assert _backend(platform, dtype=dtype, environ=environ) == chosen
        else:
            with pytest.raises(InputError) as refused:
                _backend(platform, dtype=dtype, environ=environ)
            exported = next(k for k, v in environ.items() if attention_switches(chosen)[k] != v)
            assert f"{exported}={environ[exported]} is exported" in str(refused.value)
            assert f"unset {exported}" in str(refused.value)
    assert [megatron_accepts(_backend(p, dtype=torch.bfloat16 if p.cuda else torch.float32), e)
            for p, e in cases] == [False, False, True, True, False, True, False, True]


def test_flash_attention_counts_as_transformer_engine_counts_it():
    """TE 2.17.1 uses flash-attn 2.1.1 to 2.8.3 (2.7.3 on sm100+), flash-attn-3 on sm90 only;
    outside its range it warns once and runs without it."""
    assert flash_attention_status("2.8.3", (8, 0)) == ("flash-attn 2.8.3", "")
    assert flash_attention_status("2.4.2", (9, 0)) == ("flash-attn 2.4.2", "")
    assert flash_attention_status("2.8.3+cu13torch2.13", (8, 0))[0] == "flash-attn 2.8.3+cu13torch2.13"
    for version, capability in (("2.8.3.post2", (8, 0)), ("2.9.0", (8, 0)), ("2.1.0", (8, 0)),
                                ("2.6.3", (10, 0))):
        found, why = flash_attention_status(version, capability)
        assert not found and f"flash-attn {version} is installed" in why
    assert flash_attention_status(None, (8, 0)) == ("", "flash-attn is not installed")
    assert flash_attention_status(None, (9, 0), flash_attn_3="3.0.0") == ("flash-attn-3 3.0.0", "")
    assert not flash_attention_status(None, (8, 0), flash_attn_3="3.0.0")[0]  # FA3 is sm90 only
    assert "sm75" in flash_attention_status("2.8.3", (7, 5))[1]


def test_the_trainer_refuses_before_reading_a_weight_and_megatron_pins_the_choice(monkeypatch, tmp_path):
    """``build_policy`` on a stand-in A100 without flash-attn stops before the model is read
    (its path does not even exist); with flash-attn the choice reaches ``TransformerConfig``,
    and Megatron turns it into TE's switches: flash on, fused and unfused off, so TE cannot
    fall back to the unfused attention (built on CPU: the local spec runs no TE attention, but
    ``LanguageModule`` sets the same environment)."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_dgpo.recipe import ModelConfig
    from megatron_dgpo.training import policy

    monkeypatch.setattr(Platform, "detect", classmethod(lambda cls: replace(A100, **NO_FLASH)))
    for key in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="(?s)NVIDIA A100.*flash-attn==2.8.3"):
        policy.build_policy(ModelConfig(path=str(tmp_path / "absent")), tmp_path / "absent",
                            use_distributed_optimizer=False)
    overrides = policy.attention_overrides(ModelConfig(), A100, torch.bfloat16)
    assert overrides == {"attention_backend": AttnBackend.flash}
    assert policy.attention_overrides(ModelConfig(), CPU, torch.float32) == {}
    config, _ = transformer_config_from_hf(TINY_QWEN2, platform=CPU, **overrides)
    assert config.attention_backend == AttnBackend.flash
    from megatron.core.models.common.language_module.language_module import LanguageModule

    for key in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.setenv(key, "")  # restored by monkeypatch after Megatron writes them
        os.environ.pop(key)
    LanguageModule._set_attention_backend(type("Stub", (), {"config": config})())
    assert {k: os.environ[k] for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")} \
        == {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}


def test_context_parallel_on_a_gpu_needs_transformer_engine():
    """CP runs in TE's attention only on a GPU: refused without TE and with the opt-out, with
    the setting and the fix named; the CPU path (cpu.py patch 15) and a TE node pass. A GPU
    layout gets Megatron-LM's cp_comm_type p2p, the CPU none."""
    from megatron_dgpo.runtime.gpu_flags import require_gpu_stack

    no_te = Platform(cuda=True, transformer_engine_error="not found")
    for platform, opt_out in ((no_te, False), (no_te, True), (GPU, True)):
        with pytest.raises(RuntimeError, match="(?s)parallel.context_parallel=2.*Transformer-Engine"
                                               ".*docs/install.md.*parallel.context_parallel=1"):
            require_gpu_stack(platform, without_transformer_engine=opt_out, context_parallel=2)
    require_gpu_stack(GPU, context_parallel=2)
    require_gpu_stack(CPU, context_parallel=4)
    gpu = transformer_kwargs(TINY_QWEN2, platform=GPU, context_parallel_size=2)
    assert gpu["context_parallel_size"] == 2 and gpu["cp_comm_type"] == "p2p"
    cpu = transformer_kwargs(TINY_QWEN2, platform=CPU, context_parallel_size=2)
    assert cpu["context_parallel_size"] == 2 and "cp_comm_type" not in cpu
    assert transformer_kwargs(TINY_QWEN2, platform=GPU)["context_parallel_size"] == 1
