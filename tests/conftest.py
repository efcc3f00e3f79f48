"""Session-wide fixtures: tiny models built locally and ONE vLLM engine per test session.

The engine (~25 s to start on CPU) is created lazily by the first test that asks for it and
shut down explicitly at the end of the session (an engine left running hangs the interpreter's
exit). Tests that refit its weights must restore model A (``tiny_model_dir``) before returning.
"""

from __future__ import annotations

import pytest

TINY_INIT_RANGE = 0.1  # peakier than the 0.02 default, so distinct weights give distinct log-probs


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Random tiny Qwen2 "A" (seed 0) with the locally trained tokenizer."""
    from megatron_dgpo.tasks.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_a"), seed=0, initializer_range=TINY_INIT_RANGE)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory):
    """Model "B": same architecture and tokenizer as A, different random weights (seed 1)."""
    from megatron_dgpo.tasks.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_b"), seed=1, initializer_range=TINY_INIT_RANGE)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """The session's single vLLM engine on model A, fp32 (exact log-probs)."""
    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, VLLMEngine

    engine = VLLMEngine(
        VLLMConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            max_model_len=512,
            max_num_seqs=64,
            kv_cache_memory_bytes=64 << 20,
        )
    )
    try:
        yield engine
    finally:
        engine.shutdown()
