"""Check that the ledger a step wrote matches the steps taken, the noise and the batch scheme: :func:`check_ledger`.

Exact: the recorded ledger must equal the one expected; the report gives the epsilon each implies
(:func:`ledger_epsilon`, also the white-box audit's claimed epsilon).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from vmapdp import _checks, accounting
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


def sampler_events(sampler: Any, steps: int, noise_multiplier: float) -> Ledger:
    """The ledger of the last ``steps`` batches ``sampler`` drew at ``noise_multiplier``, written
    from the scheme's definition: the sampler's (stateless) event per step, and for an epoch
    sampler one event per step (:class:`EpochGaussianEvent`, or :class:`BallsInBinsGaussianEvent`
    for balls-in-bins) whose ``epochs`` counts the draws
    ``i = draws - steps, ..., draws - 1`` (0-based) with ``i % steps_per_epoch == 0``."""
    spe = getattr(sampler, "steps_per_epoch", None)
    if spe is None:
        return Ledger((dataclasses.replace(sampler.event(noise_multiplier), count=steps),))
    drawn = sampler._step
    if drawn < steps:
        raise ValueError(f"check_ledger: the sampler drew {drawn} batch(es), fewer than steps={steps}; pass the sampler the steps' batches came from, after the steps.")
    ledger = Ledger()
    for i in range(drawn - steps, drawn):
        ledger = ledger.append(sampler._event(noise_multiplier, int(i % spe == 0)))  # the scheme's event, this step's epoch flag
    return ledger


def check_ledger(
    state_before: Any,
    state_after: Any,
    *,
    steps: int,
    noise_multiplier: float,
    sample_rate: float | None = None,
    sampler: Any = None,
    delta: float = 1e-5,
    accountant: str = "rdp",
    privatizer: Any = None,
    raise_on_failure: bool = True,
) -> LedgerReport:
    """Check that the ledger the step wrote matches the steps taken, the noise and the sampling rate.

    The accountant only knows what the ledger says: a step that records a smaller sampling rate or
    a larger noise multiplier than it used, records another sampling scheme than the one that drew
    the batches, or records nothing, reports a false epsilon. Exact: ``state_after.ledger`` must
    equal ``state_before.ledger`` followed by ``steps`` events of the scheme
    (``PoissonGaussianEvent(noise_multiplier, sample_rate)`` for ``sample_rate=`` alone; with
    ``sampler=``, the sampler's events, epochs charged on the draws that opened them: see
    :func:`sampler_events`; a ``NonPrivateEvent`` for noise 0), and the step counter must have
    advanced by ``steps``.

    Args:
        state_before, state_after: train states (or ledgers) around the steps.
        steps: how many steps were taken.
        noise_multiplier: the noise std / l2_clip_norm the step was meant to add.
        sample_rate: the Poisson rate the batches were really drawn with (the sampler's).
        sampler: the :mod:`vmapdp.data` sampler that drew the steps' batches, after the steps (any
            scheme); with ``sample_rate`` too, the two must agree.
        delta, accountant: to report the epsilon implied by each ledger.
        privatizer: the step's privatizer when it has a ``bind`` hook (correlated noise,
            :func:`vmapdp.mf.correlated_noise`): the expected events are then the ones it
            declares for ``noise_multiplier`` and ``sampler``.
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
    sample_rate, sampler = _checks.batch_scheme(call, sample_rate, sampler)
    if privatizer is not None:  # (found by review: privatizer="banded" was taken)
        _checks.privatizer(call, privatizer)
    if steps == 0:
        added = Ledger()
    elif noise_multiplier == 0:
        added = Ledger((NonPrivateEvent(count=steps),))
    elif privatizer is not None and getattr(privatizer, "bind", None) is not None:
        _, event, _ = privatizer.bind(call, noise_multiplier=noise_multiplier, l2_sensitivity=1.0, sample_rate=sample_rate, sampler=sampler, secure=False)
        added = Ledger((dataclasses.replace(event(), count=steps),))
    elif sampler is not None:
        added = sampler_events(sampler, steps, noise_multiplier)
    else:
        added = Ledger().record(noise_multiplier=noise_multiplier, sample_rate=sample_rate, count=steps)
    expected = before  # (appended, the run's next steps: positional events merge only so; found by review)
    for e in added.events:
        expected = expected.append(e)
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
        if privatizer is None and any(type(e).__name__.endswith("MFEvent") for e in rec_new):
            # (found by review: a correlated-noise run checked without its privatizer was blamed on a hand-written ledger)
            hint.append("the steps used correlated noise: pass privatizer= (the correlated_noise(...) the step was made with)")
        if taken < 0:  # (the other hints then do not apply)
            hint = ["state_before is after state_after (swapped?)"]
        figures = (
            f"The accountant would report epsilon {e_rec:.4g} instead of {e_exp:.4g}" if f"{e_rec:.4g}" != f"{e_exp:.4g}"
            else f"The accountant reports epsilon {e_rec:.4g} for both, from other events"
        )
        message = (
            f"{call}: FAILED: {'; '.join(problems)}. {figures} at delta={delta:g} ({accountant}). Likely: {'; '.join(hint) or 'a ledger written by hand'}. "
            "Build the step with the sampler the batches come from (make_train_step(..., sampler=sampler))."
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
