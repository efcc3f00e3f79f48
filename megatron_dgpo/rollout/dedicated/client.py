"""The trainer ranks' handle on their replica's dedicated engines (``DedicatedRollout``): only
each replica's leader talks to them, over the replica's link."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.rollout.base import Sampled
from megatron_dgpo.rollout.dedicated.stream import StreamLeader
from megatron_dgpo.rollout.dedicated.wire import dedicated_layout, open_link, send_bucket
from megatron_dgpo.rollout.placement import shard_prompts
from megatron_dgpo.rollout.refit import RefitStats, refit_engines, run_bucketed_refit
from megatron_dgpo.runtime import comm, parallel as groups
from megatron_dgpo.runtime.hub import snapshot_of


class DedicatedRollout:
    """The trainer ranks' handle on their replica's dedicated engines; the same calls as
    ``ReplicaRollout`` (``sample``, ``refit``, ``close``) plus ``submit`` / ``collect`` for the
    one-step-off loop. Every trainer rank constructs it and calls every method (collective over
    the trainer's world); only each replica's leader talks to the engines."""

    def __init__(self, rollout, data_config, parallel, hf_dir: Path, *, seed: int,
                 batch_prompts: int, version: int = 0):
        self.config, self.batch_prompts, self.version = rollout, batch_prompts, version
        dp_rank, dp_size = groups.data_parallel_rank(), groups.data_parallel_size()
        self.replica_group = groups.replica_group()  # TP x CP x PP: one replica's samples
        self.layout = dedicated_layout(rollout, parallel, dist.get_world_size())
        self.replica_prompts = shard_prompts(batch_prompts, dp_size, dp_rank)
        self.leader = dist.get_rank() == groups.replica_ranks()[0]
        self.needs_first_refit = True  # the engines start from random weights
        self.weight_consumer = "first"  # the leader broadcasts the weights to its engines
        self.link, self._submitted, self._in_protocol = None, False, False
        self.stream = None  # the streaming schedule's buffer and engines (the leader's)
        if self.leader:
            self.link = open_link(self.layout, dp_rank, 0, parallel.timeout_minutes)
            # the trainer's folder, and the hub commit it is (if it is one), which an engine on
            # a node whose HF cache lacks the folder fetches into its own (runtime.hub)
            self.link.broadcast_object({"kind": "start", "hf_dir": str(hf_dir),
                                        "snapshot": snapshot_of(hf_dir)})
            print(f"dgpo-train: rank {dist.get_rank()} (DP replica {dp_rank}) drives "
                  f"{self.layout.engines_per_replica} dedicated engine(s) of TP "
                  f"{self.layout.engine_tp}, one of {self.layout.num_engines}; samples batch "
                  f"positions {self.replica_prompts.start}..{self.replica_prompts.stop - 1} of "
                  f"{batch_prompts}", file=sys.stderr, flush=True)
            if rollout.streaming:  # the engines open it once started
                self.stream = StreamLeader(self.link, self.layout, rollout,
                                           replica_prompts=self.replica_prompts,
                                           batch_prompts=batch_prompts)

    @property
    def submitted(self) -> bool:
        """A batch was submitted and not collected yet."""
        return self._submitted

    def submit(self, prompts_consumed: int, refill_rounds: int = 0) -> None:
        """Start the engines on the batch that begins at stream position ``prompts_consumed``
        (with the weights they hold); returns at once."""
        if self._submitted:
            raise RuntimeError("DedicatedRollout.submit: the previous batch was not collected")
        if self.leader:
            self._in_protocol = True
            self.link.broadcast_object({"kind": "generate", "start": int(prompts_consumed),
                                        "positions": list(self.replica_prompts),
                                        "batch_prompts": self.batch_prompts,
                                        "refill_rounds": int(refill_rounds)})
        self._submitted, self._refill = True, refill_rounds

    def collect(self) -> Sampled:
        """The submitted batch (``ReplicaRollout.sample``'s triple): waits for the engines,
        then shares the replica's samples inside its replica group. Collective."""
        if not self._submitted:
            raise RuntimeError("DedicatedRollout.collect: nothing was submitted")
        pieces, stats = [], []
        if self.leader:
            for i in range(self.layout.engines_per_replica):
                piece, engine_stats = self.link.recv_object(1 + i * self.layout.engine_tp)
                pieces.append(piece)
                stats.append(engine_stats)
            self._in_protocol = False
        self._submitted = False
        batch = (Experience.join(pieces) if self.leader else None)
        batch = (batch if batch is not None else Experience([], [], [], [], [])).gather(
            self.replica_group)
        batch.policy_version = comm.broadcast_object(
            pieces[0].policy_version if self.leader else None,
            src=groups.replica_ranks()[0], group=self.replica_group)
        return Sampled(batch, *self._metrics(stats))

    def sample(self, prompts_consumed: int, refill_rounds: int = 0) -> Sampled:
        """Synchronous: ``submit`` then ``collect``."""
        self.submit(prompts_consumed, refill_rounds)
        return self.collect()

    def take(self, step: int) -> Sampled:
        """The streaming schedule: step ``step``'s groups from the buffer (the leader waits
        for the engines until enough are eligible), shared inside the replica group, with the
        stream's metrics; ``prompts_used`` counts the prompts admitted since the last take.
        Collective (trainer world)."""
        piece, stats, batches = self.stream.take(step) if self.leader else (None, None, 0)
        batch = (piece if piece is not None else Experience([], [], [], [], [])).gather(
            self.replica_group)
        batches = comm.broadcast_object(batches, src=groups.replica_ranks()[0],
                                        group=self.replica_group)
        if self.config.mask_stale_segments:
            batch.stale_before = step - 1 - self.config.max_staleness
        return Sampled(batch, self._stream_metrics(stats), batches * self.batch_prompts)

    def buffer_state(self) -> dict | None:
        """The streaming buffer as the last refit left it (the leader's; None elsewhere)."""
        return self.stream.snapshot if self.stream is not None else None

    def load_buffer(self, state: dict | None, prompts_consumed: int) -> None:
        """Continue the stream from a checkpoint's buffer, or, without one, from stream
        position ``prompts_consumed``; before the first refit."""
        if self.stream is not None:
            self.stream.load(state, prompts_consumed)

    def _stream_metrics(self, stats: dict | None) -> dict[str, float]:
        """World-reduced metrics of the streaming schedule's step (engine times and rates,
        re-prefilled and dropped tokens, restarts, what the buffer holds, the trainer's wait)."""
        sums = torch.zeros(8, dtype=torch.float64)
        maxima = torch.zeros(2, dtype=torch.float64)  # engine generation s, trainer wait s
        if stats is not None:
            for s in stats["engines"]:
                sums[0] += s["tokens"] / max(s["generation_s"], 1e-9) if s["tokens"] else 0.0
                sums[1] += 1.0 if s["tokens"] else 0.0
                sums[2] += s["idle_s"]
                sums[3] += s["reprefill_tokens"]
                sums[7] += s["tokens"]
                maxima[0] = max(maxima[0], s["generation_s"])
            sums[4] += stats["restarted"]
            sums[5] += stats["dropped_tokens"]
            sums[6] += stats["buffered_groups"]
            maxima[1] = stats["wait_s"]
        sums, maxima = comm.reduce_values(sums, "sum"), comm.reduce_values(maxima, "max")
        return {"rollout/engines": float(self.layout.num_engines),
                "throughput/generation_tokens_per_s_per_engine": float(sums[0] / max(sums[1], 1.0)),
                "time/engine_generate": float(maxima[0]),
                "time/engine_idle": float(sums[2] / self.layout.num_engines),
                "time/rollout_wait": float(maxima[1]),
                "rollout/generated_tokens": float(sums[7]),
                "rollout/reprefill_tokens": float(sums[3]),
                "rollout/restarted_responses": float(sums[4]),
                "rollout/dropped_tokens": float(sums[5]),
                "rollout/buffered_groups": float(sums[6])}

    def _metrics(self, stats: list[dict]) -> tuple[dict[str, float], int]:
        """World-reduced engine metrics of a batch, and the prompts of the stream it used."""
        sums = torch.zeros(5, dtype=torch.float64)  # rate sum, engines, idle sum, discarded, active
        maxima = torch.zeros(2, dtype=torch.float64)  # generation seconds, refill rounds
        for s in stats:
            if s["prompts"]:
                sums[0] += s["tokens"] / max(s["generation_s"], 1e-9)
                sums[1] += 1
                sums[4] += 1
            sums[2] += s["idle_s"]
            sums[3] += s["discarded"]
            maxima[0] = max(maxima[0], s["generation_s"])
            maxima[1] = max(maxima[1], s["rounds"])
        sums, maxima = comm.reduce_values(sums, "sum"), comm.reduce_values(maxima, "max")
        metrics = {"rollout/engines": float(sums[4]),
                   "throughput/generation_tokens_per_s_per_engine": float(sums[0] / max(sums[1], 1.0)),
                   "time/engine_generate": float(maxima[0]),
                   "time/engine_idle": float(sums[2] / self.layout.num_engines)}
        if self._refill:
            metrics.update({"rollout/refill_rounds": float(maxima[1]),
                            "rollout/discarded_groups": float(sums[3])})
        return metrics, (1 + int(maxima[1])) * self.batch_prompts

    def sleep_engines(self) -> None:
        """Nothing to free: dedicated engines own their GPUs (``ReplicaRollout.sleep_engines``)."""

    def refit(self, weights, version: int) -> dict[str, float]:
        """Broadcast the trained weights of step ``version`` (the export, taken on the leader)
        to this replica's engines, in the colocated refit's buckets; between batches only.
        Collective (trainer world); returns ``refit/*`` as ``ReplicaRollout.refit``."""
        if self._submitted:
            raise RuntimeError("DedicatedRollout.refit: collect the batch in flight first (the "
                               "engines take weights between batches)")
        if self.stream is not None:  # the engines stop generating and hand back what they hold
            self._in_protocol = True
            self.stream.interrupt()
        metrics = refit_engines(weights, (lambda groups: self._broadcast_weights(groups, version))
                                if self.leader else None)
        if self.stream is not None:  # and go on with the new weights
            self.stream.resume(version)
            self._in_protocol = False
        self.version = version
        self.needs_first_refit = False
        return metrics

    def _broadcast_weights(self, weights, version: int) -> RefitStats:
        """Leader: the ``refit`` command, the buckets, ``end``; raises the engines' first error."""
        self._in_protocol = True
        if self.stream is not None:
            self.stream.before_link()
        self.link.broadcast_object({"kind": "refit", "version": int(version)})
        stats = run_bucketed_refit(weights, self.config.refit_bucket_bytes,
                                   lambda bucket: send_bucket(self.link, bucket))
        self.link.broadcast_object({"kind": "end"})
        answers = [self.link.recv_object(i) for i in range(1, self.layout.link_size)]
        self._in_protocol = False
        errors = [a for a in answers if a != "ok"]
        if errors:
            raise RuntimeError(f"refit of the dedicated engines failed: {errors[0]}")
        return stats

    def close(self) -> None:
        """Stop the engines (their ranks exit 0). After an error in the middle of a command the
        engines are left to torchrun, which ends them with the failing trainer."""
        if self.link is not None and not self._in_protocol and not self._submitted:
            if self.stream is not None:
                self.stream.before_link()
            self.link.broadcast_object({"kind": "stop"})
            for i in range(1, self.layout.link_size):  # every engine rank has shut down
                self.link.recv_object(i)
            if self.stream is not None:
                self.stream.close()
        self.link = None
