"""What a conversion checks before any work, and how its output appears: whole or not at all.

``check_layout``: the parallel sizes against the model. ``check_output``: the output folder is
new or empty (or ``overwrite``), is not the input, and is no training run's checkpoint. The
output is written into ``staging_dir(out)``, a hidden sibling, and ``publish`` renames it in
(the old folder moved aside first, then removed), so no stale file survives beside new ones and a
failed conversion leaves the output as it was (``discard`` removes the staging folder).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from megatron_dgpo.models import describe
from megatron_dgpo.runtime.errors import InputError

RUN_STATE_FILE = "trainer_state.json"
RUN_LATEST_FILE = "latest"
RUN_INCOMPLETE_PREFIX = ".incomplete-"
"""A training run's checkpoint markers (``training.checkpoint``'s ``STATE_FILE``, ``LATEST_FILE``,
``INCOMPLETE_PREFIX``; a test holds them equal)."""
_STEP = re.compile(r"step_\d+")


def described(hf_config, where: str, **kwargs):
    """``models.describe(hf_config, **kwargs)``; a config the builder refuses is an
    ``InputError`` naming ``where`` (the file it came from)."""
    try:
        return describe(hf_config, **kwargs)
    except InputError:
        raise
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from exc


def _or(values: list[int]) -> str:
    return ", ".join(map(str, values[:-1])) + (" or " if len(values) > 1 else "") + str(values[-1])


def _divisors(n: int) -> str:
    return _or([d for d in range(1, n + 1) if n % d == 0])


def check_layout(dims, *, tp: int, pp: int, ep: int, world: int | None = None) -> int:
    """The ranks a conversion of a model of ``dims`` (``models.ModelDims``) at (tp, pp, ep) runs
    on, max(tp, ep) x pp. ``InputError`` naming the flag and the values that work when
    Megatron-Core cannot lay the model out so (TP splits heads and MLP widths, and splits or
    replicates KV groups; PP splits layers, EP experts; TP and EP divide one another), or when
    ``world`` (a torchrun world) is no multiple of it. The vocabulary is padded to a multiple of
    128 x TP: any TP fits it."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{flag} {value!r}: a parallel size is a whole number >= 1")
    split_by_tp = [(dims.heads, "attention heads"), (dims.ffn, "MLP width")]
    if dims.moe and ep == 1:  # with EP > 1 the converter keeps each expert whole (ETP 1)
        split_by_tp.append((dims.moe_ffn, "expert MLP width"))
    fits = [t for t in range(1, dims.heads + 1)  # KV groups split, or replicated per TP rank
            if all(n % t == 0 for n, _ in split_by_tp) and (dims.kv_heads % t == 0
                                                            or t % dims.kv_heads == 0)]
    if tp not in fits:
        count, what = next(((n, w) for n, w in split_by_tp if n % tp), (
            dims.kv_heads, "KV groups (TP must divide them or be a multiple of them)"))
        raise InputError(f"--tp {tp} does not divide the model's {count} {what}: use --tp "
                         f"{_or(fits)}")
    if dims.layers % pp:
        raise InputError(f"--pp {pp} does not divide the model's {dims.layers} layers: use --pp "
                         f"{_divisors(dims.layers)}")
    if ep > 1 and not dims.moe:
        raise InputError(f"--ep {ep}: the model has no routed experts: leave --ep at 1")
    if dims.moe and dims.experts % ep:
        raise InputError(f"--ep {ep} does not divide the model's {dims.experts} experts: use "
                         f"--ep {_divisors(dims.experts)}")
    if max(tp, ep) % min(tp, ep):
        raise InputError(f"--tp {tp} and --ep {ep} must divide one another (each pipeline stage "
                         f"converts on max(tp, ep) ranks)")
    ranks = max(tp, ep) * pp
    if world is not None and world % ranks:
        raise InputError(f"a world of {world} ranks is no multiple of max(--tp, --ep) x --pp = "
                         f"{ranks}: start it with torchrun --nproc-per-node {ranks}, or without "
                         f"torchrun (dgpo-convert then starts the {ranks} ranks itself)")
    return ranks


def _is_training_checkpoint(folder: Path) -> bool:
    """A training checkpoint (a folder with its trainer state) or a run's checkpoints folder
    (``latest`` naming a step, or a save in flight: ``.incomplete-step_*``), whatever its name."""
    if (folder / RUN_STATE_FILE).is_file():
        return True
    latest = folder / RUN_LATEST_FILE
    try:
        if latest.is_file() and latest.stat().st_size < 256 and _STEP.fullmatch(
                latest.read_text(errors="replace").strip()):
            return True
        return any(name.startswith(RUN_INCOMPLETE_PREFIX + "step_") for name in os.listdir(folder))
    except OSError:
        return False


def _subfolders(folder: Path) -> list[Path]:
    try:
        return [Path(entry.path) for entry in os.scandir(folder)
                if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def training_checkpoint_near(path: Path) -> Path | None:
    """The training checkpoint or run ``checkpoints`` folder that ``path`` is, lies inside, or
    holds (two levels down at most: a run folder, a folder of runs); None if none."""
    for folder in (path, *path.parents):
        if _is_training_checkpoint(folder):
            return folder
    for child in _subfolders(path):
        for folder in (child, *_subfolders(child)):
            if _is_training_checkpoint(folder):
                return folder
    return None


def check_output(out_dir: str, *, overwrite: bool, inputs: tuple[str, ...] = ()) -> Path:
    """The real path of the output folder ``out_dir``, after refusing (``InputError``) a folder
    that is, lies inside or holds a training run's checkpoints (``--overwrite`` or not), one
    that is or holds an input, a file, and a non-empty folder unless ``overwrite``."""
    out = Path(os.path.realpath(out_dir))
    run = training_checkpoint_near(out)
    if run is not None:
        where = "is inside" if run == out or run in out.parents else "holds"
        raise InputError(f"{out_dir} {where} a training run's checkpoints ({run}): a conversion "
                         f"never writes there, --overwrite or not; name a folder outside the run")
    for source in inputs:
        real = Path(os.path.realpath(source))
        if out == real or out in real.parents:
            raise InputError(f"{out_dir} {'is' if out == real else 'holds'} the input {source}: "
                             f"name another output folder")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out_dir} is a file: the output is a folder")
    existing = next(folder for folder in out.parents if folder.exists())
    if not os.access(existing, os.W_OK):
        raise InputError(f"{out_dir}: {existing} is not writable (the output is written there "
                         f"first, as .{out.name}.incomplete, then renamed): name a folder in a "
                         f"writable one")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise InputError(f"{out_dir} is not empty: pass --overwrite to replace it whole "
                         f"(everything in it is removed), or name a new or empty folder")
    return out


def staging_dir(out: Path) -> Path:
    """The hidden sibling a conversion into ``out`` (a real path) writes first."""
    return out.with_name(f".{out.name}.incomplete")


def fresh_staging(out: Path) -> Path:
    """``staging_dir(out)``, emptied (a killed conversion's leftovers removed) and created."""
    staging = staging_dir(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, out: Path) -> None:
    """``staging`` becomes ``out``: the old ``out`` is renamed aside, ``staging`` renamed in,
    then the old folder removed (renames within one folder: one file system)."""
    old = out.with_name(f".{out.name}.replaced")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def discard(staging: Path) -> None:
    """Remove a failed conversion's staging folder."""
    shutil.rmtree(staging, ignore_errors=True)
