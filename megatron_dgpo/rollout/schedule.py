"""When a replica's batches are sampled (``rollout.max_staleness`` k, ``rollout.partial``), as the
trainer's loop sees it: synchronously (k = 0: each step samples with the weights it starts
from), one batch ahead (k = 1: the next batch is generated while the step trains), or streamed
(k >= 2 or partial, dedicated engines: groups flow into a bounded buffer, ``rollout.buffer``).

    schedule = Schedule(rollout, cfg.rollout, refill_rounds=..., steps=..., resumed_from=...,
                        prompts_consumed=..., dp_rank=..., dp_size=...)   # before the first refit
    batch, metrics, used = schedule.batch(step, prompts_consumed)        # the step's samples
    if schedule.waiting: schedule.collect()                             # before the refit
    schedule.write(folder, leader=...)                                  # into a checkpoint
"""

from __future__ import annotations

from pathlib import Path

from megatron_dgpo.rollout.ahead import load_ahead, load_buffer, save_ahead, save_buffer
from megatron_dgpo.rollout.base import Rollout, Sampled
from megatron_dgpo.rollout.config import RolloutConfig


class Schedule:
    """The replica's batches on the schedule ``config`` asks for; what a resumed run had
    generated ahead (the checkpoint ``resumed_from``) comes first."""

    def __init__(self, rollout: Rollout, config: RolloutConfig, *, refill_rounds: int, steps: int,
                 resumed_from: Path | None, prompts_consumed: int, dp_rank: int, dp_size: int):
        self.rollout, self.config = rollout, config
        self.refill_rounds, self.steps = refill_rounds, steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.ahead = None
        if config.streaming:  # the buffer is in place before the first refit sends work
            rollout.load_buffer(load_buffer(resumed_from, dp_rank=dp_rank, dp_size=dp_size)
                                if rollout.leader else None, prompts_consumed)
        elif config.max_staleness:  # sampled by the weights before the checkpoint's
            self.ahead = load_ahead(resumed_from, replica_prompts=rollout.replica_prompts,
                                    group_size=config.group_size)

    def batch(self, step: int, prompts_consumed: int) -> Sampled:
        """Step ``step``'s batch (the stream at ``prompts_consumed``); one-step-off submits the
        next batch before returning, so it is generated while this step trains."""
        if self.config.streaming:
            return self.rollout.take(step)
        sampled = self.ahead or self.rollout.sample(prompts_consumed, self.refill_rounds)
        self.ahead = None
        if self.config.max_staleness and step < self.steps:  # on the weights of step - 1
            self.rollout.submit(prompts_consumed + sampled.prompts_used, self.refill_rounds)
        return sampled

    @property
    def waiting(self) -> bool:
        """A batch is being generated that ``collect`` must take before the refit."""
        return self.rollout.submitted

    def collect(self) -> None:
        """Wait for the batch generated during the step and keep it for the next one."""
        self.ahead = self.rollout.collect()

    def write(self, folder: Path, *, leader: bool) -> None:
        """Into a checkpoint being written: the batch generated ahead, or the stream's buffer
        (each replica's leader writes its own)."""
        if self.config.streaming:
            save_buffer(folder, self.rollout.buffer_state(), dp_rank=self.dp_rank,
                        dp_size=self.dp_size)
        else:
            save_ahead(folder, self.ahead, dp_rank=self.dp_rank, dp_size=self.dp_size,
                       leader=leader)
