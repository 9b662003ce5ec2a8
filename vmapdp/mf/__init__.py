"""DP matrix factorization: correlated noise across steps (banded MF, BLT).

* :mod:`vmapdp.mf.strategies`: the strategy matrices ``C`` and their streaming forms; the fixed
  strategies :func:`identity` (DP-SGD) and :func:`sqrt_prefix`.
* :mod:`vmapdp.mf.workloads`: the workloads ``A`` (prefix sums, momentum with a learning-rate schedule).
* :mod:`vmapdp.mf.sensitivity`: the sensitivity of ``C`` under multiple participations.
* :mod:`vmapdp.mf.error`: the expected error of ``C`` on ``A``.
* :mod:`vmapdp.mf.optimize`: the banded / BLT strategy with the least expected error.
* :mod:`vmapdp.mf.streaming`: ``(C^{-1} z)_t`` one step at a time, from a few buffers.
* :mod:`vmapdp.mf.privatizer`: :func:`correlated_noise`, the privatizer the train step takes.
* :mod:`vmapdp.mf.accounting`: the ledger events of a run and the noise calibration.
"""

from vmapdp.mf.accounting import BandedMFEvent, MinSeparationMFEvent, calibrate_mf_noise
from vmapdp.mf.error import expected_error, row_squared_errors
from vmapdp.mf.optimize import optimal_banded, optimal_blt
from vmapdp.mf.privatizer import correlated_noise, fresh_noise_multiplier
from vmapdp.mf.sensitivity import (
    brute_force_sensitivity,
    participation_patterns,
    sensitivity,
    toeplitz_gram,
    toeplitz_sensitivity_squared,
)
from vmapdp.mf.strategies import (
    BandedToeplitz,
    BufferedToeplitz,
    identity,
    sqrt_prefix,
    toeplitz_column,
    toeplitz_inverse,
    toeplitz_matrix,
    toeplitz_multiply,
)
from vmapdp.mf.workloads import momentum_prefix_sums, prefix_sums

__all__ = [
    "BandedMFEvent",
    "BandedToeplitz",
    "BufferedToeplitz",
    "MinSeparationMFEvent",
    "brute_force_sensitivity",
    "calibrate_mf_noise",
    "correlated_noise",
    "expected_error",
    "fresh_noise_multiplier",
    "identity",
    "momentum_prefix_sums",
    "optimal_banded",
    "optimal_blt",
    "participation_patterns",
    "prefix_sums",
    "row_squared_errors",
    "sensitivity",
    "sqrt_prefix",
    "toeplitz_column",
    "toeplitz_inverse",
    "toeplitz_matrix",
    "toeplitz_multiply",
    "toeplitz_gram",
    "toeplitz_sensitivity_squared",
]
