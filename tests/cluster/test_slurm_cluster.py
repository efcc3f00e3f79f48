"""The project on a real 2-node SLURM 22.05 cluster (``make test-cluster``): slurmctld and two
slurmd in network namespaces of this machine (``slurm/testing/cluster-up.sh``), torn down
whatever happens. Every job runs the tiny recipe through the unmodified ``slurm/train.sbatch`` or
NeMo-Run's SLURM executor, at DP=2 (one rank and one colocated vLLM engine per node) unless it
has a dedicated rollout node, and must reproduce the uninterrupted torchrun run of the same
layout on one host bit for bit:

* a job under a time limit: SLURM's early SIGUSR1 (``--signal=B:USR1@<lead>``) reaches the
  trainers through the batch script and torchrun, they stop at a step boundary with a
  checkpoint, the script requeues the job, and the next attempt continues to the end;
* ``scontrol requeue`` of a running job: SIGTERM from SLURM, a checkpoint, the requeued attempt
  continues (also the check that two nodes equal one host);
* ``tools/launch.py --executor slurm`` (NeMo-Run, local submission);
* ``ROLLOUT_NODES=1``: one node trains (1 rank), the other runs a dedicated vLLM engine (1 rank),
  one step off-policy, requeued by ``scontrol requeue``; it reproduces its
  own reference, the same recipe with a dedicated engine under torchrun on one host (2 ranks).

Skipped, with the reason, where the cluster cannot be built: not root, or no slurm-wlm/munge.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dgpo.telemetry import read_metrics
from tests.cluster.conftest import QUIET, RECIPE, ROOT, assert_same_run
from tests.distributed import free_port

TESTING = ROOT / "slurm" / "testing"
IN_CLUSTER = str(TESTING / "in-cluster")


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    missing = [t for t in ("slurmctld", "slurmd", "munged", "sbatch") if not shutil.which(t)
               and not Path(f"/usr/sbin/{t}").exists()]
    return f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge" if missing else None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


@pytest.fixture(scope="module")
def cluster():
    subprocess.run(["bash", str(TESTING / "cluster-down.sh")], capture_output=True)  # a crashed run's
    up = subprocess.run(["bash", str(TESTING / "cluster-up.sh")], capture_output=True, text=True)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield
    finally:
        subprocess.run(["bash", str(TESTING / "cluster-down.sh")], capture_output=True)


def _env(**extra) -> dict:
    return dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", **extra)


def _sbatch(run_dir: Path, tmp_path: Path, *options: str, steps: int, overrides=(), env=None) -> int:
    out = subprocess.run(
        [IN_CLUSTER, "sbatch", "--parsable", "--nodes=2", f"--output={tmp_path}/job-%j.out", *options,
         str(ROOT / "slurm" / "train.sbatch"), f"run_dir={run_dir}", f"train.steps={steps}",
         "checkpoint.save_every=5", *QUIET, *overrides],
        cwd=ROOT, env=_env(RECIPE="recipes/tiny_cpu.yaml", GPUS_PER_NODE="1", LOG_DIR=str(tmp_path / "logs"),
                           **(env or {})),
        capture_output=True, text=True, check=True)
    return int(out.stdout.strip().split(";")[0])


def _job(job_id: int) -> dict:
    out = subprocess.run([IN_CLUSTER, "scontrol", "show", "job", str(job_id)], capture_output=True,
                         text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def _until_done(job_id: int, timeout: float = 900, *, on_running=None, on_held=None) -> dict:
    """Wait for the job to complete; a requeued attempt held by SLURM's requeue delay is started
    at once (``StartTime=now``), after ``on_held(job)``. ``on_running(job)`` is called while it
    runs until it returns True."""
    deadline, held_since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        job = _job(job_id)
        state = job.get("JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return job
        held = state == "PENDING" and job.get("Reason") == "BeginTime"
        held_since = (held_since or time.monotonic()) if held else None
        # not before the previous attempt is cleaned up on the nodes: started while they still
        # complete it, the batch job dies with "Job credential revoked" (SLURM's own delay is
        # ~2 minutes, so real requeues never meet this)
        if held and time.monotonic() - held_since >= 3 and not _nodes_completing():
            if on_held is not None:
                on_held(job)
            subprocess.run([IN_CLUSTER, "scontrol", "update", f"jobid={job_id}", "StartTime=now"],
                           capture_output=True)
        if state == "RUNNING" and on_running is not None and on_running(job):
            on_running = None
        time.sleep(1)
    subprocess.run([IN_CLUSTER, "scancel", str(job_id)])
    pytest.fail(f"job {job_id} not done after {timeout} s: {_job(job_id)}")


def _nodes_completing() -> bool:
    out = subprocess.run([IN_CLUSTER, "sinfo", "-h", "-t", "completing", "-o", "%N"],
                         capture_output=True, text=True).stdout
    return bool(out.strip())


def _log(tmp_path: Path, job_id: int) -> str:
    return (tmp_path / f"job-{job_id}.out").read_text()


def test_time_limit_stops_requeues_and_continues_exactly(cluster, reference, tmp_path):
    """The shortest limit SLURM has (--time=1) with SIGUSR1 15 s ahead of it: SLURM may send
    the signal up to 60 s early, so it comes within the first ~45 s of the attempt, always
    before the limit and before a 100-step run can end on any machine; the trainers stop at the
    next step boundary, save, and the script requeues the job. The requeued attempt gets a
    limit it cannot reach (``scontrol update TimeLimit``) and continues to the end: the run
    must equal the uninterrupted one."""
    run_dir = tmp_path / "run"
    job_id = _sbatch(run_dir, tmp_path, "--time=1", "--signal=B:USR1@15", steps=len(reference))

    def lift_the_limit(job):
        subprocess.run([IN_CLUSTER, "scontrol", "update", f"jobid={job_id}", "TimeLimit=30"],
                       check=True, capture_output=True)

    job = _until_done(job_id, timeout=1800, on_held=lift_the_limit)
    log = _log(tmp_path, job_id)
    assert job["JobState"] == "COMPLETED", log
    assert int(job["Restarts"]) >= 1 and "requeueing job" in log, log
    # the cut attempt's trainers stopped at a step boundary with a checkpoint (their own line)
    stops = [int(k) for k in re.findall(r"dgpo: \[megatron-dgpo\] stopped after step (\d+) \(SIGUSR1\)", log)]
    assert stops and all(1 <= k < len(reference) for k in stops), log
    assert_same_run(read_metrics(run_dir), reference)
    assert len(read_metrics(run_dir)) == len(reference)
    for line in log.splitlines():
        if "attempt" in line or "stopped after step" in line:
            print(line)


def _requeued_after_step_3(job_id: int, run_dir: Path, tmp_path: Path) -> str:
    """``scontrol requeue`` the job once its run has logged step 3; waits until it completes after
    exactly one requeue and returns the batch script's log."""
    metrics = run_dir / "metrics.jsonl"

    def requeue_after_step_3(job):
        if job.get("Restarts") == "0" and metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            subprocess.run([IN_CLUSTER, "scontrol", "requeue", str(job_id)], check=True)
            return True
        return False

    job = _until_done(job_id, on_running=requeue_after_step_3)
    log = _log(tmp_path, job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", log
    return log


def test_two_nodes_equal_one_host_through_an_scontrol_requeue(cluster, reference, tmp_path):
    """A 2-node job (one rank and one colocated engine per node, each node's log kept) requeued
    by ``scontrol requeue`` after step 3: SLURM's SIGTERM, a checkpoint, the requeued attempt
    continues; steps 1..12 equal the one-host run's."""
    run_dir = tmp_path / "run"
    job_id = _sbatch(run_dir, tmp_path, "--time=20", "--signal=B:USR1@60", steps=12)
    log = _requeued_after_step_3(job_id, run_dir, tmp_path)
    assert "attempt 1" in log, log  # --open-mode=append: both attempts' lines are kept
    assert_same_run(read_metrics(run_dir), reference[:12])
    assert len(read_metrics(run_dir)) == 12
    assert (tmp_path / "logs" / str(job_id) / "node1.log").is_file()
    assert (tmp_path / "logs" / str(job_id) / "node2.log").is_file()


def test_nemo_run_slurm_executor_submits_locally(cluster, reference, tmp_path):
    launch_python = ROOT / ".venv-launch" / "bin" / "python"
    assert launch_python.exists(), "make test-cluster builds .venv-launch first"
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [IN_CLUSTER, str(launch_python), "tools/launch.py", "--executor", "slurm", "recipes/tiny_cpu.yaml",
         "train.steps=3", f"run_dir={run_dir}", *QUIET, "--account", "test", "--partition", "debug",
         "--nodes", "2", "--gpus-per-node", "1", "--job-venv", str(ROOT / ".venv"), "--time", "00:20:00",
         "--job-dir", str(tmp_path / "nemorun")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ids = re.findall(r"\b(\d+)\b", subprocess.run([IN_CLUSTER, "squeue", "-h", "-o", "%i"],
                                                  capture_output=True, text=True).stdout)
    deadline = time.monotonic() + 600
    while ids and time.monotonic() < deadline and not (run_dir / "hf").exists():
        time.sleep(2)
    job = _until_done(int(ids[-1])) if ids else {}
    assert job.get("JobState") == "COMPLETED", (job, proc.stdout[-2000:])
    assert_same_run(read_metrics(run_dir), reference[:3])
    assert len(read_metrics(run_dir)) == 3
    # a job dir that nemo-run would rewrite is refused before anything is submitted
    bad = subprocess.run([str(launch_python), "tools/launch.py", "--executor", "slurm", "recipes/tiny_cpu.yaml",
                          "--account", "test", "--job-dir", str(tmp_path / "nemo_run")],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "contains '/nemo_run'" in bad.stderr


ONE_STEP_OFF = ["rollout.max_staleness=1", "algorithm.rollout_correction=tis"]
DEDICATED_STEPS = 10


@pytest.fixture(scope="module")
def dedicated_reference(tmp_path_factory) -> list[dict]:
    """The tiny recipe with a dedicated engine, one step off-policy, under torchrun on this host:
    rank 0 trains, rank 1 is the engine. A dedicated run is a function of its seed (the batch
    generated ahead is sampled with known weights whatever the timing), so every SLURM job with
    ``ROLLOUT_NODES=1`` must reproduce it."""
    run_dir = tmp_path_factory.mktemp("dedicated_one_host")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "megatron_dgpo.train", str(RECIPE), f"run_dir={run_dir}", "rollout.placement=dedicated",
         "rollout.num_gpus=1", *ONE_STEP_OFF, *QUIET, f"train.steps={DEDICATED_STEPS}", "checkpoint.save_every=5"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=1200,
        start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(run_dir)
    assert len(records) == DEDICATED_STEPS and records[-1]["rollout/staleness"] == 1
    return records


def _dedicated_sbatch(run_dir: Path, tmp_path: Path, *options: str, steps: int) -> int:
    """train.sbatch on both nodes with ``ROLLOUT_NODES=1`` (``GPUS_PER_NODE=1``): one trainer
    rank on one node, one engine rank on the other."""
    return _sbatch(run_dir, tmp_path, *options, steps=steps, overrides=ONE_STEP_OFF, env={"ROLLOUT_NODES": "1"})


def _engine_and_trainer_nodes(tmp_path: Path, job_id: int) -> tuple[list[str], list[str]]:
    """The nodes whose log has the engine's start line, and those with the trainer's."""
    logs = {n: (tmp_path / "logs" / str(job_id) / f"{n}.log").read_text() for n in ("node1", "node2")}
    return ([n for n, text in logs.items() if "dgpo-train: dedicated engine 0 of 1" in text],
            [n for n, text in logs.items() if "drives 1 dedicated engine(s)" in text])


def test_dedicated_rollout_node_equals_one_host_through_a_requeue(cluster, dedicated_reference, tmp_path):
    """``ROLLOUT_NODES=1``: the script makes the last rank (one whole node) a dedicated engine;
    the first node's rank trains alone and refits the engine across nodes by broadcast, one step
    off-policy. ``scontrol requeue`` of the running job: SLURM's SIGTERM reaches the engine's
    node too, the engine waits for the trainer, which saves its step with the batch generated
    ahead and stops the engine; the requeued attempt continues to exactly the one-host run."""
    run_dir = tmp_path / "run"
    job_id = _dedicated_sbatch(run_dir, tmp_path, "--time=20", "--signal=B:USR1@60", steps=DEDICATED_STEPS)
    log = _requeued_after_step_3(job_id, run_dir, tmp_path)
    assert "2 x 1 GPUs (trainer on 1 nodes, dedicated rollout engines on the last 1)" in log, log
    engine, trainer = _engine_and_trainer_nodes(tmp_path, job_id)
    assert len(engine) == 1 and len(trainer) == 1 and engine != trainer, (engine, trainer)
    node_logs = "".join((tmp_path / "logs" / str(job_id) / f"{n}.log").read_text() for n in ("node1", "node2"))
    stops = [int(k) for k in re.findall(r"stopped after step (\d+) \(SIGTERM\)", node_logs)]
    assert stops and all(3 <= k < DEDICATED_STEPS for k in stops), node_logs[-3000:]
    assert_same_run(read_metrics(run_dir), dedicated_reference)
    assert len(read_metrics(run_dir)) == DEDICATED_STEPS
