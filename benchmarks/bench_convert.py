"""Converter benchmark: peak RSS and throughput of HF <-> Megatron at 14B layer shapes.

A synthetic Qwen2 checkpoint with DeepSeek-R1-Distill-Qwen-14B shapes (hidden 5120,
intermediate 13824, 40 heads, 8 KV heads, vocab 152064, untied) but 2 layers, bf16 (~3.4 GB),
is written to a temporary folder. Each measurement runs in a fresh subprocess and reports its
own peak RSS (``VmHWM``) and wall time:

    baseline   import torch + megatron_dgpo.convert, nothing else (the interpreter's floor)
    copy       copy the HF safetensors bytes to a new file (the throughput reference)
    hf->mg     megatron_dgpo.convert.hf_to_megatron(tp=1, pp=1)
    mg->hf     megatron_dgpo.convert.megatron_to_hf

Targets: peak RSS <= largest tensor + 300 MB; throughput >= 70 % of the copy's.
Usage: python benchmarks/bench_convert.py [--layers 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

SHAPES = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=5120,
              intermediate_size=13824, num_attention_heads=40, num_key_value_heads=8,
              vocab_size=152064, max_position_embeddings=4096, rms_norm_eps=1e-5,
              rope_theta=1000000.0, hidden_act="silu", tie_word_embeddings=False,
              torch_dtype="bfloat16")

_CHILD = r"""
import json, os, resource, sys, time
mode, a, b = sys.argv[1:4]
import torch
import megatron_dgpo.convert as convert
t0 = time.perf_counter()
if mode == "copy":
    with open(a, "rb") as src, open(b, "wb") as dst:
        while chunk := src.read(64 << 20):
            dst.write(chunk)
elif mode == "hf2mg":
    convert.hf_to_megatron(a, b)
elif mode == "mg2hf":
    convert.megatron_to_hf(a, b)
seconds = time.perf_counter() - t0
# VmHWM is this process image's own peak RSS (ru_maxrss would carry the parent's over fork+exec)
with open("/proc/self/status") as status:
    hwm_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "maxrss_mb": hwm_kb / 1024}))
"""


def _synthesize(hf_dir: str, layers: int) -> tuple[int, int]:
    """Write the random bf16 checkpoint tensor by tensor; (total bytes, largest tensor bytes)."""
    import torch

    from megatron_dgpo.convert import ShardedSafetensorsWriter, copy_side_files
    from megatron_dgpo.convert.hf_source import iter_params
    from megatron_dgpo.convert.transforms import hf_tensors
    from megatron_dgpo.models import describe

    cfg = dict(SHAPES, num_hidden_layers=layers)
    description = describe(cfg, padded_vocab=cfg["vocab_size"])
    dims = description.dims
    writer = ShardedSafetensorsWriter(hf_dir)
    generator = torch.Generator().manual_seed(0)
    largest = 0
    for pm, layer in iter_params(description.family.active(cfg), layers):
        for name, shape in hf_tensors(pm, layer, dims):
            tensor = torch.randn(shape, generator=generator).to(torch.bfloat16)
            largest = max(largest, tensor.numel() * 2)
            writer.add(name, tensor)
            del tensor
    writer.close()
    copy_side_files(None, hf_dir, config=cfg)
    return writer.total_bytes, largest


def _run(mode: str, a: str = "", b: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, a, b], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--keep", default=None, help="work folder to keep (default: a temp dir)")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="bench_convert_", dir="/tmp")
    try:
        hf_dir, mg_dir, out_dir = (os.path.join(work, n) for n in ("hf", "mg", "hf_out"))
        for path in (mg_dir, out_dir):
            shutil.rmtree(path, ignore_errors=True)
        total, largest = _synthesize(hf_dir, args.layers)
        shard = os.path.join(hf_dir, "model.safetensors")
        base = _run("baseline")
        copies = []
        for _ in range(2):  # before and after the conversions; the faster one is the baseline
            copies.append(_run("copy", shard, os.path.join(work, "copy.bin")))
            os.remove(os.path.join(work, "copy.bin"))
            if not copies[1:]:
                to_mg = _run("hf2mg", hf_dir, mg_dir)
                to_hf = _run("mg2hf", mg_dir, out_dir)
        copy = min(copies, key=lambda r: r["seconds"])
        identical = subprocess.run(["cmp", "-s", shard, os.path.join(out_dir, "model.safetensors")]
                                   ).returncode == 0
        mb = 1024 ** 2
        budget = largest / mb + 300
        rows = [("copy (baseline)", copy), ("hf -> megatron", to_mg), ("megatron -> hf", to_hf)]
        print(f"synthetic Qwen2 14B shapes, {args.layers} layers, bf16: {total / mb:.0f} MB of "
              f"tensors, largest tensor {largest / mb:.0f} MB; interpreter+imports RSS "
              f"{base['maxrss_mb']:.0f} MB; megatron checkpoint on disk "
              f"{_disk_bytes(mg_dir) / mb:.0f} MB")
        print(f"| step | seconds | MB/s | vs copy | peak RSS MB | peak RSS - imports MB | "
              f"target RSS <= {budget:.0f} MB |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for label, r in rows:
            rate = total / mb / r["seconds"]
            ratio = copy["seconds"] / r["seconds"]
            ok = "yes" if r["maxrss_mb"] <= budget else "NO"
            print(f"| {label} | {r['seconds']:.2f} | {rate:.0f} | {ratio:.0%} | "
                  f"{r['maxrss_mb']:.0f} | {r['maxrss_mb'] - base['maxrss_mb']:.0f} | {ok} |")
        print(f"round trip file byte-identical to the source: {identical}")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
