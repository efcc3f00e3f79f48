"""Command line of the trainer: ``python -m megatron_dgpo.train RECIPE [key=value ...]``.

One process (no torchrun) runs a world of one rank; under ``torchrun`` every rank runs this.

    python -m megatron_dgpo.train recipes/tiny_cpu.yaml train.steps=5
    torchrun --nproc-per-node 2 -m megatron_dgpo.train recipes/tiny_cpu.yaml parallel.tensor_parallel=2
    python -m megatron_dgpo.train --describe                          # every config key, documented

Re-running a command continues the run in its ``run_dir`` (``checkpoint.resume: auto``). Exit
status: 0 done; 2 a bad recipe; ``interrupt.EXIT_STOPPED`` (75) stopped early by a signal or
``train.max_minutes`` with a checkpoint saved (re-run to continue).
"""

from __future__ import annotations

import os

# One OpenMP thread per rank unless the environment says otherwise, as torchrun sets for each
# of its ranks; set before torch loads. A colocated vLLM engine on CPU binds threads when it
# starts (torch.set_num_threads is dead after that): without this the one-rank tiny job ran
# 16-18 s/step on the shared 2-core box, with it 1.6-2 s/step.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402

from megatron_dgpo.runtime.config import ConfigError, describe  # noqa: E402


def recipe_command(argv: list[str] | None, *, prog: str, description: str, config_class,
                   load, run, example: str, epilog: str = "") -> int:
    """The command line shared by ``dgpo-train`` and ``dgpo-sft``: ``RECIPE [key=value ...]
    [--resume] | --describe``. ``load(recipe, overrides)`` builds the config (a ``ConfigError``
    is printed, exit 2), ``run(config)`` runs it (in a world of one rank when started without
    torchrun) and returns the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog or None)
    parser.add_argument("recipe", nargs="?", help="recipe YAML (recipes/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the recipe")
    parser.add_argument("--resume", action="store_true",
                        help="checkpoint.resume=auto: continue from the newest complete checkpoint "
                             "in run_dir (the default unless the recipe says otherwise)")
    parser.add_argument("--describe", action="store_true",
                        help="print every config key with its type and documentation, and exit")
    args = parser.parse_args(argv)
    if args.describe:
        for key, kind, doc in describe(config_class):
            print(f"{key}  ({kind})\n    {' '.join(doc.split())}")
        return 0
    if args.recipe is None:
        parser.error(f"a recipe is required (e.g. {example})")
    if "=" in args.recipe:
        parser.error(f"the first argument must be a recipe file, got the override {args.recipe!r}")
    overrides = args.overrides + (["checkpoint.resume=auto"] if args.resume else [])
    try:
        config = load(args.recipe, overrides)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    _single_process_world()
    from megatron_dgpo.runtime.interrupt import stop_requests

    with stop_requests():  # from here on a stop signal is a request, even during start-up
        return run(config)


def _single_process_world() -> None:
    """torchrun's environment for a run started without torchrun (one rank)."""
    if "RANK" in os.environ:
        return
    from megatron_dgpo.convert._spawn import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def main(argv: list[str] | None = None) -> int:
    from megatron_dgpo.recipe import RunConfig, load_recipe

    def run(config):
        from megatron_dgpo.trainer import train

        return train(config)

    return recipe_command(argv, prog="dgpo-train", config_class=RunConfig, load=load_recipe, run=run,
                          description="Run a DGPO (or baseline) RL job from a recipe.",
                          epilog="Overrides are dotted keys: algorithm.method=grpo optimizer.lr=1e-6 ...",
                          example="recipes/tiny_cpu.yaml")


if __name__ == "__main__":  # required: checkpoint writers start spawn-based worker processes
    sys.exit(main())
