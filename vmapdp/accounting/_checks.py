"""Argument checks shared by the accounting functions.

Every check raises ``ValueError`` with the call shape as prefix, the argument with its
value, the allowed range, what the argument means and one fix.
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings

ACCOUNTANTS = ("rdp", "pld", "prv", "gdp")

_SAMPLE_RATE_MEANING = (
    "sample_rate is the probability that each example is in a step's batch "
    "(expected batch size / dataset size)"
)
_NOISE_MEANING = "noise_multiplier is the noise std divided by l2_clip_norm"
_DELTA_MEANING = (
    "delta is the probability with which the epsilon guarantee may fail; use a value "
    "well below 1/num_samples, e.g. 1e-5"
)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_noise_multiplier(where: str, value, *, allow_zero: bool = False) -> float:
    """A finite noise multiplier > 0 (or == 0 when ``allow_zero``)."""
    if not _is_real(value) or math.isnan(value):
        raise ValueError(
            f"{where}: noise_multiplier={value!r} must be a real number > 0; "
            f"{_NOISE_MEANING}. Pass a float such as noise_multiplier=1.0."
        )
    value = float(value)
    if value == 0.0 and allow_zero:
        return value
    if value <= 0.0:
        raise ValueError(
            f"{where}: noise_multiplier={value!r} is outside (0, inf); {_NOISE_MEANING}. "
            "Zero noise is not private: pass allow_non_private=True to get epsilon=inf "
            "(or record a NonPrivateEvent), or use a positive noise_multiplier."
        )
    if math.isinf(value):
        raise ValueError(
            f"{where}: noise_multiplier={value!r} must be finite; {_NOISE_MEANING}. "
            "A step that releases nothing needs no event: leave it out of the ledger."
        )
    return value


def check_sample_rate(where: str, value) -> float:
    """A sample rate in [0, 1]; 0 means the step touches no example (epsilon 0)."""
    if not _is_real(value) or math.isnan(value):
        raise ValueError(
            f"{where}: sample_rate={value!r} must be a real number in [0, 1]; "
            f"{_SAMPLE_RATE_MEANING}."
        )
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"{where}: sample_rate={value!r} is outside [0, 1]; {_SAMPLE_RATE_MEANING}. "
            "Did you pass the batch size? Use sample_rate=expected_batch_size/num_samples."
        )
    return value


def check_steps(where: str, value, *, name: str = "steps", minimum: int = 0) -> int:
    """An integer >= ``minimum`` (floats are refused, even 10.0: say int(...))."""
    if isinstance(value, bool):
        ok = False
    else:
        try:
            value = operator.index(value)
            ok = True
        except TypeError:
            ok = False
    if not ok:
        raise ValueError(
            f"{where}: {name}={value!r} must be an integer >= {minimum} (the number of "
            f"noisy steps); got {type(value).__name__}. Pass {name}=int(...), e.g. "
            f"{name}=int(epochs / sample_rate)."
        )
    if value < minimum:
        raise ValueError(
            f"{where}: {name}={value!r} is below {minimum}; it counts noisy steps. "
            f"Pass an integer >= {minimum}."
        )
    return value


def check_delta(where: str, value, *, name: str = "delta") -> float:
    """0 < delta < 1."""
    if not _is_real(value) or math.isnan(value):
        raise ValueError(
            f"{where}: {name}={value!r} must be a real number in (0, 1); {_DELTA_MEANING}."
        )
    value = float(value)
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"{where}: {name}={value!r} is outside (0, 1); {_DELTA_MEANING}."
        )
    return value


def check_epsilon(where: str, value, *, name: str = "epsilon", positive: bool = False) -> float:
    """A finite epsilon >= 0 (> 0 when ``positive``)."""
    bad = not _is_real(value) or math.isnan(value) or math.isinf(value)
    if not bad:
        value = float(value)
        bad = value <= 0.0 if positive else value < 0.0
    if bad:
        lo = "(0, inf)" if positive else "[0, inf)"
        raise ValueError(
            f"{where}: {name}={value!r} is outside {lo}; epsilon is the privacy budget "
            f"(e.g. {name}=8.0)."
        )
    return value


def check_accountant(where: str, value) -> str:
    """One of ``ACCOUNTANTS``; "prv" is returned as "pld" (same accountant)."""
    if not isinstance(value, str) or value.lower() not in ACCOUNTANTS:
        raise ValueError(
            f"{where}: accountant={value!r} is not one of {', '.join(map(repr, ACCOUNTANTS))}. "
            "Use 'rdp' (fast upper bound), 'pld' (tight upper bound) or 'gdp' "
            "(CLT approximation, not a bound)."
        )
    value = value.lower()
    return "pld" if value == "prv" else value


def check_orders(where: str, orders) -> tuple[float, ...]:
    """A non-empty sequence of finite Renyi orders > 1."""
    try:
        values = tuple(float(a) for a in orders)
    except TypeError:
        values = ()
    bad = [a for a in values if not (a > 1.0 and math.isfinite(a))]
    if not values or bad:
        raise ValueError(
            f"{where}: orders={orders!r} must be a non-empty sequence of finite Renyi "
            f"orders > 1 (bad: {bad}). Leave orders=None for the default grid "
            "(vmapdp.accounting.DEFAULT_ORDERS)."
        )
    return values


def check_num_samples(where: str, num_samples, delta: float) -> None:
    """Validate ``num_samples`` and warn when delta >= 1/num_samples."""
    if num_samples is None:
        return
    n = check_steps(where, num_samples, name="num_samples", minimum=1)
    if delta >= 1.0 / n:
        warnings.warn(
            f"{where}: delta={delta!r} >= 1/num_samples = {1.0 / n:.3g}. With such a delta "
            "a mechanism that publishes one random example in the clear satisfies the "
            "guarantee; use delta well below 1/num_samples (e.g. 1/num_samples**1.1).",
            UserWarning,
            stacklevel=3,
        )


def check_positive(where: str, name: str, value, *, hint: str) -> float:
    """A finite real > 0 (tolerances, discretisation intervals)."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {name}={value!r} must be a finite number > 0; {hint}")
    return float(value)
