"""Noise for DP-SGD: Gaussian noise from an explicit source of randomness, and the privatizer seam.

* :mod:`vmapdp.noise.gaussian`: ``add_noise(tree, std, ...)`` and the sources it draws from (a
  keyed SHAKE-256 stream, the OS CSPRNG, a ``torch.Generator``).
* :mod:`vmapdp.noise.privatizers`: :class:`Privatizer`, the ``init``/``privatize`` pair that
  ``make_train_step`` calls once per step on the aggregated clipped sum, and
  :func:`gaussian_privatizer`, the one it uses by default.
"""

from vmapdp.noise.gaussian import add_noise, key_bytes, keyed_normal, make_generator, secure_normal
from vmapdp.noise.privatizers import Privatizer, gaussian_privatizer

__all__ = ["add_noise", "make_generator", "secure_normal", "keyed_normal", "key_bytes", "Privatizer", "gaussian_privatizer"]
