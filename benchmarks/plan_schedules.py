#!/usr/bin/env python
"""What each schedule buys for the shipped 14B and 32B recipes on A100 clusters, by the planner's
step-time model (``dgpo-plan --json``'s "schedules"; docs/planner.md#schedules), and the
published asynchronous speed-ups beside the model's (``planner.published_async``).

    .venv/bin/python benchmarks/plan_schedules.py [--hardware a100]

One markdown row per recipe, cluster (the colocated recipes on their 4 nodes and on the paper's
30; the dedicated one on its 30) and schedule: synchronous colocated on all the GPUs, then
on the recipe's dedicated split (if it has one) and on the fastest split one-step-off and partial
rollouts at the least staleness that admits every response, each with its speed-up over the
synchronous colocated step and, for partial rollouts, the tokens re-prefilled per engine at each
refit. A model, not a GPU measurement (its table: benchmarks/README.md, "Planner: what each
schedule buys").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = (("dgpo_14b_async", 30), ("dgpo_14b", 4), ("dgpo_14b", 30), ("dgpo_32b", 4),
         ("dgpo_32b", 30))
HEAD = ("| recipe | nodes | schedule | trainer GPUs | rollout GPUs | generation s | training s | "
        "refit s | step s | speed-up | re-prefill per refit |")


def schedules(recipe: str, nodes: int, hardware: str) -> list[dict]:
    """``dgpo-plan RECIPE --nodes N --json``'s "schedules" on 8 x 80 GB GPUs per node."""
    from megatron_dgpo.plan import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([str(ROOT / "recipes" / f"{recipe}.yaml"), "--gpus-per-node", "8", "--nodes",
                     str(nodes), "--gpu-memory-gb", "80", "--hardware", hardware, "--json"])
    if code != 0:
        raise SystemExit(f"dgpo-plan {recipe} --nodes {nodes}: exit {code}")
    return json.loads(out.getvalue())["schedules"]


def rows(recipe: str, nodes: int, hardware: str = "a100") -> list[str]:
    """The table's rows for one recipe and cluster."""
    lines = []
    for s in schedules(recipe, nodes, hardware):
        label = s["label"] + (", fastest split" if s["split"] != "recipe" else "")
        reprefill = (f"{s['reprefill_tokens'] / 1e3:.0f}k tokens ({s['reprefill_s']:.0f} s)"
                     if s["placement"] == "partial" else "-")
        lines.append(f"| {recipe} | {nodes} | {label} | {s['trainer_gpus']} | "
                     f"{s['rollout_gpus'] or '-'} | {s['generation_s']:.0f} | "
                     f"{s['training_s']:.0f} | {s['refit_s']:.0f} | {s['step_s']:.0f} | "
                     f"{s['speed_up']:.2f}x | {reprefill} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--hardware", choices=("a100", "h100"), default="a100")
    args = ap.parse_args(argv)
    print(HEAD)
    print("|" + " --- |" * (HEAD.count(" | ") + 1))
    for recipe, nodes in CASES:
        print("\n".join(rows(recipe, nodes, args.hardware)))
    from megatron_dgpo.planner.published_async import speedup_table

    print()
    print("\n".join(speedup_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
