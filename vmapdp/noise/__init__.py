"""Noise for DP-SGD: Gaussian noise from an explicit source of randomness, and the privatizer seam.

* :mod:`vmapdp.noise.gaussian`: ``add_noise(tree, std, ...)`` and the sources it draws from (a
  keyed ChaCha20 stream, the OS CSPRNG, a ``torch.Generator``).
* :mod:`vmapdp.noise.chacha`: ChaCha20 (RFC 8439), OpenSSL's and a pure-torch twin with the same bits.
* :mod:`vmapdp.noise.privatizers`: :class:`Privatizer`, the ``init``/``privatize`` pair that
  ``make_train_step`` calls once per step on the aggregated clipped sum, and
  :func:`gaussian_privatizer`, the one it uses by default.
* :mod:`vmapdp.noise.spent`: the keyed steps this process released, so that one state stepped twice
  (a fork, a checkpoint loaded twice) cannot release two values under one noise
  (:class:`NoiseKeyReused`).
"""

from vmapdp.noise import chacha
from vmapdp.noise.gaussian import add_noise, key_bytes, keyed_normal, make_generator, secure_normal, snap_grid, snapped_release, stream_key
from vmapdp.noise.privatizers import Privatizer, gaussian_privatizer
from vmapdp.noise.spent import NoiseKeyReused, unreleased

__all__ = ["add_noise", "make_generator", "secure_normal", "keyed_normal", "key_bytes", "snap_grid", "snapped_release", "stream_key", "chacha", "Privatizer", "gaussian_privatizer", "NoiseKeyReused", "unreleased"]
