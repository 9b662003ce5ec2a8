"""The expected error of a strategy ``C`` on a workload ``A`` (DP matrix factorization).

The mechanism releases ``A x + A C^{-1} z`` with ``z ~ N(0, (sigma * sens)^2 I)`` per coordinate
(``sigma`` the noise multiplier, ``sens`` the sensitivity of ``C`` under the participation
pattern, :func:`vmapdp.mf.sensitivity`; gradients in units of the clipping norm). Row ``t`` of the
error has variance ``sigma^2 sens^2 ||(A C^{-1})[t]||^2`` in every coordinate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp.mf.sensitivity import sensitivity
from vmapdp.mf.strategies import toeplitz_column, toeplitz_inverse, toeplitz_multiply

__all__ = ["expected_error", "row_squared_errors"]

ERROR_KINDS = ("mean", "max")


def row_squared_errors(inv_coeffs: Tensor, workload: Tensor) -> Tensor:
    """``||(A T(d))[t]||^2`` for every row ``t``: ``T(d)`` the ``n x n`` lower-triangular Toeplitz
    matrix with first column ``inv_coeffs`` (that of ``C^{-1}``), ``A`` the workload, given either
    as its ``n x n`` matrix or, when it is lower-triangular Toeplitz, as its first column (1-D; the
    ``O(n log n)`` path). Differentiable in ``inv_coeffs``."""
    n = inv_coeffs.shape[0]
    if workload.dim() == 1:
        b = toeplitz_multiply(workload, inv_coeffs, n)
        return torch.cumsum(b * b, 0)
    # (A T(d))[i, j] = sum_s A[i, j + s] d[s]: a correlation of each row with d, by FFT on the flipped rows
    rows = torch.flip(toeplitz_multiply(torch.flip(workload, [1]), inv_coeffs, n), [1])
    return (rows * rows).sum(1)


def expected_error(
    strategy: Any,
    workload: Tensor | None,
    n: int,
    *,
    min_separation: int = 1,
    max_participations: int | None = None,
    kind: str = "mean",
) -> float:
    """The expected squared error of the workload's estimate, per coordinate and per unit noise
    multiplier (clipping norm 1): ``sens^2 * ||A C^{-1}||_F^2 / n`` (``kind="mean"``, the mean over
    the ``n`` steps) or ``sens^2 * max_t ||(A C^{-1})[t]||^2`` (``kind="max"``).

    ``strategy``: a :mod:`vmapdp.mf` strategy or an ``n x n`` lower-triangular tensor ``C``;
    ``workload``: an ``n x n`` tensor ``A`` (:func:`vmapdp.mf.prefix_sums`,
    :func:`vmapdp.mf.momentum_prefix_sums`), None for prefix sums. ``sens`` is
    :func:`vmapdp.mf.sensitivity` under ``min_separation`` / ``max_participations`` (an upper
    bound where it is not exact, so the error is then an upper bound too). Multiply by
    ``noise_multiplier**2 * l2_clip_norm**2`` for the error of a run. Plain DP-SGD
    (:func:`vmapdp.mf.identity`) on prefix sums with one participation gives ``(n + 1) / 2``.
    """
    call = "expected_error"
    n, strategy = _checks.mf_strategy(call, strategy, n)
    kind = _checks.choice(call, "kind", kind, ERROR_KINDS, why="'mean' averages the squared error over the steps, 'max' takes the worst step")
    a = _checks.workload(call, workload, n)
    sens = sensitivity(strategy, n, min_separation=min_separation, max_participations=max_participations)
    if isinstance(strategy, Tensor):
        b = torch.linalg.solve_triangular(strategy, a, upper=False, left=False)
        rows = (b * b).sum(1)
    else:
        col = toeplitz_column(a)
        rows = row_squared_errors(toeplitz_inverse(strategy.toeplitz_coeffs(n), n), a if col is None else col)
    err = rows.mean() if kind == "mean" else rows.max()
    return sens * sens * float(err)
