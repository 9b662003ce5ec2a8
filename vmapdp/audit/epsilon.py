"""White-box audit: a Monte-Carlo lower bound on the epsilon of one real step, vs the epsilon claimed.

:func:`audit_epsilon_lower_bound` builds the step with :func:`vmapdp.make_train_step` (or the
caller's builder), runs it on many one-coordinate trials with and without a canary, and turns
the held-out error rates into a Clopper-Pearson-backed lower bound on epsilon.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from vmapdp import optim
from vmapdp.accounting import Ledger
from vmapdp.audit.ledger import ledger_epsilon
from vmapdp.audit.report import finish
from vmapdp.audit.stats import clopper_pearson_upper
from vmapdp.noise.spent import unreleased
from vmapdp.train import init_train_state, make_train_step

__all__ = ["AuditReport", "audit_epsilon_lower_bound"]


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
        fp = (h0 - torch.searchsorted(x0, cand, right=True)).to(torch.float64)
        fn = torch.searchsorted(x1, cand, right=True).to(torch.float64)
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


def _run_trials(
    call: str,
    step: Callable[..., Any],
    opt: Any,
    *,
    trials: int,
    width: int,
    others: Sequence[float],
    canary: float,
    l2_clip_norm: float,
    seed: int,
    delta: float,
    accountant: str,
) -> tuple[Tensor, Tensor, float, int]:
    """Run the step until each world has ``trials`` released scores, ``width`` trials per step.

    Returns the scores with and without the canary, the epsilon the step's ledger claims for one
    step at ``delta``, and the number of steps run.
    """
    k_others = len(others)
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
        state = init_train_state(params, opt, seed=(1 << 64) + seed * (1 << 32) + s)  # (its own trials on a canary: public by design, above 2**64)
        with unreleased():  # trials on a toy problem, thrown away (vmapdp.noise.spent)
            new, _ = step(state, (idx, x), mask)
        if claimed is None:
            ledger = getattr(new, "ledger", None)
            if not isinstance(ledger, Ledger) or not ledger.events:
                raise ValueError(f"{call}: the step wrote no privacy event to its ledger; nothing to compare with.")
            claimed = ledger_epsilon(ledger, delta=delta, accountant=accountant)
        released = -new.params["w"].detach().to(torch.float64)  # the canary's gradient pushes w down
        if not bool(torch.isfinite(released).all()):
            raise ValueError(f"{call}: the step released non-finite parameters at step {s}; fix that before auditing its privacy.")
        in_scores.append(released[world_in])
        out_scores.append(released[~world_in])
        n_in += int(world_in.sum())
        n_out += int((~world_in).sum())
        s += 1
    return torch.cat(in_scores)[:trials], torch.cat(out_scores)[:trials], claimed, s


def _held_out_bound(scores_in: Tensor, scores_out: Tensor, *, delta: float, beta: float) -> tuple[float, int, int, int, float, float, float]:
    """The epsilon lower bound from a threshold chosen on the first half of the trials, tested on the rest.

    Returns ``(epsilon_lower_bound, held_out, false_positives, false_negatives, fpr_upper,
    fnr_upper, threshold)``; the two upper bounds are Clopper-Pearson at ``beta / 2`` each.
    """
    half = scores_in.numel() // 2
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
    return eps_lb, m, fp, fn, fpu, fnu, thr


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
    opt = optim.sgd(lr)
    step = make_step(
        _audit_loss, opt, l2_clip_norm=l2_clip_norm, noise_multiplier=noise_multiplier, expected_batch_size=float(len(others) + 1), sample_rate=1.0, compile=compile
    )
    scores_in, scores_out, claimed, s = _run_trials(
        call, step, opt, trials=trials, width=coordinates, others=others, canary=canary, l2_clip_norm=l2_clip_norm, seed=seed, delta=delta, accountant=accountant
    )
    eps_lb, m, fp, fn, fpu, fnu, thr = _held_out_bound(scores_in, scores_out, delta=delta, beta=beta)
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
    return finish(
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
