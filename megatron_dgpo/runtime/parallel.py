"""Set up and tear down Megatron-Core's model-parallel state (TP x CP x PP (x VPP) x DP), and
the package's one vocabulary of its process groups, ranks and sizes.

The backend follows the hardware: nccl with a GPU, gloo without one (then the CPU
compatibility patches of ``megatron_dgpo.runtime.cpu`` are applied). DP is what is left of the world:
``world_size / (tp * cp * pp)``. Megatron's rank order is ``tp-cp-ep-dp-pp``: TP ranks are adjacent,
PP is outermost. MoE layers' experts use a second decomposition of each pipeline stage,
``etp-ep-edp`` (expert TP, expert parallel, expert DP): dense weights are replicated over DP,
experts over the expert-DP ranks only. Under ``torchrun --max-restarts N`` each restart attempt gets its own store
prefix, so a restarted job can form its process group again (``_attempt_store``).

Only this module reads ``megatron.core.parallel_state`` (``tests/test_architecture.py``): the
rest of the package asks the accessors below (``tensor_parallel_group()``,
``data_parallel_rank(with_context_parallel=...)``, ``replica_group()``, ...). A *replica* is the
ranks that share one data-parallel index: TP x CP x PP ranks (``replica_group``), which train on
the same samples; the DP rank and size that split a batch are those without CP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated

import torch
import torch.distributed as dist

from megatron_dgpo.runtime.config import Bounds, check_bounds
from megatron_dgpo.runtime.cpu import apply_cpu_compat, cpu_only, seed_model_parallel_rng
from megatron_dgpo.runtime.gpu_flags import cuda_launch_env, require_usable_cuda
from megatron_dgpo.runtime.watchdog import start_heartbeat

DEFAULT_TIMEOUT_MINUTES = 120.0
"""Collective timeout: long enough for one step's generation on the slowest engine (a rank may
wait in a collective while others finish their share of the rollout batch). NCCL's own
default (10 minutes) kills long-response jobs during the first step."""


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes. DP is derived from the world size."""

    tensor_parallel: Annotated[int, Bounds(ge=1)] = 1
    """Tensor-parallel size: each layer's matrices (and the vocabulary) split over this many
    GPUs of a node. Must divide the attention heads and KV groups."""
    pipeline_parallel: Annotated[int, Bounds(ge=1)] = 1
    """Pipeline stages: layers split into this many consecutive groups (1F1B schedule)."""
    virtual_pipeline_parallel: Annotated[int | None, Bounds(ge=1)] = None
    """Model chunks per pipeline rank (interleaved 1F1B); None or 1 means no VPP."""
    context_parallel: Annotated[int, Bounds(ge=1)] = 1
    """Context-parallel size: every packed sequence split over this many ranks in Megatron's
    load-balanced 2 x CP chunks (attention exchanges keys and values; nothing else crosses
    ranks). For long responses. Data-parallel size = world / (TP x CP x PP)."""
    expert_parallel: Annotated[int, Bounds(ge=1)] = 1
    """Expert-parallel size (MoE models): each MoE layer's routed experts split over this many
    ranks of a pipeline stage, tokens exchanged by the token dispatcher. Must divide the
    number of experts; expert_tensor_parallel x expert_parallel must divide the ranks of a
    stage (world / pipeline_parallel). Dense models ignore it (their DP is unchanged)."""
    expert_tensor_parallel: Annotated[int | None, Bounds(ge=1)] = None
    """Tensor parallelism inside each expert; None = tensor_parallel (Megatron's default).
    1 is the usual choice for fine-grained experts (Qwen3-MoE): whole experts per rank."""
    timeout_minutes: Annotated[float, Bounds(gt=0)] = DEFAULT_TIMEOUT_MINUTES
    """How long any collective (torch.distributed and Megatron's groups) may wait before the
    job fails with a timeout error instead of hanging. Must exceed the longest time one rank
    can spend outside collectives: a step's generation, a checkpoint save. Fractions allowed
    (0.05 = 3 s, for tests)."""

    watchdog_minutes: Annotated[float | None, Bounds(ge=0.05)] = 10.0
    """Under torchrun: a rank whose heartbeat (a background thread, independent of the work)
    has stopped for this long is taken as hung (stopped, frozen node) and the job is ended
    then, instead of at ``timeout_minutes`` (``megatron_dgpo.runtime.watchdog``). Keep it well above a
    few seconds of scheduling noise; None turns it off."""

    def __post_init__(self):
        check_bounds(self)
        vpp = self.virtual_pipeline_parallel
        if vpp is not None and vpp > 1 and self.pipeline_parallel == 1:
            raise ValueError("ParallelConfig.virtual_pipeline_parallel > 1 needs "
                             "pipeline_parallel > 1")

    @property
    def etp(self) -> int:
        """Expert TP size as Megatron resolves it."""
        return self.tensor_parallel if self.expert_tensor_parallel is None \
            else self.expert_tensor_parallel

    @property
    def vpp(self) -> int | None:
        """VPP size as Megatron wants it: None when there is no interleaving."""
        vpp = self.virtual_pipeline_parallel
        return vpp if vpp is not None and vpp > 1 else None


def free_port() -> int:
    """A TCP port free on this host now, for a local rendezvous (``MASTER_PORT`` of a run
    started without torchrun, the converter's spawned ranks). Another process may take it
    before it is bound: callers that can retry should."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    return "gloo" if cpu_only() else "nccl"


def init_distributed(backend: str | None = None, *,
                     timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
                     watchdog_minutes: float | None = None, tensor_parallel: int = 1,
                     context_parallel: int = 1, rollout_ranks: int = 0) -> None:
    """``torch.distributed.init_process_group`` from the torchrun environment, if not done yet.

    ``rollout_ranks`` > 0 (``rollout.placement: dedicated``) splits torchrun's world in two
    default worlds (``split_world``): the first ranks train (Megatron's world), the last
    ``rollout_ranks`` run the engines; each rank's default group is its own side's.

    On a GPU it first sets what CUDA must see before its context exists
    (``gpu_flags.cuda_launch_env(tensor_parallel, context_parallel)``; a value the user
    exported is kept).

    ``timeout_minutes`` (``ParallelConfig.timeout_minutes``) bounds every collective of the
    default group: a rank waiting longer fails with gloo's/NCCL's timeout error.
    ``watchdog_minutes`` (``ParallelConfig.watchdog_minutes``), under torchrun, starts this
    rank's heartbeat and watcher (``megatron_dgpo.runtime.watchdog``).

    First of all, a GPU node where torch cannot use CUDA is refused with torch's reason
    (``gpu_flags.require_usable_cuda``) instead of running on the CPU path.
    """
    require_usable_cuda()
    if dist.is_initialized():
        return
    if not (isinstance(timeout_minutes, (int, float)) and timeout_minutes > 0):
        raise ValueError(f"parallel.timeout_minutes must be a positive number, got {timeout_minutes!r}")
    if not cpu_only():
        _set_cuda_launch_env(tensor_parallel, context_parallel)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=timeout_minutes)
    store = _attempt_store(timeout)
    if rollout_ranks:
        side = split_world(rollout_ranks)
        if store is None:
            raise ValueError("rollout.placement: dedicated needs torchrun (its store joins the "
                             "trainer's and the engines' ranks): start the job with torchrun and "
                             "rollout.num_gpus extra ranks")
        dist.init_process_group(backend or default_backend(), timeout=timeout,
                                store=dist.PrefixStore(f"{side.role}/", store),
                                rank=side.rank, world_size=side.size)
        if watchdog_minutes is not None:  # one ring over both sides: a hung engine ends the job too
            start_heartbeat(store, side.global_rank, side.global_size, timeout_s=60.0 * watchdog_minutes)
        return
    if store is None:
        dist.init_process_group(backend or default_backend(), timeout=timeout)
    else:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend or default_backend(), timeout=timeout, store=store,
                                rank=rank, world_size=world_size)
        if watchdog_minutes is not None and world_size > 1:
            start_heartbeat(store, rank, world_size, timeout_s=60.0 * watchdog_minutes)


def _set_cuda_launch_env(tensor_parallel: int, context_parallel: int = 1) -> None:
    import warnings

    for key, value in cuda_launch_env(tensor_parallel, context_parallel).items():
        if key in os.environ:
            continue
        if torch.cuda.is_initialized():  # read once, when the context was created
            warnings.warn(f"{key}={value} is needed with tensor_parallel={tensor_parallel}, "
                          f"context_parallel={context_parallel} but CUDA started before it "
                          f"could be set: export it in the launch script")
        os.environ[key] = value


@dataclass(frozen=True)
class WorldSide:
    """This rank's side of a torchrun world split into trainer and rollout ranks."""

    role: str
    """``trainer`` (Megatron's world: torchrun ranks [0, size)) or ``rollout`` (the last ranks)."""
    rank: int
    """Rank in its side's default world."""
    size: int
    """Ranks on its side."""
    global_rank: int
    global_size: int
    trainer_size: int


def split_world(rollout_ranks: int) -> WorldSide:
    """Which side this torchrun rank is on when the last ``rollout_ranks`` ranks run dedicated
    engines (``rollout.num_gpus``). With static or c10d rendezvous torchrun numbers whole nodes
    consecutively, so the rollout ranks are whole nodes when ``rollout_ranks`` is a multiple of
    the GPUs per node."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    trainers = world - rollout_ranks
    if not 0 < rollout_ranks < world:
        raise ValueError(f"rollout.num_gpus={rollout_ranks} leaves no trainer rank in a torchrun "
                         f"world of {world}: start num_gpus more ranks than the trainer needs")
    if rank < trainers:
        return WorldSide("trainer", rank, trainers, rank, world, trainers)
    return WorldSide("rollout", rank - trainers, rollout_ranks, rank, world, trainers)


def launch_store(timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES):
    """torchrun's store of this attempt (``_attempt_store``), shared by every rank of the job
    whichever side it is on: where groups outside the default world meet (``comm.PeerGroup``)."""
    store = _attempt_store(timedelta(minutes=timeout_minutes))
    if store is None:
        raise RuntimeError("no torchrun store: groups spanning the trainer and dedicated engines "
                           "need the job started by torchrun")
    return store


def _attempt_store(timeout: timedelta):
    """Under torchrun, the store of this restart attempt: a prefix of the agent's store keyed by
    ``TORCHELASTIC_RESTART_COUNT``; None elsewhere (``env://`` as usual).

    torchrun's agent keeps one TCPStore for all attempts of a job (the rendezvous store is shared
    with the workers). After ``--max-restarts`` restarts the workers, a new attempt's process
    group would read the dead attempt's keys (their gloo addresses: "connectFullMesh failed ...
    Connection refused", or with c10d a hang until the collective timeout; pytorch/pytorch
    #135712, #167288). Keys under a per-attempt prefix start empty."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"megatron_dgpo/attempt_{restart}/", agent)


def initialize_parallel(config: ParallelConfig, *, seed: int = 1234) -> None:
    """Initialise Megatron's parallel state for ``config`` and seed the model-parallel RNG.

    Needs ``torch.distributed`` initialised (see ``init_distributed``); the world size must be
    a multiple of TP * CP * PP. Call ``destroy_parallel`` before initialising again.
    """
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_distributed() first")
    world = dist.get_world_size()
    model_parallel = config.tensor_parallel * config.context_parallel * config.pipeline_parallel
    if world % model_parallel:
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel * "
                         f"context_parallel * pipeline_parallel = {model_parallel}")
    expert_model_parallel = config.etp * config.expert_parallel * config.pipeline_parallel
    if world % expert_model_parallel:
        raise ValueError(f"world size {world} is not a multiple of expert_tensor_parallel * "
                         f"expert_parallel * pipeline_parallel = {expert_model_parallel}")
    apply_cpu_compat()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel,
        pipeline_model_parallel_size=config.pipeline_parallel,
        virtual_pipeline_model_parallel_size=config.vpp,
        context_parallel_size=config.context_parallel,
        expert_model_parallel_size=config.expert_parallel,
        expert_tensor_parallel_size=config.expert_tensor_parallel,
        distributed_timeout_minutes=config.timeout_minutes,  # Megatron's subgroups' timeout
    )
    _init_replica_groups(config, world)
    seed_model_parallel_rng(seed)


_REPLICA_GROUP = None
_REPLICA_RANKS: list[int] | None = None


def replica_ranks_of(dp_index: int, *, world_size: int, tensor_parallel: int,
                     context_parallel: int, pipeline_parallel: int) -> list[int]:
    """The global ranks of data-parallel replica ``dp_index`` in Megatron's ``tp-cp-ep-dp-pp``
    order: rank = tp + TP * (cp + CP * (dp + DP * pp)), every tp, cp and pp; ascending."""
    dp_size = world_size // (tensor_parallel * context_parallel * pipeline_parallel)
    return sorted(tp + tensor_parallel * (cp + context_parallel * (dp_index + dp_size * pp))
                  for pp in range(pipeline_parallel) for cp in range(context_parallel)
                  for tp in range(tensor_parallel))


def _init_replica_groups(config: ParallelConfig, world: int) -> None:
    """Every replica's group (each rank creates all, as ``new_group`` requires); this rank's
    kept. Checked against Megatron's own groups: the replica holds this rank's model-parallel
    (TP x PP) and CP groups, and its index is this rank's DP rank without CP."""
    global _REPLICA_GROUP, _REPLICA_RANKS
    from megatron.core import parallel_state

    sizes = dict(world_size=world, tensor_parallel=config.tensor_parallel,
                 context_parallel=config.context_parallel,
                 pipeline_parallel=config.pipeline_parallel)
    dp_index = parallel_state.get_data_parallel_rank()
    rank = dist.get_rank()
    for d in range(parallel_state.get_data_parallel_world_size()):
        ranks = replica_ranks_of(d, **sizes)
        group = dist.new_group(ranks, timeout=timedelta(minutes=config.timeout_minutes))
        if rank in ranks:
            _REPLICA_GROUP, _REPLICA_RANKS = group, ranks
    inside = (set(dist.get_process_group_ranks(parallel_state.get_model_parallel_group()))
              | set(dist.get_process_group_ranks(parallel_state.get_context_parallel_group())))
    if _REPLICA_RANKS != replica_ranks_of(dp_index, **sizes) or not inside <= set(_REPLICA_RANKS):
        raise RuntimeError(f"rank {rank}: replica ranks {_REPLICA_RANKS} disagree with Megatron's "
                           f"groups (DP rank {dp_index}, model-parallel and CP ranks "
                           f"{sorted(inside)}): has Megatron's rank order changed?")


# ------------------------------------------------------------------ the groups' vocabulary
# The package's only reads of Megatron's parallel state: each a one-line contract. Groups are
# torch.distributed process groups; ranks are ranks inside the group; sizes its member count.


def parallel_initialized() -> bool:
    """Whether ``initialize_parallel`` has run (and ``destroy_parallel`` not since)."""
    return _ps().model_parallel_is_initialized()


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def replica_group():
    """This rank's data-parallel replica: the TP x CP x PP ranks that share its DP index (without
    CP) and so the same samples; its lowest rank is the replica's leader."""
    if _REPLICA_GROUP is None:
        raise RuntimeError("no replica group: call initialize_parallel first")
    return _REPLICA_GROUP


def replica_ranks() -> list[int]:
    """The global ranks of ``replica_group()``, ascending (the first is the replica's leader)."""
    replica_group()
    return list(_REPLICA_RANKS)


def data_parallel_group(with_context_parallel: bool = False):
    """The ranks holding the same model shard: DP (one rank per replica), or DP x CP."""
    return _ps().get_data_parallel_group(with_context_parallel=with_context_parallel)


def data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in ``data_parallel_group(with_context_parallel)``; without CP, its
    replica's index (the one that splits a batch)."""
    return _ps().get_data_parallel_rank(with_context_parallel=with_context_parallel)


def data_parallel_size(with_context_parallel: bool = False) -> int:
    """Members of ``data_parallel_group(with_context_parallel)``; without CP, the replicas."""
    return _ps().get_data_parallel_world_size(with_context_parallel=with_context_parallel)


def context_parallel_group():
    """The CP ranks that split one replica's sequences (same TP, PP and DP index)."""
    return _ps().get_context_parallel_group()


def context_parallel_rank() -> int:
    """This rank's index in ``context_parallel_group()``."""
    return _ps().get_context_parallel_rank()


def context_parallel_size() -> int:
    """Members of ``context_parallel_group()`` (``ParallelConfig.context_parallel``)."""
    return _ps().get_context_parallel_world_size()


def tensor_parallel_group():
    """The TP ranks that split each layer's matrices and the vocabulary."""
    return _ps().get_tensor_model_parallel_group()


def tensor_parallel_rank() -> int:
    """This rank's index in ``tensor_parallel_group()`` (which shard it holds)."""
    return _ps().get_tensor_model_parallel_rank()


def tensor_parallel_size() -> int:
    """Members of ``tensor_parallel_group()``."""
    return _ps().get_tensor_model_parallel_world_size()


def pipeline_parallel_group():
    """The PP ranks of this rank's pipeline, one per stage (same TP, CP and DP index)."""
    return _ps().get_pipeline_model_parallel_group()


def pipeline_parallel_rank() -> int:
    """This rank's stage, 0 first."""
    return _ps().get_pipeline_model_parallel_rank()


def pipeline_parallel_size() -> int:
    """Pipeline stages."""
    return _ps().get_pipeline_model_parallel_world_size()


def virtual_pipeline_parallel_size() -> int | None:
    """Model chunks per stage (interleaved 1F1B), None without VPP."""
    return _ps().get_virtual_pipeline_model_parallel_world_size()


def is_first_pipeline_stage(vp_stage: int | None = None) -> bool:
    """Whether this rank's stage (or, with ``vp_stage``, that model chunk) holds the embedding."""
    if vp_stage is None:
        return _ps().is_pipeline_first_stage(ignore_virtual=True)
    return _ps().is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_last_pipeline_stage(vp_stage: int | None = None) -> bool:
    """Whether this rank's stage (or, with ``vp_stage``, that model chunk) holds the logits."""
    if vp_stage is None:
        return _ps().is_pipeline_last_stage(ignore_virtual=True)
    return _ps().is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def pipeline_last_rank() -> int:
    """The global rank of the last stage of this rank's pipeline."""
    return _ps().get_pipeline_model_parallel_last_rank()


def expert_parallel_group():
    """The EP ranks that split each MoE layer's experts; None before initialisation."""
    return _ps().get_expert_model_parallel_group(check_initialized=False)


def expert_parallel_rank() -> int:
    """This rank's index in ``expert_parallel_group()`` (which experts it holds)."""
    return _ps().get_expert_model_parallel_rank()


def expert_parallel_size() -> int:
    """Members of ``expert_parallel_group()``."""
    return _ps().get_expert_model_parallel_world_size()


def expert_group_has_context_parallel_leader() -> bool:
    """Whether this rank's expert TP x EP group (whose members gather an MoE layer's experts
    together) holds a rank of CP index 0; the same answer on every member."""
    members = dist.get_process_group_ranks(
        _ps().get_expert_tensor_and_model_parallel_group(check_initialized=False))
    tp, cp = tensor_parallel_size(), context_parallel_size()
    return any(r // tp % cp == 0 for r in members)


def expert_tensor_parallel_group():
    """The ranks that split each expert's matrices; None before initialisation."""
    return _ps().get_expert_tensor_parallel_group(check_initialized=False)


def expert_tensor_parallel_rank() -> int:
    """This rank's index in ``expert_tensor_parallel_group()``."""
    return _ps().get_expert_tensor_parallel_rank()


def expert_tensor_parallel_size() -> int:
    """Members of ``expert_tensor_parallel_group()``."""
    return _ps().get_expert_tensor_parallel_world_size()


def destroy_parallel() -> None:
    """Tear down Megatron's parallel state (not the torch.distributed process group)."""
    global _REPLICA_GROUP, _REPLICA_RANKS
    _REPLICA_GROUP = _REPLICA_RANKS = None
    _ps().destroy_model_parallel()


def engine_group(engine_tp: int):
    """This rank's block of ``engine_tp`` consecutive ranks of the default world (a dedicated
    vLLM engine's ranks, on the rollout side of ``split_world``). Every rank creates every
    block's group, as ``torch.distributed.new_group`` requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % engine_tp:
        raise ValueError(f"rollout.tensor_parallel_size={engine_tp} must divide the "
                         f"{world} rollout ranks (rollout.num_gpus)")
    mine = None
    for start in range(0, world, engine_tp):
        group = dist.new_group(list(range(start, start + engine_tp)))
        if start <= rank < start + engine_tp:
            mine = group
    return mine

