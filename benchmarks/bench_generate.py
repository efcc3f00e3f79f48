#!/usr/bin/env python
"""Generation throughput: vLLM (the rollout engine) vs transformers (HFEngine), same run, CPU.

Both engines sample the same prompts (built-in set, chat template) with n samples each,
temperature 1.0, top-p 1.0, max_tokens T, fp32, on a freshly built random tiny Qwen2; throughput
counts the response tokens actually produced (random models sometimes stop early). Each engine
gets one untimed warm-up call. vLLM's engine start-up is reported separately.

    python benchmarks/bench_generate.py [--prompts 32 --n 4 --max-tokens 64 --sizes tiny small]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

SIZES = {
    "tiny": dict(),  # hidden 128, 2 layers (~0.4M parameters with the 512-token vocab)
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4),
}


def _timed(engine, prompts, n, max_tokens):
    t0 = time.perf_counter()
    out = engine.generate(prompts, n=n, max_tokens=max_tokens, seed=None)
    dt = time.perf_counter() - t0
    return sum(len(s.token_ids) for g in out for s in g), dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dgpo.rollout.hf_engine import HFEngine
    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, VLLMEngine
    from megatron_dgpo.tasks.prompts import builtin_prompts, render_prompts
    from megatron_dgpo.tasks.tiny import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = make_tiny_model(Path(tmp) / size, seed=0, **SIZES[size])
            tok = AutoTokenizer.from_pretrained(model_dir)
            params = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
            prompts = render_prompts(tok, builtin_prompts()[: args.prompts])
            seqs = len(prompts) * args.n

            hf = HFEngine(model_dir, batch_size=seqs)
            _timed(hf, prompts[:2], args.n, 4)
            hf_tokens, hf_dt = _timed(hf, prompts, args.n, args.max_tokens)
            hf.shutdown()

            t0 = time.perf_counter()
            engine = VLLMEngine(VLLMConfig(model=str(model_dir), dtype="float32", max_model_len=1024,
                                           max_num_seqs=max(seqs, 8), kv_cache_memory_bytes=256 << 20))
            start = time.perf_counter() - t0
            try:
                _timed(engine, prompts[:2], args.n, 4)
                v_tokens, v_dt = _timed(engine, prompts, args.n, args.max_tokens)
            finally:
                engine.shutdown()
            rows.append((size, params, seqs, hf_tokens / hf_dt, v_tokens / v_dt, start, hf_dt, v_dt))

    print(f"\ntorch threads: {torch.get_num_threads()}; {args.prompts} prompts x n={args.n}, max_tokens={args.max_tokens}, fp32, temperature 1.0")
    header = f"{'model':<7}{'params':>10}{'seqs':>6}{'HF tok/s':>11}{'vLLM tok/s':>12}{'speed-up':>10}{'HF s':>8}{'vLLM s':>8}{'vLLM start s':>14}"
    print(header)
    print("-" * len(header))
    for size, params, seqs, hf_tps, v_tps, start, hf_dt, v_dt in rows:
        print(f"{size:<7}{params / 1e6:>9.2f}M{seqs:>6}{hf_tps:>11.0f}{v_tps:>12.0f}{v_tps / hf_tps:>9.1f}x{hf_dt:>8.2f}{v_dt:>8.2f}{start:>14.1f}")


if __name__ == "__main__":
    main()
