"""Gaussian DP through the central limit theorem: an approximation, NOT a bound.

By the CLT of Bu, Dong, Long and Su (2020), ``T`` steps of the Poisson-subsampled Gaussian
with noise multiplier ``s`` and sample rate ``q`` are approximately mu-GDP with

    mu = q * sqrt(T * (exp(1 / s^2) - 1))

(for a schedule, mu^2 adds over steps). A mu-GDP mechanism is (epsilon, delta)-DP for

    delta(epsilon) = Phi(-epsilon / mu + mu / 2) - exp(epsilon) * Phi(-epsilon / mu - mu / 2).

The approximation is asymptotic (q -> 0 with q * sqrt(T) fixed). For finite T it can
UNDER-report epsilon, sometimes substantially (small T, large q, or small delta), so it must
not be used to claim a privacy guarantee. Use it for quick intuition; report "rdp" or "pld".

References:
  Dong, Roth, Su. "Gaussian Differential Privacy." JRSS-B 2022.
  Bu, Dong, Long, Su. "Deep Learning with Gaussian Differential Privacy." HDSR 2020.
"""

from __future__ import annotations

import math
import warnings

from vmapdp.accounting._special import log_ndtr as _log_ndtr

__all__ = ["gdp_mu", "gdp_delta", "gdp_epsilon", "GDP_WARNING"]

GDP_WARNING = (
    "accountant='gdp' is a central-limit approximation, not an upper bound: it can "
    "under-report epsilon (small steps, large sample_rate or small delta). Use "
    "accountant='rdp' or 'pld' for a privacy guarantee."
)


def warn_gdp(where: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{where}: {GDP_WARNING}", UserWarning, stacklevel=stacklevel)


def gdp_mu(events) -> float:
    """mu of the CLT approximation for (noise_multiplier, sample_rate, count) triples."""
    mu2 = 0.0
    for s, q, c in events:
        if q == 0.0:
            continue
        x = 1.0 / (s * s)
        if x > 700.0:
            return math.inf
        mu2 += c * q * q * math.expm1(x)
    return math.sqrt(mu2)


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta(epsilon) of a mu-GDP mechanism (Dong, Roth, Su 2022, Corollary 2.13)."""
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = math.exp(_log_ndtr(-epsilon / mu + mu / 2.0))
    # b <= a in exact arithmetic, but its exponent is a difference of two terms of epsilon's size: beyond 1e9 their
    # rounding alone can overflow exp (found by review: OverflowError at noise multiplier 1e-10). Dropped there, which
    # only overstates delta (b >= 0).
    b = 0.0 if epsilon > 1e9 else math.exp(epsilon + _log_ndtr(-epsilon / mu - mu / 2.0))
    return min(max(a - b, 0.0), 1.0)


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon >= 0 with gdp_delta(mu, epsilon) <= delta (bisection)."""
    if mu == 0.0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    if math.isinf(mu):
        return math.inf
    lo, hi = 0.0, max(1.0, mu * mu)
    while gdp_delta(mu, hi) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e6:
            return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gdp_delta(mu, mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return hi
