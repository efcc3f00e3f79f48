"""The tiny artifacts: deterministic, loadable by transformers, tokenizer contract."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_dgpo.tasks.tiny import make_tiny_model, train_tokenizer


def test_tiny_model_is_deterministic_and_loadable(tiny_model_dir, tiny_model_dir_b, tmp_path):
    from transformers import AutoModelForCausalLM

    again = make_tiny_model(tmp_path / "again", seed=0, initializer_range=0.1)
    a, b, c = (load_file(str(p / "model.safetensors")) for p in (tiny_model_dir, tiny_model_dir_b, again))
    # exact: the same function on the same seed in the same process
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    # exact: must differ (another seed)
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert "lm_head.weight" in a and all(t.dtype == torch.float32 for t in a.values())
    assert (tiny_model_dir / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads == 32 and cfg.num_key_value_heads == 2
    assert model.generation_config.eos_token_id == [2, 0]
    logits = model(input_ids=torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, cfg.vocab_size) and torch.isfinite(logits).all()


def test_tied_and_overridden_configs(tmp_path):
    from transformers import AutoConfig

    tied = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True, num_hidden_layers=1)
    cfg = AutoConfig.from_pretrained(tied)
    assert cfg.tie_word_embeddings and cfg.num_hidden_layers == 1
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))
    with pytest.raises(ValueError, match="head size 16"):
        make_tiny_model(tmp_path / "bad", num_attention_heads=8)
    with pytest.raises(ValueError, match="unknown Qwen2Config fields"):
        make_tiny_model(tmp_path / "bad2", hiden_size=64)


def test_tokenizer_contract(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    assert len(tok) == 512 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for d in range(10):  # a one-digit boxed answer is ONE token (what makes easy prompts learnable)
        assert len(tok(f"\\boxed{{{d}}}", add_special_tokens=False)["input_ids"]) == 1
    text = "Compute $\\frac{3}{4} + 12$ then say \\boxed{42}. Ünïcödé ok"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: lossless
    small = train_tokenizer(["hello world"] * 10, tmp_path / "tok", vocab_size=300)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(small)) <= 300
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], tmp_path / "tok2", vocab_size=100)
