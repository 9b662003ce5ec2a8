"""Cross terms between uses of different kinds of one param (vmapdp/ghost/cross.py): a token
embedding tied to the LM head's weight gets its per-sample norms from self and cross terms, never
from per-sample grads, with a margin that holds when the cross term cancels the self terms."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vmapdp
from vmapdp.ghost import engine, limits
from vmapdp.ghost.cross import crossed_sq_norms
from vmapdp.ghost.embedding import EMBEDDING
from vmapdp.ghost.linear import PAIR
from vmapdp.ghost.uses import Use


class TiedLM(nn.Module):
    """An embedding whose table is also the LM head's weight (GPT-2's tie), used ``heads`` times."""

    def __init__(self, vocab=11, d=5, heads=1):
        super().__init__()
        self.emb, self.mix, self.heads = nn.Embedding(vocab, d, padding_idx=0), nn.Linear(d, d), heads

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.emb(tokens)))
        return sum(F.linear(h * (k + 1), self.emb.weight) for k in range(self.heads))


@pytest.fixture
def never_formed(monkeypatch):
    """Nothing is kept (what a vocabulary-sized table gets), and forming per-sample grads fails."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0))

    def formed(*args, **kwargs):
        raise AssertionError("the tied table's per-sample grads were formed")

    monkeypatch.setattr(engine, "_joint_grads", formed)


def _lm(dtype, heads, b=6, t=9, vocab=11):
    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(TiedLM(vocab, heads=heads).to(dtype))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 4, (b, t), generator=g)  # a small range: tokens repeat, and padding (0) occurs
    targets = torch.randint(0, vocab, (b, t), generator=g)

    def loss_fn(p, bufs, sample):
        x, y = sample
        return F.cross_entropy(apply(p, bufs, x[None])[0], y)

    return loss_fn, params, buffers, (tokens, targets)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_a_tied_table_matches_the_per_sample_reference_without_per_sample_grads(heads, dtype, rtol, never_formed):
    loss_fn, params, buffers, batch = _lm(dtype, heads)
    c = 0.5
    mask = torch.tensor([True, True, False, True, True, True])
    ref64 = {k: v.double() for k, v in params.items()}
    grads = vmapdp.per_sample_grads(loss_fn)(ref64, {k: v.double() for k, v in buffers.items()}, batch)
    want_sum, want_norms = vmapdp.clip_and_sum(grads, c, mask=mask)
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=c, method="ghost")(params, buffers, batch, mask=mask)
    assert (norms.double() - want_norms).abs().max() <= rtol * want_norms.max()
    assert (want_norms[mask] > c).all()  # clipping is active
    total = math.sqrt(sum(float(v.square().sum()) for v in want_sum.values()))
    for k in want_sum:
        assert float((summed[k].double() - want_sum[k]).norm()) <= rtol * total, k


def _exact_sq(g, tok, u, v):
    """The exact squared norm of ``sum_t e_{tok_t} g_t^T + sum_s u_s v_s^T`` (one sample), in rationals."""
    vocab, d = u.shape[1], g.shape[1]
    grad = [[Fraction(0)] * d for _ in range(vocab)]
    for t in range(g.shape[0]):
        for j in range(d):
            grad[int(tok[t])][j] += Fraction(float(g[t, j]))
    for s in range(u.shape[0]):
        for i in range(vocab):
            for j in range(d):
                grad[i][j] += Fraction(float(u[s, i])) * Fraction(float(v[s, j]))
    return sum(x * x for row in grad for x in row)


def _cancelling(seed, d=3):
    """One sample whose uses each cancel within themselves: the embedding's grads at token 0 are
    ``a`` and ``-a + r`` (``|a|`` up to 2**40), the pair's ``u_s v_s^T`` are ``e_0 b^T`` and
    ``e_0 (-b + r')^T``. The float64 cross term ``sum_{t,s} u_s[tok_t] (g_t . v_s)`` then adds
    products ~2**60 that cancel to ~2**20: its rounding (~2**8) is what the bound must cover, as
    the self terms are small and so are their margins. Without the cross term's own bound, 18 of
    these 40 seeds break it."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.tensor([0, 0, 1])
    a = 2.0 ** torch.randint(30, 41, (d,), generator=g) * torch.randn(d, generator=g, dtype=torch.float64)
    b = 2.0 ** torch.randint(10, 21, (d,), generator=g) * torch.randn(d, generator=g, dtype=torch.float64)
    emb = torch.stack([a, -a + torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)])
    v = torch.stack([b, -b + torch.randn(d, generator=g, dtype=torch.float64)])
    u = torch.tensor([[1.0, 0, 0], [1.0, 0, 0]], dtype=torch.float64)
    return emb, tok, u, v


@pytest.mark.parametrize("seed", range(40))
def test_the_bound_holds_when_the_cross_term_cancels(seed):
    """``sqrt(sq) + margin`` bounds the exact norm (rational arithmetic) on crafted samples whose
    computed squared norm is off by up to 9 (true 11.7, computed 2.7)."""
    g, tok, u, v = _cancelling(seed)
    uses = [Use(EMBEDDING, g[None], tok[None], (3, 3), 3), Use(PAIR, u[None], v[None], (3, 3))]
    sq, margin = crossed_sq_norms(uses, (3, 3), torch.float64)
    exact = _exact_sq(g, tok, u, v)
    safe = Fraction(float(sq[0].clamp_min(0).sqrt())) + Fraction(float(margin[0]))
    assert safe * safe >= exact
    assert float(margin[0]) < 1e3  # (of the rounding's size: the masses are ~2**41)
