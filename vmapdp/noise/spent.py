"""The noise keys this process has released under: one key's noise goes out with one value only.

A train step is a pure function of its state: stepped twice (a fork kept in a variable, one
checkpoint loaded twice, a notebook cell run again on an old state) it draws the same keyed noise
both times. Released with two different clipped sums, that noise cancels in their difference,
which is the difference of the sums themselves, with no noise at all. The accountant knows
nothing of it.

So ``make_train_step`` records each keyed step it releases here, and a later step under a key
already spent raises before it returns anything, unless it releases exactly what the first one
did (a recomputation releases nothing new: the same state, batch and step, run again; compared
by each leaf's norm, bit for bit: a different clipped sum keeps every one of them only by an exact
coincidence). What is
recorded per run (a digest of seed and configuration): the steps released, as intervals (a run
of N consecutive steps costs one interval, not N entries), and for the most recent
``FINGERPRINTS`` keys a fingerprint of the release (each leaf's norm, on the leaf's device: no
host synchronisation until a key repeats). A repeat of an older key raises at once, before
anything is computed.

Distributed and sharded steps decide together: a rank whose shard of the release differs makes
every rank raise (one small collective, on a repeated key only).

What this cannot see: another process (two processes resumed from one checkpoint: see
``load_state(saved_after_last_step=)``), steps inside :func:`unreleased` (checks that throw their
results away) and keys a process was told to forget (:func:`forget_spent_keys`, for test suites).
Not recorded: secure runs (noise from the OS CSPRNG, a fresh key per step, never repeated; a
forked secure state shares no noise, but each branch's ledger counts only its own steps) and
steps without noise (``noise_multiplier=0``, charged as non-private).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import hashlib
import threading
from collections import OrderedDict
from typing import Any, Iterator

import optree
import torch
from torch import Tensor

__all__ = ["NoiseKeyReused", "SpentKeys", "SPENT", "unreleased", "forget_spent_keys", "release_fingerprint"]

FINGERPRINTS = 16  # the recent keys whose releases are kept (as fingerprints) to recognise a recomputation


class NoiseKeyReused(RuntimeError):
    """A step would release under a noise key this process already released under, with another value."""


def release_fingerprint(released: Any) -> Tensor:
    """Each leaf's norm (as float64), stacked: on the first leaf's device, no synchronisation. Two releases
    under one key differ exactly where their clipped sums do, so equal fingerprints of the noisy
    sums mean the same sums (to the bits every norm depends on)."""
    leaves = [x.detach() for x in optree.tree_leaves(released, namespace="torch") if isinstance(x, Tensor)]
    if not leaves:
        return torch.zeros(0, dtype=torch.float64)
    norms = torch._foreach_norm(leaves)  # (one fused kernel per device and dtype)
    if len({(n.dtype, n.device) for n in norms}) == 1:  # the usual case: one stack, one cast (few kernels on a GPU)
        return torch.stack(norms).to(torch.float64)
    return torch.stack([n.to(device=leaves[0].device, dtype=torch.float64) for n in norms])


class SpentKeys:
    """The record of one process (see the module docstring); ``SPENT`` is the one the step uses."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[bytes, list[list[int]]] = {}  # run digest -> sorted disjoint [first, end) step intervals
        self._recent: OrderedDict[tuple[bytes, int], Tensor] = OrderedDict()  # (run, step) -> fingerprint

    @staticmethod
    def run_digest(seed: int, binding: str) -> bytes:
        return hashlib.sha256(f"vmapdp-spent:{seed}:{binding}".encode()).digest()[:16]

    def _released(self, run: bytes, step: int) -> bool:
        spans = self._runs.get(run, ())
        i = bisect.bisect_right(spans, [step, float("inf")]) - 1
        return i >= 0 and spans[i][0] <= step < spans[i][1]

    def check(self, call: str, run: bytes, step: int) -> bool:
        """Before computing: whether step ``step`` of ``run`` was released before (its release is
        then compared after, :meth:`differs`); raises :class:`NoiseKeyReused` at once where that
        release is no longer kept to compare."""
        with self._lock:
            if not self._released(run, step):
                return False
            if (run, step) not in self._recent:
                raise NoiseKeyReused(_message(call, step, "long ago (its release is no longer kept to compare)"))
        return True

    def differs(self, run: bytes, step: int, fingerprint: Tensor) -> bool:
        """Whether a release of a spent key differs from the one recorded (one host synchronisation)."""
        with self._lock:
            kept = self._recent.get((run, step))
        return kept is None or kept.shape != fingerprint.shape or not torch.equal(kept, fingerprint.to(kept.device))

    def record(self, run: bytes, step: int, fingerprint: Tensor) -> None:
        with self._lock:
            spans = self._runs.setdefault(run, [])
            i = bisect.bisect_right(spans, [step, float("inf")])
            if i > 0 and spans[i - 1][0] <= step < spans[i - 1][1]:
                pass  # (a recomputation)
            elif i > 0 and spans[i - 1][1] == step:
                spans[i - 1][1] = step + 1
            else:
                spans.insert(i, [step, step + 1])
                i += 1
            if i < len(spans) and spans[i - 1][1] == spans[i][0]:  # join with the next interval
                spans[i - 1][1] = spans.pop(i)[1]
            self._recent[(run, step)] = fingerprint
            self._recent.move_to_end((run, step))
            while len(self._recent) > FINGERPRINTS:
                self._recent.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._runs.clear()
            self._recent.clear()


def refuse(call: str, step: int) -> NoiseKeyReused:
    """The error of a release that differs from the one recorded under its key."""
    return NoiseKeyReused(_message(call, step, "with another value"))


def _message(call: str, step: int, how: str) -> str:
    return (
        f"{call}: this process already released step {step} of this run under the same noise key, {how}: "
        "the state was stepped before (a copy kept in a variable, a checkpoint loaded twice, a cell run "
        "again on an old state). The two releases would share their noise, and their difference would "
        "be the difference of the clipped sums, with no noise at all. Continue from the latest state; "
        "for another run, start a new state (init_train_state(seed=None) draws a fresh seed). "
        "Nothing was released."
    )


SPENT = SpentKeys()
_UNRECORDED: contextvars.ContextVar[bool] = contextvars.ContextVar("vmapdp_unrecorded", default=False)


def recording() -> bool:
    """False inside :func:`unreleased`."""
    return not _UNRECORDED.get()


@contextlib.contextmanager
def unreleased() -> Iterator[None]:
    """Steps run inside are neither checked nor recorded: for checks whose results are thrown away
    (``vmapdp.audit.check_sensitivity`` steps one state with neighbouring batches on purpose). Never
    around a step whose result is used or published."""
    token = _UNRECORDED.set(True)
    try:
        yield
    finally:
        _UNRECORDED.reset(token)


def forget_spent_keys() -> None:
    """Forget every noise key this process released under: for test suites, whose tests are separate
    runs that share seeds and models. Never in a program whose releases are published."""
    SPENT.clear()
