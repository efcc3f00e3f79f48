"""Rank functions for tests/algorithm/test_vocab_parallel.py (module level so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dgpo.algorithm.vocab_parallel import logprobs_and_entropy

VOCAB = 96  # divisible by 1, 2, 4
REAL_VOCAB = 90  # the last 6 columns play TP padding


def reference(logits64: torch.Tensor, targets, temperature, vocab, g, h):
    """Float64 full-vocabulary log-probs, entropy and d(sum g logp + sum h H)/d logits."""
    x = logits64.clone().requires_grad_(True)
    logsm = torch.log_softmax(x[..., :vocab] / temperature, dim=-1)
    logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    loss = (g.double() * logp).sum() + (0.0 if h is None else (h.double() * entropy).sum())
    loss.backward()
    return logp.detach(), entropy.detach(), x.grad


def _rel(got, want):
    return float((got.detach().double() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def tp_cases_fn(rank, world_size):
    """Every (TP, dtype, temperature, entropy_grad, vocab, chunk) case; worst relative errors."""
    groups = {1: None, world_size: dist.group.WORLD}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank joins both
    groups[2] = pairs[rank // 2]
    gen = torch.Generator().manual_seed(7)
    full32 = torch.randn(3, 11, VOCAB, generator=gen) * 4.0
    targets = torch.randint(0, REAL_VOCAB, (3, 11), generator=gen)
    g = torch.randn(3, 11, generator=gen)
    h = torch.randn(3, 11, generator=gen)
    out = []
    for tp, group in sorted(groups.items()):
        for dtype in (torch.float32, torch.bfloat16):
            for temperature, entropy_grad, vocab, chunk in ((1.0, False, VOCAB, None),
                                                            (0.7, True, REAL_VOCAB, 4),
                                                            (1.3, True, VOCAB, 1)):
                out.append(_case(full32.to(dtype), targets, g, h, group, tp, temperature,
                                 entropy_grad, vocab, chunk))
    return out


def _case(full, targets, g, h, group, tp, temperature, entropy_grad, vocab, chunk,
          kernel="auto"):
    """One forward + backward of this rank's shard of ``full`` against the float64 reference:
    worst relative errors, output dtypes and flags."""
    r = 0 if group is None else dist.get_rank(group)
    width = full.shape[-1] // tp
    shard = full[..., r * width:(r + 1) * width].clone().requires_grad_(True)
    before = shard.detach().clone()
    logp, ent = logprobs_and_entropy(shard, targets, group=group, temperature=temperature,
                                     chunk_size=chunk, entropy_grad=entropy_grad,
                                     vocab_size=vocab, kernel=kernel)
    loss = (g * logp).sum() + ((h * ent).sum() if entropy_grad else 0.0)
    loss.backward()
    want_lp, want_h, want_grad = reference(full.double(), targets, temperature, vocab, g,
                                           h if entropy_grad else None)
    return dict(tp=tp, dtype=str(full.dtype), temperature=temperature,
                entropy_grad=entropy_grad, vocab=vocab, chunk=chunk, kernel=kernel,
                logp=_rel(logp, want_lp), entropy=_rel(ent, want_h),
                grad=_rel(shard.grad, want_grad[..., r * width:(r + 1) * width]),
                out_dtypes=(str(logp.dtype), str(ent.dtype)),
                ent_requires_grad=ent.requires_grad,
                # exact: the input untouched by the kernel, compared with its copy
                unmodified=bool(torch.equal(shard.detach(), before)),
                grad_dtype=str(shard.grad.dtype))


def compiled_cases(rank, world_size):
    """The compiled kernels (inductor's CPU backend) at TP = world_size: float32 log-probs only
    and with the entropy gradient, bf16 logits (bf16 gradient) with it; T != 1, TP padding
    columns, 33 tokens in chunks of 5 (the last one 3 rows), logits [1, 33, V] as the trainer
    has them."""
    group = dist.group.WORLD if world_size > 1 else None
    gen = torch.Generator().manual_seed(5)
    full32 = torch.randn(1, 33, VOCAB, generator=gen) * 4.0
    targets = torch.randint(0, REAL_VOCAB, (1, 33), generator=gen)
    g = torch.randn(1, 33, generator=gen)
    h = torch.randn(1, 33, generator=gen)
    return [_case(full32.to(dtype), targets, g, h, group, world_size, temperature, entropy_grad,
                  REAL_VOCAB, 5, kernel="compiled")
            for dtype, temperature, entropy_grad in ((torch.float32, 0.7, False),
                                                     (torch.float32, 0.7, True),
                                                     (torch.bfloat16, 1.3, True))]


QWEN2_VOCAB = 152064  # Qwen2's padded vocabulary
QWEN2_REAL_VOCAB = 151936  # its HF vocab_size
LARGE_SCALES = (1.0, 4.0, 16.0)


def large_vocab_grad_errors(rank, world_size, kernels=("eager", "compiled")):
    """Max |gradient error| and relative log-prob error against the float64 reference on
    float32 rows of scale 1..16 over the Qwen2 vocabulary (its 151936 real columns of 152064,
    the rest TP padding), this rank's shard of a TP=world_size split (world_size 1: one
    process), with each of ``kernels``, in chunks of 2 rows.

    Cases: log-probs only at T = 1, and log-probs + entropy gradient at T = 0.7.
    """
    group = dist.group.WORLD if world_size > 1 else None
    width = QWEN2_VOCAB // world_size
    gen = torch.Generator().manual_seed(11)
    out = []
    for scale in LARGE_SCALES:
        full = torch.randn(4, QWEN2_VOCAB, generator=gen) * scale
        targets = torch.randint(0, QWEN2_REAL_VOCAB, (4,), generator=gen)
        g = torch.randn(4, generator=gen)
        h = torch.randn(4, generator=gen)
        for temperature, entropy_grad in ((1.0, False), (0.7, True)):
            want_lp, _, want = reference(full.double(), targets, temperature, QWEN2_REAL_VOCAB,
                                         g, h if entropy_grad else None)
            for kernel in kernels:
                shard = full[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
                logp, ent = logprobs_and_entropy(shard, targets, group=group,
                                                 temperature=temperature, chunk_size=2,
                                                 entropy_grad=entropy_grad,
                                                 vocab_size=QWEN2_REAL_VOCAB, kernel=kernel)
                ((g * logp).sum() + ((h * ent).sum() if entropy_grad else 0.0)).backward()
                err = (shard.grad.double() - want[:, rank * width:(rank + 1) * width]).abs().max()
                out.append(dict(tp=world_size, scale=scale, temperature=temperature,
                                entropy_grad=entropy_grad, kernel=kernel, err=float(err),
                                logp_rel=_rel(logp, want_lp)))
    return out


def large_vocab_and_compiled_cases(rank, world_size):
    """At TP = world_size: the start-up build of the compiled kernels in float32 and bf16
    (``compiled_kernels_work``), then ``large_vocab_grad_errors`` ([4, V] logits, chunks of 2
    rows), ``compiled_cases`` ([1, 33, V], chunks of 5) and a forward without grad (the old
    log-probs' call) on bf16 [1, 9, V] logits in chunks of 4 (the last one 1 row); one launch
    for three tests of tests/algorithm/test_vocab_parallel.py. ``graphs``: whether each build
    worked, and the graphs dynamo compiled in the builds and after them."""
    from torch._dynamo.utils import counters

    from megatron_dgpo.algorithm.vocab_parallel import compiled_kernels_work

    built = [compiled_kernels_work(torch.device("cpu"), dtype)
             for dtype in (torch.float32, torch.bfloat16)]
    at_start = counters["stats"]["unique_graphs"]
    out = dict(large_vocab=large_vocab_grad_errors(rank, world_size),
               compiled=compiled_cases(rank, world_size))
    width = VOCAB // world_size
    logits = torch.randn(1, 9, VOCAB, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logprobs_and_entropy(logits[..., rank * width:(rank + 1) * width].bfloat16(),
                             torch.zeros(1, 9, dtype=torch.long),
                             group=dist.group.WORLD if world_size > 1 else None, chunk_size=4,
                             vocab_size=REAL_VOCAB, kernel="compiled")
    out["graphs"] = dict(built=built, start_up=at_start,
                         later=counters["stats"]["unique_graphs"] - at_start)
    return out


def training_run_start_up(rank, world_size, recipe, run_dir):
    """A ``TrainingRun`` of ``recipe`` built with ``vocab_parallel.compiled_by_default`` watched:
    each call's (device, dtype, answer, whether vLLM was imported then); the run's (device,
    dtype); whether any probe build ran (``compiled_kernels_work``)."""
    import sys

    from megatron_dgpo.algorithm import vocab_parallel
    from megatron_dgpo.recipe import load_recipe
    from megatron_dgpo.training_run import TrainingRun

    calls, real = [], vocab_parallel.compiled_by_default

    def watched(device, dtype):
        answer = real(device, dtype)
        calls.append((str(device), str(dtype), answer, "vllm" in sys.modules))
        return answer

    vocab_parallel.compiled_by_default = watched
    run = TrainingRun(load_recipe(recipe, [f"run_dir={run_dir}"]), seed=1, steps=1,
                      max_minutes=None)
    return dict(calls=calls, run=(str(next(run.models[0].parameters()).device), str(run.dtype)),
                probed=vocab_parallel._compiled_kernels_work_on.cache_info().currsize)
