"""Running a step or a gradient function on edited batches and measuring what changed.

Pytree helpers shared by the step-level checks (independence, sensitivity, noise): copies of a
batch with some rows replaced, per-sample gradients as one float64 matrix, the distance between
two parameter updates and its float rounding slack, and runs under a fixed global-RNG seed.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import optree
import torch
from torch import Tensor

from vmapdp._tree import leaves as _leaves

__all__ = [
    "check_step_hyperparameters",
    "is_float",
    "tree_map",
    "set_rows",
    "flat_rows",
    "params_of",
    "update_distance",
    "rounding_slack",
    "rng_devices",
    "seeded",
]


def check_step_hyperparameters(call: str, *, lr: float, l2_clip_norm: float, expected_batch_size: float) -> None:
    """The step-level checks' bound needs ``lr``, ``l2_clip_norm`` and ``expected_batch_size`` finite and > 0."""
    for name, v in (("lr", lr), ("l2_clip_norm", l2_clip_norm), ("expected_batch_size", expected_batch_size)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
            raise ValueError(f"{call}: {name}={v!r} must be a finite number > 0.")


def is_float(x: Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def tree_map(fn: Callable[[Tensor], Tensor], tree: Any) -> Any:
    return optree.tree_map(fn, tree, namespace="torch")


def set_rows(batch: Any, rows: Tensor | int, value: Callable[[Tensor], Tensor]) -> Any:
    """A copy of ``batch`` whose rows ``rows`` hold ``value(leaf)`` (broadcast to the rows)."""

    def one(leaf: Tensor) -> Tensor:
        out = leaf.clone()
        out[rows] = value(leaf)
        return out

    return tree_map(one, batch)


def flat_rows(grads: Any) -> Tensor:
    """Per-sample gradients ``{k: [B, ...]}`` as one float64 ``[B, P]`` matrix."""
    leaves = _leaves(grads)
    b = leaves[0].shape[0]
    return torch.cat([g.detach().reshape(b, -1).to(torch.float64) for g in leaves], dim=1)


def params_of(state: Any) -> dict[str, Tensor]:
    params = getattr(state, "params", None)
    if not isinstance(params, dict):
        raise TypeError(f"expected a TrainState (with a .params dict), got {type(state).__name__}.")
    return params


def update_distance(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return math.sqrt(sum(float((a[k].detach().to(torch.float64) - b[k].detach().to(torch.float64)).square().sum()) for k in a))


def rounding_slack(*trees: dict[str, Tensor]) -> float:
    """L2 norm of one float spacing per coordinate at the largest magnitude in ``trees``.

    Two parameter vectors ``p - u1`` and ``p - u2`` computed in float32 each carry a rounding
    error of at most half a spacing per coordinate; their difference at most one spacing.
    """
    total = 0.0
    for k in trees[0]:
        if not is_float(trees[0][k]):
            continue
        big = torch.stack([t[k].detach().abs() for t in trees]).amax(0)
        spacing = torch.nextafter(big, torch.full_like(big, math.inf)) - big
        total += float(spacing.to(torch.float64).square().sum())
    return math.sqrt(total)


def rng_devices(tree: Any) -> list[int]:
    return sorted({x.device.index or 0 for x in _leaves(tree) if isinstance(x, Tensor) and x.device.type == "cuda"})


def seeded(seed: int, devices: list[int], fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with torch's global RNG seeded to ``seed``, restoring the caller's RNG after.

    Random layers inside ``vmap(randomness='different' | 'same')`` draw from the global RNG; a
    fixed seed makes two runs see the same dropout masks, so only what the check varies differs.
    """
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return fn()
