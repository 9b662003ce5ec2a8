"""Ghost clipping's engine: ``ghost_norms_and_sum``, per-sample norms and the clipped sum from one
forward and one backward, with the book-keeping that decides what is kept, freed and summed how.

The forward runs under the tracer (plan.py), which keeps each site's input and taps its output;
one ``vjp`` gives the output grads; the rules (rules.py) turn them into uses, whose kinds give the
norms and the weighted sum. This file owns the guarantees that span layers: the float64 sums where
terms can cancel (``_sum_dtype``), the margin that keeps each contribution within the clip norm,
and the keep budget (``Limits``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor
from torch.func import vjp, vmap

from vmapdp._checks import loss_is_differentiated
from vmapdp._tree import acc_dtype, batch_size, check_mask, rows, sq_norms, zero_rows
from vmapdp._tree import leaves as _leaves
from vmapdp.clipping import weighted_sum
from vmapdp.ghost import limits
from vmapdp.ghost.cross import crossed_sq_norms
from vmapdp.ghost.plan import CONTROL_FLOW, Plan, Run, probe, run_loss
from vmapdp.ghost.rules import RULES
from vmapdp.ghost.linear import PAIR
from vmapdp.ghost.uses import Use, cat_rows, rounding_margin, row_slice, slices
from vmapdp.ghost.views import Shaped, disjoint, pad_to, place

__all__ = ["ghost_norms_and_sum"]


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the book-keeping sum of one param is accumulated in (see :func:`_weighted`).

    One matmul (conv backward, index_add) adds the ``T`` terms ``w_i u_it v_it^T`` of *every*
    sample ``i``; its rounding is ``<= gamma_N sum_i w_i M_i`` (``N = B T`` terms, ``M_i = sum_t
    |u_it| |v_it|`` the mass). The margin only bounds ``w_i M_i`` by ``C / (2 (T + 2) eps)``: a
    sample whose terms cancel (huge mass, small norm) is clipped within its own rounding, yet in
    float32 it quantises the *other* samples' partial sums (measured: the neighbour difference
    reached 1.016 C). Accumulated in float64 that cross-talk is ``<= gamma64_N * B * C / (2 T
    eps32) ~ B**2 * 2**-30 * C`` (1.5e-5 C at B = 128).

    One-term uses (an MLP's layers) are summed in float64 too. In float32 their weighted side
    ``fl(w x)`` underflows when ``x`` is subnormal, with an absolute error of up to 2**-150 that
    no relative margin covers; times an output grad near float32's max, a crafted sample was
    released at 1.00142 C at C = 1e-3 (found by review). In float64 the product stays normal.
    The same holds for a tied table and LM head with one position each, whose grads cancel each
    other (1.00086 C in float32). Measured cost (CPU, eager, 2026-11-25): an MLP's ghost clipped
    sum (784-1024-1024-10, B=256) went from 15.2 to 23.7 ms (the non-private step: 9 ms);
    models with sequences or convs were float64 already. An absolute margin for the underflow
    (``2**-150 sqrt(d) |other side|`` per sample, negligible for real data) would let one-term
    uses stay float32; it is not built."""
    if dtype != torch.float32:
        return dtype  # float64 stays float64
    return torch.float64


def _weighted(use: Use, w: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``sum_i w_i G_i`` of one use, with ``G_i`` never formed (book-keeping), accumulated in
    ``dtype`` (see :func:`_sum_dtype`).

    Rows where ``keep`` is False (not None) are zeroed first: they may hold NaN, and ``0 * NaN``
    is NaN. A bilinear use's weights scale the smaller of its two sides.

    The copies this makes (the sides cast to ``dtype`` and scaled) hold at most
    ``Limits.slice_elements`` elements (or one sample's, where that is more): a larger use is summed a slice of the batch at a time into
    one total (an LM head's output grads ``[B, T, vocab]``: their float64 copy was the peak of a
    GPT-2 step, 1.6 GB at batch 32 x 128). The same terms are added in ``dtype``, in another order:
    the rounding bound of :func:`_sum_dtype` holds for any order.
    """
    b = use.u.shape[0]
    per_sample = math.prod(use.u.shape[1:]) + (0 if use.kind.indices else math.prod(use.v.shape[1:]))
    spans = slices(b, per_sample)
    if len(spans) <= 1:  # (none for an empty batch)
        return _weighted_rows(use, w, keep, dtype)
    parts = [(use.rows(s, e), row_slice(w, s, e), None if keep is None else row_slice(keep, s, e)) for s, e in spans]
    total = _weighted_rows(*parts[0], dtype)  # (a fresh tensor: the later slices are added into it)
    add = use.kind.weighted_add or (lambda total, *sides: total.add_(use.kind.weighted(*sides)))
    for part in parts[1:]:
        add(total, *_weighted_sides(*part, dtype))
    return total


def _weighted_rows(use: Use, w: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    return use.kind.weighted(*_weighted_sides(use, w, keep, dtype))


def _weighted_sides(use: Use, w: Tensor, keep: Tensor | None, dtype: torch.dtype) -> tuple[Use, Tensor, Tensor]:
    """``(use, u, v)`` for ``UseKind.weighted``: both sides in ``dtype``, rows not kept zeroed, the
    weights on the smaller side of a bilinear use (else on ``u``)."""
    scale_v = use.kind.bilinear and use.v.numel() < use.u.numel()  # (an LM head's inputs are 65x smaller than its output grads)
    u = _prepared(use.u, keep, dtype, None if scale_v else w)
    v = use.v if use.kind.indices else _prepared(use.v, keep, dtype, w if scale_v else None)
    return use, u, v


def _prepared(x: Tensor, keep: Tensor | None, dtype: torch.dtype, w: Tensor | None) -> Tensor:
    """``x`` in ``dtype``, rows where ``keep`` is False zeroed, times the weights ``w`` per row
    (None: unscaled), with one copy where the cast made one (the rest in place on it)."""
    fresh = x.dtype != dtype
    x = x.to(dtype)
    if keep is not None:
        x = x.masked_fill_(~rows(keep, x), 0.0) if fresh else torch.where(rows(keep, x), x, 0.0)
        fresh = True
    if w is not None:
        x = x.mul_(rows(w.to(dtype), x)) if fresh else x * rows(w.to(dtype), x)
    return x


def _use_margin(use: Use, dtype: torch.dtype) -> Tensor:
    return rounding_margin(use.t, dtype) * use.kind.mass(use)


def _floor(uses: list[Use], dtype: torch.dtype, formed: bool) -> Tensor | None:
    """The least safe norm (float64) of one param (or block) whose clipped sum is accumulated in
    ``dtype``, or None: none beyond its norm plus its margin (see :func:`_bounds`).

    A float64 book-keeping sum of float32 uses (``_sum_dtype``) rounds a sample's own share by
    ``~ T eps64 mass`` only: its margin is that small, so that long sequences are clipped
    accurately. What that sum needs beyond it is a bound on each sample's *mass* (the cross-talk of
    ``_sum_dtype``: ``w_i M_i <= C / (2 (T + 2) eps32)``), so the bound is at least
    ``2 (T + 2) eps32 M_i`` (the float32 margin): for benign samples (mass ~ sqrt(T) norm) far
    below the norm, for a sample whose huge terms cancel the same clip as a float32 margin gives.
    A float64 model's sums are float64 too, with no wider type to take the cross-talk: the same
    floor bounds it the same way (without it a float64 kernel used twice, its uses cancelling,
    reached ``w M ~ C / (6 eps64)`` and moved the sum by 1.057 C; found by review).
    ``formed``: the sum will use the per-sample grads themselves (no book-keeping)."""
    if formed or dtype != torch.float64 or not uses:
        return None
    return sum(_use_margin(u, torch.float32).double() for u in uses)


def _bounds(parts: list[tuple[Tensor, Tensor, Tensor | None]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The squared norms ``[B]`` (in ``dtype``) and the safe upper bounds of the norms (float64) of
    the params (or blocks) whose ``(squared norms, margins of their clipped sums, floors of
    :func:`_floor`)`` are ``parts``: each one's safe norm is ``max(sqrt(sq) + margin, floor)``, the
    whole's the root of their squares. Stacked, the params with a floor apart from the others: a
    handful of ops per step instead of ten per param (GPT-2 small has 148)."""
    sq_all, safe_sq = None, None
    for group in ([p for p in parts if p[2] is None], [p for p in parts if p[2] is not None]):
        if not group:
            continue
        # (stack promotes: float32 parts are widened exactly; a float64 Gram sum can round below 0)
        sq = torch.stack([p[0] for p in group]).double().to(dtype).clamp_min(0.0)
        safe = sq.double().sqrt() + torch.stack([p[1] for p in group]).double()
        if group[0][2] is not None:
            safe = torch.maximum(safe, torch.stack([p[2] for p in group]).double())
        sq, safe = sq.sum(0), safe.square().sum(0)
        sq_all = sq if sq_all is None else sq_all + sq
        safe_sq = safe if safe_sq is None else safe_sq + safe
    return sq_all, safe_sq.sqrt()


def _merged(uses: list[Use], joined: list[tuple[list[Tensor], Tensor]]) -> list[Use]:
    """A param's uses of the same kind joined into one (an RNN cell's weight is used once per time
    step; a tied LM head twice): ``"pair"`` and ``"embedding"`` uses concatenate along T, so that
    the norm and the clipped sum each take one call, not one per use; uses of other kinds stay as
    they are (their cross terms: cross.py). ``joined`` caches the concatenations by the identity of
    their parts: params whose uses share tensors (a cell's input and hidden weights share the gate
    grads, a weight and its bias the output grads) share one copy."""
    if len(uses) < 2:
        return uses

    def cat(parts: list[Tensor]) -> Tensor:
        # (by identity, not id(): torch 2.11's dynamo cannot take the id() of a tensor made in the graph; 2.13's can)
        for known, together in joined:
            if len(known) == len(parts) and all(a is b for a, b in zip(known, parts)):
                return together
        joined.append((parts, torch.cat(parts, 1)))
        return joined[-1][1]

    by_kind: dict[Any, list[Use]] = {}
    for u in uses:  # (the same kind and shape: one param's box used as a [4, 2] and a [2, 4] weight does not join)
        by_kind.setdefault((u.kind, u.shape), []).append(u)
    out = []
    for (kind, _), group in by_kind.items():
        if len(group) < 2 or not kind.joinable:
            out.extend(group)
            continue
        first = group[0]
        out.append(Use(kind, cat([u.u for u in group]), cat([u.v for u in group]), first.shape, first.extra, first.index))
    return out


def _blocks(uses: list[Use]) -> dict[Any, list[Use]]:
    """A param's uses by the block of it they use (views.py; None: the whole param)."""
    out: dict[Any, list[Use]] = {}
    for u in uses:
        out.setdefault(u.index, []).append(u)
    return out


def _merge_all(uses: dict[str, list[Use]]) -> dict[str, list[Use]]:
    joined: list = []
    return {key: [m for block in _blocks(u).values() for m in _merged(block, joined)] for key, u in uses.items()}


def _disjoint_blocks(uses: list[Use], other: bool) -> bool:
    """The uses are of two or more pairwise disjoint blocks of the param (and it has no other uses):
    their norms add in squares, each block's computed on its own."""
    blocks = list(_blocks(uses))
    return not other and len(blocks) > 1 and all(disjoint(a, b) for i, a in enumerate(blocks) for b in blocks[i + 1 :])


def _held(uses: list[Use]) -> int:
    """Elements of the output grads and inputs the uses hold (tokens not counted)."""
    return sum(u.u.numel() + (0 if u.kind.indices else u.v.numel()) for u in uses)


def _sq_norms(uses: list[Use], other: Tensor | None, keep_grads: bool, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """Squared per-sample norms of one param's (of ``shape``) gradient (the sum of all its uses, see
    :func:`_merged`; uses of blocks are placed in the param), the margin of the norm for a clipped
    sum in ``dtype`` (see :func:`~vmapdp.ghost.uses.rounding_margin`), and the per-sample grads when
    they had to be formed and ``keep_grads`` allows keeping them (then the sum uses the same
    numbers and the margin is 0)."""
    if other is None and len(uses) == 1:
        sq, margin, per = uses[0].kind.sq_norms(uses[0], keep_grads, dtype)
        return sq, margin, None if per is None else pad_to(per, uses[0].index, shape, 1)
    if keep_grads:
        total = _joint_grads(uses, other, shape, None)
        sq = sq_norms(total)
        return sq, torch.zeros_like(sq), total
    # not kept: from self and cross terms where every pair of kinds has a cross rule (a tied
    # embedding and LM head: cross.py), with no per-sample grads at all
    crossed = crossed_sq_norms(uses, shape, dtype) if other is None else None
    if crossed is not None:
        return (*crossed, None)
    # else formed: the sum will be book-keeping in ``dtype``, so the norm is formed in ``dtype``
    # too (rounding like that sum: Use.to), a slice of samples at a time
    b = uses[0].u.shape[0] if uses else other.shape[0]  # (no covered use: the per-sample view's grads alone)
    sqs = []
    for s, e in slices(b, 2 * math.prod(shape)):
        part = _joint_grads([u.rows(s, e) for u in uses], None if other is None else row_slice(other, s, e), shape, dtype)
        sqs.append(sq_norms(part))
    sq = cat_rows(sqs)
    margin = torch.zeros_like(sq)
    for u in uses:  # the other uses' per-sample grads are summed as they are: no margin for them
        margin = margin + _use_margin(u, dtype).to(sq.dtype)
    return sq, margin, None


def _joint_grads(uses: list[Use], other: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype | None) -> Tensor:
    """The per-sample grads of one param: its uses' (placed in it) plus ``other`` (per-sample-view
    grads), formed in ``dtype`` (None: the uses' own)."""
    total = None if other is None else other.to(acc_dtype(other.dtype) if dtype is None else dtype)
    for u in uses:
        if dtype is not None:
            u = u.to(dtype)
        p = pad_to(u.kind.per_sample(u), u.index, shape, 1)
        total = p if total is None else total + p
    return total


def ghost_norms_and_sum(
    loss_fn: Callable[..., Tensor],
    params: dict[str, Tensor],
    shared: tuple,
    batch: Any,
    mask: Tensor | None,
    weights_fn: Callable[[Tensor], Tensor] | None,
    *,
    randomness: str = "error",
    plan: Plan | None = None,
    call: str = "ghost clipping",
    sink: Callable[[str, Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor] | None, Tensor]:
    """Per-sample norms ``[B]`` and ``sum_i w_i g_i`` from one forward and one backward.

    ``weights_fn(norms)`` returns the per-sample clip factors (rows that must not contribute get
    weight 0 here); with ``weights_fn=None`` only the norms are computed. Returns
    ``(norms, summed or None, losses)``; masked rows get norm 0 and loss 0. ``sink(name, sum)``,
    if given, takes each param's sum as soon as it is formed, and its result is kept instead (the
    sharded step reduce-scatters it, so that the full sums never exist all at once).

    Stages: the tapped forward and one backward (``_tapped_uses``), the norms and their safe
    bounds (``_norms``), the book-keeping sum (``_clipped_sum``).
    """
    if not isinstance(params, dict):
        raise TypeError(f"{call}: params must be a dict of tensors keyed like named_parameters(), got {type(params).__name__}.")
    b = batch_size(batch, call=call)
    if mask is not None:
        check_mask(mask, b, call=call)
    params = {k: v.detach() for k, v in params.items()}
    if plan is None:
        plan = probe(loss_fn, params, shared, batch, randomness)
    device = next(iter(params.values())).device
    real = torch.ones(b, dtype=torch.bool, device=device) if mask is None else mask.to(device)
    losses, uses, other_grads = _tapped_uses(loss_fn, params, shared, batch, real, plan, randomness, call)
    norms, safe, kept = _norms(params, uses, other_grads, real, keep_budget=weights_fn is not None)
    losses = torch.where(real, losses, 0.0)
    if weights_fn is None:
        return norms, None, losses
    keep = real & torch.isfinite(norms)
    w = torch.where(keep, weights_fn(safe), 0.0)
    # rows that must not contribute may hold NaN; zero them unless every row is kept (eager check)
    zero = None if (not torch.compiler.is_compiling() and bool(keep.all())) else keep
    return norms, _clipped_sum(params, uses, other_grads, kept, w, zero, sink), losses


def _per_sample_copies(p: Tensor, b: int) -> Tensor:
    """``b`` copies of ``p`` (``[b, *p.shape]``), each laid out in memory as ``p`` is (its strides).

    Copies, not a stride-0 ``expand``: an op that reads memory layout (``as_strided``) on a view
    shared by the batch has a backward that gives every sample the batch's mean gradient, so each
    sample's norm and clipped share came from the others' data (found by review: a Toeplitz weight
    made with ``as_strided``, 6.4 C between neighbouring sums). The memory of the per-sample grads
    these params get anyway."""
    order = sorted(range(p.dim()), key=lambda d: -p.stride(d))  # p's dims, outermost in memory first
    q = p.permute(order)  # contiguous where p is dense (a transposed weight, say); else copies are contiguous
    copies = q.unsqueeze(0).expand((b,) + tuple(q.shape)).contiguous()  # (out of place: p may be a transform's wrapper)
    return copies.permute([0] + [1 + order.index(d) for d in range(p.dim())])


def _tapped_uses(
    loss_fn: Callable[..., Tensor], params: dict[str, Tensor], shared: tuple, batch: Any, real: Tensor, plan: Plan, randomness: str, call: str
) -> tuple[Tensor, dict[str, list[Use]], dict[str, Tensor]]:
    """The losses ``[B]``, the covered uses of each param (from the sites' inputs and output grads)
    and the per-sample grads of the uses no rule covers: one tapped forward, one backward of the
    real rows' summed loss. The forward's saved tensors are freed on return."""
    b = real.shape[0]
    # zero taps as broadcast views of one zero: no memory, no fill; their grads come back dense
    zero = torch.zeros((), dtype=acc_dtype(next(iter(params.values())).dtype), device=real.device)
    taps = [zero.to(s.out_dtype).expand((b,) + s.out_shape) for s in plan.sites]
    expanded = {k: _per_sample_copies(params[k], b) for k in plan.other}

    def fwd(taps, expanded, sample):
        run = Run(params, plan, taps, expanded)
        if not run.compiling:  # (the sites' inputs are checked against the probe's: see Plan.batched)
            run.level = torch._C._functorch.maybe_get_level(_leaves(sample)[0])
        loss = run_loss(run, loss_fn, params, shared, sample)
        loss_is_differentiated(call, loss)
        if run.n != len(plan.sites) or run.n_cand != len(plan.candidates) or run.n_view != len(plan.views):
            raise RuntimeError(f"{call}: {CONTROL_FLOW}")
        if any(t._version != v for t, v in run.versions):
            raise RuntimeError(
                f"{call}: the model wrote in place into the input of a covered layer (linear, conv, embedding, "
                "matmul, norm affine) after the layer read it; ghost clipping needs that input unchanged. Write out of place "
                "(y = x * 3 instead of x.mul_(3)), or use method='vmap'."
            )
        return loss, run.saved

    def mapped(taps, expanded):
        return vmap(fwd, in_dims=(0, 0, 0), randomness=randomness)(taps, expanded, batch)

    losses, backward, saved = vjp(mapped, taps, expanded, has_aux=True)
    if losses.shape != (b,):
        raise ValueError(f"{call}: loss_fn must return a scalar for one sample; it returned shape {tuple(losses.shape[1:])} per sample.")
    tap_grads, other_grads = backward(real.to(losses.dtype))
    del backward  # frees the forward's saved tensors before the norms are computed

    uses: dict[str, list[Use]] = {}
    for site, x, g in zip(plan.sites, saved, tap_grads):
        wv, bv = site.views
        shaped = params if wv is None and bv is None else {**params, **{k: Shaped(v.shape) for k, v in ((site.weight, wv), (site.bias, bv)) if v is not None}}
        for key, use in RULES[site.op].uses(site, x, g, shaped):
            view = wv if key == site.weight else bv if key == site.bias else None
            uses.setdefault(key, []).append(use if view is None else place(use, view, PAIR))
    del saved, tap_grads  # from here on only `uses` holds layer inputs and output grads
    return losses, _merge_all(uses), other_grads  # (the per-use tensors that were joined are freed here, unless shared)


def _norms(
    params: dict[str, Tensor], uses: dict[str, list[Use]], other_grads: dict[str, Tensor], real: Tensor, *, keep_budget: bool
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-sample norms (inf where the safe bound is not finite, 0 on masked rows), their safe
    upper bounds (the norm plus the rounding margin of each use) and the per-sample grads that were
    formed and kept (``keep_budget``: within ``Limits``); the uses of a kept param are dropped
    from ``uses`` (the clipped sum takes them from its per-sample grads)."""
    b, device = real.shape[0], real.device
    kept: dict[str, Tensor] = {}  # per-sample grads that were formed anyway, kept within a budget
    parts: list[tuple[Tensor, Tensor, Tensor | None]] = []  # per param (or disjoint block): see _bounds
    budget = limits.LIMITS.keep_elements if keep_budget else 0
    for key in params:
        if key in uses or key in other_grads:
            size = b * params[key].numel()
            # per-sample grads that get formed are kept while they fit the budget, or when they are
            # no larger than the output grads and inputs of their uses: those are then released,
            # which frees their memory unless other params' uses share them (a bias shares the
            # output grads, sibling layers an input); so keeping adds at most that much
            wide = _sum_dtype(acc_dtype(params[key].dtype))
            if _disjoint_blocks(uses.get(key, []), key in other_grads):  # (views.py) each block like a param of its own
                for block in _blocks(uses[key]).values():
                    sq_b, margin_b, _ = _sq_norms(block, None, False, tuple(params[key].shape), wide)
                    parts.append((sq_b, margin_b, _floor(block, wide, False)))
                continue
            keep = keep_budget and (size <= budget or size <= limits.LIMITS.keep_ratio * _held(uses.get(key, [])))
            sq_k, margin_k, per = _sq_norms(uses.get(key, []), other_grads.get(key), keep, tuple(params[key].shape), wide)
            if per is not None:
                kept[key] = per
                if size <= budget:
                    budget -= size
                uses.pop(key, None)  # the clipped sum will come from `per`: free its inputs and output grads
            parts.append((sq_k, margin_k, _floor(uses.get(key, []), wide, per is not None)))
    dtype = acc_dtype(next(iter(params.values())).dtype)
    sq, safe = _bounds(parts, dtype) if parts else (torch.zeros(b, dtype=dtype, device=device), torch.zeros(b, dtype=torch.float64, device=device))
    norms = torch.where(real, sq.sqrt(), 0.0)
    # the clip factor uses an upper bound on the norm that covers the rounding of the two
    # computations (norm, and clipped sum) ghost clipping does for a sample: see rounding_margin
    safe = torch.where(real, safe, 0.0)
    # a bound that is not finite (extreme values) must not turn into a factor of 1 or NaN: such a
    # sample is dropped like a non-finite one, and its norm reported as inf so that it is counted
    norms = torch.where(torch.isfinite(safe), norms, torch.inf)
    return norms, safe.to(norms.dtype), kept


def _clipped_sum(
    params: dict[str, Tensor],
    uses: dict[str, list[Use]],
    other_grads: dict[str, Tensor],
    kept: dict[str, Tensor],
    w: Tensor,
    zero: Tensor | None,
    sink: Callable[[str, Tensor], Tensor] | None,
) -> dict[str, Tensor]:
    """``sum_i w_i g_i`` per param: the per-sample grads at hand by ``clip_and_sum``'s weighted sum,
    the covered uses by book-keeping (``_weighted``, in ``_sum_dtype``), each given to ``sink`` as
    soon as it is formed (None: kept as it is). Rows where ``zero`` is False (not None) are zeroed
    first."""
    sink = (lambda key, value: value) if sink is None else sink  # noqa: E731
    # per-sample grads at hand (kept, or of uses no rule covers): clip_and_sum's weighted sum
    # (each w_i g_i of these has norm <= C: summed in float32 their rounding is clip_and_sum's)
    per_sample = {k: kept[k] if k in kept else other_grads[k] for k in params if k in kept or (k in other_grads and k not in uses)}
    at_hand = weighted_sum(per_sample if zero is None else zero_rows(per_sample, zero), w)
    summed: dict[str, Tensor] = {}
    for key, p in params.items():  # (in the params' order, whatever was kept: the sharded step's sink is a collective)
        if key in at_hand:  # kept (every use of it is in its per-sample grads), or other uses only
            summed[key] = sink(key, at_hand.pop(key))
            continue
        dtype = acc_dtype(p.dtype)
        wide = _sum_dtype(dtype)
        parts = []
        if key in other_grads:
            other = {key: other_grads[key]} if zero is None else zero_rows({key: other_grads[key]}, zero)
            parts.append(weighted_sum({key: other[key].to(wide)}, w)[key])
        for use in uses.get(key, []):
            parts.append(pad_to(_weighted(use, w, zero, wide), use.index, tuple(p.shape)))
        if not parts:  # a param the loss does not use
            parts.append(torch.zeros(p.shape, dtype=wide, device=w.device))
        total = parts[0].to(wide)  # (added in place: a vocabulary-sized float64 temporary costs its page faults once)
        for part in parts[1:]:  # (each part is a fresh tensor of the param's shape)
            total.add_(part)
        summed[key] = sink(key, total.to(dtype))
        del parts, total
    return summed
