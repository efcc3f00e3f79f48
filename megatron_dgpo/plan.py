"""``python -m megatron_dgpo.plan``: the ``dgpo-plan`` command line at the path users type; the
planner itself is ``megatron_dgpo.planner`` (``megatron_dgpo/planner/cli.py``)."""

import sys

from megatron_dgpo.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
