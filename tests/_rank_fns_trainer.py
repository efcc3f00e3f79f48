"""Rank functions for tests/training/test_optimizer_checkpoint.py (TP=2 on two gloo ranks), and
the hub stand-in of tests/training/test_policy.py."""

from __future__ import annotations

import math

import torch

from tests._rank_fns_model import TINY_QWEN2
from tests._rank_fns_train import micro_batches

LR, WD, CLIP, BETAS, EPS = 5e-3, 0.1, 0.05, (0.9, 0.95), 1e-8


def _setup(seed: int = 5):
    from megatron.core import parallel_state

    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.training.policy import wrap_ddp
    from megatron_dgpo.recipe import OptimizerConfig
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training.optimizer import build_optimizer

    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel(ParallelConfig(tensor_parallel=2), seed=1)
    models = wrap_ddp(build_model(TINY_QWEN2, seed=seed))
    config = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, adam_beta1=BETAS[0],
                             adam_beta2=BETAS[1], adam_eps=EPS)
    return models, build_optimizer(config, models, lr=LR, bf16=False)


def _grads(models):
    from megatron_dgpo.algorithm.losses import LossConfig, LossHyperparams
    from megatron_dgpo.training.train_step import train_step

    loss = LossConfig(method="dgpo", loss=LossHyperparams())
    return train_step(models, micro_batches(0, 1, 2), loss)


def _params(models):
    return {n: p.detach().clone() for n, p in models[0].module.named_parameters()}


def _global_grad_norm(models) -> float:
    """sqrt(sum g^2) over the whole model: TP-split parameters summed over ranks, replicated
    ones (norms) counted once."""
    import torch.distributed as dist

    split, replicated = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    for p in models[0].module.parameters():
        sq = p.main_grad.double().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):
            split += sq
        else:
            replicated += sq
    dist.all_reduce(split)
    return math.sqrt(float(split) + float(replicated))


def _reference_adamw(param, grad, state, step, coefficient, decay):
    """torch.optim.AdamW's update, written out in float64."""
    g = grad.double() * coefficient
    p = param.double() * (1 - LR * (WD if decay else 0.0))
    state["m"] = BETAS[0] * state["m"] + (1 - BETAS[0]) * g
    state["v"] = BETAS[1] * state["v"] + (1 - BETAS[1]) * g * g
    m_hat = state["m"] / (1 - BETAS[0] ** step)
    v_hat = state["v"] / (1 - BETAS[1] ** step)
    return p - LR * m_hat / (v_hat.sqrt() + EPS)


def optimizer_and_skipping(rank, world, hub_root, hub_source):
    """Megatron's optimizer on CPU vs AdamW + global clip in float64; non-finite skipping;
    offloading; and, in the same launch, a hub id resolved on each "node"'s own HF cache
    (``hub_model_per_node``)."""
    from megatron_dgpo.training.optimizer import step_if_finite

    models, optimizer = _setup()
    out = {"errors": [], "norm_errors": []}
    state = {n: {"m": torch.zeros_like(p, dtype=torch.float64),
                 "v": torch.zeros_like(p, dtype=torch.float64)}
             for n, p in models[0].module.named_parameters()}
    for step in (1, 2):
        result = _grads(models)
        before = _params(models)
        grads = {n: p.main_grad.clone() for n, p in models[0].module.named_parameters()}
        norm = _global_grad_norm(models)
        coefficient = min(1.0, CLIP / (norm + 1e-6))
        stepped, grad_norm = step_if_finite(optimizer, models, result.loss)
        assert stepped
        out["norm_errors"].append(abs(grad_norm - norm) / norm)
        for name, param in models[0].module.named_parameters():
            decay = param.dim() > 1  # Megatron: no weight decay on biases and norms
            want = _reference_adamw(before[name], grads[name], state[name], step, coefficient, decay)
            out["errors"].append(float((param.detach().double() - want).abs().max()))
    out["clipped"] = coefficient < 1.0

    # A non-finite gradient on ONE rank: every rank skips, nothing changes.
    result = _grads(models)
    if rank == 1:
        next(models[0].module.parameters()).main_grad.view(-1)[3] = float("inf")
    before = _params(models)
    moments = [s["exp_avg"].clone() for s in _adam(optimizer).state.values()]
    out["inf_step"] = step_if_finite(optimizer, models, result.loss)[0]
    # exact: a skipped step leaves the weights untouched: compared with their copies
    out["inf_unchanged"] = all(torch.equal(before[n], p) for n, p in _params(models).items())
    # exact: and the moments, compared with their copies
    out["moments_unchanged"] = all(torch.equal(a, s["exp_avg"]) for a, s in
                                   zip(moments, _adam(optimizer).state.values()))
    # A NaN advantage makes the loss NaN: skipped too; then a clean step goes through.
    from megatron_dgpo.algorithm.losses import LossConfig, LossHyperparams
    from megatron_dgpo.training.train_step import train_step

    bad = micro_batches(0, 1, 2)
    bad[0].advantages[:] = float("nan")  # the whole row: the loss is NaN
    result = train_step(models, bad, LossConfig(loss=LossHyperparams()))
    out["nan_loss"] = result.loss
    out["nan_step"] = step_if_finite(optimizer, models, result.loss)[0]
    # exact: a skipped step leaves the weights untouched: compared with their copies
    out["nan_unchanged"] = all(torch.equal(before[n], p) for n, p in _params(models).items())
    out["clean_step"] = step_if_finite(optimizer, models, _grads(models).loss)[0]
    out["offload"] = _offload_round_trip()
    out["hub_model"] = hub_model_per_node(rank, hub_root, hub_source)
    return out


def _offload_round_trip() -> dict:
    """train.offload_training_state: after an update the gradient buffers and the Adam state
    are freed (their storages hold nothing) while the weights stay; they come back bit for bit
    (gradients zeroed) and the next update equals a twin's that never offloaded."""
    from megatron_dgpo.training.offload import TrainingStateOffload, optimizer_storages
    from megatron_dgpo.training.optimizer import step_if_finite

    (models, optimizer), (twin, twin_optimizer) = _setup(seed=5), _setup(seed=5)
    for m, o in ((models, optimizer), (twin, twin_optimizer)):
        step_if_finite(o, m, _grads(m).loss)
    state = [{k: v.clone() for k, v in s.items()} for s in _adam(optimizer).state.values()]
    weights = _params(models)
    offload = TrainingStateOffload(models, optimizer)
    storages = optimizer_storages(optimizer, models)
    out = {"storages": len(storages), "state_tensors": sum(len(s) for s in state)}
    offload.offload()
    out["freed"] = all(s.nbytes() == 0 for s in storages) and all(
        b.grad_data.untyped_storage().nbytes() == 0 for b in models[0].buffers)
    # exact: offloading keeps the weights in place: compared with their copies
    out["weights_kept"] = all(torch.equal(weights[n], p) for n, p in _params(models).items())
    with offload.resident():  # a checkpoint save in the middle of the offloaded phase
        # exact: the state made resident again is its own round trip through host memory
        out["resident_inside"] = all(torch.equal(a[k], b[k]) for a, b in
                                     zip(state, _adam(optimizer).state.values()) for k in a)
    out["offloaded_after"] = offload.offloaded and all(s.nbytes() == 0 for s in storages)
    host = list(offload._host)
    offload.restore()
    # exact: a round trip of the Adam state through host memory
    out["state_equal"] = all(torch.equal(a[k], b[k]) for a, b in
                             zip(state, _adam(optimizer).state.values()) for k in a)
    out["grads_zero"] = all(not p.main_grad.any() for p in models[0].module.parameters())
    offload.offload()
    out["host_reused"] = all(a is b for a, b in zip(host, offload._host))
    offload.restore()
    for m, o in ((models, optimizer), (twin, twin_optimizer)):
        step_if_finite(o, m, _grads(m).loss)
    # exact: the twin runs the same ops in the same order on the same (restored) state and data
    out["next_equal"] = all(torch.equal(a, b) for a, b in zip(_params(models).values(), _params(twin).values()))
    return out


class _HeldQueue:
    """Megatron's ``AsyncCallsQueue`` contract, executed in this process (the real queue forks
    a writer and all-reduces a CUDA tensor, so it needs a GPU): ``schedule_async_request``
    holds the request; a blocking finalise runs it with Megatron's own ``execute_sync`` (the
    write, a barrier, then the finalize fns: Megatron's metadata, then the publication)."""

    def __init__(self):
        self.requests = []

    def get_num_unfinalized_calls(self):
        return len(self.requests)

    def schedule_async_request(self, request):
        self.requests.append(request)

    def maybe_finalize_async_calls(self, blocking=False):
        while blocking and self.requests:
            self.requests.pop(0).execute_sync()

    def close(self):  # Megatron's stops the persistent writer process here
        self.closed_with_pending = len(self.requests)


def _extra_file(folder):
    """A file of this rank's added to the checkpoint (as the batch generated ahead is)."""
    (folder / "extra").mkdir(exist_ok=True)
    (folder / "extra" / f"rank{torch.distributed.get_rank()}.txt").write_text("ahead")


def checkpoint_round_trip(rank, world, root):
    """save (keep_last=1 prunes; the second save through the async path), load into a
    differently initialised model + optimizer, and the next update from both is identical."""
    import os

    from megatron_dgpo.training.checkpoint import (AsyncSaver, TrainerState, latest_checkpoint,
                                                   load_checkpoint, save_checkpoint)
    from megatron_dgpo.training.optimizer import step_if_finite

    models, optimizer = _setup(seed=5)
    meta = dict(hf_config=TINY_QWEN2, padded_vocab_size=models[0].module.vocab_size,
                dtype=torch.float32)
    saver = AsyncSaver(_HeldQueue())
    for step in (1, 2):
        step_if_finite(optimizer, models, _grads(models).loss)
        # a stale layout (as a run resumed from another layout carries): the save records its own
        save_checkpoint(root, TrainerState(step=step, prompts_consumed=32 * step,
                                           extra={"layout": {"tensor_parallel": 8,
                                                             "pipeline_parallel": 3},
                                                  "note": "kept"}),
                        models, optimizer, keep_last=1, saver=saver if step == 2 else None,
                        write_extra=_extra_file if step == 2 else None, **meta)
    # the async save is staged, not published: `latest` still names step 1, no shard written
    pending = {"pending": saver.pending,
               "latest": latest_checkpoint(root).name,
               "listing": sorted(os.listdir(root)),
               "staged_files": sorted(os.listdir(os.path.join(root, ".incomplete-step_000002")))}
    torch.distributed.barrier()
    saver.wait()
    pending["after_wait"] = saver.pending
    saver.close()
    pending["closed_with_pending"] = saver._queue.closed_with_pending
    saved = _params(models)
    drawn = torch.rand(4)  # the RNG state saved at this layout is restored on load
    step_if_finite(optimizer, models, _grads(models).loss)
    after_next = _params(models)

    fresh, fresh_optimizer = _setup(seed=9)
    # exact: must differ (another seed)
    differs_before = any(not torch.equal(saved[n], p) for n, p in _params(fresh).items())
    state = load_checkpoint(latest_checkpoint(root), fresh, fresh_optimizer)
    # exact: a round trip through the checkpoint
    loaded_equal = all(torch.equal(saved[n], p) for n, p in _params(fresh).items())
    # exact: the same generator state draws the same numbers with the same op
    rng_restored = torch.equal(torch.rand(4), drawn)
    step_if_finite(fresh_optimizer, fresh, _grads(fresh).loss)
    # exact: a resumed run replays the same kernels on the same state and data
    next_equal = all(torch.equal(after_next[n], p) for n, p in _params(fresh).items())
    return {"differs_before": differs_before, "loaded_equal": loaded_equal,
            "next_equal": next_equal, "step": state.step, "consumed": state.prompts_consumed,
            "rng_restored": rng_restored, "extra": state.extra, "async": pending,
            "ctrl_c": _ctrl_c_in_writer(root, fresh, fresh_optimizer, meta),
            "unpublished": _never_published(root, fresh, fresh_optimizer, meta)}


def _never_published(root, models, optimizer, meta) -> dict:
    """Two saves that must not be published: step 5 with a NaN in one parameter of rank 1 only
    (refused on both ranks before anything is written), and step 6 whose shard of rank 1 is
    damaged between its write and its publication (its read-back fails on both ranks). Each
    time ``latest`` and the checkpoints kept (``keep_last=1``) stay as they were."""
    import os

    from megatron_dgpo.training import checkpoint, integrity

    errors = {}
    param = next(models[0].module.parameters())
    kept = param.detach().clone()
    if torch.distributed.get_rank() == 1:
        with torch.no_grad():
            param.view(-1)[3] = float("nan")
    try:
        checkpoint.save_checkpoint(root, checkpoint.TrainerState(step=5), models, optimizer,
                                   keep_last=1, **meta)
    except checkpoint.NonFiniteState as exc:
        errors["non_finite"] = str(exc)
    with torch.no_grad():
        param.copy_(kept)
    record = integrity.record_common

    def damage_then_record(folder):
        with open(folder / "__1_0.distcp", "r+b") as handle:
            handle.seek(100)
            handle.write(b"\xff" * 64)
        record(folder)

    integrity.record_common = damage_then_record
    try:
        checkpoint.save_checkpoint(root, checkpoint.TrainerState(step=6), models, optimizer,
                                   keep_last=1, **meta)
    except RuntimeError as exc:
        errors["unverified"] = str(exc)
    finally:
        integrity.record_common = record
    torch.distributed.barrier()
    return {**errors, "latest": checkpoint.latest_checkpoint(root).name,
            "listing": sorted(os.listdir(root))}


def _ctrl_c_in_writer(root, models, optimizer, meta) -> dict:
    """Save step 3 after a first stop signal (SIGTERM: a request) with a SIGINT delivered inside
    Megatron's shard writer (megatron-core 0.19 writes with threads of this process, no longer
    in forked ones: ``FileSystemWriterAsync.write_preloaded_data``), as a Ctrl-C landing during
    the write is. Delivered once, by the first writer call of this save only."""
    import os
    import signal

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_dgpo.runtime.interrupt import stop_requests
    from megatron_dgpo.training.checkpoint import TrainerState, latest_checkpoint, save_checkpoint

    deliver = [True]
    write = FileSystemWriterAsync.write_preloaded_data

    def sigint_in_writer(*args, **kwargs):
        if deliver:
            deliver.clear()
            signal.raise_signal(signal.SIGINT)
        return write(*args, **kwargs)

    # Python's own handler, as in the trainer's process: an earlier test's in-process vLLM
    # engine core sets SIGINT to SIG_DFL when it shuts down, and these ranks inherit the
    # pytest process's handlers (seen in CI: the guard then stood aside)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    FileSystemWriterAsync.write_preloaded_data = staticmethod(sigint_in_writer)
    requested, interrupted = False, False
    try:
        with stop_requests() as stop:  # as around the trainer's loop
            signal.raise_signal(signal.SIGTERM)  # the first stop signal: only a request
            requested = stop.requested
            # the second lands in the writer
            save_checkpoint(root, TrainerState(step=3), models, optimizer, **meta)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(write)
    torch.distributed.barrier()  # both ranks are past the save before rank 0 lists the folder
    return {"interrupted": interrupted, "requested": requested, "delivered": not deliver,
            "latest": latest_checkpoint(root).name, "listing": sorted(os.listdir(root))}


def _adam(optimizer):
    """The torch AdamW inside Megatron's wrapper (one chain link for a dense model)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    assert len(inner) == 1
    return inner[0].optimizer


HUB_REPO = "stand-in/tiny-qwen2"


def stand_in_commit(repo_id: str, pushes: int) -> str:
    """The commit ``StandInHub``'s ``main`` names after ``pushes`` moves."""
    import hashlib

    return hashlib.sha1(f"{repo_id}@{pushes}".encode()).hexdigest()


class StandInHub:
    """``huggingface_hub.snapshot_download`` with the hub stood in, since there is no hub here:
    only the network fetch is replaced. A call that may fetch (``local_files_only`` false)
    copies the files of ``source`` (a tiny model folder) that match ``allow_patterns`` into
    the cache under huggingface_hub's layout (``models--org--name/blobs/<sha256>``,
    ``snapshots/<commit>/<file>`` linking to its blob, ``refs/main`` for a branch), with the
    commit written into config.json as ``stand_in_commit`` (the revision's own content).
    ``hub`` (a folder every rank sees) holds the repo's ``main``: each fetch of ``main`` moves it
    to a new commit afterwards, as a repo pushed to during start-up. ``unreachable``: a fetch
    raises ``ConnectionError``. Every call then answers with huggingface_hub's own
    ``snapshot_download(..., local_files_only=True)``: the look-up in the cache is the real one.
    The cache is ``cache_dir`` or huggingface_hub's ``HF_HUB_CACHE`` of this process (its
    node's ``HF_HOME``/hub)."""

    def __init__(self, hub, source, *, unreachable: bool = False):
        from pathlib import Path

        self.hub, self.source, self.unreachable = Path(hub), Path(source), unreachable

    def __call__(self, repo_id, *, revision=None, cache_dir=None, allow_patterns=None,
                 local_files_only=False, **kwargs):
        import hashlib
        import json
        import os
        from fnmatch import fnmatch
        from pathlib import Path

        import huggingface_hub
        from huggingface_hub import constants

        if not local_files_only:
            if self.unreachable:
                raise ConnectionError("the hub cannot be reached from this node")
            head = self.hub / "main"
            self.hub.mkdir(parents=True, exist_ok=True)
            count = int(head.read_text()) if head.exists() else 0
            commit = revision if revision not in (None, "main") else stand_in_commit(repo_id, count)
            repo = Path(cache_dir or constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
            snapshot = repo / "snapshots" / commit
            snapshot.mkdir(parents=True, exist_ok=True)
            (repo / "blobs").mkdir(exist_ok=True)
            for file in sorted(self.source.iterdir()):
                if allow_patterns and not any(fnmatch(file.name, p) for p in allow_patterns):
                    continue
                data = file.read_bytes()
                if file.name == "config.json":
                    data = json.dumps({**json.loads(data), "stand_in_commit": commit}).encode()
                blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
                blob.write_bytes(data)
                if not (snapshot / file.name).exists():
                    os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
            if revision in (None, "main"):
                (repo / "refs").mkdir(exist_ok=True)
                (repo / "refs" / "main").write_text(commit)
                head.write_text(str(count + 1))
        return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                                 allow_patterns=allow_patterns,
                                                 local_files_only=True, **kwargs)


def hub_model_per_node(rank, root, source) -> dict:
    """``policy.initial_model`` with a hub id on ranks that each play a node of their own: each
    its own ``LOCAL_RANK`` 0 and its own HF cache (``<root>/node<rank>``, what that node's
    ``HF_HOME`` gives huggingface_hub at import), the hub stood in by ``StandInHub``. Then again
    with fresh caches and a hub that rank 1's node cannot reach. Returns what each rank got."""
    import json
    import os
    from pathlib import Path

    from huggingface_hub import constants

    from megatron_dgpo.training.policy import ModelConfig, initial_model

    root, config = Path(root), ModelConfig(path=HUB_REPO)
    saved = os.environ.get("LOCAL_RANK"), constants.HF_HUB_CACHE, os.environ.get("HF_HUB_OFFLINE")
    out = {}
    try:
        os.environ["LOCAL_RANK"] = "0"
        # a node that reaches the hub (the test session's vLLM engines set HF_HUB_OFFLINE=1)
        os.environ.pop("HF_HUB_OFFLINE", None)
        constants.HF_HUB_CACHE = out["cache"] = str(root / f"node{rank}" / "hub")
        folder = initial_model(config, root / "run", seed=0,
                               download=StandInHub(root / "hub", source))
        out.update(folder=str(folder), files=sorted(os.listdir(folder)),
                   commit=json.loads((folder / "config.json").read_text())["stand_in_commit"])
        constants.HF_HUB_CACHE = str(root / f"cut_off_node{rank}" / "hub")
        try:
            initial_model(config, root / "run", seed=0,
                          download=StandInHub(root / "hub", source, unreachable=rank == 1))
        except RuntimeError as error:
            out["unreachable_error"] = str(error)
    finally:
        constants.HF_HUB_CACHE = saved[1]
        for key, value in (("LOCAL_RANK", saved[0]), ("HF_HUB_OFFLINE", saved[2])):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return out
