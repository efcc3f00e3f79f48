"""A trainer's helpers, then a SIGKILL to the trainer alone at one moment of an async save.

One gloo rank holds the tiny model, Megatron's optimizer and an ``AsyncSaver`` (Megatron's
persistent writer process, its result queue's manager, multiprocessing's resource tracker; the
trainer's other children, graders and engines, are in tests/test_trainer.py's killed run),
saves step 1 in the background, then step 2, and
kills itself (``os.kill(os.getpid(), SIGKILL)``: its children are not signalled) at ``MOMENT``:

* ``writing``: the step-2 request just handed to the writer process;
* ``publishing``: every rank's files written, before the rename (``checkpoint._publish``);
* ``published``: step 2 renamed into place and named by ``latest``.

Before dying it writes the pids of all its descendants to ``ROOT/children.json``.
``MOMENT`` ``changed``: no kill; every parameter changes in place right after step 1's save is
staged (as the next step's update does while the writer writes), and ``ROOT/changed.json``
says whether the published step 1 holds the parameters as they were when it was saved.

    python tests/_killed_during_async_save.py MOMENT ROOT
"""

import json
import os
import signal
import sys
from pathlib import Path


def _die(root: Path) -> None:
    import psutil

    children = [p.pid for p in psutil.Process().children(recursive=True)]
    (root / "children.json").write_text(json.dumps(children))
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    moment, root = sys.argv[1], Path(sys.argv[2])
    import torch

    from megatron_dgpo.convert import single_process_group
    from megatron_dgpo.runtime.lifetime import children_die_with_this_process
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training import checkpoint
    from tests._rank_fns_model import TINY_QWEN2
    from megatron_dgpo.training.optimizer import step_if_finite
    from tests._rank_fns_trainer import _grads, _setup

    children_die_with_this_process()  # as TrainingRun does first
    with single_process_group():
        initialize_parallel(ParallelConfig(), seed=1)
        models, optimizer = _setup()
        saver = checkpoint.AsyncSaver()
        meta = dict(hf_config=TINY_QWEN2, padded_vocab_size=models[0].module.vocab_size,
                    dtype=torch.float32)
        publish, schedule = checkpoint._publish, saver.schedule

        def publish_or_die(root_, name, *args):
            if name == "step_000002" and moment == "publishing":
                _die(root)
            publish(root_, name, *args)
            if name == "step_000002" and moment == "published":
                _die(root)

        def schedule_or_die(request):
            schedule(request)
            if moment == "writing" and "step_000002" in str(request.async_fn.args[1]):
                _die(root)

        checkpoint._publish, saver.schedule = publish_or_die, schedule_or_die
        if moment == "changed":
            return _changed_under_the_writer(root, models, optimizer, saver, meta)
        for step in (1, 2):
            step_if_finite(optimizer, models, _grads(models).loss)
            checkpoint.save_checkpoint(root / "checkpoints", checkpoint.TrainerState(step=step),
                                       models, optimizer, saver=saver, **meta)
        saver.wait()
    return 1  # not reached: killed above


def _changed_under_the_writer(root: Path, models, optimizer, saver, meta) -> int:
    import torch

    from megatron_dgpo.training import checkpoint
    from megatron_dgpo.training.optimizer import step_if_finite
    from tests._rank_fns_trainer import _grads, _params, _setup

    step_if_finite(optimizer, models, _grads(models).loss)
    saved = _params(models)
    checkpoint.save_checkpoint(root / "checkpoints", checkpoint.TrainerState(step=1), models,
                               optimizer, saver=saver, **meta)
    with torch.no_grad():
        for param in models[0].module.parameters():
            param.add_(1.0)
    saver.wait()
    fresh, fresh_optimizer = _setup(seed=9)
    checkpoint.load_checkpoint(checkpoint.latest_checkpoint(root / "checkpoints"), fresh,
                               fresh_optimizer)
    # exact: a round trip through the checkpoint
    kept = all(torch.equal(saved[n], p) for n, p in _params(fresh).items())
    (root / "changed.json").write_text(json.dumps({"kept": kept}))
    saver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
