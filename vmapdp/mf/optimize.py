"""Strategy optimisation: the banded Toeplitz or BLT ``C`` with the least expected error.

Both optimisers minimise ``sens(C)^2 * err(A C^{-1})`` (:func:`vmapdp.mf.expected_error`, the
``mean`` or ``max`` per-step squared error) over the strategy's Toeplitz coefficients in float64
with L-BFGS (strong-Wolfe line search). The loss is invariant to scaling ``C``. The sensitivity in
the loss is the exact one of :func:`vmapdp.mf.toeplitz_sensitivity_squared`: the
parameterisations keep the strategy inside a class where an exact rule applies, and the result
is checked for it. Each evaluation costs ``O(n log n)`` (power-series inverse and products by FFT)
for a Toeplitz workload (prefix sums, momentum with a constant learning rate), ``O(n^2 log n)``
for another workload. The optimisers run with one torch thread (the loss is a chain of small
FFTs, where threads cost more than they save, ten times more on a busy machine) and restore the
thread count when they return.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp.mf.error import ERROR_KINDS, row_squared_errors
from vmapdp.mf.sensitivity import toeplitz_sensitivity_squared
from vmapdp.mf.strategies import BandedToeplitz, BufferedToeplitz, sqrt_prefix, toeplitz_column, toeplitz_inverse

__all__ = ["optimal_banded", "optimal_blt"]


def _loss_fn(n: int, workload: Tensor, sep: int, k: int, kind: str):
    col = toeplitz_column(workload)
    wl = workload if col is None else col

    def loss(c: Tensor) -> tuple[Tensor, bool]:
        s2, exact = toeplitz_sensitivity_squared(c, n, min_separation=sep, max_participations=k)
        rows = row_squared_errors(toeplitz_inverse(c, n), wl)
        return s2 * (rows.mean() if kind == "mean" else rows.max()), exact

    return loss


@contextlib.contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _single_threaded(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_thread():
            return fn(*args, **kwargs)

    return wrapper


class _NonFinite(Exception):
    pass


def _lbfgs(param: Tensor, objective, iters: int) -> Tensor:
    """Minimise ``objective(param)`` (a scalar tensor) from ``param``; returns the best point seen
    (the run stops at the first non-finite value, where torch's line search would fail)."""
    param = param.detach().clone().requires_grad_(True)
    scale = float(objective(param).detach())
    opt = torch.optim.LBFGS([param], lr=1.0, max_iter=iters, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-14)
    best = [scale, param.detach().clone()]

    def closure():
        opt.zero_grad()
        value = objective(param) / scale
        if not torch.isfinite(value):
            raise _NonFinite
        value.backward()
        if not bool(torch.isfinite(param.grad).all()):
            raise _NonFinite
        v = float(value.detach()) * scale
        if v < best[0]:
            best[0], best[1] = v, param.detach().clone()
        return value

    try:
        opt.step(closure)
    except _NonFinite:
        pass
    return best[1]


def _inv_softplus(y: Tensor) -> Tensor:
    return torch.where(y > 20, y, torch.log(torch.expm1(y.clamp(min=1e-300))))


@_single_threaded
def optimal_banded(
    n: int,
    band: int,
    *,
    workload: Tensor | None = None,
    min_separation: int | None = None,
    max_participations: int | None = None,
    kind: str = "mean",
    iters: int = 300,
) -> BandedToeplitz:
    """The banded Toeplitz strategy with ``band`` coefficients that minimises the expected error.

    ``workload``: an ``n x n`` tensor (None: prefix sums). ``min_separation`` defaults to ``band``
    (the amplified setting of Choquette-Choo et al. 2023: with ``min_separation >= band`` the
    participations' columns are orthogonal and the sensitivity is the root of the sum of the
    ``k`` earliest column norms squared, about ``sqrt(k)`` times the column norm). There, and with
    a single participation, the coefficients are free; with ``min_separation < band`` and several
    participations they are kept ``>= 0`` and non-increasing from index 1 (the class where the
    sensitivity is exact, rule 3 of :mod:`vmapdp.mf.sensitivity`). Starts from
    :func:`vmapdp.mf.sqrt_prefix` cut to ``band`` and never returns a worse strategy. The result is
    scaled to unit norm (single-participation sensitivity 1).
    """
    call = "optimal_banded"
    n = _checks.positive_int(call, "n", n, meaning="n is the number of steps")
    band = _checks.positive_int(call, "band", band, meaning="band is the number of nonzero Toeplitz coefficients")
    if band > n:
        raise ValueError(f"{call}: band={band} must be <= n={n}; coefficients past n never act. Pass band=min(band, n).")
    sep, k = _checks.participation(call, n, band if min_separation is None else min_separation, max_participations)
    kind = _checks.choice(call, "kind", kind, ERROR_KINDS, why="'mean' averages the squared error over the steps, 'max' takes the worst step")
    iters = _checks.positive_int(call, "iters", iters, meaning="iters is the most L-BFGS iterations")
    a = _checks.workload(call, workload, n)
    loss = _loss_fn(n, a, sep, k, kind)
    init = sqrt_prefix(band).toeplitz_coeffs(band)
    one = torch.ones(1, dtype=torch.float64)
    if band == 1:
        return BandedToeplitz((1.0,))
    if sep >= band or k == 1:
        def coeffs(u: Tensor) -> Tensor:
            return torch.cat([one, u])
        u0 = init[1:]
    else:
        def coeffs(u: Tensor) -> Tensor:
            steps = torch.nn.functional.softplus(u)
            return torch.cat([one, torch.flip(torch.cumsum(torch.flip(steps, [0]), 0), [0])])
        u0 = _inv_softplus(torch.cat([init[1:-1] - init[2:], init[-1:]]))
    u = _lbfgs(u0, lambda u: loss(coeffs(u))[0], iters)
    c = coeffs(u).detach()
    value, exact = loss(c)
    if not exact or not math.isfinite(float(value)):
        raise RuntimeError(f"{call}: the optimised strategy left the class with an exact sensitivity (value {float(value)}); this is a bug, please report it.")
    return BandedToeplitz(tuple((c / c.norm()).tolist()))


def _blt_coeffs(log_theta: Tensor, omega: Tensor, n: int) -> Tensor:
    k = torch.arange(max(n - 1, 0), dtype=torch.float64)
    rest = (omega[:, None] * torch.exp(k[None, :] * log_theta[:, None])).sum(0)
    return torch.cat([torch.ones(1, dtype=torch.float64), rest])[:n]


def _initial_gaps(n: int, buffers: int) -> list[Tensor]:
    """Starting points for ``1 - theta``: ``n^(-(i+1)/buffers)`` (slow decays, the square root's
    tail), and geometric spreads from a fast decay of 1/2 to ``1/n`` and to ``1/sqrt(n)``."""
    i = torch.arange(buffers, dtype=torch.float64)
    starts = [float(n) ** (-(i + 1) / buffers)]
    if buffers > 1:
        starts.append(0.5 * (2.0 / n) ** (i / (buffers - 1)))
        starts.append(0.5 * (2.0 / math.sqrt(n)) ** (i / (buffers - 1)))
    return starts


def _merge_buffers(theta: Tensor, omega: Tensor, rtol: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Buffers whose ``theta`` agree to ``rtol`` merged into one (``omega`` summed, ``theta`` their
    ``omega``-weighted mean): the optimum often lets buffers coincide when it needs fewer."""
    order = torch.argsort(theta)
    groups: list[list[int]] = []
    for i in order.tolist():
        if groups and abs(float(theta[i]) - float(theta[groups[-1][-1]])) <= rtol * float(theta[i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    th = torch.stack([(theta[g] * omega[g]).sum() / omega[g].sum() for g in groups])
    om = torch.stack([omega[g].sum() for g in groups])
    return th, om


@_single_threaded
def optimal_blt(
    n: int,
    buffers: int,
    *,
    workload: Tensor | None = None,
    min_separation: int = 1,
    max_participations: int | None = None,
    kind: str = "mean",
    iters: int = 300,
) -> BufferedToeplitz:
    """The BLT strategy with ``buffers`` buffers that minimises the expected error.

    Parameterised as ``theta = sigmoid(u)`` in ``(0, 1)`` and ``omega = softplus(v) > 0``, so the
    Toeplitz coefficients are positive and non-increasing from index 1: the sensitivity is exact
    for every ``min_separation`` / ``max_participations`` (rule 3 of
    :mod:`vmapdp.mf.sensitivity`) and ``C^{-1}`` is a real BLT (:meth:`BufferedToeplitz.inverse`).
    Starts from three spreads of ``theta`` (``1 - n^(-(i+1)/buffers)``, and ``1 - theta``
    geometric from ``1/2`` to ``1/n`` and to ``1/sqrt(n)``), each with ``omega`` fitted by least squares to the
    coefficients of :func:`vmapdp.mf.sqrt_prefix`, and keeps the better local optimum.
    ``workload``: an ``n x n`` tensor (None: prefix sums); ``kind``: ``"mean"`` or ``"max"``
    error. ``buffers=0`` is :func:`identity`'s BLT.

    ``buffers`` is the most buffers used: where the optimum lets several ``theta`` coincide (to
    ``1e-6`` relative; common with several participations, where one buffer can be optimal),
    they are merged into one buffer when that changes the loss by less than ``1e-9`` relative,
    so the result may have fewer buffers (less streaming memory, a well-conditioned inverse).
    """
    call = "optimal_blt"
    n = _checks.positive_int(call, "n", n, meaning="n is the number of steps")
    buffers = _checks.positive_int(call, "buffers", buffers, minimum=0, meaning="buffers is the number of (theta, omega) pairs, the streaming memory in model copies")
    sep, k = _checks.participation(call, n, min_separation, max_participations)
    kind = _checks.choice(call, "kind", kind, ERROR_KINDS, why="'mean' averages the squared error over the steps, 'max' takes the worst step")
    iters = _checks.positive_int(call, "iters", iters, meaning="iters is the most L-BFGS iterations")
    a = _checks.workload(call, workload, n)
    if buffers == 0 or n == 1:
        return BufferedToeplitz((), ())
    loss = _loss_fn(n, a, sep, k, kind)
    target = sqrt_prefix(n).toeplitz_coeffs(n)[1:]
    lags = torch.arange(n - 1, dtype=torch.float64)

    def split(x: Tensor) -> tuple[Tensor, Tensor]:  # (log theta, omega), finite for every x
        return torch.nn.functional.logsigmoid(x[:buffers]), torch.nn.functional.softplus(x[buffers:])

    def objective(x: Tensor) -> Tensor:
        return loss(_blt_coeffs(*split(x), n))[0]

    best = None
    for gap in _initial_gaps(n, buffers):  # 1 - theta, spread over three ranges: the best local optimum wins
        theta0 = (1.0 - gap).clamp(1e-3, 1 - 1e-9)
        basis = torch.exp(lags[:, None] * torch.log(theta0)[None, :])
        omega0 = torch.linalg.lstsq(basis, target[:, None]).solution.flatten().clamp(min=1e-4)
        x = _lbfgs(torch.cat([torch.logit(theta0), _inv_softplus(omega0)]), objective, iters)
        value = float(objective(x).detach())
        if best is None or value < best[0]:
            best = (value, x)
    x = best[1]
    log_theta, omega = (t.detach() for t in split(x))
    theta = log_theta.exp()
    value = loss(_blt_coeffs(log_theta, omega, n))[0]
    merged = _merge_buffers(theta, omega)
    if merged[0].numel() < buffers and float(loss(_blt_coeffs(merged[0].log(), merged[1], n))[0]) <= float(value) * (1 + 1e-9):
        theta, omega = merged
    order = torch.argsort(theta, descending=True)
    blt = BufferedToeplitz(tuple(theta[order].tolist()), tuple(omega[order].tolist()))
    value, exact = loss(blt.toeplitz_coeffs(n))
    if not exact or not math.isfinite(float(value)):
        raise RuntimeError(f"{call}: the optimised strategy left the class with an exact sensitivity (value {float(value)}); this is a bug, please report it.")
    return blt
