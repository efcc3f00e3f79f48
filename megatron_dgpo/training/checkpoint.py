"""Training checkpoints: Megatron distributed checkpoints of model, optimizer and RNG, written
atomically, plus the trainer's own state (step, data position).

Layout of ``<run_dir>/checkpoints``::

    step_000010/           a complete checkpoint (torch_dist files of every rank)
        trainer_state.json   step, prompts consumed, parallel layout, the run's config
        dgpo_convert.json    model metadata: ``megatron_to_hf`` / ``load_model`` read it
        checksums/           every file's size and CRC, recorded as written (``integrity``)
    latest                 the name of the newest complete checkpoint (one line)
    config_changes.jsonl   recipe changes accepted on a resume (``resume_config_changes``)
    .incomplete-step_000020/   a save in progress (or killed): never read, removed later
    .corrupt-step_000030/  a checkpoint that failed verification on a resume, moved aside

Atomicity: every rank writes into ``.incomplete-<name>``; after a barrier, rank 0 renames the
folder to ``<name>`` (one ``rename`` on one file system) and only then replaces ``latest``
(write a temporary file, fsync, ``os.replace``). A process killed at any point leaves ``latest``
naming a complete checkpoint. An async save (``AsyncSaver``) keeps that order: the rename
and ``latest`` run as the save's finalize step, after every rank's writer has finished. The model keys are those of ``convert.hf_to_megatron``, so a
training checkpoint is also a converter checkpoint: ``dgpo-convert megatron-to-hf`` exports it.

Integrity (``checkpoint.verify``). A step whose parameters or optimizer state are not finite is
not saved (the run stops, ``latest`` keeps the previous step). Before the rename the ranks read
the new checkpoint back against its checksums; one that fails is not published, so ``latest``
and retention (``keep_last``, which counts only published checkpoints) always keep a checkpoint
that verified and trained finitely. A resume verifies its checkpoint before loading; one that
fails is named, moved aside, and the next older one is tried (``checkpoint_to_resume``).

Another layout. Model and optimizer are resharded by dist_checkpointing, so a run saved at one
TP/PP layout resumes at another. The RNG states are per (PP, TP) rank (as in Megatron's
training loop: ``rng_state`` is a ShardedObject of global shape (PP, TP), replicated over DP),
because the model-parallel seeding differs per rank; they have no meaning at another layout.
``save_checkpoint`` therefore records the layout it saved at, read from Megatron's parallel
state at save time (``trainer_state.json``: ``extra.layout``, whoever built ``extra``), and
``load_checkpoint`` restores RNG only when that layout is the current one; otherwise it keeps
the RNG states as this run's seeded start-up (``initialize_parallel``) left them and logs a
warning (as Megatron does on a (TP, PP) mismatch). The next save records the new layout, so a
later resume at that layout restores RNG again.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import torch.distributed as dist

from megatron_dgpo.runtime import comm, parallel
from megatron_dgpo.runtime.config import Bounds, check_bounds, require_choice
from megatron_dgpo.runtime.errors import InputError
from megatron_dgpo.runtime.interrupt import children_keep_running, stop_requests
from megatron_dgpo.training import integrity

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
INCOMPLETE_PREFIX = ".incomplete-"
CORRUPT_PREFIX = ".corrupt-"
CHANGES_FILE = "config_changes.jsonl"
LAYOUT_KEY = "layout"

_log = logging.getLogger(__name__)


@dataclass
class CheckpointConfig:
    """Saving, resuming and the final HF export."""

    save_every: Annotated[int, Bounds(ge=0)] = 50
    """Save a checkpoint every this many steps (and after the last step). 0: only the last."""
    keep_last: Annotated[int, Bounds(ge=1)] = 2
    """Checkpoints kept on disk (older ones are deleted once a newer one is published, i.e.
    written finite and verified)."""
    export_hf: bool = True
    """Write the final policy as an HF folder (``<run_dir>/hf``) through the converter."""
    export_dtype: Literal["float32", "bfloat16"] | None = None
    """dtype of the HF export; None: the training dtype."""
    resume: Literal["auto", "never", "require"] = "auto"
    """Where a run starts: ``auto`` continues from the newest complete checkpoint in
    ``run_dir/checkpoints`` when there is one (a requeued, restarted or re-run job continues; the
    metrics lines past that checkpoint are replaced), else starts fresh; ``require`` fails
    without one; ``never`` starts fresh and fails if ``run_dir`` already holds a checkpoint."""
    async_save: bool = False
    """Write checkpoints in the background (Megatron's async torch_dist save): training
    continues while a persistent writer process per rank (started with the run) writes the
    shards; the checkpoint is renamed into place and named by ``latest`` only after every
    rank's writer has finished, so a crash still leaves the previous complete checkpoint."""
    optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    """How the distributed optimizer's state is laid out in a checkpoint (Megatron-LM's
    ``distrib_optim_sharding_type``; the plain optimizer has one format and ignores this).
    ``dp_reshardable`` (Megatron-LM's default): each rank writes its own buffer shards, no
    communication; the run resumes at another data-parallel size only. ``fully_reshardable``
    (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``): the state is gathered per
    parameter at save (more memory and time on data-parallel rank 0), and the run resumes at any
    TP / PP / DP layout. A resume reads the type the checkpoint was saved with."""
    verify: bool = True
    """Read every checkpoint back against the checksums recorded as it was written: after a
    save (before it is published: ``latest`` names only checkpoints that verified) and before
    a resume (a checkpoint that fails is named and moved aside to ``.corrupt-<name>``, and the
    run falls back to the newest one that verifies). Costs a read of the checkpoint per save and
    per resume, spread over the ranks (benchmarks/README.md). False: neither; checksums are
    still recorded."""
    allow_config_change: bool = False
    """Resume even when the recipe changes what the run means (``MEANING_KEYS``: the method,
    the loss, the seed, the data, the group size, the batch sizes) against the one the
    checkpoint was saved with. Every change accepted on a resume is printed and appended to
    ``checkpoints/config_changes.jsonl``."""

    def __post_init__(self):
        check_bounds(self)
        require_choice("resume", self.resume, RESUME_MODES)

    def saves_at(self, step: int, last_step: int) -> bool:
        """Whether a checkpoint is written after ``step``: every ``save_every`` steps and after
        ``last_step``."""
        return bool(self.save_every) and step % self.save_every == 0 or step == last_step


@dataclass
class TrainerState:
    """What the loop needs, beyond weights and optimizer, to continue exactly."""

    step: int = 0
    """The last completed RL step."""
    prompts_consumed: int = 0
    """Prompts drawn from the (seeded, per-epoch shuffled) prompt order so far."""
    skipped_updates: int = 0
    """Optimizer updates skipped for non-finite loss or gradients, in total."""
    extra: dict = field(default_factory=dict)
    """Free-form (the resolved config, the parallel layout), for humans and checks."""


def current_layout() -> dict:
    """This world's parallel layout as recorded in ``trainer_state.json`` (``extra.layout``)."""
    return {"tensor_parallel": parallel.tensor_parallel_size(),
            "pipeline_parallel": parallel.pipeline_parallel_size(),
            "context_parallel": parallel.context_parallel_size(),
            "data_parallel": parallel.data_parallel_size(),
            "expert_parallel": parallel.expert_parallel_size()}


def _rng_layout(layout: dict) -> tuple:
    """The part of a layout that shapes the saved RNG states: (PP, TP)."""
    return layout.get("pipeline_parallel"), layout.get("tensor_parallel")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which has no {STATE_FILE}: the "
                                f"checkpoint folder was removed or damaged by hand")
    return path


RESUME_MODES = ("auto", "never", "require")


def checkpoint_to_resume(root: str | os.PathLike, mode: str, verify: bool = True) -> Path | None:
    """Collective: the checkpoint a run starts from under ``checkpoint.resume`` = ``mode``:
    ``auto``, the newest one under ``root`` that verifies (``verify``; a requeued or restarted
    job continues), or None without any; ``require``, the same but a run without one is an
    error; ``never``, none, and a run directory that already holds one is an error (starting
    over would overwrite its metrics and checkpoints). A checkpoint that fails verification is
    named in one line and moved aside to ``.corrupt-<name>``; when every one fails, the run is
    refused. Raises ``InputError``."""
    require_choice("checkpoint.resume", mode, RESUME_MODES)
    root = Path(root)
    candidates = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    if mode == "never" and candidates:
        raise InputError(f"checkpoint.resume=never: {root} already holds {candidates[0].name}; "
                         f"use another run_dir, or checkpoint.resume=auto to continue that run")
    if mode == "require" and not candidates:
        raise InputError(f"checkpoint.resume=require: no complete checkpoint under {root}")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    failed = []
    for path in candidates:
        problems = verify_checkpoint(path) if verify else (
            [] if (path / STATE_FILE).is_file() else [f"lacks {STATE_FILE}"])
        if not problems:
            if failed and rank0:
                _replace_text(root / LATEST_FILE, path.name + "\n")
                _log_line(f"falling back to {path.name}, the newest checkpoint that verifies")
            return path
        failed.append(f"{path.name}: {_one_line(problems)}")
        if rank0:
            _log_line(f"checkpoint {path} fails verification: {_one_line(problems)}; moved "
                      f"aside to {CORRUPT_PREFIX}{path.name}")
            os.replace(path, root / f"{CORRUPT_PREFIX}{path.name}")
        comm.barrier()
    if failed:
        raise InputError(f"no checkpoint under {root} verifies ({'; '.join(failed)}): start over "
                         f"in another run_dir, or set checkpoint.verify=false to load one anyway")
    return None


def resume_point(root: Path, config: CheckpointConfig, recipe: dict) -> Path | None:
    """Collective: the checkpoint a run continues from (``checkpoint_to_resume``), announced in
    one line, with the recipe ``recipe`` (``config.to_dict``) checked against the one it was
    saved with (``resume_config_changes``). Raises ``InputError``."""
    path = checkpoint_to_resume(root, config.resume, verify=config.verify)
    if path is None:
        return None
    saved = json.loads((path / STATE_FILE).read_text())
    rank0 = dist.get_rank() == 0
    if rank0:
        _log_line(f"resuming from step {saved['step']} ({path})")
    resume_config_changes(path, saved.get("extra", {}).get("config", {}), recipe,
                          allowed=config.allow_config_change, record=rank0)
    return path


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Collective (when torch.distributed is initialized): what is wrong with checkpoint
    ``path`` (``integrity.verify``), each rank reading back its share of the files; every rank
    gets the same list (empty: it verifies)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found = comm.gather_objects(integrity.verify(path, rank, world))
    return list(dict.fromkeys(problem for problems in found for problem in problems))


def _one_line(problems: list[str]) -> str:
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def _log_line(message: str) -> None:
    print(f"[megatron-dgpo] {message}", file=sys.stderr, flush=True)


MEANING_KEYS = ("algorithm", "data", "train.seed", "rollout.group_size",
                "train.rollout_batch_prompts", "train.mini_batch_prompts",
                "sft.data", "sft.seed", "sft.batch_samples")
"""Recipe keys (and sections) whose change on a resume changes what the run is: refused unless
``checkpoint.allow_config_change``."""


def config_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """The recipe keys whose value differs between ``saved`` and ``current`` (nested dicts, as
    ``config.to_dict`` gives), as dotted key -> (saved, current); a key absent on one side is
    None there."""
    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    old, new = flat(saved), flat(current)
    return {key: (old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)}


def resume_config_changes(checkpoint: Path, saved: dict, current: dict, *,
                          allowed: bool, record: bool) -> dict[str, tuple]:
    """The recipe changes of a resume from ``checkpoint`` (``config_changes``): printed (on the
    ``record`` rank), refused with ``InputError`` when one changes ``MEANING_KEYS`` and not
    ``allowed``, else appended to ``checkpoints/config_changes.jsonl`` (``record``)."""
    changes = config_changes(saved, current)
    if not changes:
        return changes
    listed = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items())
    meaning = [key for key in changes if any(key == k or key.startswith(k + ".")
                                             for k in MEANING_KEYS)]
    if meaning and not allowed:
        raise InputError(f"resuming {checkpoint} would change what the run means ("
                         + ", ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in meaning)
                         + "): use another run_dir, or set checkpoint.allow_config_change=true")
    if record:
        _log_line(f"the recipe differs from the one {checkpoint.name} was saved with: {listed}")
        line = {"resumed_from": checkpoint.name, "time": time.time(),
                "changes": {key: list(pair) for key, pair in changes.items()}}
        with open(checkpoint.parent / CHANGES_FILE, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line, default=str) + "\n")
    return changes


OPTIMIZER_SHARDING_KEY = "distrib_optim_sharding_type"  # Megatron-LM's metadata key
FULLY_RESHARDABLE = "fully_reshardable"


def distributed_optimizers(optimizer) -> list:
    """The ``DistributedOptimizer`` instances inside ``optimizer`` (through a ChainedOptimizer)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [inner for inner in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(inner, DistributedOptimizer)]


def _describable(optimizer) -> None:
    """Megatron's distributed optimizer over torch's Adam (no apex nor Transformer-Engine
    installed) reads Adam's ``step`` from torch's per-parameter state to describe itself
    (``DistributedOptimizer.state_dict``: ``assert len(steps) == 1``), and that state is empty
    until the first update: a resumed run's fresh optimizer could not be loaded into, nor one
    whose updates were all skipped be saved. Allocate the state the way Megatron's own
    ``load_state_dict`` does, at step 0 (a load then overwrites every value)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:  # fused Adam keeps its step in the param groups
        return
    for inner in distributed_optimizers(optimizer):
        if len(inner.optimizer.state) == 0:
            groups = [{**{k: v for k, v in group.items() if k != "params"}, "step": 0}
                      for group in inner.optimizer.state_dict()["param_groups"]]
            inner.load_state_dict({"optimizer": {"param_groups": groups}})


@contextmanager
def _adam_step_kept_by_bucket_loaders():
    """Megatron's distributed-optimizer loaders copy every key of torch Adam's per-parameter
    state from the loaded tensors, which hold ``step`` in the ``dp_reshardable`` format and not
    in ``fully_reshardable`` (``KeyError: 'step'``, without apex or TE only: fused Adam keeps
    no per-parameter step). Inside this block a missing ``step`` is left as it is;
    ``_restore_adam_steps`` then sets it from the param groups."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group_index]["params"][group_order]
            if "step" in self.optimizer.state[main]:
                tensors = {**tensors, "step": self.optimizer.state[main]["step"]}
        return original(self, model_param, tensors)

    if distrib_optimizer.HAVE_APEX_OR_TE:
        yield
        return
    cls._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        cls._set_main_param_and_optimizer_states = original


def _restore_adam_steps(optimizer) -> None:
    """After a load, torch Adam's per-parameter ``step`` of a distributed optimizer without apex
    or TE (see ``_describable``) is the checkpoint's, held by the param groups: Megatron's
    ``load_state_dict`` puts it there and in one tensor shared by every parameter, then its
    bucket loader copies over it the step the state had before loading (``_describable``'s 0).
    Each parameter gets its own tensor (Adam increments them in place)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in distributed_optimizers(optimizer):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                inner.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))


def _sharded_state_dict(models: list, optimizer, *, is_loading: bool,
                        optimizer_sharding: str) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_dgpo.convert import model_sharded_state_dict
    from megatron_dgpo.models.builder import unwrap_model

    model_sd = model_sharded_state_dict([unwrap_model(m) for m in models])
    state = dict(model_sd)
    # The sharding type always explicit, as Megatron-LM's training passes it: Megatron's default
    # (the deprecated fully_sharded_model_space) raises "flattened_range is not supported".
    _describable(optimizer)
    state["optimizer"] = optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata={OPTIMIZER_SHARDING_KEY: optimizer_sharding})
    # One RNG state per (PP, TP) rank, replicated over DP x CP (as Megatron's training loop does).
    rng = {"python": random.getstate(), "numpy": np.random.get_state(),
           "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    state["rng_state"] = ShardedObject(
        "rng_state", rng,
        (parallel.pipeline_parallel_size(), parallel.tensor_parallel_size()),
        (parallel.pipeline_parallel_rank(), parallel.tensor_parallel_rank()),
        replica_id=parallel.data_parallel_rank(with_context_parallel=True))
    return state


class AsyncSaver:
    """Checkpoints written in the background: Megatron's async ``torch_dist`` save.

    ``save_checkpoint(..., saver=saver)`` returns once the state is staged on the host; one
    persistent writer process per rank (Megatron's ``PersistentAsyncCaller``, spawned at the
    first save and kept) writes the files while training goes on, so the trainer process,
    which hosts vLLM and NCCL threads, is never forked for a save. The checkpoint
    is published (renamed from ``.incomplete-<name>``, then ``latest`` replaced) by a
    finalize function that Megatron runs only after the write has finished on every rank,
    from ``poll`` (call it once per step; non-blocking) or ``wait`` (blocking). So the
    "never half-written" guarantee is the synchronous save's: until then ``latest`` names the
    previous checkpoint. One save is in flight at a time (a new save waits for the previous
    one, whose clean-up would otherwise remove the new staging folder). Call ``wait`` before
    reading a checkpoint just saved (the final HF export) and before exiting.

    ``queue`` is Megatron's ``AsyncCallsQueue(persistent=True)`` (default; on CPU through
    ``megatron_dgpo.runtime.cpu`` patch 13). Collective: the writer is started here, by an empty write
    that the first ``poll`` publishes, so that the first save does not wait for a process
    to start (spawning one and importing torch there took 9.9 s of the first save on a GPU
    node). ``close`` (after ``wait``) stops the writer.
    """

    def __init__(self, queue=None):
        if queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import (AsyncCallsQueue,
                                                                                 AsyncRequest)

            from megatron_dgpo.runtime.cpu import apply_cpu_compat

            apply_cpu_compat()
            queue = AsyncCallsQueue(persistent=True)
            with children_keep_running():  # the writer outlives SLURM's stop signals
                queue.schedule_async_request(AsyncRequest(_write_nothing, (), []))
        self._queue = queue

    @property
    def pending(self) -> int:
        """Writes scheduled and not yet published (the empty write that starts the writer
        counts until a poll publishes it)."""
        return self._queue.get_num_unfinalized_calls()

    def schedule(self, request) -> None:
        """Collective: start writing ``request`` (an ``AsyncRequest`` with its finalize fns).

        A rank with nothing to write (every tensor it holds is another rank's replica: DP > 1
        with the plain optimizer, or ``fully_reshardable``) gets a request without a write
        function, which Megatron's persistent caller does not queue, and then waits forever
        for its completion: the writer is given an empty write instead."""
        self.wait()
        if request.async_fn is None:
            request = request._replace(async_fn=_write_nothing)
        self._queue.schedule_async_request(request)

    def poll(self) -> None:
        """Collective: publish the saves that have finished on every rank (non-blocking)."""
        self._queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Collective: block until every scheduled save is written and published."""
        self._queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        """Collective: publish what is pending, then stop the writer process."""
        self.wait()
        self._queue.close()
        self._closed = True

    def abort(self) -> None:
        """Not collective: stop the writer process now, publishing nothing (a run ending on an
        exception). Without it the process would hang at exit joining a writer that ignores
        stop signals. A no-op after ``close``."""
        if not getattr(self, "_closed", False):
            self._queue.close(abort=True)
            self._closed = True


def _write_nothing(*args, **kwargs) -> None:
    """An empty write, run by ``AsyncSaver``'s writer process: the one that starts it, and a
    rank's share of a checkpoint that holds nothing of that rank's."""


def save_checkpoint(root: str | os.PathLike, state: TrainerState, models: list, optimizer, *,
                    hf_config: dict, padded_vocab_size: int, dtype: torch.dtype,
                    hf_dir: str | None = None, keep_last: int = 2,
                    saver: AsyncSaver | None = None, write_extra=None,
                    optimizer_sharding: str = "dp_reshardable", verify: bool = True) -> Path:
    """Collective: write checkpoint ``step_<state.step>`` atomically; returns its path.

    ``state`` is written to ``trainer_state.json`` with ``extra.layout`` set to the current
    layout (``current_layout``), whatever ``state.extra`` held (e.g. a resumed run's old layout).

    ``hf_config`` / ``padded_vocab_size`` / ``dtype`` / ``hf_dir`` (tokenizer files) make the
    checkpoint exportable to HF. Older complete checkpoints beyond ``keep_last`` and leftover
    incomplete ones are removed after the new one is in place.

    With ``saver`` (``checkpoint.async_save``) the shards are written in the background and the
    returned path exists only once the saver has published it (``AsyncSaver``).

    ``write_extra(folder)``, called on every rank, adds files to the staged checkpoint before it
    is published (the batch a one-step-off run generated ahead,
    ``rollout.ahead.save_ahead``); they are checksummed with the rest.

    ``optimizer_sharding`` (``checkpoint.optimizer_sharding``): the distributed optimizer's
    format, recorded in the checkpoint's content metadata, where ``load_checkpoint`` reads it.

    Raises ``NonFiniteState`` (nothing written) when a parameter or optimizer state of any rank
    is not finite; with ``verify``, a checkpoint that does not read back as recorded is not
    published (``RuntimeError``).
    """
    from megatron.core import dist_checkpointing

    from megatron_dgpo.convert import write_metadata
    from megatron_dgpo.training.optimizer import sync_params

    if saver is not None:
        saver.wait()  # one save in flight: the previous one is published before this starts
    sync_params(models)  # overlapped param gather: the weights of the last step, not the one before
    _require_finite(state.step, models, optimizer)
    root = Path(root)
    name = checkpoint_name(state.step)
    staging = root / f"{INCOMPLETE_PREFIX}{name}"
    rank0 = dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()  # empty: Megatron warns of "overwriting" a folder that is not
    comm.barrier()
    _quiet_mcore_async_notice()
    integrity.install_writer_hook()
    publish = partial(_publish, root, name, keep_last, verify)
    # A first stop signal lets the save finish; a second one raises (megatron-core 0.19 writes
    # with threads of this process; an exception dropped in a fork hook is raised again at the
    # block's end), before anything is published
    with stop_requests():
        with children_keep_running():  # the writers' result queue's manager process
            distributed = bool(distributed_optimizers(optimizer))
            # always a request, run here (sync) or by the saver, so that its write is recorded
            request = dist_checkpointing.save(
                _sharded_state_dict(models, optimizer, is_loading=False,
                                    optimizer_sharding=optimizer_sharding),
                str(staging), async_sharded_save=True,
                content_metadata={OPTIMIZER_SHARDING_KEY: optimizer_sharding if distributed else None},
                # Megatron-Core's own writer, for AsyncSaver's queue (0.19 defaults to
                # nvidia-resiliency-ext's, whose requests that queue cannot run)
                async_strategy="mcore")
        if request.async_fn is not None:
            request = request._replace(async_fn=partial(
                integrity.record_writes, request.async_fn,
                str(integrity.shard_manifest(staging, dist.get_rank()))))
        record = {**state.__dict__, "extra": {**state.extra, LAYOUT_KEY: current_layout()}}
        if rank0:
            write_metadata(str(staging), hf_config, padded_vocab_size, dtype, hf_dir=hf_dir)
            _write_json(staging / STATE_FILE, record)
        if write_extra is not None:
            write_extra(staging)
        request.add_finalize_fn(publish)  # runs after Megatron's own finalisation (metadata)
        if saver is not None:
            with children_keep_running():  # the writer worker outlives SLURM's stop signals
                saver.schedule(request)
        else:
            request.execute_sync()
    return root / name


class NonFiniteState(RuntimeError):
    """A parameter or optimizer state is NaN or infinite: the step is not saved."""


def _require_finite(step: int, models: list, optimizer) -> None:
    """Collective: raise ``NonFiniteState`` on every rank when any rank holds a non-finite
    parameter or optimizer state (one sum per tensor: NaN and inf survive a sum)."""
    from megatron_dgpo.models.builder import unwrap_model

    named = [(f"parameter {n}", p) for chunk in models
             for n, p in unwrap_model(chunk).named_parameters()]
    for index, inner in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        named += [(f"optimizer {index} main parameter", p)
                  for group in torch_optimizer.param_groups for p in group["params"]]
        named += [(f"optimizer {index} state {key!r}", value)
                  for per_param in torch_optimizer.state.values() for key, value in per_param.items()
                  if torch.is_tensor(value) and value.is_floating_point() and value.numel()]
    sums = torch.stack([t.detach().sum().float() for _, t in named]) if named else torch.zeros(0)
    bad = (~torch.isfinite(sums)).nonzero()
    mine = f"rank {dist.get_rank()}: {named[int(bad[0])][0]}" if len(bad) else None
    found = [m for m in comm.gather_objects(mine) if m is not None]
    if found:
        raise NonFiniteState(f"step {step}: {found[0]} is not finite: not saved, the last "
                             f"checkpoint stays the one to resume from")


def _quiet_mcore_async_notice() -> None:
    """Megatron-Core's deprecation notice of its own async writer, logged once per process: the
    project uses that writer on purpose (docs/training.md, "Checkpoints")."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    torch_strategy._logged_mcore_async_deprecation = True


def _publish(root: Path, name: str, keep_last: int, verify: bool = True) -> None:
    """Collective: the staged checkpoint ``name`` becomes complete: checksums of the files no
    writer recorded, read back (``verify``), rename, then ``latest``."""
    staging, final = root / f"{INCOMPLETE_PREFIX}{name}", root / name
    rank0 = dist.get_rank() == 0
    comm.barrier()  # every rank's shards are written
    if rank0:
        integrity.record_common(staging)
    comm.barrier()
    problems = verify_checkpoint(staging) if verify else []
    if problems:
        raise RuntimeError(f"{staging} does not read back as written: {_one_line(problems)}; "
                           f"not published, {LATEST_FILE} stays the previous checkpoint")
    if rank0:
        _fsync_dir(staging)
        if final.exists():  # a step saved twice (e.g. re-run after a crash past the pointer)
            shutil.rmtree(final)
        os.rename(staging, final)
        _replace_text(root / LATEST_FILE, name + "\n")
        _prune(root, keep=max(1, keep_last), newest=name)
    comm.barrier()


def load_checkpoint(path: str | os.PathLike, models: list, optimizer) -> TrainerState:
    """Collective: load weights, optimizer state and (same layout only) RNG from ``path``.

    The parallel layout may differ from the saving run's (dist_checkpointing reshards model
    and optimizer); RNG states are restored only when TP and PP match the recorded layout,
    otherwise the current (freshly seeded) ones are kept and a warning is logged. The returned
    state's ``extra.layout`` is the current layout.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {STATE_FILE})")
    saved = json.loads((path / STATE_FILE).read_text())
    layout, now = saved.get("extra", {}).get(LAYOUT_KEY, {}), current_layout()
    same_layout = _rng_layout(layout) == _rng_layout(now)
    sharding = _saved_optimizer_sharding(path, optimizer, layout, now)
    sharded = _sharded_state_dict(models, optimizer, is_loading=True, optimizer_sharding=sharding)
    if not same_layout:
        sharded.pop("rng_state")
        if dist.get_rank() == 0:
            _log.warning("%s was saved at TP=%s PP=%s, resuming at TP=%s PP=%s: model and "
                         "optimizer are resharded; the RNG states are not restored (they are per "
                         "TP/PP rank): they stay as this run's seeded start-up left them", path,
                         layout.get("tensor_parallel"), layout.get("pipeline_parallel"),
                         now["tensor_parallel"], now["pipeline_parallel"])
    loaded = dist_checkpointing.load(sharded, str(path))
    loaded.pop("content_metadata", None)  # the save's metadata, read above
    from megatron_dgpo.models.builder import unwrap_model

    chunks = [unwrap_model(m) for m in models]
    if len(chunks) == 1:
        chunks[0].load_state_dict({k: v for k, v in loaded.items()
                                   if k not in ("optimizer", "rng_state")}, strict=True)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{i}"], strict=True)
    # float32 weights: the distributed optimizer's shards are views of the parameters, written
    # in place
    with torch.no_grad(), _adam_step_kept_by_bucket_loaders():
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer)
    if same_layout:
        rng = loaded["rng_state"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    saved["extra"] = {**saved.get("extra", {}), LAYOUT_KEY: now}
    return TrainerState(**saved)


def _saved_optimizer_sharding(path: Path, optimizer, saved_layout: dict, layout: dict) -> str:
    """The distributed-optimizer format ``path`` was saved in, checked against this run: the
    same kind of optimizer, and for ``dp_reshardable`` the same model-parallel layout."""
    from megatron.core import dist_checkpointing

    saved = (dist_checkpointing.load_content_metadata(str(path)) or {}).get(OPTIMIZER_SHARDING_KEY)
    distributed = bool(distributed_optimizers(optimizer))
    if distributed != (saved is not None):
        kinds = {True: "the distributed optimizer", False: "the plain (non-distributed) optimizer"}
        raise ValueError(f"{path} was saved by {kinds[saved is not None]}; this run uses "
                         f"{kinds[distributed]}: set optimizer.use_distributed_optimizer="
                         f"{str(saved is not None).lower()} to resume it")
    if saved is None:
        return "dp_reshardable"  # unused by the plain optimizer
    # not context_parallel: CP ranks hold whole parameters and the optimizer shards over DP x CP,
    # so a CP change is a DP change to both sharding types (tests/training/test_distributed_optimizer.py)
    model_parallel = ("tensor_parallel", "pipeline_parallel", "expert_parallel")
    moved = [k for k in model_parallel if saved_layout.get(k, 1) != layout.get(k, 1)]
    if saved != FULLY_RESHARDABLE and moved:
        raise ValueError(
            f"{path}: its distributed-optimizer state was saved as {saved!r}, which reshards "
            f"across data parallelism only, and {', '.join(moved)} changed ("
            + ", ".join(f"{k} {saved_layout.get(k, 1)} -> {layout.get(k, 1)}" for k in moved)
            + "): resume at the saved layout, or save with checkpoint.optimizer_sharding="
              "fully_reshardable to change it")
    return saved


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True, default=str)
        handle.flush()
        os.fsync(handle.fileno())


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int, newest: str) -> None:
    complete = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in complete[:-keep]:
        if old.name != newest:
            shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(f"{INCOMPLETE_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def export_latest(run_dir: str | os.PathLike, dtype_name: str | None = None) -> None:
    """The newest complete checkpoint of a run (``<run_dir>/checkpoints``) as the HF folder
    ``<run_dir>/hf`` (rank 0 only; ``dtype_name`` None keeps the training dtype): the final
    policy of the trainer and of ``megatron_dgpo.sft``."""
    from megatron_dgpo.training.policy import dtype_named

    run_dir = Path(run_dir)
    export_hf(latest_checkpoint(run_dir / "checkpoints"), run_dir / "hf",
              dtype_named(dtype_name) if dtype_name else None)


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
              dtype: torch.dtype | None = None) -> None:
    """A checkpoint's model as an HF folder ``out_dir``, replaced whole (the converter's
    guarded writer; rank 0 only; ``dtype`` None keeps the checkpoint's)."""
    from megatron_dgpo.convert import megatron_to_hf

    megatron_to_hf(str(checkpoint), str(out_dir), dtype=dtype, overwrite=True)
