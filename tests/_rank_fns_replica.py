"""Rank functions for context parallelism's groups (tests/rollout/test_replica.py): the replica
group at several layouts of one world, a replica's samples under CP, and the refit's export from
CP rank 0 only. One launch runs them all (each launch costs CI time)."""

from __future__ import annotations

import hashlib

LAYOUTS = [dict(tensor_parallel=1, context_parallel=1, pipeline_parallel=1),
           dict(tensor_parallel=1, context_parallel=2, pipeline_parallel=1),
           dict(tensor_parallel=2, context_parallel=2, pipeline_parallel=1),
           dict(tensor_parallel=1, context_parallel=2, pipeline_parallel=2)]
BATCH_PROMPTS, GROUP_SIZE = 4, 2


class SeedEngine:
    """Answers each prompt with tokens drawn from its sampling seed (so a sample tells which
    stream made it); records the names every refit loads."""

    holds_weights = True

    def __init__(self):
        self.loaded: list[list[str]] = []

    def generate(self, prompts_token_ids, *, n=1, temperature=1.0, top_p=1.0, max_tokens=8,
                 seeds=None):
        from megatron_dgpo.rollout.base import Completion

        out = []
        for j, _ in enumerate(prompts_token_ids):
            tokens = [[10 + (seeds[j] + k) % 50, 11 + (seeds[j] + 3 * k) % 40] for k in range(n)]
            out.append([Completion(j, t, [-1.0] * len(t), "stop") for t in tokens])
        return out

    def update_weights(self, groups):
        self.loaded.append([name for group in groups for name, _ in group])
        return None

    def sleep(self, keep_weights=False):
        pass

    def shutdown(self):
        pass


class AlternatingPool:
    def score(self, texts, truths, grader):
        return [1.0 if i % 2 else -1.0 for i in range(len(texts))]

    def close(self):
        pass


def _membership() -> dict:
    import torch.distributed as dist

    from megatron_dgpo.runtime import parallel

    seen = {}
    for layout in LAYOUTS:
        parallel.initialize_parallel(parallel.ParallelConfig(**layout), seed=3)
        try:
            seen[tuple(layout.values())] = dict(
                replica=parallel.replica_ranks(),
                replica_group=sorted(dist.get_process_group_ranks(parallel.replica_group())),
                dp=(parallel.data_parallel_rank(), parallel.data_parallel_size()),
                dp_cp=(parallel.data_parallel_rank(with_context_parallel=True),
                       parallel.data_parallel_size(with_context_parallel=True)),
                cp=(parallel.context_parallel_rank(), parallel.context_parallel_size()),
                tp=(parallel.tensor_parallel_rank(), parallel.tensor_parallel_size()),
                pp=(parallel.pipeline_parallel_rank(), parallel.pipeline_parallel_size()))
        finally:
            parallel.destroy_parallel()
    return seen


def _rollout(placement: str, hf_dir: str, parallel_config):
    from megatron_dgpo.rollout import replica
    from megatron_dgpo.rollout.config import RolloutConfig
    from megatron_dgpo.tasks.prompts import DataConfig

    config = RolloutConfig(engine="vllm" if placement == "colocated" else "hf",
                           placement=placement, group_size=GROUP_SIZE, max_response_tokens=8,
                           max_prompt_tokens=512)
    return replica.ReplicaRollout(config, DataConfig(), parallel_config, hf_dir, seed=5,
                                  batch_prompts=BATCH_PROMPTS)


def _digest(pairs) -> str:
    h = hashlib.sha256()
    for name, tensor in pairs:
        h.update(name.encode())
        h.update(tensor.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def replicas_under_cp(rank: int, world: int, hf_dir: str) -> dict:
    """Every check of tests/rollout/test_replica.py on a world of 4 gloo ranks."""
    import os

    from megatron_dgpo.convert import export_hf_groups, load_model
    from megatron_dgpo.rollout import replica
    from megatron_dgpo.runtime import comm, parallel

    os.environ["OMP_NUM_THREADS"] = "1"
    out = {"membership": _membership()}

    # CP = 2, DP = 2: each replica's samples on both of its CP ranks
    replica.build_engine = lambda *args, **kwargs: SeedEngine()
    replica.reward_pool = AlternatingPool
    config = parallel.ParallelConfig(context_parallel=2)
    parallel.initialize_parallel(config, seed=3)
    models = load_model(hf_dir)
    for placement in ("colocated", "separate"):
        rollout = _rollout(placement, hf_dir, config)
        batch = rollout.sample(0).batch
        rollout.refit(export_hf_groups(models, consumer=rollout.weight_consumer), version=1)
        out[placement] = dict(
            prompts=[tuple(p) for p in batch.prompt_tokens],
            responses=[tuple(r) for r in batch.response_tokens], rewards=list(batch.rewards),
            replica_prompts=list(rollout.replica_prompts), leader=rollout.leader,
            has_engine=rollout.engine is not None, consumer=rollout.weight_consumer,
            refit=rollout.engine.loaded if rollout.engine is not None else None)
        rollout.close()
    parallel.destroy_parallel()

    # TP = 2, CP = 2: the 'first' export gathers on CP rank 0 only; 'all' feeds every rank
    parallel.initialize_parallel(parallel.ParallelConfig(tensor_parallel=2, context_parallel=2),
                                 seed=3)
    models = load_model(hf_dir)
    calls = []
    real = comm.all_gather_

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    comm.all_gather_ = counted
    try:
        for consumer in ("first", "all"):
            calls.clear()
            pairs = [pair for group in export_hf_groups(models, consumer=consumer) for pair in group]
            out[f"export_{consumer}"] = dict(names=[n for n, _ in pairs], digest=_digest(pairs),
                                             gathers=len(calls))
    finally:
        comm.all_gather_ = real
        parallel.destroy_parallel()
    return out
