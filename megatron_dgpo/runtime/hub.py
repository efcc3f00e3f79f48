"""Model folders from the Hugging Face hub, as each node sees them.

* ``HUB_FILES``: the files of a hub repo that make a policy (config, weights, tokenizer,
  chat template).
* ``snapshot_of(folder)``: the ``HubSnapshot`` (repo id, commit) a folder of huggingface_hub's
  cache is, or None for any other folder.
* ``on_this_node(folder, snapshot)``: that snapshot on this node's own disk, fetched into its
  HF cache where the folder another node named does not exist here.

Why: a node's HF cache (``HF_HOME``) is usually node-local, so a path resolved on one node does
not exist on the others. The trainer resolves a hub id per node (``training.policy.initial_model``);
a dedicated engine on another node gets the trainer's path and its snapshot and takes the same
commit from its own cache (``rollout.dedicated.server``).
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
"""The files of a hub repo that make the policy (config, weights, tokenizer, template)."""

# huggingface_hub's cache: <cache>/models--<org>--<name>/snapshots/<commit> (a repo id never
# holds "--", which huggingface_hub refuses, so the folder name gives it back)
_SNAPSHOT = re.compile(r"models--(?P<repo>.+)$")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubSnapshot:
    """One commit of a hub model repo."""

    repo_id: str
    """``org/name``."""
    revision: str
    """The commit (40 hex digits)."""


def snapshot_of(folder) -> HubSnapshot | None:
    """The ``HubSnapshot`` a folder of huggingface_hub's cache is
    (``.../models--org--name/snapshots/<commit>``), else None."""
    folder = Path(folder)
    repo = _SNAPSHOT.fullmatch(folder.parent.parent.name)
    if folder.parent.name != "snapshots" or not repo or not _COMMIT.fullmatch(folder.name):
        return None
    return HubSnapshot(repo.group("repo").replace("--", "/"), folder.name)


def on_this_node(folder, snapshot: HubSnapshot | None, *, download=None) -> Path:
    """``folder`` where this node sees its config.json; else, for a ``snapshot``, that commit
    from this node's HF cache, fetched first if it is not there (``download``:
    ``huggingface_hub.snapshot_download`` or a function with its signature; concurrent fetches
    into one cache are locked by huggingface_hub). Raises ``FileNotFoundError`` naming this
    node, the folder and the snapshot when neither gives a model folder."""
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    node = socket.gethostname()
    if snapshot is None:
        raise FileNotFoundError(f"node {node} sees no {folder / 'config.json'}: a model folder "
                                f"must be storage every node sees")
    if download is None:
        from huggingface_hub import snapshot_download as download
    try:
        local = Path(download(snapshot.repo_id, revision=snapshot.revision,
                              allow_patterns=HUB_FILES))
    except Exception as error:  # noqa: BLE001 - the node and the snapshot are the message
        raise FileNotFoundError(f"node {node} could not fetch {snapshot.repo_id} at revision "
                                f"{snapshot.revision} into its HF cache: "
                                f"{type(error).__name__}: {error}") from error
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"node {node}: {snapshot.repo_id} at revision "
                                f"{snapshot.revision} has no config.json ({local})")
    return local
