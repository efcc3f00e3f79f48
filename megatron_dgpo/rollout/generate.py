"""A step's rollout: the engine a recipe asks for, and a prompt share sampled and graded.

``build_engine`` is the one place that turns a ``rollout`` config section into an engine (the
trainer and ``dgpo-eval`` both call it); ``generate_experience`` samples ``group_size``
responses for each prompt of one engine's share and grades them in a ``RewardPool`` into an
``Experience`` (on the engine's leader rank; the samples stay on the DP replica that trains
on them, see ``rollout.placement``). Each prompt's seed comes from the run's seed and its
global index in the prompt stream (``placement.prompt_seeds``), whatever engine it lands on, so
a step's samples do not depend on the number of engines (token for token on CPU; in
distribution on a GPU, whose bf16 logits depend on the batch) and no two samples of a run share
a random stream.
"""

from __future__ import annotations

import os
from typing import Callable

from megatron_dgpo.algorithm.advantages import drop_degenerate_groups
from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.rollout.config import RolloutConfig
from megatron_dgpo.rollout.placement import prompt_seeds
from megatron_dgpo.tasks.rewards import RewardPool


def build_engine(config: RolloutConfig, model: str | os.PathLike, *, seed: int = 0,
                 max_model_len: int | None = None, placement: str | None = None,
                 tensor_parallel_size: int | None = None, refitted: bool = False,
                 record_routing: bool = False, dedicated: bool = False):
    """The rollout engine ``config.engine`` on the HF folder ``model``: vLLM, or transformers'
    generate. ``max_model_len`` defaults to ``max_prompt_tokens + max_response_tokens``;
    ``placement`` and ``tensor_parallel_size`` default to the config's (the trainer passes the
    resolved engine TP; ``dgpo-eval``, which has no process group, asks for ``separate``).
    ``refitted``: the caller refits the engine before it generates (the trainer), so
    ``config.dummy_weights`` applies; otherwise the engine always reads the checkpoint.
    ``record_routing`` (``algorithm.routing_replay: r3``): every sample carries its MoE
    routing (``VLLMConfig.record_routing``); the transformers engine cannot and refuses.
    ``dedicated`` (``rollout.placement: dedicated``, on an engine rank): in process over the
    engine ranks' own world, never asleep and with vLLM's custom all-reduce (its GPUs are its
    own), started from random weights that the trainer's first broadcast replaces."""
    if config.engine == "hf":
        if record_routing:
            raise ValueError("algorithm.routing_replay: r3 needs the vllm engine (the "
                             "transformers engine does not record its routers' choices)")
        from megatron_dgpo.rollout.hf_engine import HFEngine

        return HFEngine(str(model))
    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, VLLMEngine

    return VLLMEngine(VLLMConfig(
        model=str(model), dtype=config.dtype, seed=seed,
        max_model_len=max_model_len or config.max_prompt_tokens + config.max_response_tokens,
        max_num_seqs=config.max_num_seqs,
        tensor_parallel_size=tensor_parallel_size or config.tensor_parallel_size or 1,
        placement=placement or config.placement, refit_bucket_bytes=config.refit_bucket_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes, enforce_eager=config.enforce_eager,
        sleep_mode=False if dedicated else config.sleep_mode, sleep_level=config.sleep_level,
        dummy_weights=True if dedicated else config.dummy_weights if refitted else False,
        engine_kwargs=config.engine_kwargs, record_routing=record_routing, dedicated=dedicated))


def reward_pool() -> RewardPool:
    """The training grader's worker pool: half the cores, between 1 and 8 workers."""
    return RewardPool(num_workers=max(1, min(8, (os.cpu_count() or 2) // 2)))


def generate_experience(engine, pool: RewardPool | None, tokenizer, prompts: list,
                        indices: list[int], positions: range, config: RolloutConfig, *,
                        train_seed: int, prompts_consumed: int) -> Experience | None:
    """``config.group_size`` responses for the prompts ``indices[p]``, p in ``positions`` (this
    engine's share of the step's batch ``indices``), graded (+1/-1) when ``pool`` is given.

    ``prompts[i]`` is ``(PromptRecord, token_ids)`` as ``prompts.load_prompts`` returns them;
    batch position p of the step that starts at stream position ``prompts_consumed`` is sampled
    with seed ``(train_seed << 40) + (prompts_consumed + p) * group_size``
    (``placement.prompt_seeds``: one stream per sample for the whole run).
    Every rank of a colocated engine must call this with the same arguments; the ranks without
    a ``pool`` only take part in generation and return None. Samples that carry their routing
    (``Completion.routed_experts``) hand it to ``Experience.routed_experts``.
    """
    share = [indices[p] for p in positions]
    groups = engine.generate([prompts[i][1] for i in share], n=config.group_size,
                             temperature=config.temperature, top_p=config.top_p,
                             max_tokens=config.max_response_tokens,
                             seeds=prompt_seeds(train_seed, prompts_consumed, positions,
                                                config.group_size))
    if pool is None:
        return None
    samples = [s for g in groups for s in g]
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    truths = [prompts[i][0].ground_truth for i in share for _ in range(config.group_size)]
    rewards = pool.score(texts, truths, grader="train") if samples else []
    routed = [s.routed_experts for s in samples]
    return Experience(prompt_tokens=[list(prompts[i][1]) for i in share
                                     for _ in range(config.group_size)],
                      response_tokens=[list(s.token_ids) for s in samples],
                      rollout_logprobs=[list(s.logprobs) for s in samples],
                      rewards=[float(r) for r in rewards],
                      truncated=[s.finish_reason == "length" for s in samples],
                      routed_experts=routed if samples and routed[0] is not None else None,
                      prompt_indices=[i for i in share for _ in range(config.group_size)],
                      positions=[prompts_consumed + p for p in positions
                                 for _ in range(config.group_size)])


def degenerate_groups(piece: Experience, group_size: int) -> list[int]:
    """The groups of ``piece`` whose rewards are all equal (their advantages are all 0)."""
    keep = drop_degenerate_groups(piece.rewards, group_size).keep
    return [k for k in range(len(piece) // group_size) if not keep[k * group_size]]


def refill_degenerate_groups(piece: Experience | None, positions: list[int], max_rounds: int, *,
                             start: int, batch_prompts: int, group_size: int,
                             sample: Callable[[int, list[int]], Experience | None],
                             redo: Callable[[Experience | None], tuple[list[int], int]]
                             ) -> tuple[Experience | None, int, int]:
    """DAPO's dynamic sampling (``algorithm.refill_rounds``) of ``piece``, the groups at batch
    ``positions`` of the batch that starts at stream position ``start``: up to ``max_rounds``
    times, the groups ``redo`` names are sampled again from the same positions of the stream's
    next batch (``sample(stream position, batch positions)``), so a position's fate depends only
    on its own stream, whatever the engines and replicas. ``redo(piece)`` gives the indices into
    ``positions`` to sample again here and the groups discarded this round as the caller
    counts them (0 ends the rounds); the ranks that sample together must agree on both. Returns
    the piece, the rounds taken and the groups discarded."""
    rounds = discarded = 0
    while rounds < max_rounds:
        mine, count = redo(piece)
        if not count:
            break
        rounds, discarded = rounds + 1, discarded + count
        if mine:
            fresh = sample(start + rounds * batch_prompts, [positions[k] for k in mine])
            if piece is not None:
                piece = piece.replace_groups(mine, fresh, group_size)
    return piece, rounds, discarded
