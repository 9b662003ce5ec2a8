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
from vmapdp.noise import key_bytes

__all__ = ["PoissonSampler", "default_capacity", "gather", "gather_dataset"]



def _kl_bernoulli(a: float, q: float) -> float:
    """KL(Bernoulli(a) || Bernoulli(q)) in nats, for 0 <= a <= 1, 0 < q < 1."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / q)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - q))
    return out


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
        if k > mean and -n * _kl_bernoulli(k / n, q) <= math.log(overflow_probability):
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
        if secure and generator is not None:
            raise ValueError(
                f"{call}: secure=True draws from the operating system's CSPRNG and cannot use a seeded "
                "generator; pass generator=None (a seeded generator makes the batches predictable)."
            )
        if sum(x is not None and x is not False for x in (generator, key, secure or None)) > 1:
            raise ValueError(f"{call}: give at most one source of randomness: generator=, key= or secure=True.")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"{call}: generator must be a torch.Generator or None, got {type(generator).__name__}.")
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
            raw = torch.frombuffer(bytearray(secrets.token_bytes(8 * n)), dtype=torch.int64)
            u = raw & ((1 << 53) - 1)
            return (u < int(q * (1 << 53))).nonzero().flatten()
        if self.key is not None:
            label = b"vmapdp-poisson:" + self.key + b":" + str(self._draws).encode()
            self._draws += 1
            raw = torch.frombuffer(bytearray(hashlib.shake_256(label).digest(8 * n)), dtype=torch.int64)
            u = raw & ((1 << 53) - 1)
            return (u < int(q * (1 << 53))).nonzero().flatten()
        return (torch.rand(n, generator=self.generator, dtype=torch.float64) < q).nonzero().flatten()

    def sample(self) -> tuple[Tensor, Tensor]:
        """One step: ``(indices, mask)`` padded to a multiple of ``capacity``."""
        idx = self._draw()
        k = idx.numel()
        m = max(1, math.ceil(k / self.capacity))
        indices = torch.zeros(m * self.capacity, dtype=torch.int64)
        mask = torch.zeros(m * self.capacity, dtype=torch.bool)
        indices[:k] = idx
        mask[:k] = True
        return indices, mask

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for _ in range(self.steps):
            yield self.sample()

    def state_dict(self) -> dict[str, Any]:
        """The sampler's RNG state, for checkpoints (``secure`` samplers have none to save)."""
        return {
            "generator": None if self.generator is None else self.generator.get_state(),
            "key": self.key,
            "draws": self._draws,
            "num_samples": self.num_samples,
            "sample_rate": self.sample_rate,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`). A state saved by a sampler of another
        dataset size or rate is refused: its stream would sample other batches than the ones the
        ledger and the resumed run assume."""
        call = "PoissonSampler.load_state_dict(state)"
        if not isinstance(state, dict):
            raise TypeError(f"{call}: state must be a dict from PoissonSampler.state_dict(), got {type(state).__name__}.")
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
            self.key, self._draws = state["key"], int(state["draws"])
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
            raise ValueError("PoissonSampler.load_state_dict: the state comes from a generator-driven sampler; resume it with generator=torch.Generator().")
        self.generator.set_state(saved)

    def __repr__(self) -> str:
        return (
            f"PoissonSampler(num_samples={self.num_samples}, sample_rate={self.sample_rate}, steps={self.steps}, "
            f"capacity={self.capacity}, secure={self.secure})"
        )


def gather(data: Any, indices: Tensor) -> Any:
    """Rows ``indices`` of every leaf of a pytree of tensors (leading dim = dataset size)."""
    return optree.tree_map(lambda x: x[indices], data, namespace="torch")


def gather_dataset(dataset: Any, indices: Tensor, collate_fn: Any = None) -> Any:
    """Rows ``indices`` of a map-style ``torch.utils.data.Dataset``, collated into a batch.

    Padding rows (index 0 under a False mask) are fetched too, so shapes stay fixed.
    """
    if collate_fn is None:
        from torch.utils.data import default_collate as collate_fn
    return collate_fn([dataset[int(i)] for i in indices])
