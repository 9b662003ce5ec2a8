"""Argument checks of the accounting functions: thin names over :mod:`vmapdp._checks`.

The shared module is the one home of argument checks (the same argument gets the same check,
range and exception type in every public entry point); these wrappers keep the accounting
code's call shape ``check_x(where, value)``.
"""

from __future__ import annotations

import math

from vmapdp import _checks
from vmapdp._checks import ACCOUNTANTS

__all__ = ["ACCOUNTANTS"]

_NON_PRIVATE_FIX = (
    "Zero noise is not private: pass allow_non_private=True to get epsilon=inf "
    "(or record a NonPrivateEvent), or use a positive noise_multiplier."
)


def check_noise_multiplier(where: str, value, *, allow_zero: bool = False) -> float:
    return _checks.noise_multiplier(where, value, allow_zero=allow_zero, zero_fix=_NON_PRIVATE_FIX)


def check_sample_rate(where: str, value) -> float:
    return _checks.sample_rate(where, value)


def check_steps(where: str, value, *, name: str = "steps", minimum: int = 0) -> int:
    steps = _checks.positive_int(where, name, value, minimum=minimum, meaning="it counts noisy steps")
    if steps > _MAX_STEPS:  # (found by review: 10**30 overflowed in the accountants' float / int64 arithmetic)
        raise ValueError(f"{where}: {name}={steps} is above 2**53, where the accountants' float64 arithmetic no longer counts steps exactly; no run takes that many. Pass the steps the run takes.")
    return steps


_MAX_STEPS = 1 << 53


def check_delta(where: str, value, *, name: str = "delta") -> float:
    return _checks.delta(where, value, name=name)


def check_epsilon(where: str, value, *, name: str = "epsilon", positive: bool = False) -> float:
    return _checks.epsilon(where, value, name=name, allow_zero=not positive)


def check_accountant(where: str, value) -> str:
    return _checks.accountant(where, value)


def check_orders(where: str, orders) -> tuple[float, ...]:
    """A non-empty sequence of finite Renyi orders > 1."""
    try:
        values = tuple(float(a) for a in orders)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: orders must be a sequence of real numbers, got {orders!r}. Leave orders=None for the default grid.") from None
    bad = [a for a in values if not (a > 1.0 and math.isfinite(a))]
    if not values or bad:
        raise ValueError(
            f"{where}: orders={orders!r} must be a non-empty sequence of finite Renyi "
            f"orders > 1 (bad: {bad}). Leave orders=None for the default grid "
            "(vmapdp.accounting.DEFAULT_ORDERS)."
        )
    return values


def check_num_samples(where: str, num_samples, delta: float) -> None:
    """Validate ``num_samples`` and warn when delta >= 1/num_samples (the accountants only report;
    make_private refuses such a delta)."""
    if num_samples is None:
        return
    n = _checks.positive_int(where, "num_samples", num_samples, meaning="num_samples is the dataset size")
    _checks.delta(where, delta, num_samples=n, refuse_large=False)


def check_positive(where: str, name: str, value, *, hint: str) -> float:
    """A finite real > 0 (tolerances, discretisation intervals)."""
    return _checks.positive(where, name, value, meaning=hint.rstrip("."))
