"""A training checkpoint's checksums: recorded as its files are written, verified before use.

``checksums/`` in a checkpoint holds JSON manifests ``{"algorithm": "crc32", "files": {relative
path: [size, crc32]}}``: ``rank<r>-shards.json``, the ``torch_dist`` files rank r's Megatron
writer wrote (the CRC is taken from the bytes as they pass to the file, in the writer's thread
or process: ``record_writes``), and ``common.json``, every other file (Megatron's metadata, the
trainer state, the converter metadata, what ``write_extra`` added), hashed by rank 0 once the
save is complete. ``verify`` reads the files back against them; it also names a checkpoint
whose manifests, metadata or shards are missing. CRC-32 guards against accidents (torn, truncated
or overwritten files), not against tampering; measured costs: benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from pathlib import Path

ALGORITHM = "crc32"
MANIFEST_DIR = "checksums"
COMMON_MANIFEST = "common.json"
REQUIRED = ("trainer_state.json", "metadata.json", ".metadata")
"""Files every complete training checkpoint has (ours, Megatron's, torch DCP's)."""
_CHUNK = 16 << 20

_recorded: dict[str, tuple[int, int]] = {}  # path -> (size, crc) of files this process wrote
_lock = threading.Lock()


class _HashingFile:
    """A binary file opened for writing whose CRC and size follow every ``write``."""

    def __init__(self, path: str, raw):
        self._path, self._raw, self._crc, self._size = path, raw, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._crc = zlib.crc32(view, self._crc)
        self._size += view.nbytes
        return self._raw.write(data)

    def seek(self, *args):  # a rewrite would invalidate the running checksum
        raise OSError(f"{self._path}: checksummed checkpoint files are written sequentially")

    def close(self) -> None:
        if not self._raw.closed:
            self._raw.close()
            with _lock:
                _recorded[self._path] = (self._size, self._crc)

    def __getattr__(self, name):  # tell, flush, fileno, closed, ...
        return getattr(self._raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _hashing_open(file, mode="r", *args, **kwargs):
    raw = open(file, mode, *args, **kwargs)
    return _HashingFile(os.fspath(file), raw) if "w" in mode and "b" in mode else raw


def install_writer_hook() -> None:
    """Megatron's ``torch_dist`` writer opens its files through ``_hashing_open`` (its module's
    ``open``; idempotent, in whatever process the writer runs)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.open = _hashing_open


def record_writes(write, manifest: str, rank: int, buckets, *rest) -> None:
    """Run Megatron's write function ``write(rank, buckets, ...)`` and record the size and CRC
    of each file it wrote in ``manifest`` (JSON). Picklable by reference: the async writer
    process runs it."""
    install_writer_hook()
    write(rank, buckets, *rest)
    files = {}
    with _lock:
        for path, *_ in buckets:
            if path in _recorded:
                files[os.path.basename(path)] = _recorded.pop(path)
    _write_manifest(Path(manifest), files)


def shard_manifest(folder: Path, rank: int) -> Path:
    return folder / MANIFEST_DIR / f"rank{rank:05d}-shards.json"


def record_common(folder: Path) -> None:
    """Rank 0, once every rank's part is written: the manifest of the files no writer recorded."""
    listed = set()
    for manifest in (folder / MANIFEST_DIR).glob("rank*-shards.json"):
        listed |= set(json.loads(manifest.read_text())["files"])
    files = {rel: _checksum(folder / rel) for rel in _files(folder) if rel not in listed}
    _write_manifest(folder / MANIFEST_DIR / COMMON_MANIFEST, files)


def verify(folder: str | os.PathLike, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with checkpoint ``folder`` (empty: it verifies). Rank ``rank`` of ``world``
    reads back every ``world``-th recorded file (``world`` ranks together read each once); the
    structure (required files, manifests, shards no manifest lists, the shards ``.metadata``
    names once it matches its checksum) is checked by each."""
    folder = Path(folder)
    problems = [f"lacks {name}" for name in REQUIRED if not (folder / name).is_file()]
    manifests = sorted((folder / MANIFEST_DIR).glob("*.json"))
    if not (folder / MANIFEST_DIR / COMMON_MANIFEST).is_file():
        return problems + [f"lacks {MANIFEST_DIR}/{COMMON_MANIFEST} (saved without checksums, "
                           f"or damaged)"]
    recorded: dict[str, list] = {}
    for manifest in manifests:
        try:
            content = json.loads(manifest.read_text())
            if content.get("algorithm") != ALGORITHM:
                raise ValueError(f"algorithm {content.get('algorithm')!r}")
            recorded.update(content["files"])
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{MANIFEST_DIR}/{manifest.name} is unreadable ({exc})")
    present = set(_files(folder))
    problems += [f"lacks {rel}" for rel in sorted(set(recorded) - present)]
    # a shard no manifest lists lost its rank's record; another unlisted file was added later
    # and is not read by a resume
    problems += [f"holds {rel}, which no checksum manifest lists"
                 for rel in sorted(present - set(recorded)) if rel.endswith(".distcp")]
    share = set(sorted(recorded)[rank::world]) | {".metadata"}  # every rank unpickles it
    for rel in sorted(share & present & set(recorded)):
        size, crc = _checksum(folder / rel)
        if [size, crc] != list(recorded[rel]):
            problems.append(f"{rel} does not match its checksum (size {size}, recorded "
                            f"{recorded[rel][0]})" if size != recorded[rel][0] else
                            f"{rel} does not match its checksum (crc32 {crc:08x}, recorded "
                            f"{recorded[rel][1]:08x})")
    if not problems:
        try:
            named = _shards_named(folder)
        except Exception as exc:  # a damaged pickle: any of its errors
            named, problems = set(), [f".metadata is unreadable ({type(exc).__name__})"]
        problems += [f"lacks {rel} (named by .metadata)" for rel in sorted(named - set(recorded))]
    return problems


def _shards_named(folder: Path) -> set[str]:
    """The data files torch DCP's ``.metadata`` of ``folder`` refers to."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


def _files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the manifests, as relative POSIX paths."""
    out = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if path.is_file() and rel.parts[0] != MANIFEST_DIR:
            out.append(rel.as_posix())
    return sorted(out)


def _checksum(path: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def _write_manifest(path: Path, files: dict) -> None:
    path.parent.mkdir(exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"algorithm": ALGORITHM, "files": {k: list(v) for k, v in files.items()}},
                  handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
