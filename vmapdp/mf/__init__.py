"""DP matrix factorization: correlated noise across steps (banded MF, BLT).

* :mod:`vmapdp.mf.strategies`: the strategy matrices ``C`` and their streaming forms.
"""

from vmapdp.mf.strategies import BandedToeplitz, BufferedToeplitz, toeplitz_matrix

__all__ = ["BandedToeplitz", "BufferedToeplitz", "toeplitz_matrix"]
