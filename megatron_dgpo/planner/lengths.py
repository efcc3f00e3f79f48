"""Response lengths of a rollout batch, X = min(L, cap) with L lognormal, as pure functions of
(mu, sigma, cap): the fit, moments, expected longest of N (docs/planner.md#response-lengths)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

LENGTH_SIGMA = 0.6
"""The default spread, the log-space standard deviation of L (a coefficient of variation of
0.66 before the cap): half the cap on average puts 9% of the responses at the cap."""

_PHI = NormalDist()


def _bisect(f, lo: float, hi: float, iterations: int = 200) -> float:
    """The root of ``f``, increasing on [lo, hi]."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class ResponseLengths:
    """X = min(L, cap), log L ~ Normal(mu, sigma): a long right tail and a point mass at the cap
    (the responses cut at ``max_response_tokens``, ``rollout/truncated_frac``)."""

    cap: float
    mu: float
    sigma: float

    @classmethod
    def fit(cls, cap: float, mean: float, *, sigma: float | None = None,
            truncated: float | None = None) -> "ResponseLengths":
        """The distribution with E[X] = ``mean`` and either the spread ``sigma`` (default
        ``LENGTH_SIGMA``) or the share at the cap ``truncated``. Raises ValueError when
        ``mean`` is not in (0, cap) or ``truncated`` not in (0, mean / cap)."""
        if not 0 < mean < cap:
            raise ValueError(f"the mean response must lie in (0, {cap:g}) tokens, got {mean:g}")
        if truncated is None:
            s = LENGTH_SIGMA if sigma is None else sigma
            if not s > 0:
                raise ValueError(f"the length spread sigma must be > 0, got {s!r}")
            mu = _bisect(lambda m: capped_moment(m, s, cap, 1) - mean,
                         math.log(cap) - 60 * s - 60, math.log(cap) + 60 * s + 60)
            return cls(cap, mu, s)
        if not 0 < truncated < mean / cap:
            raise ValueError(f"the share of responses at the cap must lie in (0, mean / cap = "
                             f"{mean / cap:.3g}), got {truncated!r}")
        z = _PHI.inv_cdf(1 - truncated)
        # the capped mean falls from cap to truncated x cap as sigma grows (mu = ln cap - z sigma)
        s = _bisect(lambda s: mean - capped_moment(math.log(cap) - z * s, s, cap, 1), 1e-9, 50.0)
        return cls(cap, math.log(cap) - z * s, s)

    def cdf(self, x: float) -> float:
        """P(X <= x)."""
        if x >= self.cap:
            return 1.0
        return _PHI.cdf((math.log(x) - self.mu) / self.sigma) if x > 0 else 0.0

    @property
    def truncated(self) -> float:
        """P(X = cap): the share of responses cut at the cap."""
        return 1.0 - _PHI.cdf((math.log(self.cap) - self.mu) / self.sigma)

    @property
    def mean(self) -> float:
        return capped_moment(self.mu, self.sigma, self.cap, 1)

    @property
    def second_moment(self) -> float:
        """E[X^2]."""
        return capped_moment(self.mu, self.sigma, self.cap, 2)

    @property
    def running_age(self) -> float:
        """E[X^2] / (2 E[X]): the tokens a running response has decoded, averaged over decode steps
        (length-biased), which is also the mean response context over every decoded token."""
        return self.second_moment / (2 * self.mean)

    def expected_max(self, n: float) -> float:
        """E[max of n independent draws] = integral over [0, cap) of 1 - F(x)^n (n >= 1)."""
        return _expected_max(self.mu, self.sigma, self.cap, max(1.0, float(n)))

    def mean_below(self, a: float) -> float:
        """E[min(X, a)] (0 for a <= 0)."""
        return capped_moment(self.mu, self.sigma, min(self.cap, a), 1) if a > 0 else 0.0

def capped_moment(mu: float, sigma: float, cap: float, k: int) -> float:
    """E[min(L, cap)^k] for log L ~ Normal(mu, sigma):
    exp(k mu + k^2 sigma^2 / 2) Phi((ln cap - mu - k sigma^2) / sigma) + cap^k P(L > cap)."""
    z = (math.log(cap) - mu) / sigma
    return (math.exp(k * mu + k * k * sigma * sigma / 2) * _PHI.cdf(z - k * sigma)
            + cap ** k * (1.0 - _PHI.cdf(z)))


@lru_cache(maxsize=4096)
def _expected_max(mu: float, sigma: float, cap: float, n: float) -> float:
    """``ResponseLengths.expected_max`` by Simpson's rule in ln x (docs/planner.md)."""
    y_hi = math.log(cap)
    y_lo = min(mu - 10 * sigma, y_hi)
    if y_hi <= y_lo:
        return cap
    below_cap = _PHI.cdf((y_hi - mu) / sigma)  # F's left limit at the cap

    def f(y):
        cdf = below_cap if y >= y_hi else _PHI.cdf((y - mu) / sigma)
        return (1.0 - cdf ** n) * math.exp(min(y, y_hi))
    steps = 4000
    h = (y_hi - y_lo) / steps
    inner = sum((4 if i % 2 else 2) * f(y_lo + i * h) for i in range(1, steps))
    simpson = f(y_lo) + f(y_hi) + inner
    return math.exp(y_lo) + simpson * h / 3
