"""The matmul rules (``torch.addmm``, ``matmul`` / ``@``, ``mm``, two-operand ``einsum``): a 2-D
param times an activation, as "pair" uses (linear.py), the same sequence-level Gram identity as
``F.linear`` (Li et al. 2022) with the weight possibly transposed.

Three orientations, per sample (``t`` runs over all positions, the batch dims of a broadcasting
matmul included):

* ``"xw"``: ``y = x @ W``, ``W`` ``[in, out]`` (GPT-2's ``Conv1D``: ``torch.addmm(b, x, W)``):
  ``G = sum_t x_t g_t^T``, the pair ``(x, g)``;
* ``"xwt"``: ``y = x @ W^T`` (``einsum("...i,ji->...j")``, what ``F.linear`` computes):
  the pair ``(g, x)``;
* ``"wx"``: ``y = W @ x``, ``W`` ``[out, in]``, ``x`` ``[..., in, T]`` or ``[in]``: positions are
  the columns: the pair ``(g^T, x^T)``.

``addmm``'s bias (shape ``[out]``, ``beta = alpha = 1``) is the pair ``(g, ones)``. Guarantees: the
per-sample grad is ``sum_t u_t v_t^T`` exactly as for ``F.linear``, so norms, margins (one term per
position: float64 Grams, ``gram_margin``) and the float64 book-keeping of sequences
(``engine._sum_dtype``, ``T > 1``) are linear's. A call in any other form (a 3-D param in ``bmm``,
``beta != 1``, a broadcasting bias, an einsum that is not a plain contraction of one index of a
matrix) is left to the generic per-sample view.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from vmapdp._tree import acc_dtype
from vmapdp.ghost.linear import PAIR, pair_mass, pair_sq_norms
from vmapdp.ghost.uses import Rule, Site, Use, UseKind, arg

__all__ = ["ADDMM", "MATMUL", "EINSUM", "GROUPED", "parse_einsum_equation"]


def _xw(x: Any, w: Any) -> bool:
    return isinstance(x, Tensor) and isinstance(w, Tensor) and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[0]


def _wx(w: Any, x: Any) -> bool:
    return isinstance(x, Tensor) and isinstance(w, Tensor) and w.dim() == 2 and x.dim() >= 1 and x.shape[0 if x.dim() == 1 else -2] == w.shape[1]


def _groups(x: Any, w: Any) -> bool:
    """A batched param ``w`` ``[*G, m, n]`` (``G`` its group dims) whose group dims ``x`` ``[...,
    *G, p, q]`` repeats exactly (no broadcasting of ``w`` against size-1 dims)."""
    return isinstance(x, Tensor) and isinstance(w, Tensor) and w.dim() >= 3 and x.dim() >= w.dim() and x.shape[x.dim() - w.dim() : -2] == w.shape[:-2]


def parse_matmul(args: tuple, kwargs: dict) -> list[tuple[Any, Any, Any, tuple]] | None:
    """``matmul(a, b)`` / ``a @ b`` / ``mm(a, b)`` / ``bmm(a, b)``: the alternatives ``a @ W`` (``W =
    b``) and ``W @ b`` (``W = a``), in that order (the tracer takes the first whose weight is a
    param); ``meta`` = ``(orientation, group dims of W)``. ``W`` is a matrix, or a batch of them
    ``[*G, m, n]`` whose group dims the other operand has as its own (``bmm`` of ``[H, T, d]`` and
    ``[H, d, e]``; ``[..., H, T, d] @ [H, d, e]``)."""
    a, b = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "other", kwargs.get("mat2"))
    out = []
    if _xw(a, b):
        out.append((a, b, None, ("xw", 0)))
    elif _groups(a, b) and a.shape[-1] == b.shape[-2]:
        out.append((a, b, None, ("xw", b.dim() - 2)))
    if _wx(a, b):
        out.append((b, a, None, ("wx", 0)))
    elif _groups(b, a) and b.shape[-2] == a.shape[-1]:
        out.append((b, a, None, ("wx", a.dim() - 2)))
    return out or None


def parse_addmm(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, tuple] | None:
    """``torch.addmm(bias, x, W)`` with ``beta = alpha = 1`` and a bias of shape ``[out]``."""
    bias, x, w = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "mat1"), arg(args, kwargs, 2, "mat2")
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1 or not _xw(x, w):
        return None
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (w.shape[1],):
        return None
    return x, w, bias, ("xw", 0)


def parse_einsum_equation(equation: str) -> tuple[int, str] | None:
    """``(index of the weight operand, orientation)`` when a two-operand equation contracts one
    index of a matrix with the last index of the other operand, all else passing through in order
    (``"...i,ij->...j"``: ``(1, "xw")``, ``"bti,oi->bto"``: ``(1, "xwt")``), else None."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1:
        return None
    lhs, out = eq.split("->")
    subs = lhs.split(",")
    if len(subs) != 2:
        return None
    for k in (1, 0):
        w, x = subs[k], subs[1 - k]
        if len(w) != 2 or w[0] == w[1] or not w.isalpha() or not x or not out:
            continue
        prefix, c, prefix_out, d = x[:-1], x[-1], out[:-1], out[-1]
        letters = prefix.replace("...", "")
        if prefix != prefix_out or set(letters) & set(w) or len(set(letters)) != len(letters) or {c, d} != set(w):
            continue
        return k, ("xw" if w == c + d else "xwt")
    return None


def parse_einsum(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, tuple] | None:
    """``einsum(equation, x, W)`` (or with the operands in a list) of the forms of
    :func:`parse_einsum_equation`."""
    if not args or not isinstance(args[0], str) or kwargs:
        return None
    ops = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    parsed = parse_einsum_equation(args[0])
    if parsed is None or len(ops) != 2:
        return None
    k, how = parsed
    w, x = ops[k], ops[1 - k]
    if not isinstance(w, Tensor) or w.dim() != 2 or not isinstance(x, Tensor):
        return None
    return x, w, None, (how, 0)


def matmul_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    b = g.shape[0]
    dt = acc_dtype(g.dtype)
    how, groups = site.meta
    shape = tuple(params[site.weight].shape)
    if groups:
        return [(site.weight, _grouped_use(how, groups, x.to(dt), g.to(dt), shape))]
    if how == "wx":
        if x.dim() > 2:  # [B, ..., in, T] -> positions [B, ... * T, in]
            x, g = x.transpose(-1, -2), g.transpose(-1, -2)
        u, v = g.reshape(b, -1, g.shape[-1]).to(dt), x.reshape(b, -1, x.shape[-1]).to(dt)
    else:
        gg, xx = g.reshape(b, -1, g.shape[-1]).to(dt), x.reshape(b, -1, x.shape[-1]).to(dt)
        u, v = (xx, gg) if how == "xw" else (gg, xx)
    out = [(site.weight, Use(PAIR, u, v, shape))]
    if site.bias:
        gg = g.reshape(b, -1, g.shape[-1]).to(dt)
        out.append((site.bias, Use(PAIR, gg, gg.new_ones(gg.shape[:2] + (1,)), tuple(params[site.bias].shape))))
    return out


def _grouped_use(how: str, groups: int, x: Tensor, g: Tensor, shape: tuple[int, ...]) -> Use:
    """A batched param ``W`` ``[*G, m, n]``: per group ``h`` the pair of ``x[..., h, :, :]`` and
    ``g[..., h, :, :]`` (every leading dim of a sample's ``x`` before ``G`` is more positions)."""
    b, h = x.shape[0], math.prod(shape[:groups])

    def per_group(t: Tensor) -> Tensor:  # [B, *lead, *G, p, q] -> [B, H, lead * p, q]
        t = t.reshape(b, -1, h, t.shape[-2], t.shape[-1]).transpose(1, 2)
        return t.reshape(b, h, -1, t.shape[-1])

    if how == "wx":
        x, g = x.transpose(-1, -2), g.transpose(-1, -2)  # positions are the columns
        return Use(GROUPED, per_group(g), per_group(x), shape)
    return Use(GROUPED, per_group(x), per_group(g), shape)


def _flat(use: Use) -> tuple[Tensor, Tensor]:
    """A grouped use's pairs as ``B * H`` pairs ``[B * H, T, d]``."""
    return use.u.flatten(0, 1), use.v.flatten(0, 1)


def _grouped_sq_norms(use: Use, keep_grads: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """Each group is a pair (linear.pair_sq_norms); the groups are disjoint blocks of the param, so
    their squared norms add, and so do their safe bounds ``(norm_h + margin_h)^2``."""
    b, h = use.u.shape[:2]
    sq, margin, per = pair_sq_norms(*_flat(use), keep_grads, dtype)
    sq, margin = sq.view(b, h), margin.view(b, h)
    total = sq.sum(1)
    safe = (sq.clamp_min(0.0).double().sqrt() + margin.double()).square().sum(1).sqrt()
    margin = (safe - total.clamp_min(0.0).double().sqrt()).clamp_min(0.0).to(margin.dtype)
    return total, margin, None if per is None else per.reshape((b,) + use.shape)


def _grouped_per_sample(use: Use) -> Tensor:
    return torch.einsum("bhti,bhtj->bhij", use.u, use.v).reshape((use.u.shape[0],) + use.shape)


def _grouped_weighted(use: Use, uw: Tensor, v: Tensor) -> Tensor:
    return torch.einsum("bhti,bhtj->hij", uw, v).reshape(use.shape)


# a batched param's use: u [B, H, T, du], v [B, H, T, dv], per-sample grad [H, du, dv] (groups do
# not join along T: their dim 1 is the group)
GROUPED = UseKind(
    "grouped pair",
    lambda use: use.u.shape[2],
    _grouped_sq_norms,
    _grouped_per_sample,
    _grouped_weighted,
    lambda use: pair_mass(*_flat(use)).view(use.u.shape[:2]).sum(1),
    joinable=False,
)


ADDMM = Rule(parse_addmm, matmul_uses, transposable=True)
MATMUL = Rule(parse_matmul, matmul_uses, transposable=True)
EINSUM = Rule(parse_einsum, matmul_uses, transposable=True)
