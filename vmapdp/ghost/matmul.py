"""The matmul rules (``torch.addmm``, ``matmul`` / ``@``, ``mm``, ``bmm``, two-operand ``einsum``):
a param times an activation, as "pair" uses (linear.py), the same sequence-level Gram identity as
``F.linear`` (Li et al. 2022) with the weight possibly transposed, batched or permuted.

Three orientations of a 2-D param, per sample (``t`` runs over all positions, the batch dims of a
broadcasting matmul included):

* ``"xw"``: ``y = x @ W``, ``W`` ``[in, out]`` (GPT-2's ``Conv1D``: ``torch.addmm(b, x, W)``):
  ``G = sum_t x_t g_t^T``, the pair ``(x, g)``;
* ``"xwt"``: ``y = x @ W^T`` (what ``F.linear`` computes): the pair ``(g, x)``;
* ``"wx"``: ``y = W @ x``, ``W`` ``[out, in]``, ``x`` ``[..., in, T]`` or ``[in]``: positions are
  the columns: the pair ``(g^T, x^T)``.

A batched param ``[*G, m, n]`` (``bmm``) is a pair per matrix ("grouped pair"). ``einsum`` takes
a param of any rank: its letters are *groups* (also in ``x`` and the output: a matrix per group),
*rows* (contracted with ``x``) and *cols* (only in the output); ``x``'s other letters are
positions. Per group the per-sample grad is ``sum_t x_t[rows] g_t[cols]^T``: a pair when ``W``'s
letters read rows then cols (``"btd,dhk->bthk"``: ``W`` ``[d, h * k]`` as a matrix) or cols then
rows (the transpose), a grouped pair with the groups first, else the same grouped pair with its
per-sample grads and sums permuted into ``W``'s order ("permuted pair", ``"btd,hdk->bthk"``).

``addmm``'s bias (shape ``[out]``, ``beta = alpha = 1``) is the pair ``(g, ones)``. Guarantees: the
per-sample grad is ``sum_t u_t v_t^T`` exactly as for ``F.linear``, so norms, margins (one term per
position: float64 Grams, ``gram_margin``) and the float64 book-keeping of sequences
(``engine._sum_dtype``, ``T > 1``) are linear's. A call in any other form (``beta != 1``, a
broadcasting bias, an einsum with a trace, a diagonal, a letter summed within one operand, or
dims of size 1 broadcast against ``W``'s) is left to the generic per-sample view.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from vmapdp._tree import acc_dtype
from vmapdp.ghost.linear import PAIR, pair_mass, pair_sq_norms
from vmapdp.ghost.uses import Rule, Site, Use, UseKind, arg

__all__ = ["ADDMM", "MATMUL", "EINSUM", "GROUPED", "PERMUTED", "EinsumForm", "einsum_form"]


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
    """``torch.addmm(bias, x, W)`` with ``beta = alpha = 1`` and a bias of shape ``[out]``, or
    ``torch.addmm(z, x, W)`` with ``z`` of the output's shape ``[n, out]``, an activation added to
    ``x @ W`` (a recurrent step's ``x_proj + h W_hh^T``): no bias use (a param there is another use
    of it, and the tracer takes the generic path)."""
    bias, x, w = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "mat1"), arg(args, kwargs, 2, "mat2")
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1 or not _xw(x, w) or not isinstance(bias, Tensor):
        return None
    if tuple(bias.shape) == (w.shape[1],):
        return x, w, bias, ("xw", 0)
    if tuple(bias.shape) == (x.shape[0], w.shape[1]):
        return x, w, None, ("xw", 0)
    return None


class EinsumForm(NamedTuple):
    """A two-operand ``einsum`` with a weight operand ``W``, its letters classified (an ellipsis is
    resolved into capital letters the equation does not use): ``x``, ``w``, ``out`` the subscripts;
    ``groups`` the letters of ``W`` that ``x`` and the output have too (a matrix per group),
    ``rows`` those contracted with ``x`` (not in the output), ``cols`` those only in the output
    (each in ``W``'s order); the letters of ``x`` not in ``W`` are positions."""

    x: str
    w: str
    out: str
    groups: str
    rows: str
    cols: str


def _ellipsis(sub: str, ndim: int, fresh: str) -> str | None:
    """The letters that ``sub``'s ellipsis stands for when its operand has ``ndim`` dims (the
    first letters of ``fresh``; "" without an ellipsis), None when the dims do not fit."""
    if "..." not in sub:
        return ""
    n = ndim - (len(sub) - 3)
    return None if n < 0 or "." in sub.replace("...", "", 1) else fresh[:n]


def einsum_form(equation: str, x_dim: int, w_dim: int, k: int) -> EinsumForm | None:
    """The form of a two-operand ``einsum`` whose operand ``k`` is the weight ``W`` (``W``'s dims
    named, no ellipsis), ``x`` of ``x_dim`` dims and ``W`` of ``w_dim``, when ghost clipping
    covers it: every letter used once per operand, every letter of ``x`` not in ``W`` kept in the
    output (a position), every letter of ``W`` seen by ``x`` or the output, the output's letters
    from the operands (no trace, no diagonal, no sum over a letter of one operand only). Else None."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1:
        return None
    lhs, out = eq.split("->")
    subs = lhs.split(",")
    if len(subs) != 2 or "." in subs[k]:
        return None
    fresh = "".join(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq)
    ell = _ellipsis(subs[1 - k], x_dim, fresh)
    if ell is None or out.count("...") != subs[1 - k].count("..."):
        return None
    xs, ws, out = subs[1 - k].replace("...", ell), subs[k], out.replace("...", ell)
    if "." in out or len(xs) != x_dim or len(ws) != w_dim:
        return None
    if not (xs + ws + out).isalpha() or any(len(set(s)) != len(s) for s in (xs, ws, out)):
        return None
    if set(out) - set(xs) - set(ws) or set(xs) - set(ws) - set(out) or set(ws) - set(xs) - set(out):
        return None
    groups = "".join(c for c in ws if c in xs and c in out)
    rows = "".join(c for c in ws if c in xs and c not in out)
    cols = "".join(c for c in ws if c in out and c not in xs)
    return EinsumForm(xs, ws, out, groups, rows, cols)


def parse_einsum(args: tuple, kwargs: dict) -> list[tuple[Any, Any, Any, tuple]] | None:
    """``einsum(equation, a, b)`` (or with the operands in a list) of the forms of
    :func:`einsum_form`: the alternatives ``W = b`` and ``W = a``, in that order; ``meta`` =
    ``("einsum", form)``. The dims ``x`` and ``W`` share must have equal sizes (no broadcasting)."""
    if not args or not isinstance(args[0], str) or kwargs:
        return None
    ops = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if len(ops) != 2 or not all(isinstance(t, Tensor) for t in ops):
        return None
    out = []
    for k in (1, 0):
        w, x = ops[k], ops[1 - k]
        form = einsum_form(args[0], x.dim(), w.dim(), k)
        if form is None:
            continue
        size = dict(zip(form.x, x.shape))
        if any(size[c] != n for c, n in zip(form.w, w.shape) if c in size):
            continue
        out.append((x, w, None, ("einsum", form)))
    return out or None


def einsum_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    """Per group, the pair of ``x``'s ``rows`` and the output grad's ``cols`` over the positions:
    ``u`` ``[B, H, T, rows]``, ``v`` ``[B, H, T, cols]`` (a letter set that is empty is a dim of
    1). ``W``'s letters in the order ``rows, cols`` make a pair use (``cols, rows``: its swap), with
    groups first a grouped pair; any other order of ``W``'s letters a permuted one."""
    _, f = site.meta
    dt = acc_dtype(g.dtype)
    b = g.shape[0]
    z = [c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in f.x + f.w + f.out][0]  # the batch dim's letter
    pos = "".join([c for c in f.x if c not in f.w])
    u = torch.einsum(f"{z}{f.x}->{z}{f.groups}{pos}{f.rows}", x).to(dt)
    v = torch.einsum(f"{z}{f.out}->{z}{f.groups}{pos}{f.cols}", g).to(dt)
    size = dict(zip(f.x, x.shape[1:])) | dict(zip(f.out, g.shape[1:]))
    h, t = math.prod([size[c] for c in f.groups]), math.prod([size[c] for c in pos])
    u, v = u.reshape(b, h, t, -1), v.reshape(b, h, t, -1)
    shape = tuple(params[site.weight].shape)
    canonical = f.groups + f.rows + f.cols
    if f.w in (canonical, f.groups + f.cols + f.rows):
        if f.w != canonical:
            u, v = v, u
        use = Use(GROUPED, u, v, shape) if f.groups else Use(PAIR, u[:, 0], v[:, 0], shape)
    else:
        order = tuple([canonical.index(c) for c in f.w])  # W's dims from the canonical per-sample grad's
        use = Use(PERMUTED, u, v, shape, (tuple([size[c] for c in canonical]), order))
    return [(site.weight, use)]


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


def _canonical(use: Use) -> Use:
    """A permuted use as the grouped pair it is, of the canonical shape (groups, rows, cols)."""
    return Use(GROUPED, use.u, use.v, use.extra[0])


def _permuted(use: Use, per: Tensor, lead: int) -> Tensor:
    """A canonical per-sample grad (``lead`` leading dims) in ``W``'s order of dims."""
    return per.permute(list(range(lead)) + [lead + d for d in use.extra[1]])


def _permuted_sq_norms(use: Use, keep_grads: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    sq, margin, per = _grouped_sq_norms(_canonical(use), keep_grads, dtype)  # (a norm does not see the order of dims)
    return sq, margin, None if per is None else _permuted(use, per, 1)


# an einsum whose W has its letters in another order than (groups, rows, cols) or (groups, cols,
# rows) (``"btd,hdk->bthk"``, W [heads, in, out], the output's head letter between x's): a grouped
# pair of the canonical shape ``extra[0]``, its per-sample grads and sums permuted to W's dims by
# ``extra[1]``
PERMUTED = UseKind(
    "permuted pair",
    lambda use: use.u.shape[2],
    _permuted_sq_norms,
    lambda use: _permuted(use, _grouped_per_sample(_canonical(use)), 1),
    lambda use, uw, v: _permuted(use, _grouped_weighted(_canonical(use), uw, v), 0),
    lambda use: pair_mass(*_flat(use)).view(use.u.shape[:2]).sum(1),
    joinable=False,
)


ADDMM = Rule(parse_addmm, matmul_uses, transposable=True)
MATMUL = Rule(parse_matmul, matmul_uses, transposable=True)
EINSUM = Rule(parse_einsum, einsum_uses, transposable=True)
