"""Privacy self-checks to run in your own test suite, on your own ``loss_fn`` and train step.

DP bugs are silent: a step that divides by the realised batch size, forgets to clip, shares one
dropout mask across the batch, samples fixed-size batches instead of Poisson ones, or adds
noise off by a factor of sqrt(2) trains normally and reports an epsilon that is false. Each check
here tests one property the privacy proof relies on, on the code you actually run::

    check_per_sample_independence(loss_fn, params, buffers, batch=batch)   # no cross-sample leaks
    check_sensitivity(step, state, batch, mask, buffers, lr=..., l2_clip_norm=..., expected_batch_size=...)
    check_noise_calibration(step, state, batch, mask, buffers, lr=..., l2_clip_norm=..., expected_batch_size=...)
    check_sampler(sampler)                                                 # Poisson(q), really
    check_ledger(before, after, steps=..., noise_multiplier=..., sample_rate=...)
    audit_epsilon_lower_bound(make_step)                                   # empirical epsilon <= claimed

Every check returns a small frozen report (``passed``, the figures, a readable ``str``) and, by
default, raises :class:`PrivacyCheckError` (an ``AssertionError``, so pytest shows it as a failed
assertion) naming what failed, the figures and the likely bug. Pass ``raise_on_failure=False`` to
get the failing report back instead.

Statistical checks have a stated false-alarm rate ``alpha``: a correct implementation fails with
probability at most about ``alpha`` (normal and Kolmogorov approximations; exact for the audit's
Clopper-Pearson bounds). Fix the seeds of your test so it is deterministic.

The step-level checks (sensitivity, noise) read the *parameter update* and assume plain SGD
(``vmapdp.optim.sgd`` without momentum) on the first step, where the update is exactly
``lr * noisy_sum / expected_batch_size``. Build a plain-SGD twin of your step for them; the
privacy of the step does not depend on the optimizer, which only post-processes the noisy sum.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Sequence

import optree
import torch
from torch import Tensor

from vmapdp import accounting
from vmapdp._tree import batch_size, check_mask
from vmapdp.accounting import Ledger, NonPrivateEvent, PoissonGaussianEvent
from vmapdp.per_sample import per_sample_grads

__all__ = [
    "PrivacyCheckError",
    "IndependenceReport",
    "SensitivityReport",
    "NoiseReport",
    "SamplerReport",
    "LedgerReport",
    "AuditReport",
    "check_per_sample_independence",
    "check_sensitivity",
    "check_noise_calibration",
    "check_sampler",
    "check_ledger",
    "audit_epsilon_lower_bound",
    "clopper_pearson_upper",
]

_F64 = torch.float64


class PrivacyCheckError(AssertionError):
    """A privacy self-check failed; ``.report`` holds the figures (a frozen report dataclass)."""

    def __init__(self, message: str, report: Any = None):
        super().__init__(message)
        self.report = report


def _finish(report: Any, raise_on_failure: bool) -> Any:
    if not report.passed and raise_on_failure:
        raise PrivacyCheckError(report.message, report)
    return report


# ---------------------------------------------------------------------------------------------
# Small statistics in plain math/torch (scipy is not a runtime dependency)
# ---------------------------------------------------------------------------------------------


def _two_sided_p(z: float) -> float:
    """P(|N(0, 1)| >= |z|)."""
    return math.erfc(abs(z) / math.sqrt(2.0)) if math.isfinite(z) else 0.0


def _ks_pvalue(d: float, n: int) -> float:
    """Kolmogorov's asymptotic p-value of a one-sample KS statistic ``d`` over ``n`` points.

    Uses Stephens' finite-n correction ``lambda = (sqrt(n) + 0.12 + 0.11 / sqrt(n)) d``; accurate
    to a few percent of the p-value for n >= 100, far better for the n >= 1000 used here.
    """
    en = math.sqrt(n)
    lam = (en + 0.12 + 0.11 / en) * d
    if lam < 0.3:
        return 1.0
    total = 0.0
    for k in range(1, 200):
        term = 2.0 * (-1.0) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam)
        total += term
        if abs(term) < 1e-16:
            break
    return min(1.0, max(0.0, total))


def _ks_normal(x: Tensor, std: float) -> tuple[float, float]:
    """KS statistic and p-value of the sample ``x`` against N(0, std^2)."""
    n = x.numel()
    xs = torch.sort(x.to(_F64)).values
    cdf = torch.special.ndtr(xs / std)
    i = torch.arange(1, n + 1, dtype=_F64)
    d = max(float((i / n - cdf).max()), float((cdf - (i - 1) / n).max()))
    return d, _ks_pvalue(d, n)


def clopper_pearson_upper(successes: int, trials: int, beta: float) -> float:
    """One-sided Clopper-Pearson upper confidence bound on a binomial proportion.

    The smallest ``p`` with ``P(Binomial(trials, p) <= successes) <= beta``: with probability at
    least ``1 - beta`` the true proportion is below it (exact, not an approximation). Computed by
    bisection on the binomial log-CDF (a log-sum-exp of log-gamma terms in float64), i.e. the
    ``1 - beta`` quantile of Beta(successes + 1, trials - successes) without scipy.

    References:
        Clopper and Pearson 1934, "The use of confidence or fiducial limits illustrated in the
        case of the binomial".
    """
    k, n = int(successes), int(trials)
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"clopper_pearson_upper: need 0 <= successes <= trials and trials >= 1, got {successes=}, {trials=}.")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"clopper_pearson_upper: beta={beta!r} must be in (0, 1).")
    if k == n:
        return 1.0
    if k == 0:
        return -math.expm1(math.log(beta) / n)  # (1 - p)^n = beta
    # for p >= k/n the terms grow with i up to k; those 40 sd below k are below e^-800 of the last
    first = max(0, int(k - 40.0 * math.sqrt(k + 1.0) - 40.0))
    i = torch.arange(first, k + 1, dtype=_F64)
    log_choose = math.lgamma(n + 1.0) - torch.lgamma(i + 1.0) - torch.lgamma(n - i + 1.0)
    target = math.log(beta)

    def log_cdf(log_p: float) -> float:
        p = math.exp(log_p)
        return float(torch.logsumexp(log_choose + i * log_p + (n - i) * math.log1p(-p), 0))

    lo, hi = math.log(k / n), 0.0  # log_cdf(lo) ~ log(1/2) > log(beta); log_cdf(0) = -inf
    while hi - lo > 1e-13:  # relative precision 1e-13 on p
        mid = 0.5 * (lo + hi)
        if log_cdf(mid) > target:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


# ---------------------------------------------------------------------------------------------
# Pytree helpers
# ---------------------------------------------------------------------------------------------


def _is_float(x: Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def _map(fn: Callable[[Tensor], Tensor], tree: Any) -> Any:
    return optree.tree_map(fn, tree, namespace="torch")


def _leaves(tree: Any) -> list[Tensor]:
    return optree.tree_leaves(tree, namespace="torch")


def _set_rows(batch: Any, rows: Tensor | int, value: Callable[[Tensor], Tensor]) -> Any:
    """A copy of ``batch`` whose rows ``rows`` hold ``value(leaf)`` (broadcast to the rows)."""

    def one(leaf: Tensor) -> Tensor:
        out = leaf.clone()
        out[rows] = value(leaf)
        return out

    return _map(one, batch)


def _flat_rows(grads: Any) -> Tensor:
    """Per-sample gradients ``{k: [B, ...]}`` as one float64 ``[B, P]`` matrix."""
    leaves = _leaves(grads)
    b = leaves[0].shape[0]
    return torch.cat([g.detach().reshape(b, -1).to(_F64) for g in leaves], dim=1)


def _params_of(state: Any) -> dict[str, Tensor]:
    params = getattr(state, "params", None)
    if not isinstance(params, dict):
        raise TypeError(f"expected a TrainState (with a .params dict), got {type(state).__name__}.")
    return params


def _update_distance(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return math.sqrt(sum(float((a[k].detach().to(_F64) - b[k].detach().to(_F64)).square().sum()) for k in a))


def _rounding_slack(*trees: dict[str, Tensor]) -> float:
    """L2 norm of one float spacing per coordinate at the largest magnitude in ``trees``.

    Two parameter vectors ``p - u1`` and ``p - u2`` computed in float32 each carry a rounding
    error of at most half a spacing per coordinate; their difference at most one spacing.
    """
    total = 0.0
    for k in trees[0]:
        if not _is_float(trees[0][k]):
            continue
        big = torch.stack([t[k].detach().abs() for t in trees]).amax(0)
        spacing = torch.nextafter(big, torch.full_like(big, math.inf)) - big
        total += float(spacing.to(_F64).square().sum())
    return math.sqrt(total)


def _rng_devices(tree: Any) -> list[int]:
    return sorted({x.device.index or 0 for x in _leaves(tree) if isinstance(x, Tensor) and x.device.type == "cuda"})


def _seeded(seed: int, devices: list[int], fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with torch's global RNG seeded to ``seed``, restoring the caller's RNG after.

    Random layers inside ``vmap(randomness='different' | 'same')`` draw from the global RNG; a
    fixed seed makes two runs see the same dropout masks, so only what the check varies differs.
    """
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return fn()


# ---------------------------------------------------------------------------------------------
# Per-sample independence
# ---------------------------------------------------------------------------------------------


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
        if _is_float(leaf):
            scale = float(leaf.detach().to(_F64).std()) if leaf.numel() > 1 else 1.0
            scale = scale if math.isfinite(scale) and scale > 0 else 1.0
            noise = torch.randn(row.shape, generator=gen, dtype=_F64).to(dtype=row.dtype, device=row.device)
            row = row + 0.5 * scale * noise
        return row

    return _set_rows(batch, j, value)


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
    devices = _rng_devices((params, shared, batch))

    def run(data: Any, s: int = seed) -> Tensor:
        return _flat_rows(_seeded(s, devices, lambda: grads_fn(params, *shared, data)))

    base = run(batch)
    scale = float(base.norm(dim=1).max())
    scale = scale if scale > 0 else 1.0
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

    loss_is_random, copies_diff = None, None
    if randomness != "error":
        loss_is_random = bool(((run(batch, seed + 1) - base).norm(dim=1) / scale > rtol).any())
        if loss_is_random:
            copies = _map(lambda leaf: leaf[:1].expand(leaf.shape).clone(), batch)
            g = run(copies)
            copy_scale = float(g.norm(dim=1).max()) or 1.0
            copies_diff = float((g - g[:1]).norm(dim=1).max()) / copy_scale

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
    return _finish(
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


# ---------------------------------------------------------------------------------------------
# Sensitivity of the step
# ---------------------------------------------------------------------------------------------


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
            "optimizer, seed=0) with a step made with secure=False."
        )


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

    The noise cancels: both runs start from the same seeded state, so they add the same noise (a
    step with ``noise_multiplier=0`` works too). All runs use torch's global RNG seeded to
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
    for name, v in (("lr", lr), ("l2_clip_norm", l2_clip_norm), ("expected_batch_size", expected_batch_size)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
            raise ValueError(f"{call}: {name}={v!r} must be a finite number > 0.")
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
    devices = _rng_devices((state.params, batch))

    def params_after(data: Any, m: Tensor) -> dict[str, Tensor]:
        new, _ = _seeded(seed, devices, lambda: step(state, data, m, *shared))
        return _params_of(new)

    # 1. padded rows are inert, bitwise
    first = real[0]
    nan_batch = _set_rows(batch, pad, lambda leaf: torch.full_like(leaf[first], math.nan) if _is_float(leaf) else leaf[first])
    huge_batch = _set_rows(batch, pad, lambda leaf: leaf[first] * (-scale) + 1.0 if _is_float(leaf) else leaf[first])
    clean = params_after(batch, mask)
    inert = True
    leaked = []
    for what, data in (("NaN", nan_batch), ("huge finite values", huge_batch)):
        other = params_after(data, mask)
        bad = [k for k in clean if not torch.equal(clean[k], other[k])]
        if bad:
            inert = False
            leaked.append(f"{what} (changed {bad[:3]}, distance {_update_distance(clean, other):.3g})")

    # 2. one added sample moves the update by at most lr * C / E[B]
    bound = lr * l2_clip_norm / expected_batch_size
    slot = pad[0]
    if adversarial is not None:
        candidates = [("the given adversarial sample", adversarial)]
    else:
        candidates = []
        for r in real[:3]:
            for sgn in (1.0, -1.0):
                row = _map(lambda leaf: leaf[r] * (sgn * scale) if _is_float(leaf) else leaf[r], batch)
                candidates.append((f"row {r} x {sgn * scale:g}", row))
    none = torch.zeros_like(mask)
    one = none.clone()
    one[first] = True
    bases = [("the batch's real rows", mask), ("an empty batch", none)]
    if len(real) > 1:
        bases.append(("one real row", one))
    worst, max_dist, max_ratio, slack_at_worst, pairs = "", 0.0, 0.0, 0.0, 0
    failed, n_failed = None, 0
    start = state.params
    for base_name, base in bases:
        with_adv = base.clone()
        with_adv[slot] = True
        for cand_name, row in candidates:
            data = _with_row(call, batch, slot, row)
            a = params_after(data, base)
            b = params_after(data, with_adv)
            dist = _update_distance(a, b)
            slack = 2.0 * _rounding_slack(a, b, start)
            pairs += 1
            ratio = dist / bound if math.isfinite(dist) else math.inf
            if not math.isfinite(dist) or dist > max_dist:
                max_dist, max_ratio, slack_at_worst = dist, ratio, slack
                worst = f"{base_name} + {cand_name}"
            if not math.isfinite(dist) or dist > bound * (1.0 + rtol) + slack:
                n_failed += 1
                if failed is None or not ratio <= failed[3]:
                    failed = (base_name, cand_name, dist, ratio, slack)
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
    return _finish(
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


# ---------------------------------------------------------------------------------------------
# Noise calibration
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NoiseReport:
    """Result of :func:`check_noise_calibration`.

    ``samples`` coordinates of the difference of two updates that differ only in their noise seed;
    ``expected_std = sqrt(2) * lr * noise_multiplier * l2_clip_norm / expected_batch_size``;
    ``std_ratio`` = measured std / expected std (1 when calibrated; 0.707 for noise off by sqrt(2)).
    The three p-values (mean, variance, Kolmogorov-Smirnov) are each compared with ``alpha / 3``.
    """

    passed: bool
    samples: int
    noise_multiplier: float
    expected_std: float
    measured_std: float
    std_ratio: float
    mean: float
    mean_pvalue: float
    var_pvalue: float
    ks_statistic: float
    ks_pvalue: float
    alpha: float
    message: str

    def __str__(self) -> str:
        return self.message


def check_noise_calibration(
    step: Callable[..., Any],
    state: Any,
    batch: Any,
    mask: Tensor,
    *shared: Any,
    lr: float,
    l2_clip_norm: float,
    expected_batch_size: float,
    noise_multiplier: float | None = None,
    alpha: float = 1e-3,
    min_samples: int = 20_000,
    seed: int = 0,
    raise_on_failure: bool = True,
) -> NoiseReport:
    """Check that the step's noise is N(0, (noise_multiplier * l2_clip_norm / expected_batch_size)^2).

    Works on your real model and data: the step is run twice from the same state with two
    different noise seeds (``state._replace(noise_seed=...)``; a secure state is simply run twice)
    on the same batch. The clipped sums are identical, so the difference of the two new parameter
    vectors is pure noise: ``lr * (z1 - z2) / expected_batch_size`` with ``z ~ N(0, (sigma C)^2)``
    per coordinate, i.e. std ``sqrt(2) * lr * sigma * C / E[B]`` (plain SGD, first step). Pairs are
    repeated until ``min_samples`` coordinates are collected, then three tests run, each at
    ``alpha / 3`` (Bonferroni; false-alarm rate at most about ``alpha``): the mean is 0 (z-test),
    the variance is the expected one (normal approximation of the sample variance), and the
    distribution is that normal (Kolmogorov-Smirnov). With the default 20,000 samples a std off by
    5% fails almost surely, one off by sqrt(2) always.

    Args:
        step, state, batch, mask, shared: as for :func:`check_sensitivity`.
        lr, l2_clip_norm, expected_batch_size: the step's hyperparameters.
        noise_multiplier: the noise the step should add; default: what the step wrote in the
            ledger, so that the check compares the noise released with the noise claimed.
        alpha: false-alarm rate.
        min_samples: how many noise coordinates to test (at least 1000).
        seed: seeds the noise seeds and torch's global RNG (dropout masks are the same in both runs).
        raise_on_failure: raise :class:`PrivacyCheckError` on failure (default) or return the report.

    Returns:
        A :class:`NoiseReport`.

    Raises:
        PrivacyCheckError: the released noise has the wrong std, a non-zero mean or is not Gaussian.
        ValueError: the expected noise std is zero, or too small to resolve in the params' dtype.
    """
    call = "check_noise_calibration(step, state, batch, mask, *shared)"
    for name, v in (("lr", lr), ("l2_clip_norm", l2_clip_norm), ("expected_batch_size", expected_batch_size)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
            raise ValueError(f"{call}: {name}={v!r} must be a finite number > 0.")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"{call}: alpha={alpha!r} must be in (0, 1).")
    if min_samples < 1000:
        raise ValueError(f"{call}: min_samples={min_samples!r} must be >= 1000 for the KS approximation.")
    params = _params_of(state)
    per_pair = sum(v.numel() for v in params.values() if _is_float(v))
    pairs = max(1, math.ceil(min_samples / per_pair))
    devices = _rng_devices((params, batch))
    secure = getattr(state, "noise_seed", 0) is None
    diffs, recorded = [], None
    for r in range(pairs):
        if secure:
            s1 = s2 = state
        else:
            s1 = state._replace(noise_seed=(seed * 1_000_003 + 2 * r + 1) % (1 << 62))
            s2 = state._replace(noise_seed=(seed * 1_000_003 + 2 * r + 2) % (1 << 62))
        a, _ = _seeded(seed, devices, lambda: step(s1, batch, mask, *shared))
        b, _ = _seeded(seed, devices, lambda: step(s2, batch, mask, *shared))
        pa, pb = _params_of(a), _params_of(b)
        diffs.append(torch.cat([(pa[k].detach().to(_F64) - pb[k].detach().to(_F64)).flatten() for k in pa if _is_float(pa[k])]))
        if recorded is None:
            ledger = getattr(a, "ledger", None)
            events = getattr(ledger, "events", ())
            recorded = events[-1] if events else None
    if noise_multiplier is None:
        if isinstance(recorded, PoissonGaussianEvent):
            noise_multiplier = recorded.noise_multiplier
        elif isinstance(recorded, NonPrivateEvent):
            noise_multiplier = 0.0
        else:
            raise ValueError(f"{call}: the step wrote no privacy event to state.ledger; pass noise_multiplier=.")
    if not noise_multiplier > 0:
        raise ValueError(f"{call}: noise_multiplier={noise_multiplier!r}: a step without noise has nothing to calibrate (epsilon is infinite).")
    x = torch.cat(diffs)
    n = x.numel()
    expected = math.sqrt(2.0) * lr * noise_multiplier * l2_clip_norm / expected_batch_size
    flat = torch.cat([v.detach().abs().flatten() for v in params.values() if _is_float(v)])
    spacing = float((torch.nextafter(flat, torch.full_like(flat, math.inf)) - flat).median())
    if expected < 100.0 * spacing:
        raise ValueError(
            f"{call}: the expected noise in the params, std {expected:.3g}, is below 100 float spacings of the "
            f"params ({spacing:.3g}); rounding would distort the test. Use a larger lr or params nearer zero."
        )
    mean = float(x.mean())
    var = float(x.var())
    measured = math.sqrt(var)
    mean_p = _two_sided_p(mean / (expected / math.sqrt(n)))
    var_p = _two_sided_p((var / expected**2 - 1.0) / math.sqrt(2.0 / (n - 1)))
    ks_d, ks_p = _ks_normal(x, expected)
    each = alpha / 3.0
    fails = [name for name, p in (("mean", mean_p), ("variance", var_p), ("Kolmogorov-Smirnov", ks_p)) if p < each]
    passed = not fails
    ratio = measured / expected
    figures = (
        f"{n} noise coordinates from {pairs} pair(s) of runs: measured std {measured:.6g}, expected sqrt(2) * lr * "
        f"noise_multiplier * l2_clip_norm / expected_batch_size = sqrt(2) * {lr:g} * {noise_multiplier:g} * {l2_clip_norm:g} / "
        f"{expected_batch_size:g} = {expected:.6g} (ratio {ratio:.4f}); mean {mean:.3g} (p={mean_p:.3g}); variance "
        f"p={var_p:.3g}; KS D={ks_d:.4f} (p={ks_p:.3g}); each test at alpha/3 = {each:.3g}"
    )
    if passed:
        message = f"check_noise_calibration: passed: {figures}."
    else:
        hint = (
            "noise std too small by about sqrt(2) (std drawn as sigma * C / sqrt(2), variance and std confused, or "
            "noise shared/halved across two terms)"
            if abs(ratio - 1 / math.sqrt(2)) < 0.05
            else "noise std off (sigma * C not used, divided by the realised instead of the expected batch size, or "
            "noise scaled before instead of after the sum)"
            if "variance" in fails or "Kolmogorov-Smirnov" in fails
            else "biased noise"
        )
        message = (
            f"{call}: FAILED ({', '.join(fails)}): {figures}. The released noise is not what the ledger claims; "
            f"epsilon is wrong. Likely bug: {hint}. (Assumes plain SGD without momentum on the first step.)"
        )
    return _finish(
        NoiseReport(
            passed=passed,
            samples=n,
            noise_multiplier=float(noise_multiplier),
            expected_std=expected,
            measured_std=measured,
            std_ratio=ratio,
            mean=mean,
            mean_pvalue=mean_p,
            var_pvalue=var_p,
            ks_statistic=ks_d,
            ks_pvalue=ks_p,
            alpha=alpha,
            message=message,
        ),
        raise_on_failure,
    )


# ---------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplerReport:
    """Result of :func:`check_sampler`.

    Batch sizes over ``steps`` steps against Binomial(num_samples, sample_rate): ``mean_batch_size``
    vs ``expected_mean``, ``var_batch_size`` vs ``expected_var``; ``dispersion_z``: how far the
    per-example inclusion counts spread from Binomial(steps, sample_rate) (negative: too even, as
    with shuffled epochs; positive: some examples favoured or never drawn); ``overlap_mean``: the
    mean number of examples shared by consecutive batches, vs ``expected_overlap`` (0 for
    shuffled epochs). Each p-value is compared with ``alpha / 4``.
    """

    passed: bool
    steps: int
    num_samples: int
    sample_rate: float
    mean_batch_size: float
    expected_mean: float
    var_batch_size: float
    expected_var: float
    dispersion_z: float
    overlap_mean: float
    expected_overlap: float
    pvalues: dict[str, float]
    duplicates: int
    out_of_range: int
    alpha: float
    message: str

    def __str__(self) -> str:
        return self.message


def check_sampler(
    sampler: Iterable[tuple[Tensor, Tensor]],
    *,
    steps: int = 1000,
    alpha: float = 1e-3,
    num_samples: int | None = None,
    sample_rate: float | None = None,
    raise_on_failure: bool = True,
) -> SamplerReport:
    """Check that a sampler's batches are independent Poisson samples with rate ``sample_rate``.

    Draws ``steps`` batches (iterating the sampler again as needed; each yields ``(indices, mask)``
    as :class:`vmapdp.data.PoissonSampler` does) and tests what Poisson sampling implies:

    * no example twice in one batch and every index in range (exact);
    * the batch size is Binomial(N, q): its mean (z-test) and its variance (normal approximation
      of the sample variance, with the binomial's kurtosis) -- fixed-size batches have variance 0;
    * each example's inclusion count over the steps is Binomial(steps, q), independently: the
      dispersion statistic ``sum_i (c_i - steps q)^2 / (steps q (1 - q))`` has mean N and a known
      variance -- shuffled epochs make it far too small, examples dropped or favoured too large;
    * consecutive batches share ``N q^2`` examples on average (z-test on the mean overlap) --
      shuffled epochs share none, a reused batch shares all.

    The four tests each run at ``alpha / 4`` (Bonferroni), two-sided, with normal approximations:
    the false-alarm rate is about ``alpha`` when ``N q (1 - q)`` is at least ~10 and ``steps`` at
    least a few hundred. ``sample_rate=1`` is checked exactly (every batch is the whole dataset).

    Args:
        sampler: an iterable of ``(indices, mask)`` with ``num_samples`` and ``sample_rate``
            attributes (or pass them).
        steps: how many batches to draw.
        alpha: false-alarm rate.
        num_samples, sample_rate: the dataset size and the rate the accountant is told.
        raise_on_failure: raise :class:`PrivacyCheckError` on failure (default) or return the report.

    Returns:
        A :class:`SamplerReport`.

    Raises:
        PrivacyCheckError: the batches are not Poisson(sample_rate) samples.
        ValueError: missing ``num_samples``/``sample_rate``, fewer than 2 steps, an empty sampler.
    """
    call = "check_sampler(sampler)"
    n = num_samples if num_samples is not None else getattr(sampler, "num_samples", None)
    q = sample_rate if sample_rate is not None else getattr(sampler, "sample_rate", None)
    if n is None or q is None:
        raise ValueError(f"{call}: the sampler has no num_samples/sample_rate attributes; pass num_samples= and sample_rate=.")
    n, q = int(n), float(q)
    if not 0.0 < q <= 1.0 or n < 1:
        raise ValueError(f"{call}: need num_samples >= 1 and sample_rate in (0, 1], got {n}, {q}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"{call}: steps={steps!r} must be an int >= 2.")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"{call}: alpha={alpha!r} must be in (0, 1).")
    sizes = torch.zeros(steps, dtype=_F64)
    overlaps = torch.zeros(steps - 1, dtype=_F64)
    counts = torch.zeros(n, dtype=_F64)
    duplicates = out_of_range = 0
    prev = None
    taken = 0
    while taken < steps:
        before = taken
        for indices, m in sampler:
            check_mask(m, indices.shape[0], call=call)
            idx = indices[m].to(torch.int64).cpu()
            bad = (idx < 0) | (idx >= n)
            out_of_range += int(bad.sum())
            idx = idx[~bad]
            member = torch.zeros(n, dtype=torch.bool)
            member[idx] = True
            duplicates += idx.numel() - int(member.sum())
            sizes[taken] = float(m.sum())
            counts += member.to(_F64)
            if prev is not None:
                overlaps[taken - 1] = float((prev & member).sum())
            prev = member
            taken += 1
            if taken == steps:
                break
        if taken == before:
            raise ValueError(f"{call}: the sampler yielded no batches.")
    s = steps
    mean, var = float(sizes.mean()), float(sizes.var())
    e_mean, e_var = n * q, n * q * (1 - q)
    e_overlap = n * q * q
    overlap = float(overlaps.mean())
    pvalues: dict[str, float] = {}
    dispersion_z = 0.0
    if q < 1.0:
        pvalues["batch-size mean"] = _two_sided_p((mean - e_mean) / math.sqrt(e_var / s))
        kurt = (1.0 - 6.0 * q * (1 - q)) / e_var  # excess kurtosis of Binomial(n, q)
        pvalues["batch-size variance"] = _two_sided_p((var - e_var) / (e_var * math.sqrt(2.0 / (s - 1) + kurt / s)))
        v = s * q * (1 - q)
        mu4_ratio = 1.0 / v + 3.0 * (s - 2) / s  # E[(c - sq)^4] / v^2 for c ~ Binomial(s, q)
        stat = float(((counts - s * q) ** 2).sum()) / v
        dispersion_z = (stat - n) / math.sqrt(n * (mu4_ratio - 1.0))
        pvalues["inclusion-count dispersion"] = _two_sided_p(dispersion_z)
        ov_var = ((s - 1) * n * q * q * (1 - q * q) + 2 * (s - 2) * n * (q**3 - q**4)) / (s - 1) ** 2
        pvalues["consecutive-batch overlap"] = _two_sided_p((overlap - e_overlap) / math.sqrt(ov_var))
        each = alpha / 4.0
        fails = [k for k, p in pvalues.items() if p < each]
    else:
        each = alpha
        fails = ["full batches"] if bool((sizes != n).any()) else []
    if duplicates:
        fails.append(f"{duplicates} duplicate(s) within a batch")
    if out_of_range:
        fails.append(f"{out_of_range} index(es) out of range")
    passed = not fails
    figures = (
        f"{s} steps of N={n}, q={q:g}: batch size mean {mean:.4g} (Poisson: {e_mean:.4g}), variance {var:.4g} "
        f"(Poisson: {e_var:.4g}); inclusion-count dispersion z={dispersion_z:.3g}; consecutive batches share "
        f"{overlap:.4g} examples (Poisson: {e_overlap:.4g}); p-values "
        + ", ".join(f"{k} {p:.3g}" for k, p in pvalues.items())
        + f" (each at alpha/{4 if q < 1 else 1} = {each:.3g})"
    )
    if passed:
        message = f"check_sampler: passed: {figures}."
    else:
        hints = []
        if "batch-size variance" in fails and var < e_var:
            hints.append("fixed-size batches (shuffling, drop_last, truncation at a capacity) instead of Poisson sampling")
        if "batch-size mean" in fails:
            hints.append(f"a sampling rate other than the q={q:g} reported to the accountant")
        if "inclusion-count dispersion" in fails:
            hints.append(
                "examples drawn without replacement across steps (epochs)"
                if dispersion_z < 0
                else "some examples favoured or never drawn (dropped tail, duplicated rows)"
            )
        if "consecutive-batch overlap" in fails:
            hints.append("batches not independent across steps")
        if duplicates or out_of_range:
            hints.append("indices repeated or outside the dataset")
        message = (
            f"{call}: FAILED ({'; '.join(fails)}): {figures}. The accountant assumes each example is in each batch "
            f"independently with probability {q:g} (Poisson subsampling); otherwise the reported epsilon is wrong. "
            f"Likely: {'; '.join(hints) or 'not a Poisson sampler'}. Use vmapdp.data.PoissonSampler."
        )
    return _finish(
        SamplerReport(
            passed=passed,
            steps=s,
            num_samples=n,
            sample_rate=q,
            mean_batch_size=mean,
            expected_mean=e_mean,
            var_batch_size=var,
            expected_var=e_var,
            dispersion_z=dispersion_z,
            overlap_mean=overlap,
            expected_overlap=e_overlap,
            pvalues=pvalues,
            duplicates=duplicates,
            out_of_range=out_of_range,
            alpha=alpha,
            message=message,
        ),
        raise_on_failure,
    )


# ---------------------------------------------------------------------------------------------
# Ledger
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LedgerReport:
    """Result of :func:`check_ledger`: the ledger expected after the steps and the one recorded,
    with the epsilon each implies at ``delta``."""

    passed: bool
    steps_taken: int
    expected: Ledger
    recorded: Ledger
    epsilon_expected: float
    epsilon_recorded: float
    delta: float
    message: str

    def __str__(self) -> str:
        return self.message


def _ledger_of(call: str, name: str, state: Any) -> Ledger:
    ledger = state if isinstance(state, Ledger) else getattr(state, "ledger", None)
    if not isinstance(ledger, Ledger):
        raise TypeError(f"{call}: {name} must be a TrainState (or a Ledger), got {type(state).__name__}.")
    return ledger


def check_ledger(
    state_before: Any,
    state_after: Any,
    *,
    steps: int,
    noise_multiplier: float,
    sample_rate: float,
    delta: float = 1e-5,
    accountant: str = "rdp",
    raise_on_failure: bool = True,
) -> LedgerReport:
    """Check that the ledger the step wrote matches the steps taken, the noise and the sampling rate.

    The accountant only knows what the ledger says: a step that records a smaller sampling rate or
    a larger noise multiplier than it used, or records nothing, reports a false epsilon. Exact:
    ``state_after.ledger`` must equal ``state_before.ledger`` followed by ``steps`` events of
    ``PoissonGaussianEvent(noise_multiplier, sample_rate)`` (a ``NonPrivateEvent`` for noise 0),
    and the step counter must have advanced by ``steps``.

    Args:
        state_before, state_after: train states (or ledgers) around the steps.
        steps: how many steps were taken.
        noise_multiplier: the noise std / l2_clip_norm the step was meant to add.
        sample_rate: the Poisson rate the batches were really drawn with (the sampler's).
        delta, accountant: to report the epsilon implied by each ledger.
        raise_on_failure: raise :class:`PrivacyCheckError` on failure (default) or return the report.

    Returns:
        A :class:`LedgerReport`.

    Raises:
        PrivacyCheckError: the recorded ledger differs from the expected one.
    """
    call = "check_ledger(state_before, state_after)"
    before = _ledger_of(call, "state_before", state_before)
    after = _ledger_of(call, "state_after", state_after)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"{call}: steps={steps!r} must be an int >= 0.")
    if steps == 0:
        added = Ledger()
    elif noise_multiplier == 0:
        added = Ledger((NonPrivateEvent(count=steps),))
    else:
        added = Ledger().record(noise_multiplier=noise_multiplier, sample_rate=sample_rate, count=steps)
    expected = before.extend(added)
    problems = []
    b_step, a_step = getattr(state_before, "step", None), getattr(state_after, "step", None)
    taken = steps if b_step is None or a_step is None else a_step - b_step
    if taken != steps:
        problems.append(f"the step counter advanced by {taken}, not {steps}")
    if after != expected:
        problems.append(f"the ledger records {list(after.events)}, expected {list(expected.events)}")

    def eps(ledger: Ledger) -> float:
        if not ledger.events:
            return 0.0
        if any(isinstance(e, NonPrivateEvent) for e in ledger.events):
            return math.inf
        return float(accounting.epsilon(ledger, delta=delta, accountant=accountant))

    e_exp, e_rec = eps(expected), eps(after)
    passed = not problems
    if passed:
        message = f"check_ledger: passed: {steps} step(s) recorded as {list(added.events)}; epsilon {e_rec:.4g} at delta={delta:g} ({accountant})."
    else:
        hint = []
        rec_new = after.events[len(before.events) - 1 :] if before.events else after.events
        rates = {e.sample_rate for e in rec_new if isinstance(e, PoissonGaussianEvent)}
        sigmas = {e.noise_multiplier for e in rec_new if isinstance(e, PoissonGaussianEvent)}
        if rates and rates != {float(sample_rate)}:
            hint.append(f"the step was built with sample_rate={sorted(rates)} but the batches were drawn at {sample_rate:g}")
        if sigmas and noise_multiplier and sigmas != {float(noise_multiplier)}:
            hint.append(f"it records noise_multiplier={sorted(sigmas)} instead of {noise_multiplier:g}")
        if after.steps - before.steps != steps:
            hint.append(f"{after.steps - before.steps} event(s) recorded for {steps} step(s) (a step that skips or doubles the record)")
        message = (
            f"{call}: FAILED: {'; '.join(problems)}. The accountant would report epsilon {e_rec:.4g} instead of "
            f"{e_exp:.4g} at delta={delta:g} ({accountant}). Likely: {'; '.join(hint) or 'a ledger written by hand'}. "
            "Build the step with the sampler's sample_rate (make_train_step(..., sample_rate=sampler.sample_rate))."
        )
    return _finish(
        LedgerReport(
            passed=passed,
            steps_taken=taken,
            expected=expected,
            recorded=after,
            epsilon_expected=e_exp,
            epsilon_recorded=e_rec,
            delta=delta,
            message=message,
        ),
        raise_on_failure,
    )


# ---------------------------------------------------------------------------------------------
# White-box audit
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Result of :func:`audit_epsilon_lower_bound`.

    ``epsilon_lower_bound`` holds with confidence ``1 - beta`` for the step as run;
    ``claimed_epsilon`` is what its ledger says (one step) at ``delta``. On the held-out half,
    ``false_positives`` of ``held_out`` trials without the canary and ``false_negatives`` of
    ``held_out`` with it were misclassified by the threshold chosen on the other half;
    ``fpr_upper``/``fnr_upper`` are their Clopper-Pearson upper bounds (each at ``beta / 2``).
    """

    passed: bool
    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    beta: float
    noise_multiplier: float
    trials: int
    held_out: int
    false_positives: int
    false_negatives: int
    fpr_upper: float
    fnr_upper: float
    threshold: float
    seconds: float
    message: str

    def __str__(self) -> str:
        return self.message


def _approx_upper(k: Tensor, n: int) -> Tensor:
    """Wilson-style 95% upper bounds, vectorised (only used to choose the threshold)."""
    z2 = 1.96**2
    return (k + z2 / 2 + 1.96 * torch.sqrt(k + z2 / 4)) / n


def _choose_threshold(out_scores: Tensor, in_scores: Tensor, delta: float) -> tuple[float, float]:
    """The (orientation, threshold) that maximises an approximate epsilon lower bound."""
    best = (-math.inf, 1.0, 0.0)
    h0, h1 = out_scores.numel(), in_scores.numel()
    for orient in (1.0, -1.0):
        x0 = torch.sort(orient * out_scores).values
        x1 = torch.sort(orient * in_scores).values
        cand = torch.cat([x0, x1])
        fp = (h0 - torch.searchsorted(x0, cand, right=True)).to(_F64)
        fn = torch.searchsorted(x1, cand, right=True).to(_F64)
        fpu, fnu = _approx_upper(fp, h0).clamp(max=1.0), _approx_upper(fn, h1).clamp(max=1.0)
        e1 = torch.log((1 - delta - fnu).clamp_min(1e-300) / fpu)
        e2 = torch.log((1 - delta - fpu).clamp_min(1e-300) / fnu)
        e = torch.maximum(e1, e2)
        i = int(e.argmax())
        if float(e[i]) > best[0]:
            best = (float(e[i]), orient, float(cand[i]))
    return best[1], best[2]


def _audit_loss(params: dict[str, Tensor], sample: tuple[Tensor, Tensor]) -> Tensor:
    """``w[idx] * x`` for one sample ``(idx, x)``: its gradient is ``x`` on coordinate ``idx`` only."""
    idx, x = sample
    return torch.index_select(params["w"], 0, idx.reshape(1)).sum() * x


def audit_epsilon_lower_bound(
    make_step: Callable[..., Callable[..., Any]] | None = None,
    *,
    noise_multiplier: float = 1.0,
    l2_clip_norm: float = 1.0,
    lr: float = 1.0,
    trials: int = 100_000,
    delta: float = 1e-2,
    beta: float = 0.05,
    canary: float = 1e3,
    others: Sequence[float] = (0.5,),
    coordinates: int = 256,
    accountant: str = "pld",
    seed: int = 0,
    compile: bool = False,
    raise_on_failure: bool = True,
) -> AuditReport:
    """White-box audit: an empirical lower bound on epsilon of one real step, vs the epsilon claimed.

    The step under audit is built by ``make_step`` (default :func:`vmapdp.make_train_step`)
    exactly as a user builds it, for a model whose parameter ``w`` has one coordinate per trial and
    the loss ``w[idx] * x`` of one sample ``(idx, x)``: a sample's gradient is ``x`` on coordinate
    ``idx`` and zero elsewhere. Per-sample L2 clipping therefore clips each sample on its own
    coordinate, the noise is independent per coordinate, and each coordinate of the released
    parameter is one independent run of the one-dimensional mechanism: ``coordinates`` trials per
    step (``coordinates=1`` is literally the one-parameter model, one trial per step, and slow).

    Each trial's dataset is ``others`` (fixed samples with gradients ``o * l2_clip_norm``), plus,
    in the trials of the "in" world, a canary with gradient ``canary * l2_clip_norm`` (huge: a
    correct step clips it to ``l2_clip_norm``). Full batch: ``sample_rate=1``, the canary is in via
    the mask; ``expected_batch_size = len(others) + 1``. ``trials`` runs per world; a threshold on
    the released parameter is chosen on the first half and evaluated on the held-out half, whose
    false-positive and false-negative rates get Clopper-Pearson upper bounds at ``beta / 2``
    each, so that, with probability at least ``1 - beta``,

        epsilon >= max(log((1 - delta - FNR_up) / FPR_up), log((1 - delta - FPR_up) / FNR_up)).

    The check fails if this lower bound exceeds the epsilon the step's own ledger claims for its
    one step (``vmapdp.accounting.epsilon(ledger, delta=delta, accountant=accountant)``). A correct
    step fails with probability at most ``beta`` (much less in practice: the bound stays well
    below the claim). Missing clipping gives a lower bound near ``log(trials)``; noise too small
    by sqrt(2) exceeds the claim at the default sizes.

    Why ``delta=1e-2`` and ``noise_multiplier=1`` by default: with ~1e5 trials, rates below
    ~1e-4 cannot be measured, and at ``delta=1e-5`` the tight claim is reached only by thresholds
    whose false-positive rate is ~1e-5; at ``delta=1e-2`` the claim is decided by rates near 1e-2,
    so the audit is far sharper. Every (epsilon(delta), delta) point of the claimed privacy
    profile must hold, so auditing at a larger delta is as valid a check of the claim.

    Args:
        make_step: ``make_step(loss_fn, optimizer, *, l2_clip_norm, noise_multiplier,
            expected_batch_size, sample_rate, compile) -> step`` (the signature of
            :func:`vmapdp.make_train_step`; wrap your own step builder in it).
        noise_multiplier, l2_clip_norm, lr: the step's hyperparameters (plain SGD).
        trials: trials per world (the same count with and without the canary).
        delta: the delta of the claimed and the audited epsilon.
        beta: one minus the confidence of the lower bound.
        canary: the canary's gradient in units of ``l2_clip_norm`` (> 1: it must be clipped).
        others: the other samples' gradients in units of ``l2_clip_norm``.
        coordinates: trials per step (the width of ``w``); 128-512 is fastest on a CPU.
        accountant: the accountant of the claimed epsilon (``"pld"``: tight, so the sharpest audit).
        seed: noise seeds are ``seed * 2**32 + step``.
        compile: passed to ``make_step``.
        raise_on_failure: raise :class:`PrivacyCheckError` on failure (default) or return the report.

    Returns:
        An :class:`AuditReport`.

    Raises:
        PrivacyCheckError: the empirical lower bound exceeds the claimed epsilon.

    References:
        Jagielski, Ullman, Oprea 2020, "Auditing differentially private machine learning: how
        private is private SGD?"; Nasr, Song, Thakurta, Papernot, Carlini 2021, "Adversary
        instantiation: lower bounds for differentially private machine learning"; Nasr et al.
        2023, "Tight auditing of differentially private machine learning"; Clopper and Pearson 1934.
    """
    from vmapdp import optim
    from vmapdp.train import init_train_state, make_train_step

    call = "audit_epsilon_lower_bound(make_step)"
    if make_step is None:
        make_step = make_train_step
    if not callable(make_step):
        raise TypeError(f"{call}: make_step must be callable like vmapdp.make_train_step, got {type(make_step).__name__}.")
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"{call}: noise_multiplier={noise_multiplier!r} must be finite and > 0.")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 200:
        raise ValueError(f"{call}: trials={trials!r} must be an int >= 200 (per world).")
    if isinstance(coordinates, bool) or not isinstance(coordinates, int) or coordinates < 1:
        raise ValueError(f"{call}: coordinates={coordinates!r} must be a positive int.")
    if not 0 < delta < 1 or not 0 < beta < 1:
        raise ValueError(f"{call}: delta={delta!r} and beta={beta!r} must be in (0, 1).")
    if not canary > 1:
        raise ValueError(f"{call}: canary={canary!r} must be > 1 (a gradient larger than l2_clip_norm, which the step must clip).")
    t0 = time.perf_counter()
    width = coordinates
    k_others = len(others)
    ebs = float(k_others + 1)
    opt = optim.sgd(lr)
    step = make_step(
        _audit_loss, opt, l2_clip_norm=l2_clip_norm, noise_multiplier=noise_multiplier, expected_batch_size=ebs, sample_rate=1.0, compile=compile
    )
    coord = torch.arange(width)
    idx = coord.repeat(k_others + 1)
    x = torch.cat([torch.full((width,), float(o) * l2_clip_norm) for o in others] + [torch.full((width,), float(canary) * l2_clip_norm)])
    real = torch.ones(width * k_others, dtype=torch.bool)
    params = {"w": torch.zeros(width)}
    in_scores, out_scores = [], []
    n_in = n_out = 0
    s = 0
    claimed = None
    while n_in < trials or n_out < trials:
        world_in = (coord + s) % 2 == 0
        mask = torch.cat([real, world_in])
        state = init_train_state(params, opt, seed=seed * (1 << 32) + s)
        new, _ = step(state, (idx, x), mask)
        if claimed is None:
            ledger = getattr(new, "ledger", None)
            if not isinstance(ledger, Ledger) or not ledger.events:
                raise ValueError(f"{call}: the step wrote no privacy event to its ledger; nothing to compare with.")
            claimed = (
                math.inf
                if any(isinstance(e, NonPrivateEvent) for e in ledger.events)
                else float(accounting.epsilon(ledger, delta=delta, accountant=accountant))
            )
        released = -new.params["w"].detach().to(_F64)  # the canary's gradient pushes w down
        if not bool(torch.isfinite(released).all()):
            raise ValueError(f"{call}: the step released non-finite parameters at step {s}; fix that before auditing its privacy.")
        in_scores.append(released[world_in])
        out_scores.append(released[~world_in])
        n_in += int(world_in.sum())
        n_out += int((~world_in).sum())
        s += 1
    scores_in = torch.cat(in_scores)[:trials]
    scores_out = torch.cat(out_scores)[:trials]
    half = trials // 2
    orient, thr = _choose_threshold(scores_out[:half], scores_in[:half], delta)
    test_out, test_in = orient * scores_out[half:], orient * scores_in[half:]
    m = test_out.numel()
    fp = int((test_out > thr).sum())
    fn = int((test_in <= thr).sum())
    fpu = clopper_pearson_upper(fp, m, beta / 2)
    fnu = clopper_pearson_upper(fn, m, beta / 2)
    bounds = []
    for num, den in ((1 - delta - fnu, fpu), (1 - delta - fpu, fnu)):
        bounds.append(math.log(num / den) if num > 0 and den > 0 else 0.0)
    eps_lb = max(0.0, *bounds)
    if math.isnan(eps_lb):
        eps_lb = math.inf
    passed = eps_lb <= claimed
    seconds = time.perf_counter() - t0
    figures = (
        f"epsilon lower bound {eps_lb:.3f} (confidence {1 - beta:g}) vs claimed {claimed:.3f} at delta={delta:g} "
        f"({accountant}, noise_multiplier={noise_multiplier:g}, one full-batch step); held-out {m} trials per world: "
        f"{fp} false positives (FPR <= {fpu:.3g}), {fn} false negatives (FNR <= {fnu:.3g}); {trials} trials per world "
        f"in {s} steps, {seconds:.1f} s"
    )
    if passed:
        message = f"audit_epsilon_lower_bound: passed: {figures}."
    else:
        message = (
            f"{call}: FAILED: {figures}. The released parameter distinguishes the canary better than the claimed "
            "epsilon allows: the step is less private than its ledger says. Likely bugs: per-sample clipping missing "
            "(the canary's huge gradient gets through), noise std smaller than noise_multiplier * l2_clip_norm (e.g. "
            "off by sqrt(2)), or a ledger that records more noise than is added."
        )
    return _finish(
        AuditReport(
            passed=passed,
            epsilon_lower_bound=eps_lb,
            claimed_epsilon=claimed,
            delta=delta,
            beta=beta,
            noise_multiplier=noise_multiplier,
            trials=trials,
            held_out=m,
            false_positives=fp,
            false_negatives=fn,
            fpr_upper=fpu,
            fnr_upper=fnu,
            threshold=thr,
            seconds=seconds,
            message=message,
        ),
        raise_on_failure,
    )
