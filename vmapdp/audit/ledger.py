"""Check that the ledger a step wrote matches the steps taken, the noise and the rate: :func:`check_ledger`.

Exact: the recorded ledger must equal the one expected; the report gives the epsilon each implies
(:func:`ledger_epsilon`, also the white-box audit's claimed epsilon).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from vmapdp import accounting
from vmapdp.accounting import Ledger, NonPrivateEvent, PoissonGaussianEvent
from vmapdp.audit.report import finish

__all__ = ["LedgerReport", "check_ledger", "ledger_epsilon"]


@dataclasses.dataclass(frozen=True)
class LedgerReport:
    """Result of :func:`check_ledger`: the ledger expected after the steps and the one recorded,
    with the epsilon each implies at ``delta``."""

    passed: bool
    steps_taken: int
    expected: Ledger
    recorded: Ledger
    epsilon_expected: float
    epsilon_recorded: float
    delta: float
    message: str

    def __str__(self) -> str:
        return self.message


def _ledger_of(call: str, name: str, state: Any) -> Ledger:
    ledger = state if isinstance(state, Ledger) else getattr(state, "ledger", None)
    if not isinstance(ledger, Ledger):
        raise TypeError(f"{call}: {name} must be a TrainState (or a Ledger), got {type(state).__name__}.")
    return ledger


def ledger_epsilon(ledger: Ledger, *, delta: float, accountant: str) -> float:
    """The epsilon a ledger implies at ``delta``: 0 when empty, infinite with a non-private event."""
    if not ledger.events:
        return 0.0
    if any(isinstance(e, NonPrivateEvent) for e in ledger.events):
        return math.inf
    return float(accounting.epsilon(ledger, delta=delta, accountant=accountant))


def check_ledger(
    state_before: Any,
    state_after: Any,
    *,
    steps: int,
    noise_multiplier: float,
    sample_rate: float,
    delta: float = 1e-5,
    accountant: str = "rdp",
    raise_on_failure: bool = True,
) -> LedgerReport:
    """Check that the ledger the step wrote matches the steps taken, the noise and the sampling rate.

    The accountant only knows what the ledger says: a step that records a smaller sampling rate or
    a larger noise multiplier than it used, or records nothing, reports a false epsilon. Exact:
    ``state_after.ledger`` must equal ``state_before.ledger`` followed by ``steps`` events of
    ``PoissonGaussianEvent(noise_multiplier, sample_rate)`` (a ``NonPrivateEvent`` for noise 0),
    and the step counter must have advanced by ``steps``.

    Args:
        state_before, state_after: train states (or ledgers) around the steps.
        steps: how many steps were taken.
        noise_multiplier: the noise std / l2_clip_norm the step was meant to add.
        sample_rate: the Poisson rate the batches were really drawn with (the sampler's).
        delta, accountant: to report the epsilon implied by each ledger.
        raise_on_failure: raise :class:`PrivacyCheckError` on failure (default) or return the report.

    Returns:
        A :class:`LedgerReport`.

    Raises:
        PrivacyCheckError: the recorded ledger differs from the expected one.
    """
    call = "check_ledger(state_before, state_after)"
    before = _ledger_of(call, "state_before", state_before)
    after = _ledger_of(call, "state_after", state_after)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"{call}: steps={steps!r} must be an int >= 0.")
    if steps == 0:
        added = Ledger()
    elif noise_multiplier == 0:
        added = Ledger((NonPrivateEvent(count=steps),))
    else:
        added = Ledger().record(noise_multiplier=noise_multiplier, sample_rate=sample_rate, count=steps)
    expected = before.extend(added)
    problems = []
    b_step, a_step = getattr(state_before, "step", None), getattr(state_after, "step", None)
    taken = steps if b_step is None or a_step is None else a_step - b_step
    if taken != steps:
        problems.append(f"the step counter advanced by {taken}, not {steps}")
    if after != expected:
        problems.append(f"the ledger records {list(after.events)}, expected {list(expected.events)}")

    e_exp, e_rec = ledger_epsilon(expected, delta=delta, accountant=accountant), ledger_epsilon(after, delta=delta, accountant=accountant)
    passed = not problems
    if passed:
        message = f"check_ledger: passed: {steps} step(s) recorded as {list(added.events)}; epsilon {e_rec:.4g} at delta={delta:g} ({accountant})."
    else:
        hint = []
        rec_new = after.events[len(before.events) - 1 :] if before.events else after.events
        rates = {e.sample_rate for e in rec_new if isinstance(e, PoissonGaussianEvent)}
        sigmas = {e.noise_multiplier for e in rec_new if isinstance(e, PoissonGaussianEvent)}
        if rates and rates != {float(sample_rate)}:
            hint.append(f"the step was built with sample_rate={sorted(rates)} but the batches were drawn at {sample_rate:g}")
        if sigmas and noise_multiplier and sigmas != {float(noise_multiplier)}:
            hint.append(f"it records noise_multiplier={sorted(sigmas)} instead of {noise_multiplier:g}")
        if after.steps - before.steps != steps:
            hint.append(f"{after.steps - before.steps} event(s) recorded for {steps} step(s) (a step that skips or doubles the record)")
        message = (
            f"{call}: FAILED: {'; '.join(problems)}. The accountant would report epsilon {e_rec:.4g} instead of "
            f"{e_exp:.4g} at delta={delta:g} ({accountant}). Likely: {'; '.join(hint) or 'a ledger written by hand'}. "
            "Build the step with the sampler's sample_rate (make_train_step(..., sample_rate=sampler.sample_rate))."
        )
    return finish(
        LedgerReport(
            passed=passed,
            steps_taken=taken,
            expected=expected,
            recorded=after,
            epsilon_expected=e_exp,
            epsilon_recorded=e_rec,
            delta=delta,
            message=message,
        ),
        raise_on_failure,
    )
