"""One-step-off (``rollout.max_staleness: 1``): the batch a replica generated ahead, kept in a
checkpoint (``save_ahead``) so that a resumed run continues with the very samples the
uninterrupted run used (``load_ahead``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.rollout.base import Sampled

AHEAD_DIR = "rollout_ahead"
"""A checkpoint's folder for the batch generated ahead (one file per DP replica)."""


def save_ahead(folder: Path, ahead, *, dp_rank: int, dp_size: int, leader: bool) -> None:
    """Into a checkpoint being written (``folder``): this replica's batch generated ahead
    (``collect``'s triple), written by the replica's leader."""
    if ahead is None or not leader:
        return
    batch, metrics, used = ahead
    (folder / AHEAD_DIR).mkdir(exist_ok=True)
    with open(folder / AHEAD_DIR / f"replica{dp_rank}.pt", "wb") as handle:
        torch.save({"batch": {k: v for k, v in vars(batch).items()
                              if k not in ("advantages", "loss_weights")},
                    "metrics": metrics, "prompts_used": used, "dp_size": dp_size}, handle)
        handle.flush()
        os.fsync(handle.fileno())  # on disk before the checkpoint is published


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
    batches = []
    for record in saved:
        batch = Experience(**{k: v for k, v in record["batch"].items() if k != "policy_version"})
        batch.policy_version = record["batch"].get("policy_version")
        batches.append(batch)
    joined = Experience.join(batches)
    if len(joined) < replica_prompts.stop * group_size:
        print(f"dgpo-train: {folder} holds {len(joined)} samples, fewer than this recipe's batch "
              f"needs ({replica_prompts.stop} x {group_size}): the recipe changed, the next batch "
              f"is sampled again", file=sys.stderr, flush=True)
        return None
    lo, hi = replica_prompts.start * group_size, replica_prompts.stop * group_size
    mine = joined.select(range(lo, hi))
    return Sampled(mine, first["metrics"], first["prompts_used"])
