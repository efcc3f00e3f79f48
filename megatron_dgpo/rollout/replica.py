"""One data-parallel replica's rollout on engines in the trainer's own ranks (colocated, or a
separate engine on the replica's leader), as the trainer drives it (``base.Rollout``):

    rollout = ReplicaRollout(cfg.rollout, cfg.data, cfg.parallel, hf_dir, seed=..., batch_prompts=...)
    weights = export_hf_groups(models, consumer=rollout.weight_consumer)  # after sync_params
    if resumed or rollout.needs_first_refit: rollout.refit(weights, version=step)
    batch, metrics, used = rollout.sample(prompts_consumed)   # the replica's whole prompt groups
    metrics = rollout.refit(weights, version=step)      # each engine from its replica's ranks
    rollout.close()

Every rank constructs it and calls every method (they are collective). Where the engines sit
and which batch positions each samples is ``placement.rollout_role``; a prompt is sampled with
a seed from ``train.seed`` and its global index in the prompt stream (``placement.prompt_seeds``),
so a step's samples do not depend on the number of engines (token for token on CPU; in
distribution on a GPU, whose bf16 logits depend on the batch) and no two samples share a stream.
Only the replica's own samples cross ranks, and only inside its replica group (TP x CP x PP:
CP ranks train on the same samples); the metrics that must be job-wide travel as reduced
tensors.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.rollout.base import Sampled
from megatron_dgpo.rollout.config import RolloutConfig
from megatron_dgpo.rollout.generate import (build_engine, degenerate_groups, generate_experience,
                                            refill_degenerate_groups, reward_pool)
from megatron_dgpo.rollout.placement import engine_tensor_parallel, rollout_role, seed_root
from megatron_dgpo.rollout.refit import refit_engines
from megatron_dgpo.runtime import comm, parallel as groups
from megatron_dgpo.runtime.parallel import ParallelConfig
from megatron_dgpo.tasks import prompts


class ReplicaRollout:
    """This rank's engine (if any), grader (if any) and part in each step's rollout.
    ``record_routing`` (``algorithm.routing_replay: r3``): the engines record each sample's
    MoE routing, which travels in the ``Experience``."""

    def __init__(self, rollout: RolloutConfig, data_config: prompts.DataConfig,
                 parallel: ParallelConfig, hf_dir: Path, *, seed: int, batch_prompts: int,
                 record_routing: bool = False, version: int = 0):
        seed_root(seed)  # an unusable train.seed fails here, not after the engine started
        self.config, self.seed, self.batch_prompts = rollout, seed, batch_prompts
        self.version = version  # the step whose weights the engines hold
        dp_rank, dp_size = groups.data_parallel_rank(), groups.data_parallel_size()
        self.replica_group = groups.replica_group()
        self.colocated = rollout.engine == "vllm" and rollout.placement == "colocated"
        engine_tp = engine_tensor_parallel(rollout.tensor_parallel_size,
                                           tensor_parallel=parallel.tensor_parallel,
                                           pipeline_parallel=parallel.pipeline_parallel,
                                           data_parallel=dp_size)
        self._placement = dict(colocated=self.colocated, engine_tp=engine_tp,
                               rank=dist.get_rank(), world_size=dist.get_world_size(),
                               replica_ranks=groups.replica_ranks(),
                               dp_rank=dp_rank, dp_size=dp_size)
        self.role = rollout_role(**self._placement, num_prompts=batch_prompts)
        self.leader = dist.get_rank() == min(self._placement["replica_ranks"])
        self.weight_consumer = "all" if self.colocated else "first"  # colocated: each rank's engine
        self.engine = self.pool = None
        self._request = None  # the batch submitted and not collected yet
        if self.role.has_engine:
            self.prompts, self.tokenizer = prompts.load_prompts(data_config, hf_dir,
                                                             rollout.max_prompt_tokens)
            self.engine = build_engine(rollout, hf_dir, seed=seed,
                                       placement="colocated" if self.colocated else "separate",
                                       tensor_parallel_size=engine_tp if self.colocated else None,
                                       refitted=True, record_routing=record_routing)
        # an engine started from dummy weights (colocated on GPU) is filled by a refit first
        self.needs_first_refit = comm.any_rank(
            self.engine is not None and not self.engine.holds_weights, self.replica_group)
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

    def sample(self, prompts_consumed: int, refill_rounds: int = 0) -> Sampled:
        """The replica's samples of the step that starts at stream position
        ``prompts_consumed`` (graded; identical on every rank of the replica), its metrics
        (``rollout/engines``, generation tokens/s per engine; with refill, the rounds and the
        discarded groups) and how many prompts of the stream the step used. Collective (world).
        With ``refill_rounds`` (``generate.refill_degenerate_groups``) only a vector of flags
        over the batch's positions crosses ranks."""
        positions, seconds = list(self.role.prompts), []

        def generate(start: int, share: list[int]) -> Experience | None:
            begin = time.perf_counter()
            indices = prompts.prompt_order(len(self.prompts), self.seed, start, self.batch_prompts)
            piece = generate_experience(self.engine, self.pool, self.tokenizer, self.prompts,
                                        indices, share, self.config,
                                        train_seed=self.seed, prompts_consumed=start)
            seconds.append(time.perf_counter() - begin)
            return piece

        piece = generate(prompts_consumed, positions) if self.role.has_engine else None
        piece, rounds, discarded = refill_degenerate_groups(
            piece, positions, refill_rounds, start=prompts_consumed,
            batch_prompts=self.batch_prompts, group_size=self.config.group_size,
            sample=generate, redo=lambda p: self._degenerate_positions(p, positions))
        if self.role.has_engine:  # GPU: free the KV cache for training; CPU: logs once
            self.engine.sleep()
        # A rank that graded nothing takes its replica's samples from the ranks that did.
        batch = (piece if piece is not None else Experience([], [], [], [], [])).gather(
            self.replica_group)
        batch.policy_version = self.version
        metrics = self._engine_metrics(piece, sum(seconds))
        if refill_rounds:
            metrics.update({"rollout/refill_rounds": float(rounds),
                            "rollout/discarded_groups": float(discarded)})
        return Sampled(batch, metrics, (1 + rounds) * self.batch_prompts)

    @property
    def submitted(self) -> bool:
        """A batch was submitted and not collected yet."""
        return self._request is not None

    def submit(self, prompts_consumed: int, refill_rounds: int = 0) -> None:
        """``sample``'s batch, sampled at ``collect``: these engines share the trainer's ranks,
        so they generate while the trainer waits, with the weights they hold then (the refit
        comes after ``collect``)."""
        if self._request is not None:
            raise RuntimeError("ReplicaRollout.submit: the previous batch was not collected")
        self._request = (prompts_consumed, refill_rounds)

    def collect(self) -> Sampled:
        """The submitted batch, sampled now."""
        if self._request is None:
            raise RuntimeError("ReplicaRollout.collect: nothing was submitted")
        request, self._request = self._request, None
        return self.sample(*request)

    def _degenerate_positions(self, piece: Experience | None, positions: list[int]
                              ) -> tuple[list[int], int]:
        """Which of ``positions`` hold a degenerate group, and how many batch positions do on
        the whole job (each grading rank flags its own; one MAX all-reduce of the flags)."""
        flags = torch.zeros(self.batch_prompts, dtype=torch.float64)
        if piece is not None:
            for k in degenerate_groups(piece, self.config.group_size):
                flags[positions[k]] = 1.0
        redo = comm.reduce_values(flags, "max") > 0
        return [k for k, p in enumerate(positions) if redo[p]], int(redo.sum())

    def sleep_engines(self) -> None:
        """This rank's engine frees its accelerator memory, its weights kept in host memory,
        until the next ``sample`` wakes it: before a checkpoint save brings offloaded training
        state back (``train.offload_training_state``), so the two never share the GPU."""
        if self.role.has_engine:
            self.engine.sleep(keep_weights=True)

    def refit(self, weights, version: int) -> dict[str, float]:
        """The trained weights of step ``version`` (the export, ``weight_consumer``'s ranks
        taking the pairs) into this rank's engine, a collective over the replica's
        ranks only (each replica feeds its own engines): colocated engines take
        the full HF tensors on every rank (each engine rank slices its TP shard); a separate or
        transformers engine on the replica leader takes them there. Returns ``refit/buckets``,
        ``refit/max_bucket_bytes``, ``refit/seconds`` (largest over the engines; collective:
        world), or {} without bucket statistics (transformers engine)."""
        load = self.engine.update_weights if self.engine is not None else None
        metrics = refit_engines(weights, load)
        self.version = version
        return metrics

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
