#!/usr/bin/env python
"""Step-time breakdown of a training run, from its metrics.jsonl (what the trainer measured).

    make run && .venv/bin/python benchmarks/step_breakdown.py outputs/tiny_cpu [--skip 1]

Prints mean seconds per step and share of the step for each phase (rollout, old log-probs, the
bypass's mismatch check, mini-batch updates, refit, checkpoint, evaluation on held-out problems
when the run had any),
and the rollout / training throughput. ``--skip``
leaves out the first steps (warm-up: the first forward passes, the checkpoint writer's start).
"""

from __future__ import annotations

import argparse
import sys

from megatron_dgpo.telemetry import read_metrics

PHASES = ("rollout", "old_logprobs", "mismatch_check", "update", "refit", "checkpoint", "eval")
OUTSIDE_STEP = ("checkpoint", "eval")  # logged beside time/step, not inside it


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="run directory (or its metrics.jsonl)")
    parser.add_argument("--skip", type=int, default=1, help="leading steps to leave out")
    args = parser.parse_args(argv)
    records = read_metrics(args.run)[args.skip:]
    if not records:
        print(f"error: no steps after skipping {args.skip} in {args.run}", file=sys.stderr)
        return 2
    steps = len(records)
    # A line's time/checkpoint is the save after the previous step (logged before saving);
    # time/eval (the evaluation after the step's refit) is not part of time/step either.
    total = sum(r["time/step"] + sum(r.get(f"time/{p}", 0.0) for p in OUTSIDE_STEP)
                for r in records) / steps
    print(f"{steps} steps, {total:.3f} s/step on average\n")
    print("| phase | s/step | share |")
    print("| --- | --- | --- |")
    for phase in PHASES:
        if phase in ("eval", "mismatch_check") and not any(f"time/{phase}" in r for r in records):
            continue  # the run did not evaluate, or did not bypass the old log-probs
        mean = sum(r.get(f"time/{phase}", 0.0) for r in records) / steps
        print(f"| {phase} | {mean:.3f} | {100 * mean / total:.1f}% |")
    other = total - sum(sum(r.get(f"time/{p}", 0.0) for r in records) / steps for p in PHASES)
    print(f"| other (advantages, packing, logging) | {other:.3f} | {100 * other / total:.1f}% |")
    for key in ("throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s"):
        print(f"\n{key}: {sum(r[key] for r in records) / steps:.0f}", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
