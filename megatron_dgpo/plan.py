"""``dgpo-plan``: which TP x PP x CP x DP layout fits a recipe's model on a given cluster.

    python -m megatron_dgpo.plan recipes/dgpo_14b.yaml --gpus-per-node 8 --nodes 1 \\
        --gpu-memory-gb 80 [key=value overrides] [--json]

For every candidate layout (TP within a node, TP | heads, KV groups and FFN width, PP | layers,
CP a power of two, DP = world / (TP PP CP)) it estimates the peak memory of one GPU, term by
term, prints them all in a table, marks which fit and picks one, saying why. The formulas are
those of the functions below (each docstring states its own) and are collected, with their
assumptions and the published figures they were checked against, in ``docs/planner.md``.

Notation: h hidden size, L layers, a attention heads, g KV groups, d head size, f FFN width,
V vocabulary (padded to a multiple of 128 TP as Megatron does), t TP, p PP, c CP, D DP,
s the tokens of one packed micro-batch row (``train.micro_batch_tokens``), b bytes per element
of the training dtype (2 for bf16). Memory is in bytes; the CLI prints GiB (2^30 bytes, the
unit ``nvidia-smi`` uses: an "80 GB" A100/H100 has ~80 GiB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field, replace

GIB = 1 << 30
_VOCAB_DIVISOR = 128  # Megatron's --make-vocab-size-divisible-by (megatron_dgpo.model)
_GPU_CHUNK_BYTES = 1 << 28  # vocab_parallel.default_chunk_size's float32 chunk on GPU


# --------------------------------------------------------------------------- architecture


@dataclass(frozen=True)
class Architecture:
    """The shape of a dense decoder (Qwen2 / Llama): what the memory formulas need."""

    name: str
    hidden: int
    """h."""
    layers: int
    """L."""
    heads: int
    """a (query heads)."""
    kv_heads: int
    """g (KV groups; g = a without GQA)."""
    intermediate: int
    """f (SwiGLU width: fc1 is [2f, h], fc2 is [h, f])."""
    vocab: int
    """V as the HF config states it (unpadded)."""
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on the Q, K, V projections (Qwen2: yes; Llama: ``attention_bias``)."""
    head_dim: int = 0
    """d; 0 means h / a."""

    def __post_init__(self):
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"architecture {self.name}: {name} must be a positive int, "
                                 f"got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"architecture {self.name}: heads ({self.heads}) must be a "
                             f"multiple of kv_heads ({self.kv_heads})")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def q_dim(self) -> int:
        """a d (= h for all the published models)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """g d: the width of K (and of V)."""
        return self.kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "") -> "Architecture":
        """From an HF ``config.json`` dict (Qwen2 or Llama); errors name the missing field."""
        def need(key):
            if cfg.get(key) is None:
                raise ValueError(f"HF config of {name or 'the model'} lacks the field {key!r}")
            return int(cfg[key])

        model_type = cfg.get("model_type", "")
        archs = cfg.get("architectures") or []
        qwen2 = model_type == "qwen2" or "Qwen2ForCausalLM" in archs
        heads = need("num_attention_heads")
        return cls(
            name=name or model_type or "model",
            hidden=need("hidden_size"), layers=need("num_hidden_layers"), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate=need("intermediate_size"), vocab=need("vocab_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if qwen2 else bool(cfg.get("attention_bias", False)),
            head_dim=int(cfg.get("head_dim") or 0),
        )


# Published config.json values (huggingface.co/<id>/blob/main/config.json).
PUBLISHED: dict[str, Architecture] = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": Architecture(
        "DeepSeek-R1-Distill-Qwen-1.5B", hidden=1536, layers=28, heads=12, kv_heads=2,
        intermediate=8960, vocab=151936, tie_word_embeddings=False, qkv_bias=True),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": Architecture(
        "DeepSeek-R1-Distill-Qwen-7B", hidden=3584, layers=28, heads=28, kv_heads=4,
        intermediate=18944, vocab=152064, tie_word_embeddings=False, qkv_bias=True),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": Architecture(
        "DeepSeek-R1-Distill-Qwen-14B", hidden=5120, layers=48, heads=40, kv_heads=8,
        intermediate=13824, vocab=152064, tie_word_embeddings=False, qkv_bias=True),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": Architecture(
        "DeepSeek-R1-Distill-Qwen-32B", hidden=5120, layers=64, heads=40, kv_heads=8,
        intermediate=27648, vocab=152064, tie_word_embeddings=False, qkv_bias=True),
    "meta-llama/Llama-3.1-70B": Architecture(
        "Llama-3.1-70B", hidden=8192, layers=80, heads=64, kv_heads=8,
        intermediate=28672, vocab=128256, tie_word_embeddings=False, qkv_bias=False),
}
PUBLISHED["meta-llama/Llama-3.1-70B-Instruct"] = replace(
    PUBLISHED["meta-llama/Llama-3.1-70B"], name="Llama-3.1-70B-Instruct")
PUBLISHED["meta-llama/Llama-3.3-70B-Instruct"] = replace(
    PUBLISHED["meta-llama/Llama-3.1-70B"], name="Llama-3.3-70B-Instruct")
# distilled from Llama-3.3-70B-Instruct: the same config.json shape
PUBLISHED["deepseek-ai/DeepSeek-R1-Distill-Llama-70B"] = replace(
    PUBLISHED["meta-llama/Llama-3.1-70B"], name="DeepSeek-R1-Distill-Llama-70B")


def padded_vocab(vocab: int, tp: int) -> int:
    """V_pad = ceil(V / (128 t)) 128 t: the rows Megatron allocates for the embedding and output
    layer (same rule as ``megatron_dgpo.model.padded_vocab_size``)."""
    multiple = _VOCAB_DIVISOR * tp
    return -(-vocab // multiple) * multiple


# --------------------------------------------------------------------------- parameters


def layer_params(arch: Architecture, tp: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank:

        (h (a d + 2 g d)  [QKV]  + (a d + 2 g d) [QKV bias, if any]  + a d h [proj]
         + 2 f h [fc1, gate and up] + f h [fc2]) / t   +   2 h [two RMSNorm weights, replicated]
    """
    qkv_out = arch.q_dim + 2 * arch.kv_dim
    sharded = (arch.hidden * qkv_out + (qkv_out if arch.qkv_bias else 0)
               + arch.q_dim * arch.hidden + 3 * arch.intermediate * arch.hidden)
    return sharded // tp + 2 * arch.hidden


def embedding_params(arch: Architecture, vocab_rows: int, tp: int = 1) -> int:
    """One vocabulary matrix (input embedding or output layer) on one TP rank: V_rows h / t."""
    return vocab_rows * arch.hidden // tp


def param_count(arch: Architecture, vocab_rows: int | None = None) -> int:
    """Unique parameters of the whole model:

        V h [embedding] + L layer_params + h [final norm] + (0 if tied else V h) [output layer]

    ``vocab_rows`` defaults to the HF vocabulary (what model cards count); pass
    ``padded_vocab(V, t)`` for what Megatron builds.
    """
    rows = arch.vocab if vocab_rows is None else vocab_rows
    vocab_mats = 1 if arch.tie_word_embeddings else 2
    return vocab_mats * rows * arch.hidden + arch.layers * layer_params(arch) + arch.hidden


def stage_params(arch: Architecture, tp: int, pp: int, stage: int) -> int:
    """Parameters held by one GPU of pipeline stage ``stage`` (0 .. p-1) at TP t:

        (L / p) layer_params(t)  + [stage 0] V_pad h / t
        + [stage p-1] (h + V_pad h / t)    (output layer: untied, or tied with p > 1, where
                                            Megatron keeps a copy on the last stage)

    with V_pad = padded_vocab(V, t). Needs p | L.
    """
    if arch.layers % pp:
        raise ValueError(f"pipeline_parallel {pp} does not divide {arch.layers} layers")
    rows = padded_vocab(arch.vocab, tp)
    count = arch.layers // pp * layer_params(arch, tp)
    if stage == 0:
        count += embedding_params(arch, rows, tp)
    if stage == pp - 1:
        count += arch.hidden
        if not arch.tie_word_embeddings or pp > 1:
            count += embedding_params(arch, rows, tp)
    return count


# --------------------------------------------------------------------------- memory terms


def weight_bytes(params: int, dtype_bytes: int = 2) -> int:
    """Model weights: b N (b = 2 for bf16 parameters)."""
    return dtype_bytes * params


def grad_bytes(params: int, grad_dtype_bytes: int = 4) -> int:
    """Gradient buffer: 4 N. Megatron DDP with ``grad_reduce_in_fp32`` keeps an fp32
    ``main_grad`` for every local parameter (not sharded by the distributed optimizer, which
    reduce-scatters into it); 2 N with 16-bit gradients."""
    return grad_dtype_bytes * params


def optimizer_bytes(params: int, dp: int, distributed: bool) -> int:
    """Adam with fp32 master weights: (4 master + 4 m + 4 v) N = 12 N, divided by ``dp`` when
    the distributed optimizer shards it over the data-parallel ranks (ZeRO stage 1; Megatron
    shards over D c, the data-parallel group with context parallelism)."""
    return 12 * params // (dp if distributed else 1)


def activation_elements_per_token_layer(arch: Architecture) -> int:
    """Elements one layer saves for backward per token, without recompute (flash attention,
    no dropout, SwiGLU, RMSNorm; sizes on one GPU are this divided by t with sequence
    parallelism):

        h [attn norm input] + h [QKV input] + a d [Q] + 2 g d [K, V] + a d [attention out = proj
        input] + h [MLP norm input] + h [fc1 input] + 2 f [fc1 out = SwiGLU input] + f [fc2 in]
        = 4 h + 2 a d + 2 g d + 3 f   (= 6 h + 2 g d + 3 f when a d = h)

    The attention's softmax statistics (a fp32 floats per token) and RoPE tables are left out
    (< 1%).
    """
    return 4 * arch.hidden + 2 * arch.q_dim + 2 * arch.kv_dim + 3 * arch.intermediate


def activation_bytes(arch: Architecture, tokens: int, layers: int, in_flight: int, tp: int,
                     recompute: bool, dtype_bytes: int = 2) -> int:
    """Activations kept for backward on one GPU, ``tokens`` = s / c per micro-batch:

        no recompute:   in_flight  layers  tokens  E b / t
        full recompute: in_flight  layers  tokens  h b / t  [each layer's input]
                        +          tokens  E b / t          [the one layer being recomputed]

    E = activation_elements_per_token_layer; / t is sequence parallelism (Megatron requires it
    with TP > 1 here; it also shards the norm inputs); ``in_flight`` micro-batches are alive at
    once (1F1B: up to p on stage 0, 1 on the last stage).
    """
    per_token_layer = activation_elements_per_token_layer(arch) * dtype_bytes
    if not recompute:
        return in_flight * layers * tokens * per_token_layer // tp
    checkpoints = in_flight * layers * tokens * arch.hidden * dtype_bytes // tp
    return checkpoints + tokens * per_token_layer // tp


def logits_bytes(tokens: int, vocab_rows: int, tp: int, dtype_bytes: int = 2) -> int:
    """The logits shard and its gradient on the last stage: 2 tokens (V_pad / t) b.

    The output layer returns logits [tokens, V_pad / t] in the training dtype; the log-prob
    kernel saves them and its backward allocates a gradient of the same shape. For bf16 this
    is 4 bytes per logit, the size of one fp32 copy.
    """
    return 2 * tokens * (vocab_rows // tp) * dtype_bytes


def logprob_workspace_bytes(tokens: int, vocab_rows: int, tp: int,
                            chunk_size: int | None) -> int:
    """The chunked log-prob kernel's work buffers: 2 min(chunk, tokens) (V_pad / t) 4 bytes
    (two float32 [chunk, V_local] buffers, V_local = V_pad / t on the first TP rank; chunk
    defaults to 256 MiB / (4 V_local), ``vocab_parallel.default_chunk_size`` on GPU)."""
    local = vocab_rows // tp
    chunk = chunk_size or max(1, _GPU_CHUNK_BYTES // (4 * local))
    return 2 * min(chunk, tokens) * local * 4


def kv_cache_bytes_per_token(arch: Architecture, dtype_bytes: int = 2) -> int:
    """vLLM's KV cache per token (all layers, whole model): 2 [K, V] L g d b."""
    return 2 * arch.layers * arch.kv_dim * dtype_bytes


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Cluster:
    """The cluster shape: ``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gb`` GiB each."""

    gpus_per_node: int
    nodes: int
    gpu_memory_gb: float

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gb * GIB)


@dataclass(frozen=True)
class Workload:
    """What a recipe says that decides memory (see ``Workload.from_recipe``)."""

    micro_batch_tokens: int
    """s: tokens of one packed micro-batch row."""
    responses_per_update: int
    """mini_batch_prompts x group_size: the responses of one optimizer update."""
    max_sequence: int
    """max_prompt_tokens + max_response_tokens."""
    recompute: bool = False
    distributed_optimizer: bool = True
    dtype_bytes: int = 2
    grad_dtype_bytes: int = 4
    log_prob_chunk_size: int | None = None
    colocated_rollout: bool = True
    """vLLM lives on the training GPUs (global rank 0 and its vLLM TP peers)."""
    rollout_tp: int = 1
    rollout_dtype_bytes: int = 2
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    overhead_bytes: int = 2 * GIB
    """CUDA context, NCCL buffers and allocator fragmentation (a flat allowance per GPU)."""

    @classmethod
    def from_recipe(cls, run) -> "Workload":
        """The memory-relevant fields of a ``RunConfig``. The distributed optimizer's ``None``
        (on with a GPU) counts as on; bf16 unless ``model.dtype: float32``."""
        dist_opt = run.optimizer.use_distributed_optimizer
        return cls(
            micro_batch_tokens=run.train.micro_batch_tokens,
            responses_per_update=run.train.mini_batch_prompts * run.rollout.group_size,
            max_sequence=run.rollout.max_prompt_tokens + run.rollout.max_response_tokens,
            recompute=run.model.recompute_activations,
            distributed_optimizer=True if dist_opt is None else bool(dist_opt),
            dtype_bytes=4 if run.model.dtype == "float32" else 2,
            log_prob_chunk_size=run.train.log_prob_chunk_size,
            colocated_rollout=run.rollout.engine == "vllm",
            rollout_tp=run.rollout.tensor_parallel_size,
            rollout_dtype_bytes=4 if run.rollout.dtype in ("float32", "float") else 2,
            gpu_memory_utilization=run.rollout.gpu_memory_utilization,
            kv_cache_memory_bytes=run.rollout.kv_cache_memory_bytes,
            max_num_seqs=run.rollout.max_num_seqs,
        )


@dataclass(frozen=True)
class Layout:
    """TP x PP x CP x DP; Megatron's rank order puts TP innermost (within a node)."""

    tp: int
    pp: int
    cp: int
    dp: int

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def __str__(self) -> str:
        return f"TP{self.tp} PP{self.pp} CP{self.cp} DP{self.dp}"


@dataclass
class Estimate:
    """Peak bytes on the most loaded GPU of a layout, term by term."""

    layout: Layout
    stage: str
    """Which GPU is the peak: "first" (stage 0, with the embedding, p micro-batches in flight
    and vLLM), "last" (output layer and logits), a middle stage's index, or "only" (p = 1)."""
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    vllm: int
    overhead: int
    gpu_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits
                + self.vllm + self.overhead)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def fits_with(self, headroom: float) -> bool:
        """total <= (1 - headroom) GPU memory."""
        return self.total <= (1.0 - headroom) * self.gpu_bytes

    def as_dict(self) -> dict:
        terms = {k: getattr(self, k) / GIB for k in
                 ("weights", "grads", "optimizer", "activations", "logits", "vllm", "overhead")}
        return dict(layout=asdict(self.layout), peak_stage=self.stage,
                    gib={**terms, "total": self.total / GIB, "gpu": self.gpu_bytes / GIB},
                    fits=self.fits, notes=list(self.notes))


def micro_batches_per_update(work: Workload, dp: int) -> int:
    """Upper bound of packed micro-batches per DP rank and update:
    ceil(ceil(responses / D) max_sequence / s) (every response at full length)."""
    per_rank = -(-work.responses_per_update // dp)
    return max(1, -(-per_rank * work.max_sequence // work.micro_batch_tokens))


def vllm_bytes(arch: Architecture, cluster: Cluster, work: Workload) -> tuple[int, list[str]]:
    """vLLM's share of one of its GPUs when colocated, and notes:

        kv_cache_memory_bytes set:  N b_r / t_r + kv_cache_memory_bytes
        otherwise:                  gpu_memory_utilization x GPU memory   (vLLM's own reserve)

    The KV cache that ``max_num_seqs`` full-length sequences need is
    max_num_seqs (prompt + response) kv_cache_bytes_per_token / t_r; when the reserve holds
    less, vLLM decodes fewer sequences at once (slower, not out of memory).
    """
    if not work.colocated_rollout:
        return 0, []
    weights = param_count(arch) * work.rollout_dtype_bytes // work.rollout_tp
    per_seq = work.max_sequence * kv_cache_bytes_per_token(arch, work.rollout_dtype_bytes) \
        // work.rollout_tp
    needed = work.max_num_seqs * per_seq
    if work.kv_cache_memory_bytes is not None:
        reserve, kv = weights + work.kv_cache_memory_bytes, work.kv_cache_memory_bytes
        how = "rollout.kv_cache_memory_bytes"
    else:
        reserve = int(work.gpu_memory_utilization * cluster.gpu_bytes)
        kv = reserve - weights
        how = f"rollout.gpu_memory_utilization={work.gpu_memory_utilization:g}"
    notes = []
    if kv <= 0:
        notes.append(f"vLLM: {how} leaves no room for the KV cache after {weights / GIB:.1f} "
                     f"GiB of weights per GPU (raise it or rollout.tensor_parallel_size)")
    elif kv < needed:
        notes.append(f"vLLM: KV cache {kv / GIB:.1f} GiB holds ~{kv // per_seq} full-length "
                     f"sequences at once, not max_num_seqs={work.max_num_seqs} "
                     f"({needed / GIB:.1f} GiB)")
    return reserve, notes


def estimate(arch: Architecture, cluster: Cluster, layout: Layout, work: Workload) -> Estimate:
    """The peak GPU of ``layout``: the largest over pipeline stages k = 0 .. p-1 of weights +
    gradients + optimizer + activations + logits + vLLM + overhead, where stage k holds
    min(p - k, micro-batches) micro-batches in flight (1F1B), stage 0 the embedding, the last
    stage the output layer and the logits, and the stages of global ranks 0 .. t_r - 1 vLLM
    (stage k holds ranks k world / p .. (k + 1) world / p - 1: PP is Megatron's outermost)."""
    t, p, c, d = layout.tp, layout.pp, layout.cp, layout.dp
    tokens = -(-work.micro_batch_tokens // c)
    rows = padded_vocab(arch.vocab, t)
    micro_batches = micro_batches_per_update(work, d)
    vllm, vllm_notes = vllm_bytes(arch, cluster, work)
    gpus_per_stage = cluster.world // p

    def stage_estimate(stage: int) -> Estimate:
        params = stage_params(arch, t, p, stage)
        last = stage == p - 1
        has_vllm = stage * gpus_per_stage < work.rollout_tp
        name = "only" if p == 1 else "first" if stage == 0 else "last" if last else f"{stage}"
        return Estimate(
            layout=layout, stage=name,
            weights=weight_bytes(params, work.dtype_bytes),
            grads=grad_bytes(params, work.grad_dtype_bytes),
            # CP ranks hold the same weights: Megatron shards the optimizer over DP x CP
            optimizer=optimizer_bytes(params, d * c, work.distributed_optimizer),
            activations=activation_bytes(arch, tokens, arch.layers // p,
                                         min(p - stage, micro_batches), t, work.recompute,
                                         work.dtype_bytes),
            logits=(logits_bytes(tokens, rows, t, work.dtype_bytes)
                    + logprob_workspace_bytes(tokens, rows, t, work.log_prob_chunk_size)
                    if last else 0),
            vllm=vllm if has_vllm else 0,
            overhead=work.overhead_bytes, gpu_bytes=cluster.gpu_bytes,
            notes=list(vllm_notes) if has_vllm else [])

    # ties go to the earlier stage (the one with vLLM and the most micro-batches in flight)
    peak = max((stage_estimate(k) for k in range(p)), key=lambda e: e.total)
    if c > 1:
        peak.notes.append("CP > 1 needs context parallelism in the trainer (not yet a "
                          "parallel.* field)")
    return peak


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def candidate_layouts(arch: Architecture, cluster: Cluster, work: Workload,
                      max_cp: int = 8) -> list[Layout]:
    """All layouts with t | gpus_per_node, t | a, t | g, t | f; p | L; c in {1, 2, 4, ..,
    max_cp}; t p c | world; and D = world / (t p c) <= responses per update (every DP rank
    gets at least one response)."""
    out = []
    for t in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % t or arch.heads % t or arch.kv_heads % t \
                or arch.intermediate % t:
            continue
        for p in range(1, arch.layers + 1):
            if arch.layers % p or cluster.world % (t * p):
                continue
            for c in _powers_of_two(max_cp):
                if cluster.world % (t * p * c):
                    continue
                d = cluster.world // (t * p * c)
                if d <= work.responses_per_update:
                    out.append(Layout(t, p, c, d))
    return out


def _preference(e: Estimate) -> tuple:
    """Smallest model-parallel size first; then CP last (only for sequences too long), PP
    after TP (TP stays on NVLink; PP adds bubbles and holds p micro-batches on stage 0); then
    the lowest peak."""
    lay = e.layout
    return (lay.model_parallel, lay.cp, lay.pp, e.total)


def choose(estimates: list[Estimate], headroom: float) -> tuple[Estimate | None, str]:
    """The preferred layout among those within (1 - headroom) of GPU memory, else among those
    that fit at all; None when nothing fits. Returns it with the explanation."""
    roomy = sorted((e for e in estimates if e.fits_with(headroom)), key=_preference)
    tight = sorted((e for e in estimates if e.fits), key=_preference)
    pick = roomy[0] if roomy else (tight[0] if tight else None)
    if pick is None:
        return None, ""
    lay = pick.layout
    smaller = [e for e in estimates if e.layout.model_parallel < lay.model_parallel]
    why = [f"{lay} (model-parallel size {lay.model_parallel}, {lay.dp} data-parallel "
           f"replica{'s' if lay.dp > 1 else ''}) peaks at {pick.total / GIB:.1f} of "
           f"{pick.gpu_bytes / GIB:.0f} GiB on "
           f"the {pick.stage} pipeline stage GPU."]
    if roomy:
        why.append(f"It is the smallest model-parallel size that leaves {headroom:.0%} "
                   f"headroom;")
    else:
        why.append(f"No layout leaves {headroom:.0%} headroom; this is the smallest that fits "
                   f"at all, so expect little margin for fragmentation;")
    passed_over = [e for e in tight if e.layout.model_parallel == lay.model_parallel
                   and _preference(e) < _preference(pick)] if roomy else []
    if passed_over:
        other = passed_over[0]
        why.append(f"{other.layout} is as small and preferred by the rules below, but its "
                   f"{other.total / GIB:.1f} GiB leaves less than {headroom:.0%} headroom;")
    if smaller:
        best_smaller = min(smaller, key=lambda e: e.total)
        why.append(f"every smaller one needs at least {best_smaller.total / GIB:.1f} GiB "
                   f"({best_smaller.layout}).")
    else:
        why.append("no smaller layout exists.")
    why.append("Fewer model-parallel GPUs mean more data-parallel replicas and less "
               "communication per token. At equal size, TP is preferred to PP (TP's all-reduces "
               "stay on NVLink within a node, PP adds pipeline bubbles and keeps up to PP "
               "micro-batches of activations on the first stage), and CP comes last (only "
               "sequences too long for one GPU's activations need it).")
    if pick.vllm:
        why.append(f"GPU 0 also holds vLLM's {pick.vllm / GIB:.1f} GiB.")
    return pick, " ".join(why)


# --------------------------------------------------------------------------- recipe & CLI


def architecture_for(run, hf_config: str | None = None) -> Architecture:
    """The recipe's model shape: ``hf_config`` (a config.json or its folder) if given; else
    ``model.tiny`` (the tiny Qwen2 of ``megatron_dgpo.tiny``); else ``model.path`` when it is a
    local folder with config.json; else the built-in table ``PUBLISHED`` keyed by hub id."""
    if hf_config:
        return Architecture.from_hf_config(_read_config(hf_config, "--hf-config"),
                                           name=os.path.basename(hf_config.rstrip("/")))
    if run.model.tiny is not None:
        from megatron_dgpo.tiny import TINY_CONFIG

        kwargs = {k: v for k, v in run.model.tiny.items() if k != "seed"}
        cfg = {"model_type": "qwen2", "vocab_size": kwargs.pop("vocab_size", 512),
               **TINY_CONFIG, **kwargs}
        return Architecture.from_hf_config(cfg, name="tiny")
    path = run.model.path
    if os.path.isfile(os.path.join(path, "config.json")):
        return Architecture.from_hf_config(_read_config(path, "model.path"),
                                           name=os.path.basename(path.rstrip("/")))
    if path in PUBLISHED:
        return PUBLISHED[path]
    raise ValueError(f"model.path {path!r} is neither a local HF folder with config.json nor "
                     f"a hub id the planner knows ({', '.join(sorted(PUBLISHED))}); pass its "
                     f"config.json with --hf-config")


def _read_config(path: str, flag: str) -> dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {file}: {exc}") from None


@dataclass
class Plan:
    """Everything ``dgpo-plan`` prints."""

    architecture: Architecture
    cluster: Cluster
    workload: Workload
    estimates: list[Estimate]
    pick: Estimate | None
    explanation: str
    recipe_layout: Estimate | None
    """The recipe's own parallel.* layout (CP 1), when it is a candidate."""
    hint: str = ""
    """Why nothing fits (when ``pick`` is None)."""
    required_overrides: list[str] = field(default_factory=list)
    """Recipe overrides the pick needs (full recompute when nothing fits without it)."""
    as_configured: str = ""
    """When ``required_overrides`` is set: the best the recipe as written can do."""

    def as_dict(self) -> dict:
        return dict(
            model=asdict(self.architecture), params=param_count(self.architecture),
            cluster=asdict(self.cluster), workload=asdict(self.workload),
            layouts=[e.as_dict() for e in self.estimates],
            pick=self.pick.as_dict() if self.pick else None, explanation=self.explanation,
            recipe_layout=self.recipe_layout.as_dict() if self.recipe_layout else None,
            hint=self.hint, required_overrides=list(self.required_overrides),
            as_configured=self.as_configured)


def make_plan(arch: Architecture, cluster: Cluster, work: Workload, *, headroom: float = 0.1,
              max_cp: int = 8, recipe_tp: int = 1, recipe_pp: int = 1) -> Plan:
    """Estimate every candidate layout and choose one (``choose``). When nothing fits and the
    recipe does not recompute activations, plan again with full recompute: if a layout fits
    then, that plan is returned with ``required_overrides`` naming the switch."""
    layouts = candidate_layouts(arch, cluster, work, max_cp)
    estimates = [estimate(arch, cluster, lay, work) for lay in layouts]
    pick, why = choose(estimates, headroom)
    own = next((e for e in estimates if (e.layout.tp, e.layout.pp, e.layout.cp)
                == (recipe_tp, recipe_pp, 1)), None)
    plan = Plan(arch, cluster, work, estimates, pick, why, own)
    if pick is not None:
        return plan
    plan.hint = _no_fit_text(arch, cluster, estimates)
    if not work.recompute and estimates:
        retry = make_plan(arch, cluster, replace(work, recompute=True), headroom=headroom,
                          max_cp=max_cp, recipe_tp=recipe_tp, recipe_pp=recipe_pp)
        if retry.pick is not None:
            retry.required_overrides = ["model.recompute_activations=true"]
            retry.as_configured = plan.hint
            retry.explanation = ("Nothing fits without activation recompute, so this plan "
                                 "turns on model.recompute_activations (full recompute, ~1/3 "
                                 "more compute). " + retry.explanation)
            return retry
        plan.hint += " Full activation recompute does not make any layout fit either."
    plan.hint += " Use more GPUs, GPUs with more memory, or shorter micro-batches."
    return plan


def _no_fit_text(arch: Architecture, cluster: Cluster, estimates: list[Estimate]) -> str:
    where = (f"{arch.name} on {cluster.nodes} x {cluster.gpus_per_node} GPUs of "
             f"{cluster.gpu_memory_gb:g} GiB")
    if not estimates:
        return (f"no layout of {where} is possible: TP must divide {cluster.gpus_per_node} "
                f"GPUs per node, {arch.heads} heads and {arch.kv_heads} KV groups, PP must "
                f"divide {arch.layers} layers, and TP x PP x CP the world size")
    least = min(estimates, key=lambda e: e.total)
    return (f"no layout fits {where}: the smallest peak is {least.total / GIB:.1f} GiB "
            f"({least.layout}).")


_COLUMNS = ("weights", "grads", "optimizer", "activations", "logits", "vllm", "overhead")


def format_table(plan: Plan, headroom: float) -> str:
    """The human-readable report: one row per layout (GiB on its peak GPU), then the pick."""
    arch, cl, work = plan.architecture, plan.cluster, plan.workload
    lines = [f"{arch.name}: {param_count(arch) / 1e9:.2f}B parameters (h={arch.hidden}, "
             f"L={arch.layers}, heads={arch.heads}, kv={arch.kv_heads}, f={arch.intermediate}, "
             f"V={arch.vocab}, tied={arch.tie_word_embeddings})",
             f"cluster: {cl.nodes} node(s) x {cl.gpus_per_node} GPUs x {cl.gpu_memory_gb:g} GiB; "
             f"micro-batch {work.micro_batch_tokens} tokens, recompute={work.recompute}, "
             f"distributed optimizer={work.distributed_optimizer}, "
             f"vLLM colocated={work.colocated_rollout}",
             ""]
    if plan.required_overrides:
        lines[-1:] = [f"as configured, {plan.as_configured[0].lower()}{plan.as_configured[1:]}",
                      f"planned with {' '.join(plan.required_overrides)}:", ""]
    head = ["layout", "stage"] + list(_COLUMNS) + ["total", "fits"]
    rows = []
    for e in sorted(plan.estimates, key=_preference):
        mark = ("yes" if e.fits_with(headroom) else "tight") if e.fits else "no"
        if plan.pick is e:
            mark += " <- pick"
        rows.append([str(e.layout), e.stage] + [f"{getattr(e, k) / GIB:.1f}" for k in _COLUMNS]
                    + [f"{e.total / GIB:.1f}", mark])
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"(GiB on each layout's most loaded GPU; 'tight' fits but with less than "
                 f"{headroom:.0%} headroom)")
    lines.append("")
    if plan.pick:
        lines.append("pick: " + plan.explanation)
        lay = plan.pick.layout
        lines.append(f"set: parallel.tensor_parallel={lay.tp} parallel.pipeline_parallel={lay.pp}"
                     + "".join(f" {o}" for o in plan.required_overrides)
                     + (f" (and context parallel {lay.cp})" if lay.cp > 1 else ""))
        for note in plan.pick.notes:
            lines.append("note: " + note)
    else:
        lines.append("DOES NOT FIT: " + plan.hint)
    if plan.recipe_layout is not None and plan.recipe_layout is not plan.pick:
        own = plan.recipe_layout
        verdict = (("fits" if own.fits_with(headroom) else "fits, but tight") if own.fits
                   else "does NOT fit")
        lines.append(f"the recipe's own layout {own.layout}: {own.total / GIB:.1f} GiB, {verdict}")
    return "\n".join(lines)


def _positive_int(flag):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {text!r}")
        return value
    return parse


def _float_in(flag, low, high, what):
    """argparse type: a float with low <= value < high (``what`` says so in the error)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value < high:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dgpo-plan",
        description="Per-GPU memory of every TP x PP x CP x DP layout of a recipe on a "
                    "cluster, and the layout to use (formulas: docs/planner.md).")
    ap.add_argument("recipe", help="recipe YAML (as for dgpo-train)")
    ap.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    ap.add_argument("--gpus-per-node", type=_positive_int("--gpus-per-node"), required=True)
    ap.add_argument("--nodes", type=_positive_int("--nodes"), default=1)
    ap.add_argument("--gpu-memory-gb", required=True,
                    type=_float_in("--gpu-memory-gb", 1e-9, math.inf, "a positive number"),
                    help="memory of one GPU in GiB (80 for an A100/H100 80GB)")
    ap.add_argument("--headroom", type=_float_in("--headroom", 0.0, 1.0, "in [0, 1)"), default=0.1,
                    help="fraction of GPU memory to keep free in the preferred layout")
    ap.add_argument("--overhead-gb", type=_float_in("--overhead-gb", 0.0, math.inf, ">= 0"),
                    default=2.0,
                    help="per-GPU allowance for CUDA context, NCCL and fragmentation (GiB)")
    ap.add_argument("--max-cp", type=_positive_int("--max-cp"), default=8,
                    help="largest context-parallel size to consider (a power of two)")
    ap.add_argument("--hf-config", help="config.json (or its folder) giving the architecture, "
                                        "instead of model.path")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    """``dgpo-plan``: 0 when a layout fits, 1 when none does, 2 on bad input."""
    from megatron_dgpo.config import ConfigError
    from megatron_dgpo.recipe import load_recipe

    ap = _parser()
    args = ap.parse_intermixed_args(argv)
    if args.max_cp & (args.max_cp - 1):
        ap.error(f"--max-cp must be a power of two, got {args.max_cp}")
    try:
        run = load_recipe(args.recipe, args.overrides)
        arch = architecture_for(run, args.hf_config)
    except (ConfigError, ValueError) as exc:
        print(f"dgpo-plan: error: {exc}", file=sys.stderr)
        return 2
    cluster = Cluster(args.gpus_per_node, args.nodes, args.gpu_memory_gb)
    work = replace(Workload.from_recipe(run), overhead_bytes=int(args.overhead_gb * GIB))
    if work.colocated_rollout and work.rollout_tp > cluster.gpus_per_node:
        print(f"dgpo-plan: error: rollout.tensor_parallel_size={work.rollout_tp} exceeds "
              f"--gpus-per-node {cluster.gpus_per_node}", file=sys.stderr)
        return 2
    plan = make_plan(arch, cluster, work, headroom=args.headroom, max_cp=args.max_cp,
                     recipe_tp=run.parallel.tensor_parallel,
                     recipe_pp=run.parallel.pipeline_parallel)
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(format_table(plan, args.headroom))
    return 0 if plan.pick is not None else 1


if __name__ == "__main__":
    sys.exit(main())
