"""The noise keys this process has released under: one key's noise goes out with one value only.

A train step is a pure function of its state: stepped twice (a fork kept in a variable, one
checkpoint loaded twice, a notebook cell run again on an old state) it draws the same keyed noise
both times. Released with two different clipped sums, that noise cancels in their difference,
which is the difference of the sums themselves, with no noise at all. The accountant knows
nothing of it.

So ``make_train_step`` records each keyed step it releases here, and a later step under a key
already spent raises before it returns anything, unless it releases exactly what the first one
did (a recomputation releases nothing new: the same state, batch and step, run again, bit for
bit; a rounding-level difference, another chunking or compiled against eager, is another value).
What is recorded per run (a digest of seed and configuration): the steps released, as intervals
(a run of N consecutive steps costs one interval), and for every step a checksum of its release
(one int64 on the release's device, written without a host synchronisation, read only when a key
repeats): each leaf's bits summed as int32 words (a one-ulp change of one entry moves it by one),
the leaves' sums mixed by pseudo-random odd multipliers. A step under a key that another thread
is releasing raises too.

Distributed and sharded steps decide together: a rank whose shard of the release differs makes
every rank raise (one small collective, on a repeated key only).

What this cannot see: another process (two processes resumed from one checkpoint: see
``load_state(saved_after_last_step=)``), steps inside :func:`unreleased` (checks that throw their
results away, while the frame that entered it runs: a generator suspended inside it does not
cover its caller) and keys a process was told to forget (:func:`forget_spent_keys`, for test suites).
Not recorded: secure runs (noise from the OS CSPRNG, a fresh key per step, never repeated; a
forked secure state's branches each count only their own steps in their ledgers) and steps
without noise (``noise_multiplier=0``, charged as non-private).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import sys
import threading
from typing import Any

import torch
from torch import Tensor

from vmapdp._tree import leaves as _leaves

__all__ = ["NoiseKeyReused", "SpentKeys", "SPENT", "unreleased", "forget_spent_keys", "release_fingerprint"]


class NoiseKeyReused(RuntimeError):
    """A step would release under a noise key this process already released under, with another value."""


_CHUNK = 4096  # steps per block of checksums


_SMALL = 1 << 18  # bytes: leaves up to this size are checksummed together, in one pass
_BLOCK = 1 << 20  # words weighted by one block of multipliers (cached per device: 4 MiB)
_WEIGHTS: dict[torch.device, Tensor] = {}


def _weights(device: torch.device) -> Tensor:
    """``_BLOCK`` odd int32 multipliers, pseudo-random (the low 32 bits of splitmix64 of the
    position), on ``device``."""
    w = _WEIGHTS.get(device)
    if w is None:
        z = torch.arange(1, _BLOCK + 1, dtype=torch.int64) * _signed(0x9E3779B97F4A7C15)  # (int64 products wrap)
        z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed(0xBF58476D1CE4E5B9)
        z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed(0x94D049BB133111EB)
        z = (z ^ ((z >> 31) & ((1 << 33) - 1))) | 1
        low = z & 0xFFFFFFFF
        w = _WEIGHTS[device] = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32).to(device)
    return w


def _signed(z: int) -> int:
    return z - 2**64 if z >= 2**63 else z


def _bits_sum(x: Tensor) -> Tensor:
    """The sum of ``x``'s bits read as int32 words (int16 or bytes where the size asks), each word
    weighted by a pseudo-random odd multiplier of its position (int32, wrapping; blocks of
    ``_BLOCK`` words mixed again by ``_multipliers``): exact and order-free, the same bits give
    the same sum on any device and thread count. The weights make changes of a few ulps that cancel
    in a plain sum (+1 in one word, -1 in another: found by review, 2% of forks by one well-fit
    example went through a plain word sum) collide only by a ~2**-32 coincidence."""
    flat = x.detach().contiguous().reshape(-1)
    if flat.is_sparse or flat.storage_offset() * flat.element_size() % 4:  # (a view at an odd offset cannot be read as words)
        flat = flat.to_dense().clone() if flat.is_sparse else flat.clone()
    if (flat.numel() * flat.element_size()) % 4 == 0:
        words = flat.view(torch.int32)
    else:
        words = flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(torch.int16)
    weights = _weights(words.device)
    # (int32 products and sums wrap: the weighted sum mod 2**32, as fast as three plain passes)
    blocks = [(words[i : i + _BLOCK] * weights[: min(_BLOCK, words.numel() - i)]).sum(dtype=torch.int32) for i in range(0, words.numel(), _BLOCK)]
    if not blocks:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    if len(blocks) == 1:
        return blocks[0].to(torch.int64)
    return (torch.stack(blocks).to(torch.int64) * torch.tensor(_multipliers(len(blocks)), dtype=torch.int64, device=words.device)).sum()


def release_fingerprint(released: Any) -> Tensor:
    """A 0-dim int64 checksum of the tensors of ``released`` (on the first one's device, no
    synchronisation): each leaf's words summed with pseudo-random odd weights (:func:`_bits_sum`),
    the leaves' sums mixed by pseudo-random odd multipliers. A bit-for-bit recomputation gives the
    same. It is a checksum, not a hash: a change that keeps it does so by a ~2**-32 coincidence
    (found by review: per-leaf float32 norms of a 4M-element leaf did not move when one sample was
    removed, and 16 of 30 such forks went through; then a plain word sum let 2% of one-example
    forks through, their +1 and -1 ulp changes cancelling). About 3 ms for 10M entries on 2 idle
    cores (an int32 multiply and sum per word; a plain sum took 1.2 ms)."""
    leaves = [x for x in _leaves(released) if isinstance(x, Tensor)]
    if not leaves:
        return torch.zeros((), dtype=torch.int64)
    device = leaves[0].device
    # the small leaves' bytes joined into one tensor, summed in one pass: a few kernel launches per leaf cost
    # more than the sum itself (found by review: 80 small leaves took 1.2 ms, 0.5 with a plain sum)
    is_small = [x.device == device and not x.is_sparse and x.numel() * x.element_size() <= _SMALL for x in leaves]
    small = [x for x, s in zip(leaves, is_small) if s]
    parts = [x for x, s in zip(leaves, is_small) if not s]
    if small:
        joined = torch.cat([x.detach().contiguous().reshape(-1).view(torch.uint8) for x in small])
        parts.append(torch.cat([joined, joined.new_zeros(-joined.numel() % 4)]))  # (whole int32 words)
    sums = torch.stack([_bits_sum(x).to(device) for x in parts]).to(torch.int64)
    return (sums * torch.tensor(_multipliers(len(parts)), dtype=torch.int64, device=device)).sum()


def _multipliers(n: int) -> list[int]:
    """``n`` odd int64 multipliers, pseudo-random (splitmix64 of the leaf index): no linear pattern
    of changes across leaves cancels them as an arithmetic progression would."""
    out = []
    for i in range(n):
        z = (i + 1) * 0x9E3779B97F4A7C15 % 2**64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
        z = (z ^ (z >> 31)) | 1
        out.append(z - 2**64 if z >= 2**63 else z)
    return out


class SpentKeys:
    """The record of one process (see the module docstring); ``SPENT`` is the one the step uses."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[bytes, list[list[int]]] = {}  # run digest -> sorted disjoint [first, end) step intervals
        self._sums: dict[tuple[bytes, int], Tensor] = {}  # (run, step // _CHUNK) -> the checksums of those steps
        self._inflight: set[tuple[bytes, int]] = set()

    @staticmethod
    def run_digest(seed: int, binding: str) -> bytes:
        return hashlib.sha256(f"vmapdp-spent:{seed}:{binding}".encode()).digest()[:16]

    @staticmethod
    def _after(spans: list[list[int]], step: int) -> tuple[int, bool]:
        """The index past the last interval starting at or before ``step``, and whether that one holds it."""
        i = bisect.bisect_right(spans, [step, float("inf")])
        return i, i > 0 and spans[i - 1][0] <= step < spans[i - 1][1]

    def _released(self, run: bytes, step: int) -> bool:
        return self._after(self._runs.get(run, []), step)[1]

    def check(self, call: str, run: bytes, step: int) -> bool:
        """Before computing: whether step ``step`` of ``run`` was released before (its release is
        then compared after, :meth:`differs`), marking it in flight until :meth:`done`; raises
        :class:`NoiseKeyReused` where another thread is releasing it."""
        with self._lock:
            if (run, step) in self._inflight:
                raise NoiseKeyReused(
                    f"{call}: another thread is releasing step {step} of this run under the same noise key now (one state "
                    "stepped by two threads): both releases would share their noise. Step each state once. Nothing was released."
                )
            self._inflight.add((run, step))
            return self._released(run, step)

    def done(self, run: bytes, step: int) -> None:
        """The step under this key returned or raised: no longer in flight."""
        with self._lock:
            self._inflight.discard((run, step))

    def differs(self, run: bytes, step: int, fingerprint: Tensor) -> bool:
        """Whether a release of a spent key differs from the one recorded (one host synchronisation)."""
        with self._lock:
            block = self._sums.get((run, step // _CHUNK))
        if block is None:
            return True
        return bool(block[step % _CHUNK].cpu() != fingerprint.cpu())

    def record(self, run: bytes, step: int, fingerprint: Tensor) -> None:
        with self._lock:
            spans = self._runs.setdefault(run, [])
            i, held = self._after(spans, step)
            if held:
                return  # (a recomputation: the checksum is the one recorded)
            if i > 0 and spans[i - 1][1] == step:
                spans[i - 1][1] = step + 1
            else:
                spans.insert(i, [step, step + 1])
                i += 1
            if i < len(spans) and spans[i - 1][1] == spans[i][0]:  # join with the next interval
                spans[i - 1][1] = spans.pop(i)[1]
            key = (run, step // _CHUNK)
            if key not in self._sums or self._sums[key].device != fingerprint.device:
                old = self._sums.get(key)
                self._sums[key] = torch.zeros(_CHUNK, dtype=torch.int64, device=fingerprint.device)
                if old is not None:
                    self._sums[key].copy_(old)
            self._sums[key][step % _CHUNK] = fingerprint  # (a device write: no synchronisation)

    def clear(self) -> None:
        with self._lock:
            self._runs.clear()
            self._sums.clear()
            self._inflight.clear()


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
# the frames running a `with unreleased():` block now, process-wide: id -> [frame, depth] (the frame
# held, so its id is not reused while on record). A frame is on one stack at a time, so threads and
# asyncio tasks stay apart without a context of their own, and leaving a block in another context
# (a generator resumed elsewhere) still takes its own entry out.
_INSIDE: dict[int, list] = {}
_INSIDE_LOCK = threading.Lock()


def recording() -> bool:
    """False inside :func:`unreleased`: while a frame that entered it is on the caller's stack (a
    generator suspended inside it, its frame off the stack, leaves its caller recorded)."""
    if not _INSIDE:
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if id(frame) in _INSIDE:
            return False
        frame = frame.f_back
    return True


class unreleased(contextlib.ContextDecorator):
    """Steps run inside are neither checked nor recorded: for checks whose results are thrown away
    (``vmapdp.audit.check_sensitivity`` steps one state with neighbouring batches on purpose). Never
    around a step whose result is used or published. It covers the code its ``with`` block runs in
    that frame and the calls from it (not other threads, not the caller of a generator suspended
    inside it); enter it with a ``with`` statement or as a decorator. No state on the instance: one
    may be shared."""

    def __enter__(self) -> None:
        frame = sys._getframe(1)  # the frame that runs the with-statement
        with _INSIDE_LOCK:
            _INSIDE.setdefault(id(frame), [frame, 0])[1] += 1

    def __exit__(self, *exc: Any) -> bool:
        frame = sys._getframe(1)  # a with-statement leaves in the frame that entered it, in any context or thread
        with _INSIDE_LOCK:
            entry = _INSIDE.get(id(frame))
            if entry is None or entry[0] is not frame:
                raise RuntimeError("vmapdp.noise.unreleased(): left from another frame than the one that entered it; enter it with a with-statement.")
            entry[1] -= 1
            if not entry[1]:
                del _INSIDE[id(frame)]
        return False


def forget_spent_keys() -> None:
    """Forget every noise key this process released under: for test suites, whose tests are separate
    runs that share seeds and models. Never in a program whose releases are published."""
    SPENT.clear()
