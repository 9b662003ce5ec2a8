"""The L2 sensitivity of a strategy ``C`` under multiple participations.

One example takes part in a set ``P`` of steps (a *participation pattern*): at most ``k`` steps,
any two at least ``min_separation`` apart. At step ``t`` in ``P`` its clipped gradient adds a
vector ``g_t`` with ``||g_t|| <= 1`` to the gradient sum ``x_t``; everything else is the same
with or without it. The mechanism releases ``C x + z``, so the example moves the mean of the
release by ``sum_{t in P} C[:, t] g_t^T``, whose squared Frobenius norm is
``sum_{s, t in P} X[s, t] <g_s, g_t>`` with ``X = C^T C``. The sensitivity is the largest such
norm over patterns and vectors:

* where ``X >= 0`` entrywise, all ``g_t`` equal is worst and ``sens^2 = max_P sum_{s,t in P} X[s, t]``;
* always ``sens^2 <= max_P sum_{s,t in P} |X[s, t]|`` (``|<g_s, g_t>| <= 1``; Choquette-Choo
  et al. 2023, "(Amplified) Banded Matrix Factorization", Eq. (5)).

:func:`sensitivity` computes it exactly where a structural fact makes the maximisation easy
and otherwise returns a proven upper bound (``require_exact=True`` refuses instead). It never
returns less than the truth. The rules, in order:

1. ``k = 1``: the largest column norm of ``C``.
2. Columns more than ``min_separation - 1`` apart are orthogonal (``X[s, t] = 0`` for
   ``|s - t| >= min_separation``; a banded ``C`` with ``band <= min_separation``): the cross terms
   vanish, and the best pattern maximises a sum of squared column norms (a dynamic program; for a
   Toeplitz ``C`` the earliest pattern ``0, sep, 2 sep, ...``).
3. ``X >= 0``, ``X[s+1, t+1] <= X[s, t]`` and ``X[s, t+1] <= X[s, t]`` for ``t > s``: moving any
   participation earlier never lowers a term, so the earliest pattern ``0, sep, .., (k-1) sep``
   is worst. A lower-triangular Toeplitz ``C`` whose coefficients are ``>= 0`` and non-increasing
   from index 1 on (every BLT with ``omega >= 0``, ``0 <= theta < 1``; the square root of prefix
   sums) satisfies it: ``X[s, t] = sum_{r=0}^{n-1-max(s,t)} c[r] c[r + |s-t|]``. (jax-privacy's
   ``toeplitz.minsep_sensitivity_squared``, after Kalinin and Lampert 2024, arXiv:2405.13763,
   Theorem 2, asks for coefficients non-increasing from index 0; from index 1 suffices.)
4. Otherwise an upper bound: Algorithm 4 of Choquette-Choo et al. 2023 (the best pattern for
   each row of ``|X|``, then the best pattern over those row maxima); for a Toeplitz ``C`` also
   rule 3 applied to the smallest non-negative majorant of ``|c|`` that is non-increasing from
   index 1 (entries only grow in absolute value, and rows obey the triangle inequality), and
   the smaller of the two. For a Toeplitz ``C`` with ``n > 1024`` only the majorant (``O(n log n)``).

:func:`brute_force_sensitivity` enumerates all patterns (small ``n``, for tests).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp.mf.strategies import toeplitz_matrix, toeplitz_multiply

__all__ = ["brute_force_sensitivity", "participation_patterns", "sensitivity", "toeplitz_gram", "toeplitz_sensitivity_squared"]

_MAX_PATTERNS = 1 << 20
_GRAM_MAX_N = 1024  # the O(n^2 k) work of rule 4 on C^T C stays under a few seconds


def _earliest_pattern(n: int, sep: int, k: int, dtype=torch.float64) -> Tensor:
    e = torch.zeros(n, dtype=dtype)
    e[torch.arange(k) * sep] = 1.0
    return e


def toeplitz_sensitivity_squared(coeffs: Tensor, n: int, *, min_separation: int = 1, max_participations: int | None = None) -> tuple[Tensor, bool]:
    """``(sens^2, exact)`` for the ``n x n`` lower-triangular Toeplitz ``C`` with first column ``coeffs``.

    Differentiable in ``coeffs`` (the optimizers use it). ``exact`` is True where rule 1, 2 or 3
    of the module docstring applies; otherwise the value is rule 4's upper bound. ``coeffs`` is
    cut or zero-padded to ``n``. (:func:`sensitivity` also tries rules 3-4 on ``C^T C`` where
    this returns a bound.)
    """
    call = "toeplitz_sensitivity_squared"
    n = _checks.positive_int(call, "n", n, meaning="n is the number of steps")
    sep, k = _checks.participation(call, n, min_separation, max_participations)
    c = coeffs[:n] if coeffs.numel() >= n else torch.cat([coeffs, coeffs.new_zeros(n - coeffs.numel())])
    if k == 1:  # rule 1: column 0 has the largest norm (the others are its truncations)
        return (c * c).sum(), True
    nz = torch.nonzero(c.detach()).flatten()
    band = int(nz[-1]) + 1 if nz.numel() else 1
    if band <= sep:  # rule 2: column p has squared norm cumsum(c^2)[n-1-p], largest for the earliest
        cs = torch.cumsum(c * c, 0)
        return cs[n - 1 - torch.arange(k) * sep].sum(), True
    cd = c.detach()
    exact = bool((cd >= 0).all()) and bool((cd[2:] <= cd[1:-1]).all())
    if not exact:  # rule 4: the majorant, non-increasing from index 1
        tail = torch.flip(torch.cummax(torch.flip(c[1:].abs(), [0]), 0).values, [0])
        c = torch.cat([c[:1].abs(), tail])
    v = toeplitz_multiply(c, _earliest_pattern(n, sep, k, c.dtype), n)
    return (v * v).sum(), exact


def _best_pattern_sum(x: Tensor, sep: int, k: int) -> Tensor:
    """``max_P sum_{t in P} x[..., t]`` over patterns of at most ``k`` steps ``sep`` apart, for
    ``x >= 0`` (a dynamic program over the last axis, batched over the others; Choquette-Choo et
    al. 2023, Algorithm 3)."""
    n = x.shape[-1]
    f = x.new_zeros(*x.shape[:-1], n + sep)
    for _ in range(k):  # f[t]: best with at most j picks among steps >= t
        g = torch.cat([x + f[..., sep:sep + n], f[..., n:]], dim=-1)
        f = torch.flip(torch.cummax(torch.flip(g, [-1]), -1).values, [-1])
    return f[..., 0]


def toeplitz_gram(coeffs: Tensor, n: int) -> Tensor:
    """``X = C^T C`` for the ``n x n`` lower-triangular Toeplitz ``C`` with first column ``coeffs``,
    in ``O(n^2)``: ``X[i, j] = sum_{s=0}^{n-1-max(i,j)} c[s] c[s + |i-j|]``."""
    c = coeffs[:n] if coeffs.numel() >= n else torch.cat([coeffs, coeffs.new_zeros(n - coeffs.numel())])
    i = torch.arange(n)
    shifted = torch.cat([c, c.new_zeros(n)])[i[:, None] + i[None, :]]  # shifted[d, s] = c[s + d]
    q = torch.cumsum(c[None, :] * shifted, dim=1)  # q[d, m] = sum_{s <= m} c[s] c[s + d]
    return q[(i[:, None] - i[None, :]).abs(), n - 1 - torch.maximum(i[:, None], i[None, :])]


def _gram_sensitivity_squared(x: Tensor, sep: int, k: int) -> tuple[float, bool]:
    """Rules 1-3 on ``X = C^T C`` where they apply (exact), else Algorithm 4 (an upper bound)."""
    n = x.shape[0]
    if k == 1:
        return float(x.diagonal().max()), True
    i = torch.arange(n)
    far = (i[:, None] - i[None, :]).abs() >= sep
    if not bool((x[far] != 0).any()):  # rule 2
        return float(_best_pattern_sum(x.diagonal(), sep, k)), True
    tol = 1e-12 * float(x.abs().max())
    y = x.abs()
    viol_diag = float((y[1:, 1:] - y[:-1, :-1]).max()) if n > 1 else 0.0
    row_step = (y[:, 1:] - y[:, :-1])[torch.triu(torch.ones(n, n - 1, dtype=torch.bool), 1)]
    viol_row = float(row_step.max()) if row_step.numel() else 0.0
    viol = max(viol_diag, viol_row, 0.0)
    if float(x.min()) >= -tol and viol <= tol:  # rule 3 on |X|, with the rounding-size violations added back
        p = torch.arange(k) * sep
        return float(y[p][:, p].sum()) + k * k * n * viol, True
    rows = _best_pattern_sum(y, sep, k)  # rule 4: Algorithm 4 of Choquette-Choo et al. 2023
    return float(_best_pattern_sum(rows, sep, k)), False


def sensitivity(strategy: Any, n: int, *, min_separation: int = 1, max_participations: int | None = None, require_exact: bool = False) -> float:
    """The L2 sensitivity of ``C x`` when one example takes part in at most ``max_participations``
    of the ``n`` steps, any two at least ``min_separation`` apart, each time adding a vector of norm
    ``<= 1`` (the clipped gradient over the clipping norm).

    ``strategy``: a :mod:`vmapdp.mf` strategy (:class:`BandedToeplitz`, :class:`BufferedToeplitz`)
    or an ``n x n`` lower-triangular tensor ``C``. ``max_participations=None``: as many as fit,
    ``ceil(n / min_separation)``. The value is exact where a rule of the module docstring applies
    (always for ``max_participations=1``: the largest column norm) and a proven upper bound
    otherwise; with ``require_exact=True`` the latter raises ValueError. Patterns that are a subset
    of these (fixed epochs, cyclic batches) have at most this sensitivity.
    """
    call = "sensitivity"
    n, strategy = _checks.mf_strategy(call, strategy, n)
    sep, k = _checks.participation(call, n, min_separation, max_participations)
    if isinstance(strategy, Tensor):
        value, exact = _gram_sensitivity_squared(strategy.T @ strategy, sep, k)
    else:
        coeffs = strategy.toeplitz_coeffs(n)
        s2, exact = toeplitz_sensitivity_squared(coeffs, n, min_separation=sep, max_participations=k)
        value = float(s2)
        if not exact and n <= _GRAM_MAX_N:  # rules 3-4 on C^T C may do better than the majorant
            value2, exact = _gram_sensitivity_squared(toeplitz_gram(coeffs, n), sep, k)
            value = min(value, value2)
    if require_exact and not exact:
        raise ValueError(
            f"{call}: no exact rule applies to this strategy with min_separation={sep}, {k} participations in n={n} steps "
            "(C^T C has negative entries, or does not decrease away from the diagonal and down it); the value "
            f"{math.sqrt(value):.6g} is an upper bound. Pass require_exact=False to use the bound (valid, perhaps loose), "
            "use brute_force_sensitivity for small n, or pick a strategy with non-negative, non-increasing coefficients."
        )
    return math.sqrt(value)


def participation_patterns(n: int, min_separation: int = 1, max_participations: int | None = None) -> Iterator[tuple[int, ...]]:
    """Every non-empty participation pattern: the sets of at most ``max_participations`` steps of
    ``0 .. n-1``, any two at least ``min_separation`` apart, as sorted tuples. Refuses (ValueError)
    when there are more than ``2**20`` of them."""
    call = "participation_patterns"
    n = _checks.positive_int(call, "n", n, meaning="n is the number of steps")
    sep, k = _checks.participation(call, n, min_separation, max_participations)
    count = [[0] * (k + 1) for _ in range(n + sep + 1)]  # count[t][j]: patterns of <= j steps among t.. (incl. empty)
    for t in range(n + sep, -1, -1):
        for j in range(k + 1):
            count[t][j] = 1 if t >= n or j == 0 else count[t + 1][j] + count[t + sep][j - 1]
    if count[0][k] - 1 > _MAX_PATTERNS:
        raise ValueError(
            f"{call}: n={n}, min_separation={sep}, {k} participations give {count[0][k] - 1} patterns, more than "
            f"{_MAX_PATTERNS} to enumerate. Use a smaller n, or sensitivity() (no enumeration)."
        )

    def extend(prefix: tuple[int, ...], start: int) -> Iterator[tuple[int, ...]]:
        if len(prefix) == k:
            return
        for t in range(start, n):
            pat = prefix + (t,)
            yield pat
            yield from extend(pat, t + sep)

    return extend((), 0)


def brute_force_sensitivity(strategy: Any, n: int, *, min_separation: int = 1, max_participations: int | None = None) -> float:
    """``sqrt(max_P sum_{s,t in P} |X[s, t]|)`` (``X = C^T C``) over every pattern of
    :func:`participation_patterns`: the sensitivity where ``X >= 0`` entrywise, the Eq. (5) upper
    bound of Choquette-Choo et al. 2023 otherwise. For tests on small ``n``."""
    call = "brute_force_sensitivity"
    n, strategy = _checks.mf_strategy(call, strategy, n)
    c = strategy if isinstance(strategy, Tensor) else toeplitz_matrix(strategy.toeplitz_coeffs(n), n)
    y = (c.T @ c).abs()
    best = 0.0
    for pat in participation_patterns(n, min_separation, max_participations):
        idx = torch.tensor(pat)
        best = max(best, float(y[idx][:, idx].sum()))
    return math.sqrt(best)


