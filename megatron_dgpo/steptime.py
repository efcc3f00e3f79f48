"""How long an RL step takes where generation runs: a roofline model of generation, training and
refit for ``dgpo-plan`` (colocated engines vs dedicated ones, synchronous vs one-step-off).

A step is three phases. With E engines of t_r GPUs, a rollout batch of P prompts x G responses
of mean length p (prompt) + r (response), longest response R, and N the parameters a token
passes through (all of them for a dense model, the routed top-k experts for MoE):

    generation  prefill + max(S a_w + D (p + r / 2) kv / (t_r B_hbm eta),   HBM: weights once
                              D 2 N / (t_r F mfu_decode))                 a step, each decoded
                + S o                                                     token's KV context;
                                                                          or FLOPs, if larger
                each engine decodes n = ceil(P G / E) responses, D = n r tokens, c at a time
                (c = min(max_num_seqs, n, KV cache / (p + r))) in S = max(0, n - c) r / c + R
                steps: continuous batching keeps c responses going, then the last ones started
                take up to R more steps (the long tail: a step reads all the weights however
                few responses are left); a_w = 2 N / (t_r B_hbm eta) reads the weights, o is a
                step's fixed cost (scheduling, sampling, TP all-reduce latency)
    prefill     2 N n p / (t_r F mfu_prefill)
    training    P G (p + r) (2 N (3 + recompute + 1) + 4 L h (p + r) / 2 (3 + recompute + 1))
                / (T F mfu_train)   forward + backward (+ a recomputed forward), plus the
                                    forward-only old log-probs; causal attention over packed
                                    sequences of mean length p + r
    refit       colocated: 2 N / t_r / B_nvlink + wake_sleep (+ the training state to the host
                and back over PCIe when train.offload_training_state);
                dedicated: 2 N / B_nvlink (the replica's leader gathers its TP x PP shards) +
                2 N / B_net (the broadcast to its engines, one NIC's bandwidth however many
                engines: NCCL pipelines a broadcast along a ring)

and the placements combine them as

    colocated        step = generation(E = world / t_r) + training(T = world) + refit
    dedicated, sync  step = generation(E = R / t_r) + training(T = world - R) + refit
    one-step-off     step = max(generation, training) + refit   (the engines generate batch
                     k+1 while the trainer updates on batch k; the refit is taken between)

with the trainer idle for generation - training and the engines for training - generation
(whichever is positive). F, B_hbm, B_nvlink, B_net and the efficiencies are ``Hardware``'s;
they are the published peaks and typical shares, not measurements of this project (it has no
GPU): the model ranks placements and shows which side waits, it does not promise seconds.
docs/planner.md#step-time has its checks against published step times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dgpo.memory import Architecture, kv_cache_bytes_per_token, param_count


@dataclass(frozen=True)
class Hardware:
    """One GPU type's published peaks and the shares of them RL phases typically reach."""

    name: str
    peak_tflops: float
    """F: dense bf16 tensor-core TFLOP/s (A100 312, H100 SXM 989)."""
    hbm_gb_per_s: float
    """B_hbm: HBM bandwidth, GB/s (A100 80GB 2039, H100 SXM 3350)."""
    nvlink_gb_per_s: float
    """B_nvlink: one direction of one GPU's NVLink, GB/s (A100 300, H100 450)."""
    network_gb_per_s: float
    """B_net: one GPU's share of the inter-node fabric, GB/s (one 200 Gb/s HDR NIC per A100:
    25; 400 Gb/s NDR per H100: 50)."""
    pcie_gb_per_s: float
    """Host <-> GPU copies of offloaded training state, GB/s (PCIe 4 x16: 25; PCIe 5: 50)."""
    train_mfu: float = 0.35
    """Training's share of F (Megatron-Core dense models at 8-16k tokens with recompute)."""
    decode_hbm_efficiency: float = 0.6
    """eta: the share of B_hbm a decode step reaches (vLLM with CUDA graphs)."""
    decode_mfu: float = 0.5
    decode_step_overhead_s: float = 0.004
    """o: a decode step's fixed cost beyond its kernels (vLLM's scheduler and sampler, the TP
    all-reduces' latency: two per layer), seconds."""
    prefill_mfu: float = 0.5
    wake_sleep_s: float = 5.0
    """A colocated engine's sleep + wake per step (free and re-allocate the KV cache, reload or
    re-map the weights), seconds."""


HARDWARE = {
    "a100": Hardware("A100-80GB", peak_tflops=312, hbm_gb_per_s=2039, nvlink_gb_per_s=300,
                     network_gb_per_s=25, pcie_gb_per_s=25),
    "h100": Hardware("H100-80GB-SXM", peak_tflops=989, hbm_gb_per_s=3350, nvlink_gb_per_s=450,
                     network_gb_per_s=50, pcie_gb_per_s=50),
}
"""``dgpo-plan --hardware``; the paper ran on A100 80GB (Appendix B)."""


@dataclass(frozen=True)
class StepShape:
    """What a recipe says about one step's tokens, plus the two lengths it cannot say."""

    prompts: int
    """P: ``train.rollout_batch_prompts``."""
    group_size: int
    """G: ``rollout.group_size``."""
    max_response_tokens: int
    """R: the longest response (``rollout.max_response_tokens``)."""
    mean_prompt_tokens: float
    """p: the mean prompt (DAPO-Math-17k's prompts with their chat template: ~150-250)."""
    mean_response_tokens: float
    """r: the mean response (reasoning models at an 8k cap: about half of it)."""
    max_num_seqs: int = 256
    recompute: bool = False
    """``model.recompute_activations``: one more forward per token."""
    offloaded_state_bytes_per_gpu: int = 0
    """Colocated with ``train.offload_training_state``: gradients + optimizer state that leave
    each GPU and come back every step."""

    @classmethod
    def from_recipe(cls, run, *, mean_prompt_tokens: float = 200.0,
                    mean_response_fraction: float = 0.5) -> "StepShape":
        if not 0 < mean_response_fraction <= 1:
            raise ValueError(f"mean_response_fraction must be in (0, 1], got {mean_response_fraction!r}")
        return cls(prompts=run.train.rollout_batch_prompts, group_size=run.rollout.group_size,
                   max_response_tokens=run.rollout.max_response_tokens,
                   mean_prompt_tokens=min(mean_prompt_tokens, run.rollout.max_prompt_tokens),
                   mean_response_tokens=mean_response_fraction * run.rollout.max_response_tokens,
                   max_num_seqs=run.rollout.max_num_seqs, recompute=run.model.recompute_activations)


def active_params(arch: Architecture) -> int:
    """N: the parameters one token's matmuls touch: every parameter of a dense model but the
    input embedding (a lookup; a tied output layer still multiplies), an MoE layer's top-k
    routed experts rather than all E."""
    n = param_count(arch) - (0 if arch.tie_word_embeddings else arch.vocab * arch.hidden)
    if arch.moe:
        n -= arch.layers * (arch.experts - arch.topk) * 3 * arch.hidden * arch.moe_ffn
    return n


def generation_seconds(arch: Architecture, shape: StepShape, hw: Hardware, *, engines: int,
                       engine_tp: int, kv_cache_bytes_per_engine_gpu: float) -> float:
    """One rollout batch on ``engines`` engines of ``engine_tp`` GPUs (module docstring)."""
    n_params = active_params(arch)
    per_engine = math.ceil(shape.prompts * shape.group_size / engines)
    p, r = shape.mean_prompt_tokens, shape.mean_response_tokens
    kv_token = kv_cache_bytes_per_token(arch)
    kv_room_tokens = max(kv_cache_bytes_per_engine_gpu, 0) * engine_tp / kv_token
    concurrent = max(1, min(shape.max_num_seqs, per_engine, int(kv_room_tokens // (p + r))))
    steps = max(0, per_engine - concurrent) * r / concurrent + shape.max_response_tokens
    decoded = per_engine * r
    hbm = hw.hbm_gb_per_s * 1e9 * hw.decode_hbm_efficiency
    memory = (steps * 2 * n_params + decoded * (p + r / 2) * kv_token) / engine_tp / hbm
    compute = decoded * 2 * n_params / engine_tp / (hw.peak_tflops * 1e12 * hw.decode_mfu)
    prefill = 2 * n_params * per_engine * p / engine_tp / (hw.peak_tflops * 1e12 * hw.prefill_mfu)
    return prefill + max(memory, compute) + steps * hw.decode_step_overhead_s


def training_seconds(arch: Architecture, shape: StepShape, hw: Hardware, *, gpus: int) -> float:
    """Forward + backward (+ recompute) of every token, and the old log-probs' forward, on
    ``gpus`` trainer GPUs."""
    seq = shape.mean_prompt_tokens + shape.mean_response_tokens
    tokens = shape.prompts * shape.group_size * seq
    passes = 3 + int(shape.recompute) + 1  # fwd + 2x bwd, recomputed fwd, old log-probs fwd
    per_token = passes * (2 * active_params(arch) + 4 * arch.layers * arch.q_dim * seq / 2)
    return tokens * per_token / (gpus * hw.peak_tflops * 1e12 * hw.train_mfu)


def refit_seconds(arch: Architecture, shape: StepShape, hw: Hardware, *, dedicated: bool,
                  engine_tp: int) -> float:
    """The trained weights into the engines (module docstring)."""
    weights = 2 * param_count(arch)
    if dedicated:
        return weights / (hw.nvlink_gb_per_s * 1e9) + weights / (hw.network_gb_per_s * 1e9)
    offload = 2 * shape.offloaded_state_bytes_per_gpu / (hw.pcie_gb_per_s * 1e9)
    return weights / engine_tp / (hw.nvlink_gb_per_s * 1e9) + hw.wake_sleep_s + offload


@dataclass(frozen=True)
class StepTime:
    """One placement's step, seconds: the phases and who waits."""

    placement: str
    """"colocated", "dedicated" (synchronous) or "one-step-off"."""
    trainer_gpus: int
    rollout_gpus: int
    """GPUs of dedicated engines (0: colocated, the engines share the trainer's GPUs)."""
    generation_s: float
    training_s: float
    refit_s: float

    @property
    def step_s(self) -> float:
        if self.placement == "one-step-off":
            return max(self.generation_s, self.training_s) + self.refit_s
        return self.generation_s + self.training_s + self.refit_s

    @property
    def trainer_idle_s(self) -> float:
        """Seconds per step the trainer's GPUs wait for samples (colocated: they generate)."""
        return self._waiting(self.generation_s, self.training_s)

    @property
    def engine_idle_s(self) -> float:
        """Seconds per step dedicated engines wait for the trainer."""
        return self._waiting(self.training_s, self.generation_s)

    def _waiting(self, other: float, own: float) -> float:
        """What a side waits for the other side's ``other`` seconds of work beside its ``own``:
        nothing colocated (the same GPUs do both), all of it synchronous, the difference
        one-step-off."""
        if self.placement == "colocated":
            return 0.0
        if self.placement == "one-step-off":
            return max(0.0, other - own)
        return other

    def as_dict(self) -> dict:
        return dict(placement=self.placement, trainer_gpus=self.trainer_gpus,
                    rollout_gpus=self.rollout_gpus, step_s=self.step_s,
                    generation_s=self.generation_s, training_s=self.training_s,
                    refit_s=self.refit_s, trainer_idle_s=self.trainer_idle_s,
                    engine_idle_s=self.engine_idle_s)


def step_times(arch: Architecture, shape: StepShape, hw: Hardware, *, world: int,
               rollout_gpus: int, engine_tp: int, kv_cache_bytes_per_engine_gpu: float,
               colocated_kv_cache_bytes_per_gpu: float | None = None) -> list[StepTime]:
    """Colocated engines of ``engine_tp`` GPUs on all ``world`` GPUs, then (``rollout_gpus`` >
    0) dedicated engines on ``rollout_gpus`` of them, synchronous and one-step-off.
    ``colocated_kv_cache_bytes_per_gpu``: a colocated engine's KV room (default: the dedicated
    one's)."""
    colocated_kv = (kv_cache_bytes_per_engine_gpu if colocated_kv_cache_bytes_per_gpu is None
                    else colocated_kv_cache_bytes_per_gpu)
    out = [StepTime("colocated", world, 0,
                    generation_seconds(arch, shape, hw, engines=world // engine_tp,
                                       engine_tp=engine_tp,
                                       kv_cache_bytes_per_engine_gpu=colocated_kv),
                    training_seconds(arch, shape, hw, gpus=world),
                    refit_seconds(arch, shape, hw, dedicated=False, engine_tp=engine_tp))]
    if rollout_gpus:
        trainer = world - rollout_gpus
        gen = generation_seconds(arch, shape, hw, engines=rollout_gpus // engine_tp,
                                 engine_tp=engine_tp,
                                 kv_cache_bytes_per_engine_gpu=kv_cache_bytes_per_engine_gpu)
        train = training_seconds(arch, shape, hw, gpus=trainer)
        refit = refit_seconds(arch, shape, hw, dedicated=True, engine_tp=engine_tp)
        out += [StepTime(mode, trainer, rollout_gpus, gen, train, refit)
                for mode in ("dedicated", "one-step-off")]
    return out
