"""The RL loop, one step at a time, every DP replica on its own share of the batch:

    rollout (the replica's engines: colocated vLLM in its ranks, or one engine on its leader)
    -> rewards (math-verify workers, where the samples are) -> group advantages
    -> old log-probs, pi_prox (forward only; the engine's with ``algorithm.old_logprobs: rollout``)
    -> one optimizer update per mini-batch (N all-reduced)
    -> bucketed refit of each engine from its own replica's ranks
    -> (recipe section ``eval``, on schedule) held-out problems on the refitted engines -> log -> checkpoint

and, at the end, the final policy exported as an HF folder. What RL shares with the supervised
warm start (setup, resume, the step boundary with its checkpoint and agreed stop, the end) is
``training_run.TrainingRun``; this file holds the RL step (``RLStep``). Every piece lives in its
own module, named at each call (``rollout``, ``experience``, ``train_step``, ``telemetry``); this
file only wires them (``python -m megatron_dgpo.train`` is the command line).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace

from megatron_dgpo import telemetry
from megatron_dgpo.algorithm.advantages import batch_advantages, reduce_group_stats
from megatron_dgpo.algorithm.losses import merge_metrics
from megatron_dgpo.algorithm.mismatch import mismatch_metrics
from megatron_dgpo.convert import export_hf_groups
from megatron_dgpo.recipe import RunConfig
from megatron_dgpo.rollout.base import Rollout
from megatron_dgpo.rollout.evaluation import HeldOutEvaluation
from megatron_dgpo.rollout.schedule import Schedule
from megatron_dgpo.rollout.start import engine_rank, serve_engines, start_rollout
from megatron_dgpo.runtime.gpu_flags import pad_multiple
from megatron_dgpo.tasks.prompts import prompt_census
from megatron_dgpo.training.expert_load import ExpertLoad
from megatron_dgpo.training.minibatches import pack_update, plan_updates
from megatron_dgpo.training.offload import TrainingStateOffload
from megatron_dgpo.training.optimizer import step_if_finite, sync_params
from megatron_dgpo.training.routing_replay import RoutingReplay
from megatron_dgpo.training.train_step import fill_old_logprobs, prox_logprobs, train_step
from megatron_dgpo.training_run import TrainingRun


def train(cfg: RunConfig) -> int:
    """Run (or continue: ``cfg.checkpoint.resume``) the job ``cfg`` on the current torchrun
    world. Returns the exit status: 0 when every step ran, ``EXIT_STOPPED`` when a stop signal
    or ``train.max_minutes`` ended it early (with a checkpoint of the last completed step)."""
    if engine_rank(cfg.rollout):  # this rank is one of the engines' GPUs, not a trainer's
        return serve_engines(cfg.rollout, cfg.data, cfg.parallel, seed=cfg.train.seed)
    run = TrainingRun(cfg, seed=cfg.train.seed, steps=cfg.train.steps,
                      max_minutes=cfg.train.max_minutes, rollout_ranks=cfg.rollout.num_gpus,
                      routing_replay=cfg.algorithm.routing_replay)
    with run:
        rl_step = RLStep(cfg, run)
        return run.loop(rl_step, save=rl_step.save)


class RLStep:
    """One RL step on this rank (``__call__``), and what the steps share: the replica's rollout
    and its schedule (what is generated ahead), the held-out evaluation, the updates' telemetry."""

    def __init__(self, cfg: RunConfig, run: TrainingRun):
        self.cfg, self.run = cfg, run
        self.expert_load = ExpertLoad(run.models)  # MoE routing statistics (none if dense)
        self.replay = (RoutingReplay(run.models)  # the engine's expert choices, replayed
                       if cfg.algorithm.routing_replay == "r3" else None)
        self.offload = TrainingStateOffload(run.models, run.optimizer,
                                            enabled=cfg.train.offload_training_state)
        self.offload.offload()  # vLLM starts only if its share of the GPU is free then
        # the prompts too long for the rollout: said at every start, logged with step 1 only
        # (a resumed run's metrics equal the uninterrupted run's)
        dropped = _dropped_prompts(cfg, run)
        self.first_metrics = {} if run.state.step else dropped
        # held-out problems read and rendered on every rank before any engine starts
        self.evaluation = (HeldOutEvaluation.from_recipe(cfg.eval, run.hf_dir, cfg.rollout)
                           if cfg.eval.enabled else None)
        self.rollout = run.closing(start_rollout(
            cfg.rollout, cfg.data, cfg.parallel, run.hf_dir, seed=cfg.train.seed,
            batch_prompts=cfg.train.rollout_batch_prompts, version=run.state.step,
            record_routing=cfg.algorithm.routing_replay == "r3"))
        # what a stopped run had generated ahead (its batch, or its stream's buffer)
        self.schedule = Schedule(self.rollout, cfg.rollout, refill_rounds=cfg.algorithm.refill_rounds,
                                 steps=cfg.train.steps, resumed_from=run.resumed_from,
                                 prompts_consumed=run.state.prompts_consumed,
                                 dp_rank=run.dp_rank, dp_size=run.dp_size)
        if run.state.step or self.rollout.needs_first_refit:  # resumed, or engines without weights
            _refit(self.rollout, run.models, version=run.state.step)
        self.ledger = telemetry.JsonLines(run.run_dir / telemetry.SAMPLES_FILE,  # logging.samples
                                          enabled=run.rank0 and cfg.logging.samples)
        self.ledger.truncate_after(run.state.step)

    def __call__(self, step: int) -> dict[str, float]:
        """Step ``step``: the state advanced, the step's metrics returned. Collective."""
        cfg, run, rollout, group = self.cfg, self.run, self.rollout, self.cfg.rollout.group_size
        timer = telemetry.PhaseTimer()
        with timer("rollout"):
            batch, engine_stats, prompts_used = self.schedule.batch(step, run.state.prompts_consumed)
            adv = batch_advantages(batch, cfg.algorithm, group_size=group,
                                   max_response_tokens=cfg.rollout.max_response_tokens)
            batch.advantages, batch.loss_weights = adv.advantages, adv.loss_weights

        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_tokens, batch.response_tokens)]
        num_updates = cfg.train.rollout_batch_prompts // cfg.train.mini_batch_prompts
        plan = plan_updates(rollout.replica_prompts.start, len(rollout.replica_prompts), group,
                            num_updates, lengths)
        updates = [pack_update(batch, indices, cfg.train.micro_batch_tokens,
                               pad_multiple=pad_multiple(cfg.parallel.tensor_parallel,
                                                          cfg.parallel.context_parallel))
                   for indices in plan]
        mismatch = self._old_logprobs(updates, step, timer)

        with (timer("update"), self.expert_load.recording(),
              _replay_recording(self.replay, "train/")):
            self.offload.restore()
            parts, grad_norms, skipped, trained_tokens = [], [], 0, 0
            for rows in updates:
                result = train_step(run.models, rows, cfg.algorithm,
                                    temperature=cfg.rollout.temperature,
                                    chunk_size=cfg.train.log_prob_chunk_size,
                                    routing_replay=self.replay)
                parts.append(result.metrics)
                if not result.num_tokens:  # every group of this mini-batch was dropped
                    continue
                stepped, grad_norm = step_if_finite(run.optimizer, run.models, result.loss)
                skipped += not stepped
                grad_norms.append(grad_norm)
                trained_tokens += sum(int(r.tokens.numel()) for r in rows)
            run.state.skipped_updates += skipped
            self.offload.offload()  # before vLLM wakes for the refit and the next rollout

        if self.schedule.waiting:
            with timer("rollout_wait"):  # the trainer idles until the engines are done
                self.schedule.collect()
        with timer("refit"):  # the engines take step's weights between batches
            refit_stats = _refit(rollout, run.models, version=step)
        eval_metrics = {}
        if self.evaluation is not None and cfg.eval.due(step, cfg.train.steps):
            with timer("eval"):  # the refitted engines; outside time/step and throughput
                eval_metrics = self.evaluation.run(rollout)
        run.state.step, run.state.prompts_consumed = step, run.state.prompts_consumed + prompts_used

        if cfg.logging.samples:  # before the metrics line and the checkpoint, as it
            self.ledger.append(batch.ledger(step, group, run.dp_group))
        once, self.first_metrics = self.first_metrics, {}
        sampled = batch.rollout_metrics(group, run.dp_group)
        generated = round(sampled["rollout/response_length_mean"] * sampled["rollout/num_samples"])
        return {**sampled, **reduce_group_stats(adv.stats, run.dp_group), **mismatch,
                **telemetry.update_metrics(merge_metrics(parts), grad_norms, skipped, run.lr),
                "train/skipped_updates_total": float(run.state.skipped_updates),
                **self.expert_load.metrics(), **(self.replay.metrics() if self.replay else {}),
                "rollout/staleness": float(step - 1 - batch.policy_version),
                **batch.staleness_metrics(step, run.dp_group, segments=cfg.rollout.streaming),
                **engine_stats, **refit_stats, **eval_metrics, **once,
                **timer.metrics(generated, trained_tokens, run.dp_size)}

    def _old_logprobs(self, updates: list, step: int, timer) -> dict[str, float]:
        """pi_old of every packed row and the rollout/trainer mismatch. ``old_logprobs:
        rollout`` (bypass): the engine's, no forward (phase 0 s); the first mini-batch's forward
        runs on its schedule only to measure the mismatch (phase ``mismatch_check``)."""
        algorithm, rows = self.cfg.algorithm, [row for rows in updates for row in rows]
        forward = dict(temperature=self.cfg.rollout.temperature,
                       chunk_size=self.cfg.train.log_prob_chunk_size, routing_replay=self.replay)
        if algorithm.old_logprobs == "trainer":
            with timer("old_logprobs"), _replay_recording(self.replay, "mismatch/"):
                fill_old_logprobs(self.run.models, rows, **forward)
            return mismatch_metrics(rows, self.run.dp_group).as_dict()
        timer.skipped("old_logprobs")
        fill_old_logprobs(self.run.models, rows, "rollout")
        every = algorithm.old_logprobs_check_every
        if not every or (step - 1) % every:
            return {}
        with timer("mismatch_check"), _replay_recording(self.replay, "mismatch/"):
            trainer = prox_logprobs(self.run.models, updates[0], **forward)
            checked = [replace(row, old_logprobs=logp) for row, logp in zip(updates[0], trainer)]
            return mismatch_metrics(checked, self.run.dp_group).as_dict()

    def save(self) -> None:
        """A checkpoint of the step just run, with what the rollout holds ahead of it."""
        with _resident_beside_sleeping_engines(self.rollout, self.offload):
            self.run.save(write_extra=lambda folder: self.schedule.write(
                folder, leader=self.rollout.leader))


def _dropped_prompts(cfg: RunConfig, run: TrainingRun) -> dict[str, float]:
    """On rank 0: the training prompts the rollout leaves out as longer than
    ``rollout.max_prompt_tokens``, said in one line and returned as metrics."""
    if not run.rank0:
        return {}
    kept, total = prompt_census(cfg.data, run.hf_dir, cfg.rollout.max_prompt_tokens)
    print(f"dgpo-train: data: {total - kept} of {total} prompts are longer than "
          f"rollout.max_prompt_tokens={cfg.rollout.max_prompt_tokens} (with the chat template) "
          f"and left out", file=sys.stderr, flush=True)
    return {"data/prompts": float(total), "data/prompts_dropped_for_length": float(total - kept)}


def _refit(rollout: Rollout, models: list, version: int) -> dict[str, float]:
    """The engines take the weights of step ``version``: the updated parameters gathered (with
    overlapped param gather the last step left them to the next forward), then exported to the
    ranks that feed an engine. Collective."""
    sync_params(models)
    return rollout.refit(export_hf_groups(models, consumer=rollout.weight_consumer), version)


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
