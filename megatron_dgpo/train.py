"""Command line of the trainer: ``python -m megatron_dgpo.train RECIPE [key=value ...]``.

One process (no torchrun) runs a world of one rank; under ``torchrun`` every rank runs this.

    python -m megatron_dgpo.train recipes/tiny_cpu.yaml train.steps=5
    torchrun --nproc-per-node 2 -m megatron_dgpo.train recipes/tiny_cpu.yaml parallel.tensor_parallel=2
    python -m megatron_dgpo.train --describe                          # every config key, documented

Re-running a command continues the run in its ``run_dir`` (``checkpoint.resume: auto``). The
recipe's inputs are checked before anything starts (``megatron_dgpo.preflight``). Exit status: 0
done; 2 a mistake in the input (one ``dgpo-train: error: ...`` line); ``interrupt.EXIT_STOPPED`` (75) stopped early by a signal or
``train.max_minutes`` with a checkpoint saved (re-run to continue).
"""

from __future__ import annotations

import sys

from megatron_dgpo.command import quiet_console, recipe_command  # first: the OpenMP default
from megatron_dgpo.runtime.errors import reported_as


@reported_as("dgpo-train")
def main(argv: list[str] | None = None) -> int:
    from megatron_dgpo.preflight import check_run
    from megatron_dgpo.recipe import RunConfig, load_recipe

    def run(config):
        quiet_console("dgpo-train", config.run_dir, verbose=config.logging.verbose)
        from megatron_dgpo.trainer import train

        return train(config)

    return recipe_command(argv, prog="dgpo-train", module="megatron_dgpo.train",
                          config_class=RunConfig, load=load_recipe, check=check_run, run=run,
                          description="Run a DGPO (or baseline) RL job from a recipe.",
                          epilog="Overrides are dotted keys: algorithm.method=grpo optimizer.lr=1e-6 ...",
                          example="recipes/tiny_cpu.yaml")


if __name__ == "__main__":  # required: checkpoint writers start spawn-based worker processes
    sys.exit(main())
