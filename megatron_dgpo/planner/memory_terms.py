"""Per-GPU memory in bytes, term by term, as pure functions (notation: ``megatron_dgpo.planner``;
assumptions and sources: docs/planner.md), and the attention backend a plan's GPUs run."""

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
    """Gradient buffer: 4 N (an fp32 ``main_grad`` per local parameter, which the distributed
    optimizer does not shard); 2 N with 16-bit gradients."""
    return grad_dtype_bytes * params


def optimizer_bytes(params: int, dp: int, distributed: bool) -> int:
    """Adam with fp32 master weights: 12 N, divided by ``dp`` when ``distributed`` (pass D c:
    Megatron shards over DP x CP)."""
    return 12 * params // (dp if distributed else 1)


def activation_elements_per_token_layer(desc: ModelDescription, etp: int = 1) -> int:
    """Elements one layer saves for backward per token without recompute (flash or fused
    attention; whole, before TP sharding), u = ``etp``:

        dense: 4 h + 2 a d + 2 g d + 3 f        MoE: 4 h + 2 a d + 2 g d + k (u h + 3 f_e)

    plus a d + g d with q/k norms; routed counts at the balanced mean. The terms and what is left
    out: docs/planner.md#activations."""
    d = desc.dims
    attention = 2 * d.q_dim + 2 * d.kv_dim + (d.q_dim + d.kv_dim if desc.qk_norm else 0)
    mlp = d.topk * (etp * d.hidden + 3 * d.moe_ffn) if d.moe else 3 * d.ffn
    return 4 * d.hidden + attention + mlp


def activation_split(desc: ModelDescription, sequence_parallel: bool, etp: int = 1
                     ) -> tuple[int, int]:
    """``activation_elements_per_token_layer`` as (W, S), whole on every TP rank and sharded over
    TP: (0, E) with sequence parallelism, else (4 h, E - 4 h); MoE routed parts count as sharded."""
    total = activation_elements_per_token_layer(desc, etp)
    if sequence_parallel:
        return 0, total
    return 4 * desc.dims.hidden, total - 4 * desc.dims.hidden


def score_row(attention: str, tokens: int, max_sequence: int | None, tp: int) -> tuple[int, int]:
    """(b, S): the sequences of one packed row of ``tokens`` and the length each is padded to,
    as the attention backend's [s, s] tensors see them; (0, 0) for "flash" and "fused".

        unfused  S = min(tokens, max_sequence rounded up to pad_multiple(t)), b = ceil(tokens / S)
        local    S = tokens, b = 1          (docs/planner.md#attention-backend)"""
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
    """Whether Transformer-Engine 2.17.1's ``FusedScaleMaskSoftmax`` runs its CUDA kernel on
    [b, a/t, S, S] scores, ``batches`` = b a / t: 16-bit, 16 < S < 16384, S % 8 = 0, batches % 4
    = 0, S a multiple of the kernel's block; else torch's softmax in float32."""
    return (dtype_bytes == 2 and 16 < seq < 16384 and seq % 8 == 0 and batches % 4 == 0
            and seq % _softmax_block(seq) == 0)


def megatron_softmax_kernel(seq: int, batches: int, dtype_bytes: int, kernels: bool) -> bool:
    """Whether Megatron-Core's ``FusedScaleMaskSoftmax`` (the local spec) runs its CUDA kernel on
    [1, a/t, S, S] scores: ``kernels`` import, 16-bit, 16 < S <= 4096, S % 4 = 0, ``batches`` =
    a / t a multiple of 4 and of the kernel's block."""
    return (kernels and dtype_bytes == 2 and 16 < seq <= 4096 and seq % 4 == 0
            and batches % 4 == 0 and batches % _softmax_block(seq) == 0)


def score_layer_bytes(attention: str, rows: int, seq: int, heads: int, dtype_bytes: int = 2, *,
                      softmax_kernels: bool = GPU.softmax_kernels) -> tuple[int, int]:
    """(saved, live): bytes of one layer's [S, S] attention tensors on one GPU, n = b (a / t) S^2
    (``rows`` = b, ``seq`` = S, ``heads`` = a / t), b_e = ``dtype_bytes``; ``saved`` is kept for
    backward, ``live`` is all of the layer's while it runs; (0, 0) outside ``SCORE_BACKENDS``.

        unfused, CUDA kernel or fp32 scores:  (2 b_e n + b S^2, 3 b_e n + b S^2)
        unfused, torch's fp32 softmax:        ((4 + b_e) n + b S^2, (8 + 2 b_e) n + b S^2)
        local, CUDA kernel or fp32 scores:    (b_e n, 2 b_e n)
        local, torch's fp32 softmax:          ((4 + b_e) n, (8 + 2 b_e) n)

    Which tensors these are: docs/planner.md#attention-backend."""
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
    """The [S, S] attention tensors on one GPU (0 for "flash" and "fused"; ``tokens`` is the whole
    row), (b, S) = ``score_row``, (saved, live) = ``score_layer_bytes``, m = ``in_flight``:

        no recompute:    (m layers - 1) saved + live
        full recompute:  live
        local adds:      m S^2 + b_e (a / t) S^2     (row masks, Megatron's global score buffer)"""
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
    """Elements of Q, K, V per row and layer (whole over TP) that the [s, s] backends keep beyond
    E's a d + 2 g d per token: 3 a d b S - (a d + 2 g d) tokens (K and V repeated to every query
    head on [b, S] padded copies); 0 for the other backends."""
    if attention not in SCORE_BACKENDS:
        return 0
    rows, seq = score_row(attention, tokens, max_sequence, tp)
    d = desc.dims
    return 3 * d.q_dim * rows * seq - (d.q_dim + 2 * d.kv_dim) * tokens


def activation_bytes(desc: ModelDescription, tokens: int, layers: int, in_flight: int, tp: int,
                     recompute: bool, dtype_bytes: int = 2, *,
                     sequence_parallel: bool | None = None, etp: int = 1,
                     attention: str = "flash", max_sequence: int | None = None) -> int:
    """Activations kept for backward on one GPU, ``tokens`` = s / c per micro-batch, (W, S) =
    ``activation_split``, m = ``in_flight``, L / p = ``layers``, u = ``etp``, t' = t with sequence
    parallelism (default: the trainer's GPU rule, ``gpu_flags.sequence_parallel``), else 1:

        no recompute:   m (L / p) tokens (W + S / t) b
        full recompute: m (L / p) tokens h b / t' + tokens (W + S / t) b

    "unfused" and "local" add ``_attention_qkv_elements`` and ``attention_score_bytes``
    (``max_sequence``: the longest sample). Derivation: docs/planner.md#activations."""
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
    """The MoE token dispatcher's transient buffers of one layer on one GPU (0 for a dense model),
    T = tokens / t, u = ``etp``, e = ``ep``:

        alltoall, flex:  T k h b (1 + 2 u)          allgather:  T h b (u e + 2 u k)

    Where each copy comes from in Megatron-Core 0.16: docs/planner.md, the dispatch row."""
    if not desc.dims.moe:
        return 0
    local = -(-tokens // tp)
    if dispatcher == "allgather":
        copies = etp * ep + 2 * etp * desc.dims.topk
    else:
        copies = desc.dims.topk * (1 + 2 * etp)
    return local * desc.dims.hidden * dtype_bytes * copies


def logits_bytes(tokens: int, vocab_rows: int, tp: int, dtype_bytes: int = 2) -> int:
    """The logits shard and its gradient on the last stage: 2 tokens (V_pad / t) b_l, b_l =
    ``dtype_bytes`` (the trainer keeps the model's dtype: docs/planner.md, the logits row)."""
    return 2 * tokens * (vocab_rows // tp) * dtype_bytes


def logprob_workspace_bytes(tokens: int, vocab_rows: int, tp: int,
                            chunk_size: int | None) -> int:
    """The chunked log-prob kernel's two float32 [chunk, V_pad / t] buffers: 2 min(chunk, tokens)
    (V_pad / t) 4; ``chunk_size`` None: ``vocab_parallel.default_chunk_size`` on GPU."""
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
    """The NCCL communicators one trainer GPU of ``layout`` holds all job long, by name: TP, DP (DP
    x CP with CP), CP, PP, EP, expert-TP, expert-DP, model-parallel, embedding, world, vLLM TP and
    the refit link, each where the layout has it (docs/planner.md, the nccl row)."""
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
    """NCCL's buffers on one GPU: communicators x ``channels`` x ``NCCL_CHANNEL_BYTES`` (one
    connection per channel; why, and what is not counted: docs/planner.md, the nccl row)."""
    return communicators * channels * NCCL_CHANNEL_BYTES


def allocator_cache_bytes(dynamic: int, slack: float) -> int:
    """The caching allocator's blocks beyond the live tensors at training's peak: ``slack`` x
    ``dynamic`` (activations + dispatch + logits; docs/planner.md, the cache row)."""
    return int(slack * dynamic)


def engine_weight_bytes(desc: ModelDescription, work: Workload, engine_tp: int) -> int:
    """An engine's weights on each of its ``engine_tp`` GPUs: N b_r / t_r."""
    return param_count(desc) * work.rollout_dtype_bytes // engine_tp


def engine_reserve(desc: ModelDescription, cluster: Cluster, work: Workload, engine_tp: int
                   ) -> tuple[int, int, list[str]]:
    """``vllm_bytes``' reserve on one GPU of an engine of ``engine_tp`` GPUs wherever it lives, the
    weights' share of it (the rest: KV cache, activations, graphs) and the notes."""
    reserve, notes = vllm_bytes(desc, cluster, replace(work, colocated_rollout=True,
                                                       rollout_tp=engine_tp))
    return reserve, engine_weight_bytes(desc, work, engine_tp), notes


def vllm_bytes(desc: ModelDescription, cluster: Cluster, work: Workload) -> tuple[int, list[str]]:
    """vLLM's share of one of its GPUs when colocated (0 otherwise), and notes; ``work.rollout_tp``
    resolved (``engine_tp``):

        kv_cache_memory_bytes set:  N b_r / t_r + kv_cache_memory_bytes
        otherwise:                  gpu_memory_utilization x GPU memory

    but at least N b_r / t_r + one full-length sequence's KV cache, the least vLLM starts with."""
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
    """The image's stack (``gpu_flags.GPU``) on a GPU named ``device_name`` of ``capability`` with
    the FlashAttention ``flash_attn`` names (``FLASH_ATTN_SOURCES``), as ``flash_attention_status``
    judges it. Raises ``ValueError`` naming ``--flash-attn`` otherwise."""
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
    """``work`` with ``attention`` set to the backend the trainer runs on ``platform``
    (``gpu_flags.attention_backend``; no ``NVTE_*`` variable set). Raises its ``ValueError`` where
    the recipe's backend cannot run there."""
    import torch  # the dtype attention_backend compares; the planner's modules stay torch-free

    dtype = torch.float32 if work.dtype_bytes == 4 else torch.bfloat16
    backend = attention_backend(platform, work.attention_backend, dtype=dtype,
                                without_transformer_engine=work.without_transformer_engine,
                                environ={})
    return replace(work, attention=backend)
