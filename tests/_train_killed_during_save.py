"""Run the trainer, SIGKILL-ing the process in the middle of saving checkpoint ``step_<N>``
(after every rank's shards are written, before the folder is renamed into place).

    python tests/_train_killed_during_save.py N RECIPE [key=value ...]
"""

import os
import signal
import sys


def main() -> int:
    kill_step, argv = int(sys.argv[1]), sys.argv[2:]
    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def save_then_die(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        result = real_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if checkpoint_dir.endswith(f"step_{kill_step:06d}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dist_checkpointing.save = save_then_die
    from megatron_dgpo.train import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
