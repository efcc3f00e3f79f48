"""``python -m megatron_dgpo.arithmetic OUT_DIR``, the path users type: writes the column-addition
task and its initial tiny model (the task itself is ``megatron_dgpo/tasks/arithmetic.py``)."""

import sys

from megatron_dgpo.tasks.arithmetic import main

if __name__ == "__main__":
    sys.exit(main())
