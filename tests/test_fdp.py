"""f-DP readouts: tpr_bound (the hypothesis-testing form of the ledger's delta(eps)) and mu_gdp."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import norm

from vmapdp import accounting
from vmapdp.accounting import EpochGaussianEvent, FixedSizeGaussianEvent, Ledger, NonPrivateEvent, PoissonGaussianEvent

FPR = torch.tensor([0.0, 1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0], dtype=torch.float64)


def gaussian_tpr(alpha: torch.Tensor, mu: float) -> torch.Tensor:
    """The exact trade-off of the Gaussian mechanism G_mu (Dong, Roth, Su 2022): TPR = Phi(Phi^-1(FPR) + mu)."""
    return torch.tensor(norm.cdf(norm.ppf(alpha.numpy()) + mu), dtype=torch.float64)


def full_batch(sigma: float) -> Ledger:
    return Ledger((PoissonGaussianEvent(noise_multiplier=sigma, sample_rate=1.0),))


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 5.0])
def test_full_batch_gaussian_bound_is_above_the_exact_tradeoff_and_close_to_it(sigma):
    """One full-batch step is the Gaussian mechanism with mu = 1 / sigma: the bound may not be
    below its exact TPR anywhere (that would claim more privacy than the mechanism has), and the
    PLD's is within 1e-3 of it (measured: at most 4e-4)."""
    bound = accounting.tpr_bound(full_batch(sigma), fpr=FPR)
    exact = gaussian_tpr(FPR, 1.0 / sigma)
    assert bool((bound >= exact - 1e-12).all())
    assert float((bound - exact).max()) < 1e-3
    rdp = accounting.tpr_bound(full_batch(sigma), fpr=FPR, accountant="rdp")  # looser, still a bound
    assert bool((rdp >= bound - 1e-9).all())


def test_the_bound_is_monotone_in_fpr_and_grows_as_the_noise_shrinks():
    alpha = torch.linspace(0, 1, 101, dtype=torch.float64)
    ledgers = [Ledger((PoissonGaussianEvent(noise_multiplier=s, sample_rate=0.1, count=20),)) for s in (2.0, 1.0, 0.7)]
    bounds = [accounting.tpr_bound(L, fpr=alpha) for L in ledgers]
    for b in bounds:
        assert bool((b[1:] >= b[:-1]).all())
        assert bool((b >= alpha).all()) and bool((b <= 1.0).all())
    inner = slice(1, -1)  # at fpr 0 and 1 all bounds may meet
    assert bool((bounds[1][inner] > bounds[0][inner]).all()) and bool((bounds[2][inner] > bounds[1][inner]).all())


def test_the_bound_is_the_hypothesis_testing_form_of_the_ledgers_delta():
    """At every grid eps, (eps, delta(eps)) alone gives the formula's value; the minimum over a
    grid is at most each of them, and a one-point grid gives exactly that point's value."""
    ledger = Ledger((PoissonGaussianEvent(noise_multiplier=1.0, sample_rate=0.1, count=20),))
    eps = 1.5
    d = float(accounting.delta_curve(ledger, [eps])[0])
    assert d == pytest.approx(accounting.delta(ledger, epsilon=eps), rel=0.05)  # same PLD, other grids
    alpha = torch.tensor([0.01, 0.2, 0.6], dtype=torch.float64)
    one = accounting.tpr_bound(ledger, fpr=alpha, epsilons=[eps])
    by_hand = torch.minimum(torch.minimum(math.exp(eps) * alpha + d, 1 - math.exp(-eps) * (1 - d - alpha)), torch.ones(3, dtype=torch.float64))
    assert torch.allclose(one, torch.maximum(by_hand, alpha), atol=1e-12)
    assert bool((accounting.tpr_bound(ledger, fpr=alpha) <= one + 1e-12).all())


def test_epoch_ledgers_have_the_exact_gaussian_tradeoff_and_mu():
    """Three shuffled epochs at sigma=4: three Gaussian mechanisms of sensitivity 2, mu = sqrt(3) * 2 / 4."""
    ledger = Ledger((EpochGaussianEvent(noise_multiplier=4.0, steps_per_epoch=10, scheme="shuffle", count=30, epochs=3),))
    mu = accounting.mu_gdp(ledger)
    assert mu == pytest.approx(math.sqrt(3) * 0.5, rel=1e-12)
    bound = accounting.tpr_bound(ledger, fpr=FPR)
    exact = gaussian_tpr(FPR, mu)
    assert bool((bound >= exact - 1e-12).all()) and float((bound - exact).max()) < 1e-3


def test_mu_gdp_is_the_labelled_clt_approximation_for_poisson_and_refuses_elsewhere():
    ledger = Ledger((PoissonGaussianEvent(noise_multiplier=1.0, sample_rate=0.01, count=1000),))
    with pytest.warns(UserWarning, match=r"central-limit approximation, not an upper bound"):
        mu = accounting.mu_gdp(ledger)
    assert mu == pytest.approx(0.01 * math.sqrt(1000 * math.expm1(1.0)), rel=1e-12)
    with pytest.raises(ValueError, match=r"mu_gdp\(ledger\): .*fixed-size"):
        accounting.mu_gdp(Ledger((FixedSizeGaussianEvent(noise_multiplier=1.0, batch_size=10, num_samples=100),)))
    assert accounting.mu_gdp(Ledger()) == 0.0 and accounting.mu_gdp(Ledger((NonPrivateEvent(),))) == math.inf


def test_tpr_bound_edges_and_argument_checks():
    assert torch.equal(accounting.tpr_bound(Ledger(), fpr=FPR), FPR)  # nothing released: guessing
    assert torch.equal(accounting.tpr_bound(Ledger((NonPrivateEvent(),)), fpr=FPR), torch.ones_like(FPR))
    fixed = Ledger((FixedSizeGaussianEvent(noise_multiplier=2.0, batch_size=10, num_samples=100, count=5),))
    mixed = Ledger().record(noise_multiplier=2.0, sample_rate=0.1, count=5) + fixed  # Poisson converted to replace-one
    with pytest.raises(ValueError, match=r"accountant='pld' has no privacy loss distribution for Poisson events"):
        accounting.tpr_bound(mixed, fpr=0.1)
    assert 0.1 < float(accounting.tpr_bound(mixed, fpr=0.1, accountant="rdp")) <= 1.0
    # fixed-size batches have a PLD (replace-one): tighter than RDP, never below the remove pair it contains
    tpr_pld, tpr_rdp = (float(accounting.tpr_bound(fixed, fpr=0.1, accountant=a)) for a in ("pld", "rdp"))
    assert 0.1 < tpr_pld <= tpr_rdp <= 1.0
    with pytest.raises(ValueError, match=r"tpr_bound\(ledger, fpr\): fpr must be in \[0, 1\], got \[1.5\]"):
        accounting.tpr_bound(full_batch(1.0), fpr=[0.1, 1.5])
    with pytest.raises(ValueError, match=r"accountant='gdp' is a central-limit approximation, not a bound"):
        accounting.tpr_bound(full_batch(1.0), fpr=0.1, accountant="gdp")
