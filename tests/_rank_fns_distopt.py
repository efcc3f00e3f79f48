"""Rank functions for tests/training/test_distributed_optimizer.py: Megatron's distributed optimizer on
gloo ranks (``megatron_dgpo.runtime.cpu`` patches 11-13), against the plain optimizer, and its
checkpoints (both sharding types, the async save's persistent writer, resharding)."""

from __future__ import annotations

import torch

from tests._rank_fns_model import TINY_QWEN2
from tests._rank_fns_train import micro_batches

LR, WD, CLIP = 5e-3, 0.1, 0.05


def _setup(tp: int, *, distributed: bool, seed: int = 5, bucket_size: int | None = None,
           overlap: bool = False):
    from megatron.core import parallel_state

    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.training.policy import wrap_ddp
    from megatron_dgpo.recipe import OptimizerConfig
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training.optimizer import build_optimizer

    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel(ParallelConfig(tensor_parallel=tp), seed=1)
    # several buckets: the shard views of more than one bucket are reduced and gathered
    models = wrap_ddp(build_model(TINY_QWEN2, seed=seed), use_distributed_optimizer=distributed,
                      bucket_size=bucket_size, overlap_grad_reduce=overlap,
                      overlap_param_gather=overlap and distributed)
    config = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                             use_distributed_optimizer=distributed)
    return models, build_optimizer(config, models, lr=LR, bf16=False)


def _update(models, optimizer, step: int) -> float:
    from megatron.core import parallel_state as ps

    from megatron_dgpo.algorithm.losses import LossConfig, LossHyperparams
    from megatron_dgpo.training.optimizer import step_if_finite
    from megatron_dgpo.training.train_step import train_step

    loss = LossConfig(method="dgpo", loss=LossHyperparams())
    # each step a different share of the sequences: the Adam moments differ from step to step
    batches = micro_batches(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), 2)
    result = train_step(models, batches[step % len(batches):] + batches[:step % len(batches)], loss)
    stepped, grad_norm = step_if_finite(optimizer, models, result.loss)
    assert stepped
    return grad_norm


def _params(models) -> dict:
    from megatron_dgpo.training.optimizer import sync_params

    sync_params(models)  # overlapped param gather: the other ranks' shards of the last update
    return {n: p.detach().clone() for n, p in models[0].module.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _equal(a: dict, b: dict) -> bool:
    # exact: a resume at the same layout (TP 1, DP 2, the same buckets) replays the same
    # kernels on the same, round-tripped state
    return all(torch.equal(a[n], b[n]) for n in a)


def _logprobs(models) -> torch.Tensor:
    """Log-probs of every sequence (the same on every rank and at every layout)."""
    from megatron_dgpo.training.train_step import forward_logprobs

    return torch.cat([logp.flatten() for logp, _ in forward_logprobs(models, micro_batches(0, 1, 2))])


META = dict(hf_config=TINY_QWEN2, dtype=torch.float32)
BUCKET = 20_000  # several buckets: more than one bucket's shard views reduced and gathered


SHARDINGS = ("dp_reshardable", "fully_reshardable")


def train_save_and_resume(rank, world, root) -> dict:
    """At TP 1, DP 2, for each sharding type: two updates with the plain optimizer and with the
    distributed one (same data; overlapped grad reduce and param gather, several buckets), the
    distributed one saved then through the async saver (Megatron's persistent writer, started
    at its creation); a third update from the live optimizer and from a fresh one loaded from
    the checkpoint: bitwise equal. And why the sharding type is always passed: Megatron's
    default one raises on save."""
    from megatron_dgpo.training.checkpoint import (AsyncSaver, TrainerState, distributed_optimizers,
                                                   load_checkpoint, save_checkpoint)

    out = {"default_sharding": _megatron_default_sharding_fails()}
    # a run ending on an exception stops its writer (else the process hangs at exit joining it)
    probe = AsyncSaver()
    writer = type(probe._queue)._persistent_caller.process  # class-wide in megatron-core 0.19
    probe.abort()
    writer.join(timeout=30)
    out["aborted"] = not writer.is_alive()
    for sharding in SHARDINGS:
        plain, plain_opt = _setup(1, distributed=False)
        models, optimizer = _setup(1, distributed=True, bucket_size=BUCKET, overlap=True)
        got = {"distributed": [bool(distributed_optimizers(o)) for o in (plain_opt, optimizer)],
               "buckets": len(models[0].buffers[0].buckets)}
        saver = AsyncSaver()
        # megatron-core 0.19: the queue's persistent caller is class-wide (``_persistent_caller``)
        got["writer_started"] = saver._queue._persistent_caller.process is not None
        got["norms"] = [(_update(plain, plain_opt, step), _update(models, optimizer, step))
                        for step in range(2)]
        got["vs_plain"] = _max_diff(_params(plain), _params(models))
        save_checkpoint(f"{root}/{sharding}", TrainerState(step=2), models, optimizer,
                        saver=saver, padded_vocab_size=models[0].module.vocab_size,
                        optimizer_sharding=sharding, **META)
        saver.close()
        _update(models, optimizer, 2)
        fresh, fresh_opt = _setup(1, distributed=True, seed=9, bucket_size=BUCKET, overlap=True)
        load_checkpoint(f"{root}/{sharding}/step_000002", fresh, fresh_opt)
        _update(fresh, fresh_opt, 2)
        got["resumed_equal"] = _equal(_params(models), _params(fresh))
        live = _logprobs(models)
        if rank == 0:  # for the resumes at other layouts
            torch.save(live, f"{root}/{sharding}/logprobs_after_3.pt")
        out[sharding] = got
    return out


def _megatron_default_sharding_fails() -> str:
    """Megatron 0.16's default sharding type (``fully_sharded_model_space``, without metadata)
    on a save: the exception's text, or "" if it saved."""
    import tempfile

    from megatron.core import dist_checkpointing

    models, optimizer = _setup(1, distributed=True)
    _update(models, optimizer, 0)
    from megatron_dgpo.convert import model_sharded_state_dict

    model_sd = model_sharded_state_dict([models[0].module])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            dist_checkpointing.save({"optimizer": optimizer.sharded_state_dict(model_sd)}, tmp)
    except Exception as error:  # noqa: BLE001 - its text is what the test checks
        return f"{type(error).__name__}: {error}"
    return ""


def resume_at_another_layout(rank, world, root, tp: int) -> dict:
    """Each checkpoint of ``train_save_and_resume`` loaded at TP = tp, DP = world / tp, and the
    third update made: the log-probs then are those of the run that never stopped (within
    float rounding: another layout sums the gradients in another order), or the load is
    refused with the reason."""
    from megatron_dgpo.training.checkpoint import load_checkpoint

    out = {}
    for sharding in SHARDINGS:
        fresh, fresh_opt = _setup(tp, distributed=True, seed=9, bucket_size=BUCKET, overlap=True)
        try:
            load_checkpoint(f"{root}/{sharding}/step_000002", fresh, fresh_opt)
        except ValueError as refused:
            out[sharding] = {"refused": str(refused)}
            continue
        before = _logprobs(fresh)
        _update(fresh, fresh_opt, 2)
        live = torch.load(f"{root}/{sharding}/logprobs_after_3.pt")
        out[sharding] = {"refused": None, "diff": float((_logprobs(fresh) - live).abs().max()),
                         "moved": float((live - before).abs().max())}
    return out


def _synthetic_step(models, optimizer, step: int) -> None:
    """One distributed-optimizer step on gradients made up per parameter (no forward: the same
    at every CP size), reduced over DP x CP by Megatron's DDP as a training step's are."""
    from megatron_dgpo.training.optimizer import step_if_finite

    optimizer.zero_grad()
    for model in models:
        model.zero_grad_buffer()
    for i, (_, param) in enumerate(sorted(models[0].module.named_parameters())):
        grid = torch.arange(param.numel(), dtype=torch.float64).view_as(param)
        param.main_grad.copy_(1e-2 * torch.sin(grid * (0.37 + 0.11 * i) + step))
    for model in models:
        model.finish_grad_sync()
    stepped, _ = step_if_finite(optimizer, models, 0.0)
    assert stepped


def _optimizer_state(optimizer) -> list:
    """This rank's shard of the distributed optimizer's state: (step, exp_avg, exp_avg_sq) per
    parameter shard, in the optimizer's order."""
    from megatron_dgpo.training.checkpoint import distributed_optimizers

    out = []
    for inner in distributed_optimizers(optimizer):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state[param]
                out.append((float(state["step"]), state["exp_avg"].clone(),
                            state["exp_avg_sq"].clone()))
    return out


def resume_across_context_parallel(rank, world, root) -> dict:
    """On 2 ranks, for each sharding type: saved at CP 2 (DP 1) then loaded at CP 1 (DP 2), and
    saved at CP 1 loaded at CP 2, after two synthetic steps. The loaded weights and this rank's
    optimizer shard equal the saved ones, and the next step equals the live run's."""
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_dgpo.training.checkpoint import TrainerState, load_checkpoint, save_checkpoint

    out = {}
    for sharding in SHARDINGS:
        for saved_cp, loaded_cp in ((2, 1), (1, 2)):
            folder = f"{root}/{sharding}_cp{saved_cp}"
            initialize_parallel(ParallelConfig(context_parallel=saved_cp), seed=1)
            models, optimizer = _setup(1, distributed=True, bucket_size=BUCKET)
            for step in range(2):
                _synthetic_step(models, optimizer, step)
            saved_params, saved_state = _params(models), _optimizer_state(optimizer)
            save_checkpoint(folder, TrainerState(step=2), models, optimizer,
                            padded_vocab_size=models[0].module.vocab_size,
                            optimizer_sharding=sharding, **META)
            _synthetic_step(models, optimizer, 2)
            live = _params(models)
            if rank == 0:  # for the resume on one rank
                torch.save({"saved": saved_params, "live": live}, f"{folder}/expected.pt")
            destroy_parallel()

            initialize_parallel(ParallelConfig(context_parallel=loaded_cp), seed=1)
            fresh, fresh_opt = _setup(1, distributed=True, seed=9, bucket_size=BUCKET)
            state = load_checkpoint(f"{folder}/step_000002", fresh, fresh_opt)
            loaded_state = _optimizer_state(fresh_opt)
            got = {"layout": state.extra["layout"],
                   "params_equal": _equal(saved_params, _params(fresh)),
                   "state_equal": len(saved_state) == len(loaded_state) and all(
                       a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])  # exact: a copy
                       for a, b in zip(saved_state, loaded_state)),
                   "moments": sum(float(s[1].abs().sum()) for s in saved_state)}
            _synthetic_step(fresh, fresh_opt, 2)
            got["next_step_equal"] = _equal(live, _params(fresh))
            destroy_parallel()
            out[f"{sharding}_cp{saved_cp}_to_cp{loaded_cp}"] = got
    return out


def resume_on_one_rank(rank, world, root) -> dict:
    """``resume_across_context_parallel``'s CP 2 checkpoints loaded on one rank (CP 1, DP 1:
    the optimizer's 2 shards become one): the weights exactly, the next step within rounding
    (the clipped gradient's norm sums the shards in another order)."""
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training.checkpoint import load_checkpoint

    initialize_parallel(ParallelConfig(), seed=1)
    out = {}
    for sharding in SHARDINGS:
        folder = f"{root}/{sharding}_cp2"
        expected = torch.load(f"{folder}/expected.pt")
        fresh, fresh_opt = _setup(1, distributed=True, seed=9, bucket_size=BUCKET)
        load_checkpoint(f"{folder}/step_000002", fresh, fresh_opt)
        got = {"params_equal": _equal(expected["saved"], _params(fresh))}
        _synthetic_step(fresh, fresh_opt, 2)
        got["next_step_diff"] = _max_diff(expected["live"], _params(fresh))
        got["moved"] = _max_diff(expected["live"], expected["saved"])
        out[sharding] = got
    return out
