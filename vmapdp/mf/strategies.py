"""Correlated-noise strategies: the matrix ``C`` of a factorization ``A = B C`` (DP matrix factorization).

A strategy is a lower-triangular Toeplitz matrix ``C`` (``n x n`` for an ``n``-step run). Training
with it releases, at step ``t``, the clipped gradient sum plus ``(C^{-1} z)_t``, where the ``z_t``
are independent Gaussians; the noise partly cancels in the prefix sums of the updates. Plain
DP-SGD is ``C = I``.

Two streaming forms, each a frozen dataclass of Python floats (public, part of the step's
configuration):

* :class:`BandedToeplitz`: ``C[t, t-k] = coeffs[k]`` for ``0 <= k < len(coeffs)`` (the band),
  ``0`` below the band; ``coeffs[0] > 0``. ``C^{-1} z`` streams with the last ``band - 1`` outputs.
* :class:`BufferedToeplitz` (BLT, Dvijotham et al. 2024): ``C[t, t] = 1`` and
  ``C[t, t-k] = sum_i omega[i] * theta[i] ** (k - 1)`` for ``k >= 1``. ``C^{-1}`` is again a BLT,
  so ``C^{-1} z`` streams with one buffer per ``theta``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

__all__ = ["BandedToeplitz", "BufferedToeplitz", "toeplitz_matrix"]


def toeplitz_matrix(coeffs: Tensor, n: int) -> Tensor:
    """The ``n x n`` lower-triangular Toeplitz matrix with first column ``coeffs`` (zero-padded or cut to ``n``)."""
    col = torch.zeros(n, dtype=coeffs.dtype)
    m = min(n, coeffs.numel())
    col[:m] = coeffs[:m]
    i = torch.arange(n)
    lag = i[:, None] - i[None, :]
    return torch.where(lag >= 0, col[lag.clamp(min=0)], torch.zeros((), dtype=coeffs.dtype))


@dataclasses.dataclass(frozen=True)
class BandedToeplitz:
    """A banded lower-triangular Toeplitz strategy: ``C[t, t-k] = coeffs[k]`` for ``k < band``."""

    coeffs: tuple[float, ...]

    def __post_init__(self):
        c = tuple(float(x) for x in self.coeffs)
        if not c or not all(torch.isfinite(torch.tensor(c, dtype=torch.float64)).tolist()) or c[0] <= 0:
            raise ValueError(f"BandedToeplitz(coeffs={self.coeffs!r}): coeffs must be a non-empty sequence of finite floats with coeffs[0] > 0.")
        object.__setattr__(self, "coeffs", c)

    @property
    def band(self) -> int:
        return len(self.coeffs)

    def toeplitz_coeffs(self, n: int) -> Tensor:
        """The first column of ``C`` for ``n`` steps (float64)."""
        out = torch.zeros(n, dtype=torch.float64)
        m = min(n, self.band)
        out[:m] = torch.tensor(self.coeffs[:m], dtype=torch.float64)
        return out

    def matrix(self, n: int) -> Tensor:
        """``C`` for ``n`` steps, float64."""
        return toeplitz_matrix(self.toeplitz_coeffs(n), n)


@dataclasses.dataclass(frozen=True)
class BufferedToeplitz:
    """A BLT strategy: ``C[t, t] = 1``, ``C[t, t-k] = sum_i omega[i] * theta[i] ** (k - 1)`` (``k >= 1``)."""

    theta: tuple[float, ...]
    omega: tuple[float, ...]

    def __post_init__(self):
        th, om = tuple(float(x) for x in self.theta), tuple(float(x) for x in self.omega)
        if len(th) != len(om) or not all(torch.isfinite(torch.tensor(th + om, dtype=torch.float64)).tolist()):
            raise ValueError(f"BufferedToeplitz(theta={self.theta!r}, omega={self.omega!r}): theta and omega must be finite and of the same length (one pair per buffer).")
        object.__setattr__(self, "theta", th)
        object.__setattr__(self, "omega", om)

    @property
    def buffers(self) -> int:
        return len(self.theta)

    def toeplitz_coeffs(self, n: int) -> Tensor:
        """The first column of ``C`` for ``n`` steps (float64)."""
        k = torch.arange(max(n - 1, 0), dtype=torch.float64)
        th = torch.tensor(self.theta, dtype=torch.float64)
        om = torch.tensor(self.omega, dtype=torch.float64)
        rest = (om[:, None] * th[:, None] ** k[None, :]).sum(0) if self.buffers else torch.zeros_like(k)
        return torch.cat([torch.ones(1, dtype=torch.float64), rest])[:n]

    def matrix(self, n: int) -> Tensor:
        """``C`` for ``n`` steps, float64."""
        return toeplitz_matrix(self.toeplitz_coeffs(n), n)
