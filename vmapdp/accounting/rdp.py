"""Renyi DP of the Poisson-subsampled Gaussian mechanism, exact at every order.

For noise multiplier ``s`` and sample rate ``q``, one step has RDP of order ``a``

    rdp(a) = log(A_a) / (a - 1),   A_a = E_{z ~ N(0, s^2)} [(1 - q + q exp((2z - 1) / (2 s^2)))^a]

(add/remove neighbours; this direction dominates the other one). ``A_a`` is evaluated in log
space: at integer orders as the finite binomial sum, at fractional orders as the two
convergent series of Mironov, Talwar and Zhang (2019, Sec. 3.3), summed as an alternating
series that is cut after a positive term, so the truncated value is never below the true
one. RDP adds over steps and over events at each order, so schedules are exact.

Conversion to (epsilon, delta) uses the bound of Balle et al. (2020) / Canonne, Kamath and
Steinke (2020)::

    epsilon = min_a  rdp(a) + log((a - 1) / a) - (log(delta) + log(a)) / (a - 1)

together with ``epsilon = 0`` whenever ``delta >= sqrt(1 - exp(-rdp(a)))`` (total variation
bounded through KL <= rdp(a) by the Bretagnolle-Huber inequality), and never below 0.

References:
  Mironov. "Renyi Differential Privacy." CSF 2017.
  Mironov, Talwar, Zhang. "Renyi Differential Privacy of the Sampled Gaussian Mechanism." 2019.
  Balle, Barthe, Gaboardi, Hsu, Sato. "Hypothesis Testing Interpretations and Renyi
  Differential Privacy." AISTATS 2020.
  Canonne, Kamath, Steinke. "The Discrete Gaussian for Differential Privacy." NeurIPS 2020.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from vmapdp.accounting import _checks

__all__ = [
    "DEFAULT_ORDERS",
    "rdp_poisson_gaussian",
    "rdp_to_epsilon",
    "rdp_to_delta",
]

_F64 = torch.float64


def _default_orders() -> tuple[float, ...]:
    orders = [1.0 + x / 20.0 for x in range(1, 20)]  # 1.05 .. 1.95
    orders += [round(2.0 + x / 10.0, 10) for x in range(0, 90)]  # 2.0 .. 10.9 (Opacus's grid)
    orders += [float(a) for a in range(11, 64)]  # 11 .. 63
    base = 64
    while base < 1024:  # 64 .. 1024, four per octave: small-epsilon regimes need them
        orders += [float(base * m) for m in (1.0, 1.25, 1.5, 1.75)]
        base *= 2
    orders += [1024.0, 1536.0, 2048.0, 3072.0, 4096.0, 6144.0, 8192.0]
    return tuple(orders)


#: The default grid of Renyi orders: every 0.05 below 2 and every 0.1 up to 10.9 (where
#: moderate and large epsilons are decided; a superset of Opacus's grid), every integer to
#: 63, then four per octave up to 1024 and two per octave up to 8192 (small epsilons: large
#: noise, few steps, small delta need orders in the thousands).
DEFAULT_ORDERS: tuple[float, ...] = _default_orders()

# Fractional-order series: stop after a positive term below exp(_LOG_TERM_TOL) times the
# size of A - 1 (at most ~1e-7 relative error on rdp, always on the high side).
_LOG_TERM_TOL = -16.0
_MAX_TERMS = 1 << 13
# added to log A: the float64 rounding of its sums (terms of magnitude up to ~A ~ 1, a few dozen
# per block), which at large noise is comparable to log A itself (found by review: sigma 50,
# q 1e-4, order 1.05 came out 4e-4 relative below the exact value). 128 ulp of 1: the RDP of
# usual settings moves by ~1e-14 / (a - 1) per step, epsilon by a relative ~1e-9 or less
_LOG_A_ROUNDING = 128 * 2.0**-53
_CHUNK = 32  # (noise, rate) pairs per vectorised pass


@functools.lru_cache(maxsize=16)
def _int_order_tables(int_orders: tuple[int, ...]):
    """Flat tables for the integer-order binomial sums: k, alpha, log C(alpha, k), segment."""
    ks, alphas, segs = [], [], []
    for s, a in enumerate(int_orders):
        ks.append(torch.arange(a + 1, dtype=_F64))
        alphas.append(torch.full((a + 1,), float(a), dtype=_F64))
        segs.append(torch.full((a + 1,), s, dtype=torch.long))
    k = torch.cat(ks)
    alpha = torch.cat(alphas)
    seg = torch.cat(segs)
    log_binom = torch.lgamma(alpha + 1) - torch.lgamma(k + 1) - torch.lgamma(alpha - k + 1)
    return k, alpha, seg, log_binom


def _log_a_int(sigma: torch.Tensor, q: torch.Tensor, int_orders: tuple[int, ...]) -> torch.Tensor:
    """log A_a at integer orders; sigma, q: [P] with 0 < q < 1. Returns [P, len(int_orders)]."""
    k, alpha, seg, log_binom = _int_order_tables(int_orders)
    P, O = sigma.shape[0], len(int_orders)
    log_q = torch.log(q)[:, None]
    log_1mq = torch.log1p(-q)[:, None]
    inv2s2 = (0.5 / sigma**2)[:, None]
    terms = log_binom + k * log_q + (alpha - k) * log_1mq + (k * k - k) * inv2s2  # [P, F]
    seg_p = seg.expand(P, -1)
    peak = torch.full((P, O), -math.inf, dtype=_F64).scatter_reduce(1, seg_p, terms, "amax")
    total = torch.zeros((P, O), dtype=_F64).scatter_add(1, seg_p, torch.exp(terms - peak.gather(1, seg_p)))
    return peak + torch.log(total)


def _log_a_frac(sigma: torch.Tensor, q: torch.Tensor, frac_orders: tuple[float, ...]) -> torch.Tensor:
    """log A_a at fractional orders by the Mironov-Talwar-Zhang series; [P, len(frac_orders)].

    The tail (i > a) alternates in sign with eventually decreasing magnitude; the sum is cut
    right after a positive term that is decreasing and below exp(_LOG_TERM_TOL) times A - 1
    (the size of rdp), so the partial sum is an upper bound within a relative ~1e-7. Rows
    that would need more than _MAX_TERMS terms get +inf (that order is then unused: safe).
    """
    P, O = sigma.shape[0], len(frac_orders)
    alpha_all = torch.tensor(frac_orders, dtype=_F64).expand(P, O).reshape(-1)
    sig_all = sigma[:, None].expand(P, O).reshape(-1)
    q_all = q[:, None].expand(P, O).reshape(-1)
    rows = P * O
    # running sum A = value * exp(scale), kept in two parts so that huge A cannot overflow
    value = torch.zeros(rows, dtype=_F64)
    scale = torch.full((rows,), -math.inf, dtype=_F64)
    prev_m = torch.full((rows,), math.inf, dtype=_F64)
    active = torch.arange(rows)
    gave_up: list[torch.Tensor] = []
    start = 0
    block = int(2 * math.ceil(max(frac_orders)) + 40)  # most rows stop within this block
    while active.numel() > 0 and start < _MAX_TERMS:
        a = alpha_all[active][:, None]
        s = sig_all[active][:, None]
        qq = q_all[active][:, None]
        i = torch.arange(start, start + block, dtype=_F64)[None, :]
        log_q, log_1mq = torch.log(qq), torch.log1p(-qq)
        z0 = s * s * (log_1mq - log_q) + 0.5
        inv2s2 = 0.5 / (s * s)
        j = a - i
        log_binom = torch.lgamma(a + 1) - torch.lgamma(i + 1) - torch.lgamma(j + 1)  # log |C(a, i)|
        log_s0 = log_binom + i * log_q + j * log_1mq + (i * i - i) * inv2s2 + torch.special.log_ndtr((z0 - i) / s)
        log_s1 = log_binom + j * log_q + i * log_1mq + (j * j - j) * inv2s2 + torch.special.log_ndtr((j - z0) / s)
        m = torch.logaddexp(log_s0, log_s1)  # log |term_i|
        n_neg = i - torch.floor(a) - 1  # number of negative factors in C(a, i)
        positive = (n_neg <= 0) | (torch.remainder(n_neg, 2) == 0)
        top = m.max(dim=1, keepdim=True).values
        w = torch.where(positive, 1.0, -1.0) * torch.exp(m - top)  # signed terms / exp(top)
        new_scale = torch.maximum(scale[active], top[:, 0])
        carried = value[active] * torch.exp(scale[active] - new_scale)
        carried = torch.where(torch.isfinite(scale[active]), carried, 0.0)
        unit = torch.exp(top[:, 0] - new_scale)
        # Cut relative to A - 1, the size of rdp * (a - 1), not to A (~1): estimate A - 1 from
        # the sum including this whole block, or, if cancellation makes that useless, by
        # its small-q form a (a - 1) q^2 (exp(1/s^2) - 1) / 2.
        whole = carried + unit * w.sum(dim=1)
        am1 = torch.expm1(torch.log(torch.clamp(whole, min=1e-300)) + new_scale)
        a0 = a[:, 0]
        small_q = torch.log(a0 * (a0 - 1) / 2) + 2 * log_q[:, 0] + torch.log(torch.expm1(2 * inv2s2[:, 0]))
        log_am1 = torch.where(am1 > 1e-12, torch.log(torch.clamp(am1, min=1e-300)), small_q)
        tol = (torch.clamp(log_am1, max=0.0) + _LOG_TERM_TOL)[:, None]
        m_prev = torch.cat([prev_m[active][:, None], m[:, :-1]], dim=1)
        stop = positive & (i > a + 1) & (m < m_prev) & (m < tol)
        has_stop = stop.any(dim=1)
        first = torch.where(has_stop, stop.to(torch.int8).argmax(dim=1), block - 1)
        keep = torch.arange(block)[None, :] <= first[:, None]
        value[active] = carried + unit * torch.where(keep, w, 0.0).sum(dim=1)
        scale[active] = new_scale
        prev_m[active] = m[:, -1]
        # far in the tail |term_i| decays like i^-(a + 2): rows that would need more than
        # _MAX_TERMS terms give up now (+inf: the order is skipped; this happens for large
        # noise, where the best orders are large integers anyway)
        end = float(start + block)
        need = end * torch.exp(torch.clamp((m[:, -1] - tol[:, 0]) / (a[:, 0] + 2.0), max=30.0))
        hopeless = ~has_stop & (m[:, -1] < m[:, -2]) & (need > _MAX_TERMS)
        gave_up.append(active[hopeless])
        active = active[~has_stop & ~hopeless]
        start += block
        block *= 4
    log_a = torch.log(torch.clamp(value, min=1e-300)) + scale
    log_a[torch.cat([active, *gave_up])] = math.inf
    return log_a.reshape(P, O)


def rdp_poisson_gaussian_batch(
    noise_multiplier: torch.Tensor, sample_rate: torch.Tensor, orders: Sequence[float]
) -> torch.Tensor:
    """RDP of one step for a batch of (noise_multiplier, sample_rate) pairs: [P, len(orders)].

    Inputs are float64 tensors of shape [P] with noise_multiplier > 0 and 0 <= sample_rate <= 1
    (unchecked: this is the vectorised kernel behind :func:`rdp_poisson_gaussian`).
    """
    sigma = noise_multiplier.to(_F64).reshape(-1)
    q = sample_rate.to(_F64).reshape(-1)
    if sigma.shape[0] > _CHUNK:  # bound the memory of the [pairs, terms] intermediates
        return torch.cat(
            [
                rdp_poisson_gaussian_batch(sigma[i : i + _CHUNK], q[i : i + _CHUNK], orders)
                for i in range(0, sigma.shape[0], _CHUNK)
            ]
        )
    orders_t = torch.tensor(tuple(orders), dtype=_F64)
    P = sigma.shape[0]
    out = torch.zeros((P, orders_t.shape[0]), dtype=_F64)
    full = q >= 1.0
    if full.any():  # the Gaussian mechanism: a / (2 s^2)
        out[full] = orders_t[None, :] / (2.0 * sigma[full, None] ** 2)
    mid = (q > 0.0) & ~full
    if mid.any():
        is_int = torch.tensor([float(a).is_integer() for a in orders])
        log_a = torch.empty((int(mid.sum()), orders_t.shape[0]), dtype=_F64)
        int_orders = tuple(int(a) for a in orders if float(a).is_integer())
        frac_orders = tuple(float(a) for a in orders if not float(a).is_integer())
        if int_orders:
            log_a[:, is_int] = _log_a_int(sigma[mid], q[mid], int_orders)
        if frac_orders:
            log_a[:, ~is_int] = _log_a_frac(sigma[mid], q[mid], frac_orders)
        out[mid] = torch.clamp((log_a + _LOG_A_ROUNDING) / (orders_t[None, :] - 1.0), min=0.0)
    return out


@functools.lru_cache(maxsize=256)
def _rdp_cached(noise_multiplier: float, sample_rate: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    t = rdp_poisson_gaussian_batch(
        torch.tensor([noise_multiplier], dtype=_F64), torch.tensor([sample_rate], dtype=_F64), orders
    )
    return tuple(t[0].tolist())


def rdp_poisson_gaussian(
    *, noise_multiplier: float, sample_rate: float, orders: Sequence[float] = DEFAULT_ORDERS
) -> torch.Tensor:
    """RDP of ONE step of the Poisson-subsampled Gaussian mechanism at each order.

    Args:
      noise_multiplier: noise std / l2_clip_norm, > 0.
      sample_rate: Poisson sampling probability in [0, 1].
      orders: Renyi orders > 1 (default :data:`DEFAULT_ORDERS`).

    Returns:
      float64 tensor [len(orders)]; multiply by the number of steps for a composition.

    Raises:
      ValueError: an argument is out of range.

    Example:
      >>> rdp_poisson_gaussian(noise_multiplier=1.0, sample_rate=1.0, orders=[2.0, 3.0])
      tensor([1.0000, 1.5000], dtype=torch.float64)

    References:
      Mironov, Talwar, Zhang. "Renyi Differential Privacy of the Sampled Gaussian Mechanism." 2019.
    """
    where = "rdp_poisson_gaussian"
    sigma = _checks.check_noise_multiplier(where, noise_multiplier)
    q = _checks.check_sample_rate(where, sample_rate)
    orders = _checks.check_orders(where, orders)
    return torch.tensor(_rdp_cached(sigma, q, orders), dtype=_F64)


def rdp_to_epsilon(rdp: torch.Tensor, orders: Sequence[float], delta) -> torch.Tensor:
    """Smallest epsilon over orders for total RDP ``rdp`` [..., O] and ``delta`` (broadcast).

    Returns a float64 tensor of shape ``rdp.shape[:-1]`` (broadcast with delta), >= 0.
    """
    a = torch.tensor(tuple(orders), dtype=_F64)
    rdp = torch.as_tensor(rdp, dtype=_F64)
    log_delta = torch.log(torch.as_tensor(delta, dtype=_F64))[..., None]
    eps = rdp + torch.log1p(-1.0 / a) - (log_delta + torch.log(a)) / (a - 1.0)
    # delta >= TV bound sqrt(1 - exp(-KL)) with KL <= rdp(a): epsilon = 0 suffices.
    tv_ok = 2.0 * log_delta > torch.log(-torch.expm1(-rdp))
    eps = torch.where(tv_ok, torch.zeros_like(eps), eps)
    eps = torch.where(torch.isnan(eps), math.inf, eps)  # inf - inf at non-private orders
    return torch.clamp(eps.min(dim=-1).values, min=0.0)


def rdp_to_delta(rdp: torch.Tensor, orders: Sequence[float], epsilon) -> torch.Tensor:
    """Smallest delta over orders for total RDP ``rdp`` [..., O] at ``epsilon`` >= 0 (inverse
    of :func:`rdp_to_epsilon`)."""
    a = torch.tensor(tuple(orders), dtype=_F64)
    rdp = torch.as_tensor(rdp, dtype=_F64)
    eps = torch.as_tensor(epsilon, dtype=_F64)[..., None]
    log_delta = (a - 1.0) * (rdp - eps + torch.log1p(-1.0 / a)) - torch.log(a)
    log_tv = 0.5 * torch.log(-torch.expm1(-rdp))
    log_delta = torch.minimum(log_delta, log_tv)
    log_delta = torch.where(torch.isnan(log_delta), 0.0, log_delta)
    return torch.clamp(torch.exp(log_delta.min(dim=-1).values), max=1.0)


# ---------------------------------------------------------------------------------------
# Replace-one RDP: fixed-size sampling without replacement, Gaussian epochs, converted Poisson
# ---------------------------------------------------------------------------------------


def _wor_log_terms_int(sigma_eff: float, q: float, int_orders: tuple[int, ...]) -> torch.Tensor:
    """log(1 + sum_j ...) of Wang-Balle-Kasiviswanathan Theorem 9 at integer orders >= 2 for a
    base mechanism with RDP eps(a) = a / (2 sigma_eff^2) (eps(inf) = inf):

        1 + q^2 C(a, 2) min(4 (e^eps(2) - 1), 2 e^eps(2)) + sum_{j=3}^{a} 2 q^j C(a, j) e^{(j-1) eps(j)}
    """
    k, alpha, seg, log_binom = _int_order_tables(int_orders)
    inv = 0.5 / (sigma_eff * sigma_eff)
    eps2 = 2.0 * inv
    log_j2 = min(math.log(4.0) + eps2 + math.log(-math.expm1(-eps2)), eps2 + math.log(2.0))
    terms = log_binom + k * math.log(q) + torch.where(k == 2, torch.full_like(k, log_j2), math.log(2.0) + (k - 1) * k * inv)
    terms = torch.where(k >= 2, terms, torch.full_like(k, -math.inf))
    terms = torch.where(k == 0, torch.zeros_like(k), terms)  # the leading 1
    O = len(int_orders)
    peak = torch.full((O,), -math.inf, dtype=_F64).scatter_reduce(0, seg, terms, "amax")
    total = torch.zeros(O, dtype=_F64).scatter_add(0, seg, torch.exp(terms - peak[seg]))
    return peak + torch.log(total)


@functools.lru_cache(maxsize=64)
def rdp_fixed_size_gaussian(noise_multiplier: float, sample_rate: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    """Replace-one RDP of ONE step of the Gaussian mechanism on a batch drawn without
    replacement (batch_size = sample_rate * num_samples), at each order.

    Wang, Balle, Kasiviswanathan (2019), Theorem 9, for the Gaussian mechanism with the
    replace-one sensitivity 2 (in units of the clip norm: base RDP eps(a) = 2 a /
    noise_multiplier^2, eps(inf) = inf). Fractional orders: the cumulant (a - 1) eps'(a) is
    convex in a, so interpolating it linearly between the neighbouring integers is an upper
    bound (their Corollary 10). Order values below 2 use the order-2 bound (RDP grows with the
    order). Unchecked arguments (the events check them).
    """
    sigma_eff = noise_multiplier / 2.0
    if sample_rate >= 1.0:
        return tuple(float(a) / (2.0 * sigma_eff**2) for a in orders)
    need = sorted({max(2, math.floor(a)) for a in orders} | {max(2, math.ceil(a)) for a in orders})
    log_a = _wor_log_terms_int(sigma_eff, sample_rate, tuple(need))
    cgf = {a: float(v) for a, v in zip(need, log_a)}  # (a - 1) * eps'(a)
    out = []
    for a in orders:
        if a < 2.0:
            out.append(cgf[2])  # eps'(a) <= eps'(2) = cgf(2) / 1
            continue
        lo, hi = math.floor(a), math.ceil(a)
        c = cgf[lo] if lo == hi else (hi - a) * cgf[lo] + (a - lo) * cgf[hi]
        out.append(max(c / (a - 1.0), 0.0))
    return tuple(out)


def rdp_replace_one_from_add_remove(rdp_at, orders: Sequence[float]) -> torch.Tensor:
    """Replace-one RDP from add/remove RDP: a replacement is a removal then an addition, and
    Renyi divergences obey the weak triangle inequality (Mironov 2017, Proposition 11)::

        D_a(P || R) <= (a - 1/2) / (a - 1) * D_2a(P || Q) + D_{2a - 1}(Q || R)

    ``rdp_at(orders2)`` returns the add/remove RDP (both directions bounded) at the orders
    ``orders2``; orders whose doubled order exceeds 8192 get +inf (unused).
    """
    a = torch.tensor(tuple(orders), dtype=_F64)
    ok = 2.0 * a <= 8192.0
    a_ok = a[ok].tolist()
    twice = tuple(2.0 * x for x in a_ok)
    twice_m1 = tuple(2.0 * x - 1.0 for x in a_ok)
    r2 = torch.as_tensor(rdp_at(twice), dtype=_F64)
    r1 = torch.as_tensor(rdp_at(twice_m1), dtype=_F64)
    ak = torch.tensor(a_ok, dtype=_F64)
    out = torch.full_like(a, math.inf)
    out[ok] = (ak - 0.5) / (ak - 1.0) * r2 + r1
    return out
