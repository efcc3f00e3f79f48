"""The paper's comparison at CPU scale: one warm start, six methods x seeds x settings, a report.

    .venv/bin/python benchmarks/reproduce.py --out outputs/reproduce              # the full study
    .venv/bin/python benchmarks/reproduce.py --out /tmp/r --methods dgpo --seeds 0 --steps 2

What it runs (each stage skipped when its output already exists, so an interrupted study
continues where it stopped; a cell already in ``results.csv`` is not run again):

1. the column-addition task (``megatron_dgpo.tasks.arithmetic``): supervised pairs, RL prompts,
   held-out problems and a random tiny Qwen2 (``<out>/task``);
2. the supervised warm start (``megatron_dgpo.sft``, ``recipes/sft_arithmetic.yaml``,
   ``<out>/sft/hf``), evaluated on the held-out problems, as is the random initial model;
3. for each setting (``SETTINGS``) x method x seed, RL from the warm start (``recipes/arithmetic_cpu.yaml``
   plus the setting's overrides, ``<out>/runs/<setting>/<method>/seed<k>``), then the final
   policy evaluated on the held-out problems by ``dgpo-eval`` (Avg@k, Pass@k);
4. ``results.csv`` (one row per cell, ``COLUMNS``), ``results.md`` (mean and spread over seeds
   per setting x method, and how many seeds a 3-point gap needs) and ``results.png``
   (accuracy, entropy, the weight on grad pi in LN and HP, and the pre-clip gradient norm vs
   step: the mean over seeds per method with the min-max band).

Every number comes from the trainer's ``metrics.jsonl`` and ``dgpo-eval``'s JSON. A cell is a
function of its recipe and seed: run again, it gives the same row.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from threading import Lock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dgpo.algorithm.losses import TOKEN_METHODS as METHODS  # noqa: E402  (the paper's six)
from megatron_dgpo.telemetry import read_metrics  # noqa: E402

SFT_RECIPE = ROOT / "recipes" / "sft_arithmetic.yaml"
RL_RECIPE = ROOT / "recipes" / "arithmetic_cpu.yaml"


@dataclass(frozen=True)
class Setting:
    """One regime of the study: the recipe overrides that define it, and why."""

    overrides: tuple[str, ...]
    about: str
    steps: int | None = None
    """RL steps of this setting's cells (None: ``--steps``)."""
    plotted: bool = True
    """A row of the figure (False for a setting whose curves another row already shows)."""


SETTINGS = {
    "paper": Setting(("optimizer.lr=auto",),
                     "the paper's regime: 16 updates per rollout batch at the learning rate of the "
                     "paper's own rule, 1e-6 at 1.5B scaled by sqrt(1.5e9 / N) (6.3e-5 for the "
                     "0.38M-parameter policy); 0.7% of tokens fall in the clip regions over the "
                     "first 3 steps (up to 1.8%), 0.2% over a run as the policy sharpens"),
    "paper_early": Setting(("optimizer.lr=auto",),
                           "the paper setting stopped after 10 steps, before training accuracy "
                           "saturates: with a constant learning rate its runs are the first 10 "
                           "steps of the paper setting's, so the held-out evaluation shows how far "
                           "each method got early", steps=10, plotted=False),
    "verdict": Setting(("optimizer.lr=auto",),
                       "the paper's learning rate for 20 steps from a less-trained warm start "
                       "(run with --sft-steps 300: 29-34% held-out instead of 63%, 0.09 nats/token), "
                       "so that training neither saturates nor starts near-deterministic; DGPO and "
                       "GRPO only, 10 seeds x 2 warm starts, paired by warm start and seed",
                       steps=20),
    "lr_3x": Setting(("optimizer.lr=auto", "optimizer.lr_reference=3e-6"),
                     "3x the paper's learning rate (1.9e-4): between the stable paper setting and "
                     "the one-step collapse of the stress setting, where the methods' clipping "
                     "can decide whether a run survives"),
    "stress": Setting(("optimizer.lr=auto", "optimizer.lr_reference=1e-5"),
                      "10x the paper's learning rate (6.3e-4): the later updates of the first "
                      "rollout batch push tokens far outside the trust region, into LN (w -> 0 "
                      "for negative advantages), where the soft-clipping methods' weight on "
                      "grad pi is unbounded; every method's accuracy collapses in that step"),
}
COLUMNS = ("setting", "method", "seed", "warm_start", "final_accuracy", "eval_avg_at_k", "eval_pass_at_k",
           "entropy_start", "entropy_end", "max_LN_weight_on_grad_pi", "max_HP_weight_on_grad_pi",
           "max_grad_norm", "clipped_token_frac", "truncated_frac", "skipped_updates", "seconds")
LAST = 5
"""Steps averaged at the end of a run (final_accuracy, entropy_end, truncated_frac)."""
EARLY = (6, 10)
"""Steps whose training accuracy the report shows as the early learning speed (first, last)."""


def _run(cmd: list[str], log: Path) -> None:
    """Run ``cmd`` from the repository root with its output in ``log``; an error quotes the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {code}); log {log}:\n{tail}")


def evaluate(model_dir: Path, heldout: Path, out: Path, n: int, max_tokens: int, limit: int | None) -> dict:
    """``dgpo-eval`` of ``model_dir`` on the held-out problems (cached in ``out``)."""
    if not out.is_file():
        cmd = [sys.executable, "-m", "megatron_dgpo.evaluate", "--model", str(model_dir),
               "--benchmarks", str(heldout), "--n", str(n), "--max-tokens", str(max_tokens),
               "--kv-cache-mb", "64", "--workers", "1", "--no-progress", "--out", str(out)]
        if limit:
            cmd += ["--limit", str(limit)]
        _run(cmd, out.with_suffix(".log"))
    return json.loads(out.read_text())


def warm_start_name(seed: int) -> str:
    """The warm start of supervised seed ``seed``: ``sft`` for seed 0 (the study's first), else
    ``sft_w<seed>``; also the name of its evaluation (``warm_start`` / ``warm_start_w<seed>``)."""
    return "sft" if seed == 0 else f"sft_w{seed}"


def warm_start(out: Path, sft_steps: int, args, seed: int = 0) -> Path:
    """The task and the supervised warm start of ``sft.seed=seed`` (once each); returns the
    warm-started HF folder. Warm starts differ in the SFT data order (the seed); the task and
    the random initial policy are shared."""
    from megatron_dgpo.tasks.arithmetic import make_task

    task = make_task(out / "task")
    sft_dir = out / warm_start_name(seed)
    warm = "warm_start" if seed == 0 else f"warm_start_w{seed}"

    def evaluation(name: str, model_dir: Path):
        return lambda: evaluate(model_dir, task / "heldout.jsonl", out / "eval" / f"{name}.json",
                                args.eval_n, args.max_tokens, args.eval_limit)

    initial = evaluation("initial", task / "initial_model")
    with ThreadPoolExecutor(max_workers=1) as pool:
        # the random policy's evaluation needs only the task: with --jobs > 1 it runs beside
        # the supervised run (a process each)
        beside = pool.submit(initial) if args.jobs > 1 else None
        if not (sft_dir / "hf" / "config.json").is_file():
            _run([sys.executable, "-m", "megatron_dgpo.sft", str(SFT_RECIPE), f"run_dir={sft_dir}",
                  f"model.path={task / 'initial_model'}", f"sft.data={task / 'sft.jsonl'}",
                  f"sft.steps={sft_steps}", f"sft.seed={seed}", "logging.progress_bar=false"],
                 sft_dir / "sft.log")
        if beside is None:
            initial()
        else:
            beside.result()
    evaluation(warm, sft_dir / "hf")()
    return sft_dir / "hf"


def cell_dir(out: Path, setting: str, method: str, seed: int, warm: int = 0) -> Path:
    """The run directory of one cell (warm start 0's cells keep the study's first layout)."""
    base = out / "runs" / setting
    return (base if warm == 0 else base / f"w{warm}") / method / f"seed{seed}"


def run_cell(out: Path, setting: str, method: str, seed: int, warm: int, args) -> dict:
    """RL for one setting x method x seed from warm start ``warm``, then its held-out
    evaluation; returns the cell's ``results.csv`` row."""
    run_dir = cell_dir(out, setting, method, seed, warm)
    begin = time.perf_counter()
    if not (run_dir / "hf" / "config.json").is_file():
        _run([sys.executable, "-m", "megatron_dgpo.train", str(RL_RECIPE), f"run_dir={run_dir}",
              f"model.path={out / warm_start_name(warm) / 'hf'}",
              f"data.source={out / 'task' / 'train.jsonl'}",
              f"algorithm.method={method}", f"train.seed={seed}",
              f"train.steps={SETTINGS[setting].steps or args.steps}",
              "logging.progress_bar=false", *SETTINGS[setting].overrides], run_dir / "train.log")
    result = evaluate(run_dir / "hf", out / "task" / "heldout.jsonl", run_dir / "eval.json",
                      args.eval_n, args.max_tokens, args.eval_limit)
    return cell_row(setting, method, seed, read_metrics(run_dir), result,
                    time.perf_counter() - begin, warm)


def cell_row(setting: str, method: str, seed: int, records: list[dict], result: dict,
             seconds: float, warm: int = 0) -> dict:
    """One ``results.csv`` row from a run's metrics records and its evaluation result."""
    if not records:
        raise ValueError(f"{setting}/{method}/seed{seed}: the run logged no step")
    last = records[-LAST:]

    def mean(key, rows=last):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(values) if values else math.nan

    def peak(key):
        values = [r[key] for r in records if r.get(key) is not None]
        return max(values) if values else math.nan

    n = result["config"]["n"]
    average = result["average"]
    return {"setting": setting, "method": method, "seed": seed, "warm_start": warm,
            "final_accuracy": mean("rollout/accuracy"),
            "eval_avg_at_k": average[f"avg@{n}"], "eval_pass_at_k": average["pass@k"][str(n)],
            "entropy_start": records[0]["train/entropy"], "entropy_end": mean("train/entropy"),
            "max_LN_weight_on_grad_pi": peak("train/F_over_w/LN_max"),
            "max_HP_weight_on_grad_pi": peak("train/F_over_w/HP_max"),
            "max_grad_norm": peak("train/grad_norm_max"),
            "clipped_token_frac": 1 - mean("train/region/M_frac", records),
            "truncated_frac": mean("rollout/truncated_frac"),
            "skipped_updates": int(records[-1]["train/skipped_updates_total"]),
            "seconds": round(seconds, 1)}


def read_results(path: Path) -> list[dict]:
    """The rows of ``results.csv`` (numbers parsed), [] when absent. A file written before the
    ``warm_start`` column existed reads as warm start 0."""
    if not path.is_file():
        return []
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row.setdefault("warm_start", "0")
        for key in COLUMNS[2:]:
            row[key] = (int(row[key]) if key in ("seed", "warm_start", "skipped_updates")
                        else float(row[key]))
    return rows


def append_result(path: Path, row: dict) -> None:
    """Append ``row``; a file with an older header is rewritten with today's columns first."""
    if path.is_file():
        with open(path) as f:
            header = next(csv.reader(f), [])
        if tuple(header) != COLUMNS:
            rows = read_results(path)
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS)
                writer.writeheader()
                writer.writerows({k: r[k] for k in COLUMNS} for r in rows)
    new = not path.is_file()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def seeds_for_gap(std: float, gap: float = 0.03) -> int:
    """Seeds per method for a two-sided 5% test to detect ``gap`` with 80% power, given the
    per-seed standard deviation ``std`` of the metric: n = 2 (z_0.975 + z_0.8)^2 std^2 / gap^2."""
    return max(2, math.ceil(2 * (1.959964 + 0.841621) ** 2 * std**2 / gap**2))


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (Lentz's method)."""
    tiny, front = 1e-300, 1.0
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
            front = d * c
        if abs(front - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    return incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (q > 0.5) of Student's t with ``df`` degrees of freedom (bisection)."""
    low, high = 0.0, 1e3
    for _ in range(200):
        mid = (low + high) / 2
        if 1.0 - t_two_sided_p(mid, df) / 2.0 < q:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def sign_flip_p(differences: list[float]) -> float:
    """Two-sided p of the paired sign-flip (randomisation) test: the share of the 2^n sign
    assignments whose mean is at least as far from 0 as the observed one (exact; n <= 20)."""
    n = len(differences)
    if not 1 <= n <= 20:
        raise ValueError(f"sign_flip_p enumerates 2^n assignments: n must be 1..20, got {n}")
    observed = abs(sum(differences)) - 1e-12
    hits = sum(abs(sum(d if mask >> i & 1 else -d for i, d in enumerate(differences))) >= observed
               for mask in range(1 << n))
    return hits / (1 << n)


@dataclass(frozen=True)
class Paired:
    """A paired comparison of method ``a`` against ``b``: differences a - b of one metric over
    the cells they share, paired by (warm start, seed) (same warm start, same first rollout)."""

    a: str
    b: str
    differences: list[float]
    by_warm_start: dict[int, list[float]]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.differences)

    @property
    def t(self) -> float:
        n, sd = len(self.differences), statistics.stdev(self.differences)
        return self.mean / (sd / math.sqrt(n)) if sd > 0 else math.copysign(math.inf, self.mean)

    @property
    def p(self) -> float:
        return t_two_sided_p(self.t, len(self.differences) - 1) if math.isfinite(self.t) else 0.0

    def interval(self, level: float = 0.95) -> tuple[float, float]:
        n = len(self.differences)
        half = t_quantile(0.5 + level / 2, n - 1) * statistics.stdev(self.differences) / math.sqrt(n)
        return self.mean - half, self.mean + half


def paired(rows: list[dict], setting: str, a: str, b: str, key: str = "eval_avg_at_k") -> Paired | None:
    """``Paired`` of ``a`` vs ``b`` at ``setting`` (None with fewer than 3 pairs)."""
    cells = {(r["method"], r.get("warm_start", 0), r["seed"]): r[key]
             for r in rows if r["setting"] == setting}
    pairs = sorted((w, k) for (m, w, k) in cells if m == a and (b, w, k) in cells)
    if len(pairs) < 3:
        return None
    by_warm: dict[int, list[float]] = {}
    for w, k in pairs:
        by_warm.setdefault(w, []).append(cells[a, w, k] - cells[b, w, k])
    return Paired(a, b, [d for w in sorted(by_warm) for d in by_warm[w]], by_warm)


def verdict(comparison: Paired, level: float = 0.05) -> str:
    """One paragraph: the paired difference in points with its CI and tests, per warm start,
    and whether ``a`` beating ``b`` is reproduced (significant at ``level`` by the paired t
    test and the sign-flip test, and ahead in every warm start)."""
    c, scale = comparison, 100.0
    low, high = c.interval(1 - level)
    warm = ", ".join(f"warm start {w}: {scale * statistics.fmean(d):+.1f} ({len(d)} pairs)"
                     for w, d in sorted(c.by_warm_start.items()))
    flip = sign_flip_p(c.differences) if len(c.differences) <= 20 else math.nan
    ahead = all(statistics.fmean(d) > 0 for d in c.by_warm_start.values())
    holds = c.p < level and flip < level and ahead and c.mean > 0
    return (f"{c.a} - {c.b}, held-out Avg@k: {scale * c.mean:+.1f} points over "
            f"{len(c.differences)} pairs ({1 - level:.0%} CI {scale * low:+.1f} to "
            f"{scale * high:+.1f}; paired t = {c.t:.2f}, df {len(c.differences) - 1}, "
            f"p = {c.p:.3g}; sign-flip p = {flip:.3g}); {warm}. "
            + (f"**Reproduced at this scale**: {c.a} ends above {c.b}."
               if holds else f"**Not reproduced at this scale**: no significant lead of {c.a} "
                             f"over {c.b} that holds in every warm start."))


def early_accuracy(records: list[dict]) -> float:
    """Mean training accuracy over steps ``EARLY`` (NaN for a shorter run)."""
    values = [r["rollout/accuracy"] for r in records if EARLY[0] <= r["step"] <= EARLY[1]]
    return statistics.fmean(values) if len(values) == EARLY[1] - EARLY[0] + 1 else math.nan


def summary_table(rows: list[dict], evals: dict[str, dict], k: int, metrics: dict) -> str:
    """The markdown report: warm start, then mean +- std over seeds per setting x method (the
    early training accuracy and step-1 grad norm from each cell's ``metrics`` records, keyed by
    (setting, method, seed))."""
    def fmt(values, scale=100.0, digits=1):
        values = [v * scale for v in values if not math.isnan(v)]
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.{digits}f}"
        return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"

    lines = [f"- `{name}`: {setting.about}." for name, setting in SETTINGS.items()
             if any(r["setting"] == name for r in rows)]
    lines += ["", "| policy | held-out Avg@%d | Pass@%d |" % (k, k), "|---|---|---|"]
    for name, result in evals.items():
        lines.append(f"| {name} | {100 * result['average'][f'avg@{k}']:.1f} | "
                     f"{100 * result['average']['pass@k'][str(k)]:.1f} |")
    lines += ["", f"| setting | method | seeds | held-out Avg@{k} | Pass@{k} | "
              f"train acc (steps {EARLY[0]}-{EARLY[1]}) | train acc (last {LAST}) | "
              "entropy start → end | max LN F/w | max HP F/w | step-1 grad norm | max grad norm | "
              "clipped tokens % | truncated % | skipped |", "|" + "---|" * 15]
    stds: dict[str, list[float]] = {}
    for setting in SETTINGS:
        for method in METHODS:
            cell = [r for r in rows if r["setting"] == setting and r["method"] == method]
            if not cell:
                continue
            col = lambda key: [r[key] for r in cell]  # noqa: E731
            records = [metrics[setting, method, r["seed"], r["warm_start"]] for r in cell]
            early = [early_accuracy(run) for run in records]
            # the first step is on the shared warm start: how hard each method pushes from it
            first_norm = [run[0]["train/grad_norm_max"] for run in records]
            if len(cell) > 1:
                stds.setdefault(setting, []).append(statistics.stdev(col("eval_avg_at_k")))
            lines.append(
                f"| {setting} | {method} | {len(cell)} | {fmt(col('eval_avg_at_k'))} | "
                f"{fmt(col('eval_pass_at_k'))} | {fmt(early)} | {fmt(col('final_accuracy'))} | "
                f"{fmt(col('entropy_start'), 1, 3)} → {fmt(col('entropy_end'), 1, 3)} | "
                f"{_range(col('max_LN_weight_on_grad_pi'))} | {_range(col('max_HP_weight_on_grad_pi'))} | "
                f"{fmt(first_norm, 1, 1)} | {_range(col('max_grad_norm'))} | "
                f"{fmt(col('clipped_token_frac'), 100, 2)} | "
                f"{fmt(col('truncated_frac'))} | {sum(col('skipped_updates'))} |")
    lines.append("")
    for setting, values in stds.items():  # per setting: a collapsed setting's spread is ~0
        pooled = math.sqrt(statistics.fmean(v * v for v in values))
        if pooled < 0.005:
            lines.append(f"- `{setting}`: no seed spread of held-out Avg@{k} (every run ends at "
                         f"the same accuracy).")
            continue
        lines.append(f"- `{setting}`: seed spread of held-out Avg@{k}, pooled over {len(values)} "
                     f"methods: {100 * pooled:.1f} points; a 3-point gap between two methods needs "
                     f"{seeds_for_gap(pooled)} seeds per method (two-sided 5% test, 80% power).")
    comparisons = [(setting, paired(rows, setting, "dgpo", "grpo")) for setting in SETTINGS]
    comparisons = [(setting, c) for setting, c in comparisons if c is not None]
    if comparisons:
        lines += ["", "DGPO vs GRPO, paired by warm start and seed (the same warm start and seed "
                      "give both methods the same first rollout):", ""]
        lines += [f"- `{setting}`: {verdict(c)}" for setting, c in comparisons]
    return "\n".join(lines) + "\n"


def _range(values: list[float]) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "-"
    return f"{min(finite):.3g}–{max(finite):.3g}" if len(finite) > 1 else f"{finite[0]:.3g}"


PANELS = (("rollout/accuracy", "training accuracy", "linear"),
          ("train/entropy", "entropy (nats/token)", "linear"),
          ("train/F_over_w/LN_max", "LN: max F / w (weight on grad pi)", "log"),
          ("train/F_over_w/HP_max", "HP: max F / w", "log"),
          ("train/grad_norm_max", "max pre-clip grad norm", "log"))


def plot(rows: list[dict], metrics: dict, path: Path) -> None:
    """Overlay per setting (rows) and metric (columns): mean over seeds per method vs step,
    with the min-max band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in SETTINGS if SETTINGS[s].plotted and any(r["setting"] == s for r in rows)]
    fig, axes = plt.subplots(len(settings), len(PANELS), figsize=(4.2 * len(PANELS), 3.4 * len(settings)),
                             squeeze=False)
    for i, setting in enumerate(settings):
        for method in METHODS:
            runs = [metrics[setting, method, r["seed"], r["warm_start"]]
                    for r in rows if r["setting"] == setting and r["method"] == method]
            if not runs:
                continue
            for j, (key, title, scale) in enumerate(PANELS):
                steps = min(len(run) for run in runs)
                series = [[run[s].get(key) for run in runs] for s in range(steps)]
                # a log axis cannot show 0 (no token in the region that step); a step without
                # a value is a gap (NaN), not a line drawn across it
                series = [[v for v in vs if v is not None and (scale == "linear" or v > 0)]
                          for vs in series]
                stat = lambda f: [f(vs) if vs else math.nan for vs in series]  # noqa: E731
                xs = range(1, steps + 1)
                ax = axes[i][j]
                line, = ax.plot(xs, stat(statistics.fmean), label=method, lw=1.4, marker=".", ms=3)
                ax.fill_between(xs, stat(min), stat(max), color=line.get_color(), alpha=0.15)
                ax.set_title(f"{setting}: {title}", fontsize=9)
                ax.set_xlabel("RL step", fontsize=8)
        axes[i][0].legend(fontsize=7)
        for j, (_, _, scale) in enumerate(PANELS):
            if any(not all(map(math.isnan, line.get_ydata())) for line in axes[i][j].lines):  # log needs a point
                axes[i][j].set_yscale(scale)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/reproduce", help="study folder (created; resumable)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="RL steps per cell")
    parser.add_argument("--sft-steps", type=int, default=400, help="supervised warm-start steps")
    parser.add_argument("--warm-starts", nargs="+", type=int, default=[0],
                        help="supervised seeds: one warm start each, every cell run from each")
    parser.add_argument("--eval-n", type=int, default=8, help="samples per held-out problem (k)")
    parser.add_argument("--eval-limit", type=int, default=None, help="first N held-out problems")
    parser.add_argument("--max-tokens", type=int, default=48, help="response limit in evaluation")
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes run at once (one core each): cells, and the random "
                             "policy's evaluation beside the warm start")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.csv"

    begin = time.perf_counter()
    for seed in args.warm_starts:
        warm_start(out, args.sft_steps, args, seed)
    print(f"warm start(s) ready ({time.perf_counter() - begin:.0f} s)", flush=True)
    done = {(r["setting"], r["method"], r["seed"], r["warm_start"]) for r in read_results(results)}
    todo = [(s, m, k, w) for w in args.warm_starts for s in args.settings for k in args.seeds
            for m in args.methods if (s, m, k, w) not in done]
    lock = Lock()

    def work(cell):
        row = run_cell(out, *cell, args)
        with lock:
            append_result(results, row)
            print(f"{cell[0]:>6} {cell[1]:>7} seed {cell[2]} warm {cell[3]}: held-out Avg@{args.eval_n} "
                  f"{100 * row['eval_avg_at_k']:.1f}, train acc {100 * row['final_accuracy']:.1f}, "
                  f"max LN F/w {row['max_LN_weight_on_grad_pi']:.3g} ({row['seconds']:.0f} s)", flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(work, cell) for cell in todo]:
            future.result()

    rows = [r for r in read_results(results) if r["setting"] in SETTINGS and r["method"] in METHODS]
    evals = {path.stem: json.loads(path.read_text())
             for path in sorted((out / "eval").glob("*.json"))}  # initial, warm_start[_w<seed>]
    cells = [(r["setting"], r["method"], r["seed"], r["warm_start"]) for r in rows]
    metrics = {cell: read_metrics(cell_dir(out, *cell)) for cell in cells}  # read once, used twice
    (out / "results.md").write_text(summary_table(rows, evals, args.eval_n, metrics))
    plot(rows, metrics, out / "results.png")
    print((out / "results.md").read_text())
    print(f"wrote {results}, {out / 'results.md'}, {out / 'results.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
