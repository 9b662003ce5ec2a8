"""Privacy events and the ledger: the only interface between training and accounting.

An event is an immutable record of something a training loop released. A :class:`Ledger`
is an immutable sequence of events; ``ledger.append(event)`` returns a new ledger and merges
an event into the last one when they are identical apart from ``count``, so a ledger after
100k steps at one noise level holds a single event. Accountants (``vmapdp.accounting.epsilon``
and friends) are pure functions of a ledger.

Neighbouring relation (``event.adjacency``, explicit per event type):

* ``"add_remove"``: the neighbouring dataset has one example more or one fewer. Poisson
  subsampling (:class:`PoissonGaussianEvent`, :class:`TruncatedPoissonGaussianEvent`,
  :class:`CyclicPoissonGaussianEvent`) and balls-in-bins (:class:`BallsInBinsGaussianEvent`) are
  analysed under it; every accountant reports the worse of the two directions.
* ``"replace_one"``: the neighbouring dataset has the same size and one example replaced.
  Schemes whose batch size or epoch structure depends on the dataset size (fixed-size
  batches without replacement, shuffled epochs; balls-in-bins in ledgers written before
  :class:`BallsInBinsGaussianEvent`) are analysed under it. One
  replacement moves a clipped sum by up to 2 * l2_clip_norm (twice the add/remove
  sensitivity), and the accountants use that sensitivity.

A ledger that holds a ``"replace_one"`` event reports for ``"replace_one"`` as a whole
(:attr:`Ledger.adjacency`); its Poisson events are then converted (a replacement is a removal
followed by an addition; see :mod:`vmapdp.accounting.core`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, ClassVar, Iterable, Union

from vmapdp import _checks as _shared_checks
from vmapdp.accounting import _checks
from vmapdp.accounting._special import kl_bernoulli

__all__ = [
    "ADD_REMOVE",
    "REPLACE_ONE",
    "PoissonGaussianEvent",
    "FixedSizeGaussianEvent",
    "EpochGaussianEvent",
    "BallsInBinsGaussianEvent",
    "TruncatedPoissonGaussianEvent",
    "CyclicPoissonGaussianEvent",
    "NonPrivateEvent",
    "Event",
    "Ledger",
]

ADD_REMOVE = "add_remove"
REPLACE_ONE = "replace_one"
EPOCH_SCHEMES = ("shuffle", "balls_in_bins")

_FORMAT = "vmapdp.accounting.Ledger"
_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PoissonGaussianEvent:
    """``count`` steps of the Poisson-subsampled Gaussian mechanism.

    Each step includes every example independently with probability ``sample_rate``, sums
    the per-example contributions (each with L2 norm <= l2_clip_norm) and adds
    N(0, (noise_multiplier * l2_clip_norm)^2) noise to every coordinate.

    Args:
      noise_multiplier: noise std / l2_clip_norm; finite and > 0. (Zero noise is a
        :class:`NonPrivateEvent`.)
      sample_rate: probability that an example is in a step's batch, in (0, 1]; 1 is the
        full-batch Gaussian mechanism.
      count: how many such steps, an integer >= 1.

    Raises:
      ValueError: an argument is out of range (the message names it, its value and the range).

    Example:
      >>> PoissonGaussianEvent(noise_multiplier=1.1, sample_rate=0.01, count=100)
      PoissonGaussianEvent(noise_multiplier=1.1, sample_rate=0.01, count=100)
    """

    noise_multiplier: float
    sample_rate: float
    count: int = 1
    adjacency: ClassVar[str] = ADD_REMOVE

    def __post_init__(self):
        where = "PoissonGaussianEvent"
        object.__setattr__(
            self, "noise_multiplier", _checks.check_noise_multiplier(where, self.noise_multiplier)
        )
        object.__setattr__(self, "sample_rate", _checks.check_sample_rate(where, self.sample_rate))
        object.__setattr__(self, "count", _checks.check_steps(where, self.count, name="count", minimum=1))

    def _key(self):
        return ("poisson_gaussian", self.noise_multiplier, self.sample_rate)

    def _with_count(self, count: int) -> "PoissonGaussianEvent":
        return dataclasses.replace(self, count=count)

    def to_dict(self) -> dict:
        return {
            "type": "poisson_gaussian",
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "count": self.count,
        }


@dataclasses.dataclass(frozen=True)
class NonPrivateEvent:
    """``count`` steps released without noise (noise_multiplier = 0): epsilon is infinite.

    Record one when a training run deliberately turns noise off, so that every accountant
    reports ``inf`` instead of silently ignoring the step.

    Example:
      >>> Ledger().append(NonPrivateEvent()).steps
      1
    """

    count: int = 1
    adjacency: ClassVar[str] = ADD_REMOVE  # infinite epsilon under either relation

    def __post_init__(self):
        object.__setattr__(
            self, "count", _checks.check_steps("NonPrivateEvent", self.count, name="count", minimum=1)
        )

    def _key(self):
        return ("non_private",)

    def _with_count(self, count: int) -> "NonPrivateEvent":
        return dataclasses.replace(self, count=count)

    def to_dict(self) -> dict:
        return {"type": "non_private", "count": self.count}


def _check_sizes(where: str, batch_size, num_samples) -> tuple[int, int]:
    n = _shared_checks.positive_int(where, "num_samples", num_samples, meaning="num_samples is the dataset size")
    b = _shared_checks.positive_int(where, "batch_size", batch_size, meaning="batch_size is the number of examples in every batch")
    if b > n:
        raise ValueError(
            f"{where}: batch_size={b} must be in [1, num_samples={n}]; a batch drawn without replacement "
            "cannot hold more examples than the dataset. Pass batch_size <= num_samples."
        )
    return b, n


@dataclasses.dataclass(frozen=True)
class FixedSizeGaussianEvent:
    """``count`` steps of the Gaussian mechanism on batches of exactly ``batch_size`` examples
    drawn uniformly WITHOUT replacement from ``num_samples`` (fresh and independent each step).

    Neighbouring relation: ``"replace_one"`` (said out loud: the batch size and the dataset size
    are public, so add/remove neighbours do not apply). One replacement moves the clipped sum by
    up to ``2 * l2_clip_norm``.

    Args:
      noise_multiplier: noise std / l2_clip_norm; finite and > 0.
      batch_size: examples per batch, an int in [1, num_samples].
      num_samples: the dataset size, an int >= 1.
      count: how many such steps, an int >= 1.

    Raises:
      TypeError: a wrong type. ValueError: a value out of range.

    Guarantees:
      ``accountant="pld"`` (the default): a certified upper bound from the symmetrised remove
      pair of the Poisson-subsampled Gaussian at noise ``noise_multiplier / 2`` and rate
      ``batch_size / num_samples`` (advanced joint convexity over a coupling of the batches;
      proof in :func:`vmapdp.accounting.pld.pld_epsilon_bounds`). ``epsilon_bounds`` also gives
      a certified LOWER bound on the true epsilon: the composition of that remove pair, which a
      dataset realises (every other example equal to the replacement). That lower bound is the
      figure jax-privacy 2.0 reports for fixed-size batches (Poisson with doubled sensitivity);
      ours is 8-26% above it at the settings tested and 23-77% below RDP's. ``accountant="rdp"``:
      Wang, Balle, Kasiviswanathan 2019, Theorem 9, with sensitivity 2 in units of the clip norm.

    References:
      Wang, Balle, Kasiviswanathan. "Subsampled Renyi Differential Privacy and Analytical
      Moments Accountant." AISTATS 2019.
      Balle, Barthe, Gaboardi. "Privacy Amplification by Subsampling: Tight Analyses via
      Couplings and Divergences." NeurIPS 2018.
      Zhu, Dong, Wang. "Optimal Accounting of Differential Privacy via Characteristic
      Function." AISTATS 2022.

    Example:
      >>> FixedSizeGaussianEvent(noise_multiplier=1.0, batch_size=64, num_samples=6400).sample_rate
      0.01
    """

    noise_multiplier: float
    batch_size: int
    num_samples: int
    count: int = 1
    adjacency: ClassVar[str] = REPLACE_ONE

    def __post_init__(self):
        where = "FixedSizeGaussianEvent"
        object.__setattr__(self, "noise_multiplier", _checks.check_noise_multiplier(where, self.noise_multiplier))
        b, n = _check_sizes(where, self.batch_size, self.num_samples)
        object.__setattr__(self, "batch_size", b)
        object.__setattr__(self, "num_samples", n)
        object.__setattr__(self, "count", _checks.check_steps(where, self.count, name="count", minimum=1))

    @property
    def sample_rate(self) -> float:
        """``batch_size / num_samples``: the probability that a given example is in a batch."""
        return self.batch_size / self.num_samples

    def _key(self):
        return ("fixed_size_gaussian", self.noise_multiplier, self.batch_size, self.num_samples)

    def _with_count(self, count: int) -> "FixedSizeGaussianEvent":
        return dataclasses.replace(self, count=count)

    def to_dict(self) -> dict:
        return {
            "type": "fixed_size_gaussian",
            "adjacency": self.adjacency,
            "noise_multiplier": self.noise_multiplier,
            "batch_size": self.batch_size,
            "num_samples": self.num_samples,
            "count": self.count,
        }


@dataclasses.dataclass(frozen=True)
class EpochGaussianEvent:
    """``count`` steps of a sampler that uses every example in AT MOST ONE step per epoch
    (``scheme="shuffle"``: disjoint batches of a fresh random permutation;
    ``scheme="balls_in_bins"``: each example in one uniformly random step of the epoch),
    each step adding Gaussian noise with ``noise_multiplier``.

    ``epochs`` counts the steps among the ``count`` that opened a new epoch, and ``continues``
    says that the first of them did not open one: it continues an epoch begun under another
    event (before a change of noise multiplier, say). A sampler reports both per step through its
    ``event()``; merging two events adds the counters and keeps the first one's ``continues``.
    The accountants charge ``max(epochs + continues, ceil(count / steps_per_epoch))`` epochs: the
    epochs these steps touch when they come from one sampler in order. An epoch split between
    two events is charged in full by both (the steps under each are part of one whole epoch at
    that event's noise: post-processing), so a change of noise inside an epoch is never
    under-charged. A ledger written before ``continues`` existed loads with ``continues=True``
    (at most one epoch more per event than it was charged then).

    Neighbouring relation: ``"replace_one"``. One replacement moves one step's clipped sum per
    epoch by up to ``2 * l2_clip_norm``.

    Guarantees:
      The accountants charge each epoch as ONE Gaussian mechanism with sensitivity 2 (mu = 2 /
      noise_multiplier): given the sampler's randomness, the differing example enters one step
      of the epoch and the other steps are post-processing, and a mixture over randomness that
      does not depend on the data is at most as distinguishable as its worst component
      (joint convexity). This is an upper bound WITHOUT amplification by shuffling; it is the
      exact privacy of deterministic batches, which shuffling is at most as bad as (Chua et al.
      2024). A Poisson epsilon is never reported for these schemes. ``scheme="balls_in_bins"``
      is kept so that ledgers written before :class:`BallsInBinsGaussianEvent` existed still
      load and account as they did; :class:`vmapdp.data.BallsInBinsSampler` now records a
      :class:`BallsInBinsGaussianEvent` (add/remove, amplified by random allocation).

    Args:
      noise_multiplier: noise std / l2_clip_norm; finite and > 0.
      steps_per_epoch: steps in one epoch, an int >= 1.
      scheme: ``"shuffle"`` or ``"balls_in_bins"`` (recorded for the reader; both are charged
        the same).
      count: steps, an int >= 1.
      epochs: how many of the steps opened an epoch, an int in [0, count].
      continues: the first step continues an epoch opened before it (a bool; default False).

    References:
      Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha, Zhang. "How Private are DP-SGD
      Implementations?" ICML 2024.
      Chua et al. "Balls-and-Bins Sampling for DP-SGD." AISTATS 2025.
      Feldman, Shenfeld. "Privacy Amplification by Random Allocation." 2025.
      Dong, Roth, Su. "Gaussian Differential Privacy." JRSS-B 2022 (the Gaussian trade-off).

    Example:
      >>> e = EpochGaussianEvent(noise_multiplier=2.0, steps_per_epoch=10, scheme="shuffle", count=25)
      >>> e.charged_epochs
      3
    """

    noise_multiplier: float
    steps_per_epoch: int
    scheme: str
    count: int = 1
    epochs: int = 0
    continues: bool = False
    adjacency: ClassVar[str] = REPLACE_ONE

    def __post_init__(self):
        where = "EpochGaussianEvent"
        object.__setattr__(self, "noise_multiplier", _checks.check_noise_multiplier(where, self.noise_multiplier))
        _shared_checks.choice(where, "scheme", self.scheme, EPOCH_SCHEMES, why="it names how the epoch's batches are drawn")
        _check_epoch_fields(self, where, "steps_per_epoch is the number of steps in one epoch")

    @property
    def charged_epochs(self) -> int:
        """How many Gaussian mechanisms (one per epoch) the accountants charge."""
        return _charged_epochs(self)

    def _key(self):
        return ("epoch_gaussian", self.noise_multiplier, self.steps_per_epoch, self.scheme)

    def _combine(self, other: "EpochGaussianEvent") -> "EpochGaussianEvent":
        return dataclasses.replace(self, count=self.count + other.count, epochs=self.epochs + other.epochs)

    def to_dict(self) -> dict:
        return {
            "type": "epoch_gaussian",
            "adjacency": self.adjacency,
            "noise_multiplier": self.noise_multiplier,
            "steps_per_epoch": self.steps_per_epoch,
            "scheme": self.scheme,
            "count": self.count,
            "epochs": self.epochs,
            "continues": self.continues,
        }


@dataclasses.dataclass(frozen=True)
class BallsInBinsGaussianEvent:
    """``count`` steps of balls-in-bins sampling with the Gaussian mechanism: every epoch each
    example goes to one uniformly random step of the ``steps_per_epoch`` steps, independently of
    the others, with a fresh assignment every epoch (:class:`vmapdp.data.BallsInBinsSampler`).

    Neighbouring relation: ``"add_remove"`` (adding or removing an example does not change the
    other examples' steps). ``epochs``, ``continues`` and the charged epochs are as in
    :class:`EpochGaussianEvent`: ``max(epochs + continues, ceil(count / steps_per_epoch))``, a
    partial epoch charged as a whole one (its outputs are part of the whole epoch's:
    post-processing), and an epoch split between two events (a change of noise inside it)
    charged by both.

    Guarantees:
      ``accountant="pld"`` (the default): each epoch is the random allocation of 1 of
      ``steps_per_epoch`` steps, whose privacy loss is that of the pair ``P = (1/t) sum_j
      N(e_j, sigma^2 I_t)`` against ``Q = N(0, sigma^2 I_t)``; Chua et al. (2025, Section 3)
      show this pair tightly dominates adaptively chosen steps (the adaptive batch linear query
      mechanism with balls-and-bins batches). Epochs (fresh assignments) compose as adaptive
      mechanisms (Zhu, Dong, Wang 2022). The pair's loss distribution is discretised with every
      loss rounded up (:mod:`vmapdp.accounting.allocation`), so the result is a certified upper
      bound up to float64 rounding in the FFT; ``epsilon_bounds`` also gives the lower bound
      from the same construction rounded down. Where the discretisation is too coarse (low
      noise: the bracket widens, e.g. [3.8, 14.0] at noise 0.6, 100 steps per epoch, 10 epochs;
      infinite at noise 0.5, 10 steps, 2 epochs) the accountants report the smaller of this bound
      and the unamplified one below (both valid). E.g. 1.11 (bracket [1.108, 1.112]) at noise 2,
      10 steps per epoch, 3 epochs, delta 1e-5, where one Gaussian per epoch gives 3.71 under
      add/remove (8.39 under replace-one). ``accountant="rdp"`` and the mu of
      ``vmapdp.accounting.mu_gdp`` charge each epoch as one Gaussian mechanism with
      sensitivity 1 (mu = 1 / noise_multiplier): valid, without amplification.

    Args:
      noise_multiplier: noise std / l2_clip_norm; finite and > 0.
      steps_per_epoch: steps (bins) in one epoch, an int >= 1.
      count: steps, an int >= 1.
      epochs: how many of the steps opened an epoch, an int in [0, count].
      continues: the first step continues an epoch opened before it (a bool; default False).

    References:
      Chua, Ghazi, Harrison, Leeman, Kamath, Kumar, Manurangsi, Sinha, Zhang. "Balls-and-Bins
      Sampling for DP-SGD." AISTATS 2025.
      Feldman, Shenfeld. "Privacy Amplification by Random Allocation." 2025.
      Zhu, Dong, Wang. "Optimal Accounting of Differential Privacy via Characteristic
      Function." AISTATS 2022.

    Example:
      >>> BallsInBinsGaussianEvent(noise_multiplier=2.0, steps_per_epoch=10, count=25).charged_epochs
      3
    """

    noise_multiplier: float
    steps_per_epoch: int
    count: int = 1
    epochs: int = 0
    continues: bool = False
    adjacency: ClassVar[str] = ADD_REMOVE

    def __post_init__(self):
        where = "BallsInBinsGaussianEvent"
        object.__setattr__(self, "noise_multiplier", _checks.check_noise_multiplier(where, self.noise_multiplier))
        _check_epoch_fields(self, where, "steps_per_epoch is the number of steps (bins) in one epoch")

    @property
    def charged_epochs(self) -> int:
        """How many random-allocation epochs the accountants charge."""
        return _charged_epochs(self)

    def _key(self):
        return ("balls_in_bins_gaussian", self.noise_multiplier, self.steps_per_epoch)

    def _with_count(self, count: int) -> "BallsInBinsGaussianEvent":
        return dataclasses.replace(self, count=count, epochs=min(self.epochs, count))

    def _combine(self, other: "BallsInBinsGaussianEvent") -> "BallsInBinsGaussianEvent":
        return dataclasses.replace(self, count=self.count + other.count, epochs=self.epochs + other.epochs)

    def to_dict(self) -> dict:
        return {
            "type": "balls_in_bins_gaussian",
            "adjacency": self.adjacency,
            "noise_multiplier": self.noise_multiplier,
            "steps_per_epoch": self.steps_per_epoch,
            "count": self.count,
            "epochs": self.epochs,
            "continues": self.continues,
        }


def binomial_tail_bound(n: int, q: float, k: int) -> float:
    """An upper bound on ``P(Binomial(n, q) >= k)``: the Chernoff bound ``exp(-n KL(k/n || q))``
    for ``k > n q`` (1 otherwise, 0 for ``k > n``)."""
    if k > n:
        return 0.0
    if q >= 1.0 or k <= n * q:
        return 1.0
    return math.exp(-n * kl_bernoulli(k / n, q))


@dataclasses.dataclass(frozen=True)
class TruncatedPoissonGaussianEvent:
    """``count`` Poisson-subsampled Gaussian steps whose batch is cut to ``max_batch_size``
    examples when the Poisson sample is larger (truncated Poisson sampling).

    Neighbouring relation: ``"add_remove"`` (as for Poisson sampling).

    Guarantees:
      Couple the truncated run with the untruncated Poisson run on the same randomness: they
      release the same thing unless some step samples more than ``max_batch_size`` examples,
      which happens with probability at most ``p = count * P(Binomial(num_samples + 1,
      sample_rate) > max_batch_size)`` on either neighbour (:attr:`truncation_probability`,
      by the Chernoff bound). So for every set S, ``P[M'(X) in S] <= P[M(X) in S] + p <=
      e^eps P[M'(X') in S] + delta_Poisson(eps) + (1 + e^eps) p``: the accountants account the
      Poisson steps and add ``(1 + e^eps) * p`` to delta (and refuse when that would take more
      than half of the delta budget).

    Args:
      noise_multiplier: noise std / l2_clip_norm; finite and > 0.
      sample_rate: the Poisson rate, in (0, 1].
      max_batch_size: the cap, an int >= 1.
      num_samples: the dataset size, an int >= 1.
      count: steps, an int >= 1.

    Example:
      >>> e = TruncatedPoissonGaussianEvent(noise_multiplier=1.0, sample_rate=0.01, max_batch_size=200, num_samples=10_000)
      >>> e.truncation_probability < 1e-17  # P(Binomial(10001, 0.01) > 200), Chernoff
      True
    """

    noise_multiplier: float
    sample_rate: float
    max_batch_size: int
    num_samples: int
    count: int = 1
    adjacency: ClassVar[str] = ADD_REMOVE

    def __post_init__(self):
        where = "TruncatedPoissonGaussianEvent"
        object.__setattr__(self, "noise_multiplier", _checks.check_noise_multiplier(where, self.noise_multiplier))
        object.__setattr__(self, "sample_rate", _checks.check_sample_rate(where, self.sample_rate))
        object.__setattr__(
            self,
            "max_batch_size",
            _shared_checks.positive_int(where, "max_batch_size", self.max_batch_size, meaning="max_batch_size caps the batch"),
        )
        object.__setattr__(
            self, "num_samples", _shared_checks.positive_int(where, "num_samples", self.num_samples, meaning="num_samples is the dataset size")
        )
        object.__setattr__(self, "count", _checks.check_steps(where, self.count, name="count", minimum=1))

    @property
    def truncation_probability(self) -> float:
        """Upper bound on the probability that any of the ``count`` steps truncates, on the
        dataset or any add/remove neighbour of it (size ``num_samples + 1`` is the worst)."""
        per_step = binomial_tail_bound(self.num_samples + 1, self.sample_rate, self.max_batch_size + 1)
        return min(1.0, self.count * per_step)

    def _key(self):
        return ("truncated_poisson_gaussian", self.noise_multiplier, self.sample_rate, self.max_batch_size, self.num_samples)

    def _with_count(self, count: int) -> "TruncatedPoissonGaussianEvent":
        return dataclasses.replace(self, count=count)

    def to_dict(self) -> dict:
        return {
            "type": "truncated_poisson_gaussian",
            "adjacency": self.adjacency,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "max_batch_size": self.max_batch_size,
            "num_samples": self.num_samples,
            "count": self.count,
        }


@dataclasses.dataclass(frozen=True)
class CyclicPoissonGaussianEvent:
    """``count`` consecutive steps of cyclic Poisson sampling with the Gaussian mechanism: the data
    is split once into ``cycle`` disjoint groups, step ``t`` samples group ``t mod cycle`` at rate
    ``sample_rate`` (Poisson), and each step adds independent N(0, (noise_multiplier *
    l2_clip_norm)^2) noise (:class:`vmapdp.data.CyclicPoissonSampler`).

    Neighbouring relation: ``"add_remove"`` (as for Poisson sampling).

    Guarantees:
      An example can be used only in the steps of its own group, and ``count`` consecutive steps
      visit any one group at most ``ceil(count / cycle)`` times (:attr:`charged_steps`); the
      other steps do not depend on it (post-processing, given the groups, which do not depend on
      the data's values). So the accountants charge ``charged_steps`` Poisson-subsampled Gaussian
      steps at ``sample_rate`` (PLD and RDP, exactly as :class:`PoissonGaussianEvent`): the
      identity-strategy case of Choquette-Choo et al. (2023), tight for the worst-case example.
      Merging adds the counts, and only :meth:`Ledger.append` merges (one run's next step): the
      events of two runs composed (``extend``, ``+``, a list given to ``Ledger``) stay apart,
      each charged its own ceiling; an event split by other events is charged each part's
      ceiling (an upper bound).

    Args:
      noise_multiplier: noise std / l2_clip_norm; finite and > 0.
      sample_rate: the Poisson rate within a group, in [0, 1].
      cycle: the number of groups, an int >= 1 (1 is plain Poisson sampling).
      count: steps, an int >= 1.

    References:
      Choquette-Choo, Ganesh, Steinke, Thakurta. "Privacy Amplification for Matrix Mechanisms."
      ICLR 2024. Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu. "(Amplified)
      Banded Matrix Factorization: A unified approach to private training." NeurIPS 2023.

    Example:
      >>> CyclicPoissonGaussianEvent(noise_multiplier=1.0, sample_rate=0.1, cycle=4, count=10).charged_steps
      3
    """

    noise_multiplier: float
    sample_rate: float
    cycle: int
    count: int = 1
    adjacency: ClassVar[str] = ADD_REMOVE
    positional: ClassVar[bool] = True  # charged by one run's positions: merged by Ledger.append only

    def __post_init__(self):
        where = "CyclicPoissonGaussianEvent"
        object.__setattr__(self, "noise_multiplier", _checks.check_noise_multiplier(where, self.noise_multiplier))
        object.__setattr__(self, "sample_rate", _checks.check_sample_rate(where, self.sample_rate))
        object.__setattr__(
            self,
            "cycle",
            _shared_checks.positive_int(where, "cycle", self.cycle, meaning="cycle is the number of disjoint groups the steps go through in turn"),
        )
        object.__setattr__(self, "count", _checks.check_steps(where, self.count, name="count", minimum=1))

    @property
    def charged_steps(self) -> int:
        """``ceil(count / cycle)``: the most steps of these that any one example can be in."""
        return math.ceil(self.count / self.cycle)

    def _key(self):
        return ("cyclic_poisson_gaussian", self.noise_multiplier, self.sample_rate, self.cycle)

    def _with_count(self, count: int) -> "CyclicPoissonGaussianEvent":
        return dataclasses.replace(self, count=count)

    def to_dict(self) -> dict:
        return {
            "type": "cyclic_poisson_gaussian",
            "adjacency": self.adjacency,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "cycle": self.cycle,
            "count": self.count,
        }


Event = Union[PoissonGaussianEvent, FixedSizeGaussianEvent, EpochGaussianEvent, BallsInBinsGaussianEvent, TruncatedPoissonGaussianEvent, CyclicPoissonGaussianEvent, NonPrivateEvent]
_EVENT_TYPES = (PoissonGaussianEvent, FixedSizeGaussianEvent, EpochGaussianEvent, BallsInBinsGaussianEvent, TruncatedPoissonGaussianEvent, CyclicPoissonGaussianEvent, NonPrivateEvent)
_BY_TYPE = {
    "poisson_gaussian": PoissonGaussianEvent,
    "fixed_size_gaussian": FixedSizeGaussianEvent,
    "epoch_gaussian": EpochGaussianEvent,
    "balls_in_bins_gaussian": BallsInBinsGaussianEvent,
    "truncated_poisson_gaussian": TruncatedPoissonGaussianEvent,
    "cyclic_poisson_gaussian": CyclicPoissonGaussianEvent,
    "non_private": NonPrivateEvent,
}
_NAMES = ", ".join(t.__name__ for t in _EVENT_TYPES)
_OWN_TYPES = _EVENT_TYPES  # the events the accountants compute with (registered ones are accounted as these)


def register_event(cls: type, type_name: str) -> type:
    """Let ledgers hold (and ``from_json`` read) events of ``cls``, defined outside this module.

    Such an event is accounted exactly as the events of this module that its ``accounted_as()``
    returns (the accountants expand it); besides that it has ``adjacency``, ``count``, ``_key()``,
    ``_with_count(count)`` and ``to_dict()`` (with ``"type": type_name``) like the events here.
    Used by :mod:`vmapdp.mf.accounting` for the correlated-noise events.
    """
    global _EVENT_TYPES, _NAMES
    if not callable(getattr(cls, "accounted_as", None)):
        raise TypeError(f"register_event({cls.__name__}): the class needs an accounted_as() method giving the events it is accounted as.")
    if cls not in _EVENT_TYPES:
        _EVENT_TYPES = _EVENT_TYPES + (cls,)
        _NAMES = ", ".join(t.__name__ for t in _EVENT_TYPES)
    _BY_TYPE[type_name] = cls
    return cls


def accounted_events(events: Iterable[Event]) -> tuple[Event, ...]:
    """``events`` with each registered event replaced by the events it is accounted as, until
    only this module's events are left (a registered event may be accounted as another one), in order."""
    out: list[Event] = []

    def expand(e: Any, depth: int) -> None:
        if hasattr(e, "accounted_as"):
            if depth >= 16:
                raise ValueError(f"accounted_events: {type(e).__name__} is accounted as registered events 16 levels deep (a cycle?).")
            for x in e.accounted_as():
                expand(x, depth + 1)
        elif isinstance(e, _OWN_TYPES):
            out.append(e)
        else:
            # (found by review: an event no accountant knows was dropped, counted as zero epsilon)
            raise TypeError(
                f"accounted_events: {type(e).__name__} is not an event the accountants know ({', '.join(t.__name__ for t in _OWN_TYPES)}) "
                "and has no accounted_as(); register it with register_event, accounted as those events."
            )

    for e in events:
        expand(e, 0)
    return tuple(out)


def _combine(a: Event, b: Event) -> Event:
    """Two events with the same key as one (counts, and any other counters, added)."""
    if hasattr(a, "_combine"):
        return a._combine(b)
    return a._with_count(a.count + b.count)


def _check_epoch_fields(event: Any, where: str, meaning: str) -> None:
    """Checks (and normalises, on the frozen dataclass) the epoch fields that EpochGaussianEvent and
    BallsInBinsGaussianEvent share: steps_per_epoch, count, epochs, continues."""
    object.__setattr__(event, "steps_per_epoch", _shared_checks.positive_int(where, "steps_per_epoch", event.steps_per_epoch, meaning=meaning))
    object.__setattr__(event, "count", _checks.check_steps(where, event.count, name="count", minimum=1))
    epochs = _shared_checks.positive_int(where, "epochs", event.epochs, minimum=0, meaning="epochs counts the steps that opened an epoch")
    if epochs > event.count:
        raise ValueError(
            f"{where}: epochs={epochs} must be in [0, count={event.count}]; every epoch opens with one of "
            "the counted steps. Pass the sampler's own event (sampler.event(noise_multiplier))."
        )
    object.__setattr__(event, "epochs", epochs)
    if not isinstance(event.continues, bool):
        raise TypeError(
            f"{where}: continues={event.continues!r} must be a bool: whether the first step continues an epoch opened "
            "before it. Pass the sampler's own event (sampler.event(noise_multiplier))."
        )


def _charged_epochs(event: Any) -> int:
    """The epochs an epoch event's steps touch: those they open, plus the one their first step
    continues, and at least ``ceil(count / steps_per_epoch)`` (see EpochGaussianEvent)."""
    return max(event.epochs + event.continues, math.ceil(event.count / event.steps_per_epoch))


def _event_from_dict(d: dict) -> Event:
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError(
            f"Ledger.from_json: expected an event object with a 'type' field; got {d!r}."
        )
    fields = {k: v for k, v in d.items() if k not in ("type", "adjacency")}
    if d["type"] in ("epoch_gaussian", "balls_in_bins_gaussian") and "continues" not in fields:
        fields["continues"] = True  # written before the field existed: its first epoch may have begun under another event
    cls = _BY_TYPE.get(d["type"])
    if cls is None:
        raise ValueError(
            f"Ledger.from_json: unknown event type {d['type']!r}; expected one of "
            f"{', '.join(map(repr, _BY_TYPE))}. Was the ledger written by a newer vmapdp?"
        )
    if "adjacency" in d and d["adjacency"] != cls.adjacency:
        raise ValueError(
            f"Ledger.from_json: a {d['type']!r} event says adjacency={d['adjacency']!r}, but that event is "
            f"analysed under {cls.adjacency!r}; the ledger was edited or written by another program. "
            "Re-record the event."
        )
    try:
        return cls(**fields)
    except TypeError as err:
        raise ValueError(f"Ledger.from_json: bad fields for a {d['type']!r} event ({err}); got {d!r}.") from None


def _merged(events: Iterable[Event]) -> tuple[Event, ...]:
    if isinstance(events, _EVENT_TYPES) or not isinstance(events, Iterable):  # (found by review: Ledger(None) was a bare TypeError)
        raise TypeError(f"Ledger: events must be an iterable of events (Ledger([event, ...])), got {type(events).__name__}.")
    out: list[Event] = []
    for e in events:
        if not isinstance(e, _EVENT_TYPES):
            raise ValueError(
                f"Ledger: expected one of {_NAMES}; got "
                f"{type(e).__name__} ({e!r}). Build events with "
                "PoissonGaussianEvent(noise_multiplier=..., sample_rate=...) or a sampler's event()."
            )
        # (an event charged by a run's positions merges only through Ledger.append, one run's next step: two runs'
        # events joined by their counts would be charged ceil((a + b) / cycle) < ceil(a / cycle) + ceil(b / cycle);
        # found by review: ten composed cyclic runs cost one run's epsilon)
        # (likewise an epoch event that continues an epoch opened before it: joined to another run's ledger it would
        # be charged inside that run's epoch, when that epoch is not in it; found by review)
        if out and out[-1]._key() == e._key() and not getattr(e, "positional", False) and not getattr(e, "continues", False):
            out[-1] = _combine(out[-1], e)
        else:
            out.append(e)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Ledger:
    """An immutable, append-only record of privacy events (a composition).

    Consecutive identical events are merged into one with the summed ``count``, so the
    ledger stays tiny however long training runs; two ledgers describing the same sequence
    of steps compare equal. Events charged by a run's positions (cyclic Poisson, banded and
    min-separation matrix factorization: ``positional``), and epoch events that continue an
    epoch opened before them (``continues``), are merged by :meth:`append` only, one run's next
    step; composed ledgers (``extend``, ``+``) keep each run's events apart. The ledger is a plain value: hashable, comparable, JSON
    round-trippable (``to_json`` / ``from_json``), and an opaque leaf for optree.

    Args:
      events: events in the order they happened (merged on construction).

    Example:
      >>> ledger = Ledger()
      >>> for _ in range(1000):
      ...     ledger = ledger.append(PoissonGaussianEvent(noise_multiplier=1.0, sample_rate=0.01))
      >>> ledger.events
      (PoissonGaussianEvent(noise_multiplier=1.0, sample_rate=0.01, count=1000),)
      >>> Ledger.from_json(ledger.to_json()) == ledger
      True
    """

    events: tuple[Event, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "events", _merged(self.events))

    def append(self, event: Event) -> "Ledger":
        """A new ledger with ``event`` added at the end (merged into the last if identical)."""
        if not isinstance(event, _EVENT_TYPES):
            raise TypeError(
                f"Ledger.append(event): expected PoissonGaussianEvent or NonPrivateEvent (or another of "
                f"{_NAMES}); got {type(event).__name__} ({event!r})."
            )
        events = self.events
        if events and events[-1]._key() == event._key():
            return Ledger(events[:-1] + (_combine(events[-1], event),))
        return Ledger(events + (event,))

    def record(self, *, noise_multiplier: float, sample_rate: float, count: int = 1) -> "Ledger":
        """Shorthand for ``append(PoissonGaussianEvent(noise_multiplier=..., sample_rate=..., count=...))``."""
        return self.append(
            PoissonGaussianEvent(noise_multiplier=noise_multiplier, sample_rate=sample_rate, count=count)
        )

    def extend(self, other: "Ledger") -> "Ledger":
        """The composition of this ledger followed by ``other``."""
        if not isinstance(other, Ledger):
            raise TypeError(f"Ledger.extend(other): expected a Ledger; got {type(other).__name__}.")
        return Ledger(self.events + other.events)

    def __add__(self, other: "Ledger") -> "Ledger":
        if not isinstance(other, Ledger):
            return NotImplemented
        return self.extend(other)

    @property
    def adjacency(self) -> str:
        """The neighbouring relation the accountants report this ledger for: ``"replace_one"`` if
        any event is analysed under it (Poisson events are then converted), else ``"add_remove"``."""
        return REPLACE_ONE if any(e.adjacency == REPLACE_ONE for e in self.events) else ADD_REMOVE

    @property
    def steps(self) -> int:
        """Total number of recorded steps (sum of counts)."""
        return sum(e.count for e in self.events)

    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "events": [e.to_dict() for e in self.events],
        }

    def to_json(self) -> str:
        """A JSON string; floats are written with full precision (exact round trip)."""
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Ledger":
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise ValueError(
                f"Ledger.from_json: expected an object with format={_FORMAT!r}; got {d!r:.200}."
            )
        if d.get("version") != _VERSION:
            raise ValueError(
                f"Ledger.from_json: version={d.get('version')!r} is not supported (expected "
                f"{_VERSION}). Upgrade vmapdp to read this ledger."
            )
        return cls(tuple(_event_from_dict(e) for e in d.get("events", ())))

    @classmethod
    def from_json(cls, s: str) -> "Ledger":
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(s))
