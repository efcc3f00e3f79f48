"""Rollout-vs-trainer log-prob mismatch (``algorithm.mismatch``): the [B, T] definition against
a float64 reference, the packed rows' statistics against the unpacked definition, and the
reduction over ranks against one process."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.algorithm.mismatch import logprob_mismatch, mismatch_metrics
from megatron_dgpo.training.minibatches import pack_update


def test_mismatch_metrics_float64_reference():
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 5, generator=g) * 4
    trainer = rollout + torch.randn(3, 5, generator=g) * 0.01
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    trainer[0, 4] = float("nan")  # padding garbage must not leak through the mask
    st = logprob_mismatch(rollout, trainer, mask)
    d = [[(trainer[b, t] - rollout[b, t]).item() for t in range(5) if mask[b, t]] for b in range(3)]
    flat = [abs(x) for row in d for x in row]
    assert st.num_tokens == 8
    assert st.mean_abs_diff == pytest.approx(sum(flat) / 8, rel=1e-9)
    assert st.max_abs_diff == pytest.approx(max(flat), rel=1e-9)
    assert st.token_mult_error == pytest.approx(math.expm1(sum(flat) / 8), rel=1e-9)
    seq = [math.expm1(sum(abs(x) for x in row)) for row in d if row]
    assert st.seq_mult_error == pytest.approx(sum(seq) / len(seq), rel=1e-9)
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_mismatch(rollout, trainer[:, :4], mask)


def test_mismatch_metrics_of_packed_rows_equal_the_unpacked_definition():
    gen = torch.Generator().manual_seed(0)
    batch = Experience(prompt_tokens=[[1, 2, 3], [4, 5], [6, 7, 8, 9]],
                       response_tokens=[[10, 11], [12, 13, 14, 15], [16]],
                       rollout_logprobs=[[-1.0, -2.0], [-0.5, -0.1, -3.0, -1.5], [-0.2]],
                       rewards=[1.0, -1.0, 1.0], truncated=[False] * 3,
                       advantages=torch.tensor([1.0, -1.0, 0.5]))
    trainer = [torch.tensor(lp) + 0.05 * torch.randn(len(lp), generator=gen)
               for lp in batch.rollout_logprobs]
    rows = pack_update(batch, [0, 1, 2], budget=12, pad_multiple=2)
    assert len(rows) == 2
    for row in rows:  # put the "trainer" log-probs where the trainer's forward pass puts them
        old = torch.zeros(len(row.tokens))
        ends = row.cu_seqlens.tolist()
        for k, sample in enumerate(row.sample_indices):
            start = ends[k] + len(batch.prompt_tokens[sample]) - 1
            old[start:start + len(trainer[sample])] = trainer[sample]
        row.old_logprobs = old
    got = mismatch_metrics(rows).as_dict()
    width = max(len(t) for t in trainer)
    pad = lambda xs: torch.stack([torch.cat([torch.tensor(x, dtype=torch.float64).reshape(-1),
                                             torch.zeros(width - len(x))]) for x in xs])
    mask = pad([[1.0] * len(t) for t in trainer]) > 0
    want = logprob_mismatch(pad(batch.rollout_logprobs), pad([t.tolist() for t in trainer]), mask)
    for key, value in want.as_dict().items():
        if key != "mismatch/num_tokens":
            assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-7), key


def _mismatch_rows(seed: int):
    """Packed micro-batches of 6 samples with trainer log-probs (and one huge |d| sample)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [2, 4, 1, 3, 5, 2]
    batch = Experience(prompt_tokens=[[1, 2, 3]] * 6, response_tokens=[[7] * n for n in lengths],
                       rollout_logprobs=[(-torch.rand(n, generator=gen)).tolist() for n in lengths],
                       rewards=[1.0] * 6, truncated=[False] * 6, advantages=torch.zeros(6))
    rows = pack_update(batch, list(range(6)), budget=16, pad_multiple=1)
    for row in rows:
        row.old_logprobs = torch.where(row.loss_mask, row.rollout_logprobs
                                       + 0.1 * torch.randn(len(row.tokens), generator=gen), 0.0)
    rows[0].old_logprobs[rows[0].loss_mask.nonzero()[0]] += 100.0  # past the exp cap
    return rows


def _mismatch_dp_fn(rank, world_size):
    rows = _mismatch_rows(seed=4)
    return mismatch_metrics(rows[rank::world_size], torch.distributed.group.WORLD).as_dict()


def test_mismatch_metrics_reduce_over_the_group_like_one_process():
    from tests.distributed import run_ranks

    want = mismatch_metrics(_mismatch_rows(seed=4)).as_dict()
    assert want["mismatch/max_abs_diff"] > 99.0
    for got in run_ranks(_mismatch_dp_fn, 2):
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=1e-12), key
