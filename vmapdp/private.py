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
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import optree
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vmapdp import _checks, accounting, optim
from vmapdp._tree import batch_size, sample_shapes, shapes_differ
from vmapdp.ghost import METHODS
from vmapdp.checkpoint import load_state, save_state
from vmapdp.data import PoissonSampler, gather, gather_dataset
from vmapdp.errors import PublicSeedWarning
from vmapdp.functional import functionalize
from vmapdp.train import TrainState, init_train_state, make_train_step, seeded_randomness, step_seed
from vmapdp.validation import VMAP_SLOW, VMAP_UNSUPPORTED, validate

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


def _check_optimizer_params(call: str, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """The torch optimizer must hold exactly the model's trainable params (found by review: one over
    the head only, or over another module, was taken for its hyperparameters alone and every
    trainable param of the model was trained), and no LR scheduler may be attached (its steps would
    change the torch optimizer's lr, which the functional copy made here never reads again)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    missing = [name for i, name in trainable.items() if i not in held]
    foreign = len(held - {id(p) for p in model.parameters()})  # (frozen params held: no grads, as in torch)
    if missing or foreign:
        raise ValueError(
            f"{call}: the optimizer must hold exactly the model's trainable parameters, since make_private trains every "
            "parameter with requires_grad=True: "
            + (f"{len(missing)} trainable parameter(s) are not in it ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})"
               if missing else "")
            + ("; " if missing and foreign else "")
            + (f"it holds {foreign} tensor(s) that are not parameters of the model" if foreign else "")
            + ". To train part of the model, freeze the rest (p.requires_grad_(False)) and build the optimizer over "
            "[p for p in model.parameters() if p.requires_grad]. Nothing was changed."
        )
    if any("initial_lr" in group for group in optimizer.param_groups):
        raise ValueError(
            f"{call}: an LR scheduler is attached to the optimizer (its param group has 'initial_lr'), but make_private "
            "copies the optimizer's hyperparameters once and a torch scheduler's steps would not reach the training: "
            "make the optimizer without a scheduler, and change the rate between steps through a tensor learning rate "
            "(vmapdp.optim.sgd(lr=torch.tensor(0.1)), then lr.fill_(new) with make_train_step). Nothing was changed."
        )


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
        self._swaps_left = _SWAP_CHECKED_BATCHES  # first batches whose collation is checked (_check_rows_kept_apart)

    @property
    def sample_rate(self) -> float:
        return self.sampler.sample_rate

    @property
    def expected_batch_size(self) -> float:
        return self.sampler.expected_batch_size

    def _batch(self, indices: Tensor) -> Any:
        collate = getattr(self, "_collate_fn", None)
        tensors = _tensors_of(self._data)
        if tensors is not None and collate is None:  # (a collate_fn given with a TensorDataset: applied, not dropped; found in review)
            return gather(tensors, indices)
        batch = _one_row_each(gather_dataset(self._data, indices, collate), len(indices))
        if not getattr(self, "_shapes_checked", False):
            # the first batch: each row collated alone must give the batch's shapes (later batches:
            # the step's own check, make_train_step(fixed_shapes=True), against this first one)
            shapes = sample_shapes(batch)
            alone = {sample_shapes(gather_dataset(self._data, indices[i : i + 1], collate)) for i in range(len(indices))}
            if alone != {shapes}:
                other = sorted(alone - {shapes}, key=repr)[0]
                raise shapes_differ(f"make_private: collate_fn gives batches whose per-sample shapes depend on the rows in them ({dict(shapes)} against {dict(other)})")
            self._shapes_checked = True
        if self._swaps_left > 0:
            self._swaps_left -= 1
            _check_rows_kept_apart(self._data, indices, collate, next(iter(self.state.params.values())).device)
        return dict(batch) if isinstance(batch, Mapping) else tuple(batch)

    def _write_back(self) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in self.state.params:
                    p.copy_(self.state.params[name])

    def train_epoch(self) -> Iterator[dict[str, Tensor]]:
        """Run one epoch of Poisson-sampled DP-SGD steps; yields each step's (non-private) metrics."""
        device = next(iter(self.state.params.values())).device  # (a model on a GPU, its data on the host: each batch is moved)
        for _ in range(len(self.sampler)):
            # a step that raises (a budget, a refused batch) released nothing: the sampler goes back to where it was, so
            # that its next batch is the one a run resumed from a checkpoint would draw for that step (a spare draw left
            # behind is refused by the next step: it would make a resumed run repeat a step with another batch)
            before = self.sampler.state_dict()
            try:
                indices, mask = self.sampler.sample()
                # a dataset's random augmentation draws from the state's seed: a step resumed from a checkpoint reads the
                # same batch bit for bit (its noise is the same: a different batch would cancel it; found by review)
                with seeded_randomness(step_seed(self.state, "data"), device, python=True):
                    rows = self._batch(indices)
                batch = optree.tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, Tensor) else x, rows, namespace="torch")
                self.state, metrics = self._step(self.state, batch, mask.to(device), self._buffers)
            except BaseException:
                self.sampler.load_state_dict(before)
                raise
            self._write_back()
            yield metrics

    def fit(self, epochs: int = 1) -> list[float]:
        """Train ``epochs`` epochs; returns the mean (non-private) training loss of each epoch."""
        # (found by review: epochs=-1 returned [] without a word, epochs=True trained one, 2.5 raised a bare TypeError)
        epochs = _checks.positive_int("PrivateTrainer.fit(epochs)", "epochs", epochs, meaning="epochs is how many passes over the data to train")
        losses = []
        for _ in range(epochs):
            ms = [float(m["loss"]) for m in self.train_epoch()]
            losses.append(sum(ms) / max(1, len(ms)))
        return losses

    def epsilon(self, delta: float | None = None, *, accountant: str = "pld") -> float:
        """Epsilon spent so far (at ``delta``, default the one given to make_private), by the PLD
        accountant (the one ``target_epsilon=`` is calibrated with) unless ``accountant=`` says."""
        if delta is not None:  # (found by review: delta=0.3 on 100 rows reported epsilon 0.0; make_private refuses it)
            delta = _checks.delta("PrivateTrainer.epsilon(delta)", delta, num_samples=self.sampler.num_samples)
        return self.state.epsilon(self.delta if delta is None else delta, accountant=accountant)

    def save(self, path: str, *, key: bytes | str | None = None) -> None:
        """Save the state and the sampler's state (see :func:`vmapdp.save_state`; ``key=`` for an HMAC)."""
        save_state(path, self.state, sampler=self.sampler, key=key)

    def load(self, path: str, *, key: bytes | str | None = None, saved_after_last_step: bool = False) -> None:
        """Load a checkpoint of this run, all or nothing: the file's digest, its fit to this model
        and optimizer (every param's key, shape and dtype, the optimizer state) and the sampler's
        state are all checked before the state, the sampler or the module is written. The budgets
        recorded in the checkpoint stay enforced on top of this trainer's own. A ``secure``
        trainer's checkpoint needs ``saved_after_last_step=True`` (see :func:`vmapdp.load_state`)."""
        device = next(iter(self.state.params.values())).device
        state = load_state(path, sampler=self.sampler, like=self.state, key=key, map_location=device, saved_after_last_step=saved_after_last_step)
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
    criterion: Callable[[Tensor, Tensor], Tensor] | None = None,
    seed: int | None = None,
    compile: bool = True,
    secure: bool = False,
    method: str = "auto",
    collate_fn: Callable[[list], Any] | None = None,
    randomness: str = "error",
    strategy: Any = None,
    cycle: int | None = None,
) -> PrivateTrainer:
    """Make a module + torch optimizer + data train with DP-SGD (the Opacus-style entry point).

    Args:
        model: the module (checked with :func:`vmapdp.validate`; fix problems with
            :func:`vmapdp.fix` first). Its weights are updated in place after every step.
        optimizer: a ``torch.optim`` optimizer over ``model.parameters()``; only its class and
            hyperparameters are used (SGD, Adam, AdamW run on the same kernels; others through
            :func:`vmapdp.optim.from_torch`). It must hold every trainable param of the model (to
            train part of it, freeze the rest) and no other tensor, with no LR scheduler attached.
        data: a map-style ``Dataset`` of ``(x, y)`` pairs, or of dicts (``{"input_ids": ...,
            "labels": ...}``: the label under ``"labels"`` or ``"label"``, every other key passed to
            the model as a keyword argument; a model output with ``.logits`` is fine), or a
            ``DataLoader`` over one (its ``batch_size`` becomes the expected batch size, as in
            Opacus). Poisson sampling replaces the loader's batching, so a loader with a custom
            ``sampler``, ``batch_sampler``, ``collate_fn`` or ``drop_last=True`` is refused.
        l2_clip_norm: per-sample clipping bound.
        delta: the delta of the (epsilon, delta) guarantee, in ``(0, 1 / len(dataset))`` (a larger
            one is refused: publishing one random record is already ``(0, 1/n)``-DP); use much less.
        noise_multiplier: noise std / l2_clip_norm; or give ``target_epsilon`` and ``epochs`` to
            calibrate it (PLD, never above the target; the budget is then enforced by PLD too).
        batch_size: expected batch size (required for a Dataset).
        criterion: ``criterion(logits [1, K], target [1])``, applied per sample (default
            ``F.cross_entropy``). For a transformers (or peft) model with dict rows the default is
            the model's task loss per sample (:func:`vmapdp.hf.loss_fn`: next-token cross-entropy
            over the non-padding positions for a causal LM, cross-entropy of the logits for a
            classifier), and a 2-D padding ``attention_mask`` is passed as a vmap-safe 4-D mask.
        seed: the secret noise seed (None: OS entropy); sampling gets its own generator.
        compile: compile the per-chunk tensor work.
        secure: noise and sampling from the OS CSPRNG (no seed).
        collate_fn: collates the sampled rows into a batch (default ``default_collate``; applied
            to a ``TensorDataset`` too). It must treat each row on its own (pad, tokenise; never mix
            rows, as mixup does) and keep one row per sample; padding rows are passed too. The
            first three batches are checked: collated again with the last row read from another
            example, the other rows must not change, and (where nothing is random) the rows keep
            their order (ValueError otherwise). The dataset must read each row from its own
            example only (not checked).
        randomness: for random layers in training mode (dropout, on by default in a transformers
            model built from a config): ``"different"`` gives every sample its own draw, as DP-SGD
            assumes; the default ``"error"`` refuses them (see :func:`vmapdp.per_sample_grads`).
        method: how the clipped sum is computed (see :func:`vmapdp.make_train_step`); what
            ``"auto"`` chose is kept in the state, so a resumed run replays it bit for bit.
        strategy: a :mod:`vmapdp.mf` strategy (``BandedToeplitz``, ``BufferedToeplitz``): train
            with noise correlated across steps (:func:`vmapdp.mf.correlated_noise`) over a run of
            ``epochs`` epochs (required) of ``round(len(data) / batch_size)`` steps each. Batches
            then come from a :class:`vmapdp.data.CyclicPoissonSampler` of ``cycle`` groups
            (default: the band of a banded strategy; required for a BLT) at rate
            ``batch_size * cycle / len(data)`` within a group, so the expected batch is still
            ``batch_size``; the ledger records the mechanism's events and ``target_epsilon``
            calibrates with :func:`vmapdp.mf.calibrate_mf_noise`. A step past the run is refused.
        cycle: the sampler's number of groups with ``strategy`` (see above).

    Raises:
        vmapdp.UnsupportedModuleError: the module mixes samples or updates buffers (with the fix).
        ValueError: a bad or missing argument (named).
    """
    call = "make_private(model, optimizer, data)"
    secure = _checks.flag(call, "secure", secure)
    if criterion is not None and not callable(criterion):  # (found by review: criterion="ce" was taken, and failed at fit)
        raise TypeError(f"{call}: criterion must be a function criterion(logits [1, K], target [1]) such as torch.nn.functional.cross_entropy, got {type(criterion).__name__}.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: model must be a torch.nn.Module, got {type(model).__name__}.")
    from vmapdp.sharding import is_fsdp_module

    if is_fsdp_module(model):  # (its steps would run the whole model on every rank, each on all the data)
        raise ValueError(
            f"{call}: model is under FSDP2's fully_shard (DTensor parameters); make_private trains one process's model. "
            "Train it sharded: apply, params, buffers = vmapdp.functionalize(model); sharding = vmapdp.sharding.Sharding(params); "
            "init_train_state(params, opt, sharding=sharding), make_train_step(..., sharding=sharding) and "
            "sharding.write_to_module(model, state.params) (see vmapdp.sharding); or call make_private before fully_shard."
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # (found by review: every rank ran its own private training on the data, each charging only its own releases;
        # a warning, not a refusal: one rank training alone, after a public data-parallel phase, is a use of its own)
        warnings.warn(
            f"{call}: a process group of {torch.distributed.get_world_size()} ranks is initialized, and make_private trains in "
            "one process: if every rank calls it, each runs a training of its own on the data, and their releases compose "
            "while each ledger counts only its own. To train data-parallel, use make_train_step(..., distributed=True) with "
            "batches from vmapdp.distributed.sharded(sampler); to train on one rank, call it there only (or after "
            "torch.distributed.destroy_process_group()).",
            UserWarning,
            stacklevel=2,
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{call}: optimizer must be a torch.optim.Optimizer over model.parameters(), got {type(optimizer).__name__}.")
    if isinstance(data, torch.utils.data.DataLoader):
        _check_loader(call, data)
        if batch_size is not None and data.batch_size is not None and batch_size != data.batch_size:
            # (found by review: the loader's was dropped without a word)
            raise ValueError(
                f"{call}: batch_size={batch_size} given, and the DataLoader's batch_size is {data.batch_size}: which one is the "
                "expected batch size of Poisson sampling? Pass one of them (leave batch_size out to use the loader's)."
            )
        batch_size = batch_size if batch_size is not None else data.batch_size
        data = data.dataset
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"{call}: collate_fn must be callable or None, got {type(collate_fn).__name__}.")
    if isinstance(data, torch.utils.data.IterableDataset) or not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise TypeError(
            f"{call}: data must be a map-style Dataset (len() and data[i]) or a DataLoader over one, got "
            f"{type(data).__name__}; Poisson sampling picks rows by index. Wrap the examples in a map-style Dataset."
        )
    if (
        isinstance(data, tuple) and len(data) >= 2 and all(isinstance(t, Tensor) and t.dim() >= 1 for t in data)
        and len({t.shape[0] for t in data}) == 1 and data[0].shape[0] != len(data)
    ):
        # (found by review: (x, y) was read as a dataset of two rows, and refused for its batch size)
        raise TypeError(
            f"{call}: data is a tuple of {len(data)} tensors of {data[0].shape[0]} rows each: columns, not rows (a Dataset "
            "is indexed by example). Pass torch.utils.data.TensorDataset(*data)."
        )
    if batch_size is None:
        raise ValueError(f"{call}: batch_size is required when data is a Dataset (the expected batch size of Poisson sampling).")
    n = _checks.positive_int(call, "len(data)", len(data), meaning="the dataset must hold at least one example")
    batch_size = _checks.positive_int(call, "batch_size", batch_size, meaning="batch_size is the expected batch size of Poisson sampling")
    if batch_size > n:
        raise ValueError(f"{call}: batch_size={batch_size} must be in [1, {n}] (the dataset size); it is the expected batch size of Poisson sampling.")
    delta = _checks.delta(call, delta, num_samples=n)
    l2_clip_norm = _checks.positive(call, "l2_clip_norm", l2_clip_norm, meaning=_checks.CLIP_MEANING)
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError(f"{call}: give exactly one of noise_multiplier= or target_epsilon= (with epochs=).")
    if noise_multiplier is not None:
        noise_multiplier = _checks.noise_multiplier(call, noise_multiplier)
    _checks.choice(call, "method", method, METHODS, why="see vmapdp.clipped_grad_sum")
    label_key = _row_form(call, data)
    sample_rate = batch_size / n
    privatizer = None
    if strategy is not None:
        privatizer, sampler, steps = _correlated(call, strategy, cycle, epochs, n, batch_size, secure, seed)
        if target_epsilon is not None:
            from vmapdp.mf import calibrate_mf_noise

            noise_multiplier = calibrate_mf_noise(strategy, sampler=sampler, steps=steps, target_epsilon=target_epsilon, delta=delta)
    elif cycle is not None:
        raise ValueError(f"{call}: cycle= applies to correlated noise only; pass strategy= too, or drop cycle=.")
    if target_epsilon is not None and strategy is None:
        if epochs is None:
            raise ValueError(f"{call}: target_epsilon needs epochs= to know how many steps to calibrate for.")
        epochs = _checks.positive_int(call, "epochs", epochs, meaning="epochs is how many epochs to calibrate the noise for")
        noise_multiplier = accounting.calibrate_noise(
            target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate, steps=epochs * max(1, round(1 / sample_rate))
        )
    # torch's recurrent layers are fine: functionalize runs them as their vmapdp.nn twins
    problems = [p for p in validate(model) if not (p.fixable and p.kind in (VMAP_UNSUPPORTED, VMAP_SLOW))]
    if problems:
        validate(model, raise_on_problem=True)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"{call}: model {type(model).__name__} has no trainable parameters (none, or all with requires_grad=False); "
            "there is nothing to train. Unfreeze the parameters to train (or add adapters: vmapdp.nn.add_lora)."
        )
    apply, params, buffers = functionalize(model)
    if label_key is not None and collate_fn is None:
        collate_fn = _collate_mappings  # BatchEncoding rows are Mappings, not dicts
    hf_loss = None
    if label_key is not None:
        from vmapdp import hf

        if hf.is_transformers_model(model):
            hf_loss = hf.sample_loss(model, apply, criterion=criterion)
    if criterion is None:
        criterion = F.cross_entropy

    def loss_fn(params, buffers, sample):
        if hf_loss is not None:
            return hf_loss(params, buffers, sample)
        if label_key is None:
            x, y = sample
            out = apply(params, buffers, x[None])
        else:  # a dict row: the label under label_key, every other key an input of the model
            y = sample[label_key]
            out = apply(params, buffers, **{k: v[None] for k, v in sample.items() if k != label_key})
        return criterion(_logits(out), y[None])

    _check_optimizer_params(call, optimizer, model)
    opt = _functional_optimizer(optimizer)
    if strategy is None:
        sampler = PoissonSampler(n, sample_rate, key=None if secure else _sampler_key(seed), secure=secure)
    step = make_train_step(
        loss_fn,
        opt,
        l2_clip_norm=l2_clip_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=sampler.expected_batch_size,
        sampler=sampler,  # each step records the sampler's event (Poisson here)
        physical_batch_size=sampler.capacity,
        compile=compile,
        budget=(target_epsilon, delta) if target_epsilon is not None else None,
        accountant="pld",  # the accountant calibrate_noise used: the budget is enforced against the same one
        secure=secure,
        method=method,
        randomness=randomness,
        privatizer=privatizer,
    )
    if seed is not None:  # (one warning, naming both: the seed keys the noise and, hashed, the sampler; found by review)
        _checks.guessable(call, "seed", seed, "the noise (and subtract it) and the batches")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PublicSeedWarning)
        state = init_train_state(params, opt, seed=seed, secure=secure, budget=(target_epsilon, delta) if target_epsilon is not None else None, privatizer=privatizer, num_samples=n)
    trainer = PrivateTrainer(model, step, state, sampler, data, noise_multiplier, l2_clip_norm, delta, buffers)
    trainer._collate_fn = collate_fn
    return trainer


def _correlated(call: str, strategy: Any, cycle: Any, epochs: Any, n: int, batch_size: int, secure: bool, seed: int | None) -> tuple[Any, Any, int]:
    """The correlated-noise privatizer, the cyclic Poisson sampler (one epoch per iteration) and the run's steps."""
    from vmapdp.data import CyclicPoissonSampler
    from vmapdp.mf import BandedToeplitz, correlated_noise

    if epochs is None:
        raise ValueError(f"{call}: strategy= needs epochs=: the correlated noise is built for the run's length.")
    epochs = _checks.positive_int(call, "epochs", epochs, meaning="epochs is the length of the run the correlated noise is built for")
    if cycle is None:
        if not isinstance(strategy, BandedToeplitz):
            raise ValueError(f"{call}: a BLT strategy needs cycle= (the sampler's groups: participations of an example are cycle steps apart).")
        cycle = strategy.band
    cycle = _checks.positive_int(call, "cycle", cycle, meaning="cycle is the number of groups of the cyclic Poisson sampler")
    rate = batch_size * cycle / n
    if rate > 1.0:
        raise ValueError(f"{call}: batch_size={batch_size} with cycle={cycle} needs a rate of {rate:.3g} > 1 within a group of about {n / cycle:.0f} examples; pass batch_size <= {n // cycle} or a smaller cycle.")
    per_epoch = max(1, round(n / batch_size))
    sampler = CyclicPoissonSampler(n, rate, cycle=cycle, steps=per_epoch, key=None if secure else _sampler_key(seed), secure=secure)
    return correlated_noise(strategy, steps=epochs * per_epoch), sampler, epochs * per_epoch


_DEFAULT_COLLATES = (torch.utils.data.default_collate, torch.utils.data._utils.collate.default_collate)


def _check_loader(call: str, loader: torch.utils.data.DataLoader) -> None:
    """Refuse a DataLoader whose settings change what a batch is: make_private replaces its batching
    by Poisson sampling (rows drawn independently at rate batch_size / len(dataset)), so those
    settings would be ignored, and the privacy analysis assumes exactly that sampling."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    replaced = "make_private replaces the loader's batching by Poisson sampling (each row in a step's batch independently, with probability batch_size / len(dataset)); the accounting assumes exactly that"
    fix = "Pass loader.dataset with batch_size= instead"
    if loader.batch_size is None and loader.batch_sampler is None:  # (found by review: called a custom batch_sampler (NoneType))
        raise ValueError(f"{call}: the DataLoader has batch_size=None (it yields single rows, no batches): {replaced}. {fix}.")
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise ValueError(f"{call}: the DataLoader has a custom batch_sampler ({type(loader.batch_sampler).__name__}), which would be ignored: {replaced}. {fix}.")
    sampler = loader.sampler
    plain_random = type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(loader.dataset)
    if type(sampler) is not SequentialSampler and not plain_random:
        raise ValueError(
            f"{call}: the DataLoader has a custom sampler ({type(sampler).__name__}), which would be ignored: {replaced}; "
            f"a weighted or subset sampler changes who is sampled, and that is not what is accounted. {fix} (a subset: torch.utils.data.Subset)."
        )
    if loader.drop_last:
        raise ValueError(f"{call}: the DataLoader has drop_last=True, which would be ignored (Poisson sampling has no last batch to drop): {replaced}. {fix}, or drop_last=False.")
    if loader.collate_fn not in _DEFAULT_COLLATES:
        name = getattr(loader.collate_fn, "__name__", type(loader.collate_fn).__name__)
        raise ValueError(
            f"{call}: the DataLoader has a custom collate_fn ({name}); make_private draws the rows itself, so it is "
            "not applied silently. If it collates each row on its own (padding, tokenising; never mixing rows "
            f"as mixup does), pass it explicitly: make_private(loader.dataset, ..., batch_size={loader.batch_size}, collate_fn=...)."
        )


def _row_form(call: str, data: Any) -> str | None:
    """How a row reads: None for ``(x, y)`` pairs, or the label key of dict rows."""
    if _tensors_of(data) is not None:
        if len(data.tensors) != 2:
            raise ValueError(f"{call}: a TensorDataset must hold (inputs, labels), got {len(data.tensors)} tensors.")
        return None
    row = data[0]
    if isinstance(row, Mapping):  # a dict, or a transformers BatchEncoding
        keys = [k for k in ("labels", "label") if k in row]
        if not keys:
            raise ValueError(
                f"{call}: the dataset's rows are dicts with keys {sorted(row)} but no 'labels' or 'label' key; "
                "make_private passes every other key to the model as a keyword argument and the label to the "
                "criterion. Rename the label key to 'labels'."
            )
        return keys[0]
    if isinstance(row, (tuple, list)) and len(row) == 2:
        return None
    raise ValueError(
        f"{call}: a row of the dataset must be an (input, label) pair or a dict with a 'labels' key, got "
        f"{type(row).__name__}{f' of length {len(row)}' if isinstance(row, (tuple, list)) else ''}. Return (x, y) from __getitem__."
    )


def _collate_mappings(rows: list) -> dict:
    """``default_collate`` of Mapping rows (dicts, ``BatchEncoding``) as plain dicts, all with the
    same keys: ``default_collate`` takes the first row's and would drop a key only later rows have
    (found by review: a row's ``token_type_ids`` dropped whenever a row without it came first)."""
    dicts = [dict(r) for r in rows]
    for d in dicts[1:]:
        if d.keys() != dicts[0].keys():
            raise ValueError(
                f"make_private: the dataset's rows have different keys ({sorted(dicts[0])} and {sorted(d)}): a batch of "
                "them would drop the keys its first row lacks. Give every row the same keys (pad a field some rows "
                "lack, e.g. token_type_ids of zeros). Nothing was released for this step."
            )
    # a tokenizer's rows without return_tensors hold Python lists, which default_collate transposes into a list
    # of per-position tensors (the loss then failed on a list; found by review): each row's list becomes a tensor
    dicts = [{k: torch.as_tensor(v) if isinstance(v, (list, tuple)) else v for k, v in d.items()} for d in dicts]
    for k, v in dicts[0].items():
        other = next((d[k] for d in dicts[1:] if isinstance(v, Tensor) and isinstance(d[k], Tensor) and d[k].shape != v.shape), None)
        if other is not None:
            raise ValueError(
                f"make_private: the dataset's rows hold {k!r} of different shapes ({tuple(v.shape)} and {tuple(other.shape)}): "
                "a batch stacks one tensor per key. Pad every row to one length when tokenizing (tokenizer(..., "
                "padding='max_length', max_length=L, truncation=True)); padding each batch to its longest row would "
                "make a sample's shape depend on the others. Nothing was released for this step."
            )
    return torch.utils.data.default_collate(dicts)


def _logits(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, dict) and isinstance(out.get("logits"), Tensor):
        return out["logits"]
    raise TypeError(f"make_private: the model returned {type(out).__name__}; the criterion needs a tensor of logits (or an output with .logits).")


def _sampler_key(seed: int | None) -> bytes:
    """The sampler's key: from OS entropy, or hashed from the noise seed under its own label
    (one-way: the sampler's key never reveals the noise seed)."""
    if seed is None:
        return secrets.token_bytes(32)
    return hashlib.sha256(f"vmapdp-sampler:{seed}".encode()).digest()


def _one_row_each(batch: Any, sampled: int) -> Any:
    """``batch`` (a collated one) if it holds one row per sampled row, else ValueError."""
    rows = batch_size(batch, call="make_private: collate_fn(rows)")
    if rows != sampled:
        raise ValueError(f"make_private: collate_fn returned {rows} rows for {sampled} sampled rows; it must keep one row per sample.")
    return batch


# make_private's first batches whose collation is checked for rows that see each other (_check_rows_kept_apart)
_SWAP_CHECKED_BATCHES = 3


def _check_rows_kept_apart(data: Any, indices: Tensor, collate: Callable | None, device: torch.device | None = None) -> None:
    """ValueError where a row's values depend on the other rows of its batch (a ``collate_fn``
    taking a statistic over the batch, mixup, a state carried across batches) or where the
    ``collate_fn`` reorders the rows (sorting them by length would put a padding row's example under
    a real row's mask). The batch is collated twice under one seed, the second time with its last
    row read from another example: every other row must agree bit for bit. Only the last row is
    swapped: the rows before it are read before it, so a per-row augmentation whose number of draws
    depends on the row draws alike for them (found by review: swapping a middle row shifted the
    later rows' draws and refused such augmentation). Where the data and the collate draw nothing at
    random (the batch collated again under another seed is the same), the batch collated in
    reverse order must be the batch reversed."""
    n, b = len(data), len(indices)
    if b < 2 or n < 2:
        return
    seed = secrets.randbits(63)

    def collated(idx: Tensor, at: int) -> Any:
        with seeded_randomness(at, device, python=True):
            return _one_row_each(gather_dataset(data, idx, collate), b)

    def rows_of(tree: Any, keep: Tensor) -> Any:
        return optree.tree_map(lambda x: x[keep] if isinstance(x, Tensor) else x, tree, namespace="torch")

    base = collated(indices, seed)
    swapped = indices.clone()
    swapped[-1] = (int(indices[-1]) + 1 + secrets.randbelow(n - 1)) % n  # another example than the last row's
    keep = torch.ones(b, dtype=torch.bool)
    keep[-1] = False
    if not _same_values(rows_of(base, keep), rows_of(collated(swapped, seed), keep)):
        raise ValueError(
            "make_private: collate_fn (or the dataset) makes a row's values depend on the other rows of its batch, or "
            "reorders the rows: with the last row read from another example, other rows changed. A statistic over the "
            "batch (its mean, its standard deviation), mixup, or a state carried from batch to batch lets one sample "
            "move every other sample's gradient, which the clip does not bound; a sort puts a padding row's example "
            "under a real row's mask. Compute such statistics from public data (or once, privately), or per row; keep "
            "the rows in the order given; read each row from its own example only."
        )
    if _same_values(base, collated(indices, seed ^ 1)):  # nothing random: the order must be kept too
        flip = torch.arange(b - 1, -1, -1)
        if not _same_values(optree.tree_map(lambda x: x[flip] if isinstance(x, Tensor) else x, base, namespace="torch"), collated(indices[flip], seed)):
            raise ValueError(
                "make_private: collate_fn reorders the rows (the batch collated in reverse order is not the batch "
                "reversed): sorting by length, say, puts a padding row's example under a real row's mask, where it "
                "counts. Keep the rows in the order given."
            )


def _same_values(a: Any, b: Any) -> bool:
    """Whether two collated batches (or their rows) hold the same values, bit for bit (NaN equal
    to NaN), leaf by leaf."""
    la, sa = optree.tree_flatten(a, namespace="torch")
    lb, sb = optree.tree_flatten(b, namespace="torch")
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            same = x == y
            if x.is_floating_point() or x.is_complex():
                same = same | (x.isnan() & y.isnan())
            if not bool(same.all()):
                return False
        elif x != y:
            return False
    return True

