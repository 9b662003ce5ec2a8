"""Tight accounting with privacy loss distributions (PLD), composed by FFT.

For one Poisson-subsampled Gaussian step (noise multiplier ``s``, sample rate ``q``) the
output distributions for neighbours are the mixture ``P = (1 - q) N(0, s^2) + q N(1, s^2)``
and ``Q = N(0, s^2)`` (the sensitivity is 1 in units of the clip norm). Add/remove
neighbouring gives two directions, *remove* = (P, Q) and *add* = (Q, P); each is composed
over all steps separately and the reported epsilon is the worse of the two.

Discretisation on the grid of losses ``{k * h}`` (h = ``value_discretization_interval``):

* **Upper bound ("connect the dots", Doroshenko et al. 2022).** The probability mass that P
  puts on losses in each interval ``(k h - h, k h]`` is split between the two end points so
  that both the P-mass and the Q-mass of the interval are preserved. The resulting discrete
  pair has a privacy curve that linearly interpolates the true curve in ``exp(epsilon)``
  between grid points; the curve is convex there, so the discrete pair *dominates* the true
  one, and so does its composition. Mass above the top grid point that Q cannot account
  for goes to an infinite loss.
* **Lower bound.** Bin the output by the same loss intervals (a post-processing, so the
  binned pair is dominated by the true pair). Then, for each grid point, merge a piece of
  the bin just below it with a piece of the bin just above it, in the proportion that makes
  the merged atom's loss ``log(P/Q)`` exactly that grid point (splitting and merging atoms
  are post-processings too); the piece sizes are balanced so that almost every bin is used
  up, and what is left is rounded *down* to the grid point below (rounding losses down can
  only lower delta). Where the loss piles up against its bound (``log(1 - q)`` for remove,
  ``-log(1 - q)`` for add) the grid is shifted so that the whole pile-up is one atom exactly
  on a grid point. The result is dominated by the true pair, and so is its composition.

Composition of many steps and of different events (schedules) multiplies the discrete
Fourier transforms; the FFT window is chosen from Chernoff bounds on the composed loss so
that at most ``_TAIL`` mass falls outside it on each side; that mass is added to the upper
delta and subtracted from the lower one. ``upper - lower`` is therefore a certified bound on
the discretisation error of the returned epsilon (up to floating-point rounding in the FFT,
around 1e-12 in delta). Both discretisations move the mean loss by O(h^2) per step, so
the gap shrinks like ``steps * h^2``; by default h is chosen to make it at most 1% of
epsilon.

References:
  Meiser, Mohammadi. "Tight on Budget? Tight Bounds for r-Fold Approximate Differential
  Privacy." CCS 2018.
  Koskela, Jalko, Honkela. "Computing Tight Differential Privacy Guarantees Using FFT."
  AISTATS 2020.
  Gopi, Lee, Wutschitz. "Numerical Composition of Differential Privacy." NeurIPS 2021.
  Doroshenko, Ghazi, Kamath, Kumar, Manurangsi. "Connect the Dots: Tighter Discrete
  Approximations of Privacy Loss Distributions." PoPETs 2022.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple, Sequence

import torch

from vmapdp.accounting import _special, rdp as _rdp

__all__ = ["Allocation", "PLDBounds", "pld_epsilon_bounds", "pld_delta_bounds"]

_F64 = torch.float64
_X_TAIL = 10.0  # single-step grid covers x in [-10 s, 1 + 10 s]; beyond: < 1e-23 mass (kept, see below)
_TAIL = 1e-18  # Chernoff mass allowed outside the FFT window, each side
_MAX_BINS = 1 << 21  # per single-step distribution
_MAX_FFT = 1 << 24
_T_GRID = torch.logspace(-3, 5, 41, dtype=_F64)
_MERGE_SWEEPS = 4


class Allocation(NamedTuple):
    """``count`` epochs of balls-in-bins (random allocation of 1 of ``steps_per_epoch``) with
    the Gaussian mechanism, each with a fresh assignment; add/remove neighbouring
    (:mod:`vmapdp.accounting.allocation`)."""

    noise_multiplier: float
    steps_per_epoch: int
    count: int


class PLDBounds(NamedTuple):
    """Certified bracket from the PLD accountant.

    Fields:
      upper: the reported value, an upper bound (epsilon or delta).
      lower: a lower bound from a dominated discretisation; ``upper - lower`` bounds the
        discretisation error.
      value_discretization_interval: the grid spacing h in loss units that was used.
    """

    upper: float
    lower: float
    value_discretization_interval: float


# ---------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------


def _loss_remove(x: torch.Tensor, s: float, q: float) -> torch.Tensor:
    """log(P/Q)(x) = log(1 - q + q exp((2x - 1) / (2 s^2))), increasing in x."""
    log_1mq = math.log1p(-q) if q < 1.0 else -math.inf
    return torch.logaddexp(torch.full_like(x, log_1mq), math.log(q) + (2.0 * x - 1.0) / (2.0 * s * s))


def _x_of_loss(ell: torch.Tensor, s: float, q: float) -> torch.Tensor:
    """Inverse of _loss_remove: the x with log(P/Q)(x) = ell (-inf at or below log(1-q))."""
    one_m_q = 1.0 - q
    big = ell > math.log(2.0) + (math.log(one_m_q) if q < 1.0 else -math.inf)
    # log(e^ell - (1 - q)), two forms for precision
    a = ell + torch.log1p(-one_m_q * torch.exp(-torch.where(big, ell, torch.zeros_like(ell))))
    b = torch.log(torch.clamp(torch.expm1(torch.where(big, torch.zeros_like(ell), ell)) + q, min=0.0))
    log_diff = torch.where(big, a, b)
    return s * s * (log_diff - math.log(q)) + 0.5


def _gauss_bin_masses(x_edges: torch.Tensor, mean: float, s: float) -> torch.Tensor:
    """N(mean, s^2) masses of (x_edges[k], x_edges[k+1]] (increasing edges), accurate in
    both tails: differences of the upper tail right of the mean, of the lower tail left of it."""
    z = (x_edges - mean) / s
    cdf = torch.special.ndtr(z)
    sf = torch.special.ndtr(-z)
    z1, z2 = z[:-1], z[1:]
    right = sf[:-1] - sf[1:]
    left = cdf[1:] - cdf[:-1]
    mid = 1.0 - cdf[:-1] - sf[1:]
    out = torch.where(z1 >= 0, right, torch.where(z2 <= 0, left, mid))
    return torch.clamp(out, min=0.0)


def _bin_masses(edges: torch.Tensor, s: float, q: float, direction: str):
    """P- and Q-masses of the loss intervals (edges[k], edges[k+1]] for one direction."""
    if direction == "remove":
        xe = _x_of_loss(edges, s, q)
    else:  # add: loss = -loss_remove is decreasing in x; flip to increasing x edges
        xe = torch.flip(_x_of_loss(-edges, s, q), [0])
    n0 = _gauss_bin_masses(xe, 0.0, s)
    n1 = _gauss_bin_masses(xe, 1.0, s)
    if direction == "add":
        n0, n1 = torch.flip(n0, [0]), torch.flip(n1, [0])
    mix = (1.0 - q) * n0 + q * n1
    return (mix, n0) if direction == "remove" else (n0, mix)


class _StepPMF(NamedTuple):
    upper_lo: int  # grid index of upper[0]
    upper: torch.Tensor  # connect-the-dots masses at (upper_lo + k) * h
    p_inf: float  # upper: mass at +inf loss
    lower_lo: int  # grid index of lower[0]
    lower: torch.Tensor  # dominated masses at (lower_lo + k) * h + shift
    shift: float  # in [0, h)


def _scaled(log_x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """exp(log_x) * y without overflow of exp(log_x) (y >= 0; 0 * inf counts as 0)."""
    return torch.where(y > 0, torch.exp(log_x + torch.log(torch.where(y > 0, y, 1.0))), 0.0)


def _lump_point(s: float, q: float, h: float) -> float | None:
    """A loss g0 such that P's mass with remove-loss <= g0 + h, as one atom, has a loss in
    [g0 + 1e-6 h, g0 + h): the pile-up against log(1 - q) becomes one atom that rounds down
    to the grid point g0 at a negligible cost. None if the x range has no such cut.

    The cut is a lower tail {x' <= x}; gap(x) = loss(x) - atom(x) - h is found equal to
    -1e-6 h by bisection, keeping the end point where gap <= -1e-6 h (so the bound holds
    whether or not gap is monotone).
    """
    log_1mq = math.log1p(-q) if q < 1.0 else -math.inf
    log_q = math.log(q)

    def loss(x):  # remove-direction loss at x
        return _special.logaddexp(log_1mq, log_q + (2.0 * x - 1.0) / (2.0 * s * s))

    def gap(x):  # cut loss - atom loss - h; the atom's loss is log(P(x' <= x) / Q(x' <= x))
        ratio = _special.log_ndtr((x - 1.0) / s) - _special.log_ndtr(x / s)
        return loss(x) - _special.logaddexp(log_1mq, log_q + ratio) - h

    target = -1e-6 * h
    lo, hi = -_X_TAIL * s - 1.0, 1.0 + _X_TAIL * s
    if not (gap(lo) <= target < gap(hi)):
        return None
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if gap(mid) <= target:
            lo = mid
        else:
            hi = mid
    return loss(lo) - h


@functools.lru_cache(maxsize=24)
def _step_pmf(s: float, q: float, h: float, direction: str) -> _StepPMF:
    if direction == "replace_one":
        return _symmetrised(_step_pmf(s, q, h, "remove"), h)
    x_lo = torch.tensor([-_X_TAIL * s], dtype=_F64)
    x_hi = torch.tensor([1.0 + _X_TAIL * s], dtype=_F64)
    l_lo, l_hi = float(_loss_remove(x_lo, s, q)), float(_loss_remove(x_hi, s, q))
    e_lo, e_hi = (l_lo, l_hi) if direction == "remove" else (-l_hi, -l_lo)
    i_lo, i_hi = math.floor(e_lo / h), math.ceil(e_hi / h)
    if i_hi - i_lo > _MAX_BINS:  # tiny noise: keep the top, pessimistically lump the rest
        if direction == "remove":
            i_hi = i_lo + _MAX_BINS
        else:
            i_lo = i_hi - _MAX_BINS
    n = i_hi - i_lo + 1
    grid = torch.arange(i_lo, i_hi + 1, dtype=_F64) * h
    inf = torch.tensor([math.inf], dtype=_F64)

    # Upper bound: bins between grid points, each split between its two end points.
    pm, qm = _bin_masses(torch.cat([-inf, grid, inf]), s, q, direction)  # bottom, n-1 inner, top
    upper = torch.zeros(n, dtype=_F64)
    upper[0] += pm[0]
    share_up = (pm[1:-1] - _scaled(grid[:-1], qm[1:-1])) / (-math.expm1(-h))
    share_up = torch.minimum(torch.clamp(share_up, min=0.0), pm[1:-1])
    upper[1:] += share_up
    upper[:-1] += pm[1:-1] - share_up
    to_top = min(float(pm[-1]), float(_scaled(grid[-1:], qm[-1:])))
    upper[-1] += to_top
    p_inf = max(float(pm[-1]) - to_top, 0.0)

    # Lower bound, on the grid shifted so that the pile-up of losses at the end where the
    # loss is bounded (log(1 - q) for remove, -log(1 - q) for add) is one atom on a grid point
    g0 = _lump_point(s, q, h)
    zero = torch.zeros(1, dtype=_F64)
    if g0 is None:  # no pile-up to lump (q = 1, or a very coarse grid): plain grid
        lower, lower_lo, shift = _merge_down(pm, qm, grid, h), i_lo, 0.0
    elif direction == "remove":  # P-mass with loss <= g0 + h is one atom, rounded to g0
        k0 = math.floor(g0 / h)
        shift = g0 - k0 * h
        top = min(max(math.ceil((e_hi - shift) / h), k0 + 2), k0 + _MAX_BINS)
        g = torch.arange(k0, top + 1, dtype=_F64) * h + shift  # g0, g0 + h, .., top
        pl, ql = _bin_masses(torch.cat([-inf, g[1:], inf]), s, q, direction)  # atom first
        lower = _merge_down(torch.cat([zero, pl]), torch.cat([zero, ql]), g, h, bottom_exact=True)
        lower_lo = k0
    else:  # mirror image: P-mass with loss > -g0 - h is one atom, at the top point -g0
        k_top = math.floor(-g0 / h)
        shift = -g0 - k_top * h
        bottom = max(min(math.floor((e_lo - shift) / h), k_top - 2), k_top - _MAX_BINS)
        g = torch.arange(bottom, k_top + 1, dtype=_F64) * h + shift  # .., -g0 - h, -g0
        pl, ql = _bin_masses(torch.cat([-inf, g[:-1], inf]), s, q, direction)  # atom last
        lower = _merge_down(torch.cat([pl, zero]), torch.cat([ql, zero]), g, h, top_exact=True)
        lower_lo = bottom
    return _StepPMF(i_lo, upper, p_inf, lower_lo, lower, shift)


def _symmetrised(rem: _StepPMF, h: float) -> _StepPMF:
    """The replace-one step of fixed-size sampling without replacement, from the remove step.

    ``rem`` is the remove direction of the Poisson pair at (s, q) = (noise_multiplier / 2,
    batch_size / num_samples). Its upper PMF keeps its losses above 0; each loss ``l > 0`` is
    mirrored to ``-l`` with mass ``exp(-l)`` times its own; what is left is an atom at loss 0.
    The result is the privacy loss distribution of a symmetric pair whose hockey-stick
    divergence equals the remove pair's for every ``e^eps >= 1`` and, by symmetry, is its
    reverse's for ``e^eps < 1`` (see :func:`pld_epsilon_bounds`). The lower PMF stays the
    remove direction's: a lower bound on the true epsilon (see there).
    """
    idx = torch.arange(rem.upper.shape[0]) + rem.upper_lo
    pos = idx > 0
    top = int(idx[-1]) if bool(pos.any()) else 0
    upper = torch.zeros(2 * top + 1, dtype=_F64)
    k = idx[pos]
    mass = rem.upper[pos]
    upper[top + k] = mass
    upper[top - k] = mass * torch.exp(-k.to(_F64) * h)
    rest = 1.0 - rem.p_inf - float(upper.sum())
    if rest < -1e-9:  # the remove pair has P(L > 0) + Q(L > 0) <= 1; rounding only
        raise RuntimeError(f"pld: symmetrised replace-one step has negative mass at loss 0 ({rest:.3g}); please report.")
    upper[top] = max(rest, 0.0)
    return _StepPMF(-top, upper, rem.p_inf, rem.lower_lo, rem.lower, rem.shift)


def _merge_down(
    pm: torch.Tensor,
    qm: torch.Tensor,
    grid: torch.Tensor,
    h: float,
    *,
    bottom_exact: bool = False,
    top_exact: bool = False,
) -> torch.Tensor:
    """A discrete pair on ``grid`` dominated by the binned pair (post-processing + rounding down).

    ``pm``, ``qm``: P- and Q-masses of the bins (-inf, g_0], (g_0, g_1], ..., (g_n-1, inf).
    Bin k holds the losses in (g_k, g_k+1], so its loss ratio lies in that interval. For each
    inner grid point g_k+1 a fraction a_k of bin k (below g_k+1) and b_k = rho_k a_k of bin
    k+1 (above it) are merged into one atom whose loss is exactly g_k+1 (splitting and merging
    are post-processings). With u_k = 1 / (1 + rho_k), a_k = u_k and b_k = 1 - u_k balance the
    pieces exactly when rho varies slowly; a factor theta keeps every bin's two pieces within
    its mass. Remainders are rounded down to g_k, the top tail to the top point; the bottom
    tail is dropped (rounded down to -inf). With ``bottom_exact`` the first inner bin is a
    lumped atom whose loss ratio is exactly its lower end point (its remainder costs
    nothing); with ``top_exact`` the last inner bin's loss ratio is exactly its upper end
    point and its remainder stays there.
    """
    n = grid.shape[0]
    a_in, q_in = pm[1:-1], qm[1:-1]  # n - 1 inner bins
    lower = torch.zeros(n, dtype=_F64)
    lower[-1] += pm[-1]
    if n < 2:
        return lower
    below = torch.clamp(_scaled(grid[1:], q_in) - a_in, min=0.0)  # bin k vs g_k+1
    above = torch.clamp(a_in - _scaled(grid[:-1], q_in), min=0.0)  # bin k vs g_k
    num, den = below[:-1], above[1:]  # merge at g_k+1: bin k (below) with bin k + 1 (above)
    ok = (num > 0) & (den > 0) & (a_in[:-1] > 0) & (a_in[1:] > 0)
    rho = torch.where(ok, num / torch.where(ok, den, 1.0), 1.0)
    u = 1.0 / (1.0 + rho)
    # A lumped atom sits exactly on its grid point and needs no merging: give it the share
    # that keeps its neighbour bin balanced instead (its own remainder costs nothing).
    free = ok.clone()  # merge fractions the sweeps below may raise
    if bottom_exact and u.shape[0] >= 2 and bool(ok[0]):
        u[0] = torch.clamp((1.0 - u[1]) / rho[0], max=1.0 / max(float(rho[0]), 1.0))
        free[0] = False
    if top_exact and u.shape[0] >= 2 and bool(ok[-1]):
        u[-1] = torch.clamp(u[-2], max=1.0 / max(float(rho[-1]), 1.0))
        free[-1] = False
    u = torch.where(ok, u, 0.0)
    rho = torch.where(ok, rho, 0.0)
    # bin k gives u_k up and rho_k-1 u_k-1 down; where that exceeds the bin, shrink both
    # merges touching it by the same factor (theta), which makes every bin fit
    wanted = torch.cat([u, u.new_zeros(1)]) + torch.cat([u.new_zeros(1), rho * u])
    theta_bin = 1.0 / torch.clamp(wanted, min=1.0)
    theta = torch.minimum(theta_bin[:-1], theta_bin[1:])
    a = u * theta  # fraction of bin k merged up at g_k+1 (feasible)
    # Raise the fractions to a maximal feasible point: bin k's pieces a_k (up) and
    # rho_k-1 a_k-1 (down) must fit in it; even and odd k alternately (each half-sweep
    # keeps feasibility because a_k only shares constraints with a_k-1 and a_k+1).
    lim = torch.where(ok, 1.0 / torch.clamp(rho, min=1.0), 0.0)
    for _ in range(_MERGE_SWEEPS):
        for parity in (0, 1):
            prev_down = torch.cat([a.new_zeros(1), rho[:-1] * a[:-1]])  # rho_k-1 a_k-1
            next_up = torch.cat([a[1:], a.new_zeros(1)])  # a_k+1
            cap = torch.minimum(1.0 - prev_down, (1.0 - next_up) / torch.where(ok, rho, 1.0))
            cap = torch.clamp(torch.minimum(cap, lim), min=0.0)
            sel = torch.zeros_like(ok)
            sel[parity::2] = True
            a = torch.where(sel & free, torch.maximum(a, cap), a)
    frac_up = a  # of bin k, to g_k+1
    frac_down = rho * a  # of bin k + 1, to g_k+1
    used = torch.zeros(n - 1, dtype=_F64)
    used[:-1] += frac_up
    used[1:] += frac_down
    rest = torch.clamp(1.0 - used, min=0.0)
    lower[1:-1] += frac_up * a_in[:-1] + frac_down * a_in[1:]
    if top_exact:
        lower[:-2] += rest[:-1] * a_in[:-1]  # remainder of bin k rounded down to g_k
        lower[-1] += rest[-1] * a_in[-1]  # the top atom is exactly at the top point
    else:
        lower[:-1] += rest * a_in  # remainder of bin k rounded down to g_k
    return lower


# ---------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------


def _log_mgf(pmf: torch.Tensor, lo: int, h: float, t: torch.Tensor) -> torch.Tensor:
    loss = (torch.arange(pmf.shape[0], dtype=_F64) + lo) * h
    return torch.logsumexp(torch.log(pmf)[None, :] + t[:, None] * loss[None, :], dim=1)


def _window(parts, h: float) -> tuple[int, int]:
    """Grid-index range holding all but _TAIL of the composed mass on each side (Chernoff)."""
    trivial_lo = sum(c * min(p.upper_lo, p.lower_lo) for p, c in parts)
    trivial_hi = sum(
        c * max(p.upper_lo + p.upper.shape[0], p.lower_lo + p.lower.shape[0]) for p, c in parts
    )
    log_tail = math.log(_TAIL)
    w_lo, w_hi = math.inf, -math.inf
    for which in ("upper", "lower"):
        up = torch.zeros_like(_T_GRID)
        down = torch.zeros_like(_T_GRID)
        for p, c in parts:
            pmf, lo = getattr(p, which), getattr(p, which + "_lo")
            up = up + c * _log_mgf(pmf, lo, h, _T_GRID)
            down = down + c * _log_mgf(pmf, lo, h, -_T_GRID)
        w_hi = max(w_hi, float(((up - log_tail) / _T_GRID).min()))
        w_lo = min(w_lo, float(((log_tail - down) / _T_GRID).max()))
    return max(math.floor(w_lo / h) - 2, trivial_lo - 1), min(math.ceil(w_hi / h) + 2, trivial_hi)


def _fft_size(n: int) -> int:
    m = 1 << max(4, (n - 1).bit_length())
    return 3 * (m // 4) if 3 * (m // 4) >= n else m


def _compose(parts, which: str, w_lo: int, size: int) -> tuple[torch.Tensor, float]:
    """Masses of the composed loss at grid indices w_lo .. w_lo + size - 1 (circular FFT), and the
    delta its FFT rounding may move (see below)."""
    prod = None
    base = 0
    for p, c in parts:
        pmf, lo = getattr(p, which), getattr(p, which + "_lo")
        arr = torch.zeros(size, dtype=_F64)
        arr.index_add_(0, torch.arange(pmf.shape[0]) % size, pmf)
        f = torch.pow(torch.fft.rfft(arr), c)
        prod = f if prod is None else prod * f
        base += c * lo
    out = torch.fft.irfft(prod, n=size)
    # FFT rounding moves every entry by about the same absolute amount, which the power above
    # multiplies ~count-fold: the largest negative entry (a true mass cannot be negative)
    # estimates it (an estimate, not a proven bound). Zeroed, and delta widened by twice that per
    # entry: 1e-12 or less at a delta of 1e-5, but below ~1e-11 after 1e5 steps it dominates
    # (found by review: the bracket closed on one value far above the truth, its lower end no
    # bound), so the bracket now says so
    rounding = 2.0 * max(-float(out.min()), 0.0) * size
    return torch.clamp(torch.roll(out, shifts=(base - w_lo) % size), min=0.0), rounding


class _Composed(NamedTuple):
    loss: torch.Tensor  # [M] loss values, increasing
    mass: torch.Tensor  # [M]
    p_inf: float
    slack: float  # delta correction: + for the upper bound, - for the lower bound
    rounding: float = 0.0  # this composition's estimate of the FFT's rounding (see _compose); _directions adds it to |slack|


def _allocation_pmf(s: float, t: int, h: float, direction: str) -> _StepPMF:
    """One balls-in-bins epoch as a step: its upper and lower loss distributions."""
    from vmapdp.accounting.allocation import allocation_pmf

    up = allocation_pmf(s, t, h, direction, True)
    lo = allocation_pmf(s, t, h, direction, False)
    return _StepPMF(up.lo, up.mass, up.p_inf, lo.lo, lo.mass, 0.0)


def _part(e, h: float, direction: str):
    """(step distributions, count) of one event: a Poisson triple or an :class:`Allocation`."""
    if isinstance(e, Allocation):
        if direction not in ("remove", "add"):
            raise ValueError("pld: balls-in-bins epochs are analysed under add/remove only.")
        return _allocation_pmf(e.noise_multiplier, e.steps_per_epoch, h, direction), e.count
    s, q, c = e
    return _step_pmf(s, q, h, direction), c


def _compose_direction(events, h: float, direction: str) -> tuple[_Composed, _Composed]:
    parts = [_part(e, h, direction) for e in events]
    w_lo, w_hi = _window(parts, h)
    size = _fft_size(w_hi - w_lo + 1)
    if size > _MAX_FFT:
        raise ValueError(
            f"epsilon(accountant='pld'): value_discretization_interval={h:.3g} needs an FFT of "
            f"{size} points (> {_MAX_FFT}). Pass a larger value_discretization_interval or "
            "eps_error, or use accountant='rdp'."
        )
    idx = torch.arange(w_lo, w_lo + size, dtype=_F64)
    upper, upper_rounding = _compose(parts, "upper", w_lo, size)
    lower, lower_rounding = _compose(parts, "lower", w_lo, size)
    p_inf = -math.expm1(sum(c * math.log1p(-p.p_inf) for p, c in parts))
    shift = sum(c * p.shift for p, c in parts)
    return (
        _Composed(idx * h, upper, p_inf, _TAIL, upper_rounding),
        _Composed(idx * h + shift, lower, 0.0, -2.0 * _TAIL, lower_rounding),
    )


def _delta_at(c: _Composed, epsilon: float) -> float:
    keep = c.loss > epsilon
    d = c.p_inf + float((c.mass[keep] * -torch.expm1(epsilon - c.loss[keep])).sum()) + c.slack
    return min(max(d, 0.0), 1.0)


def _epsilon_at(c: _Composed, delta: float) -> float:
    """Smallest epsilon >= 0 with delta(epsilon) <= delta, solved exactly between grid points.

    delta(eps) = p_inf + sum_{loss > eps} mass * (1 - exp(eps - loss)); with suffix sums
    SP_k = sum_{j >= k} mass_j and log SQ_k = log sum_{j >= k} mass_j exp(-loss_j) (in log
    space: losses can exceed 700), on (loss_k-1, loss_k] it is p_inf + SP_k - exp(eps) SQ_k.
    """
    target = delta - c.slack
    if c.p_inf >= target:
        return math.inf
    keep = (c.loss > 0) & (c.mass > 0)
    loss, mass = c.loss[keep], c.mass[keep]
    if loss.numel() == 0:
        return 0.0
    sp = torch.flip(torch.cumsum(torch.flip(mass, [0]), 0), [0])
    log_sq = torch.flip(torch.logcumsumexp(torch.flip(torch.log(mass) - loss, [0]), 0), [0])
    sp_next = torch.cat([sp[1:], sp.new_zeros(1)])
    log_sq_next = torch.cat([log_sq[1:], log_sq.new_full((1,), -math.inf)])
    d_grid = c.p_inf + sp_next - torch.exp(loss + log_sq_next)  # delta at eps = loss_k
    if c.p_inf + float(sp[0]) - math.exp(float(log_sq[0])) <= target:  # delta at eps = 0
        return 0.0
    below = d_grid <= target
    if not bool(below.any()):
        return math.inf
    k = int(torch.argmax(below.to(torch.int8)))  # first grid loss with delta <= target
    num = c.p_inf + float(sp[k]) - target
    eps = math.log(num) - float(log_sq[k]) if num > 0 else float(loss[k])
    lo = float(loss[k - 1]) if k > 0 else 0.0
    return min(max(eps, lo, 0.0), float(loss[k]))


_DIRECTIONS = {"add_remove": ("remove", "add"), "replace_one": ("replace_one", "remove")}


def _directions(events, h, relation):
    """(upper, lower) composed pairs, one per direction the relation needs; for replace-one the
    symmetric pair first (its upper is the bound), then the remove pair (the lower bound, and
    its upper to measure the discretisation error alone)."""
    pairs = [_compose_direction(events, h, d) for d in _DIRECTIONS[relation]]
    # the rounding is an estimate (from the negative entries a composition happens to have; found
    # by review: one with none had its error too): every composition is widened by the largest,
    # the upper one's delta up, the lower one's down
    r = max(c.rounding for pair in pairs for c in pair)
    return [(up._replace(slack=up.slack + r, rounding=r), lo._replace(slack=lo.slack - r, rounding=r)) for up, lo in pairs]


def _read(parts, relation, value):
    """(upper, lower, discretised upper of the lower's pair) of ``value`` over the directions."""
    if relation == "replace_one":
        sym, rem = parts
        return value(sym[0]), value(rem[1]), value(rem[0])
    up = max(value(p[0]) for p in parts)
    return up, max(value(p[1]) for p in parts), up


def _private_events(events):
    """events: (noise_multiplier, sample_rate, count) triples with 0 < q, finite noise, and
    :class:`Allocation` epochs."""
    out = []
    for e in events:
        if isinstance(e, Allocation):
            if e.count > 0:
                out.append(Allocation(float(e.noise_multiplier), int(e.steps_per_epoch), int(e.count)))
            continue
        s, q, c = e
        if q > 0.0 and c > 0:
            out.append((float(s), float(q), int(c)))
    return out


def _as_poisson(e):
    """A Poisson triple standing in for ``e`` where only a scale is needed (the first grid):
    an epoch of t steps as t steps at rate 1 / t."""
    if isinstance(e, Allocation):
        return (e.noise_multiplier, 1.0 / e.steps_per_epoch, e.steps_per_epoch * e.count)
    return e


def _initial_interval(events, tol: float) -> float:
    """Grid spacing predicted to give a certified gap of about tol / 2.

    The gap between the two bounds grows like the total shift of the mean loss between the
    upper and the lower discretisation, sum(count * shift_per_step(h)) with shift ~ h^2; the
    single-step distributions are cheap, so h is tuned on them before any FFT. The first
    guess resolves one step's loss (about sample_rate * sqrt(exp(1 / noise^2) - 1) in size).
    """
    alloc = sum(e.count for e in events if isinstance(e, Allocation))  # epochs: loss rounding only
    events = [e for e in events if not isinstance(e, Allocation)]
    if not events:  # the epochs' grid of sums is fixed; the loss grid adds at most h per epoch
        return min(max(0.25 * tol / alloc, 1e-5), 1e-2)
    steps = sum(c for _, _, c in events)
    scale = min(q * math.sqrt(math.expm1(min(1.0 / (s * s), 700.0))) for s, q, _ in events)
    h = min(max(min(math.sqrt(tol / (4.0 * steps)), scale / 10.0), 1e-6), 0.05)
    for _ in range(4):
        shift = 0.0
        for s, q, c in events:
            for direction in ("remove", "add"):
                p = _step_pmf(s, q, h, direction)
                upper_loss = (torch.arange(p.upper.shape[0], dtype=_F64) + p.upper_lo) * h
                lower_loss = (torch.arange(p.lower.shape[0], dtype=_F64) + p.lower_lo) * h + p.shift
                shift = max(shift, c * float((p.upper * upper_loss).sum() - (p.lower * lower_loss).sum()))
        shift += alloc * h
        if shift <= 0.0:
            break
        ratio = math.sqrt(0.5 * tol / shift)
        h_next = min(max(h * ratio, 1e-6), 0.05)
        if 0.8 <= ratio <= 1.25 or h_next == h:
            h = min(h, h_next)
            break
        h = h_next
    return h


def pld_epsilon_bounds(
    events: Sequence[tuple[float, float, int]],
    *,
    delta: float,
    eps_error: float | None = None,
    value_discretization_interval: float | None = None,
    relation: str = "add_remove",
) -> PLDBounds:
    """Epsilon bracket for a composition of Poisson-subsampled Gaussian steps, or of
    fixed-size (without replacement) Gaussian steps under replace-one.

    ``relation="add_remove"``: each event is Poisson-subsampled with (noise multiplier, rate),
    or an :class:`Allocation` (balls-in-bins epochs, :mod:`vmapdp.accounting.allocation`);
    both directions are composed and the worse is reported; ``lower`` and ``upper`` bracket
    the true epsilon up to the discretisation. An epoch's grid of sums is fixed, so with
    allocation events and no ``eps_error`` the grid is refined only while the gap shrinks, and
    the bracket is returned as it is (it can be wider than 1%; both ends stay certified).

    ``relation="replace_one"``: each event is a step on a batch of ``b`` examples drawn
    without replacement from ``n``, passed as ``(noise_multiplier / 2, b / n, count)`` (the
    replace-one sensitivity is 2 clip norms; a full-batch Gaussian is rate 1). Write ``R`` for
    the remove pair at these parameters, ``P = (1 - q) N(0, s^2) + q N(1, s^2)`` against
    ``Q = N(0, s^2)``, and ``H_a`` for the hockey-stick divergence.

    * Upper bound. For neighbours D, D' (example i replaced), couple the batches: draw ``b``
      of the other ``n - 1`` examples and one ``j`` among them; the batch without i is that
      set, the batch with i swaps j for i. Given the coupling both outputs are
      ``(1 - q) A + q B`` and ``(1 - q) A + q B'`` with A, B, B' Gaussians whose means are at
      most 2 clip norms apart, so advanced joint convexity (Balle, Barthe, Gaboardi 2018,
      Theorem 2) and joint convexity give ``H_a(M(D) || M(D')) <= H_a(R)`` for every
      ``a >= 1``, in either order. For ``a < 1``, ``H_a(X || Y) = 1 - a + a H_{1/a}(Y || X)``
      then bounds it by the symmetric pair built from R (:func:`_symmetrised`). That pair
      dominates every ordered pair of neighbours at every ``a >= 0``, so its composition
      bounds the composed mechanism (Zhu, Dong, Wang 2022, Theorem 10); its discretisation is
      connect-the-dots applied to R, which dominates R. It is the smallest pair that dominates
      both orders of R (its divergence is the larger of the two orders' at every ``a``), and
      both orders occur as single steps (below), so no accountant that composes one dominating
      pair per step can report less.
    * Lower bound. If every other example equals the replacement and the replaced example is
      its opposite (two unit vectors), the two outputs are exactly R's P and Q at every step,
      so the true epsilon is at least R's composed epsilon; ``lower`` is the dominated
      discretisation of that composition. ``upper - lower`` is then the discretisation error
      plus the gap between the symmetric pair and R (about 10-15% of epsilon at typical
      settings, e.g. 14.82 against 13.36 at noise 1, b / n = 0.01, 1000 steps, delta 1e-5);
      the grid is refined on the discretisation error of R alone. The true epsilon lies in
      between: an adaptive adversary can choose, step by step, which of the two orders of R
      a step realises, so R's own composition is not known to be an upper bound.

    Args:
      events: (noise_multiplier, sample_rate, count) triples (validated by the caller).
      delta: target delta in (0, 1).
      eps_error: largest accepted ``upper - lower``; the grid is refined until it holds.
        Default: 1% of the upper bound (at least 1e-4).
      value_discretization_interval: fixed grid spacing h; no refinement when given.
      relation: ``"add_remove"`` or ``"replace_one"`` (above).

    Returns:
      :class:`PLDBounds` with ``lower <= true epsilon <= upper``.

    References:
      Balle, Barthe, Gaboardi. "Privacy Amplification by Subsampling: Tight Analyses via
      Couplings and Divergences." NeurIPS 2018.
      Zhu, Dong, Wang. "Optimal Accounting of Differential Privacy via Characteristic
      Function." AISTATS 2022.
    """
    events = _private_events(events)
    if not events:
        return PLDBounds(0.0, 0.0, value_discretization_interval or 0.0)

    def run(h):
        up, lo, same_pair = _read(_directions(events, h, relation), relation, lambda c: _epsilon_at(c, delta))
        return PLDBounds(up, min(lo, up), h), same_pair - lo

    if value_discretization_interval is not None:
        return run(value_discretization_interval)[0]
    tol_of = (lambda up: eps_error) if eps_error is not None else (lambda up: max(0.01 * up, 1e-4))
    # scale from RDP (an upper bound) to pick the first grid
    r = sum(c * torch.tensor(_rdp._rdp_cached(s, q, _rdp.DEFAULT_ORDERS), dtype=_F64) for s, q, c in map(_as_poisson, events))
    eps_rdp = float(_rdp.rdp_to_epsilon(r, _rdp.DEFAULT_ORDERS, delta))
    if math.isinf(eps_rdp):
        eps_rdp = 100.0
    h = _initial_interval(events, tol_of(eps_rdp))
    fixed_part = eps_error is None and any(isinstance(e, Allocation) for e in events)
    last_gap = math.inf
    for _ in range(6):
        res, gap = run(h)  # the discretisation error (for replace-one: of the remove pair)
        tol = tol_of(res.upper)
        if gap <= tol or math.isinf(res.upper):
            return res
        if fixed_part and gap > 0.8 * last_gap:
            # balls-in-bins epochs: their grid of sums is fixed, so the gap stops shrinking with
            # h; by default the bracket is reported as it is (still certified both ways)
            return res
        last_gap = gap
        h = max(h * min(math.sqrt(0.7 * tol / gap), 0.8), h / 8)
    warnings.warn(
        f"epsilon(accountant='pld'): discretisation error {gap:.3g} is above the requested "
        f"{tol:.3g} after refining to value_discretization_interval={res.value_discretization_interval:.3g}; "
        "returning the (still valid) upper bound.",
        UserWarning,
        stacklevel=3,
    )
    return res


def pld_delta_bounds(
    events: Sequence[tuple[float, float, int]],
    *,
    epsilon: float,
    eps_error: float | None = None,
    value_discretization_interval: float | None = None,
    relation: str = "add_remove",
) -> PLDBounds:
    """Delta bracket at ``epsilon``: ``lower <= true delta(epsilon) <= upper`` (``relation`` as
    in :func:`pld_epsilon_bounds`).

    Without ``value_discretization_interval`` the grid is refined until the upper bound is at
    most the lower bound at ``epsilon - eps_error`` (default eps_error: 1% of epsilon, at least
    1e-4), i.e. the reported delta is no larger than the true delta at ``epsilon - eps_error``.
    """
    events = _private_events(events)
    if not events:
        return PLDBounds(0.0, 0.0, value_discretization_interval or 0.0)

    def run(h, eps_lo):
        parts = _directions(events, h, relation)
        up, lo, _ = _read(parts, relation, lambda c: _delta_at(c, epsilon))
        lo_shifted = _read(parts, relation, lambda c: _delta_at(c, eps_lo))[1]
        same_pair = _read(parts, relation, lambda c: _delta_at(c, epsilon))[2]
        return PLDBounds(up, min(lo, up), h), same_pair <= lo_shifted

    if value_discretization_interval is not None:
        return run(value_discretization_interval, epsilon)[0]
    err = eps_error if eps_error is not None else max(0.01 * epsilon, 1e-4)
    eps_lo = max(epsilon - err, 0.0)
    h = _initial_interval(events, err)
    fixed_part = eps_error is None and any(isinstance(e, Allocation) for e in events)
    for i in range(6):
        res, certified = run(h, eps_lo)  # for replace-one: the remove pair's discretisation
        if certified or res.upper == 0.0 or (fixed_part and i >= 1):  # epochs: see pld_epsilon_bounds
            return res
        h = h / 2
    warnings.warn(
        f"delta(accountant='pld'): could not certify eps_error={err:.3g} after refining to "
        f"value_discretization_interval={h:.3g}; returning the (still valid) upper bound.",
        UserWarning,
        stacklevel=3,
    )
    return res
