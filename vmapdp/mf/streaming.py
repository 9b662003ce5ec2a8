"""Streaming ``C^{-1} z``: the correlated noise of one step from that step's draw and a few buffers.

For a lower-triangular Toeplitz strategy ``C`` (:mod:`vmapdp.mf.strategies`) the noise released at
step ``t`` is ``y_t = (C^{-1} z)_t``, computed from ``C y = z`` one step at a time:

* banded (``C[t, t-k] = c_k``, ``k < b``): ``y_t = (z_t - sum_{k=1}^{b-1} c_k y_{t-k}) / c_0``;
  the state is the last ``b - 1`` outputs, most recent first (``[b - 1, *shape]`` per leaf).
* BLT (``C[t, t] = 1``, ``C[t, t-k] = sum_i omega_i theta_i^(k-1)``): ``y_t = z_t - sum_i omega_i
  s_{i,t}`` and ``s_{i,t+1} = theta_i s_{i,t} + y_t``; the state is one buffer per ``theta``
  (``[buffers, *shape]`` per leaf).

Both are exact: ``y_1 .. y_t`` are the first ``t`` entries of ``C^{-1} z`` for every ``t`` (up to
the rounding of the recursion, done in the leaf's noise dtype: float32, or float64 for float64
leaves). The functions here are pure tensor maps; :mod:`vmapdp.mf.privatizer` draws the ``z_t``
and carries the buffers in ``TrainState.noise_state``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vmapdp.mf.strategies import BandedToeplitz, BufferedToeplitz, toeplitz_inverse, toeplitz_multiply

__all__ = ["state_rows", "next_noise", "recursion_gain", "MAX_RECURSION_GAIN"]

# the largest recursion_gain correlated_noise takes: float32's rounding of the subtracted terms stays
# within 2**-14 of the step's draw (float64 leaves: 2**-43)
MAX_RECURSION_GAIN = 2.0**10


def state_rows(strategy: BandedToeplitz | BufferedToeplitz) -> int:
    """Rows of buffer kept per leaf: ``band - 1`` (banded) or ``buffers`` (BLT)."""
    if isinstance(strategy, BandedToeplitz):
        return strategy.band - 1
    if isinstance(strategy, BufferedToeplitz):
        return strategy.buffers
    raise TypeError(f"state_rows(strategy): expected a vmapdp.mf.BandedToeplitz or BufferedToeplitz, got {type(strategy).__name__}.")


def next_noise(strategy: BandedToeplitz | BufferedToeplitz, z: Tensor, buffer: Tensor) -> tuple[Tensor, Tensor]:
    """``(y_t, next buffer)`` from the step's standard normal draw ``z`` (one leaf) and its buffer.

    ``buffer`` has ``state_rows(strategy)`` rows of ``z``'s shape and dtype; the arithmetic is in
    that dtype, element-wise (one correctly rounded multiply and add per row, rows in a fixed
    order): each element of the output depends on the same elements of ``z`` and ``buffer`` only,
    so the noise of a slice (a parameter shard, :mod:`vmapdp.sharding`) is bitwise the slice of
    the whole leaf's noise on one device.
    """
    if isinstance(strategy, BandedToeplitz):
        if strategy.band == 1:  # C = c_0 I: DP-SGD's noise (bit for bit when c_0 = 1)
            return z / strategy.coeffs[0], buffer
        y = (z - _weighted_rows(strategy.coeffs[1:], buffer)) / strategy.coeffs[0]  # sum_k c_k y_{t-k}
        return y, torch.cat([y.unsqueeze(0), buffer[:-1]], dim=0)
    if strategy.buffers == 0:
        return z, buffer
    theta = torch.tensor(strategy.theta, dtype=buffer.dtype, device=buffer.device).view(-1, *([1] * z.dim()))
    y = z - _weighted_rows(strategy.omega, buffer)
    return y, theta * buffer + y


def recursion_gain(strategy: BandedToeplitz | BufferedToeplitz, steps: int) -> float:
    """How large, over a run of ``steps``, the terms :func:`next_noise` subtracts from the step's
    draw ``z_t`` get, in units of ``z_t`` (their standard deviations summed, exact float64 impulse
    responses): banded ``sum_{k>=1} |c_k| ||d||_2`` (``d``: the first column of ``C^{-1}``, the
    response of the kept ``y``); BLT ``sum_i |omega_i| ||e_i||_2 sqrt(m_i)`` (``e_i = g_i * d``,
    ``g_i = theta_i^k``: the response of buffer ``i``, which keeps its rounding errors for ``m_i =
    min(steps, 1 / (1 - theta_i^2))`` steps). The recursion rounds each term to the noise dtype,
    so each step's fresh draw is kept to about ``gain * 2**-24`` of itself in float32. A strategy
    whose ``C^{-1}`` grows (a banded polynomial with a root in the unit disk, a BLT inverse with
    ``|theta| > 1``) or whose buffers grow (``|theta| > 1``: ``inf`` at once) has a gain that grows without bound:
    after enough steps the fresh draw is rounded away and the noise released is a function of the
    earlier noise, which the accountant (exact arithmetic) does not know. ``inf`` where the float64
    responses overflow."""
    n = steps
    if isinstance(strategy, BandedToeplitz):
        if strategy.band == 1:
            return 0.0
        d = toeplitz_inverse(strategy.toeplitz_coeffs(n), n)
        gain = sum(abs(c) for c in strategy.coeffs[1:]) * float(torch.linalg.vector_norm(d))
    else:
        if strategy.buffers == 0:
            return 0.0
        if any(abs(theta) > 1.0 for theta in strategy.theta):  # (a buffer grows geometrically: y = z - omega s cancels
            return float("inf")  # ever larger terms, and an unused one overflows; the FFT below would lose them too)
        d = toeplitz_inverse(strategy.toeplitz_coeffs(n), n)
        k = torch.arange(n, dtype=torch.float64)
        gain = 0.0
        for theta, omega in zip(strategy.theta, strategy.omega):
            g = torch.tensor(theta, dtype=torch.float64) ** k  # (inf past float64's range: the gain is then inf)
            # a buffer keeps its rounding errors for about 1 / (1 - theta^2) steps (all of the run at |theta| = 1), where
            # they add up like a random walk (found by review: theta = 1 kept 151 x gain x 2**-24 over 30000 steps)
            memory = n if abs(theta) >= 1.0 else min(n, 1.0 / (1.0 - theta * theta))
            gain += abs(omega) * float(torch.linalg.vector_norm(toeplitz_multiply(g, d, n))) * memory**0.5
    return gain if gain == gain else float("inf")  # (NaN: an overflow inside the FFT)


def _weighted_rows(weights: tuple[float, ...], buffer: Tensor) -> Tensor:
    """``sum_k weights[k] * buffer[k]``, element-wise in ``buffer``'s dtype, rows in order (not a
    matrix product, whose blocking may round a column differently with the matrix's width)."""
    w = torch.tensor(weights, dtype=buffer.dtype, device=buffer.device)
    acc = buffer[0] * w[0]
    term = torch.empty_like(acc)
    for k in range(1, len(weights)):  # a multiply, then an add: never add(alpha=), whose vector path may fuse them
        torch.mul(buffer[k], w[k], out=term)
        acc.add_(term)
    return acc
