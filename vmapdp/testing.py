"""Oracles, assertions and privacy self-checks, public so users can test their own models and steps.

``microbatch_grads`` is the reference every fast path in vmapdp is tested against: one sample at
a time, ordinary ``torch.autograd``, float64, CPU. ``assert_grads_close`` compares two pytrees of
per-sample gradients key by key and sample by sample and reports every mismatch at once.

The privacy self-checks (from :mod:`vmapdp.audit`) run on your own ``loss_fn`` or train step and
raise :class:`PrivacyCheckError` with figures when a DP bug shows: samples that influence each
other, a sensitivity above ``lr * C / E[B]``, noise of the wrong scale, a sampler that is not
Poisson, a ledger that does not match the steps, and a white-box audit's epsilon lower bound.
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch
from torch import Tensor

from vmapdp._tree import batch_size, leaves_with_paths
from vmapdp.audit import (
    PrivacyCheckError,
    audit_epsilon_lower_bound,
    check_ledger,
    check_noise_calibration,
    check_per_sample_independence,
    check_sampler,
    check_sensitivity,
    clopper_pearson_upper,
)

__all__ = [
    "microbatch_grads",
    "assert_grads_close",
    # privacy self-checks for your own step (vmapdp.audit)
    "PrivacyCheckError",
    "check_per_sample_independence",
    "check_sensitivity",
    "check_noise_calibration",
    "check_sampler",
    "check_ledger",
    "audit_epsilon_lower_bound",
    "clopper_pearson_upper",
]


def _to(tree: Any, dtype: torch.dtype, device: torch.device | str) -> Any:
    def one(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        x = x.detach().to(device)
        return x.to(dtype) if x.is_floating_point() or x.is_complex() else x

    return optree.tree_map(one, tree, namespace="torch")


def microbatch_grads(
    loss_fn: Callable[..., Tensor],
    *args: Any,
    argnums: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> Any:
    """Per-sample gradients the slow, obviously correct way: one sample at a time.

    Same convention as :func:`vmapdp.per_sample_grads`: ``loss_fn(params, *shared, sample)`` for
    one sample; the last argument is the batch (leading dim ``B``). Every floating-point tensor
    in the arguments is converted to ``dtype`` (float64 by default) on ``device`` first, then for
    each ``i`` the loss of sample ``i`` is differentiated by ``torch.autograd.grad``.

    Tensors that ``loss_fn`` captures from outside (rather than receiving as arguments) are not
    converted; pass the buffers as an argument so the whole computation runs in ``dtype``.

    Returns:
        A pytree like ``args[argnums]`` whose leaves are ``[B, *shape]`` in ``dtype``. A parameter
        the loss does not use gets zeros.
    """
    call = "microbatch_grads(loss_fn, *args)"
    if len(args) < 2:
        raise TypeError(f"{call}: expected (params, ..., batch), got {len(args)} argument(s).")
    args = tuple(_to(a, dtype, device) for a in args)
    b = batch_size(args[-1], call=call)
    leaves, spec = optree.tree_flatten(args[argnums], namespace="torch")
    per_leaf: list[list[Tensor]] = [[] for _ in leaves]
    for i in range(b):
        sample = optree.tree_map(lambda x: x[i], args[-1], namespace="torch")
        live = [leaf.clone().requires_grad_(True) for leaf in leaves]
        call_args = list(args[:-1]) + [sample]
        call_args[argnums] = optree.tree_unflatten(spec, live)
        loss = loss_fn(*call_args)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(f"{call}: loss_fn must return a scalar tensor for one sample, got {type(loss).__name__}.")
        grads = torch.autograd.grad(loss.reshape(()), live, allow_unused=True)
        for j, (g, leaf) in enumerate(zip(grads, leaves)):
            per_leaf[j].append(torch.zeros_like(leaf) if g is None else g)
    stacked = [
        torch.stack(gs) if gs else torch.zeros((0,) + tuple(leaf.shape), dtype=leaf.dtype, device=leaf.device)
        for gs, leaf in zip(per_leaf, leaves)
    ]
    return optree.tree_unflatten(spec, stacked)


def assert_grads_close(actual: Any, expected: Any, *, rtol: float = 1e-4, atol: float = 1e-8) -> None:
    """Assert per-sample gradients match a reference, key by key and sample by sample.

    For every leaf and every sample ``i``: ``||a_i - e_i|| <= rtol * ||e_i|| + atol`` (L2 over the
    leaf's elements, computed in float64). On failure the AssertionError lists every mismatching
    key with the worst sample, both norms and the relative error.
    """
    a = dict(leaves_with_paths(actual))
    e = dict(leaves_with_paths(expected))
    problems = []
    if a.keys() != e.keys():
        problems.append(f"keys differ: only in actual {sorted(a.keys() - e.keys())}, only in expected {sorted(e.keys() - a.keys())}")
    for key in sorted(a.keys() & e.keys()):
        x, y = a[key], e[key]
        if x.shape != y.shape:
            problems.append(f"{key!r}: shape {tuple(x.shape)} != expected {tuple(y.shape)}")
            continue
        if x.numel() == 0:
            continue
        x64 = x.detach().double().cpu().reshape(x.shape[0], -1)
        y64 = y.detach().double().cpu().reshape(y.shape[0], -1)
        err = (x64 - y64).norm(dim=1)
        ref = y64.norm(dim=1)
        bad = ~(err <= rtol * ref + atol)
        if bool(bad.any()):
            rel = err / ref.clamp_min(1e-300)
            i = int(torch.where(bad, rel.nan_to_num(float("inf")), -1.0).argmax())
            problems.append(
                f"{key!r}: {int(bad.sum())}/{x.shape[0]} samples differ; worst sample {i}: "
                f"|actual|={x64[i].norm():.6g} |expected|={ref[i]:.6g} |diff|={err[i]:.3g} (rel {rel[i]:.3g}, rtol {rtol:g})"
            )
    if problems:
        raise AssertionError("per-sample gradients differ from the reference:\n  " + "\n  ".join(problems))
