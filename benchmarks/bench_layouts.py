#!/usr/bin/env python
"""The tiny job at every layout the cluster-life work keeps alive, against the 1-rank run.

One run per layout of ``recipes/tiny_cpu.yaml`` (``--steps`` steps, colocated engines: one per
TP x PP group), each under torchrun with gloo on this machine. Reported per layout: whether
step 1's samples are token-identical to the 1-rank run (all ``rollout/*`` metrics equal), the
largest relative difference of the ``train/*`` metrics over all steps (and which: ``train/loss``
is a float32 sum that cancels to a small value, so its relative difference is the largest),
the median seconds per step after the first, and the peak resident memory of the largest rank
process (RSS sampled every 50 ms; its grader worker processes not included).

    python benchmarks/bench_layouts.py [--steps 3] [--layouts 1 tp2dp2 ...]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {  # name: (ranks, TP, PP)
    "1": (1, 1, 1), "tp2dp2": (4, 2, 1), "pp2dp2": (4, 1, 2), "tp2pp2": (4, 2, 2),
    "dp4": (4, 1, 1), "tp2pp2dp2": (8, 2, 2),
}


def _peak_rank_rss(root_pid: int, stop: threading.Event, peak: dict) -> None:
    import psutil

    root = psutil.Process(root_pid)
    while not stop.wait(0.05):
        try:
            ranks = [p for p in root.children() if p.environ().get("RANK") is not None] or [root]
            for rank in ranks:
                peak["rss"] = max(peak.get("rss", 0), rank.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def run_layout(name: str, steps: int, out: Path) -> tuple[list[dict], float]:
    from megatron_dgpo.runtime.parallel import free_port
    from megatron_dgpo.telemetry import read_metrics

    ranks, tp, pp = LAYOUTS[name]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                 "--master-port", str(free_port())] if ranks > 1 else [sys.executable])
    cmd = launcher + ["-m", "megatron_dgpo.train", str(ROOT / "recipes" / "tiny_cpu.yaml"),
                      f"run_dir={out / name}", f"train.steps={steps}", "checkpoint.save_every=0",
                      "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.tensorboard=false",
                      f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stop, peak = threading.Event(), {}
    watcher = threading.Thread(target=_peak_rank_rss, args=(proc.pid, stop, peak), daemon=True)
    watcher.start()
    _, err = proc.communicate()
    stop.set()
    if proc.returncode:
        raise RuntimeError(f"layout {name} failed ({proc.returncode}):\n{err[-3000:]}")
    return read_metrics(out / name), peak.get("rss", 0) / 2**30


def compare(records: list[dict], reference: list[dict]) -> tuple[bool, float, str]:
    """(step-1 rollout metrics identical, largest relative difference of a train/* metric over
    all steps, that metric's key)."""
    rollout = lambda r: {k: v for k, v in r.items() if k.startswith("rollout/") and k != "rollout/engines"}  # noqa: E731
    same_samples = rollout(records[0]) == rollout(reference[0])
    worst, worst_key = 0.0, "-"
    for got, want in zip(records, reference):
        for key, b in want.items():
            a = got.get(key)
            if key.startswith("train/") and a is not None and b is not None and math.isfinite(b):
                diff = abs(a - b) / max(abs(b), 1e-6)
                if diff > worst:
                    worst, worst_key = diff, key
    return same_samples, worst, worst_key


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)
    layouts = ["1"] + [n for n in args.layouts if n != "1"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name in layouts:
            begin = time.perf_counter()
            results[name] = run_layout(name, args.steps, Path(tmp))
            print(f"# {name}: {time.perf_counter() - begin:.0f} s", file=sys.stderr, flush=True)
        reference = results["1"][0]
        for name in layouts:
            records, rss = results[name]
            same, worst, worst_key = compare(records, reference)
            step_s = statistics.median(r["time/step"] for r in records[1:]) if len(records) > 1 else float("nan")
            ranks, tp, pp = LAYOUTS[name]
            rows.append(f"| {name} | {ranks} | {tp} | {pp} | {ranks // (tp * pp)} | {records[0]['rollout/engines']:.0f} "
                        f"| {'yes' if same else 'NO'} | {worst:.1e} ({worst_key}) | {step_s:.2f} | {rss:.2f} |")
    print(f"tiny job, {args.steps} steps per layout; equality against the 1-rank run")
    print("| layout | ranks | TP | PP | DP | engines | step-1 samples identical | max rel. diff train/* (metric) | s/step | peak RSS of a rank (GiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
