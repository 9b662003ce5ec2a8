"""DP matrix factorization: correlated noise across steps (banded MF, BLT).

* :mod:`vmapdp.mf.strategies`: the strategy matrices ``C`` and their streaming forms.
* :mod:`vmapdp.mf.streaming`: ``(C^{-1} z)_t`` one step at a time, from a few buffers.
* :mod:`vmapdp.mf.privatizer`: :func:`correlated_noise`, the privatizer the train step takes.
* :mod:`vmapdp.mf.accounting`: the ledger events of a run and the noise calibration.
"""

from vmapdp.mf.accounting import BandedMFEvent, MinSeparationMFEvent, calibrate_mf_noise
from vmapdp.mf.privatizer import correlated_noise
from vmapdp.mf.strategies import BandedToeplitz, BufferedToeplitz, toeplitz_matrix

__all__ = ["BandedMFEvent", "BandedToeplitz", "BufferedToeplitz", "MinSeparationMFEvent", "calibrate_mf_noise", "correlated_noise", "toeplitz_matrix"]
