#!/usr/bin/env python
"""dgpo-convert: HF <-> Megatron-Core checkpoints (see megatron_dgpo/convert/cli.py)."""

import sys

from megatron_dgpo.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
