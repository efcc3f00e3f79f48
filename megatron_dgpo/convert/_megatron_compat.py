"""The one adapter to the private torch.distributed.checkpoint (DCP) and Megatron-Core APIs the
converter relies on; nothing else in ``megatron_dgpo.convert`` imports them.

Tested with torch 2.13 and megatron-core 0.19 (``TESTED``; 0.16 before, with the same APIs). On first use the installed versions
are compared with these: an untested version gives one ``UserWarning`` (the APIs below may still
be there); a missing API raises ``IncompatibleDependency`` naming the package, its installed
version and the API, before anything is read or written.

Private or internal pieces used (and why):
    megatron.core.dist_checkpointing.strategies.torch: ``MCoreSavePlanner``,
        ``TorchDistSaveShardedStrategy``, ``_replace_state_dict_keys_with_sharded_keys``,
        ``mcore_to_pyt_state_dict``: a torch_dist save whose tensor data are produced on demand
    ``ShardedTensor`` fields ``local_shape``, ``global_shape``, ``global_offset``,
        ``axis_fragmentations``, ``prepend_axis_num``, ``flattened_range``, ``key``: store a big
        tensor as several row chunks, its vocabulary rows unpadded, under another key
    torch.distributed.checkpoint.planner_helpers ``_create_read_items`` and the
        ``__create_chunk_list__`` / ``__get_tensor_shard__`` tensor protocol: read one box of a
        stored tensor without materialising the rest
    ``FileSystemWriter(thread_count=1, per_thread_copy_ahead=0)`` and ``SavePlanner.resolve_data``
        call order: one chunk in memory at a time
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import warnings

import torch

TESTED = {"torch": ("2.13",), "megatron-core": ("0.19",)}
"""Package -> major.minor versions the converter's tests ran with."""


class IncompatibleDependency(RuntimeError):
    """An API the converter needs is missing from the installed torch / megatron-core."""


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def check_versions() -> None:
    """Warn once per process for each package whose installed version was not tested."""
    for package, tested in TESTED.items():
        version = _installed(package)
        if not any(version == t or version.startswith(t + ".") for t in tested):
            warnings.warn(f"megatron_dgpo.convert was tested with {package} "
                          f"{', '.join(tested)}, found {version}: the private "
                          f"checkpoint APIs it uses may have changed", stacklevel=3)


def api(package: str, module: str, name: str):
    """``module.name``, or ``IncompatibleDependency`` naming package, version and API."""
    check_versions()
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise IncompatibleDependency(
            f"{package} {_installed(package)} lacks {module}.{name} ({exc}); "
            f"megatron_dgpo.convert needs it and was tested with {package} "
            f"{', '.join(TESTED[package])}") from None


def _mcore(name: str):
    return api("megatron-core", "megatron.core.dist_checkpointing.strategies.torch", name)


def _dcp(module: str, name: str):
    return api("torch", f"torch.distributed.checkpoint{module}", name)


# ----------------------------------------------------------------------------- saving

def mcore_save_planner_class():
    """Megatron-Core's DCP save planner (subclassed to produce chunks on demand)."""
    return _mcore("MCoreSavePlanner")


def torch_dist_save_strategy_class():
    """Megatron-Core's ``torch_dist`` save strategy (subclassed to save serially)."""
    return _mcore("TorchDistSaveShardedStrategy")


def is_bytes_item(write_item) -> bool:
    """True for a DCP write item that is not tensor data (e.g. pickled common state)."""
    return write_item.type == _dcp(".planner", "WriteItemType").BYTE_IO


def save_serially(sharded_state_dict, checkpoint_dir: str, keep_only_main_replica: bool,
                  planner) -> None:
    """``dcp.save`` of a Megatron sharded state dict with a single-thread writer that asks
    ``planner.resolve_data`` for one item at a time, in order, and writes it before the next
    (no copy-ahead, one file per rank)."""
    state, _, _ = _mcore("_replace_state_dict_keys_with_sharded_keys")(
        sharded_state_dict, keep_only_main_replica)
    writer = _dcp("", "FileSystemWriter")(checkpoint_dir, single_file_per_rank=True,
                                          thread_count=1, per_thread_copy_ahead=0)
    _dcp("", "save")(_mcore("mcore_to_pyt_state_dict")(state, False), storage_writer=writer,
                     planner=planner)


def split_rows(sharded_tensor, parts: int) -> list:
    """A ``ShardedTensor`` stored as ``parts`` equal row chunks (same global tensor)."""
    sh, step = sharded_tensor, sharded_tensor.local_shape[0] // parts
    return [dataclasses.replace(
        sh, data=sh.data[j * step:(j + 1) * step], local_shape=(step,) + sh.local_shape[1:],
        global_offset=(sh.global_offset[0] + j * step,) + sh.global_offset[1:],
        axis_fragmentations=(sh.axis_fragmentations[0] * parts,) + sh.axis_fragmentations[1:])
        for j in range(parts)]


def trim_rows(sharded_tensor, rows: int):
    """A whole (unsharded) ``ShardedTensor`` whose global tensor keeps its first ``rows`` rows."""
    sh = sharded_tensor
    if tuple(sh.local_shape) != tuple(sh.global_shape) or sh.prepend_axis_num:
        raise ValueError(f"{sh.key}: only a whole, unsharded tensor can drop rows")
    shape = (rows,) + tuple(sh.global_shape[1:])
    return dataclasses.replace(sh, data=sh.data[:rows], local_shape=shape, global_shape=shape)


def rename_keys(sharded_state_dict: dict, renamed: dict) -> None:
    """Give the sharded tensors (and other sharded objects) of a nested sharded state dict whose
    checkpoint key is in ``renamed`` the key ``renamed[key]``, in place: they then load from,
    or save to, that key."""
    for name, value in sharded_state_dict.items():
        if isinstance(value, dict):
            rename_keys(value, renamed)
        elif getattr(value, "key", None) in renamed:
            sharded_state_dict[name] = dataclasses.replace(value, key=renamed[value.key])


def plain_row_sharded(value) -> bool:
    """True for a ``ShardedTensor`` that ``split_rows`` may split: no prepended (layer) axis, not
    flattened."""
    sharded_tensor = api("megatron-core", "megatron.core.dist_checkpointing", "ShardedTensor")
    return (isinstance(value, sharded_tensor) and not value.prepend_axis_num
            and value.flattened_range is None)


# ----------------------------------------------------------------------------- reading

def read_failures() -> tuple:
    """What a DCP read of damaged files raises: any ``Exception``, and DCP's
    ``CheckpointException`` (a ``BaseException``) carrying a rank's failure."""
    return Exception, _dcp("", "CheckpointException")


def checkpoint_reader(ckpt_dir: str):
    """DCP's filesystem reader of a torch_dist checkpoint folder."""
    return _dcp("", "FileSystemReader")(ckpt_dir)


def stored_tensors(reader) -> dict:
    """{key: TensorStorageMetadata} of the stored tensors (``.size``, ``.chunks[i].offsets``,
    ``.properties.dtype``)."""
    tensor_md = _dcp(".metadata", "TensorStorageMetadata")
    return {key: md for key, md in reader.read_metadata().state_dict_metadata.items()
            if isinstance(md, tensor_md)}


@functools.cache
def _box_planner_class():
    """DCP's default load planner, restricted to one key read into one box (built once: a class
    made per call would keep its buffer alive in a reference cycle until the next gc)."""
    load_plan = _dcp(".planner", "LoadPlan")
    create_read_items = _dcp(".planner_helpers", "_create_read_items")

    class _BoxPlanner(_dcp(".default_planner", "DefaultLoadPlanner")):
        def __init__(self, key: str, buffer: torch.Tensor):
            super().__init__()
            self.key, self.buffer = key, buffer

        def create_local_plan(self):
            md = self.metadata.state_dict_metadata[self.key]
            return load_plan(create_read_items(self.key, md, self.buffer))

    return _BoxPlanner


def read_box(reader, key: str, offsets: tuple[int, ...], shape: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
    """The sub-tensor of stored tensor ``key`` at ``offsets`` of size ``shape``, read alone.

    torch.distributed.checkpoint reads only the stored chunks that overlap the box (DCP's
    ``__create_chunk_list__`` protocol describes the box; the planner is otherwise DCP's own).
    Runs without torch.distributed.
    """
    buffer = torch.empty(shape, dtype=dtype)
    chunk = _dcp(".metadata", "ChunkStorageMetadata")(offsets=torch.Size(offsets),
                                                      sizes=buffer.size())
    buffer.__create_chunk_list__ = lambda: [chunk]
    buffer.__get_tensor_shard__ = functools.partial(_identity, buffer)
    _dcp("", "load")({key: buffer}, storage_reader=reader,
                     planner=_box_planner_class()(key, buffer), no_dist=True)
    del buffer.__create_chunk_list__, buffer.__get_tensor_shard__  # break the reference cycle
    return buffer


def _identity(tensor, _index):
    return tensor
