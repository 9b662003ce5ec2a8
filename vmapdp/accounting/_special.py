"""Scalar special functions in plain ``math`` (no numpy/scipy at runtime)."""

from __future__ import annotations

import math

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def log_ndtr(z: float) -> float:
    """log Phi(z) for the standard normal CDF, accurate far into the lower tail."""
    if z > 0.0:
        return math.log1p(-0.5 * math.erfc(z / math.sqrt(2.0)))
    if z > -37.0:  # erfc is accurate to full relative precision down to ~1e-300
        return math.log(0.5 * math.erfc(-z / math.sqrt(2.0)))
    # asymptotic series of the Mills ratio: for z <= -37 the terms fall below 1e-16 fast
    z2 = z * z
    series, term = 1.0, 1.0
    for k in range(1, 12):
        term *= -(2 * k - 1) / z2
        series += term
    return -0.5 * z2 - math.log(-z) - _LOG_SQRT_2PI + math.log(series)


def logaddexp(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


def kl_bernoulli(a: float, q: float) -> float:
    """KL(Bernoulli(a) || Bernoulli(q)) in nats, for 0 <= a <= 1, 0 < q < 1 (Chernoff bounds)."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / q)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - q))
    return out
