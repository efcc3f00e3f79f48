"""The command line that ``dgpo-train`` and ``dgpo-sft`` share: ``RECIPE [key=value ...]
[--resume] | --describe`` (``recipe_command``), run in a world of one rank when started
without torchrun.

Importing this module sets ``OMP_NUM_THREADS=1`` unless the environment sets it, as torchrun
does for each of its ranks: the commands import it before torch loads. A colocated vLLM engine
on CPU binds its threads when it starts (``torch.set_num_threads`` has no effect after that),
so the default has to be in place first (benchmarks/README.md gives the step times with and
without it).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402

from megatron_dgpo.runtime.config import ConfigError, describe  # noqa: E402


def recipe_command(argv: list[str] | None, *, prog: str, description: str, config_class,
                   load, run, example: str, epilog: str = "") -> int:
    """Parse ``argv`` as ``RECIPE [key=value ...] [--resume] | --describe`` and return the exit
    status: ``--describe`` prints every key of ``config_class`` with its type and
    documentation (0); otherwise ``load(recipe, overrides)`` builds the config (a
    ``ConfigError`` is printed, 2) and ``run(config)`` runs it, in a world of one rank when
    started without torchrun, with stop signals taken as requests from then on."""
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
    single_process_world()
    from megatron_dgpo.runtime.interrupt import stop_requests

    with stop_requests():  # from here on a stop signal is a request, even during start-up
        return run(config)


def single_process_world() -> None:
    """torchrun's environment for a run started without torchrun (one rank)."""
    if "RANK" in os.environ:
        return
    from megatron_dgpo.runtime.parallel import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
