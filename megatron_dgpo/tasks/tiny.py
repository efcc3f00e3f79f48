"""Tiny test/demo artifacts built locally, with no download: a byte-level BPE tokenizer
(``train_tokenizer``) and a random model of any HF family with it (``make_tiny_model``; its config
alone, ``tiny_config``), loadable by transformers and vLLM, deterministic in the seed and the
overrides: docs/training.md#the-tiny-model-and-tokenizer.

    model_dir = make_tiny_model("/tmp/tiny")            # tokenizer + Qwen2 weights, fp32
    model_dir = make_tiny_model("/tmp/moe", family="qwen3_moe")  # 8 experts, top 2"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOXED_TOKENS = ("\\boxed{",) + tuple(f"\\boxed{{{d}}}" for d in range(10))
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    use_sliding_window=False,
)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                norm_topk_prob=True, router_aux_loss_coef=0.0)
"""The routed experts of a tiny ``family="qwen3_moe"`` (8 experts, top 2, width 64)."""


def train_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 512, *,
                    individual_digits: bool = False) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` and save it (transformers layout) in
    ``out_dir``; returns ``out_dir``. ``vocab_size`` counts everything (256 byte symbols, merges,
    special and added tokens). ``individual_digits``: every digit its own token
    (``tasks.arithmetic``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + len(BOXED_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} leaves no room for the 256 byte symbols and added tokens")
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if individual_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(BOXED_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in BOXED_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def tiny_tokenizer_texts() -> list[str]:
    """The training corpus of the tiny tokenizer: the built-in prompts in chat form, their boxed
    answers, and a few sentences of generic math prose."""
    from megatron_dgpo.tasks.prompts import builtin_prompts

    texts = []
    for r in builtin_prompts():
        for m in r.messages:
            texts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        texts.append(f"<|im_start|>assistant\nThe answer is \\boxed{{{r.ground_truth}}}.<|im_end|>\n")
    texts += [
        "Let us reason step by step. First compute the sum, then simplify the fraction.",
        "Therefore the final answer is $x = 2$, so the probability equals one half.",
        "We have 12 + 30 = 42 and 7 * 6 = 42; hence both sides are equal.",
    ] * 4
    return texts


def _config_class(family: str):
    """transformers' config class of HF ``model_type`` ``family``."""
    from transformers import AutoConfig

    try:
        return type(AutoConfig.for_model(family))
    except ValueError:
        raise ValueError(f"model.tiny.family: {family!r} is no model_type transformers knows "
                         f"(qwen2, qwen3, qwen3_moe, llama, ...)") from None


def tiny_config(*, family: str = "qwen2", tie_word_embeddings: bool = False,
                vocab_size: int = 512, seed: int = 0, tokenizer_texts: Iterable[str] | None = None,
                individual_digits: bool = False, **config_overrides) -> dict:
    """The HF config (``config.json`` fields) ``make_tiny_model`` builds with the same arguments:
    ``model_type`` ``family``, ``TINY_CONFIG`` (+ ``TINY_MOE`` with routed experts) under
    ``config_overrides``, ``vocab_size`` the tokenizer's requested size; ``seed`` and the
    tokenizer's arguments do not change it. Raises ``ValueError`` on an unknown family or field."""
    del seed, tokenizer_texts, individual_digits  # the weights and the tokenizer only
    config_class = _config_class(family)
    known = set(config_class().to_dict())
    defaults = {**TINY_CONFIG, **(TINY_MOE if "moe_intermediate_size" in known else {})}
    # head_dim is read by every Qwen family's attention; Qwen3-MoE's config class declares no
    # such field but keeps it as an extra attribute
    unknown = set(config_overrides) - known - {"head_dim"} - set(defaults)
    if unknown:
        raise ValueError(f"unknown {config_class.__name__} fields: {sorted(unknown)}")
    if "vocab_size" in config_overrides:
        raise ValueError("vocab_size follows the tokenizer: pass it as make_tiny_model(vocab_size=...)")
    return {"model_type": family, "vocab_size": vocab_size,
            "tie_word_embeddings": tie_word_embeddings, **defaults, **config_overrides}


def make_tiny_model(out_dir: str | os.PathLike, *, seed: int = 0,
                    tokenizer_texts: Iterable[str] | None = None, individual_digits: bool = False,
                    **config_args) -> Path:
    """Build and save a random tiny model (fp32 safetensors) plus its tokenizer in ``out_dir``;
    returns ``out_dir``. ``config_args``: ``tiny_config``'s. ``seed`` fixes the weights (not the
    tokenizer); ``tokenizer_texts``: the tokenizer's corpus (default ``tiny_tokenizer_texts()``);
    ``individual_digits``: see ``train_tokenizer``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    fields = tiny_config(**config_args)
    family, vocab_size = fields.pop("model_type"), fields.pop("vocab_size")
    out = Path(out_dir)
    texts = tiny_tokenizer_texts() if tokenizer_texts is None else list(tokenizer_texts)
    train_tokenizer(texts, out, vocab_size=vocab_size, individual_digits=individual_digits)
    tokenizer = AutoTokenizer.from_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = _config_class(family)(vocab_size=len(tokenizer), bos_token_id=None,
                                   eos_token_id=eos, pad_token_id=pad, torch_dtype="float32",
                                   **fields)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < 32:
        raise ValueError(f"head size {head_dim} < 32: vLLM's CPU attention needs 32, 64, 80, ... (hidden/heads)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, pad], pad_token_id=pad, do_sample=True, temperature=1.0, top_p=1.0
    )
    model.save_pretrained(out, safe_serialization=True)
    return out
