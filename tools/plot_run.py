#!/usr/bin/env python
"""Draw a run's training dynamics (reward, entropy, region fractions, ...) as one PNG.

    python tools/plot_run.py runs/tiny_cpu            # writes runs/tiny_cpu/dynamics.png
    python tools/plot_run.py runs/a runs/b -o cmp.png # overlays several runs

Reads each run's ``metrics.jsonl`` (megatron_dgpo.telemetry). A panel is drawn for every
metric group present in at least one run; missing ones are skipped. A run that evaluated on
held-out problems (recipe section ``eval``) gets a panel of each benchmark's Avg@n and its
largest Pass@k against the step (points at the evaluated steps only).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from megatron_dgpo.telemetry import read_metrics

# (panel title, metric keys, y-label); the paper's Fig. 4 analysis is the region fractions.
PANELS = [
    ("Reward", ["rollout/reward_mean"], "mean reward"),
    ("Accuracy", ["rollout/accuracy"], "fraction correct"),
    ("Response length", ["rollout/response_length_mean"], "tokens"),
    ("Entropy", ["train/entropy"], "nats / token"),
    ("Clip regions", ["train/region/LN_frac", "train/region/HP_frac", "train/region/LP_frac",
                      "train/region/HN_frac"], "fraction of tokens"),
    ("Gradient weight F", ["train/F/LN_mean", "train/F/HP_mean"], "mean F"),
    ("Grad norm", ["train/grad_norm"], "L2 norm"),
    ("Rollout/trainer mismatch", ["mismatch/mean_abs_diff", "mismatch/max_abs_diff"],
     "|log p diff|"),
    ("Rollout correction", ["train/correction/weight_mean", "train/correction/clip_frac",
                            "train/correction/token_masked_frac",
                            "train/correction/sample_masked_frac", "train/correction/ess_frac"],
     "weight mean / share"),
]


def eval_panel(runs: dict[str, list[dict]]) -> list[tuple[str, list[str], str]]:
    """The held-out evaluation panel (``eval/<benchmark>/avg@<n>`` and the largest
    ``eval/<benchmark>/pass@<k>`` of each benchmark), or none when no run evaluated."""
    keys = {k for recs in runs.values() for r in recs for k in r if k.startswith("eval/")}
    shown = sorted(k for k in keys if "/avg@" in k)
    largest: dict[str, tuple[int, str]] = {}
    for key in keys:
        bench, _, metric = key.rpartition("/")
        if metric.startswith("pass@") and metric[5:].isdigit():
            largest[bench] = max(largest.get(bench, (0, "")), (int(metric[5:]), key))
    shown += sorted(key for _, key in largest.values())
    return [("Held-out evaluation", shown, "accuracy")] if shown else []


def plot_runs(run_dirs: list[Path], out: Path) -> list[str]:
    """Draw the panels present in the runs' metrics into ``out``; returns the panel titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): read_metrics(d) for d in run_dirs}
    present = [p for p in PANELS + eval_panel(runs)
               if any(k in r for recs in runs.values() for r in recs for k in p[1])]
    if not present:
        raise SystemExit(f"none of the known metrics are in {', '.join(runs)}")
    cols = min(3, len(present))
    rows = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False,
                             constrained_layout=True)
    for ax, (title, keys, ylabel) in zip(axes.flat, present):
        for name, records in runs.items():
            for key in keys:
                points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
                if points:
                    steps, values = zip(*points)
                    short = key.split("/", 1)[1] if key.startswith("eval/") else key.split("/")[-1]
                    label = short if len(runs) == 1 else f"{Path(name).name}: {key}"
                    ax.plot(steps, values, marker="o", ms=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1 or len(runs) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(present):]:
        ax.set_visible(False)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [p[0] for p in present]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics files)")
    parser.add_argument("-o", "--out", type=Path, help="PNG path (default: <run>/dynamics.png)")
    args = parser.parse_args(argv)
    out = args.out or (args.runs[0] if args.runs[0].is_dir() else args.runs[0].parent)
    if out.is_dir():
        out = out / "dynamics.png"
    try:
        titles = plot_runs(args.runs, out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({', '.join(titles)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
