#!/usr/bin/env python
"""Packed vs padded micro-batches on a long-CoT-like length mix: non-pad fraction and tokens/s.

    .venv/bin/python benchmarks/bench_packing.py [--samples 64] [--max-len 1024]

Lengths: most responses short, a tail up to the maximum (a log-normal body clipped to max-len,
plus a few samples at the cap, as truncated long chains of thought are). The same samples go
through ``train_step`` (forward + backward of the DGPO loss on a small Qwen2-shaped Megatron
model, one CPU rank) twice:
  padded: micro-batches of --rows samples in arrival order, each padded to its longest;
  packed: first-fit-decreasing rows of at most --max-len tokens (block-diagonal attention).
Reported: non-pad token fraction, wall time, and real (non-pad) tokens per second.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=2048,
             hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
             rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False)


def long_tail_lengths(n: int, max_len: int, prompt: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    body = torch.exp(torch.randn(n, generator=gen) * 0.7 + torch.log(torch.tensor(max_len / 8)))
    lengths = (body.round().long() + prompt).clamp(prompt + 2, max_len)
    lengths[: max(1, n // 16)] = max_len  # truncated at the cap
    return lengths[torch.randperm(n, generator=gen)].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=4, help="samples per padded micro-batch")
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from megatron_dgpo.algorithm.losses import LossConfig, LossHyperparams
    from megatron_dgpo.algorithm.packing import Sample, pack, padded_micro_batch
    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.training.policy import wrap_ddp
    from megatron_dgpo.runtime.parallel import (ParallelConfig, destroy_parallel, init_distributed,
                                                initialize_parallel)
    from megatron_dgpo.training.train_step import train_step

    init_distributed()
    initialize_parallel(ParallelConfig(), seed=0)
    models = wrap_ddp(build_model(MODEL, seed=0))
    lengths = long_tail_lengths(args.samples, args.max_len, args.prompt, seed=0)
    gen = torch.Generator().manual_seed(1)
    samples = []
    for length in lengths:
        n_resp = length - args.prompt
        samples.append(Sample(
            tokens=torch.randint(0, MODEL["vocab_size"], (length,), generator=gen),
            response_start=args.prompt,
            per_token={"old_logprobs": torch.full((n_resp,), -7.6),
                       "advantages": torch.randn(n_resp, generator=gen)}))
    real = sum(lengths)

    def aligned(s, key):
        return torch.cat([torch.zeros(s.response_start), s.per_token[key]])

    padded = [padded_micro_batch([s.tokens for s in group],
                                 [torch.arange(len(s.tokens)) >= s.response_start
                                  for s in group],
                                 [aligned(s, "old_logprobs") for s in group],
                                 [aligned(s, "advantages") for s in group])
              for group in (samples[i:i + args.rows]
                            for i in range(0, len(samples), args.rows))]
    packed = pack(samples, budget=args.max_len)
    loss = LossConfig(method="dgpo", loss=LossHyperparams(n=1, m=2))

    results = {}
    for name, micro_batches in (("padded", padded), ("packed", packed)):
        train_step(models, micro_batches[:1], loss)  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            step = train_step(models, micro_batches, loss)
            best = min(best, time.perf_counter() - start)
        total = sum(mb.tokens.numel() for mb in micro_batches)
        results[name] = dict(micro_batches=len(micro_batches), tokens=total,
                             non_pad=real / total, seconds=best, tok_s=real / best,
                             loss=step.loss)
    destroy_parallel()

    lengths_sorted = sorted(lengths)
    print(f"{args.samples} samples, lengths min {lengths_sorted[0]}, median "
          f"{lengths_sorted[len(lengths) // 2]}, max {lengths_sorted[-1]} (cap {args.max_len}); "
          f"{real} real tokens; model hidden {MODEL['hidden_size']}, "
          f"{MODEL['num_hidden_layers']} layers, 1 CPU rank, {torch.get_num_threads()} threads")
    print(f"| layout | micro-batches | tokens processed | non-pad fraction | fwd+bwd s | "
          f"real tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['micro_batches']} | {r['tokens']} | {r['non_pad']:.1%} | "
              f"{r['seconds']:.2f} | {r['tok_s']:.0f} |")
    speedup = results["packed"]["tok_s"] / results["padded"]["tok_s"]
    same = abs(results["packed"]["loss"] - results["padded"]["loss"]) <= 1e-5 * abs(
        results["padded"]["loss"])
    print(f"packed / padded tokens/s: {speedup:.2f}x (target >= 2x); packed non-pad "
          f"{results['packed']['non_pad']:.1%} (target >= 97%); same loss: {same}")


if __name__ == "__main__":
    main()
