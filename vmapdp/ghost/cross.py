"""Cross terms between uses of different kinds of one param: the norm of their sum, no per-sample grads.

A param used by two different ops (GPT-2 ties its token embedding to its LM head: one
``F.embedding`` use and one ``F.linear`` use of the same ``[V, d]`` matrix) has the per-sample grad
``G = G_a + G_b``, whose squared norm is ``||G_a||^2 + ||G_b||^2 + 2 <G_a, G_b>``. Each kind gives
its own term (its ``sq_norms``); a rule here gives the cross term ``<G_a, G_b>`` from the uses'
tensors. Without a rule for a pair of kinds the engine forms the per-sample grads ``[B, *shape]`` (a
slice of samples at a time), which for GPT-2 small is 38.6M float64 numbers per sample.

The embedding-pair rule: ``G_emb = sum_t e_{tok_t} g_t^T`` and ``G_pair = sum_s u_s v_s^T``, so
``<G_emb, G_pair> = sum_{t,s} u_s[tok_t] (g_t . v_s)``: one gather of ``u`` at the sample's tokens
and one ``[S, d] x [d, T]`` product per sample, in float64.

Rounding. Each cross term is computed in float64 with an error of at most
``gamma * M_a * M_b`` (``M`` a use's mass ``sum_t |u_t||v_t|``; ``gamma = 2 (d + T S + 2) eps64``:
a length-``d`` dot product, a product, a sum of ``T S`` terms, doubled for the masses' own
rounding). Each self term comes with its kind's margin ``m`` (a bound on its norm's error plus its
clipped-sum share's rounding). The norm's safe bound is then
``sqrt(sum_a (|G_a| + m_a)^2 + 2 sum_{a<b} (c_ab + e_ab)) + sum_a m_a``, an upper bound on the true
norm plus the rounding of the released sum whatever the signs (an adversary can make the cross
term cancel the self terms).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from vmapdp.ghost.uses import Use, cat_rows, eps_of, slices

__all__ = ["CROSS", "crossed_sq_norms"]


def _embedding_pair(emb: Use, pair: Use) -> tuple[Tensor, float] | None:
    """``<G_emb, G_pair>`` per sample and its relative rounding bound ``gamma``, or None when the
    pair's grad is not laid out like the table (``u`` over the vocabulary, ``v`` over the embedding dim)."""
    g, tok = emb.u, emb.v  # [B, T, d], [B, T]
    u, v = pair.u, pair.v  # [B, S, V], [B, S, d]
    b, t, d = g.shape
    s = u.shape[1]
    if u.shape[2] != emb.extra or v.shape[2] != d:
        return None
    crosses = []
    for lo, hi in slices(b, 3 * s * t + 2 * (s + t) * d):
        at_tokens = torch.gather(u[lo:hi], 2, tok[lo:hi].unsqueeze(1).expand(-1, s, -1)).double()  # u_s[tok_t]: [b, S, T]
        crosses.append((at_tokens * torch.bmm(v[lo:hi].double(), g[lo:hi].double().transpose(1, 2))).sum((1, 2)))
    # a length-d dot product, a product, a sum of T S terms; doubled for the masses' own rounding
    return cat_rows(crosses), 2.0 * (d + t * s + 2) * eps_of(torch.float64)


# (kind name, kind name) -> (use of the first kind, use of the second) -> (cross term [B], gamma) or
# None; |computed - true| <= gamma M_a M_b, with M a use's mass (its kind's ``mass``)
CROSS: dict[tuple[str, str], Callable[[Use, Use], tuple[Tensor, float] | None]] = {
    ("embedding", "pair"): _embedding_pair,
}


def _cross(a: Use, b: Use) -> tuple[Tensor, Tensor] | None:
    """The cross term of two uses and its rounding bound, or None without a rule for their kinds
    (or when the rule finds the uses laid out otherwise)."""
    for x, y in ((a, b), (b, a)):
        rule = CROSS.get((x.kind.name, y.kind.name))
        found = None if rule is None else rule(x, y)
        if found is not None:
            c, gamma = found
            return c, gamma * a.kind.mass(a).double() * b.kind.mass(b).double()
    return None


def crossed_sq_norms(uses: list[Use], shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """The squared per-sample norms of the sum of ``uses`` (of a param of ``shape``, each of all of
    it) and their margin for a clipped sum in ``dtype``, from self and cross terms; None when some
    pair of uses has no cross rule (the engine then forms the per-sample grads)."""
    if len(uses) < 2 or any(u.index is not None or tuple(u.shape) != tuple(shape) for u in uses):
        return None
    pairs = [(a, b) for i, a in enumerate(uses) for b in uses[i + 1 :]]
    if any((a.kind.name, b.kind.name) not in CROSS and (b.kind.name, a.kind.name) not in CROSS for a, b in pairs):
        return None  # (before any cross term is computed)
    crosses = []
    for a, b in pairs:
        c = _cross(a, b)
        if c is None:
            return None
        crosses.append(c)
    sq = upper = spare = None
    for use in uses:
        sq_a, m_a, _ = use.kind.sq_norms(use, False, dtype)
        sq_a, m_a = sq_a.double().clamp_min(0.0), m_a.double()
        sq = sq_a if sq is None else sq + sq_a
        up = (sq_a.sqrt() + m_a).square()
        upper = up if upper is None else upper + up
        spare = m_a if spare is None else spare + m_a
    for c, e in crosses:
        sq = sq + 2.0 * c
        upper = upper + 2.0 * (c + e)
    margin = upper.clamp_min(0.0).sqrt() - sq.clamp_min(0.0).sqrt() + spare
    return sq, margin.clamp_min(0.0)
