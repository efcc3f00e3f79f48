#!/usr/bin/env python
"""Generation overlapped with training, measured: the tiny job with a dedicated engine,
synchronous (``rollout.max_staleness: 0``) against one-step-off (``1``), on this machine.

    .venv/bin/python benchmarks/bench_async.py [--steps 50] [--long-steps 30] [--out DIR [--reuse]]
    .venv/bin/python benchmarks/bench_async.py --planner-only   # the 14B estimate alone

Each run is ``torchrun --nproc-per-node 2 -m megatron_dgpo.train recipes/tiny_cpu.yaml
rollout.placement=dedicated rollout.num_gpus=1 ...``: one trainer rank and one engine rank,
each a process with one OpenMP thread, so on a 2-core machine each side holds a core and the
overlap is real. Two workloads:

* ``tiny``: the recipe as written (4-token responses): generation is ~15% of a step;
* ``tiny, 32-token responses``: ``rollout.max_response_tokens=32``, generation ~25% of a step.

Both modes run with ``algorithm.rollout_correction: tis``, the recommended setting for
one-step-off (it only reweights tokens when the engine and the trainer disagree: at staleness 0
the weights are 1 to float32 rounding). Per run, means over the steps after the first (warm-up):

* step: ``time/step``;
* generation: the engine's time on the batch (``time/engine_generate``);
* training: old log-probs + mini-batch updates (``time/old_logprobs + time/update``);
* trainer idle: the trainer waiting for samples (``time/rollout`` + ``time/rollout_wait``);
* engine idle: the engine waiting between batches (``time/engine_idle``);
* accuracy: ``rollout/accuracy`` over the second half of the run and its last 10 steps.

Then the planner's estimate for the paper's 14B recipe with dedicated engines on the paper's
30 nodes (``megatron_dgpo.planner.search.step_time_estimate`` on ``recipes/dgpo_14b_async.yaml``),
synchronous and one-step-off, in the same columns, and the colocated step beside them.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
WORKLOADS = {"tiny": [], "tiny, 32-token responses": ["rollout.max_response_tokens=32"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(run_dir: Path, staleness: int, steps: int, extra: list[str]) -> float:
    """One job; returns its wall-clock seconds (start-up included)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "-m", "megatron_dgpo.train", str(RECIPE),
           f"run_dir={run_dir}", "rollout.placement=dedicated", "rollout.num_gpus=1",
           f"rollout.max_staleness={staleness}", "algorithm.rollout_correction=tis",
           f"train.steps={steps}", "checkpoint.save_every=0", "checkpoint.export_hf=false",
           "logging.progress_bar=false", "logging.tensorboard=false", *extra]
    begin = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench_async: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return time.perf_counter() - begin


def summary(run_dir: Path) -> dict[str, float]:
    from megatron_dgpo.telemetry import read_metrics

    records = read_metrics(run_dir)
    timed = records[1:]

    def mean(fn, rows=timed):
        return sum(fn(r) for r in rows) / len(rows)

    return {
        "step": mean(lambda r: r["time/step"]),
        "generation": mean(lambda r: r["time/engine_generate"]),
        "training": mean(lambda r: r["time/old_logprobs"] + r["time/update"]),
        "refit": mean(lambda r: r["time/refit"]),
        "trainer idle": mean(lambda r: r["time/rollout"] + r.get("time/rollout_wait", 0.0)),
        "engine idle": mean(lambda r: r["time/engine_idle"]),
        "accuracy (2nd half)": mean(lambda r: r["rollout/accuracy"], records[len(records) // 2:]),
        "accuracy (last 10)": mean(lambda r: r["rollout/accuracy"], records[-10:]),
        "staleness": mean(lambda r: r["rollout/staleness"], records),
    }


def _row(name: str, mode: str, s: dict, base: dict | None) -> str:
    speedup = f"{base['step'] / s['step']:.2f}x" if base else "1.00x"
    cells = [f"{s[k]:.3f}" for k in ("step", "generation", "training", "refit", "trainer idle",
                                       "engine idle")]
    acc = (f"{s['accuracy (2nd half)']:.3f} / {s['accuracy (last 10)']:.3f}"
           if "accuracy (2nd half)" in s else "-")
    return f"| {name} | {mode} | " + " | ".join(cells) + f" | {speedup} | {acc} |"


def planner_rows() -> list[str]:
    """The planner's estimate (docs/planner.md#step-time) for the paper's 14B run with dedicated
    engines on the paper's 30 nodes of 8 A100: synchronous and one-step-off on the recipe's 80
    rollout GPUs, and the colocated step for comparison (its speedup column is against the
    synchronous dedicated step, as the measured rows')."""
    from megatron_dgpo.planner.inputs import Cluster
    from megatron_dgpo.planner.search import step_time_estimate
    from megatron_dgpo.recipe import load_recipe

    recipe = ROOT / "recipes" / "dgpo_14b_async.yaml"
    estimate = step_time_estimate(load_recipe(recipe), Cluster(gpus_per_node=8, nodes=30,
                                                               gpu_memory_gb=80))
    rows, base = [], None
    for key, mode in (("synchronous", "synchronous"), ("one_step_off", "one-step-off"),
                      ("colocated", "colocated, all 240 GPUs")):
        e = estimate[key]
        s = {"step": e["step_s"], "generation": e["generation_s"], "training": e["training_s"],
             "refit": e["refit_s"], "trainer idle": e["trainer_idle_s"],
             "engine idle": e["engine_idle_s"]}
        rows.append(_row(f"planner: {recipe.name}, 30 x 8 A100", mode, s, base))
        base = base or s
    return rows


def _table_head() -> list[str]:
    return ["| workload | mode | step s | generation s | training s | refit s | trainer idle s "
            "| engine idle s | speedup | accuracy (2nd half / last 10) |",
            "| " + " | ".join(["---"] * 10) + " |"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="steps of the tiny job")
    parser.add_argument("--long-steps", type=int, default=30,
                        help="steps of the 32-token-response job")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here")
    parser.add_argument("--reuse", action="store_true",
                        help="with --out: tabulate finished runs found there instead of re-running")
    parser.add_argument("--planner-only", action="store_true",
                        help="print only the planner's rows (no runs)")
    args = parser.parse_args(argv)
    if args.planner_only:
        print("\n".join(_table_head() + planner_rows()))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_async_"))
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; runs in {out}\n")
    lines = _table_head()
    for name, extra in WORKLOADS.items():
        steps = args.steps if name == "tiny" else args.long_steps
        base = None
        for staleness, mode in ((0, "synchronous"), (1, "one-step-off")):
            run_dir = out / f"{name.split(',')[0]}{'_long' if extra else ''}_staleness{staleness}"
            done = (run_dir / "metrics.jsonl").is_file() and len(
                (run_dir / "metrics.jsonl").read_text().splitlines()) == steps
            seconds = 0.0 if done and args.reuse else run(run_dir, staleness, steps, extra)
            s = summary(run_dir)
            lines.append(_row(f"{name} ({steps} steps)", mode, s, base))
            base = base or s
            print(f"  {name}, {mode}: {seconds:.0f} s wall, staleness {s['staleness']:.2f}",
                  flush=True)
    lines += planner_rows()
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
