"""The privacy loss distribution of one epoch of balls-in-bins (random allocation of 1 of t).

One epoch of ``t`` Gaussian steps (noise multiplier ``s``, sensitivity 1 clip norm) in which
every example goes to one uniformly random step, independently of the others, under add/remove
neighbouring. Chua et al. (AISTATS 2025, Section 3: the adaptive batch linear query mechanism
with balls-and-bins batches, ABLQ_B) show that the pair

    P = (1 / t) sum_j N(e_j, s^2 I_t)    against    Q = N(0, s^2 I_t)

tightly dominates the epoch for adaptively chosen steps (the remove direction is (P, Q), the
add direction (Q, P)); Feldman and Shenfeld (2025) analyse the same pair. Epochs with fresh
assignments compose as independent (adaptively chosen) mechanisms.

With ``Z_j = exp(y_j / s^2 - 1 / (2 s^2))`` the density ratio is ``P / Q (y) = S / t`` with
``S = sum_j Z_j``. Under Q every ``log Z_j`` is N(-1 / (2 s^2), 1 / s^2), independently; under P
one of them (which one does not matter) is N(+1 / (2 s^2), 1 / s^2) instead. So

* remove: the loss ``L = log(S / t)`` under P,
* add: the loss ``-L = log(t / S)`` under Q.

Discretisation (certified: every loss is rounded in the pessimistic direction, pointwise):

* Each ``Z`` is put on a linear grid ``{k d}`` of _MAX_POINTS points from its exact bin masses
  (normal CDF of ``log Z``): rounded UP for the remove law (so ``S`` and ``L`` only grow) and
  DOWN for the add law (``S`` only shrinks, ``-L`` only grows; ``Z`` below the first grid point
  becomes 0 and ``S = 0`` an infinite loss; ``Z`` above the grid's top is clamped to the top).
* Remove law: the lognormal upper tail is long, so a term above ``b`` (where the P term
  exceeds b with probability Phi(-6)) is *big*. The parts "no big term" (fine grid on [0, b]),
  "exactly the P term big" and "exactly one Q term big" (grid spacing ``b * _BIG_REL``: then
  ``S > b``, so the relative rounding of S stays below _BIG_REL) are summed separately; "two or
  more big" is charged its union bound as an infinite loss; a big term above the point where
  the t terms' tail mass is _Z_TAIL is an infinite loss.
* The ``t`` terms are summed by FFT convolution with binary exponentiation. After a
  convolution the sum is cut where the mass beyond is below _CUT (rounded up: charged as an
  infinite sum; rounded down: clamped to the top point) and moved to a grid of doubled spacing,
  in the same direction, while it holds more than _MAX_POINTS points.
* ``L`` is then rounded up to the loss grid ``{k h}`` of :mod:`vmapdp.accounting.pld`.

The result is a loss distribution whose every loss is at least the true one under a coupling,
so its composition (with any other events) gives a delta that is at least the true delta at
every epsilon: ``delta(eps) = E[(1 - e^(eps - L))_+]`` is increasing in each loss. The same
construction with every rounding reversed (and the mass that would be infinite dropped) gives a
loss distribution below the true one: the lower bound, valid for the pair (which a dataset and
an adversary realise; Chua et al. call the pair tight). Both are exact up to float64 rounding
in the FFT, which is ABSOLUTE, about 1e-16 of the vector's total mass per convolution (negative
results clipped at 0): a delta below about 1e-13 is within that rounding and is not certified
(in every case the review checked, the rounding fell on the safe side). dp-accounting's and
opake's PLD code rely on the FFT the same way.

References:
  Chua, Ghazi, Harrison, Leeman, Kamath, Kumar, Manurangsi, Sinha, Zhang. "Balls-and-Bins
  Sampling for DP-SGD." AISTATS 2025 (arXiv:2412.16802).
  Feldman, Shenfeld. "Privacy Amplification by Random Allocation." 2025 (arXiv:2502.08202).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

_F64 = torch.float64
_MAX_POINTS = 1 << 18  # points of one summed distribution (the FFT has twice as many)
_Z_TAIL = 1e-17  # mass of one Z beyond the first grid's top (remove: charged as an infinite loss)
_BIG_REL = 2.5e-4  # relative rounding of a sum that holds a big term
_CUT = 1e-17  # mass beyond a sum's cut after one convolution (remove: charged as infinite)


class _Sum(NamedTuple):
    """Masses at the points ``k * d`` (k = 0 .. n - 1), plus ``inf`` (mass at an infinite sum)."""

    d: float
    mass: torch.Tensor
    inf: float


def _log_normal_masses(edges: torch.Tensor, mean: float, sd: float) -> torch.Tensor:
    """Masses of ``(edges[k], edges[k + 1]]`` for ``Z`` with ``log Z ~ N(mean, sd^2)``; edges
    increasing, >= 0 (0 and inf allowed). Accurate in both tails (upper-tail differences right
    of the median, lower-tail differences left of it)."""
    from vmapdp.accounting.pld import _gauss_bin_masses

    with torch.no_grad():
        x = torch.log(edges)  # log 0 = -inf
    return _gauss_bin_masses(x, mean, sd)


def _z_top(mean: float, sd: float, z: float) -> float:
    """The point ``exp(mean + z sd)``: ``Z`` with ``log Z ~ N(mean, sd^2)`` is above it with
    probability ``Phi(-z)``."""
    return math.exp(mean + z * sd)


def _tail_z(t: int) -> float:
    """z with ``t * Phi(-z) <= _Z_TAIL`` (bisection on the normal tail)."""
    from vmapdp.accounting._special import log_ndtr

    lo, hi = 0.0, 40.0
    target = math.log(_Z_TAIL / t)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if log_ndtr(-mid) > target else (lo, mid)
    return hi


def _discretise(mean: float, sd: float, lo: float, hi: float, d: float, top: float, up: bool) -> _Sum:
    """The part of ``Z`` (``log Z ~ N(mean, sd^2)``) in ``(lo, hi]`` as masses on the grid
    ``{k d}``, each value rounded up (``up``) or down. With ``hi = inf`` the mass above ``top``
    goes to an infinite value (up) or to the grid point at or below ``top`` (down)."""
    end = min(hi, top)
    k_a, k_b = math.floor(lo / d), math.ceil(end / d)
    inner = torch.arange(k_a + 1, k_b, dtype=_F64) * d
    inner = inner[(inner > lo) & (inner < end)]
    edges = torch.cat([torch.tensor([lo], dtype=_F64), inner, torch.tensor([end], dtype=_F64)])
    m = _log_normal_masses(edges, mean, sd)
    if up:
        idx = torch.ceil(edges[1:] / d)
    else:
        idx = torch.floor(edges[:-1] / d)
    idx = torch.clamp(idx.to(torch.int64), min=0)
    n = int(idx.max()) + 1
    mass = torch.zeros(n, dtype=_F64)
    mass.index_add_(0, idx, m)
    inf = 0.0
    if hi == math.inf and top < hi:
        beyond = float(_log_normal_masses(torch.tensor([top, math.inf], dtype=_F64), mean, sd)[0])
        if up:
            inf = beyond
        else:
            mass[-1] += beyond
    return _Sum(d, mass, inf)


def _coarsen(a: _Sum, factor: int, up: bool) -> _Sum:
    """The same sum on the grid {k factor d}, rounding up or down."""
    if factor == 1:
        return a
    n = a.mass.shape[0]
    idx = torch.arange(n)
    new = (idx + factor - 1) // factor if up else idx // factor
    out = torch.zeros(int(new[-1]) + 1, dtype=_F64)
    out.index_add_(0, new, a.mass)
    return _Sum(a.d * factor, out, a.inf)


def _conv(a: _Sum, b: _Sum, up: bool) -> _Sum:
    """The law of the sum of two independent sums (rounded in one direction), on a grid of at
    most _MAX_POINTS points, cut where the mass beyond is at most _CUT."""
    if a is b:  # squaring: one forward transform
        n = 2 * a.mass.shape[0] - 1
        size = 1 << (n - 1).bit_length()
        fa = torch.fft.rfft(a.mass, n=size)
        out = torch.fft.irfft(fa * fa, n=size)[:n]
    else:
        if a.d < b.d:
            a = _coarsen(a, round(b.d / a.d), up)
        elif b.d < a.d:
            b = _coarsen(b, round(a.d / b.d), up)
        n = a.mass.shape[0] + b.mass.shape[0] - 1
        size = 1 << (n - 1).bit_length()
        out = torch.fft.irfft(torch.fft.rfft(a.mass, n=size) * torch.fft.rfft(b.mass, n=size), n=size)[:n]
    out = torch.clamp(out, min=0.0)  # FFT round-off leaves ~1e-17 negatives
    inf = 1.0 - (1.0 - a.inf) * (1.0 - b.inf)
    # cut the top where the mass beyond it is negligible
    tail = torch.flip(torch.cumsum(torch.flip(out, [0]), 0), [0])  # tail[k] = mass at >= k
    beyond = tail <= _CUT
    if bool(beyond.any()):
        k = int(torch.argmax(beyond.to(torch.int8)))  # first index whose tail is negligible
        k = max(k, 1)
        cut = float(tail[k])
        out = out[:k].clone()
        if up:
            inf = inf + cut  # remove law: the sum is rounded up to infinity
        else:
            out[-1] += cut  # add law: clamped down to the top point
    s = _Sum(a.d, out, inf)
    while s.mass.shape[0] > _MAX_POINTS:
        s = _coarsen(s, 2, up)
    return s


def _power(base: _Sum, k: int, up: bool) -> _Sum | None:
    """The sum of ``k`` independent copies (None for k = 0)."""
    out = None
    while k:
        if k & 1:
            out = base if out is None else _conv(out, base, up)
        k >>= 1
        if k:
            base = _conv(base, base, up)
    return out


def _grid(top: float) -> float:
    """Spacing of the linear grid of _MAX_POINTS points on [0, top]."""
    return top / (_MAX_POINTS - 1)


def _scaled(a: _Sum, factor: float) -> _Sum:
    return _Sum(a.d, a.mass * factor, a.inf * factor)


def _remove_laws(s: float, t: int, up: bool) -> list[_Sum]:
    """The law of S = Z_1 + ... + Z_t under P (Z_1 from P, the others from Q), rounded up
    (``up``) or down, as sub-probability parts on their own grids.

    A term is *big* above ``b``, where one term from P exceeds b with probability Phi(-6).
    Parts: no big term (one fine grid on [0, b]); exactly one big term, the P term or one of
    the t - 1 Q terms (then S > b, and a grid of spacing b * _BIG_REL keeps the relative
    rounding of S below _BIG_REL); two or more big terms: at most the union bound (t - 1) pP pQ + C(t - 1, 2)
    pQ^2 (with pP, pQ the probabilities of being big), charged as an infinite loss (up) or
    dropped (down).
    """
    sd = 1.0 / s
    m_q, m_p = -0.5 * sd * sd, 0.5 * sd * sd
    b = _z_top(m_p, sd, 6.0)
    top = _z_top(m_p, sd, _tail_z(t))  # the big terms' grid: above it, charged as infinite
    d = _grid(b)
    zq = _discretise(m_q, sd, 0.0, b, d, b, up)
    zp = _discretise(m_p, sd, 0.0, b, d, b, up)
    if t == 1:
        return [zp, _discretise(m_p, sd, b, math.inf, max(b * _BIG_REL, top / _MAX_POINTS), top, up)]
    rest = _power(zq, t - 2, up)  # t - 2 small Q terms
    one_p = zp if rest is None else _conv(zp, rest, up)  # the P term and t - 2 Q terms, all small
    small_q = zq if rest is None else _conv(zq, rest, up)  # t - 1 small Q terms
    none_big = _conv(zp, small_q, up)
    coarse = max(1, math.floor(max(b * _BIG_REL, top / _MAX_POINTS) / d))
    big_d = coarse * d  # a multiple of the fine grid, so the fine sums can be coarsened onto it
    bp = _discretise(m_p, sd, b, math.inf, big_d, top, up)
    bq = _discretise(m_q, sd, b, math.inf, big_d, top, up)
    p_big = _conv(bp, _coarsen(small_q, coarse, up), up)
    q_big = _scaled(_conv(bq, _coarsen(one_p, coarse, up), up), t - 1)
    pp = float(_log_normal_masses(torch.tensor([b, math.inf], dtype=_F64), m_p, sd)[0])
    pq = float(_log_normal_masses(torch.tensor([b, math.inf], dtype=_F64), m_q, sd)[0])
    two = min(1.0, (t - 1) * pp * pq + 0.5 * (t - 1) * (t - 2) * pq * pq)
    parts = [none_big, p_big, q_big]
    if up:
        parts.append(_Sum(d, torch.zeros(1, dtype=_F64), two))
    return parts


def _add_laws(s: float, t: int, up: bool) -> list[_Sum]:
    """The law of S = Z_1 + ... + Z_t under Q, rounded up (``up``) or down: one grid whose top
    is where one term has mass Phi(-5) above it (rounded down: clamped to the top, which only
    lowers large S, where the add loss log(t / S) is small; rounded up: charged as infinite S,
    loss -inf, i.e. dropped)."""
    sd = 1.0 / s
    m_q = -0.5 * sd * sd
    top = _z_top(m_q, sd, 5.0)
    d = _grid(top)
    return [_power(_discretise(m_q, sd, 0.0, math.inf, d, top, up), t, up)]


class _LossPMF(NamedTuple):
    lo: int  # grid index of mass[0]
    mass: torch.Tensor  # masses at (lo + k) * h
    p_inf: float  # mass at an infinite loss


def _to_loss_grid(laws: list[_Sum], t: int, h: float, remove: bool, up: bool) -> _LossPMF:
    """The loss (remove: log(S / t); add: log(t / S)) of each point of the parts, rounded to the
    grid {k h} up (``up``) or down; infinite losses (S = inf for remove, S = 0 for add) kept as
    p_inf (upper) or dropped (lower)."""
    losses, masses, p_inf = [], [], 0.0
    for law in laws:
        sums = torch.arange(law.mass.shape[0], dtype=_F64) * law.d
        keep = law.mass > 0
        if remove and up:
            p_inf += law.inf
        zero = sums == 0
        if not remove and up:
            p_inf += float(law.mass[zero & keep].sum())
        keep = keep & ~zero  # S = 0: remove loss -inf (no contribution); add: counted above
        loss = torch.log(sums[keep] / t)
        losses.append(-loss if not remove else loss)
        masses.append(law.mass[keep])
    loss, mass = torch.cat(losses), torch.cat(masses)
    idx = (torch.ceil(loss / h) if up else torch.floor(loss / h)).to(torch.int64)
    lo = int(idx.min())
    out = torch.zeros(int(idx.max()) - lo + 1, dtype=_F64)
    out.index_add_(0, idx - lo, mass)
    return _LossPMF(lo, out, min(p_inf, 1.0))


@functools.lru_cache(maxsize=16)
def _laws(s: float, t: int, direction: str, up: bool) -> tuple[_Sum, ...]:
    """The discretised sums of one epoch (the costly part; independent of the loss grid)."""
    if direction == "remove":
        return tuple(_remove_laws(s, t, up))
    return tuple(_add_laws(s, t, not up))  # add: a larger loss is a smaller S


@functools.lru_cache(maxsize=32)
def allocation_pmf(s: float, t: int, h: float, direction: str, up: bool) -> _LossPMF:
    """The loss of one epoch on the grid {k h}, rounded up (``up``: the upper bound) or down
    (the lower bound), for ``direction`` ``"remove"`` or ``"add"``; cached per arguments."""
    return _to_loss_grid(list(_laws(s, t, direction, up)), t, h, direction == "remove", up)
