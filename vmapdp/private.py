"""An Opacus-style entry point for module users, built on the pure core.

``make_private(model, optimizer, data, ...)`` takes what an Opacus user has (an ``nn.Module``, a
``torch.optim`` optimizer, a ``Dataset`` or ``DataLoader``) and returns a :class:`PrivateTrainer`
that trains it with DP-SGD: Poisson sampling at ``batch_size / len(dataset)``, per-sample
clipping, Gaussian noise, the privacy ledger. Underneath it is exactly
``functionalize`` + ``make_train_step`` + ``PoissonSampler``; the trainer only keeps the state
and writes the new weights back into the module after every step (the one stateful part, and
the reason this lives outside the core).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vmapdp import accounting, optim
from vmapdp.checkpoint import load_state, save_state
from vmapdp.data import PoissonSampler, gather, gather_dataset
from vmapdp.functional import functionalize
from vmapdp.train import TrainState, init_train_state, make_train_step
from vmapdp.validate import validate

__all__ = ["make_private", "PrivateTrainer"]


def _functional_optimizer(optimizer: torch.optim.Optimizer) -> optim.Optimizer:
    """The init/update pair with the same hyperparameters as a torch optimizer."""
    if len(optimizer.param_groups) != 1:
        raise ValueError(
            f"make_private: the optimizer has {len(optimizer.param_groups)} param groups; only one is supported. "
            "Build the optimizer over model.parameters() with one set of hyperparameters."
        )
    d = optimizer.param_groups[0]
    lr = float(d["lr"])
    if type(optimizer) is torch.optim.SGD:
        return optim.sgd(lr, momentum=d["momentum"], dampening=d["dampening"], nesterov=d["nesterov"], weight_decay=d["weight_decay"], maximize=d["maximize"])
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        decoupled = type(optimizer) is torch.optim.AdamW or d.get("decoupled_weight_decay", False)
        make = optim.adamw if decoupled else optim.adam
        return make(lr, betas=tuple(d["betas"]), eps=d["eps"], weight_decay=d["weight_decay"], amsgrad=d["amsgrad"], maximize=d["maximize"])
    # any other optimizer: every hyperparameter of its group, through the general adapter
    implementation = ("params", "foreach", "fused", "capturable", "differentiable")
    return optim.from_torch(type(optimizer), **{k: v for k, v in d.items() if k not in implementation})


def _tensors_of(dataset: Any) -> tuple[Tensor, ...] | None:
    if isinstance(dataset, torch.utils.data.TensorDataset):
        return tuple(dataset.tensors)
    return None


class PrivateTrainer:
    """DP-SGD training of a module; made by :func:`make_private`.

    Attributes:
        model: the module; its parameters hold the latest weights after every step.
        state: the :class:`vmapdp.TrainState` (params, optimizer state, ledger, step).
        sampler: the :class:`vmapdp.data.PoissonSampler` (one epoch per iteration).
        noise_multiplier, l2_clip_norm, sample_rate, expected_batch_size, delta.
    """

    def __init__(self, model, step, state, sampler, data, noise_multiplier, l2_clip_norm, delta, buffers):
        self.model = model
        self._step = step
        self.state: TrainState = state
        self.sampler = sampler
        self._data = data
        self._buffers = buffers
        self.noise_multiplier = noise_multiplier
        self.l2_clip_norm = l2_clip_norm
        self.delta = delta

    @property
    def sample_rate(self) -> float:
        return self.sampler.sample_rate

    @property
    def expected_batch_size(self) -> float:
        return self.sampler.expected_batch_size

    def _batch(self, indices: Tensor) -> Any:
        tensors = _tensors_of(self._data)
        if tensors is not None:
            return gather(tensors, indices)
        return tuple(gather_dataset(self._data, indices))

    def _write_back(self) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in self.state.params:
                    p.copy_(self.state.params[name])

    def train_epoch(self) -> Iterator[dict[str, Tensor]]:
        """Run one epoch of Poisson-sampled DP-SGD steps; yields each step's (non-private) metrics."""
        for indices, mask in self.sampler:
            self.state, metrics = self._step(self.state, self._batch(indices), mask, self._buffers)
            self._write_back()
            yield metrics

    def fit(self, epochs: int = 1) -> list[float]:
        """Train ``epochs`` epochs; returns the mean (non-private) training loss of each epoch."""
        losses = []
        for _ in range(epochs):
            ms = [float(m["loss"]) for m in self.train_epoch()]
            losses.append(sum(ms) / max(1, len(ms)))
        return losses

    def epsilon(self, delta: float | None = None, *, accountant: str = "rdp") -> float:
        """Epsilon spent so far (at ``delta``, default the one given to make_private)."""
        return self.state.epsilon(self.delta if delta is None else delta, accountant=accountant)

    def save(self, path: str, *, key: bytes | str | None = None) -> None:
        """Save the state and the sampler's state (see :func:`vmapdp.save_state`; ``key=`` for an HMAC)."""
        save_state(path, self.state, sampler=self.sampler, key=key)

    def load(self, path: str, *, key: bytes | str | None = None) -> None:
        """Load a checkpoint of this run, all or nothing: the file's digest, its fit to this model
        and optimizer (every param's key, shape and dtype, the optimizer state) and the sampler's
        state are all checked before the state, the sampler or the module is written. The budgets
        recorded in the checkpoint stay enforced on top of this trainer's own."""
        device = next(iter(self.state.params.values())).device
        state = load_state(path, sampler=self.sampler, like=self.state, key=key, map_location=device)
        self.state = state
        self._write_back()


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    *,
    l2_clip_norm: float,
    delta: float,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    criterion: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    seed: int | None = None,
    compile: bool = True,
    secure: bool = False,
    method: str = "auto",
) -> PrivateTrainer:
    """Make a module + torch optimizer + data train with DP-SGD (the Opacus-style entry point).

    Args:
        model: the module (checked with :func:`vmapdp.validate`; fix problems with
            :func:`vmapdp.fix` first). Its weights are updated in place after every step.
        optimizer: a ``torch.optim`` optimizer over ``model.parameters()``; only its class and
            hyperparameters are used (SGD, Adam, AdamW run on the same kernels; others through
            :func:`vmapdp.optim.from_torch`).
        data: a map-style ``Dataset`` of ``(x, y)`` pairs or a ``DataLoader`` over one (its
            ``batch_size`` becomes the expected batch size, as in Opacus).
        l2_clip_norm: per-sample clipping bound.
        delta: the delta of the (epsilon, delta) guarantee; below 1 / len(dataset).
        noise_multiplier: noise std / l2_clip_norm; or give ``target_epsilon`` and ``epochs`` to
            calibrate it (RDP, never above the target).
        batch_size: expected batch size (required for a Dataset).
        criterion: ``criterion(logits [1, K], target [1])``, applied per sample.
        seed: the secret noise seed (None: OS entropy); sampling gets its own generator.
        compile: compile the per-chunk tensor work.
        secure: noise and sampling from the OS CSPRNG (no seed).
        method: how the clipped sum is computed (see :func:`vmapdp.make_train_step`); name one
            for bit-for-bit reproducible runs.

    Raises:
        vmapdp.UnsupportedModuleError: the module mixes samples or updates buffers (with the fix).
        ValueError: a bad or missing argument (named).
    """
    call = "make_private(model, optimizer, data)"
    if isinstance(data, torch.utils.data.DataLoader):
        batch_size = batch_size or data.batch_size
        data = data.dataset
    if batch_size is None:
        raise ValueError(f"{call}: batch_size is required when data is a Dataset (the expected batch size of Poisson sampling).")
    n = len(data)
    if not 0 < batch_size <= n:
        raise ValueError(f"{call}: batch_size={batch_size} must be in [1, {n}] (the dataset size).")
    if not 0 < delta < 1:
        raise ValueError(f"{call}: delta={delta!r} must be in (0, 1), and below 1/len(dataset) = {1 / n:.3g}.")
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError(f"{call}: give exactly one of noise_multiplier= or target_epsilon= (with epochs=).")
    sample_rate = batch_size / n
    if target_epsilon is not None:
        if not epochs:
            raise ValueError(f"{call}: target_epsilon needs epochs= to know how many steps to calibrate for.")
        noise_multiplier = accounting.calibrate_noise(
            target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate, steps=epochs * max(1, round(1 / sample_rate))
        )
    validate(model, raise_on_problem=True)
    apply, params, buffers = functionalize(model)

    def loss_fn(params, buffers, sample):
        x, y = sample
        return criterion(apply(params, buffers, x[None]), y[None])

    opt = _functional_optimizer(optimizer)
    sampler = PoissonSampler(n, sample_rate, key=None if secure else _sampler_key(seed), secure=secure)
    step = make_train_step(
        loss_fn,
        opt,
        l2_clip_norm=l2_clip_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=sampler.expected_batch_size,
        sample_rate=sample_rate,
        physical_batch_size=sampler.capacity,
        compile=compile,
        budget=(target_epsilon, delta) if target_epsilon is not None else None,
        secure=secure,
        method=method,
    )
    state = init_train_state(params, opt, seed=seed, secure=secure, budget=(target_epsilon, delta) if target_epsilon is not None else None)
    return PrivateTrainer(model, step, state, sampler, data, noise_multiplier, l2_clip_norm, delta, buffers)


def _sampler_key(seed: int | None) -> bytes:
    """The sampler's key: from OS entropy, or hashed from the noise seed under its own label
    (one-way: the sampler's key never reveals the noise seed)."""
    if seed is None:
        return secrets.token_bytes(32)
    return hashlib.sha256(f"vmapdp-sampler:{seed}".encode()).digest()
