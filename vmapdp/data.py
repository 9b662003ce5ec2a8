"""Poisson sampling with static shapes, and gathering a batch by index.

DP-SGD's privacy analysis (the subsampled Gaussian) assumes each step's batch is a *Poisson*
sample: every example is in independently with probability ``sample_rate``. The batch size is
then random, which would make every step a new shape for ``torch.compile``. ``PoissonSampler``
keeps the shapes fixed instead: each step's indices are padded to a fixed ``capacity`` and come
with a mask (False = padding). A step that samples more than ``capacity`` examples is never
truncated or resampled (both would break the accounting): it yields a whole number of
capacity-sized chunks, which the train step processes one after the other and sums before the
noise is added once.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from typing import Any, Iterator

import optree
import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp.accounting._special import kl_bernoulli
from vmapdp.noise import key_bytes

__all__ = [
    "PoissonSampler",
    "FixedSizeSampler",
    "ShuffledSampler",
    "BallsInBinsSampler",
    "TruncatedPoissonSampler",
    "CyclicPoissonSampler",
    "default_capacity",
    "gather",
    "gather_dataset",
]

_U53 = (1 << 53) - 1

# the stream_id of a secure memoryless sampler (Poisson, fixed-size): any secure one continues a run of another
# (fresh draws from the OS), and a state stepped with one loads only with saved_after_last_step=True
SECURE_SAMPLER_ID = "secure-memoryless"
# the sampler_id of a state read with load_state(..., ignore_sampler=True): for evaluation, refused by a step with a sampler
EVALUATION_ONLY_ID = "evaluation-only"


def _generator_digest(generator: torch.Generator) -> bytes:
    """A digest of a torch generator's state: a generator-driven sampler's source for its ``stream_id``."""
    return hashlib.sha256(generator.get_state().numpy().tobytes()).digest()


def _stream_id(sampler: Any, params: dict[str, Any]) -> str:
    """``sampler.stream_id``: a digest of its kind, the arguments that decide its batches
    (``params``) and its source (its key, else ``sampler._source_id``: a generator's state at
    its first draw, named now if not yet, or a secure sampler's token)."""
    source = sampler.key if sampler.key is not None else sampler._source_id
    if source is None:  # (a generator-driven sampler before its first draw: named now, and kept)
        source = sampler._source_id = _generator_digest(sampler.generator)
    label = repr((type(sampler).__name__, sorted(params.items()))).encode()
    return hashlib.sha256(b"vmapdp-sampler-id:" + hashlib.sha256(source).digest() + label).hexdigest()[:32]


def _shake_u53(label: bytes, n: int) -> Tensor:
    """n independent uniform 53-bit integers (int64) from SHAKE-256 of ``label``."""
    raw = torch.frombuffer(bytearray(hashlib.shake_256(label).digest(8 * n)), dtype=torch.int64)
    return raw & _U53


def _os_u53(n: int) -> Tensor:
    """n uniform 53-bit integers from the operating system's CSPRNG."""
    return torch.frombuffer(bytearray(secrets.token_bytes(8 * n)), dtype=torch.int64) & _U53



def _check_state(call: str, state: Any) -> None:
    """A sampler's ``load_state_dict`` argument: a non-empty dict whose key, if any, is bytes."""
    if not isinstance(state, dict):
        raise TypeError(f"{call}: state must be a dict from the sampler's state_dict(), got {type(state).__name__}.")
    if not state or not isinstance(state.get("key", b""), (bytes, type(None))):
        raise ValueError(
            f"{call}: the state is {'empty' if not state else 'malformed (its key is not bytes)'}: it is not a dict the sampler's "
            "state_dict() returned (edited, or of something else). Load the dict state_dict() saved. Nothing was loaded."
        )


def _state_count(call: str, state: dict, name: str, default: Any = None) -> int:
    """A count in a sampler's saved state (batches drawn, steps taken): an int in ``[0, 2**63)``
    (found by review: draws=-1 put a keyed stream before its start, "2" and 1.5 were read as ints)."""
    value = state.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(
            f"{call}: the state's {name}={value!r} must be an int in [0, 2**63) (what the sampler has drawn so far): "
            "it was edited, or is not a dict the sampler's state_dict() returned. Load the dict state_dict() saved. "
            "Nothing was loaded."
        )
    return value


def _check_source(call: str, generator: Any, key: Any, secure: Any) -> None:
    """A sampler's source of randomness: at most one of ``generator=``, ``key=``, ``secure=True``."""
    _checks.flag(call, "secure", secure)
    if secure and generator is not None:
        raise ValueError(
            f"{call}: secure=True draws from the operating system's CSPRNG and cannot use a seeded "
            "generator; pass generator=None (a seeded generator makes the batches predictable)."
        )
    if sum(x is not None and x is not False for x in (generator, key, secure or None)) > 1:
        raise ValueError(f"{call}: give at most one source of randomness: generator=, key= or secure=True.")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{call}: generator must be a torch.Generator or None, got {type(generator).__name__}.")
    for name, value in (("generator", generator), ("key", key)):
        if value is not None:
            _checks.guessable(call, name, value, "the batches (the sampling the accountant counts on being secret)")


def default_capacity(num_samples: int, sample_rate: float, overflow_probability: float = 1e-6) -> int:
    """The smallest capacity ``c`` with ``P(Binomial(num_samples, sample_rate) > c) <= overflow_probability``.

    Uses the Chernoff bound ``P(X >= k) <= exp(-n KL(k/n || q))`` for ``k > nq``, which is an
    upper bound, so the real overflow rate is at most ``overflow_probability`` per step.
    """
    n, q = num_samples, sample_rate
    if q >= 1.0:
        return n
    mean = n * q
    lo = max(1, math.ceil(mean))
    for k in range(lo, n + 1):  # first k with P(X >= k) small enough; capacity k - 1
        if k > mean and -n * kl_bernoulli(k / n, q) <= math.log(overflow_probability):
            return max(1, k - 1)
    return n


class PoissonSampler:
    """Independent Poisson samples of ``range(num_samples)``, padded to a fixed capacity.

    Args:
        num_samples: dataset size ``N``.
        sample_rate: ``q``, the probability that each example is in a step's batch (expected
            batch size ``q * N``).
        steps: how many steps to yield (default one epoch, ``round(1 / sample_rate)``).
        generator: a ``torch.Generator`` to sample with: reproducible but predictable (torch's CPU
            generator keeps 32 bits of a seed and Mersenne Twister is linear in its state), so
            for tests and experiments only: whoever predicts the batches voids the subsampling
            amplification the accountant counts on.
        key: a secret key (bytes, int or str): reproducible sampling decisions from a SHAKE-256
            stream of ``(key, step)``. Default (no generator, no key, not secure): a random
            256-bit key from OS entropy. Keep it as secret as the noise seed.
        capacity: the fixed physical batch size. Default: the smallest size that one step
            overflows with probability ``<= overflow_probability``. Set it lower to bound memory:
            a step then spans several chunks (virtual steps).
        overflow_probability: used to choose the default capacity.
        secure: draw the sampling decisions from the operating system's CSPRNG
            (``secrets``/``os.urandom``): not reproducible, nothing to checkpoint.

    Iterating yields ``(indices, mask)`` per step: int64 ``[m * capacity]`` and bool
    ``[m * capacity]`` with ``m = max(1, ceil(k / capacity))`` for ``k`` sampled examples;
    ``m = 1`` except on the rare overflowing step. Padding rows hold index 0 and mask False.
    Every sampled example appears exactly once; nothing is dropped; an empty step yields an
    all-False mask (DP-SGD still releases noise for it).

    Example:
        >>> sampler = PoissonSampler(1000, 0.01, steps=3, generator=torch.Generator().manual_seed(0))
        >>> for indices, mask in sampler:
        ...     batch = gather((x, y), indices)   # then step(state, batch, mask)
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        *,
        key: bytes | int | str | None = None,
        capacity: int | None = None,
        overflow_probability: float = 1e-6,
        secure: bool = False,
    ):
        call = "PoissonSampler"
        num_samples = _checks.positive_int(call, "num_samples", num_samples, meaning="num_samples is the dataset size")
        sample_rate = _checks.sample_rate(call, sample_rate)
        if steps is None:
            steps = max(1, round(1.0 / sample_rate))
        steps = _checks.positive_int(call, "steps", steps, minimum=0, meaning="steps is how many batches to yield")
        _checks.probability(call, "overflow_probability", overflow_probability, allow_one=False, meaning="it sets the default capacity")
        if capacity is None:
            capacity = default_capacity(num_samples, sample_rate, overflow_probability)
        capacity = _checks.positive_int(call, "capacity", capacity, meaning="capacity is the physical batch size")
        _check_source(call, generator, key, secure)
        self.num_samples = num_samples
        self.sample_rate = float(sample_rate)
        self.steps = steps
        self.capacity = capacity
        self.secure = secure
        self.generator = generator
        if generator is None and not secure:
            key = key_bytes(key, call=call) if key is not None else secrets.token_bytes(32)
        self.key: bytes | None = key
        self._draws = 0  # steps drawn so far (the keyed stream's counter)
        # what tells a generator-driven sampler from another made alike (stream_id): the generator's state at its first
        # draw (None until then); kept in state_dict
        self._source_id: bytes | None = None

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * num_samples``: the divisor DP-SGD uses (never the realised size)."""
        return self.sample_rate * self.num_samples

    def __len__(self) -> int:
        return self.steps

    def _draw(self) -> Tensor:
        """The sampled indices of one step (sorted int64)."""
        n, q = self.num_samples, self.sample_rate
        if self.secure:
            # 53-bit uniform integers from the OS CSPRNG; example i is in iff u_i < q * 2**53
            return (_os_u53(n) < int(q * (1 << 53))).nonzero().flatten()
        if self.key is not None:
            label = b"vmapdp-poisson:" + self.key + b":" + str(self._draws).encode()
            self._draws += 1
            return (_shake_u53(label, n) < int(q * (1 << 53))).nonzero().flatten()
        if self._source_id is None:
            self._source_id = _generator_digest(self.generator)
        self._draws += 1
        return (torch.rand(n, generator=self.generator, dtype=torch.float64) < q).nonzero().flatten()

    def sample(self) -> tuple[Tensor, Tensor]:
        """One step: ``(indices, mask)`` padded to a multiple of ``capacity``."""
        return _padded(self, self._draw(), self.capacity, chunks=True)

    # its event does not depend on its position (memoryless), but a keyed sampler's batches do
    positional = False
    last_rows: int | None = None  # the real rows of the last draw (None: none yet)
    binomial_draws = True  # a draw's real rows are Binomial(num_samples, expected_batch_size / num_samples) (capped by max_batch_size)

    @property
    def steps_drawn(self) -> int | None:
        """The batches a keyed or generator-driven sampler has drawn (restored by
        :meth:`load_state_dict`); None for a secure one. ``make_train_step`` wants exactly
        ``step + 1``: a sampler restarted on a resumed run (a fresh one, one with a fresh generator
        of the same seed, or a checkpoint saved without it) would draw other batches for the steps
        it repeats, under the same noise keys, and the two releases of a repeated step would differ
        by a noise-free vector (found by review)."""
        return None if self.secure else self._draws

    @property
    def stream_id(self) -> str:
        """The sampler's identity (as :attr:`CyclicPoissonSampler.stream_id`): a digest of its key
        or of a generator's state at its first draw (named where its id is read first, then kept),
        and of the arguments that decide its batches; ``SECURE_SAMPLER_ID`` for a secure one (every
        secure Poisson sampler is the same process: fresh draws from the OS). A state stepped with a
        secure sampler is loaded only with ``saved_after_last_step=True``, whether or not the sampler
        was saved with it (found by review: a checkpoint saved without it resumed, and the repeated
        step drew another batch under the same keyed noise, 1.87 C). As secret as the key."""
        return SECURE_SAMPLER_ID if self.secure else _stream_id(self, self._id_params())

    def _id_params(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "sample_rate": self.sample_rate}

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for _ in range(self.steps):
            yield self.sample()

    def event(self, noise_multiplier: float):
        """The accounting event of one step at ``noise_multiplier``: a
        :class:`~vmapdp.accounting.PoissonGaussianEvent` (add/remove neighbours)."""
        from vmapdp.accounting import PoissonGaussianEvent

        return PoissonGaussianEvent(noise_multiplier=noise_multiplier, sample_rate=self.sample_rate)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's RNG state, for checkpoints (``secure`` samplers have none to save)."""
        return {
            "generator": None if self.generator is None else self.generator.get_state(),
            "key": self.key,
            "secure": self.secure,
            "draws": self._draws,
            "num_samples": self.num_samples,
            "sample_rate": self.sample_rate,
            "source_id": None if self.key is not None else self._source_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`). A state saved by a sampler of another
        dataset size or rate is refused: its stream would sample other batches than the ones the
        ledger and the resumed run assume."""
        call = "PoissonSampler.load_state_dict(state)"
        _check_state(call, state)
        for name, mine in (("num_samples", self.num_samples), ("sample_rate", self.sample_rate)):
            theirs = state.get(name)  # (absent in states saved before this check existed)
            if theirs is not None and theirs != mine:
                raise ValueError(
                    f"{call}: the state comes from a sampler with {name}={theirs!r}, this one has {name}={mine!r}; "
                    "resuming it would continue another sampling process than the one the run (and its privacy "
                    f"ledger) used. Make the sampler with the same num_samples and sample_rate as the saved run."
                )
        saved = state.get("generator")
        if state.get("key") is not None:
            if self.secure or self.generator is not None:
                raise ValueError("PoissonSampler.load_state_dict: the state comes from a keyed sampler; resume it with a PoissonSampler made without generator= or secure=.")
            self.key, self._draws = state["key"], _state_count(call, state, "draws")
            return
        if self.secure:
            if saved is not None:
                raise ValueError("PoissonSampler.load_state_dict: this sampler is secure (OS CSPRNG) but the state comes from a seeded sampler.")
            return  # a secure sampler has no state: it keeps drawing from the OS
        if saved is None:
            raise ValueError(
                "PoissonSampler.load_state_dict: the state comes from a secure sampler (no RNG state); "
                "resume it with PoissonSampler(..., secure=True)."
            )
        if self.generator is None:
            raise ValueError("PoissonSampler.load_state_dict: the state comes from a generator-driven sampler; resume it with generator=torch.Generator() (predictable: for tests; a keyed sampler's state resumes under its key=).")
        draws = _state_count(call, state, "draws", 0)  # (0 in states saved before a generator's draws were counted)
        self.generator.set_state(saved)
        self._draws = draws
        self._source_id = state.get("source_id")  # (None: not drawn from yet, or saved before stream_id: named at the next draw)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_samples={self.num_samples}, sample_rate={self.sample_rate}, steps={self.steps}, "
            f"capacity={self.capacity}, secure={self.secure})"
        )


def _padded(sampler: Any, idx: Tensor, capacity: int, *, chunks: bool) -> tuple[Tensor, Tensor]:
    """:func:`_pad` of one draw of ``sampler``, whose real rows it records (``sampler.last_rows``):
    the distributed step checks that its ranks' shares add up to them."""
    sampler.last_rows = int(idx.numel())
    return _pad(idx, capacity, chunks=chunks)


def _pad(idx: Tensor, capacity: int, *, chunks: bool) -> tuple[Tensor, Tensor]:
    """``(indices, mask)`` of length ``capacity`` (a multiple of it with ``chunks``); padding rows
    hold index 0 and mask False."""
    k = idx.numel()
    m = max(1, math.ceil(k / capacity)) if chunks else 1
    indices = torch.zeros(m * capacity, dtype=torch.int64)
    mask = torch.zeros(m * capacity, dtype=torch.bool)
    indices[:k] = idx
    mask[:k] = True
    return indices, mask


class _KeyedSampler:
    """What every sampler shares: the source of randomness (a secret key's SHAKE-256 stream, a
    torch generator for tests, or the OS CSPRNG), its checkpoint state, and the padding.

    Subclasses set ``_LABEL`` (the stream's domain separation) and implement ``sample()`` and
    ``event(noise_multiplier)``. Every draw takes uniform 53-bit integers from :meth:`_u53`; a
    keyed draw is a pure function of ``(key, draw number)``, so a restored counter resumes the
    stream bitwise.
    """

    _LABEL = b"vmapdp-sampler:"

    def _init_source(self, call, generator, key, secure) -> None:
        _check_source(call, generator, key, secure)
        self.secure = secure
        self.generator = generator
        if generator is None and not secure:
            key = key_bytes(key, call=call) if key is not None else secrets.token_bytes(32)
        self.key: bytes | None = key if generator is None and not secure else None
        # what tells this sampling process from another made alike (stream_id): the key itself, the
        # generator's state at the sampler's first draw (None until then), or a fresh token for a secure
        # sampler; restored by load_state_dict
        self._source_id: bytes | None = b"" if self.key is not None else None if generator is not None else secrets.token_bytes(16)
        self._draws = 0
        self._step = 0  # steps yielded so far

    def _u53(self, n: int) -> Tensor:
        if self.secure:
            return _os_u53(n)
        if self.key is not None:
            label = self._LABEL + self.key + b":" + str(self._draws).encode()
            self._draws += 1
            return _shake_u53(label, n)
        if self._source_id is None:
            self._source_id = _generator_digest(self.generator)
        return torch.randint(0, 1 << 53, (n,), generator=self.generator, dtype=torch.int64)

    def _permutation(self, n: int) -> Tensor:
        """A uniformly random permutation of range(n): sort by 53-bit keys (ties, probability
        below n^2 / 2^54, keep index order)."""
        return torch.sort(self._u53(n), stable=True).indices

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for _ in range(self.steps):
            yield self.sample()

    def _params(self) -> dict[str, Any]:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra(self, state: dict[str, Any]) -> None:
        pass

    positional = True  # a step's event depends on its position (an epoch's first step, a group)
    last_rows: int | None = None  # the real rows of the last draw (None: none yet)

    @property
    def stream_id(self) -> str:
        """A digest naming this sampling process: the kind, its arguments and its source (the
        key; the generator's state at its first draw; a secure sampler's own random token). Two
        samplers made alike with the same ``key=`` or generator seed have the same id; a sampler
        made without ``key=`` (a random key) or with ``secure=True`` has its own, which
        :meth:`load_state_dict` restores. ``make_train_step`` records it in
        ``TrainState.sampler_id`` and refuses a later step whose sampler has another (a fresh
        sampler fast-forwarded to the state's step would repeat groups or epoch positions
        differently from the ones the ledger charged). A generator-driven sampler (for tests) is
        named by its generator's state at its first draw (or where its id is read first, then
        kept): draws that others make from the same generator later are not seen.

        As secret as the key: a digest of it, so a guessable key (a small seed) can be found from
        the id by trying them. ``TrainState`` keeps it beside the noise seed, which is secret too,
        and never prints it."""
        return _stream_id(self, self._params())

    @property
    def steps_drawn(self) -> int:
        """The batches drawn so far (restored by :meth:`load_state_dict`): ``make_train_step``
        wants this sampler exactly one batch past the state (a fresh sampler on a resumed run
        would repeat the groups or epoch positions that the ledger has already charged; one that
        drew a batch whose step never ran would have the ledger charge too little)."""
        return self._step

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bitwise (keyed or generator-driven; a secure sampler
        resumes its current epoch from the saved assignment, then draws fresh)."""
        return {
            "kind": type(self).__name__,
            **self._params(),
            "generator": None if self.generator is None else self.generator.get_state(),
            "key": self.key,
            "secure": self.secure,
            "draws": self._draws,
            "step": self._step,
            "source_id": None if self.key is not None else self._source_id,
            **self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of a sampler made with the same
        arguments and the same kind of randomness); anything else is refused, because it would
        continue another sampling process than the one the run's ledger describes."""
        call = f"{type(self).__name__}.load_state_dict(state)"
        _check_state(call, state)
        mine = {"kind": type(self).__name__, **self._params()}
        if "kind" not in state and "sample_rate" in state:  # (found by review: "the state has kind=None")
            raise ValueError(
                f"{call}: the state is a PoissonSampler's (or a TruncatedPoissonSampler's), not a {type(self).__name__}'s: "
                "resuming it would continue another sampling process than the one the run (and its privacy ledger) used. "
                "Resume it with the sampler the run was made with."
            )
        for name, value in mine.items():
            if state.get(name) != value:
                raise ValueError(
                    f"{call}: the state has {name}={state.get(name)!r}, this sampler has {name}={value!r}; resuming it "
                    "would continue another sampling process than the one the run (and its privacy ledger) used. "
                    "Make the sampler with the same arguments as the saved run."
                )
        source = "key" if state.get("key") is not None else "generator" if state.get("generator") is not None else "secure"
        here = "key" if self.key is not None else "generator" if self.generator is not None else "secure"
        if source != here:
            raise ValueError(f"{call}: the state comes from a {source}-driven sampler, this one is {here}-driven; make it the same way (key=, generator= or secure=True).")
        draws, step = _state_count(call, state, "draws"), _state_count(call, state, "step")  # (checked before anything changes)
        if source == "key":
            self.key = state["key"]
        elif source == "generator":
            self.generator.set_state(state["generator"])
        self._draws, self._step = draws, step
        if source == "generator":  # (None: not drawn from yet, or a state saved before stream_id: named at the next draw)
            self._source_id = state.get("source_id")
        elif source == "secure" and isinstance(state.get("source_id"), bytes):  # (absent from states saved before stream_id)
            self._source_id = state["source_id"]
        self._load_extra(state)


class FixedSizeSampler(_KeyedSampler):
    """Batches of exactly ``batch_size`` distinct examples, drawn uniformly WITHOUT replacement
    from ``range(num_samples)``, independently at every step.

    Yields ``(indices, mask)``: int64 ``[batch_size]`` (sorted) and an all-True mask.

    Accounting: :meth:`event` gives a :class:`~vmapdp.accounting.FixedSizeGaussianEvent`, analysed
    under the REPLACE-ONE neighbouring relation (the batch size reveals the dataset size, so
    add/remove does not apply) by ``accountant="pld"`` (default) or ``"rdp"``.

    Args:
      num_samples: dataset size n. batch_size: b in [1, n]. steps: steps to yield (default one
        epoch's worth, ``round(n / b)``). generator / key / secure: as in :class:`PoissonSampler`.
    """

    positional = False  # every step samples afresh: its event does not depend on the steps before

    _LABEL = b"vmapdp-fixed-size:"

    @property
    def stream_id(self) -> str:
        """As :attr:`PoissonSampler.stream_id`: ``SECURE_SAMPLER_ID`` when secure (memoryless:
        every secure one is the same process), else its key's or generator's digest."""
        return SECURE_SAMPLER_ID if self.secure else super().stream_id

    def __init__(self, num_samples: int, batch_size: int, steps: int | None = None, generator: torch.Generator | None = None, *, key=None, secure: bool = False):
        call = "FixedSizeSampler"
        self.num_samples = _checks.positive_int(call, "num_samples", num_samples, meaning="num_samples is the dataset size")
        self.batch_size = _checks.positive_int(call, "batch_size", batch_size, meaning="batch_size is the number of examples in every batch")
        if self.batch_size > self.num_samples:
            raise ValueError(f"{call}: batch_size={batch_size} must be in [1, num_samples={num_samples}]; a batch without replacement cannot be larger than the dataset.")
        self.steps = _checks.positive_int(call, "steps", steps if steps is not None else max(1, round(num_samples / batch_size)), minimum=0, meaning="steps is how many batches to yield")
        self.capacity = self.batch_size
        self._init_source(call, generator, key, secure)

    expected_batch_size = property(lambda self: float(self.batch_size), doc="the batch size (every batch has it)")
    sample_rate = property(lambda self: self.batch_size / self.num_samples, doc="batch_size / num_samples: the probability that an example is in a batch")
    draw_sizes = property(lambda self: (self.batch_size,), doc="the real rows a draw can have (the step checks a batch against them)")

    def _params(self):
        return {"num_samples": self.num_samples, "batch_size": self.batch_size}

    def sample(self) -> tuple[Tensor, Tensor]:
        idx = torch.sort(self._permutation(self.num_samples)[: self.batch_size]).values
        self._step += 1
        return _padded(self, idx, self.capacity, chunks=False)

    def event(self, noise_multiplier: float):
        """The accounting event of one step at ``noise_multiplier``."""
        from vmapdp.accounting import FixedSizeGaussianEvent

        return FixedSizeGaussianEvent(noise_multiplier=noise_multiplier, batch_size=self.batch_size, num_samples=self.num_samples)


class _EpochSampler(_KeyedSampler):
    """Shared by the samplers that use every example at most once per epoch: the epoch's
    assignment (a permutation, or a step per example) is drawn when the epoch opens and kept in
    the checkpoint state."""

    steps_per_epoch: int

    def _draw_epoch(self) -> Tensor:
        raise NotImplementedError

    def _batch(self, assignment: Tensor, j: int) -> Tensor:
        raise NotImplementedError

    def sample(self) -> tuple[Tensor, Tensor]:
        j = self._step % self.steps_per_epoch
        if j and self._assignment is None:  # (a redrawn permutation mid-epoch: examples twice in an epoch charged once)
            raise ValueError(
                f"{type(self).__name__}.sample: step {j} of an epoch but no epoch assignment: the sampler's state was loaded "
                "without it (edited, or not saved by state_dict), and a new permutation now would put examples in two "
                "batches of an epoch charged as one. Load the state_dict the sampler saved whole. Nothing was drawn."
            )
        if j == 0:
            self._assignment = self._draw_epoch()
        self._opened_epoch = j == 0
        idx = self._batch(self._assignment, j)
        self._step += 1
        return _padded(self, idx, self.capacity, chunks=self._chunks)

    def _follow_draw(self) -> None:
        """Move to the next step as if this sampler had drawn it, without drawing: a secure
        sampler's batches are drawn on rank 0 and broadcast (``vmapdp.distributed.sharded``), and
        every rank records the step's event, which says whether it opened an epoch (found by
        review: the other ranks' secure epoch samplers had drawn nothing, and their first step
        raised). The epoch's assignment stays rank 0's alone."""
        self._opened_epoch = self._step % self.steps_per_epoch == 0
        self._step += 1

    def event(self, noise_multiplier: float):
        """The accounting event of the step last returned by :meth:`sample` (record it before
        releasing that step), saying whether the step opened an epoch: an
        :class:`~vmapdp.accounting.EpochGaussianEvent` for shuffled epochs, a
        :class:`~vmapdp.accounting.BallsInBinsGaussianEvent` for balls-in-bins."""
        if self._step == 0:
            raise ValueError(f"{type(self).__name__}.event: no step drawn yet; call sample() (or iterate) first, then record the event of that step.")
        return self._event(noise_multiplier, int(self._opened_epoch))

    def _event(self, noise_multiplier: float, opened: int):
        from vmapdp.accounting import EpochGaussianEvent

        return EpochGaussianEvent(noise_multiplier=noise_multiplier, steps_per_epoch=self.steps_per_epoch, scheme=self._SCHEME, epochs=opened, continues=not opened)

    def _extra_state(self):
        return {"assignment": self._assignment, "opened_epoch": self._opened_epoch}

    def _load_extra(self, state):
        self._assignment = state.get("assignment")
        self._opened_epoch = bool(state.get("opened_epoch", False))


class ShuffledSampler(_EpochSampler):
    """Shuffled epochs: each epoch a fresh uniformly random permutation cut into
    ``steps_per_epoch = ceil(num_samples / batch_size)`` disjoint batches that cover the data
    (the last one short when batch_size does not divide num_samples; padded, mask False).

    Accounting: :meth:`event` gives an :class:`~vmapdp.accounting.EpochGaussianEvent` (each epoch
    charged as one Gaussian mechanism, replace-one; no amplification by shuffling is claimed, and
    a Poisson epsilon is never reported for it).

    Args:
      num_samples, batch_size: as in :class:`FixedSizeSampler`. epochs: epochs to yield
        (default 1). generator / key / secure: as in :class:`PoissonSampler`.
    """

    _LABEL = b"vmapdp-shuffle:"
    _SCHEME = "shuffle"
    _chunks = False

    def __init__(self, num_samples: int, batch_size: int, epochs: int = 1, generator: torch.Generator | None = None, *, key=None, secure: bool = False):
        call = "ShuffledSampler"
        self.num_samples = _checks.positive_int(call, "num_samples", num_samples, meaning="num_samples is the dataset size")
        self.batch_size = _checks.positive_int(call, "batch_size", batch_size, meaning="batch_size is the number of examples in a batch")
        if self.batch_size > self.num_samples:
            raise ValueError(f"{call}: batch_size={batch_size} must be in [1, num_samples={num_samples}]; one batch cannot be larger than the dataset.")
        self.epochs = _checks.positive_int(call, "epochs", epochs, minimum=0, meaning="epochs is how many passes over the data to yield")
        self.steps_per_epoch = math.ceil(self.num_samples / self.batch_size)
        self.steps = self.epochs * self.steps_per_epoch
        self.capacity = self.batch_size
        self._assignment: Tensor | None = None
        self._opened_epoch = False
        self._init_source(call, generator, key, secure)

    expected_batch_size = property(lambda self: float(self.batch_size), doc="the (full) batch size")
    sample_rate = property(lambda self: self.batch_size / self.num_samples, doc="batch_size / num_samples: the share of the data in a full batch")

    def _params(self):
        return {"num_samples": self.num_samples, "batch_size": self.batch_size}

    def _draw_epoch(self) -> Tensor:
        return self._permutation(self.num_samples)

    def _batch(self, perm: Tensor, j: int) -> Tensor:
        return torch.sort(perm[j * self.batch_size : (j + 1) * self.batch_size]).values


class BallsInBinsSampler(_EpochSampler):
    """Balls-in-bins epochs: each epoch every example goes to one uniformly random step of the
    ``steps_per_epoch`` steps, independently (batch sizes Binomial(n, 1/steps_per_epoch)).

    Yields ``(indices, mask)`` padded to ``capacity`` like :class:`PoissonSampler` (a step with
    more than ``capacity`` examples spans extra chunks; nothing is dropped).

    Accounting: :meth:`event` gives a :class:`~vmapdp.accounting.BallsInBinsGaussianEvent`
    (add/remove; each epoch the random allocation of 1 of ``steps_per_epoch``, accounted by a
    certified privacy loss distribution; see there).

    Args:
      num_samples: dataset size. steps_per_epoch: steps (bins) per epoch. epochs: epochs to
        yield (default 1). capacity / overflow_probability: as in :class:`PoissonSampler` (at
        rate 1 / steps_per_epoch). generator / key / secure: as in :class:`PoissonSampler`.
    """

    _LABEL = b"vmapdp-balls-in-bins:"
    _SCHEME = "balls_in_bins"
    _chunks = True
    binomial_draws = True  # as PoissonSampler's: Binomial(num_samples, 1 / steps_per_epoch)

    def __init__(self, num_samples: int, steps_per_epoch: int, epochs: int = 1, generator: torch.Generator | None = None, *, key=None, capacity: int | None = None, overflow_probability: float = 1e-6, secure: bool = False):
        call = "BallsInBinsSampler"
        self.num_samples = _checks.positive_int(call, "num_samples", num_samples, meaning="num_samples is the dataset size")
        self.steps_per_epoch = _checks.positive_int(call, "steps_per_epoch", steps_per_epoch, meaning="steps_per_epoch is the number of bins (steps) per epoch")
        self.epochs = _checks.positive_int(call, "epochs", epochs, minimum=0, meaning="epochs is how many epochs to yield")
        _checks.probability(call, "overflow_probability", overflow_probability, allow_one=False, meaning="it sets the default capacity")
        if capacity is None:
            capacity = default_capacity(self.num_samples, 1.0 / self.steps_per_epoch, overflow_probability)
        self.capacity = _checks.positive_int(call, "capacity", capacity, meaning="capacity is the physical batch size")
        self.steps = self.epochs * self.steps_per_epoch
        self._assignment = None
        self._opened_epoch = False
        self._init_source(call, generator, key, secure)

    expected_batch_size = property(lambda self: self.num_samples / self.steps_per_epoch, doc="num_samples / steps_per_epoch")
    sample_rate = property(lambda self: 1.0 / self.steps_per_epoch, doc="1 / steps_per_epoch: the probability that an example is in a step's batch")

    def _params(self):
        return {"num_samples": self.num_samples, "steps_per_epoch": self.steps_per_epoch}

    def _draw_epoch(self) -> Tensor:
        # step of each example: floor(u * S / 2^53), bias below S / 2^53
        return (self._u53(self.num_samples) * self.steps_per_epoch) >> 53 if self.steps_per_epoch < (1 << 10) else torch.floor(
            self._u53(self.num_samples).to(torch.float64) * (self.steps_per_epoch / float(1 << 53))
        ).to(torch.int64)

    def _batch(self, bins: Tensor, j: int) -> Tensor:
        return (bins == j).nonzero().flatten()

    def _event(self, noise_multiplier: float, opened: int):
        from vmapdp.accounting import BallsInBinsGaussianEvent

        return BallsInBinsGaussianEvent(noise_multiplier=noise_multiplier, steps_per_epoch=self.steps_per_epoch, epochs=opened, continues=not opened)


class TruncatedPoissonSampler(PoissonSampler):
    """Poisson sampling capped at ``max_batch_size``: a step that samples more examples keeps a
    uniformly random subset of ``max_batch_size`` of them. Every step yields exactly
    ``max_batch_size`` rows (one shape, no extra chunks).

    Accounting: :meth:`event` gives a :class:`~vmapdp.accounting.TruncatedPoissonGaussianEvent`:
    the Poisson analysis plus the probability that any step truncates, added to delta; the
    accountants refuse when that probability is too large for the delta (raise max_batch_size).

    Args:
      num_samples, sample_rate, steps, generator, key, secure: as in :class:`PoissonSampler`.
      max_batch_size: the cap (default: the capacity that one step exceeds with probability
        <= 1e-12, so that truncation costs nothing visible).
    """

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None, generator: torch.Generator | None = None, *, key=None, max_batch_size: int | None = None, secure: bool = False):
        call = "TruncatedPoissonSampler"
        if max_batch_size is None:
            n = _checks.positive_int(call, "num_samples", num_samples, meaning="num_samples is the dataset size")
            max_batch_size = default_capacity(n + 1, _checks.sample_rate(call, sample_rate), 1e-12)
        max_batch_size = _checks.positive_int(call, "max_batch_size", max_batch_size, meaning="max_batch_size caps the batch")
        super().__init__(num_samples, sample_rate, steps, generator, key=key, capacity=max_batch_size, secure=secure)
        self.max_batch_size = max_batch_size

    def sample(self) -> tuple[Tensor, Tensor]:
        idx = self._draw()
        if idx.numel() > self.max_batch_size:  # keep a uniformly random subset
            if self.secure:
                keys = _os_u53(idx.numel())
            elif self.key is not None:
                keys = _shake_u53(b"vmapdp-truncate:" + self.key + b":" + str(self._draws - 1).encode(), idx.numel())
            else:
                keys = torch.randint(0, 1 << 53, (idx.numel(),), generator=self.generator, dtype=torch.int64)
            idx = torch.sort(idx[torch.sort(keys, stable=True).indices[: self.max_batch_size]]).values
        return _padded(self, idx, self.capacity, chunks=False)

    def _id_params(self) -> dict[str, Any]:
        return {**super()._id_params(), "max_batch_size": self.max_batch_size}

    def event(self, noise_multiplier: float):
        """The accounting event of one step at ``noise_multiplier``."""
        from vmapdp.accounting import TruncatedPoissonGaussianEvent

        return TruncatedPoissonGaussianEvent(noise_multiplier=noise_multiplier, sample_rate=self.sample_rate, max_batch_size=self.max_batch_size, num_samples=self.num_samples)


class CyclicPoissonSampler(_KeyedSampler):
    """Cyclic Poisson sampling: the data is split ONCE into ``cycle`` disjoint groups, each example
    assigned to a uniformly random group independently of the others (keyed); step ``t`` draws a
    Poisson sample at rate ``sample_rate`` from group ``t mod cycle`` only. Every example can be used only in the steps of its own group, i.e. at most once every
    ``cycle`` steps (the participation pattern of banded matrix-factorization mechanisms,
    Choquette-Choo et al. 2023). ``cycle=1`` is plain Poisson sampling.

    Yields ``(indices, mask)`` padded to ``capacity`` like :class:`PoissonSampler` (a step with
    more than ``capacity`` examples spans extra chunks; nothing is dropped or resampled).

    Accounting: :meth:`event` gives a :class:`~vmapdp.accounting.CyclicPoissonGaussianEvent`
    (add/remove): ``count`` consecutive steps touch any one example in at most ``ceil(count /
    cycle)`` Poisson-subsampled Gaussian steps, and in no other step (with independent noise,
    i.e. the identity strategy of matrix factorization). The assignment is independent per
    example, so adding or removing one example leaves the others' groups distributed exactly as
    before (the first ``n`` assignments of ``n + 1`` examples are those of ``n``): the coupling
    the add/remove analysis needs. (A balanced partition, by a permutation, would move other
    examples between groups when one is added; it is not used for that reason.) Group sizes are
    therefore random; each step's batch is ``Binomial(num_samples, sample_rate / cycle)``.

    Args:
      num_samples: dataset size ``n``. sample_rate: the Poisson rate ``q`` within a group, in
        (0, 1]. cycle: the number of groups ``b``, an int in [1, n]. steps: steps to yield
        (default ``round(cycle / sample_rate)``: each example expected once).
      capacity / overflow_probability: as in :class:`PoissonSampler` (for batches of
        ``Binomial(n, sample_rate / cycle)``). generator / key / secure: as in :class:`PoissonSampler`.

    Example:
      >>> s = CyclicPoissonSampler(1000, 0.05, cycle=4, steps=8, key=b"secret")
      >>> s.expected_batch_size   # 0.05 * 1000 / 4
      12.5
    """

    _LABEL = b"vmapdp-cyclic-poisson:"
    binomial_draws = True  # as PoissonSampler's: Binomial(num_samples, sample_rate / cycle)

    def __init__(self, num_samples: int, sample_rate: float, cycle: int, steps: int | None = None, generator: torch.Generator | None = None, *, key=None, capacity: int | None = None, overflow_probability: float = 1e-6, secure: bool = False):
        call = "CyclicPoissonSampler"
        self.num_samples = _checks.positive_int(call, "num_samples", num_samples, meaning="num_samples is the dataset size")
        self.sample_rate = float(_checks.sample_rate(call, sample_rate))
        self.cycle = _checks.positive_int(call, "cycle", cycle, meaning="cycle is the number of disjoint groups the steps go through in turn")
        if self.cycle > self.num_samples:
            raise ValueError(
                f"{call}: cycle={cycle} must be in [1, num_samples={num_samples}]; with more groups than examples some "
                "groups would be empty. Pass cycle <= num_samples."
            )
        if steps is None:
            steps = max(1, round(self.cycle / self.sample_rate))
        self.steps = _checks.positive_int(call, "steps", steps, minimum=0, meaning="steps is how many batches to yield")
        _checks.probability(call, "overflow_probability", overflow_probability, allow_one=False, meaning="it sets the default capacity")
        if capacity is None:
            capacity = default_capacity(self.num_samples, self.sample_rate / self.cycle, overflow_probability)
        self.capacity = _checks.positive_int(call, "capacity", capacity, meaning="capacity is the physical batch size")
        self._assignment: Tensor | None = None  # the group of every example, drawn on the first step
        self._init_source(call, generator, key, secure)

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * num_samples / cycle``: the divisor DP-SGD uses (public: the expected
        size of every step's batch)."""
        return self.sample_rate * self.num_samples / self.cycle

    def _params(self):
        return {"num_samples": self.num_samples, "sample_rate": self.sample_rate, "cycle": self.cycle}

    def groups(self) -> Tensor:
        """The group (int64 in ``[0, cycle)``) of every example, each uniform and independent;
        drawn once, on first use (53-bit uniforms: exact in float64, so ``floor(u * cycle)``)."""
        if self._assignment is None:
            if self._step:  # (groups drawn now, at another point of the stream, would differ from the ones charged)
                raise ValueError(
                    f"{type(self).__name__}.groups: the sampler has drawn {self._step} steps but holds no groups: its state "
                    "was loaded without them (edited, or not saved by state_dict), and groups drawn now would differ "
                    "from the ones its earlier steps used (an example in two groups). Load the state_dict the sampler "
                    "saved whole. Nothing was drawn."
                )
            u = self._u53(self.num_samples).to(torch.float64) / float(1 << 53)
            self._assignment = (u * self.cycle).floor().to(torch.int64)
        return self._assignment

    def sample(self) -> tuple[Tensor, Tensor]:
        members = (self.groups() == self._step % self.cycle).nonzero().flatten()
        idx = members[self._u53(members.numel()) < int(self.sample_rate * (1 << 53))]
        self._step += 1
        return _padded(self, idx, self.capacity, chunks=True)

    def event(self, noise_multiplier: float):
        """The accounting event of one step at ``noise_multiplier``."""
        from vmapdp.accounting import CyclicPoissonGaussianEvent

        return CyclicPoissonGaussianEvent(noise_multiplier=noise_multiplier, sample_rate=self.sample_rate, cycle=self.cycle)

    def _extra_state(self):
        return {"assignment": self._assignment}

    def _load_extra(self, state):
        self._assignment = state.get("assignment")


def gather(data: Any, indices: Tensor) -> Any:
    """Rows ``indices`` of every leaf of a pytree of tensors (leading dim = dataset size).

    ``indices`` must be a 1-D integer tensor in ``[0, rows)``: a negative index would wrap
    around and could name a row twice (found by review: ``[-1, n - 1]`` stepped one example as
    two rows, each adding up to the clip norm to a sum charged as one)."""
    call = "gather(data, indices)"
    if not isinstance(indices, Tensor) or indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"{call}: indices must be a 1-D integer tensor (a sampler's draw), got {type(indices).__name__}{' ' + str(tuple(indices.shape)) + ' ' + str(indices.dtype) if isinstance(indices, Tensor) else ''}.")
    leaves = [x for x in optree.tree_leaves(data, namespace="torch") if isinstance(x, Tensor)]
    if indices.numel() and leaves:
        lo, hi, rows = int(indices.min()), int(indices.max()), min(x.shape[0] if x.dim() else 0 for x in leaves)
        if lo < 0 or hi >= rows:
            raise IndexError(f"{call}: indices must be in [0, {rows}) (the data's rows), got {lo if lo < 0 else hi}. Pass a sampler's indices for this dataset.")
    return optree.tree_map(lambda x: x[indices], data, namespace="torch")


def gather_dataset(dataset: Any, indices: Tensor, collate_fn: Any = None) -> Any:
    """Rows ``indices`` of a map-style ``torch.utils.data.Dataset``, collated into a batch.

    Padding rows (index 0 under a False mask) are fetched too, so shapes stay fixed.
    """
    if collate_fn is None:
        from torch.utils.data import default_collate as collate_fn
    return collate_fn([dataset[int(i)] for i in indices])
