"""Evaluation: k samples per problem, Avg@k and unbiased Pass@k, per benchmark and averaged.

For a problem with n graded samples of which c are correct:

    Avg@n  = c / n                                  (expected accuracy of one sample)
    Pass@k = 1 - C(n - c, k) / C(n, k),  k <= n      (Chen et al. 2021, unbiased estimator of the
                                                      probability that k samples hold a correct one)

Both are averaged over the problems of a benchmark; "average" is the unweighted mean over
benchmarks (the paper's "Avg." column). k runs over 1, 2, 4, ..., n (and n itself). Samples are
graded with the conservative evaluation grader (``rewards.eval_correct``) in a ``RewardPool``;
problem i is sampled with seed ``--seed + i n``. The sampling, grading and scores are
``megatron_dgpo.rollout.evaluation``'s, which the trainer's evaluation during training (recipe
section ``eval``) shares, so both give the same numbers for the same policy and settings.

CLI (``dgpo-eval``, also ``python tools/dgpo_eval.py``):
    dgpo-eval --model runs/x/hf --benchmarks aime24 math500 --n 32 --max-tokens 8192 --out eval.json
``--benchmarks`` takes file paths or names looked up in ``--bench-dir`` (default
$DGPO_BENCHMARKS_DIR or ../shared/benchmarks next to the repository).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from megatron_dgpo.preflight import check_hf_folder
from megatron_dgpo.rollout.evaluation import (BenchmarkResult, grade_problems,  # noqa: F401
                                              ks_up_to, pass_at_k, problem_seeds, score_benchmark)
from megatron_dgpo.tasks.prompts import (PromptRecord, benchmark_files, find_benchmarks_dir,
                                         render_prompts, resolve_benchmarks)
from megatron_dgpo.runtime.errors import InputError, reported_as
from megatron_dgpo.tasks.rewards import RewardPool


def evaluate(
    engine,
    tokenizer,
    benchmarks: dict[str, list[PromptRecord]],
    *,
    n: int = 32,
    max_tokens: int = 1024,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    pool: RewardPool | None = None,
    prompts_per_call: int = 32,
    progress: bool = True,
) -> dict:
    """Sample n responses per problem with ``engine`` and grade them (evaluation grader).

    Returns a JSON-ready dict: {"benchmarks": {name: BenchmarkResult.as_dict()}, "average":
    {"avg@n", "pass@k"}, "config": {...}}.
    """
    from tqdm.auto import tqdm

    own_pool = pool is None
    pool = pool or RewardPool()
    results: dict[str, BenchmarkResult] = {}
    total = sum(len(v) for v in benchmarks.values())
    bar = tqdm(total=total, desc="dgpo-eval", unit="problem", disable=not progress)
    t0 = time.time()
    try:
        for name, records in benchmarks.items():
            if not records:
                raise ValueError(f"benchmark {name!r} has no problems")
            prompts = render_prompts(tokenizer, records)
            correct, lengths, truncated = [], [], 0
            for start in range(0, len(records), prompts_per_call):
                stop = min(start + prompts_per_call, len(records))
                graded = grade_problems(engine, pool, tokenizer, prompts[start:stop],
                                        [r.ground_truth for r in records[start:stop]],
                                        problem_seeds(seed, range(start, stop), n), n=n,
                                        max_tokens=max_tokens, temperature=temperature, top_p=top_p)
                correct += graded.correct
                lengths += graded.lengths
                truncated += graded.truncated
                bar.update(stop - start)
                bar.set_postfix(bench=name)
            results[name] = score_benchmark(
                name, correct, n, mean_response_tokens=sum(lengths) / len(lengths), truncated_frac=truncated / len(lengths)
            )
    finally:
        bar.close()
        if own_pool:
            pool.close()
    ks = ks_up_to(n)
    average = {
        f"avg@{n}": sum(r.avg for r in results.values()) / len(results),
        "pass@k": {str(k): sum(r.pass_at[k] for r in results.values()) / len(results) for k in ks},
    }
    return {
        "benchmarks": {name: r.as_dict() for name, r in results.items()},
        "average": average,
        "config": {"n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                   "grader": "eval", "seconds": round(time.time() - t0, 2)},
    }


def format_table(result: dict) -> str:
    """A fixed-width table: one row per benchmark plus the average, Avg@n then Pass@k in %."""
    n = result["config"]["n"]
    ks = [str(k) for k in ks_up_to(n)]
    header = ["benchmark", "problems", f"Avg@{n}"] + [f"Pass@{k}" for k in ks]
    rows = []
    for name, r in result["benchmarks"].items():
        rows.append([name, str(r["num_problems"]), f"{100 * r[f'avg@{n}']:.1f}"] + [f"{100 * r['pass@k'][k]:.1f}" for k in ks])
    avg = result["average"]
    rows.append(["average", "", f"{100 * avg[f'avg@{n}']:.1f}"] + [f"{100 * avg['pass@k'][k]:.1f}" for k in ks])
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    line = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _resolve_benchmarks(specs: Sequence[str] | None, bench_dir: str | None, limit: int | None) -> dict[str, list[PromptRecord]]:
    if not specs:
        directory = Path(bench_dir) if bench_dir else find_benchmarks_dir()
        specs = list(benchmark_files(directory)) if directory and directory.is_dir() else []
        if not specs:
            raise InputError("no --benchmarks given and no benchmark folder found (--bench-dir)")
    return resolve_benchmarks(specs, bench_dir, limit=limit)


def _build_engine(args):
    """The engine ``--engine`` asks for, built by the trainer's own factory."""
    from megatron_dgpo.rollout.config import RolloutConfig
    from megatron_dgpo.rollout.generate import build_engine

    config = RolloutConfig(engine=args.engine, dtype=args.dtype, tensor_parallel_size=args.tp,
                           max_response_tokens=args.max_tokens,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           kv_cache_memory_bytes=(args.kv_cache_mb << 20) if args.kv_cache_mb else None)
    return build_engine(config, args.model, seed=args.seed, max_model_len=args.max_model_len,
                        placement="separate")  # one process, no torch.distributed group


@reported_as("dgpo-eval")
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dgpo-eval", description="Avg@k / Pass@k of a model on math benchmarks.")
    p.add_argument("--model", required=True, help="HF model folder (weights + tokenizer)")
    p.add_argument("--benchmarks", nargs="*", help="benchmark files or names (default: all found in --bench-dir)")
    p.add_argument("--bench-dir", help="folder with aime24.jsonl, ... (default: $DGPO_BENCHMARKS_DIR or ../shared/benchmarks)")
    p.add_argument("--n", "-k", type=int, default=32, help="samples per problem (k_max)")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="first N problems of each benchmark")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + response limit (default: max-tokens + 2048, at most the model's positions)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--kv-cache-mb", type=int, default=None, help="KV-cache size in MiB (CPU default 256)")
    p.add_argument("--workers", type=int, default=2, help="grading processes")
    p.add_argument("--grade-timeout", type=float, default=4.0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from megatron_dgpo.convert.safetensors_io import read_hf_config

    if not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (a local HF model folder is "
                f"needed; nothing is downloaded)")
    check_hf_folder(Path(args.model), f"--model {args.model}", trainable=False)
    benchmarks = _resolve_benchmarks(args.benchmarks, args.bench_dir, args.limit)
    if args.max_model_len is None:  # room for a long prompt, within what the model's positions allow
        positions = read_hf_config(args.model).get("max_position_embeddings")
        args.max_model_len = min(args.max_tokens + 2048, positions or float("inf"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with _build_engine(args) as engine, RewardPool(num_workers=args.workers, timeout_s=args.grade_timeout) as pool:
        result = evaluate(engine, tokenizer, benchmarks, n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, seed=args.seed, pool=pool, progress=not args.no_progress)
    result["config"].update(model=str(args.model), engine=args.engine)
    print(format_table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
