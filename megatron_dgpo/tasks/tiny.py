"""Tiny test/demo artifacts built locally, with no download: a tokenizer and a random model
(Qwen2 by default).

    from megatron_dgpo.tasks.tiny import make_tiny_model
    model_dir = make_tiny_model("/tmp/tiny")            # tokenizer + Qwen2 weights, fp32
    model_dir = make_tiny_model("/tmp/tiny2", seed=1)   # same shapes and tokenizer, new weights
    model_dir = make_tiny_model("/tmp/moe", family="qwen3_moe")  # 8 experts, top 2

``train_tokenizer(texts, out_dir, vocab_size=512)``: byte-level BPE trained with ``tokenizers``
on ``texts``, saved as a transformers tokenizer (``AutoTokenizer.from_pretrained(out_dir)``
works, and so does vLLM). Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``,
``<|im_end|>`` (eos, ends an assistant turn). Added (non-special) tokens: ``\\boxed{`` and
``\\boxed{0}`` ... ``\\boxed{9}``, so a one-digit boxed answer is one token (see
``megatron_dgpo.tasks.prompts``: this is what makes the easy families learnable by a random tiny model).
The chat template is Qwen's ChatML:
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n``.

``make_tiny_model(out_dir, *, seed=0, family="qwen2", vocab_size=512, **config_overrides)``: a
randomly initialised model of HF ``model_type`` ``family`` (transformers' auto classes; default:
hidden 128, 4 heads of size 32, 2 KV heads, 2 layers, MLP 256, ~0.3M parameters; a family with
routed experts, e.g. "qwen3_moe", gets 8 experts of width 64, top 2) saved in fp32 safetensors,
with a ``generation_config.json`` (eos = ``<|im_end|>`` and ``<|endoftext|>``) and the tokenizer
of ``tiny_tokenizer_texts()`` in the same folder. Head size 32 is the smallest vLLM's CPU
attention accepts. The result depends only on ``seed`` and the overrides (deterministic). Any
field of the family's config class can be overridden (e.g. ``num_hidden_layers=4``,
``initializer_range=0.2``); ``vocab_size`` follows the tokenizer. ``tiny_config`` gives the
model's config without building it (what ``dgpo-plan`` plans for a recipe's ``model.tiny``).
Which families the trainer accepts is the family registry's business
(``megatron_dgpo.models.families``), not this module's.
"""

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
    """Train a byte-level BPE tokenizer on ``texts`` and save it (transformers layout) in ``out_dir``.

    vocab_size counts everything (256 byte symbols, merges, special and added tokens); it must
    leave room for the byte alphabet. individual_digits: every digit is its own token (as in
    Qwen2's and Llama's tokenizers), so numbers are never merged into multi-digit pieces: what
    arithmetic tasks need (``megatron_dgpo.tasks.arithmetic``). Returns ``out_dir``.
    """
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
    """The HF config (``config.json`` fields) of the model ``make_tiny_model`` builds with the
    same arguments, without building it: ``model_type`` ``family``, ``TINY_CONFIG`` (and
    ``TINY_MOE`` for a family with routed experts) under ``config_overrides``. ``vocab_size`` is
    the tokenizer's requested size (the built model takes the trained tokenizer's length);
    ``seed`` and the tokenizer's arguments do not change the config. Raises ``ValueError`` on an
    unknown family or field."""
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
    """Build and save a random tiny model (fp32 safetensors) plus its tokenizer in ``out_dir``.

    ``config_args``: ``tiny_config``'s (``family``: an HF ``model_type``, "qwen2" by default;
    ``vocab_size``; ``tie_word_embeddings``; fields of the family's config class). ``seed``
    fixes the weights (the tokenizer does not depend on it). ``tokenizer_texts``: the
    tokenizer's training corpus (default ``tiny_tokenizer_texts()``); ``individual_digits``:
    see ``train_tokenizer``. Returns ``out_dir`` (loadable by transformers and vLLM).
    """
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
