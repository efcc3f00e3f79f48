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
``(s-1)*B .. s*B-1`` of an endless per-epoch shuffled order (``prompts.prompt_order``), each
data-parallel replica taking every DP-th sample, so a run (and a resumed run) is a function of
its recipe.

The data: a .jsonl/.json/.parquet file whose rows hold the prompt (a string or chat messages,
rendered with the tokenizer's chat template, as in the rollout) and the response text
(``sft.prompt_field`` / ``sft.response_field``); ``megatron_dgpo.tasks.arithmetic`` writes one.
"""

from __future__ import annotations

from megatron_dgpo.command import quiet_console, recipe_command  # first: the OpenMP default

import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Annotated  # noqa: E402

from megatron_dgpo.runtime.config import Bounds, check_bounds, load_config  # noqa: E402
from megatron_dgpo.runtime.errors import InputError, reported_as  # noqa: E402
from megatron_dgpo.runtime.parallel import ParallelConfig  # noqa: E402
from megatron_dgpo.telemetry import LoggingConfig  # noqa: E402
from megatron_dgpo.training.checkpoint import CheckpointConfig  # noqa: E402
from megatron_dgpo.training.optimizer import OptimizerConfig  # noqa: E402
from megatron_dgpo.training.policy import ModelConfig  # noqa: E402
from megatron_dgpo.training_run import TrainingRun  # noqa: E402


@dataclass
class SFTConfig:
    """The supervised data and the loop's sizes."""

    data: str = ""
    """The (prompt, response) pairs: a .jsonl/.json/.parquet file."""
    prompt_field: str = "prompt"
    """Dotted field holding the prompt (a string or chat messages)."""
    response_field: str = "response"
    """Dotted field holding the response text (the end-of-turn token is appended)."""
    steps: Annotated[int, Bounds(ge=1)] = 500
    """Optimizer steps."""
    batch_samples: Annotated[int, Bounds(ge=1)] = 64
    """Samples per optimizer step (split over the data-parallel replicas)."""
    micro_batch_tokens: Annotated[int, Bounds(ge=1)] = 4096
    """Token budget of one packed micro-batch row; must hold the longest prompt + response."""
    seed: Annotated[int, Bounds(ge=0)] = 0
    """Seeds the weights of a ``model.tiny`` policy and the data order."""
    max_minutes: Annotated[float | None, Bounds(gt=0)] = None
    """The job's own time budget, as ``train.max_minutes`` of the RL trainer: stop with a
    checkpoint (exit ``interrupt.EXIT_STOPPED``) when another step and a save would not fit."""

    def __post_init__(self):
        check_bounds(self)


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

    from megatron_dgpo.algorithm.packing import Sample
    from megatron_dgpo.tasks.prompts import load_sft_pairs, render_prompt

    if tokenizer.eos_token_id is None:
        raise InputError(f"tokenizer {tokenizer.name_or_path!r} has no eos token to end a response with")
    samples = []
    for i, (messages, response) in enumerate(load_sft_pairs(config.data, prompt_key=config.prompt_field,
                                                             response_key=config.response_field)):
        prompt_ids = render_prompt(tokenizer, messages)
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(prompt_ids) + len(response_ids) > config.micro_batch_tokens:
            raise InputError(f"{config.data} row {i}: {len(prompt_ids) + len(response_ids)} tokens "
                             f"do not fit in sft.micro_batch_tokens={config.micro_batch_tokens}")
        samples.append(Sample(torch.tensor(prompt_ids + response_ids), len(prompt_ids), {}))
    return samples


SFT_PROGRESS = {"loss": ("sft/loss", ".4f"), "s": ("time/step", ".2f")}
"""What the progress bar shows: label -> (metric, format)."""


def train_sft(cfg: SFTRunConfig) -> int:
    """Run (or continue: ``cfg.checkpoint.resume``) the supervised job ``cfg`` on the current
    torchrun world; ``run_dir/hf`` then holds the exported policy. Returns the exit status, as
    ``trainer.train``: 0, or ``EXIT_STOPPED`` after a stop signal or the time budget."""
    from transformers import AutoTokenizer

    run = TrainingRun(cfg, seed=cfg.sft.seed, steps=cfg.sft.steps,
                      max_minutes=cfg.sft.max_minutes, progress=SFT_PROGRESS)
    samples = tokenize_pairs(cfg.sft, AutoTokenizer.from_pretrained(str(run.hf_dir)))
    with run:
        return run.loop(lambda step: _sft_step(cfg, run, samples, step))


def _sft_step(cfg: SFTRunConfig, run: TrainingRun, samples: list, step: int) -> dict[str, float]:
    """Step ``step``: samples ``(step-1)*B .. step*B-1`` of the shuffled order, every DP-th to
    this replica, packed, one optimizer update. Collective."""
    from megatron_dgpo.algorithm.packing import pack
    from megatron_dgpo.runtime.gpu_flags import pad_multiple
    from megatron_dgpo.tasks.prompts import prompt_order
    from megatron_dgpo.training.optimizer import step_if_finite
    from megatron_dgpo.training.train_step import sft_step

    begin, config = time.perf_counter(), cfg.sft
    order = prompt_order(len(samples), config.seed, (step - 1) * config.batch_samples,
                         config.batch_samples)
    mine = [samples[i] for i in order[run.dp_rank::run.dp_size]]
    rows = pack(mine, config.micro_batch_tokens, pad_multiple(cfg.parallel.tensor_parallel,
                                                          cfg.parallel.context_parallel))
    loss, num_tokens = sft_step(run.models, rows)
    stepped, grad_norm = step_if_finite(run.optimizer, run.models, loss)
    run.state.step, run.state.skipped_updates = step, run.state.skipped_updates + (not stepped)
    return {"sft/loss": loss, "sft/tokens": float(num_tokens),
            "train/grad_norm": grad_norm, "train/lr": run.lr,
            "train/skipped_updates_total": float(run.state.skipped_updates),
            "time/step": time.perf_counter() - begin}


def load_sft_recipe(path, overrides=()) -> SFTRunConfig:
    """``SFTRunConfig`` from a YAML file and dotted ``key=value`` overrides."""
    return load_config(SFTRunConfig, path, overrides)


@reported_as("dgpo-sft")
def main(argv: list[str] | None = None) -> int:
    from megatron_dgpo.preflight import check_sft

    def run(config: SFTRunConfig) -> int:
        quiet_console("dgpo-sft", config.run_dir, verbose=config.logging.verbose)
        return train_sft(config)

    return recipe_command(argv, prog="dgpo-sft", module="megatron_dgpo.sft",
                          config_class=SFTRunConfig, load=load_sft_recipe, check=check_sft,
                          run=run, description="Supervised warm start of a policy from a recipe.",
                          example="recipes/sft_arithmetic.yaml")


if __name__ == "__main__":  # required: checkpoint writers start spawn-based worker processes
    sys.exit(main())
