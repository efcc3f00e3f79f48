"""A batch's step metrics where their data lives: ``Experience.rollout_metrics`` against hand
counts, and, with ``advantages.batch_advantages``'s group statistics and
``advantages.reduce_group_stats``, reduced over two DP replicas like the numbers of one process
holding the whole batch."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dgpo.algorithm.advantages import (batch_advantages, group_advantages,
                                                reduce_group_stats)
from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.recipe import AlgorithmConfig

G = 2
REWARDS = [1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0]  # four groups of two
LENGTHS = [3, 5, 2, 7, 4, 4, 1, 6]


def _batch(lo: int = 0, hi: int = len(REWARDS)) -> Experience:
    return Experience(prompt_tokens=[[1, 2]] * (hi - lo),
                      response_tokens=[[9] * n for n in LENGTHS[lo:hi]],
                      rollout_logprobs=[[-0.5] * n for n in LENGTHS[lo:hi]],
                      rewards=REWARDS[lo:hi], truncated=[n == 7 for n in LENGTHS[lo:hi]])


OVERLONG = AlgorithmConfig(drop_degenerate_groups=True, overlong_filter=True,
                           overlong_penalty_window=3)
"""Every group statistic on: the degenerate-group filter, the overlong filter and penalty (the
replicas' halves hold different penalties: 5 and 7 tokens, 6)."""


def test_rollout_metrics_count_the_batch():
    metrics = _batch().rollout_metrics(G)
    assert metrics == {
        "rollout/reward_mean": 0.0,  # exact: four +1 and four -1
        "rollout/accuracy": 0.5,
        "rollout/pass_at_group": 0.75,  # groups 0, 2 and 3 hold a +1
        "rollout/response_length_mean": 32 / 8,
        "rollout/response_length_max": 7.0,
        "rollout/truncated_frac": 1 / 8,
        "rollout/num_samples": 8.0,
    }


def _replica_fn(rank, world_size):
    """Replica ``rank``'s half of the batch: its metrics and group statistics, reduced."""
    share = len(REWARDS) // world_size
    lo, hi = rank * share, (rank + 1) * share
    batch = _batch(lo, hi)
    stats = batch_advantages(batch, OVERLONG, group_size=G, max_response_tokens=7).stats
    group = torch.distributed.group.WORLD
    return batch.rollout_metrics(G, group), reduce_group_stats(stats, group)


def test_two_replicas_report_the_numbers_of_one():
    from tests.distributed import run_ranks

    whole = _batch().rollout_metrics(G)
    want_stats = batch_advantages(_batch(), OVERLONG, group_size=G, max_response_tokens=7).stats
    assert want_stats.keys() == {*group_advantages(torch.tensor(REWARDS), G)[1].as_dict(),
                                 "adv/num_dropped_groups", "adv/overlong_filtered_frac",
                                 "adv/overlong_penalty_mean", "adv/overlong_penalized_frac"}
    assert want_stats["adv/overlong_penalized_frac"] == 3 / 8  # 5, 7 and 6 tokens past 4
    assert reduce_group_stats(want_stats) == want_stats  # one replica: as it is
    for metrics, group_stats in run_ranks(_replica_fn, 2):
        assert metrics.keys() == whole.keys() and group_stats.keys() == want_stats.keys()
        for key, value in {**whole, **want_stats}.items():
            got = metrics.get(key, group_stats.get(key))
            assert math.isclose(got, value, rel_tol=1e-12, abs_tol=1e-12), key


def test_each_sample_keeps_its_prompt_position_and_segments_through_join_select_and_refill():
    """What a sample knows of its behaviour (the ledger's and the staleness's inputs) travels
    with it: joined pieces keep their order, a selection and a refill carry every field, and a
    batch without segments reads one segment of its version."""
    a, b = _batch(0, 4), _batch(4, 8)
    for piece, lo, version in ((a, 0, 3), (b, 4, 1)):
        piece.prompt_indices = [10 + lo + i for i in range(4)]
        piece.positions = [100 + lo + i // G for i in range(4)]
        piece.segments = [[(version, n)] for n in LENGTHS[lo:lo + 4]]
        piece.policy_version = version
    joined = Experience.join([a, None, b])
    assert joined.prompt_indices == list(range(10, 18)) and joined.policy_version == 1
    assert joined.segments_of(5) == [(1, LENGTHS[5])]
    picked = joined.select([6, 1])
    assert (picked.positions, picked.rewards) == ([105, 100], [REWARDS[6], REWARDS[1]])
    refilled = joined.replace_groups([0], picked, G)
    assert refilled.positions[:2] == [105, 100] and refilled.segments[2:] == joined.segments[2:]
    plain = _batch()
    plain.policy_version = 7
    assert plain.segments_of(3) == [(7, LENGTHS[3])]
    with pytest.raises(ValueError, match="some pieces carry prompt_indices"):
        Experience.join([a, _batch(0, 2)])


def test_stale_segments_get_loss_weight_zero_and_the_staleness_is_counted_per_token():
    """``mask_stale_segments``: a response sampled across refits keeps its tokens of versions
    >= ``stale_before`` in the loss (with the sample's aggregation weight) and drops the older
    ones; the staleness metrics count every token at the lag of its own segment."""
    batch = _batch(0, 2)  # lengths 3 and 5
    batch.advantages = torch.tensor([1.0, -1.0])
    batch.segments = [[(4, 1), (6, 2)], [(6, 5)]]
    batch.stale_before = 5
    # exact: each weight is a copy of the sample's weight (1, or 0.5) times a 0/1 mask
    assert batch.sample(0).per_token["loss_weights"].tolist() == [0.0, 1.0, 1.0]
    assert batch.sample(1).per_token["loss_weights"].tolist() == [1.0] * 5  # exact: copies
    batch.loss_weights = torch.tensor([0.5, 0.25], dtype=torch.float64)
    assert batch.sample(0).per_token["loss_weights"].tolist() == [0.0, 0.5, 0.5]  # exact: copies
    metrics = batch.staleness_metrics(8, segments=True)  # step 8 starts from version 7
    assert metrics == {"rollout/staleness_mean": (3 * 1 + 1 * 2 + 1 * 5) / 8,
                       "rollout/staleness_max": 3.0, "rollout/partial_frac": 0.5,
                       "rollout/segments_per_response": 1.5, "rollout/masked_tokens_frac": 1 / 8}
    batch.stale_before, batch.loss_weights = None, None  # nothing masked: no weights at all
    assert "loss_weights" not in batch.sample(0).per_token


def test_the_ledger_has_one_record_per_response():
    batch = _batch(0, 4)
    batch.prompt_indices, batch.positions = [3, 3, 8, 8], [40, 40, 41, 41]
    batch.segments = [[(0, 3)], [(0, 2), (1, 3)], [(1, 2)], [(1, 7)]]
    records = batch.ledger(5, G)
    assert records[1] == {"step": 5, "prompt_index": 3, "position": 40, "sample": 1,
                          "versions": [0, 1], "segments": [2, 3], "length": 5,
                          "finish_reason": "stop", "reward": -1.0}
    assert [r["finish_reason"] for r in records] == ["stop", "stop", "stop", "length"]
    assert [r["sample"] for r in records] == [0, 1, 0, 1]
