"""Which colocated engine a rank belongs to, which replica drives which dedicated engine, and
which prompts each engine samples.

Colocated engines (``VLLMConfig.placement="colocated"``) are vLLM ``external_launcher`` SPMD
groups of ``engine_tp`` *consecutive* global ranks: ranks ``[e * t, (e + 1) * t)`` form engine
``e``, so there are ``world / t`` engines. Every rank of an engine must call ``generate`` with
the same prompts and seeds; every rank feeds its own engine rank the full HF tensors
(``export_hf_groups(consumer="all")``: DP replicas hold identical weights, so any replica's
ranks can feed any engine).

Dedicated engines (``rollout.placement: dedicated``, ``DedicatedLayout``): the last
``rollout.num_gpus`` ranks form ``num_gpus / t`` engines, shared out evenly over the trainer's DP
replicas (the trainer and ``dgpo-plan`` check the same split).

Sharding a rollout batch of P prompts (each giving a whole group of ``n`` samples): engine e
takes the contiguous slice ``shard_prompts(P, E, e)`` (sizes differ by at most one), and a
prompt's sampling seed depends only on the run's seed and its global index in the prompt stream
(``prompt_seeds``), so the union of the engines' samples equals a single engine's samples for the
same batch and seed, whatever E is.

Seeds (``prompt_seeds``): the prompt with global index g (prompts consumed by earlier steps plus
its batch position) is sampled with seed ``(train.seed << 40) + g * group_size``. vLLM samples a
request's child j with seed ``seed + j`` (``vllm/v1/engine/parallel_sampling.py``), so sample j
of that prompt draws from stream ``(train.seed << 40) + g * group_size + j``: one stream per
(step, prompt, sample) for the whole run, shared by no other sample of this run or of a run with
another ``train.seed`` (each seed owns 2**40 streams), whatever the engine and rank counts.
With partial rollouts each later segment of a response has a stream of its own
(``response_seed``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLayout:
    """This rank's place among ``world // engine_tp`` colocated engines."""

    world_size: int
    rank: int
    engine_tp: int

    def __post_init__(self):
        if not (isinstance(self.engine_tp, int) and self.engine_tp >= 1):
            raise ValueError(f"rollout.tensor_parallel_size must be a positive int, got {self.engine_tp!r}")
        if self.world_size % self.engine_tp:
            raise ValueError(f"rollout.tensor_parallel_size={self.engine_tp} must divide the "
                             f"world size {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")

    @property
    def num_engines(self) -> int:
        return self.world_size // self.engine_tp

    @property
    def engine_index(self) -> int:
        return self.rank // self.engine_tp

    @property
    def is_engine_leader(self) -> bool:
        """The engine's first rank: the one that grades and keeps the engine's samples when the
        other TP ranks of the engine hold identical copies."""
        return self.rank % self.engine_tp == 0


@dataclass(frozen=True)
class DedicatedLayout:
    """Who drives which engine: ``num_engines`` engines of ``engine_tp`` rollout ranks, split
    evenly over the trainer's ``dp_size`` replicas."""

    rollout_ranks: int
    engine_tp: int
    dp_size: int

    def __post_init__(self):
        problem = dedicated_split_problem(self.rollout_ranks, self.engine_tp, self.dp_size)
        if problem:
            raise ValueError(problem)

    @property
    def num_engines(self) -> int:
        return self.rollout_ranks // self.engine_tp

    @property
    def engines_per_replica(self) -> int:
        return self.num_engines // self.dp_size

    @property
    def link_size(self) -> int:
        """Members of a replica's ``PeerGroup``: its leader and its engines' ranks."""
        return 1 + self.engines_per_replica * self.engine_tp

    def replica_of(self, rollout_rank: int) -> int:
        return rollout_rank // self.engine_tp // self.engines_per_replica

    def link_index(self, rollout_rank: int) -> int:
        return 1 + rollout_rank - self.replica_of(rollout_rank) * (self.link_size - 1)

    def engine_in_replica(self, rollout_rank: int) -> int:
        return rollout_rank // self.engine_tp % self.engines_per_replica

    def link_name(self, replica: int) -> str:
        return f"megatron_dgpo/rollout/replica{replica}"


def dedicated_split_problem(rollout_ranks: int, engine_tp: int, dp_size: int) -> str | None:
    """Why ``rollout_ranks`` ranks cannot be engines of ``engine_tp`` ranks shared out evenly over
    ``dp_size`` replicas (``DedicatedLayout``), naming the recipe keys; None when they can.
    ``dgpo-plan`` asks the same of every layout it proposes."""
    if rollout_ranks % engine_tp:
        return (f"rollout.num_gpus={rollout_ranks} must be a multiple of "
                f"rollout.tensor_parallel_size={engine_tp}")
    engines = rollout_ranks // engine_tp
    if engines % dp_size:
        return (f"rollout.num_gpus={rollout_ranks} gives {engines} engines of {engine_tp} GPUs, "
                f"which must be a multiple of the trainer's {dp_size} DP replicas (each replica "
                f"drives its own)")
    return None


def shard_prompts(num_prompts: int, num_engines: int, engine_index: int) -> range:
    """Engine ``engine_index``'s contiguous share of ``num_prompts`` prompts (whole groups);
    the first ``num_prompts % num_engines`` engines take one more."""
    if not 0 <= engine_index < num_engines:
        raise ValueError(f"engine_index {engine_index} outside [0, {num_engines})")
    base, extra = divmod(num_prompts, num_engines)
    start = engine_index * base + min(engine_index, extra)
    return range(start, start + base + (engine_index < extra))


SEED_STREAM_BITS = 40  # streams per train.seed: 2**40 ~ 1.1e12 (prompt, sample) pairs per run
MAX_TRAIN_SEED = 1 << (63 - SEED_STREAM_BITS)  # every seed stays below 2**63 (vLLM keeps int64)


def seed_root(train_seed: int) -> int:
    """The first sampling stream of a run: ``train_seed << SEED_STREAM_BITS``. Runs with
    different seeds own disjoint blocks of 2**40 streams; ``train_seed`` must lie in
    [0, 2**23) so that every seed is a non-negative int64 (vLLM's GPU sampler stores seeds as
    int64, ``torch.Generator.manual_seed`` takes up to 2**64 - 1)."""
    if not (isinstance(train_seed, int) and 0 <= train_seed < MAX_TRAIN_SEED):
        raise ValueError(f"train.seed must be an int in [0, {MAX_TRAIN_SEED}) (sampling seeds are "
                         f"train.seed << {SEED_STREAM_BITS} + stream), got {train_seed!r}")
    return train_seed << SEED_STREAM_BITS


def prompt_seeds(train_seed: int, prompts_consumed: int, positions, group_size: int) -> list[int]:
    """The sampling seeds of the step that starts at stream position ``prompts_consumed``, for
    its batch positions ``positions`` (pass as ``generate(seeds=..., n=group_size)``): position p
    is global prompt ``g = prompts_consumed + p`` and gets ``seed_root(train_seed) + g *
    group_size``. Spacing by the group size leaves room for the engine's per-sample streams
    (vLLM: child j takes ``seed + j``), so no two samples of the run share a stream, across
    prompts and across steps; the global index keeps seeds independent of the engine count."""
    if not (isinstance(group_size, int) and group_size >= 1):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    root = seed_root(train_seed)
    seeds = []
    for p in positions:
        g = int(prompts_consumed) + int(p)
        if not (g >= 0 and (g + 1) * group_size <= 1 << SEED_STREAM_BITS):
            raise ValueError(f"global prompt index {g} x group_size {group_size} is outside the "
                             f"run's 2**{SEED_STREAM_BITS} sampling streams")
        seeds.append(root + g * group_size)
    return seeds


SEGMENT_BITS = 32  # partial rollouts: a response's segment r >= 1 draws from stream (r << 32) + s


def response_seed(train_seed: int, position: int, group_size: int, sample: int,
                  segment: int = 0) -> int:
    """The sampling seed of segment ``segment`` of response ``sample`` of the prompt at global
    stream position ``position`` (``rollout.partial``: each run of tokens between two refits is
    a segment, drawn from a stream of its own). Segment 0 is ``prompt_seeds``' stream for that
    sample (a response never interrupted samples what ``generate(n=group_size)`` would);
    segment r >= 1 takes stream ``(r << 32) + position * group_size + sample``, so no two
    segments of the run share one (positions x group_size below 2**32, segments below 2**8)."""
    stream = int(position) * group_size + int(sample)
    if not (0 <= sample < group_size and 0 <= stream < 1 << SEGMENT_BITS
            and 0 <= segment < 1 << (SEED_STREAM_BITS - SEGMENT_BITS)):
        raise ValueError(f"response {sample} of global prompt {position} (group_size "
                         f"{group_size}), segment {segment}: outside the run's segment streams "
                         f"(position x group_size < 2**{SEGMENT_BITS}, segment < "
                         f"2**{SEED_STREAM_BITS - SEGMENT_BITS})")
    return seed_root(train_seed) + (int(segment) << SEGMENT_BITS) + stream


def engine_tensor_parallel(rollout_tp: int | None, *, tensor_parallel: int, pipeline_parallel: int,
                           data_parallel: int) -> int:
    """``rollout.tensor_parallel_size`` resolved: None = the trainer's TP x PP (one engine per DP
    replica; CP engines per replica under context parallelism), except with PP > 1 and DP > 1,
    where a replica's ranks are not consecutive (Megatron orders ranks tp-cp-dp-pp, PP
    outermost): then TP (one engine per stage and CP rank of a replica)."""
    if rollout_tp is not None:
        return rollout_tp
    if pipeline_parallel > 1 and data_parallel > 1:
        return tensor_parallel
    return tensor_parallel * pipeline_parallel


@dataclass(frozen=True)
class RolloutRole:
    """This rank's part in a step's rollout of ``num_prompts`` prompt groups.

    replica_prompts: the batch positions (a contiguous range, whole groups) its DP replica
        samples, grades and trains on; ``shard_prompts(P, DP, dp_rank)``.
    prompts: the positions this rank's engine samples (a sub-range of ``replica_prompts``;
        empty on ranks without an engine).
    has_engine: this rank builds an engine (every rank when colocated; the replica leader,
        i.e. the first rank of its replica group, for separate / transformers engines).
    grades: this rank grades its engine's samples and contributes them to the replica (one
        rank per engine).
    num_engines: engines in the job; active_engines: those with a non-empty share this step.
    """

    replica_prompts: range
    prompts: range
    has_engine: bool
    grades: bool
    num_engines: int
    active_engines: int


def rollout_role(*, colocated: bool, engine_tp: int, rank: int, world_size: int,
                 replica_ranks: list[int], dp_rank: int, dp_size: int,
                 num_prompts: int) -> RolloutRole:
    """Where the step's prompts are sampled (see ``RolloutRole``).

    Colocated: engines are blocks of ``engine_tp`` consecutive ranks (``EngineLayout``); each
    block must lie inside one DP replica (``replica_ranks``: this rank's TP x CP x PP ranks,
    ``parallel.replica_ranks()``), so that a replica's samples never cross DP. The
    replica's prompts are split over its engines with ``shard_prompts``. Separate: one engine
    per replica, on its leader.
    """
    replica = shard_prompts(num_prompts, dp_size, dp_rank)
    members = sorted(replica_ranks)
    if not colocated:
        leader = rank == members[0]
        return RolloutRole(replica, replica if leader else range(0), leader, leader, dp_size,
                           sum(len(shard_prompts(num_prompts, dp_size, d)) > 0 for d in range(dp_size)))
    layout = EngineLayout(world_size, rank, engine_tp)
    inside = set(members)
    engines = sorted({r // engine_tp for r in members})
    for e in engines:
        block = set(range(e * engine_tp, (e + 1) * engine_tp))
        if not block <= inside:
            raise ValueError(
                f"rollout.tensor_parallel_size={engine_tp}: an engine's ranks {sorted(block)} span "
                f"several data-parallel replicas (this replica's ranks: "
                f"{members}); it must divide parallel.tensor_parallel, or divide "
                f"parallel.tensor_parallel x parallel.context_parallel x "
                f"parallel.pipeline_parallel when pipeline_parallel = 1 or there is one "
                f"replica (or leave it unset)")
    per_replica = len(engines)
    sub = shard_prompts(len(replica), per_replica, engines.index(layout.engine_index))
    active = sum(min(len(shard_prompts(num_prompts, dp_size, d)), per_replica) for d in range(dp_size))
    return RolloutRole(replica, range(replica.start + sub.start, replica.start + sub.stop),
                       True, layout.is_engine_leader, layout.num_engines, active)
