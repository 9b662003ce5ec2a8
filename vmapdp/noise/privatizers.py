"""The privatizer seam: how the train step turns the aggregated clipped sum into a release.

A :class:`Privatizer` is an ``init``/``privatize`` pair of pure functions, like the optimizers
of :mod:`vmapdp.optim`::

    noise_state = privatizer.init(params)                                   # init_train_state
    noisy, noise_state = privatizer.privatize(summed, noise_state, key)     # once per step

``make_train_step`` calls ``privatize`` once per logical step, after the clipped sums of every
chunk (and every rank) are summed and after the ledger has recorded the step; its state is
``TrainState.noise_state``, carried from step to step and saved by checkpoints. ``key`` is the
step's secret noise key (bytes, derived from the state's seed, step, run and configuration), or
``None`` for a ``secure`` run, whose noise comes from the OS CSPRNG.

:func:`gaussian_privatizer` is the default: independent ``N(0, std**2)`` per coordinate, no
state, each released value snapped to a grid of ``std/128`` to ``std/64`` against floating-point
attacks (``add_noise``'s default; :mod:`vmapdp.noise.gaussian`). Noise that needs state (correlated noise from a matrix factorization keeps a few buffers
of past draws) or another generator plugs in here without touching the step.

What the ledger records: for a privatizer without ``bind`` (the default Gaussian, or one of
yours), the step's event at its ``noise_multiplier``; such a privatizer must give at least the
privacy of Gaussian noise of std ``noise_multiplier * l2_sensitivity`` on each step's sum, and
should release through ``add_noise`` (or, drawing its noise itself, through
:func:`vmapdp.noise.snapped_release`), whose rounding to a grid keeps the input's low bits out of
the released floats. Noise
correlated across steps has no per-step guarantee of that kind, so its privatizer has a ``bind``
hook (:func:`vmapdp.mf.correlated_noise`): ``make_train_step`` calls it once with its
configuration and gets back the privatizer to run, the event each step records, and the
mechanism's description (bound into the noise key).

Correlated noise's state counts the steps it has noised (``t``); the step and ``load_state``
refuse one that does not fit the train state's step (:func:`check_noise_position`).
"""

from __future__ import annotations

import hashlib

from typing import Any, Callable, NamedTuple

import torch

from vmapdp import _checks
from vmapdp.noise.gaussian import _noise_dtype, add_noise

__all__ = ["Privatizer", "check_noise_owner", "check_noise_position", "gaussian_privatizer", "is_correlated_state", "noise_owner", "unowned"]


def is_correlated_state(noise_state: Any) -> bool:
    """Whether ``noise_state`` has :func:`vmapdp.mf.correlated_noise`'s layout (``t``,
    ``strategy``, ``buffers``, and from its run's first step ``owner``): only that privatizer may
    step it."""
    return isinstance(noise_state, dict) and set(noise_state) in ({"t", "strategy", "buffers"}, {"t", "strategy", "buffers", "owner"})


def unowned(noise_state: Any) -> bool:
    """Whether ``noise_state`` is a correlated-noise state without an ``owner`` (made before noise
    states were bound to their run: an older version's checkpoint)."""
    return is_correlated_state(noise_state) and "owner" not in noise_state and isinstance(noise_state.get("t"), torch.Tensor)


def noise_owner(noise_seed: int | None, run_id: str, start: int) -> torch.Tensor:
    """The ``owner`` of a correlated-noise state (uint8 [32]): a one-way digest of the train
    state's noise seed, its run and the step its noise run started at. Its buffers hold draws
    already released: continued by another run, or by a later segment of the same one, they would
    enter a second sum (found by review: a state swapped in from another run, or replayed from an
    earlier segment, raised a column norm of C from 1.19 to 1.36 where the ledger charged 1.19).
    Secure runs (no seed) are told apart by their run and start only."""
    data = repr((b"vmapdp-mf-owner", noise_seed, run_id, int(start))).encode()
    return torch.tensor(list(hashlib.sha256(data).digest()), dtype=torch.uint8)


def check_noise_owner(call: str, noise_state: dict, noise_seed: int | None, run_id: str, step: int, fix: str) -> dict:
    """The correlated-noise state to step at ``step``, bound to its run segment (:func:`noise_owner`):
    at a segment's first step (``t = 0``) its buffers must be zeros (a fresh state) and it gets its
    owner; later its owner must be this segment's (a checkpoint saved before owners were
    recorded gets its run's from ``load_state``)."""
    t = int(noise_state["t"])
    expected = noise_owner(noise_seed, run_id, step - t)
    if t == 0:
        if any(bool(b.any()) for b in noise_state["buffers"].values()):
            raise ValueError(
                f"{call}: the noise state starts a correlated-noise run (t = 0) but its buffers are not zeros: they hold "
                f"another run's released draws, which would enter this run's sums too. {fix}"
            )
        return {**noise_state, "owner": expected}
    owner = noise_state.get("owner")
    if owner is None:
        raise ValueError(
            f"{call}: the noise state has no owner (made before noise states were bound to their run): read it "
            f"through load_state (load_sharded for a sharded run), which binds an older checkpoint's state to its run. {fix}"
        )
    if not torch.equal(owner.cpu(), expected):
        raise ValueError(
            f"{call}: the noise state's buffers belong to another run, or to another noise run of this one (its owner is "
            "not this state's seed, run and run start): their draws were released there, and continuing them would add "
            f"them to this run's sums too, which the ledger does not charge. {fix}"
        )
    return noise_state


def check_noise_position(call: str, noise_state: Any, step: int, *, period: int | None, fix: str) -> None:
    """Refuse a correlated-noise state whose step count ``t`` does not fit its train state's ``step``.

    Correlated noise releases ``(C^{-1} z)_t`` from buffers of the steps before: buffers of
    another position (a noise state reset or carried over from another point of the run, or a
    checkpoint whose fields were put together from two saves) would release noise that is not
    the mechanism's, while the ledger charges the mechanism (found by review). With ``period``
    (the run length ``steps`` the noise was built for) the state must be ``t`` steps into the
    run that started at a multiple of ``period``: ``step - t`` a multiple of ``period``, ``0 <= t
    <= period`` (a fresh state, ``t = 0``, at a multiple starts the next run, which the ledger
    charges as a run of its own; any other privatizer is refused a state of this layout, so the
    count cannot be left behind by steps of other noise). ``period=None`` (``load_state``, which does not know the run
    length) checks ``0 <= t <= step`` only; the step checks the rest before anything is released.
    Only :func:`vmapdp.mf.correlated_noise`'s layout (``t``, ``strategy``, ``buffers``) is
    checked: a privatizer of yours keeps its own state as it likes, in another layout (a state
    of this layout is refused by every privatizer but the bound correlated noise).
    """
    if not is_correlated_state(noise_state):
        return
    t = noise_state["t"]
    if not (isinstance(t, torch.Tensor) and t.dim() == 0 and not t.is_floating_point() and t.dtype != torch.bool):
        raise ValueError(f"{call}: the noise state's step count 't' must be a 0-dim int tensor, got {t!r}. {fix}")
    t = int(t)
    fits = 0 <= t <= step if period is None else 0 <= t <= period and t <= step and (step - t) % period == 0
    if not fits:
        runs = "" if period is None else f" (runs of {period} steps: t must be the state's step minus a multiple of {period})"
        raise ValueError(
            f"{call}: the noise state has noised {t} steps but the state is at step {step}{runs}: its buffers belong to "
            f"another point of the run, and continuing them would release noise that is not the mechanism the ledger "
            f"charges. {fix}"
        )


class Privatizer(NamedTuple):
    """An ``init``/``privatize`` pair (see the module docstring).

    ``init(params) -> state``: the noise state before the first step (a pytree of tensors; ``()``
    for none). ``privatize(summed, state, key) -> (noisy, state)``: the released sum (a pytree
    like ``summed``, each leaf float32 or wider) and the next state; pure, drawing its randomness
    from ``key`` only (``None``: from the OS CSPRNG). ``bind`` (optional): ``bind(call, *,
    noise_multiplier, l2_sensitivity, sample_rate, sampler, secure) -> (privatizer, event, config)``:
    the privatizer the step runs, ``event()`` the ledger event of each step (called before
    anything is computed), ``config`` a string bound into the noise key; it raises for a
    configuration it has no analysis for. A sharded step (``make_train_step(sharding=)``) also
    passes ``offsets=``: each leaf's first element in its flattened parameter (the sums it then
    privatizes, and the state ``init`` gets, are this rank's 1-D shards); a privatizer without a
    ``bind`` that takes ``offsets`` is refused there.
    """

    init: Callable[[Any], Any]
    privatize: Callable[[Any, Any, bytes | None], tuple[Any, Any]]
    bind: Callable[..., tuple[Any, Callable[[], Any], str]] | None = None
    # what a privatizer without ``bind`` releases, bound into the noise key (``gaussian_privatizer``:
    # its std): two steps with other privatizers never draw the same noise (found by review: std
    # 2.0 and 3.0 from one state gave noise in the ratio 1.5, the same draws). Give yours one.
    config: str = ""
    # a bound correlated noise's run length: its state's step count t restarts every ``period`` steps (0: none)
    period: int = 0
    # the std of the independent Gaussian noise it adds to each coordinate (``gaussian_privatizer``'s), or None
    # where not known: make_train_step refuses one below the std its ledger event charges (found by review:
    # gaussian_privatizer(0.0) with noise_multiplier=1 released the bare sum, charged as sigma 1)
    std: float | None = None


def gaussian_privatizer(std: float, *, secure: bool = False, offsets: Any = None, noise_dtype: torch.dtype | None = None) -> Privatizer:
    """Independent Gaussian noise ``N(0, std**2)`` on every coordinate of the sum, snapped
    (``add_noise(snap=True)``: each value rounded to a multiple of ``snap_grid(std)``); no state.

    Args:
        std: the noise standard deviation, ``>= 0`` (DP-SGD: ``noise_multiplier * l2_sensitivity``).
        secure: draw from the OS CSPRNG (``add_noise(secure=True)``: a fresh key from it per step,
            expanded by ChaCha20); the step's key is
            then ``None``. Otherwise the noise is drawn from the step's key
            (``add_noise(summed, std, key=key)``: the same key, the same bits).
        offsets: for sums of parameter shards (:mod:`vmapdp.sharding`): each leaf's first element
            in its stream (a pytree like the sum: ``add_noise(offsets=)``), so a shard gets the slice of the whole
            parameter's noise. With ``secure`` each shard's owner draws its own (independent)
            noise and ``offsets`` is not used.
        noise_dtype: ``torch.float64`` draws float64 noise for float32 sums (``add_noise(noise_dtype=)``:
            the snapped release's per-cell gap to the Gaussian ~``2**-45`` instead of ~``2**-16``, for
            ~2x the release's time on a CPU); None (or float32): the sum's own. Not with
            ``make_train_step(sharding=)``, which noises each shard with its default privatizer.

    Raises:
        TypeError / ValueError: ``noise_dtype`` not None, float32 or float64 (at construction).
        ValueError: at ``privatize``, a key given to a secure privatizer or none to a keyed one.
    """
    call = "gaussian_privatizer(std)"
    std = _checks.noise_std(call, std)
    secure = _checks.flag(call, "secure", secure)
    noise_dtype = _noise_dtype(call, noise_dtype)

    def init(params: Any) -> tuple:
        return ()

    def privatize(summed: Any, state: Any, key: bytes | None) -> tuple[Any, Any]:
        if secure != (key is None):
            raise ValueError(f"{call}: secure={secure} " + ("takes no key (its noise comes from the OS CSPRNG)." if secure else "needs the step's noise key, got None."))
        if secure:
            return add_noise(summed, std, secure=True, noise_dtype=noise_dtype), state
        return add_noise(summed, std, key=key, offsets=offsets, noise_dtype=noise_dtype), state

    wide = "" if noise_dtype is None else f", noise_dtype={noise_dtype}"  # (the default's config unchanged: bound into no key)
    return Privatizer(init, privatize, config=f"gaussian(std={float(std)!r}, secure={secure}{wide})", std=float(std))
