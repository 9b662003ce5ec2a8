"""Privacy accounting for DP-SGD: events, ledgers and accountants as pure functions.

Training appends immutable events to an immutable :class:`Ledger`; accountants read it::

    from vmapdp import accounting as acc

    ledger = acc.Ledger()
    ledger = ledger.record(noise_multiplier=1.1, sample_rate=0.01, count=500)  # or per step
    ledger = ledger.record(noise_multiplier=0.9, sample_rate=0.01, count=500)  # a schedule
    acc.epsilon(ledger, delta=1e-5)                      # tight upper bound (PLD, the default)
    acc.epsilon(ledger, delta=1e-5, accountant="rdp")    # looser upper bound (RDP), fast
    acc.epsilon(noise_multiplier=1.1, sample_rate=0.01, steps=1000, delta=1e-5)
    acc.calibrate_noise(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=1000)
    acc.tpr_bound(ledger, fpr=[0.01, 0.1])             # f-DP: the best attacker's TPR at those FPRs

Accountants (``accountant=``):
  ``"pld"``  (the default) privacy loss distributions composed by FFT with connect-the-dots
             discretisation; upper bound with a certified error (see :func:`epsilon_bounds`);
             ``"prv"`` is an alias.
  ``"rdp"``  Renyi DP at exact integer and fractional orders up to 8192; a looser upper
             bound (5-11% more noise for the same epsilon); fast.
  ``"gdp"``  the Gaussian-DP central limit approximation; NOT a bound; warns on use.

Neighbouring relation: add/remove one example, Poisson subsampling.
"""

from vmapdp.accounting.core import calibrate_noise, delta, epsilon, epsilon_bounds, epsilon_grid, within_budget
from vmapdp.accounting.events import (
    BallsInBinsGaussianEvent,
    CyclicPoissonGaussianEvent,
    EpochGaussianEvent,
    Event,
    FixedSizeGaussianEvent,
    Ledger,
    NonPrivateEvent,
    PoissonGaussianEvent,
    TruncatedPoissonGaussianEvent,
)
from vmapdp.accounting.fdp import delta_curve, mu_gdp, tpr_bound
from vmapdp.accounting.pld import PLDBounds
from vmapdp.accounting.rdp import DEFAULT_ORDERS, rdp_poisson_gaussian

__all__ = [
    "BallsInBinsGaussianEvent",
    "CyclicPoissonGaussianEvent",
    "DEFAULT_ORDERS",
    "EpochGaussianEvent",
    "Event",
    "FixedSizeGaussianEvent",
    "Ledger",
    "NonPrivateEvent",
    "PLDBounds",
    "PoissonGaussianEvent",
    "TruncatedPoissonGaussianEvent",
    "calibrate_noise",
    "delta",
    "delta_curve",
    "epsilon",
    "epsilon_bounds",
    "epsilon_grid",
    "mu_gdp",
    "rdp_poisson_gaussian",
    "tpr_bound",
    "within_budget",
]
