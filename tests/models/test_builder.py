"""Model builder: Megatron GPTModel logits equal transformers' for the same weights."""

import pytest
import torch

from megatron_dgpo.models.builder import (hf_config_dict, padded_vocab_size,
                                          transformer_config_from_hf)
from megatron_dgpo.models.describe import rope_of
from tests._rank_fns_model import TINY_QWEN2, parity_fn
from tests.distributed import run_ranks


def test_padded_vocab_size():
    assert padded_vocab_size(152064, 1) == 152064
    assert padded_vocab_size(152064, 2) == 152064
    assert padded_vocab_size(152064, 8) == 152576
    assert padded_vocab_size(300, 1) == 384
    assert padded_vocab_size(300, 4) == 512
    with pytest.raises(ValueError):
        padded_vocab_size(0, 1)


def test_config_mapping_and_refusals():
    from transformers import LlamaConfig, Qwen2Config

    tc, spec = transformer_config_from_hf(Qwen2Config(**{k: v for k, v in TINY_QWEN2.items()
                                                         if k not in ("model_type",
                                                                      "architectures")}))
    assert (tc.num_layers, tc.hidden_size, tc.num_query_groups, tc.kv_channels) == (2, 128, 2, 32)
    assert tc.add_qkv_bias and not tc.add_bias_linear and tc.gated_linear_unit
    assert tc.normalization == "RMSNorm" and tc.calculate_per_token_loss
    assert spec.family == "qwen2" and spec.vocab_size == 300 and spec.rotary_base == 10000.0

    llama = LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                        max_position_embeddings=16384,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
    tc, spec = transformer_config_from_hf(llama)
    assert spec.family == "llama" and spec.rope_scaling and spec.rope_scaling_factor == 8.0
    assert not tc.add_qkv_bias

    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        rope_of({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="high_freq_factor"):
        rope_of({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}})
    with pytest.raises(ValueError, match="supported model_type.*qwen2.*llama"):
        transformer_config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="hidden_size"):
        transformer_config_from_hf({"model_type": "qwen2", "num_attention_heads": 4})
    with pytest.raises(TypeError, match="hf_config"):
        hf_config_dict(42)


def test_logits_equal_transformers_tp1_tp2_tied_untied():
    results = run_ranks(parity_fn, 2)
    for rank_result in results:
        for tp in (1, 2):
            for tied in (False, True):
                r = rank_result[(tp, tied)]
                assert r["local_shape"] == (2, 24, r["padded"] // tp)
                assert r["max_err"] <= 1e-5 * max(1.0, r["scale"]), (tp, tied, r)
                assert r["qkv_bias"] and r["tied"] == tied
                assert ("output_layer.weight" in r["names"]) == (not tied)
                assert "decoder.layers.1.self_attention.linear_qkv.bias" in r["names"]
        assert rank_result["rope"] == (1e6, 2, 32)
    torch.testing.assert_close(torch.tensor(results[0][(2, False)]["max_err"]),
                               torch.tensor(results[1][(2, False)]["max_err"]), atol=1e-6, rtol=0)


def test_packed_samples_stay_apart_under_megatrons_fused_softmax(monkeypatch):
    """The local spec's attention takes packed rows as a block-diagonal causal mask. With
    ``masked_softmax_fusion`` (a GPU with Megatron's softmax kernels) and the spec's default
    "causal" mask type, Megatron runs its upper-triangular kernel, which ignores the mask: each
    sample attended to those packed before it. The spec's attention now says "arbitrary". The
    CUDA kernels are stood in by their torch equivalents (no GPU here); the reference is the
    softmax of the masked scores."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    from megatron_dgpo.algorithm.packing import block_causal_mask
    from megatron_dgpo.models.builder import layer_spec
    from megatron_dgpo.runtime.gpu_flags import Platform

    def masked(scores, mask):
        return torch.softmax(scores.float().masked_fill(mask, -10000.0), -1).to(scores.dtype)

    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)
    monkeypatch.setattr(fused_softmax.ScaledUpperTriangMaskedSoftmax, "apply",
                        lambda x, scale: masked(x * scale, causal))
    monkeypatch.setattr(fused_softmax.ScaledMaskedSoftmax, "apply",
                        lambda x, mask, scale: masked(x * scale, mask))
    monkeypatch.setattr(FusedScaleMaskSoftmax, "is_kernel_available", lambda self, *a: True)

    mask_type = layer_spec(platform=Platform(cuda=True)).submodules.self_attention.params["attn_mask_type"]
    softmax = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=mask_type,
                                    scaled_masked_softmax_fusion=True,
                                    mask_func=lambda s, m: s.masked_fill(m, -10000.0),
                                    softmax_in_fp32=True, scale=None)
    mask = block_causal_mask(torch.tensor([0, 3, 8]))  # [1, 1, 8, 8]: samples of 3 and 5 tokens
    assert mask.shape == (1, 1, 8, 8) and mask[0, 0, 4, 2]  # token 4 may not see sample 1
    scores = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    probs = softmax(scores, mask)
    # no weight across the sample boundary
    # exact: exp of a score masked to -10000 underflows to 0.0 in float32 on any machine
    assert float(probs[..., 3:, :3].abs().max()) == 0.0
    torch.testing.assert_close(probs, masked(scores, mask.expand_as(scores)))
