"""The schema of a run: ``recipes/*.yaml`` files are ``RunConfig`` trees.

    cfg = load_recipe("recipes/tiny_cpu.yaml", ["algorithm.method=grpo", "train.steps=5"])

Each section is a small dataclass handed to the one component that uses it (the trainer never
passes the whole tree down): ``model`` to model loading, ``parallel`` to Megatron's parallel
state, ``rollout`` to the rollout engine, ``algorithm`` to advantages and the loss, ``train``
to the loop's batching, ``optimizer`` to Megatron's optimizer, ``data`` to the prompt source,
``checkpoint`` to save/resume, ``logging`` to telemetry, ``eval`` to the evaluation on held-out
problems during training. Every field is documented right under
its declaration; ``python -m megatron_dgpo.train --describe`` prints them all.

Batch sizes count prompts (the paper's convention: rollout batch 512 prompts, mini-batch 32),
each prompt giving ``rollout.group_size`` responses; there are
``train.rollout_batch_prompts / train.mini_batch_prompts`` optimizer updates per rollout batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_dgpo.config import load_config, require_choice
from megatron_dgpo.losses import (AGGREGATIONS, METHODS, ROLLOUT_CORRECTIONS, LossHyperparams,
                                  check_method)
from megatron_dgpo.parallel import ParallelConfig
from megatron_dgpo.telemetry import LoggingConfig


@dataclass
class ModelConfig:
    """The initial policy."""

    path: str = ""
    """HF model folder (config.json + safetensors + tokenizer) of the initial policy. Relative
    paths are resolved against the working directory. Ignored when ``tiny`` is set."""
    tiny: dict[str, Any] | None = None
    """Create a tiny random Qwen2 and its tokenizer at start instead of loading ``path``
    (``megatron_dgpo.tiny.make_tiny_model`` keyword arguments, e.g. {seed: 0,
    num_hidden_layers: 2}); written to ``<run_dir>/initial_model``. No download."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter dtype of the trained model. bfloat16 on GPU (fp32 main weights live in the
    optimizer); float32 on CPU (bf16 matmuls are slow there and vLLM's CPU log-probs are fp32)."""
    nominal_params: float | None = None
    """The model's size as its name states it (1.5e9 for a "1.5B" model), used by
    ``optimizer.lr: auto``. None: the parameter count of the built model."""
    recompute_activations: bool = False
    """Full-layer activation recomputation (Megatron ``recompute_granularity="full"``,
    uniform method, one layer per block): trades ~33% more compute for O(layers) activations."""
    without_transformer_engine: bool = False
    """On a GPU, run without Transformer-Engine (Megatron's local layer spec). A GPU run stops
    at start when TE does not import, because the local spec builds a dense [S, S] attention
    mask per layer (~10 GB of scores per layer at 16k tokens, TP 4); set this only for short
    sequences (and to train in float32 on a GPU). No effect on CPU."""
    moe_token_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """MoE models (Qwen3-MoE): how tokens reach their experts across expert-parallel ranks
    (Megatron's ``moe_token_dispatcher_type``). ``alltoall``: routed tokens only, any layout;
    ``allgather``: every rank gathers all tokens of its EP group, needs
    ``parallel.pipeline_parallel: 1`` (it refuses the variable sequence lengths pipelining
    uses); ``flex``: DeepEP / HybridEP kernels, a GPU with DeepEP installed only. Dense models
    ignore it."""
    moe_aux_loss_coeff: float = 0.0
    """MoE models: weight of Megatron's load-balancing loss (``moe_aux_loss_coeff``; > 0 turns
    on ``aux_loss`` balancing). 0 (off) by default: RL fine-tunes a pre-trained router, and the
    extra loss term would change the policy gradient (HF's ``router_aux_loss_coef`` is the
    pre-training value). Dense models ignore it."""

    def __post_init__(self):
        coeff = self.moe_aux_loss_coeff
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not (
                math.isfinite(coeff) and coeff >= 0):
            raise ValueError(f"moe_aux_loss_coeff must be a finite number >= 0, got {coeff!r}")

    def require_source(self) -> None:
        """Raise unless the policy has a source (``path`` or ``tiny``); called by the run
        configs that need one (a bare ``ModelConfig()`` is their default)."""
        if not self.tiny and not self.path:
            raise ValueError("model: set model.path (an HF folder) or model.tiny")


@dataclass
class RolloutConfig:
    """Generation of the responses (vLLM, or transformers as a fallback)."""

    engine: Literal["vllm", "hf"] = "vllm"
    """``vllm`` (the real engine, CPU or GPU) or ``hf`` (transformers' generate: slow, for
    machines where vLLM does not run)."""
    group_size: int = 8
    """Responses sampled per prompt (G): the group whose rewards are normalised into
    advantages. The paper does not state it; 8 is the common choice (DAPO uses 16)."""
    temperature: float = 1.0
    """Sampling temperature. The trainer divides logits by the same value, so the old and new
    log-probs are of the distribution the tokens were drawn from."""
    top_p: float = 1.0
    """Nucleus sampling mass. Values < 1 make the sampled log-probs those of the truncated
    distribution (vLLM's processed log-probs), which the trainer cannot reproduce: keep 1.0."""
    max_response_tokens: int = 8192
    """Maximum response length; longer responses are cut (finish reason "length")."""
    max_prompt_tokens: int = 2048
    """Prompts longer than this (chat template included) are dropped from the dataset."""
    dtype: str = "auto"
    """vLLM weights dtype: "auto" follows the checkpoint; "float32" gives exact log-probs."""
    tensor_parallel_size: int | None = None
    """vLLM's own tensor parallelism: ranks (GPUs) per engine. None = the trainer's
    ``parallel.tensor_parallel`` x ``parallel.pipeline_parallel`` (each DP replica owns one
    engine on its own GPUs; with PP > 1 and DP > 1: ``parallel.tensor_parallel``). With
    ``placement: colocated`` (CPU too) an engine spans this many consecutive trainer ranks,
    which must lie in one DP replica's model-parallel group (it divides
    ``parallel.tensor_parallel``, or equals TP x PP when PP = 1 or DP = 1); the replica's
    prompts are split over its engines. ``separate``: the GPUs of each replica leader's engine.
    ``dedicated``: GPUs per engine among the ``num_gpus`` rollout GPUs (None = 1)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take for weights + KV cache (GPU). Colocated engines
    share it with training; dedicated engines own their GPUs (0.85-0.9 is usual there)."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache size in bytes; required by vLLM on CPU (default there 256 MiB)."""
    max_num_seqs: int = 256
    """Sequences vLLM decodes at once."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Any other ``vllm.LLM`` keyword argument."""
    placement: Literal["colocated", "separate", "dedicated"] = "colocated"
    """Where vLLM runs (engine ``vllm`` only). ``colocated``: inside the trainer's ranks
    (``external_launcher``), one engine per ``tensor_parallel_size`` consecutive ranks, sharing
    their GPUs (sleep mode frees its memory during training on GPU). ``separate``: an engine in
    its own process on the replica leader's GPUs, for machines or vLLM versions where
    colocation does not work. ``dedicated``: engines on GPUs of their own, the last
    ``num_gpus`` ranks of the torchrun world, outside the trainer's (Megatron's) world; each
    DP replica's leader drives its share of the engines and refits them by a weight broadcast
    (NCCL on GPU, gloo on CPU); with ``max_staleness: 1`` generation overlaps training
    (``megatron_dgpo.rollout.dedicated``)."""
    num_gpus: int = 0
    """``placement: dedicated`` only: GPUs (on CPU, processes) of the rollout engines, taken
    from the end of the torchrun world (the SLURM script's ``ROLLOUT_NODES``); the trainer's
    world is the rest. Engines are ``num_gpus / tensor_parallel_size`` (``tensor_parallel_size``
    None: 1 GPU per engine); their count must be a multiple of the trainer's DP replicas (each
    replica drives its own engines, so samples never cross DP)."""
    max_staleness: Literal[0, 1] = 0
    """Policy lag of the samples. 0: every step samples with the weights it starts from
    (synchronous). 1 (``placement: dedicated``): one-step-off-policy, batch k+1 is generated
    with the weights of step k-1 while the trainer updates on batch k, so generation and
    training overlap; pi_old stays the trainer's policy at the start of the step and the
    engine's log-probs feed ``algorithm.rollout_correction: tis`` (recommended) and the
    mismatch metrics; ``rollout/staleness`` is logged."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs. None: eager on CPU (required there), CUDA graphs on GPU; true
    saves the graphs' memory pool and capture time at some decode speed."""
    sleep_mode: bool | None = None
    """Free the engine's GPU memory while training runs (vLLM sleep mode). None: on for
    colocated engines on GPU (they share the trainer's GPUs), off otherwise; CPU: never (vLLM
    refuses it there)."""
    sleep_level: Literal[1, 2] = 2
    """What sleep does with the weights: 2 drops them (every wake is followed by the refit,
    which reloads every weight), 1 keeps a copy in pinned host memory (~2 bytes per parameter
    of the engine's shard, copied out and back every step for nothing when refitting)."""
    dummy_weights: bool | None = None
    """Start colocated engines from random weights that the trainer's first refit replaces,
    instead of every rank reading the whole HF checkpoint (verl does the same). None: on for
    colocated engines on GPU, off otherwise."""
    refit_bucket_bytes: int = 512 << 20
    """Largest weight payload of one in-place reload when the trainer refits the engine (512
    MiB, as slime). Buckets never split a layer's fused q/k/v or gate/up tensors (a larger
    group goes alone); must stay below 4 GiB (vLLM's message limit for ``separate``)."""

    def __post_init__(self):
        if self.placement not in ("colocated", "separate", "dedicated"):
            raise ValueError(f"placement must be 'colocated', 'separate' or 'dedicated', got "
                             f"{self.placement!r}")
        if self.max_staleness not in (0, 1):
            raise ValueError(f"max_staleness must be 0 (synchronous) or 1 (one-step-off-policy), "
                             f"got {self.max_staleness!r}")
        if self.placement == "dedicated":
            if self.engine != "vllm":
                raise ValueError(f"placement: dedicated needs engine: vllm, got {self.engine!r}")
            tp = self.tensor_parallel_size or 1
            if not (isinstance(self.num_gpus, int) and self.num_gpus >= 1 and self.num_gpus % tp == 0):
                raise ValueError(f"num_gpus must be a positive multiple of tensor_parallel_size "
                                 f"({tp}) with placement: dedicated (the engines' GPUs), got "
                                 f"{self.num_gpus!r}")
        elif self.num_gpus:
            raise ValueError(f"num_gpus={self.num_gpus} is for placement: dedicated (engines on "
                             f"GPUs of their own); placement is {self.placement!r}")
        if self.max_staleness and self.placement != "dedicated":
            raise ValueError(f"max_staleness: 1 needs placement: dedicated (generation overlaps "
                             f"training only on GPUs of its own); placement is {self.placement!r}")
        if not (isinstance(self.refit_bucket_bytes, int) and 1 <= self.refit_bucket_bytes < (1 << 32) - 1):
            raise ValueError(f"refit_bucket_bytes must be an int in [1, 2**32 - 1) (below vLLM's "
                             f"4 GiB message limit), got {self.refit_bucket_bytes!r}")
        if self.tensor_parallel_size is not None and not (
                isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1):
            raise ValueError(f"tensor_parallel_size must be None or a positive int, got "
                             f"{self.tensor_parallel_size!r}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        for name in ("max_response_tokens", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class AlgorithmConfig:
    """The policy-gradient method and its advantage estimator."""

    method: str = "dgpo"
    """One of dgpo, grpo, cispo, gppo, ce_gppo, aspo (``megatron_dgpo.losses.METHODS``)."""
    loss: LossHyperparams = field(default_factory=LossHyperparams)
    """Clip ranges and each method's own constants (DGPO n, m; CE-GPPO beta1, beta2; ASPO;
    GRPO's optional ``dual_clip``, which the other methods refuse). How they and the log-ratio
    clamp differ from the paper's official code: ``megatron_dgpo.losses``' docstring, README."""
    advantage_eps: float = 1e-6
    """Added to the group's reward std before dividing (groups with one distinct reward get 0)."""
    advantage_unbiased_std: bool = True
    """Sample (n-1) std of the group's rewards, as GRPO's reference code; False: population std."""
    loss_aggregation: Literal["token_mean", "group_token_mean",
                              "seq_mean_token_mean"] = "token_mean"
    """How token terms s are averaged over a mini-batch (``losses.sample_loss_weights``).
    ``token_mean``: sum_t s_t / (valid tokens of the whole mini-batch, over every micro-batch
    and DP rank), DAPO's token mean. Not exactly the paper's official code (verl's
    ``token-mean``): there each micro-batch's loss is its own token mean, scaled by 1 / (the
    gradient-accumulation steps) and the gradients averaged over DP ranks, so tokens of short
    micro-batches weigh more; the two agree only when every micro-batch holds the same number
    of valid tokens, which packed micro-batches seldom do. Kept: every token of the mini-batch
    gets the same weight 1/N, so the gradient does not depend on how the mini-batch is split
    over TP/PP/DP ranks and micro-batches (tested). ``group_token_mean``: the
    paper's Eq. 1, each prompt group's token sum divided by that group's token count
    sum_i |o_i|, then the mean over the mini-batch's groups. ``seq_mean_token_mean``: each
    response's token mean, averaged over the responses."""
    rollout_correction: Literal["none", "tis"] = "none"
    """``tis``: multiply each token's loss term by the truncated importance weight
    min(pi_old / pi_rollout, rollout_correction_cap) (no gradient through it; verl, NeMo-RL),
    correcting for the rollout engine's sampler differing from the trainer (bf16, kernels).
    Logged as ``train/tis/*``. ``none``: no correction (the mismatch is still measured)."""
    rollout_correction_cap: float = 2.0
    """TIS truncation C (>= 1): importance weights above it are cut to it."""
    drop_degenerate_groups: bool = False
    """DAPO's filter: prompt groups whose rewards are all equal are left out of the update (no
    tokens in the loss or in N; counted as ``adv/num_dropped_groups``)."""
    refill_rounds: int = 0
    """With ``drop_degenerate_groups``: DAPO's dynamic sampling, up to this many extra sampling
    rounds per step. Each batch position whose group came out degenerate is sampled again from
    the next unused prompt of the stream, until every position holds an informative group or
    the rounds run out (positions still degenerate then are dropped as without refill). So the
    step trains on ``rollout_batch_prompts`` informative groups while the policy sharpens. Logged:
    ``rollout/refill_rounds``, ``rollout/discarded_groups``. 0: drop without refilling."""
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
        require_choice("method", self.method, METHODS)
        check_method(self.method, self.loss)  # loss.dual_clip with a method that refuses it
        require_choice("loss_aggregation", self.loss_aggregation, AGGREGATIONS)
        require_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        require_choice("routing_replay", self.routing_replay, ("off", "r3"))
        cap = self.rollout_correction_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (
                math.isfinite(cap) and cap >= 1):
            raise ValueError(f"rollout_correction_cap must be a finite number >= 1, got {cap!r}")
        if isinstance(self.refill_rounds, bool) or not isinstance(self.refill_rounds, int) \
                or self.refill_rounds < 0:
            raise ValueError(f"refill_rounds must be an integer >= 0, got {self.refill_rounds!r}")
        if self.refill_rounds and not self.drop_degenerate_groups:
            raise ValueError("refill_rounds refills the groups drop_degenerate_groups drops: "
                             "set drop_degenerate_groups: true as well, or refill_rounds: 0")


@dataclass
class TrainConfig:
    """The loop's sizes and seeds."""

    steps: int = 100
    """RL steps (rollout batches) to run in total, counting those of a resumed run."""
    rollout_batch_prompts: int = 512
    """Prompts sampled per step (the paper: 512)."""
    mini_batch_prompts: int = 32
    """Prompts per optimizer update (the paper: 32, i.e. 16 updates per rollout batch). Their
    responses are split over the data-parallel ranks."""
    micro_batch_tokens: int = 16384
    """Token budget of one packed micro-batch row (sequence packing). Must hold the longest
    prompt + response."""
    seed: int = 42
    """Seeds weights' RNG, the prompt order, vLLM sampling and mini-batch shuffling: a run is a
    function of its config (and resuming does not change it). In [0, 2**23): each seed owns
    2**40 sampling streams (``rollout.placement.prompt_seeds``)."""
    log_prob_chunk_size: int | None = None
    """Tokens per chunk in the vocab-parallel log-prob kernel (None: automatic)."""
    offload_training_state: bool = False
    """Move the gradient buffers and the optimizer state (Adam moments, fp32 main weights) off
    the GPU after each step's updates and back before the next step's (``megatron_dgpo.offload``),
    so the colocated vLLM engine refits and generates without them beside it (NeMo-RL's offload
    before refit). Costs host memory (~16 bytes per parameter of a rank's shard, pinned) and
    two host copies of them per step. The state also leaves before the engines start, so vLLM
    finds its ``gpu_memory_utilization`` free. ``dgpo-plan`` counts it. Off by default; on in
    the 14B-70B recipes, which give the freed memory to vLLM's KV cache."""
    max_minutes: float | None = None
    """The job's own time budget (Megatron-LM's ``--exit-duration-in-mins``): the run stops
    with a checkpoint, as on a stop signal, after the first step at whose end another step
    and a save would likely not fit (elapsed + the last step's time + the last save's time >
    budget), and exits with ``interrupt.EXIT_STOPPED``. Counted from the trainer's start (a
    restarted or requeued attempt has its own). None: no budget."""

    def __post_init__(self):
        for name in ("steps", "rollout_batch_prompts", "mini_batch_prompts", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0 or None, got {self.max_minutes}")
        if self.rollout_batch_prompts % self.mini_batch_prompts:
            raise ValueError(f"rollout_batch_prompts ({self.rollout_batch_prompts}) must be a "
                             f"multiple of mini_batch_prompts ({self.mini_batch_prompts})")
        if not 0 <= self.seed < 1 << 23:  # rollout.placement.MAX_TRAIN_SEED
            raise ValueError(f"seed must be in [0, 2**23) (sampling seeds are seed << 40 + "
                             f"stream, below 2**63), got {self.seed}")


@dataclass
class OptimizerConfig:
    """AdamW with a constant learning rate (Megatron-Core's optimizer)."""

    lr: float | Literal["auto"] = 1e-6
    """Learning rate, or ``auto``: lr_reference * sqrt(lr_reference_params / N) with N the
    model's size (``model.nominal_params``), the paper's constant total-gradient-variance rule."""
    lr_reference: float = 1e-6
    """The learning rate known to work at ``lr_reference_params`` (paper: 1e-6 at 1.5B)."""
    lr_reference_params: float = 1.5e9
    """Model size of ``lr_reference``."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay on matrices; biases and norms are not decayed."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.95
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip over all model-parallel shards (0 disables)."""
    use_distributed_optimizer: bool | None = None
    """Shard optimizer states over data parallel (Megatron's distributed optimizer). None: on
    with a GPU, off on CPU (where it runs too, through ``megatron_dgpo.cpu``)."""

    def __post_init__(self):
        if isinstance(self.lr, str) and self.lr != "auto":
            raise ValueError(f"lr must be a number or 'auto', got {self.lr!r}")
        if not isinstance(self.lr, str) and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def learning_rate(self, num_params: float) -> float:
        """The constant learning rate for a model of ``num_params`` parameters."""
        if self.lr != "auto":
            return float(self.lr)
        if not num_params > 0:
            raise ValueError(f"lr: auto needs a positive parameter count, got {num_params}")
        return self.lr_reference * math.sqrt(self.lr_reference_params / num_params)


@dataclass
class DataConfig:
    """Training prompts."""

    source: str = "builtin"
    """``builtin`` (the package's prompts), or a .jsonl/.json/.parquet file in DAPO-Math-17k's
    layout (``megatron_dgpo.data.load_prompt_dataset``)."""
    builtin_families: list[str] | None = None
    """With ``source: builtin``: only these families (e.g. [repeat, add, sub]); None: all."""
    prompt_field: str = "prompt"
    """Dotted field holding the prompt (a string or chat messages)."""
    answer_field: str = "reward_model.ground_truth"
    """Dotted field holding the ground-truth answer."""
    boxed_instruction: bool = False
    """Rewrite each prompt to ask for a \\boxed{} answer, which is what the reward grades:
    DAPO-Math-17k's "Answer: $Answer" preamble and reminder are removed
    (``megatron_dgpo.data.boxed_instruction``). Set it for DAPO-Math-17k."""


@dataclass
class CheckpointConfig:
    """Saving, resuming and the final HF export."""

    save_every: int = 50
    """Save a checkpoint every this many steps (and after the last step). 0: only the last."""
    keep_last: int = 2
    """Checkpoints kept on disk (older ones are deleted after a newer one is complete)."""
    export_hf: bool = True
    """Write the final policy as an HF folder (``<run_dir>/hf``) through the converter."""
    export_dtype: Literal["float32", "bfloat16"] | None = None
    """dtype of the HF export; None: the training dtype."""
    resume: Literal["auto", "never", "require"] = "auto"
    """Where a run starts: ``auto`` continues from the newest complete checkpoint in
    ``run_dir/checkpoints`` when there is one (a requeued, restarted or re-run job continues; the
    metrics lines past that checkpoint are replaced), else starts fresh; ``require`` fails
    without one; ``never`` starts fresh and fails if ``run_dir`` already holds a checkpoint."""
    async_save: bool = False
    """Write checkpoints in the background (Megatron's async torch_dist save): training
    continues while a persistent writer process per rank (started with the run) writes the
    shards; the checkpoint is renamed into place and named by ``latest`` only after every
    rank's writer has finished, so a crash still leaves the previous complete checkpoint."""
    optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    """How the distributed optimizer's state is laid out in a checkpoint (Megatron-LM's
    ``distrib_optim_sharding_type``; the plain optimizer has one format and ignores this).
    ``dp_reshardable`` (Megatron-LM's default): each rank writes its own buffer shards, no
    communication; the run resumes at another data-parallel size only. ``fully_reshardable``
    (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``): the state is gathered per
    parameter at save (more memory and time on data-parallel rank 0), and the run resumes at any
    TP / PP / DP layout. A resume reads the type the checkpoint was saved with."""

    def saves_at(self, step: int, last_step: int) -> bool:
        """Whether a checkpoint is written after ``step``: every ``save_every`` steps and after
        ``last_step``."""
        return bool(self.save_every) and step % self.save_every == 0 or step == last_step


@dataclass
class EvalConfig:
    """Evaluation on held-out problems during training (NeMo-RL's ``val_period``, verl's
    ``test_freq``): after a step's refit the run's own engines, holding the just-trained
    weights, sample ``n`` responses per problem, each engine its share of the problems, graded
    as ``dgpo-eval`` grades (``megatron_dgpo.rollout.evaluation``). Logged in that step's
    metrics line: ``eval/<benchmark>/avg@<n>``, ``eval/<benchmark>/pass@<k>`` (k = 1, 2, 4, ...,
    n) and ``time/eval`` (not part of ``time/step`` nor of the throughputs). Training is the
    same with or without it (its samples, seeds and random streams are untouched)."""

    every: int = 0
    """Evaluate after every this many steps. 0: off (the default)."""
    at_end: bool | None = None
    """Also evaluate after the run's last step (``train.steps``). None: true when ``every`` > 0;
    true with ``every: 0`` evaluates only at the end."""
    benchmarks: list[str] = field(default_factory=list)
    """What to evaluate on: names of the published benchmarks ``dgpo-eval`` knows (aime24,
    aime25, amc23, math500, minerva_math, olympiadbench; read from ``benchmarks_dir``) and/or
    paths to held-out files (.jsonl/.json/.parquet in a layout ``data.load_benchmark`` reads,
    e.g. rows {"problem", "answer"}; named by the file's stem). Required when evaluation is on."""
    benchmarks_dir: str | None = None
    """Folder of the named benchmarks (aime24.jsonl, ...). None: $DGPO_BENCHMARKS_DIR, else
    ../shared/benchmarks next to the repository (as ``dgpo-eval``)."""
    n: int = 8
    """Samples per problem: the k of Avg@k and the largest k of Pass@k."""
    max_tokens: int | None = None
    """Response limit of an evaluation sample. None: ``rollout.max_response_tokens``. Every
    prompt plus this must fit the engines' context, ``rollout.max_prompt_tokens`` +
    ``rollout.max_response_tokens`` (checked at start)."""
    temperature: float = 1.0
    """Sampling temperature of the evaluation samples."""
    top_p: float = 1.0
    """Nucleus sampling mass of the evaluation samples, in (0, 1]."""
    limit: int | None = None
    """Only the first this many problems of each benchmark. None: all of them."""
    seed: int = 0
    """Problem i of a benchmark is sampled with seed ``seed + i n`` (sample j: ``+ j``) at every
    evaluation, whatever the number of engines: the seeds of ``dgpo-eval --seed``, so the
    numbers equal ``dgpo-eval`` of that step's policy with the same settings. In [0, 2**62)."""

    def __post_init__(self):
        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not (integer(self.every) and self.every >= 0):
            raise ValueError(f"every must be an integer >= 0 (0: off), got {self.every!r}")
        if not (integer(self.n) and self.n >= 1):
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("max_tokens", "limit"):
            value = getattr(self, name)
            if value is not None and not (integer(value) and value >= 1):
                raise ValueError(f"{name} must be null or an integer >= 1, got {value!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not (integer(self.seed) and 0 <= self.seed < 1 << 62):
            raise ValueError(f"seed must be an integer in [0, 2**62), got {self.seed!r}")
        if any(not spec.strip() for spec in self.benchmarks):
            raise ValueError(f"benchmarks must be names or paths, got an empty one in "
                             f"{self.benchmarks!r}")
        if self.enabled and not self.benchmarks:
            raise ValueError("benchmarks must name at least one benchmark or held-out file when "
                             "evaluation is on (every > 0 or at_end: true)")

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates at all."""
        return self.every > 0 or bool(self.at_end)

    def due(self, step: int, last_step: int) -> bool:
        """Whether to evaluate after ``step``: every ``every`` steps, and after ``last_step``
        when ``at_end`` (None: when ``every`` > 0)."""
        at_end = self.every > 0 if self.at_end is None else self.at_end
        return bool(self.every) and step % self.every == 0 or at_end and step == last_step


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
        if self.train.micro_batch_tokens < self.rollout.max_response_tokens + 1:
            raise ValueError(f"train.micro_batch_tokens ({self.train.micro_batch_tokens}) must "
                             f"exceed rollout.max_response_tokens "
                             f"({self.rollout.max_response_tokens}) plus the prompt")


def load_recipe(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """``RunConfig`` from a recipe YAML and dotted ``key=value`` overrides (errors name the key)."""
    return load_config(RunConfig, path, overrides)  # sections' own checks become ConfigError


def save_recipe(cfg: RunConfig, run_dir: str | Path) -> None:
    """Write the resolved recipe (defaults and overrides applied) to ``<run_dir>/config.yaml``."""
    import yaml

    from megatron_dgpo.config import to_dict

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
