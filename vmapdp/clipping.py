"""Per-sample clipping and summation, as pure functions over pytrees of per-sample gradients.

Input: ``grads``, a pytree (usually ``{name: [B, *shape]}``) from ``per_sample_grads``.

Rules (``rule=``):

* ``"clip"`` (flat clipping, Abadi et al. 2016): ``g_i * min(1, C / ||g_i||)``. A zero gradient is
  left exactly zero; a gradient already within ``C`` is returned unchanged.
* ``"normalize"`` (automatic clipping, Bu et al. 2022, "Automatic Clipping: Differentially
  Private Deep Learning Made Easier and Stronger"): ``g_i * C / (||g_i|| + stability)``. Every
  sample's contribution has norm ``< C``, so the sensitivity is ``C`` as for flat clipping, and
  with a scale-invariant optimizer the choice of ``C`` stops mattering.

Per-layer clipping (:func:`clip_and_sum_per_layer`) gives each group of keys its own threshold;
its total L2 sensitivity is ``sqrt(sum_g C_g**2)`` (:func:`per_layer_sensitivity`).

Non-finite gradients (``nonfinite=``): a sample whose gradient holds NaN or inf is never released.
With ``"zero"`` (default) its contribution is exactly 0 (a bounded contribution, so the privacy
guarantee holds) and its norm is reported as non-finite in the returned ``norms``, so
``(~norms.isfinite()).sum()`` counts such samples. With ``"raise"`` a ``FloatingPointError`` is
raised instead (this reads a value on the host: it syncs, and under ``torch.compile`` it breaks
the graph).

Rows where ``mask`` is False contribute exactly 0, even if they hold NaN, and get norm 0.

Guarantees (flat rule): each clipped sample has L2 norm ``<= C`` up to float rounding (relative
``~1e-7`` in float32), its direction is kept, a sample within ``C`` is unchanged, clipping is
idempotent. Norms and sums are accumulated in float32 or wider whatever the gradients' dtype.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping

import optree
import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp._tree import acc_dtype, batch_size, check_mask, leaves_with_paths, rows, sq_norms, zero_rows
from vmapdp._tree import leaves as _leaves  # (optree.tree_leaves, without optree for a dict of tensors)

__all__ = [
    "grad_norms",
    "clip_factors",
    "clip_per_sample",
    "clip_and_sum",
    "clip_and_sum_per_layer",
    "per_layer_sensitivity",
]

Rule = Literal["clip", "normalize"]
NonFinite = Literal["zero", "raise"]


def grad_norms(grads: Any) -> Tensor:
    """Per-sample L2 norms over all leaves of per-sample gradients ``{name: [B, ...]}`` -> ``[B]``.

    Accumulated in float32 or wider (float64 stays float64), whatever the gradients' dtype.
    A sample with a non-finite entry gets a non-finite norm.
    """
    leaves = _leaves(grads)
    if not leaves:
        raise ValueError("grad_norms(grads): grads has no tensor leaves.")
    _check_floating("grad_norms(grads)", grads)
    # (blocks in float32 or wider, their squares in float64: _tree.sq_norms; no squared copy of the
    # grads; the leaves' squares stacked and added at once, and promote_types, a dispatched op,
    # asked only of dtypes that differ: GPT-2 small's 148 leaves, 296 ops fewer)
    sq = torch.stack([sq_norms(g) for g in leaves]).sum(0) if len(leaves) > 1 else sq_norms(leaves[0])
    out = acc_dtype(leaves[0].dtype)
    for dtype in {acc_dtype(g.dtype) for g in leaves[1:]} - {out}:
        out = torch.promote_types(out, dtype)
    return sq.sqrt().to(out)


def _check_floating(call: str, grads: Any) -> None:
    """Per-sample gradients are floating point: an int or bool leaf is something else (labels?)."""
    for name, leaf in leaves_with_paths(grads):
        if isinstance(leaf, Tensor) and not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"{call}: grads must hold floating-point per-sample gradients, but leaf {name!r} has dtype "
                f"{leaf.dtype}; an integer tensor is not a gradient (labels or indices passed by mistake?). "
                "Pass the output of vmapdp.per_sample_grads (or cast with .float())."
            )


def _check_shapes(call: str, grads: Any, params: Any, b: int) -> None:
    """With ``params`` given: every leaf of ``grads`` is ``[B, *param.shape]`` (catches grads that
    were already summed over the batch, which the leading dims alone cannot always reveal)."""
    if params is None:
        return
    gp, pp = dict(leaves_with_paths(grads)), dict(leaves_with_paths(params))
    if gp.keys() != pp.keys():
        raise ValueError(f"{call}: grads and params have different keys: {sorted(gp.keys() ^ pp.keys())[:10]}. Pass per-sample grads of these params.")
    bad = [(k, tuple(gp[k].shape), (b,) + tuple(pp[k].shape)) for k in gp if tuple(gp[k].shape) != (b,) + tuple(pp[k].shape)]
    if bad:
        k, got, want = bad[0]
        raise ValueError(
            f"{call}: grads[{k!r}] has shape {got}, expected {want} = [B, *params[{k!r}].shape]; per-sample "
            "gradients carry one row per sample in front of the parameter's shape. Did you pass gradients "
            "already summed over the batch? Clipping must come before the sum (vmapdp.per_sample_grads)."
        )


def check_rule(call: str, rule: str, stability: float, nonfinite: str) -> None:
    _checks.choice(call, "rule", rule, ("clip", "normalize"), why="'clip' is flat clipping, 'normalize' automatic clipping")
    _checks.positive(call, "stability", stability, meaning="it is added to the norm by rule='normalize'")
    _checks.choice(call, "nonfinite", nonfinite, ("zero", "raise"), why="a non-finite sample is dropped ('zero') or raises ('raise')")


def clip_factors(norms: Tensor, l2_clip_norm: float | Tensor, *, rule: Rule = "clip", stability: float = 0.01) -> Tensor:
    """The per-sample scale factors ``[B]`` that a rule applies to samples with these ``norms``.

    ``"clip"``: ``min(1, C / norm)``, exactly 1 for a zero norm (and for ``C = inf``).
    ``"normalize"``: ``C / (norm + stability)``.
    """
    check_rule("clip_factors", rule, stability, "zero")
    _checks.clip_norm("clip_factors", "l2_clip_norm", l2_clip_norm)
    if rule == "normalize":
        factors = l2_clip_norm / (norms + stability)
    else:
        factors = torch.where(norms > l2_clip_norm, l2_clip_norm / norms, torch.ones((), dtype=norms.dtype, device=norms.device))
    ok = _checks.clip_norm_ok(l2_clip_norm)
    if ok is not None:
        # a tensor bound the host could not read (traced): if it is NaN, inf or <= 0 the factor is
        # 0, so such a bound releases nothing (never an unclipped, flipped or NaN contribution)
        factors = torch.where(ok.to(factors.device), factors, torch.zeros((), dtype=factors.dtype, device=factors.device))
    return factors


def released_rows(norms: Tensor, mask: Tensor | None, nonfinite: str, call: str) -> Tensor:
    """Which rows are released: finite and (if a mask is given) real."""
    finite = torch.isfinite(norms)
    keep = finite if mask is None else finite & mask
    if nonfinite == "raise":
        bad = ~finite if mask is None else (~finite & mask)
        if bool(bad.any()):
            idx = bad.nonzero().flatten().tolist()
            raise FloatingPointError(
                f"{call}: per-sample gradients of samples {idx[:10]}{'...' if len(idx) > 10 else ''} "
                "are not finite (NaN or inf). Fix the loss for those inputs, or pass nonfinite='zero' "
                "to drop their contribution (counted in the returned norms)."
            )
    return keep


def weighted_sum(grads: Any, weights: Tensor) -> Any:
    """``sum_i weights[i] * grads[i]`` per leaf, accumulated in float32 or wider."""

    def one(g: Tensor) -> Tensor:  # (tensordot's product, without its two permutes: 4 dispatched ops per leaf, not 6)
        dtype = acc_dtype(g.dtype)
        flat = g.to(dtype).reshape(g.shape[0], math.prod(g.shape[1:]))  # (not -1: B may be 0)
        return torch.mm(weights.to(dtype).view(1, g.shape[0]), flat).view(g.shape[1:])

    return optree.tree_map(one, grads, namespace="torch")


def _prepare(call: str, grads: Any, mask: Tensor | None, params: Any = None) -> Tensor | None:
    """Check the grads' dtype, batch dim (and shapes, given params) and the mask; the mask on the grads' device."""
    b = batch_size(grads, call=call, what="grads")
    _check_floating(call, grads)
    _check_shapes(call, grads, params, b)
    if mask is None:
        return None
    check_mask(mask, b, call=call)
    return mask.to(_leaves(grads)[0].device)


def clip_per_sample(
    grads: Any,
    l2_clip_norm: float | Tensor,
    *,
    rule: Rule = "clip",
    stability: float = 0.01,
    nonfinite: NonFinite = "zero",
    params: Any = None,
) -> Any:
    """Scale each sample's gradient so that its total L2 norm is at most ``l2_clip_norm``.

    Args:
        grads: per-sample gradients, every leaf ``[B, ...]``.
        l2_clip_norm: the bound ``C > 0``.
        rule: ``"clip"`` (``min(1, C/norm)``) or ``"normalize"`` (``C/(norm + stability)``).
        nonfinite: ``"zero"`` returns 0 for a sample with NaN/inf; ``"raise"`` raises.
        params: optional, the params the grads are of: every leaf must then be ``[B, *param.shape]``
            (see :func:`clip_and_sum`).

    Returns:
        A pytree like ``grads`` (same keys, shapes, dtypes).

    Guarantees:
        Every row has norm ``<= C`` (float rounding aside) and the direction of its input; with
        ``rule="clip"`` rows already within ``C`` are returned unchanged and clipping twice equals
        clipping once.
    """
    call = "clip_per_sample(grads, l2_clip_norm)"
    check_rule(call, rule, stability, nonfinite)
    _checks.clip_norm(call, "l2_clip_norm", l2_clip_norm)
    _prepare(call, grads, None, params)
    norms = grad_norms(grads)
    keep = released_rows(norms, None, nonfinite, call)
    factors = clip_factors(norms, l2_clip_norm, rule=rule, stability=stability)

    def one(g: Tensor) -> Tensor:
        scaled = (g.to(acc_dtype(g.dtype)) * rows(factors, g)).to(g.dtype)
        return torch.where(rows(keep, g), scaled, torch.zeros((), dtype=g.dtype))

    return optree.tree_map(one, grads, namespace="torch")


def clip_and_sum(
    grads: Any,
    l2_clip_norm: float | Tensor,
    *,
    mask: Tensor | None = None,
    rule: Rule = "clip",
    stability: float = 0.01,
    nonfinite: NonFinite = "zero",
    params: Any = None,
) -> tuple[Any, Tensor]:
    """Clip every sample's gradient to total L2 norm ``l2_clip_norm`` and sum over the batch.

    Args:
        grads: per-sample gradients, every leaf ``[B, ...]``.
        l2_clip_norm: the bound ``C > 0`` on one sample's contribution (the sensitivity of the sum
            under adding or removing one sample). The number ``math.inf`` clips nothing (the
            plain sum, for non-private comparisons: no bound at all); a tensor must be finite.
        mask: optional bool ``[B]``; False rows (padding) contribute exactly 0, even if NaN.
        rule, stability, nonfinite: see the module docstring.
        params: optional, the params the grads are of (a pytree like ``grads`` without the ``B``
            dim). Given, every leaf must be ``[B, *param.shape]``: this catches gradients already
            summed over the batch. Without it only the leading dims can be compared, which catches
            summed grads whose leaves' first dims differ but not those whose first dims happen to
            agree (e.g. ``{"w": [4, 3], "b": [4]}`` is a valid batch of 4 per-sample grads of a
            ``[3]`` weight and a scalar): pass ``params`` where you have them.

    Returns:
        ``(summed, norms)``: ``summed`` like one sample's gradient (leaves without the ``B`` dim,
        in float32 or wider); ``norms`` ``[B]`` the unclipped per-sample norms (0 for masked
        rows, non-finite for samples whose gradient was not finite and so was dropped).

    Example:
        >>> grads = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}
        >>> summed, norms = clip_and_sum(grads, 1.0)
        >>> summed["w"], norms
        (tensor([0.9000, 1.2000]), tensor([5.0000, 0.5000]))
    """
    call = "clip_and_sum(grads, l2_clip_norm)"
    check_rule(call, rule, stability, nonfinite)
    _checks.clip_norm(call, "l2_clip_norm", l2_clip_norm)
    mask = _prepare(call, grads, mask, params)
    norms = grad_norms(grads)
    keep = released_rows(norms, mask, nonfinite, call)
    weights = torch.where(keep, clip_factors(norms, l2_clip_norm, rule=rule, stability=stability), 0.0)
    summed = weighted_sum(zero_rows(grads, keep), weights)
    if mask is not None:
        norms = torch.where(mask, norms, 0.0)
    return summed, norms


def _groups_of(call: str, grads: Mapping[str, Tensor], l2_clip_norms: Any, groups: Mapping[str, str] | None) -> dict[str, list[str]]:
    if not isinstance(grads, Mapping):
        raise TypeError(f"{call}: per-layer clipping needs grads as a dict keyed like params, got {type(grads).__name__}.")
    if groups is None:
        groups = {k: k for k in grads}
    missing = [k for k in grads if k not in groups]
    if missing:
        raise ValueError(
            f"{call}: keys {missing} are in no group, so their gradients would be released unclipped. "
            "Give every key of grads a group in `groups` (key -> group name)."
        )
    unknown = [k for k in groups if k not in grads]
    if unknown:
        raise ValueError(f"{call}: groups names keys {unknown} that are not in grads (keys: {list(grads)}).")
    members: dict[str, list[str]] = {}
    for k in grads:
        members.setdefault(groups[k], []).append(k)
    if not isinstance(l2_clip_norms, Mapping):
        raise TypeError(f"{call}: l2_clip_norms must be a dict group -> threshold, got {type(l2_clip_norms).__name__}.")
    no_thr = [g for g in members if g not in l2_clip_norms]
    if no_thr:
        raise ValueError(f"{call}: groups {no_thr} have no threshold in l2_clip_norms (given for {list(l2_clip_norms)}).")
    extra = [g for g in l2_clip_norms if g not in members]
    if extra:
        raise ValueError(f"{call}: l2_clip_norms names groups {extra} that hold no key of grads.")
    for g in members:
        _checks.clip_norm(call, f"l2_clip_norms[{g!r}]", l2_clip_norms[g])
    return members


def per_layer_sensitivity(l2_clip_norms: Mapping[str, float]) -> float:
    """Total L2 sensitivity of a per-layer clipped sum: ``sqrt(sum over groups of C_g**2)``.

    One sample's clipped contribution has norm ``<= C_g`` in each group, so its total norm is at
    most this. Noise for DP-SGD with per-layer clipping is scaled to it.
    """
    if not l2_clip_norms:
        raise ValueError("per_layer_sensitivity(l2_clip_norms): no thresholds given.")
    return math.sqrt(sum(float(c) ** 2 for c in l2_clip_norms.values()))


def clip_and_sum_per_layer(
    grads: Mapping[str, Tensor],
    l2_clip_norms: Mapping[str, float],
    *,
    groups: Mapping[str, str] | None = None,
    mask: Tensor | None = None,
    nonfinite: NonFinite = "zero",
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per-layer (per-group) clipping: each group of keys is clipped to its own threshold.

    Args:
        grads: per-sample gradients ``{key: [B, ...]}``.
        l2_clip_norms: ``{group: C_g}``. Without ``groups`` every key is its own group, so this is
            ``{key: C_key}``.
        groups: optional ``{key: group}``; every key of ``grads`` must be in a group.
        mask, nonfinite: as in :func:`clip_and_sum`. A sample that is not finite in any group is
            dropped whole.

    Returns:
        ``(summed, norms)`` with ``norms = {group: [B]}`` (unclipped). The sum's sensitivity is
        ``per_layer_sensitivity(l2_clip_norms)``.

    Raises:
        ValueError: a key without a group or a group without a threshold (nothing is silently
        left unclipped).
    """
    call = "clip_and_sum_per_layer(grads, l2_clip_norms)"
    check_rule(call, "clip", 0.01, nonfinite)
    members = _groups_of(call, grads, l2_clip_norms, groups)
    mask = _prepare(call, grads, mask)
    norms = {g: grad_norms({k: grads[k] for k in keys}) for g, keys in members.items()}
    finite = torch.stack([n for n in norms.values()]).isfinite().all(0)
    keep = released_rows(torch.where(finite, 0.0, math.nan), mask, nonfinite, call)
    summed: dict[str, Tensor] = {}
    for g, keys in members.items():
        weights = torch.where(keep, clip_factors(norms[g], l2_clip_norms[g]), 0.0)
        summed.update(weighted_sum(zero_rows({k: grads[k] for k in keys}, keep), weights))
    if mask is not None:
        norms = {g: torch.where(mask, n, 0.0) for g, n in norms.items()}
    return {k: summed[k] for k in grads}, norms
