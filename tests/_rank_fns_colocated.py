"""Rank functions for tests/rollout/test_refit.py: colocated vLLM engines (external_launcher) on two
gloo ranks, and a collective timeout. Each returns plain data; the test asserts on it."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

MAX_TOKENS = 10
N = 3
SEED = 1000  # train.seed: per-prompt seed = (SEED << 40) + global prompt index * N


def _tokens(groups):
    return [[list(s.token_ids) for s in g] for g in groups]


@torch.no_grad()
def _max_diff_vs_transformers(model_dir, prompts, groups) -> float:
    """Largest |vLLM - transformers fp32| over the sampled tokens' log-probs (float64 softmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        for s in group:
            ids = torch.tensor([list(prompt) + list(s.token_ids)])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, (ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max().item())
    return worst


def _engine(model_dir, tp: int, **config):
    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, VLLMEngine

    return VLLMEngine(VLLMConfig(model=str(model_dir), dtype="float32", max_model_len=256,
                                 max_num_seqs=16, kv_cache_memory_bytes=32 << 20,
                                 placement="colocated", tensor_parallel_size=tp,
                                 refit_bucket_bytes=128 << 10, **config))


def colocated_engines(rank, world, model_a, model_b, prompts):
    """TP=1 engine per rank: sharded generation with global-index seeds, in-process bucketed
    refit, sleep on CPU, a shutdown that keeps the process group; then one TP=2 engine over
    both ranks that generates and refits."""
    from safetensors.torch import load_file

    from megatron_dgpo.rollout.placement import EngineLayout, prompt_seeds, shard_prompts
    from tests.conftest import hf_groups

    os.environ["OMP_NUM_THREADS"] = "1"  # before the engine: torch.set_num_threads is dead after
    out = {}
    t0 = time.perf_counter()
    engine = _engine(model_a, tp=1)
    out["start_s"] = time.perf_counter() - t0
    layout = EngineLayout(world, rank, engine_tp=1)
    mine = shard_prompts(len(prompts), layout.num_engines, layout.engine_index)
    out["whole"] = _tokens(engine.generate(prompts, n=N, max_tokens=MAX_TOKENS,
                                           seeds=prompt_seeds(SEED, 0, range(len(prompts)), N)))
    shard = engine.generate([prompts[i] for i in mine], n=N, max_tokens=MAX_TOKENS,
                            seeds=prompt_seeds(SEED, 0, mine, N))
    out["shard"] = _tokens(shard)
    out["diff_a"] = _max_diff_vs_transformers(model_a, [prompts[i] for i in mine], shard)

    engine.sleep()  # CPU: logs once, no-op
    engine.sleep()
    b_tensors = load_file(os.path.join(model_b, "model.safetensors"))
    stats = engine.update_weights(hf_groups(model_b, b_tensors))
    out["refit"] = {"buckets": stats.buckets, "max_bucket_bytes": stats.max_bucket_bytes,
                    "tensors": stats.tensors, "total_bytes": stats.total_bytes,
                    "metrics": stats.as_metrics()}
    after_b = engine.generate(prompts, n=N, max_tokens=MAX_TOKENS,
                              seeds=prompt_seeds(SEED, 0, range(len(prompts)), N))
    out["diff_b"] = _max_diff_vs_transformers(model_b, prompts, after_b)
    out["diff_b_vs_a"] = _max_diff_vs_transformers(model_a, prompts, after_b)
    engine.update_weights_from_dir(model_b)  # full reload from the HF folder: same samples
    from_dir = engine.generate(prompts, n=N, max_tokens=MAX_TOKENS,
                               seeds=prompt_seeds(SEED, 0, range(len(prompts)), N))
    out["bucketed_equals_dir"] = _tokens(after_b) == _tokens(from_dir)
    out["lp_bucketed_vs_dir"] = max(abs(x - y) for ga, gb in zip(after_b, from_dir)
                                    for sa, sb in zip(ga, gb) for x, y in zip(sa.logprobs, sb.logprobs))
    engine.shutdown()
    engine.shutdown()  # idempotent
    flag = torch.tensor([rank + 1.0])
    dist.all_reduce(flag)  # the trainer's group survives the engine
    out["all_reduce_after_shutdown"] = flag.item()

    # one engine over both ranks (TP=2), started from dummy weights (what a GPU colocated engine
    # and a level-2 sleep leave): one bucketed refit must refill every tensor it needs, so that
    # its samples are model A's as from a fresh load; identical prompts and seeds on both ranks
    tp2 = _engine(model_a, tp=2, dummy_weights=True)
    seeds = prompt_seeds(SEED, 0, range(len(prompts)), N)
    out["tp2_refused_before_refit"] = not tp2.holds_weights
    a_tensors = load_file(os.path.join(model_a, "model.safetensors"))
    tp2.update_weights(hf_groups(model_a, a_tensors))
    g = tp2.generate(prompts, n=N, max_tokens=MAX_TOKENS, seeds=seeds)
    out["tp2_tokens"] = _tokens(g)
    out["tp2_diff_a"] = _max_diff_vs_transformers(model_a, prompts, g)
    stats = tp2.update_weights(hf_groups(model_b, b_tensors))
    out["tp2_buckets"] = stats.buckets
    out["tp2_diff_b"] = _max_diff_vs_transformers(
        model_b, prompts, tp2.generate(prompts, n=N, max_tokens=MAX_TOKENS, seeds=seeds))
    tp2.shutdown()
    dist.barrier()
    return out


def slow_rank_times_out(rank, world, port, timeout_minutes, delay_s):
    """Re-create the process group through ``init_distributed`` with a short timeout; rank 1
    arrives ``delay_s`` late. Returns (error text or None, seconds waited) per collective."""
    from megatron.core import parallel_state

    from megatron_dgpo.runtime.parallel import (ParallelConfig, destroy_parallel, init_distributed,
                                                initialize_parallel)

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    init_distributed("gloo", timeout_minutes=timeout_minutes)
    initialize_parallel(ParallelConfig(timeout_minutes=timeout_minutes))
    dist.barrier()  # both ranks ready
    out = {}
    if rank == 1:
        time.sleep(delay_s)
    for name, group in (("dp_group", parallel_state.get_data_parallel_group()), ("world", None)):
        t0 = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            out[name] = (None, time.perf_counter() - t0)
        except RuntimeError as exc:
            out[name] = (str(exc), time.perf_counter() - t0)
    destroy_parallel()
    return out
