"""The user's mistakes as one kind of error, and how every command reports them.

``InputError`` (a ``ValueError``): a recipe, an argument, a data or model file is wrong; its
message names the key, file or line. ``reported_as(prog)`` wraps a command's main: an
``InputError`` escaping it becomes one ``prog: error: ...`` line on stderr and exit status 2,
with the traceback only when ``DGPO_DEBUG=1``.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback

EXIT_INPUT_ERROR = 2
"""A command's exit status for a mistake in its input (argparse's too)."""


class InputError(ValueError):
    """The user's input is wrong; the message names the key, file or line."""


def reported_as(prog: str):
    """Decorator for a command's ``main``: an ``InputError`` it raises is printed as
    ``{prog}: error: {message}`` (the traceback too with ``DGPO_DEBUG=1``) and the command
    returns ``EXIT_INPUT_ERROR``."""
    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except InputError as exc:
                if os.environ.get("DGPO_DEBUG") == "1":
                    traceback.print_exc()
                print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
                return EXIT_INPUT_ERROR
        return run
    return wrap


class MissingInputError(InputError, FileNotFoundError):
    """A file or folder the user named (or one it must hold) does not exist."""
