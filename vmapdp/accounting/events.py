"""Privacy events and the ledger: the only interface between training and accounting.

An event is an immutable record of something a training loop released. A :class:`Ledger`
is an immutable sequence of events; ``ledger.append(event)`` returns a new ledger and merges
an event into the last one when they are identical apart from ``count``, so a ledger after
100k steps at one noise level holds a single event. Accountants (``vmapdp.accounting.epsilon``
and friends) are pure functions of a ledger.

Neighbouring relation: add/remove one example (Poisson subsampling). Every accountant here
reports the worse of the two directions.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Union

from vmapdp.accounting import _checks

__all__ = ["PoissonGaussianEvent", "NonPrivateEvent", "Event", "Ledger"]

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
      sample_rate: probability that an example is in a step's batch, in [0, 1]. 0 means no
        example is ever used and costs no privacy; 1 is the full-batch Gaussian mechanism.
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


Event = Union[PoissonGaussianEvent, NonPrivateEvent]
_EVENT_TYPES = (PoissonGaussianEvent, NonPrivateEvent)


def _event_from_dict(d: dict) -> Event:
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError(
            f"Ledger.from_json: expected an event object with a 'type' field; got {d!r}."
        )
    fields = {k: v for k, v in d.items() if k != "type"}
    if d["type"] == "poisson_gaussian":
        return PoissonGaussianEvent(**fields)
    if d["type"] == "non_private":
        return NonPrivateEvent(**fields)
    raise ValueError(
        f"Ledger.from_json: unknown event type {d['type']!r}; expected 'poisson_gaussian' "
        "or 'non_private'. Was the ledger written by a newer vmapdp?"
    )


def _merged(events: Iterable[Event]) -> tuple[Event, ...]:
    out: list[Event] = []
    for e in events:
        if not isinstance(e, _EVENT_TYPES):
            raise ValueError(
                f"Ledger: expected PoissonGaussianEvent or NonPrivateEvent; got "
                f"{type(e).__name__} ({e!r}). Build events with "
                "PoissonGaussianEvent(noise_multiplier=..., sample_rate=...)."
            )
        if out and out[-1]._key() == e._key():
            out[-1] = out[-1]._with_count(out[-1].count + e.count)
        else:
            out.append(e)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Ledger:
    """An immutable, append-only record of privacy events (a composition).

    Consecutive identical events are merged into one with the summed ``count``, so the
    ledger stays tiny however long training runs; two ledgers describing the same sequence
    of steps compare equal. The ledger is a plain value: hashable, comparable, JSON
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
                f"Ledger.append(event): expected PoissonGaussianEvent or NonPrivateEvent; got "
                f"{type(event).__name__} ({event!r})."
            )
        events = self.events
        if events and events[-1]._key() == event._key():
            return Ledger(events[:-1] + (events[-1]._with_count(events[-1].count + event.count),))
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
