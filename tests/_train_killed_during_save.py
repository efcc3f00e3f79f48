"""Run the trainer, SIGKILL-ing it in the middle of saving checkpoint ``step_<N>`` (after every
rank's files are written, before the folder is renamed into place: ``checkpoint._publish``).

The trainer process alone is killed (as by the OOM killer, or torchrun killing a rank): its
vLLM engine, reward workers and checkpoint helpers get no signal and must die with it
(``runtime.lifetime``). Before dying it writes the pids of all its descendants to
``<run_dir>/children.json``.

    python tests/_train_killed_during_save.py N RECIPE run_dir=DIR [key=value ...]
"""

import json
import os
import signal
import sys
from pathlib import Path


def main() -> int:
    kill_step, argv = int(sys.argv[1]), sys.argv[2:]
    # first: the trainer's CLI module sets its OpenMP default before torch loads, so this run
    # computes with the same threads (and float rounding) as `python -m megatron_dgpo.train`
    from megatron_dgpo.train import main as train_main
    from megatron_dgpo.training import checkpoint

    import psutil

    run_dir = Path(next(a for a in argv if a.startswith("run_dir=")).split("=", 1)[1])
    publish = checkpoint._publish

    def die_before_publishing(root, name, *args):
        if name == checkpoint.checkpoint_name(kill_step):
            children = [p.pid for p in psutil.Process().children(recursive=True)]
            (run_dir / "children.json").write_text(json.dumps(children))
            os.kill(os.getpid(), signal.SIGKILL)
        return publish(root, name, *args)

    checkpoint._publish = die_before_publishing
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
