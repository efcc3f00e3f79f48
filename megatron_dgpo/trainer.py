"""The RL loop, one step at a time, every DP replica on its own share of the batch:

    rollout (the replica's engines: colocated vLLM in its ranks, or one engine on its leader)
    -> rewards (math-verify workers, where the samples are) -> group advantages
    -> old log-probs (forward only) -> one optimizer update per mini-batch (N all-reduced)
    -> bucketed refit of each engine from its own model-parallel group -> log -> checkpoint

and, at the end, the final policy exported as an HF folder. Every piece lives in its own
module, named at each call (``model``, ``data``, ``rollout.generate``, ``experience``,
``train_step``, ``telemetry``, ``checkpoint``); this file only wires them
(``python -m megatron_dgpo.train`` is the command line).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dgpo import data, model, policy, telemetry
from megatron_dgpo.advantages import drop_degenerate_groups, group_advantages
from megatron_dgpo.checkpoint import (AsyncSaver, TrainerState, export_hf, latest_checkpoint,
                                      load_checkpoint, save_checkpoint)
from megatron_dgpo.config import to_dict
from megatron_dgpo.convert import export_hf_weights
from megatron_dgpo.experience import (Experience, pack_update, plan_updates, prompt_order,
                                      reduce_group_stats, rollout_metrics)
from megatron_dgpo.gpu_config import pad_multiple
from megatron_dgpo.losses import merge_metrics, sample_loss_weights
from megatron_dgpo.optimizer import (build_optimizer, step_if_finite, sync_params,
                                     use_distributed_optimizer)
from megatron_dgpo.parallel import init_distributed, initialize_parallel
from megatron_dgpo.recipe import RunConfig, save_recipe
from megatron_dgpo.rollout.generate import build_engine, generate_experience, reward_pool
from megatron_dgpo.rollout.refit import RefitStats
from megatron_dgpo.rollout.placement import engine_tensor_parallel, rollout_role
from megatron_dgpo.rollout.mismatch import mismatch_metrics
from megatron_dgpo.train_step import LossConfig, forward_logprobs, train_step


def train(cfg: RunConfig, *, resume: bool = False) -> Path:
    """Run (or, with ``resume``, continue) the job ``cfg`` on the current torchrun world.
    Returns the run directory."""
    from megatron.core import parallel_state as ps

    init_distributed(timeout_minutes=cfg.parallel.timeout_minutes)  # before any engine
    initialize_parallel(cfg.parallel, seed=cfg.train.seed)
    rank0, run_dir = dist.get_rank() == 0, Path(cfg.run_dir)
    hf_dir = policy.initial_model(cfg.model, run_dir, cfg.train.seed)
    models, hf_config, dtype = policy.build_policy(
        cfg.model, hf_dir, use_distributed_optimizer=use_distributed_optimizer(cfg.optimizer))
    lr = cfg.optimizer.learning_rate(cfg.model.nominal_params or policy.count_parameters(hf_dir))
    optimizer = build_optimizer(cfg.optimizer, models, lr=lr, bf16=dtype == torch.bfloat16)
    saver = AsyncSaver() if cfg.checkpoint.async_save else None  # refused on CPU
    state = TrainerState(extra=_run_record(cfg, lr))
    if resume and (latest := latest_checkpoint(run_dir / "checkpoints")) is not None:
        state = load_checkpoint(latest, models, optimizer)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    dp_group, mp_group = ps.get_data_parallel_group(), ps.get_model_parallel_group()
    loss_cfg = LossConfig(method=cfg.algorithm.method, temperature=cfg.rollout.temperature,
                          hyperparams=cfg.algorithm.loss, chunk_size=cfg.train.log_prob_chunk_size,
                          aggregation=cfg.algorithm.loss_aggregation,
                          rollout_correction=cfg.algorithm.rollout_correction,
                          rollout_correction_cap=cfg.algorithm.rollout_correction_cap)
    group, num_updates = cfg.rollout.group_size, cfg.train.rollout_batch_prompts // cfg.train.mini_batch_prompts
    colocated = cfg.rollout.engine == "vllm" and cfg.rollout.placement == "colocated"
    engine_tp = engine_tensor_parallel(cfg.rollout.tensor_parallel_size,
                                       tensor_parallel=cfg.parallel.tensor_parallel,
                                       pipeline_parallel=cfg.parallel.pipeline_parallel,
                                       data_parallel=dp_size)
    role = rollout_role(colocated=colocated, engine_tp=engine_tp, rank=dist.get_rank(),
                        world_size=dist.get_world_size(),
                        model_parallel_ranks=dist.get_process_group_ranks(mp_group),
                        dp_rank=dp_rank, dp_size=dp_size,
                        num_prompts=cfg.train.rollout_batch_prompts)
    engine = pool = logger = None
    try:
        if rank0:
            save_recipe(cfg, run_dir)
        if role.has_engine:
            prompts, tokenizer = data.load_prompts(cfg.data, hf_dir, cfg.rollout.max_prompt_tokens)
            engine = build_engine(cfg.rollout, hf_dir, seed=cfg.train.seed,
                                  placement="colocated" if colocated else "separate",
                                  tensor_parallel_size=engine_tp if colocated else None)
        if role.grades:
            pool = reward_pool()
            kind = "colocated vllm" if colocated else "hf" if cfg.rollout.engine == "hf" else "separate vllm"
            width = engine_tp if colocated else cfg.rollout.tensor_parallel_size or 1
            print(f"dgpo-train: rank {dist.get_rank()} (DP replica {dp_rank}): {kind} engine of "
                  f"TP {width}, one of {role.num_engines}; samples batch positions "
                  f"{role.prompts.start}..{role.prompts.stop - 1} of {cfg.train.rollout_batch_prompts}",
                  file=sys.stderr, flush=True)
        logger = telemetry.MetricsLogger(run_dir, cfg.logging, enabled=rank0)
        logger.truncate_after(state.step)
        if state.step:  # resumed: the engine starts from the initial weights
            _refit(models, engine, colocated)
        bar = telemetry.ProgressBar(cfg.train.steps, state.step,
                                    enabled=rank0 and cfg.logging.progress_bar)
        save_time = {}
        for step in range(state.step + 1, cfg.train.steps + 1):
            timer = telemetry.PhaseTimer()
            if saver is not None:
                saver.poll()  # publish a background save that has finished on every rank
            with timer("rollout"):
                piece, generation_s = None, 0.0
                if role.has_engine:
                    indices = prompt_order(len(prompts), cfg.train.seed, state.prompts_consumed,
                                           cfg.train.rollout_batch_prompts)
                    begin = time.perf_counter()
                    piece = generate_experience(engine, pool, tokenizer, prompts, indices,
                                                role.prompts, cfg.rollout,
                                                base_seed=(cfg.train.seed << 20) + state.prompts_consumed)
                    generation_s = time.perf_counter() - begin
                    engine_sleep = getattr(engine, "sleep", None)
                    if engine_sleep:  # GPU: free the KV cache for training; CPU: logs once
                        engine_sleep()
                batch = piece.gather(mp_group) if piece is not None else _gather_none(mp_group)
                batch.advantages, adv_stats = group_advantages(
                    torch.tensor(batch.rewards), group, eps=cfg.algorithm.advantage_eps,
                    unbiased=cfg.algorithm.advantage_unbiased_std)
                # issue 14 hook: per-sample aggregation weights over whole groups, 0 for groups
                # the degenerate filter drops (None on the default path: token_mean, no filter)
                kept = (drop_degenerate_groups(batch.rewards, group)
                        if cfg.algorithm.drop_degenerate_groups else None)
                batch.loss_weights = sample_loss_weights(
                    [len(r) for r in batch.response_tokens], group,
                    cfg.algorithm.loss_aggregation, kept and kept.keep)
                engine_stats = _engine_metrics(piece, generation_s, role)

            with timer("old_logprobs"):
                lengths = [len(p) + len(r) for p, r in zip(batch.prompt_tokens, batch.response_tokens)]
                plan = plan_updates(role.replica_prompts.start, len(role.replica_prompts), group,
                                    num_updates, lengths)
                updates = [pack_update(batch, indices, cfg.train.micro_batch_tokens,
                                       pad_multiple=pad_multiple(cfg.parallel.tensor_parallel))
                           for indices in plan]
                rows = [row for rows_u in updates for row in rows_u]
                outputs = forward_logprobs(models, rows,
                                           temperature=cfg.rollout.temperature,
                                           chunk_size=cfg.train.log_prob_chunk_size)
                for row, (logp, _) in zip(rows, outputs):
                    row.old_logprobs = torch.where(row.loss_mask, logp, 0.0)
                mismatch = mismatch_metrics(rows, ps.get_data_parallel_group()).as_dict()

            with timer("update"):
                parts, grad_norms, skipped, trained_tokens = [], [], 0, 0
                for rows_u in updates:
                    result = train_step(models, rows_u, loss_cfg)
                    if not result.num_tokens:  # issue 14: all its groups dropped: no update
                        parts.append(result.metrics)
                        continue
                    stepped, grad_norm = step_if_finite(optimizer, models, result.loss)
                    skipped += not stepped
                    parts.append(result.metrics)
                    grad_norms.append(grad_norm)
                    trained_tokens += sum(int(r.tokens.numel()) for r in rows_u)
                state.skipped_updates += skipped

            with timer("refit"):
                refit = _refit(models, engine, colocated)
            state.step, state.prompts_consumed = step, state.prompts_consumed + cfg.train.rollout_batch_prompts

            # Logged before the checkpoint: a crash after the save cannot lose this step's line
            # (a resumed run drops lines past its checkpoint). The save's time goes to the next line.
            rollout = rollout_metrics(batch, group, dp_group)
            generated = round(rollout["rollout/response_length_mean"] * rollout["rollout/num_samples"])
            group_stats = {**adv_stats.as_dict(), **(kept.as_dict() if kept else {})}
            metrics = {**rollout, **reduce_group_stats(group_stats, dp_group), **mismatch,
                       **telemetry.update_metrics(merge_metrics(parts), grad_norms, skipped, lr),
                       "train/skipped_updates_total": float(state.skipped_updates),
                       **engine_stats, **_refit_metrics(refit),
                       **timer.metrics(generated, trained_tokens, dp_size), **save_time}
            logger.log(step, metrics)
            bar.advance(metrics)

            save_time = {}
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 or step == cfg.train.steps:
                begin = time.perf_counter()
                save_checkpoint(run_dir / "checkpoints", state, models, optimizer,
                                hf_config=hf_config, padded_vocab_size=model.padded_vocab_of(models),
                                dtype=dtype, hf_dir=str(hf_dir), keep_last=cfg.checkpoint.keep_last,
                                saver=saver)
                save_time = {"time/checkpoint": time.perf_counter() - begin}

        if saver is not None:
            saver.wait()  # the last checkpoint is published before it is exported or we exit
        if cfg.checkpoint.export_hf and rank0:
            export_hf(latest_checkpoint(run_dir / "checkpoints"), run_dir / "hf",
                      cfg.checkpoint.export_dtype and model.dtype_named(cfg.checkpoint.export_dtype))
        dist.barrier()
        return run_dir
    finally:  # Ctrl-C included: free the engine and workers; nothing half-written is kept
        for closer in (engine and engine.shutdown, pool and pool.close, logger and logger.close):
            if closer:
                closer()


def _run_record(cfg: RunConfig, lr: float) -> dict:
    """What a checkpoint records about the run (the layout decides whether RNG is restored)."""
    from megatron.core import parallel_state as ps

    return {"layout": {"tensor_parallel": ps.get_tensor_model_parallel_world_size(),
                       "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
                       "data_parallel": ps.get_data_parallel_world_size()},
            "learning_rate": lr, "config": to_dict(cfg)}


def _gather_none(group):
    """A rank that graded nothing takes its replica's samples from the ranks that did."""
    return Experience([], [], [], [], []).gather(group)


def _engine_metrics(piece, generation_s: float, role) -> dict[str, float]:
    """``rollout/engines`` (engines that sampled this step) and generation tokens/s per engine
    (mean over them; each engine's leader contributes its own rate). Collective (world)."""
    rate = torch.zeros(2, dtype=torch.float64)
    if piece is not None and len(role.prompts):
        rate[0] = sum(len(r) for r in piece.response_tokens) / max(generation_s, 1e-9)
        rate[1] = 1.0
    if dist.get_world_size() > 1:
        dist.all_reduce(rate)
    return {"rollout/engines": float(role.active_engines),
            "throughput/generation_tokens_per_s_per_engine": float(rate[0] / max(rate[1], 1.0))}


def _refit(models: list, engine, colocated: bool):
    """Stream the trained weights into this rank's engine: a collective over the replica's
    model-parallel group only (each replica feeds its own engines). Colocated engines take the
    full HF tensors on every rank (each engine rank slices its TP shard); a separate or
    transformers engine on the replica leader takes them there. Returns the ``RefitStats`` (or
    None: no engine here, or the transformers engine)."""
    sync_params(models)  # overlapped param gather: the updated weights, not the last forward's
    pairs = export_hf_weights(models, consumer="all" if colocated else "first")
    if engine is not None:
        return engine.update_weights(pairs)
    for _ in pairs:  # the other ranks take part in the gathers
        pass
    return None


def _refit_metrics(stats) -> dict[str, float]:
    """``refit/buckets``, ``refit/max_bucket_bytes``, ``refit/seconds``: the largest over the
    engines (collective: world)."""
    keys = tuple(RefitStats().as_metrics())
    values = torch.tensor([stats.as_metrics()[k] if stats is not None else 0.0 for k in keys],
                          dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    if not values.any():  # no engine reported buckets (transformers engine)
        return {}
    return dict(zip(keys, values.tolist()))
