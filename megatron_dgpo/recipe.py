"""The schema of a run: ``recipes/*.yaml`` files are ``RunConfig`` trees.

    cfg = load_recipe("recipes/tiny_cpu.yaml", ["algorithm.method=grpo", "train.steps=5"])

Each section is a small dataclass handed to the one component that uses it (the trainer never
passes the whole tree down), and it lives with that component, so that no component imports the
run's schema: ``model`` (``policy.ModelConfig``) to model loading, ``parallel``
(``parallel.ParallelConfig``) to Megatron's parallel state, ``rollout``
(``rollout.config.RolloutConfig``) to the rollout engines, ``optimizer``
(``optimizer.OptimizerConfig``) to Megatron's optimizer, ``data`` (``prompts.DataConfig``) to the
prompt source, ``checkpoint`` (``checkpoint.CheckpointConfig``) to save/resume, ``logging``
(``telemetry.LoggingConfig``) to telemetry, ``eval`` (``rollout.evaluation.EvalConfig``) to the
evaluation on held-out problems during training. The loop's own sections are declared here,
since the loop sits above the schema: ``algorithm`` (advantages, the loss, DAPO's filter and
refill, DAPO's overlong filtering and penalty, routing replay) and ``train`` (the loop's sizes
and seeds). ``RunConfig`` composes them and checks what spans sections. Every field is documented right under its declaration;
``python -m megatron_dgpo.train --describe`` prints them all.

Batch sizes count prompts (the paper's convention: rollout batch 512 prompts, mini-batch 32),
each prompt giving ``rollout.group_size`` responses; there are
``train.rollout_batch_prompts / train.mini_batch_prompts`` optimizer updates per rollout batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from megatron_dgpo.algorithm.losses import LossConfig
from megatron_dgpo.algorithm.packing import padded_length
from megatron_dgpo.rollout.config import RolloutConfig
from megatron_dgpo.rollout.evaluation import EvalConfig
from megatron_dgpo.rollout.placement import MAX_TRAIN_SEED
from megatron_dgpo.runtime.config import Bounds, check_bounds, load_config, require_choice
from megatron_dgpo.runtime.gpu_flags import pad_multiple
from megatron_dgpo.runtime.parallel import ParallelConfig
from megatron_dgpo.tasks.prompts import DataConfig
from megatron_dgpo.telemetry import LoggingConfig
from megatron_dgpo.training.checkpoint import CheckpointConfig
from megatron_dgpo.training.optimizer import OptimizerConfig
from megatron_dgpo.training.policy import ModelConfig


@dataclass
class AlgorithmConfig(LossConfig):
    """The policy-gradient method (the loss's fields, ``losses.LossConfig``), its advantage
    estimator, DAPO's filter and refill, DAPO's overlong filtering and soft overlong
    punishment, routing replay."""

    advantage_eps: Annotated[float, Bounds(ge=0)] = 1e-6
    """Added to the group's reward std before dividing (groups with one distinct reward get 0)."""
    advantage_unbiased_std: bool = True
    """Sample (n-1) std of the group's rewards, as GRPO's reference code; False: population std."""
    drop_degenerate_groups: bool = False
    """DAPO's filter: prompt groups whose rewards are all equal are left out of the update (no
    tokens in the loss or in N; counted as ``adv/num_dropped_groups``)."""
    refill_rounds: Annotated[int, Bounds(ge=0)] = 0
    """With ``drop_degenerate_groups``: DAPO's dynamic sampling, up to this many extra sampling
    rounds per step. Each batch position whose group came out degenerate is sampled again from
    the next unused prompt of the stream, until every position holds an informative group or
    the rounds run out (positions still degenerate then are dropped as without refill). So the
    step trains on ``rollout_batch_prompts`` informative groups while the policy sharpens. Logged:
    ``rollout/refill_rounds``, ``rollout/discarded_groups``. 0: drop without refilling."""
    overlong_filter: bool = False
    """DAPO's overlong filtering (NeMo-RL's ``overlong_filtering``): every sample truncated at
    ``rollout.max_response_tokens`` (finish reason "length") gets loss weight 0 on each of its
    tokens, so it takes no part in the loss, in N or in the loss metrics, whatever the
    ``loss_aggregation`` (``group_token_mean`` sums the group's kept samples only). It still
    counts in its group's reward mean and std, as in NeMo-RL: only its own term leaves the
    loss. A mini-batch left with no token is not stepped. Logged: ``adv/overlong_filtered_frac``
    (the share of samples filtered; ``rollout/truncated_frac`` is logged in any case).
    False: truncated samples train like the others."""
    overlong_penalty_window: Annotated[int, Bounds(ge=0)] = 0
    """DAPO's soft overlong punishment: the length L_cache of the window below the response
    cap L_max = ``rollout.max_response_tokens`` over which a response's reward is penalised,
    linearly from 0 at |y| = L_max - L_cache to -``overlong_penalty_factor`` at L_max (a
    truncated response gets the whole penalty). The penalty is added to each sample's task
    reward before the group advantages; the accuracy, ``rollout/reward_mean``, the
    degenerate-group filter and the refill keep judging the task reward (verl's
    ``filter_groups.metric: acc``), while ``adv/reward_mean`` is the penalised reward's. verl's
    ``overlong_buffer.len``, NeMo-RL's ``overlong_buffer_length`` (DAPO: 4096 of 20480).
    Logged: ``adv/overlong_penalty_mean``, ``adv/overlong_penalized_frac`` (the share of
    samples with a penalty < 0). Below ``rollout.max_response_tokens``. 0: off."""
    overlong_penalty_factor: Annotated[float, Bounds(gt=0)] = 1.0
    """The penalty at the cap (verl's ``overlong_buffer.penalty_factor``, NeMo-RL's
    ``overlong_buffer_penalty``): R_length = -factor (|y| - (L_max - L_cache)) / L_cache in the
    window. A finite number > 0; 1.0 is DAPO's (the reward of a correct answer, +1, falls to 0
    at the cap). Used only with ``overlong_penalty_window`` > 0."""
    routing_replay: Literal["off", "r3"] = "off"
    """MoE models: ``r3`` (rollout routing replay) makes the trainer route every token to the
    experts the rollout engine chose for it, in the old-log-prob and the training forwards
    (Megatron's ``RouterReplay``; the gate weights still come from the current router, which
    keeps its gradient). The engine records the choices: vLLM's routed-experts output
    (``enable_return_routed_experts``) on GPU, a capture hook on vLLM's routers on CPU (a
    colocated engine only, with prefix caching off; on the tiny MoE job the rollout takes as
    long as without it).
    Logged: ``mismatch/routing_replay_diff_frac`` (old-log-prob forward) and
    ``train/routing_replay_diff_frac`` (updates), the share of token-layers whose free routing
    would differ from the replayed one. Refused for a dense model and the ``hf`` engine.
    ``off``: the trainer routes freely and nothing is recorded."""

    def __post_init__(self):
        check_bounds(self)
        super().__post_init__()
        require_choice("routing_replay", self.routing_replay, ("off", "r3"))
        if self.refill_rounds and not self.drop_degenerate_groups:
            raise ValueError("refill_rounds refills the groups drop_degenerate_groups drops: "
                             "set drop_degenerate_groups: true as well, or refill_rounds: 0")


@dataclass
class TrainConfig:
    """The loop's sizes and seeds."""

    steps: Annotated[int, Bounds(ge=1)] = 100
    """RL steps (rollout batches) to run in total, counting those of a resumed run."""
    rollout_batch_prompts: Annotated[int, Bounds(ge=1)] = 512
    """Prompts sampled per step (the paper: 512)."""
    mini_batch_prompts: Annotated[int, Bounds(ge=1)] = 32
    """Prompts per optimizer update (the paper: 32, i.e. 16 updates per rollout batch). Their
    responses are split over the data-parallel ranks."""
    micro_batch_tokens: Annotated[int, Bounds(ge=1)] = 16384
    """Token budget of one packed micro-batch row (sequence packing). Must hold the longest
    prompt + response."""
    seed: Annotated[int, Bounds(ge=0, lt=MAX_TRAIN_SEED)] = 42
    """Seeds weights' RNG, the prompt order, vLLM sampling and mini-batch shuffling: a run is a
    function of its config (and resuming does not change it). In [0, 2**23): each seed owns
    2**40 sampling streams (``rollout.placement.prompt_seeds``)."""
    log_prob_chunk_size: Annotated[int | None, Bounds(ge=1)] = None
    """Tokens per chunk in the vocab-parallel log-prob kernel (None: automatic)."""
    offload_training_state: bool = False
    """Move the gradient buffers and the optimizer state (Adam moments, fp32 main weights) off
    the GPU after each step's updates and back before the next step's (``megatron_dgpo.training.offload``),
    so the colocated vLLM engine refits and generates without them beside it (NeMo-RL's offload
    before refit). Costs host memory (~16 bytes per parameter of a rank's shard, pinned) and
    two host copies of them per step. The state also leaves before the engines start, so vLLM
    finds its ``gpu_memory_utilization`` free. ``dgpo-plan`` counts it. Off by default; on in
    the 14B-70B recipes, which give the freed memory to vLLM's KV cache."""
    max_minutes: Annotated[float | None, Bounds(gt=0)] = None
    """The job's own time budget (Megatron-LM's ``--exit-duration-in-mins``): the run stops
    with a checkpoint, as on a stop signal, after the first step at whose end another step
    and a save would likely not fit (elapsed + the last step's time + the last save's time >
    budget), and exits with ``interrupt.EXIT_STOPPED``. Counted from the trainer's start (a
    restarted or requeued attempt has its own). None: no budget."""

    def __post_init__(self):
        check_bounds(self)
        if self.rollout_batch_prompts % self.mini_batch_prompts:
            raise ValueError(f"rollout_batch_prompts ({self.rollout_batch_prompts}) must be a "
                             f"multiple of mini_batch_prompts ({self.mini_batch_prompts})")


@dataclass
class RunConfig:
    """A whole run. ``run_dir`` holds everything it writes: metrics.jsonl, tensorboard/,
    checkpoints/, hf/, the resolved config.yaml."""

    run_dir: str = "outputs/run"
    """Output folder of the run (created). A run found there is continued
    (``checkpoint.resume``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        self.model.require_source()
        context = self.rollout.max_prompt_tokens + self.rollout.max_response_tokens
        if self.eval.max_tokens is not None and self.eval.max_tokens >= context:
            raise ValueError(f"eval.max_tokens ({self.eval.max_tokens}) leaves no room for a "
                             f"prompt in the engines' context of {context} tokens "
                             f"(rollout.max_prompt_tokens + rollout.max_response_tokens)")
        if self.algorithm.routing_replay != "off" and self.rollout.engine != "vllm":
            raise ValueError(f"algorithm.routing_replay: {self.algorithm.routing_replay} needs an "
                             f"engine that records each token's expert choices; rollout.engine "
                             f"{self.rollout.engine!r} cannot (use rollout.engine: vllm)")
        if self.rollout.placement == "dedicated":
            for on, what in ((self.eval.enabled, "eval (held-out evaluation on the engines)"),
                             (self.algorithm.routing_replay != "off", "algorithm.routing_replay")):
                if on:
                    raise ValueError(f"{what} does not run on dedicated engines yet: use "
                                     f"rollout.placement: colocated for it")
        if self.rollout.streaming:
            if self.algorithm.rollout_correction == "none":
                raise ValueError(f"rollout.max_staleness: {self.rollout.max_staleness}"
                                 f"{' with rollout.partial' if self.rollout.partial else ''} "
                                 f"trains on samples of older policies than pi_old: it needs a "
                                 f"behaviour correction (algorithm.rollout_correction: tis), not "
                                 f"none")
            if self.algorithm.refill_rounds:
                raise ValueError("algorithm.refill_rounds does not run on the streaming schedule "
                                 "(rollout.max_staleness >= 2 or rollout.partial) yet: use "
                                 "refill_rounds: 0 there")
        if self.algorithm.overlong_penalty_window >= self.rollout.max_response_tokens:
            raise ValueError(f"algorithm.overlong_penalty_window "
                             f"({self.algorithm.overlong_penalty_window}) must be below "
                             f"rollout.max_response_tokens ({self.rollout.max_response_tokens}): "
                             f"the penalty window sits below the response cap")
        self._check_old_logprobs_from_rollout()
        longest = padded_length(self.rollout.max_prompt_tokens + self.rollout.max_response_tokens,
                                pad_multiple(self.parallel.tensor_parallel,
                                             self.parallel.context_parallel))
        if self.train.micro_batch_tokens < longest:
            raise ValueError(f"train.micro_batch_tokens ({self.train.micro_batch_tokens}) cannot "
                             f"hold the longest sample: rollout.max_prompt_tokens "
                             f"({self.rollout.max_prompt_tokens}) + rollout.max_response_tokens "
                             f"({self.rollout.max_response_tokens}), padded for TP x CP, is "
                             f"{longest} tokens; set train.micro_batch_tokens={longest} or more")


    def _check_old_logprobs_from_rollout(self) -> None:
        """``algorithm.old_logprobs: rollout`` only where the engine's log-probs are pi_old."""
        if self.algorithm.old_logprobs != "rollout":
            return
        why = "algorithm.old_logprobs: rollout takes pi_old from the engine's log-probs"
        if self.rollout.top_p < 1:
            raise ValueError(f"{why}, which rollout.top_p = {self.rollout.top_p} < 1 makes those "
                             f"of a truncated distribution: use old_logprobs: trainer")
        if self.rollout.max_staleness >= 1:
            raise ValueError(f"{why}, but rollout.max_staleness = {self.rollout.max_staleness} "
                             f"needs pi_prox, the trainer's policy at the start of the step "
                             f"(the decoupled objective): use old_logprobs: trainer")
        if (self.rollout.dtype != self.model.dtype
                and not self.algorithm.old_logprobs_accept_dtype_mismatch):
            raise ValueError(f"{why}, and rollout.dtype {self.rollout.dtype!r} is not the "
                             f"trainer's model.dtype {self.model.dtype!r} ('auto' follows the "
                             f"checkpoint): set rollout.dtype: {self.model.dtype}, or accept the "
                             f"difference with algorithm.old_logprobs_accept_dtype_mismatch: true")


def load_recipe(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """``RunConfig`` from a recipe YAML and dotted ``key=value`` overrides (errors name the key)."""
    return load_config(RunConfig, path, overrides)  # sections' own checks become ConfigError


def save_recipe(cfg: RunConfig, run_dir: str | Path) -> None:
    """Write the resolved recipe (defaults and overrides applied) to ``<run_dir>/config.yaml``."""
    import yaml

    from megatron_dgpo.runtime.config import to_dict

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
