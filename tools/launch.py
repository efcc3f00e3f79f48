"""Launch a recipe with NeMo-Run: the trainer (``python -m megatron_dgpo.train``) as a NeMo-Run
``Script`` task, on this machine (``LocalExecutor``, torchrun) or on a SLURM cluster
(``SlurmExecutor``, one torchrun per node, optionally in a container).

    # this machine, 2 processes
    .venv-launch/bin/python tools/launch.py recipes/tiny_cpu.yaml train.steps=1 --nproc 2 \\
        parallel.tensor_parallel=2
    # SLURM; --dry-run writes and prints the sbatch script instead of submitting it
    .venv-launch/bin/python tools/launch.py --executor slurm recipes/dgpo_14b.yaml \\
        --account ACC --partition batch --nodes 4 --container-image nvcr.io/me/dgpo:latest --dry-run
    # SLURM, the last 10 of 30 nodes running dedicated rollout engines (one step off-policy)
    .venv-launch/bin/python tools/launch.py --executor slurm recipes/dgpo_14b_async.yaml --rollout-nodes 10 \\
        --account ACC --partition batch --nodes 30 --container-image nvcr.io/me/dgpo:latest --dry-run

Dedicated rollout engines (README, "Where generation runs"): ``--rollout-nodes N`` (SLURM, 0 < N
< ``--nodes``) or ``--rollout-gpus N`` (local, 0 < N < ``--nproc``) put the trainer's overrides
``rollout.placement=dedicated rollout.num_gpus=<N x --gpus-per-node, or N>`` before the command
line's, as ``ROLLOUT_NODES`` does in ``slurm/train.sbatch``: the last ranks of the torchrun world
are the engines', and torchrun numbers each node's ranks consecutively, so they are whole nodes.

Runs in its own environment (``bash tools/setup_launch_env.sh`` makes ``.venv-launch``): nemo-run
conflicts with vLLM's server dependencies, and the machine that submits jobs needs no torch. The
job itself runs the training environment: ``--job-venv`` (default ``.venv`` here, for the local
executor) or the container image's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nemo_run as run

ROOT = Path(__file__).resolve().parents[1]
TRAINER_MODULE = "megatron_dgpo.train"


def trainer_task(recipe: str, overrides: list[str], resume: bool = False) -> run.Script:
    """``-m megatron_dgpo.train RECIPE [overrides] [--resume]`` as a NeMo-Run task (the executor's
    launcher puts torchrun in front of it)."""
    args = [recipe, *overrides] + (["--resume"] if resume else [])
    return run.Script(path=TRAINER_MODULE, m=True, entrypoint="python", args=args)


def _venv_env(job_venv: str | None) -> dict[str, str]:
    """PATH with the job's venv first, so that the launcher's ``torchrun`` (and ``python``) are
    the training environment's, not this launcher's (which has no torch)."""
    if not job_venv:
        return {}
    bin_dir = Path(job_venv).resolve() / "bin"
    if not (bin_dir / "torchrun").is_file():
        raise SystemExit(f"launch.py: --job-venv {job_venv}: no bin/torchrun there")
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(bin_dir.parent)}


def local_executor(nproc: int, job_venv: str | None) -> run.LocalExecutor:
    """torchrun with ``nproc`` processes on this machine."""
    return run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun", env_vars=_venv_env(job_venv))


def slurm_executor(*, account: str, partition: str | None, nodes: int, gpus_per_node: int,
                   container_image: str | None, time: str, job_dir: str,
                   job_venv: str | None = None, container_mounts: list[str] = (),
                   ssh_host: str | None = None, ssh_user: str | None = None,
                   package_code: bool = True) -> run.SlurmExecutor:
    """One torchrun per node (NeMo-Run's torchrun launcher sets ntasks-per-node=1 and
    nproc-per-node=gpus_per_node) on ``nodes`` nodes; rendezvous on the first node.

    ``package_code``: ship the repository's committed HEAD (``git archive``) to the job dir, where
    the job runs it (``/nemo_run/code`` in a container); off: the job runs in the submission dir,
    which must then be on a filesystem the nodes share.
    """
    # The Experiment (base_dir=job_dir) writes its files under <job_dir>/experiments/<exp>/<id>;
    # an SSH tunnel rsyncs them there, a local one submits them in place, so it must look there.
    tunnel = (run.SSHTunnel(host=ssh_host, user=ssh_user or os.environ.get("USER", ""), job_dir=job_dir)
              if ssh_host else run.LocalTunnel(job_dir=os.path.join(job_dir, "experiments")))
    return run.SlurmExecutor(
        account=account, partition=partition, nodes=nodes, ntasks_per_node=gpus_per_node,
        gpus_per_node=gpus_per_node, container_image=container_image,
        container_mounts=list(container_mounts), time=time, exclusive=True, job_name_prefix="dgpo-",
        launcher="torchrun", env_vars=_venv_env(job_venv), tunnel=tunnel,
        packager=run.GitArchivePackager() if package_code else run.Packager())


def rollout_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides that make the last ranks dedicated rollout engines (none: colocated):
    ``--rollout-nodes`` whole nodes of a SLURM job, ``--rollout-gpus`` processes of a local one.
    Refused, naming the flag, when no trainer rank would be left."""
    if args.executor == "slurm":
        flag, count, of, total = "--rollout-nodes", args.rollout_nodes, "--nodes", args.nodes
        other = args.rollout_gpus
    else:
        flag, count, of, total = "--rollout-gpus", args.rollout_gpus, "--nproc", args.nproc
        other = args.rollout_nodes
    if other:
        wrong = "--rollout-gpus" if args.executor == "slurm" else "--rollout-nodes"
        raise SystemExit(f"launch.py: {wrong} is not for --executor {args.executor} (use {flag})")
    if not count:
        return []
    if not 0 < count < total:
        raise SystemExit(f"launch.py: {flag} {count} must be between 1 and {of} - 1 = {total - 1}: "
                         f"the trainer needs the other ranks")
    gpus = count * args.gpus_per_node if args.executor == "slurm" else count
    return ["rollout.placement=dedicated", f"rollout.num_gpus={gpus}"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/launch.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML, relative to the repository root or absolute")
    p.add_argument("overrides", nargs="*", help="key.sub=value recipe overrides")
    p.add_argument("--resume", action="store_true", help="passed to the trainer")
    p.add_argument("--executor", choices=("local", "slurm"), default="local")
    p.add_argument("--name", help="experiment name (default: the recipe file name)")
    p.add_argument("--job-dir", default=None,
                   help="where NeMo-Run keeps experiments, logs and sbatch scripts "
                        "(default: $NEMORUN_HOME or ~/.nemo_run); for SLURM a shared path")
    p.add_argument("--job-venv", default=None,
                   help="training venv the job runs (default for local: .venv; for slurm: none, "
                        "the container's or the nodes' PATH)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would run (SLURM: write and print the sbatch script), run nothing")
    local = p.add_argument_group("local executor")
    local.add_argument("--nproc", type=int, default=1, help="torchrun processes (default 1)")
    local.add_argument("--rollout-gpus", type=int, default=0, metavar="N",
                       help="the last N of the --nproc processes run dedicated rollout engines "
                            "(default 0: colocated)")
    slurm = p.add_argument_group("slurm executor")
    slurm.add_argument("--account")
    slurm.add_argument("--partition")
    slurm.add_argument("--nodes", type=int, default=1)
    slurm.add_argument("--gpus-per-node", type=int, default=8)
    slurm.add_argument("--rollout-nodes", type=int, default=0, metavar="N",
                       help="the last N of the --nodes nodes run dedicated rollout engines "
                            "(default 0: colocated)")
    slurm.add_argument("--container-image", help="e.g. nvcr.io/nvidia/pytorch:25.01-py3 with this "
                                                 "project's dependencies installed")
    slurm.add_argument("--container-mounts", nargs="*", default=[], metavar="SRC:DST")
    slurm.add_argument("--time", default="04:00:00", help="wall-clock limit (default 04:00:00)")
    slurm.add_argument("--ssh-host", help="submit through SSH to this login node (default: local sbatch)")
    slurm.add_argument("--ssh-user")
    slurm.add_argument("--no-package", action="store_true",
                       help="do not git-archive HEAD into the job dir; run the shared checkout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # overrides may follow options
    recipe = Path(args.recipe)
    if not (recipe if recipe.is_absolute() else ROOT / recipe).is_file():
        raise SystemExit(f"launch.py: recipe {args.recipe}: no such file")
    name = args.name or recipe.stem.replace(".", "_")  # part of job ids and file names
    job_dir = str(Path(args.job_dir or os.environ.get("NEMORUN_HOME", Path.home() / ".nemo_run")).resolve())
    if args.executor == "slurm" and "/nemo_run" in job_dir:
        # nemo-run 0.11 rewrites every "/nemo_run" of a non-container sbatch script into the job
        # dir: the job's --output folder would not exist (JobLaunchFailure, ExitCode 0:53)
        raise SystemExit(f"launch.py: job dir {job_dir} contains '/nemo_run', which nemo-run rewrites "
                         f"in the sbatch script; use another --job-dir / NEMORUN_HOME (~/.nemo_run is fine)")
    overrides = rollout_overrides(args) + args.overrides  # the command line's come later and win

    if args.executor == "local":
        # Absolute: the local job runs in the caller's working directory, wherever that is.
        task = trainer_task(str(recipe if recipe.is_absolute() else ROOT / recipe), overrides, args.resume)
        executor = local_executor(args.nproc, args.job_venv or str(ROOT / ".venv"))
    else:
        if not args.account:
            raise SystemExit("launch.py: --executor slurm needs --account")
        # Relative: the job resolves it in its own code dir (the packaged copy or the checkout).
        task = trainer_task(str(recipe), overrides, args.resume)
        executor = slurm_executor(
            account=args.account, partition=args.partition, nodes=args.nodes,
            gpus_per_node=args.gpus_per_node, container_image=args.container_image,
            container_mounts=args.container_mounts, time=args.time, job_dir=job_dir,
            job_venv=args.job_venv, ssh_host=args.ssh_host, ssh_user=args.ssh_user,
            package_code=not args.no_package)

    with run.Experiment(name, executor=executor, base_dir=job_dir, log_level="WARN") as exp:
        exp.add(task, name="train")
        if args.dry_run:
            exp.dryrun(log=args.executor == "local", delete_exp_dir=False)
            for script in sorted(Path(exp._exp_dir).glob("*_sbatch.sh")):
                print(script.read_text())
                print(f"# sbatch script written to {script} (not submitted)")
            return 0
        # Local: stream logs; leaving the `with` waits for the job. SLURM: submit and return.
        exp.run(detach=args.executor == "slurm", tail_logs=args.executor == "local")
    if args.executor == "local":
        states = [job.state.name for job in exp.jobs]
        if states != ["SUCCEEDED"]:
            print(f"launch.py: the job ended {states}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
