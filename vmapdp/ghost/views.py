"""Views of a param (``W.chunk(3)``, ``W.split``, ``W[a:b]``, ``W.narrow``, ``W.unbind``, ``W.t()``,
``W.T``, ``W.transpose``, reshapes, and broadcasts: ``expand``, ``broadcast_to``, ``repeat``) as
the weight or bias of a covered op: ghost clipping's uses of a block of a param.

``nn.MultiheadAttention`` slices its packed ``in_proj_weight`` / ``in_proj_bias`` into the q, k
and v projections (``chunk`` / ``split``) before ``F.linear``; ``x @ W.t()`` is a linear with a
transposed param. A view op on a param is recorded by the probe as the *box* it selects: applied to
a tensor holding each element's flat index in the param, the op returns the indices it selects;
when those are a box of the param (a slice ``[start, stop)`` per dim, in row-major order, or its
transpose for a 2-D view) the view is a ``View`` and a covered op that takes it as its weight or
bias is a site like any other. Anything else (a strided slice, a gather) is an ordinary use of the
param, routed through its per-sample copy.

A site on a view makes a use of the view's shape; ``place`` turns it into a use of the param's
block (a transposed pair use is the pair with ``u`` and ``v`` swapped: ``(sum_t u_t v_t^T)^T``).
A *broadcast* view (``bias.view(1, 1, d).expand(b, t, d)``, a class token ``expand`` ed to a
batch) repeats a box along some dims (``View.sums``: the dims whose indices are all equal); the
per-sample grad of the box is the view's summed over those dims, so its use is formed as
per-sample grads of the view's shape (as much memory as a per-sample copy of the view), summed,
and kept as a direct use (affine.py): norm and clipped sum from the same numbers.
The engine adds the uses of one param by block: the per-sample grads of *disjoint* blocks are
disjoint parts of the param's grad, so their squared norms add (and so do their safe bounds, as
for two params); blocks that overlap, or a block and a use of the whole param, are added as
per-sample grads placed in the param's shape (exact, cross terms included).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from vmapdp.ghost.affine import DIRECT
from vmapdp.ghost.uses import Use

__all__ = ["View", "VIEW_OPS", "box_of", "place", "disjoint", "pad_to", "Shaped"]


class View(NamedTuple):
    """A box of a param seen as a tensor of ``shape`` (``transposed``: the box's transpose, 2-D)."""

    index: tuple[tuple[int, int], ...]  # [start, stop) per param dim
    shape: tuple[int, ...]  # the view's shape
    transposed: bool = False
    sums: tuple[int, ...] = ()  # dims of the view that repeat the box (a broadcast: expand, repeat)

    @property
    def block(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.index)


class Shaped(NamedTuple):
    """A stand-in for a param in a rule's ``params`` (rules read only ``.shape``): a view's shape."""

    shape: tuple[int, ...]


VIEW_OPS = {
    Tensor.chunk,
    torch.chunk,
    Tensor.split,
    torch.split,
    Tensor.unbind,
    torch.unbind,
    Tensor.narrow,
    torch.narrow,
    Tensor.__getitem__,
    Tensor.t,
    torch.t,
    Tensor.T.__get__,
    Tensor.mT.__get__,
    Tensor.transpose,
    torch.transpose,
    Tensor.expand,  # broadcasts repeat a box (View.sums): ViT's class token, a bias expanded to [B, T, d]
    Tensor.broadcast_to,
    torch.broadcast_to,
    Tensor.repeat,  # (a copy, but of a box repeated along whole dims: MultiheadAttention's bias_k / bias_v)
    # reshapes keep the row-major order: a box of a param reshaped is the same box
    Tensor.view,
    Tensor.reshape,
    torch.reshape,
    Tensor.flatten,
    torch.flatten,
    Tensor.unflatten,
    Tensor.unsqueeze,
    torch.unsqueeze,
    Tensor.squeeze,
    torch.squeeze,
}


def box_of(idx: Tensor, shape: tuple[int, ...]) -> View | None:
    """The ``View`` that a view op's output ``idx`` (flat indices into a param of ``shape``) is, or
    None when it is not a box of the param in row-major order or its 2-D transpose, possibly
    broadcast (repeated along dims whose indices are all equal: ``View.sums``; then not transposed)."""
    if idx.dtype not in (torch.int32, torch.int64) or idx.numel() == 0:
        return None
    sums = tuple(d for d in range(idx.dim()) if idx.shape[d] > 1 and torch.equal(idx, idx.narrow(d, 0, 1).expand_as(idx)))
    base = idx
    for d in sums:
        base = base.narrow(d, 0, 1)
    view = _box(base, shape)
    if view is None or not sums:
        return view
    return None if view.transposed else View(view.index, tuple(idx.shape), False, sums)


def _box(idx: Tensor, shape: tuple[int, ...]) -> View | None:
    """``box_of`` without broadcasting: every index of ``idx`` distinct."""
    flat = idx.reshape(-1).long()
    coords = []
    rest = flat
    for n in reversed(shape):
        coords.append(rest % n)
        rest = rest // n
    coords = coords[::-1]
    index = tuple((int(c.min()), int(c.max()) + 1) for c in coords)
    if math.prod(e - s for s, e in index) != flat.numel():
        return None
    # the box's flat indices in row-major order, from its ranges (no param-sized tensor)
    block = torch.zeros((), dtype=torch.long)
    stride = 1
    for d in reversed(range(len(shape))):
        s, e = index[d]
        block = block + (torch.arange(s, e) * stride).view((-1,) + (1,) * (len(shape) - 1 - d))
        stride *= shape[d]
    block = block.reshape(-1)
    if torch.equal(flat, block):
        return View(index, tuple(idx.shape))
    if idx.dim() == 2 and torch.equal(idx.t().reshape(-1).long(), block):
        return View(index, tuple(idx.shape), True)
    return None


def place(use: Use, view: View, pair: Any) -> Use:
    """A use of ``view`` as a use of the param's block (``pair``: linear.PAIR, whose transpose is
    the same pair swapped). A transposed view in a use of another kind, and a broadcast view, give
    a direct use (affine.DIRECT): the per-sample grads of the view, formed (``[B, *view shape]``,
    the memory of a per-sample copy of the view), transposed or summed over the repeated dims."""
    # (a pair whose sides are not the view's rows and columns, an einsum's "tdk,dk->t" on P.t() whose u holds both
    # letters, say, is not transposed by swapping them: found by review, its sum came back permuted)
    swappable = use.kind is pair and tuple(use.u.shape[-1:] + use.v.shape[-1:]) == tuple(view.shape)
    if view.sums or (view.transposed and not swappable):
        per = use.kind.per_sample(use)
        if view.transposed:
            per = per.transpose(1, 2)
        if view.sums:
            per = per.sum([1 + d for d in view.sums], keepdim=True)
        return Use(DIRECT, per.reshape((per.shape[0],) + view.block), per.new_ones(per.shape[0], 1), view.block, None, view.index)
    if view.transposed:
        use = Use(use.kind, use.v, use.u, tuple(reversed(use.shape)), use.extra)
    return Use(use.kind, use.u, use.v, use.shape, use.extra, view.index)


def disjoint(a: tuple[tuple[int, int], ...] | None, b: tuple[tuple[int, int], ...] | None) -> bool:
    """Two blocks (None: the whole param) share no element."""
    if a is None or b is None:
        return False
    return any(ea <= sb or eb <= sa for (sa, ea), (sb, eb) in zip(a, b))


def pad_to(block: Tensor, index: tuple[tuple[int, int], ...] | None, shape: tuple[int, ...], lead: int = 0) -> Tensor:
    """``block`` (``lead`` leading dims, then a view's shape) placed at ``index`` in zeros of
    ``[*lead dims, *shape]`` (a pad: no in-place write)."""
    if index is None:
        return block
    block = block.reshape(tuple(block.shape[:lead]) + tuple(e - s for s, e in index))
    pad: list[int] = []
    for (s, e), n in reversed(list(zip(index, shape))):
        pad += [s, n - e]
    return F.pad(block, pad)
