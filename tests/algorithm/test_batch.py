"""A batch's step metrics where their data lives: ``Experience.rollout_metrics`` against hand
counts, and, with ``advantages.batch_advantages``'s group statistics and
``advantages.reduce_group_stats``, reduced over two DP replicas like the numbers of one process
holding the whole batch."""

from __future__ import annotations

import math

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
