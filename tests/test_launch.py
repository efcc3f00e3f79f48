"""tools/launch.py (NeMo-Run), run with the launch environment's python (.venv-launch, made by
tools/setup_launch_env.sh): the Slurm executor's dry run writes an sbatch script with the asked
resources and the trainer command; the local executor runs the tiny recipe for one real step."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

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
