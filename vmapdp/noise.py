"""Gaussian noise for DP-SGD, from an explicit generator.

``add_noise(tree, std, generator)`` adds independent ``N(0, std**2)`` to every element of every
leaf. The noise is drawn in float32 or wider (float64 stays float64) whatever the leaves' dtype,
and the sum is returned in that dtype: a half-precision gradient is never noised in half
precision.

The noise never comes from torch's global RNG: that one is routinely seeded (``torch.manual_seed
(0)`` for reproducible experiments), and noise from a known seed protects nothing. Pass a
``torch.Generator`` you seeded (reproducible runs) or ``generator=None`` for a fresh generator
seeded from the operating system's entropy (unpredictable, not reproducible).
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import optree
import torch
from torch import Tensor

__all__ = ["add_noise", "make_generator"]


def make_generator(seed: int | None = None, *, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device``, seeded with ``seed`` or, if None, from OS entropy."""
    if seed is None:
        seed = secrets.randbits(63)
    elif isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"make_generator(seed): seed must be a non-negative int or None, got {seed!r}.")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def add_noise(tree: Any, std: float | Tensor, generator: torch.Generator | None = None) -> Any:
    """Add independent Gaussian noise ``N(0, std**2)`` to every element of every leaf.

    Args:
        tree: a pytree of tensors (e.g. the clipped sum of per-sample gradients).
        std: the noise standard deviation, ``>= 0`` (for DP-SGD, ``noise_multiplier *
            l2_clip_norm``, before dividing by the batch size).
        generator: the source of randomness; its state advances. ``None``: a fresh generator
            seeded from OS entropy (never torch's global RNG).

    Returns:
        A pytree like ``tree``; each leaf in ``promote_types(leaf.dtype, float32)``.

    Guarantees:
        Leaves are drawn in a fixed order (optree's: dict keys sorted), so the same generator
        state gives the same noise. The noise is drawn in float32 or wider.

    Raises:
        ValueError: ``std`` negative or not finite; a generator on another device than a leaf.
    """
    call = "add_noise(tree, std, generator)"
    if not isinstance(std, Tensor):
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not (std >= 0) or not math.isfinite(std):
            raise ValueError(f"{call}: std={std!r} must be a finite float >= 0 (noise_multiplier * l2_clip_norm).")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{call}: generator must be a torch.Generator or None, got {type(generator).__name__}. "
            "Make one with vmapdp.make_generator(seed)."
        )

    leaves, spec = optree.tree_flatten(tree, namespace="torch")
    if generator is None and leaves:
        generator = make_generator(device=leaves[0].device)
    out = []
    for leaf in leaves:
        if generator.device.type != leaf.device.type:
            raise ValueError(
                f"{call}: the generator is on {generator.device} but a leaf is on {leaf.device}; "
                f"make the generator with vmapdp.make_generator(seed, device={str(leaf.device)!r})."
            )
        dtype = torch.promote_types(leaf.dtype, torch.float32)
        noise = torch.randn(leaf.shape, dtype=dtype, device=leaf.device, generator=generator)
        out.append(leaf.to(dtype) + noise * std)
    return optree.tree_unflatten(spec, out)
