"""f-DP readouts of a ledger: how well can any membership attacker do?

A mechanism is (epsilon, delta)-DP for neighbours D, D' exactly when every test between them with
false-positive rate ``alpha`` (rejecting "D" when the data is D) has a true-positive rate
``TPR <= min(1, e^eps alpha + delta, 1 - e^-eps (1 - delta - alpha))`` (Kairouz, Oh, Viswanath
2015, Theorem 2.1; Dong, Roth, Su 2022, Proposition 2.5): the first term is DP from D' to D on the
rejection region, the second DP from D to D' on its complement. A ledger is (eps, delta(eps))-DP
for EVERY eps at once, so the minimum over eps is a bound too, and over all eps it is the exact
trade-off of the (discretised) privacy loss distribution (Dong, Roth, Su 2022, Proposition 2.12).
:func:`tpr_bound` evaluates it on a grid of eps, which can only make it larger (still a bound).

References:
  Kairouz, Oh, Viswanath. "The Composition Theorem for Differential Privacy." ICML 2015.
  Dong, Roth, Su. "Gaussian Differential Privacy." JRSS-B 2022.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from vmapdp.accounting import _checks, gdp as _gdp, pld as _pld
from vmapdp.accounting import core as _core
from vmapdp.accounting import events as _events

__all__ = ["delta_curve", "tpr_bound", "mu_gdp"]

_F64 = torch.float64
_GRID = 2000  # eps grid points of tpr_bound (a composed PLD: read at every point at once)
_GRID_SLOW = 400  # eps grid points where each delta(eps) is a separate conversion (RDP, closed forms)
_TOL = 1e-3  # the PLD grid's target certified gap, as in epsilon()


def _ledger(where: str, ledger: Any) -> _events.Ledger:
    return _core._resolve_ledger(where, ledger, None, None, None, True)


def _pld_curve(c: _pld._Composed, eps: torch.Tensor) -> torch.Tensor:
    """delta(eps) of one composed PLD at every eps (the same sum as ``_pld._delta_at``, vectorised:
    delta = p_inf + SP_k - e^eps SQ_k + slack with k the first loss > eps, suffix sums SP of the
    mass and SQ of mass * e^-loss, the latter in log space)."""
    keep = c.mass > 0
    loss, mass = c.loss[keep], c.mass[keep]
    if loss.numel() == 0:
        return torch.full_like(eps, min(max(c.p_inf + c.slack, 0.0), 1.0))
    sp = torch.flip(torch.cumsum(torch.flip(mass, [0]), 0), [0])
    log_sq = torch.flip(torch.logcumsumexp(torch.flip(torch.log(mass) - loss, [0]), 0), [0])
    sp = torch.cat([sp, sp.new_zeros(1)])
    log_sq = torch.cat([log_sq, log_sq.new_full((1,), -math.inf)])
    k = torch.searchsorted(loss, eps, right=True)  # first loss > eps
    d = c.p_inf + sp[k] - torch.exp(eps + log_sq[k]) + c.slack
    return d.clamp(0.0, 1.0)


def _composed(plan: Any, accountant: str, h: float | None) -> tuple | None:
    """The upper PLDs of a plan for ``"pld"`` (remove and add, or the replace-one one), composed
    once; None where the plan has no PLD (see ``_core._pld_events``)."""
    if accountant != "pld" or plan.non_private or plan.empty:
        return None
    found = _core._pld_events(plan)
    if found is None:
        return None
    events, relation = found
    events = _pld._private_events(events)
    h = h if h is not None else _pld._initial_interval(events, _TOL)
    parts = _pld._directions(events, h, relation)
    return (parts[0][0],) if relation == "replace_one" else tuple(p[0] for p in parts)


def _curve(plan: Any, eps: torch.Tensor, accountant: str, h: float | None, parts: tuple | None = None) -> torch.Tensor:
    """An upper bound on delta(eps) of the plan at every eps of ``eps`` (float64)."""
    if plan.non_private:
        return torch.ones_like(eps)
    if plan.empty:
        return torch.zeros_like(eps)
    parts = parts or _composed(plan, accountant, h)
    if parts is not None:
        d = functools.reduce(torch.maximum, [_pld_curve(p, eps) for p in parts])
        if plan.fail > 0.0:
            d = d + plan.fail * (1.0 + torch.exp(eps.clamp(max=700.0)))
        return d.clamp(max=1.0)
    orders = _core._rdp.DEFAULT_ORDERS
    return torch.tensor([_core._delta(plan, float(e), accountant, orders, None, None) for e in eps.tolist()], dtype=_F64)


def delta_curve(ledger, /, epsilons, *, accountant: str = "pld", value_discretization_interval: float | None = None) -> torch.Tensor:
    """Upper bounds on delta(eps) of ``ledger`` at each of ``epsilons`` (one composition for all).

    Args:
      ledger: a :class:`Ledger`, an event, or a train state.
      epsilons: epsilons >= 0 (a float, a sequence or a tensor).
      accountant: ``"pld"`` (default; the PLD is composed once on one grid and read at every
        eps), ``"rdp"``; ``"gdp"`` is refused (not a bound).
      value_discretization_interval: for ``"pld"``: the PLD grid spacing (default: chosen for a
        certified epsilon gap of about 1e-3).

    Returns:
      A float64 tensor shaped like ``epsilons``: upper bounds on delta(eps), in [0, 1].

    Raises:
      ValueError / TypeError: a bad argument, or an accountant that cannot bound the ledger.
    """
    where = "delta_curve(ledger, epsilons)"
    ledger = _ledger(where, ledger)
    eps = _as_tensor(where, "epsilons", epsilons, lo=0.0, hi=math.inf, rng="in [0, inf)")
    accountant = _bound_accountant(where, accountant, value_discretization_interval)
    plan = _core._plan(ledger)
    _core._refuse(where, plan, accountant)
    return _curve(plan, eps.flatten(), accountant, value_discretization_interval).reshape(eps.shape)


def tpr_bound(ledger, /, fpr, *, accountant: str = "pld", epsilons=None, value_discretization_interval: float | None = None) -> torch.Tensor:
    """An upper bound on the true-positive rate of ANY membership test at false-positive rate ``fpr``.

    ``TPR(alpha) <= min over eps of min(1, e^eps alpha + delta(eps), 1 - e^-eps (1 - delta(eps) - alpha))``
    with ``delta(eps)`` the ledger's upper bound (:func:`delta_curve`): the hypothesis-testing
    form of (eps, delta)-DP, for every eps at once (module docstring). ``1 - tpr_bound`` is a
    lower bound on the f-DP trade-off function ``f(alpha)`` (the attacker's false-negative rate).

    Args:
      ledger: a :class:`Ledger`, an event, or a train state.
      fpr: false-positive rates in [0, 1] (a float, a sequence or a tensor).
      accountant: ``"pld"`` (default) or ``"rdp"`` (looser); ``"gdp"`` is refused (not a bound:
        use :func:`mu_gdp` for the approximation).
      epsilons: the eps grid (default: 2000 points (PLD; 400 otherwise) from 0 to the largest
        loss of the PLD, or to where delta(eps) falls below 1e-12; at most 200). A coarser grid
        gives a larger (still valid) bound.
      value_discretization_interval: for ``"pld"``: the PLD grid spacing.

    Returns:
      A float64 tensor shaped like ``fpr``: upper bounds on the TPR, in [fpr, 1]; non-decreasing
      in ``fpr``. 1 for a non-private ledger, ``fpr`` for an empty one.

    Raises:
      ValueError / TypeError: a bad argument, or an accountant that cannot bound the ledger
      (Poisson steps next to replace-one ones need ``accountant="rdp"``).

    Guarantees:
      An upper bound whenever delta(eps) is (``"pld"``: the connect-the-dots upper PLD; ``"rdp"``:
      the RDP conversion). For the full-batch Gaussian mechanism it is within about 1e-3 of the
      exact ``Phi(Phi^-1(fpr) + 1/sigma)`` (tests/test_fdp.py).

    References:
      Kairouz, Oh, Viswanath 2015 (Theorem 2.1); Dong, Roth, Su 2022 (Propositions 2.5, 2.12).

    Example:
      >>> from vmapdp.accounting import Ledger, PoissonGaussianEvent
      >>> tpr = tpr_bound(Ledger((PoissonGaussianEvent(noise_multiplier=1.0, sample_rate=1.0),)), fpr=0.05)
      >>> 0.2595 <= float(tpr) < 0.262   # exact Gaussian: Phi(Phi^-1(0.05) + 1) = 0.25951
      True
    """
    where = "tpr_bound(ledger, fpr)"
    ledger = _ledger(where, ledger)
    alpha = _as_tensor(where, "fpr", fpr, lo=0.0, hi=1.0, rng="in [0, 1]")
    accountant = _bound_accountant(where, accountant, value_discretization_interval)
    plan = _core._plan(ledger)
    _core._refuse(where, plan, accountant)
    if plan.non_private:
        return torch.ones_like(alpha)
    if plan.empty:
        return alpha.clone()
    parts = _composed(plan, accountant, value_discretization_interval)
    if epsilons is None:
        if parts is not None:  # past the largest finite loss delta(eps) is flat (p_inf): nothing to gain
            top = max(float(c.loss[c.mass > 0].max()) if bool((c.mass > 0).any()) else 0.0 for c in parts)
        else:
            try:
                top = _core._epsilon(plan, 1e-12, accountant, _core._rdp.DEFAULT_ORDERS, None, None, where=where)
            except ValueError:  # truncation too likely at delta=1e-12: the widest grid
                top = math.inf
        top = min(top, 200.0) if math.isfinite(top) else 200.0
        eps = torch.linspace(0.0, max(top, 1e-3), _GRID if parts is not None else _GRID_SLOW, dtype=_F64)
    else:
        eps = _as_tensor(where, "epsilons", epsilons, lo=0.0, hi=math.inf, rng="in [0, inf)").flatten()
    d = _curve(plan, eps, accountant, value_discretization_interval, parts)
    a = alpha.flatten()[:, None]
    e, dd = eps[None, :], d[None, :]
    first = torch.exp(e.clamp(max=700.0)) * a + dd
    second = 1.0 - torch.exp(-e) * (1.0 - dd - a)
    tpr = torch.minimum(first, second).clamp(max=1.0).amin(dim=1)
    return torch.maximum(tpr, alpha.flatten()).reshape(alpha.shape)  # no test beats guessing's TPR = FPR bound


def mu_gdp(ledger, /) -> float:
    """The mu of Gaussian DP for a ledger, where it applies.

    * Shuffled epochs (or ``EpochGaussianEvent(scheme="balls_in_bins")`` of older ledgers) only:
      EXACT for the mechanism charged, ``mu = sqrt(sum over epochs of (2 / sigma)^2)``
      (each epoch one Gaussian mechanism of sensitivity 2 under replace-one; see
      :class:`EpochGaussianEvent`); no warning.
    * Balls-in-bins epochs (:class:`BallsInBinsGaussianEvent`): an upper bound, each epoch
      charged as one Gaussian mechanism, ``mu = 1 / sigma`` (sensitivity 1, add/remove; 2 in a
      replace-one ledger), without amplification; no warning.
    * Plain Poisson steps: the central-limit APPROXIMATION ``mu = q sqrt(T (e^(1/sigma^2) - 1))``
      (Bu, Dong, Long, Su 2020): NOT a bound (it can under-report), with a UserWarning.

    Returns:
      mu >= 0 (0 for an empty ledger, inf for a non-private one).

    Raises:
      ValueError: fixed-size or truncated steps, or epochs mixed with Poisson steps (no mu-GDP
      readout applies: use :func:`tpr_bound`).
    """
    where = "mu_gdp(ledger)"
    plan = _core._plan(_ledger(where, ledger))
    if plan.non_private:
        return math.inf
    if plan.empty:
        return 0.0
    if (plan.epochs or plan.allocations) and not (plan.poisson or plan.fixed):
        return math.hypot(plan.mu_epochs, plan.mu_allocations)
    if plan.poisson and not (plan.fixed or plan.epochs or plan.allocations) and plan.fail == 0.0:
        _gdp.warn_gdp(where)
        return _gdp.gdp_mu(plan.poisson)
    raise ValueError(
        f"{where}: the ledger mixes or holds fixed-size, truncated or epoch steps with others; mu-GDP applies to "
        "plain Poisson steps (as a central-limit approximation) or to shuffled/balls-in-bins epochs alone (exactly). "
        "Use tpr_bound(ledger, fpr=...) for a trade-off bound on any ledger."
    )


def _bound_accountant(where: str, accountant: str, h: float | None) -> str:
    accountant = _checks.check_accountant(where, accountant)
    if accountant == "gdp":
        raise ValueError(f"{where}: accountant='gdp' is a central-limit approximation, not a bound. Pass accountant='pld' or 'rdp' (or use mu_gdp(ledger) for the approximation).")
    if h is not None:
        if accountant != "pld":
            raise ValueError(f"{where}: value_discretization_interval= applies to accountant='pld' only (got {accountant!r}). Drop it, or use accountant='pld'.")
        _checks.check_positive(where, "value_discretization_interval", h, hint="it is the PLD grid spacing in loss units, e.g. 1e-3.")
    return accountant


def _as_tensor(where: str, name: str, value: Any, *, lo: float, hi: float, rng: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(value, dtype=_F64)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{where}: {name} must be a float, a sequence of floats or a tensor, got {type(value).__name__}.") from None
    bad = ~((t >= lo) & (t <= hi))
    if bool(bad.any()):
        raise ValueError(f"{where}: {name} must be {rng}, got {t[bad].flatten()[:3].tolist()} among them. Pass values {rng}.")
    return t
