"""The conv rules (``conv1d/2d/3d`` and ``conv_transpose1d/2d/3d``, the adjoint: its weight's use
is the conv's with the roles of input and output grads swapped) and their "conv" use: per-sample
norms of conv kernels, three ways.

Few channels: one grouped conv backward with the batch as groups gives the per-sample grads
(kept for the clipped sum when they fit, see ``Limits``). Wide channels: ghost norms from float64
Grams, the patches' Gram taken from the input's own Gram when cheaper (no patches in memory), or
from unfolded patches as a pair (linear.py). The clipped sum is one conv backward over the batch.
A conv bias is a pair use (output grads, ones).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vmapdp._tree import acc_dtype, sq_norms
from vmapdp.ghost import limits
from vmapdp.ghost.linear import PAIR, pair_mass, pair_sq_norms
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
    int_tuple,
    rounding_margin,
    rows_per_slice,
    slices,
)

__all__ = ["CONV", "CONV_RULES", "conv_sq_norms", "conv_per_sample", "conv_grams", "conv_pair"]


def parse_conv(dims: int, args: tuple, kwargs: dict) -> tuple[Any, Any, Any, tuple] | None:
    """``conv{dims}d(input, weight, bias, stride, padding, dilation, groups)`` with a kernel of rank
    ``dims + 2``; ``meta`` its geometry ``(dims, stride, padding, dilation, groups, kernel shape)``."""
    w = arg(args, kwargs, 1, "weight")
    if not isinstance(w, Tensor) or w.dim() != dims + 2:
        return None
    padding = arg(args, kwargs, 4, "padding", 0)
    meta = (
        dims,
        int_tuple(arg(args, kwargs, 3, "stride", 1), dims),
        padding if isinstance(padding, str) else int_tuple(padding, dims),
        int_tuple(arg(args, kwargs, 5, "dilation", 1), dims),
        int(arg(args, kwargs, 6, "groups", 1)),
        tuple(w.shape),
    )
    b = arg(args, kwargs, 2, "bias")
    if isinstance(b, Tensor) and tuple(b.shape) != (w.shape[0],):
        return None  # a broadcasting bias: the generic path
    return arg(args, kwargs, 0, "input"), w, b, meta


def conv_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    b = g.shape[0]
    dt = acc_dtype(g.dtype)
    dims, stride, padding, dilation, groups, kshape = site.meta  # (set by parse_conv)
    c_in, c_out = x.shape[-dims - 1], kshape[0]
    xs = _conv_padded(x.reshape((-1, c_in) + tuple(x.shape[-dims:])).to(dt), dims, padding, tuple(kshape[2:]), dilation)
    gs = g.reshape((b, -1, c_out) + tuple(g.shape[-dims:])).to(dt)
    out = [(site.weight, Use(CONV, gs, xs.reshape((b, -1) + tuple(xs.shape[1:])), tuple(params[site.weight].shape), (dims, stride, dilation, groups)))]
    if site.bias:
        out.append(_bias_use(site, gs, params))
    return out


def _bias_use(site: Site, g: Tensor, params: dict[str, Tensor]) -> tuple[str, Use]:
    """A conv's (or transposed conv's) bias: the pair of its output grads' positions with ones;
    ``g`` ``[B, n, C_out, *out]``."""
    b, c_out = g.shape[0], g.shape[2]
    u = g.flatten(3).transpose(2, 3)  # [B, n, L, C_out]
    u = u[:, 0] if u.shape[1] == 1 else u.reshape(b, -1, c_out)  # [B, n*L, C_out], a view when n == 1
    return site.bias, Use(PAIR, u, u.new_ones(u.shape[:2] + (1,)), tuple(params[site.bias].shape))


def parse_conv_transpose(dims: int, args: tuple, kwargs: dict) -> tuple[Any, Any, Any, tuple] | None:
    """``conv_transpose{dims}d(input, weight, bias, stride, padding, output_padding, groups,
    dilation)`` with a kernel ``[C_in, C_out / groups, *k]``; ``meta`` its geometry ``(dims,
    stride, padding, dilation, groups, kernel shape)``."""
    w = arg(args, kwargs, 1, "weight")
    if not isinstance(w, Tensor) or w.dim() != dims + 2:
        return None
    groups = int(arg(args, kwargs, 6, "groups", 1))
    meta = (
        dims,
        int_tuple(arg(args, kwargs, 3, "stride", 1), dims),
        int_tuple(arg(args, kwargs, 4, "padding", 0), dims),
        int_tuple(arg(args, kwargs, 7, "dilation", 1), dims),
        groups,
        tuple(w.shape),
    )
    b = arg(args, kwargs, 2, "bias")
    if isinstance(b, Tensor) and tuple(b.shape) != (w.shape[1] * groups,):
        return None
    return arg(args, kwargs, 0, "input"), w, b, meta


def conv_transpose_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    """A transposed conv ``y = C_W^T x`` is the adjoint of the conv ``C_W`` (stride, padding and
    dilation its own; weight ``[C_in, C_out / groups, *k]`` is that conv's ``[out, in / groups,
    *k]``), so ``<dy, C_W^T x> = <C_W dy, x>``: its weight's per-sample grad is that conv's weight
    grad with the output grads ``dy`` as the conv's input and the input ``x`` as its output grads.
    A ``"conv"`` use with those roles (``output_padding``'s extra rows are read by no position of
    ``C_W``); the bias is a pair of ``dy``'s positions with ones, as a conv's."""
    b = g.shape[0]
    dt = acc_dtype(g.dtype)
    dims, stride, padding, dilation, groups, kshape = site.meta  # (set by parse_conv_transpose)
    c_in, c_out = kshape[0], kshape[1] * groups
    xs = x.reshape((b, -1, c_in) + tuple(x.shape[-dims:])).to(dt)
    gs = _conv_padded(g.reshape((-1, c_out) + tuple(g.shape[-dims:])).to(dt), dims, padding, tuple(kshape[2:]), dilation)
    # only the rows the conv reads for x's positions: an output_padding >= stride (legal where
    # dilation > stride) leaves rows that would give the conv more output positions than x has
    need = tuple((m - 1) * st + dl * (k - 1) + 1 for m, st, dl, k in zip(x.shape[-dims:], stride, dilation, kshape[2:]))
    gs = gs[(Ellipsis,) + tuple(slice(0, n) for n in need)]
    out = [(site.weight, Use(CONV, xs, gs.reshape((b, -1) + tuple(gs.shape[1:])), tuple(params[site.weight].shape), (dims, stride, dilation, groups)))]
    if site.bias:
        out.append(_bias_use(site, g.reshape((b, -1, c_out) + tuple(g.shape[-dims:])).to(dt), params))
    return out


def _unfold(x: Tensor, dims: int, kernel: tuple, stride: tuple, dilation: tuple) -> Tensor:
    """Patches ``[N, C * prod(kernel), L]`` of an already padded ``x`` ``[N, C, *spatial]``."""
    if dims == 2:
        return F.unfold(x, kernel, dilation=dilation, stride=stride)
    if dims == 1:
        return F.unfold(x.unsqueeze(2), (1,) + kernel, dilation=(1,) + dilation, stride=(1,) + stride)
    n, c = x.shape[:2]
    for i in range(dims):
        span = dilation[i] * (kernel[i] - 1) + 1
        x = x.unfold(2 + i, span, stride[i])  # appends the window dim
        if dilation[i] > 1:
            x = x[..., :: dilation[i]]
    # [N, C, *out, *window] -> [N, C, *window, *out]
    perm = (0, 1) + tuple(range(2 + dims, 2 + 2 * dims)) + tuple(range(2, 2 + dims))
    x = x.permute(perm)
    return x.reshape(n, c * math.prod(kernel), -1)


def _conv_padded(x: Tensor, dims: int, padding: Any, kernel: tuple, dilation: tuple) -> Tensor:
    """``x`` ``[N, C, *spatial]`` with the conv's zero padding applied, so the conv uses padding 0."""
    if isinstance(padding, str):
        if padding == "valid":
            return x
        pads: list[int] = []
        for i in reversed(range(dims)):  # F.pad lists the last dim first
            total = dilation[i] * (kernel[i] - 1)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads)
    if not any(padding):
        return x
    return F.pad(x, [p for p in reversed(padding) for _ in range(2)])


def conv_pair(use: Use, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A groups=1 conv use as a pair: output grads ``[B, n*L, C_out]`` and patches ``[B, n*L, C_in*k]``
    (in ``dtype``: patches for float64 Grams are unfolded from a float64 input, not copied)."""
    dims, stride, dilation, _ = use.extra
    g, x = use.u.to(dtype), use.v
    b, n, c_out = g.shape[:3]
    patches = _unfold(x.flatten(0, 1).to(dtype), dims, tuple(use.shape[2:]), stride, dilation)  # [B*n, C_in*k, L]
    if n == 1:  # transposed views, no copies
        return g.flatten(3)[:, 0].transpose(1, 2), patches.transpose(1, 2)
    v = patches.reshape(b, n, patches.shape[1], patches.shape[2]).transpose(2, 3).reshape(b, -1, patches.shape[1])
    u = g.flatten(3).transpose(2, 3).reshape(b, -1, c_out)
    return u, v


def input_gram_cheaper(positions: int, c_in: int, k: int, t: int) -> bool:
    """The patches' Gram from the input's Gram (:func:`conv_grams`) costs less than from unfolded patches."""
    return positions * positions * c_in + k * t * t < t * t * c_in * k + t * c_in * k


def conv_grams(use: Use) -> tuple[Tensor, Tensor]:
    """Float64 Grams ``[B, T, T]`` of a groups=1 conv use's output grads and of its patches, the
    latter from the Gram of the padded input's positions: ``<patch_t, patch_s> = sum_k <x[i_tk],
    x[i_sk]>`` over the kernel offsets ``k`` (``i_tk``: the input position output ``t`` reads at
    offset ``k``; for each ``k`` a strided view of the input Gram). Costs ``P^2 C_in + K T^2`` per
    sample instead of ``T^2 C_in K``, and no patches. For float32 data only (a float64 model's
    convs take the direct path: ``uses.float64_factors``)."""
    dims, stride, dilation, _ = use.extra
    g, x = use.u, use.v  # [B, n, C_out, *out], [B, n, C_in, *in] (padded)
    b, n, c_out = g.shape[:3]
    c_in, in_shape, out_shape, kernel = x.shape[2], tuple(x.shape[3:]), tuple(g.shape[3:]), tuple(use.shape[2:])
    u = g.flatten(3).transpose(2, 3).reshape(b, -1, c_out).double()  # [B, T, C_out]
    gu = torch.bmm(u, u.transpose(1, 2))
    p = math.prod(in_shape)
    xs = x.flatten(3).transpose(2, 3).reshape(b, n * p, c_in).double()  # [B, n*P, C_in]
    gx = torch.bmm(xs, xs.transpose(1, 2)).view((b, n) + in_shape + (n,) + in_shape)
    gv = None
    for offset in itertools.product(*(range(k) for k in kernel)):
        # the input positions every output position reads at this kernel offset: a strided view
        at = tuple(slice(o * dl, o * dl + (m - 1) * st + 1, st) for o, dl, m, st in zip(offset, dilation, out_shape, stride))
        term = gx[(slice(None), slice(None)) + at + (slice(None),) + at]  # [B, n, *out, n, *out]
        gv = term.clone() if gv is None else gv.add_(term)
    return gu, gv.reshape(b, u.shape[1], u.shape[1])


def conv_backward(use: Use, grad: Tensor, x: Tensor, groups: int, weight_shape: tuple) -> Tensor:
    dims, stride, dilation, _ = use.extra
    weight = grad.new_empty(weight_shape)
    return torch.ops.aten.convolution_backward(
        grad, x, weight, None, list(stride), [0] * dims, list(dilation), False, [0] * dims, groups, [False, True, False]
    )[1]


def conv_per_sample(use: Use) -> Tensor:
    """Per-sample conv weight grads ``[B, *shape]``: one conv backward with the batch as groups."""
    _, _, _, groups = use.extra
    g, x = use.u, use.v
    b, n = g.shape[:2]
    # the sample's own dim n becomes the conv's batch dim; samples become groups
    gg = g.transpose(0, 1).reshape((n, -1) + tuple(g.shape[3:]))
    xx = x.transpose(0, 1).reshape((n, -1) + tuple(x.shape[3:]))
    w = conv_backward(use, gg, xx, groups * b, (b * use.shape[0],) + use.shape[1:])
    return w.reshape((b,) + use.shape)


def _grouped_path(use: Use) -> bool:
    """Few channels: the grouped conv backward (no patches in memory) is the fast kernel."""
    c_out, c_in_g = use.shape[:2]
    return use.extra[3] > 1 or c_out * c_in_g <= limits.LIMITS.grouped_conv_max


def conv_mass(use: Use) -> Tensor:
    """``sum_t |g_t| |patch_t|`` per sample, without forming the patches (a conv of ``x^2`` with
    ones); for float64 data from the patches, a slice of the batch at a time, position by position
    (``linear.pair_mass``: the squares of float64 factors can underflow, ``uses.float64_factors``)."""
    dims, stride, dilation, _ = use.extra
    g, x = use.u, use.v  # [B, n, C_out, *out], [B, n, C_in, *in] (padded)
    b, n = g.shape[:2]
    if float64_factors(g, x):
        t, dv = use.t, math.prod(use.shape[1:])
        return cat_rows([pair_mass(*conv_pair(use.rows(s, e), torch.float64)) for s, e in slices(b, t * (dv + use.shape[0]))])
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    ones = x.new_ones((1, x.shape[2]) + tuple(use.shape[2:]))
    patch_sq = conv(x.flatten(0, 1).square(), ones, stride=stride, dilation=dilation)  # [B*n, 1, *out]
    g_norm = torch.linalg.vector_norm(g.flatten(0, 1), dim=1, keepdim=True).square()
    return (g_norm * patch_sq).sqrt().reshape(b, -1).sum(1)


def conv_sq_norms(use: Use, keep_grads: bool, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Squared norms of one conv use, their margin (for a clipped sum in ``dtype``, default the
    use's), and the per-sample grads when ``keep_grads``."""
    dtype = use.u.dtype if dtype is None else dtype
    b = use.u.shape[0]
    if not _grouped_path(use):
        t, du, dv = use.t, use.shape[0], math.prod(use.shape[1:])
        gram = gram_cheaper(t, du, dv) and not float64_factors(use.u, use.v)  # (float64 data: the direct path)
        positions = use.v.shape[1] * math.prod(use.v.shape[3:])  # n * padded input positions
        c_in, k = use.v.shape[2], math.prod(use.shape[2:])
        if gram and input_gram_cheaper(positions, c_in, k, t):
            # the patches' Gram from the input's own (fewer products, no patches in memory)
            per_sample = 2 * positions * positions + positions * c_in + 3 * t * t + t * du
            parts = [from_grams(*conv_grams(use.rows(s, e)), dtype) for s, e in slices(b, per_sample)]
            sqs, masses = zip(*parts)
            sq, mass = cat_rows(sqs), cat_rows(masses)
            return sq, gram_margin(sq, mass, t, du, dv, dtype), None
        # patches are unfolded a slice of the batch at a time (float64 ones for Grams)
        parts = [
            pair_sq_norms(*conv_pair(use.rows(s, e), torch.float64 if gram else use.u.dtype), keep_grads, dtype, gram=gram)
            for s, e in slices(b, 2 * t * (t + du + dv) + t * dv if gram else du * dv + t * dv)
        ]
        sqs, margins, pers = zip(*parts)
        per = None if pers[0] is None else cat_rows(pers).reshape((b,) + use.shape)
        return cat_rows(sqs), cat_rows(margins), per
    rows = max(1, limits.LIMITS.grouped_channels // use.v.shape[2])  # samples per grouped conv backward (x all their C_in)
    step = min(rows, b) if keep_grads else min(rows, rows_per_slice(b, math.prod(use.shape)))
    # kept grads of one slice are that slice's own (no copy); of several, copied into one tensor
    per = use.u.new_empty((b,) + use.shape) if keep_grads and step < b else None
    sqs = []
    for s in range(0, b, step):
        part = use.rows(s, s + step)
        g = conv_per_sample(part if keep_grads else part.to(dtype))  # not kept: in the sum's dtype (Use.to)
        sqs.append(sq_norms(g).to(g.dtype))
        if per is not None:
            per[s:s + step] = g
        elif keep_grads:
            per = g
    sq = cat_rows(sqs)
    if per is not None:  # the clipped sum will use these very numbers: nothing to reconcile
        return sq, torch.zeros_like(sq), per
    return sq, rounding_margin(use.t, dtype) * conv_mass(use), None



def _weighted(use: Use, uw: Tensor, v: Tensor) -> Tensor:
    return conv_backward(use, uw.flatten(0, 1), v.flatten(0, 1), use.extra[3], use.shape)


def _positions(use: Use) -> int:
    """``n * L``: a sample's own batch dim times the output positions."""
    return use.u.shape[1] * math.prod(use.u.shape[3:])


# conv uses of one param are not joined (each has its own geometry)
CONV = UseKind("conv", _positions, conv_sq_norms, conv_per_sample, _weighted, conv_mass, joinable=False)
CONV_RULES = {op: Rule(functools.partial(parse_conv, dims), conv_uses) for op, dims in ((torch.conv1d, 1), (torch.conv2d, 2), (torch.conv3d, 3))}
CONV_RULES.update({
    op: Rule(functools.partial(parse_conv_transpose, dims), conv_transpose_uses)
    for op, dims in ((torch.conv_transpose1d, 1), (torch.conv_transpose2d, 2), (torch.conv_transpose3d, 3))
})
