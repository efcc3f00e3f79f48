"""What a checkpoint keeps of the rollout's work ahead of the trainer, so that a resumed run
loses nothing: one-step-off's batch generated ahead (``save_ahead``, ``load_ahead``: the resumed
run continues with the very samples the uninterrupted run used), and the streaming schedule's
buffer (``save_buffer``, ``load_buffer``: finished and unfinished responses with their
log-probs and segment versions, and where the replica's stream stands)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.rollout.base import Sampled

AHEAD_DIR = "rollout_ahead"
"""A checkpoint's folder for the batch generated ahead (one file per DP replica)."""
BUFFER_DIR = "rollout_buffer"
"""A checkpoint's folder for the streaming schedule's buffer (one file per DP replica)."""


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as handle:
        torch.save(record, handle)
        handle.flush()
        os.fsync(handle.fileno())  # on disk before the checkpoint is published


def save_ahead(folder: Path, ahead, *, dp_rank: int, dp_size: int, leader: bool) -> None:
    """Into a checkpoint being written (``folder``): this replica's batch generated ahead
    (``collect``'s triple), written by the replica's leader."""
    if ahead is None or not leader:
        return
    batch, metrics, used = ahead
    _write(folder / AHEAD_DIR / f"replica{dp_rank}.pt",
           {"batch": {k: v for k, v in vars(batch).items() if k not in ("advantages", "loss_weights")},
            "metrics": metrics, "prompts_used": used, "dp_size": dp_size})


def load_ahead(checkpoint: Path | None, *, replica_prompts: range, group_size: int):
    """The batch a checkpoint saved as generated ahead, cut to this replica's prompts (the
    saving run may have had another DP size: the replicas' files are joined in order, which
    is the batch's position order), or None when it has none."""
    folder = None if checkpoint is None else Path(checkpoint) / AHEAD_DIR
    if folder is None or not folder.is_dir():
        return None
    first = torch.load(folder / "replica0.pt", weights_only=False)
    saved = [first] + [torch.load(folder / f"replica{d}.pt", weights_only=False)
                       for d in range(1, first["dp_size"])]
    joined = Experience.join([Experience(**record["batch"]) for record in saved])
    if len(joined) < replica_prompts.stop * group_size:
        print(f"dgpo-train: {folder} holds {len(joined)} samples, fewer than this recipe's batch "
              f"needs ({replica_prompts.stop} x {group_size}): the recipe changed, the next batch "
              f"is sampled again", file=sys.stderr, flush=True)
        return None
    mine = joined.select(range(replica_prompts.start * group_size, replica_prompts.stop * group_size))
    return Sampled(mine, first["metrics"], first["prompts_used"])


def save_buffer(folder: Path, state: dict | None, *, dp_rank: int, dp_size: int) -> None:
    """Into a checkpoint being written: this replica's streaming buffer (``state``, the
    leader's; None elsewhere), written by the replica's leader."""
    if state is not None:
        _write(folder / BUFFER_DIR / f"replica{dp_rank}.pt", {"state": state, "dp_size": dp_size})


def load_buffer(checkpoint: Path | None, *, dp_rank: int, dp_size: int) -> dict | None:
    """This replica's streaming buffer from a checkpoint, or None when it holds none (a run
    resumed onto the streaming schedule from another one). Raises ``ValueError`` when the
    checkpoint's DP size differs (each replica streams its own share of the prompts)."""
    folder = None if checkpoint is None else Path(checkpoint) / BUFFER_DIR
    if folder is None or not folder.is_dir():
        return None
    record = torch.load(folder / f"replica{dp_rank}.pt", weights_only=False)
    if record["dp_size"] != dp_size:
        raise ValueError(f"{folder} holds the rollout buffers of {record['dp_size']} DP replicas, "
                         f"this run has {dp_size}: resume the streaming schedule at the same DP "
                         f"size (each replica streams its own prompts)")
    return record["state"]
