"""Run the trainer, SIGKILL-ing it in the middle of saving checkpoint ``step_<N>`` (after every
rank's shards are written, before the folder is renamed into place).

The whole process group dies at once (start this in a new session), as when a scheduler kills
a job: the trainer, its vLLM engine processes and its reward workers.

    python tests/_train_killed_during_save.py N RECIPE [key=value ...]
"""

import os
import signal
import sys


def main() -> int:
    kill_step, argv = int(sys.argv[1]), sys.argv[2:]
    # first: the trainer's CLI module sets its OpenMP default before torch loads, so this run
    # computes with the same threads (and float rounding) as `python -m megatron_dgpo.train`
    from megatron_dgpo.train import main as train_main
    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def save_then_die(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        result = real_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if checkpoint_dir.endswith(f"step_{kill_step:06d}"):
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return result

    dist_checkpointing.save = save_then_die
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
