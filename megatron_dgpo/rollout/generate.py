"""A step's rollout: the engine a recipe asks for, and a prompt share sampled and graded.

``build_engine`` is the one place that turns a ``rollout`` config section into an engine (the
trainer and ``dgpo-eval`` both call it); ``generate_experience`` samples ``group_size``
responses for each prompt and grades them in a ``RewardPool`` into an ``Experience`` (rank 0
only; the trainer broadcasts it).
"""

from __future__ import annotations

import os

from megatron_dgpo.experience import Experience
from megatron_dgpo.recipe import RolloutConfig
from megatron_dgpo.rewards import RewardPool


def build_engine(config: RolloutConfig, model: str | os.PathLike, *, seed: int = 0,
                 max_model_len: int | None = None):
    """The rollout engine ``config.engine`` on the HF folder ``model``: vLLM, or transformers'
    generate. ``max_model_len`` defaults to ``max_prompt_tokens + max_response_tokens``."""
    if config.engine == "hf":
        from megatron_dgpo.rollout.hf_engine import HFEngine

        return HFEngine(str(model))
    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, VLLMEngine

    return VLLMEngine(VLLMConfig(
        model=str(model), dtype=config.dtype, seed=seed,
        max_model_len=max_model_len or config.max_prompt_tokens + config.max_response_tokens,
        max_num_seqs=config.max_num_seqs, tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes, engine_kwargs=config.engine_kwargs))


def reward_pool() -> RewardPool:
    """The training grader's worker pool: half the cores, between 1 and 8 workers."""
    return RewardPool(num_workers=max(1, min(8, (os.cpu_count() or 2) // 2)))


def generate_experience(engine, pool: RewardPool, tokenizer, prompts: list, indices: list[int],
                        config: RolloutConfig, *, seed: int) -> Experience:
    """``config.group_size`` responses for each prompt of ``indices``, graded (+1/-1).

    ``prompts[i]`` is ``(PromptRecord, token_ids)`` as ``data.load_prompts`` returns them;
    ``seed`` seeds the engine's sampling (prompt k of the call gets ``seed + k``).
    """
    groups = engine.generate([prompts[i][1] for i in indices], n=config.group_size,
                             temperature=config.temperature, top_p=config.top_p,
                             max_tokens=config.max_response_tokens, seed=seed)
    samples = [s for g in groups for s in g]
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    truths = [prompts[i][0].ground_truth for i in indices for _ in range(config.group_size)]
    rewards = pool.score(texts, truths, grader="train")
    return Experience(prompt_tokens=[list(prompts[i][1]) for i in indices
                                     for _ in range(config.group_size)],
                      response_tokens=[list(s.token_ids) for s in samples],
                      rollout_logprobs=[list(s.logprobs) for s in samples],
                      rewards=[float(r) for r in rewards],
                      truncated=[s.finish_reason == "length" for s in samples])
