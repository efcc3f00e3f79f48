"""The RL loop, one step at a time, every DP replica on its own share of the batch:

    rollout (the replica's engines: colocated vLLM in its ranks, or one engine on its leader)
    -> rewards (math-verify workers, where the samples are) -> group advantages
    -> old log-probs (forward only) -> one optimizer update per mini-batch (N all-reduced)
    -> bucketed refit of each engine from its own model-parallel group
    -> (recipe section ``eval``, on schedule) held-out problems on the refitted engines -> log -> checkpoint

and, at the end, the final policy exported as an HF folder. A run directory holding a checkpoint
is continued (``checkpoint.resume: auto``); a stop signal or the time budget ends the run at a
step boundary agreed by every rank, with a checkpoint (``interrupt``). Every piece lives in its own
module, named at each call (``policy``, ``rollout.replica``, ``experience``, ``train_step``,
``telemetry``, ``checkpoint``); this file only wires them
(``python -m megatron_dgpo.train`` is the command line).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dgpo import comm, model, policy, telemetry
from megatron_dgpo.advantages import drop_degenerate_groups, group_advantages
from megatron_dgpo.checkpoint import (AsyncSaver, TrainerState, checkpoint_to_resume, export_latest,
                                      load_checkpoint, save_checkpoint)
from megatron_dgpo.config import to_dict
from megatron_dgpo.convert import export_hf_weights
from megatron_dgpo.experience import pack_update, plan_updates, reduce_group_stats, rollout_metrics
from megatron_dgpo.expert_load import ExpertLoad
from megatron_dgpo.gpu_config import pad_multiple
from megatron_dgpo.interrupt import EXIT_STOPPED, TimeBudget, stop_requests
from megatron_dgpo.losses import merge_metrics, sample_loss_weights
from megatron_dgpo.offload import TrainingStateOffload
from megatron_dgpo.optimizer import build_optimizer, step_if_finite, sync_params, use_distributed_optimizer
from megatron_dgpo.parallel import init_distributed, initialize_parallel, split_world
from megatron_dgpo.recipe import RunConfig, save_recipe
from megatron_dgpo.rollout.base import Rollout
from megatron_dgpo.rollout.dedicated.ahead import load_ahead, save_ahead
from megatron_dgpo.rollout.dedicated.client import DedicatedRollout
from megatron_dgpo.rollout.dedicated.server import serve as serve_engines
from megatron_dgpo.rollout.evaluation import HeldOutEvaluation
from megatron_dgpo.rollout.mismatch import mismatch_metrics
from megatron_dgpo.rollout.replica import ReplicaRollout
from megatron_dgpo.routing_replay import RoutingReplay
from megatron_dgpo.train_step import LossConfig, forward_logprobs, train_step


def train(cfg: RunConfig) -> int:
    """Run (or continue: ``cfg.checkpoint.resume``) the job ``cfg`` on the current torchrun
    world. Returns the exit status: 0 when every step ran, ``EXIT_STOPPED`` when a stop signal
    or ``train.max_minutes`` ended it early (with a checkpoint of the last completed step)."""
    from megatron.core import parallel_state as ps

    dedicated = cfg.rollout.placement == "dedicated"
    if dedicated and split_world(cfg.rollout.num_gpus).role == "rollout":
        return serve_engines(cfg)  # this rank is one of the engines' GPUs, not a trainer's
    budget = TimeBudget(cfg.train.max_minutes)
    init_distributed(timeout_minutes=cfg.parallel.timeout_minutes,
                     watchdog_minutes=cfg.parallel.watchdog_minutes,
                     tensor_parallel=cfg.parallel.tensor_parallel,
                     rollout_ranks=cfg.rollout.num_gpus)  # before any engine
    initialize_parallel(cfg.parallel, seed=cfg.train.seed)
    rank0, run_dir = dist.get_rank() == 0, Path(cfg.run_dir)
    hf_dir = policy.initial_model(cfg.model, run_dir, cfg.train.seed)
    r3 = cfg.algorithm.routing_replay == "r3"
    models, hf_config, dtype = policy.build_policy(
        cfg.model, hf_dir, use_distributed_optimizer=use_distributed_optimizer(cfg.optimizer),
        routing_replay=cfg.algorithm.routing_replay)
    lr = cfg.optimizer.learning_rate(cfg.model.nominal_params or policy.count_parameters(hf_dir))
    optimizer = build_optimizer(cfg.optimizer, models, lr=lr, bf16=dtype == torch.bfloat16)
    expert_load = ExpertLoad(models)  # MoE routing statistics of the updates (none if dense)
    replay = RoutingReplay(models) if r3 else None  # the engine's expert choices, replayed
    saver = AsyncSaver() if cfg.checkpoint.async_save else None  # its writer starts now
    offload = TrainingStateOffload(models, optimizer, enabled=cfg.train.offload_training_state)
    state = TrainerState(extra=_run_record(cfg, lr))
    if (latest := checkpoint_to_resume(run_dir / "checkpoints", cfg.checkpoint.resume)) is not None:
        state = load_checkpoint(latest, models, optimizer)
    ahead_of_time = cfg.rollout.max_staleness > 0  # one-step-off: batch k+1 sampled during step k
    dp_size, dp_group = ps.get_data_parallel_world_size(), ps.get_data_parallel_group()
    loss_cfg = LossConfig(method=cfg.algorithm.method, temperature=cfg.rollout.temperature,
                          hyperparams=cfg.algorithm.loss, chunk_size=cfg.train.log_prob_chunk_size,
                          aggregation=cfg.algorithm.loss_aggregation,
                          rollout_correction=cfg.algorithm.rollout_correction,
                          rollout_correction_cap=cfg.algorithm.rollout_correction_cap)
    group, num_updates = cfg.rollout.group_size, cfg.train.rollout_batch_prompts // cfg.train.mini_batch_prompts
    rollout = logger = None
    with stop_requests() as stop:
        try:
            if rank0:
                save_recipe(cfg, run_dir)
            offload.offload()  # vLLM starts only if its share of the GPU is free then
            # held-out problems read and rendered on every rank before any engine starts
            evaluation = (HeldOutEvaluation.from_recipe(cfg.eval, hf_dir, cfg.rollout)
                          if cfg.eval.enabled else None)
            if dedicated:  # engines on GPUs of their own, fed by a weight broadcast
                rollout = DedicatedRollout(cfg.rollout, cfg.data, cfg.parallel, hf_dir,
                                           seed=cfg.train.seed, version=state.step,
                                           batch_prompts=cfg.train.rollout_batch_prompts)
            else:
                rollout = ReplicaRollout(cfg.rollout, cfg.data, cfg.parallel, hf_dir, seed=cfg.train.seed,
                                         batch_prompts=cfg.train.rollout_batch_prompts,
                                         record_routing=r3, version=state.step)
            logger = telemetry.MetricsLogger(run_dir, cfg.logging, enabled=rank0)
            logger.truncate_after(state.step)
            if state.step or rollout.needs_first_refit:  # resumed, or an engine without weights
                _refit(rollout, models, version=state.step)
            # the batch a stopped one-step-off run had generated ahead, sampled by the weights
            # before its checkpoint's: the resumed run trains on exactly what it would have
            ahead = (load_ahead(latest, replica_prompts=rollout.replica_prompts, group_size=group)
                     if ahead_of_time else None)
            bar = telemetry.ProgressBar(cfg.train.steps, state.step,
                                        enabled=rank0 and cfg.logging.progress_bar)

            def save() -> dict:
                begin = time.perf_counter()
                with _resident_beside_sleeping_engines(rollout, offload):
                    save_checkpoint(run_dir / "checkpoints", state, models, optimizer,
                                    hf_config=hf_config, padded_vocab_size=model.padded_vocab_of(models),
                                    dtype=dtype, hf_dir=str(hf_dir), keep_last=cfg.checkpoint.keep_last,
                                    saver=saver, optimizer_sharding=cfg.checkpoint.optimizer_sharding,
                                    write_extra=lambda folder: save_ahead(
                                        folder, ahead, dp_rank=ps.get_data_parallel_rank(),
                                        dp_size=dp_size, leader=rollout.leader))
                return {"time/checkpoint": time.perf_counter() - begin}

            save_time, last_save_seconds, stopped = {}, 0.0, False
            for step in range(state.step + 1, cfg.train.steps + 1):
                timer = telemetry.PhaseTimer()
                if saver is not None:
                    saver.poll()  # publish a background save that has finished on every rank
                with timer("rollout"):
                    batch, engine_stats, prompts_used = ahead or rollout.sample(
                        state.prompts_consumed, cfg.algorithm.refill_rounds)
                    ahead = None
                    if ahead_of_time and step < cfg.train.steps:  # the next batch, on the weights
                        rollout.submit(state.prompts_consumed + prompts_used,  # of step - 1
                                       cfg.algorithm.refill_rounds)
                    batch.advantages, adv_stats = group_advantages(
                        torch.tensor(batch.rewards), group, eps=cfg.algorithm.advantage_eps,
                        unbiased=cfg.algorithm.advantage_unbiased_std)
                    # Per-sample aggregation weights, computed over whole groups before packing
                    # splits them; 0 for dropped groups (None by default: token_mean, no filter).
                    kept = (drop_degenerate_groups(batch.rewards, group)
                            if cfg.algorithm.drop_degenerate_groups else None)
                    batch.loss_weights = sample_loss_weights(
                        [len(r) for r in batch.response_tokens], group,
                        cfg.algorithm.loss_aggregation, kept and kept.keep)

                with timer("old_logprobs"):
                    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_tokens, batch.response_tokens)]
                    plan = plan_updates(rollout.replica_prompts.start, len(rollout.replica_prompts), group,
                                        num_updates, lengths)
                    updates = [pack_update(batch, indices, cfg.train.micro_batch_tokens,
                                           pad_multiple=pad_multiple(cfg.parallel.tensor_parallel))
                               for indices in plan]
                    rows = [row for rows_u in updates for row in rows_u]
                    with _replay_recording(replay, "mismatch/"):
                        outputs = forward_logprobs(models, rows,
                                                   temperature=cfg.rollout.temperature,
                                                   chunk_size=cfg.train.log_prob_chunk_size,
                                                   routing_replay=replay)
                    for row, (logp, _) in zip(rows, outputs):
                        row.old_logprobs = torch.where(row.loss_mask, logp, 0.0)
                    mismatch = mismatch_metrics(rows, dp_group).as_dict()

                with timer("update"), expert_load.recording(), _replay_recording(replay, "train/"):
                    offload.restore()
                    parts, grad_norms, skipped, trained_tokens = [], [], 0, 0
                    for rows_u in updates:
                        result = train_step(models, rows_u, loss_cfg, routing_replay=replay)
                        parts.append(result.metrics)
                        if not result.num_tokens:  # every group of this mini-batch was dropped
                            continue
                        stepped, grad_norm = step_if_finite(optimizer, models, result.loss)
                        skipped += not stepped
                        grad_norms.append(grad_norm)
                        trained_tokens += sum(int(r.tokens.numel()) for r in rows_u)
                    state.skipped_updates += skipped
                    offload.offload()  # before vLLM wakes for the refit and the next rollout

                if ahead_of_time and rollout.submitted:
                    with timer("rollout_wait"):  # the trainer idles until the engines are done
                        ahead = rollout.collect()
                with timer("refit"):  # the engines take step's weights between batches
                    refit_stats = _refit(rollout, models, version=step)
                eval_metrics = {}
                if evaluation is not None and cfg.eval.due(step, cfg.train.steps):
                    with timer("eval"):  # the refitted engines; outside time/step and throughput
                        eval_metrics = evaluation.run(rollout)
                state.step, state.prompts_consumed = step, state.prompts_consumed + prompts_used

                # Logged before the checkpoint: a crash after the save cannot lose this step's line
                # (a resumed run drops lines past its checkpoint). The save's time goes to the next line.
                sampled = rollout_metrics(batch, group, dp_group)
                generated = round(sampled["rollout/response_length_mean"] * sampled["rollout/num_samples"])
                group_stats = {**adv_stats.as_dict(), **(kept.as_dict() if kept else {})}
                metrics = {**sampled, **reduce_group_stats(group_stats, dp_group), **mismatch,
                           **telemetry.update_metrics(merge_metrics(parts), grad_norms, skipped, lr),
                           "train/skipped_updates_total": float(state.skipped_updates),
                           **expert_load.metrics(), **(replay.metrics() if replay else {}),
                           "rollout/staleness": float(step - 1 - batch.policy_version),
                           **engine_stats, **refit_stats, **eval_metrics,
                           **timer.metrics(generated, trained_tokens, dp_size), **save_time}
                logger.log(step, metrics)
                bar.advance(metrics)

                saved = cfg.checkpoint.saves_at(step, cfg.train.steps)
                save_time = save() if saved else {}
                # Every rank stops at the same step boundary, this step saved (interrupt).
                last_save_seconds = save_time.get("time/checkpoint", last_save_seconds)
                step_seconds = time.perf_counter() - timer.start
                if step < cfg.train.steps and stop.agreed(budget.exceeded(step_seconds, last_save_seconds)):
                    if not saved:
                        save()
                    stopped = True
                    if rank0:
                        print(f"[megatron-dgpo] stopped after step {step} "
                              f"({stop.reason or 'train.max_minutes or a signal on another rank'}); the checkpoint is saved, "
                              f"re-run the same command to continue", flush=True)
                    break

            if saver is not None:
                saver.close()  # the last checkpoint is published before it is exported or we exit
            if cfg.checkpoint.export_hf and rank0 and not stopped:
                export_latest(run_dir, cfg.checkpoint.export_dtype)
            comm.barrier()
            return EXIT_STOPPED if stopped else 0
        finally:  # a second signal included: free the engines and workers; nothing half-written is kept
            for closer in (rollout and rollout.close, logger and logger.close, saver and saver.abort):
                if closer:
                    closer()


def _refit(rollout: Rollout, models: list, version: int) -> dict[str, float]:
    """The engines take the weights of step ``version``: the updated parameters gathered (with
    overlapped param gather the last step left them to the next forward), then exported to the
    ranks that feed an engine. Collective."""
    sync_params(models)
    return rollout.refit(export_hf_weights(models, consumer=rollout.weight_consumer), version)


@contextlib.contextmanager
def _resident_beside_sleeping_engines(rollout: Rollout, offload: TrainingStateOffload):
    """The training state on the device for a checkpoint save. Offloaded, it comes back only
    after the engines, awake since the refit, have gone to sleep: the two never share the GPU
    (about 26 GB of optimizer state and fp32 gradients against ~10 GB free beside an awake
    engine at the 14B layout)."""
    if offload.enabled:
        rollout.sleep_engines()
    with offload.resident():
        yield


def _replay_recording(replay: RoutingReplay | None, prefix: str):
    """``replay.recording(prefix)``, or nothing without routing replay."""
    return replay.recording(prefix) if replay is not None else contextlib.nullcontext()


def _run_record(cfg: RunConfig, lr: float) -> dict:
    """What a checkpoint records about the run (the layout decides whether RNG is restored)."""
    from megatron.core import parallel_state as ps

    return {"layout": {"tensor_parallel": ps.get_tensor_model_parallel_world_size(),
                       "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
                       "data_parallel": ps.get_data_parallel_world_size()},
            "learning_rate": lr, "config": to_dict(cfg)}
