"""The tiny CPU recipe end to end: real vLLM, math-verify, Megatron-Core (gloo), as `make run`.

Three jobs share this module (each starts its own vLLM engine, ~30 s):
* the recipe as written (50 steps): reward rises, telemetry complete, checkpoint + HF export;
* the same recipe killed (the trainer process alone) in the middle of writing its step-4
  checkpoint: no process of it survives; its step-3 checkpoint then damaged, and ``--resume``d:
  the damage is named, the run falls back to step 2, and its metrics equal the uninterrupted
  run's;
* the same recipe at TP=2 (torchrun, 2 gloo ranks, one TP=2 colocated engine): step 1 equals
  the TP=1 run's;
* the same recipe at CP=2 (torchrun, 2 gloo ranks, one replica) with overlong filtering and
  refill: equal to the CP=1 run; and at TP=2 x CP=2 (4 ranks): equal to the 1-rank run;
* the same recipe at DP=2 (torchrun, 2 gloo ranks, two colocated engines): each engine samples
  its replica's half of the batch, and the run equals the single-engine run;
* evaluation on held-out problems during training (``eval``): logged at its steps, the training
  identical to the run without it, and the same numbers from two replicas (the DP=2 run) as one;
* stop signals (Ctrl-C at 1 rank, SIGTERM to one of 2 ranks): the run stops at a step boundary
  with a checkpoint, exits 75, and the same command continues it to the uninterrupted result.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dgpo.telemetry import read_metrics
from tests.conftest import TINY_QUIET as QUIET
from tests.conftest import TINY_RECIPE as RECIPE
from tests.conftest import keep_tiny_run
from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
# Wall-clock measurements; everything else in a metrics line is a function of the config.
VARYING = ("time", "time/", "throughput/", "refit/seconds")


def _run(args: list[str], *, launcher: list[str] | None = None, timeout: int = 900):
    """Run a job in its own session (process group), so that a kill reaches all its processes."""
    cmd = (launcher or [sys.executable]) + args
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def _train(run_dir: Path, *overrides: str, resume: bool = False):
    args = ["-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}", *QUIET, *overrides]
    return _run(args + (["--resume"] if resume else []))


def _check(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VARYING)}


def _assert_same_metrics(got: dict, want: dict, rel: float = 0.0) -> None:
    got, want = _deterministic(got), _deterministic(want)
    assert got.keys() == want.keys()
    for key in want:
        a, b = got[key], want[key]
        if b is None or a is None:
            assert a is b, key
        else:
            assert math.isclose(a, b, rel_tol=rel, abs_tol=rel), (key, a, b)


def _assert_same_section(got: dict, want: dict, prefix: str, rel: float) -> None:
    """``_assert_same_metrics`` on the metrics whose names start with ``prefix``."""
    _assert_same_metrics({k: v for k, v in got.items() if k.startswith(prefix)},
                         {k: v for k, v in want.items() if k.startswith(prefix)}, rel=rel)


def _assert_same_training(got: dict, want: dict) -> None:
    """A context-parallel step against the run without CP: loss, grad norm and entropy within
    1e-5, every other training metric within 1e-4, the engines' log-probs the trainer's."""
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-7), key
    _assert_same_section(got, want, "train/", rel=1e-4)
    assert got["mismatch/mean_abs_diff"] < 1e-5


@pytest.fixture(scope="module")
def full_job(tmp_path_factory, request) -> tuple[Path, str]:
    """The recipe as written (50 steps): its run folder and its console output (stdout then
    stderr; vLLM logs to stdout). Its metrics are kept for the later sessions of this checkout
    (``make test-slow``, ``make test-cluster``), whose references are its first steps
    (``tiny_first_steps`` in tests/conftest.py)."""
    run_dir = tmp_path_factory.mktemp("tiny_full")
    proc = _train(run_dir)
    _check(proc)
    keep_tiny_run(request.config, run_dir)
    return run_dir, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def full_run(full_job) -> Path:
    return full_job[0]


EVAL_N = 16


@pytest.fixture(scope="module")
def eval_overrides(tmp_path_factory) -> list[str]:
    """Evaluation every 2 steps (and at the end) on a held-out file in the benchmarks' layout:
    the tiny task's ten "repeat" problems (the family has no others; the tiny policy solves a
    few % of them, so 160 samples give non-trivial numbers)."""
    path = tmp_path_factory.mktemp("held_out") / "repeat_digits.jsonl"
    path.write_text("".join(json.dumps({"id": f"digit-{d}", "answer": str(d), "problem":
                                        f"Repeat the digit {d}. Put it in \\boxed{{}}."}) + "\n"
                            for d in range(10)))
    return ["eval.every=2", f"eval.benchmarks=[{path}]", f"eval.n={EVAL_N}"]


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, eval_overrides):
    run_dir = tmp_path_factory.mktemp("tiny_eval")
    _check(_train(run_dir, "train.steps=3", *eval_overrides))
    return run_dir


def _training(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("eval/")}


def _evaluation(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("eval/")}


def test_reward_rises_and_telemetry_is_complete(full_run):
    records = read_metrics(full_run)
    assert [r["step"] for r in records] == list(range(1, 51))
    accuracy = [r["rollout/accuracy"] for r in records]
    # The second half, not the last steps: at lr 3e-3 the tiny policy's accuracy oscillates
    # late in the run, and where it stands at step 50 depends on the host's CPU kernels
    # (measured on one host: last 10 steps 0.125 after a 0.22 peak; second half 0.168).
    first, later = sum(accuracy[:5]) / 5, sum(accuracy[25:]) / 25
    # A constant guess of one digit scores 10% on the repeat family; the random policy ~2%.
    assert later > 0.15 and later > 3 * first, (first, later)
    rewards = [r["rollout/reward_mean"] for r in records]
    assert sum(rewards[25:]) / 25 > sum(rewards[:5]) / 5 + 0.2
    for record in records:
        for key in ("rollout/reward_mean", "rollout/response_length_mean", "train/entropy",
                    "train/region/LN_frac", "train/region/HP_frac", "train/region/LP_frac",
                    "train/region/HN_frac", "train/F/LN_mean", "train/grad_norm", "train/lr",
                    "mismatch/mean_abs_diff", "time/rollout", "time/old_logprobs",
                    "time/update", "time/refit", "throughput/train_tokens_per_s",
                    "rollout/engines", "refit/buckets", "refit/max_bucket_bytes", "refit/seconds",
                    "throughput/generation_tokens_per_s_per_engine"):
            assert key in record, key
        regions = sum(record[f"train/region/{r}_frac"] for r in ("LN", "HP", "LP", "HN", "M"))
        assert math.isclose(regions, 1.0, rel_tol=1e-9)
        assert record["train/updates"] == 4 and record["train/skipped_updates"] == 0
        # vLLM (fp32, CPU) and Megatron's log-probs of the sampled tokens agree.
        assert record["mismatch/mean_abs_diff"] < 1e-5 and record["mismatch/max_abs_diff"] < 1e-3
    assert records[-1]["train/entropy"] < records[0]["train/entropy"]


def test_log_has_no_partial_weight_load_warnings(full_job):
    """vLLM warns, at every reload call, about each module the call did not fill (on a complete
    reload too: the rotary embedding's cache is never in a checkpoint); the engine holds those
    warnings back and checks each refit's completeness itself (rollout.vllm_worker)."""
    run_dir, output = full_job
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "Reloading weights inplace" in log  # vLLM's reload logs do reach the run's log
    for text in (output, log):
        assert "Failed to load weights" not in text
        assert "were not loaded from checkpoint" not in text


def test_the_console_shows_the_run_and_the_log_file_other_packages_notices(full_job):
    """The tiny run printed ~65 lines of other packages' notices (TE and apex fallbacks on CPU,
    Megatron-Core's deprecations, vLLM's INFO lines): they are in <run_dir>/logs/rank0.log,
    and the console keeps the project's lines (runtime/console.py, logging.verbose)."""
    run_dir, output = full_job
    log = (run_dir / "logs" / "rank0.log").read_text()
    for notice in ("GPTModel IS DEPRECATED", "MimoModelConfig is experimental",
                   "Transformer Engine and Apex are not installed", "Reloading weights inplace",
                   "Initializing a V1 LLM engine"):
        assert notice in log and notice not in output, notice
    # Megatron's own async writer is chosen knowingly (docs/training.md): its notice is silenced
    assert "MCore's async save is deprecated" not in log + output
    assert "dgpo-train: rank 0 (DP replica 0): colocated vllm engine" in output
    assert "dgpo-train: data: 0 of 10 prompts are longer than rollout.max_prompt_tokens=96" in output
    first, second = read_metrics(run_dir)[:2]  # the census is logged once, with the first step
    assert (first["data/prompts"], first["data/prompts_dropped_for_length"]) == (10, 0)
    assert not any(key.startswith("data/") for key in second)
    assert f"dgpo-train: other packages' notices go to {run_dir}/logs/rank<k>.log" in output
    assert len(output.splitlines()) < 15, output


def test_checkpoint_and_hf_export(full_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    checkpoints = full_run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000050"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step_000025", "step_000050"]
    state = json.loads((checkpoints / "step_000050" / "trainer_state.json").read_text())
    assert state["step"] == 50 and state["prompts_consumed"] == 50 * 32
    exported = AutoModelForCausalLM.from_pretrained(full_run / "hf")
    initial = load_file(str(full_run / "initial_model" / "model.safetensors"))
    trained = dict(exported.named_parameters())
    # exact: must differ: training moved these weights
    changed = [n for n, t in initial.items() if not torch.equal(t, trained[n].detach())]
    assert "lm_head.weight" in changed and len(changed) > len(initial) // 2
    from tools.plot_run import main as plot_main

    assert plot_main([str(full_run)]) in (0, None)
    assert (full_run / "dynamics.png").stat().st_size > 10_000
    from benchmarks.step_breakdown import main as breakdown_main

    assert breakdown_main([str(full_run)]) == 0


def test_load_model_reads_the_jobs_training_checkpoint(full_run):
    """convert.load_model on the job's last training checkpoint (model, optimizer, RNG, and its
    content metadata in the common state) reads the model alone: its weights are the HF
    export's (megatron_to_hf of the same checkpoint, another reader), bitwise."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    from megatron_dgpo.convert import export_hf_weights, load_model, single_process_group
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    checkpoint = full_run / "checkpoints" / "step_000050"
    assert "content_metadata" in dist_checkpointing.load_common_state_dict(str(checkpoint))
    with single_process_group():
        initialize_parallel(ParallelConfig())
        try:
            got = {k: v.clone() for k, v in export_hf_weights(load_model(str(checkpoint)))}
        finally:
            destroy_parallel()
    want = load_file(str(full_run / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        # exact: two readers of the same stored values
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_killed_mid_save_then_resumed_equals_uninterrupted(full_run, tmp_path):
    """SIGKILL to the trainer process alone while it saves step 4 (files written, not yet
    published): none of its processes outlives it by 10 s, and ``latest`` names step 3. Then
    step 3's shard is overwritten in its middle (size unchanged, issue 45's corruption): the
    resume names it, moves it aside, continues from step 2 (the newest checkpoint that
    verifies) and equals the uninterrupted run exactly; the steps logged past step 2 are moved
    to metrics.replaced.jsonl. The resume's recipe change (offloading) is listed and kept in
    checkpoints/config_changes.jsonl."""
    import time

    import psutil

    run_dir = tmp_path / "killed"
    schedule = ["train.steps=4", "checkpoint.save_every=1", "checkpoint.keep_last=2"]
    killed = _run(["tests/_train_killed_during_save.py", "4", str(RECIPE), f"run_dir={run_dir}",
                   *QUIET, *schedule])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    children = json.loads((run_dir / "children.json").read_text())
    assert children  # the reward workers at least
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(psutil.Process(p)) for p in children
                                              if psutil.pid_exists(p)):
        time.sleep(0.2)
    assert not [p for p in children if psutil.pid_exists(p) and _running(psutil.Process(p))]
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000003"
    assert (checkpoints / ".incomplete-step_000004").is_dir()  # the torn save, never read
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]  # logged before saving
    shard = checkpoints / "step_000003" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(b"\xff" * 4096)

    # resumed with the training state offloaded between updates (and brought back around the
    # step-4 save): still exactly the uninterrupted run
    resumed = _train(run_dir, *schedule, "train.offload_training_state=true", resume=True)
    _check(resumed)
    assert re.search(r"checkpoint \S+step_000003 fails verification: __0_0.distcp does not match "
                     r"its checksum", resumed.stderr), resumed.stderr[-3000:]
    assert "falling back to step_000002, the newest checkpoint that verifies" in resumed.stderr
    assert f"resuming from step 2 ({checkpoints / 'step_000002'})" in resumed.stderr
    assert "train.offload_training_state: False -> True" in resumed.stderr
    change = json.loads((checkpoints / "config_changes.jsonl").read_text())
    assert change["resumed_from"] == "step_000002"
    assert change["changes"] == {"train.offload_training_state": [False, True]}
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # steps 3-4 of the killed run replaced
    assert [r["step"] for r in read_metrics(run_dir / "metrics.replaced.jsonl")] == [3, 4]
    reference = read_metrics(full_run)[:4]
    for got, want in zip(records, reference):
        _assert_same_metrics(got, want)
    assert (checkpoints / "latest").read_text().strip() == "step_000004"
    assert not list(checkpoints.glob(".incomplete-*"))
    assert (checkpoints / ".corrupt-step_000003").is_dir()


def _torchrun(run_dir: Path, *overrides: str, ranks: int = 2):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                "--master-port", str(free_port())]
    proc = _run(["-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}", *QUIET,
                 "train.steps=2", "checkpoint.save_every=0", *overrides], launcher=launcher)
    _check(proc)
    return proc


def _engine_shares(stderr: str) -> list[tuple[int, int]]:
    """The batch positions each engine announced it samples (one line per engine leader)."""
    return sorted((int(a), int(b)) for a, b in
                  re.findall(r"samples batch positions (\d+)\.\.(\d+) of 32", stderr))


def _rollout(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("rollout/") and k != "rollout/engines"}


def test_tensor_parallel_two_ranks_matches_one(full_run, tmp_path):
    run_dir = tmp_path / "tp2"
    proc = _torchrun(run_dir, "parallel.tensor_parallel=2")
    assert _engine_shares(proc.stderr) == [(0, 31)]  # one TP=2 engine, its leader grades
    records, reference = read_metrics(run_dir), read_metrics(full_run)
    got, want = records[0], reference[0]
    assert got["rollout/engines"] == want["rollout/engines"] == 1
    assert got["refit/buckets"] >= 1 and got["refit/max_bucket_bytes"] > 0
    # Same initial weights and seeds: identical rollouts (a TP=2 engine samples the same
    # tokens in fp32); the loss over a vocab split in two equals the single-rank loss to
    # float32 rounding. The next step, after a TP=2 update and refit, still learns the same.
    assert _rollout(got) == _rollout(want)
    for got, want in zip(records, reference[:2]):
        _assert_same_section(got, want, "train/", rel=1e-4)
        assert got["mismatch/mean_abs_diff"] < 1e-5
    assert (run_dir / "hf" / "config.json").is_file()


def test_context_parallel_two_ranks_match_one_with_overlong_filtering(tmp_path):
    """CP=2 (torchrun, 2 gloo ranks, one replica: both ranks hold halves of every row, and
    each rank's colocated engine samples half of the replica's batch) against the same job at
    CP=1, both with DAPO's overlong filter and penalty, its refill of degenerate groups, the
    per-sequence aggregation and the bypass (the engine's log-probs as pi_old; the forward runs
    only to measure the mismatch, here every step): identical samples and refill rounds, the
    same filtered share, the training metrics within float32 rounding of the CP=1 run's (loss,
    grad norm and entropy within 1e-5), no old-log-prob phase, two steps."""
    overlong = ["algorithm.overlong_filter=true", "algorithm.overlong_penalty_window=2",
                "algorithm.drop_degenerate_groups=true", "algorithm.refill_rounds=1",
                "algorithm.loss_aggregation=seq_mean_token_mean", "rollout.max_response_tokens=6",
                "algorithm.old_logprobs=rollout", "algorithm.old_logprobs_check_every=1",
                "train.steps=2", "checkpoint.save_every=0"]
    _check(_train(tmp_path / "cp1", *overlong))
    proc = _torchrun(tmp_path / "cp2", "parallel.context_parallel=2", *overlong)
    assert "DP replica 0" in proc.stderr and "DP replica 1" not in proc.stderr
    assert _engine_shares(proc.stderr) == [(0, 15), (16, 31)]
    records, reference = read_metrics(tmp_path / "cp2"), read_metrics(tmp_path / "cp1")
    assert [r["step"] for r in records] == [1, 2]
    for got, want in zip(records, reference):
        assert got["rollout/engines"] == 2 and want["rollout/engines"] == 1
        assert _rollout(got) == _rollout(want)  # the same samples and refill rounds
        assert got["rollout/refill_rounds"] >= 1 and "adv/num_dropped_groups" in got
        assert 0 < got["adv/overlong_filtered_frac"] == want["adv/overlong_filtered_frac"] < 1
        assert got["adv/overlong_penalty_mean"] == want["adv/overlong_penalty_mean"] < 0
        for record in (got, want):  # the bypass: no pi_old forward, the check's forward instead
            assert record["time/old_logprobs"] == 0.0 and record["time/mismatch_check"] > 0
        _assert_same_training(got, want)


def test_tensor_and_context_parallel_four_ranks_match_one(full_run, tmp_path):
    """TP=2 x CP=2 (torchrun, 4 gloo ranks, one replica; two colocated TP=2 engines, one per CP
    slice, each sampling half of the replica's batch): the samples of the 1-rank run, and its
    loss, grad norm and entropy within 1e-5, two steps."""
    run_dir = tmp_path / "tp2cp2"
    proc = _torchrun(run_dir, "parallel.tensor_parallel=2", "parallel.context_parallel=2",
                     ranks=4)
    assert _engine_shares(proc.stderr) == [(0, 15), (16, 31)]
    records, reference = read_metrics(run_dir), read_metrics(full_run)[:2]
    assert [r["step"] for r in records] == [1, 2]
    for got, want in zip(records, reference):
        assert got["rollout/engines"] == 2 and want["rollout/engines"] == 1
        assert _rollout(got) == _rollout(want)
        _assert_same_training(got, want)


def test_data_parallel_two_engines_share_the_batch_and_equal_one(full_run, eval_run, eval_overrides,
                                                                 tmp_path):
    """DP=2: each rank's colocated engine samples its replica's whole groups (disjoint halves of
    the batch) with seeds from the global prompt index; no rank receives the other's samples.
    The metrics (from reduced sums) and the updates (N all-reduced) equal the 1-engine run's.
    With evaluation on (at step 2): each engine evaluates half of the held-out problems, and the
    combined numbers equal the 1-engine run's (``eval_run``); the training is as without it."""
    run_dir = tmp_path / "dp2"
    proc = _torchrun(run_dir, *eval_overrides)
    assert _engine_shares(proc.stderr) == [(0, 15), (16, 31)]
    records, reference = read_metrics(run_dir), read_metrics(full_run)[:2]
    assert [r["step"] for r in records] == [1, 2]
    for got, want in zip(records, reference):
        assert got["rollout/engines"] == 2 and want["rollout/engines"] == 1
        assert got["throughput/generation_tokens_per_s_per_engine"] > 0
        assert _rollout(got) == _rollout(want)  # same samples, the batch's union
        _assert_same_section(got, want, "adv/", rel=1e-12)
        _assert_same_section(got, want, "train/", rel=1e-4)
        assert got["mismatch/mean_abs_diff"] < 1e-5
    assert not _evaluation(records[0]) and "time/eval" not in records[0]
    assert _evaluation(records[1]) == _evaluation(read_metrics(eval_run)[1])  # 2 engines = 1


def test_evaluation_during_training_is_logged_and_leaves_training_unchanged(full_run, eval_run):
    """eval.every=2 on a 3-step run: eval/<benchmark>/avg@16 and pass@1..16 and time/eval at
    steps 2 (every) and 3 (the last step), in [0, 1], Pass@k rising with k. The training is
    bit-identical to the run without evaluation (every deterministic metric of every step equals
    full_run's), and the throughputs still count only rollout and update tokens."""
    records, reference = read_metrics(eval_run), read_metrics(full_run)[:3]
    assert [r["step"] for r in records] == [1, 2, 3]
    names = [f"eval/repeat_digits/avg@{EVAL_N}"] + [f"eval/repeat_digits/pass@{k}"
                                                    for k in (1, 2, 4, 8, 16)]
    assert not _evaluation(records[0]) and "time/eval" not in records[0]
    for record in records[1:]:
        assert sorted(_evaluation(record)) == sorted(names)
        values = [record[k] for k in names]
        assert all(0.0 <= v <= 1.0 for v in values), values
        assert values[1:] == sorted(values[1:]) and math.isclose(values[0], values[1])
        assert record["time/eval"] > 0
    assert any(records[i][names[-1]] > 0 for i in (1, 2))  # some problem solved at least once
    for got, want in zip(records, reference):
        _assert_same_metrics(_training(got), want)  # exact: evaluation changed nothing
        # throughput: the step's own rollout and update work over their own phases' seconds
        generated = got["rollout/response_length_mean"] * got["rollout/num_samples"]
        assert math.isclose(got["throughput/rollout_tokens_per_s"] * got["time/rollout"], generated,
                            rel_tol=1e-9)
        assert math.isclose(got["throughput/train_tokens_per_s"] * got["time/update"],
                            want["throughput/train_tokens_per_s"] * want["time/update"], rel_tol=1e-9)
    from tools.plot_run import plot_runs

    assert "Held-out evaluation" in plot_runs([eval_run], eval_run / "dynamics.png")
    from benchmarks.step_breakdown import main as breakdown_main

    assert breakdown_main([str(eval_run)]) == 0


def _sigint_default():
    """SIGINT's default disposition in the trainer, as a terminal gives it: a suite started in
    the background by a shell without job control inherits SIGINT ignored (``cmd &``), and the
    trainer would then never see the Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(cmd: list[str]):
    """A job in its own session (on failure the whole group is killed: children hold the output
    pipes), with SIGINT's default disposition as a terminal gives it."""
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_sigint_default)


def _signal_after_step(proc, run_dir: Path, step: int, signum, target=None):
    """Send ``signum`` to the process ``target(job)`` returns (default: the job) once step
    ``step``'s metrics line is written; return the job's stderr and the processes it had then
    (engines, workers, ranks)."""
    import time

    import psutil

    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill((target or (lambda job: job))(psutil.Process(proc.pid)).pid, signum)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"no exit 180 s after {signum!r}; {len(read_metrics(run_dir))} steps logged:\n"
                    f"{err[-3000:]}")
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not [p for p in alive if _running(p)], alive  # nothing left behind
    return err, children


def _assert_stopped_with_checkpoint(run_dir: Path, steps: int) -> int:
    """The run stopped early at a step boundary: its last metrics line's step has a complete
    checkpoint named by ``latest``, and there is no final export. Returns that step."""
    from megatron_dgpo.training.checkpoint import latest_checkpoint

    logged = [r["step"] for r in read_metrics(run_dir)]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) < steps, logged
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert json.loads((latest / "trainer_state.json").read_text())["step"] == logged[-1]
    assert not list((run_dir / "checkpoints").glob(".incomplete-*"))
    assert not (run_dir / "hf").exists()
    return logged[-1]


@pytest.mark.slow  # ~35 s each: `make test-slow`
def test_ctrl_c_stops_after_the_step_in_flight_and_the_same_command_continues(tiny_first_steps, tmp_path):
    """Ctrl-C (SIGINT) once, after step 2's line: the step in flight finishes, a checkpoint of it
    is written (off the save schedule), engines and workers shut down, exit 75. Running the same
    command again continues from it (resume is the default) and the run equals the
    uninterrupted one: the signal cost no completed step."""
    from megatron_dgpo.runtime.interrupt import EXIT_STOPPED

    run_dir = tmp_path / "ctrl_c"
    cmd = [sys.executable, "-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}", *QUIET,
           "train.steps=6", "checkpoint.save_every=0"]
    proc = _start(cmd)
    err, _ = _signal_after_step(proc, run_dir, 2, signal.SIGINT)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    assert "SIGINT received: stopping after the step in flight" in err
    _assert_stopped_with_checkpoint(run_dir, 6)

    again = _run(cmd[1:])
    _check(again)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for got, want in zip(records, tiny_first_steps):
        _assert_same_metrics(got, want)


@pytest.mark.slow  # ~35 s each: `make test-slow`
def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_a_rerun_continues(tiny_first_steps, tmp_path):
    """DP=2 under torchrun; SIGTERM to rank 1 only (as a node's slurmstepd may deliver it first):
    both ranks agree at the step boundary (without it rank 1 could not save, a collective,
    and rank 0 would wait in the next step), save that step and exit 75. The same command
    continues it to the end, equal to the 1-rank run as DP=2 runs are. As a GPU recipe runs:
    Megatron's distributed optimizer, checkpoints written by its async writer, the training
    state offloaded between updates (the plain optimizer's DP=2 run is
    ``test_data_parallel_two_engines_share_the_batch_and_equal_one``)."""
    run_dir = tmp_path / "sigterm"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port())]
    args = ["-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}", *QUIET,
            "train.steps=4", "checkpoint.save_every=0", "optimizer.use_distributed_optimizer=true",
            "checkpoint.async_save=true", "train.offload_training_state=true"]
    def rank1(torchrun):
        return next(p for p in torchrun.children() if p.environ().get("RANK") == "1")

    proc = _start(launcher + args)
    err, _ = _signal_after_step(proc, run_dir, 1, signal.SIGTERM, target=rank1)
    assert re.search(r"exitcode\s*:\s*75", err), err[-3000:]  # torchrun's report of the ranks
    assert "SIGTERM received: stopping after the step in flight" in err
    _assert_stopped_with_checkpoint(run_dir, 4)

    _check(_run(args, launcher=launcher[:-1] + [str(free_port())]))
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for got, want in zip(records, tiny_first_steps[:4]):
        assert _rollout(got) == _rollout(want)
        _assert_same_section(got, want, "train/", rel=1e-4)


def _running(process) -> bool:
    """Alive and not a zombie (one exited but not yet reaped by its new parent)."""
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_tied_embeddings_refit_keeps_the_engine_on_the_trained_policy(tmp_path):
    """Qwen2.5-0.5B's shape family ties the output layer to the embedding: the refit must carry
    the trained embedding into vLLM's tied lm_head. After every update the engine's sampled
    log-probs equal the trainer's (a stale or untied head would be off by the update).

    The run warm-starts from a tied Qwen2 that Megatron-Bridge wrote (``model.path`` = its
    checkpoint folder, tests/convert/fixtures/bridge/qwen2_tied): its initial policy is the HF
    original's weights, converted once into ``initial_model``."""
    import json

    from safetensors.torch import load_file

    run_dir = tmp_path / "tied"
    fixture = ROOT / "tests" / "convert" / "fixtures" / "bridge" / "qwen2_tied"
    _check(_train(run_dir, f"model.path={fixture / 'bridge'}", "model.tiny=null", "train.steps=3",
                  "checkpoint.save_every=0", "checkpoint.export_hf=false"))
    assert json.loads((run_dir / "initial_model" / "config.json").read_text())["tie_word_embeddings"]
    got, want = (load_file(str(d / "model.safetensors"))
                 for d in (run_dir / "initial_model", fixture / "hf"))
    # exact: a lossless conversion of the same values
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # the original's stop ids: the run samples as a run from fixture/hf does
    assert ((run_dir / "initial_model" / "generation_config.json").read_bytes()
            == (fixture / "hf" / "generation_config.json").read_bytes())
    records = read_metrics(run_dir)
    assert len(records) == 3
    for record in records:
        assert record["mismatch/mean_abs_diff"] < 1e-5 and record["mismatch/max_abs_diff"] < 1e-3, record
    # the policy did move between the samples: a refit after a real update was checked
    assert any(record["train/grad_norm"] > 0 for record in records[:-1]), records


@pytest.mark.slow  # two 2-step runs with up to 3 sampling rounds each: `make test-slow`
def test_refill_resamples_degenerate_groups_and_two_replicas_equal_one(tiny_first_steps, tmp_path):
    """algorithm.refill_rounds (DAPO's dynamic sampling): a batch position whose group came out
    degenerate is sampled again from the next batch of the stream. The first round is the
    plain run's batch, so its degenerate groups are the ones discarded first; what is still
    degenerate after the last round is dropped as before; the stream advances by the rounds
    used; and two replicas (each refilling its own positions) equal one, with a rollout
    correction (the geometric mask, over each refilled sample) on."""
    refill = ["algorithm.drop_degenerate_groups=true", "algorithm.refill_rounds=2",
              "algorithm.rollout_correction=geometric_mask"]
    one, two = tmp_path / "one", tmp_path / "two"
    _check(_train(one, "train.steps=2", "checkpoint.save_every=2", *refill))
    _torchrun(two, *refill)
    plain, records = tiny_first_steps[0], read_metrics(one)
    first = records[0]
    degenerate = plain["adv/num_degenerate"]  # of the plain run's step 1 = this run's round 1
    assert degenerate > 0
    assert 1 <= first["rollout/refill_rounds"] <= 2
    assert first["rollout/discarded_groups"] >= degenerate
    # what the last round left degenerate is dropped; never more than without refill
    assert first["adv/num_dropped_groups"] <= degenerate
    if first["rollout/refill_rounds"] < 2:
        assert first["adv/num_dropped_groups"] == 0
    # float32 engine: every sample's geometric mean ratio inside [0.999, 1.001], none masked
    assert first["train/correction/sample_masked_frac"] == 0.0
    assert abs(first["train/correction/weight_mean"] - 1.0) < 1e-12
    state = json.loads((one / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["prompts_consumed"] == 32 * sum(1 + r["rollout/refill_rounds"] for r in records)
    for got, want in zip(read_metrics(two), records):
        assert got["rollout/engines"] == 2
        assert _rollout(got) == _rollout(want)  # the same rounds, discards and samples
        _assert_same_section(got, want, "adv/", rel=1e-12)
        _assert_same_section(got, want, "train/", rel=1e-4)


def test_a_save_brings_offloaded_state_back_only_after_the_engines_sleep():
    """With ``train.offload_training_state`` the trainer's save restores optimizer state and
    gradient buffers on the device: only after the replica's engines, awake since the refit,
    have gone to sleep (before, the save ran beside an awake engine). Without offload the
    engines are left alone."""
    import torch

    from megatron_dgpo.trainer import _resident_beside_sleeping_engines
    from megatron_dgpo.training.offload import TrainingStateOffload

    events = []

    class Rollout:
        def sleep_engines(self):
            events.append("engines asleep")

    class Buffers(torch.nn.Module):  # Megatron DDP's two offload methods, recorded
        def offload_grad_buffers(self, synchronize, empty_cache):
            events.append("training state off")

        def restore_grad_buffers(self, synchronize):
            events.append("training state back")

    model = Buffers()
    optimizer = type("NoState", (), {"chained_optimizers": []})()
    for enabled, want in ((True, ["training state off", "engines asleep", "training state back",
                                  "saved", "training state off"]),
                          (False, ["saved"])):
        events.clear()
        offload = TrainingStateOffload([model], optimizer, enabled=enabled)
        offload.offload()
        with _resident_beside_sleeping_engines(Rollout(), offload):
            events.append("saved")
        assert events == want
