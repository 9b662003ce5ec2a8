"""The vocabulary of ghost clipping's rules: a ``Use`` of a param, its kind's maths, sites and rules,
and the floating-point margin that keeps a sample's released contribution within the clip norm.

A rule (linear.py, conv.py, embedding.py) turns one covered call into ``Use`` s: batched layer
inputs and output grads whose per-sample grad is never formed. The margin functions bound the
rounding between a sample's norm and its share of the clipped sum (two different computations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from vmapdp.ghost import limits

__all__ = ["Use", "UseKind", "Site", "Rule", "rounding_margin", "from_grams", "gram_margin", "gram_cheaper", "slices", "rows_per_slice", "row_slice", "pow2_normalized", "times_pow2", "float64_factors"]


@dataclass
class Use:
    """One covered use of a param, as batched tensors (leading dim B); ``kind`` holds its maths.

    ``PAIR`` (linear.py): per-sample grad ``sum_t u_t v_t^T`` with ``u`` ``[B, T, du]``, ``v``
    ``[B, T, dv]`` (linear weights and biases, conv biases). ``CONV`` (conv.py): ``u`` the output
    grads ``[B, n, C_out, *out]``, ``v`` the padded input ``[B, n, C_in, *in]`` (``n``: a sample's
    own batch dim, usually 1), ``extra = (dims, stride, dilation, groups)``. ``EMBEDDING``
    (embedding.py): ``u`` grads ``[B, T, d]``, ``v`` tokens ``[B, T]``, ``extra`` the vocabulary size.
    ``DIRECT`` (affine.py): ``u`` the per-sample grads themselves ``[B, *shape]`` (small affines).
    The matmul rules (matmul.py) make ``PAIR`` uses.
    """

    kind: "UseKind"
    u: Tensor
    v: Tensor
    shape: tuple[int, ...]  # the param's shape (a view's: see ``index``)
    extra: Any = None
    index: tuple[tuple[int, int], ...] | None = None  # the block of the param it is a use of (views.py); None: all of it

    @property
    def t(self) -> int:
        """Positions per sample (``T``, or ``n * L`` output positions of a conv)."""
        return self.kind.positions(self)

    def rows(self, s: int, e: int) -> "Use":
        """The use restricted to samples ``s:e``."""
        return Use(self.kind, row_slice(self.u, s, e), row_slice(self.v, s, e), self.shape, self.extra, self.index)

    def to(self, dtype: torch.dtype) -> "Use":
        """The use with its floating tensors in ``dtype`` (indices stay as they are). A norm of
        grads that are not kept is formed in the dtype of the clipped sum it bounds, so that it
        rounds within that sum's margin (see engine._sum_dtype)."""
        if self.u.dtype == dtype:
            return self
        return Use(self.kind, self.u.to(dtype), self.v if self.kind.indices else self.v.to(dtype), self.shape, self.extra, self.index)


class UseKind(NamedTuple):
    """The maths of one kind of use, which the engine calls (a rule file defines its kinds)."""

    name: str
    positions: Callable[[Use], int]  # T: the terms of a sample's per-sample grad
    # (use, keep_grads, dtype of the clipped sum) -> (sq, margin, per-sample grads or None)
    sq_norms: Callable[[Use, bool, torch.dtype], tuple[Tensor, Tensor, Tensor | None]]
    per_sample: Callable[[Use], Tensor]  # the per-sample grads [B, *shape]
    weighted: Callable[[Use, Tensor, Tensor], Tensor]  # (use, u * w, v) -> sum_i w_i G_i, without G_i
    mass: Callable[[Use], Tensor]  # sum_t |u_t| |v_t| per sample (see rounding_margin)
    indices: bool = False  # v holds indices (tokens): never cast, zeroed or counted as held
    joinable: bool = True  # a param's uses of this kind join along T into one (see engine.merged)
    bilinear: bool = False  # ``weighted`` is bilinear in (u, v): the weights may scale the smaller of the two
    # (total, use, u, v) -> None, the weights on one side as for ``weighted``: adds its sum into ``total`` (a previous slice's) in
    # place, with no temporary of the param's size; None: ``weighted`` then an add
    weighted_add: Callable[[Tensor, Use, Tensor, Tensor], None] | None = None


class Site(NamedTuple):
    """One call of a covered op whose weight is a trainable param (the probe records them)."""

    op: Callable  # the op, a key of rules.RULES
    weight: str  # param key of the weight
    bias: str | None  # param key of the bias (None: no bias, or a bias that is not a param)
    out_shape: tuple[int, ...]  # per-sample output shape (the tap's)
    out_dtype: torch.dtype
    meta: tuple = ()  # what the rule's parse returned for the call (conv: its geometry)
    views: tuple = (None, None)  # the weight's and the bias's views.View when they are views of their params


class Rule(NamedTuple):
    """How ghost clipping covers one op: a new op is one new rule in one file, listed in rules.RULES."""

    # (args, kwargs) -> (input, weight, bias, meta) when the call is in the standard form the rule
    # handles (the weight a matrix / kernel of the right rank, the bias of the output's last dim),
    # or a list of such alternatives (``x @ W`` or ``W @ x``: the tracer takes the first whose
    # weight is a param), else None: the generic path
    parse: Callable[[tuple, dict], tuple[Any, Any, Any, tuple] | list[tuple[Any, Any, Any, tuple]] | None]
    # (site, saved input, tap grad [B, *out], params) -> the (param key, Use) pairs of the call
    uses: Callable[[Site, Tensor, Tensor, dict[str, Tensor]], list[tuple[str, Use]]]
    # the weight may be a transposed view (views.py): its use is a "pair" (linear.PAIR)
    transposable: bool = False


def arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``name``) of an op call."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def int_tuple(v: Any, d: int) -> tuple[int, ...]:
    """A conv argument as ``d`` ints (ATen repeats a single int, or a 1-element list, per dim)."""
    if isinstance(v, (tuple, list)):
        return tuple(int(u) for u in v) * (d if len(v) == 1 else 1)
    return (int(v),) * d


def rows_per_slice(b: int, per_sample: int) -> int:
    """How many of ``b`` samples fit a slice of ``Limits.slice_elements`` intermediates."""
    return max(1, min(b, limits.LIMITS.slice_elements // max(per_sample, 1)))


def slices(b: int, per_sample: int) -> list[tuple[int, int]]:
    step = rows_per_slice(b, per_sample)
    return [(s, min(s + step, b)) for s in range(0, b, step)]


def row_slice(x: Tensor, s: int, e: int) -> Tensor:
    """``x[s:e]``, or ``x`` itself when that is all of it (a slice is a dispatched op: one per
    param per step saved where one slice holds the whole batch)."""
    return x if s == 0 and e == x.shape[0] else x[s:e]


def cat_rows(xs: Any) -> Tensor:
    return torch.cat(list(xs)) if len(xs) > 1 else xs[0]


def eps_of(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def rounding_margin(t: int, dtype: torch.dtype) -> float:
    """Relative margin for a per-sample gradient ``sum_t u_t v_t^T`` computed twice, differently.

    Ghost clipping computes a sample's norm and its share of the clipped sum by two different
    float computations; each can be off by ``~ T eps sum_t |u_t| |v_t|`` (worst case, when the
    terms cancel). The clip factor uses ``norm + margin * sum_t |u_t||v_t|`` so that the released
    contribution is within ``C`` however the rounding falls (an adversary can make the terms
    cancel); benign samples see a relative change of ``~ T^1.5 eps``, with ``eps`` that of the
    clipped sum's dtype (float64 for sequences, whose float32 margin is only a floor: see
    ``engine._floor``).
    """
    return 2.0 * (t + 2) * eps_of(dtype)


def from_grams(gu: Tensor, gv: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Squared norms ``sum_{t,s} gu_ts gv_ts`` and masses ``sum_t |u_t||v_t|`` (in ``dtype``) of a
    pair from its float64 Grams ``[B, T, T]`` of float32 factors (``|u_t|^2 |v_t|^2`` are their
    diagonals). A float64 model's factors never take this path (see :func:`float64_factors`)."""
    t = gu.shape[1]
    diagonals = gu.flatten(1)[:, :: t + 1] * gv.flatten(1)[:, :: t + 1]  # (a strided slice: inductor lowers it)
    return (gu * gv).sum((1, 2)), diagonals.sqrt().sum(1).to(dtype)


def float64_factors(*xs: Tensor) -> bool:
    """Whether a use's factors are float64 data (a float64 model), whose squares can underflow.

    A Gram norm squares each factor: output grads near 1e-162 square to 0 in float64 while their
    products with inputs near 1e154 are normal numbers, so the Gram norm (and mass) came out 0
    and the sample went out unclipped (1.25 C at C = 1e-6, 31 C at C = 1e-8; with positions of
    different scales 88 C even after scaling each sample by a power of two; found by review).
    Float64 factors therefore take the direct path (per-sample grads: sums of products, whose
    squares underflow only for grads far below any clip norm, ``MIN_CLIP_NORM``), and their
    masses are taken position by position, each factor scaled by a power of two
    (:func:`pow2_normalized`). Float32 factors squared in float64 cannot underflow."""
    return any(x.dtype == torch.float64 for x in xs)


_EXPONENT_LIMIT = 1000  # |e| of the powers of two below: 2**e is a normal float64


def _pow2(e: Tensor) -> Tensor:
    """``2.0**e`` exactly, float64, for int64 ``e`` within +-1022 (built from its bits)."""
    return ((e + 1023) << 52).view(torch.float64)


def pow2_normalized(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` (float64) times ``2**-e`` per row (its last dim), with ``e`` (int64, ``x.shape[:-1]``)
    the exponent that brings the row's largest ``|entry|`` into ``[0.5, 1)`` (clamped to +-1000: a
    row of zeros or subnormals is scaled up by ``2**1000``, one with inf or NaN stays
    non-finite), and ``e``. Exact: a power of two."""
    amax = x.detach().abs().amax(-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    e = (((amax.view(torch.int64) >> 52) & 0x7FF) - 1022).clamp(-_EXPONENT_LIMIT, _EXPONENT_LIMIT)
    return x * _pow2(-e).unsqueeze(-1), e


def times_pow2(x: Tensor, e: Tensor) -> Tensor:
    """``x * 2**e`` elementwise (``x`` float64, ``e`` int64 of its shape, ``|e| <= 2000``: a sum of
    two exponents of :func:`pow2_normalized`), exact wherever the result is a normal number:
    applied in two halves of one sign, each a normal power of two, so the partial product does
    not overflow or underflow before the result would."""
    half = torch.div(e, 2, rounding_mode="trunc")
    return x * _pow2(half) * _pow2(e - half)


def gram_margin(sq: Tensor, mass: Tensor, t: int, du: int, dv: int, dtype: torch.dtype) -> Tensor:
    """The margin of a norm from float64 Grams of ``T`` positions: the clipped sum's rounding (see
    :func:`~vmapdp.ghost.uses.rounding_margin`) plus the Gram sum's own, within ``gamma * mass^2`` of the true squared norm."""
    gamma = (du + dv + t * t + 2) * eps_of(torch.float64)
    m = mass.double()
    root = sq.clamp_min(0.0).sqrt()
    return rounding_margin(t, dtype) * mass + ((sq.clamp_min(0.0) + gamma * m * m).sqrt() - root)


def gram_cheaper(t: int, du: int, dv: int) -> bool:
    """Ghost norms (two ``T x T`` Grams) cost less than the direct ``du x dv`` outer product."""
    return t * (du + dv) < du * dv

