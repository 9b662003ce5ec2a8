"""Accountants as pure functions of a ledger: epsilon, delta, grids and noise calibration."""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple, Sequence

import torch

from vmapdp import _checks as _shared_checks
from vmapdp.accounting import _checks, gdp as _gdp, pld as _pld, rdp as _rdp
from vmapdp.accounting import events as _events
from vmapdp.accounting.events import (
    BallsInBinsGaussianEvent,
    EpochGaussianEvent,
    FixedSizeGaussianEvent,
    Ledger,
    NonPrivateEvent,
    CyclicPoissonGaussianEvent,
    PoissonGaussianEvent,
    TruncatedPoissonGaussianEvent,
)

__all__ = ["epsilon", "delta", "epsilon_bounds", "epsilon_grid", "calibrate_noise", "within_budget"]

_F64 = torch.float64
_MIN_NOISE = 0.1
_MAX_NOISE = 1e4


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------


def _resolve_ledger(where, ledger, noise_multiplier, sample_rate, steps, allow_non_private) -> Ledger:
    """A Ledger from either the positional ledger or the keyword form."""
    kwargs = {"noise_multiplier": noise_multiplier, "sample_rate": sample_rate, "steps": steps}
    given = [k for k, v in kwargs.items() if v is not None]
    if ledger is not None:
        if given:
            raise ValueError(
                f"{where}: got a ledger and also {', '.join(f'{k}=' for k in given)}; pass either "
                f"a ledger ({where.split('(')[0]}(ledger, delta=...)) or noise_multiplier=, "
                "sample_rate= and steps=, not both."
            )
        if isinstance(ledger, Ledger):
            return ledger
        if isinstance(ledger, _events._EVENT_TYPES):
            return Ledger((ledger,))
        inner = getattr(ledger, "ledger", None)
        if isinstance(inner, Ledger):  # e.g. a TrainState carrying its ledger
            return inner
        raise TypeError(
            f"{where}: expected a Ledger, an event, or an object with a .ledger Ledger "
            f"(a train state); got {type(ledger).__name__}. Build one with "
            "Ledger().record(noise_multiplier=..., sample_rate=..., count=...)."
        )
    missing = [k for k, v in kwargs.items() if v is None]
    if missing:
        raise ValueError(
            f"{where}: missing {', '.join(f'{k}=' for k in missing)}; pass noise_multiplier=, "
            "sample_rate= and steps= (all three), or a ledger as the first argument."
        )
    sigma = _checks.check_noise_multiplier(where, noise_multiplier, allow_zero=allow_non_private)
    q = _checks.check_sample_rate(where, sample_rate)
    steps = _checks.check_steps(where, steps)
    if steps == 0 or q == 0.0:  # nothing about any example was released
        return Ledger()
    if sigma == 0.0:
        return Ledger((NonPrivateEvent(count=steps),))
    return Ledger((PoissonGaussianEvent(noise_multiplier=sigma, sample_rate=q, count=steps),))


class _Plan(NamedTuple):
    """What the accountants need from a ledger, grouped by analysis."""

    non_private: bool = False
    poisson: tuple = ()  # (noise_multiplier, sample_rate, count): add/remove Poisson steps (truncated and cyclic ones too)
    fixed: tuple = ()  # (noise_multiplier, sample_rate, count): replace-one, without replacement
    epochs: tuple = ()  # (noise_multiplier, charged epochs): replace-one Gaussian mechanisms, sensitivity 2
    fail: float = 0.0  # probability that the truncated run differs from the Poisson run
    adjacency: str = _events.ADD_REMOVE
    allocations: tuple = ()  # (noise_multiplier, steps_per_epoch, charged epochs): balls-in-bins, add/remove

    @property
    def empty(self) -> bool:
        return not (self.poisson or self.fixed or self.epochs or self.allocations)

    @property
    def mu_allocations(self) -> float:
        """mu of the balls-in-bins epochs charged as one Gaussian each (sensitivity 1, or 2 in a
        replace-one ledger): valid, without amplification."""
        sens = 1.0 if self.adjacency == _events.ADD_REMOVE else 2.0
        return math.sqrt(sum(e * (sens / s) ** 2 for s, _, e in self.allocations))

    @property
    def mu_epochs(self) -> float:
        """mu of the composed epoch Gaussians (replace-one sensitivity 2)."""
        return math.sqrt(sum(e * (2.0 / s) ** 2 for s, e in self.epochs))


def _plan(ledger: Ledger) -> _Plan:
    poisson, fixed, epochs, fail, alloc = [], [], [], 0.0, []
    for e in _events.accounted_events(ledger.events):  # registered events (vmapdp.mf) as the ones below
        if isinstance(e, NonPrivateEvent):
            return _Plan(non_private=True, adjacency=ledger.adjacency)
        if isinstance(e, PoissonGaussianEvent):
            poisson.append((e.noise_multiplier, e.sample_rate, e.count))
        elif isinstance(e, TruncatedPoissonGaussianEvent):
            poisson.append((e.noise_multiplier, e.sample_rate, e.count))
            fail += e.truncation_probability
        elif isinstance(e, CyclicPoissonGaussianEvent):  # any one example: ceil(count / cycle) Poisson steps
            poisson.append((e.noise_multiplier, e.sample_rate, e.charged_steps))
        elif isinstance(e, FixedSizeGaussianEvent):
            fixed.append((e.noise_multiplier, e.sample_rate, e.count))
        elif isinstance(e, EpochGaussianEvent):
            epochs.append((e.noise_multiplier, e.charged_epochs))
        elif isinstance(e, BallsInBinsGaussianEvent):
            alloc.append((e.noise_multiplier, e.steps_per_epoch, e.charged_epochs))
    return _Plan(False, tuple(poisson), tuple(fixed), tuple(epochs), min(fail, 1.0), ledger.adjacency, tuple(alloc))


def _poisson_plan(triples) -> _Plan:
    return _Plan(poisson=tuple(t for t in triples if t[1] > 0 and t[2] > 0))


def _options(where, accountant, orders, eps_error, value_discretization_interval):
    accountant = _checks.check_accountant(where, accountant)
    if orders is not None:
        if accountant != "rdp":
            raise ValueError(
                f"{where}: orders= applies to accountant='rdp' only (got accountant={accountant!r}). "
                "Drop orders=, or use accountant='rdp'."
            )
        orders = _checks.check_orders(where, orders)
    if (eps_error is not None or value_discretization_interval is not None) and accountant != "pld":
        raise ValueError(
            f"{where}: eps_error= and value_discretization_interval= apply to accountant='pld' "
            f"only (got accountant={accountant!r}). Drop them, or use accountant='pld'."
        )
    if eps_error is not None:
        eps_error = _checks.check_positive(
            where, "eps_error", eps_error, hint="it is the accepted discretisation error of epsilon, e.g. 0.01."
        )
    if value_discretization_interval is not None:
        value_discretization_interval = _checks.check_positive(
            where,
            "value_discretization_interval",
            value_discretization_interval,
            hint="it is the PLD grid spacing in loss units, e.g. 1e-3.",
        )
    return accountant, orders or _rdp.DEFAULT_ORDERS, eps_error, value_discretization_interval


def _total_rdp(triples, orders) -> torch.Tensor:
    total = torch.zeros(len(orders), dtype=_F64)
    for s, q, c in triples:
        total += c * torch.tensor(_rdp._rdp_cached(s, q, tuple(orders)), dtype=_F64)
    return total


def _plan_rdp(plan: _Plan, orders) -> torch.Tensor:
    """Total RDP of the plan at ``orders``, for the plan's neighbouring relation."""
    orders = tuple(orders)
    mu_alloc = plan.mu_allocations  # balls-in-bins epochs: one Gaussian each, rdp(a) = a mu^2 / 2
    alloc = torch.tensor(orders, dtype=_F64) * (0.5 * mu_alloc * mu_alloc)
    if plan.adjacency == _events.ADD_REMOVE:
        return _total_rdp(plan.poisson, orders) + alloc
    total = alloc.clone()
    if plan.poisson:  # converted: a replacement is a removal and an addition
        total += _rdp.rdp_replace_one_from_add_remove(lambda o: _total_rdp(plan.poisson, o), orders)
    for s, q, c in plan.fixed:
        total += c * torch.tensor(_rdp.rdp_fixed_size_gaussian(s, q, orders), dtype=_F64)
    mu = plan.mu_epochs
    if mu > 0:  # the Gaussian mechanism: rdp(a) = a mu^2 / 2
        total += torch.tensor(orders, dtype=_F64) * (0.5 * mu * mu)
    return total


def _pld_events(plan: _Plan):
    """(events, relation) for the PLD accountant, or None where it has no PLD for the plan.

    Add/remove: the Poisson triples. Replace-one without Poisson steps: fixed-size steps as
    ``(noise / 2, batch_size / num_samples, count)`` and each charged epoch Gaussian as
    ``(noise / 2, 1, epochs)`` (sensitivity 2 clip norms; see ``pld.pld_epsilon_bounds``).
    """
    if plan.adjacency == _events.ADD_REMOVE:
        return plan.poisson + tuple(_pld.Allocation(s, t, e) for s, t, e in plan.allocations if e > 0), "add_remove"
    if plan.poisson or plan.allocations:
        return None
    events = [(s / 2.0, q, c) for s, q, c in plan.fixed] + [(s / 2.0, 1.0, e) for s, e in plan.epochs if e > 0]
    return tuple(events), "replace_one"


def _refuse(where, plan: _Plan, accountant: str) -> None:
    """The accountant cannot bound this plan: say why and which one can."""
    if accountant == "pld" and plan.adjacency == _events.REPLACE_ONE and (plan.poisson or plan.allocations):
        raise ValueError(
            f"{where}: accountant='pld' has no privacy loss distribution for Poisson events (nor for "
            "BallsInBinsGaussianEvent epochs) in a ledger that is replace-one because of other events "
            "(fixed-size or shuffled steps, or old balls-in-bins EpochGaussianEvents), so it cannot bound this "
            "ledger. Pass accountant='rdp' (add/remove events converted to replace-one), or keep one sampler per ledger."
        )
    if accountant == "gdp" and (plan.fixed or plan.epochs or plan.allocations or plan.fail > 0):
        raise ValueError(
            f"{where}: accountant='gdp' is the central limit approximation of plain Poisson subsampling; it "
            "does not apply to fixed-size, shuffled, balls-in-bins or truncated sampling. Pass accountant='pld' "
            "or 'rdp' (upper bounds)."
        )


def _core_epsilon(plan: _Plan, delta, accountant, orders, eps_error, h) -> float:
    if accountant == "rdp":
        return float(_rdp.rdp_to_epsilon(_plan_rdp(plan, orders), orders, delta))
    if accountant == "pld":
        if plan.adjacency == _events.REPLACE_ONE and not plan.fixed and not plan.allocations:  # only Gaussian epochs: exact (Balle and Wang 2018)
            return _gdp.gdp_epsilon(plan.mu_epochs, delta)
        events, relation = _pld_events(plan)
        eps = _pld.pld_epsilon_bounds(
            events, delta=delta, eps_error=eps_error, value_discretization_interval=h, relation=relation
        ).upper
        if plan.allocations:  # also valid: each epoch one Gaussian; the smaller of two upper bounds
            eps = min(eps, _core_epsilon(_unamplified(plan), delta, accountant, orders, eps_error, h))
        if math.isinf(eps):
            # PLD's certified upper end is inf where delta is below what its FFT rounding may move (a delta
            # near 1e-12 after 1e5 steps): RDP's bound is valid too
            rdp = _core_epsilon(plan, delta, "rdp", orders, eps_error, h)
            if math.isfinite(rdp):
                warnings.warn(
                    f"epsilon(accountant='pld'): the PLD cannot certify an epsilon at delta={delta:g} (its FFT rounding over "
                    f"these steps may move delta by more than that); RDP's upper bound {rdp:.4g} is returned instead.",
                    UserWarning,
                    stacklevel=4,
                )
            return rdp
        return eps
    return _gdp.gdp_epsilon(_gdp.gdp_mu(plan.poisson), delta)


def _unamplified(plan: _Plan) -> _Plan:
    """The plan with each balls-in-bins epoch charged as one Gaussian mechanism (sensitivity 1,
    add/remove): a valid bound without amplification, at most the random-allocation PLD's true
    value's upper bound where that PLD's fixed grid is too coarse (low noise)."""
    gauss = tuple((s, 1.0, e) for s, _, e in plan.allocations if e > 0)
    return plan._replace(poisson=plan.poisson + gauss, allocations=())


def _core_delta(plan: _Plan, epsilon, accountant, orders, eps_error, h) -> float:
    if accountant == "rdp":
        return float(_rdp.rdp_to_delta(_plan_rdp(plan, orders), orders, epsilon))
    if accountant == "pld":
        if plan.adjacency == _events.REPLACE_ONE and not plan.fixed and not plan.allocations:
            return _gdp.gdp_delta(plan.mu_epochs, epsilon)
        events, relation = _pld_events(plan)
        d = _pld.pld_delta_bounds(
            events, epsilon=epsilon, eps_error=eps_error, value_discretization_interval=h, relation=relation
        ).upper
        if plan.allocations:  # the smaller of two upper bounds (see _core_epsilon)
            d = min(d, _core_delta(_unamplified(plan), epsilon, accountant, orders, eps_error, h))
        return d
    return _gdp.gdp_delta(_gdp.gdp_mu(plan.poisson), epsilon)


def _epsilon(plan, delta, accountant, orders, eps_error, h, where="epsilon") -> float:
    if not isinstance(plan, _Plan):
        plan = _poisson_plan(plan)
    if plan.non_private:
        return math.inf
    if plan.empty:
        return 0.0
    _refuse(where, plan, accountant)
    if plan.fail == 0.0:
        return _core_epsilon(plan, delta, accountant, orders, eps_error, h)
    # truncation: delta_total(eps) = delta_core(eps) + (1 + e^eps) fail. With E the epsilon at
    # delta / 2 and (1 + e^E) fail <= delta / 2, eps1 = epsilon at delta - (1 + e^E) fail is <= E,
    # so delta_total(eps1) <= delta - (1 + e^E) fail + (1 + e^eps1) fail <= delta.
    big = _core_epsilon(plan, delta / 2, accountant, orders, eps_error, h)
    cost = math.inf if big > 700 else (1.0 + math.exp(big)) * plan.fail
    if not cost <= delta / 2:
        raise ValueError(
            f"{where}: the truncated Poisson steps truncate with probability up to {plan.fail:.3g}, which "
            f"costs (1 + e^eps) * {plan.fail:.3g} = {cost:.3g} of delta={delta!r}, more than half of it; the "
            "truncation cannot be accounted for at this delta. Raise max_batch_size (e.g. "
            "vmapdp.data.default_capacity(num_samples, sample_rate, overflow_probability=1e-12)) or delta."
        )
    return _core_epsilon(plan, delta - cost, accountant, orders, eps_error, h)


def _delta(plan, epsilon, accountant, orders, eps_error, h, where="delta") -> float:
    if not isinstance(plan, _Plan):
        plan = _poisson_plan(plan)
    if plan.non_private:
        return 1.0
    if plan.empty:
        return 0.0
    _refuse(where, plan, accountant)
    d = _core_delta(plan, epsilon, accountant, orders, eps_error, h)
    if plan.fail > 0.0:
        d += plan.fail * (1.0 + math.exp(min(epsilon, 700.0)))
    return min(d, 1.0)


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def epsilon(
    ledger=None,
    /,
    *,
    delta: float,
    noise_multiplier: float | None = None,
    sample_rate: float | None = None,
    steps: int | None = None,
    accountant: str = "pld",
    orders: Sequence[float] | None = None,
    eps_error: float | None = None,
    value_discretization_interval: float | None = None,
    num_samples: int | None = None,
    allow_non_private: bool = False,
) -> float:
    """Epsilon spent for a given delta: a pure function of the ledger (or of the keywords).

    Call either ``epsilon(ledger, delta=...)`` (any schedule; a ``Ledger``, one event, or an
    object with a ``.ledger`` such as a train state) or ``epsilon(noise_multiplier=...,
    sample_rate=..., steps=..., delta=...)`` (constant hyperparameters).

    Args:
      ledger: the privacy ledger (positional only).
      delta: target delta in (0, 1); keep it well below 1/num_samples.
      noise_multiplier: noise std / l2_clip_norm, > 0 (0 only with ``allow_non_private``).
      sample_rate: Poisson sampling probability in [0, 1] (0: no data used, epsilon 0).
      steps: number of noisy steps, an integer >= 0.
      accountant: ``"pld"`` (the default) or its alias ``"prv"`` (privacy loss distributions,
        tight upper bound with a certified discretisation error), ``"rdp"`` (Renyi DP, a looser
        upper bound, fast), ``"gdp"`` (CLT approximation, NOT a bound; warns).
      orders: Renyi orders for ``"rdp"`` (default :data:`DEFAULT_ORDERS`, up to 8192).
      eps_error: for ``"pld"``: largest certified discretisation error accepted; default 1%
        of the result (at least 1e-4).
      value_discretization_interval: for ``"pld"``: fixed loss grid spacing (no refinement).
      num_samples: dataset size, if known: warns when delta >= 1/num_samples.
      allow_non_private: accept noise_multiplier=0 and return ``inf``.

    Returns:
      epsilon >= 0 (``inf`` if the ledger holds a non-private step). For ``"rdp"`` and
      ``"pld"`` an upper bound on the true epsilon under the ledger's neighbouring relation
      (``Ledger.adjacency``: add/remove, or replace-one when it holds a replace-one event).

    Raises:
      ValueError: an argument is out of range, or both/neither of the two call forms.

    Example:
      >>> round(epsilon(noise_multiplier=1.1, sample_rate=256 / 60000, steps=14070, delta=1e-5), 3)
      2.387
      >>> round(epsilon(noise_multiplier=1.1, sample_rate=256 / 60000, steps=14070, delta=1e-5, accountant="rdp"), 3)
      2.597

    References:
      Mironov, Talwar, Zhang 2019 (RDP of the sampled Gaussian); Balle et al. 2020 (RDP
      conversion); Doroshenko et al. 2022 (connect-the-dots PLD); Bu et al. 2020 (GDP CLT).
    """
    where = "epsilon"
    ledger = _resolve_ledger(where, ledger, noise_multiplier, sample_rate, steps, allow_non_private)
    delta = _checks.check_delta(where, delta)
    accountant, orders, eps_error, h = _options(where, accountant, orders, eps_error, value_discretization_interval)
    _checks.check_num_samples(where, num_samples, delta)
    plan = _plan(ledger)
    _refuse(where, plan, accountant)
    if accountant == "gdp":
        _gdp.warn_gdp(where)
    return _epsilon(plan, delta, accountant, orders, eps_error, h)


def delta(
    ledger=None,
    /,
    *,
    epsilon: float,
    noise_multiplier: float | None = None,
    sample_rate: float | None = None,
    steps: int | None = None,
    accountant: str = "pld",
    orders: Sequence[float] | None = None,
    eps_error: float | None = None,
    value_discretization_interval: float | None = None,
    allow_non_private: bool = False,
) -> float:
    """Delta at a given epsilon; the inverse of :func:`epsilon` (same call forms).

    Args:
      epsilon: epsilon >= 0.
      eps_error: for ``"pld"``: the returned delta is certified to be at most the true delta
        at ``epsilon - eps_error`` (default 1% of epsilon, at least 1e-4).
      (others): as in :func:`epsilon`.

    Returns:
      delta in [0, 1]; an upper bound for ``"rdp"`` and ``"pld"``; 1.0 for a non-private
      ledger.

    Raises:
      ValueError: an argument is out of range.

    Example:
      >>> d = delta(noise_multiplier=1.0, sample_rate=0.01, steps=1000, epsilon=2.0)
      >>> 0 < d < 1e-4
      True
    """
    where = "delta"
    ledger = _resolve_ledger(where, ledger, noise_multiplier, sample_rate, steps, allow_non_private)
    epsilon = _checks.check_epsilon(where, epsilon)
    accountant, orders, eps_error, h = _options(where, accountant, orders, eps_error, value_discretization_interval)
    plan = _plan(ledger)
    _refuse(where, plan, accountant)
    if accountant == "gdp":
        _gdp.warn_gdp(where)
    return _delta(plan, epsilon, accountant, orders, eps_error, h)


def epsilon_bounds(
    ledger=None,
    /,
    *,
    delta: float,
    noise_multiplier: float | None = None,
    sample_rate: float | None = None,
    steps: int | None = None,
    eps_error: float | None = None,
    value_discretization_interval: float | None = None,
    allow_non_private: bool = False,
) -> _pld.PLDBounds:
    """Certified bracket ``lower <= true epsilon <= upper`` from the PLD accountant.

    ``upper`` is what ``epsilon(..., accountant="pld")`` returns; ``upper - lower`` states the
    discretisation error (see :mod:`vmapdp.accounting.pld`). Same call forms as
    :func:`epsilon`.

    Returns:
      ``PLDBounds(upper, lower, value_discretization_interval)``.

    Example:
      >>> b = epsilon_bounds(noise_multiplier=1.0, sample_rate=0.01, steps=1000, delta=1e-5)
      >>> 0 <= b.upper - b.lower <= 0.01 * b.upper
      True
    """
    where = "epsilon_bounds"
    ledger = _resolve_ledger(where, ledger, noise_multiplier, sample_rate, steps, allow_non_private)
    delta = _checks.check_delta(where, delta)
    _, _, eps_error, h = _options(where, "pld", None, eps_error, value_discretization_interval)
    plan = _plan(ledger)
    if plan.non_private:
        return _pld.PLDBounds(math.inf, math.inf, h or 0.0)
    found = _pld_events(plan)
    if found is None or plan.fail > 0 or (plan.epochs and not plan.fixed):
        raise ValueError(
            f"{where}: the certified bracket covers Poisson-subsampled events (add/remove) and fixed-size "
            "events (replace-one, possibly with epoch events); this ledger holds epoch events alone, "
            "truncated events, or Poisson events next to replace-one ones. Use epsilon(ledger, delta=...) "
            "for their upper bound."
        )
    events, relation = found
    return _pld.pld_epsilon_bounds(events, delta=delta, eps_error=eps_error, value_discretization_interval=h, relation=relation)


def _as_list(where, name, value):
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist() if value.dim() > 0 else value.item()
    elif hasattr(value, "tolist") and not isinstance(value, (int, float)):  # numpy arrays
        value = value.tolist()
    if isinstance(value, (list, tuple, range)):
        if len(value) == 0:
            raise ValueError(f"{where}: {name} is an empty sequence; pass at least one value.")
        return list(value)
    return [value]


def epsilon_grid(
    *,
    noise_multiplier,
    sample_rate,
    steps,
    delta,
    accountant: str = "pld",
    orders: Sequence[float] | None = None,
    eps_error: float | None = None,
    num_samples: int | None = None,
) -> list[float]:
    """Epsilon over a grid in one call, e.g. a curve over steps or over noise multipliers.

    Each of ``noise_multiplier``, ``sample_rate``, ``steps`` and ``delta`` is a scalar or a
    sequence (list, tuple, range, 1-D tensor or array); sequences must share one length and
    scalars are broadcast. The default ``"pld"`` runs one PLD composition per grid point
    (tens to hundreds of milliseconds each). With ``"rdp"`` the per-step RDP of every distinct
    (noise_multiplier, sample_rate) pair is computed in one vectorised pass, so a curve of a
    few hundred points takes milliseconds.

    Returns:
      list of float, one epsilon per grid point (same meaning as :func:`epsilon`).

    Raises:
      ValueError: a value is out of range (the message names it and its position), or the
        sequences have different lengths.

    Example:
      >>> eps = epsilon_grid(noise_multiplier=1.0, sample_rate=0.01, steps=[100, 1000, 10000], delta=1e-5)
      >>> eps == sorted(eps)
      True
    """
    where = "epsilon_grid"
    cols = {
        "noise_multiplier": _as_list(where, "noise_multiplier", noise_multiplier),
        "sample_rate": _as_list(where, "sample_rate", sample_rate),
        "steps": _as_list(where, "steps", steps),
        "delta": _as_list(where, "delta", delta),
    }
    lengths = {k: len(v) for k, v in cols.items() if len(v) > 1}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"{where}: the sequences have different lengths ({lengths}); pass sequences of one "
            "length, and scalars for the rest."
        )
    n = max([1, *lengths.values()])
    cols = {k: v * n if len(v) == 1 else v for k, v in cols.items()}
    sig = [_checks.check_noise_multiplier(f"{where}[{i}]", v) for i, v in enumerate(cols["noise_multiplier"])]
    qs = [_checks.check_sample_rate(f"{where}[{i}]", v) for i, v in enumerate(cols["sample_rate"])]
    ts = [_checks.check_steps(f"{where}[{i}]", v) for i, v in enumerate(cols["steps"])]
    ds = [_checks.check_delta(f"{where}[{i}]", v) for i, v in enumerate(cols["delta"])]
    accountant, orders, eps_error, _ = _options(where, accountant, orders, eps_error, None)
    if num_samples is not None:
        _checks.check_num_samples(where, num_samples, max(ds))
    if accountant == "gdp":
        _gdp.warn_gdp(where)
    if accountant != "rdp":
        return [
            _epsilon([(s, q, t)] if t > 0 and q > 0 else [], d, accountant, orders, eps_error, None)
            for s, q, t, d in zip(sig, qs, ts, ds)
        ]
    pairs = sorted(set(zip(sig, qs)))
    index = {p: i for i, p in enumerate(pairs)}
    rdp_one = _rdp.rdp_poisson_gaussian_batch(
        torch.tensor([p[0] for p in pairs], dtype=_F64), torch.tensor([p[1] for p in pairs], dtype=_F64), orders
    )
    rows = torch.tensor([index[(s, q)] for s, q in zip(sig, qs)])
    total = rdp_one[rows] * torch.tensor(ts, dtype=_F64)[:, None]
    return _rdp.rdp_to_epsilon(total, orders, torch.tensor(ds, dtype=_F64)).tolist()


def calibrate_noise(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    orders: Sequence[float] | None = None,
    eps_error: float | None = None,
    value_discretization_interval: float | None = None,
    num_samples: int | None = None,
    rtol: float = 0.01,
    sampling: str = "poisson",
) -> float:
    """The smallest noise multiplier whose epsilon is at most ``target_epsilon``.

    Searches ``noise_multiplier`` in [0.1, 1e4] (log-space bracketing, then safeguarded
    log-log interpolation/bisection) against exactly what ``epsilon(noise_multiplier=...,
    sample_rate=..., steps=..., delta=..., accountant=..., <same options>)`` returns. The
    default accountant is ``"pld"``: it needs 5-11% less noise than ``"rdp"`` for the same
    budget (e.g. 0.815 against 0.866 at target_epsilon=3, delta=1e-5, sample_rate=0.01,
    steps=1000), because it is a tighter upper bound on the same epsilon.

    Guarantees:
      The achieved epsilon lies in the bracket ``[(1 - rtol) * target_epsilon,
      target_epsilon]``: ``epsilon(noise_multiplier=result, ...) <= target_epsilon`` (never
      overshoots; the search keeps an upper end that meets the target and returns it), and
      ``>= (1 - rtol) * target_epsilon`` (unless the search bottoms out on a noise grid
      narrower than 1e-12 relative).

    Args:
      target_epsilon: the budget, > 0.
      delta, sample_rate, steps, accountant, orders, eps_error,
        value_discretization_interval, num_samples: as in :func:`epsilon` (steps >= 1,
        sample_rate > 0).
      rtol: accepted relative shortfall of the achieved epsilon below the target.
      sampling: ``"poisson"`` (the default), or ``"balls_in_bins"``: ``steps`` steps of
        :class:`vmapdp.data.BallsInBinsSampler` with ``steps_per_epoch = 1 / sample_rate`` (an
        integer), accounted as :class:`BallsInBinsGaussianEvent` (a partial last epoch charged
        whole). With ``"pld"`` every trial noise computes new epoch distributions (seconds each).

    Returns:
      noise_multiplier (float).

    Raises:
      ValueError: bad arguments; the budget needs noise_multiplier > 1e4 (target too small);
        or the budget is met even at noise_multiplier = 0.1 (delta too large for the
        sampling: no meaningful calibration).

    Example:
      >>> s = calibrate_noise(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=1000)
      >>> epsilon(noise_multiplier=s, sample_rate=0.01, steps=1000, delta=1e-5) <= 3.0
      True
    """
    where = "calibrate_noise"
    target = _checks.check_epsilon(where, target_epsilon, name="target_epsilon", positive=True)
    delta = _checks.check_delta(where, delta)
    q = _checks.check_sample_rate(where, sample_rate)
    steps = _checks.check_steps(where, steps, minimum=1)
    if q == 0.0:
        raise ValueError(
            f"{where}: sample_rate=0.0 uses no data, so every noise multiplier gives epsilon 0; "
            "pass the real sample_rate (expected batch size / dataset size)."
        )
    accountant, orders, eps_error, h = _options(where, accountant, orders, eps_error, value_discretization_interval)
    rtol = _checks.check_positive(where, "rtol", rtol, hint="e.g. rtol=0.01 (within 1% below the target).")
    if rtol >= 1.0:
        raise ValueError(f"{where}: rtol={rtol!r} must be below 1, e.g. 0.01.")
    _checks.check_num_samples(where, num_samples, delta)
    _shared_checks.choice(where, "sampling", sampling, ("poisson", "balls_in_bins"), why="it names the sampler the noise is calibrated for")
    if sampling == "balls_in_bins":
        per_epoch = round(1.0 / q)
        if abs(per_epoch * q - 1.0) > 1e-9:
            raise ValueError(
                f"{where}: sampling='balls_in_bins' needs sample_rate = 1 / steps_per_epoch for an integer "
                f"steps_per_epoch; got sample_rate={q!r}. Pass sample_rate=sampler.sample_rate."
            )
    if accountant == "gdp":
        _gdp.warn_gdp(where)
        if sampling != "poisson":
            raise ValueError(f"{where}: accountant='gdp' applies to sampling='poisson' only; pass accountant='pld' or 'rdp'.")

    cache: dict[float, float] = {}

    def f(sigma: float) -> float:
        if sigma not in cache:
            if sampling == "poisson":
                plan = [(sigma, q, steps)]
            else:
                plan = _plan(Ledger((BallsInBinsGaussianEvent(sigma, per_epoch, count=steps),)))
            cache[sigma] = _epsilon(plan, delta, accountant, orders, eps_error, h)
        return cache[sigma]

    # bracket: lo infeasible (eps > target), hi feasible (eps <= target)
    sigma = 1.0
    if f(sigma) <= target:
        hi = sigma
        lo = sigma / 2
        while f(lo) <= target:
            if lo <= _MIN_NOISE:
                raise ValueError(
                    f"{where}: even noise_multiplier={lo:.3g} gives epsilon={f(lo):.4g} <= "
                    f"target_epsilon={target!r} (delta={delta!r}, sample_rate={q!r}, steps={steps}): "
                    "delta is so large next to the chance of ever sampling an example that "
                    "the budget says nothing. Use a smaller delta or a smaller target_epsilon."
                )
            hi, lo = lo, max(lo / 2, _MIN_NOISE)
    else:
        lo = sigma
        hi = sigma * 2
        while f(hi) > target:
            if hi >= _MAX_NOISE:
                raise ValueError(
                    f"{where}: target_epsilon={target!r} needs noise_multiplier > {_MAX_NOISE:g} "
                    f"(epsilon at {_MAX_NOISE:g} is {f(hi):.4g}); the budget is too small for "
                    f"steps={steps}, sample_rate={q!r}, delta={delta!r}. Raise target_epsilon, "
                    "or lower steps or sample_rate."
                )
            lo, hi = hi, min(hi * 2, _MAX_NOISE)
    goal = target * (1.0 - rtol / 2)
    for it in range(200):
        e_hi = f(hi)
        if e_hi >= (1.0 - rtol) * target or hi / lo <= 1.0 + 1e-12:
            return hi
        e_lo = f(lo)
        a, b = math.log(lo), math.log(hi)
        mid = 0.5 * (a + b)
        if it % 3 != 2 and math.isfinite(e_lo) and e_lo > 0 and e_hi > 0:
            # epsilon is close to a power of sigma: interpolate log(eps) linearly in log(sigma)
            la, lb = math.log(e_lo), math.log(e_hi)
            cand = a + (math.log(goal) - la) * (b - a) / (lb - la)
            width = b - a
            mid = min(max(cand, a + 0.02 * width), b - 0.02 * width)
        sigma = math.exp(mid)
        if f(sigma) <= target:
            hi = sigma
        else:
            lo = sigma
    return hi


# ---------------------------------------------------------------------------------------
# Budgets
# ---------------------------------------------------------------------------------------


def within_budget(ledger: Ledger, /, *, epsilon: float, delta: float, accountant: str = "pld") -> bool:
    """Whether the ledger's epsilon at ``delta`` is at most ``epsilon``: the check a training
    step makes before every release, cheap enough for that.

    Sound shortcuts, never a looser answer than ``epsilon(ledger, ...) <= epsilon``:

    * RDP first (microseconds): it is an upper bound on the true epsilon, so RDP within the
      budget means the ledger is within it, whatever ``accountant`` is asked.
    * A replace-one ledger of shuffled or balls-in-bins batches: ``"pld"`` is the exact closed
      form for Gaussian epochs; where it cannot bound the ledger (Poisson steps converted to
      replace-one) RDP is the only bound, so when RDP is over the budget the ledger is not
      within it (the step stops where RDP says).
    * Else (Poisson-type steps, or a fixed-size step last), for ``"pld"``: the largest count
      ``K`` of the ledger's last event that stays within
      the budget is found once (galloping from the current count, then bisection; cached), and
      later calls compare counts. The true epsilon grows with the count, so a certified upper
      bound within the budget at ``K`` covers every count up to ``K``.

    Raises:
      ValueError / TypeError: a bad argument (the checks of :func:`epsilon`).
    """
    where = "within_budget"
    if not isinstance(ledger, Ledger):
        raise TypeError(f"{where}(ledger): expected a Ledger, got {type(ledger).__name__}.")
    epsilon = _checks.check_epsilon(where, epsilon)
    delta = _checks.check_delta(where, delta)
    accountant = _options(where, accountant, None, None, None)[0]
    if not ledger.events:
        return True
    rdp_bounded = True
    try:
        if _ledger_epsilon(ledger.events, delta, "rdp") <= epsilon:
            return True
    except ValueError:  # a ledger RDP does not cover: decide with the accountant asked
        rdp_bounded = False
    if accountant == "rdp":
        return False
    *prefix, last = ledger.events
    if ledger.adjacency == _events.REPLACE_ONE and not isinstance(last, FixedSizeGaussianEvent):
        # "pld" here is the closed form of the composed epoch Gaussians (cheap: no count search),
        # or a refusal (Poisson steps converted): then RDP, an upper bound, is the only bound and is over
        try:
            return _ledger_epsilon(ledger.events, delta, accountant) <= epsilon
        except ValueError:  # refused: RDP's bound, over the budget, decides
            if rdp_bounded:
                return False
            raise
    if ledger.adjacency == _events.REPLACE_ONE and _pld_events(_plan(ledger)) is None:
        if rdp_bounded:  # fixed-size steps after Poisson ones: RDP's bound, over the budget, decides
            return False
        raise ValueError(f"{where}: no accountant bounds this ledger; see epsilon(ledger, delta=...).")
    # the count search varies the last event's count; its family must reach the last event itself
    # (an epoch event whose epochs exceed 1, from a noise change mid-epoch, is not reached from a
    # count of 1: its epochs were clamped to 1 and the budget went one epoch over, found by review)
    for base in (last._with_count(1), last._with_count(max(getattr(last, "epochs", 1), 1))):
        if base._with_count(last.count) == last:
            return last.count <= _max_count(tuple(prefix), base, last.count, epsilon, delta, accountant)
    return _ledger_epsilon(ledger.events, delta, accountant) <= epsilon


def _ledger_epsilon(events: tuple, delta: float, accountant: str) -> float:
    return float(epsilon(Ledger(events), delta=delta, accountant=accountant, allow_non_private=True))


_MAX_COUNTS: dict[tuple, int] = {}  # a memo of _max_count's pure results (bounded)


def _max_count(prefix: tuple, event: Any, start: int, budget: float, delta: float, accountant: str) -> int:
    """The largest ``k`` with ``epsilon(prefix + event x k) <= budget``, or a number below
    ``start`` when ``start`` itself is over (then nothing is memoised: the step stops there)."""
    key = (prefix, event, budget, delta, accountant)
    if key in _MAX_COUNTS:
        return _MAX_COUNTS[key]

    def ok(k: int) -> bool:
        return _ledger_epsilon(prefix + (event._with_count(k),), delta, accountant) <= budget

    if not ok(start):
        return start - 1
    lo, step = start, max(1, start // 16)
    while ok(lo + step):  # gallop: every certified count is a lower bound on the largest one
        lo, step = lo + step, step * 2
        if lo > 1 << 40:
            break
    hi = lo + step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    if len(_MAX_COUNTS) >= 64:
        _MAX_COUNTS.clear()
    _MAX_COUNTS[key] = lo
    return lo
