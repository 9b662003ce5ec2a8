"""Small statistics in plain math/torch for the checks (scipy is not a runtime dependency).

Two-sided normal p-values, the one-sample Kolmogorov-Smirnov test against N(0, std^2), and the
exact Clopper-Pearson upper bound on a binomial proportion, and exact binomial tails.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["two_sided_p", "ks_pvalue", "ks_normal", "clopper_pearson_upper", "binomial_tail"]


def two_sided_p(z: float) -> float:
    """P(|N(0, 1)| >= |z|)."""
    return math.erfc(abs(z) / math.sqrt(2.0)) if math.isfinite(z) else 0.0


def ks_pvalue(d: float, n: int) -> float:
    """Kolmogorov's asymptotic p-value of a one-sample KS statistic ``d`` over ``n`` points.

    Uses Stephens' finite-n correction ``lambda = (sqrt(n) + 0.12 + 0.11 / sqrt(n)) d``; accurate
    to a few percent of the p-value for n >= 100, far better for the n >= 1000 used here.
    """
    en = math.sqrt(n)
    lam = (en + 0.12 + 0.11 / en) * d
    if lam < 0.3:
        return 1.0
    total = 0.0
    for k in range(1, 200):
        term = 2.0 * (-1.0) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam)
        total += term
        if abs(term) < 1e-16:
            break
    return min(1.0, max(0.0, total))


def chi2_two_sided_p(sum_of_squares: float, dof: int) -> float:
    """Two-sided p-value of ``sum_of_squares`` against ``chi2(dof)`` (the sum of ``dof`` squared
    standard normals): ``2 min(F, 1 - F)``, exact for any ``dof`` (regularised incomplete gamma)."""
    k = torch.tensor(dof / 2.0, dtype=torch.float64)
    x = torch.tensor(sum_of_squares / 2.0, dtype=torch.float64)
    below, above = float(torch.special.gammainc(k, x)), float(torch.special.gammaincc(k, x))
    return min(1.0, 2.0 * min(below, above))


def ks_normal(x: Tensor, std: float) -> tuple[float, float]:
    """KS statistic and p-value of the sample ``x`` against N(0, std^2)."""
    n = x.numel()
    xs = torch.sort(x.to(torch.float64)).values
    cdf = torch.special.ndtr(xs / std)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = max(float((i / n - cdf).max()), float((cdf - (i - 1) / n).max()))
    return d, ks_pvalue(d, n)


def clopper_pearson_upper(successes: int, trials: int, beta: float) -> float:
    """One-sided Clopper-Pearson upper confidence bound on a binomial proportion.

    The smallest ``p`` with ``P(Binomial(trials, p) <= successes) <= beta``: with probability at
    least ``1 - beta`` the true proportion is below it (exact, not an approximation). Computed by
    bisection on the binomial log-CDF (a log-sum-exp of log-gamma terms in float64), i.e. the
    ``1 - beta`` quantile of Beta(successes + 1, trials - successes) without scipy.

    References:
        Clopper and Pearson 1934, "The use of confidence or fiducial limits illustrated in the
        case of the binomial".
    """
    k, n = int(successes), int(trials)
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"clopper_pearson_upper: need 0 <= successes <= trials and trials >= 1, got {successes=}, {trials=}.")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"clopper_pearson_upper: beta={beta!r} must be in (0, 1).")
    if k == n:
        return 1.0
    if k == 0:
        return -math.expm1(math.log(beta) / n)  # (1 - p)^n = beta
    # for p >= k/n the terms grow with i up to k; those 40 sd below k are below e^-800 of the last
    first = max(0, int(k - 40.0 * math.sqrt(k + 1.0) - 40.0))
    i = torch.arange(first, k + 1, dtype=torch.float64)
    log_choose = math.lgamma(n + 1.0) - torch.lgamma(i + 1.0) - torch.lgamma(n - i + 1.0)
    target = math.log(beta)

    def log_cdf(log_p: float) -> float:
        p = math.exp(log_p)
        return float(torch.logsumexp(log_choose + i * log_p + (n - i) * math.log1p(-p), 0))

    lo, hi = math.log(k / n), 0.0  # log_cdf(lo) ~ log(1/2) > log(beta); log_cdf(0) = -inf
    while hi - lo > 1e-13:  # relative precision 1e-13 on p
        mid = 0.5 * (lo + hi)
        if log_cdf(mid) > target:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


def binomial_tail(k: int, s: int, q: float, *, upper: bool) -> float:
    """``P(X >= k)`` (``upper``) or ``P(X <= k)`` for ``X ~ Binomial(s, q)``, summed exactly from
    ``k`` away from the mean (1 where ``k`` is on the mean's side: a bound, not the tail)."""
    if (upper and k <= s * q) or (not upper and k >= s * q):
        return 1.0
    log_q, log_1q = math.log(q), math.log1p(-q)
    total, j = 0.0, k
    while 0 <= j <= s:
        term = math.exp(math.lgamma(s + 1) - math.lgamma(j + 1) - math.lgamma(s - j + 1) + j * log_q + (s - j) * log_1q)
        total += term
        if term < 1e-18 * total or term == 0.0:
            break
        j += 1 if upper else -1
    return min(1.0, total)
