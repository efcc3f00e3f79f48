#!/usr/bin/env python
"""Generation's long tail off the critical path, measured on CPU with dedicated engines:
synchronous (``rollout.max_staleness: 0``), one-step-off (``1``) and the streaming schedule at
``2`` with partial rollouts, on a task whose response lengths have a long tail.

    .venv/bin/python benchmarks/bench_staleness.py [--steps 20] [--max-num-seqs 256] [--out DIR [--reuse]]

The task: the tiny recipe (``recipes/tiny_cpu.yaml``, the built-in "repeat" prompts) on a tiny
random Qwen2 whose end-of-sequence token is likely at every position (~2.3%), so response
lengths are geometric, as a reasoning model's are long-tailed: mean ~40 tokens, capped at
``max_response_tokens`` 256, and the longest of a step's 256 responses several times the mean,
which a synchronous step waits for. Each run: ``torchrun --nproc-per-node 2``, one trainer rank
and one engine rank (one OpenMP thread each; on a 2-core machine each side holds a core). Per
mode, over the steps after the first (warm-up), the ratios to synchronous of:

* trained samples per second (responses trained / the steps' wall time);
* generated tokens per second (tokens the engine sampled, kept or not / the same time);
* and, after the same number of trained samples, accuracy on the 10 problems (32 samples each,
  ``megatron_dgpo.rollout.evaluation`` on the exported policy) and the mean reward of the last
  five steps;
* what interrupting costs (streaming): tokens prefilled again to continue responses, per
  generated token, and the share of trained responses sampled across a refit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_async import run  # noqa: E402  (the same torchrun job, one engine rank)

EOS_BIAS = 0.3
"""The end-of-sequence logit's offset, through a residual dimension held at 1 (P(eos) ~2.3%)."""
MODES = {"synchronous": (0, []), "one-step-off": (1, []),
         "k = 2, partial": (2, ["rollout.partial=true"])}
WORKLOAD = ["rollout.max_response_tokens=256", "train.micro_batch_tokens=2048",
            # a tenth of the recipe's learning rate: at 3e-3 the policy learns within a few
            # steps to put the end-of-sequence token off, and every response hits the cap
            "optimizer.lr=3.0e-4",
            "checkpoint.export_hf=true", "checkpoint.save_every=0"]


def long_tailed_model(out: Path) -> Path:
    """A tiny random Qwen2 whose end-of-sequence token has a constant extra logit: every
    embedding's first dimension is 1 and only the EOS row of the output layer reads it."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dgpo.tasks.tiny import make_tiny_model

    if (out / "config.json").is_file():
        return out
    folder = make_tiny_model(out, seed=0, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[model.config.eos_token_id, 0] = EOS_BIAS
    model.save_pretrained(folder)
    return folder


def held_out_accuracy(hf_dir: Path) -> float:
    """Avg@32 of the exported policy on the 10 "repeat" problems (256 tokens, the evaluation
    grader: ``megatron_dgpo.rollout.evaluation``)."""
    from transformers import AutoTokenizer

    from megatron_dgpo.rollout.config import RolloutConfig
    from megatron_dgpo.rollout.evaluation import grade_problems, problem_seeds
    from megatron_dgpo.rollout.generate import build_engine, reward_pool
    from megatron_dgpo.tasks.prompts import builtin_prompts, render_prompts

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    records = [r for r in builtin_prompts() if r.family == "repeat"]
    config = RolloutConfig(dtype="float32", kv_cache_memory_bytes=64 << 20,
                           max_response_tokens=256, max_prompt_tokens=96)
    with build_engine(config, hf_dir, placement="separate") as engine:
        pool = reward_pool()
        try:
            graded = grade_problems(engine, pool, tokenizer, render_prompts(tokenizer, records),
                                    [r.ground_truth for r in records],
                                    problem_seeds(7, range(len(records)), 32), n=32,
                                    max_tokens=256, temperature=1.0, top_p=1.0)
        finally:
            pool.close()
    return sum(graded.correct) / (32 * len(records))


def summary(run_dir: Path) -> dict[str, float]:
    from megatron_dgpo.telemetry import read_metrics

    records = read_metrics(run_dir)
    timed = records[1:]
    seconds = sum(r["time/step"] for r in timed)
    generated = sum(r.get("rollout/generated_tokens",
                          r["rollout/response_length_mean"] * r["rollout/num_samples"])
                    for r in timed)
    stream = [r for r in timed if "rollout/reprefill_tokens" in r]
    return {
        "samples_per_s": sum(r["rollout/num_samples"] for r in timed) / seconds,
        "tokens_per_s": generated / seconds,
        "step": seconds / len(timed),
        "length_mean": sum(r["rollout/response_length_mean"] for r in timed) / len(timed),
        "length_max": sum(r["rollout/response_length_max"] for r in timed) / len(timed),
        "staleness": sum(r["rollout/staleness_mean"] for r in timed) / len(timed),
        "reward_last5": sum(r["rollout/reward_mean"] for r in records[-5:]) / 5,
        "reprefill_per_token": (sum(r["rollout/reprefill_tokens"] for r in stream)
                                / max(sum(r["rollout/generated_tokens"] for r in stream), 1.0)
                                if stream else 0.0),
        "partial_frac": (sum(r["rollout/partial_frac"] for r in stream) / len(stream)
                         if stream else 0.0),
        "accuracy": held_out_accuracy(run_dir / "hf"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="rollout.max_num_seqs: fewer makes the engine, not the trainer, the "
                             "bottleneck (responses are in flight at every refit)")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here")
    parser.add_argument("--reuse", action="store_true",
                        help="with --out: tabulate finished runs found there instead of re-running")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_staleness_"))
    model = long_tailed_model(out / "model")
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; runs in {out}\n",
          flush=True)
    rows = {}
    for mode, (staleness, extra) in MODES.items():
        run_dir = out / (mode.replace(" ", "").replace(",", "_").replace("=", "")
                         + f"_seqs{args.max_num_seqs}")
        done = (run_dir / "hf").is_dir()
        if not (done and args.reuse):
            run(run_dir, staleness, args.steps,
                [*WORKLOAD, *extra, "model.tiny=null", f"model.path={model}",
                 f"rollout.max_num_seqs={args.max_num_seqs}"])
        rows[mode] = summary(run_dir)
        print(f"  {mode}: {json.dumps({k: round(v, 4) for k, v in rows[mode].items()})}", flush=True)
    base = rows["synchronous"]
    print("\n| mode | step s | trained samples/s | generated tokens/s | response length mean / max "
          "| staleness (tokens) | re-prefilled per generated token | responses across a refit "
          "| reward, last 5 steps | held-out accuracy |")
    print("| " + " | ".join(["---"] * 10) + " |")
    for mode, s in rows.items():
        print(f"| {mode} | {s['step']:.2f} | {s['samples_per_s']:.1f} "
              f"({s['samples_per_s'] / base['samples_per_s']:.2f}x) | {s['tokens_per_s']:.0f} "
              f"({s['tokens_per_s'] / base['tokens_per_s']:.2f}x) | {s['length_mean']:.1f} / "
              f"{s['length_max']:.0f} | {s['staleness']:.2f} | {s['reprefill_per_token']:.3f} | "
              f"{s['partial_frac']:.3f} | {s['reward_last5']:+.3f} | {s['accuracy']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
