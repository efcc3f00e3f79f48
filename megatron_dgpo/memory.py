"""Per-GPU memory of a training layout: the planner's formulas, as pure functions.

Each function's docstring states its formula; ``docs/planner.md`` collects them with their
assumptions and the published figures they were checked against. ``megatron_dgpo.plan`` (the
``dgpo-plan`` CLI) searches layouts with them.

Notation: h hidden size, L layers, a attention heads, g KV groups, d head size, f FFN width,
V vocabulary (padded to a multiple of 128 TP as Megatron does), t TP, p PP, c CP, D DP,
s the tokens of one packed micro-batch row (``train.micro_batch_tokens``), b bytes per element
of the training dtype (2 for bf16). Mixture of experts (Qwen3-MoE): E routed experts per layer,
k experts per token, f_e one expert's SwiGLU width, e EP (expert parallel), u ETP (expert
tensor parallel), D_e = world / (p e u) the expert data-parallel size. Memory is in bytes
(GIB = 2^30, the unit ``nvidia-smi`` uses). CP (c) is kept in the formulas for what-if estimates only: the trainer has no context
parallelism, so ``dgpo-plan`` searches c = 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from megatron_dgpo.gpu_config import GPU
from megatron_dgpo.gpu_config import sequence_parallel as gpu_sequence_parallel
from megatron_dgpo.models import describe, padded_vocab_size

GIB = 1 << 30


# --------------------------------------------------------------------------- architecture


@dataclass(frozen=True)
class Architecture:
    """The shape of a decoder (Qwen2, Llama, Qwen3 dense; Qwen3-MoE with ``experts`` > 0): what
    the memory formulas need.

    Built from an HF config with ``from_hf_config`` (through ``megatron_dgpo.models``), or by
    hand for what-if estimates."""

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
    """Bias on the Q, K, V projections (Qwen2: yes; Llama: no)."""
    head_dim: int = 0
    """d; 0 means h / a."""
    qk_norm: bool = False
    """RMSNorm weights over each query and key head (Qwen3): 2 d parameters per layer."""
    experts: int = 0
    """E, routed experts per layer (every layer an MoE layer); 0 for a dense model, whose
    layers have the SwiGLU MLP of width ``intermediate``."""
    moe_ffn: int = 0
    """f_e, one expert's SwiGLU width (its fc1 is [2 f_e, h], fc2 [h, f_e])."""
    topk: int = 0
    """k, experts each token is routed to."""

    def __post_init__(self):
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"architecture {self.name}: {name} must be a positive int, "
                                 f"got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"architecture {self.name}: heads ({self.heads}) must be a "
                             f"multiple of kv_heads ({self.kv_heads})")
        if self.experts and not (self.moe_ffn >= 1 and 1 <= self.topk <= self.experts):
            raise ValueError(f"architecture {self.name}: an MoE model needs moe_ffn >= 1 and "
                             f"1 <= topk <= experts ({self.experts}), got moe_ffn="
                             f"{self.moe_ffn!r}, topk={self.topk!r}")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def moe(self) -> bool:
        return self.experts > 0

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
        """From an HF ``config.json`` dict of a registered family (``megatron_dgpo.models``:
        the same dimensions and quirks the model builder and the converter use); errors name
        the missing or unsupported field."""
        try:
            desc = describe(cfg)
        except ValueError as exc:
            raise ValueError(f"{name or 'the model'}: {exc}") from None
        dims = desc.dims
        return cls(
            name=name or cfg.get("model_type") or "model",
            hidden=dims.hidden, layers=dims.layers, heads=dims.heads, kv_heads=dims.kv_heads,
            intermediate=dims.ffn, vocab=dims.vocab,
            tie_word_embeddings=desc.tie_word_embeddings, qkv_bias=desc.qkv_bias,
            head_dim=dims.head_dim, qk_norm=desc.qk_norm, experts=dims.experts,
            moe_ffn=dims.moe_ffn, topk=dims.topk,
        )


_QWEN2 = dict(model_type="qwen2", vocab_size=152064, tie_word_embeddings=False)
_LLAMA31_70B = dict(model_type="llama", hidden_size=8192, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
                    vocab_size=128256, tie_word_embeddings=False, attention_bias=False)
# every Qwen3 model: head_dim 128 whatever h / a is (Qwen3-32B: 5120 / 64 = 80), untied
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, tie_word_embeddings=False,
              attention_bias=False)
# both released MoE models: 128 experts, top-8, renormalised top-k, every layer MoE (their
# intermediate_size is that of the dense MLP they do not have)
_QWEN3_MOE = dict(_QWEN3, model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  router_aux_loss_coef=0.001)
PUBLISHED_CONFIGS: dict[str, dict] = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": dict(
        _QWEN2, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": dict(
        _QWEN2, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": dict(
        _QWEN2, hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=13824),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": dict(
        _QWEN2, hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=27648),
    # Llama-3.3-70B-Instruct and DeepSeek-R1-Distill-Llama-70B (distilled from it) have the
    # same config.json shape as Llama-3.1-70B
    **{hub_id: _LLAMA31_70B for hub_id in (
        "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct",
        "meta-llama/Llama-3.3-70B-Instruct", "deepseek-ai/DeepSeek-R1-Distill-Llama-70B")},
    "Qwen/Qwen3-8B": dict(
        _QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=12288),
    "Qwen/Qwen3-14B": dict(
        _QWEN3, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=17408),
    "Qwen/Qwen3-32B": dict(
        _QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=25600),
    "Qwen/Qwen3-30B-A3B": dict(
        _QWEN3_MOE, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768),
    "Qwen/Qwen3-235B-A22B": dict(
        _QWEN3_MOE, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536),
}
"""The architecture fields of published config.json files
(huggingface.co/<id>/blob/main/config.json)."""
PUBLISHED: dict[str, Architecture] = {
    hub_id: Architecture.from_hf_config(cfg, name=hub_id.split("/")[1])
    for hub_id, cfg in PUBLISHED_CONFIGS.items()}
"""The planner's built-in architectures by hub id; the family registry supplies the quirks
(Qwen2: QKV bias; Llama: none; Qwen3: q/k norms; Qwen3-MoE: router and experts)."""


def padded_vocab(vocab: int, tp: int) -> int:
    """V_pad = ceil(V / (128 t)) 128 t: the rows Megatron allocates for the embedding and output
    layer (``megatron_dgpo.models.padded_vocab_size``, the rule the model builder uses)."""
    return padded_vocab_size(vocab, tp)


# --------------------------------------------------------------------------- parameters


def layer_params(arch: Architecture, tp: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank, routed experts excluded
    (``expert_layer_params``):

        (h (a d + 2 g d)  [QKV]  + (a d + 2 g d) [QKV bias, if any]  + a d h [proj]
         + 2 f h [fc1, gate and up] + f h [fc2]       (dense MLP only)) / t
        + 2 h [two RMSNorm weights]  + 2 d [q/k norms, Qwen3]  + E h [router, MoE]

    The norms and the router are replicated over TP (Megatron's ``TopKRouter`` weight is
    [E, h] on every rank).
    """
    qkv_out = arch.q_dim + 2 * arch.kv_dim
    mlp = 0 if arch.moe else 3 * arch.intermediate * arch.hidden
    sharded = (arch.hidden * qkv_out + (qkv_out if arch.qkv_bias else 0)
               + arch.q_dim * arch.hidden + mlp)
    replicated = (2 * arch.hidden + (2 * arch.head_dim if arch.qk_norm else 0)
                  + arch.experts * arch.hidden)
    return sharded // tp + replicated


def expert_layer_params(arch: Architecture, ep: int = 1, etp: int = 1) -> int:
    """One layer's routed-expert parameters on one rank: (E / e) 3 f_e h / u (each expert's
    fc1 [2 f_e, h] and fc2 [h, f_e], E / e experts per EP rank, each split over expert TP
    u); 0 for a dense model."""
    if not arch.moe:
        return 0
    if arch.experts % ep:
        raise ValueError(f"expert_parallel {ep} does not divide {arch.experts} experts")
    return arch.experts // ep * 3 * arch.moe_ffn * arch.hidden // etp


def embedding_params(arch: Architecture, vocab_rows: int, tp: int = 1) -> int:
    """One vocabulary matrix (input embedding or output layer) on one TP rank: V_rows h / t."""
    return vocab_rows * arch.hidden // tp


def param_count(arch: Architecture, vocab_rows: int | None = None) -> int:
    """Unique parameters of the whole model:

        V h [embedding] + L (layer_params + expert_layer_params) + h [final norm]
        + (0 if tied else V h) [output layer]

    ``vocab_rows`` defaults to the HF vocabulary (what model cards count); pass
    ``padded_vocab(V, t)`` for what Megatron builds.
    """
    rows = arch.vocab if vocab_rows is None else vocab_rows
    vocab_mats = 1 if arch.tie_word_embeddings else 2
    return (vocab_mats * rows * arch.hidden
            + arch.layers * (layer_params(arch) + expert_layer_params(arch)) + arch.hidden)


def stage_expert_params(arch: Architecture, pp: int, ep: int = 1, etp: int = 1) -> int:
    """The routed-expert parameters on one GPU of any pipeline stage: (L / p) (E / e) 3 f_e h
    / u. They are replicated over the D_e = world / (p e u) expert data-parallel ranks only,
    which is what the distributed optimizer shards their state over."""
    return arch.layers // pp * expert_layer_params(arch, ep, etp)


def stage_params(arch: Architecture, tp: int, pp: int, stage: int, ep: int = 1,
                 etp: int | None = None) -> int:
    """Parameters held by one GPU of pipeline stage ``stage`` (0 .. p-1) at TP t (EP e and
    expert TP u, default t, for an MoE model):

        (L / p) layer_params(t)  + stage_expert_params(e, u)  + [stage 0] V_pad h / t
        + [stage p-1] (h + V_pad h / t)    (output layer: untied, or tied with p > 1, where
                                            Megatron keeps a copy on the last stage)

    with V_pad = padded_vocab(V, t). Needs p | L (and e | E).
    """
    if arch.layers % pp:
        raise ValueError(f"pipeline_parallel {pp} does not divide {arch.layers} layers")
    rows = padded_vocab(arch.vocab, tp)
    count = arch.layers // pp * layer_params(arch, tp) \
        + stage_expert_params(arch, pp, ep, tp if etp is None else etp)
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


def activation_elements_per_token_layer(arch: Architecture, etp: int = 1) -> int:
    """Elements one layer saves for backward per token, without recompute (flash attention,
    no dropout, SwiGLU, RMSNorm; whole, before any TP sharding):

        h [attn norm input] + h [QKV input] + a d [Q] + 2 g d [K, V] + a d [attention out = proj
        input] + h [MLP norm input] + h [fc1 input] + 2 f [fc1 out = SwiGLU input] + f [fc2 in]
        = 4 h + 2 a d + 2 g d + 3 f   (= 6 h + 2 g d + 3 f when a d = h)

    Qwen3's q/k norms add their inputs, a d + g d. An MoE layer has no dense MLP: its h [fc1
    input] is the router's input, and each token's k routed copies keep, per expert TP group
    of u ranks, k (u h [the expert's gathered fc1 input] + 3 f_e [fc1 out, fc2 in])
    (``SequentialMLP`` / ``TEGroupedMLP`` with the probabilities applied in the activation):

        MoE: 4 h + 2 a d + 2 g d + k (u h + 3 f_e)

    Routed counts are the balanced mean (T k tokens per EP rank); without the load-balancing
    loss a hot expert's rank receives more. The attention's softmax statistics (a fp32 floats
    per token), the router's fp32 scores (E per token) and RoPE tables are left out (< 1%).
    """
    attention = 2 * arch.q_dim + 2 * arch.kv_dim + (
        arch.q_dim + arch.kv_dim if arch.qk_norm else 0)
    mlp = arch.topk * (etp * arch.hidden + 3 * arch.moe_ffn) if arch.moe \
        else 3 * arch.intermediate
    return 4 * arch.hidden + attention + mlp


def activation_split(arch: Architecture, sequence_parallel: bool, etp: int = 1
                     ) -> tuple[int, int]:
    """``activation_elements_per_token_layer`` as (whole on every TP rank, sharded over TP):

        sequence parallel:  (0, E)                    every saved tensor is sharded
        without it:         (4 h, E - 4 h)            the two norm inputs and the QKV and fc1
                                                      (router) inputs are whole

    An MoE layer's routed part counts as sharded: each rank routes its own s / t tokens
    (Megatron needs sequence parallelism for MoE with TP > 1).
    """
    total = activation_elements_per_token_layer(arch, etp)
    if sequence_parallel:
        return 0, total
    return 4 * arch.hidden, total - 4 * arch.hidden


def activation_bytes(arch: Architecture, tokens: int, layers: int, in_flight: int, tp: int,
                     recompute: bool, dtype_bytes: int = 2, *,
                     sequence_parallel: bool | None = None, etp: int = 1) -> int:
    """Activations kept for backward on one GPU, ``tokens`` = s / c per micro-batch, with
    (W, S) = ``activation_split`` (W = 0, S = E with sequence parallelism; W = 4 h without):

        no recompute:   in_flight  layers  tokens  (W + S / t) b
        full recompute: in_flight  layers  tokens  h b / t'     [each layer's input]
                        +          tokens  (W + S / t) b        [the one layer being recomputed]

    t' = t with sequence parallelism (the layer inputs are sharded along the sequence), 1
    without. ``sequence_parallel`` defaults to what the trainer runs on a GPU
    (``gpu_config.sequence_parallel``: on whenever t > 1). ``in_flight`` micro-batches are
    alive at once (1F1B: up to p on stage 0, 1 on the last stage). ``etp``: expert TP u of an
    MoE model.
    """
    if sequence_parallel is None:
        sequence_parallel = gpu_sequence_parallel(tp, GPU)
    whole, sharded = activation_split(arch, sequence_parallel, etp)

    def one_layer(count: int) -> int:  # bytes of `count` token-layers' full activations
        return count * whole * dtype_bytes + count * sharded * dtype_bytes // tp

    if not recompute:
        return one_layer(in_flight * layers * tokens)
    shard = tp if sequence_parallel else 1
    checkpoints = in_flight * layers * tokens * arch.hidden * dtype_bytes // shard
    return checkpoints + one_layer(tokens)


MOE_DISPATCHERS = ("alltoall", "allgather", "flex")
"""``model.moe_token_dispatcher`` values (``megatron_dgpo.recipe.ModelConfig``)."""


def dispatcher_bytes(arch: Architecture, tokens: int, tp: int, ep: int, etp: int,
                     dispatcher: str = "alltoall", dtype_bytes: int = 2) -> int:
    """The token dispatcher's buffers of one MoE layer on one GPU (0 for a dense model), with
    T = tokens / t the rank's tokens (sequence parallel) and u the expert TP:

        alltoall, flex:  T k h b (1 + 2 u)
        allgather:       T h b (u e + 2 u k)

    They are transient (freed before the next layer runs; the expert MLP's saved input is in
    the activations), so one layer's worth, forward or backward, is counted. Where they come
    from in Megatron-Core 0.16 (``megatron/core/transformer/moe/token_dispatcher.py``):

    - ``MoEAlltoAllTokenDispatcher.dispatch_preprocess``: ``permute`` copies each token once
      per chosen expert, the [T k, h] send buffer; ``token_dispatch``: ``all_to_all`` over the
      EP group receives [T k, h] (balanced routing); ``dispatch_postprocess``: with expert TP
      u > 1 ``gather_from_sequence_parallel_region`` makes it [u T k, h], and
      ``sort_chunks_by_idxs`` (several local experts) copies it again, sorted by expert. Send
      + gathered receive + sorted copy = T k h (1 + 2 u); the combine path
      (``combine_preprocess``, ``token_combine``, ``combine_postprocess``'s ``unpermute``) and
      backward mirror them.
    - ``MoEAllGatherTokenDispatcher.token_dispatch`` gathers every token of the EP x ETP group,
      [u e T, h], and ``dispatch_postprocess``'s ``permute`` keeps the local experts' [u T k, h]
      (plus the mirrored output).
    - flex (DeepEP / HybridEP) exchanges the same routed tokens as alltoall; its own
      communication buffers (NVSHMEM) are not counted.
    """
    if not arch.moe:
        return 0
    local = -(-tokens // tp)
    if dispatcher == "allgather":
        copies = etp * ep + 2 * etp * arch.topk
    else:
        copies = arch.topk * (1 + 2 * etp)
    return local * arch.hidden * dtype_bytes * copies


def logits_bytes(tokens: int, vocab_rows: int, tp: int, dtype_bytes: int = 2) -> int:
    """The logits shard and its gradient on the last stage: 2 tokens (V_pad / t) b_l.

    b_l is the dtype the logits reach the log-prob kernel in: the trainer keeps them in the
    model's dtype (``Float16Module`` with ``fp32_output=False``; the kernel upcasts chunk by
    chunk), so b_l = b. The kernel saves them and its backward allocates a gradient of the
    same shape and dtype. For bf16 this is 4 bytes per logit; fp32 logits out of
    ``Float16Module``'s default would be 8 (+ the transient bf16 gradient of the cast).
    """
    return 2 * tokens * (vocab_rows // tp) * dtype_bytes


def logprob_workspace_bytes(tokens: int, vocab_rows: int, tp: int,
                            chunk_size: int | None) -> int:
    """The chunked log-prob kernel's work buffers: 2 min(chunk, tokens) (V_pad / t) 4 bytes
    (two float32 [chunk, V_local] buffers, V_local = V_pad / t on the first TP rank; chunk
    defaults to 256 MiB / (4 V_local), ``vocab_parallel.default_chunk_size`` on GPU)."""
    from megatron_dgpo.vocab_parallel import default_chunk_size

    local = vocab_rows // tp
    chunk = chunk_size or default_chunk_size(local, "cuda")
    return 2 * min(chunk, tokens) * local * 4


def kv_cache_bytes_per_token(arch: Architecture, dtype_bytes: int = 2) -> int:
    """vLLM's KV cache per token (all layers, whole model): 2 [K, V] L g d b."""
    return 2 * arch.layers * arch.kv_dim * dtype_bytes


NCCL_CHANNEL_BYTES = (4 << 20) + 4_915_200 + (1 << 19)
"""One NCCL channel's buffers for one connection with NCCL's default sizes: Simple
``NCCL_BUFFSIZE`` 4 MiB + LL128 4,915,200 bytes (120 x 640 threads x 8 steps x 8 bytes) + LL
512 KiB (8 lines x 512 threads x 8 steps x 16 bytes) = 9.19 MiB."""


def nccl_communicators(layout: "Layout", *, tied: bool, engine_tp: int, has_engine: bool,
                       refit_link: bool = False) -> list[str]:
    """The NCCL communicators one trainer GPU holds for the whole job (NCCL creates a
    communicator at a group's first collective and keeps it):

        TP [t > 1]  DP [D > 1: gradient reduce-scatter, parameter all-gather]
        PP [p > 1: stage-to-stage send/recv]  model-parallel [t p > 1: gradient-norm and loss
        reductions]  embedding [p > 1 and tied: tied-weight gradient sync]  world [D t p > 1:
        ``comm.any_rank`` at every step boundary, step metrics]  vLLM TP [an engine of
        t_r > 1 GPUs on this GPU: its own PyNccl communicator, kept while it sleeps]
        refit link [a DP replica's leader with dedicated engines: the weight broadcast to them]

    An MoE layout adds EP [e > 1: the dispatcher's all-to-all], expert-TP [u > 1: the
    experts' TP collectives] and expert-DP [D_e > 1: the experts' gradient reduce-scatter and
    parameter all-gather]; Megatron makes them groups of their own even where their ranks are
    those of TP or DP, so each is a communicator of its own.
    """
    t, p, d = layout.tp, layout.pp, layout.dp
    named = [("TP", t > 1), ("DP", d > 1), ("PP", p > 1), ("model-parallel", t * p > 1),
             ("embedding", p > 1 and tied), ("world", t * p * d > 1),
             ("vLLM TP", has_engine and engine_tp > 1), ("refit link", refit_link)]
    if layout.moe:  # Megatron's expert grid: EP (token all-to-all), expert TP, expert DP
        u, e = layout.expert_tp, layout.ep
        named[3:3] = [("EP", e > 1), ("expert-TP", u > 1), ("expert-DP", layout.expert_dp > 1)]
    return [name for name, used in named if used]


def nccl_bytes(communicators: int, channels: int = 32) -> int:
    """NCCL's buffers on one GPU: communicators x C x 9.19 MiB (``NCCL_CHANNEL_BYTES``), C the
    channels per communicator (up to 32 on NVLink; ``--nccl-channels``). One connection per
    channel: since NCCL 2.22 (``NCCL_RUNTIME_CONNECT=1``) only the algorithm a collective
    uses is connected, a ring has one receive connection per channel (its send buffers are on
    the next GPU). NCCL's maintainers: memory is linear in channels; ring uses 2 connections
    regardless of scale (NVIDIA/nccl#986). With every algorithm connected (older NCCL, tree:
    up to 3 more peers) one communicator measured ~1.1 GiB on 8 GPUs (NVIDIA/nccl#864), 4x
    this. NVLS (NVLink SHARP) buffers are not counted: set ``NCCL_NVLS_ENABLE=0`` or leave
    headroom."""
    return communicators * channels * NCCL_CHANNEL_BYTES


def allocator_cache_bytes(dynamic: int, slack: float) -> int:
    """What PyTorch's caching allocator holds beyond the live tensors at training's peak:
    slack x (activations + dispatch + logits). Those are the tensors freed and re-allocated
    every micro-batch (the MoE dispatcher's every layer) at sizes that vary with the packed rows, so cached blocks do not fit the next
    request exactly (fragmentation); weights, gradients and optimizer state are allocated once.
    ``expandable_segments`` would shrink it but is refused by vLLM's sleep-mode allocator, so
    the trainer leaves it off. The trainer empties the cache before a colocated engine wakes
    (``train.py``), so rollout does not pay it."""
    return int(slack * dynamic)


# --------------------------------------------------------------------------- a layout's peak


@dataclass(frozen=True)
class Cluster:
    """The cluster shape: ``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gb`` GiB each."""

    gpus_per_node: int
    nodes: int
    gpu_memory_gb: float
    rollout_gpus: int = 0
    """GPUs of dedicated rollout engines (``rollout.placement: dedicated``, ``rollout.num_gpus``):
    the last ones of the job, outside the trainer's world."""

    @property
    def gpus(self) -> int:
        """Every GPU of the job."""
        return self.gpus_per_node * self.nodes

    @property
    def world(self) -> int:
        """The trainer's (Megatron's) world: every GPU but the dedicated engines'."""
        return self.gpus - self.rollout_gpus

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
    logits_dtype_bytes: int | None = None
    """Bytes per logit into the log-prob kernel; None: ``dtype_bytes`` (the trainer keeps the
    logits in the model's dtype)."""
    log_prob_chunk_size: int | None = None
    colocated_rollout: bool = True
    """vLLM lives on the training GPUs: with ``rollout.placement: colocated`` an engine in every
    rank (one per ``rollout_tp`` GPUs); with ``separate``, one per DP replica leader (its
    ``rollout_tp`` GPUs counted from the first of the node). False for the transformers engine
    and for dedicated engines (``Cluster.rollout_gpus`` of them)."""
    rollout_placement: str = "colocated"
    """With "dedicated", each DP replica's leader holds one more communicator, the refit link to
    its engines (``dedicated_engine_estimate``)."""
    rollout_tp: int | None = None
    """GPUs per engine; None = the layout's TP x PP (TP when PP > 1 and DP > 1)."""
    sleep_mode: bool = True
    """A colocated engine sleeps during training (vLLM sleep mode: KV cache freed, weights
    dropped), so its memory and training's activations/logits never coexist: the GPU peak
    counts max(vLLM, activations + logits)."""
    offload_training_state: bool = False
    """``train.offload_training_state``: gradients and optimizer state leave the GPU while a
    sleeping colocated engine is awake, so the peak is max(training, vLLM) over them too."""
    moe_dispatcher: str = "alltoall"
    """``model.moe_token_dispatcher`` (``dispatcher_bytes``; allgather needs PP 1)."""
    rollout_dtype_bytes: int = 2
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    enforce_eager: bool = False
    """``rollout.enforce_eager``: no CUDA graphs, so a sleeping engine keeps no graph pool."""
    cuda_graph_bytes: int = GIB
    """A vLLM engine's CUDA-graph pool per GPU (``--cuda-graph-gb``). Since vLLM 0.21 it is
    profiled inside ``gpu_memory_utilization`` while the engine is awake, but sleep mode does
    not release it, so it stays through training. Published captures: 0.13 GiB (0.5B model,
    decode sizes to 256), 0.36 GiB (piecewise sizes to 16), 1.4 GiB (a 1T MoE at TP 8, sizes
    to 512); vLLM's older warning said 1-3 GiB."""
    nccl_channels: int = 32
    """C of ``nccl_bytes`` (``--nccl-channels``)."""
    allocator_slack: float = 0.1
    """``allocator_cache_bytes``'s slack (``--allocator-slack``)."""
    overhead_bytes: int = GIB
    """The CUDA context (~0.5 GiB with lazy module loading) and the cuBLAS / TE workspaces: a
    flat allowance per GPU (``--overhead-gb``); NCCL, CUDA graphs and the allocator's cache
    are their own terms."""

    @classmethod
    def from_recipe(cls, run) -> "Workload":
        """The memory-relevant fields of a ``RunConfig``. ``None`` means what it means on a GPU:
        the distributed optimizer and sleep mode count as on, ``enforce_eager`` as off (CUDA
        graphs); bf16 unless ``model.dtype: float32``."""
        dist_opt = run.optimizer.use_distributed_optimizer
        return cls(
            micro_batch_tokens=run.train.micro_batch_tokens,
            responses_per_update=run.train.mini_batch_prompts * run.rollout.group_size,
            max_sequence=run.rollout.max_prompt_tokens + run.rollout.max_response_tokens,
            recompute=run.model.recompute_activations,
            moe_dispatcher=run.model.moe_token_dispatcher,
            distributed_optimizer=True if dist_opt is None else bool(dist_opt),
            dtype_bytes=4 if run.model.dtype == "float32" else 2,
            log_prob_chunk_size=run.train.log_prob_chunk_size,
            colocated_rollout=run.rollout.engine == "vllm" and run.rollout.placement != "dedicated",
            rollout_placement=run.rollout.placement,
            rollout_tp=run.rollout.tensor_parallel_size,
            rollout_dtype_bytes=4 if run.rollout.dtype in ("float32", "float") else 2,
            gpu_memory_utilization=run.rollout.gpu_memory_utilization,
            kv_cache_memory_bytes=run.rollout.kv_cache_memory_bytes,
            max_num_seqs=run.rollout.max_num_seqs,
            offload_training_state=run.train.offload_training_state,
            sleep_mode=run.rollout.sleep_mode is not False,
            enforce_eager=bool(run.rollout.enforce_eager),
        )


@dataclass(frozen=True)
class Layout:
    """TP x PP x CP x DP; Megatron's rank order puts TP innermost (within a node).

    ``cp`` > 1 is for what-if estimates only: the trainer has no context parallelism, so
    ``dgpo-plan`` never proposes it."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int = 1
    """Expert parallel (MoE): each layer's experts split over e ranks of a stage."""
    etp: int | None = None
    """Expert TP u (MoE); None for a dense layout (then ``expert_tp`` is TP, as Megatron's
    default)."""

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def moe(self) -> bool:
        return self.etp is not None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """D_e = world / (p e u): the ranks holding the same experts (the expert grid
        ``etp-ep-edp`` decomposes each pipeline stage's t c D ranks again)."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    def __str__(self) -> str:
        dense = f"TP{self.tp} PP{self.pp} CP{self.cp} DP{self.dp}"
        return dense + (f" EP{self.ep} ETP{self.etp}" if self.moe else "")


TERMS = ("weights", "grads", "optimizer", "activations", "dispatch", "logits", "cache", "vllm",
         "graphs", "nccl", "overhead")
"""``Estimate``'s memory terms, in the order the table prints them."""


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
    nccl: int = 0
    """NCCL communicators' buffers (``nccl_bytes``): resident all job long."""
    graphs: int = 0
    """A sleeping engine's CUDA-graph pool: resident while training runs (awake, it is inside
    the vLLM reserve)."""
    cache: int = 0
    """The allocator's cached memory at training's peak (``allocator_cache_bytes``)."""
    dispatch: int = 0
    """The MoE token dispatcher's buffers of one layer (``dispatcher_bytes``); 0 when dense."""
    expert_params: int = 0
    """The routed-expert parameters among this GPU's (``stage_expert_params``)."""
    notes: list[str] = field(default_factory=list)
    vllm_sleeps: bool = False
    """vLLM is asleep while training runs: the peak holds max(vllm, activations + logits)."""
    engines: int = 0
    """vLLM engines in the job for this layout."""
    offloaded: bool = False
    """Gradients and optimizer state are off the GPU while vLLM is awake (only matters when it
    sleeps during training)."""
    communicators: list[str] = field(default_factory=list)
    """The NCCL communicators counted in ``nccl`` (``nccl_communicators``)."""

    @property
    def total(self) -> int:
        """weights + NCCL + overhead + the larger of the two phases when vLLM sleeps during
        training (training: grads + optimizer + activations + dispatch + logits + cache + the
        sleeping engine's graphs; rollout: vLLM, + grads + optimizer unless offloaded), else everything
        at once."""
        state = self.grads + self.optimizer
        training = self.activations + self.dispatch + self.logits + self.cache
        if self.vllm_sleeps:
            phases = max(state + training + self.graphs,
                         self.vllm + (0 if self.offloaded else state))
        else:
            phases = state + training + self.vllm
        return self.weights + self.nccl + phases + self.overhead

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def fits_with(self, headroom: float) -> bool:
        """total <= (1 - headroom) GPU memory."""
        return self.total <= (1.0 - headroom) * self.gpu_bytes

    def as_dict(self) -> dict:
        terms = {k: getattr(self, k) / GIB for k in TERMS}
        layout = asdict(self.layout)
        if not self.layout.moe:  # a dense layout has no expert grid
            del layout["ep"], layout["etp"]
        return dict(layout=layout, peak_stage=self.stage,
                    gib={**terms, "total": self.total / GIB, "gpu": self.gpu_bytes / GIB},
                    fits=self.fits, notes=list(self.notes), vllm_sleeps=self.vllm_sleeps,
                    offloaded=self.offloaded, engines=self.engines,
                    nccl_communicators=list(self.communicators))


def micro_batches_per_update(work: Workload, dp: int) -> int:
    """Upper bound of packed micro-batches per DP rank and update:
    ceil(ceil(responses / D) max_sequence / s) (every response at full length)."""
    per_rank = -(-work.responses_per_update // dp)
    return max(1, -(-per_rank * work.max_sequence // work.micro_batch_tokens))


def engine_tp(work: Workload, layout: Layout) -> int:
    """GPUs per vLLM engine for ``layout`` (``rollout.tensor_parallel_size`` resolved as the
    trainer does, ``rollout.placement.engine_tensor_parallel``)."""
    from megatron_dgpo.rollout.placement import engine_tensor_parallel

    return engine_tensor_parallel(work.rollout_tp, tensor_parallel=layout.tp,
                                  pipeline_parallel=layout.pp, data_parallel=layout.dp)


def engine_weight_bytes(arch: Architecture, work: Workload, engine_tp: int) -> int:
    """An engine's weights on each of its ``engine_tp`` GPUs: N b_r / t_r."""
    return param_count(arch) * work.rollout_dtype_bytes // engine_tp


def engine_reserve(arch: Architecture, cluster: Cluster, work: Workload, engine_tp: int
                   ) -> tuple[int, int, list[str]]:
    """vLLM's reserve on one GPU of an engine of ``engine_tp`` GPUs, wherever the engine lives
    (``vllm_bytes``), the weights' share of it (the rest is KV cache, activations, graphs) and
    ``vllm_bytes``' notes."""
    reserve, notes = vllm_bytes(arch, cluster, replace(work, colocated_rollout=True,
                                                       rollout_tp=engine_tp))
    return reserve, engine_weight_bytes(arch, work, engine_tp), notes


def dedicated_engines(cluster: Cluster, work: Workload) -> int:
    """E = ``rollout.num_gpus`` / ``rollout.tensor_parallel_size``: the dedicated engines."""
    return cluster.rollout_gpus // (work.rollout_tp or 1)


def dedicated_split_problem(cluster: Cluster, work: Workload, dp: int) -> str | None:
    """Why the trainer would refuse to share the dedicated engines out over ``dp`` replicas
    (``rollout.placement.DedicatedLayout``'s own check), None when it would not (or when there
    are no dedicated engines)."""
    from megatron_dgpo.rollout.placement import dedicated_split_problem as trainer_check

    return trainer_check(cluster.rollout_gpus, work.rollout_tp or 1, dp) if cluster.rollout_gpus \
        else None


def vllm_bytes(arch: Architecture, cluster: Cluster, work: Workload) -> tuple[int, list[str]]:
    """vLLM's share of one of its GPUs when colocated, and notes:

        kv_cache_memory_bytes set:  N b_r / t_r + kv_cache_memory_bytes
        otherwise:                  gpu_memory_utilization x GPU memory   (vLLM's own reserve)

    The KV cache that ``max_num_seqs`` full-length sequences need is
    max_num_seqs (prompt + response) kv_cache_bytes_per_token / t_r; when the reserve holds
    less, vLLM decodes fewer sequences at once (slower, not out of memory). When it holds
    less than one, vLLM does not start: the share is then counted as N b_r / t_r + one
    sequence's KV cache, the least that would run (an MoE engine holds every expert, so this
    is where a too-small engine TP shows). ``work.rollout_tp`` must be resolved (``engine_tp``).
    """
    if not work.colocated_rollout:
        return 0, []
    weights = engine_weight_bytes(arch, work, work.rollout_tp)
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
    if kv < per_seq:
        # vLLM refuses to start without room for one max-length sequence: count the least it
        # needs, so a layout "fits" only where a larger reserve would
        notes.append(f"vLLM: {how} leaves {max(kv, 0) / GIB:.1f} GiB for the KV cache after "
                     f"{weights / GIB:.1f} GiB of weights per GPU, less than one full-length "
                     f"sequence ({per_seq / GIB:.2f} GiB), so the engine would not start; counted "
                     f"at the {(weights + per_seq) / GIB:.1f} GiB it needs (raise "
                     f"gpu_memory_utilization / kv_cache_memory_bytes or "
                     f"rollout.tensor_parallel_size)")
        reserve = max(reserve, weights + per_seq)
    elif kv < needed:
        notes.append(f"vLLM: KV cache {kv / GIB:.1f} GiB holds ~{kv // per_seq} full-length "
                     f"sequences at once, not max_num_seqs={work.max_num_seqs} "
                     f"({needed / GIB:.1f} GiB)")
    return reserve, notes


def estimate(arch: Architecture, cluster: Cluster, layout: Layout, work: Workload) -> Estimate:
    """The peak GPU of ``layout``: the largest over pipeline stages k = 0 .. p-1 of weights +
    gradients + optimizer + activations + logits + allocator cache + vLLM (+ a sleeping
    engine's CUDA graphs) + NCCL + overhead (``Estimate.total``), where stage k holds
    min(p - k, micro-batches) micro-batches in flight (1F1B), stage 0 the embedding, the last
    stage the output layer and the logits. vLLM: colocated (the default), an engine of t_r GPUs
    in every rank, on every stage, asleep during training with ``sleep_mode`` (then the stage
    holds max(vLLM, activations + logits), not their sum); separate, the stages of global
    ranks 0 .. t_r - 1 (stage k holds ranks k world / p .. (k + 1) world / p - 1: PP is
    Megatron's outermost); dedicated, none (``dedicated_engine_estimate``), but stage 0 holds
    the refit link. An MoE model's layout carries EP e and expert TP u: the experts
    (``stage_expert_params``) have their optimizer state sharded over D_e, not D, and the
    dispatcher's buffers (``dispatcher_bytes``) join training's terms."""
    if arch.moe != layout.moe:
        raise ValueError(f"layout {layout} is {'an MoE' if layout.moe else 'a dense'} layout "
                         f"but {arch.name} is {'an MoE' if arch.moe else 'a dense'} model")
    t, p, c, d = layout.tp, layout.pp, layout.cp, layout.dp
    e, u = layout.ep, layout.expert_tp
    tokens = -(-work.micro_batch_tokens // c)
    rows = padded_vocab(arch.vocab, t)
    micro_batches = micro_batches_per_update(work, d)
    t_r = engine_tp(work, layout)
    work = replace(work, rollout_tp=t_r)
    vllm, vllm_notes = vllm_bytes(arch, cluster, work)
    gpus_per_stage = cluster.world // p
    colocated = work.colocated_rollout and work.rollout_placement == "colocated"
    sleeps = colocated and work.sleep_mode
    engines = (cluster.world // t_r if colocated else d if work.colocated_rollout else 0)

    def stage_estimate(stage: int) -> Estimate:
        params = stage_params(arch, t, p, stage, e, u)
        experts = stage_expert_params(arch, p, e, u)
        last = stage == p - 1
        has_vllm = work.colocated_rollout and (colocated or stage * gpus_per_stage < t_r)
        name = "only" if p == 1 else "first" if stage == 0 else "last" if last else f"{stage}"
        activations = activation_bytes(arch, tokens, arch.layers // p,
                                       min(p - stage, micro_batches), t, work.recompute,
                                       work.dtype_bytes, etp=u)
        dispatch = dispatcher_bytes(arch, tokens, t, e, u, work.moe_dispatcher, work.dtype_bytes)
        logits = (logits_bytes(tokens, rows, t, work.logits_dtype_bytes or work.dtype_bytes)
                  + logprob_workspace_bytes(tokens, rows, t, work.log_prob_chunk_size)
                  if last else 0)
        communicators = nccl_communicators(
            layout, tied=arch.tie_word_embeddings, engine_tp=t_r, has_engine=has_vllm,
            refit_link=work.rollout_placement == "dedicated" and stage == 0)
        return Estimate(
            layout=layout, stage=name,
            weights=weight_bytes(params, work.dtype_bytes),
            grads=grad_bytes(params, work.grad_dtype_bytes),
            # CP ranks hold the same weights: Megatron shards the optimizer over DP x CP;
            # expert DP already counts CP in
            optimizer=(optimizer_bytes(params - experts, d * c, work.distributed_optimizer)
                       + optimizer_bytes(experts, layout.expert_dp, work.distributed_optimizer)),
            activations=activations, dispatch=dispatch, expert_params=experts, logits=logits,
            vllm=vllm if has_vllm else 0,
            overhead=work.overhead_bytes, gpu_bytes=cluster.gpu_bytes,
            nccl=nccl_bytes(len(communicators), work.nccl_channels),
            graphs=(work.cuda_graph_bytes if has_vllm and sleeps and not work.enforce_eager
                    else 0),
            cache=allocator_cache_bytes(activations + dispatch + logits, work.allocator_slack),
            notes=list(vllm_notes) if has_vllm else [], vllm_sleeps=sleeps, engines=engines,
            offloaded=sleeps and work.offload_training_state, communicators=communicators)

    # ties go to the earlier stage (the one with vLLM and the most micro-batches in flight)
    peak = max((stage_estimate(k) for k in range(p)), key=lambda e: e.total)
    if c > 1:
        peak.notes.append("CP > 1 needs context parallelism in the trainer (not yet a "
                          "parallel.* field)")
    return peak


@dataclass
class EngineEstimate:
    """One GPU of a dedicated engine (``dedicated_engine_estimate``)."""

    engines: int
    engine_tp: int
    reserve: int
    """vLLM's reserve on each of its GPUs (``vllm_bytes``): weights, KV cache, activations,
    CUDA graphs, its CUDA context."""
    weights: int
    """The engine's weights per GPU, N b_r / t_r."""
    nccl: int
    """The engine's TP communicator and the refit link, beside vLLM's reserve."""
    gpu_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.reserve + self.nccl

    @property
    def kv_cache(self) -> int:
        return max(self.reserve - self.weights, 0)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def as_dict(self) -> dict:
        return dict(engines=self.engines, engine_tp=self.engine_tp,
                    gib=dict(reserve=self.reserve / GIB, weights=self.weights / GIB,
                             kv_cache=self.kv_cache / GIB, nccl=self.nccl / GIB,
                             total=self.total / GIB, gpu=self.gpu_bytes / GIB),
                    fits=self.fits, notes=list(self.notes))


def dedicated_engine_estimate(arch: Architecture, cluster: Cluster, work: Workload
                              ) -> EngineEstimate | None:
    """A dedicated engine's GPU (``rollout.placement: dedicated``): vLLM's reserve
    (``vllm_bytes``, engines of t_r = ``rollout.tensor_parallel_size`` GPUs, default 1) plus
    the NCCL buffers of its TP group (t_r > 1) and of the refit link; no training state. None
    unless the workload has dedicated engines."""
    if work.rollout_placement != "dedicated" or not cluster.rollout_gpus:
        return None
    t_r = work.rollout_tp or 1
    reserve, weights, notes = engine_reserve(arch, cluster, work, t_r)
    return EngineEstimate(
        engines=dedicated_engines(cluster, work), engine_tp=t_r, reserve=reserve, weights=weights,
        nccl=nccl_bytes(1 + int(t_r > 1), work.nccl_channels), gpu_bytes=cluster.gpu_bytes,
        notes=notes)
