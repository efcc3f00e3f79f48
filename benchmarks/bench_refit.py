#!/usr/bin/env python
"""Weight refit of the vLLM engine: one safetensors blob (the method before buckets) vs buckets.

One run, one random Qwen2 of a few hundred MB (fp32, built with ``megatron_dgpo.tasks.tiny``), its
weights resident in this process as the trainer's would be. Each method refits the engine from
the same in-memory (name, tensor) stream, ``--repeats`` times; reported: median seconds, bucket
count, largest payload, and the peak resident memory above the level before the refit (RSS of
this process plus its children, i.e. the separate engine process, sampled every 5 ms).

    blob       separate engine, whole model -> one safetensors payload -> collective_rpc
    buckets    separate engine, ``VLLMEngine.update_weights`` with --bucket-mib buckets
    in-process colocated engine (external_launcher, 1 rank), ``update_weights`` in process

and then the tiny job's step (``recipes/tiny_cpu.yaml``, ``--job-steps`` steps, medians over
steps 2..) with 1 engine (1 rank) and with 2 engines (torchrun, 2 ranks, DP=2: each engine
samples half of the prompts): seconds per step, per rollout, generated tokens/s per engine.

    python benchmarks/bench_refit.py [--layers 8 --hidden 1024 --bucket-mib 64 --repeats 3]
                                     [--job-steps 8]   (0 skips the job)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path


class PeakRSS:
    """Peak RSS (bytes) of this process and its children while the block runs."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self._proc = psutil.Process()
        self._interval = interval

    def _rss(self) -> int:
        total = self._proc.memory_info().rss
        for child in self._proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except Exception:  # noqa: BLE001 - a child may exit while we sample
                pass
        return total

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self._interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def refit_as_one_blob(engine, groups) -> dict:
    """The refit before buckets, kept here for the comparison only: the whole model copied
    into one safetensors payload, sent once through ``collective_rpc``."""
    from safetensors.torch import save

    from megatron_dgpo.rollout.vllm_worker import reload_from_safetensors_blob

    tensors = {name: t.detach().to("cpu").contiguous() for group in groups for name, t in group}
    blob = save(tensors)
    engine.llm.collective_rpc(reload_from_safetensors_blob, args=(blob,))
    engine.llm.reset_prefix_cache()
    return {"buckets": 1, "max_bucket_bytes": len(blob)}


def refit_in_buckets(engine, groups) -> dict:
    stats = engine.update_weights(groups)
    return {"buckets": stats.buckets, "max_bucket_bytes": stats.max_bucket_bytes}


def measure(name, engine, refit, groups, repeats, check) -> dict:
    times, peaks, info = [], [], {}
    for _ in range(repeats):
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            info = refit(engine, iter(groups))
            times.append(time.perf_counter() - t0)
        peaks.append(mem.peak - mem.base)
    check(engine)
    return {"method": name, "seconds": statistics.median(times), "peak_extra_mb": max(peaks) / 2**20, **info}


def tiny_job_step_times(steps: int, ranks: int, run_dir: Path) -> dict:
    """Run the tiny recipe for ``steps`` steps on ``ranks`` ranks (one colocated engine per
    rank) and return the medians of its wall-clock metrics over steps 2.. (step 1 warms up)."""
    import subprocess
    import sys

    from megatron_dgpo.telemetry import read_metrics
    from tests.distributed import free_port

    root = Path(__file__).resolve().parents[1]
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-port", str(free_port())]
    cmd = launcher + ["-m", "megatron_dgpo.train", str(root / "recipes" / "tiny_cpu.yaml"),
                      f"run_dir={run_dir}", f"train.steps={steps}", "checkpoint.save_every=0",
                      "checkpoint.export_hf=false", "logging.progress_bar=false",
                      "logging.tensorboard=false"]
    # not this process's own one-rank group's torchrun variables (set for the colocated engine)
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    proc = subprocess.run(cmd, cwd=root, env=dict(env, PYTHONPATH=str(root)),
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"tiny job on {ranks} rank(s) failed:\n{proc.stderr[-3000:]}")
    records = read_metrics(run_dir)[1:]
    keys = ("time/step", "time/rollout", "throughput/generation_tokens_per_s_per_engine",
            "rollout/engines", "rollout/accuracy")
    return {k: statistics.median(r[k] for r in records) for k in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--job-steps", type=int, default=8)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, VLLMEngine
    from megatron_dgpo.runtime.parallel import init_distributed
    from megatron_dgpo.tasks.prompts import builtin_prompts, render_prompts
    from megatron_dgpo.tasks.tiny import make_tiny_model
    from tests.conftest import hf_groups
    from tests.distributed import free_port

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                     num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                     num_key_value_heads=max(1, args.hidden // 256))
        model_a = make_tiny_model(Path(tmp) / "a", seed=0, **shape)
        model_b = make_tiny_model(Path(tmp) / "b", seed=1, **shape)
        weights = load_file(str(model_b / "model.safetensors"))  # "the trainer's" new weights
        groups = hf_groups(model_b, weights)  # as the trainer's export yields them
        total = sum(t.numel() * t.element_size() for t in weights.values())
        print(f"model: {sum(t.numel() for t in weights.values()) / 1e6:.1f}M params, "
              f"{total / 2**20:.0f} MiB fp32, {len(weights)} tensors")
        from transformers import AutoTokenizer

        prompt = render_prompts(AutoTokenizer.from_pretrained(model_a), builtin_prompts()[:1])
        reference = {}

        def check(engine):
            """Every method must leave B's weights: same greedy-ish samples for a fixed seed."""
            out = engine.generate(prompt, n=2, max_tokens=8, seed=3)
            key = [s.token_ids for s in out[0]]
            reference.setdefault("tokens", key)
            assert key == reference["tokens"], "refit methods disagree"
            engine.update_weights_from_dir(model_a)  # back to A for the next method

        common = dict(model=str(model_a), dtype="float32", max_model_len=256, max_num_seqs=8,
                      kv_cache_memory_bytes=32 << 20, refit_bucket_bytes=args.bucket_mib << 20)
        with VLLMEngine(VLLMConfig(**common, placement="separate")) as engine:
            rows.append(measure("blob (separate, before)", engine, refit_as_one_blob, groups, args.repeats, check))
            rows.append(measure(f"buckets {args.bucket_mib} MiB (separate)", engine, refit_in_buckets,
                                groups, args.repeats, check))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        init_distributed("gloo")
        engine = VLLMEngine(VLLMConfig(**common, placement="colocated"))
        rows.append(measure(f"buckets {args.bucket_mib} MiB (colocated, in process)", engine,
                            refit_in_buckets, groups, args.repeats, check))
        rows.append(measure("blob (colocated, in process)", engine, refit_as_one_blob, groups,
                            args.repeats, check))
        engine.shutdown()
        dist.destroy_process_group()
        del torch
        jobs = [(ranks, tiny_job_step_times(args.job_steps, ranks, Path(tmp) / f"job{ranks}"))
                for ranks in ((1, 2) if args.job_steps > 1 else ())]

    print(f"\n| method | seconds (median of {args.repeats}) | buckets | largest payload MiB | peak extra RSS MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['seconds']:.2f} | {r['buckets']} | {r['max_bucket_bytes'] / 2**20:.0f} | "
              f"{r['peak_extra_mb']:.0f} |")

    if jobs:
        print(f"\ntiny job (recipes/tiny_cpu.yaml), medians over steps 2..{args.job_steps}:")
        print("| ranks | engines | s/step | s rollout | gen tokens/s per engine | accuracy |")
        print("|---|---|---|---|---|---|")
        for ranks, m in jobs:
            print(f"| {ranks} | {m['rollout/engines']:.0f} | {m['time/step']:.2f} | "
                  f"{m['time/rollout']:.2f} | "
                  f"{m['throughput/generation_tokens_per_s_per_engine']:.0f} | "
                  f"{m['rollout/accuracy']:.3f} |")


if __name__ == "__main__":
    main()
