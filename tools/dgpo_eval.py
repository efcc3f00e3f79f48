#!/usr/bin/env python
"""dgpo-eval: Avg@k / Pass@k of a model on math benchmarks (see megatron_dgpo/evaluate.py)."""

import sys

from megatron_dgpo.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
