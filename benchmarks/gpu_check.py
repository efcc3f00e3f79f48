"""The acceptance test of a CUDA node: the GPU path checked in one command on one 80 GB GPU
(under 10 minutes; two more runs with 2 GPUs).

    python benchmarks/gpu_check.py [--out benchmarks/results] [--only NAME ...]

Prints one row per check and writes ``<out>/gpu_check.md`` and ``<out>/gpu_check.json``
(device, versions, the components found, every number). Each check is its own function; one
that raises is reported as an error row and the others still run. Each check declares what it
needs beyond torch, megatron-core and one CUDA GPU (``NEEDS``: Transformer-Engine ``TE``,
``vLLM``, ``apex``, ``2 GPUs``; found by ``available_components``); where that is missing its
row says "not run: needs ..." (no pass mark) and the check is not called. With only torch and
megatron-core installed the checks marked "needs nothing" still run, the trainer included.
Exit status 1 if a check failed, else 0. Without CUDA it prints one line saying it skipped and
exits 0 (the CPU test suite runs it that way), unless this is a GPU node whose CUDA does not
start (NVIDIA device files, ``torch.cuda.is_available()`` False: the wrong driver for torch's
CUDA, a CPU torch): then it fails with torch's reason (``gpu_flags.require_usable_cuda``).

Checks (one GPU, a world of one rank, TP = PP = DP = 1, but the 2-GPU torchrun runs at the end):

* ``attention_choice`` (needs nothing: the decision is a function of the GPU's generation,
  cuDNN and flash-attn, evaluated as if TE were installed where it is not): the trainer's
  attention backend for packed rows (``gpu_flags.attention_backend``) is cuDNN fused on sm90 and
  newer, FlashAttention on sm80/86/89 and under ``--profile a100`` (whose flash-attn must be
  built for this GPU: the image builds sm80, sm90 and sm100); where that needs flash-attn and it
  is missing, the row fails with the trainer's refusal (this node cannot train). The same GPU
  without flash-attn (a stand-in ``Platform``) is refused naming flash-attn 2.8.3 when cuDNN
  attention is off, and float32 is refused (TE's only float32 backend is the dense unfused one).
* ``te_attention_selected`` (needs TE): the trainer's TE model (its ``attention_overrides``) on a
  packed row, forward and backward: the backend TE itself selected (its
  ``_attention_backends`` record) is the trainer's choice, never the unfused one.
* ``packed_attention_memory`` (needs TE): peak extra memory of forward + backward of packed rows
  of 8 sequences of 1024 and of 2048 tokens: the ratio must be linear in tokens (<= 2.5; dense
  [s, s] scores would make it about 3 on this model, the estimate is reported beside it).
* ``trainer_refuses_unfused`` (needs TE): ``python -m megatron_dgpo.train recipes/tiny_gpu.yaml``
  with ``NVTE_FUSED_ATTN=0 NVTE_FLASH_ATTN=0`` (no backend but the unfused one): it exits
  non-zero at start-up with the refusal, before any metrics line (no generation ran).
* ``te_thd_bf16`` (needs TE): the Transformer-Engine layer spec (the trainer's attention
  backend) with a packed row as THD ``PackedSeqParams`` (fused RoPE where TE has it) against Megatron's local spec with a
  block-diagonal causal mask, same weights, same packed row: log-probs and parameter gradients
  of sum_t w_t log p_t, each compared with the fp32 local model; TE's error must be within 2x
  (+ 1e-3) the local bf16 path's own error (bf16 rounding, not the attention kernel, sets the
  tolerance). TE's flash and cuDNN attention take fp16/bf16 only (its float32 backend is the
  dense unfused one, which the trainer refuses), so there is no fp32 TE run.
* ``logprobs_v152064`` (needs nothing): ``vocab_parallel.logprobs_and_entropy`` forward +
  backward (the gradient of sum_t w_t log p_t, and with ``entropy_grad=True`` of
  + sum_t w_t H_t) on bf16 logits [8192, 152064], its compiled kernels (``kernel="compiled"``,
  the default where ``compiled_by_default``: CUDA with Triton) and its eager ones, beside
  Megatron's ``vocab_parallel_cross_entropy`` (log-probs only) in the same run: time in
  multiples of one read of the logits and peak extra memory in multiples of the logits (the
  gradient w.r.t. them, itself 1.0x, included). Goal for the compiled kernels, entropy gradient
  off and on: <= 8x one read, <= 1.2x; the log-probs (<= 1e-3) and the gradient (<= 1e-2, bf16)
  against float32 ``log_softmax`` autograd on 256 rows. The first compiled calls (compiling)
  are timed apart.
* ``distopt_checkpoint`` (needs nothing: TE's layer spec where TE imports, the local spec
  otherwise): the trainer's bf16 policy (``policy.wrap_policy``: Float16Module, Megatron DDP
  with ``gpu_flags.ddp_flags``: overlapped grad reduce and param gather) and the distributed
  optimizer; one ``train_step`` update, an async dist-checkpoint save in each sharding type
  (``checkpoint.optimizer_sharding``; ``checkpoint.AsyncSaver``, Megatron's real queue, its
  writer started before the save); a fresh model loaded from the checkpoint holds the saved
  parameters bitwise (a copy), and its next update agrees with the live model's within 10% of
  the update's size (a tolerance, not equality: FlashAttention's backward accumulates with
  atomics, so GPU updates are not bitwise reproducible); the save is not published before its
  writer finished.
* ``throughput_1p5b`` (needs TE and apex: its goal is for the stack the recipes assume, and
  without TE the local spec's dense [S, S] masks and scores of an 8192-token row ran out of
  memory on a 139 GiB GPU): a DeepSeek-R1-Distill-Qwen-1.5B-shaped Qwen2 (random bf16 weights,
  the trainer's policy and GPU flags, TE + THD) ``train_step`` (forward + DGPO loss + backward
  + gradient reduction) on one packed 8192-token row of unequal samples: tokens/s and MFU
  (model FLOPs, recompute not counted), recompute off and on. Goal on H100: MFU >= 45% without
  recompute.
* ``vllm_colocated`` (needs vLLM; the trainer's side takes the local spec without TE): CUDA
  vLLM (bf16, ``placement="colocated"``: inside this process, on the trainer's GPU, sleep mode)
  beside the trainer's policy: generate -> ``sleep()`` -> one ``train_step`` update -> refit
  (``update_weights`` wakes it; ``export_hf_groups``) -> generate -> the rollout vs trainer
  log-prob mismatch (``algorithm.mismatch``: mean |d|, exp(mean |d|) - 1), before and after the
  update. The refit worked if the mismatch after it is not larger than before (x3): a stale
  engine would be off by a 2e-3 learning-rate update. The engine must draw seeded requests'
  noise counter-based (Model Runner V2: ``rollout.vllm_engine.seeded_draw``) and run its
  all-reduces on NCCL only (``rollout.vllm_engine.engine_env`` applied before it started).
* ``seeded_sampling_v152064`` (needs vLLM): one decode step's sampling draw for 1024 requests
  over vocabulary 152064 (benchmarks/bench_sampling.py): Model Runner V2's draw with every
  request seeded, goal within 1.5x of V1's batched unseeded draw; V1's per-request seeded draw
  reported beside them (8.9 ms against 0.88 ms on an H200: benchmarks/README.md).
* ``tiny_gpu_stop_resume`` (needs nothing): ``python -m megatron_dgpo.train
  recipes/tiny_gpu.yaml`` (scheduled saves off), SIGTERM once its first metrics line is
  written: exit ``interrupt.EXIT_STOPPED`` (75), the step in flight saved as the checkpoint
  ``latest`` names, no HF export; then the same command again: it resumes, the metrics lines
  continue to step 5, the final checkpoint and the HF export are written.
* ``tiny_gpu_run`` (needs nothing): the same recipe for its 5 steps uninterrupted: 5 metric
  lines, the last checkpoint published by the async saver, the HF export.
* ``context_parallel`` (needs TE and 2 GPUs): the trainer's bf16 policy under torchrun on 2
  GPUs, once at CP = 1 (DP = 2, both ranks the same packed row) and once at
  ``parallel.context_parallel`` = 2 (TE's context-parallel attention, ``cp_comm_type`` p2p, the
  row's zigzag THD shards): ``forward_logprobs`` (whole rows) and one ``train_step``'s loss and
  gradients of the CP run agree with the CP = 1 run (bf16: log-probs within 5e-2, loss within
  1e-2 relative, every gradient within 5e-2 of its largest entry).
* ``tiny_gpu_tp2``, ``tiny_gpu_dp2`` (need 2 GPUs): the same under torchrun on 2 GPUs at
  TP = 2 and at DP = 2 (NCCL groups: where a CPU tensor in a reduction or a pickled CUDA tensor
  in a broadcast object would fail).

The tiny runs take the recipe as it is on the full stack; without vLLM they sample with
transformers' generate (``rollout.engine=hf``), without TE they build the local spec
(``model.without_transformer_engine=true``): ``tiny_gpu_overrides``, named in their rows.

``--profile a100`` runs any GPU as an A100 chooses attention: TE's cuDNN attention off
(``NVTE_FUSED_ATTN=0``, for this process and the trainers it starts), so the trainer must take
FlashAttention, and refuse without flash-attn. On a GPU, results agree with the float32 or CPU
references within the tolerances each row states; bitwise equality is claimed only where a row
says so (a checkpoint's reload on the same GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform as host
import re
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_dgpo.runtime.gpu_flags import NVTE_SWITCHES  # noqa: E402

SKIP_LINE = "gpu_check: skipped: no CUDA device (the GPU checks need one)"

# a small Qwen2 for the agreement checks: GQA, QKV bias, head size 64
SMALL_QWEN2 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=4096,
                   hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, rope_theta=1.0e6, hidden_act="silu",
                   tie_word_embeddings=False)
# DeepSeek-R1-Distill-Qwen-1.5B's config.json shape
QWEN2_1P5B = dict(SMALL_QWEN2, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  max_position_embeddings=131072, rope_theta=10000.0)
PACKED_LENGTHS = (1000, 37, 2048, 611, 500)  # one packed row of unequal samples
ROW_TOKENS = 8192
V_QWEN2 = 152064


@dataclass
class Row:
    """One line of the table."""

    check: str
    ok: bool | None
    """True / False against the goal; None where the number is reported without a pass mark."""
    result: str
    goal: str
    numbers: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ helpers


def _packed_row(lengths, vocab: int, seed: int):
    """(tokens [S] int64, cu_seqlens [k+1] int32 on the host, targets [S], weights [S])."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (torch.randint(0, vocab, (total,), generator=gen), cu,
            torch.randint(0, vocab, (total,), generator=gen), torch.rand(total, generator=gen))


def _block_causal_mask(cu_seqlens, device):
    """[1, 1, S, S] bool, True = masked: causal within each sample, nothing across samples."""
    widths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(len(widths)), widths).to(device)
    pos = torch.arange(len(seg), device=device)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


def _logits(model, tokens, cu_seqlens, *, thd: bool, **kwargs):
    """[1, S, V] logits of one packed row: THD ``PackedSeqParams`` (host cu_seqlens and
    max_seqlen, as the trainer passes them) or a block-diagonal mask."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids = tokens[None].cuda()
    pos = torch.arange(ids.shape[1], device="cuda")[None]
    if not thd:
        return model(ids, pos, _block_causal_mask(cu_seqlens, "cuda"), **kwargs)
    cu = cu_seqlens.to("cuda", non_blocking=True)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return model(ids, pos, None, packed_seq_params=params, **kwargs)


def _weighted_logprob_loss(logits, targets, weights, vocab_size):
    from megatron_dgpo.algorithm.vocab_parallel import logprobs_and_entropy

    logp, _ = logprobs_and_entropy(logits, targets[None].cuda(), vocab_size=vocab_size)
    return (logp * weights[None].cuda()).sum(), logp.detach()


def _te_to_local(name: str) -> str:
    """TE spec parameter name -> local spec name (TE fuses the norms into the next linear)."""
    return (name.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
            .replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))


def _timed(fn, repeats: int = 5) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs after one warm-up (CUDA synchronised)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _peak_extra(fn) -> tuple[int, object]:
    """(peak bytes allocated beyond what was allocated before, fn's result)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def _gpu_platform():
    from megatron_dgpo.runtime.gpu_flags import Platform

    return Platform.detect()


PROFILES = {"a100": {"NVTE_FUSED_ATTN": "0"}}
"""``--profile``: the environment under which this GPU chooses attention as another generation
must: ``a100`` turns TE's cuDNN attention off, which is what an A100 lacks for packed rows."""


@contextmanager
def _attention_switches_restored():
    """TE's attention switches as they were (the profile's) after the block: building a model
    sets them for its backend (Megatron's ``LanguageModule._set_attention_backend``) and asserts
    they agree with what is already set, so one check's model must not leave them to the next
    check's model of another backend."""
    saved = {key: os.environ.get(key) for key in NVTE_SWITCHES}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _trainer_attention(dtype=torch.bfloat16) -> dict:
    """The ``TransformerConfig`` attention override the trainer passes on this GPU
    (``policy.attention_overrides`` of a default ``ModelConfig``; {} for the local spec)."""
    from megatron_dgpo.recipe import ModelConfig
    from megatron_dgpo.training.policy import attention_overrides

    return attention_overrides(ModelConfig(), _gpu_platform(), dtype)


def _policy(hf_config, *, seed: int, recompute: bool = False,
            use_distributed_optimizer: bool = True):
    """The trainer's bf16 policy of random weights: ``build_model`` (this machine's spec and
    ``gpu_flags`` flags) wrapped by ``policy.wrap_policy`` (Float16Module, DDP flags)."""
    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.recipe import ModelConfig
    from megatron_dgpo.training.policy import model_overrides, wrap_policy

    overrides = model_overrides(ModelConfig(dtype="bfloat16", recompute_activations=recompute))
    chunks = build_model(hf_config, dtype=torch.bfloat16, seed=seed, **overrides,
                         **_trainer_attention())
    return wrap_policy(chunks, use_distributed_optimizer=use_distributed_optimizer)


def _micro_batch(lengths, vocab: int, seed: int, models=None):
    """One packed ``MicroBatch`` of random samples of ``lengths`` (a quarter prompt, the rest
    response; advantages +-1), padded to ``gpu_flags.pad_multiple``; with ``models`` its
    ``old_logprobs`` are the policy's own (as the trainer's forward pass sets them)."""
    from megatron_dgpo.algorithm.packing import Sample, pack
    from megatron_dgpo.runtime.gpu_flags import pad_multiple
    from megatron_dgpo.runtime.parallel import context_parallel_size, tensor_parallel_size
    from megatron_dgpo.training.train_step import forward_logprobs

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        start = max(1, n // 4)
        samples.append(Sample(torch.randint(0, vocab, (n,), generator=gen), start, {
            "advantages": torch.randint(0, 2, (n - start,), generator=gen).float() * 2 - 1,
            "old_logprobs": torch.zeros(n - start)}))
    (row,) = pack(samples, budget=10**9,
                  pad_multiple=pad_multiple(tensor_parallel_size(), context_parallel_size()))
    if models is not None:
        ((logp, _),) = forward_logprobs(models, [row])
        row.old_logprobs = torch.where(row.loss_mask, logp, 0.0)
    return row


def _update(models, optimizer, row) -> float:
    """One optimizer update on ``row`` through the trainer's ``train_step`` (THD with TE, bf16
    logits, overlapped reduction) and ``step_if_finite``. Returns the loss."""
    from megatron_dgpo.training.optimizer import step_if_finite
    from megatron_dgpo.algorithm.losses import LossConfig
    from megatron_dgpo.training.train_step import train_step

    result = train_step(models, [row], LossConfig())
    stepped, _ = step_if_finite(optimizer, models, result.loss)
    if not stepped:
        raise RuntimeError("the optimizer skipped the update (non-finite loss or gradients)")
    return result.loss


def _params(models) -> dict:
    from megatron_dgpo.models.builder import unwrap_model
    from megatron_dgpo.training.optimizer import sync_params

    sync_params(models)
    return {n: p.detach().clone() for n, p in unwrap_model(models[0]).named_parameters()}


# ------------------------------------------------------------------------------ checks


def _reference_weights() -> dict:
    """SMALL_QWEN2's weights (local spec names, fp32): what every agreement run loads. Its
    local-spec build sets every NVTE_*_ATTN switch to 0: they are put back as they were, or
    the TE model built next would meet them and Megatron would assert."""
    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.runtime.gpu_flags import Platform

    with _attention_switches_restored():
        model = build_model(SMALL_QWEN2, seed=3, platform=Platform(cuda=True))[0]
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _spec_run(spec: str, dtype: torch.dtype, weights: dict):
    """(log-probs [1, S] fp32, {local name: grad fp32}) of sum_t w_t log p_t on the packed row:
    ``spec="te"``: TE layer spec + THD (this machine's flags: fused RoPE); ``"local"``: the local
    spec + block-diagonal mask. Same weights (cast to ``dtype``)."""
    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.runtime.gpu_flags import Platform

    platform = _gpu_platform() if spec == "te" else Platform(cuda=True)
    if spec == "te" and not platform.transformer_engine:
        raise RuntimeError("Transformer-Engine is not installed: nothing to compare")
    # no DDP here, so no main_grad for gradient-accumulation fusion to write into
    model = build_model(SMALL_QWEN2, dtype=dtype, seed=3, platform=platform,
                        gradient_accumulation_fusion=False,
                        **(_trainer_attention(dtype) if spec == "te" else {}))[0]
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[_te_to_local(name)])
    tokens, cu, targets, w = _packed_row(PACKED_LENGTHS, SMALL_QWEN2["vocab_size"], seed=0)
    logits = _logits(model, tokens, cu, thd=spec == "te")
    loss, logp = _weighted_logprob_loss(logits, targets, w, SMALL_QWEN2["vocab_size"])
    loss.backward()
    return logp.float(), {_te_to_local(n): p.grad.float() for n, p in model.named_parameters()}


def _agreement(a, b) -> tuple[float, float, float]:
    """(max |d log p|, mean |d log p|, max over parameters of max|d grad| / max|grad|)."""
    (lp_a, g_a), (lp_b, g_b) = a, b
    d = (lp_a - lp_b).abs()
    grad = max(float((g_a[n] - g_b[n]).abs().max() / g_b[n].abs().max().clamp_min(1e-30))
               for n in g_b)
    return float(d.max()), float(d.mean()), grad


def check_attention_choice() -> Row:
    from dataclasses import replace

    from megatron_dgpo.runtime.gpu_flags import attention_backend

    platform = _gpu_platform()
    with_te = replace(platform, transformer_engine=True)  # the decision TE's presence makes
    fused_off = os.environ.get("NVTE_FUSED_ATTN") == "0"
    capability = platform.compute_capability
    expected = "fused" if capability >= (9, 0) and not fused_off else (
        "flash" if platform.flash_attention else "refused")

    def choose(p, dtype=torch.bfloat16, environ=None):
        try:
            return attention_backend(p, "auto", dtype=dtype, environ=environ)
        except ValueError as error:
            return f"refused: {error}"

    chosen = choose(with_te)
    no_flash = replace(with_te, flash_attention="",
                       flash_attention_error="flash-attn is not installed (a stand-in)")
    refusal = choose(no_flash, environ={**os.environ, "NVTE_FUSED_ATTN": "0"})
    fp32 = choose(with_te, torch.float32)
    ok = (chosen.split(":")[0] == expected != "refused" and refusal.startswith("refused")
          and "flash-attn==2.8.3" in refusal and fp32.startswith("refused"))
    return Row("attention_choice", ok,
               f"{platform.gpu}, cuDNN {platform.cudnn}, {platform.flash_attention or 'no flash-attn'}"
               f"{', NVTE_FUSED_ATTN=0' if fused_off else ''}: {chosen[:160]}; without flash-attn "
               f"and cuDNN attention: {refusal[:80]}...; float32: {fp32[:60]}...",
               f"auto = {expected} (a backend, not a refusal); no flash-attn without cuDNN "
               f"attention and float32 refused",
               dict(chosen=chosen, expected=expected, refusal=refusal, float32=fp32,
                    transformer_engine_installed=platform.transformer_engine))


def _te_selected_backend() -> dict:
    """What Transformer-Engine selected for the last attention call (its module-level record
    ``_attention_backends`` in ``dot_product_attention.py``, TE 2.17)."""
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention

    record = dot_product_attention._attention_backends
    name = ("flash" if record["use_flash_attention"] else "fused" if record["use_fused_attention"]
            else "unfused" if record["use_unfused_attention"] else "none")
    return dict(selected=name, flash=str(record["flash_attention_backend"]),
                fused_sub_backend=str(record["fused_attention_backend"]))


def _te_model(config: dict):
    """The trainer's bf16 TE model of ``config`` (its attention backend), unwrapped."""
    from megatron_dgpo.models.builder import build_model

    return build_model(config, dtype=torch.bfloat16, seed=3, gradient_accumulation_fusion=False,
                       **_trainer_attention())[0]


def _packed_forward_backward(model, lengths, vocab: int):
    tokens, cu, targets, w = _packed_row(lengths, vocab, seed=0)
    loss, _ = _weighted_logprob_loss(_logits(model, tokens, cu, thd=True), targets, w, vocab)
    loss.backward()


def check_te_attention_selected() -> Row:
    choice = _trainer_attention()["attention_backend"].name
    _packed_forward_backward(_te_model(SMALL_QWEN2), PACKED_LENGTHS, SMALL_QWEN2["vocab_size"])
    selected = _te_selected_backend()
    return Row("te_attention_selected", selected["selected"] == choice,
               f"trainer chose {choice}; TE selected {selected['selected']} (flash "
               f"{selected['flash']}, fused sub-backend {selected['fused_sub_backend']})",
               "TE selects the trainer's backend, never unfused", dict(selected, chosen=choice))


MEMORY_SEQUENCES = 8
MEMORY_LENGTHS = (1024, 2048)


def check_packed_attention_memory() -> Row:
    """Peak extra memory of forward + backward of a packed row of ``MEMORY_SEQUENCES``
    sequences per length in ``MEMORY_LENGTHS``; the same model and weights."""
    model = _te_model(SMALL_QWEN2)
    vocab, heads = SMALL_QWEN2["vocab_size"], SMALL_QWEN2["num_attention_heads"]
    peaks = {}
    for n in MEMORY_LENGTHS:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        peaks[n], _ = _peak_extra(lambda: _packed_forward_backward(
            model, [n] * MEMORY_SEQUENCES, vocab))
    short, long = MEMORY_LENGTHS
    ratio = peaks[long] / peaks[short]
    # what TE's unfused attention would add at the longer rows: bf16 scores and probabilities
    # [b h, s, s] and a bool mask [b, 1, s, s] per layer
    dense = (SMALL_QWEN2["num_hidden_layers"] * MEMORY_SEQUENCES * long * long
             * (2 * 2 * heads + 1))
    selected = _te_selected_backend()["selected"]
    return Row("packed_attention_memory", ratio <= 2.5 and selected != "unfused",
               f"{selected}: {peaks[short] / 2**20:.0f} MiB at {MEMORY_SEQUENCES}x{short} tokens, "
               f"{peaks[long] / 2**20:.0f} MiB at {MEMORY_SEQUENCES}x{long}: x{ratio:.2f} "
               f"(dense scores would add {dense / 2**20:.0f} MiB)",
               "peak(2s) / peak(s) <= 2.5 (linear in tokens)",
               dict(peak_bytes={str(k): v for k, v in peaks.items()}, ratio=ratio,
                    dense_scores_bytes_at_long=dense, selected=selected))


def check_trainer_refuses_unfused() -> Row:
    goal = "exit != 0 at start-up with the refusal, no metrics line (no generation)"
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(_trainer_env(), NVTE_FUSED_ATTN="0", NVTE_FLASH_ATTN="0")
        env.pop("NVTE_UNFUSED_ATTN", None)
        begin = time.perf_counter()
        proc = subprocess.run(tiny_gpu_command(1, tiny_gpu_overrides(available_components()),
                                               f"{tmp}/run"),
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - begin
        logged = (Path(tmp) / "run" / "metrics.jsonl").is_file()
    said = "model.attention_backend=auto" in proc.stderr and "unfused" in proc.stderr
    refusal = next((line for line in proc.stderr.splitlines() if "attention_backend" in line), "")
    return Row("trainer_refuses_unfused", proc.returncode != 0 and said and not logged,
               f"rc {proc.returncode} after {seconds:.0f} s, metrics written {logged}: "
               f"{refusal[-200:] or _tail(proc.stderr)}", goal,
               dict(returncode=proc.returncode, seconds=seconds, metrics_written=logged,
                    stderr_tail=proc.stderr[-2000:]))


def check_te_thd_bf16() -> Row:
    goal = "TE+THD bf16 error vs fp32 <= 2x local bf16 error + 1e-3"
    weights = _reference_weights()
    with _attention_switches_restored():  # local, TE and local again: each sets the switches
        reference = _spec_run("local", torch.float32, weights)
    with _attention_switches_restored():
        te = _agreement(_spec_run("te", torch.bfloat16, weights), reference)
    with _attention_switches_restored():
        local = _agreement(_spec_run("local", torch.bfloat16, weights), reference)
    ok = te[0] <= 2 * local[0] + 1e-3 and te[2] <= 2 * local[2] + 1e-3
    return Row("te_thd_bf16", ok,
               f"vs fp32: TE max|d logp| {te[0]:.2e} grads {te[2]:.2e}; local bf16 "
               f"{local[0]:.2e} / {local[2]:.2e}", goal,
               dict(te_logp_max_abs=te[0], te_logp_mean_abs=te[1], te_grad_max_rel=te[2],
                    local_logp_max_abs=local[0], local_logp_mean_abs=local[1],
                    local_grad_max_rel=local[2]))


def _fp32_logprob_reference(logits, targets, weights, entropy: bool):
    """float32 log-probs of ``targets`` and the gradient of sum w log p (+ sum w H) on these
    rows (``log_softmax`` autograd): what ``check_logprobs_v152064`` measures errors against."""
    x = logits.float().requires_grad_()
    logsm = torch.log_softmax(x, dim=-1)
    logp = logsm.gather(1, targets[:, None])[:, 0]
    loss = (weights * logp).sum()
    if entropy:
        loss = loss - (weights * (logsm.exp() * logsm).sum(-1)).sum()
    loss.backward()
    return logp.detach(), x.grad


def check_logprobs_v152064() -> Row:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_dgpo.algorithm.vocab_parallel import compiled_by_default, logprobs_and_entropy

    goal = ("compiled kernels, entropy gradient off and on: time <= 8x one read of the logits, "
            "extra memory (gradient included) <= 1.2x the logits; vs float32: |d logp| <= 1e-3, "
            "|d grad| <= 1e-2")
    tokens = ROW_TOKENS
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(tokens, V_QWEN2, device="cuda", generator=gen) * 3).bfloat16()
    targets = torch.randint(0, V_QWEN2, (tokens,), device="cuda", generator=gen)
    weights = torch.rand(tokens, device="cuda", generator=gen)
    size = logits.numel() * logits.element_size()
    rows = slice(0, 256)  # the rows checked against float32
    references = {entropy: _fp32_logprob_reference(logits[rows], targets[rows], weights[rows],
                                                   entropy) for entropy in (False, True)}

    # each run returns its log-probs and gradient on ``rows`` only when asked (keep): copies
    # made while the gradient is alive would count in the peak memory
    def dgpo(kernel: str, entropy_grad: bool):
        def run(keep=False):
            x = logits.detach().requires_grad_()
            logp, entropy = logprobs_and_entropy(x, targets, kernel=kernel,
                                                 entropy_grad=entropy_grad)
            loss = (logp * weights).sum()
            if entropy_grad:
                loss = loss + (entropy * weights).sum()
            loss.backward()
            return (logp.detach()[rows].clone(), x.grad[rows].clone()) if keep else None
        return run

    def megatron(keep=False):
        # [s, b, V] as Megatron's loss takes it; it upcasts bf16 to an fp32 copy and works on
        # it. Its loss is -log p, so the gradient of sum w log p is minus the one of sum w loss.
        x = logits.detach().requires_grad_()
        loss = vocab_parallel_cross_entropy(x[:, None], targets[:, None])
        (loss[:, 0] * weights).sum().backward()
        return (-loss.detach()[rows, 0], -x.grad[rows].clone()) if keep else None

    runs = {"compiled": (dgpo("compiled", False), False),
            "compiled_entropy_grad": (dgpo("compiled", True), True),
            "eager": (dgpo("eager", False), False),
            "eager_entropy_grad": (dgpo("eager", True), True),
            "megatron_ce": (megatron, False)}
    read = _timed(lambda: logits.amax())
    numbers = dict(logits_bytes=size, read_ms=read * 1e3,
                   auto_kernel="compiled" if compiled_by_default(logits.device, logits.dtype) else "eager")
    for name, (fn, entropy) in runs.items():
        start = time.perf_counter()
        logp, grad = fn(keep=True)  # the compiled kernels compile here
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        seconds = _timed(fn)
        # after the first call: what compiling or autotuning allocates once is not counted
        extra, _ = _peak_extra(fn)
        want_logp, want_grad = references[entropy]
        numbers[name] = dict(ms=seconds * 1e3, time_x_read=seconds / read,
                             extra_x_logits=extra / size, first_call_s=first,
                             logp_max_abs_vs_fp32=float((logp - want_logp).abs().max()),
                             grad_max_abs_vs_fp32=float((grad.float() - want_grad).abs().max()))
    compiled = [numbers[name] for name in ("compiled", "compiled_entropy_grad")]
    ours = [numbers[name] for name in runs if name != "megatron_ce"]
    ok = all(n["time_x_read"] <= 8.0 and n["extra_x_logits"] <= 1.2 for n in compiled) and all(
        n["logp_max_abs_vs_fp32"] <= 1e-3 and n["grad_max_abs_vs_fp32"] <= 1e-2 for n in ours)

    def cell(name):
        n = numbers[name]
        return (f"{n['time_x_read']:.1f}x read ({n['ms']:.1f} ms), {n['extra_x_logits']:.2f}x "
                f"logits, |d logp| {n['logp_max_abs_vs_fp32']:.1e}, "
                f"|d grad| {n['grad_max_abs_vs_fp32']:.1e}")

    result = "; ".join(f"{name}: {cell(name)}" for name in runs)
    first = max(numbers[name]["first_call_s"] for name in ("compiled", "compiled_entropy_grad"))
    return Row("logprobs_v152064", ok,
               f"{result}; compiled first call {first:.1f} s; auto = {numbers['auto_kernel']}",
               goal, numbers)


def check_distopt_checkpoint() -> Row:
    from megatron_dgpo.models.builder import padded_vocab_of
    from megatron_dgpo.recipe import OptimizerConfig
    from megatron_dgpo.training.checkpoint import (AsyncSaver, TrainerState, latest_checkpoint,
                                                   load_checkpoint, save_checkpoint)
    from megatron_dgpo.training.optimizer import build_optimizer

    goal = ("the loaded parameters bitwise the saved ones (a copy); the next update from the "
            "loaded state within 10% of the update's size of the live one's (GPU kernels, e.g. "
            "attention's backward, are not bitwise reproducible)")
    config = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
    vocab = SMALL_QWEN2["vocab_size"]

    def policy(seed):
        models = _policy(SMALL_QWEN2, seed=seed)
        return models, build_optimizer(config, models, lr=1e-3, bf16=True)

    numbers, ok, results = {}, True, []
    for sharding in ("dp_reshardable", "fully_reshardable"):  # checkpoint.optimizer_sharding
        live, live_opt = policy(seed=1)
        _update(live, live_opt, _micro_batch(PACKED_LENGTHS, vocab, seed=1, models=live))
        second = _micro_batch(PACKED_LENGTHS, vocab, seed=2, models=live)  # old log-probs fixed
        with tempfile.TemporaryDirectory() as root:
            saver = AsyncSaver()  # its writer starts here, not in the first save
            begin = time.perf_counter()
            save_checkpoint(root, TrainerState(step=1), live, live_opt, hf_config=SMALL_QWEN2,
                            padded_vocab_size=padded_vocab_of(live), dtype=torch.bfloat16,
                            saver=saver, optimizer_sharding=sharding)
            blocked = time.perf_counter() - begin
            published_early = latest_checkpoint(root) is not None
            saver.close()
            saved = _params(live)
            _update(live, live_opt, second)
            expected = _params(live)
            fresh, fresh_opt = policy(seed=2)
            load_checkpoint(latest_checkpoint(root), fresh, fresh_opt)
            loaded = _params(fresh)
            _update(fresh, fresh_opt, second)
            got = _params(fresh)
        not_copied = [n for n in saved if not torch.equal(saved[n], loaded[n])]
        deviation = max(float((got[n].float() - expected[n].float()).abs().max())
                        / max(float((expected[n].float() - saved[n].float()).abs().max()), 1e-30)
                        for n in expected)
        bitwise = sum(torch.equal(expected[n], got[n]) for n in expected)
        ok = ok and not not_copied and deviation <= 0.1 and not published_early
        results.append(f"{sharding}: loaded {len(saved) - len(not_copied)}/{len(saved)} bitwise; "
                       f"next update max |d| {deviation:.1e} of the update ({bitwise}/"
                       f"{len(expected)} tensors bitwise), save blocked {blocked:.2f} s, "
                       f"published early {published_early}")
        numbers[sharding] = dict(tensors=len(expected), not_copied=not_copied[:10],
                                 next_update_deviation=deviation, next_update_bitwise=bitwise,
                                 save_blocking_s=blocked, published_before_wait=published_early)
    return Row("distopt_checkpoint", ok, "; ".join(results),
               goal + " (both sharding types); async save published only when written", numbers)


def _colocated_engine(hf_dir: str):
    """CUDA vLLM inside this process (``placement="colocated"``), bf16, with sleep mode: the
    only place this check builds an engine (``sleep()`` frees its memory; ``update_weights``
    wakes it, reloads in buckets and wakes the KV cache; ``generate`` wakes what still sleeps)."""
    from megatron_dgpo.rollout import VLLMConfig, VLLMEngine

    return VLLMEngine(VLLMConfig(model=hf_dir, dtype="bfloat16", seed=0, max_model_len=512,
                                 max_num_seqs=64, gpu_memory_utilization=0.25,
                                 placement="colocated", sleep_mode=True))


def _rollout_row(groups, prompts):
    """The samples of ``groups`` as one packed ``MicroBatch`` with their rollout log-probs."""
    from megatron_dgpo.algorithm.packing import Sample, pack

    samples = []
    for group in groups:
        for c in group:
            prompt = list(prompts[c.prompt_index])
            samples.append(Sample(torch.tensor(prompt + list(c.token_ids)), len(prompt), {
                "rollout_logprobs": torch.tensor(c.logprobs),
                "advantages": torch.randn(len(c.token_ids)).sign(),
                "old_logprobs": torch.tensor(c.logprobs)}))
    (row,) = pack(samples, budget=10**9)
    return row


def check_vllm_colocated() -> Row:
    from megatron_dgpo.recipe import ModelConfig, OptimizerConfig
    from megatron_dgpo.algorithm.mismatch import mismatch_metrics
    from megatron_dgpo.rollout.vllm_engine import NCCL_ONLY_ALL_REDUCE_ENV
    from megatron_dgpo.tasks.tiny import make_tiny_model
    from megatron_dgpo.training.optimizer import build_optimizer
    from megatron_dgpo.training.policy import build_policy
    from megatron_dgpo.training.train_step import forward_logprobs

    goal = "mismatch after sleep/train/refit <= 3x before (bf16)"
    with tempfile.TemporaryDirectory() as tmp:
        tiny = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2)
        hf_dir = str(make_tiny_model(Path(tmp) / "policy", seed=0, **tiny))
        # vLLM is what this checks: the trainer's side takes the local spec where TE is absent
        without_te = not available_components()["TE"]
        models, _, _ = build_policy(ModelConfig(tiny=tiny, dtype="bfloat16",
                                                without_transformer_engine=without_te),
                                    hf_dir, use_distributed_optimizer=True)
        optimizer = build_optimizer(OptimizerConfig(lr=2e-3, use_distributed_optimizer=True),
                                    models, lr=2e-3, bf16=True)
        engine = _colocated_engine(hf_dir)
        try:
            prompts = [engine.tokenizer.encode(f"Repeat the digit {d}.") for d in range(8)]
            stats, seconds = {}, {}
            for phase in ("before", "after"):
                begin = time.perf_counter()
                groups = engine.generate(prompts, n=4, temperature=1.0, max_tokens=48, seed=7)
                seconds[f"generate_{phase}"] = time.perf_counter() - begin
                row = _rollout_row(groups, prompts)
                ((logp, _),) = forward_logprobs(models, [row])
                row.old_logprobs = torch.where(row.loss_mask, logp, 0.0)
                stats[phase] = mismatch_metrics([row]).as_dict()
                if phase == "after":
                    break
                engine.sleep()
                free_asleep = torch.cuda.mem_get_info()[0] / 2**30
                _update(models, optimizer, row)
                begin = time.perf_counter()
                from megatron_dgpo.convert import export_hf_groups
                from megatron_dgpo.training.optimizer import sync_params

                sync_params(models)
                engine.update_weights(export_hf_groups(models, consumer="first"))
                seconds["refit"] = time.perf_counter() - begin
            draw = engine.seeded_draw
        finally:
            engine.shutdown()
    key, mult = "mismatch/mean_abs_diff", "mismatch/token_mult_error"
    before, after = stats["before"][key], stats["after"][key]
    # the colocated engine's all-reduces are pynccl's on every GPU (vllm_engine.engine_env)
    all_reduce_env = {k: os.environ.get(k) for k in NCCL_ONLY_ALL_REDUCE_ENV}
    nccl_only = all_reduce_env == NCCL_ONLY_ALL_REDUCE_ENV
    ok = after <= 3 * max(before, 1e-3) and draw == "counter-based" and nccl_only
    return Row("vllm_colocated", ok,
               f"mean |d| {before:.2e} -> {after:.2e} (token mult. error "
               f"{stats['after'][mult]:.2e}); {free_asleep:.0f} GiB free asleep; refit "
               f"{seconds['refit']:.2f} s; seeded draw {draw}; NCCL-only all-reduce env "
               f"{nccl_only}", goal + "; seeded draw counter-based; NCCL-only all-reduces",
               dict(stats, seconds=seconds, free_gib_while_asleep=free_asleep, seeded_draw=draw,
                    all_reduce_env=all_reduce_env))


def check_seeded_sampling_v152064() -> Row:
    """vLLM's sampling draw for 1024 requests x vocabulary 152064 (benchmarks/bench_sampling.py):
    Model Runner V2's counter-based draw with every request seeded against V1's batched
    unseeded draw (goal: within 1.5x), and V1's per-request seeded draw beside them."""
    from benchmarks.bench_sampling import measure

    ms = {name: 1e3 * s for name, s in measure(1024, V_QWEN2, 5, "cuda").items()}
    base = ms["v1 batched, unseeded"]
    ratio = ms["v2 gumbel, seeded"] / base
    return Row("seeded_sampling_v152064", ratio <= 1.5,
               f"v2 seeded {ms['v2 gumbel, seeded']:.2f} ms = {ratio:.2f}x v1 unseeded "
               f"{base:.2f} ms; v1 seeded {ms['v1 seeded']:.2f} ms", "v2 seeded <= 1.5x unseeded",
               dict(ms=ms, ratio=ratio))


def _peak_flops() -> float | None:
    """Dense bf16 tensor-core peak of this GPU (vendor datasheets), None if unknown."""
    name = torch.cuda.get_device_name()
    if "H100" in name and "PCIe" in name:
        return 756e12
    if any(k in name for k in ("H100", "H200", "H800", "GH200")):
        return 989e12
    if "A100" in name:
        return 312e12
    return None


def _model_flops(cfg: dict, lengths) -> float:
    """Training FLOPs of one packed row (forward + backward = 3 forward):

        forward = 2 N_mm S + sum over samples 2 n^2 a d L  (causal QK^T and AV)

    N_mm: parameters in matrix multiplies (QKV, projection, SwiGLU, output layer)."""
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = h
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    n_mm = layers * (h * (q + 2 * kv) + q * h + 3 * f * h) + cfg["vocab_size"] * h
    attention = sum(2 * n * n * q * layers for n in lengths)
    return 3 * (2 * n_mm * sum(lengths) + attention)


def _train_step_seconds(hf_config, lengths, recompute: bool) -> tuple[float, float]:
    """(best seconds of one ``train_step`` forward + backward of a fresh random bf16 policy on
    one packed row of ``lengths``, peak GiB allocated)."""
    from megatron_dgpo.algorithm.losses import LossConfig
    from megatron_dgpo.training.train_step import train_step

    models = _policy(hf_config, seed=0, recompute=recompute, use_distributed_optimizer=False)
    row = _micro_batch(lengths, hf_config["vocab_size"], seed=0, models=models)
    torch.cuda.reset_peak_memory_stats()
    seconds = _timed(lambda: train_step(models, [row], LossConfig()), repeats=5)
    return seconds, torch.cuda.max_memory_allocated() / 2**30


def check_throughput_1p5b() -> Row:
    goal = "MFU >= 45% on H100 (recompute off)"
    gen = torch.Generator().manual_seed(0)
    lengths, left = [], ROW_TOKENS
    while left > 0:
        n = min(left, int(torch.randint(300, 3000, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    flops = _model_flops(QWEN2_1P5B, lengths)
    peak = _peak_flops()
    results = {}
    for recompute in (False, True):
        seconds, peak_gib = _train_step_seconds(QWEN2_1P5B, lengths, recompute)
        results["recompute" if recompute else "no_recompute"] = dict(
            seconds=seconds, tokens_per_s=ROW_TOKENS / seconds,
            mfu=flops / seconds / peak if peak else None, peak_gib=peak_gib)
        torch.cuda.empty_cache()
    off, on = results["no_recompute"], results["recompute"]
    ok = (off["mfu"] >= 0.45) if off["mfu"] is not None else None

    def mfu(r):
        return f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"

    return Row("throughput_1p5b", ok,
               f"{off['tokens_per_s']:,.0f} tok/s MFU {mfu(off)} ({off['peak_gib']:.0f} GiB); "
               f"recompute {on['tokens_per_s']:,.0f} tok/s MFU {mfu(on)} "
               f"({on['peak_gib']:.0f} GiB)", goal,
               dict(results, row_lengths=lengths, flops_per_row=flops, peak_flops=peak))


TINY_GPU_LAYOUTS = {  # check name: (GPUs, recipe overrides)
    "tiny_gpu_run": (1, []),
    # the layouts where a CPU tensor on an NCCL group or a pickled CUDA tensor would surface
    "tiny_gpu_tp2": (2, ["parallel.tensor_parallel=2"]),
    "tiny_gpu_dp2": (2, []),
}
TINY_GPU_STEPS = 5  # recipes/tiny_gpu.yaml's train.steps


def tiny_gpu_overrides(available: dict) -> list[str]:
    """What recipes/tiny_gpu.yaml needs changed to run with the components ``available`` has:
    transformers' generate instead of vLLM, Megatron's local spec instead of TE (its dense
    masks are small at the recipe's 1024-token rows). Empty on the full GPU stack."""
    return ((["rollout.engine=hf"] if not available.get("vLLM") else [])
            + (["model.without_transformer_engine=true"] if not available.get("TE") else []))


def tiny_gpu_command(gpus: int, overrides: list[str], run_dir: str) -> list[str]:
    """``recipes/tiny_gpu.yaml`` on ``gpus`` GPUs of this node (torchrun when more than one)."""
    from megatron_dgpo.runtime.parallel import free_port

    launcher = [sys.executable] if gpus == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
        "--master-port", str(free_port())]
    return launcher + ["-m", "megatron_dgpo.train", str(ROOT / "recipes/tiny_gpu.yaml"),
                       f"run_dir={run_dir}", "logging.progress_bar=false", *overrides]


def _trainer_env() -> dict:
    """This environment for a trainer child: no torchrun variables of ours, the checkout first."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run_state(run: Path) -> dict:
    """What a tiny run left in ``run``: the steps of its metrics lines (in file order), the
    checkpoint ``latest`` names, whether the HF export exists, the last metrics line."""
    lines = []
    if (run / "metrics.jsonl").is_file():
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    latest = run / "checkpoints" / "latest"
    return dict(steps=[r["step"] for r in lines],
                latest=latest.read_text().strip() if latest.is_file() else None,
                exported=(run / "hf" / "config.json").is_file(), last=lines[-1] if lines else {})


def _tail(text: str | None, n: int = 300) -> str:
    return (text or "")[-n:].replace("\n", " ")


def check_tiny_gpu(name: str) -> Row:
    gpus, layout = TINY_GPU_LAYOUTS[name]
    overrides = layout + tiny_gpu_overrides(available_components())
    goal = (f"{gpus} GPU(s){' ' + ' '.join(overrides) if overrides else ''}: "
            f"{TINY_GPU_STEPS} steps, checkpoint step_{TINY_GPU_STEPS:06d} published, HF export")
    with tempfile.TemporaryDirectory() as tmp:
        begin = time.perf_counter()
        proc = subprocess.run(tiny_gpu_command(gpus, overrides, f"{tmp}/run"),
                              cwd=ROOT, env=_trainer_env(), capture_output=True, text=True,
                              timeout=600)
        seconds = time.perf_counter() - begin
        state = _run_state(Path(tmp) / "run")
    ok = (proc.returncode == 0 and state["steps"] == list(range(1, TINY_GPU_STEPS + 1))
          and state["latest"] == f"step_{TINY_GPU_STEPS:06d}" and state["exported"])
    tail = "" if ok else " | " + _tail(proc.stderr or proc.stdout)
    return Row(name, ok,
               f"rc {proc.returncode}, {len(state['steps'])} steps in {seconds:.0f} s, latest "
               f"{state['latest']}, export {state['exported']}, last mismatch "
               f"{state['last'].get('mismatch/mean_abs_diff', float('nan')):.2e}{tail}", goal,
               dict(returncode=proc.returncode, steps=len(state["steps"]), seconds=seconds,
                    latest=state["latest"], exported=state["exported"],
                    last_metrics=state["last"], overrides=overrides,
                    stderr_tail=(proc.stderr or "")[-2000:]))


CP_GOAL = "CP=2 vs CP=1 (bf16): logp <= 5e-2, loss <= 1e-2 rel, grads <= 5e-2 of max"


def _context_parallel_worker(out: str) -> int:
    """One rank of ``check_context_parallel`` (under torchrun, 2 ranks): the same packed row at
    CP = 1 and CP = 2; rank 0 writes the differences to ``out`` (JSON)."""
    from megatron_dgpo.algorithm.losses import LossConfig
    from megatron_dgpo.models.builder import unwrap_model
    from megatron_dgpo.runtime.parallel import (ParallelConfig, destroy_parallel,
                                                init_distributed, initialize_parallel)
    from megatron_dgpo.training.train_step import forward_logprobs, train_step

    init_distributed()
    runs, row = {}, None
    for cp in (2, 1):  # the row is built (padded to 2 CP, old log-probs) at CP = 2, then reused
        initialize_parallel(ParallelConfig(context_parallel=cp), seed=3)
        models = _policy(SMALL_QWEN2, seed=3, use_distributed_optimizer=False)
        if row is None:
            row = _micro_batch(PACKED_LENGTHS, SMALL_QWEN2["vocab_size"], seed=1, models=models)
        ((logp, _),) = forward_logprobs(models, [row])
        result = train_step(models, [row], LossConfig())
        grads = {n: p.main_grad.float().cpu().clone()
                 for n, p in unwrap_model(models[0]).named_parameters()}
        runs[cp] = dict(logp=torch.where(row.loss_mask, logp, 0.0), loss=result.loss, grads=grads)
        destroy_parallel()
    one, two = runs[1], runs[2]
    numbers = dict(
        logp_max_abs=float((one["logp"] - two["logp"]).abs().max()),
        loss_rel=abs(one["loss"] - two["loss"]) / max(abs(one["loss"]), 1e-6),
        grad_max_rel=max(float((one["grads"][n] - g).abs().max()
                               / one["grads"][n].abs().max().clamp(min=1e-12))
                         for n, g in two["grads"].items()))
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(numbers))
    return 0


def check_context_parallel() -> Row:
    from megatron_dgpo.runtime.parallel import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cp.json"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), str(Path(__file__).resolve()),
             "--context-parallel-worker", str(out)],
            cwd=ROOT, env=_trainer_env(), capture_output=True, text=True, timeout=600)
        numbers = json.loads(out.read_text()) if out.is_file() else {}
    if proc.returncode != 0 or not numbers:
        return Row("context_parallel", False, f"rc {proc.returncode}: {_tail(proc.stderr)}",
                   CP_GOAL, dict(stderr_tail=(proc.stderr or "")[-2000:]))
    ok = (numbers["logp_max_abs"] <= 5e-2 and numbers["loss_rel"] <= 1e-2
          and numbers["grad_max_rel"] <= 5e-2)
    return Row("context_parallel", ok,
               f"max|d logp| {numbers['logp_max_abs']:.2e}, loss {numbers['loss_rel']:.2e} rel, "
               f"grads {numbers['grad_max_rel']:.2e} of max", CP_GOAL, numbers)


def _stop_after_first_step(cmd: list[str], run: Path, log: Path) -> tuple[int, float]:
    """Start the trainer, SIGTERM it once its first metrics line is written (the trainer
    finishes the step in flight, saves it, exits ``EXIT_STOPPED``). Returns (exit status,
    seconds from the signal to the exit). Its session is killed if it outlives the limits."""
    import signal

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_trainer_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 420
        metrics = run / "metrics.jsonl"
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_text().strip():
                break
            time.sleep(0.1)
        if proc.poll() is not None:
            return proc.returncode, 0.0  # ended before its first step was logged
        if time.monotonic() >= deadline:
            raise TimeoutError("no metrics line within 420 s")
        sent = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=240), time.perf_counter() - sent
    finally:
        if proc.poll() is None:  # the trainer, its engines and reward workers share the session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_tiny_gpu_stop_resume() -> Row:
    from megatron_dgpo.runtime.interrupt import EXIT_STOPPED

    overrides = tiny_gpu_overrides(available_components())
    goal = (f"SIGTERM after the first metrics line: exit {EXIT_STOPPED}, the step in flight "
            f"saved, no export; the same command again: steps continue to {TINY_GPU_STEPS}, "
            f"final checkpoint, HF export{' (' + ' '.join(overrides) + ')' if overrides else ''}")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        # no scheduled saves: the checkpoint after the stop can only be the stop's own
        cmd = tiny_gpu_command(1, overrides + ["checkpoint.save_every=0"], str(run))
        begin = time.perf_counter()
        rc, stop_s = _stop_after_first_step(cmd, run, Path(tmp) / "stopped.log")
        stopped = _run_state(run)
        stop_log = (Path(tmp) / "stopped.log").read_text(errors="replace")
        resumed = subprocess.run(cmd, cwd=ROOT, env=_trainer_env(), capture_output=True,
                                 text=True, timeout=600)
        seconds = time.perf_counter() - begin
        final = _run_state(run)
    at = stopped["steps"][-1] if stopped["steps"] else None
    stop_ok = (rc == EXIT_STOPPED and at is not None and at < TINY_GPU_STEPS
               and stopped["steps"] == list(range(1, at + 1))
               and stopped["latest"] == f"step_{at:06d}" and not stopped["exported"])
    resume_ok = (resumed.returncode == 0 and final["steps"] == list(range(1, TINY_GPU_STEPS + 1))
                 and final["latest"] == f"step_{TINY_GPU_STEPS:06d}" and final["exported"])
    tail = ("" if stop_ok else " | stop: " + _tail(stop_log)) + (
        "" if resume_ok else " | resume: " + _tail(resumed.stderr or resumed.stdout))
    return Row("tiny_gpu_stop_resume", stop_ok and resume_ok,
               f"stop: rc {rc} {stop_s:.0f} s after SIGTERM, steps {stopped['steps']}, latest "
               f"{stopped['latest']}; resume: rc {resumed.returncode}, steps {final['steps']}, "
               f"latest {final['latest']}, export {final['exported']}; {seconds:.0f} s{tail}",
               goal, dict(stop_returncode=rc, stop_seconds_after_signal=stop_s,
                          stopped=stopped, resume_returncode=resumed.returncode, final=final,
                          seconds=seconds, overrides=overrides, stop_log_tail=stop_log[-2000:],
                          resume_stderr_tail=(resumed.stderr or "")[-2000:]))


CHECKS = (
    ("attention_choice", check_attention_choice),
    ("te_attention_selected", check_te_attention_selected),
    ("packed_attention_memory", check_packed_attention_memory),
    ("te_thd_bf16", check_te_thd_bf16),
    ("logprobs_v152064", check_logprobs_v152064),
    ("distopt_checkpoint", check_distopt_checkpoint),
    ("throughput_1p5b", check_throughput_1p5b),
    ("seeded_sampling_v152064", check_seeded_sampling_v152064),  # vLLM enters the process here
    ("vllm_colocated", check_vllm_colocated),  # after the others: vLLM stays in the process
    ("trainer_refuses_unfused", check_trainer_refuses_unfused),
    ("context_parallel", check_context_parallel),
    ("tiny_gpu_stop_resume", check_tiny_gpu_stop_resume),
    *((name, partial(check_tiny_gpu, name)) for name in TINY_GPU_LAYOUTS),
)

NEEDS = {  # what each check needs beyond torch, megatron-core and one CUDA GPU (docstring)
    "attention_choice": (),
    "te_attention_selected": ("TE",),
    "packed_attention_memory": ("TE",),
    "trainer_refuses_unfused": ("TE",),
    "te_thd_bf16": ("TE",),
    "logprobs_v152064": (),
    "distopt_checkpoint": (),
    "throughput_1p5b": ("TE", "apex"),
    "seeded_sampling_v152064": ("vLLM",),
    "vllm_colocated": ("vLLM",),
    "tiny_gpu_stop_resume": (),
    "context_parallel": ("TE", "2 GPUs"),
    "tiny_gpu_run": (),
    "tiny_gpu_tp2": ("2 GPUs",),
    "tiny_gpu_dp2": ("2 GPUs",),
}
COMPONENTS = ("TE", "vLLM", "apex")


def available_components() -> dict:
    """What this machine offers the checks: ``TE`` (``transformer_engine.pytorch`` imports:
    a TE built for another torch counts as absent, as ``gpu_flags.Platform.detect`` has it),
    ``vLLM`` (installed: found, not imported, so that vLLM enters this process only in the
    last in-process check; an installed but broken vLLM fails its checks instead), ``apex``
    (its ``fused_weight_gradient_mlp_cuda`` and ``fused_layer_norm_cuda`` extensions import),
    ``GPUs`` (``torch.cuda.device_count()``)."""
    import importlib.util

    from megatron_dgpo.runtime.gpu_flags import _import_error

    return {"TE": _import_error("transformer_engine.pytorch") is None,
            "vLLM": importlib.util.find_spec("vllm") is not None,
            "apex": all(_import_error(m) is None
                        for m in ("fused_weight_gradient_mlp_cuda", "fused_layer_norm_cuda")),
            "GPUs": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def missing_requirements(needs, available: dict) -> list[str]:
    """The entries of ``needs`` that ``available`` (``available_components``' form) lacks, in
    order: a component name of ``COMPONENTS``, or ``"<n> GPUs"``. Anything else is a typo in
    ``NEEDS`` and raises."""
    missing = []
    for need in needs:
        count = re.fullmatch(r"([0-9]+) GPUs?", need)
        if count:
            if available.get("GPUs", 0) < int(count.group(1)):
                missing.append(need)
        elif need in COMPONENTS:
            if not available.get(need):
                missing.append(need)
        else:
            raise ValueError(f"NEEDS: unknown requirement {need!r}; one of {COMPONENTS} or "
                             f"'<n> GPUs'")
    return missing


def run_check(name: str, fn, available: dict) -> Row:
    """One check: a "not run: needs ..." row (ok None, ``fn`` not called) when ``available``
    lacks what ``NEEDS[name]`` asks for; otherwise ``fn()``'s row, or an error row if it
    raises. ``numbers["check_seconds"]`` is the time it took."""
    begin = time.perf_counter()
    missing = missing_requirements(NEEDS[name], available)
    if missing:
        row = Row(name, None, f"not run: needs {' and '.join(missing)}",
                  f"needs {', '.join(NEEDS[name])}", dict(missing=missing))
    else:
        try:
            with _attention_switches_restored():
                row = fn()
        except Exception as exc:  # reported in the table; the other checks still run
            row = Row(name, False, f"error: {type(exc).__name__}: {exc}"[:400], "runs",
                      dict(traceback=traceback.format_exc()))
    row.numbers["check_seconds"] = time.perf_counter() - begin
    return row


# ------------------------------------------------------------------------------ driver


def _environment() -> dict:
    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return dict(device=torch.cuda.get_device_name(), host=host.node(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                torch=torch.__version__, cuda=torch.version.cuda,
                megatron_core=version("megatron-core"),
                transformer_engine=version("transformer-engine") or version("transformer_engine"),
                vllm=version("vllm"), platform=asdict(_gpu_platform()),
                available=available_components())


def _table(rows: list[Row]) -> str:
    mark = {True: "pass", False: "FAIL", None: "-"}
    lines = ["| check | | result | goal |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.check} | {mark[r.ok]} | {r.result} | {r.goal} |" for r in rows]
    return "\n".join(lines)


def run_checks(names=None, available: dict | None = None) -> list[Row]:
    """Every check (or those in ``names``) in this process; failures become rows, a check
    whose needs ``available`` lacks a "not run" row."""
    from megatron_dgpo.runtime.parallel import ParallelConfig, init_distributed, initialize_parallel
    from megatron_dgpo.command import single_process_world

    available = available_components() if available is None else available
    single_process_world()
    init_distributed()
    initialize_parallel(ParallelConfig(), seed=1234)
    rows = []
    for name, fn in CHECKS:
        if names and name not in names:
            continue
        row = run_check(name, fn, available)
        print(f"{row.check:20s} {'pass' if row.ok else 'FAIL' if row.ok is False else '-':5s} "
              f"{row.result}", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                        help="folder for gpu_check.md and gpu_check.json")
    parser.add_argument("--only", nargs="*", choices=[name for name, _ in CHECKS],
                        help="run only these checks")
    parser.add_argument("--context-parallel-worker", metavar="OUT",
                        help=argparse.SUPPRESS)  # one rank of check_context_parallel
    parser.add_argument("--profile", choices=sorted(PROFILES),
                        help="choose attention as this GPU generation must (a100: TE's cuDNN "
                             "attention off, NVTE_FUSED_ATTN=0)")
    args = parser.parse_args(argv)
    os.environ.update(PROFILES.get(args.profile, {}))  # the trainers started here inherit it
    if args.context_parallel_worker:
        return _context_parallel_worker(args.context_parallel_worker)
    from megatron_dgpo.runtime import gpu_flags

    try:  # a GPU node whose CUDA does not start is a failed check, not a CPU machine
        gpu_flags.require_usable_cuda()
    except RuntimeError as error:
        print(f"gpu_check: FAIL: {error}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print(SKIP_LINE)
        return 0
    env = dict(_environment(), profile=args.profile)
    begin = time.perf_counter()
    rows = run_checks(args.only, env["available"])
    env["total_seconds"] = time.perf_counter() - begin
    table = _table(rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = f" as {args.profile} ({PROFILES[args.profile]})" if args.profile else ""
    header = (f"# gpu_check.py on {env['device']}{profile}\n\n{env['date']}; torch {env['torch']} "
              f"(CUDA {env['cuda']}), megatron-core {env['megatron_core']}, TE "
              f"{env['transformer_engine']}, vLLM {env['vllm']}, apex extensions "
              f"{'yes' if env['available']['apex'] else 'no'}, {env['available']['GPUs']} "
              f"GPU(s); {env['total_seconds']:.0f} s in all.\n\n")
    (out / "gpu_check.md").write_text(header + table + "\n")
    (out / "gpu_check.json").write_text(json.dumps(
        dict(environment=env, checks=[asdict(r) for r in rows]), indent=2, default=str) + "\n")
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
