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


def _one_term_tie(b, d, vocab=3):
    """A table used once as an embedding (one token) and once as a linear weight (one position):
    per-sample grad ``e_tok z^T + y x^T``. Rows ``0 .. b-2`` (attackers) make the two uses cancel
    (``y = a e_0``, ``z = -a x + r``, ``a ~ 1e6``); row ``b-1`` (the target) has only ``z``."""
    g = torch.Generator().manual_seed(0)
    tok = torch.zeros(b, 1, dtype=torch.int64)
    z, x, y = torch.zeros(b, 1, d), torch.zeros(b, 1, d), torch.zeros(b, 1, vocab)
    unit = torch.ones(d) / d**0.5
    for j in range(b - 1):
        y[j, 0, 0] = 1e6 * (1 + 0.01 * torch.rand((), generator=g))
        x[j, 0] = unit
        z[j, 0] = -y[j, 0, 0] * unit + 0.01 * torch.randn(d, generator=g)

    def loss(p, sample):
        tok, z, x, y = sample
        return (F.embedding(tok, p["w"]) * z).sum() + (F.linear(x, p["w"]) * y).sum()

    return loss, {"w": torch.zeros(vocab, d)}, (tok, z, x, y)


def test_uses_of_one_position_that_cancel_each_other_do_not_quantise_the_neighbours(monkeypatch):
    """Found by review: both uses of the tied table have one term per sample (T = S = 1), so the
    book-keeping sum stayed float32 (engine._sum_dtype: "with T = 1 nothing can cancel"), but the
    embedding's and the head's grads of one sample cancel each other. The crossed norm's safe
    bound, ``~ sqrt(24 eps32) M``, let each attacker's clipped parts reach ~590 C in the float32
    embedding and head sums, which quantised the target's share: its coordinates chosen (from the
    attackers' partial sums) to round up, the neighbour difference was 1.00086 C at B = 32
    (1.00021 C at B = 8; 1.2 C before cross.py, from the formed norm's float32 margin)."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0))  # a vocabulary-sized table
    b, d = 32, 16
    loss, params, (tok, z, x, y) = _one_term_tie(b, d)
    sums = []
    weighted = engine._weighted

    def spy(use, w, keep, dtype=None):
        out = weighted(use, w, keep, dtype)
        if use.kind is EMBEDDING:
            sums.append(out)
        return out

    monkeypatch.setattr(engine, "_weighted", spy)
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=1.0, method="ghost")
    without = torch.ones(b, dtype=torch.bool)
    without[-1] = False
    fn(params, (tok, z, x, y), mask=without)
    s = sums[-1][0].double()  # the attackers' partial sums at W[0], in the sum's dtype
    ulp = torch.finfo(sums[-1].dtype).eps * 2.0 ** torch.frexp(s.abs()).exponent.double() / 2
    budget, c = (1.0 - 1e-5) ** 2, torch.zeros(d, dtype=torch.float64)
    for k in range(d):  # c_k = (m_k + 0.52) ulp_k: fl(s_k + c_k) rounds up by 0.48 ulp_k; ||c|| < 1
        c[k] = (torch.floor((budget / (d - k)) ** 0.5 / ulp[k] - 0.52) + 0.52) * ulp[k]
        budget -= float(c[k]) ** 2
    z[-1, 0] = (c * torch.sign(s)).float()
    full, norms, _ = fn(params, (tok, z, x, y))
    minus, _, _ = fn(params, (tok, z, x, y), mask=without)
    assert float(norms[-1]) < 1.0  # the target is not clipped: its share is c itself
    assert float((full["w"].double() - minus["w"].double()).norm()) <= 1.0 + 1e-4


def test_a_float64_kernel_used_twice_does_not_quantise_the_neighbours(monkeypatch):
    """Found by review, present before cross.py: a float64 model whose conv kernel
    is used twice (two "conv" uses: not joined, no cross rule) gets its norm from the formed
    per-sample grads with the float64 margin ``2 (T + 2) eps64 (M1 + M2)``; engine._bound's float32
    floor applied only when the sum's dtype differed from the uses' (a float32 model), so an attacker
    whose two uses cancel (``G2 = -G1 + R``) got ``w M`` up to ``C / (6 eps64) ~ 7.5e14 C``, and
    its +-halves sat in the two uses' separate float64 conv-backward sums: the target's share was
    quantised at ``ulp(k * 3.7e14 C) ~ 0.06 k C``. Measured: 1.057 C here (1.024 C with the
    default limits: conv1d 1024 -> 1024, B = 9, nothing kept). The floor now applies to every
    float64 book-keeping sum."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0))  # a large kernel
    b, cin = 8, 6

    def loss(p, sample):
        x1, y1, x2, y2 = sample
        return (F.conv1d(x1[None], p["w"]) * y1).sum() + (F.conv1d(x2[None], p["w"]) * y2).sum()

    g = torch.Generator().manual_seed(0)
    unit = torch.randn(cin, 1, generator=g, dtype=torch.float64).abs()
    unit = unit / unit.norm()
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=1.0, method="ghost")
    params = {"w": torch.zeros(1, cin, 1, dtype=torch.float64)}
    without = torch.ones(b, dtype=torch.bool)
    without[-1] = False
    worst = 0.0
    for trial in range(6):
        gg = torch.Generator().manual_seed(100 + trial)
        x1, x2 = torch.zeros(b, cin, 1, dtype=torch.float64), torch.zeros(b, cin, 1, dtype=torch.float64)
        y1, y2 = torch.zeros(b, 1, 1, dtype=torch.float64), torch.zeros(b, 1, 1, dtype=torch.float64)
        for j in range(b - 1):  # attackers: use 2's grad is minus use 1's, up to 1e-3
            a = 1e20 * (1 + 0.01 * float(torch.rand((), generator=gg)))
            y1[j], y2[j] = 1.0, 1.0
            x1[j], x2[j] = a * unit, -a * unit + 1e-3 * torch.randn(cin, 1, generator=gg, dtype=torch.float64)
        y1[-1], x1[-1] = 1.0, unit * (1 + 0.3 * torch.randn(cin, 1, generator=g, dtype=torch.float64))  # the target
        full, _, _ = fn(params, (x1, y1, x2, y2))
        minus, _, _ = fn(params, (x1, y1, x2, y2), mask=without)
        worst = max(worst, float((full["w"] - minus["w"]).norm()))
    assert worst <= 1.0 + 1e-4


def test_two_direct_uses_that_cancel_do_not_quantise_the_neighbours(monkeypatch):
    """Found by review, present before cross.py, reachable with tuned limits only
    (keep_ratio < 0.5 and the budget exceeded; by default a direct use's per-sample grads are
    kept): a param used by two elementwise affines (``x * w`` twice; ALBERT-style shared norms).
    Direct uses had mass 0 and margin 0 ("norm and sum share the numbers"), true for one use,
    but with two the norm is of ``u1 + u2`` while the sum adds ``(w u1).sum(0)`` and
    ``(w u2).sum(0)`` apart: an attacker with ``u1 = A = 2**52 / 4 * 1.25``, ``u2 = -A`` has norm 0
    (w = 1) and quantises the float64 sums to a grid of 0.25: a target (norm 0.992 C) whose
    coordinates are 1.5 grid steps is released as 2 steps: 1.32 C."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0))
    b, d, step = 4, 7, 0.25

    def loss(p, sample):
        x1, x2 = sample
        return (x1 * p["w"]).sum() + (x2 * p["w"]).sum()

    x1, x2 = torch.zeros(b, d), torch.zeros(b, d)
    x1[0], x2[0] = step * 2.0**52 * 1.25, -step * 2.0**52 * 1.25
    x1[-1] = 1.5 * step * 1.0001  # norm 0.992
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=1.0, method="ghost")
    without = torch.ones(b, dtype=torch.bool)
    without[-1] = False
    full, norms, _ = fn({"w": torch.zeros(d)}, (x1, x2))
    minus, _, _ = fn({"w": torch.zeros(d)}, (x1, x2), mask=without)
    assert float(norms[-1]) < 1.0
    assert float((full["w"].double() - minus["w"].double()).norm()) <= 1.0 + 1e-4
