"""Which colocated engine a rank belongs to, and which prompts each engine samples.

Colocated engines (``VLLMConfig.placement="colocated"``) are vLLM ``external_launcher`` SPMD
groups of ``engine_tp`` *consecutive* global ranks: ranks ``[e * t, (e + 1) * t)`` form engine
``e``, so there are ``world / t`` engines. Every rank of an engine must call ``generate`` with
the same prompts and seeds; every rank feeds its own engine rank the full HF tensors
(``export_hf_weights(consumer="all")``: DP replicas hold identical weights, so any replica's
ranks can feed any engine).

Sharding a rollout batch of P prompts (each giving a whole group of ``n`` samples): engine e
takes the contiguous slice ``shard_prompts(P, E, e)`` (sizes differ by at most one), and prompt
p's sampling seed is ``base_seed + p`` (``prompt_seeds``), so the union of the engines'
samples equals a single engine's samples for the same batch and seed, whatever E is.
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


def shard_prompts(num_prompts: int, num_engines: int, engine_index: int) -> range:
    """Engine ``engine_index``'s contiguous share of ``num_prompts`` prompts (whole groups);
    the first ``num_prompts % num_engines`` engines take one more."""
    if not 0 <= engine_index < num_engines:
        raise ValueError(f"engine_index {engine_index} outside [0, {num_engines})")
    base, extra = divmod(num_prompts, num_engines)
    start = engine_index * base + min(engine_index, extra)
    return range(start, start + base + (engine_index < extra))


def prompt_seeds(base_seed: int, prompt_indices) -> list[int]:
    """Per-prompt sampling seeds from the global prompt index (pass as ``generate(seeds=...)``)."""
    return [int(base_seed) + int(i) for i in prompt_indices]
