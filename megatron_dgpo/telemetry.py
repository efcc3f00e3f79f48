"""Per-step metrics: one JSON line per step, TensorBoard scalars, and wandb when configured.

The JSONL file is the source of truth (``tools/plot_run.py`` reads it); TensorBoard and wandb
are views of the same numbers. Only rank 0 of a job writes; other ranks get a logger that
drops everything, so callers never branch on the rank.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class LoggingConfig:
    """Where and how the trainer reports metrics."""

    tensorboard: bool = True
    """Also write TensorBoard event files under ``<run_dir>/tensorboard``."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project too (requires `wandb` and a login); None: off."""
    wandb_run_name: str | None = None
    """Name of the wandb run; defaults to the run directory's name."""
    progress_bar: bool = True
    """Show a progress bar over training steps on rank 0."""
    samples: bool = False
    """The ledger of samples: ``<run_dir>/samples.jsonl``, one line per trained response (the
    step that trained it, its prompt's index in the dataset and position in the prompt stream,
    its sample index in the group, the weight version of each of its segments, its length,
    finish reason and reward), written by rank 0 before the step's checkpoint; a resumed run
    continues it with no gap and no duplicate. Off: nothing written."""
    verbose: bool = False
    """Show other packages' notices on the console too (Transformer-Engine and apex fallbacks,
    Megatron-Core's deprecations, vLLM's INFO lines). False: they go to
    ``<run_dir>/logs/rank<k>.log``; errors and the project's own lines stay on the console."""


class MetricsLogger:
    """Writes ``{"step": s, "time": t, **metrics}`` per step to ``<run_dir>/metrics.jsonl``.

    Appends, so a resumed run continues the same file; ``truncate_after(step)`` moves the lines
    a run wrote past the checkpoint it resumes from (steps it will run again) to
    ``metrics.replaced.jsonl``, and ``log`` refuses a step not after the last one logged, so the
    file never shows a step twice. Non-finite numbers are written as JSON ``null`` (the line
    stays valid JSON).
    """

    def __init__(self, run_dir: str | os.PathLike, config: LoggingConfig | None = None,
                 enabled: bool = True):
        self.config = config or LoggingConfig()
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._lines = JsonLines(self.path, enabled)
        self._tb = self._wandb = None
        self._last_step = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if self.config.wandb_project:
            import wandb

            self._wandb = wandb.init(project=self.config.wandb_project,
                                     name=self.config.wandb_run_name or Path(run_dir).name,
                                     dir=str(run_dir), resume="allow")

    def truncate_after(self, step: int) -> None:
        """Move lines of steps > ``step`` (written after the checkpoint being resumed) to
        ``metrics.replaced.jsonl``; the next line logged must be of a later step."""
        self._last_step = step
        self._lines.truncate_after(step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._last_step is not None and step <= self._last_step:
            raise RuntimeError(f"{self.path}: step {step} logged after step {self._last_step}")
        self._last_step = step
        record = {"step": int(step), "time": time.time()}
        record.update({key: _finite_or_none(value) for key, value in metrics.items()})
        self._lines.append([record])
        numeric = {k: v for k, v in record.items()
                   if k not in ("step", "time") and isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class JsonLines:
    """An append-only ``.jsonl`` file of per-step records (``{"step": s, ...}``) written by one
    rank: ``truncate_after(step)`` moves the lines a crashed run wrote past the checkpoint
    being resumed to ``<name>.replaced.jsonl``, so a resumed run continues it with no step
    twice and nothing is lost."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled

    def truncate_after(self, step: int) -> None:
        """Move lines of steps > ``step`` to ``<name>.replaced.jsonl``."""
        if not (self.enabled and self.path.exists()):
            return
        kept, dropped = [], []
        for line in self.path.read_text().splitlines():
            if line.strip():
                (kept if json.loads(line)["step"] <= step else dropped).append(line)
        if not dropped:
            return
        with open(self.path.with_name(self.path.stem + ".replaced.jsonl"), "a") as replaced:
            replaced.write("".join(line + "\n" for line in dropped))
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def append(self, records: list[dict]) -> None:
        if self.enabled and records:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))


SAMPLES_FILE = "samples.jsonl"
"""The ledger of trained responses in a run folder (``logging.samples``)."""


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (or of ``<dir>/metrics.jsonl``), by step."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
    return sorted(records, key=lambda r: r["step"])


def _finite_or_none(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def update_metrics(merged: dict, grad_norms: list[float], skipped: int, lr: float) -> dict:
    """The ``train/`` metrics of one step's mini-batch updates: the loss's region fractions and
    F statistics over all of them (the paper's Fig. 4 analysis; ``merged`` is
    ``losses.merge_metrics`` of the updates' ``StepResult.metrics``), entropy, loss, grad
    norms (mean and max of the finite ones), skipped updates and the learning rate."""
    from megatron_dgpo.algorithm.losses import summarize_metrics

    out = {f"train/{k}": v for k, v in summarize_metrics(merged).items()}
    finite = [g for g in grad_norms if math.isfinite(g)]
    out["train/grad_norm"] = sum(finite) / len(finite) if finite else math.nan
    out["train/grad_norm_max"] = max(finite) if finite else math.nan
    out["train/updates"] = float(len(grad_norms))
    out["train/skipped_updates"] = float(skipped)
    out["train/lr"] = lr
    return out


RL_PROGRESS = {"reward": ("rollout/reward_mean", "+.3f"), "acc": ("rollout/accuracy", ".3f"),
               "s": ("time/step", ".1f")}
"""What the RL trainer's progress bar shows: label -> (metric, format)."""


class ProgressBar:
    """A tqdm bar over training steps showing a few of each step's metrics (``show``: label ->
    (metric key, format); the RL trainer's reward, accuracy and seconds per step by default);
    does nothing when disabled (other ranks, or ``logging.progress_bar: false``)."""

    def __init__(self, total: int, done: int, *, enabled: bool,
                 show: dict[str, tuple[str, str]] = RL_PROGRESS):
        self._bar = None
        self._show = show
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, desc="dgpo", unit="step",
                             dynamic_ncols=True)

    def advance(self, metrics: dict) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix({label: format(metrics[key], spec)
                               for label, (key, spec) in self._show.items()})
        self._bar.update(1)


class PhaseTimer:
    """Wall-clock seconds per phase of one step (GPU work synchronised at phase ends)."""

    OUTSIDE_STEP = ("eval",)
    """Phases timed (``time/<phase>``) but not part of the training step: the evaluation on
    held-out problems is left out of ``time/step``, and the throughputs count only the rollout
    and update phases."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        begin = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - begin

    def skipped(self, phase: str) -> None:
        """Log ``phase`` as 0 s: a phase this step's configuration leaves out."""
        self.seconds.setdefault(phase, 0.0)

    def metrics(self, generated: int, trained_tokens: int, dp_size: int) -> dict[str, float]:
        """``time/<phase>``, ``time/step`` (without the ``OUTSIDE_STEP`` phases) and rollout/train
        throughput of a step that generated ``generated`` response tokens in all
        (``trained_tokens`` per DP rank)."""
        out = {f"time/{phase}": s for phase, s in self.seconds.items()}
        outside = sum(self.seconds.get(phase, 0.0) for phase in self.OUTSIDE_STEP)
        out["time/step"] = time.perf_counter() - self.start - outside
        out["throughput/rollout_tokens_per_s"] = generated / max(self.seconds["rollout"], 1e-9)
        out["throughput/train_tokens_per_s"] = trained_tokens * dp_size / max(self.seconds["update"], 1e-9)
        return out
