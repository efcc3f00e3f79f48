"""Per-GPU memory, term by term, as pure functions: weights, gradients, optimizer state,
activations (with the [s, s] tensors of the attention backends that have them), the MoE
dispatcher's buffers, logits and the log-prob kernel's workspace, NCCL's buffers, the
allocator's cache, and vLLM's reserve on an engine's GPUs; and which attention backend a plan's
GPUs run (``planned_platform``, ``resolve_attention``: the trainer's own rule).

Each function's docstring states its formula (notation: ``megatron_dgpo.planner``);
``docs/planner.md`` collects them with their assumptions and the published figures they were
checked against. ``megatron_dgpo.planner.peak`` adds them up for a layout's GPUs.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_dgpo.models import ModelDescription
from megatron_dgpo.planner.inputs import GIB, Cluster, Layout, Workload
from megatron_dgpo.planner.parameters import param_count
from megatron_dgpo.runtime.config import require_choice
from megatron_dgpo.runtime.gpu_flags import (FLASH_ATTN_PIN, GPU, Platform, attention_backend,
                                             flash_attention_status, pad_multiple)
# the installed distribution's version, as Transformer-Engine reads it (private in gpu_flags)
from megatron_dgpo.runtime.gpu_flags import distribution_version
from megatron_dgpo.runtime.gpu_flags import sequence_parallel as gpu_sequence_parallel

SCORE_BACKENDS = ("unfused", "local")
"""The attention backends with [s, s] tensors per layer (``attention_score_bytes``); "flash" and
"fused" keep activations linear in tokens."""


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


def activation_elements_per_token_layer(desc: ModelDescription, etp: int = 1) -> int:
    """Elements one layer saves for backward per token, without recompute (flash or cuDNN
    fused attention, no dropout, SwiGLU, RMSNorm; whole, before any TP sharding):

        h [attn norm input] + h [QKV input] + a d [Q] + 2 g d [K, V] + a d [attention out = proj
        input] + h [MLP norm input] + h [fc1 input] + 2 f [fc1 out = SwiGLU input] + f [fc2 in]
        = 4 h + 2 a d + 2 g d + 3 f   (= 6 h + 2 g d + 3 f when a d = h)

    Qwen3's q/k norms add their inputs, a d + g d. An MoE layer has no dense MLP: its h [fc1
    input] is the router's input, and each token's k routed copies keep, per expert TP group
    of u ranks, k (u h [the expert's gathered fc1 input] + 3 f_e [fc1 out, fc2 in])
    (``SequentialMLP`` / ``TEGroupedMLP`` with the probabilities applied in the activation):

        MoE: 4 h + 2 a d + 2 g d + k (u h + 3 f_e)

    Routed counts are the balanced mean (T k tokens per EP rank); without the load-balancing
    loss a hot expert's rank receives more. Left out (< 1%): the attention's softmax statistics,
    a fp32 floats per token (flash-attn 2's varlen ``softmax_lse`` [a, tokens], cuDNN's ragged
    THD stats [tokens, a, 1] from cuDNN 9.6: 4 a bytes, 0.1% of the 14B model's E b), the
    router's fp32 scores (E per token) and RoPE tables. The backends with [s, s] tensors
    change the Q, K, V part (``activation_bytes``).
    """
    d = desc.dims
    attention = 2 * d.q_dim + 2 * d.kv_dim + (d.q_dim + d.kv_dim if desc.qk_norm else 0)
    mlp = d.topk * (etp * d.hidden + 3 * d.moe_ffn) if d.moe else 3 * d.ffn
    return 4 * d.hidden + attention + mlp


def activation_split(desc: ModelDescription, sequence_parallel: bool, etp: int = 1
                     ) -> tuple[int, int]:
    """``activation_elements_per_token_layer`` as (whole on every TP rank, sharded over TP):

        sequence parallel:  (0, E)                    every saved tensor is sharded
        without it:         (4 h, E - 4 h)            the two norm inputs and the QKV and fc1
                                                      (router) inputs are whole

    An MoE layer's routed part counts as sharded: each rank routes its own s / t tokens
    (Megatron needs sequence parallelism for MoE with TP > 1).
    """
    total = activation_elements_per_token_layer(desc, etp)
    if sequence_parallel:
        return 0, total
    return 4 * desc.dims.hidden, total - 4 * desc.dims.hidden


def score_row(attention: str, tokens: int, max_sequence: int | None, tp: int) -> tuple[int, int]:
    """(b, S): the sequences of one packed row of ``tokens`` tokens and the length each is
    padded to, as the attention backend's [s, s] tensors see them; (0, 0) for "flash" and
    "fused", which have none.

        unfused  S = min(tokens, max_sequence rounded up to pad_multiple(t)), b = ceil(tokens / S)
        local    S = tokens, b = 1

    Transformer-Engine's ``UnfusedDotProductAttention`` converts the packed (THD) row to
    [b, S, ...] with every sequence padded to the row's longest (``ConvertTHDtoBSHD``); the
    planner's row is full of sequences of the longest length a sample can have (the last one
    padded). A row of one long and n short samples costs (n + 1) S^2 all the same, which can be
    more: leave headroom, or keep such rows short. Megatron's local spec
    takes no packed rows: the trainer gives it the whole row, one [S, S] problem with a
    block-diagonal causal mask (``packing.block_causal_mask``), worst at a full row.
    """
    if attention == "local":
        return 1, tokens
    if attention != "unfused":
        return 0, 0
    pad = pad_multiple(tp)
    longest = tokens if max_sequence is None else -(-max_sequence // pad) * pad
    seq = min(tokens, longest)
    return -(-tokens // seq), seq


def _softmax_block(keys: int) -> int:
    """Rows per CUDA block of the scaled (masked) softmax kernels, ``get_batch_per_block``
    (the same in Transformer-Engine and Megatron's ``scaled_masked_softmax_cuda``)."""
    pow2 = 1 << (keys - 1).bit_length()
    warp = min(pow2, 32)
    return (128 // warp) * (2 if pow2 <= 128 else 1)


def te_softmax_kernel(seq: int, batches: int, dtype_bytes: int) -> bool:
    """Whether Transformer-Engine 2.17.1's ``FusedScaleMaskSoftmax`` (unfused attention, a
    padding_causal mask) runs its CUDA kernel on [b, a/t, S, S] scores, ``batches`` = b a / t
    (``is_kernel_available``): 16-bit scores, 16 < S < 16384, S a multiple of 8, batches of 4,
    S a multiple of the kernel's block. Otherwise it runs torch's softmax in float32."""
    return (dtype_bytes == 2 and 16 < seq < 16384 and seq % 8 == 0 and batches % 4 == 0
            and seq % _softmax_block(seq) == 0)


def megatron_softmax_kernel(seq: int, batches: int, dtype_bytes: int, kernels: bool) -> bool:
    """Whether Megatron-Core's ``FusedScaleMaskSoftmax`` (the local spec's attention, causal)
    runs its CUDA kernel on [1, a/t, S, S] scores (``is_kernel_available``): the compiled
    kernels import (``kernels``: ``masked_softmax_fusion``), 16-bit scores, 16 < S <= 4096,
    S a multiple of 4, batches = a / t a multiple of 4 and of the kernel's block."""
    return (kernels and dtype_bytes == 2 and 16 < seq <= 4096 and seq % 4 == 0
            and batches % 4 == 0 and batches % _softmax_block(seq) == 0)


def score_layer_bytes(attention: str, rows: int, seq: int, heads: int, dtype_bytes: int = 2, *,
                      softmax_kernels: bool = GPU.softmax_kernels) -> tuple[int, int]:
    """(saved, live): bytes of one layer's [S, S] attention tensors on one GPU, with n = b
    (a / t) S^2 score elements (``rows`` = b sequences padded to ``seq`` = S, ``heads`` = a / t:
    sequence parallelism gathers the whole row, each TP rank has its heads), b_e =
    ``dtype_bytes``. ``saved``: kept for backward until the layer's backward ran; ``live``:
    everything of the layer at once while it runs (``saved`` included).

    unfused (Transformer-Engine 2.17.1 ``UnfusedDotProductAttention.forward``, THD):
        scores [b a/t, S, S] b_e (``torch.baddbmm`` into a fresh tensor; kept by ``forward``
        until it returns), the full padding-causal mask [b, 1, S, S] bool (``get_full_mask``;
        saved by the mask fills), the softmax's probabilities, and the probabilities with the
        padding rows zeroed (``masked_fill``, out of place), which ``torch.bmm`` saves:
          CUDA softmax kernel (``te_softmax_kernel``), or float32 scores:
              saved = 2 b_e n + b S^2          [probabilities, masked ones; mask]
              live  = 3 b_e n + b S^2          [+ scores]
          16-bit scores, torch's softmax (``softmax_in_fp32``; S >= 16384 always):
              saved = (4 + b_e) n + b S^2      [fp32 probabilities, masked b_e ones; mask]
              live  = (8 + 2 b_e) n + b S^2    [+ scores, their fp32 copy, the b_e cast]
    local (Megatron-Core's ``DotProductAttention``, b = 1, causal softmax with the row's mask):
          CUDA kernel (``megatron_softmax_kernel``), or float32 scores:
              saved = b_e n                    [probabilities]
              live  = 2 b_e n                  [+ scores]
          16-bit scores, torch's softmax (``attention_softmax_in_fp32``; S > 4096 always):
              saved = (4 + b_e) n              [fp32 probabilities, their b_e cast]
              live  = (8 + 2 b_e) n            [+ scores, their fp32 copy]
        (the row's mask and Megatron's global score buffer are per micro-batch and per GPU:
        ``attention_score_bytes``)

    Backward holds as much: the layer's saved tensors and their gradients (one [S, S]
    gradient per saved tensor at a time, the fp32 ones in fp32), and the gradients' chain
    frees each as it goes. Attention dropout is 0 (every catalogue model's
    ``attention_dropout``; a dropout mask would add b a/t S^2 bytes)."""
    if attention not in SCORE_BACKENDS:
        return 0, 0
    n = rows * heads * seq * seq
    half = dtype_bytes < 4
    if attention == "unfused":
        mask = rows * seq * seq
        if half and not te_softmax_kernel(seq, rows * heads, dtype_bytes):
            return (4 + dtype_bytes) * n + mask, (8 + 2 * dtype_bytes) * n + mask
        return 2 * dtype_bytes * n + mask, 3 * dtype_bytes * n + mask
    if half and not megatron_softmax_kernel(seq, heads, dtype_bytes, softmax_kernels):
        return (4 + dtype_bytes) * n, (8 + 2 * dtype_bytes) * n
    return dtype_bytes * n, 2 * dtype_bytes * n


def attention_score_bytes(desc: ModelDescription, attention: str, tokens: int, layers: int,
                          in_flight: int, tp: int, recompute: bool, dtype_bytes: int = 2, *,
                          max_sequence: int | None = None,
                          softmax_kernels: bool = GPU.softmax_kernels) -> int:
    """The [S, S] attention tensors on one GPU (0 for "flash" and "fused"), with (b, S) =
    ``score_row``, (saved, live) = ``score_layer_bytes`` of one layer, m = ``in_flight``
    micro-batches, L / p = ``layers``:

        no recompute:    (m L / p - 1) saved + live    every earlier layer's saved tensors
                                                       while the last one runs (its forward,
                                                       or the first backward)
        full recompute:  live                          one layer at a time: the checkpointed
                                                       forward keeps nothing, the recomputed
                                                       one its own until its backward ran
        local, either:   + m S^2 + b_e (a / t) S^2     each micro-batch's [1, 1, S, S] bool
                                                       row mask (every layer's mask fill saves
                                                       it), and Megatron's global buffer
                                                       (``torch.baddbmm``'s beta = 0 input),
                                                       kept for good

    Neither backend has context parallelism (TE's backend selection disables the unfused one
    with it, the local spec asserts c = 1): ``tokens`` is taken as the whole row."""
    if attention not in SCORE_BACKENDS:
        return 0
    rows, seq = score_row(attention, tokens, max_sequence, tp)
    heads = desc.dims.heads // tp
    saved, live = score_layer_bytes(attention, rows, seq, heads, dtype_bytes,
                                    softmax_kernels=softmax_kernels)
    held = live if recompute else (in_flight * layers - 1) * saved + live
    if attention == "local":
        held += in_flight * seq * seq + dtype_bytes * heads * seq * seq
    return held


def _attention_qkv_elements(desc: ModelDescription, attention: str, tokens: int,
                            max_sequence: int | None, tp: int) -> int:
    """What the backends with [s, s] tensors keep of Q, K, V per row and layer (whole over TP)
    beyond E's a d + 2 g d per token: they compute on [b, S] padded copies with K and V
    repeated to every query head (``repeat_interleave``; ``torch.baddbmm`` saves Q and K,
    ``torch.bmm`` V), 3 a d per padded token: 3 a d b S - (a d + 2 g d) tokens. The
    flash-attention path's THD Q, K, V are then saved by nobody (the fused RoPE keeps only
    its tables)."""
    if attention not in SCORE_BACKENDS:
        return 0
    rows, seq = score_row(attention, tokens, max_sequence, tp)
    d = desc.dims
    return 3 * d.q_dim * rows * seq - (d.q_dim + 2 * d.kv_dim) * tokens


def activation_bytes(desc: ModelDescription, tokens: int, layers: int, in_flight: int, tp: int,
                     recompute: bool, dtype_bytes: int = 2, *,
                     sequence_parallel: bool | None = None, etp: int = 1,
                     attention: str = "flash", max_sequence: int | None = None) -> int:
    """Activations kept for backward on one GPU, ``tokens`` = s / c per micro-batch, with
    (W, S) = ``activation_split`` (W = 0, S = E with sequence parallelism; W = 4 h without):

        no recompute:   in_flight  layers  tokens  (W + S / t) b
        full recompute: in_flight  layers  tokens  h b / t'     [each layer's input]
                        +          tokens  (W + S / t) b        [the one layer being recomputed]

    t' = t with sequence parallelism (the layer inputs are sharded along the sequence), 1
    without. ``sequence_parallel`` defaults to what the trainer runs on a GPU
    (``gpu_flags.sequence_parallel``: on whenever t > 1 with Transformer-Engine; off with the
    local spec, ``attention="local"``). ``in_flight`` micro-batches are alive at once (1F1B: up
    to p on stage 0, 1 on the last stage). ``etp``: expert TP u of an MoE model.

    ``attention`` (``Workload.attention``): "flash" and "fused" as above. "unfused" and
    "local" add, per micro-batch and layer kept, their padded Q, K, V (``score_row``'s b S
    tokens, 3 a d each, for E's a d + 2 g d per token, sharded over TP like them) and their
    [S, S] tensors, ``attention_score_bytes`` (``max_sequence``: the longest sample).
    """
    if sequence_parallel is None:
        platform = replace(GPU, transformer_engine=False) if attention == "local" else GPU
        sequence_parallel = gpu_sequence_parallel(tp, platform)
    whole, sharded = activation_split(desc, sequence_parallel, etp)
    padded = _attention_qkv_elements(desc, attention, tokens, max_sequence, tp)

    def one_layer(count: int) -> int:  # bytes of `count` token-layers' full activations
        return count * whole * dtype_bytes + count * sharded * dtype_bytes // tp

    def padding(rows: int) -> int:  # bytes of `rows` row-layers' padded Q, K, V beyond E's
        return rows * padded * dtype_bytes // tp

    scores = attention_score_bytes(desc, attention, tokens, layers, in_flight, tp, recompute,
                                   dtype_bytes, max_sequence=max_sequence)
    if not recompute:
        return one_layer(in_flight * layers * tokens) + padding(in_flight * layers) + scores
    shard = tp if sequence_parallel else 1
    checkpoints = in_flight * layers * tokens * desc.dims.hidden * dtype_bytes // shard
    return checkpoints + one_layer(tokens) + padding(1) + scores


def dispatcher_bytes(desc: ModelDescription, tokens: int, tp: int, ep: int, etp: int,
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
    if not desc.dims.moe:
        return 0
    local = -(-tokens // tp)
    if dispatcher == "allgather":
        copies = etp * ep + 2 * etp * desc.dims.topk
    else:
        copies = desc.dims.topk * (1 + 2 * etp)
    return local * desc.dims.hidden * dtype_bytes * copies


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
    from megatron_dgpo.algorithm.vocab_parallel import default_chunk_size

    local = vocab_rows // tp
    chunk = chunk_size or default_chunk_size(local, "cuda")
    return 2 * min(chunk, tokens) * local * 4


def kv_cache_bytes_per_token(desc: ModelDescription, dtype_bytes: int = 2) -> int:
    """vLLM's KV cache per token (all layers, whole model): 2 [K, V] L g d b."""
    return 2 * desc.dims.layers * desc.dims.kv_dim * dtype_bytes


NCCL_CHANNEL_BYTES = (4 << 20) + 4_915_200 + (1 << 19)
"""One NCCL channel's buffers for one connection with NCCL's default sizes: Simple
``NCCL_BUFFSIZE`` 4 MiB + LL128 4,915,200 bytes (120 x 640 threads x 8 steps x 8 bytes) + LL
512 KiB (8 lines x 512 threads x 8 steps x 16 bytes) = 9.19 MiB."""


def nccl_communicators(layout: "Layout", *, tied: bool, engine_tp: int, has_engine: bool,
                       refit_link: bool = False) -> list[str]:
    """The NCCL communicators one trainer GPU holds for the whole job (NCCL creates a
    communicator at a group's first collective and keeps it):

        TP [t > 1]  DP [D > 1: gradient reduce-scatter, parameter all-gather; with CP c > 1 the
        distributed optimizer's group is DP x CP, D c > 1]  CP [c > 1: the attention's K/V
        ring, Transformer-Engine's p2p exchange]
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
    t, p, d, c = layout.tp, layout.pp, layout.dp, layout.cp
    dp_group = ("DP x CP", d * c > 1) if c > 1 else ("DP", d > 1)
    named = [("TP", t > 1), dp_group, ("CP", c > 1), ("PP", p > 1),
             ("model-parallel", t * p > 1), ("embedding", p > 1 and tied),
             ("world", t * p * c * d > 1),
             ("vLLM TP", has_engine and engine_tp > 1), ("refit link", refit_link)]
    if layout.moe:  # Megatron's expert grid: EP (token all-to-all), expert TP, expert DP
        u, e = layout.expert_tp, layout.ep
        named[4:4] = [("EP", e > 1), ("expert-TP", u > 1), ("expert-DP", layout.expert_dp > 1)]
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


def engine_weight_bytes(desc: ModelDescription, work: Workload, engine_tp: int) -> int:
    """An engine's weights on each of its ``engine_tp`` GPUs: N b_r / t_r."""
    return param_count(desc) * work.rollout_dtype_bytes // engine_tp


def engine_reserve(desc: ModelDescription, cluster: Cluster, work: Workload, engine_tp: int
                   ) -> tuple[int, int, list[str]]:
    """vLLM's reserve on one GPU of an engine of ``engine_tp`` GPUs, wherever the engine lives
    (``vllm_bytes``), the weights' share of it (the rest is KV cache, activations, graphs) and
    ``vllm_bytes``' notes."""
    reserve, notes = vllm_bytes(desc, cluster, replace(work, colocated_rollout=True,
                                                       rollout_tp=engine_tp))
    return reserve, engine_weight_bytes(desc, work, engine_tp), notes


def vllm_bytes(desc: ModelDescription, cluster: Cluster, work: Workload) -> tuple[int, list[str]]:
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
    weights = engine_weight_bytes(desc, work, work.rollout_tp)
    per_seq = work.max_sequence * kv_cache_bytes_per_token(desc, work.rollout_dtype_bytes) \
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


FLASH_ATTN_SOURCES = {
    "image": "the pinned image's",
    "here": "installed where dgpo-plan runs",
    "none": "none on the cluster",
}
"""``dgpo-plan --flash-attn``: which flash-attn the plan's GPUs have (``planned_platform``)."""


def planned_platform(device_name: str, capability: tuple[int, int] | None,
                     flash_attn: str = "image") -> Platform:
    """The GPU platform a plan assumes: the pinned image's stack (``gpu_flags.GPU``:
    Transformer-Engine 2.17.1, cuDNN 9.20, apex and Megatron's kernels) on a GPU named
    ``device_name`` of ``capability``, with the flash-attn ``flash_attn`` says
    (``FLASH_ATTN_SOURCES``), judged as Transformer-Engine judges it
    (``gpu_flags.flash_attention_status``):

        image  flash-attn ``gpu_flags.FLASH_ATTN_PIN`` (2.8.3), the image's
        here   the flash-attn and flash-attn-3 installed in this Python environment, by their
               distributions' versions as TE reads them (run it in the cluster's environment)
        none   no flash-attn (a cluster built without it)

    Only FlashAttention varies: the rest of the stack is the image's whatever the choice."""
    require_choice("--flash-attn", flash_attn, tuple(FLASH_ATTN_SOURCES))
    versions = {"image": (FLASH_ATTN_PIN, None), "none": (None, None),
                "here": (distribution_version("flash-attn"),
                         distribution_version("flash-attn-3"))}[flash_attn]
    found, why_not = flash_attention_status(versions[0], capability, flash_attn_3=versions[1])
    return replace(GPU, compute_capability=capability, device_name=device_name,
                   flash_attention=found, flash_attention_error=why_not)


def attention_basis(platform: Platform, flash_attn: str) -> str:
    """The GPU and FlashAttention a plan's backend was decided on, for the report."""
    flash = platform.flash_attention or f"no FlashAttention: {platform.flash_attention_error}"
    return f"{platform.gpu}, {flash} (--flash-attn {flash_attn}: {FLASH_ATTN_SOURCES[flash_attn]})"


def resolve_attention(work: Workload, platform: Platform) -> Workload:
    """``work`` with ``attention`` set to the backend the trainer would run on ``platform``
    (``planned_platform``): ``gpu_flags.attention_backend`` itself, on the recipe's
    ``model.attention_backend``, ``model.without_transformer_engine`` and ``model.dtype``.
    Raises its ``ValueError``, the trainer's start-up refusal with the fix, where the recipe's
    backend cannot run there. The cluster's ``NVTE_*`` variables are not known here: none
    count as set."""
    import torch  # the dtype attention_backend compares; the planner's modules stay torch-free

    dtype = torch.float32 if work.dtype_bytes == 4 else torch.bfloat16
    backend = attention_backend(platform, work.attention_backend, dtype=dtype,
                                without_transformer_engine=work.without_transformer_engine,
                                environ={})
    return replace(work, attention=backend)
