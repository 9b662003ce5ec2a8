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
    that dtype, in a fixed order (bitwise reproducible on one device).
    """
    if isinstance(strategy, BandedToeplitz):
        if strategy.band == 1:  # C = c_0 I: DP-SGD's noise (bit for bit when c_0 = 1)
            return z / strategy.coeffs[0], buffer
        c = torch.tensor(strategy.coeffs[1:], dtype=buffer.dtype, device=buffer.device)
        y = (z - torch.tensordot(c, buffer, dims=1)) / strategy.coeffs[0]  # sum_k c_k y_{t-k}: one pass over the buffer
        return y, torch.cat([y.unsqueeze(0), buffer[:-1]], dim=0)
    if strategy.buffers == 0:
        return z, buffer
    omega = torch.tensor(strategy.omega, dtype=buffer.dtype, device=buffer.device)
    theta = torch.tensor(strategy.theta, dtype=buffer.dtype, device=buffer.device).view(-1, *([1] * z.dim()))
    y = z - torch.tensordot(omega, buffer, dims=1)
    return y, theta * buffer + y
