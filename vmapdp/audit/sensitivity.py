"""Check that one sample moves the step's update by at most ``lr * l2_clip_norm / expected_batch_size``.

:func:`check_sensitivity` runs the real step on neighbouring batches (one adversarial sample
added) from the same seeded state, so the noise cancels, and checks that padded rows are inert.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import optree
import torch
from torch import Tensor

from vmapdp import distributed as _dist
from vmapdp._tree import batch_size, check_mask
from vmapdp.audit.report import finish
from vmapdp.audit.runs import check_step_hyperparameters, is_float, params_of, rng_devices, rounding_slack, seeded, set_rows, tree_map, update_distance
from vmapdp.noise.gaussian import _unsnapped
from vmapdp.noise.spent import unreleased

__all__ = ["SensitivityReport", "check_sensitivity"]


@dataclasses.dataclass(frozen=True)
class SensitivityReport:
    """Result of :func:`check_sensitivity`.

    ``bound`` is ``lr * l2_clip_norm / expected_batch_size``; ``max_distance`` the largest L2
    distance between the parameter updates of two neighbouring batches (one adversarial sample
    added) over ``pairs`` pairs; ``ratio = max_distance / bound`` (about 1 when the adversarial
    sample was clipped to exactly ``l2_clip_norm``; ``tight`` says it reached at least 0.5).
    ``padding_inert``: padded rows filled with NaN or huge values left the update bitwise unchanged.
    """

    passed: bool
    bound: float
    max_distance: float
    ratio: float
    slack: float
    worst: str
    pairs: int
    padding_inert: bool
    tight: bool
    message: str

    def __str__(self) -> str:
        return self.message


def _require_seeded(call: str, state: Any) -> None:
    if getattr(state, "noise_seed", 0) is None:
        raise ValueError(
            f"{call}: the state draws its noise from the OS CSPRNG (secure=True), so two runs from it add "
            "different noise and cannot be compared. Check a seeded twin: init_train_state(params, "
            "optimizer, seed=secrets.randbits(128)) with a step made with secure=False."
        )


class _Ranks:
    """How the step's ranks take part: ``adds`` whether this rank adds the adversarial sample (rank 0
    only: one sample added to the global batch, not one per rank), ``sharded`` whether this rank's
    params are its shards (distances summed over the ranks, squared). One process: adds, not sharded."""

    def __init__(self, step: Any, call: str) -> None:
        grouped = _dist.is_initialized() and _dist.world_size() > 1
        if grouped and not hasattr(step, "distributed"):  # (found by review: a sharded step's wrapper measured each rank's own shards)
            raise ValueError(
                f"{call}: in a process group of {_dist.world_size()} ranks the check must know whether the step is distributed or "
                "sharded (rank 0 alone adds the sample; a sharded update's distance is summed over the ranks), and this step "
                "does not say: pass the step make_train_step returned, or set step.distributed and step.sharded (bools) on "
                "your wrapper."
            )
        self.across = bool(getattr(step, "distributed", False)) and grouped
        self.adds = not self.across or _dist.rank() == 0
        self.sharded = self.across and bool(getattr(step, "sharded", False))

    def norms(self, *squares: float) -> list[float]:
        """The square roots of ``squares``, each summed over the ranks first where the params are sharded."""
        if self.sharded:
            squares = tuple(_dist.all_reduce_sum(torch.tensor(squares, dtype=torch.float64)).tolist())
        return [math.sqrt(x) for x in squares]

    def refused(self, call: str, err: BaseException | None) -> None:
        """Across the ranks of a distributed step: raise on every rank where another refused its
        arguments (``err`` is this rank's refusal, raised by the caller), so none waits in the
        step's collectives for a rank that left."""
        if self.across and _dist.max_ints([int(err is not None)])[0] and err is None:
            raise ValueError(f"{call}: another rank refused its arguments (its error is raised there); nothing was run.")

    def any(self, flag: bool) -> bool:
        """``flag`` on any rank (sharded: each rank sees its shards only)."""
        if self.sharded:
            return bool(_dist.all_reduce_sum(torch.tensor([float(flag)], dtype=torch.float64)).item() > 0)
        return flag


def _padding_leaks(params_after: Callable[[Any, Tensor], dict[str, Tensor]], batch: Any, mask: Tensor, first: int, pad: list[int], scale: float, ranks: _Ranks) -> list[str]:
    """What changed the update when the padded rows were filled with NaN, then huge values (empty: inert)."""
    nan_batch = set_rows(batch, pad, lambda leaf: torch.full_like(leaf[first], math.nan) if is_float(leaf) else leaf[first])
    huge_batch = set_rows(batch, pad, lambda leaf: leaf[first] * (-scale) + 1.0 if is_float(leaf) else leaf[first])
    clean = params_after(batch, mask)
    leaked = []
    for what, data in (("NaN", nan_batch), ("huge finite values", huge_batch)):
        other = params_after(data, mask)
        bad = [k for k in clean if not torch.equal(clean[k], other[k])]
        (dist,) = ranks.norms(update_distance(clean, other) ** 2)
        if ranks.any(bool(bad)):
            where = bad[:3] if bad else "another rank's shards"
            leaked.append(f"{what} (changed {where}, distance {dist:.3g})")
    return leaked


def _candidates(batch: Any, real: list[int], adversarial: Any, scale: float) -> list[tuple[str, Any]]:
    """The adversarial samples to add: the given one, or up to three real rows scaled by ``+-scale``."""
    if adversarial is not None:
        return [("the given adversarial sample", adversarial)]
    candidates = []
    for r in real[:3]:
        for sgn in (1.0, -1.0):
            row = tree_map(lambda leaf: leaf[r] * (sgn * scale) if is_float(leaf) else leaf[r], batch)
            candidates.append((f"row {r} x {sgn * scale:g}", row))
    return candidates


def _neighbour_pairs(
    call: str,
    params_after: Callable[[Any, Tensor], dict[str, Tensor]],
    batch: Any,
    mask: Tensor,
    real: list[int],
    slot: int,
    candidates: list[tuple[str, Any]],
    *,
    bound: float,
    rtol: float,
    start: dict[str, Tensor],
    ranks: _Ranks,
) -> tuple[str, float, float, float, int, tuple | None, int]:
    """Run every base batch with and without each candidate in ``slot`` and compare the updates.

    Returns ``(worst pair, its distance, its ratio to bound, its rounding slack, pairs run,
    the worst failing pair or None, how many pairs failed)``.
    """
    none = torch.zeros_like(mask)
    one = none.clone()
    one[real[0]] = True
    bases = [("the batch's real rows", mask), ("an empty batch", none)]
    if len(real) > 1 or ranks.across:  # (every rank of a distributed step runs the same steps: the same bases)
        bases.append(("one real row", one))
    worst, max_dist, max_ratio, slack_at_worst, pairs = "", 0.0, 0.0, 0.0, 0
    failed, n_failed = None, 0
    for base_name, base in bases:
        with_adv = base.clone()
        with_adv[slot] = ranks.adds  # (the other ranks step their base rows: one sample added to the global batch)
        for cand_name, row in candidates:
            data = batch if row is None else _with_row(call, batch, slot, row)
            a = params_after(data, base)
            b = params_after(data, with_adv)
            dist, slack = ranks.norms(update_distance(a, b) ** 2, (2.0 * rounding_slack(a, b, start)) ** 2)
            pairs += 1
            ratio = dist / bound if math.isfinite(dist) else math.inf
            if not math.isfinite(dist) or dist > max_dist:
                max_dist, max_ratio, slack_at_worst = dist, ratio, slack
                worst = f"{base_name} + {cand_name}"
            if not math.isfinite(dist) or dist > bound * (1.0 + rtol) + slack:
                n_failed += 1
                if failed is None or not ratio <= failed[3]:
                    failed = (base_name, cand_name, dist, ratio, slack)
    return worst, max_dist, max_ratio, slack_at_worst, pairs, failed, n_failed


def check_sensitivity(
    step: Callable[..., Any],
    state: Any,
    batch: Any,
    mask: Tensor,
    *shared: Any,
    lr: float,
    l2_clip_norm: float,
    expected_batch_size: float,
    adversarial: Any = None,
    scale: float = 1e3,
    seed: int = 0,
    rtol: float = 1e-3,
    raise_on_failure: bool = True,
) -> SensitivityReport:
    """Check that one sample moves the update by at most ``lr * l2_clip_norm / expected_batch_size``.

    From the same ``state``, the step is run on a batch and on the same batch with one adversarial
    sample added (a padded row of ``mask`` turned on, holding a real row scaled by ``+-scale`` to
    get a huge gradient, or ``adversarial``). The **L2 distance between the two parameter
    updates** must be at most ``lr * l2_clip_norm / expected_batch_size`` (plus float32 rounding
    and ``rtol``): the sum of clipped gradients moves by at most ``l2_clip_norm`` and is divided by
    the public constant ``expected_batch_size``. This holds for plain SGD (no momentum) on the
    first step, which is what to pass here. The base batches are the real rows of ``mask``, no rows
    at all, and the first real row alone, so a divisor that depends on the realised batch size
    shows up even when the batch is about as large as expected.

    Also checks that padded rows contribute nothing: the update with the padded rows' contents
    replaced by NaN, and by huge finite values, must be bitwise equal to the original update.

    A distributed or sharded step (``make_train_step(distributed=True)`` or ``sharding=``) is
    checked by calling this on every rank with its own batch: rank 0 adds the adversarial sample
    (one sample added to the global batch; ``adversarial=`` is read there), the others step their
    base rows (as many pairs as rank 0 runs), and the distance of
    a sharded step's updates is summed over the ranks' shards, so every rank reaches the same
    verdict on the whole update.

    The noise cancels: both runs start from the same seeded state, so they add the same noise (a
    step with ``noise_multiplier=0`` works too), unsnapped (snapping, post-processing of each
    release, would round neighbouring sums to different grid cells); they run inside
    :func:`vmapdp.noise.spent.unreleased`, so the step's guard against releasing one noise key
    twice lets them through, and nothing they compute may be published. All runs use torch's global RNG seeded to
    ``seed`` (dropout sees the same masks).

    Args:
        step: ``step(state, batch, mask, *shared) -> (new_state, metrics)`` (e.g. from
            :func:`vmapdp.make_train_step` with ``vmapdp.optim.sgd(lr)``), eager or compiled.
        state: a seeded state before the step (:func:`vmapdp.init_train_state`).
        batch, mask, shared: a batch as the step takes it; ``mask`` needs at least one real row
            and at least one padded (False) row, the adversarial slot.
        lr, l2_clip_norm, expected_batch_size: the step's hyperparameters (the bound).
        adversarial: one sample (a pytree like a row of ``batch``, no batch dim) to add instead
            of the scaled real rows.
        scale: factor applied to floating-point leaves of real rows to make adversarial samples.
        seed: seeds torch's global RNG for every run (restored afterwards).
        rtol: relative tolerance on the bound.
        raise_on_failure: raise :class:`PrivacyCheckError` on failure (default) or return the report.

    Returns:
        A :class:`SensitivityReport`.

    Raises:
        PrivacyCheckError: an added sample moved the update more than the bound (clipping missing
            or after the sum, a data-dependent divisor, mixing samples), or padded rows changed it.
        ValueError: a mask without a real or a padded row; a secure (unseeded) state.
    """
    call = "check_sensitivity(step, state, batch, mask, *shared)"
    ranks = _Ranks(step, call)
    try:
        check_step_hyperparameters(call, lr=lr, l2_clip_norm=l2_clip_norm, expected_batch_size=expected_batch_size)
        _require_seeded(call, state)
        n = batch_size(batch, call=call)
        check_mask(mask, n, call=call)
        real = mask.nonzero().flatten().tolist()
        pad = (~mask).nonzero().flatten().tolist()
        if not real or not pad:
            raise ValueError(
                f"{call}: the mask has {len(real)} real and {len(pad)} padded rows; the check needs at least one "
                "of each (a padded row is the slot for the adversarial sample). Pad the batch by one row."
            )
        candidates = _candidates(batch, real, adversarial, scale)
        _with_row(call, batch, pad[0], candidates[0][1])  # (an adversarial sample of the wrong structure: refused here, before any step)
    except (TypeError, ValueError) as err:
        ranks.refused(call, err)
        raise
    ranks.refused(call, None)  # (a distributed step: every rank refuses if one does, none waits in the step's collectives)
    if ranks.across:  # every rank runs rank 0's pairs: as many, its own rows in place of the sample it does not add
        count = _dist.broadcast_int(len(candidates))
        candidates = candidates if ranks.adds else [("rank 0's sample", None)] * count
    devices = rng_devices((state.params, batch))

    def params_after(data: Any, m: Tensor) -> dict[str, Tensor]:
        # one state stepped on neighbouring batches: nothing of it is released; unsnapped, so the noise cancels exactly
        with unreleased(), _unsnapped():
            new, _ = seeded(seed, devices, lambda: step(state, data, m, *shared))
        return params_of(new)

    # 1. padded rows are inert, bitwise
    first = real[0]
    leaked = _padding_leaks(params_after, batch, mask, first, pad, scale, ranks)
    inert = not leaked

    # 2. one added sample moves the update by at most lr * C / E[B]
    bound = lr * l2_clip_norm / expected_batch_size
    worst, max_dist, max_ratio, slack_at_worst, pairs, failed, n_failed = _neighbour_pairs(
        call, params_after, batch, mask, real, pad[0], candidates, bound=bound, rtol=rtol, start=state.params, ranks=ranks
    )
    passed = inert and failed is None
    lines = []
    if failed is not None:
        base_name, cand_name, dist, ratio, slack = failed
        lines.append(
            f"{call}: FAILED in {n_failed} of {pairs} neighbouring pairs; worst: adding one sample ({cand_name}) to {base_name} moved the parameter update by "
            f"{dist:.6g}, {ratio:.4g} x the bound lr * l2_clip_norm / expected_batch_size = {lr:g} * {l2_clip_norm:g} / "
            f"{expected_batch_size:g} = {bound:.6g} (tolerance rtol={rtol:g}, float rounding {slack:.2g}). The step's "
            "sensitivity is larger than the accountant assumes. Likely bugs: per-sample clipping missing or applied "
            "after summing; dividing by the realised batch size (mask.sum()) instead of the constant "
            "expected_batch_size; samples mixed before clipping; noise that depends on the data. (This check assumes "
            "plain SGD without momentum on the first step; Adam or momentum rescale the update.)"
        )
    if not inert:
        lines.append(
            f"{call}: FAILED: padded rows (mask False) changed the update when filled with {', '.join(leaked)}; they must "
            "contribute exactly nothing. Likely bugs: the mask is ignored, or applied by multiplication (NaN * 0 = NaN) "
            "instead of torch.where, or padded rows enter batch statistics."
        )
    tight = max_ratio >= 0.5
    if passed:
        note = "" if tight else " (warning: no adversarial sample reached half the bound; its gradient may be below l2_clip_norm, so the bound was not approached)"
        lines.append(
            f"check_sensitivity: passed: over {pairs} neighbouring pairs the update moved by at most {max_dist:.6g} = "
            f"{max_ratio:.4f} x lr * l2_clip_norm / expected_batch_size ({bound:.6g}; worst: {worst}); padded rows "
            f"filled with NaN or huge values left the update bitwise unchanged{note}."
        )
    return finish(
        SensitivityReport(
            passed=passed,
            bound=bound,
            max_distance=max_dist,
            ratio=max_ratio,
            slack=slack_at_worst,
            worst=worst,
            pairs=pairs,
            padding_inert=inert,
            tight=tight,
            message="\n".join(lines),
        ),
        raise_on_failure,
    )


def _with_row(call: str, batch: Any, slot: int, row: Any) -> Any:
    """A copy of ``batch`` whose row ``slot`` holds the sample ``row`` (a pytree like one row)."""

    def one(leaf: Tensor, value: Any) -> Tensor:
        out = leaf.clone()
        out[slot] = torch.as_tensor(value, dtype=leaf.dtype, device=leaf.device)
        return out

    try:
        return optree.tree_map(one, batch, row, namespace="torch")
    except ValueError as err:
        raise ValueError(f"{call}: adversarial must have the structure of one row of the batch: {err}") from err
