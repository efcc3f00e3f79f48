"""Rank functions for tests/test_sft.py: the supervised step on one batch, split several ways."""

from __future__ import annotations

import torch

from tests._rank_fns_model import TINY_QWEN2
from tests._rank_fns_train import LENGTHS, PROMPTS, _build, _grads


def samples():
    """8 prompt + response sequences of unequal lengths (random ids)."""
    from megatron_dgpo.algorithm.packing import Sample

    gen = torch.Generator().manual_seed(21)
    return [Sample(torch.randint(0, TINY_QWEN2["vocab_size"], (n,), generator=gen), p, {})
            for n, p in zip(LENGTHS, PROMPTS)]


def sft_fn(rank, world_size, tp):
    """Each DP replica takes every DP-th sample (as ``megatron_dgpo.sft`` does); the batch goes
    through ``sft_step`` as one packed row per replica and as rows of at most 30 tokens."""
    from megatron.core import parallel_state as ps

    from megatron_dgpo.algorithm.packing import pack
    from megatron_dgpo.runtime.parallel import destroy_parallel
    from megatron_dgpo.training.train_step import sft_step

    models = _build(TINY_QWEN2, tp, 1)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = samples()[dp_rank::dp_size]
    out = {}
    for name, budget in (("one_row", 10**6), ("rows_of_30", 30)):
        rows = pack(mine, budget)
        loss, num_tokens = sft_step(models, rows)
        grads, pad_ok = _grads(models, TINY_QWEN2["vocab_size"])
        out[name] = dict(loss=loss, num_tokens=num_tokens, rows=len(rows), pad_ok=pad_ok,
                         grads=grads if rank == 0 else None)
    destroy_parallel()
    return out
