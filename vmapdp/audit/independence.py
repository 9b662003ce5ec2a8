"""Check that each sample's gradient depends on that sample alone: :func:`check_per_sample_independence`.

Perturbs one sample at a time and watches every other sample's per-sample gradient; with a
random ``loss_fn`` (dropout) also checks that identical copies of a sample get their own draws.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp._tree import batch_size
from vmapdp.audit.report import finish
from vmapdp.audit.runs import flat_rows, is_float, rng_devices, seeded, set_rows, tree_map
from vmapdp.per_sample import per_sample_grads

__all__ = ["IndependenceReport", "check_per_sample_independence"]


@dataclasses.dataclass(frozen=True)
class IndependenceReport:
    """Result of :func:`check_per_sample_independence`.

    ``max_leak``: the largest change of any *other* sample's gradient when one sample was
    perturbed, relative to the batch's largest per-sample gradient norm (0 when independent).
    ``min_self_change``: the smallest relative change of a perturbed sample's own gradient (if 0,
    the perturbation did not reach the gradient and the check saw nothing). ``loss_is_random``:
    whether the gradients changed with the RNG seed (dropout); then ``copies_max_diff`` is the
    largest relative difference between the gradients of identical copies of one sample (0 when
    the random draws are shared across the batch).
    """

    passed: bool
    batch_size: int
    perturbed: tuple[int, ...]
    max_leak: float
    worst: tuple[int, int] | None  # (perturbed sample, leaking sample)
    min_self_change: float
    randomness: str
    loss_is_random: bool | None
    copies_max_diff: float | None
    rtol: float
    message: str

    def __str__(self) -> str:
        return self.message


def _perturb_row(batch: Any, j: int, b: int, gen: torch.Generator) -> Any:
    """Row ``j`` replaced by another sample's row, plus noise on floating-point leaves."""
    src = (j + 1) % b

    def value(leaf: Tensor) -> Tensor:
        row = leaf[src].clone()
        if is_float(leaf):
            scale = float(leaf.detach().to(torch.float64).std()) if leaf.numel() > 1 else 1.0
            scale = scale if math.isfinite(scale) and scale > 0 else 1.0
            noise = torch.randn(row.shape, generator=gen, dtype=torch.float64).to(dtype=row.dtype, device=row.device)
            row = row + 0.5 * scale * noise
        return row

    return set_rows(batch, j, value)


def _leaks(run: Callable[..., Tensor], batch: Any, b: int, base: Tensor, scale: float, samples: tuple[int, ...], seed: int) -> tuple[float, tuple[int, int] | None, float]:
    """Perturb each of ``samples`` in turn: the largest change of another sample's gradient (relative
    to ``scale``), the pair (perturbed, leaking) where it happened, and the smallest own change."""
    gen = torch.Generator().manual_seed(seed)
    max_leak, worst, min_self = 0.0, None, math.inf
    for j in samples:
        moved = run(_perturb_row(batch, j, b, gen))
        change = (moved - base).norm(dim=1) / scale
        if not torch.isfinite(change).all():
            change = torch.where(torch.isfinite(change), change, torch.full_like(change, math.inf))
        min_self = min(min_self, float(change[j]))
        others = change.clone()
        others[j] = 0.0
        i = int(others.argmax())
        if float(others[i]) > max_leak:
            max_leak, worst = float(others[i]), (j, i)
    return max_leak, worst, min_self


def _own_draws(run: Callable[..., Tensor], batch: Any, base: Tensor, scale: float, *, seed: int, rtol: float, randomness: str) -> tuple[bool | None, float | None]:
    """Whether the gradients change with the RNG seed, and then how far identical copies of one
    sample differ (None, None when ``randomness="error"``: nothing random to check)."""
    loss_is_random, copies_diff = None, None
    if randomness != "error":
        loss_is_random = bool(((run(batch, seed + 1) - base).norm(dim=1) / scale > rtol).any())
        if loss_is_random:
            copies = tree_map(lambda leaf: leaf[:1].expand(leaf.shape).clone(), batch)
            g = run(copies)
            copy_scale = float(g.norm(dim=1).max()) or 1.0
            copies_diff = float((g - g[:1]).norm(dim=1).max()) / copy_scale
    return loss_is_random, copies_diff


def check_per_sample_independence(
    loss_fn: Callable[..., Tensor] | None,
    params: Any,
    *shared: Any,
    batch: Any,
    randomness: str = "error",
    grads_fn: Callable[..., Any] | None = None,
    samples: Sequence[int] | None = None,
    seed: int = 0,
    rtol: float = 1e-5,
    raise_on_failure: bool = True,
) -> IndependenceReport:
    """Check that each sample's gradient depends on that sample alone (and on its own random draws).

    1. **No cross-sample leaks.** For each sample ``j`` in ``samples``, the batch is copied with
       row ``j`` replaced by another sample's row plus noise on its floating-point leaves; every
       other sample's per-sample gradient must stay the same (to ``rtol`` of the batch's largest
       gradient norm). Catches train-mode BatchNorm, batch statistics, any code that reads across
       the batch: the sensitivity analysis of DP-SGD assumes that removing one example changes
       exactly one clipped term of the sum.
    2. **Own random draws** (``randomness != "error"``). If the gradients change with the RNG seed
       (dropout in ``loss_fn``), a batch of identical copies of one sample must get *different*
       gradients: with ``randomness="same"`` every sample shares one dropout mask, which couples
       the samples. A deterministic ``loss_fn`` passes this part vacuously
       (``report.loss_is_random`` is False).

    Both computations run with torch's global RNG seeded to ``seed`` (restored afterwards), so a
    random ``loss_fn`` sees the same draws in the runs being compared.

    Args:
        loss_fn: ``loss_fn(params, *shared, sample) -> scalar`` for one sample, as for
            :func:`vmapdp.per_sample_grads`.
        params, shared: the arguments before the batch.
        batch: a pytree of tensors with leading dim ``B >= 2``.
        randomness: as for :func:`vmapdp.per_sample_grads` (use the value your step uses).
        grads_fn: a per-sample gradient function ``grads_fn(params, *shared, batch) -> {k: [B, ...]}``
            to check instead of ``vmapdp.per_sample_grads(loss_fn, randomness=randomness)`` (your
            own or a third-party implementation); ``loss_fn`` may then be None.
        samples: which samples to perturb (default: up to four spread over the batch).
        seed: seeds the global RNG (dropout) and the perturbation noise.
        rtol: tolerated change of another sample's gradient, relative to the largest per-sample
            gradient norm in the batch.
        raise_on_failure: raise :class:`PrivacyCheckError` on failure (default) or return the report.

    Returns:
        An :class:`IndependenceReport`.

    Raises:
        PrivacyCheckError: a sample's gradient depends on another sample, or identical samples
            share their random draws.
        ValueError: a batch with fewer than two samples, a bad ``samples``.

    Example:
        >>> report = check_per_sample_independence(loss_fn, params, buffers, batch=(x, y))
        >>> report.max_leak
        0.0
    """
    call = "check_per_sample_independence(loss_fn, params, *shared, batch=)"
    _checks.positive(call, "rtol", rtol, allow_zero=True, meaning="the tolerated change of another sample's gradient")  # (found by review: -1 or NaN raised a bare TypeError)
    if grads_fn is None:
        if not callable(loss_fn):
            raise TypeError(f"{call}: loss_fn must be callable (or pass grads_fn=), got {type(loss_fn).__name__}.")
        grads_fn = per_sample_grads(loss_fn, randomness=randomness)
    elif not callable(grads_fn):
        raise TypeError(f"{call}: grads_fn must be callable, got {type(grads_fn).__name__}.")
    b = batch_size(batch, call=call)
    if b < 2:
        raise ValueError(f"{call}: the batch has {b} sample(s); independence needs at least 2. Pass a few real samples.")
    if samples is None:
        samples = sorted({0, b // 3, (2 * b) // 3, b - 1})
    samples = tuple(int(j) for j in samples)
    if not samples or any(not 0 <= j < b for j in samples):
        raise ValueError(f"{call}: samples={samples!r} must be non-empty indices in [0, {b}).")
    devices = rng_devices((params, shared, batch))

    def run(data: Any, s: int = seed) -> Tensor:
        return flat_rows(seeded(s, devices, lambda: grads_fn(params, *shared, data)))

    base = run(batch)
    scale = float(base.norm(dim=1).max())
    scale = scale if scale > 0 else 1.0
    max_leak, worst, min_self = _leaks(run, batch, b, base, scale, samples, seed)
    loss_is_random, copies_diff = _own_draws(run, batch, base, scale, seed=seed, rtol=rtol, randomness=randomness)

    leak_ok = max_leak <= rtol
    copies_ok = copies_diff is None or copies_diff > rtol
    passed = leak_ok and copies_ok
    lines = []
    if not leak_ok:
        j, i = worst
        lines.append(
            f"{call}: FAILED: perturbing sample {j} changed the gradient of sample {i} by {max_leak:.3g} "
            f"(relative to the largest per-sample gradient norm {scale:.3g}; tolerance rtol={rtol:g}). "
            "Per-sample gradients are not independent: the batch is mixed (train-mode BatchNorm, batch "
            "statistics, a loss that reads other rows). Removing one example then changes every term of "
            "the clipped sum and the sensitivity is no longer l2_clip_norm. Fix: vmapdp.fix(module) "
            "(BatchNorm -> GroupNorm), or compute per-sample gradients with vmapdp.per_sample_grads."
        )
    if not copies_ok:
        lines.append(
            f"{call}: FAILED: {b} identical copies of one sample got identical gradients (largest relative "
            f"difference {copies_diff:.3g} <= rtol={rtol:g}) although loss_fn is random (its gradients change "
            f"with the RNG seed): the random draws (dropout masks) are shared across the batch "
            f"(randomness={randomness!r}). That couples the samples; use randomness='different'."
        )
    if passed:
        note = "" if min_self > rtol else f" (warning: perturbing a sample changed its own gradient by only {min_self:.3g}; the check saw little)"
        rnd = (
            ""
            if loss_is_random is None
            else (
                f"; random loss: identical copies differ by up to {copies_diff:.3g}, own draws per sample"
                if loss_is_random
                else "; loss_fn drew no randomness (dropout part vacuous)"
            )
        )
        lines.append(
            f"check_per_sample_independence: passed: perturbing samples {list(samples)} of {b} changed the other "
            f"samples' gradients by at most {max_leak:.3g} (rtol {rtol:g}){rnd}{note}."
        )
    return finish(
        IndependenceReport(
            passed=passed,
            batch_size=b,
            perturbed=samples,
            max_leak=max_leak,
            worst=worst,
            min_self_change=min_self,
            randomness=randomness,
            loss_is_random=loss_is_random,
            copies_max_diff=copies_diff,
            rtol=rtol,
            message="\n".join(lines),
        ),
        raise_on_failure,
    )
