"""accounting.within_budget: the step's budget check, fast and never looser than epsilon() itself."""

import pytest

from vmapdp import accounting
from vmapdp.accounting import Ledger, PoissonGaussianEvent
from vmapdp.accounting import core


def _ledger(*pairs):
    """Ledger of (noise_multiplier, count) Poisson events at q = 0.02."""
    return Ledger(tuple(PoissonGaussianEvent(noise_multiplier=s, sample_rate=0.02, count=c) for s, c in pairs))


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_within_budget_agrees_with_epsilon_at_every_count(accountant):
    """Walking a run step by step, the answer is exactly `epsilon(ledger) <= budget` at each count
    (the counts straddle the boundary, where the shortcuts switch from RDP to the cached PLD count)."""
    core._MAX_COUNTS.clear()
    delta, prefix = 1e-5, ((1.5, 40),)
    budget = accounting.epsilon(_ledger(*prefix, (1.0, 70)), delta=delta, accountant=accountant) * 1.0001
    reference = [accounting.epsilon(_ledger(*prefix, (1.0, c)), delta=delta, accountant=accountant) <= budget for c in range(1, 140, 3)]
    fast = [accounting.within_budget(_ledger(*prefix, (1.0, c)), epsilon=budget, delta=delta, accountant=accountant) for c in range(1, 140, 3)]
    assert fast == reference
    assert any(reference) and not all(reference)  # the sweep crosses the budget


def test_within_budget_is_sound_where_rdp_says_no_but_pld_says_yes():
    """PLD allows more steps than RDP for the same budget; the answer follows PLD there (the
    budget make_private calibrates for), and is False just past PLD's last certified count."""
    core._MAX_COUNTS.clear()
    budget, delta = 2.0, 1e-5
    k = core._max_count((), PoissonGaussianEvent(noise_multiplier=1.0, sample_rate=0.02), 1, budget, delta, "pld")
    assert accounting.epsilon(_ledger((1.0, k)), delta=delta) <= budget < accounting.epsilon(_ledger((1.0, k + 1)), delta=delta)
    assert accounting.epsilon(_ledger((1.0, k)), delta=delta, accountant="rdp") > budget  # RDP alone would stop earlier
    assert accounting.within_budget(_ledger((1.0, k)), epsilon=budget, delta=delta)
    assert not accounting.within_budget(_ledger((1.0, k + 1)), epsilon=budget, delta=delta)


def test_within_budget_checks_its_arguments():
    with pytest.raises(TypeError, match=r"within_budget\(ledger\): expected a Ledger"):
        accounting.within_budget([], epsilon=1.0, delta=1e-5)
    with pytest.raises(ValueError, match=r"delta"):
        accounting.within_budget(Ledger(), epsilon=1.0, delta=2.0)
    assert accounting.within_budget(Ledger(), epsilon=1.0, delta=1e-5)


def test_within_budget_charges_a_balls_in_bins_epoch_opened_under_another_noise():
    """Found by review (hunt2/f2_bib_budget_ledger.py): half an epoch at noise 2.0, then noise 1.5
    for the rest of it and 2.3 more epochs: the last event touches 4 epochs (3 opened + the one it
    continues), but the budget's count search started from ``_with_count(1)``, which clamps the
    epochs to 1, and charged 3: steps were released at epsilon 2.051 past a budget of 2.0."""
    from vmapdp.accounting import BallsInBinsGaussianEvent as Event

    spe, ledger = 10, Ledger()
    for t in range(5):
        ledger = ledger.append(Event(noise_multiplier=2.0, steps_per_epoch=spe, epochs=int(t == 0), continues=t != 0))
    for t in range(5, 33):
        ledger = ledger.append(Event(noise_multiplier=1.5, steps_per_epoch=spe, epochs=int(t % spe == 0), continues=t % spe != 0))
    assert ledger.events[-1].charged_epochs == 4
    eps = accounting.epsilon(ledger, delta=1e-5)
    assert not accounting.within_budget(ledger, epsilon=eps * (1 - 1e-3), delta=1e-5, accountant="pld")  # was True
    assert accounting.within_budget(ledger, epsilon=eps * (1 + 1e-3), delta=1e-5, accountant="pld")
