"""Privacy accounting of correlated noise: the ledger events of a matrix-factorization run.

Convention (the one :func:`vmapdp.mf.correlated_noise` noises with): the standard deviation of
the draws ``z`` is ``std_z = noise_multiplier * l2_clip_norm * sens``, where ``sens`` is the
strategy's sensitivity for the participation the analysis allows. ``noise_multiplier`` then keeps
its DP-SGD meaning and the events below reduce exactly to events the accountants already have:

* :class:`BandedMFEvent`: a banded strategy (band ``b``) with cyclic Poisson sampling
  (:class:`vmapdp.data.CyclicPoissonSampler`) of ``cycle >= b`` groups. An example can take part
  only in steps of its group, at least ``cycle >= b`` apart, so the columns of ``C`` it touches
  have disjoint supports; ``sens`` is the largest column norm of ``C`` and the run has the privacy
  of cyclic Poisson DP-SGD at ``noise_multiplier`` (Choquette-Choo et al. 2023: the
  Poisson-equivalent analysis of amplified banded MF). Accounted as the sampler's own
  :class:`~vmapdp.accounting.CyclicPoissonGaussianEvent`.
* :class:`MinSeparationMFEvent`: any strategy (BLT in particular) with a participation pattern of
  at most ``max_participations`` steps per example, at least ``min_separation`` apart, over a run
  of ``steps`` steps, without amplification by sampling. ``sens = max over such patterns of
  ||sum of C's columns||`` (:func:`vmapdp.mf.sensitivity`), and the whole run is ONE Gaussian
  mechanism with ``mu = 1 / noise_multiplier`` under add/remove (adaptive inputs to a
  lower-triangular ``C`` cost no more than fixed ones: Denisov et al. 2022 for one participation,
  Choquette-Choo, McMahan, Rush and Thakurta 2023 for the multiple participations of a
  ``(k, b)``-pattern, with the sensitivity taken over all such patterns as here; the sampler's
  randomness does not depend on the data, so the mixture over it is at most as distinguishable
  as its worst pattern). Charged in full on the run's first step (as an epoch is on the step that opens it)
  and accounted as one full-batch Gaussian step, ``PoissonGaussianEvent(noise_multiplier,
  sample_rate=1)``, per run of ``steps`` steps.

References:
  Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu. "(Amplified) Banded Matrix
  Factorization: A unified approach to private training." NeurIPS 2023.
  Choquette-Choo, McMahan, Rush, Thakurta. "Multi-Epoch Matrix Factorization Mechanisms for
  Private Machine Learning." ICML 2023.
  Denisov, McMahan, Rush, Smith, Thakurta. "Improved Differential Privacy for SGD via Optimal
  Private Linear Operators on Adaptive Streams." NeurIPS 2022.
  Dvijotham, McMahan, Pillutla, Steinke, Thakurta. "Efficient and Near-Optimal Noise Generation
  for Streaming Differential Privacy." FOCS 2024 (BLT).
  McKenna. "Scaling up the Banded Matrix Factorization Mechanism for Differentially Private ML."
  ICLR 2025.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from vmapdp import _checks as _shared_checks
from vmapdp.accounting import _checks
from vmapdp.accounting.core import calibrate_noise
from vmapdp.accounting.events import ADD_REMOVE, CyclicPoissonGaussianEvent, PoissonGaussianEvent, register_event
from vmapdp.mf.strategies import BandedToeplitz, BufferedToeplitz

__all__ = ["BandedMFEvent", "MinSeparationMFEvent", "mf_event", "noise_sensitivity", "calibrate_mf_noise"]

_MECHANISMS = ("banded", "blt")


@dataclasses.dataclass(frozen=True)
class BandedMFEvent:
    """``count`` steps of banded matrix factorization (band ``band``) with cyclic Poisson sampling
    (``cycle >= band`` groups, rate ``sample_rate`` within a group), the draws' std being
    ``noise_multiplier * l2_clip_norm * (largest column norm of C)``.

    Neighbouring relation: ``"add_remove"``. Accounted as
    ``CyclicPoissonGaussianEvent(noise_multiplier, sample_rate, cycle, count)`` (see the module
    docstring).

    Example:
      >>> e = BandedMFEvent(noise_multiplier=1.0, sample_rate=0.5, cycle=4, band=2, count=8)
      >>> e.accounted_as()[0].charged_steps
      2
    """

    noise_multiplier: float
    sample_rate: float
    cycle: int
    band: int
    count: int = 1
    adjacency: ClassVar[str] = ADD_REMOVE
    positional: ClassVar[bool] = True  # charged by one run's positions: merged by Ledger.append only

    def __post_init__(self):
        where = "BandedMFEvent"
        object.__setattr__(self, "noise_multiplier", _checks.check_noise_multiplier(where, self.noise_multiplier))
        object.__setattr__(self, "sample_rate", _checks.check_sample_rate(where, self.sample_rate))
        object.__setattr__(self, "cycle", _shared_checks.positive_int(where, "cycle", self.cycle, meaning="cycle is the number of groups of the cyclic sampler"))
        object.__setattr__(self, "band", _shared_checks.positive_int(where, "band", self.band, meaning="band is the number of nonzero diagonals of C"))
        if self.cycle < self.band:
            raise ValueError(
                f"{where}: cycle={self.cycle} < band={self.band}: two participations of one example can then share rows of C, "
                "and the Poisson-equivalent analysis does not apply. Use a CyclicPoissonSampler with cycle >= band, or a strategy "
                "with band <= cycle."
            )
        object.__setattr__(self, "count", _checks.check_steps(where, self.count, name="count", minimum=1))

    def accounted_as(self) -> tuple:
        return (CyclicPoissonGaussianEvent(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate, cycle=self.cycle, count=self.count),)

    def _key(self):
        return ("banded_mf", self.noise_multiplier, self.sample_rate, self.cycle, self.band)

    def _with_count(self, count: int) -> BandedMFEvent:
        return dataclasses.replace(self, count=count)

    def to_dict(self) -> dict:
        return {
            "type": "banded_mf",
            "adjacency": self.adjacency,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "cycle": self.cycle,
            "band": self.band,
            "count": self.count,
        }


@dataclasses.dataclass(frozen=True)
class MinSeparationMFEvent:
    """``count`` steps of a matrix-factorization run of ``steps`` steps in which every example takes
    part at most ``max_participations`` times, at least ``min_separation`` steps apart; the draws'
    std is ``noise_multiplier * l2_clip_norm * sens`` for that pattern, so each run of ``steps``
    steps is one Gaussian mechanism with ``mu = 1 / noise_multiplier`` (add/remove).

    ``mechanism`` (``"banded"`` or ``"blt"``) and ``size`` (its band or number of buffers) record
    which strategy ran. Accounted as ``charged_runs = ceil(count / steps)`` full-batch Gaussian
    steps, ``PoissonGaussianEvent(noise_multiplier, sample_rate=1.0, count=charged_runs)``.

    Example:
      >>> MinSeparationMFEvent(noise_multiplier=2.0, steps=10, min_separation=5, max_participations=2, mechanism="blt", size=2, count=3).charged_runs
      1
    """

    noise_multiplier: float
    steps: int
    min_separation: int
    max_participations: int
    mechanism: str
    size: int
    count: int = 1
    adjacency: ClassVar[str] = ADD_REMOVE
    positional: ClassVar[bool] = True  # charged by one run's positions: merged by Ledger.append only

    def __post_init__(self):
        where = "MinSeparationMFEvent"
        object.__setattr__(self, "noise_multiplier", _checks.check_noise_multiplier(where, self.noise_multiplier))
        for name, meaning in (
            ("steps", "steps is the length of the run the strategy was built for"),
            ("min_separation", "min_separation is the fewest steps between two participations of an example"),
            ("max_participations", "max_participations is the most steps one example takes part in"),
        ):
            object.__setattr__(self, name, _shared_checks.positive_int(where, name, getattr(self, name), meaning=meaning))
        _shared_checks.choice(where, "mechanism", self.mechanism, _MECHANISMS, why="it names the strategy that ran")
        object.__setattr__(self, "size", _shared_checks.positive_int(where, "size", self.size, minimum=0, meaning="size is the band or the number of buffers"))
        object.__setattr__(self, "count", _checks.check_steps(where, self.count, name="count", minimum=1))

    @property
    def charged_runs(self) -> int:
        """``ceil(count / steps)``: the Gaussian mechanisms (whole runs) these steps belong to."""
        return math.ceil(self.count / self.steps)

    def accounted_as(self) -> tuple:
        return (PoissonGaussianEvent(noise_multiplier=self.noise_multiplier, sample_rate=1.0, count=self.charged_runs),)

    def _key(self):
        return ("min_separation_mf", self.noise_multiplier, self.steps, self.min_separation, self.max_participations, self.mechanism, self.size)

    def _with_count(self, count: int) -> MinSeparationMFEvent:
        return dataclasses.replace(self, count=count)

    def to_dict(self) -> dict:
        return {
            "type": "min_separation_mf",
            "adjacency": self.adjacency,
            "noise_multiplier": self.noise_multiplier,
            "steps": self.steps,
            "min_separation": self.min_separation,
            "max_participations": self.max_participations,
            "mechanism": self.mechanism,
            "size": self.size,
            "count": self.count,
        }


register_event(BandedMFEvent, "banded_mf")
register_event(MinSeparationMFEvent, "min_separation_mf")


def _cyclic_groups(call: str, sampler: Any, steps: int) -> tuple[float, int]:
    """``(sample_rate, cycle)`` of the run's sampler, or the error that names the fix."""
    from vmapdp.data import CyclicPoissonSampler

    if type(sampler) is not CyclicPoissonSampler:
        got = "sample_rate= alone (Poisson sampling)" if sampler is None else type(sampler).__name__
        raise ValueError(
            f"{call}: correlated noise is accounted here for cyclic Poisson sampling only, got {got}. Draw the batches with "
            "vmapdp.data.CyclicPoissonSampler(num_samples, sample_rate, cycle=...) and pass it as sampler= (cycle >= the band for "
            "a banded strategy; a BLT's participations are then at least cycle steps apart). Plain DP-SGD needs no privatizer=."
        )
    if sampler.steps > steps:
        raise ValueError(
            f"{call}: the sampler yields {sampler.steps} steps but the correlated noise was built for steps={steps}; the strategy "
            f"covers no step past {steps}. Build it with steps >= {sampler.steps} or make the sampler with steps <= {steps}."
        )
    return sampler.sample_rate, sampler.cycle


def mf_event(call: str, strategy: BandedToeplitz | BufferedToeplitz, *, noise_multiplier: float, sampler: Any, steps: int) -> BandedMFEvent | MinSeparationMFEvent:
    """The event each step of ``strategy`` with ``sampler`` records (the same for every step), or a
    ValueError for a pair without a published analysis here (the message names the fix).

    Banded strategies get the amplified analysis (:class:`BandedMFEvent`, ``cycle >= band``); BLT
    strategies the min-separation one (:class:`MinSeparationMFEvent` with ``min_separation =
    cycle`` and ``max_participations = ceil(steps / cycle)``; the Poisson rate within a group is
    not used: no amplification is claimed for a BLT).
    """
    q, cycle = _cyclic_groups(call, sampler, steps)
    if isinstance(strategy, BandedToeplitz):
        if cycle < strategy.band:
            raise ValueError(
                f"{call}: the banded strategy has band={strategy.band} but the sampler's cycle={cycle} is shorter: two participations "
                "of one example could share rows of C, and amplified banded MF has no analysis for that. Make the "
                f"CyclicPoissonSampler with cycle >= {strategy.band}, or use a strategy with band <= {cycle}."
            )
        return BandedMFEvent(noise_multiplier=noise_multiplier, sample_rate=q, cycle=cycle, band=strategy.band)
    if isinstance(strategy, BufferedToeplitz):
        return MinSeparationMFEvent(
            noise_multiplier=noise_multiplier, steps=steps, min_separation=cycle, max_participations=math.ceil(steps / cycle), mechanism="blt", size=strategy.buffers
        )
    raise TypeError(f"{call}: strategy must be a vmapdp.mf.BandedToeplitz or BufferedToeplitz, got {type(strategy).__name__}.")


def noise_sensitivity(strategy: BandedToeplitz | BufferedToeplitz, event: BandedMFEvent | MinSeparationMFEvent, steps: int) -> float:
    """``sens`` of the convention above for ``event``'s analysis (float64 math): the largest column
    norm of ``C`` (``n = steps``) for :class:`BandedMFEvent`; :func:`vmapdp.mf.sensitivity` with the
    event's separation and participations for :class:`MinSeparationMFEvent`."""
    if isinstance(event, BandedMFEvent) or event.max_participations == 1:  # one participation: the largest column,
        return float(strategy.toeplitz_coeffs(steps).norm())  # the first (the others are its truncations)
    from vmapdp.mf.sensitivity import sensitivity

    return float(sensitivity(strategy, steps, min_separation=event.min_separation, max_participations=event.max_participations))


def calibrate_mf_noise(
    strategy: BandedToeplitz | BufferedToeplitz, *, sampler: Any, steps: int, target_epsilon: float, delta: float, accountant: str = "pld"
) -> float:
    """The smallest noise multiplier (to ``calibrate_noise``'s ``rtol=0.01``) whose ledger for
    ``steps`` steps of ``strategy`` with ``sampler`` has epsilon at most ``target_epsilon``: the
    calibration of the event's equivalent (cyclic Poisson DP-SGD over ``ceil(steps / cycle)``
    steps, or one full-batch Gaussian step), never above the target (its guarantee).

    Raises:
      ValueError: a strategy/sampler pair without an analysis (see :func:`mf_event`), or the
        checks of :func:`vmapdp.accounting.calibrate_noise`.
    """
    call = "calibrate_mf_noise(strategy)"
    steps = _shared_checks.positive_int(call, "steps", steps, meaning="steps is the length of the run")
    event = mf_event(call, strategy, noise_multiplier=1.0, sampler=sampler, steps=steps)
    if isinstance(event, BandedMFEvent):
        charged = CyclicPoissonGaussianEvent(noise_multiplier=1.0, sample_rate=event.sample_rate, cycle=event.cycle, count=steps).charged_steps
        return calibrate_noise(target_epsilon=target_epsilon, delta=delta, sample_rate=event.sample_rate, steps=charged, accountant=accountant)
    return calibrate_noise(target_epsilon=target_epsilon, delta=delta, sample_rate=1.0, steps=1, accountant=accountant)

