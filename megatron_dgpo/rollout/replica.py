"""One data-parallel replica's rollout, as the trainer drives it:

    rollout = ReplicaRollout(cfg.rollout, cfg.data, cfg.parallel, hf_dir, seed=..., batch_prompts=...)
    if resumed or rollout.needs_first_refit: rollout.refit(models, version=step)
    batch, metrics, used = rollout.sample(prompts_consumed)   # the replica's whole prompt groups
    metrics = rollout.refit(models, version=step)       # each engine from its own model-parallel group
    rollout.close()

Every rank constructs it and calls every method (they are collective). Where the engines sit
and which batch positions each samples is ``placement.rollout_role``; a prompt is sampled with
a seed from ``train.seed`` and its global index in the prompt stream (``placement.prompt_seeds``),
so a step's samples do not depend on the number of engines and no two samples share a stream.
Only the replica's own samples cross ranks, and only inside its model-parallel group; the
metrics that must be job-wide travel as reduced tensors.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dgpo import comm, data
from megatron_dgpo.advantages import drop_degenerate_groups
from megatron_dgpo.convert import export_hf_weights
from megatron_dgpo.batch import Experience
from megatron_dgpo.optimizer import sync_params
from megatron_dgpo.parallel import ParallelConfig
from megatron_dgpo.recipe import DataConfig, RolloutConfig
from megatron_dgpo.rollout.generate import build_engine, generate_experience, reward_pool
from megatron_dgpo.rollout.placement import engine_tensor_parallel, rollout_role, seed_root
from megatron_dgpo.rollout.refit import RefitStats


class ReplicaRollout:
    """This rank's engine (if any), grader (if any) and part in each step's rollout.
    ``record_routing`` (``algorithm.routing_replay: r3``): the engines record each sample's
    MoE routing, which travels in the ``Experience``."""

    def __init__(self, rollout: RolloutConfig, data_config: DataConfig, parallel: ParallelConfig,
                 hf_dir: Path, *, seed: int, batch_prompts: int, record_routing: bool = False,
                 version: int = 0):
        from megatron.core import parallel_state as ps

        seed_root(seed)  # an unusable train.seed fails here, not after the engine started
        self.config, self.seed, self.batch_prompts = rollout, seed, batch_prompts
        self.version = version  # the step whose weights the engines hold
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.mp_group = ps.get_model_parallel_group()
        self.colocated = rollout.engine == "vllm" and rollout.placement == "colocated"
        engine_tp = engine_tensor_parallel(rollout.tensor_parallel_size,
                                           tensor_parallel=parallel.tensor_parallel,
                                           pipeline_parallel=parallel.pipeline_parallel,
                                           data_parallel=dp_size)
        self._placement = dict(colocated=self.colocated, engine_tp=engine_tp,
                               rank=dist.get_rank(), world_size=dist.get_world_size(),
                               model_parallel_ranks=dist.get_process_group_ranks(self.mp_group),
                               dp_rank=dp_rank, dp_size=dp_size)
        self.role = rollout_role(**self._placement, num_prompts=batch_prompts)
        self.engine = self.pool = None
        if self.role.has_engine:
            self.prompts, self.tokenizer = data.load_prompts(data_config, hf_dir,
                                                             rollout.max_prompt_tokens)
            self.engine = build_engine(rollout, hf_dir, seed=seed,
                                       placement="colocated" if self.colocated else "separate",
                                       tensor_parallel_size=engine_tp if self.colocated else None,
                                       refitted=True, record_routing=record_routing)
        # an engine started from dummy weights (colocated on GPU) is filled by a refit first
        self.needs_first_refit = comm.any_rank(
            self.engine is not None and not self.engine.holds_weights, self.mp_group)
        if self.role.grades:
            self.pool = reward_pool()
            kind = ("colocated vllm" if self.colocated else
                    "hf" if rollout.engine == "hf" else "separate vllm")
            width = engine_tp if self.colocated else rollout.tensor_parallel_size or 1
            print(f"dgpo-train: rank {dist.get_rank()} (DP replica {dp_rank}): {kind} engine of "
                  f"TP {width}, one of {self.role.num_engines}; samples batch positions "
                  f"{self.role.prompts.start}..{self.role.prompts.stop - 1} of {batch_prompts}",
                  file=sys.stderr, flush=True)

    @property
    def replica_prompts(self) -> range:
        """The batch positions (whole prompt groups) this rank's DP replica trains on."""
        return self.role.replica_prompts

    def share(self, num_items: int) -> range:
        """This rank's engine's share of ``num_items`` items split over the job's engines as a
        batch's prompts are (``placement.rollout_role``: by replica, then by engine inside it;
        empty without an engine): the held-out problems of an evaluation."""
        return rollout_role(**self._placement, num_prompts=num_items).prompts

    def sample(self, prompts_consumed: int, refill_rounds: int = 0
               ) -> tuple[Experience, dict[str, float], int]:
        """The replica's samples of the step that starts at stream position
        ``prompts_consumed`` (graded; identical on every rank of the replica), its metrics
        (``rollout/engines``, generation tokens/s per engine; with refill, the rounds and the
        discarded groups) and how many prompts of the stream the step used. Collective (world).

        ``refill_rounds`` (DAPO's dynamic sampling, ``algorithm.refill_rounds``): after each
        round, every batch position whose group is degenerate is sampled again from the same
        position of the next ``batch_prompts`` prompts of the stream, up to that many extra
        rounds. A position's fate depends only on its own stream, so the result is the same
        for any number of engines and replicas; only a vector of flags crosses ranks."""
        piece, generation_s, group = None, 0.0, self.config.group_size
        positions = list(self.role.prompts)
        if self.role.has_engine:
            piece, generation_s = self._generate(prompts_consumed, positions)
        rounds, discarded = 0, 0.0
        while rounds < refill_rounds:
            redo = self._degenerate_positions(piece, positions)
            if not redo.any():
                break
            rounds, discarded = rounds + 1, discarded + float(redo.sum())
            mine = [k for k, p in enumerate(positions) if redo[p]]
            if self.role.has_engine and mine:
                start = prompts_consumed + rounds * self.batch_prompts
                fresh, seconds = self._generate(start, [positions[k] for k in mine])
                generation_s += seconds
                if piece is not None:
                    piece = piece.replace_groups(mine, fresh, group)
        if self.role.has_engine:  # GPU: free the KV cache for training; CPU: logs once
            self.engine.sleep()
        # A rank that graded nothing takes its replica's samples from the ranks that did.
        batch = (piece if piece is not None else Experience([], [], [], [], [])).gather(self.mp_group)
        batch.policy_version = self.version
        metrics = self._engine_metrics(piece, generation_s)
        if refill_rounds:
            metrics.update({"rollout/refill_rounds": float(rounds),
                            "rollout/discarded_groups": discarded})
        return batch, metrics, (1 + rounds) * self.batch_prompts

    def _generate(self, start: int, positions: list[int]) -> tuple[Experience | None, float]:
        """This engine's groups at batch ``positions`` of the batch that starts at stream
        position ``start`` (None on ranks that do not grade), and the seconds it took."""
        indices = data.prompt_order(len(self.prompts), self.seed, start, self.batch_prompts)
        begin = time.perf_counter()
        piece = generate_experience(self.engine, self.pool, self.tokenizer, self.prompts,
                                    indices, positions, self.config,
                                    train_seed=self.seed, prompts_consumed=start)
        return piece, time.perf_counter() - begin

    def _degenerate_positions(self, piece: Experience | None, positions: list[int]) -> torch.Tensor:
        """[batch_prompts] bool, the same on every rank: which batch positions hold a group whose
        rewards are all equal (each grading rank flags its own positions; one MAX all-reduce)."""
        flags = torch.zeros(self.batch_prompts, dtype=torch.float64)
        if piece is not None:
            keep = drop_degenerate_groups(piece.rewards, self.config.group_size).keep
            for k, position in enumerate(positions):
                flags[position] = float(not keep[k * self.config.group_size])
        return comm.reduce_values(flags, "max") > 0

    def sleep_engines(self) -> None:
        """This rank's engine frees its accelerator memory, its weights kept in host memory,
        until the next ``sample`` wakes it: before a checkpoint save brings offloaded training
        state back (``train.offload_training_state``), so the two never share the GPU."""
        if self.role.has_engine:
            self.engine.sleep(keep_weights=True)

    def refit(self, models: list, version: int) -> dict[str, float]:
        """Stream the trained weights (of step ``version``) into this rank's engine, a collective over the replica's
        model-parallel group only (each replica feeds its own engines): colocated engines take
        the full HF tensors on every rank (each engine rank slices its TP shard); a separate or
        transformers engine on the replica leader takes them there. Returns ``refit/buckets``,
        ``refit/max_bucket_bytes``, ``refit/seconds`` (largest over the engines; collective:
        world), or {} without bucket statistics (transformers engine)."""
        sync_params(models)  # overlapped param gather: the updated weights, not the last forward's
        pairs = export_hf_weights(models, consumer="all" if self.colocated else "first")
        if self.engine is not None:
            stats = self.engine.update_weights(pairs)
        else:
            for _ in pairs:  # the other ranks take part in the gathers
                pass
            stats = None
        self.version = version
        keys = tuple(RefitStats().as_metrics())
        values = comm.reduce_values([stats.as_metrics()[k] if stats is not None else 0.0 for k in keys], "max")
        return dict(zip(keys, values.tolist())) if values.any() else {}

    def close(self) -> None:
        """Free the engine and the reward workers (Ctrl-C included)."""
        for closer in (self.engine and self.engine.shutdown, self.pool and self.pool.close):
            if closer:
                closer()

    def _engine_metrics(self, piece, generation_s: float) -> dict[str, float]:
        """``rollout/engines`` (engines that sampled this step) and generation tokens/s per
        engine (mean over them; each engine's leader contributes its own rate)."""
        rate = torch.zeros(2, dtype=torch.float64)
        if piece is not None and len(self.role.prompts):
            rate[0] = sum(len(r) for r in piece.response_tokens) / max(generation_s, 1e-9)
            rate[1] = 1.0
        rate = comm.reduce_values(rate, "sum")
        return {"rollout/engines": float(self.role.active_engines),
                "throughput/generation_tokens_per_s_per_engine": float(rate[0] / max(rate[1], 1.0))}
