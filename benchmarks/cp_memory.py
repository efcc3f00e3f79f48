#!/usr/bin/env python
"""Activation memory per rank of one train step against response length, at CP = 1, 2, 4.

    .venv/bin/python benchmarks/cp_memory.py [--lengths 256 512 1024] [--cps 1 2 4]

One packed row (4 samples: a 32-token prompt and a response of the given length each) through
``train_step`` (forward + backward of the DGPO loss) on a small Qwen2-shaped Megatron model,
float32, gloo ranks on the CPU (world = CP, so DP = 1). Measured: the bytes autograd saves for
backward during the step (``torch.autograd.graph.saved_tensors_hooks``), each storage counted
once, parameters left out, per rank; the table shows the largest rank's and its ratio to
CP = 1. At CP = 1 the row runs the local attention with its block-diagonal mask; at CP > 1
``cpu.py``'s patch 15, which keeps the all-gathered keys and values (the whole row's) for
backward: the rest falls as 1 / CP.

Beside it, the planner's prediction for the 32k-response recipes (``recipes/*_32k.yaml`` on
their header's nodes of 8 x 80 GB A100s): the activations + logits of the peak GPU at the
recipe's TP x PP with CP = 1, 2, 4, and the ratio to CP = 1 (``planner.peak.estimate``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=2048,
             hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-6,
             rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False)
SAMPLES, PROMPT = 4, 32


def _row(response: int, pad: int):
    from megatron_dgpo.algorithm.packing import Sample, pack

    gen = torch.Generator().manual_seed(0)
    n = PROMPT + response
    samples = [Sample(torch.randint(0, MODEL["vocab_size"], (n,), generator=gen), PROMPT,
                      {"advantages": torch.randn(response, generator=gen),
                       "old_logprobs": torch.full((response,), -7.6)})
               for _ in range(SAMPLES)]
    (row,) = pack(samples, budget=10**9, pad_multiple=pad)
    return row


def _saved_bytes(models, row) -> int:
    from megatron_dgpo.algorithm.losses import LossConfig
    from megatron_dgpo.training.train_step import train_step

    params = {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        train_step(models, [row], LossConfig())
    return sum(seen.values())


def _rank(rank: int, world: int, port: int, lengths: list[int], out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.runtime.gpu_flags import pad_multiple
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training.policy import wrap_ddp

    dist.init_process_group("gloo", rank=rank, world_size=world)
    initialize_parallel(ParallelConfig(context_parallel=world), seed=1)
    models = wrap_ddp(build_model(MODEL, seed=1))
    result = {n: _saved_bytes(models, _row(n, pad_multiple(1, world))) for n in lengths}
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def measure(cp: int, lengths: list[int]) -> dict[int, list[int]]:
    """{response length: [saved bytes of each rank]} at context-parallel size ``cp``."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(cp, port, lengths, out), nprocs=cp, join=True)
        ranks = [torch.load(f"{out}/rank{r}.pt") for r in range(cp)]
    return {n: [r[n] for r in ranks] for n in lengths}


def planner_rows(cps: list[int]) -> list[str]:
    """Markdown rows: each 32k recipe's predicted activations + logits (GiB, the peak GPU) at
    its TP x PP and each CP size of ``cps`` that divides its GPUs."""
    import re

    from megatron_dgpo.planner.catalogue import architecture_for
    from megatron_dgpo.planner.inputs import GIB, Cluster, Layout, Workload
    from megatron_dgpo.planner.peak import estimate
    from megatron_dgpo.planner.search import plan_attention
    from megatron_dgpo.planner.steptime import HARDWARE
    from megatron_dgpo.recipe import load_recipe

    rows = []
    for path in sorted(Path(__file__).resolve().parents[1].glob("recipes/*_32k.yaml")):
        cfg = load_recipe(path)
        nodes = int(re.search(r"sbatch --nodes=(\d+)", path.read_text()).group(1))
        cluster, par = Cluster(8, nodes, 80), cfg.parallel
        work = plan_attention(Workload.from_recipe(cfg), HARDWARE["a100"])[0]
        model, cells, base = architecture_for(cfg), [], None
        for cp in cps:
            ranks = par.tensor_parallel * par.pipeline_parallel * cp
            if cluster.gpus % ranks:
                cells.append("-")
                continue
            e = estimate(model, cluster, Layout(par.tensor_parallel, par.pipeline_parallel, cp,
                                                cluster.gpus // ranks), work)
            gib = (e.activations + e.logits) / GIB
            base = gib if cp == 1 else base
            cells.append(f"{gib:.1f}" + (f" ({gib / base:.2f})" if base and cp != 1 else ""))
        rows.append(f"| {path.stem} | TP{par.tensor_parallel} PP{par.pipeline_parallel} | "
                    + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    results = {cp: measure(cp, args.lengths) for cp in args.cps}
    base = results.get(1)
    print(f"| response tokens | row tokens | " + " | ".join(
        f"CP={cp} MiB/rank" + (" (x CP=1)" if base and cp != 1 else "") for cp in args.cps)
        + " |")
    print("| --- | --- |" + " --- |" * len(args.cps))
    for n in args.lengths:
        cells = []
        for cp in args.cps:
            worst = max(results[cp][n])
            ratio = f" ({worst / max(base[n]):.2f})" if base and cp != 1 else ""
            cells.append(f"{worst / 2**20:.1f}{ratio}")
        print(f"| {n} | {SAMPLES * (PROMPT + n)} | " + " | ".join(cells) + " |")
    print("\nPlanner, 32k recipes on A100-80GB: activations + logits of the peak GPU, GiB")
    print("| recipe | layout | " + " | ".join(f"CP={cp}" for cp in args.cps) + " |")
    print("| --- | --- |" + " --- |" * len(args.cps))
    print("\n".join(planner_rows(args.cps)))


if __name__ == "__main__":
    main()
