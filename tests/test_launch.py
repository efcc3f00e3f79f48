"""tools/launch.py (NeMo-Run), run with the launch environment's python (.venv-launch, made by
tools/setup_launch_env.sh): the Slurm executor's dry run writes an sbatch script with the asked
resources and the trainer command, with dedicated rollout nodes or processes as two overrides put
before the command line's; the local executor runs the tiny recipe for one real step."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_PYTHON = ROOT / ".venv-launch" / "bin" / "python"


def _launch(*args: str, timeout: float) -> subprocess.CompletedProcess:
    assert LAUNCH_PYTHON.is_file(), "no .venv-launch: run `bash tools/setup_launch_env.sh` (make test does)"
    return subprocess.run([str(LAUNCH_PYTHON), "tools/launch.py", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def test_slurm_dry_run_writes_the_sbatch_script(tmp_path):
    overrides = ["train.steps=3", "run_dir=/scratch/dgpo runs/14b"]
    result = _launch("--executor", "slurm", "recipes/dgpo_14b.yaml", *overrides, "--resume",
                     "--account", "acc1", "--partition", "batch", "--nodes", "4", "--gpus-per-node", "8",
                     "--container-image", "nvcr.io/me/dgpo:1", "--time", "12:00:00",
                     "--job-dir", str(tmp_path), "--dry-run", timeout=120)
    assert result.returncode == 0, result.stderr
    written = re.search(r"sbatch script written to (\S+) \(not submitted\)", result.stdout)
    script = Path(written.group(1))
    assert script.is_file() and str(script).startswith(str(tmp_path))
    text = script.read_text()
    directives = set(re.findall(r"^#SBATCH (\S+)$", text, flags=re.M))
    assert {"--account=acc1", "--partition=batch", "--nodes=4", "--gpus-per-node=8",
            "--ntasks-per-node=1", "--time=12:00:00", "--exclusive"} <= directives
    srun = shlex.split(next(line for line in text.splitlines() if line.startswith("srun ")))
    assert srun[srun.index("--container-image") + 1] == "nvcr.io/me/dgpo:1"
    torchrun = srun[srun.index("torchrun"):]
    assert torchrun[torchrun.index("--nnodes") + 1] == "4"
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "8"
    assert torchrun[torchrun.index("-m"):] == ["-m", "megatron_dgpo.train", "recipes/dgpo_14b.yaml",
                                               *overrides, "--resume"]
    assert "sbatch --requeue --parsable" in text  # the command NeMo-Run would submit it with


def test_slurm_executor_needs_an_account(tmp_path):
    result = _launch("--executor", "slurm", "recipes/dgpo_14b.yaml", "--job-dir", str(tmp_path),
                     "--dry-run", timeout=120)
    assert result.returncode != 0 and "--account" in result.stderr


def _torchrun_argv(script_text: str) -> list[str]:
    srun = shlex.split(next(line for line in script_text.splitlines() if line.startswith("srun ")))
    return srun[srun.index("torchrun"):]


def test_rollout_nodes_become_the_trainers_first_overrides(tmp_path):
    # the module docstring's example (and docs/launching.md's), in a job dir of the test's own
    for doc in ("tools/launch.py", "docs/launching.md"):
        text = " ".join(re.sub(r"\\+\n", " ", (ROOT / doc).read_text()).split())  # lines joined
        assert ("tools/launch.py --executor slurm recipes/dgpo_14b_async.yaml --rollout-nodes 10 --account ACC "
                "--partition batch --nodes 30 --container-image nvcr.io/me/dgpo:latest --dry-run") in text, doc
    result = _launch("--executor", "slurm", "recipes/dgpo_14b_async.yaml", "--rollout-nodes", "10",
                     "--account", "ACC", "--partition", "batch", "--nodes", "30",
                     "--container-image", "nvcr.io/me/dgpo:latest", "--dry-run", "--job-dir", str(tmp_path),
                     "train.steps=3", timeout=120)
    assert result.returncode == 0, result.stderr
    script = Path(re.search(r"sbatch script written to (\S+) \(not submitted\)", result.stdout).group(1))
    text = script.read_text()
    assert "#SBATCH --nodes=30" in text.splitlines()  # the engines' nodes are part of the job
    torchrun = _torchrun_argv(text)
    assert torchrun[torchrun.index("--nnodes") + 1] == "30"
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "8"
    trainer_args = torchrun[torchrun.index("-m") + 2:]
    assert trainer_args == ["recipes/dgpo_14b_async.yaml", "rollout.placement=dedicated", "rollout.num_gpus=80",
                            "train.steps=3"]
    # a layout the trainer accepts: 160 trainer GPUs at TP 8 are 20 DP replicas, 80 engine GPUs at
    # the recipe's engine TP 4 are 20 engines, one per replica
    from megatron_dgpo.recipe import load_recipe
    from megatron_dgpo.rollout.dedicated.wire import dedicated_layout

    cfg = load_recipe(ROOT / trainer_args[0], trainer_args[1:])
    assert dedicated_layout(cfg.rollout, cfg.parallel, 30 * 8 - 80).engines_per_replica == 1


def test_rollout_gpus_of_the_local_executor(tmp_path):
    result = subprocess.run([str(LAUNCH_PYTHON), "tools/launch.py", "recipes/tiny_cpu.yaml", "train.steps=1",
                             "--nproc", "2", "--rollout-gpus", "1", "--job-dir", str(tmp_path), "--dry-run"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120,
                            env=dict(os.environ, COLUMNS="300"))
    assert result.returncode == 0, result.stderr
    quoted = re.findall(r"'([^']*)'", result.stdout)  # NeMo-Run prints the torchrun app's arguments
    assert quoted[quoted.index("--nproc-per-node") + 1] == "2"
    start = quoted.index("megatron_dgpo.train")
    assert quoted[start + 2:start + 5] == ["rollout.placement=dedicated", "rollout.num_gpus=1", "train.steps=1"]


@pytest.mark.parametrize("args, message", [
    (["--executor", "slurm", "--nodes", "2", "--rollout-nodes", "2"], "--rollout-nodes 2 must be between 1 and"),
    (["--executor", "slurm", "--nodes", "2", "--rollout-nodes", "-1"], "--rollout-nodes -1 must be between 1 and"),
    (["--executor", "slurm", "--nodes", "2", "--rollout-nodes", "one"], "argument --rollout-nodes: invalid int"),
    (["--executor", "slurm", "--nodes", "2", "--rollout-gpus", "1"], "--rollout-gpus is not for --executor slurm"),
    (["--nproc", "2", "--rollout-gpus", "2"], "--rollout-gpus 2 must be between 1 and --nproc - 1 = 1"),
    (["--nproc", "2", "--rollout-nodes", "1"], "--rollout-nodes is not for --executor local"),
])
def test_rollout_ranks_that_leave_no_trainer_are_refused(tmp_path, args, message):
    result = _launch("recipes/dgpo_14b.yaml", "--account", "acc", "--job-dir", str(tmp_path), "--dry-run",
                     *args, timeout=120)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert not list(tmp_path.rglob("*_sbatch.sh"))  # nothing written


def test_local_executor_runs_one_real_step_of_the_tiny_recipe(tmp_path):
    run_dir = tmp_path / "run"
    result = _launch("recipes/tiny_cpu.yaml", "train.steps=1", f"run_dir={run_dir}",
                     "logging.progress_bar=false", "--nproc", "1", "--job-dir", str(tmp_path / "nemo"),
                     timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1]
    assert lines[0]["rollout/num_samples"] > 0 and "time/update" in lines[0]
    assert (run_dir / "checkpoints").is_dir()
