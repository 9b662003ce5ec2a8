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
  so ``C^{-1} z`` streams with one buffer per ``theta`` (:meth:`BufferedToeplitz.inverse`).

Two fixed strategies: :func:`identity` (``C = I``, plain DP-SGD) and :func:`sqrt_prefix` (the
lower-triangular Toeplitz square root of the prefix-sum matrix, cut to a band). The Toeplitz
algebra the rest of :mod:`vmapdp.mf` uses: :func:`toeplitz_multiply` and :func:`toeplitz_inverse`
on first columns (lower-triangular Toeplitz matrices form a commutative algebra: products and
inverses are again lower-triangular Toeplitz, given by the truncated power series of the columns).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from vmapdp import _checks

__all__ = [
    "BandedToeplitz", "BufferedToeplitz", "identity", "sqrt_prefix", "toeplitz_column", "toeplitz_inverse", "toeplitz_matrix", "toeplitz_multiply",
]


def toeplitz_matrix(coeffs: Tensor, n: int) -> Tensor:
    """The ``n x n`` lower-triangular Toeplitz matrix with first column ``coeffs`` (zero-padded or cut to ``n``)."""
    col = torch.zeros(n, dtype=coeffs.dtype)
    m = min(n, coeffs.numel())
    col[:m] = coeffs[:m]
    i = torch.arange(n)
    lag = i[:, None] - i[None, :]
    return torch.where(lag >= 0, col[lag.clamp(min=0)], torch.zeros((), dtype=coeffs.dtype))


def _fit(x: Tensor, n: int) -> Tensor:
    """``x`` cut or zero-padded to length ``n`` (differentiable)."""
    if x.numel() >= n:
        return x[:n]
    return torch.cat([x, x.new_zeros(n - x.numel())])


def toeplitz_multiply(a: Tensor, b: Tensor, n: int) -> Tensor:
    """First column of ``T(a) @ T(b)`` (both ``n x n`` lower-triangular Toeplitz): the first ``n``
    terms of the convolution of ``a`` and ``b`` (by FFT, differentiable; inputs cut or zero-padded
    to ``n``). ``a`` may carry leading batch dimensions (each row is convolved with ``b``)."""
    if a.shape[-1] < n:
        a = torch.cat([a, a.new_zeros(*a.shape[:-1], n - a.shape[-1])], -1)
    a, b = a[..., :n], _fit(b, n)
    size = 1 << max(2 * n - 1, 1).bit_length()
    return torch.fft.irfft(torch.fft.rfft(a, size) * torch.fft.rfft(b, size), size)[..., :n]


def toeplitz_column(matrix: Tensor) -> Tensor | None:
    """The first column of ``matrix`` if it is exactly a lower-triangular Toeplitz matrix, else None."""
    n = matrix.shape[0]
    col = matrix[:, 0]
    return col if torch.equal(matrix, toeplitz_matrix(col, n)) else None


def toeplitz_inverse(c: Tensor, n: int) -> Tensor:
    """First column of ``T(c)^{-1}`` for an ``n x n`` lower-triangular Toeplitz ``T(c)``, ``c[0] != 0``.

    The first ``n`` terms of the power series ``1 / c(x)``, by Newton's iteration
    ``d <- d (2 - c d)`` (each round doubles the number of correct terms; ``O(n log n)``,
    differentiable). Raises ValueError when ``c[0] == 0`` (the matrix is singular).
    """
    c = _fit(c, n)
    if float(c[0].detach()) == 0.0:
        raise ValueError("toeplitz_inverse: c[0] must be nonzero; the lower-triangular Toeplitz matrix T(c) is singular otherwise.")
    d = (1.0 / c[:1])
    m = 1
    while m < n:
        m = min(2 * m, n)
        e = -toeplitz_multiply(c[:m], d, m)
        e = torch.cat([e[:1] + 2.0, e[1:]])
        d = toeplitz_multiply(d, e, m)
    return d


def _sqrt_prefix_coeffs(k: int) -> Tensor:
    """``binom(2j, j) / 4**j`` for ``j < k``: the power series of ``(1 - x)^(-1/2)``."""
    j = torch.arange(1, k, dtype=torch.float64)
    return torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod((2 * j - 1) / (2 * j), 0)])


@dataclasses.dataclass(frozen=True)
class BandedToeplitz:
    """A banded lower-triangular Toeplitz strategy: ``C[t, t-k] = coeffs[k]`` for ``k < band``."""

    coeffs: tuple[float, ...]

    def __post_init__(self):
        c = tuple(float(x) for x in self.coeffs)
        if not c or not all(torch.isfinite(torch.tensor(c, dtype=torch.float64)).tolist()) or c[0] <= 0:
            shown = _checks.shortened(repr(self.coeffs))
            raise ValueError(f"BandedToeplitz(coeffs={shown}): coeffs must be a non-empty sequence of finite floats with coeffs[0] > 0.")
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

    def inverse(self) -> "BufferedToeplitz":
        """The BLT of ``C^{-1}``, with as many buffers (Dvijotham et al. 2024, Lemma 5.2).

        Write ``C(x) = 1 + x 1^T (I - x Theta)^{-1} omega`` with ``Theta = diag(theta)``. Its inverse
        is ``1 - x 1^T (I - x M)^{-1} omega`` with ``M = Theta - omega 1^T``; diagonalising ``M``
        gives the inverse's ``theta`` (the eigenvalues of ``M``) and ``omega``. When every
        ``omega >= 0``, ``M`` is similar to the symmetric ``Theta - s s^T`` (``s = sqrt(omega)``),
        so the inverse's ``theta`` are real (they interlace ``theta``) and its ``omega`` are
        ``-(U^T s)^2 <= 0``. With negative ``omega`` the eigenvalues may be complex: ValueError
        then (such a ``C^{-1}`` is no real BLT). The result is checked against the power-series
        inverse of the Toeplitz coefficients (RuntimeError if they disagree, e.g. for nearly
        equal ``theta``).
        """
        if not self.buffers:
            return self
        th = torch.tensor(self.theta, dtype=torch.float64)
        om = torch.tensor(self.omega, dtype=torch.float64)
        if bool((om >= 0).all()):
            s = om.sqrt()
            lam, u = torch.linalg.eigh(torch.diag(th) - torch.outer(s, s))
            inv = BufferedToeplitz(tuple(lam.tolist()), tuple((-(u.T @ s) ** 2).tolist()))
        else:
            lam, v = torch.linalg.eig(torch.diag(th) - torch.outer(om, torch.ones_like(om)))
            if bool((lam.imag.abs() > 1e-12 * (1 + lam.abs())).any()):
                raise ValueError(
                    f"BufferedToeplitz.inverse: theta={self.theta}, omega={self.omega} has a complex inverse "
                    f"(eigenvalues {lam.tolist()}); C^{{-1}} is no real BLT. Use omega >= 0 (what optimal_blt returns)."
                )
            w = torch.linalg.solve(v, om.to(v.dtype))
            inv = BufferedToeplitz(tuple(lam.real.tolist()), tuple((-(v.sum(0) * w).real).tolist()))
        n = 64  # check: the first column of C^{-1}, by a triangular solve (exact to rounding even where C^{-1} grows)
        e0 = torch.zeros(n, 1, dtype=torch.float64)
        e0[0] = 1.0
        want = torch.linalg.solve_triangular(self.matrix(n), e0, upper=False)[:, 0]
        got = inv.toeplitz_coeffs(n)
        if not torch.allclose(got, want, rtol=1e-7, atol=1e-9 * float(want.abs().max())):
            raise RuntimeError(
                f"BufferedToeplitz.inverse: the computed inverse of theta={self.theta}, omega={self.omega} does not "
                f"invert C (max coefficient error {float((got - want).abs().max()):.3g} of {float(want.abs().max()):.3g}); "
                "nearly equal theta make the eigendecomposition ill-conditioned. Merge buffers whose theta are nearly equal."
            )
        return inv


def identity() -> BandedToeplitz:
    """``C = I``: independent noise at every step, plain DP-SGD."""
    return BandedToeplitz((1.0,))


def sqrt_prefix(band: int) -> BandedToeplitz:
    """The square root of the prefix-sum matrix, cut to ``band`` coefficients.

    ``coeffs[k] = binom(2k, k) / 4**k``, the power series of ``(1 - x)^(-1/2)``: the
    lower-triangular Toeplitz ``C`` with ``C @ C = prefix_sums(n)`` when ``band >= n``
    (Fichtenberger, Henzinger and Upadhyay 2023; optimal for the max error on prefix sums under
    single participation among Toeplitz strategies, Dvijotham et al. 2024). Pass ``band=n`` for
    the exact square root of an ``n``-step run; a smaller band gives the banded strategy of
    Kalinin and Lampert 2024 ("banded square root").
    """
    band = _checks.positive_int("sqrt_prefix", "band", band, meaning="band is the number of Toeplitz coefficients kept (band=n: the exact square root)")
    return BandedToeplitz(tuple(_sqrt_prefix_coeffs(band).tolist()))
