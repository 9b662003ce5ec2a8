"""The elementwise-affine rules (``F.layer_norm``, ``F.group_norm``, ``F.rms_norm``, ``x * w`` and
``x + w`` with a param ``w`` that broadcasts into ``x``, and ``torch.cat`` with a param) and their
"direct" use: the per-sample grads themselves, which are small.

An affine ``y = xhat * w + b`` over the last dim(s) (the channel dim for group norm) has per-sample
grads ``sum_t xhat_t * g_t`` (weight) and ``sum_t g_t`` (bias): as many numbers per sample as the
param (``[B, C]``), cheaper than any Gram. ``xhat`` is recomputed from the kept input (the
normalised input; the other operand of a ``mul``). Guarantees: the norm and the clipped sum are
computed from the very same per-sample grads, so no rounding margin is needed (each sample's sum
over its positions happens within the sample, never across the batch), and the clipped sum is
``clip_and_sum``'s weighted sum (float32 for float32, like the grads of uses no rule covers).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vmapdp._tree import acc_dtype, sq_norms
from vmapdp.ghost.uses import Rule, Site, Use, UseKind, arg

__all__ = ["DIRECT", "LAYER_NORM", "GROUP_NORM", "RMS_NORM", "MUL", "ADD", "CAT", "direct_use", "batch_norm_affine", "instance_norm_affine"]


def _sq_norms(use: Use, keep_grads: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    sq = sq_norms(use.u).to(use.u.dtype)
    return sq, torch.zeros_like(sq), use.u if keep_grads else None


def _weighted(use: Use, uw: Tensor, v: Tensor) -> Tensor:
    return uw.sum(0)


DIRECT = UseKind(
    "direct",
    lambda use: 1,  # the sum over positions is the sample's own: one term in the batch's sum
    _sq_norms,
    lambda use: use.u,
    _weighted,
    # its one term per sample is the per-sample grad itself: mass = its norm. A param with one
    # direct use needs no margin (norm and sum share the numbers: _sq_norms' margin is 0); beside
    # other uses (its grads summed apart from theirs, which they may cancel) the mass gives the
    # margin and engine._floor's float32 floor, as for any use
    lambda use: sq_norms(use.u).sqrt().to(use.u.dtype),
    joinable=False,
)


def direct_use(grads: Tensor) -> Use:
    """A direct use: ``grads`` ``[B, *param shape]`` (``v`` is an unused ``[B, 1]``)."""
    return Use(DIRECT, grads, grads.new_ones(grads.shape[0], 1), tuple(grads.shape[1:]))


def _affine_uses(site: Site, xhat: Tensor, g: Tensor, dims: tuple[int, ...]) -> list[tuple[str, Use]]:
    """The weight's ``sum xhat * g`` and the bias's ``sum g`` over ``dims`` (positions)."""
    out = [(site.weight, direct_use((xhat * g).sum(dims) if dims else xhat * g))]
    if site.bias:
        out.append((site.bias, direct_use(g.sum(dims) if dims else g)))
    return out


def _lead(x: Tensor, k: int) -> tuple[int, ...]:
    """The position dims of a batched ``x`` ``[B, ..., *shape]`` whose last ``k`` dims are the param's."""
    return tuple(range(1, x.dim() - k))


def _shape(v: Any) -> tuple[int, ...]:
    return (int(v),) if isinstance(v, int) else tuple(int(s) for s in v)


def parse_layer_norm(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, tuple] | None:
    """``F.layer_norm(input, normalized_shape, weight, bias, eps)`` with a weight (and bias) of the
    normalised shape; ``meta`` = ``(shape, eps)``."""
    x, shape, w, b = arg(args, kwargs, 0, "input"), _shape(arg(args, kwargs, 1, "normalized_shape")), arg(args, kwargs, 2, "weight"), arg(args, kwargs, 3, "bias")
    if not isinstance(w, Tensor) or tuple(w.shape) != shape or (isinstance(b, Tensor) and tuple(b.shape) != shape):
        return None
    return x, w, b, (shape, float(arg(args, kwargs, 4, "eps", 1e-5)))


def layer_norm_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    shape, eps = site.meta
    dt = acc_dtype(g.dtype)
    dims = tuple(range(-len(shape), 0))
    x = x.to(dt)
    xhat = (x - x.mean(dims, keepdim=True)) * torch.rsqrt(x.var(dims, unbiased=False, keepdim=True) + eps)
    return _affine_uses(site, xhat, g.to(dt), _lead(x, len(shape)))


def parse_rms_norm(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, tuple] | None:
    """``F.rms_norm(input, normalized_shape, weight, eps)``; ``meta`` = ``(shape, eps)`` (``eps``
    None: the machine epsilon of the input's accumulation dtype, as torch's)."""
    x, shape, w = arg(args, kwargs, 0, "input"), _shape(arg(args, kwargs, 1, "normalized_shape")), arg(args, kwargs, 2, "weight")
    if not isinstance(w, Tensor) or tuple(w.shape) != shape or not isinstance(x, Tensor):
        return None
    eps = arg(args, kwargs, 3, "eps")
    return x, w, None, (shape, float(torch.finfo(acc_dtype(x.dtype)).eps if eps is None else eps))


def rms_norm_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    shape, eps = site.meta
    dt = acc_dtype(g.dtype)
    dims = tuple(range(-len(shape), 0))
    x = x.to(dt)
    xhat = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    return _affine_uses(site, xhat, g.to(dt), _lead(x, len(shape)))


def parse_group_norm(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, tuple] | None:
    """``F.group_norm(input, num_groups, weight, bias, eps)``, input ``[N, C, *]``, weight ``[C]``;
    ``meta`` = ``(groups, eps)``."""
    x, groups, w, b = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "num_groups"), arg(args, kwargs, 2, "weight"), arg(args, kwargs, 3, "bias")
    if not isinstance(x, Tensor) or x.dim() < 2 or not isinstance(w, Tensor) or tuple(w.shape) != (x.shape[1],):
        return None
    if isinstance(b, Tensor) and tuple(b.shape) != (x.shape[1],):
        return None
    return x, w, b, (int(groups), float(arg(args, kwargs, 4, "eps", 1e-5)))


def group_norm_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    groups, eps = site.meta
    dt = acc_dtype(g.dtype)
    x = x.to(dt)  # [B, N, C, *]
    grouped = x.reshape(x.shape[:2] + (groups, -1))
    mean = grouped.mean(-1, keepdim=True)
    var = grouped.var(-1, unbiased=False, keepdim=True)
    xhat = ((grouped - mean) * torch.rsqrt(var + eps)).reshape(x.shape)
    dims = (1,) + tuple(range(3, x.dim()))
    return _affine_uses(site, xhat, g.to(dt), dims)


def _broadcasts_into(w: Any, x: Any) -> bool:
    """``w`` (a float tensor of ``x``'s dtype) broadcasts into ``x``'s shape (the output is ``x``'s shape)."""
    if not isinstance(w, Tensor) or not isinstance(x, Tensor) or w.dim() > x.dim() or x.dtype != w.dtype or not w.is_floating_point():
        return False
    try:
        return tuple(torch.broadcast_shapes(x.shape, w.shape)) == tuple(x.shape)
    except RuntimeError:
        return False


def _operands(args: tuple, kwargs: dict) -> list[tuple[Any, Any, Any, tuple]] | None:
    """The alternatives ``(x = a, w = b)`` and ``(x = b, w = a)`` of a binary elementwise op whose
    ``w`` broadcasts into ``x``."""
    a, b = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "other")
    if set(kwargs) - {"other"}:
        return None  # alpha=, out=: the generic path
    out = [(x, w, None, ()) for x, w in ((a, b), (b, a)) if _broadcasts_into(w, x)]
    return out or None


def _reduce_to(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Batched ``t`` ``[B, *out]`` summed over what broadcasting ``shape`` into ``out`` repeated."""
    lead = t.dim() - 1 - len(shape)
    if lead:
        t = t.sum(tuple(range(1, 1 + lead)))
    dims = tuple(1 + i for i, n in enumerate(shape) if n == 1 and t.shape[1 + i] != 1)
    return t.sum(dims, keepdim=True) if dims else t


def parse_mul(args: tuple, kwargs: dict) -> list[tuple[Any, Any, Any, tuple]] | None:
    """``x * w`` or ``w * x`` with ``w`` broadcasting into ``x`` (a hand-written RMSNorm's
    ``h * weight``, a layer scale): the alternatives, ``w`` the second operand first."""
    return _operands(args, kwargs)


def mul_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    dt = acc_dtype(g.dtype)
    shape = tuple(params[site.weight].shape)
    return [(site.weight, direct_use(_reduce_to(x.to(dt) * g.to(dt), shape).reshape((g.shape[0],) + shape)))]


def parse_add(args: tuple, kwargs: dict) -> list[tuple[Any, Any, Any, tuple]] | None:
    """``x + w`` or ``w + x`` with ``w`` broadcasting into ``x`` (a learned position embedding, a
    hand-written bias): the alternatives, ``w`` the second operand first."""
    return _operands(args, kwargs)


def add_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    shape = tuple(params[site.weight].shape)
    return [(site.weight, direct_use(_reduce_to(g.to(acc_dtype(g.dtype)), shape).reshape((g.shape[0],) + shape)))]


def parse_cat(args: tuple, kwargs: dict) -> list[tuple[Any, Any, Any, tuple]] | None:
    """``torch.cat(tensors, dim)`` (ViT's ``cat((class token, patches), 1)``): the alternatives, one
    per operand ``w`` (``meta`` = ``(dim, offset, size)``: where ``w`` lies in the output), with
    another operand as the "input" (the rule needs only the output grad)."""
    tensors, dim = arg(args, kwargs, 0, "tensors"), arg(args, kwargs, 1, "dim", 0)
    if set(kwargs) - {"tensors", "dim"} or not isinstance(tensors, (list, tuple)) or len(tensors) < 2 or not isinstance(dim, int):
        return None
    if not all(isinstance(t, Tensor) and t.dim() == tensors[0].dim() > 0 for t in tensors):
        return None
    dim = dim % tensors[0].dim()
    out, offset = [], 0
    for i, w in enumerate(tensors):
        out.append((tensors[1 if i == 0 else 0], w, None, (dim, offset, int(w.shape[dim]))))
        offset += int(w.shape[dim])
    return out


def cat_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    """The operand's per-sample grad is its slice of the output grad."""
    dim, offset, size = site.meta
    shape = tuple(params[site.weight].shape)
    return [(site.weight, direct_use(g.narrow(dim + 1, offset, size).to(acc_dtype(g.dtype)).reshape((g.shape[0],) + shape)))]


def batch_norm_affine(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None = None, bias: Tensor | None = None,
    training: bool = False, momentum: float = 0.1, eps: float = 1e-5,
) -> Tensor:
    """``F.batch_norm`` as its normalisation then its affine ``xhat * w.view(1, C, 1..) + b.view(..)``,
    which the tracer runs instead of the op (plan.TRACED_THROUGH): the affine's uses are then the
    ``mul`` and ``add`` rules' on views of the weight and bias (a ResNet's BatchNorm in eval mode).
    ``xhat`` is normalised by the running statistics (eval), or by the sample's own statistics
    over ``[N, *spatial]`` when there are none (``track_running_stats=False``), in float32 at least,
    and cast back to the input's dtype, as the op does. Training with running statistics (an
    in-place update of buffers, which vmap refuses) and a norm without affine run the op itself."""
    if (weight is None and bias is None) or (training and running_mean is not None) or input.dim() < 2:
        return torch.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, torch.backends.cudnn.enabled)
    if training:
        F._verify_batch_size(input.size())  # (the op's own check: one value per channel cannot be normalised)
    shape = (1, -1) + (1,) * (input.dim() - 2)
    x = input.to(torch.promote_types(input.dtype, torch.float32))
    if running_mean is None or running_var is None:
        dims = [0] + list(range(2, input.dim()))
        mean, var = x.mean(dims, keepdim=True), x.var(dims, unbiased=False, keepdim=True)
    else:
        mean, var = running_mean.view(shape).to(x.dtype), running_var.view(shape).to(x.dtype)
    y = ((x - mean) * torch.rsqrt(var + eps)).to(input.dtype)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y.to(input.dtype)  # the op's output dtype (a float32 affine on a bfloat16 input stays bfloat16)


def instance_norm_affine(
    fallback: Any, input: Tensor, running_mean: Tensor | None = None, running_var: Tensor | None = None, weight: Tensor | None = None,
    bias: Tensor | None = None, use_input_stats: bool = True, momentum: float = 0.1, eps: float = 1e-5,
) -> Tensor:
    """``F.instance_norm`` as the op without its affine, then ``xhat * w.view(1, C, 1..) +
    b.view(..)`` (plan.TRACED_THROUGH, as :func:`batch_norm_affine`): the affine's uses are the
    ``mul`` and ``add`` rules' (a style-transfer or GAN discriminator's InstanceNorm). Statistics
    updated in place (``track_running_stats=True`` in training), a norm without affine, an
    unbatched input and tensors of mixed dtypes run ``fallback``, the op's own body (its checks
    and errors included)."""
    tensors = [t for t in (running_mean, running_var, weight, bias) if t is not None]
    if (weight is None and bias is None) or (use_input_stats and running_mean is not None) or input.dim() < 3 or any(t.dtype != input.dtype for t in tensors):
        return fallback(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
    y = fallback(input, running_mean, running_var, None, None, use_input_stats, momentum, eps)  # (the op's checks: one value per channel)
    shape = (1, -1) + (1,) * (input.dim() - 2)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y


LAYER_NORM = Rule(parse_layer_norm, layer_norm_uses)
RMS_NORM = Rule(parse_rms_norm, rms_norm_uses)
GROUP_NORM = Rule(parse_group_norm, group_norm_uses)
MUL = Rule(parse_mul, mul_uses)
CAT = Rule(parse_cat, cat_uses)
ADD = Rule(parse_add, add_uses)
