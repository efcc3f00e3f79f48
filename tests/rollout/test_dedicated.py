"""Dedicated rollout engines (``rollout.placement: dedicated``) end to end: the tiny recipe under
torchrun with one trainer rank and one engine rank (its own process, its own world), real vLLM,
math-verify and Megatron-Core on gloo.

* ``max_staleness: 0``: the samples and every metric equal the colocated 1-rank run's (the
  engine gets its weights by broadcast instead of in process; the loop is today's);
* ``max_staleness: 1``: batch k+1 is sampled with the weights of step k-1 (the engine's log-probs
  of the batch a checkpoint holds as generated ahead, against an HF export of each step's
  checkpoint through transformers), staleness and TIS are logged and applied;
* 6 ranks, a DP=2 trainer and two TP-2 engines, with DAPO's refill: each replica drives its own
  engine, and the samples equal one colocated rank's;
* a SIGTERM to the trainer after step 3: the trainer stops at the step boundary with a checkpoint
  that holds the batch generated ahead, the engine exits when told, and the same command
  continues to exactly the uninterrupted run.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from megatron_dgpo.telemetry import read_metrics
from tests.distributed import free_port
from tests.test_trainer import (QUIET, RECIPE, _assert_same_metrics,
                                _assert_stopped_with_checkpoint, _check, _run, _signal_after_step,
                                _start, _train)

pytestmark = pytest.mark.slow  # ~3 min of torchrun jobs: `make test-slow`

DEDICATED = ["rollout.placement=dedicated", "rollout.num_gpus=1"]
OFF_POLICY = [*DEDICATED, "rollout.max_staleness=1", "algorithm.rollout_correction=tis"]
ENGINE_TIMES = ("time/engine_generate", "time/engine_idle", "time/rollout_wait")


def _launcher() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port())]


def _job(run_dir: Path, *overrides: str) -> list[str]:
    return ["-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}", *QUIET, *overrides]


@pytest.fixture(scope="module")
def off_policy_run(tmp_path_factory):
    """6 one-step-off steps, a checkpoint after every step (all kept)."""
    run_dir = tmp_path_factory.mktemp("one_step_off")
    _check(_run(_job(run_dir, *OFF_POLICY, "train.steps=6", "checkpoint.save_every=1",
                     "checkpoint.keep_last=10"), launcher=_launcher()))
    return run_dir


def test_synchronous_dedicated_engine_equals_colocated(tiny_first_steps, tmp_path):
    """The colocated 1-rank run is ``tiny_first_steps`` (a run of fewer steps is the longer
    run's beginning)."""
    dedicated = tmp_path / "dedicated"
    proc = _run(_job(dedicated, *DEDICATED, "train.steps=3", "checkpoint.save_every=0"),
                launcher=_launcher())
    _check(proc)
    assert "drives 1 dedicated engine(s) of TP 1, one of 1; samples batch positions 0..31" in proc.stderr
    assert "dedicated engine 0 of 1 (TP 1) on rollout rank 0" in proc.stderr
    got, want = read_metrics(dedicated), tiny_first_steps[:3]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        assert set(g) - set(w) == {"time/engine_generate", "time/engine_idle"}
        assert g["rollout/staleness"] == w["rollout/staleness"] == 0.0
        # the same samples, rewards, losses and gradients: bit-identical, not close
        _assert_same_metrics({k: v for k, v in g.items() if k in w}, w)
        assert g["refit/buckets"] >= 1 and g["time/engine_generate"] > 0


def _logprobs(hf_dir: Path, batch: dict) -> list[torch.Tensor]:
    """log pi(response token | prefix) of every sample of ``batch`` under the HF model
    ``hf_dir`` (transformers, float32, temperature 1 as the recipe)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, response in zip(batch["prompt_tokens"], batch["response_tokens"]):
            tokens = torch.tensor([prompt + response])
            logp = torch.log_softmax(model(tokens).logits[0, :-1].double(), -1)
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
            out.append(logp[positions, tokens[0, len(prompt):]].float())
    return out


def _export(checkpoint: Path, out: Path) -> Path:
    from megatron_dgpo.training.checkpoint import export_hf

    export_hf(checkpoint, out)
    return out


def test_one_step_off_samples_with_the_weights_of_the_step_before(off_policy_run, tmp_path):
    from megatron_dgpo.rollout.ahead import AHEAD_DIR

    records = read_metrics(off_policy_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["rollout/staleness"] for r in records] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert records[0]["mismatch/mean_abs_diff"] < 1e-5  # batch 1: the weights it trains from
    for r in records[1:]:  # later batches lag one update: the engine's log-probs differ, and
        assert r["mismatch/mean_abs_diff"] > 1e-3  # TIS reweights the tokens by pi_old / pi_rollout
        assert r["train/correction/ratio_min"] < 1.0 < r["train/correction/ratio_max"]
        assert r["train/correction/weight_mean"] != 1.0
        assert r["time/engine_generate"] > 0
    # steps 1-5 wait for the batch generated during them (step 6, the last, generates nothing)
    assert ["time/rollout_wait" in r for r in records] == [True] * 5 + [False]

    checkpoints = off_policy_run / "checkpoints"
    weights = {0: off_policy_run / "initial_model"}
    for step in (1, 2):
        weights[step] = _export(checkpoints / f"step_{step:06d}", tmp_path / f"hf_{step}")
    for k in (1, 2):  # checkpoint k holds batch k+1, generated during step k
        ahead = torch.load(checkpoints / f"step_{k:06d}" / AHEAD_DIR / "replica0.pt",
                           weights_only=False)
        batch = ahead["batch"]
        assert batch["policy_version"] == k - 1 and len(batch["response_tokens"]) == 256
        engine = torch.cat([torch.tensor(lp) for lp in batch["rollout_logprobs"]])
        sampled_by = torch.cat(_logprobs(weights[k - 1], batch))
        trained_from = torch.cat(_logprobs(weights[k], batch))
        assert (engine - sampled_by).abs().max() < 1e-5, k  # the weights of step k-1
        assert (engine - trained_from).abs().mean() > 1e-3, k  # not those of step k
    assert not (checkpoints / "step_000006" / AHEAD_DIR).exists()  # nothing ahead of the end


def test_sigterm_keeps_the_batch_generated_ahead_and_the_rerun_equals_the_uninterrupted_run(
        off_policy_run, tmp_path):
    from megatron_dgpo.rollout.ahead import AHEAD_DIR
    from megatron_dgpo.runtime.interrupt import EXIT_STOPPED

    run_dir = tmp_path / "stopped"
    job = _job(run_dir, *OFF_POLICY, "train.steps=6", "checkpoint.save_every=0")
    proc = _start(_launcher() + job)
    def trainer(torchrun):  # as a node's slurmstepd may deliver it; the engine is told by it
        return next(p for p in torchrun.children() if p.environ().get("RANK") == "0")

    err, _ = _signal_after_step(proc, run_dir, 3, signal.SIGTERM, target=trainer)
    assert re.search(rf"exitcode\s*:\s*{EXIT_STOPPED}", err), err[-3000:]  # the trainer's
    assert "SIGTERM received: stopping after the step in flight" in err
    stopped = _assert_stopped_with_checkpoint(run_dir, 6)
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == stopped and (latest / AHEAD_DIR / "replica0.pt").is_file()

    _check(_run(job, launcher=_launcher()))
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for got, want in zip(records, read_metrics(off_policy_run)):
        _assert_same_metrics(got, want)  # wall-clock keys aside (the checkpoint's time too)


def test_two_replicas_drive_their_own_tensor_parallel_engines_with_refill(tmp_path):
    """6 ranks: a DP=2 trainer (2 ranks) and 2 dedicated engines of TP 2 (4 ranks), DAPO's refill
    on (the engine's leader tells its TP peer which groups to sample again): each replica
    drives its own engine on its half of the batch, and the samples, rewards and group
    statistics equal one colocated rank's; the updates agree to float32 rounding (DP=2)."""
    refill = ["algorithm.refill_rounds=1", "algorithm.drop_degenerate_groups=true",
              "train.steps=2", "checkpoint.save_every=0"]
    colocated, dedicated = tmp_path / "colocated", tmp_path / "dedicated"
    _check(_train(colocated, *refill))
    launcher = _launcher()
    launcher[launcher.index("--nproc-per-node") + 1] = "6"
    proc = _run(_job(dedicated, "rollout.placement=dedicated", "rollout.num_gpus=4",
                     "rollout.tensor_parallel_size=2", *refill), launcher=launcher)
    _check(proc)
    shares = sorted(re.findall(r"drives 1 dedicated engine\(s\) of TP 2, one of 2; samples batch "
                               r"positions (\d+)\.\.(\d+)", proc.stderr))
    assert shares == [("0", "15"), ("16", "31")]
    for got, want in zip(read_metrics(dedicated), read_metrics(colocated)):
        assert got["rollout/engines"] == 2 and want["rollout/engines"] == 1
        for prefix, rel in (("rollout/", 0.0), ("adv/", 1e-12), ("train/", 1e-4)):
            _assert_same_metrics({k: v for k, v in got.items()
                                  if k.startswith(prefix) and k != "rollout/engines"},
                                 {k: v for k, v in want.items()
                                  if k.startswith(prefix) and k != "rollout/engines"}, rel=rel)
        assert got["rollout/refill_rounds"] == want["rollout/refill_rounds"] == 1.0  # it refilled


STREAMING = [*DEDICATED, "rollout.max_staleness=2", "rollout.partial=true",
             "algorithm.rollout_correction=tis", "logging.samples=true",
             # 32-token responses decoded 8 at a time: the engine is still generating when
             # the trainer refits, so responses are interrupted and continued
             "rollout.max_response_tokens=32", "rollout.max_num_seqs=8"]


def _ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_streaming_with_partial_rollouts_trains_every_prompt_once_within_the_bound_through_a_sigterm(
        tmp_path):
    """k = 2 with partial rollouts and the ledger on, stopped by SIGTERM after step 3 and run
    again: the ledger continues with no gap and no duplicate; every response trained at step s
    was sampled with weights of versions >= s - 1 - 2; some responses span a refit (two
    segments or more); the trained groups and those the last checkpoint's buffer holds are the
    admitted stream, each once, so within an epoch of the 10 prompts each is trained once."""
    from megatron_dgpo.rollout.ahead import BUFFER_DIR
    from megatron_dgpo.runtime.interrupt import EXIT_STOPPED

    run_dir, steps, batch, group = tmp_path / "stream", 6, 32, 8
    job = _job(run_dir, *STREAMING, f"train.steps={steps}", "checkpoint.save_every=0")
    proc = _start(_launcher() + job)

    def trainer(torchrun):
        return next(p for p in torchrun.children() if p.environ().get("RANK") == "0")

    err, _ = _signal_after_step(proc, run_dir, 3, signal.SIGTERM, target=trainer)
    assert re.search(rf"exitcode\s*:\s*{EXIT_STOPPED}", err), err[-3000:]
    stopped = _assert_stopped_with_checkpoint(run_dir, steps)
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (latest / BUFFER_DIR / "replica0.pt").is_file()
    before = _ledger(run_dir)
    assert {r["step"] for r in before} == set(range(1, stopped + 1))

    _check(_run(job, launcher=_launcher()))
    ledger = _ledger(run_dir)
    assert ledger[:len(before)] == before  # continued, not rewritten
    assert [r["step"] for r in ledger] == sorted(r["step"] for r in ledger)
    assert {s: sum(r["step"] == s for r in ledger) for s in range(1, steps + 1)} == \
        {s: batch * group for s in range(1, steps + 1)}  # no gap, no duplicate step
    for r in ledger:
        assert r["step"] - 1 - min(r["versions"]) <= 2  # no token older than k
        assert sum(r["segments"]) == r["length"] and len(r["segments"]) == len(r["versions"])
    assert any(len(r["versions"]) > 1 for r in ledger)  # interrupted and continued
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert max(r["rollout/staleness_max"] for r in records) <= 2
    assert sum(r["rollout/reprefill_tokens"] for r in records) > 0

    # every group trained once, and with those the final checkpoint's buffer holds, the
    # admitted stream without a gap
    trained = {}
    for r in ledger:
        trained.setdefault(r["position"], []).append((r["sample"], r["prompt_index"]))
    assert all(sorted(s for s, _ in samples) == list(range(group)) for samples in trained.values())
    final = torch.load(run_dir / "checkpoints" / f"step_{steps:06d}" / BUFFER_DIR / "replica0.pt",
                       weights_only=False)["state"]
    held = {int(p) for p in final["groups"]}
    assert not held & set(trained)
    assert sorted(held | set(trained)) == list(range(final["admitted"]))
    # the built-in repeat family's 10 prompts: each epoch trained in full trains each once
    for epoch in range(len(trained) // 10):
        positions = range(epoch * 10, epoch * 10 + 10)
        if all(p in trained for p in positions):
            assert sorted(trained[p][0][1] for p in positions) == list(range(10))
