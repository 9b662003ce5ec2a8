"""Gaussian noise for DP-SGD, from an explicit source of randomness.

``add_noise(tree, std, ...)`` adds independent ``N(0, std**2)`` to every element of every leaf.
The noise is drawn in float32 or wider (float64 stays float64) whatever the leaves' dtype, and
the sum is returned in that dtype: a half-precision gradient is never noised in half precision.

Sources, exactly one per call:

* ``key=`` (bytes or int): reproducible noise that only the key's holder can predict: each leaf
  is drawn (Box-Muller, float64) from the SHAKE-256 stream of ``(key, leaf index)``
  (:func:`keyed_normal`). ``make_train_step`` uses ``key = (secret seed, step)``. torch's
  generators cannot play this role: the CPU one keeps only 32 bits of a seed (a brute-forceable
  search, and streams of different steps collide by the birthday bound within ~10**5 steps), and
  Mersenne Twister's output is linear in its state, which can be solved for from outputs.
* ``secure=True``: the operating system's CSPRNG (not reproducible).
* ``generator=``: a ``torch.Generator`` you manage: predictable (see above), fine for tests, not
  for releasing models.
* none of them: a fresh random key from OS entropy (unpredictable, not reproducible).

The noise never comes from torch's global RNG: that one is routinely seeded (``torch.manual_seed
(0)`` for reproducible experiments), and noise from a known seed protects nothing.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from typing import Any

import optree
import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp._tree import acc_dtype

__all__ = ["add_noise", "make_generator", "secure_normal", "keyed_normal", "key_bytes"]


def key_bytes(key: bytes | int | str, *, call: str = "noise") -> bytes:
    """A secret key (bytes, int or str) as the bytes that keyed streams hash."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, (int, str)) and not isinstance(key, bool):
        return str(key).encode()
    raise TypeError(f"{call}: key must be bytes, int or str, got {type(key).__name__}.")


def keyed_normal(shape: tuple[int, ...], key: bytes | int | str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Tensor:
    """Standard normal samples determined by ``key`` (same key, same samples).

    The random bits are the output of SHAKE-256 (an extendable-output hash, used as a keyed
    stream) on ``key``; Box-Muller turns them into normals in float64. Predicting them without the
    key means breaking SHAKE-256. (torch's own generators are no substitute: the CPU generator
    keeps 32 bits of a seed, and Mersenne Twister output is linear in its state, so its state can
    be solved for from enough outputs.)
    """
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    stream = hashlib.shake_256(b"vmapdp-keyed-normal:" + key_bytes(key)).digest(16 * ((n + 1) // 2))
    raw = torch.frombuffer(bytearray(stream), dtype=torch.int64)
    return _box_muller(raw, n).reshape(shape).to(dtype=dtype, device=device)


def _box_muller(bits: Tensor, n: int) -> Tensor:
    """``n`` standard normals (float64) from an even number of random int64 words (53 bits each used)."""
    u = ((bits.reshape(2, -1) & ((1 << 53) - 1)).to(torch.float64) + 0.5) / float(1 << 53)  # in (0, 1)
    r = torch.sqrt(-2.0 * torch.log(u[0]))
    return torch.cat([r * torch.cos(2 * math.pi * u[1]), r * torch.sin(2 * math.pi * u[1])])[:n]


def secure_normal(shape: tuple[int, ...], *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Tensor:
    """Standard normal samples from the operating system's CSPRNG (``secrets``), via Box-Muller.

    What this defends against: an adversary who knows or guesses the seed of a pseudo-random
    generator (torch's generators are not cryptographic; their output can be predicted from a
    seed or from enough past output). What it does NOT defend against: attacks on the floating-
    point representation of Gaussian samples (Mironov 2012; Jin et al. 2022, "Are We There Yet?
    Timing and Floating-Point Attacks on Differential Privacy Systems"; Haney et al. 2022), which
    need a discrete or snapped mechanism that vmapdp does not implement. Samples are computed in
    float64 from 53-bit uniforms and then cast.
    """
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.frombuffer(bytearray(secrets.token_bytes(16 * ((n + 1) // 2))), dtype=torch.int64)
    return _box_muller(raw, n).reshape(shape).to(dtype=dtype, device=device)


def make_generator(seed: int | None = None, *, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device``, seeded with ``seed`` or, if None, from OS entropy.

    Torch's CPU generator keeps only 32 bits of its seed, so noise drawn from it can be recovered
    by a 2**32 search: use it for tests and reproducible experiments; for noise that protects
    data use ``add_noise(..., key=secret)`` (a SHAKE-256 stream) or ``secure=True``.
    """
    if seed is None:
        seed = secrets.randbits(63)
    else:
        seed = _checks.positive_int("make_generator(seed)", "seed", seed, minimum=0, fix="Or pass seed=None (OS entropy).")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def add_noise(
    tree: Any, std: float | Tensor, generator: torch.Generator | None = None, *, key: bytes | int | str | None = None, secure: bool = False
) -> Any:
    """Add independent Gaussian noise ``N(0, std**2)`` to every element of every leaf.

    Args:
        tree: a pytree of tensors (e.g. the clipped sum of per-sample gradients).
        std: the noise standard deviation, ``>= 0`` (for DP-SGD, ``noise_multiplier *
            l2_clip_norm``, before dividing by the batch size).
        generator: a ``torch.Generator`` to draw from (its state advances); see the module
            docstring for why a ``key`` is the better choice for real releases.
        key: draw reproducibly from this secret key (a SHAKE-256 stream, :func:`keyed_normal`).
        secure: draw from the OS CSPRNG (:func:`secure_normal`).
        With none of the three, a fresh random key from OS entropy is used.

    Returns:
        A pytree like ``tree``; each leaf in ``promote_types(leaf.dtype, float32)``.

    Guarantees:
        Leaves are drawn in a fixed order (optree's: dict keys sorted), so the same generator
        state gives the same noise. The noise is drawn in float32 or wider.

    Raises:
        TypeError: ``std`` not a number or a 0-dim floating tensor.
        ValueError: ``std`` negative or not finite (a tensor one too: read on the host when not
        tracing; while tracing such a std gives NaN, that is nothing released); a generator on
        another device than a leaf.
    """
    call = "add_noise(tree, std, generator)"
    # a tensor std is read on the host when not tracing; traced, a NaN/inf/negative one gives NaN noise
    std = _checks.noise_std_guarded(_checks.noise_std(call, std))
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{call}: generator must be a torch.Generator or None, got {type(generator).__name__}. "
            "Make one with vmapdp.make_generator(seed)."
        )

    if secure and generator is not None:
        raise ValueError(f"{call}: secure=True draws from the OS CSPRNG and takes no generator (a seeded generator is predictable).")
    if sum(x is not None and x is not False for x in (generator, key, secure or None)) > 1:
        raise ValueError(f"{call}: give at most one source of randomness: generator=, key= or secure=True.")
    leaves, spec = optree.tree_flatten(tree, namespace="torch")
    if secure:
        return optree.tree_unflatten(
            spec,
            [leaf.to(_dt(leaf)) + secure_normal(leaf.shape, dtype=_dt(leaf), device=leaf.device) * std for leaf in leaves],
        )
    if generator is None:
        base = key_bytes(key, call=call) if key is not None else secrets.token_bytes(32)
        return optree.tree_unflatten(
            spec,
            [
                leaf.to(_dt(leaf)) + keyed_normal(leaf.shape, base + b":leaf:" + str(i).encode(), dtype=_dt(leaf), device=leaf.device) * std
                for i, leaf in enumerate(leaves)
            ],
        )
    out = []
    for leaf in leaves:
        if generator.device.type != leaf.device.type:
            raise ValueError(
                f"{call}: the generator is on {generator.device} but a leaf is on {leaf.device}; "
                f"make the generator with vmapdp.make_generator(seed, device={str(leaf.device)!r})."
            )
        dtype = _dt(leaf)
        noise = torch.randn(leaf.shape, dtype=dtype, device=leaf.device, generator=generator)
        out.append(leaf.to(dtype) + noise * std)
    return optree.tree_unflatten(spec, out)


def _dt(leaf: Tensor) -> torch.dtype:
    return acc_dtype(leaf.dtype)
