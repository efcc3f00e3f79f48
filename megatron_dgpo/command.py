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
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from megatron_dgpo.runtime.config import describe  # noqa: E402
from megatron_dgpo.runtime.errors import EXIT_INPUT_ERROR, InputError  # noqa: E402


def recipe_command(argv: list[str] | None, *, prog: str, module: str, description: str,
                   config_class, load, check, run, example: str, epilog: str = "") -> int:
    """Parse ``argv`` as ``RECIPE [key=value ...] [--resume] | --describe`` and return the exit
    status: ``--describe`` prints every key of ``config_class`` with its type and
    documentation (0); otherwise ``load(recipe, overrides)`` builds the config,
    ``check(config, world_size=..., relaunch=...)`` checks its inputs (``preflight``; relaunch:
    this command after ``torchrun --nproc-per-node N``), both before any process group or model
    exists, and ``run(config)`` runs it, in a world of one rank when started without torchrun,
    with stop signals taken as requests from then on. An ``InputError`` of the load or the
    check is every rank's (the same recipe and files): rank 0 reports it (``main`` is wrapped
    in ``errors.reported_as``), the other ranks exit 2 without a word."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog or None)
    parser.add_argument("recipe", nargs="?", help="recipe YAML (recipes/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the recipe")
    parser.add_argument("--resume", action="store_true",
                        help="checkpoint.resume=auto: continue from the newest complete checkpoint "
                             "in run_dir (the default unless the recipe says otherwise)")
    parser.add_argument("--describe", action="store_true",
                        help="print every config key with its type and documentation, and exit")
    argv = sys.argv[1:] if argv is None else list(argv)
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
        check(config, world_size=int(os.environ.get("WORLD_SIZE", "1")),
              relaunch=shlex.join(["-m", module, *argv]))
    except InputError:
        if os.environ.get("RANK", "0") == "0" or os.environ.get("DGPO_DEBUG") == "1":
            raise
        return EXIT_INPUT_ERROR
    single_process_world()
    from megatron_dgpo.runtime.interrupt import stop_requests

    with stop_requests():  # from here on a stop signal is a request, even during start-up
        return run(config)


def quiet_console(prog: str, run_dir: str, *, verbose: bool) -> None:
    """Unless ``verbose`` (``logging.verbose``), other packages' notices go to
    ``<run_dir>/logs/rank<k>.log`` (``runtime.console``), which rank 0 names once."""
    if verbose:
        return
    from megatron_dgpo.runtime.console import route_notices

    rank = os.environ.get("RANK", "0")
    log = Path(run_dir) / "logs" / f"rank{rank}.log"
    route_notices(log)
    if rank == "0":
        print(f"{prog}: other packages' notices go to {log.parent}/rank<k>.log "
              f"(logging.verbose=true shows them here)", file=sys.stderr, flush=True)


def single_process_world() -> None:
    """torchrun's environment for a run started without torchrun (one rank)."""
    if "RANK" in os.environ:
        return
    from megatron_dgpo.runtime.parallel import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
