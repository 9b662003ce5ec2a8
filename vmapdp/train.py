"""The DP-SGD step: ``step(state, batch, mask) -> (state, metrics)``, composed from the pure parts.

One logical step, in this fixed order (each line a stage of ``step``)::

    ledger = ledger.append(event)              # every budget checked first: nothing computed past one
    summed, stats = sum over chunks of clipped_grad_sum(loss_fn, method=...)(params, chunk, mask=mask)
              # = clip_and_sum(per_sample_grads(loss_fn)(params, chunk), C, mask=mask), by ghost
              #   clipping, per-sample grads or two passes; masked rows add exactly 0;
              #   stats: StepStats, the non-private telemetry
    summed, stats = all_reduce((summed, stats))                  # distributed=True only
              # sharding=: params gathered before the chunks, the sums reduce-scattered to their
              # owners here, and each owner noises and updates its shard only (vmapdp.sharding)
    noisy, noise_state = privatizer.privatize(summed, noise_state, key)  # once per logical step
              # default: gaussian_privatizer, + N(0, (noise_multiplier * C)**2)
    update = noisy / expected_batch_size       # the EXPECTED size, never the realised one
    params, opt_state = optimizer.update(update, opt_state, params)

The tensor work of a chunk (norms, clipping, the masked sum) runs under
``torch.compile`` with static shapes, so a run of Poisson steps padded to one capacity compiles
once; ``"auto"`` races the methods eagerly and compiles only the winner (kept eager where its
compiled run is slower, or, on the CPU, where its time is mostly in kernels compiling leaves as
they are). Noise is drawn outside the compiled graph, after aggregation, from a key derived from
``(state.noise_seed, state.step)`` bound to the run (``state.run_id``, a digest of the initial
params) and to the step's release-defining configuration (clip norm, noise multiplier, expected
batch size, sample rate, rule, method, ...): see :func:`noise_binding`. The same state and
configuration always give the same step, and a run resumed from a checkpoint continues bit for
bit as if it had not stopped: the method ``"auto"`` chose for each chunk shape is recorded in the
state (``state.methods``) and replayed, and the privatizer's state (``state.noise_state``)
is carried like the optimizer's. A budget given to a step is recorded in the state
(``state.budgets``) and enforced by every later step on it, whatever that step was given.
Because the same state always gives the same noise, a process never releases one keyed step
twice with different values (a state stepped again on another batch: :mod:`vmapdp.noise.spent`
raises ``NoiseKeyReused`` before anything is returned; a recomputation, the first release bit
for bit, passes).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import secrets
import types
import warnings
from typing import Any, Callable, NamedTuple

import optree
import torch
from torch import Tensor

from vmapdp import _checks, accounting
from vmapdp import adaptive as _adaptive
from vmapdp import distributed as _dist
from vmapdp import precision as _precision
from vmapdp._tree import batch_size, check_mask, sample_shapes, shapes_differ, tensor_bytes
from vmapdp._tree import leaves as _leaves
from vmapdp.accounting import Ledger, NonPrivateEvent, PoissonGaussianEvent
from vmapdp.clipped import METHODS, AutoChooser, ClippedGradSum, auto_candidates, check_per_sample_grads_fit, clipped_grad_sum, eager_profile, one_check_per_step, race, shape_key, two_pass_chunk
from vmapdp.data import EVALUATION_ONLY_ID
from vmapdp.ghost import limits as ghost_limits
from vmapdp.noise import Privatizer, gaussian_privatizer
from vmapdp.noise import spent as _spent
from vmapdp.noise.privatizers import check_noise_owner, check_noise_position, is_correlated_state
from vmapdp.per_sample import refuse_writes, watch_writes
from vmapdp.precision import full_float32, mixed_precision
from vmapdp.sharding import Sharding, full_value

__all__ = ["TrainState", "StepStats", "init_train_state", "make_train_step", "PrivacyBudgetExceeded", "noise_binding", "step_config", "step_seed", "seeded_randomness"]


class PrivacyBudgetExceeded(RuntimeError):
    """The next step would take epsilon past a budget: the one given to ``make_train_step`` or one
    recorded in the state (``TrainState.budgets``, kept in checkpoints)."""


class TrainState(NamedTuple):
    """Everything a DP training run needs to continue; a plain value (save it, compare it)."""

    params: dict[str, Tensor]  # trainable params, keyed like named_parameters()
    opt_state: Any  # the optimizer's state (NamedTuple of tensors)
    noise_seed: int | None  # secret seed of the noise (None: noise from the OS CSPRNG)
    step: int  # logical steps taken
    ledger: Ledger  # privacy events recorded so far
    run_id: str = ""  # hex SHA-256 of the initial params (init_train_state); bound into every noise key
    budgets: tuple[tuple[float, float, str], ...] = ()  # (epsilon, delta, accountant): every budget ever given, all enforced
    methods: tuple[tuple[str, str], ...] = ()  # (chunk shape digest, method run): replayed on resume
    noise_state: Any = ()  # the privatizer's state (a pytree of tensors; () for the Gaussian's none)
    clip_norm: Any = None  # adaptive clipping's current threshold (0-dim float32 tensor); None: the step's l2_clip_norm
    sampler_id: str = ""  # the stream_id of the sampler whose batches the steps took ("": none recorded yet); secret like the seed

    def __repr__(self) -> str:  # never print the secret noise seed
        seed = "None" if self.noise_seed is None else "<secret>"
        return (
            f"TrainState(params={{{len(self.params)} tensors}}, opt_state={type(self.opt_state).__name__}, noise_seed={seed}, "
            f"step={self.step}, ledger={self.ledger!r}, budgets={self.budgets!r}, methods={dict(self.methods)!r})"
        )

    def epsilon(self, delta: float, *, accountant: str = "pld") -> float:
        """Epsilon spent so far at ``delta`` (from the ledger; host-side float math)."""
        return accountant_epsilon(self.ledger, delta, accountant)


class StepStats(NamedTuple):
    """A step's non-private telemetry as sums (0-dim float32 tensors), added leaf-wise over chunks
    and ranks (a NamedTuple is a pytree); :meth:`metrics` turns them into the step's metrics."""

    loss_sum: Tensor  # loss over the real rows with a finite gradient
    rows: Tensor  # real rows (mask True)
    clipped: Tensor  # real rows with a finite gradient norm above the clip norm
    norm_sum: Tensor  # per-sample gradient norms of the real rows with a finite one
    nonfinite: Tensor  # real rows dropped for a non-finite gradient

    @classmethod
    def of_chunk(cls, mask: Tensor, norms: Tensor, losses: Tensor, l2_clip_norm: float) -> StepStats:
        """The telemetry of one chunk from its per-sample norms and losses (pure tensor work)."""
        finite = torch.isfinite(norms)
        counted = mask & finite
        return cls(
            torch.where(counted, losses, 0.0).sum().float(),
            mask.sum().float(),
            (counted & (norms > l2_clip_norm)).sum().float(),
            torch.where(counted, norms, 0.0).sum().float(),
            (mask & ~finite).sum().float(),
        )

    @classmethod
    def zeros(cls, device: torch.device) -> StepStats:
        """The telemetry of an empty batch."""
        return cls(*(torch.zeros((), device=device) for _ in cls._fields))

    def metrics(self) -> dict[str, Tensor]:
        """Mean loss, real rows, clip fraction, mean per-sample norm, non-finite rows dropped."""
        real = self.rows.clamp_min(1.0)
        return {
            "loss": self.loss_sum / real,
            "batch_size": self.rows,
            "clip_fraction": self.clipped / real,
            "mean_grad_norm": self.norm_sum / real,
            "nonfinite": self.nonfinite,
        }


def accountant_epsilon(ledger: Ledger, delta: float, accountant: str) -> float:
    _checks.delta("epsilon(delta)", delta)  # checked even before the first step
    _checks.accountant("epsilon(delta)", accountant)
    if not ledger.events:
        return 0.0
    return float(accounting.epsilon(ledger, delta=delta, accountant=accountant))


def _budget_accountant(call: str, accountant: Any) -> str:
    """The accountant a budget is enforced with: an upper bound (``"rdp"``, ``"pld"``/``"prv"``)."""
    return _checks.accountant(call, accountant, ("rdp", "pld", "prv"), why="a budget is only enforced against an upper bound on epsilon ('gdp' is an approximation that can under-report)")


def _check_budget(call: str, budget: Any, accountant: str, num_samples: int | None = None) -> tuple[float, float, str] | None:
    """``budget=(epsilon, delta)`` checked, as the state records it: ``(epsilon, delta, accountant)``;
    with ``num_samples`` (a sampler's dataset size) also ``delta < 1/num_samples``; without, ``delta
    < 1/100`` (found by review: budget=(1.0, 0.5) with sample_rate= alone was enforced, 14 steps of a
    guarantee that protects nobody; a delta of 1/100 or more protects nobody in any dataset of 100
    rows or more, and a step with a sampler checks the state's budgets against its dataset too)."""
    if budget is None:
        return None
    if not (isinstance(budget, tuple) and len(budget) == 2):
        raise TypeError(f"{call}: budget must be a tuple (epsilon, delta), got {budget!r}.")
    eps = _checks.epsilon(call, budget[0], name="budget epsilon", allow_zero=False)
    delta = _checks.delta(call, budget[1], name="budget delta", num_samples=num_samples)
    _sized_delta(call, delta, num_samples, "budget delta", rows=100)
    accountant = _budget_accountant(call, accountant)
    return (eps, delta, accountant)


def _sized_delta(call: str, delta: float, num_samples: int | None, name: str, *, rows: int) -> None:
    """Where the dataset's size is unknown, a budget's delta must be below ``1/rows``: it protects
    nobody in any dataset of ``rows`` rows or more (100 where a budget is given; 2, the least any
    dataset has, for one a state already holds, checked where it was given; see
    :func:`_check_budget`). With the size, ``_checks.delta`` checks ``1/num_samples``."""
    if num_samples is None and delta >= 1.0 / rows:
        raise ValueError(
            f"{call}: {name}={delta!r} is 1/{rows} or more, which protects nobody in a dataset of {rows} rows or more "
            f"({_checks.DELTA_MEANING}), and the dataset's size is not known here. Pass a delta well below 1/num_samples "
            "(e.g. 1e-5); for a dataset smaller than that, give the budget to make_train_step(sampler=...) (or "
            "num_samples= to init_train_state), which checks it against 1/num_samples."
        )


def merge_budgets(budgets: tuple, new: tuple[float, float, str] | None) -> tuple[tuple[float, float, str], ...]:
    """``budgets`` plus ``new``, keeping the smallest epsilon per (delta, accountant): the tightest of each."""
    best: dict[tuple[float, str], float] = {}
    for eps, delta, acc in budgets + ((new,) if new is not None else ()):
        best[(delta, acc)] = min(eps, best.get((delta, acc), math.inf))
    return tuple(sorted((eps, delta, acc) for (delta, acc), eps in best.items()))


def params_digest(params: dict[str, Tensor]) -> str:
    """Hex SHA-256 of a params dict: names, dtypes, shapes and bytes, and the names' order (the run
    id of a state). The order counts: each leaf's noise stream is the one of its position, so two
    runs of one seed whose dicts list the same params in another order would swap streams between
    params, and the difference of their releases would cancel the noise (found by review)."""
    h = hashlib.sha256(b"vmapdp-params:")
    for k in sorted(params):
        v = full_value(params[k]).detach()  # (an FSDP2 DTensor gathered, one parameter at a time)
        h.update(repr((k, str(v.dtype), tuple(v.shape))).encode())
        h.update(tensor_bytes(v))
    h.update(repr(("order", tuple(params))).encode())
    return h.hexdigest()


def init_train_state(
    params: dict[str, Tensor],
    optimizer: Any,
    *,
    seed: int | None = None,
    secure: bool = False,
    budget: tuple[float, float] | None = None,
    accountant: str = "pld",
    privatizer: Privatizer | None = None,
    sharding: Sharding | None = None,
    num_samples: int | None = None,
) -> TrainState:
    """The state before the first step.

    Args:
        params: trainable params (from :func:`vmapdp.functionalize`); they are cloned, so the
            module they came from is never written to.
        optimizer: an init/update pair from :mod:`vmapdp.optim`.
        seed: the secret seed of the noise. Anyone who knows it can subtract the noise, so keep it
            as secret as the data, and large (a small int can be guessed; use it for tests and
            reproducible experiments only); ``None`` draws 128 bits from OS entropy. Publish at
            most one run per explicit seed: two runs that share a seed and differ in anything but
            their noise (the data, the learning rate, the loss) release a difference in which
            equal noise cancels. As a second line of defence the noise key of every step also
            binds the run id (a digest of ``params``) and the step's configuration
            (:func:`noise_binding`: clip norm, noise multiplier, expected batch size, sample rate,
            rule, method, precision, the optimizer's hyperparameters), so such runs get
            independent noise; what cannot be bound is the data and ``loss_fn``. With
            ``seed=None`` every run has its own random seed and nothing is shared.
        secure: draw the noise from the OS CSPRNG at every step (a fresh key from it per step,
            expanded by ChaCha20) instead of from the state's secret seed;
            such a state holds no seed (``seed`` must be None) and is not reproducible.
        budget: ``(epsilon, delta)`` recorded in the state from the start: every step on it (or
            on its descendants and checkpoints) raises :class:`PrivacyBudgetExceeded` rather than
            spend past it, whatever budget the step itself was given (see ``make_train_step``).
        accountant: the accountant ``budget`` is enforced with (``"rdp"`` or ``"pld"``).
        num_samples: the dataset's size, where known: ``budget``'s delta must be below
            ``1/num_samples`` (without it, below 1/100; a step with a sampler checks its own).
        privatizer: the :class:`vmapdp.noise.Privatizer` the run's steps use, when it keeps state
            (``state.noise_state = privatizer.init(params)``); ``None``: no noise state (the
            default Gaussian keeps none).
        sharding: a :class:`vmapdp.sharding.Sharding` of ``params``: the state keeps this rank's
            shards of the params, the optimizer state and the privatizer's state only
            (``privatizer.init`` gets the shards: correlated noise's buffers are ``[rows, shard
            length]``) (``params`` are the full ones, the
            same on every rank; the run id is theirs, as in the unsharded run). For steps made
            with ``make_train_step(..., sharding=)``.
    """
    call = "init_train_state(params, optimizer)"
    _checks.params_dict(call, params, fsdp_ok=True)
    _checks.optimizer(call, optimizer)  # (found by review: a torch.optim.SGD raised AttributeError here)
    secure = _checks.flag(call, "secure", secure)
    if privatizer is not None:
        _checks.privatizer(call, privatizer)
    if secure and seed is not None:
        raise ValueError(f"{call}: secure=True rejects seeds: its noise comes from the OS CSPRNG, and a seed would make it predictable. Pass seed=None.")
    if seed is not None:
        seed = _checks.positive_int(call, "seed", seed, minimum=0, fix="Or pass seed=None (128 bits of OS entropy).")  # (a NumPy int: a Python int)
        _checks.guessable(call, "seed", seed, "the noise and subtract it")
    num_samples = _checks.optional_positive_int(call, "num_samples", num_samples, meaning="num_samples is the dataset's size")
    recorded = _check_budget(call, budget, accountant, num_samples)
    if not secure and seed is None:
        seed = secrets.randbits(128)
    run_id = params_digest(params)  # of the full params, sharded or not
    # (the full values, the same on every rank: a rank refusing its own shard alone would leave the others waiting)
    _checks.finite_params(call, {k: full_value(v) for k, v in params.items()}, "Initialise finite params.")
    if sharding is None:  # (an FSDP2 DTensor gathered: the whole model on every rank)
        params = {k: full_value(v).detach().clone() for k, v in params.items()}
    else:  # copies of this rank's shards only (no full copy)
        _checks.sharding(call, sharding, privatizer=privatizer)
        params = sharding.shard(params)
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        noise_seed=seed,
        step=0,
        ledger=Ledger(),
        run_id=run_id,
        budgets=merge_budgets((), recorded),
        noise_state=() if privatizer is None else privatizer.init(params),
    )


def step_config(
    *,
    l2_clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    sample_rate: float,
    rule: str = "clip",
    nonfinite: str = "zero",
    randomness: str = "error",
    method: str = "auto",
    precision: torch.dtype | None = None,
    optimizer: str = "",
    sampler: str = "",
    adaptive: str = "",
    noise: str = "",
    layout: str = "",
) -> str:
    """The release-defining configuration of a step, canonically (floats in hex: exact); ``method``
    as asked for (``"auto"`` whatever it chooses); ``optimizer`` its :attr:`Optimizer.config`;
    ``sampler`` the batch scheme other than Poisson (:func:`scheme_description`; ``""`` for
    Poisson sampling, which ``sample_rate`` already says, and then left out); ``noise`` a bound
    privatizer's mechanism (correlated noise; ``""`` for the default, left out); ``layout`` how a
    batch is split (chunks, ranks), bound where random layers draw per chunk (``""``: left out)."""
    fields = (
        ("l2_clip_norm", float(l2_clip_norm).hex()),
        ("noise_multiplier", float(noise_multiplier).hex()),
        ("expected_batch_size", float(expected_batch_size).hex()),
        ("sample_rate", float(sample_rate).hex()),
        ("rule", rule),
        ("nonfinite", nonfinite),
        ("randomness", randomness),
        ("method", method),
        ("precision", str(precision)),
        ("optimizer", optimizer),
    ) + ((("sampler", sampler),) if sampler else ()) + ((("adaptive", adaptive),) if adaptive else ()) + ((("noise", noise),) if noise else ()) + ((("layout", layout),) if layout else ())
    return repr(fields)


def scheme_description(sampler: Any) -> str:
    """The batch scheme of ``sampler`` for the noise binding: ``""`` for plain Poisson sampling (or
    no sampler), else its class and the public parameters that define its events."""
    from vmapdp.data import PoissonSampler

    if sampler is None or type(sampler) is PoissonSampler:
        return ""
    names = ("num_samples", "sample_rate", "batch_size", "steps_per_epoch", "max_batch_size", "cycle")
    return repr((type(sampler).__name__, tuple((k, getattr(sampler, k)) for k in names if hasattr(sampler, k))))


def noise_binding(run_id: str, config: str) -> str:
    """What a step's noise key binds besides ``(seed, step)``: the run (``state.run_id``) and the
    step's configuration (:func:`step_config`). Hex SHA-256.

    Execution details that change only rounding are left out, so that the runs they make can be
    compared noise for noise: ``physical_batch_size``, ``compile``, ``distributed`` (a distributed
    run equals one process) and what ``"auto"`` chose. In one process such a comparison releases
    one key twice with values that differ in rounding: run the twin inside
    :func:`vmapdp.noise.spent.unreleased` and publish neither. ``precision`` is bound: a sample that
    overflows in float16 is dropped there and kept in float32, a difference that is not rounding.
    ``loss_fn`` cannot be bound: see :func:`init_train_state` for the rule that stays the caller's.
    """
    return hashlib.sha256(b"vmapdp-noise-binding:" + repr((run_id, config)).encode()).hexdigest()


def _check_shapes(call: str, first: list[tuple], shapes: tuple) -> None:
    """``make_train_step(fixed_shapes=True)``: a batch's per-sample shapes are those of the first
    batch the step released (recorded by the step once it succeeds)."""
    if first and shapes != first[0]:
        raise shapes_differ(
            f"{call}: the batch's per-sample shapes {dict(shapes)} are not the first batch's {dict(first[0])}",
            ", or pass fixed_shapes=False where the shapes change on a public schedule",
        )


def step_seed(state: "TrainState", label: str = "model", rank: int = 0) -> int | None:
    """A seed for the randomness of the state's next step other than its noise (dropout, data
    augmentation), so that a step resumed from a checkpoint, in this process or a fresh one,
    draws it again bit for bit; None for a ``secure`` state (no seed: its noise is fresh on every
    release, so a repeated step cannot cancel it).

    Why: the noise of a step is a function of ``(state.noise_seed, state.step)``, so a step
    recomputed after a crash adds the same noise; if its dropout masks or augmented inputs came
    from torch's global generator, the recomputed sum differs and the difference of the two
    releases is noise-free (found by review: std 1000 C noise, the two releases 5.47 apart).
    ``make_train_step`` seeds its per-sample computations from ``step_seed(state, "model", rank)``
    (where ``randomness`` allows random layers) and ``make_private`` its dataset reads from
    ``step_seed(state, "data")``; seed your own augmentation from it in a loop of your own
    (``torch.Generator().manual_seed(step_seed(state, "data"))``). One-way from the secret noise
    seed: a seed never reveals the noise seed. ``label`` and ``rank`` (a distributed rank's own
    rows) give independent streams."""
    if state.noise_seed is None:
        return None
    text = f"vmapdp-step-randomness:v1:{label}:{rank}:{state.noise_seed}:{state.step}:{state.run_id}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@contextlib.contextmanager
def seeded_randomness(seed: int | None, device: torch.device | None = None, *, python: bool = False):
    """Run the block with torch's global generators (the CPU's, and ``device``'s where it is an
    accelerator) seeded with ``seed``, and restore them afterwards: draws in the block (dropout,
    augmentation) are a function of the seed and leave the caller's generators as they were.
    ``python``: Python's ``random`` and NumPy's global generator too (where NumPy is imported), as
    a dataset's augmentation may use them (found by review: an augmentation by ``random`` made a
    resumed ``make_private`` step read another batch, 1.3 C between the two releases).
    ``seed=None``: the block runs as it is."""
    if seed is None:
        yield
        return
    accel = device is not None and device.type not in ("cpu", "meta")
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[device] if accel else [], device_type=device.type if accel else "cuda"))
        torch.random.default_generator.manual_seed(seed)
        if accel:
            module = torch.get_device_module(device.type)
            with module.device(device) if hasattr(module, "device") else contextlib.nullcontext():
                module.manual_seed(seed)
        if python:
            import random
            import sys

            py_state = random.getstate()
            stack.callback(random.setstate, py_state)
            random.seed(seed)
            np = sys.modules.get("numpy")
            if np is not None:
                np_state = np.random.get_state()
                stack.callback(np.random.set_state, np_state)
                np.random.seed(seed % 2**32)
        yield


def _step_key(seed: int, step: int, binding: str) -> bytes:
    """The noise key of step ``step``: distinct for every (seed, step, binding), hashed by add_noise(key=)."""
    return f"vmapdp-noise:v2:{seed}:{step}:{binding}".encode()


def _ledger_event(call: str, noise_multiplier: float, sample_rate: float, sampler: Any = None) -> Callable[[], Any]:
    """What the ledger records for each step, as a function called once per step before anything
    is computed: ``sampler.event(noise_multiplier)`` (the event of the batch the sampler drew last:
    for shuffled and balls-in-bins epochs, an :class:`~vmapdp.accounting.EpochGaussianEvent`
    that charges the epoch on the step that opens it), a Poisson-subsampled Gaussian for
    ``sample_rate=`` alone, or (with a warning, to the caller of ``make_train_step``) a
    :class:`NonPrivateEvent` for ``noise_multiplier=0``, whatever the sampler."""
    if noise_multiplier > 0:
        if sampler is None:
            event = PoissonGaussianEvent(noise_multiplier=noise_multiplier, sample_rate=float(sample_rate))
            return lambda: event

        def sampled() -> Any:
            event = sampler.event(noise_multiplier)
            if not isinstance(event, accounting.events._EVENT_TYPES) or isinstance(event, NonPrivateEvent):
                raise TypeError(
                    f"step(state, batch, mask): the sampler's event(noise_multiplier) gave {event!r}, not a privacy event of "
                    "vmapdp.accounting; the ledger cannot record it. Use a sampler from vmapdp.data."
                )
            return event

        return sampled
    warnings.warn(
        f"{call}: noise_multiplier=0 trains WITHOUT differential privacy; the ledger records a NonPrivateEvent and epsilon is infinite.",
        UserWarning,
        stacklevel=3,
    )
    return NonPrivateEvent


def _checked_inputs(call: str, state: Any, batch: Any, mask: Any, secure: bool) -> tuple[int, Tensor]:
    """The batch's row count and its mask on the params' device; TypeError/ValueError for a state
    that is not a TrainState or was made with another ``secure``, or a mask that does not fit."""
    if not isinstance(state, TrainState):
        raise TypeError(f"{call}: state must be a TrainState from vmapdp.init_train_state, got {type(state).__name__}.")
    if secure != (state.noise_seed is None):
        raise ValueError(
            f"{call}: the step was made with secure={secure} but the state "
            + ("holds no noise seed (made with secure=True)." if state.noise_seed is None else "holds a noise seed; secure=True rejects seeds.")
            + " Use the same secure setting in init_train_state and make_train_step."
        )
    n = batch_size(batch, call=call)
    check_mask(mask, n, call=call)
    return n, mask.to(next(iter(state.params.values())).device)  # samplers make masks on the CPU


def _charged(call: str, state: TrainState, event: Any, own_budget: tuple[float, float, str] | None, num_samples: int | None = None) -> tuple[Ledger, tuple]:
    """The ledger with this step's ``event`` and every budget it must keep (the step's and the
    state's), or :class:`PrivacyBudgetExceeded` if the step would spend past one: run before
    anything is computed, so nothing is released past a budget. ``num_samples`` (the sampler's
    dataset size): a budget at ``delta >= 1/num_samples`` is refused, whatever recorded it."""
    ledger = state.ledger.append(event)
    budgets = merge_budgets(tuple(state.budgets), own_budget)  # the step's and every one the state holds
    for _, b_delta, _ in budgets:  # (found by review: init_train_state(budget=(1.0, 0.2)) on 100 rows was enforced at 0.2)
        _checks.delta(call, b_delta, name="a budget's delta", num_samples=num_samples)
        _sized_delta(call, b_delta, num_samples, "a budget's delta", rows=2)  # (a budget a state holds, past the checks where it was given: found by review)
    for b_eps, b_delta, b_accountant in budgets:
        if not accounting.within_budget(ledger, epsilon=b_eps, delta=b_delta, accountant=b_accountant):
            try:
                eps = accountant_epsilon(ledger, b_delta, b_accountant)
            except ValueError:  # an accountant that cannot bound this ledger (Poisson steps made replace-one): RDP decided
                eps, b_accountant = accountant_epsilon(ledger, b_delta, "rdp"), "rdp, the only bound for this ledger"
            whose = "given to this step" if own_budget is not None and (b_eps, b_delta, b_accountant) == own_budget else "recorded in the state"
            raise PrivacyBudgetExceeded(
                f"{call}: step {state.step + 1} would spend epsilon={eps:.4g} > budget {b_eps:g} "
                f"(delta={b_delta:g}, {b_accountant}; the budget {whose}). Training stops here; the state is unchanged."
            )
    return ledger, budgets




def _check_rows(n: int, size: int) -> None:
    """Refuse a batch of ``n`` rows that the chunk loop cannot split into chunks of ``size``."""
    if n % size:
        raise ValueError(f"step(state, batch, mask): the batch has {n} rows, not a multiple of physical_batch_size={size}; pad it with the sampler.")


def _check_sampler_position(call: str, sampler: Any, step: int, distributed: bool, bound: bool = False, recorded: str = "") -> str:
    """Refuse a step whose state and sampler are not in step.

    A sampler with a position (groups, epochs: ``steps_drawn``) must have drawn exactly
    ``step + 1`` batches for the state's next step: the ledger records the event of the batch it
    drew last. One that has drawn more skipped positions (a step that raised after its batch was
    drawn, caught by the loop, or batches drawn ahead), and the ledger, whose events assume
    consecutive positions, would charge too little: 20 shuffled epochs touched by 20 released
    steps were charged as 11, a cyclic Poisson group that took part in all 10 steps as 3 (found
    by review). One that has drawn fewer restarted: a fresh
    sampler on a resumed run starts again at group 0 (cyclic Poisson) or a new epoch, so an
    example can participate closer together than the ledger's events assume (for banded
    correlated noise, inside one band). A Poisson or fixed-size sampler's event has no position
    (memoryless), but a keyed one's batches do: one that has drawn fewer than ``step + 1`` restarted
    its stream, and a resumed run would draw other batches for the steps it repeats, under the same
    noise keys (found by review: a checkpoint saved without its sampler resumed so, the two releases
    of the repeated step a noise-free difference); one that has drawn more is refused as well.
    With ``distributed``, a secure sampler is checked on rank 0 only (its batches are drawn there
    and broadcast); a keyed one on every rank (each rank draws; found by review: rank 1's undrawn
    sampler and full batches there were charged as cyclic sampling). A sampler that has drawn
    nothing is not checked for its position: the step was given it for its events only, and its
    batches come from another object (made alike), except where the noise is ``bound``
    (correlated noise): its accounting rests on the separation of each example's participations,
    which only the sampler's own batches are known to have (found by review: an undrawn cyclic
    sampler and full batches at every step were charged epsilon 1.9 for a far larger one).

    The sampler must also be the one the state's steps were drawn by (``stream_id`` against the
    state's ``recorded`` ``sampler_id``): a fresh sampler under another key, fast-forwarded to
    the state's step, would pass the position check but put an example's participations
    elsewhere than the ledger's events assume (found by review), and draw other batches for
    repeated steps (any keyed sampler, Poisson and fixed-size too). Returns the id to record."""
    drawn = getattr(sampler, "steps_drawn", None)
    if distributed and _dist.rank() != 0 and getattr(sampler, "secure", False):
        if getattr(sampler, "last_rows", None) is not None:
            # (each rank's own secure draw: W independent samples of the dataset, an example on several ranks)
            raise ValueError(
                f"{call}: this rank's secure {type(sampler).__name__} has drawn a batch, but a secure sampler's batches "
                "cannot agree across processes: each rank would step its share of another draw, and an example could be "
                "stepped on several ranks (up to world_size x C charged as C). Let rank 0 draw and deal them out: "
                "vmapdp.distributed.sharded(sampler). Nothing was released."
            )
        return recorded
    # (every sampler with a position in its stream: positional or not, a fresh sampler under another key would draw
    # other batches for the steps a resumed run repeats, under the same noise keys; found by review)
    ident = getattr(sampler, "stream_id", None)
    if recorded == EVALUATION_ONLY_ID:  # (with a sampler or sample_rate= alone: found by review)
        raise ValueError(
            f"{call}: this state was read with load_state(..., ignore_sampler=True), for evaluation only: its sampler's "
            "state was not restored and the checks of a resume were skipped, and a resumed run would repeat released steps "
            "with other batches (or fresh noise). Load it without ignore_sampler (with its sampler: load_state(..., "
            "sampler=)) to resume training. Nothing was released."
        )
    if ident is not None and recorded and ident != recorded:
        raise ValueError(
            f"{call}: this {type(sampler).__name__} is not the sampler the state's {step} steps were drawn by (another key=, "
            "generator seed or secure sampler, or other arguments): its batches, groups or epoch positions differ from the ones "
            "the ledger charged (and a step repeated after a resume would add the same noise to another batch), even drawn to "
            "the same position. Resume the run's own sampler with the state (save_state(..., sampler=) and "
            "load_state(..., sampler=)), or make it with the same key=. Nothing was released."
        )
    if sampler is None and recorded:
        # (found by review: a run sampled at rate 0.2 and continued with sample_rate=0.01 alone reported epsilon 2.93
        # where its steps cost 4.99; a secure epoch sampler's run continued so repeated a lost step with another batch)
        raise ValueError(
            f"{call}: this state's {step} steps were drawn by a sampler (its id is recorded in state.sampler_id), but this step "
            "is given none (sample_rate= alone): it could not check that its batches continue that sampling, and the ledger "
            "would charge whatever rate it is told. Give the step the run's sampler (make_train_step(..., sampler=)): the one "
            "saved with the state (load_state(..., sampler=)), or one made with the same key= and drawn to the state's step; a "
            "secure sampler's run cannot be continued without its own. Nothing was released."
        )
    recorded = ident if ident is not None else recorded
    if drawn is None or (not drawn and not bound):  # (a secure Poisson sampler: its identity only)
        return recorded
    if not drawn and step == 0:
        raise ValueError(
            f"{call}: correlated noise is charged for the participations its sampler ({type(sampler).__name__}) allows "
            "(each example at most once in any band of steps), but that sampler has drawn no batch: this batch came from "
            "elsewhere, with no such guarantee. Draw each step's batch from the sampler given to make_train_step. "
            "Nothing was released."
        )
    # (any sampler with a position in its stream, Poisson and fixed-size too: a spare batch is harmless to their events, but
    # a run resumed from the checkpoint before it would draw the spare batch for the step that released another, under the
    # same noise key; found by review: 1.94 C between the two releases)
    if drawn > step + 1:
        raise ValueError(
            f"{call}: the state is at step {step} but its sampler has drawn {drawn} batches: {drawn - step - 1} drawn batch(es) "
            "never became a step (a step that raised after its batch was drawn, or batches drawn ahead). The ledger records "
            "the event of the sampler's last batch and assumes consecutive positions, so it would charge too little, and a run "
            "resumed from an earlier checkpoint would repeat a released step with another batch under the same noise. Draw exactly "
            "one batch per step; after a failed step, resume the last checkpoint with its sampler (save_state(..., sampler=) "
            "and load_state(..., sampler=)). Nothing was released."
        )
    if drawn < step + 1:
        raise ValueError(
            f"{call}: the state is at step {step} but its sampler has drawn only {drawn} batches, so this batch is not the "
            f"state's step {step + 1}. Draw each step's batch from the sampler (a self-check too: draw the next batch before "
            "running a step from a later state). A sampler that restarted (a fresh one on a resumed run) would repeat the groups "
            "or epoch positions the ledger has already charged: resume it with the state (save_state(..., sampler=) and "
            "load_state(..., sampler=)). Nothing was released."
        )
    return recorded


def _plausible_rows(call: str, rows: int, expected: float, sampler: Any = None) -> None:
    """With a sampler given for its events only (no draw to compare with), the batch's real rows
    must be a size that sampler could draw: at most ``E + 10 sqrt(E) + 20`` for its expected size
    ``E`` (a binomial batch exceeds it with probability below 1e-17: by Bernstein's inequality for
    ``E >= 1``, by the exact tail, at most 7e-24, below). Found by review: a whole dataset stepped every step (200 rows for E = 10) was
    charged at the sampler's rate. What vmapdp's samplers know is checked too (found by review:
    50 rows were charged as a FixedSizeSampler's 8, and a PoissonSampler(40, 0.2)'s whole dataset
    passed the bound): a fixed-size sampler's sizes exactly (``draw_sizes``), a truncated one's
    cap, the dataset's size, and for a binomial draw (``binomial_draws``) its exact upper tail,
    refused below 1e-17 (the bound's false-alarm rate). Not with ``sample_rate=`` alone, whose
    dataset size, so draw size, is unknown (``expected_batch_size`` is a divisor of the caller's
    choice)."""
    bound = expected + 10.0 * math.sqrt(expected) + 20.0
    sizes, cap, n = (getattr(sampler, a, None) for a in ("draw_sizes", "max_batch_size", "num_samples"))
    why = None
    if sizes is not None and rows not in sizes:
        why = f"its every draw has {' or '.join(map(str, sizes))} real rows"
    elif cap is not None and rows > cap:
        why = f"it draws at most max_batch_size={cap} rows"
    elif n is not None and rows > n:
        why = f"its dataset has {n} examples"
    elif rows > bound:
        why = f"more than {math.floor(bound)} rows has probability below 1e-17"
    elif getattr(sampler, "binomial_draws", False) and n and rows > expected:
        from vmapdp.audit.stats import binomial_tail

        tail = binomial_tail(rows, n, min(1.0, expected / n), upper=True)
        if tail < 1e-17:
            why = f"{rows} or more of its {n} examples are drawn with probability {tail:.2g}"
    if why is not None:
        raise ValueError(
            f"{call}: the batch has {rows} real rows but the step charges {type(sampler).__name__ if sampler is not None else 'a sampling'}"
            f" of expected batch size {expected:g} ({why}): this is not a batch of that sampling (the whole "
            "dataset, rows repeated, or padding marked real?), and the ledger would charge too little. Draw each batch from "
            "the step's sampler: indices, mask = sampler.sample(). Nothing was released."
        )


def _check_drawn_rows(call: str, sampler: Any, mask: Tensor, expected: float | None) -> None:
    """In one process, the batch's real rows (``mask``'s True entries) must be those of the
    sampler's last draw (``last_rows``), where the step's sampler has drawn: a mask that marks the
    sampler's padding as real (``torch.ones_like(mask)``: the padding rows are copies of row 0) or a
    batch with rows repeated steps an example several times, each adding up to C to a sum charged
    as C (found by review: example 0 stepped 21 times). A sampler that has drawn nothing was given
    for its events only (see :func:`_check_sampler_position`). Same-sized other rows are not seen."""
    if sampler is None or expected is None:  # (sample_rate= alone: nothing to compare with, no host sync)
        return
    drawn = getattr(sampler, "last_rows", None)
    real = int(mask.sum())
    if drawn is None:
        _plausible_rows(call, real, expected, sampler)
        return
    if real != drawn:
        raise ValueError(
            f"{call}: the mask marks {real} real rows but the step's sampler drew {drawn}: "
            + ("padding rows marked real (pass the sampler's own mask, not torch.ones_like(mask)) or rows repeated, "
               "each adding up to C to a sum charged as C. " if real > drawn else "rows of the draw were dropped. ")
            + "Step exactly the sampler's draw: indices, mask = sampler.sample(); step(state, gather(data, indices), mask). "
            "Nothing was released."
        )


def _compared_sampler_id(sampler: Any, recorded: str) -> str | None:
    """The sampler id the ranks' same-state check compares: the step's own keyed (or
    generator-driven) sampler's where it is positional or has drawn (every rank draws from its own,
    and they must draw the same global batch to deal it out: found by review, Poisson and
    fixed-size samplers made without ``key=`` drew under another random key on each rank and put an
    example on both ranks, 2 C charged as C); None for a secure one (rank 0 draws), one given for
    its events only (a sampler without a position that has drawn nothing), or no sampler: the
    state's recorded id may differ across ranks there (a secure sampler's is recorded on rank 0
    only; found by review)."""
    if sampler is None or getattr(sampler, "secure", False):
        return None
    drawn = getattr(sampler, "steps_drawn", None)
    return recorded if _positional(sampler) or (drawn is not None and drawn > 0) else None


def _records_draws(sampler: Any) -> bool:
    """``sampler`` is one of vmapdp's, which record each draw (``last_rows``); a caller's own
    sampler may not (found by review: one dealt correctly was refused as undrawn)."""
    from vmapdp.data import PoissonSampler, _KeyedSampler

    return isinstance(sampler, (PoissonSampler, _KeyedSampler))


def _check_dealt_rows(call: str, sampler: Any, rows: Tensor, expected: float | None, *, failed: BaseException | None = None) -> None:
    """The ranks' real rows, summed (``rows``, the reduced telemetry, the same on every rank), must be
    the real rows of the ranks' sampler's last draw (``last_rows`` of every rank that drew, which
    must agree; reduced, so every rank decides on the same figures and all refuse together): more
    means an example stepped on two ranks (every rank stepped the whole global batch, or took its
    share of another draw), each adding up to C to one sum charged as C. Before the noise (nothing released). Not checked where no rank's
    sampler has drawn (given for its events only) or there is none: there the summed rows must be
    plausible for ``expected`` (:func:`_plausible_rows`). ``failed``: what this rank's per-sample
    work raised (it joined the reduction with zero sums): every rank raises, that rank its own error."""
    mine = getattr(sampler, "last_rows", None) if sampler is not None else None
    # the largest and the smallest draw over the ranks whose sampler drew (one all_reduce): any rank's,
    # not only rank 0's (found by review: rank 0's undrawn sampler let rank 1's draw be stepped twice)
    # (and whether a rank's own sampler drew nothing while another's drew: that rank stepped a batch from elsewhere,
    # which a row count cannot tell from a share of this draw; a secure sampler is drawn on rank 0 only)
    idle = mine is None and not (getattr(sampler, "secure", False) and _dist.rank() != 0)
    drawn = [-1, -(1 << 62)] if mine is None else [int(mine), -int(mine)]
    hi, neg_lo, some_idle, some_failed = _dist.max_ints(drawn + [int(idle), int(failed is not None)])
    if failed is not None:
        raise failed
    if some_failed:
        raise RuntimeError(
            f"{call}: another rank failed while computing its clipped sums (its error is raised there); this rank "
            "stopped with it after the reduction, before the noise: nothing was released on any rank."
        )
    if hi < 0:
        if _records_draws(sampler) and _dist.world_size() > 1:
            # (found by review: a sampler given for its events only let every rank step its own draw, each rank the
            # whole batch, or a DistributedSampler's shuffled batches charged as Poisson, with nothing checked; the
            # rows summed over the ranks cannot show one draw dealt out. sample_rate= alone warns at make_train_step)
            raise ValueError(
                f"{call}: no rank's sampler ({type(sampler).__name__}) drew this step's batch: with several ranks the step "
                "must see the draw it charges, to check that the ranks' rows are that one draw dealt out (each rank drawing "
                "its own batch, or stepping the whole batch, puts an example on two ranks: 2 C charged as C; a "
                "DistributedSampler's shuffled batches would be charged as the sampler's). Draw every batch from the "
                "step's sampler and deal it: for indices, mask in vmapdp.distributed.sharded(sampler). Nothing was released."
            )
        if expected is not None:  # (the ranks' rows summed: the same figure on every rank)
            _plausible_rows(call, int(rows.item()), expected, sampler)
        return
    if some_idle:
        raise ValueError(
            f"{call}: a rank's sampler drew this step's batch ({hi} real rows) but another rank's drew nothing: that rank "
            "stepped a batch from elsewhere (another sampler object), and an example could be stepped on more than one "
            "rank. Draw every rank's batch from the step's own sampler and deal it: vmapdp.distributed.sharded(sampler). "
            "Nothing was released."
        )
    if -neg_lo != hi:
        raise ValueError(
            f"{call}: the ranks' samplers drew batches of different sizes ({-neg_lo} and {hi} real rows): they are not "
            "one sampler's draw dealt out. Draw the same global batch on every rank (the same sampler, same key=) and "
            "deal it: vmapdp.distributed.sharded(sampler). Nothing was released."
        )
    total = int(rows.item())
    if total != hi:
        raise ValueError(
            f"{call}: the ranks stepped {total} real rows in all, but their sampler's last batch has {hi}: "
            + ("an example was stepped on more than one rank (each rank stepped the whole global batch?), adding up to "
               "world_size x C to one sum charged as C. " if total > hi else "rows of the batch were dropped. ")
            + "Deal each global batch out: vmapdp.distributed.sharded(sampler), or shard(*sampler.sample(), "
            "sampler.capacity) with the same sampler (same key=) on every rank. Nothing was released."
        )


def _positional(sampler: Any) -> bool:
    """Whether ``sampler`` has a position its steps must follow (groups, epochs: ``steps_drawn``;
    not a fixed-size sampler's, whose draws are alike, nor a Poisson one's, memoryless)."""
    return getattr(sampler, "steps_drawn", None) is not None and getattr(sampler, "positional", True)


def _shape_digest(key: tuple) -> str:
    """A stable, serialisable name for a ``shape_key`` (kept in ``TrainState.methods``)."""
    return hashlib.sha256(b"vmapdp-shape:" + repr(key).encode()).hexdigest()[:32]


def _fresh_function(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object, so torch.compile caches it apart from other steps.

    Dynamo keeps one cache per code object; every make_train_step closure shares ``chunk_sums``'
    code, and a process that builds many steps (a sweep over epsilons) would hit its recompile
    limit. A fresh code object gives each step its own cache.
    """
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _chunk_shapes(batch: Any, mask: Tensor, shared: tuple, n: int, physical_batch_size: int | None) -> tuple:
    """The distinct shapes (``shape_key``) of the chunks a step of ``n`` rows runs, in the order it first
    runs them: a distributed "auto" chooses once per chunk shape, on every rank together."""
    size = physical_batch_size or max(n, 1)
    rows = list(dict.fromkeys(min(size, n - start) for start in range(0, n, size)))
    return tuple(shape_key((optree.tree_map(lambda x: x[:k], batch, namespace="torch"), mask[:k], *shared)) for k in rows)


# every run "auto" can choose (TrainState.methods' values): the ranks agree on one by its index here
_AUTO_RUNS = tuple(m for m in METHODS if m != "auto") + tuple(f"{m} eager" for m in METHODS if m != "auto")


def _parse_ran(ran: Any) -> tuple[str, bool] | None:
    """A recorded choice (``TrainState.methods``) as ``(method, eager)``; None for anything else:
    ``"<method>"`` ran as the step was made (compiled when ``compile``), ``"<method> eager"`` ran
    eagerly in a compiled step, because "auto" timed it faster than the compiled one."""
    if not isinstance(ran, str):
        return None
    name, _, how = ran.partition(" ")
    return (name, how == "eager") if name in METHODS and name != "auto" and how in ("", "eager") else None


def _same_chunks(batch: Any, mask: Tensor, n: int, physical_batch_size: int | None) -> tuple[Any, Tensor, int]:
    """``Sharding(unshard="use")``: each chunk makes its own gathers (one per use of a parameter)
    and reduce-scatters (one per parameter), so every rank must run the same number of chunks of
    the same size, or the collectives pair up wrongly (a hang, or the sums of two parameters of
    one size added together). ``vmapdp.distributed.shard`` gives the ranks shares that differ by a
    row, which can span one chunk more on some ranks. The ranks agree on the largest row count
    (one ``all_reduce``; ValueError on every rank if one is not a multiple of
    ``physical_batch_size``) and each pads its batch to it with masked rows (copies of its first
    row, zeros if it has none), which add exactly 0. Returns ``(batch, mask, rows)``."""
    uneven = physical_batch_size is not None and n % physical_batch_size != 0
    most, uneven = _dist.max_ints([n, int(uneven)])
    if uneven:
        raise ValueError(
            f"step(state, batch, mask): a rank's batch (this one has {n} rows) is not a multiple of physical_batch_size="
            f"{physical_batch_size}; pad it with the sampler (vmapdp.distributed.sharded does)."
        )
    if most > n:
        pad = most - n

        def grow(x: Tensor) -> Tensor:
            fill = x[:1] if n else x.new_zeros((1, *x.shape[1:]))
            return torch.cat([x, fill.expand(pad, *x.shape[1:])])

        batch = optree.tree_map(grow, batch, namespace="torch")
        mask = torch.cat([mask, mask.new_zeros(pad)])
    return batch, mask, most


def _chunk_function(sum_fn: Callable, *, l2_clip_norm: float, adaptive: bool, backend: str | None, sink: Callable | None = None) -> Callable:
    """``chunk_sums(params, mask, shared, chunk) -> (clipped sum, StepStats)`` of one physical
    chunk: pure tensor work, compiled (``fullgraph``, static shapes) with ``backend`` (None: eager). With
    ``adaptive`` the threshold is ``shared[0]``, a traced tensor, and ``sum_fn`` clips ``loss / C``
    to 1 (so the sum is scaled back by ``C``). ``sink``: given each param's sum (eager only; the
    sharded step's reduce-scatter, after which the sums are shards: what follows is element-wise)."""

    def chunk_sums(params, mask, shared, chunk):
        summed, norms, losses = sum_fn(params, *shared, chunk, mask=mask, sink=sink)  # padding rows add exactly 0
        if not adaptive:
            return summed, StepStats.of_chunk(mask, norms, losses, l2_clip_norm)
        c = shared[0]  # the traced threshold; an invalid one (unchecked while tracing) releases NaN, nothing
        ok = _checks.clip_norm_ok(c)
        summed = {k: torch.where(ok, v * c, torch.full_like(v, math.nan)) for k, v in summed.items()}
        return summed, StepStats.of_chunk(mask, norms * c, losses * c, c)

    if backend is None:
        return chunk_sums
    made: dict[bool, Callable] = {}  # (CUDA graphs?) -> the compiled chunk
    # nonfinite="raise": the graph drops such rows (ClippedGradSum.counting_nonfinite) and counts them in its
    # telemetry; the count is read here, before anything is added up or released (found by review: the graph's own
    # check, a Python branch on values, failed every compiled step with torch's data-dependent-guard error)
    raise_nonfinite = getattr(sum_fn, "raise_later", False)

    def compiled(params, mask, shared, chunk):
        graphs = backend == "inductor" and _cuda_graphs(params, mask)
        if graphs not in made:
            how = _compile_kwargs(backend, graphs, mask.device.type)
            made[graphs] = torch.compile(_fresh_function(chunk_sums), fullgraph=True, dynamic=False, backend=backend, **how)
        # the version counters around the compiled call, eagerly: a write into a param or buffer that the eager
        # one-sample check did not see (made on later calls only, or only under the compiler) lands on every chunk,
        # and the new params would tell how many chunks ran (found by review: released by compiled vmap and two_pass)
        watched = watch_writes(params, shared)
        traced = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        try:
            if not graphs:
                out = made[graphs](params, mask, shared, chunk)
            else:
                # each call is a step of Inductor's CUDA graph trees (the marker is process-wide: a caller's own
                # "reduce-overhead" functions share it), and its replay writes the outputs into the graph's
                # own memory, which the next replay (the next chunk's) overwrites: the sums are copied out
                # before anything adds them up
                torch.compiler.cudagraph_mark_step_begin()
                out = optree.tree_map(torch.clone, made[graphs](params, mask, shared, chunk), namespace="torch")
            _checked_after(sum_fn, params, shared, chunk, watched, traced)
        except Exception as err:
            # the graphs compiled so far are dropped: the one that ran a refused loss would be found in the cache
            # by a retry, which traces nothing and so checks nothing (found by review: a caller catching the
            # error released every later step); the next call compiles afresh, and is checked
            made.pop(graphs, None)
            explained = _explain_compile_error(err)
            if explained is None:
                raise
            raise explained from err
        if raise_nonfinite and bool(out[1].nonfinite > 0):  # (the graph is sound: kept; found by review, it was dropped)
            raise FloatingPointError(
                f"step(state, batch, mask): per-sample gradients of {int(out[1].nonfinite)} real rows of this chunk are not "
                "finite (NaN or inf) (compiled, the rows are not named: a step with compile=False names them). Fix the "
                "loss for those inputs, or pass nonfinite='zero' to drop their contribution (counted in metrics['nonfinite'])."
            )
        return out

    return compiled


def _checked_after(sum_fn: ClippedGradSum, params: Any, shared: tuple, chunk: Any, watched: list, traced: int) -> None:
    """After a compiled chunk, eagerly, before anything is released: no param or buffer written
    (``refuse_writes``), and where torch.compile traced anew during the call (a guard failed: a flag
    the loss reads outside its arguments changed), the one-sample check of the loss run again
    (found by review: a loss that stopped reading its sample at a later step was released by every
    compiled step, its shape checked once)."""
    refuse_writes("step(state, batch, mask)", watched)
    if torch._dynamo.utils.counters["stats"]["unique_graphs"] != traced:
        sum_fn.recheck(params, *shared, chunk)


def _cuda_graphs(params: dict[str, Tensor], mask: Tensor) -> bool:
    """Whether a compiled chunk replays a CUDA graph: on CUDA, for at most
    ``Limits.cuda_graph_elements`` trainable elements (a replay copies the params into the graph's
    memory and holds its parameter-sized sums there, which the step then copies out: about three
    parameter-sized buffers more than an eager step)."""
    limits = ghost_limits.LIMITS
    return mask.device.type == "cuda" and limits.cuda_graphs and sum(v.numel() for v in params.values()) <= limits.cuda_graph_elements


def _compile_kwargs(backend: str, graphs: bool, device_type: str) -> dict[str, Any]:
    """``torch.compile``'s mode or options for a chunk: Inductor's CUDA graphs where ``graphs``
    (one replay per chunk); on the CPU, Inductor without its layout optimization, which turns a
    graph's conv inputs channels-last: ghost's grouped conv backward (per-sample conv grads, the
    batch as groups) then reorders its result twice inside oneDNN, 2.3 ms of an 11 ms MNIST CNN
    step at B=128. Without it (2026-11-28, 2-core CPU, the compiled ghost step, interleaved in
    one process against the non-private eager step's 10.6 / 32.7 ms): 18.0 -> 16.0 ms at B=128,
    52.0 -> 39.1 ms at B=512, and a cold compile of 17 s instead of 27.

    Always Inductor's ``emulate_precision_casts``: its fused kernels otherwise keep bfloat16 /
    float16 intermediates in float32 where eager rounds them, so ghost's norm and its clipped sum,
    which read one output gradient through two kernels, saw it rounded differently, and a sample
    with cancelling terms was released at 1.43 C (found by review: two embedding tables added, bf16,
    compiled; eager and emulated 1.0000013 C)."""
    if backend != "inductor":
        return {}
    options: dict[str, Any] = {"emulate_precision_casts": True}
    if graphs:
        options["triton.cudagraphs"] = True  # (mode="reduce-overhead", which cannot be given with options)
    elif device_type == "cpu":
        options["layout_optimization"] = False
    return {"options": options}


def _explain_compile_error(err: BaseException) -> BaseException | None:
    """torch's compiler error, with the cause and the fix where vmapdp knows them (None: raise it as is)."""
    if "'version_info'" in str(err) and "not supported between" in str(err):
        return RuntimeError(
            _checks.optree_untraceable("step(state, batch, mask): the compiled step (compile=True) failed", torch.__version__, optree.__version__)
            + f" (torch said: {str(err).splitlines()[0][:200]})"
        )
    if "recompile" in type(err).__name__.lower() or "recompile_limit" in str(err):
        return RuntimeError(
            "step(state, batch, mask): the compiled step was recompiled until torch.compile's limit: an argument it "
            "specializes on changes from step to step (a Python float or int passed as a shared argument, such as a "
            "temperature, or a Python global the loss reads: each value compiles a graph of its own). Pass it as a "
            f"0-dim tensor (torch.tensor(t)), or use compile=False. (torch said: {str(err).splitlines()[0][:200]})"
        )
    return None


def make_train_step(
    loss_fn: Callable[..., Tensor],
    optimizer: Any,
    *,
    l2_clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: float | None = None,
    sample_rate: float | None = None,
    sampler: Any = None,
    physical_batch_size: int | None = None,
    method: str = "auto",
    norm_chunk_size: int | None = None,
    rule: str = "clip",
    nonfinite: str = "zero",
    randomness: str = "error",
    compile: bool | str = True,
    budget: tuple[float, float] | None = None,
    accountant: str = "pld",
    secure: bool = False,
    distributed: bool = False,
    precision: torch.dtype | None = None,
    privatizer: Privatizer | None = None,
    adaptive_clipping: _adaptive.AdaptiveClipping | None = None,
    sharding: Sharding | None = None,
    fixed_shapes: bool = True,
) -> Callable[..., tuple[TrainState, dict[str, Tensor]]]:
    """Build the DP-SGD step ``step(state, batch, mask, *shared) -> (new_state, metrics)``.

    Args:
        loss_fn: ``loss_fn(params, *shared, sample) -> scalar`` for ONE sample (as for
            :func:`vmapdp.per_sample_grads`; ``shared`` are e.g. the buffers).
        optimizer: an init/update pair from :mod:`vmapdp.optim`.
        l2_clip_norm: each sample's gradient is clipped to this L2 norm (the sensitivity).
        noise_multiplier: noise std / l2_clip_norm, > 0. ``0`` trains without privacy: the
            ledger then records a :class:`NonPrivateEvent` and epsilon is infinite (with a warning).
        expected_batch_size: the divisor of the noisy sum: ``sample_rate * dataset size``, a public
            constant. Never the realised batch size, which depends on the data and is private.
            With ``distributed=True`` it is the GLOBAL one (over all ranks, the whole dataset),
            not a rank's share. Default: ``sampler.expected_batch_size`` (required without a sampler).
            With a sampler that has not drawn (given for its events only), a batch's real rows are
            checked against what the sampler can draw (its fixed size or cap; at most ``E + 10 sqrt(E)
            + 20`` for its expected size ``E``, and outside a binomial draw's tail below 1e-17).
        sample_rate: the Poisson sampling rate the batches were drawn with (for the ledger); alone,
            it means Poisson sampling. Batches from anything else (fixed-size, shuffled, a
            DataLoader) with ``sample_rate=`` get a Poisson epsilon that is too small: pass
            ``sampler=`` instead.
        sampler: the :mod:`vmapdp.data` sampler the batches come from (``PoissonSampler``,
            ``FixedSizeSampler``, ``ShuffledSampler``, ``BallsInBinsSampler``,
            ``TruncatedPoissonSampler``, ``CyclicPoissonSampler``): each step records ``sampler.event(noise_multiplier)``,
            the event of the batch the sampler drew last, before anything is computed. So call
            the step on each batch as it is drawn (iterate the sampler; do not draw ahead): an
            epoch sampler's event says whether its last batch opened an epoch. Given with
            ``sample_rate`` the two must agree (ValueError otherwise). Fixed-size batches are
            accounted by RDP only: a budget with ``accountant="pld"`` is then enforced by the RDP
            bound (see :func:`vmapdp.accounting.within_budget`).
        physical_batch_size: split each batch into chunks of this many rows (use the sampler's
            ``capacity``: a rare overflowing step then reuses the compiled chunk). Default: one
            chunk of whatever size the batch has.
        method: how each chunk's clipped sum is computed: ``"auto"`` (default), ``"vmap"``,
            ``"ghost"`` or ``"two_pass"``; all exact, they differ in speed and memory (see
            :func:`vmapdp.clipped_grad_sum`). ``"auto"`` times the methods that apply
            (``vmapdp.clipped.auto_candidates``: ghost, and vmap or, for a model too large for it,
            two_pass) eagerly on the first chunk of each shape and keeps the fastest (``step.chosen_methods``); with ``compile``
            only that winner is compiled, then timed against its own eager run, and the chunk
            runs eagerly where that is faster (``step.chosen_runs``: ``"<method>"`` or
            ``"<method> eager"``): an "auto" step runs compiled only where that timed faster. On
            the CPU, a winner whose eager run spends ``Limits.compile_kernel_share`` (65%) of its
            time or more in convolutions, matrix products and sorts, which Inductor calls as they
            are, runs ``"<method> eager"`` without being compiled at all (the CIFAR-10 CNN: a 48 s
            cold compile that bought nothing), and so does, with a warning, one whose eager run
            dispatches more than ``Limits.compile_max_ops`` ATen ops (an unrolled time loop:
            the IMDb LSTM's took 6 minutes to compile); both from ``vmapdp.clipped.eager_profile``. What
            each chunk shape ran (named or chosen) is recorded in the new state
            (``state.methods``): a step on a state that has a choice for the shape replays it
            without racing, so a resumed run (``load_state``) is bit for bit the uninterrupted one.
        norm_chunk_size: for ``method="two_pass"`` (and "auto"'s two_pass): per-sample grads this many rows at a time
            (default: as many as keep them under ``Limits.two_pass_elements``, 2 GiB in float32).
        rule, nonfinite: see :func:`vmapdp.clip_and_sum`. ``nonfinite="raise"`` is a debugging
            switch, not private: whether a step raises (and the row it names) depends on who is
            in the batch (compiled, after the chunk's graph, which counts them: the rows are not
            named). The default ``"zero"`` drops such a sample (counted in ``metrics``).
        randomness: for random layers (dropout): ``"different"`` per sample; see
            :func:`vmapdp.per_sample_grads`. Random layers draw from :func:`step_seed` (a
            repeated step is bit for bit the first), but per chunk, per rank and per method: so
            with them the batch's split (``physical_batch_size``, ``norm_chunk_size``, the world
            size) joins the noise key, and ``"auto"`` does not race (a race's choice can differ
            between processes): it runs the first of :func:`vmapdp.clipped.auto_candidates`
            (ghost where it covers a param), compiled when ``compile``.
        compile: run each chunk's tensor work under ``torch.compile(fullgraph=True, dynamic=False)``:
            one graph per chunk shape and method (a run of Poisson steps padded to one capacity
            compiles once, whatever the masks and the adaptive clip norm). A named method is
            always compiled; ``"auto"`` may keep a chunk eager, compiled or not (see ``method``). Inductor's
            caches (on disk, in ``TORCHINDUCTOR_CACHE_DIR``) make a second process's compile
            warm; dynamo's tracing is redone in every process. A str names the
            ``torch.compile`` backend (``True`` is ``"inductor"``): ``"aot_eager"`` or ``"eager"``
            run dynamo's capture (and AOTAutograd's) of the same graph without code generation,
            which is how the test suite checks the compiled path of models whose Inductor compile
            takes minutes.
        budget: ``(epsilon, delta)``: a step that would take epsilon past it raises
            :class:`PrivacyBudgetExceeded` before computing anything. It is recorded in the new
            state (``state.budgets``, saved in checkpoints) and every budget a state holds is
            enforced too: a step with a looser budget or none cannot spend past a budget the run
            was ever given.
        accountant: the accountant for the budget check: ``"rdp"`` or ``"pld"`` (upper bounds;
            ``"gdp"`` is an approximation and is refused here).
        secure: draw the noise from the OS CSPRNG (the state must hold no seed).
        distributed: data-parallel on ``torch.distributed`` (:mod:`vmapdp.distributed`): call
            ``torch.distributed.init_process_group`` first (RuntimeError otherwise). Each rank passes
            its own rows (``vmapdp.distributed.sharded(sampler)``: disjoint shares of ONE global
            Poisson sample); the clipped sums and telemetry are summed over ranks in one
            ``all_reduce``, the noise is added once (the same key on every rank; with ``secure``
            rank 0 draws it and broadcasts the noisy sum), and every rank ends with identical
            params, equal to one process stepping on all rows. Every rank must step the same state
            (same ``seed=``, or ``load_state`` on every rank): checked each step, ValueError on
            every rank otherwise. ``metrics`` are then global.
        precision: bfloat16/float16 compute for the per-sample grads (:func:`vmapdp.mixed_precision`).
        privatizer: how the summed clipped gradients become a release, a
            :class:`vmapdp.noise.Privatizer` called once per step as
            ``privatize(summed, state.noise_state, key)``; its state is carried in
            ``state.noise_state`` (make the state with ``init_train_state(..., privatizer=)``).
            Default: ``gaussian_privatizer(noise_multiplier * l2_clip_norm, secure=secure)``, the
            noise the ledger records; another one must give at least its privacy. A privatizer
            with a ``bind`` hook (correlated noise, :func:`vmapdp.mf.correlated_noise`) is bound
            here to ``noise_multiplier``, the clip norm and ``sampler``, and decides the event each
            step records (it refuses a sampler it has no analysis for). With ``secure``
            and ``distributed``, rank 0 alone privatizes and broadcasts the release and the state
            (:func:`vmapdp.distributed.privatized_on_rank0`).
        adaptive_clipping: a :class:`vmapdp.AdaptiveClipping` (Andrew et al. 2021): the clip norm
            starts at ``l2_clip_norm`` and follows a privately estimated quantile of the per-sample
            norms; the threshold is carried in ``state.clip_norm`` and enters the compiled chunk
            as a traced 0-dim tensor (each sample's gradient is that of ``loss / C_t`` clipped to 1,
            times ``C_t``: exact, one graph for every threshold). The count of unclipped samples is
            released with its own noise ``count_noise_multiplier``; the gradient noise uses the
            paper's split ``sigma_grad = (noise_multiplier^-2 - (2 count_noise_multiplier)^-2)^(-1/2)``,
            so the step as a whole is the Gaussian mechanism at ``noise_multiplier`` that the ledger
            records. Both releases go through the privatizer seam: ``privatizer`` gets the clipped
            sum in units of ``C_t`` (its default noise std is ``sigma_grad * l2_sensitivity``; a
            given one must give at least that privacy) and its release is multiplied by ``C_t``;
            the count is a second privatizer (:meth:`AdaptiveClipping.count_privatizer`) drawn from
            its own key. With ``distributed`` the count is summed over ranks with the clipped sums
            (the same all_reduce). ``rule="clip"`` only.
            ``metrics`` then add ``clip_norm`` (the threshold used) and ``unclipped_estimate``
            (the private estimate of the unclipped fraction; both public).
        sharding: a :class:`vmapdp.sharding.Sharding`: data-parallel as ``distributed=True``
            (implied), with the params and the optimizer state sharded over the ranks (the state
            from ``init_train_state(..., sharding=)``). Each step gathers the params (the whole model
            before the forward, or each parameter at each use: ``Sharding(params, unshard=)``), each rank
            clips and sums its own rows, the sums are reduce-scattered to the shards' owners, each
            owner adds the noise of its shard (the slice of the unsharded step's noise) and
            updates its shard. Equal to one process on all rows up to summation order. The
            default Gaussian privatizer (``secure`` included: each owner then draws its shard's
            noise from its own CSPRNG) or correlated noise (:func:`vmapdp.mf.correlated_noise`,
            bound with the shard layout: each owner keeps and advances the buffers of its shards
            only; the state from ``init_train_state(..., privatizer=, sharding=)``); other
            privatizers are refused. With ``adaptive_clipping`` the count of unclipped samples is
            summed over ranks with the telemetry and noised once under the same key (``secure``:
            by rank 0, broadcast), so every rank gets the same next clip norm.
        fixed_shapes: refuse (before anything is released) a batch whose per-sample shapes (every
            leaf's shape past the batch dim) differ from the first batch this step took. A sample's
            shapes must not depend on the data: a batch padded to its longest row makes each
            sample's computation depend on the others' lengths (a model's positions, ghost's
            rounding margins: one crafted sample moved the others' clipped sums by 2.2 C), so
            pad to a fixed length. The first batch cannot be checked against anything: this
            catches a data-dependent padding at the second step. ``False``: shapes that change on
            a public schedule (never with the rows drawn).

    Returns:
        ``step(state, batch, mask, *shared)``. ``batch`` is a pytree with leading dim ``n``
        (a multiple of ``physical_batch_size`` when given), ``mask`` a bool ``[n]`` (False rows are
        padding and contribute exactly nothing, even if they hold NaN). ``metrics`` are
        **non-private telemetry** computed from the data without noise (mean loss over real rows,
        number of real rows, clip fraction, mean per-sample norm, non-finite samples dropped):
        fine for debugging, not for release. ``step`` raises
        :class:`vmapdp.noise.NoiseKeyReused` (nothing returned) for a state this process already
        stepped on other data (see :mod:`vmapdp.noise.spent`; checks that step one state on purpose
        run inside :func:`vmapdp.noise.unreleased`).
    """
    call = "make_train_step(loss_fn, optimizer)"
    _checks.loss_function(call, loss_fn)
    secure, fixed_shapes, distributed = (_checks.flag(call, k, v) for k, v in (("secure", secure), ("fixed_shapes", fixed_shapes), ("distributed", distributed)))
    if precision is not None:
        loss_fn = mixed_precision(loss_fn, precision)  # float32 params, clipping and noise
    _checks.optimizer(call, optimizer)
    if privatizer is not None:
        _checks.privatizer(call, privatizer)
    noise_multiplier = _checks.noise_multiplier(call, noise_multiplier, allow_zero=True)
    l2_clip_norm = _checks.positive(call, "l2_clip_norm", l2_clip_norm, allow_inf=noise_multiplier == 0, meaning=_checks.CLIP_MEANING)
    sample_rate, sampler = _checks.batch_scheme(call, sample_rate, sampler)
    if expected_batch_size is None and sampler is not None:
        expected_batch_size = sampler.expected_batch_size
    elif expected_batch_size is None:  # (found by review: "must be a real number, got NoneType" said neither)
        raise TypeError(
            f"{call}: expected_batch_size is required with sample_rate= alone: the public divisor of the noisy sum, "
            "sample_rate * num_samples (e.g. expected_batch_size=sample_rate * len(dataset)). Or pass sampler=, which knows it."
        )
    expected_batch_size = _checks.positive(call, "expected_batch_size", expected_batch_size, meaning="the public divisor of the noisy sum")
    # the size the charged sampling draws on average: the sampler's (a given expected_batch_size is the divisor
    # only, the caller's choice: 1.0 releases the noisy sum itself); unknown with sample_rate= alone (not checked)
    drawn_size = sampler.expected_batch_size if sampler is not None else None
    physical_batch_size = _checks.optional_positive_int(call, "physical_batch_size", physical_batch_size)
    # (a sampler knows its dataset's size: a budget at delta >= 1/n protects nobody; found by review: (1.0, 0.2) on 100 rows was taken)
    own_budget = _check_budget(call, budget, accountant, getattr(sampler, "num_samples", None))
    if own_budget is not None and noise_multiplier == 0:  # (found by review: taken here, refused at the first step)
        raise ValueError(
            f"{call}: budget={budget!r} with noise_multiplier=0: a step without noise is not private (epsilon is "
            "infinite), so every step would be refused. Pass a positive noise_multiplier, or no budget for a non-private run."
        )
    if adaptive_clipping is not None:
        if not isinstance(adaptive_clipping, _adaptive.AdaptiveClipping):
            raise TypeError(f"{call}: adaptive_clipping must be a vmapdp.AdaptiveClipping(count_noise_multiplier=...), got {type(adaptive_clipping).__name__}.")
        adaptive_clipping.check_step(call, noise_multiplier=noise_multiplier, l2_clip_norm=l2_clip_norm, rule=rule)
    if sharding is not None:
        _checks.sharding(call, sharding, privatizer=privatizer, method=method, compile=compile)
        if not getattr(optimizer, "elementwise", True):
            # (found by review: from_torch(torch.optim.Adafactor), which scales by each param's RMS, updated the 1-D
            # shards with their own statistics, 0.116 off one process's params after 3 steps; an empty shard raised
            # after the noise on some ranks only)
            raise ValueError(
                f"{call}: sharding= updates each rank's slice of every param, which only an element-wise optimizer allows, "
                f"and {optimizer.config.split('(')[0] or 'this optimizer'} is not known to be one (its update of a coordinate "
                "may read others: a param's norm or RMS, row and column moments). Use vmapdp.optim's sgd, adam or adamw, or "
                "from_torch of SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta, ASGD or Rprop."
            )
        distributed = True  # data-parallel with sharded state
    if distributed:
        _dist.require_initialized(call)
        if sampler is None and _dist.world_size() > 1:
            # (found by review: every rank stepping the whole global batch, sharded() forgotten, was charged as one
            # batch; only the rows' total is checked then, and up to about 5 ranks' copies pass it)
            warnings.warn(
                f"{call}: distributed with sample_rate= alone: the step cannot check that the ranks' rows are one draw "
                "dealt out (each rank stepping the whole batch, each example on every rank, would be charged as one "
                "batch). Pass sampler= (the sampler vmapdp.distributed.sharded deals): the step then compares the ranks' "
                "rows with its draw.",
                UserWarning,
                stacklevel=2,
            )
    _checks.choice(call, "method", method, METHODS, why="see vmapdp.clipped_grad_sum")
    backend = _checks.compile_backend(call, compile)
    compile = backend is not None
    _budget_accountant(call, accountant)
    random_layers = randomness != "error"  # (their draws depend on the batch's split and the method: see randomness)
    # "auto" races the methods that apply on the first chunk of each shape (auto_candidates; two_pass's made when raced)
    methods = ("ghost", "vmap") if method == "auto" else (method,)
    sum_loss, sum_clip = loss_fn, l2_clip_norm
    if adaptive_clipping is not None:  # clip(g, C) = C * clip(g / C, 1), and g / C is the gradient of loss / C

        def sum_loss(params, clip_norm, *rest):
            return loss_fn(params, *rest) / clip_norm

        form = _precision.scaled_form(loss_fn)
        if form is not None:  # (a float16 loss with a static loss_scale: ghost's form, divided alike; found by
            scale, scaled = form  # review: without it ghost ran the unscaled form, its coverage lost)
            _precision.mark_scaled_form(sum_loss, scale, lambda params, clip_norm, *rest: scaled(params, *rest) / clip_norm)
        sum_clip = 1.0

    def new_sum_fn(m: str) -> ClippedGradSum:
        return clipped_grad_sum(sum_loss, l2_clip_norm=sum_clip, method=m, norm_chunk_size=norm_chunk_size, rule=rule, nonfinite=nonfinite, randomness=randomness)

    sum_fns = {m: new_sum_fn(m) for m in methods}
    l2_sensitivity = sum_fns[methods[0]].l2_sensitivity  # what one sample can move the clipped sum by
    # with adaptive clipping the privatizer sees the sum in units of the threshold, and the gradient's share of the noise
    grad_noise = noise_multiplier if adaptive_clipping is None else adaptive_clipping.gradient_noise_multiplier(noise_multiplier)
    default_std = grad_noise * l2_sensitivity if noise_multiplier > 0 else 0.0  # the default Gaussian privatizer's
    noise_config = ""
    bound_noise = privatizer is not None and getattr(privatizer, "bind", None) is not None
    if bound_noise:  # it decides its noise and the ledger's event
        if adaptive_clipping is not None:
            raise ValueError(
                f"{call}: a privatizer that decides its own noise and ledger event (correlated noise) cannot run with adaptive_clipping: "
                "no published analysis covers the pair. Drop adaptive_clipping=, or use the default Gaussian privatizer."
            )
        layout = {} if sharding is None else {"offsets": sharding.offsets}  # sharded: the sums are this rank's shards
        privatizer, event, noise_config = privatizer.bind(
            call, noise_multiplier=noise_multiplier, l2_sensitivity=l2_sensitivity, sample_rate=sample_rate, sampler=sampler, secure=secure, **layout
        )
    else:
        event = _ledger_event(call, noise_multiplier, sample_rate, sampler)
        known_std = getattr(privatizer, "std", None)
        if known_std is not None and known_std < default_std * (1 - 1e-12):
            units = " (with adaptive_clipping the privatizer noises the sum in units of the clip threshold C_t: its std is the gradient's noise multiplier)" if adaptive_clipping is not None else ""
            raise ValueError(
                f"{call}: the privatizer adds Gaussian noise of std {known_std!r}, but the ledger charges every step as noise of "
                f"std noise_multiplier x sensitivity = {default_std!r}{units}: the release would be less private than the "
                "epsilon reported. Leave privatizer= out (the default is that noise), or give gaussian_privatizer(std) at "
                "least that std. Nothing was released."
            )
        if privatizer is not None:  # one of the caller's: what it releases joins the key (Privatizer.config), unless it is the default's
            if getattr(privatizer, "config", "") != gaussian_privatizer(default_std, secure=secure).config:
                noise_config = f"privatizer={getattr(privatizer, 'config', '')}"
    config = step_config(
        l2_clip_norm=l2_clip_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
        rule=rule,
        nonfinite=nonfinite,
        randomness=randomness,
        method=method,
        precision=precision,
        optimizer=getattr(optimizer, "config", ""),
        sampler=scheme_description(sampler),
        adaptive="" if adaptive_clipping is None else adaptive_clipping.config(),
        noise=noise_config,
        # random layers (randomness != "error") draw per chunk and per rank, so the split of a batch changes what a step
        # releases, not only its rounding: bound then, so that a run resumed with another split never repeats a key with
        # another value (found by review: physical_batch_size None against 4, 3.27 C; 2 ranks against one, 2.19 C)
        layout="" if not random_layers else repr((
            ("physical_batch_size", physical_batch_size), ("norm_chunk_size", norm_chunk_size),
            ("two_pass_elements", ghost_limits.LIMITS.two_pass_elements), ("world_size", _dist.world_size() if distributed else 1),
        )),
    )
    stateless = privatizer is None  # the default Gaussian: no noise state (a state that has one belongs to another privatizer)
    if privatizer is None:
        offsets = None if sharding is None or secure else sharding.offsets  # a shard's noise: its slice of the leaf's stream
        privatizer = gaussian_privatizer(default_std, secure=secure, offsets=offsets)
    count_privatizer = None if adaptive_clipping is None else adaptive_clipping.count_privatizer(secure=secure)
    if secure and distributed:  # the OS CSPRNG differs per rank: rank 0 privatizes, every rank gets its release
        if sharding is None:  # (sharded, each owner draws its own shards' noise)
            privatizer = _dist.privatized_on_rank0(privatizer)
        count_privatizer = count_privatizer and _dist.privatized_on_rank0(count_privatizer)  # one count for every rank

    # unshard="use": each param's clipped sum is reduce-scattered as soon as it is formed (ghost) or at
    # the end of its chunk (the other methods), so the full sums never exist all at once
    scattered = sharding is not None and sharding.unshard == "use"
    sink = sharding.reduce_scatter_one if scattered else None
    # ... and each chunk (two_pass: each norm chunk) makes its own gathers and reduce-scatters: the ranks must chunk alike
    # (two_pass's default chunk follows Limits.two_pass_elements, which a rank may have tuned: compared too; found by review)
    chunking = (
        (("physical_batch_size", physical_batch_size), ("norm_chunk_size", norm_chunk_size), ("two_pass_elements", ghost_limits.LIMITS.two_pass_elements))
        if scattered else None
    )
    chunk_fn = functools.partial(_chunk_function, l2_clip_norm=l2_clip_norm, adaptive=adaptive_clipping is not None, sink=sink)
    chunk_fns: dict[tuple[str, bool], Callable] = {}  # (method, compiled) -> chunk function, made on first use
    # "auto"'s choices per chunk shape: the method (raced eagerly), then, when compiling, whether the compiled
    # winner beats its eager run; distributed, every rank runs rank 0's choice (each timed its own rows)
    # (agreed in one collective that every rank reaches, a rank whose probe or race raised included: found by
    # review, such a rank skipped the broadcast and left the others waiting; by name among every run "auto" can
    # choose, not by position in a rank's own candidates, which depend on its rows)
    agree = (lambda pick: _AUTO_RUNS[_dist.rank0_choice("step(state, batch, mask)", lambda: _AUTO_RUNS.index(pick()))]) if distributed else None
    chooser, compiled_or_eager = AutoChooser(agree=agree), AutoChooser(agree=agree)
    digests: dict[tuple, str] = {}  # chunk shape -> its stable digest (the key of TrainState.methods)
    first_shapes: list[tuple] = []  # the per-sample shapes of the first batch (fixed_shapes)

    def runner(ran: str) -> Callable:
        """The chunk function of a recorded choice ``ran``: ``"<method>"`` (compiled when ``compile``)
        or ``"<method> eager"`` (a compiled step's "auto" found the eager run faster)."""
        name, eager = _parse_ran(ran)
        compiled = compile and not eager
        if (name, compiled) not in chunk_fns:
            if name not in sum_fns:
                sum_fns[name] = new_sum_fn(name)
            fn = sum_fns[name]
            if compiled and nonfinite == "raise":  # (whether to raise depends on values: a graph cannot; checked after it)
                fn = fn.counting_nonfinite()
            chunk_fns[name, compiled] = chunk_fn(fn, backend=backend if compiled else None)
        return chunk_fns[name, compiled]

    def _not_compiled(run: Callable, device: torch.device, name: str) -> bool:
        """Whether a CPU chunk is better not compiled, from its eager run (``eager_profile``; rank
        0's measure, distributed): it spends ``Limits.compile_kernel_share`` of its time or more in
        kernels Inductor calls as they are (compiling it cannot pay), or it dispatches more than
        ``Limits.compile_max_ops`` ATen ops, a graph whose compile would take minutes (an unrolled
        time loop: warned, as the compiled step might have run faster). Inductor only: another
        backend (tests) always compiles."""
        if device.type != "cpu":
            return False
        profile = None

        def decide() -> int:
            nonlocal profile
            profile = eager_profile(run, device)
            bound = profile.kernel_share >= ghost_limits.LIMITS.compile_kernel_share
            too_big = not bound and profile.ops > ghost_limits.LIMITS.compile_max_ops  # (warned: compiled, it might run faster)
            return 2 * int(bound or too_big) + int(too_big)

        skip, too_big = divmod(_dist.rank0_choice("step(state, batch, mask)", decide) if distributed else decide(), 2)
        if too_big:
            warnings.warn(
                f"{call}: method='auto' runs its {name!r} chunks eagerly, not compiled: one eager run dispatches "
                f"{profile.ops} ATen ops (more than Limits.compile_max_ops = {ghost_limits.LIMITS.compile_max_ops}; an "
                "unrolled loop such as a recurrent layer's time steps), and compiling a graph that size takes minutes "
                "(the IMDb LSTM benchmark model, 256 steps: ~12k ops, 6 min on a 2-core CPU, after which its steps ran "
                f"3.5x faster). To compile it anyway, name the method (method={name!r}, compile=True); compile=False "
                "silences this.",
                UserWarning,
                stacklevel=6,
            )
        return bool(skip)

    def method_for(recorded: dict[str, str], params, shared, chunk, mask) -> tuple[str, str]:
        """What the chunk runs (``"<method>"`` or, chosen by a compiled "auto", ``"<method> eager"``)
        and its shape digest; its plan made (and the loss checked) eagerly, once per shape and floats'
        values, to keep the compiled graph free of it. ``recorded``: the state's choices (replayed by "auto")."""
        key = shape_key((params, *shared, chunk))
        if method != "auto":  # (prepared before its run: planned and checked once per shape and floats' values)
            sum_fns[method].prepare(params, *shared, chunk)
        digest = digests.get(key)
        if digest is None:
            digest = digests[key] = _shape_digest(key)
        if method != "auto":
            return method, digest
        name = chooser.get(key)  # (a later chunk of this shape finds the plan made here)
        if name is None and _parse_ran(recorded.get(digest)) is not None:  # replay the state's choice: no race
            ran = recorded[digest]
            name = chooser.replay(key, _parse_ran(ran)[0])
            compiled_or_eager.replay(key, ran)
            runner(ran)
        elif name is None:

            def fastest() -> str:
                # the race runs each candidate eagerly: only the winner is ever compiled
                plan = sum_fns["ghost"].prepare(params, *shared, chunk)
                names = auto_candidates(plan, params, batch_size(chunk, call=call), norm_chunk_size)
                if random_layers:  # random layers draw differently under each method: no race (see make_train_step)
                    return names[0]
                return race({m: functools.partial(runner(f"{m} eager"), params, mask, shared, chunk) for m in names}, mask.device)

            name = chooser.choose(key, fastest)
        sum_fns[name].prepare(params, *shared, chunk)  # (the winner's own plan and check, before it runs compiled)
        ran = compiled_or_eager.get(key)
        if ran is None and random_layers:  # (as the step was made: compiled when compile)
            ran = compiled_or_eager.replay(key, name)
        if ran is None:  # compiled: keep the compiled winner only where it beats the eager one
            names = [name, f"{name} eager"] if compile else [name]
            if backend == "inductor" and _not_compiled(functools.partial(runner(f"{name} eager"), params, mask, shared, chunk), mask.device, name):
                names = [f"{name} eager"]  # compiling could not pay for itself (or would take minutes): not compiled at all
            ran = compiled_or_eager.choose(key, lambda: race({r: functools.partial(runner(r), params, mask, shared, chunk) for r in names}, mask.device))
        return ran, digest

    def clipped_sums(state: TrainState, params: dict, batch: Any, mask: Tensor, shared: tuple, n: int) -> tuple[tuple[Any, StepStats], tuple]:
        """The clipped sum and telemetry of the batch at ``params`` (the full ones), chunk by
        chunk, and the methods the state records (each chunk shape's, with this batch's added)."""
        if scattered:  # the same chunks on every rank (padded with masked rows): see _same_chunks
            batch, mask, n = _same_chunks(batch, mask, n, physical_batch_size)
        size = physical_batch_size or max(n, 1)
        _check_rows(n, size)  # (the step checks it before its same-state check; scattered: _same_chunks padded to a multiple)
        total, recorded = None, dict(state.methods)
        # (unshard="use": the gathers and reduce-scatters run inside the chunks; a rank that fails there tells the others)
        with sharding.failures_told("step(state, batch, mask)") if scattered else contextlib.nullcontext():
            for start in range(0, n, size):
                chunk = optree.tree_map(lambda x: x[start : start + size], batch, namespace="torch")
                chunk_mask = mask[start : start + size]
                # (no TF32 on CUDA, the race included: the norm/sum margins assume float32; the per-call check that the loss
                # reads its sample on the step's first chunk only: nothing of the caller's runs between its chunks)
                with full_float32(mask.device.type), one_check_per_step(start > 0):
                    name, digest = method_for(recorded, params, shared, chunk, chunk_mask)
                    part = runner(name)(params, chunk_mask, shared, chunk)
                recorded[digest] = name
                total = part if total is None else optree.tree_map(torch.add, total, part, namespace="torch")
        if total is None:  # an empty batch: the step still releases noise
            total = zero_sums(state, params, mask.device)
        return total, tuple(sorted(recorded.items()))

    def zero_sums(state: TrainState, params: dict, device: torch.device) -> tuple[Any, StepStats]:
        """The clipped sums and telemetry of no rows (the structure every rank's reduction expects)."""
        shapes = {k: state.params[k].shape if scattered else v.shape for k, v in params.items()}  # (scattered: the sums are shards)
        zeros = {k: torch.zeros(shapes[k], dtype=torch.promote_types(v.dtype, torch.float32), device=v.device) for k, v in params.items()}
        return zeros, StepStats.zeros(device)

    def step(state: TrainState, batch: Any, mask: Tensor, *shared: Any) -> tuple[TrainState, dict[str, Tensor]]:
        inflight: list[tuple[bytes, int]] = []  # the noise key this call releases under (vmapdp.noise.spent)
        try:
            return _step(state, batch, mask, shared, inflight)
        finally:
            for run, at in inflight:
                _spent.SPENT.done(run, at)

    def _step(state: TrainState, batch: Any, mask: Tensor, shared: tuple, inflight: list) -> tuple[TrainState, dict[str, Tensor]]:
        scall = "step(state, batch, mask)"
        failed = None  # distributed: what this rank's own checks raised, raised on every rank by the same-state check
        try:
            n, mask = _checked_inputs(scall, state, batch, mask, secure)
            _checks.no_nan_shared(scall, shared)
            shapes = sample_shapes(batch) if fixed_shapes else None
            if fixed_shapes:
                _check_shapes(scall, first_shapes, shapes)
            sampler_id = _check_sampler_position(scall, sampler, state.step, distributed, bound=bound_noise, recorded=state.sampler_id)
            if not distributed and _spent.recording():  # (distributed: the ranks' shares, summed after the reduction:
                _check_drawn_rows(scall, sampler, mask, drawn_size)  # _check_dealt_rows; unreleased(): the audit's)
            if stateless and _leaves(state.noise_state):
                # a correlated-noise state stepped by the default Gaussian: its buffers' step count would
                # lag the sampler's groups, and later correlated steps would put an example's
                # participations closer than the band (sensitivity 1.54 where the ledger charged 1.41;
                # found by review)
                raise ValueError(
                    f"{scall}: the state carries a privatizer's noise state (correlated noise: {type(state.noise_state).__name__}) "
                    "but this step has none (the default Gaussian noise): pass the privatizer the state was made with "
                    "(make_train_step(..., privatizer=...)). Nothing was released."
                )
            if not bound_noise and is_correlated_state(state.noise_state):
                # (an explicit gaussian_privatizer, say: it passes the buffers through unchanged, and later correlated
                # steps would continue them at another point of the sampler's groups; found by review)
                raise ValueError(
                    f"{scall}: the state carries correlated noise's state (its step count and buffers) but this step's "
                    "privatizer is not that correlated noise: it would pass the buffers through, and later correlated steps "
                    "would continue them out of step with the sampler's groups. Step it with make_train_step(..., "
                    "privatizer=correlated_noise(...)), the one it was made with. Nothing was released."
                )
            if bound_noise:
                fix = ("Make the noise state with the run (init_train_state(..., privatizer=)) and carry it from step to step, "
                       "or resume a checkpoint whole (load_state). Nothing was released.")
                check_noise_position(scall, state.noise_state, state.step, period=privatizer.period or None, fix=fix)
                if is_correlated_state(state.noise_state):
                    state = state._replace(noise_state=check_noise_owner(scall, state.noise_state, state.noise_seed, state.run_id, state.step, fix))
            ledger, budgets = _charged(scall, state, event(), own_budget, getattr(sampler, "num_samples", None))  # before anything is computed or released
            if not scattered:  # a rank's own refusal, raised on every rank at the check (scattered: _same_chunks decides on all ranks)
                _check_rows(n, physical_batch_size or max(n, 1))
            if distributed and method in ("vmap", "two_pass") and sharding is None:
                # per-sample grads past this rank's free memory: refused here, so that the other ranks are told at
                # the check instead of waiting in the reduction (one process: the chunk's own check, later, suffices)
                # ("auto" is not checked here: its race drops a candidate that does not fit, which a refusal would not)
                rows = min(n, physical_batch_size or n)
                rows = min(rows, norm_chunk_size or two_pass_chunk(state.params)) if method == "two_pass" else rows
                check_per_sample_grads_fit(scall, method, rows, state.params, copied=lambda: not bool(mask.all()))
            if sharding is not None:  # this rank's shards (step_params would refuse them after the check, in the first gather)
                sharding.check_local(scall, state.params)
            clip = None
            if adaptive_clipping is not None:  # the threshold enters the compiled chunk as a traced tensor
                clip = _adaptive.initial_clip_norm(l2_clip_norm, mask.device) if state.clip_norm is None else state.clip_norm
                clip = _adaptive.check_clip_norm(scall, clip)
                shared = (clip, *shared)
            binding = noise_binding(state.run_id, config)
            # (no noise, nothing to cancel: such a step is charged as non-private; secure: a fresh key per step)
            run = None if secure or noise_multiplier == 0 or not _spent.recording() else _spent.SPENT.run_digest(state.noise_seed, binding)
            repeat = run is not None and _spent.SPENT.check(scall, run, state.step)  # (raises where another thread releases it now)
            if run is not None:
                inflight.append((run, state.step))
        except Exception as err:
            if not distributed:
                raise
            failed = err  # (the other ranks would wait in the step's first collective until the group's timeout)
        # the same-state check, before the step's first collective (ranks that disagree would gather or choose differently)
        # (and the sampler's id where every rank draws its own batches: ranks under other keys would
        # put an example in other groups on each rank; found by review)
        same = None if failed else (
            state.noise_seed, state.step, binding, state.ledger.to_json(), None if clip is None else float(clip), repeat,
            _compared_sampler_id(sampler, sampler_id),
            # "auto" chooses once per chunk shape, in a collective: ranks whose chunks differ in shape would
            # reach it at different steps (one rank's new shape is another's known one) and wait in it
            # (scattered: _same_chunks gives every rank the same chunks); and the choices the state records, which
            # a rank replays without the collective (found by review: a rank whose state recorded none raced and
            # waited in the collective while the other, replaying, was in the reduction)
            (_chunk_shapes(batch, mask, shared, n, physical_batch_size), state.methods) if method == "auto" and not scattered else None,
        )
        if sharding is not None:  # and what sharded ranks hold or do per rank: the noise state's replicated part, the collectives
            same = same and same + (sharding.replicated(state.noise_state), sharding.unshard, chunking)
            sharding.check_step(scall, same, error=failed)
        elif distributed:  # and the noise state (correlated noise: its step count and buffers), which every rank holds whole
            _dist.check_step(scall, same and same + (_dist.state_summary(state.noise_state),), error=failed)
        params = state.params if sharding is None else sharding.step_params(state.params)  # full params, or gathered on use
        # random layers draw from a seed of the state's (step_seed): a resumed step draws them again bit for bit
        seed = step_seed(state, "model", _dist.rank() if distributed else 0) if random_layers else None  # (sharded: distributed)
        failed = None  # distributed: what this rank's per-sample work raised, raised on every rank after the reduction
        try:
            with seeded_randomness(seed, mask.device):
                (summed, stats), methods = clipped_sums(state, params, batch, mask, shared, n)
        except BaseException as err:  # (a KeyboardInterrupt too: failures_told tells the others of it, who reset)
            if scattered:  # every rank raises here at once (Sharding.failures_told), each stopped at its own point of a
                # first call's work (one rank's plan probed and kept, another's not): all start the next step cold, or their
                # gathers would differ (found while testing: the next step's gathers paired up wrongly and gloo aborted)
                sum_fns.update({m: new_sum_fn(m) for m in sum_fns})
                chunk_fns.clear()
            if not distributed or scattered or not isinstance(err, Exception):
                raise
            # the other ranks are in the reduction already: join it with nothing, then every rank raises in
            # _check_dealt_rows, before the noise (a model that raised on one rank's rows, or "auto"'s choice that
            # did not fit one rank's memory, left the others waiting in the reduction until the group's timeout)
            failed = err
            (summed, stats), methods = zero_sums(state, params, mask.device), state.methods
        del params
        if sharding is not None:  # each owner gets the global sum of its shards
            summed, stats = sharding.reduce_step(scall, summed, stats, same, scattered=scattered, checked=True)
        elif distributed:  # sum over ranks (one all_reduce)
            summed, stats = _dist.all_reduce_step(scall, summed, stats, (state.noise_seed, state.step, binding), checked=True)
        if distributed:
            _check_dealt_rows(scall, sampler, stats.rows, drawn_size, failed=failed)
        key = None if secure else _step_key(state.noise_seed, state.step, binding)
        new_clip, noise_state, extra = state.clip_norm, state.noise_state, {}
        if adaptive_clipping is None:
            noisy, noise_state = privatizer.privatize(summed, state.noise_state, key)
        else:
            noisy, count, noise_state = adaptive_clipping.release(summed, stats, clip, key, state.noise_state, privatizer=privatizer, count_privatizer=count_privatizer)
            new_clip, estimate = adaptive_clipping.next_clip_norm(clip, count, expected_batch_size)
            extra = {"clip_norm": clip, "unclipped_estimate": estimate}
        if run is not None:  # a key spent before: released again only as a recomputation (vmapdp.noise.spent)
            fingerprint = _spent.release_fingerprint((noisy, extra))
            if repeat:  # (every rank agrees on repeat: it is in the same-state check; the verdict is collective)
                differs = _spent.SPENT.differs(run, state.step, fingerprint)
                if distributed or sharding is not None:
                    differs = bool(_dist.max_ints([int(differs)])[0])
                if differs:
                    raise _spent.refuse(scall, state.step)
        # the sums, the noisy sums and the update are each the params' size: only the update is alive
        # while the optimizer runs (with its copies, it dominates the step's peak on a large model)
        del summed
        update = {k: v / expected_batch_size for k, v in noisy.items()}
        del noisy
        params, opt_state = optimizer.update(update, state.opt_state, state.params)
        new_state = TrainState(params, opt_state, state.noise_seed, state.step + 1, ledger, state.run_id, budgets, methods, noise_state, new_clip, sampler_id)
        if run is not None:
            _spent.SPENT.record(run, state.step, fingerprint)
        if fixed_shapes and not first_shapes:  # (a first call that raised records nothing)
            first_shapes.append(shapes)
        return new_state, {**stats.metrics(), **extra}


    step.chosen_methods = chooser.chosen  # type: ignore[attr-defined]
    step.chosen_runs = compiled_or_eager.chosen  # type: ignore[attr-defined]
    # (how its ranks take part, for vmapdp.audit.check_sensitivity: one sample added to the global batch)
    step.distributed = distributed  # type: ignore[attr-defined]  (True for a sharded step too)
    step.sharded = sharding is not None  # type: ignore[attr-defined]
    return step
