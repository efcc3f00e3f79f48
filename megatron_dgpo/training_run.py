"""What the RL trainer and the supervised warm start share: one training run on the torchrun world.

    run = TrainingRun(cfg, seed=..., steps=..., max_minutes=...)  # ranks, policy, optimizer, resume
    with run:                              # stop signals become requests; the end frees everything
        return run.loop(step)              # step(k) -> metrics; logged, saved on schedule, stopped

``cfg`` is a run config with the sections both loops have (``run_dir``, ``model``, ``parallel``,
``optimizer``, ``checkpoint``, ``logging``: ``recipe.RunConfig`` or ``sft.SFTRunConfig``). One job
at a time holds the run directory (``run_lock``). A run directory holding a checkpoint is
continued (``checkpoint.resume``: the newest checkpoint that verifies; the recipe's changes
against it listed, and refused where they change what the run means); a stop signal or the
time budget ends the run at a step boundary every rank agrees on, with a checkpoint
(``interrupt``); a run that completes exports its final policy as an HF folder. Children die
with the process (``lifetime``).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_dgpo import telemetry
from megatron_dgpo.algorithm import vocab_parallel
from megatron_dgpo.models.builder import padded_vocab_of
from megatron_dgpo.recipe import save_recipe
from megatron_dgpo.runtime import comm
from megatron_dgpo.runtime.config import to_dict
from megatron_dgpo.runtime.errors import InputError
from megatron_dgpo.runtime.interrupt import EXIT_STOPPED, TimeBudget, stop_requests
from megatron_dgpo.runtime import parallel
from megatron_dgpo.runtime.lifetime import children_die_with_this_process
from megatron_dgpo.runtime.parallel import init_distributed, initialize_parallel
from megatron_dgpo.runtime.run_lock import RunLock
from megatron_dgpo.tasks.tiny import make_tiny_model
from megatron_dgpo.training import policy
from megatron_dgpo.training.checkpoint import (AsyncSaver, TrainerState, export_latest,
                                               load_checkpoint, resume_point, save_checkpoint)
from megatron_dgpo.training.optimizer import build_optimizer, use_distributed_optimizer


class TrainingRun:
    """This rank's part of a run: the policy's chunks (``models``), its optimizer, the trainer
    state (resumed from ``resumed_from`` when there was a checkpoint), the metrics logger and
    the checkpoint saves. Built collectively by every rank of the trainer's world.

    ``routing_replay``: the policy's routers built for replay (``algorithm.routing_replay``);
    ``rollout_ranks``: torchrun ranks that are dedicated engines, outside this world;
    ``progress``: what the progress bar shows (``telemetry.ProgressBar``)."""

    def __init__(self, cfg, *, seed: int, steps: int, max_minutes: float | None,
                 routing_replay: str = "off", rollout_ranks: int = 0,
                 progress: dict[str, tuple[str, str]] = telemetry.RL_PROGRESS):
        self.budget = TimeBudget(max_minutes)  # counted from the start, setup included
        children_die_with_this_process()  # engines, graders, checkpoint writers: a SIGKILL too
        init_distributed(timeout_minutes=cfg.parallel.timeout_minutes,
                         watchdog_minutes=cfg.parallel.watchdog_minutes,
                         tensor_parallel=cfg.parallel.tensor_parallel,
                         context_parallel=cfg.parallel.context_parallel,
                         rollout_ranks=rollout_ranks)  # before any engine
        initialize_parallel(cfg.parallel, seed=seed)
        self.cfg, self.steps, self._progress = cfg, steps, progress
        self.rank0, self.run_dir = dist.get_rank() == 0, Path(cfg.run_dir)
        self.lock = _lock_run_dir(self.run_dir, self.rank0)
        # the checkpoint to continue, verified, and the recipe checked against it: before the
        # model is built, so that a refusal costs seconds
        self.resumed_from = resume_point(self.run_dir / "checkpoints", cfg.checkpoint, to_dict(cfg))
        # the replicas (DP without CP): CP ranks share their replica's samples
        self.dp_rank, self.dp_size = parallel.data_parallel_rank(), parallel.data_parallel_size()
        self.dp_group = parallel.data_parallel_group()
        self.hf_dir = policy.initial_model(cfg.model, self.run_dir, seed, make_tiny=make_tiny_model)
        self.models, self.hf_config, self.dtype = policy.build_policy(
            cfg.model, self.hf_dir, routing_replay=routing_replay,
            use_distributed_optimizer=use_distributed_optimizer(cfg.optimizer))
        # the log-prob kernels, built in the logits' dtype (the model's) on the stage that has
        # logits and before any engine imports vLLM: with inductor's compile threads, and a
        # failure known now (vocab_parallel's module docstring; nothing is built on CPU)
        if parallel.is_last_pipeline_stage():
            vocab_parallel.compiled_by_default(next(self.models[0].parameters()).device, self.dtype)
        self.lr = cfg.optimizer.learning_rate(cfg.model.nominal_params
                                              or policy.count_parameters(self.hf_dir))
        self.optimizer = build_optimizer(cfg.optimizer, self.models, lr=self.lr,
                                         bf16=self.dtype == torch.bfloat16)
        self.saver = AsyncSaver() if cfg.checkpoint.async_save else None  # its writer starts now
        # the checkpoint records the layout itself (it decides whether a resume restores RNG)
        self.state = TrainerState(extra={"learning_rate": self.lr, "config": to_dict(cfg)})
        if self.resumed_from is not None:
            self.state = load_checkpoint(self.resumed_from, self.models, self.optimizer)
            self.state.extra["config"] = to_dict(cfg)  # the next checkpoint records this recipe
        self.logger = self._stop = self._exit = None

    def __enter__(self) -> TrainingRun:
        self._exit = contextlib.ExitStack()
        self._exit.callback(self.lock.release)
        self._stop = self._exit.enter_context(stop_requests())
        if self.saver is not None:  # nothing half-written is kept, a second signal included
            self._exit.callback(self.saver.abort)
        if self.rank0:
            save_recipe(self.cfg, self.run_dir)
        self.logger = telemetry.MetricsLogger(self.run_dir, self.cfg.logging, enabled=self.rank0)
        self._exit.callback(self.logger.close)
        self.logger.truncate_after(self.state.step)
        return self

    def closing(self, resource):
        """``resource``, closed when the run ends (before the logger and the saver), however it
        ends: engines and grader workers are freed on a second signal too."""
        self._exit.callback(resource.close)
        return resource

    def __exit__(self, *exc) -> bool:
        return self._exit.__exit__(*exc)

    def save(self, write_extra=None) -> None:
        """Checkpoint the current state (``write_extra(folder)`` adds files to it). Collective."""
        save_checkpoint(self.run_dir / "checkpoints", self.state, self.models, self.optimizer,
                        hf_config=self.hf_config, dtype=self.dtype, hf_dir=str(self.hf_dir),
                        padded_vocab_size=padded_vocab_of(self.models),
                        keep_last=self.cfg.checkpoint.keep_last, saver=self.saver,
                        optimizer_sharding=self.cfg.checkpoint.optimizer_sharding,
                        write_extra=write_extra, verify=self.cfg.checkpoint.verify)

    def loop(self, step: Callable[[int], dict[str, float]],
             save: Callable[[], None] | None = None) -> int:
        """Run ``step(k)`` for the steps after the state's up to ``steps``: each returns its
        metrics (and advances ``state``), logged before the checkpoint so that a crash after the
        save cannot lose the line (a resumed run drops lines past its checkpoint); a save's time
        goes to the next line. ``save`` (default ``save``) writes a checkpoint on schedule, and
        before an agreed stop. Returns the exit status: 0, or ``EXIT_STOPPED`` when a stop
        signal or the time budget ended the run early."""
        save = save or self.save
        bar = telemetry.ProgressBar(self.steps, self.state.step, show=self._progress,
                                    enabled=self.rank0 and self.cfg.logging.progress_bar)
        save_time, last_save_seconds, stopped = {}, 0.0, False
        for k in range(self.state.step + 1, self.steps + 1):
            begin = time.perf_counter()
            if self.saver is not None:
                self.saver.poll()  # publish a background save that has finished on every rank
            metrics = {**step(k), **save_time}
            self.logger.log(k, metrics)
            bar.advance(metrics)
            saved = self.cfg.checkpoint.saves_at(k, self.steps)
            save_time = {"time/checkpoint": _seconds(save)} if saved else {}
            last_save_seconds = save_time.get("time/checkpoint", last_save_seconds)
            step_seconds = time.perf_counter() - begin
            # every rank stops at the same step boundary, this step saved (interrupt)
            out_of_time = self.budget.exceeded(step_seconds, last_save_seconds)
            if k < self.steps and self._stop.agreed(out_of_time):
                if not saved:
                    save()
                stopped = True
                if self.rank0:
                    print(f"[megatron-dgpo] stopped after step {k} "
                          f"({self._stop.reason or 'max_minutes or a signal on another rank'}); "
                          f"the checkpoint is saved, re-run the same command to continue",
                          flush=True)
                break
        if self.saver is not None:
            self.saver.close()  # the last checkpoint is published before it is exported or we exit
        if self.cfg.checkpoint.export_hf and self.rank0 and not stopped:
            export_latest(self.run_dir, self.cfg.checkpoint.export_dtype)
        comm.barrier()
        return EXIT_STOPPED if stopped else 0


def _lock_run_dir(run_dir: Path, rank0: bool) -> RunLock:
    """Collective: rank 0 takes ``run_dir``'s lock; every rank raises its refusal."""
    lock, refusal = RunLock(run_dir), None
    if rank0:
        try:
            lock.acquire()
        except InputError as exc:
            refusal = str(exc)
    refusal = comm.broadcast_object(refusal, src=0)
    if refusal is not None:
        raise InputError(refusal)
    return lock


def _seconds(call: Callable[[], None]) -> float:
    begin = time.perf_counter()
    call()
    return time.perf_counter() - begin
