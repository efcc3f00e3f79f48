"""MetricsLogger (JSONL + TensorBoard) and tools/plot_run.py."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from megatron_dgpo.telemetry import LoggingConfig, MetricsLogger, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def load_plot_run():
    spec = importlib.util.spec_from_file_location("plot_run", ROOT / "tools" / "plot_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_jsonl_tensorboard_and_resume_truncation(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=True))
    for step in range(1, 5):
        logger.log(step, {"rollout/reward_mean": step / 10, "train/entropy": 1.0 / step,
                          "train/grad_norm": math.inf if step == 2 else 0.5})
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1]["train/grad_norm"] is None  # inf is not JSON: written as null
    assert records[2]["rollout/reward_mean"] == pytest.approx(0.3)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("rollout/reward_mean")
    assert [(s.step, round(s.value, 6)) for s in scalars] == [(1, 0.1), (2, 0.2), (3, 0.3),
                                                              (4, 0.4)]

    # a run resumed from the step-2 checkpoint drops what the crashed run logged after it
    resumed = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False))
    resumed.truncate_after(2)
    resumed.log(3, {"rollout/reward_mean": 0.33})
    assert [(r["step"], r["rollout/reward_mean"]) for r in read_metrics(tmp_path)] == [
        (1, 0.1), (2, 0.2), (3, 0.33)]
    # the lines dropped are kept aside, not lost
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.replaced.jsonl")] == [3, 4]
    # a step logged twice (a second writer, or a resumed run replaying a step) is refused
    with pytest.raises(RuntimeError, match="step 3 logged after step 3"):
        resumed.log(3, {"rollout/reward_mean": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", enabled=False)
    logger.log(1, {"x": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_bad_metrics_file_names_the_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path / "nothing")


def test_plot_run_draws_present_panels(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False))
    for step in range(1, 6):
        logger.log(step, {"rollout/reward_mean": -1 + step / 5, "train/entropy": 2 - step / 5,
                          "train/region/LN_frac": 0.01 * step, "train/region/HP_frac": 0.02,
                          "train/correction/weight_mean": 0.97,
                          "train/correction/token_masked_frac": 0.01 * step})
    plot_run = load_plot_run()
    out = tmp_path / "dyn.png"
    titles = plot_run.plot_runs([tmp_path], out)
    assert titles == ["Reward", "Entropy", "Clip regions", "Rollout correction"]
    assert out.stat().st_size > 10_000
    assert plot_run.main([str(tmp_path / "missing")]) == 2


def test_plot_run_draws_the_held_out_evaluation_when_present(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False))
    for step in range(1, 5):
        extra = {} if step % 2 else {"eval/aime24/avg@4": 0.1 * step, "eval/aime24/pass@1": 0.1 * step,
                                     "eval/aime24/pass@2": 0.2, "eval/aime24/pass@4": 0.3,
                                     "eval/held/avg@4": 0.5, "eval/held/pass@4": 0.9}
        logger.log(step, {"rollout/reward_mean": 0.0, **extra})
    plot_run = load_plot_run()
    runs = {str(tmp_path): read_metrics(tmp_path)}
    assert plot_run.eval_panel(runs) == [("Held-out evaluation", [
        "eval/aime24/avg@4", "eval/held/avg@4", "eval/aime24/pass@4", "eval/held/pass@4"], "accuracy")]
    assert plot_run.plot_runs([tmp_path], tmp_path / "dyn.png") == ["Reward", "Held-out evaluation"]
    assert plot_run.eval_panel({"run": [{"step": 1, "rollout/reward_mean": 0.0}]}) == []


def test_phase_timer_leaves_evaluation_out_of_the_step_and_the_throughputs(monkeypatch):
    """time/eval is logged, but time/step and throughput/* count only the training phases."""
    from megatron_dgpo import telemetry

    clock = iter([0.0, 0.0, 2.0, 2.0, 6.0, 6.0, 16.0, 16.5])
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    timer = telemetry.PhaseTimer()               # start at 0
    for phase in ("rollout", "update", "eval"):  # 2 s, 4 s, 10 s
        with timer(phase):
            pass
    metrics = timer.metrics(generated=100, trained_tokens=40, dp_size=2)
    assert metrics["time/eval"] == 10.0 and metrics["time/rollout"] == 2.0
    assert metrics["time/step"] == 16.5 - 10.0
    assert metrics["throughput/rollout_tokens_per_s"] == 50.0
    assert metrics["throughput/train_tokens_per_s"] == 20.0


def test_a_skipped_phase_is_logged_as_zero_and_takes_no_time(monkeypatch):
    """The bypass leaves the old-log-prob forward out: time/old_logprobs is 0, not absent."""
    from megatron_dgpo import telemetry

    clock = iter([0.0, 0.0, 3.0, 3.0, 5.0, 5.0])
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    timer = telemetry.PhaseTimer()
    timer.skipped("old_logprobs")
    for phase in ("rollout", "update"):
        with timer(phase):
            pass
    metrics = timer.metrics(generated=1, trained_tokens=1, dp_size=1)
    assert metrics["time/old_logprobs"] == 0.0 and metrics["time/rollout"] == 3.0
    assert metrics["time/step"] == 5.0
