"""Supervised warm start: train the policy on (prompt, response) pairs, then export it as an HF
folder that an RL recipe's ``model.path`` starts from (the paper's RL starts from a distilled
model, not from a random one).

    python -m megatron_dgpo.sft RECIPE [key=value ...] [--resume]
    torchrun --nproc-per-node 2 -m megatron_dgpo.sft RECIPE parallel.tensor_parallel=2

The same pieces as the RL trainer: Megatron-Core's model (any TP/PP/DP), sequence packing,
Megatron's optimizer, distributed checkpoints with ``--resume``, metrics.jsonl, and the HF
export through the converter. The loss is the token-mean negative log-likelihood of the response
tokens, the end-of-turn token included (so the policy learns to stop), normalised over the whole
batch exactly like the RL loss (``train_step.sft_step``). Step s trains on samples
``(s-1)*B .. s*B-1`` of an endless per-epoch shuffled order (``data.prompt_order``), each
data-parallel replica taking every DP-th sample, so a run (and a resumed run) is a function of
its recipe.

The data: a .jsonl/.json/.parquet file whose rows hold the prompt (a string or chat messages,
rendered with the tokenizer's chat template, as in the rollout) and the response text
(``sft.prompt_field`` / ``sft.response_field``); ``megatron_dgpo.arithmetic`` writes one.
"""

from __future__ import annotations

import os

# As in megatron_dgpo.train: one OpenMP thread per rank unless the environment says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import contextlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

from megatron_dgpo.checkpoint import CheckpointConfig  # noqa: E402
from megatron_dgpo.config import load_config  # noqa: E402
from megatron_dgpo.optimizer import OptimizerConfig  # noqa: E402
from megatron_dgpo.parallel import ParallelConfig  # noqa: E402
from megatron_dgpo.policy import ModelConfig  # noqa: E402
from megatron_dgpo.telemetry import LoggingConfig  # noqa: E402


@dataclass
class SFTConfig:
    """The supervised data and the loop's sizes."""

    data: str = ""
    """The (prompt, response) pairs: a .jsonl/.json/.parquet file."""
    prompt_field: str = "prompt"
    """Dotted field holding the prompt (a string or chat messages)."""
    response_field: str = "response"
    """Dotted field holding the response text (the end-of-turn token is appended)."""
    steps: int = 500
    """Optimizer steps."""
    batch_samples: int = 64
    """Samples per optimizer step (split over the data-parallel replicas)."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch row; must hold the longest prompt + response."""
    seed: int = 0
    """Seeds the weights of a ``model.tiny`` policy and the data order."""
    max_minutes: float | None = None
    """The job's own time budget, as ``train.max_minutes`` of the RL trainer: stop with a
    checkpoint (exit ``interrupt.EXIT_STOPPED``) when another step and a save would not fit."""

    def __post_init__(self):
        for name in ("steps", "batch_samples", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0 or None, got {self.max_minutes}")


@dataclass
class SFTRunConfig:
    """A supervised run. ``run_dir`` holds metrics.jsonl, checkpoints/, hf/ (the exported policy)."""

    run_dir: str = "outputs/sft"
    """Output folder (created); a run found there is continued (``checkpoint.resume``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        self.model.require_source()
        if not self.sft.data:
            raise ValueError("sft.data: the (prompt, response) file is required")


def tokenize_pairs(config: SFTConfig, tokenizer) -> list:
    """The pairs of ``config.data`` as ``packing.Sample`` (prompt ids by the chat template, then
    response ids and the end-of-turn id). A pair longer than ``micro_batch_tokens`` is an error
    naming its row (it could never be trained on)."""
    import torch

    from megatron_dgpo.data import load_sft_pairs, render_prompt
    from megatron_dgpo.packing import Sample

    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos token to end a response with")
    samples = []
    for i, (messages, response) in enumerate(load_sft_pairs(config.data, prompt_key=config.prompt_field,
                                                             response_key=config.response_field)):
        prompt_ids = render_prompt(tokenizer, messages)
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(prompt_ids) + len(response_ids) > config.micro_batch_tokens:
            raise ValueError(f"{config.data} row {i}: {len(prompt_ids) + len(response_ids)} tokens "
                             f"do not fit in sft.micro_batch_tokens={config.micro_batch_tokens}")
        samples.append(Sample(torch.tensor(prompt_ids + response_ids), len(prompt_ids), {}))
    return samples


def train_sft(cfg: SFTRunConfig) -> int:
    """Run (or continue: ``cfg.checkpoint.resume``) the supervised job ``cfg`` on the current
    torchrun world; ``run_dir/hf`` then holds the exported policy. Returns the exit status, as
    ``trainer.train``: 0, or ``EXIT_STOPPED`` after a stop signal or the time budget."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from megatron_dgpo import comm, model, policy, telemetry
    from megatron_dgpo.checkpoint import (TrainerState, checkpoint_to_resume, export_latest,
                                          load_checkpoint, save_checkpoint)
    from megatron_dgpo.interrupt import EXIT_STOPPED, TimeBudget, stop_requests
    from megatron_dgpo.config import to_dict
    from megatron_dgpo.data import prompt_order
    from megatron_dgpo.gpu_config import pad_multiple
    from megatron_dgpo.optimizer import build_optimizer, step_if_finite, use_distributed_optimizer
    from megatron_dgpo.packing import pack
    from megatron_dgpo.parallel import init_distributed, initialize_parallel
    from megatron_dgpo.recipe import save_recipe
    from megatron_dgpo.train_step import sft_step

    run = cfg.sft
    budget = TimeBudget(run.max_minutes)
    init_distributed(timeout_minutes=cfg.parallel.timeout_minutes,
                     watchdog_minutes=cfg.parallel.watchdog_minutes,
                     tensor_parallel=cfg.parallel.tensor_parallel)
    initialize_parallel(cfg.parallel, seed=run.seed)
    rank0, run_dir = dist.get_rank() == 0, Path(cfg.run_dir)
    hf_dir = policy.initial_model(cfg.model, run_dir, run.seed)
    samples = tokenize_pairs(run, AutoTokenizer.from_pretrained(str(hf_dir)))
    models, hf_config, dtype = policy.build_policy(
        cfg.model, hf_dir, use_distributed_optimizer=use_distributed_optimizer(cfg.optimizer))
    lr = cfg.optimizer.learning_rate(cfg.model.nominal_params or policy.count_parameters(hf_dir))
    optimizer = build_optimizer(cfg.optimizer, models, lr=lr, bf16=dtype == torch.bfloat16)
    state = TrainerState(extra={"learning_rate": lr, "config": to_dict(cfg)})
    if (latest := checkpoint_to_resume(run_dir / "checkpoints", cfg.checkpoint.resume)) is not None:
        state = load_checkpoint(latest, models, optimizer)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if rank0:
        save_recipe(cfg, run_dir)
    logger = telemetry.MetricsLogger(run_dir, cfg.logging, enabled=rank0)

    def save() -> float:
        begin = time.perf_counter()
        save_checkpoint(run_dir / "checkpoints", state, models, optimizer,
                        hf_config=hf_config, padded_vocab_size=model.padded_vocab_of(models),
                        dtype=dtype, hf_dir=str(hf_dir), keep_last=cfg.checkpoint.keep_last,
                        optimizer_sharding=cfg.checkpoint.optimizer_sharding)
        return time.perf_counter() - begin

    stopped, save_seconds = False, 0.0
    with stop_requests() as stop, contextlib.closing(logger):
        logger.truncate_after(state.step)
        bar = telemetry.ProgressBar(run.steps, state.step, enabled=rank0 and cfg.logging.progress_bar,
                                    show={"loss": ("sft/loss", ".4f"), "s": ("time/step", ".2f")})
        for step in range(state.step + 1, run.steps + 1):
            begin = time.perf_counter()
            order = prompt_order(len(samples), run.seed, (step - 1) * run.batch_samples, run.batch_samples)
            mine = [samples[i] for i in order[dp_rank::dp_size]]
            rows = pack(mine, run.micro_batch_tokens, pad_multiple(cfg.parallel.tensor_parallel))
            loss, num_tokens = sft_step(models, rows)
            stepped, grad_norm = step_if_finite(optimizer, models, loss)
            state.step, state.skipped_updates = step, state.skipped_updates + (not stepped)
            metrics = {"sft/loss": loss, "sft/tokens": float(num_tokens),
                       "train/grad_norm": grad_norm, "train/lr": lr,
                       "train/skipped_updates_total": float(state.skipped_updates),
                       "time/step": time.perf_counter() - begin}
            logger.log(step, metrics)
            bar.advance(metrics)
            saved = cfg.checkpoint.saves_at(step, run.steps)
            if saved:
                save_seconds = save()
            if step < run.steps and stop.agreed(budget.exceeded(metrics["time/step"], save_seconds)):
                if not saved:
                    save()
                stopped = True
                break
        if cfg.checkpoint.export_hf and rank0 and not stopped:
            export_latest(run_dir, cfg.checkpoint.export_dtype)
        comm.barrier()
        return EXIT_STOPPED if stopped else 0


def load_sft_recipe(path, overrides=()) -> SFTRunConfig:
    """``SFTRunConfig`` from a YAML file and dotted ``key=value`` overrides."""
    return load_config(SFTRunConfig, path, overrides)


def main(argv: list[str] | None = None) -> int:
    from megatron_dgpo.train import recipe_command

    return recipe_command(argv, prog="dgpo-sft", config_class=SFTRunConfig, load=load_sft_recipe,
                          run=train_sft,
                          description="Supervised warm start of a policy from a recipe.",
                          example="recipes/sft_arithmetic.yaml")


if __name__ == "__main__":  # required: checkpoint writers start spawn-based worker processes
    sys.exit(main())
