"""Streaming safetensors I/O: lazy per-tensor reads, and a sharded writer fed tensor by tensor.

Neither side ever holds more than one tensor: the reader opens the file, reads the requested
sub-box of one tensor and closes it (so no mmap keeps pages resident); the writer appends each
tensor's bytes to the current shard right away and fills in the shard's header at the end
(safetensors allows the header to be padded with spaces, so a header area is reserved up front).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from megatron_dgpo.runtime.errors import InputError, MissingInputError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
              "added_tokens.json", "chat_template.jinja")

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
                torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def read_hf_config(hf_dir: str) -> dict:
    """config.json of an HF checkpoint folder; ``MissingInputError`` naming it if absent,
    ``InputError`` if it is no JSON object."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise MissingInputError(f"missing file: {path} (an HF checkpoint folder needs "
                                f"config.json)")
    return _json_object(path)


def _json_object(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except ValueError as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class LazyHFReader:
    """Per-tensor access to an HF safetensors checkpoint (single file or index + shards)."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, INDEX_FILE)
        single = os.path.join(hf_dir, SINGLE_FILE)
        if os.path.isfile(index):
            weight_map = _json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise InputError(f"{index}: no 'weight_map' object")
            self._file_of = {name: os.path.join(hf_dir, f) for name, f in weight_map.items()}
        elif os.path.isfile(single):
            with _opened(single) as handle:
                self._file_of = {name: single for name in handle.keys()}
        else:
            raise MissingInputError(f"missing files: neither {index} nor {single} exists "
                                    f"(only safetensors HF checkpoints are supported)")
        for path in sorted(set(self._file_of.values())):
            if not os.path.isfile(path):
                raise MissingInputError(f"missing file: {path} (listed in {INDEX_FILE})")
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _file(self, name: str) -> str:
        if name not in self._file_of:
            raise InputError(f"tensor {name!r} is missing from the HF checkpoint {self.hf_dir}")
        return self._file_of[name]

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype from the header only (no data read)."""
        if name not in self._meta:
            with _opened(self._file(name)) as handle:
                sl = handle.get_slice(name)
                dtype = _dtype_from_name(sl.get_dtype())
                self._meta[name] = (tuple(sl.get_shape()), dtype)
        return self._meta[name]

    def read(self, name: str, box=None) -> torch.Tensor:
        """``tensor[box]`` (box: ``(start, stop)`` per leading dim) read without the rest."""
        with _opened(self._file(name)) as handle:
            if box is None:
                return handle.get_tensor(name)
            sl = handle.get_slice(name)
            return sl[tuple(slice(a, b) for a, b in box)].contiguous()


def _opened(path: str):
    """``safe_open(path)``; a file safetensors cannot read is an ``InputError`` naming it."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as exc:
        raise InputError(f"{path}: not a readable safetensors file ({exc}): damaged or "
                         f"incomplete") from exc


def _dtype_from_name(name: str) -> torch.dtype:
    for dtype, short in _DTYPE_NAMES.items():
        if short == name:
            return dtype
    raise InputError(f"unsupported safetensors dtype {name!r}")


@dataclass(frozen=True)
class TensorBlocks:
    """A tensor of ``shape`` delivered as consecutive row blocks [rows_i, *shape[1:]]."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: Iterable[torch.Tensor]

    def cast(self, dtype: torch.dtype) -> "TensorBlocks":
        if dtype == self.dtype or not self.dtype.is_floating_point:
            return self
        return TensorBlocks(self.shape, dtype, (block.to(dtype) for block in self.blocks))

    def materialize(self) -> torch.Tensor:
        return torch.cat(list(self.blocks)).reshape(self.shape)


class ShardedSafetensorsWriter:
    """Writes ``model-0000i-of-0000n.safetensors`` shards + index from tensors given one by one.

    Memory: one tensor at a time (its bytes are written at once). Shards roll over when the next
    tensor would push the current one past ``max_shard_bytes``.
    """

    def __init__(self, out_dir: str, max_shard_bytes: int = 5 * 1024**3,
                 header_reserve: int = 1 << 20):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self.header_reserve = header_reserve
        self._shards: list[tuple[str, dict]] = []  # (temporary path, header) per shard
        self._handle = None
        self._header: dict = {}
        self._offset = 0
        self.total_bytes = 0

    def _open_shard(self):
        self._close_shard()
        path = os.path.join(self.out_dir, f".shard{len(self._shards)}.tmp")
        self._handle = open(path, "wb")
        self._handle.write(b"\0" * self.header_reserve)
        self._header = {}
        self._offset = 0
        self._shards.append((path, self._header))

    def _close_shard(self):
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append one tensor (any dtype in safetensors; written in its own dtype)."""
        self.add_blocks(name, TensorBlocks(tuple(tensor.shape), tensor.dtype, (tensor,)))

    def add_blocks(self, name: str, blocks: "TensorBlocks") -> None:
        """Append one tensor given as consecutive row blocks (never whole in memory)."""
        if blocks.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {blocks.dtype} cannot be saved as safetensors")
        if any(name in header for _, header in self._shards):
            raise ValueError(f"tensor {name!r} was written twice")
        itemsize = torch.empty((), dtype=blocks.dtype).element_size()
        nbytes = itemsize * int(torch.Size(blocks.shape).numel())
        if self._handle is None or (self._offset and self._offset + nbytes > self.max_shard_bytes):
            self._open_shard()
        written = 0
        for block in blocks.blocks:
            if block.dtype != blocks.dtype:
                raise ValueError(f"tensor {name!r}: a block has dtype {block.dtype}, "
                                 f"expected {blocks.dtype}")
            block = block.detach().to("cpu").contiguous()
            if block.numel():
                self._handle.write(block.reshape(-1).view(torch.uint8).numpy().data)
            written += block.numel() * itemsize
            del block
        if written != nbytes:
            raise ValueError(f"tensor {name!r}: blocks hold {written} bytes, shape "
                             f"{tuple(blocks.shape)} needs {nbytes}")
        self._header[name] = {"dtype": _DTYPE_NAMES[blocks.dtype], "shape": list(blocks.shape),
                              "data_offsets": [self._offset, self._offset + nbytes]}
        self._offset += nbytes
        self.total_bytes += nbytes

    def abort(self) -> None:
        """Remove the shards written so far (a failed write leaves no temporary file)."""
        self._close_shard()
        for path, _ in self._shards:
            if os.path.exists(path):
                os.remove(path)
        self._shards.clear()

    def close(self) -> list[str]:
        """Finish the headers, name the shards, write the index. Returns the shard file names."""
        self._close_shard()
        if not self._shards:
            raise ValueError("no tensors were written")
        count = len(self._shards)
        names = [SINGLE_FILE] if count == 1 else [
            f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for (path, header), final in zip(self._shards, names):
            _finish_header(path, {"__metadata__": {"format": "pt"}, **header}, self.header_reserve)
            os.replace(path, os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in header})
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            with open(os.path.join(self.out_dir, INDEX_FILE), "w", encoding="utf-8") as handle:
                json.dump(index, handle, indent=2, sort_keys=True)
        return names


def _finish_header(path: str, header: dict, reserve: int) -> None:
    """Write ``[u64 length][json padded with spaces]`` into the reserved area at the file start.

    If the header outgrew the reserved area the data is shifted (rare: > ~5000 tensors/shard).
    """
    payload = json.dumps(header, separators=(",", ":")).encode()
    if len(payload) + 8 <= reserve:
        payload += b" " * (reserve - 8 - len(payload))
        with open(path, "r+b") as handle:
            handle.write(struct.pack("<Q", len(payload)) + payload)
        return
    payload += b" " * (-(len(payload) + 8) % 8)
    tmp = path + ".grow"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(struct.pack("<Q", len(payload)) + payload)
        src.seek(reserve)
        shutil.copyfileobj(src, dst, 64 << 20)
    os.replace(tmp, path)


def copy_side_files(src_dir: str | None, out_dir: str, config: dict | None = None) -> None:
    """config.json (``config`` if given, else the source's), generation config, tokenizer files."""
    os.makedirs(out_dir, exist_ok=True)
    if src_dir:
        for name in SIDE_FILES:
            path = os.path.join(src_dir, name)
            if os.path.isfile(path) and not (name == "config.json" and config is not None):
                shutil.copyfile(path, os.path.join(out_dir, name))
    if config is not None:
        with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)


def write_hf_checkpoint(pairs: Iterable[tuple[str, torch.Tensor]], out_dir: str, *,
                        dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 1024**3,
                        progress=None) -> int:
    """Consume ``(hf_name, tensor or TensorBlocks)`` pairs into sharded safetensors.

    Returns the bytes written.

    ``dtype`` casts floating tensors; ``progress`` (e.g. a tqdm bar) is advanced per tensor.
    """
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes=max_shard_bytes)
    try:
        for name, tensor in pairs:
            if isinstance(tensor, TensorBlocks):
                writer.add_blocks(name, tensor.cast(dtype) if dtype is not None else tensor)
                del tensor
                continue
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            writer.add(name, tensor)
            del tensor  # so that the next tensor is not produced while this one is alive
            if progress is not None:
                progress.update(1)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.total_bytes


def iter_hf_tensors(hf_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of an HF checkpoint, one at a time (for tests and tools)."""
    reader = LazyHFReader(hf_dir)
    for name in reader.names():
        yield name, reader.read(name)
