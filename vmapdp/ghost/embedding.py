"""The embedding rule (``F.embedding``) and its "embedding" use: per-sample norms by token equality.

A sample's grad of an embedding table is ``sum_t e_{tok_t} g_t^T``: grads of equal tokens add up,
found by one flat sort (never a vocabulary-sized tensor per sample); the clipped sum is one
``index_add``. Padding rows get no gradient (their output grads are zeroed); renorming
(``max_norm``) and frequency-scaled embeddings are left to the generic path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vmapdp._tree import acc_dtype
from vmapdp.ghost.uses import Rule, Site, Use, UseKind, arg, rounding_margin

__all__ = ["EMBEDDING", "EMBEDDING_RULE", "embedding_sq_norms", "embedding_bag_as_embedding"]


def embedding_bag_as_embedding(
    fallback: Any, input: Tensor, weight: Tensor, offsets: Tensor | None = None, max_norm: float | None = None, norm_type: float = 2,
    scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False, per_sample_weights: Tensor | None = None,
    include_last_offset: bool = False, padding_idx: int | None = None,
) -> Tensor:
    """``F.embedding_bag`` of bags given as rows of a 2-D input (``nn.EmbeddingBag`` on ``[bags,
    L]``, no offsets) as ``F.embedding``, then each bag's sum (weighted by ``per_sample_weights``),
    mean or max over its entries that are not ``padding_idx`` (an empty bag gives 0): what the tracer
    runs instead of the op (plan.TRACED_THROUGH), so that the table's use is the embedding rule's
    (and no per-sample loop: vmap has no batching rule for ``embedding_bag``). Other calls (offsets,
    ``max_norm``, frequency scaling) run ``fallback``, the op's own body."""
    psw = per_sample_weights
    own = (
        offsets is not None or input.dim() != 2 or input.shape[-1] == 0 or max_norm is not None or scale_grad_by_freq
        or mode not in ("sum", "mean", "max") or (mode == "max" and sparse)
        or (psw is not None and (mode != "sum" or psw.shape != input.shape or psw.dtype != weight.dtype))
        or (padding_idx is not None and not -weight.shape[0] <= padding_idx < weight.shape[0])
    )
    if own:  # (what the op refuses, it refuses itself)
        return fallback(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse, psw, include_last_offset, padding_idx)
    pad = None if padding_idx is None else (padding_idx + weight.shape[0] if padding_idx < 0 else padding_idx)
    rows = torch.nn.functional.embedding(input, weight, pad)  # [bags, L, d]
    keep = torch.ones_like(input, dtype=torch.bool) if pad is None else input != pad
    count = keep.sum(-1, keepdim=True)  # [bags, 1]
    if mode == "max":  # (the op's gradient goes to one entry per bag and dim, the first of tied maxima: gather, not amax)
        masked = rows.masked_fill(~keep[..., None], float("-inf"))
        out = masked.gather(-2, masked.argmax(-2, keepdim=True)).squeeze(-2)
        return torch.where(count > 0, out, torch.zeros((), dtype=out.dtype, device=out.device))
    if psw is not None:
        rows = rows * psw[..., None]
    out = (rows * keep[..., None].to(rows.dtype)).sum(-2)
    return out if mode == "sum" else out / count.clamp(min=1).to(out.dtype)


def parse_embedding(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, tuple] | None:
    """``F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq)`` with a
    matrix weight, no ``max_norm``, no ``scale_grad_by_freq``; ``meta`` = ``(padding_idx,)``, >= 0."""
    w = arg(args, kwargs, 1, "weight")
    if not isinstance(w, Tensor) or w.dim() != 2:
        return None
    if arg(args, kwargs, 3, "max_norm") is not None or arg(args, kwargs, 5, "scale_grad_by_freq", False):
        return None  # renorming / frequency-scaled embeddings: the generic path
    pad = arg(args, kwargs, 2, "padding_idx")
    if pad is not None and pad < 0:
        pad += w.shape[0]
    return arg(args, kwargs, 0, "input"), w, None, (pad,)


def embedding_uses(site: Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, Use]]:
    b = g.shape[0]
    w = params[site.weight]
    (pad,) = site.meta
    tok = x.reshape(b, -1)
    gg = g.reshape(b, -1, g.shape[-1]).to(acc_dtype(g.dtype))
    if pad is not None:
        gg = torch.where((tok == pad).unsqueeze(-1), 0.0, gg)
    return [(site.weight, Use(EMBEDDING, gg, tok, tuple(w.shape), w.shape[0]))]


def embedding_sq_norms(g: Tensor, tok: Tensor, vocab: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``||sum_t e_{tok_t} g_t^T||^2`` per sample, by summing the grads of equal (sample, token)
    pairs, and its margin. One flat sort of ``row * vocab + token`` groups the pairs; sizes stay
    static (at most ``B*T`` groups) for torch.compile, and no tensor is vocab-sized per sample."""
    b, t, d = g.shape
    if t == 0:
        return g.new_zeros(b), g.new_zeros(b)
    srt, perm = (torch.arange(b, device=tok.device).unsqueeze(1) * vocab + tok).flatten().sort()
    first = torch.ones_like(srt, dtype=torch.bool)
    first[1:] = srt[1:] != srt[:-1]
    group = first.cumsum(0) - 1  # the group of each sorted position
    group_of = torch.empty_like(group).scatter_(0, perm, group)  # ... of each position
    sums = g.new_zeros(b * t, d).index_add_(0, group_of, g.reshape(-1, d))
    row_of_group = torch.zeros_like(group).scatter_(0, group, srt // vocab)  # unused groups: row 0, sum 0
    sq = g.new_zeros(b).index_add_(0, row_of_group, torch.linalg.vector_norm(sums, dim=1).square())
    return sq, rounding_margin(t, g.dtype if dtype is None else dtype) * torch.linalg.vector_norm(g, dim=2).sum(1)



def _sq_norms(use: Use, keep_grads: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor, None]:
    return (*embedding_sq_norms(use.to(dtype).u, use.v, use.extra, dtype), None)  # never kept: in the sum's dtype (Use.to)


def _per_sample(use: Use) -> Tensor:
    g, tok = use.u, use.v
    out = g.new_zeros(g.shape[0], use.extra, g.shape[-1])
    return out.scatter_add(1, tok.unsqueeze(-1).expand_as(g), g).reshape((g.shape[0],) + use.shape)


def _weighted(use: Use, uw: Tensor, tok: Tensor) -> Tensor:
    flat = uw.reshape(-1, uw.shape[-1])
    return uw.new_zeros(use.extra, uw.shape[-1]).index_add(0, tok.reshape(-1), flat).reshape(use.shape)


def _weighted_add(total: Tensor, use: Use, uw: Tensor, tok: Tensor) -> None:
    """A later slice's rows added into ``total`` in place (engine._weighted's sliced sum): no
    table-sized temporary per slice."""
    total.view(use.extra, uw.shape[-1]).index_add_(0, tok.reshape(-1), uw.reshape(-1, uw.shape[-1]))


def _mass(use: Use) -> Tensor:
    return torch.linalg.vector_norm(use.u, dim=2).sum(1)  # (a token's one-hot has norm 1)


EMBEDDING = UseKind("embedding", lambda use: use.u.shape[1], _sq_norms, _per_sample, _weighted, _mass, indices=True, weighted_add=_weighted_add)
EMBEDDING_RULE = Rule(parse_embedding, embedding_uses)
