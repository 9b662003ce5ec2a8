"""The linear rule (``F.linear``) and the "pair" use it makes: a per-sample grad ``sum_t u_t v_t^T``.

A linear weight's use is the pair (output grads, inputs), its bias's (output grads, ones); conv
biases are pairs too. Norms come from float64 Grams or the direct outer product, whichever is
cheaper (Bu et al. 2023, mixed ghost clipping); the clipped sum is one matmul over the batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vmapdp._tree import acc_dtype, sq_norms
from vmapdp.ghost.uses import (
    Rule,
    Site,
    Use,
    UseKind,
    arg,
    cat_rows,
    float64_factors,
    from_grams,
    gram_cheaper,
    gram_margin,
    pow2_normalized,
    rounding_margin,
    row_slice,
    slices,
    times_pow2,
)

__all__ = ["LINEAR", "PAIR", "pair_sq_norms", "pair_mass", "pair_uses"]


def parse_linear(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, tuple] | None:
    """``F.linear(input, weight, bias)`` with a matrix weight and a bias of shape ``[out]`` (or none)."""
    w = arg(args, kwargs, 1, "weight")
    if not isinstance(w, Tensor) or w.dim() != 2:
        return None
    b = arg(args, kwargs, 2, "bias")
    if isinstance(b, Tensor) and tuple(b.shape) != (w.shape[0],):
        return None  # a broadcasting bias: the generic path
    return arg(args, kwargs, 0, "input"), w, b, ()


def pair_uses(key: str, bias: str | None, u: Tensor, v: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    """A weight's pair use ``(u, v)`` and its bias's ``(u, ones)``: ``u`` ``[B, T, d_out]``."""
    out = [(key, Use(PAIR, u, v, tuple(params[key].shape)))]
    if bias:
        out.append((bias, Use(PAIR, u, u.new_ones(u.shape[:2] + (1,)), tuple(params[bias].shape))))
    return out


def linear_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    b = g.shape[0]
    dt = acc_dtype(g.dtype)
    return pair_uses(site.weight, site.bias, g.reshape(b, -1, g.shape[-1]).to(dt), x.reshape(b, -1, x.shape[-1]).to(dt), params)


def pair_sq_norms(
    u: Tensor, v: Tensor, keep_grads: bool = False, dtype: torch.dtype | None = None, gram: bool | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``||sum_t u_t v_t^T||^2`` per sample, ghost (Gram matrices) or direct, whichever is cheaper,
    the floating-point margin of the norm (see :func:`~vmapdp.ghost.uses.rounding_margin`), and, when the direct way formed
    them and ``keep_grads``, the per-sample grads ``[B, du, dv]`` (then the margin is 0: the sum
    will use these very numbers). ``dtype``: the dtype the clipped sum is computed in (default
    ``u``'s), which the margin is for. ``gram``: None chooses by cost, direct for float64 factors
    (``uses.float64_factors``); True for the float64 patches of a float32 conv's Gram path."""
    dtype = u.dtype if dtype is None else dtype
    b, t, du = u.shape
    dv = v.shape[2]
    ghost = (gram_cheaper(t, du, dv) and not float64_factors(u, v)) if gram is None else gram
    sqs, masses = [], []
    per = u.new_empty(b, du, dv) if keep_grads and not ghost else None
    for s, e in slices(b, 2 * t * (t + du + dv) if ghost else du * dv):  # (float64 copies in the Gram case)
        us, vs = row_slice(u, s, e), row_slice(v, s, e)
        if ghost:
            # float64: the T^2 terms can cancel, and in float32 an adversarial sample can make the
            # computed norm far smaller than the true one (a large shared component in x, output
            # grads of alternating sign)
            u64, v64 = us.double(), vs.double()
            sq, mass = from_grams(torch.bmm(u64, u64.transpose(1, 2)), torch.bmm(v64, v64.transpose(1, 2)), dtype)
            sqs.append(sq)
            masses.append(mass)
        else:
            if per is None and dtype != us.dtype:
                # the norm of grads that are not kept must round like the sum it bounds: that sum
                # is accumulated in ``dtype`` (float64) with ``dtype``'s margin, and float32 grads'
                # rounding (~T eps32 mass: cancelling terms) would exceed that margin
                us, vs = us.to(dtype), vs.to(dtype)
            g = outer_sum(us, vs, None if per is None else row_slice(per, s, e))
            sqs.append(sq_norms(g).to(g.dtype))
            if per is None:
                masses.append(pair_mass(us, vs))
    sq = cat_rows(sqs)
    if per is not None:
        return sq, torch.zeros_like(sq), per
    mass = cat_rows(masses)
    if ghost:
        return sq, gram_margin(sq, mass, t, du, dv, dtype), None
    return sq, rounding_margin(t, dtype) * mass, None


def pair_mass(u: Tensor, v: Tensor) -> Tensor:
    """``sum_t |u_t| |v_t|`` per sample. In the tensors' dtype (a float64 copy would cost memory):
    it overflows only for extreme values (|u| ~ 2e19 in float32), and a non-finite margin then
    drops the sample visibly (see ghost_norms_and_sum), never releases it unclipped. Float64
    factors are scaled position by position first (``pow2_normalized``): ``|u_t|`` of entries
    near 1e-162 is 0 in float64, while ``|u_t| |v_t|`` may be a normal number."""
    if float64_factors(u, v):  # position by position, each factor scaled by a power of two (exact)
        (u, eu), (v, ev) = pow2_normalized(u.double()), pow2_normalized(v.double())
        return times_pow2(torch.linalg.vector_norm(u, dim=2) * torch.linalg.vector_norm(v, dim=2), eu + ev).sum(1)
    return (torch.linalg.vector_norm(u, dim=2) * torch.linalg.vector_norm(v, dim=2)).sum(1)



def _sq_norms(use: Use, keep_grads: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    sq, margin, per = pair_sq_norms(use.u, use.v, keep_grads, dtype)
    return sq, margin, None if per is None else per.reshape((per.shape[0],) + use.shape)


def outer_sum(u: Tensor, v: Tensor, out: Tensor | None = None) -> Tensor:
    """``sum_t u_t v_t^T`` per sample, ``[B, du, dv]``, by one ``bmm`` (into ``out`` if given). A
    bias's ``v`` is a column of ones (``dv = 1``): then as ``(v^T u)^T``, whose row-major product
    ran 3x faster on the CPU than ``u^T v`` (2.8 against 8.7 ms for ``u`` ``[128, 256, 400]``)."""
    if v.shape[2] == 1:
        return torch.bmm(v.transpose(1, 2), u, out=None if out is None else out.transpose(1, 2)).transpose(1, 2)
    return torch.bmm(u.transpose(1, 2), v, out=out)


def _per_sample(use: Use) -> Tensor:
    return outer_sum(use.u, use.v).reshape((use.u.shape[0],) + use.shape)


def _weighted(use: Use, uw: Tensor, v: Tensor) -> Tensor:
    return (uw.reshape(-1, uw.shape[-1]).T @ v.reshape(-1, v.shape[-1])).reshape(use.shape)


def _weighted_add(total: Tensor, use: Use, uw: Tensor, v: Tensor) -> None:
    total.view(uw.shape[-1], v.shape[-1]).addmm_(uw.reshape(-1, uw.shape[-1]).T, v.reshape(-1, v.shape[-1]))


PAIR = UseKind(
    "pair", lambda use: use.u.shape[1], _sq_norms, _per_sample, _weighted, lambda use: pair_mass(use.u, use.v), bilinear=True, weighted_add=_weighted_add
)
LINEAR = Rule(parse_linear, linear_uses, transposable=True)
