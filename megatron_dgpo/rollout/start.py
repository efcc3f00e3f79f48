"""The rollout's entry point: which ranks are engines, and the handle the trainer's loop drives
(``base.Rollout``) wherever ``rollout.placement`` puts the engines.

    if engine_rank(cfg.rollout):          # a dedicated engine's GPU, not a trainer's
        return serve_engines(cfg.rollout, cfg.data, cfg.parallel, seed=cfg.train.seed)
    rollout = start_rollout(cfg.rollout, cfg.data, cfg.parallel, hf_dir, seed=cfg.train.seed,
                            batch_prompts=cfg.train.rollout_batch_prompts, version=step)

The loop imports this module only: the placements' own modules (``replica``, ``dedicated``)
stay behind it.
"""

from __future__ import annotations

from pathlib import Path

from megatron_dgpo.rollout.base import Rollout
from megatron_dgpo.rollout.config import RolloutConfig
from megatron_dgpo.rollout.dedicated.client import DedicatedRollout
from megatron_dgpo.rollout.dedicated.server import serve
from megatron_dgpo.rollout.replica import ReplicaRollout
from megatron_dgpo.runtime.parallel import ParallelConfig, split_world
from megatron_dgpo.tasks.prompts import DataConfig


def engine_rank(rollout: RolloutConfig) -> bool:
    """Whether this torchrun rank is one of the dedicated engines' GPUs (``placement:
    dedicated``: the last ``rollout.num_gpus`` ranks) rather than a trainer's."""
    return rollout.placement == "dedicated" and split_world(rollout.num_gpus).role == "rollout"


def serve_engines(rollout: RolloutConfig, data: DataConfig, parallel: ParallelConfig, *,
                  seed: int) -> int:
    """An engine rank's main (``dedicated.server.serve``): runs the engines' commands until
    the trainer stops them. Returns the exit status (0)."""
    return serve(rollout, data, parallel, seed=seed)


def start_rollout(rollout: RolloutConfig, data: DataConfig, parallel: ParallelConfig,
                  hf_dir: Path, *, seed: int, batch_prompts: int, version: int = 0,
                  record_routing: bool = False) -> Rollout:
    """This trainer rank's ``Rollout``: ``DedicatedRollout`` for ``placement: dedicated`` (GPUs
    of their own, fed by a weight broadcast), else ``ReplicaRollout`` (engines in the trainer's
    ranks). The engines hold the weights of step ``version`` once ``needs_first_refit`` is
    served. ``record_routing``: the engines record each sample's MoE routing (routing replay;
    engines in the trainer's ranks only, which the recipe enforces). Collective (trainer world)."""
    if rollout.placement == "dedicated":
        return DedicatedRollout(rollout, data, parallel, hf_dir, seed=seed, version=version,
                                batch_prompts=batch_prompts)
    return ReplicaRollout(rollout, data, parallel, hf_dir, seed=seed, batch_prompts=batch_prompts,
                          record_routing=record_routing, version=version)
