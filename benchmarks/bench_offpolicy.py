#!/usr/bin/env python
"""The rollout corrections, GSPO and the bypass on the tiny job: each trains, its metrics are
logged, and what the bypass saves as a share of the step.

    .venv/bin/python benchmarks/bench_offpolicy.py [--steps 8] [--out DIR [--reuse]] [--only NAME ...]

One 1-rank run of ``recipes/tiny_cpu.yaml`` per line below. The corrections run with the engine
in bf16 (``rollout.dtype=bfloat16``) against the float32 trainer, so pi_prox / pi_behav is a real
mismatch and each option weighs or masks something; GSPO, the baseline and the bypass keep the
recipe's float32 engine. Per run, over the steps after the first (warm-up): accuracy over the
second half, the behaviour weights' ``train/correction/*`` means, the mismatch, and the share of
``time/step`` spent in ``time/old_logprobs``; the bypass's saving is its step time against the
baseline's, and the baseline's old-log-prob share (what the bypass leaves out).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
BF16 = ["rollout.dtype=bfloat16"]
RUNS = {
    "baseline (trainer pi_old, fp32 engine)": [],
    "bypass (old_logprobs: rollout)": ["algorithm.old_logprobs=rollout",
                                       "algorithm.old_logprobs_check_every=4"],
    "gspo": ["algorithm.method=gspo", "algorithm.loss_aggregation=seq_mean_token_mean"],
    "none, bf16 engine": BF16,
    "tis": [*BF16, "algorithm.rollout_correction=tis"],
    "token_mask": [*BF16, "algorithm.rollout_correction=token_mask"],
    "sequence_tis": [*BF16, "algorithm.rollout_correction=sequence_tis"],
    "sequence_mask": [*BF16, "algorithm.rollout_correction=sequence_mask"],
    "geometric_mask": [*BF16, "algorithm.rollout_correction=geometric_mask"],
}
SHOWN = ("correction/weight_mean", "correction/clip_frac", "correction/token_masked_frac",
         "correction/sample_masked_frac", "correction/ess_frac")


def run(run_dir: Path, steps: int, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}",
           f"train.steps={steps}", "checkpoint.save_every=0", "checkpoint.export_hf=false",
           "logging.progress_bar=false", "logging.tensorboard=false", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench_offpolicy: {' '.join(cmd)} failed ({proc.returncode}):\n"
                 f"{proc.stderr[-4000:]}")


def summary(run_dir: Path) -> dict[str, float]:
    from megatron_dgpo.telemetry import read_metrics

    records = read_metrics(run_dir)
    timed = records[1:]

    def mean(key, rows=timed):
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else float("nan")

    out = {key: mean(f"train/{key}") for key in SHOWN}
    out["accuracy"] = mean("rollout/accuracy", records[len(records) // 2:])
    out["mismatch"] = mean("mismatch/mean_abs_diff", records)
    out["step"] = mean("time/step")
    out["old_logprobs"] = mean("time/old_logprobs")
    out["checked_steps"] = sum("mismatch/mean_abs_diff" in r for r in records)
    out["steps"] = len(records)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary dir)")
    parser.add_argument("--reuse", action="store_true", help="summarise runs already in --out")
    parser.add_argument("--only", nargs="*", choices=list(RUNS), help="run these alone")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_offpolicy_"))
    names = args.only or list(RUNS)
    results = {}
    for index, name in enumerate(names):
        run_dir = out / f"run{list(RUNS).index(name)}"
        if not args.reuse:
            print(f"[{index + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
            run(run_dir, args.steps, RUNS[name])
        results[name] = summary(run_dir)

    def cell(value, spec=".3f"):
        return "-" if value != value else format(value, spec)

    print(f"{args.steps} steps each, means over steps 2..{args.steps} (accuracy: second half)\n")
    print("| run | accuracy | mismatch | weight mean | clipped | tokens masked | samples masked "
          "| ESS / tokens | old log-probs s | step s | old log-probs share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        share = r["old_logprobs"] / r["step"]
        print(f"| {name} | {cell(r['accuracy'])} | {cell(r['mismatch'], '.2e')} | "
              f"{cell(r['correction/weight_mean'])} | {cell(r['correction/clip_frac'])} | "
              f"{cell(r['correction/token_masked_frac'])} | "
              f"{cell(r['correction/sample_masked_frac'])} | {cell(r['correction/ess_frac'])} | "
              f"{r['old_logprobs']:.3f} | {r['step']:.3f} | {100 * share:.1f}% |")
    base, bypass = (results.get("baseline (trainer pi_old, fp32 engine)"),
                    results.get("bypass (old_logprobs: rollout)"))
    if base and bypass:
        print(f"\nbypass: time/old_logprobs {bypass['old_logprobs']:.3f} s (the baseline's "
              f"{base['old_logprobs']:.3f} s = {100 * base['old_logprobs'] / base['step']:.1f}% of "
              f"its step); step {bypass['step']:.3f} s against {base['step']:.3f} s "
              f"({100 * (1 - bypass['step'] / base['step']):+.1f}% saved); the mismatch measured "
              f"on {bypass['checked_steps']} of {bypass['steps']} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
