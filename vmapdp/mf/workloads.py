"""Workloads: the matrix ``A`` a training run applies to the per-step gradient sums.

Row ``t`` of ``A`` says which combination of the gradient sums ``x_0 .. x_t`` the run needs
after step ``t``; matrix factorization releases ``A x + A C^{-1} z`` (``A = B C``), and a
strategy ``C`` is judged by the error ``A C^{-1} z`` (:func:`vmapdp.mf.expected_error`).
Each workload is an ``n x n`` lower-triangular float64 tensor.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from vmapdp import _checks

__all__ = ["momentum_prefix_sums", "prefix_sums"]


def prefix_sums(n: int) -> Tensor:
    """``A[t, s] = 1`` for ``s <= t``: the parameters of SGD with a constant learning rate of 1
    are (up to sign) the prefix sums of the gradients."""
    n = _checks.positive_int("prefix_sums", "n", n, meaning="n is the number of steps")
    return torch.ones(n, n, dtype=torch.float64).tril()


def momentum_prefix_sums(n: int, momentum: float, learning_rates: Sequence[float] | Tensor | None = None) -> Tensor:
    """The workload of SGD with heavy-ball momentum and a learning-rate schedule.

    With ``m_t = momentum * m_{t-1} + x_t`` (``m_{-1} = 0``) and ``theta_{t+1} = theta_t - lr_t m_t``,
    the parameter change after step ``t`` is ``theta_0 - theta_{t+1} = sum_s A[t, s] x_s`` with
    ``A[t, s] = sum_{r=s}^{t} lr_r * momentum**(r - s)`` for ``s <= t``. ``learning_rates=None``
    means ``lr_t = 1`` (then ``A`` is Toeplitz); ``momentum=0`` with ``lr_t = 1`` is
    :func:`prefix_sums`.
    """
    call = "momentum_prefix_sums"
    n = _checks.positive_int(call, "n", n, meaning="n is the number of steps")
    beta = _checks.momentum(call, momentum)
    lr = _checks.learning_rates(call, learning_rates, n)
    t = torch.arange(n)
    lag = (t[:, None] - t[None, :]).clamp(min=0)
    decay = torch.where(t[:, None] >= t[None, :], torch.tensor(beta, dtype=torch.float64) ** lag, 0.0)  # decay[r, s] = beta^(r-s)
    return torch.cumsum(lr[:, None] * decay, dim=0)
