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

from vmapdp.mf.strategies import BandedToeplitz, BufferedToeplitz

__all__ = ["state_rows", "next_noise"]


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
