"""megatron_dgpo/planner/lengths.py: the capped lognormal of response lengths, its fit, moments
and the expected longest of N responses, against a Monte Carlo of the same distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_dgpo.planner.lengths import LENGTH_SIGMA, ResponseLengths, capped_moment

CASES = [  # (cap, mean, fit keywords): the 8k recipes, a truncation share, a 28k cap, a 4k one
    (8192, 4096, {}), (8192, 4096, dict(truncated=0.1)), (28672, 2000, {}),
    (3968, 398, dict(truncated=0.002)), (8192, 1500, dict(sigma=1.0))]


def _draws(d: ResponseLengths, shape, seed=0):
    rng = np.random.default_rng(seed)
    return np.minimum(np.exp(rng.normal(d.mu, d.sigma, shape)), d.cap)


@pytest.mark.parametrize("cap, mean, kw", CASES)
def test_fit_and_moments_against_a_monte_carlo(cap, mean, kw):
    """The fit reproduces the mean (and the truncated share or sigma asked for); the closed-form
    E[X], E[X^2], P(X = cap) and E[min(X, a)] agree with 400,000 draws."""
    d = ResponseLengths.fit(cap, mean, **kw)
    assert d.mean == pytest.approx(mean, rel=1e-9)
    if "truncated" in kw:
        assert d.truncated == pytest.approx(kw["truncated"], rel=1e-6)
    else:
        assert d.sigma == kw.get("sigma", LENGTH_SIGMA)
    x = _draws(d, 400_000)
    assert x.mean() == pytest.approx(d.mean, rel=0.01)
    assert (x ** 2).mean() == pytest.approx(d.second_moment, rel=0.02)
    assert (x == cap).mean() == pytest.approx(d.truncated, abs=0.002)
    for a in (0.5 * mean, 2 * mean):
        assert np.minimum(x, a).mean() == pytest.approx(d.mean_below(a), rel=0.01)
    assert d.cdf(cap) == 1.0 and d.cdf(0) == 0.0


@pytest.mark.parametrize("cap, mean, kw", CASES)
def test_expected_longest_of_n_against_a_monte_carlo(cap, mean, kw):
    """E[max of n] = integral of 1 - F^n over [0, cap), the order statistic of the capped
    distribution: within four standard errors of the mean of 1000 batches' maxima for
    n from 1 to 4096; it grows with n and reaches the cap once n times the truncated share is
    large."""
    d = ResponseLengths.fit(cap, mean, **kw)
    x = _draws(d, (1000, 4096), seed=1)
    previous = 0.0
    for n in (1, 8, 64, 512, 4096):
        expected = d.expected_max(n)
        maxima = x[:, :n].max(axis=1)
        error = abs(expected - maxima.mean())
        assert error <= 4 * maxima.std() / math.sqrt(len(maxima)) + 1e-4 * cap, n
        assert expected >= previous
        previous = expected
    assert d.expected_max(1) == pytest.approx(mean, rel=1e-4)
    if d.truncated * 4096 > 20:
        assert d.expected_max(4096) == pytest.approx(cap, rel=1e-6)


def test_capped_moment_by_hand_and_bad_input_is_refused():
    """E[min(L, c)] of a lognormal written out with math.erf; a mean outside (0, cap) or a
    truncated share at or above mean / cap (no lognormal has it) is refused."""
    mu, s, c = 7.0, 0.8, 2000.0

    def phi(z):
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))
    z = (math.log(c) - mu) / s
    assert capped_moment(mu, s, c, 1) == pytest.approx(
        math.exp(mu + s * s / 2) * phi(z - s) + c * (1 - phi(z)), rel=1e-12)
    assert capped_moment(mu, s, 1e30, 1) == pytest.approx(math.exp(mu + s * s / 2), rel=1e-12)
    assert capped_moment(mu, s, 1e30, 2) == pytest.approx(math.exp(2 * mu + 2 * s * s), rel=1e-12)
    for mean, kw in ((0, {}), (8192, {}), (4096, dict(truncated=0.5)),
                     (4096, dict(truncated=0.0)), (4096, dict(sigma=0.0))):
        with pytest.raises(ValueError):
            ResponseLengths.fit(8192, mean, **kw)
