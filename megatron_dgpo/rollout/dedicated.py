"""Dedicated rollout engines: vLLM on GPUs of their own, outside the trainer's world, refitted by
a weight broadcast, optionally generating one batch ahead (``rollout.placement: dedicated``).

    torchrun world  [ trainer ranks 0 .. T-1           | rollout ranks T .. T+R-1              ]
                      Megatron's world (TP x PP x DP)    E = R / t engines of t ranks (vLLM TP)

``parallel.split_world`` gives each side its own default world, so Megatron and vLLM
(``external_launcher`` over the rollout ranks, as a colocated engine) each see only their own
ranks. DP replica d owns engines [d k, (d + 1) k), k = E / D, and talks to them through a
``comm.PeerGroup`` of 1 + k t members: index 0 is the replica's leader (the first rank of its
model-parallel group, where ``export_hf_weights(consumer="first")`` delivers the full HF
tensors), then the engines' ranks in order. Only the replica's own samples reach it (samples
never cross DP) and each replica refits its own engines: nothing funnels through global rank 0.
The link is tried when it is made: ``PeerGroup`` sends one checked broadcast on its tensor
channel at creation (NCCL opens its communicator there), so a broken link between trainer and
engine nodes fails at start with the group's name, not after the collective timeout at the
first refit.

Protocol: the leader broadcasts a command, every engine rank takes part.

* ``start`` (once, ``hf_dir``): the engines build vLLM from the policy's config with random
  weights (the first refit fills them) and load the prompts.
* ``generate`` (``start``, ``positions``, ``batch_prompts``, ``refill_rounds``): engine i of
  the replica samples its contiguous share of the replica's batch positions with the seeds of
  their global prompt index (``placement.prompt_seeds``, so the samples are those of any other
  placement), its leader grades them and *sends* them back. The trainer's leader receives them
  when it needs them (``collect``): meanwhile the engines generate and the trainer trains.
* ``refit`` (``version``), then per bucket ``bucket`` (the tensors' names, shapes, dtypes) and
  one tensor broadcast of the bucket's bytes, then ``end``: the buckets are
  ``refit.bucket_named_tensors``' (a fused q/k/v, gate/up or experts group is never split) and
  each is reloaded in place as a colocated engine's (``VLLMEngine.load_bucket``). Every engine
  rank answers ``ok`` or its error, which the leader raises.
* ``stop``: the engines shut down and their ranks exit 0.

One-step-off (``rollout.max_staleness: 1``, the trainer's loop): ``submit`` batch k+1 with the
engines' weights of step k-1 before the update of step k, ``collect`` it after; the refit with
step k's weights follows, between batches. A batch carries the version of the weights that
sampled it (``Experience.policy_version``). The engines report the time they waited for a
command before each batch (``time/engine_idle``) and their generation time
(``time/engine_generate``); the trainer times its own wait (``time/rollout_wait``).
A checkpoint keeps the batch generated ahead (``save_ahead``), so a resumed run continues with
the very samples the uninterrupted run used.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dgpo import comm, data
from megatron_dgpo.batch import Experience
from megatron_dgpo.rollout.base import Sampled
from megatron_dgpo.rollout.generate import (build_engine, degenerate_groups, generate_experience,
                                            refill_degenerate_groups, reward_pool)
from megatron_dgpo.rollout.placement import DedicatedLayout, shard_prompts
from megatron_dgpo.rollout.refit import RefitStats, refit_engines, run_bucketed_refit

AHEAD_DIR = "rollout_ahead"
"""A checkpoint's folder for the batch generated ahead (one file per DP replica)."""

_ALIGN = 16  # bytes: each tensor of a broadcast bucket starts aligned for any dtype's view


def _layout(rollout_config, parallel, trainer_size: int) -> DedicatedLayout:
    return DedicatedLayout(rollout_config.num_gpus, rollout_config.tensor_parallel_size or 1,
                           trainer_size // (parallel.tensor_parallel * parallel.pipeline_parallel))


def _device_backend() -> str:
    return "gloo" if comm.device_of().type == "cpu" else "nccl"


# ------------------------------------------------------------------------------ engine side


def serve(cfg) -> int:
    """The main of a rollout rank (``RunConfig`` ``cfg``): join the rollout world and this
    engine's replica, then run commands until ``stop``. Returns 0."""
    from megatron_dgpo.parallel import engine_group, init_distributed, launch_store, split_world

    rollout = cfg.rollout
    init_distributed(timeout_minutes=cfg.parallel.timeout_minutes,
                     watchdog_minutes=cfg.parallel.watchdog_minutes,
                     tensor_parallel=1,  # Megatron's CUDA_DEVICE_MAX_CONNECTIONS is not vLLM's
                     rollout_ranks=rollout.num_gpus)
    side = split_world(rollout.num_gpus)
    layout = _layout(rollout, cfg.parallel, side.trainer_size)
    group = engine_group(layout.engine_tp)  # before the engine: a collective of the rollout world
    replica = layout.replica_of(side.rank)
    link = comm.PeerGroup(launch_store(cfg.parallel.timeout_minutes), layout.link_name(replica),
                          layout.link_index(side.rank), layout.link_size,
                          device_backend=_device_backend(),
                          timeout=timedelta(minutes=cfg.parallel.timeout_minutes))
    server = _EngineServer(cfg, layout, link, group, leader=side.rank % layout.engine_tp == 0,
                           engine_index=layout.engine_in_replica(side.rank))
    try:
        server.run()
    finally:
        server.close()
    return 0


class _EngineServer:
    """One engine rank: builds vLLM on ``start``, then generates and refits on command."""

    def __init__(self, cfg, layout: DedicatedLayout, link, group, *, leader: bool,
                 engine_index: int):
        self.cfg, self.layout, self.link, self.group = cfg, layout, link, group
        self.leader, self.engine_index = leader, engine_index
        self.engine = self.pool = None
        self.version = 0

    def run(self) -> None:
        # idle: the wall time between two batches' reports not spent generating or refitting
        # (waiting for a command, or for the trainer to take the previous batch)
        last_report, busy = time.perf_counter(), 0.0
        while True:
            command = self.link.broadcast_object(None)
            kind, begin = command["kind"], time.perf_counter()
            if kind == "start":
                self._start(Path(command["hf_dir"]))
                last_report = time.perf_counter()
            elif kind == "generate":
                piece, stats = self._generate(command)
                now = time.perf_counter()
                stats["idle_s"] = max(now - last_report - busy - (now - begin), 0.0)
                last_report, busy = now, 0.0
                if self.leader:
                    self.link.send_object((piece, stats), 0)
            elif kind == "refit":
                answer = self._refit(command["version"])
                busy += time.perf_counter() - begin
                self.link.send_object(answer, 0)
            elif kind == "stop":
                self.close()
                self.link.send_object("stopped", 0)  # before the trainer exits: a trainer that
                return  # exits 75 first would have torchrun kill this rank (-15)
            else:
                raise ValueError(f"dedicated engine: unknown command {kind!r}")

    def _start(self, hf_dir: Path) -> None:
        rollout = self.cfg.rollout
        self.prompts, self.tokenizer = data.load_prompts(self.cfg.data, hf_dir,
                                                         rollout.max_prompt_tokens)
        self.engine = build_engine(rollout, hf_dir, seed=self.cfg.train.seed, placement="colocated",
                                   tensor_parallel_size=self.layout.engine_tp, refitted=True,
                                   dedicated=True)
        if self.leader:
            self.pool = reward_pool()
            print(f"dgpo-train: dedicated engine {dist.get_rank() // self.layout.engine_tp} of "
                  f"{self.layout.num_engines} (TP {self.layout.engine_tp}) on rollout rank "
                  f"{dist.get_rank()}", file=sys.stderr, flush=True)

    def _generate(self, command: dict) -> tuple[Experience | None, dict]:
        """This engine's share of the replica's positions, with DAPO's refill rounds (a
        position's fate depends only on its own stream: the same as on any placement)."""
        start, batch_prompts = command["start"], command["batch_prompts"]
        positions = command["positions"]
        mine = [positions[j] for j in shard_prompts(len(positions), self.layout.engines_per_replica,
                                                    self.engine_index)]
        begin, group = time.perf_counter(), self.cfg.rollout.group_size

        def redo(piece: Experience | None) -> tuple[list[int], int]:
            # the engine's leader grades; its TP peers sample again what it says
            groups = comm.broadcast_object(
                None if piece is None else degenerate_groups(piece, group),
                src=dist.get_rank() - dist.get_rank() % self.layout.engine_tp, group=self.group)
            return groups, len(groups)

        piece, rounds, discarded = refill_degenerate_groups(
            self._sample(start, batch_prompts, mine), mine, command["refill_rounds"],
            start=start, batch_prompts=batch_prompts, group_size=group,
            sample=lambda at, share: self._sample(at, batch_prompts, share), redo=redo)
        if piece is not None:
            piece.policy_version = self.version
        tokens = sum(len(r) for r in piece.response_tokens) if piece is not None else 0
        return piece, {"generation_s": time.perf_counter() - begin, "tokens": tokens,
                       "prompts": len(mine), "rounds": rounds, "discarded": discarded}

    def _sample(self, start: int, batch_prompts: int, positions: list[int]) -> Experience | None:
        if not positions:
            return Experience([], [], [], [], []) if self.leader else None
        indices = data.prompt_order(len(self.prompts), self.cfg.train.seed, start, batch_prompts)
        return generate_experience(self.engine, self.pool, self.tokenizer, self.prompts, indices,
                                   positions, self.cfg.rollout, train_seed=self.cfg.train.seed,
                                   prompts_consumed=start)

    def _refit(self, version: int) -> str:
        """Receive buckets until ``end`` and reload each; "ok" or the first error (the
        remaining buckets are still received, so the trainer's broadcasts never hang)."""
        error = None
        try:
            self.engine.begin_refit()
        except Exception as exc:  # noqa: BLE001 - reported to the trainer, which raises
            error = f"{type(exc).__name__}: {exc}"
        while True:
            message = self.link.broadcast_object(None)
            if message["kind"] == "end":
                break
            bucket = receive_bucket(self.link, message["tensors"])
            if error is None:
                try:
                    self.engine.load_bucket(bucket)
                except Exception as exc:  # noqa: BLE001
                    error = f"{type(exc).__name__}: {exc}"
        if error is None:
            try:
                self.engine.end_refit()
                self.version = version
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"
        return "ok" if error is None else f"rollout rank {dist.get_rank()}: {error}"

    def close(self) -> None:
        for closer in (self.engine and self.engine.shutdown, self.pool and self.pool.close):
            if closer:
                closer()
        self.engine = self.pool = None


# ------------------------------------------------------------------------ weight broadcast


def _bucket_layout(meta: list) -> tuple[list[int], int]:
    """Byte offsets of a bucket's tensors in its flat buffer (each aligned) and its size."""
    offsets, size = [], 0
    for _, shape, dtype in meta:
        offsets.append(size)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=_dtype(dtype)).element_size()
        size += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, size


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def send_bucket(link, bucket: list[tuple[str, torch.Tensor]]) -> None:
    """Leader: one bucket of HF tensors to every engine rank: its names, shapes and dtypes as an
    object, then its bytes as one tensor broadcast on the device's backend."""
    meta = [(name, tuple(t.shape), str(t.dtype)) for name, t in bucket]
    link.broadcast_object({"kind": "bucket", "tensors": meta})
    offsets, size = _bucket_layout(meta)
    flat = torch.empty(size, dtype=torch.uint8, device=link.device)
    for (_, tensor), offset in zip(bucket, offsets):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[offset:offset + raw.numel()].copy_(raw)
    link.broadcast_(flat, 0)


def receive_bucket(link, meta: list) -> list[tuple[str, torch.Tensor]]:
    """Engine rank: the bucket ``send_bucket`` broadcasts, as (name, tensor) views of one buffer
    on this rank's device."""
    offsets, size = _bucket_layout(meta)
    flat = link.broadcast_(torch.empty(size, dtype=torch.uint8, device=link.device), 0)
    pairs = []
    for (name, shape, dtype), offset in zip(meta, offsets):
        dtype = _dtype(dtype)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        pairs.append((name, flat[offset:offset + nbytes].view(dtype).view(shape)))
    return pairs


# ----------------------------------------------------------------------------- trainer side


class DedicatedRollout:
    """The trainer ranks' handle on their replica's dedicated engines; the same calls as
    ``ReplicaRollout`` (``sample``, ``refit``, ``close``) plus ``submit`` / ``collect`` for the
    one-step-off loop. Every trainer rank constructs it and calls every method (collective over
    the trainer's world); only each replica's leader talks to the engines."""

    def __init__(self, rollout, data_config, parallel, hf_dir: Path, *, seed: int,
                 batch_prompts: int, version: int = 0):
        from megatron.core import parallel_state as ps

        from megatron_dgpo.parallel import launch_store

        self.config, self.batch_prompts, self.version = rollout, batch_prompts, version
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.mp_group = ps.get_model_parallel_group()
        self.layout = _layout(rollout, parallel, dist.get_world_size())
        self.replica_prompts = shard_prompts(batch_prompts, dp_size, dp_rank)
        self.leader = dist.get_rank() == min(dist.get_process_group_ranks(self.mp_group))
        self.needs_first_refit = True  # the engines start from random weights
        self.weight_consumer = "first"  # the leader broadcasts the weights to its engines
        self.link, self._submitted, self._in_protocol = None, False, False
        if self.leader:
            self.link = comm.PeerGroup(launch_store(parallel.timeout_minutes),
                                       self.layout.link_name(dp_rank), 0, self.layout.link_size,
                                       device_backend=_device_backend(),
                                       timeout=timedelta(minutes=parallel.timeout_minutes))
            self.link.broadcast_object({"kind": "start", "hf_dir": str(hf_dir)})
            print(f"dgpo-train: rank {dist.get_rank()} (DP replica {dp_rank}) drives "
                  f"{self.layout.engines_per_replica} dedicated engine(s) of TP "
                  f"{self.layout.engine_tp}, one of {self.layout.num_engines}; samples batch "
                  f"positions {self.replica_prompts.start}..{self.replica_prompts.stop - 1} of "
                  f"{batch_prompts}", file=sys.stderr, flush=True)

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
        then shares the replica's samples inside its model-parallel group. Collective."""
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
        batch = (batch if batch is not None else Experience([], [], [], [], [])).gather(self.mp_group)
        batch.policy_version = comm.broadcast_object(
            pieces[0].policy_version if self.leader else None,
            src=min(dist.get_process_group_ranks(self.mp_group)), group=self.mp_group)
        return Sampled(batch, *self._metrics(stats))

    def sample(self, prompts_consumed: int, refill_rounds: int = 0) -> Sampled:
        """Synchronous: ``submit`` then ``collect``."""
        self.submit(prompts_consumed, refill_rounds)
        return self.collect()

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
        metrics = refit_engines(weights, (lambda pairs: self._broadcast_weights(pairs, version))
                                if self.leader else None)
        self.version = version
        self.needs_first_refit = False
        return metrics

    def _broadcast_weights(self, weights, version: int) -> RefitStats:
        """Leader: the ``refit`` command, the buckets, ``end``; raises the engines' first error."""
        self._in_protocol = True
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
            self.link.broadcast_object({"kind": "stop"})
            for i in range(1, self.layout.link_size):  # every engine rank has shut down
                self.link.recv_object(i)
        self.link = None


# ----------------------------------------------------------------- the batch generated ahead


def save_ahead(folder: Path, ahead, *, dp_rank: int, dp_size: int, leader: bool) -> None:
    """Into a checkpoint being written (``folder``): this replica's batch generated ahead
    (``collect``'s triple), written by the replica's leader."""
    if ahead is None or not leader:
        return
    batch, metrics, used = ahead
    (folder / AHEAD_DIR).mkdir(exist_ok=True)
    with open(folder / AHEAD_DIR / f"replica{dp_rank}.pt", "wb") as handle:
        torch.save({"batch": {k: v for k, v in vars(batch).items()
                              if k not in ("advantages", "loss_weights")},
                    "metrics": metrics, "prompts_used": used, "dp_size": dp_size}, handle)
        handle.flush()
        os.fsync(handle.fileno())  # on disk before the checkpoint is published


def load_ahead(checkpoint: Path | None, *, replica_prompts: range, group_size: int):
    """The batch a checkpoint saved as generated ahead, cut to this replica's prompts (the
    saving run may have had another DP size: the replicas' files are joined in order, which
    is the batch's position order), or None when it has none."""
    folder = None if checkpoint is None else Path(checkpoint) / AHEAD_DIR
    if folder is None or not folder.is_dir():
        return None
    first = torch.load(folder / "replica0.pt", weights_only=False)
    saved = [first] + [torch.load(folder / f"replica{d}.pt", weights_only=False)
                       for d in range(1, first["dp_size"])]
    batches = []
    for record in saved:
        batch = Experience(**{k: v for k, v in record["batch"].items() if k != "policy_version"})
        batch.policy_version = record["batch"].get("policy_version")
        batches.append(batch)
    joined = Experience.join(batches)
    if len(joined) < replica_prompts.stop * group_size:
        print(f"dgpo-train: {folder} holds {len(joined)} samples, fewer than this recipe's batch "
              f"needs ({replica_prompts.stop} x {group_size}): the recipe changed, the next batch "
              f"is sampled again", file=sys.stderr, flush=True)
        return None
    lo, hi = replica_prompts.start * group_size, replica_prompts.stop * group_size
    mine = Experience(joined.prompt_tokens[lo:hi], joined.response_tokens[lo:hi],
                      joined.rollout_logprobs[lo:hi], joined.rewards[lo:hi], joined.truncated[lo:hi],
                      routed_experts=None if joined.routed_experts is None else joined.routed_experts[lo:hi])
    mine.policy_version = batches[0].policy_version
    return Sampled(mine, first["metrics"], first["prompts_used"])
