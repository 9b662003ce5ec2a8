"""Correlated noise as a privatizer: ``make_train_step(..., privatizer=correlated_noise(strategy, steps=n))``.

At step ``t`` the step releases ``summed_t + std_z * (C^{-1} z)_t`` (snapped to a grid as
``add_noise``'s releases are: ``snap_grid(std_z / c_0)``, of the part drawn at that step), where ``z_t`` is the step's
keyed standard normal draw (leaf ``i`` of the sum: ``keyed_normal(shape, key, leaf=i)``, the same
draw plain DP-SGD adds) and ``(C^{-1} z)_t`` is streamed from buffers
(:mod:`vmapdp.mf.streaming`). ``std_z = noise_multiplier * l2_clip_norm * sens``, with ``sens``
the strategy's sensitivity for the analysis the sampler allows (:mod:`vmapdp.mf.accounting`), so
``noise_multiplier`` keeps its DP-SGD meaning and the ledger records the mechanism's event.
``C = I`` (``BandedToeplitz((1.0,))``) is plain DP-SGD: the same release, bit for bit, as
:func:`vmapdp.noise.gaussian_privatizer` under the same key.

The state (``TrainState.noise_state``, made by ``init_train_state(..., privatizer=)``) is
``{"t": int64 0-dim, "strategy": uint8 [32], "buffers": {name: [rows, *shape]}, "owner": uint8
[32]}``: the steps noised so far, a SHA-256 of the mechanism (a state is refused by another one),
the run segment the buffers belong to (``vmapdp.noise.privatizers.noise_owner``, set at its first
step) and, per leaf,
the last ``band - 1`` outputs (banded) or one buffer per ``theta`` (BLT), in the leaf's noise
dtype (float32; float64 for float64 leaves). It is saved by checkpoints, so a resumed run
continues bit for bit, and it is the same on every rank of a distributed run (the same key, the
same arithmetic).

With ``make_train_step(..., sharding=)`` (:mod:`vmapdp.sharding`) the step binds it with the
shard layout (``bind(offsets=)``): each rank keeps the buffers of its own shards only
(``[rows, shard length]`` per leaf, from ``init_train_state(..., sharding=)``), draws its shards'
``z_t`` at their global element offsets in the same keyed streams, and runs the same element-wise
recursion, so its noise (the release minus the sum) and its buffers are bitwise the slices of
the one-process ones. With ``secure=True`` each owner draws its shards' ``z_t`` from its own
CSPRNG (independent, as the elements of one draw are).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, Callable

import optree
import torch

from vmapdp import _checks
from vmapdp._tree import acc_dtype
from vmapdp.mf.accounting import mf_event, noise_sensitivity
from vmapdp.mf.strategies import BandedToeplitz, BufferedToeplitz
from vmapdp.mf.streaming import MAX_RECURSION_GAIN, next_noise, recursion_gain, state_rows
from vmapdp.noise.gaussian import _keyed_normals, _release, snap_grid
from vmapdp.noise.privatizers import Privatizer, is_correlated_state

__all__ = ["correlated_noise", "describe", "fresh_noise_multiplier"]


def describe(strategy: BandedToeplitz | BufferedToeplitz, steps: int) -> str:
    """The mechanism as the step's configuration binds it into the noise key (floats in hex: exact)."""
    if isinstance(strategy, BandedToeplitz):
        return repr(("banded", tuple(c.hex() for c in strategy.coeffs), steps))
    return repr(("blt", tuple(x.hex() for x in strategy.theta), tuple(x.hex() for x in strategy.omega), steps))


def _fingerprint(strategy: BandedToeplitz | BufferedToeplitz, steps: int) -> torch.Tensor:
    """SHA-256 of :func:`describe` as a uint8 tensor: the noise state names the mechanism it belongs to."""
    return torch.tensor(list(hashlib.sha256(describe(strategy, steps).encode()).digest()), dtype=torch.uint8)


def correlated_noise(strategy: BandedToeplitz | BufferedToeplitz, *, steps: int) -> Privatizer:
    """The privatizer of matrix-factorization noise with ``strategy`` over a run of ``steps`` steps.

    Pass it to both ``init_train_state(..., privatizer=)`` (the buffers) and
    ``make_train_step(..., privatizer=, sampler=)``; the step binds it to its noise multiplier,
    clip norm and sampler (:attr:`Privatizer.bind`), which fixes ``std_z`` and the event the
    ledger records each step:

    * a :class:`~vmapdp.mf.BandedToeplitz` with a :class:`vmapdp.data.CyclicPoissonSampler` of
      ``cycle >= band``: :class:`~vmapdp.mf.accounting.BandedMFEvent` (amplified banded MF);
    * a :class:`~vmapdp.mf.BufferedToeplitz` (BLT) with a ``CyclicPoissonSampler``:
      :class:`~vmapdp.mf.accounting.MinSeparationMFEvent` (participations ``cycle`` apart, at most
      ``ceil(steps / cycle)``; no amplification).

    Args:
        strategy: the matrix ``C`` (:mod:`vmapdp.mf.strategies`).
        steps: the run's length ``n`` (the sampler's ``steps`` must not exceed it); a step past
            it is refused.

    Raises:
        TypeError / ValueError: a bad strategy or ``steps``, or a strategy whose streamed
        ``C^{-1} z`` grows over ``steps`` until float32 rounds the fresh draws away
        (:func:`vmapdp.mf.streaming.recursion_gain` above ``MAX_RECURSION_GAIN``); at ``make_train_step``, a sampler or
        noise multiplier without an analysis (the message names the fix); at a step, a state not
        made with this privatizer, or a step past ``steps``.
    """
    call = "correlated_noise(strategy, steps)"
    if not isinstance(strategy, (BandedToeplitz, BufferedToeplitz)):
        raise TypeError(f"{call}: strategy must be a vmapdp.mf.BandedToeplitz or BufferedToeplitz, got {type(strategy).__name__}.")
    steps = _checks.positive_int(call, "steps", steps, meaning="steps is the length of the run the noise is built for")
    gain = recursion_gain(strategy, steps)
    if not gain <= MAX_RECURSION_GAIN:  # (found by review: BandedToeplitz((1.0, 2.0)) rounded every fresh draw away by step 39)
        raise ValueError(
            f"{call}: {_checks.shortened(repr(strategy), 160)} streams C^-1 z with terms that grow to {gain:.3g} times each step's fresh "
            f"draw over {steps} steps (at most {MAX_RECURSION_GAIN:g} is taken): in float32 the fresh draws would be "
            "rounded away and the noise released would be a function of the earlier noise, which the accounting (exact "
            "arithmetic) does not assume. Use a strategy whose inverse stays bounded: a banded one whose polynomial "
            "c_0 + c_1 x + ... has no root in the unit disk, a BLT with every |theta| < 1 whose inverse's theta "
            "(strategy.inverse()) are in (-1, 1); vmapdp.mf.optimal_banded, optimal_blt and sqrt_prefix are."
        )
    rows = state_rows(strategy)

    def init(params: Any) -> dict:
        return {
            "t": torch.zeros((), dtype=torch.int64),
            "strategy": _fingerprint(strategy, steps),
            "buffers": {k: torch.zeros((rows, *v.shape), dtype=acc_dtype(v.dtype), device=v.device) for k, v in params.items()},
            "owner": torch.zeros(32, dtype=torch.uint8),  # (set at the run's first step: check_noise_owner)
        }

    def unbound(summed: Any, state: Any, key: bytes | None) -> tuple[Any, Any]:
        raise ValueError(
            f"{call}: this privatizer is bound to the step's noise multiplier, clip norm and sampler by make_train_step; "
            "pass it as make_train_step(..., privatizer=)."
        )

    def bound_again(where: str, **kwargs: Any) -> tuple[Privatizer, Callable[[], Any], str]:
        raise ValueError(
            f"{where}: this correlated noise was already bound (by make_train_step or .bind()); a bound one carries no "
            "accounting of its own and would be charged as independent Gaussian noise. Pass the unbound "
            "correlated_noise(strategy, steps=) to make_train_step(..., privatizer=)."
        )

    def bind(
        where: str, *, noise_multiplier: float, l2_sensitivity: float, sample_rate: float, sampler: Any, secure: bool, offsets: Any = None
    ) -> tuple[Privatizer, Callable[[], Any], str]:
        if not noise_multiplier > 0:
            raise ValueError(f"{where}: correlated noise needs noise_multiplier > 0, got {noise_multiplier!r}; for a non-private run drop privatizer=.")
        event = mf_event(where, strategy, noise_multiplier=noise_multiplier, sampler=sampler, steps=steps)
        std = noise_multiplier * l2_sensitivity * noise_sensitivity(strategy, event, steps)
        return Privatizer(init, _privatize(strategy, steps, std, secure, offsets), bound_again, period=steps), (lambda: event), describe(strategy, steps)

    return Privatizer(init, unbound, bind)


def _privatize(strategy: BandedToeplitz | BufferedToeplitz, steps: int, std: float, secure: bool, offsets: Any = None) -> Callable:
    """``offsets``: None, or (a sharded step) each leaf's first element in its flattened
    parameter: the sums and buffers are then this rank's 1-D shards, and each shard's ``z_t`` is
    that range of the leaf's keyed stream (``keyed_normal(offset=)``)."""
    call = "step(state, batch, mask): correlated noise"
    rows = state_rows(strategy)
    fingerprint = _fingerprint(strategy, steps)
    # releases snapped as add_noise's (vmapdp.noise.gaussian), to the grid of the part drawn at this step (std / c_0)
    grid = snap_grid(std / (strategy.coeffs[0] if isinstance(strategy, BandedToeplitz) else 1.0))

    def privatize(summed: Any, state: Any, key: bytes | None) -> tuple[Any, Any]:
        if secure != (key is None):
            raise ValueError(f"{call}: secure={secure} " + ("takes no key (its noise comes from the OS CSPRNG)." if secure else "needs the step's noise key, got None."))
        if not (is_correlated_state(state) and isinstance(state["buffers"], dict)):
            raise ValueError(
                f"{call}: the state's noise_state is not this privatizer's (got {type(state).__name__}); make the state with "
                "init_train_state(..., privatizer=) and the same correlated_noise(...) as the step."
            )
        if not torch.equal(state["strategy"].cpu(), fingerprint):
            raise ValueError(
                f"{call}: the state's buffers were made for another correlated noise (another strategy or steps=); continuing "
                "them under this one would release noise of neither. Use the same correlated_noise(...) in init_train_state "
                "and make_train_step (and for a resumed run, the one it was saved with)."
            )
        t = int(state["t"])
        if t >= steps:
            raise ValueError(
                f"{call}: step {t + 1} is past steps={steps}, the run the correlated noise (and its accounting) was built for; "
                "nothing was released. Build correlated_noise(strategy, steps=...) for the whole run, or start the next run of "
                "that length from a fresh noise state (state._replace(noise_state=privatizer.init(state.params))), which the "
                "ledger charges as a run of its own."
            )
        if not (isinstance(summed, dict) and set(summed) == set(state["buffers"])):
            raise ValueError(f"{call}: the sum's leaves are not the state's buffers {sorted(state['buffers'])}; make the state from the same params.")
        if offsets is not None and not (
            isinstance(offsets, dict) and set(offsets) == set(summed) and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets.values())
        ):
            raise ValueError(f"{call}: offsets={offsets!r} must map every leaf {sorted(summed)} to its first element (an int >= 0): pass the step's Sharding.offsets.")
        paths, leaves, spec = optree.tree_flatten_with_path(summed, namespace="torch")
        names = [p[0] for p in paths]  # in optree's order of the leaves: add_noise's leaf index
        for name, leaf in zip(names, leaves):
            buf = state["buffers"][name]
            if buf.dtype != acc_dtype(leaf.dtype) or tuple(buf.shape) != (rows, *leaf.shape):
                raise ValueError(
                    f"{call}: the buffer of {name!r} is {buf.dtype} {tuple(buf.shape)}, expected {acc_dtype(leaf.dtype)} {(rows, *leaf.shape)}; make the state from the same params "
                    "(init_train_state(params, ..., privatizer=, sharding=) for a sharded step)."
                )
        buffers = {}

        def release(i: int, z: torch.Tensor) -> torch.Tensor:  # a leaf's release as soon as its draw is made (the tree's noise is never alive at once)
            name, leaf = names[i], leaves[i]
            y, buffers[name] = next_noise(strategy, z, state["buffers"][name].to(leaf.device))
            return _release(leaf, y, std, grid=grid)

        # every leaf's draw in as few launches as their sizes allow (on a GPU: one launch of the noise
        # kernel); secure: under a fresh key from the OS CSPRNG, as add_noise(secure=True)
        out = _keyed_normals(secrets.token_bytes(32) if secure else key, [(tuple(leaf.shape), i, 0 if offsets is None or secure else offsets[name], acc_dtype(leaf.dtype), leaf.device) for i, (name, leaf) in enumerate(zip(names, leaves))], then=release)
        buffers = {name: buffers[name] for name in names}
        nxt = {"t": torch.tensor(t + 1, dtype=torch.int64), "strategy": state["strategy"], "buffers": buffers}
        if "owner" in state:  # (the run segment the buffers belong to: set and checked by the step, check_noise_owner)
            nxt["owner"] = state["owner"]
        return optree.tree_unflatten(spec, out), nxt

    return privatize


def fresh_noise_multiplier(strategy: BandedToeplitz | BufferedToeplitz, *, noise_multiplier: float, sampler: Any, steps: int) -> float:
    """The std, over the clip norm, of the part of a step's release drawn at that step:
    ``noise_multiplier * sens / C[0, 0]`` (``y_t = (z_t - ...) / c_0``; the rest is fixed by the
    state). Two runs of one step from one state with different noise seeds differ by that much
    noise: what :func:`vmapdp.testing.check_noise_calibration` measures.
    """
    call = "fresh_noise_multiplier(strategy)"
    event = mf_event(call, strategy, noise_multiplier=noise_multiplier, sampler=sampler, steps=steps)
    c0 = strategy.coeffs[0] if isinstance(strategy, BandedToeplitz) else 1.0
    return noise_multiplier * noise_sensitivity(strategy, event, steps) / c0
