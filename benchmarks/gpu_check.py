"""The GPU path, checked in one command on one 80 GB GPU (under 10 minutes).

    python benchmarks/gpu_check.py [--out benchmarks/results] [--only NAME ...]

Prints one row per check and writes ``<out>/gpu_check.md`` and ``<out>/gpu_check.json``
(device, versions, every number). Each check is its own function; one that raises is reported
as an error row and the others still run. Exit status 1 if a check failed, else 0. Without
CUDA it prints one line saying it skipped and exits 0 (the CPU test suite runs it that way).

Checks (one GPU, a world of one rank, TP = PP = DP = 1):

* ``te_thd_fp32`` / ``te_thd_bf16``: the Transformer-Engine layer spec with a packed row as
  THD ``PackedSeqParams`` (fused RoPE where TE has it) against Megatron's local spec with a
  block-diagonal causal mask, same weights, same packed row: log-probs and parameter gradients
  of sum_t w_t log p_t. fp32: tight (max |d log p| <= 1e-4, gradients <= 1e-3 relative). bf16:
  each is compared with the fp32 local model; TE's error must be within 2x (+ 1e-3) the local
  bf16 path's own error (bf16 rounding, not the attention kernel, sets the tolerance).
* ``logprobs_v152064``: ``vocab_parallel.logprobs_and_entropy`` forward + backward on bf16
  logits [8192, 152064]: peak extra memory in multiples of the shard (goal <= 1.0x beside the
  gradient the backward must return, which is itself 1.0x) and time in multiples of one read of
  the shard (goal <= 2x), beside Megatron's ``vocab_parallel_cross_entropy`` in the same run;
  log-probs against float32 ``log_softmax`` on 256 rows.
* ``distopt_checkpoint``: bf16 policy through ``Float16Module`` (bf16 logits out), Megatron
  DDP + distributed optimizer with the GPU flags of ``gpu_config`` (overlapped grad reduce and
  param gather), one update, an async dist-checkpoint save (``checkpoint.AsyncSaver``), then
  the next update from the live model and from a fresh model loaded from the checkpoint:
  bitwise equal parameters.
* ``vllm_colocated``: CUDA vLLM (bf16) beside the trainer on the same GPU: generate -> sleep ->
  one training update -> wake -> refit (``export_hf_weights``) -> generate -> the rollout vs
  trainer log-prob mismatch (mean |d|, exp(mean |d|) - 1), before and after the update. The
  refit worked if the mismatch after it is not larger than before (x3).
* ``throughput_1p5b``: a DeepSeek-R1-Distill-Qwen-1.5B-shaped Qwen2 (random bf16 weights, TE,
  packed 8192-token rows, the trainer's GPU flags) forward + backward through the log-prob
  kernel: tokens/s and MFU (model FLOPs, recompute not counted), recompute off and on. Goal on
  H100: MFU >= 45% without recompute.
* ``tiny_gpu_run``: ``python -m megatron_dgpo.train recipes/tiny_gpu.yaml`` for its 5 steps:
  5 metric lines, the last checkpoint published by the async saver, the HF export.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform as host
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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
    from megatron_dgpo.vocab_parallel import logprobs_and_entropy

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
    from megatron_dgpo.gpu_config import Platform

    return Platform.detect()


def _bf16_policy(hf_config, *, seed: int, recompute: bool = False,
                 use_distributed_optimizer: bool = True):
    """The trainer's bf16 policy: GPTModel (this machine's spec and flags) in Float16Module in
    Megatron DDP with ``gpu_config.ddp_flags``."""
    from megatron.core.transformer.module import Float16Module

    from megatron_dgpo.gpu_config import ddp_flags
    from megatron_dgpo.model import build_model

    overrides = dict(bf16=True)
    if recompute:
        overrides.update(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    chunks = build_model(hf_config, dtype=torch.bfloat16, seed=seed, **overrides)
    flags = ddp_flags(_gpu_platform(), use_distributed_optimizer=use_distributed_optimizer)
    return _wrap_for_training([Float16Module(c.config, c) for c in chunks], chunks[0].hf_spec,
                              flags)


def _policy_update(models, optimizer, row, vocab_size) -> float:
    """One update on one packed row: bf16 logits (``fp32_output=False``) into the log-prob
    kernel, backward, grad sync, optimizer step. Returns the loss."""
    from megatron_dgpo.optimizer import step_if_finite

    tokens, cu, targets, weights = row
    for model in models:
        model.zero_grad_buffer()
    optimizer.zero_grad()
    logits = _logits(models[0], tokens, cu, thd=_gpu_platform().transformer_engine,
                     fp32_output=False)
    loss, _ = _weighted_logprob_loss(logits, targets, weights / len(tokens), vocab_size)
    loss.backward()
    for model in models:
        model.finish_grad_sync()
    stepped, _ = step_if_finite(optimizer, models, float(loss))
    if not stepped:
        raise RuntimeError("the optimizer skipped the update (non-finite gradients)")
    return float(loss)


def _params(models) -> dict:
    from megatron_dgpo.model import unwrap_model
    from megatron_dgpo.optimizer import sync_params

    sync_params(models)
    return {n: p.detach().clone() for n, p in unwrap_model(models[0]).named_parameters()}


# ------------------------------------------------------------------------------ checks


def _te_vs_local(dtype: torch.dtype):
    """(log-probs, grads by local name) of the TE+THD and local+mask models (same weights)."""
    from megatron_dgpo.gpu_config import Platform
    from megatron_dgpo.model import build_model

    te_platform = _gpu_platform()
    if not te_platform.transformer_engine:
        raise RuntimeError("Transformer-Engine is not installed: nothing to compare")
    kwargs = dict(dtype=dtype, seed=3, gradient_accumulation_fusion=False)  # no DDP main_grad
    te = build_model(SMALL_QWEN2, platform=te_platform, **kwargs)[0]
    local = build_model(SMALL_QWEN2, platform=Platform(cuda=True), **kwargs)[0]
    te_params = dict(te.named_parameters())
    with torch.no_grad():
        for name, param in local.named_parameters():
            param.copy_(te_params[_find_te_name(te_params, name)])
    row = _packed_row(PACKED_LENGTHS, SMALL_QWEN2["vocab_size"], seed=0)
    out = {}
    for label, model, thd in (("te", te, True), ("local", local, False)):
        logits = _logits(model, row[0], row[1], thd=thd)
        loss, logp = _weighted_logprob_loss(logits, row[2], row[3], SMALL_QWEN2["vocab_size"])
        loss.backward()
        names = {n: (n if label == "local" else _te_to_local(n)) for n, _ in
                 model.named_parameters()}
        out[label] = (logp.float(), {names[n]: p.grad.float() for n, p in
                                     model.named_parameters()})
    return out


def _find_te_name(te_params: dict, local_name: str) -> str:
    for name in te_params:
        if _te_to_local(name) == local_name:
            return name
    raise KeyError(f"no TE parameter for {local_name}")


def _agreement(a, b) -> tuple[float, float, float]:
    """(max |d log p|, mean |d log p|, max over parameters of max|d grad| / max|grad|)."""
    (lp_a, g_a), (lp_b, g_b) = a, b
    d = (lp_a - lp_b).abs()
    grad = max(float((g_a[n] - g_b[n]).abs().max() / g_b[n].abs().max().clamp_min(1e-30))
               for n in g_b)
    return float(d.max()), float(d.mean()), grad


def check_te_thd_fp32() -> Row:
    goal = "max |d logp| <= 1e-4, grads <= 1e-3 rel."
    out = _te_vs_local(torch.float32)
    lp_max, lp_mean, grad = _agreement(out["te"], out["local"])
    ok = lp_max <= 1e-4 and grad <= 1e-3
    return Row("te_thd_fp32", ok, f"max |d logp| {lp_max:.2e}, mean {lp_mean:.2e}, "
               f"grads {grad:.2e} rel.", goal,
               dict(logp_max_abs=lp_max, logp_mean_abs=lp_mean, grad_max_rel=grad))


def check_te_thd_bf16() -> Row:
    goal = "TE+THD bf16 error vs fp32 <= 2x local bf16 error + 1e-3"
    reference = _te_vs_local(torch.float32)["local"]
    out = _te_vs_local(torch.bfloat16)
    te = _agreement(out["te"], reference)
    local = _agreement(out["local"], reference)
    ok = te[0] <= 2 * local[0] + 1e-3 and te[2] <= 2 * local[2] + 1e-3
    return Row("te_thd_bf16", ok,
               f"vs fp32: TE max|d logp| {te[0]:.2e} grads {te[2]:.2e}; local bf16 "
               f"{local[0]:.2e} / {local[2]:.2e}", goal,
               dict(te_logp_max_abs=te[0], te_logp_mean_abs=te[1], te_grad_max_rel=te[2],
                    local_logp_max_abs=local[0], local_logp_mean_abs=local[1],
                    local_grad_max_rel=local[2]))


def check_logprobs_v152064() -> Row:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_dgpo.vocab_parallel import logprobs_and_entropy

    goal = "extra memory <= 1.0x shard beside the gradient; time <= 2x one read"
    tokens = ROW_TOKENS
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(tokens, V_QWEN2, device="cuda", generator=gen) * 3).bfloat16()
    targets = torch.randint(0, V_QWEN2, (tokens,), device="cuda", generator=gen)
    weights = torch.rand(tokens, device="cuda", generator=gen)
    shard = logits.numel() * logits.element_size()

    def ours():
        x = logits.detach().requires_grad_()
        logp, _ = logprobs_and_entropy(x, targets)
        (logp * weights).sum().backward()
        return logp.detach(), x.grad

    def megatron(copy):
        loss = vocab_parallel_cross_entropy(copy[:, None], targets[:, None])  # [s, b] layout
        (loss[:, 0] * weights).sum().backward()

    read = _timed(lambda: logits.amax())
    extra, (logp, grad) = _peak_extra(ours)
    del grad
    t_ours = _timed(ours)
    with torch.no_grad():
        ref = torch.log_softmax(logits[:256].float(), -1).gather(1, targets[:256, None])[:, 0]
    error = float((logp[:256] - ref).abs().max())
    copy = logits.detach().clone().requires_grad_()  # Megatron's kernel works in place
    m_extra, _ = _peak_extra(lambda: megatron(copy))
    t_meg = _timed(lambda: megatron(logits.detach().clone().requires_grad_()))
    beside_grad = extra / shard - 1.0
    ok = beside_grad <= 1.0 and t_ours / read <= 2.0 and error <= 1e-3
    return Row("logprobs_v152064", ok,
               f"dgpo: {extra / shard:.2f}x shard ({beside_grad:.2f}x beside the gradient), "
               f"{t_ours / read:.1f}x one read ({t_ours * 1e3:.1f} ms); megatron CE: "
               f"{m_extra / shard:.2f}x, {t_meg / read:.1f}x; |d logp| vs fp32 {error:.1e}",
               goal, dict(shard_bytes=shard, read_ms=read * 1e3, dgpo_ms=t_ours * 1e3,
                          dgpo_extra_x_shard=extra / shard, dgpo_time_x_read=t_ours / read,
                          megatron_ms=t_meg * 1e3, megatron_extra_x_shard=m_extra / shard,
                          megatron_time_x_read=t_meg / read, logp_max_abs_vs_fp32=error))


def check_distopt_checkpoint() -> Row:
    from megatron_dgpo.checkpoint import (AsyncSaver, TrainerState, latest_checkpoint,
                                          load_checkpoint, save_checkpoint)
    from megatron_dgpo.model import unwrap_model
    from megatron_dgpo.optimizer import build_optimizer
    from megatron_dgpo.recipe import OptimizerConfig

    goal = "next update bitwise equal after save/load"
    config = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
    vocab = SMALL_QWEN2["vocab_size"]
    rows = [_packed_row(PACKED_LENGTHS, vocab, seed=s) for s in (1, 2)]

    def policy(seed):
        models = _bf16_policy(SMALL_QWEN2, seed=seed)
        return models, build_optimizer(config, models, lr=1e-3, bf16=True)

    live, live_opt = policy(seed=1)
    _policy_update(live, live_opt, rows[0], vocab)
    with tempfile.TemporaryDirectory() as root:
        saver = AsyncSaver()
        begin = time.perf_counter()
        save_checkpoint(root, TrainerState(step=1), live, live_opt, hf_config=SMALL_QWEN2,
                        padded_vocab_size=unwrap_model(live[0]).vocab_size,
                        dtype=torch.bfloat16, saver=saver)
        blocked = time.perf_counter() - begin
        published_early = latest_checkpoint(root) is not None
        saver.wait()
        _policy_update(live, live_opt, rows[1], vocab)
        expected = _params(live)
        fresh, fresh_opt = policy(seed=2)
        load_checkpoint(latest_checkpoint(root), fresh, fresh_opt)
        _policy_update(fresh, fresh_opt, rows[1], vocab)
        got = _params(fresh)
    unequal = [n for n in expected if not torch.equal(expected[n], got[n])]
    ok = not unequal
    return Row("distopt_checkpoint", ok,
               f"{len(expected) - len(unequal)}/{len(expected)} tensors bitwise equal; async "
               f"save returned after {blocked:.2f} s (published before wait: "
               f"{published_early})", goal,
               dict(tensors=len(expected), unequal=unequal[:10], save_blocking_s=blocked,
                    published_before_wait=published_early))


def _colocated_engine(hf_dir: str):
    """The rollout engine on this GPU with sleep mode, and its (sleep, wake) calls: the
    engine's own ``sleep`` where it has one (its refit wakes it), else vLLM's
    ``LLM.sleep(level=1)`` / ``wake_up()``. The only place this check touches the engine API
    beyond ``generate`` / ``update_weights``."""
    import dataclasses

    from megatron_dgpo.rollout import VLLMConfig, VLLMEngine

    fields = {f.name for f in dataclasses.fields(VLLMConfig)}
    kwargs = dict(model=hf_dir, dtype="bfloat16", seed=0, max_model_len=512, max_num_seqs=64,
                  gpu_memory_utilization=0.25)
    if "sleep_mode" in fields:
        kwargs["sleep_mode"] = True
    else:
        kwargs["engine_kwargs"] = {"enable_sleep_mode": True}
    engine = VLLMEngine(VLLMConfig(**kwargs))
    if hasattr(engine, "sleep"):
        return engine, engine.sleep, (lambda: None)
    return engine, (lambda: engine.llm.sleep(level=1)), (lambda: engine.llm.wake_up())


def _trainer_logprobs(models, samples, prompts, vocab_size):
    """(trainer log-probs, vLLM log-probs) of the sampled tokens, one packed row."""
    tokens, cu, picks = [], [0], []
    for sample in samples:
        prompt = prompts[sample.prompt_index]
        seq = list(prompt) + list(sample.token_ids)
        start = cu[-1]
        picks.extend(range(start + len(prompt) - 1, start + len(seq) - 1))
        tokens.extend(seq)
        cu.append(start + len(seq))
    tokens = torch.tensor(tokens)
    targets = torch.roll(tokens, -1)
    with torch.no_grad():
        logits = _logits(models[0], tokens, torch.tensor(cu, dtype=torch.int32),
                         thd=_gpu_platform().transformer_engine, fp32_output=False)
        from megatron_dgpo.vocab_parallel import logprobs_and_entropy

        logp, _ = logprobs_and_entropy(logits, targets[None].cuda(), vocab_size=vocab_size)
    trainer = logp[0, torch.tensor(picks, device="cuda")].float().cpu()
    rollout = torch.tensor([lp for s in samples for lp in s.logprobs])
    return trainer, rollout


def check_vllm_colocated() -> Row:
    from megatron_dgpo.convert import export_hf_weights, load_model
    from megatron_dgpo.optimizer import build_optimizer
    from megatron_dgpo.recipe import OptimizerConfig
    from megatron_dgpo.tiny import make_tiny_model

    goal = "mismatch after sleep/train/wake/refit <= 3x before (bf16)"
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(make_tiny_model(Path(tmp) / "policy", seed=0, hidden_size=256,
                                     intermediate_size=512, num_attention_heads=4,
                                     num_key_value_heads=2))
        engine, sleep, wake = _colocated_engine(hf_dir)
        try:
            from megatron.core.transformer.module import Float16Module

            from megatron_dgpo.gpu_config import ddp_flags

            chunks = load_model(hf_dir, dtype=torch.bfloat16, bf16=True)
            spec = chunks[0].hf_spec
            models = _wrap_for_training([Float16Module(c.config, c) for c in chunks], spec,
                                        ddp_flags(_gpu_platform(),
                                                  use_distributed_optimizer=True))
            optimizer = build_optimizer(OptimizerConfig(lr=2e-3, use_distributed_optimizer=True),
                                        models, lr=2e-3, bf16=True)
            tokenizer = engine.tokenizer
            prompts = [tokenizer.encode(f"Repeat the digit {d}.") for d in range(8)]
            stats = []
            for phase in ("before", "after"):
                begin = time.perf_counter()
                groups = engine.generate(prompts, n=4, temperature=1.0, max_tokens=48, seed=7)
                generate_s = time.perf_counter() - begin
                samples = [s for g in groups for s in g]
                trainer, rollout = _trainer_logprobs(models, samples, prompts, spec.vocab_size)
                d = (trainer - rollout).abs()
                stats.append(dict(phase=phase, mean_abs=float(d.mean()), max_abs=float(d.max()),
                                  token_mult_error=math.expm1(float(d.mean())),
                                  tokens=int(d.numel()), generate_s=generate_s))
                if phase == "after":
                    break
                sleep()
                free_asleep = torch.cuda.mem_get_info()[0]
                row = _packed_row((300, 200, 12), spec.vocab_size, seed=5)
                _policy_update(models, optimizer, row, spec.vocab_size)
                wake()
                begin = time.perf_counter()
                from megatron_dgpo.optimizer import sync_params

                sync_params(models)
                engine.update_weights(export_hf_weights(models, consumer="first"))
                refit_s = time.perf_counter() - begin
        finally:
            engine.shutdown()
    before, after = stats
    ok = after["mean_abs"] <= 3 * max(before["mean_abs"], 1e-3)
    return Row("vllm_colocated", ok,
               f"mean |d| {before['mean_abs']:.2e} -> {after['mean_abs']:.2e} (token mult. "
               f"error {after['token_mult_error']:.2e}); refit {refit_s:.2f} s", goal,
               dict(before=before, after=after, refit_s=refit_s,
                    free_gib_while_asleep=free_asleep / 2**30))


def _wrap_for_training(chunks, spec, flags):
    """``chunks`` (in Float16Module) in Megatron DDP with ``gpu_config.ddp_flags``."""
    from megatron_dgpo.train_step import wrap_ddp

    for chunk in chunks:
        chunk.hf_spec = spec
    return wrap_ddp(chunks, **flags)


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


def _forward_backward(hf_config, row, *, recompute: bool):
    """A closure: one forward + backward of a fresh bf16 policy on ``row`` (no optimizer)."""
    models = _bf16_policy(hf_config, seed=0, recompute=recompute, use_distributed_optimizer=False)
    thd = _gpu_platform().transformer_engine

    def step():
        for model in models:
            model.zero_grad_buffer()
        logits = _logits(models[0], row[0], row[1], thd=thd, fp32_output=False)
        loss, _ = _weighted_logprob_loss(logits, row[2], row[3], hf_config["vocab_size"])
        loss.backward()
        for model in models:
            model.finish_grad_sync()

    return step


def check_throughput_1p5b() -> Row:
    goal = "MFU >= 45% on H100 (recompute off)"
    gen = torch.Generator().manual_seed(0)
    lengths, left = [], ROW_TOKENS
    while left > 0:
        n = min(left, int(torch.randint(300, 3000, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    row = _packed_row(lengths, QWEN2_1P5B["vocab_size"], seed=0)
    flops = _model_flops(QWEN2_1P5B, lengths)
    peak = _peak_flops()
    results = {}
    for recompute in (False, True):
        torch.cuda.reset_peak_memory_stats()
        seconds = _timed(_forward_backward(QWEN2_1P5B, row, recompute=recompute), repeats=5)
        key = "recompute" if recompute else "no_recompute"
        results[key] = dict(seconds=seconds, tokens_per_s=ROW_TOKENS / seconds,
                            mfu=flops / seconds / peak if peak else None,
                            peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.empty_cache()
    off, on = results["no_recompute"], results["recompute"]
    ok = (off["mfu"] >= 0.45) if off["mfu"] is not None else None
    mfu = (lambda r: f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a")
    return Row("throughput_1p5b", ok,
               f"{off['tokens_per_s']:,.0f} tok/s MFU {mfu(off)} ({off['peak_gib']:.0f} GiB); "
               f"recompute {on['tokens_per_s']:,.0f} tok/s MFU {mfu(on)} "
               f"({on['peak_gib']:.0f} GiB)", goal,
               dict(results, row_lengths=lengths, flops_per_row=flops, peak_flops=peak))


def check_tiny_gpu_run() -> Row:
    goal = "5 steps, checkpoint step_000005 published, HF export"
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        begin = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_dgpo.train", str(ROOT / "recipes/tiny_gpu.yaml"),
             f"run_dir={tmp}/run", "logging.progress_bar=false"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
        seconds = time.perf_counter() - begin
        run = Path(tmp) / "run"
        lines = []
        if (run / "metrics.jsonl").is_file():
            lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        latest = (run / "checkpoints" / "latest")
        latest = latest.read_text().strip() if latest.is_file() else None
        exported = (run / "hf" / "config.json").is_file()
    last = lines[-1] if lines else {}
    ok = proc.returncode == 0 and len(lines) == 5 and latest == "step_000005" and exported
    tail = "" if ok else " | " + (proc.stderr or proc.stdout)[-300:].replace("\n", " ")
    return Row("tiny_gpu_run", ok,
               f"rc {proc.returncode}, {len(lines)} steps in {seconds:.0f} s, latest {latest}, "
               f"export {exported}, last mismatch "
               f"{last.get('mismatch/mean_abs_diff', float('nan')):.2e}{tail}", goal,
               dict(returncode=proc.returncode, steps=len(lines), seconds=seconds,
                    latest=latest, exported=exported, last_metrics=last,
                    stderr_tail=(proc.stderr or "")[-2000:]))


CHECKS = (
    ("te_thd_fp32", check_te_thd_fp32),
    ("te_thd_bf16", check_te_thd_bf16),
    ("logprobs_v152064", check_logprobs_v152064),
    ("distopt_checkpoint", check_distopt_checkpoint),
    ("vllm_colocated", check_vllm_colocated),
    ("throughput_1p5b", check_throughput_1p5b),
    ("tiny_gpu_run", check_tiny_gpu_run),
)


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
                vllm=version("vllm"), platform=asdict(_gpu_platform()))


def _table(rows: list[Row]) -> str:
    mark = {True: "pass", False: "FAIL", None: "-"}
    lines = ["| check | | result | goal |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.check} | {mark[r.ok]} | {r.result} | {r.goal} |" for r in rows]
    return "\n".join(lines)


def run_checks(names=None) -> list[Row]:
    """Every check (or those in ``names``) in this process; failures become rows."""
    from megatron_dgpo.parallel import ParallelConfig, init_distributed, initialize_parallel
    from megatron_dgpo.train import _single_process_world

    _single_process_world()
    init_distributed()
    initialize_parallel(ParallelConfig(), seed=1234)
    rows = []
    for name, fn in CHECKS:
        if names and name not in names:
            continue
        begin = time.perf_counter()
        try:
            row = fn()
        except Exception as exc:  # reported in the table; the other checks still run
            row = Row(name, False, f"error: {type(exc).__name__}: {exc}"[:400], "runs",
                      dict(traceback=traceback.format_exc()))
        row.numbers["check_seconds"] = time.perf_counter() - begin
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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(SKIP_LINE)
        return 0
    env = _environment()
    begin = time.perf_counter()
    rows = run_checks(args.only)
    env["total_seconds"] = time.perf_counter() - begin
    table = _table(rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"# gpu_check.py on {env['device']}\n\n{env['date']}; torch {env['torch']} "
              f"(CUDA {env['cuda']}), megatron-core {env['megatron_core']}, TE "
              f"{env['transformer_engine']}, vLLM {env['vllm']}; {env['total_seconds']:.0f} s "
              f"in all.\n\n")
    (out / "gpu_check.md").write_text(header + table + "\n")
    (out / "gpu_check.json").write_text(json.dumps(
        dict(environment=env, checks=[asdict(r) for r in rows]), indent=2, default=str) + "\n")
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
