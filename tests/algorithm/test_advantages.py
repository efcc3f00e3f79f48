"""GRPO group advantages against a float64 per-group reference written with statistics.stdev."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_dgpo.algorithm.advantages import group_advantages, overlong_penalty


def _reference(rewards, G, eps, unbiased):
    out = []
    for g in range(0, len(rewards), G):
        grp = rewards[g : g + G]
        if len(set(grp)) == 1:
            out += [0.0] * G
            continue
        sd = statistics.stdev(grp) if unbiased else statistics.pstdev(grp)
        mu = statistics.fmean(grp)
        out += [(r - mu) / (sd + eps) for r in grp]
    return out


@pytest.mark.parametrize("unbiased", [True, False])
def test_matches_reference_and_counts_degenerate_groups(unbiased):
    rewards = [1, -1, -1, -1,   1, 1, 1, 1,   -1, -1, -1, -1,   1, -1, 1, -1,   0.5, 0.25, 1, -1]
    adv, stats = group_advantages(torch.tensor(rewards, dtype=torch.float32), 4, eps=1e-6, unbiased=unbiased)
    ref = _reference(rewards, 4, 1e-6, unbiased)
    assert torch.allclose(adv.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-6)
    assert stats.num_groups == 5 and stats.num_degenerate == 2 and stats.frac_degenerate == pytest.approx(0.4)
    assert adv[4:12].abs().max() == 0  # exact: degenerate groups get torch.where's 0, not 0/eps noise
    assert stats.reward_mean == pytest.approx(sum(rewards) / len(rewards))


def test_binary_rewards_sample_vs_population_std():
    # one right out of G=4: sample std uses G-1, so |A| is smaller by sqrt((G-1)/G)
    r = torch.tensor([1.0, -1.0, -1.0, -1.0])
    a_s, _ = group_advantages(r, 4, eps=0.0, unbiased=True)
    a_p, _ = group_advantages(r, 4, eps=0.0, unbiased=False)
    assert torch.allclose(a_s / a_p, torch.full((4,), (3 / 4) ** 0.5))
    assert a_p[0].item() == pytest.approx(1.5 / (0.75**0.5))
    assert abs(a_s.sum().item()) < 1e-6  # advantages of a group sum to zero


def test_group_of_one_and_errors():
    adv, stats = group_advantages(torch.tensor([1.0, -1.0]), 1)
    # exact: a group of one is degenerate: torch.where's zeros
    assert adv.tolist() == [0.0, 0.0] and stats.num_degenerate == 2
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.ones(4), 3)
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.ones(2, 2), 2)


def test_drop_degenerate_groups_keeps_informative_groups_only():
    from megatron_dgpo.algorithm.advantages import drop_degenerate_groups

    rewards = [1, -1, 1,   1, 1, 1,   -1, -1, -1,   0.5, 0.5, 1,   2, 2, 2]
    kept = drop_degenerate_groups(rewards, 3)
    assert kept.indices == [0, 1, 2, 9, 10, 11]
    assert kept.keep.tolist() == [i in kept.indices for i in range(15)]  # exact: booleans
    assert kept.num_dropped == 3 == group_advantages(torch.tensor(rewards), 3)[1].num_degenerate
    assert kept.as_dict() == {"adv/num_dropped_groups": 3.0}
    assert drop_degenerate_groups([1.0, -1.0], 1).num_dropped == 2  # G = 1: no signal
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        drop_degenerate_groups(rewards, 4)


def _dapo_length_reward(y: int, l_max: int, l_cache: int) -> float:
    """R_length of DAPO (Yu et al. 2025, Eq. 13), written from the paper, in Python floats."""
    if y <= l_max - l_cache:
        return 0.0
    if y <= l_max:
        return ((l_max - l_cache) - y) / l_cache
    return -1.0


@pytest.mark.parametrize("l_max, l_cache, factor", [(20480, 4096, 1.0), (16, 5, 0.5), (3, 1, 2.0)])
def test_overlong_penalty_matches_dapo_at_and_around_each_boundary(l_max, l_cache, factor):
    start = l_max - l_cache
    lengths = sorted({1, start - 1, start, start + 1, (start + l_max) // 2, l_max - 1, l_max,
                      l_max + 1, l_max + 7} - {0})
    got = overlong_penalty(lengths, l_max, l_cache, factor)
    want = [_dapo_length_reward(y, l_max, l_cache) * factor for y in lengths]
    assert got.dtype == torch.float64
    # exact: the same IEEE operations on integer-valued doubles as the reference (one
    # subtraction of integers, one division, one product with the factor)
    assert got.tolist() == want
    assert got[lengths.index(start)].item() == 0.0  # exact: the window's edge, and not -0.0
    assert math.copysign(1.0, got[lengths.index(start)].item()) == 1.0
    assert got[lengths.index(l_max)].item() == -factor  # exact: the cap, (-l_cache / l_cache) * f
    assert got[lengths.index(start + 1)].item() == pytest.approx(-factor / l_cache, rel=1e-15)


def test_overlong_penalty_refuses_a_window_outside_the_cap():
    for window in (0, 16, 17):
        with pytest.raises(ValueError, match=r"must lie in \[1, 16\)"):
            overlong_penalty([3], 16, window)
