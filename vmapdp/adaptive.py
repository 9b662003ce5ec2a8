"""Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021): the clip norm follows a privately
estimated quantile of the per-sample gradient norms.

At every step, with clip norm ``C_t`` (a 0-dim tensor carried in ``TrainState.clip_norm``)::

    b_i  = 1 if ||g_i|| <= C_t else 0                       # per real sample (finite norm)
    s    = sum_i (b_i - 1/2) + N(0, sigma_b^2)               # released: sensitivity 1/2 (add/remove)
    b~   = s / m + 1/2                                       # m: the public expected batch size
    C_t+1 = C_t * exp(-eta * (b~ - gamma))                   # geometric update towards quantile gamma

``b~`` estimates the fraction of unclipped samples without reading the (private) realised batch
size: ``E[sum_i 1/2] = m / 2``. The gradient sum (sensitivity ``C_t``) gets noise std
``sigma_grad * C_t`` and the count noise ``sigma_b``; one sample moves the pair, in units of its
noise, by at most ``sqrt(sigma_grad^-2 + (2 sigma_b)^-2)``. Choosing (the paper's noise split)

    sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)

makes that ``1 / sigma``: the step, count included, is ONE Gaussian mechanism with noise
multiplier ``sigma`` on the sampled batch, and the ledger records exactly that (the sampler's
event at ``sigma``). It needs ``sigma_b > sigma / 2``; the gradient noise grows (``sigma_b = 10
sigma`` costs 0.1% more gradient noise).

References:
  Andrew, Thakkar, McMahan, Ramaswamy. "Differentially Private Learning with Adaptive Clipping."
  NeurIPS 2021 (Algorithm 1; Theorem 1 and Section 3.1 for the noise split).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp.noise import Privatizer, gaussian_privatizer

__all__ = ["AdaptiveClipping"]


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """Adaptive clipping for :func:`vmapdp.make_train_step` (``adaptive_clipping=``): the clip norm
    starts at the step's ``l2_clip_norm`` and follows the ``target_quantile`` of the per-sample
    gradient norms, estimated privately at every step (module docstring).

    Args:
      count_noise_multiplier: ``sigma_b``, the std of the noise on the count of unclipped samples;
        must exceed half the step's ``noise_multiplier``. Andrew et al. use ``m / 20`` for an
        expected batch size ``m``.
      target_quantile: ``gamma`` in (0, 1): the fraction of samples to leave unclipped (0.5: the
        median norm).
      learning_rate: ``eta`` > 0 of the geometric update (0.2 in the paper).
      clip_norm_range: ``(lo, hi)``, public bounds the threshold is clamped to after each update
        (post-processing: no privacy cost). Without them a run whose samples all have zero
        gradients drove the threshold to a subnormal float32, and a huge noisy count to ``inf``,
        which stalled or stopped training.

    Raises:
      TypeError / ValueError: an argument out of range.

    Guarantees:
      With ``noise_multiplier=sigma`` the ledger records the sampler's event at ``sigma``; the
      gradient noise is :meth:`gradient_noise_multiplier` ``* C_t`` and the count noise
      ``sigma_b``, which together are exactly as private as that event says. The threshold is a
      traced 0-dim tensor inside the compiled step, checked like any clip norm (finite, > 0) on
      the host before each step and guarded in the graph (an invalid one releases NaN, nothing).

    References:
      Andrew, Thakkar, McMahan, Ramaswamy. NeurIPS 2021.
    """

    count_noise_multiplier: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    clip_norm_range: tuple[float, float] = (1e-6, 1e6)

    def __post_init__(self):
        call = "AdaptiveClipping"
        object.__setattr__(
            self, "count_noise_multiplier", _checks.positive(call, "count_noise_multiplier", self.count_noise_multiplier, meaning="it is the std of the noise on the count of unclipped samples")
        )
        object.__setattr__(
            self, "target_quantile", _checks.probability(call, "target_quantile", self.target_quantile, allow_zero=False, allow_one=False, meaning="it is the fraction of samples to leave unclipped")
        )
        object.__setattr__(self, "learning_rate", _checks.positive(call, "learning_rate", self.learning_rate, meaning="it is the step size of the geometric clip-norm update"))
        bounds = self.clip_norm_range
        if not (isinstance(bounds, tuple) and len(bounds) == 2):
            raise TypeError(f"{call}: clip_norm_range must be a tuple (lo, hi), got {bounds!r}.")
        lo = _checks.positive(call, "clip_norm_range[0]", bounds[0], meaning="it is the smallest threshold the update may reach")
        hi = _checks.positive(call, "clip_norm_range[1]", bounds[1], meaning="it is the largest threshold the update may reach")
        if not lo < hi:
            raise ValueError(f"{call}: clip_norm_range={bounds!r} must have lo < hi.")
        if lo < _checks.MIN_CLIP_NORM:
            raise ValueError(
                f"{call}: clip_norm_range={bounds!r} lets the threshold fall below 2**-40 (~9.1e-13), the smallest clip norm "
                "vmapdp takes (float32 squares of gradient entries that small underflow); the run would stop there. Use lo >= 1e-12."
            )
        object.__setattr__(self, "clip_norm_range", (lo, hi))

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        """``(sigma^-2 - (2 sigma_b)^-2)^(-1/2)``: the gradient's share of a step at ``noise_multiplier``.

        Raises:
          ValueError: ``count_noise_multiplier <= noise_multiplier / 2`` (the count alone would
          spend the whole step's privacy).
        """
        s, sb = float(noise_multiplier), self.count_noise_multiplier
        rest = s ** -2 - (2.0 * sb) ** -2
        if not rest > 0:
            raise ValueError(
                f"make_train_step(adaptive_clipping=): count_noise_multiplier={sb!r} must be > noise_multiplier / 2 = {s / 2!r}; "
                "the count of unclipped samples (sensitivity 1/2) would then cost the whole step's privacy, leaving none for the "
                f"gradient. Pass count_noise_multiplier well above it (e.g. {10 * s:g}, or expected_batch_size / 20)."
            )
        return rest ** -0.5

    def config(self) -> str:
        """The release-defining configuration (bound into the noise key)."""
        lo, hi = self.clip_norm_range
        return repr(("adaptive", float(self.count_noise_multiplier).hex(), float(self.target_quantile).hex(), float(self.learning_rate).hex(), lo.hex(), hi.hex()))

    def check_step(self, call: str, *, noise_multiplier: float, l2_clip_norm: float, rule: str) -> None:
        """Refuse a step this adaptive clipping cannot serve (checked at ``make_train_step``)."""
        if noise_multiplier == 0 or math.isinf(l2_clip_norm):
            raise ValueError(
                f"{call}: adaptive clipping needs noise_multiplier > 0 and a finite initial l2_clip_norm (got {noise_multiplier!r}, "
                f"{l2_clip_norm!r}); its count is a private release. Drop adaptive_clipping= for a non-private run."
            )
        if rule != "clip":
            raise ValueError(
                f"{call}: adaptive clipping supports rule='clip' (one flat threshold); got rule={rule!r}. Drop adaptive_clipping= or rule=."
            )
        lo, hi = self.clip_norm_range
        if not lo <= l2_clip_norm <= hi:  # (found by review: clamped after the first step without a word)
            raise ValueError(
                f"{call}: the initial l2_clip_norm={l2_clip_norm!r} is outside adaptive clipping's clip_norm_range={self.clip_norm_range!r}, "
                "which the threshold is clamped to after every update. Start inside the range, or widen it."
            )
        self.gradient_noise_multiplier(noise_multiplier)  # raises if the count would spend it all

    def count_privatizer(self, *, secure: bool) -> Privatizer:
        """The count's release: ``N(0, count_noise_multiplier^2)`` on ``sum_i (b_i - 1/2)``, a
        privatizer of the same seam as the gradient's (the step draws it from its own key)."""
        return gaussian_privatizer(self.count_noise_multiplier, secure=secure)

    def release(self, summed: dict, stats: Any, clip_norm: Tensor, key: bytes | None, noise_state: Any, *, privatizer: Privatizer, count_privatizer: Privatizer) -> tuple[dict, Tensor, Any]:
        """The step's two releases, each through a privatizer, from independent streams.

        The gradient: ``privatizer`` gets the clipped sum in units of ``C_t`` (``summed / C_t``,
        recovered exactly: the chunk computed it in those units and multiplied by ``C_t``; the
        division is done in float64 and rounds back to the same float32), so its fixed noise std
        (``gradient_noise_multiplier(sigma) * l2_sensitivity`` for the default) scales with the
        threshold; its release is multiplied back by ``C_t`` (post-processing). The count:
        ``sum_i (b_i - 1/2)`` over the real rows (``b_i = 1`` for an unclipped sample; sensitivity
        1/2), from ``stats`` (summed over ranks with the gradients when distributed), released by
        ``count_privatizer`` with the key ``key + b":adaptive-count"``.

        Returns:
          ``(noisy sum, noisy half count, the privatizer's next state)``.
        """
        c64 = clip_norm.double()
        unit = {k: (v.double() / c64).to(v.dtype) for k, v in summed.items()}
        noisy, noise_state = privatizer.privatize(unit, noise_state, key)
        half_count = 0.5 * stats.rows - stats.clipped - stats.nonfinite
        count, _ = count_privatizer.privatize(half_count, (), None if key is None else key + b":adaptive-count")
        return {k: v * clip_norm for k, v in noisy.items()}, count, noise_state

    def next_clip_norm(self, clip_norm: Tensor, noisy_count: Tensor, expected_batch_size: float) -> tuple[Tensor, Tensor]:
        """``(C_t+1, b~)`` from ``noisy_count = sum_i (b_i - 1/2) + N(0, sigma_b^2)`` (post-processing)."""
        estimate = noisy_count / expected_batch_size + 0.5
        lo, hi = self.clip_norm_range
        updated = clip_norm * torch.exp(-self.learning_rate * (estimate - self.target_quantile))
        return updated.clamp(lo, hi), estimate


def initial_clip_norm(l2_clip_norm: float, device: torch.device) -> Tensor:
    """The threshold of the first step: a float32 0-dim tensor."""
    return torch.tensor(float(l2_clip_norm), dtype=torch.float32, device=device)


def check_clip_norm(call: str, clip_norm: Tensor) -> Tensor:
    """The carried threshold, checked like any clip norm (a 0-dim float tensor, finite, > 0)."""
    if not isinstance(clip_norm, Tensor):
        raise TypeError(f"{call}: state.clip_norm must be a 0-dim tensor (the adaptive clip norm) or None, got {type(clip_norm).__name__}.")
    _checks.clip_norm(call, "state.clip_norm", clip_norm, allow_inf=False)
    if not math.isfinite(float(clip_norm)):
        raise ValueError(f"{call}: state.clip_norm={clip_norm!r} must be finite.")
    return clip_norm
