"""Ghost clipping's einsum rule for params of any rank (matmul.py: per-head projections ``"btd,dhk->bthk"``,
their transposed and permuted orders, per-group matrices) and broadcast views of params (views.py:
``bias.view(1, 1, d).expand(b, t, d)``, a ``[1, d]`` weight expanded, a class token repeated):
covered (coverage 100%), per-sample norms and clipped sums equal to the float64 oracle
``vmapdp.testing.microbatch_grads`` and to vmap's, and the neighbour difference of the released sum
at most ``C`` on crafted cancelling samples (tests/test_sensitivity.py's property)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vmapdp
from test_sensitivity import B, CRAFTED, TOL, Pool, _alternating, _floats, neighbour_differences
from vmapdp.ghost import coverage
from vmapdp.ghost.matmul import GROUPED, PERMUTED
from vmapdp.ghost.linear import PAIR
from vmapdp.ghost.affine import DIRECT
from vmapdp.testing import microbatch_grads

C = 0.2
t = torch.tanh
RUNNING = (torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 4.0, 0.25, 2.0], dtype=torch.float64))


def _forms():
    """One-param losses ``(loss, param shapes, the kind of the use it makes)``; a sample is ``[5, 4]``."""
    return {
        "btd,dhk->bthk (W [d, h, k])": (lambda p, x: t(torch.einsum("td,dhk->thk", x, p["w"])).sum(), {"w": (4, 2, 3)}, PAIR),
        "btd,hkd->bthk (transposed order)": (lambda p, x: t(torch.einsum("...d,hkd->...hk", x, p["w"])).square().sum(), {"w": (2, 3, 4)}, PAIR),
        "btd,hdk->bthk (permuted order)": (lambda p, x: t(torch.einsum("td,hdk->thk", x, p["w"])).square().sum(), {"w": (2, 4, 3)}, PERMUTED),
        "bthk,hkd->btd (output projection)": (lambda p, x: t(torch.einsum("thk,hkd->td", x.view(5, 2, 2), p["w"])).sum(), {"w": (2, 2, 3)}, PAIR),
        "bthd,hdk->bthk (per-head matrices)": (lambda p, x: t(torch.einsum("thd,hdk->thk", x.view(5, 2, 2), p["w"])).sum(), {"w": (2, 2, 3)}, GROUPED),
        "bthd,hkd->bthk (per-head, transposed)": (lambda p, x: t(torch.einsum("thd,hkd->thk", x.view(5, 2, 2), p["w"])).sum(), {"w": (2, 3, 2)}, GROUPED),
        "bthd,dhk->bthk (per-head, permuted)": (lambda p, x: t(torch.einsum("thd,dhk->thk", x.view(5, 2, 2), p["w"])).square().sum(), {"w": (2, 2, 3)}, PERMUTED),
        "W first, 4-D W": (lambda p, x: t(torch.einsum("gdhk,td->tghk", p["w"], x)).sum(), {"w": (2, 4, 2, 3)}, PERMUTED),
        "positions out of order, bi,ij->jb": (lambda p, x: t(torch.einsum("bi,ij->jb", x, p["w"])).sum(), {"w": (4, 3)}, PAIR),
        "a vector, ...d,d->...": (lambda p, x: t(torch.einsum("...d,d->...", x, p["w"])).sum(), {"w": (4,)}, PAIR),
        "a 3-D W through a transposed 2-D view": (lambda p, x: t(torch.einsum("thd,hd->th", x.view(5, 2, 2), p["w"].t())).sum(), {"w": (2, 2)}, DIRECT),
        # found by review: both of W's letters on one side, W = P.t(): the pair's sides are not the view's rows and
        # columns, so swapping them released the sum permuted (norms right)
        "tdk,dk->t on P.t() (both letters contracted)": (
            lambda p, x: t(torch.einsum("tdk,dk->t", x[:, :2, None] * x[:, None, :3], p["w"].t())).square().sum(), {"w": (3, 2)}, DIRECT),
        "t,dk->tdk on P.t() (both letters in the output)": (lambda p, x: torch.sin(torch.einsum("t,dk->tdk", x[:, 1], p["w"].t())).sum(), {"w": (3, 2)}, DIRECT),
        "bias.view(1, 1, d).expand(b, t, d)": (lambda p, x: t(x[None] + p["b"].view(1, 1, 4).expand(1, 5, 4)).square().sum(), {"b": (4,)}, DIRECT),
        "broadcast_to, then x * w": (lambda p, x: t(x * torch.broadcast_to(p["b"].unsqueeze(0), (5, 4))).square().sum(), {"b": (4,)}, DIRECT),
        "a [1, d] weight expanded in F.linear": (lambda p, x: t(F.linear(x, p["w"].expand(3, 4))).square().sum(), {"w": (1, 4)}, DIRECT),
        "a [d] weight reshaped for F.linear": (lambda p, x: t(F.linear(x, p["w"].reshape(3, 4))).square().sum(), {"w": (12,)}, PAIR),
        "a class token repeated, then cat": (lambda p, x: t(torch.cat([p["c"].expand(2, 1, 4), x.expand(2, 5, 4)], 1)).square().sum(), {"c": (1, 1, 4)}, DIRECT),
        "a block of a param repeated": (lambda p, x: t(x + p["w"][1:2].repeat(5, 1)).square().sum() + t(x @ p["w"][2:].t()).sum(), {"w": (3, 4)}, DIRECT),
        # affine.batch_norm_affine: the affine as x * w.view(1, C, 1) + b.view(1, C, 1)
        "F.batch_norm, eval (running stats)": (
            lambda p, x: t(F.batch_norm(x.t()[None], RUNNING[0], RUNNING[1], p["w"], p["b"], False, 0.1, 1e-3)).square().sum(), {"w": (4,), "b": (4,)}, DIRECT),
        "F.batch_norm, no running stats": (lambda p, x: t(F.batch_norm(x.t()[None], None, None, p["w"], p["b"], True)).square().sum(), {"w": (4,), "b": (4,)}, DIRECT),
    }


def _uses(fn, params, x):
    """The uses the ghost engine makes, by param, from one run (the engine's own code path)."""
    from vmapdp.ghost import engine

    seen = {}
    real = engine._merge_all

    def spy(uses):
        seen.update({k: [u.kind for u in v] for k, v in uses.items()})
        return real(uses)

    engine._merge_all = spy
    try:
        fn(params, x)
    finally:
        engine._merge_all = real
    return seen


@pytest.mark.parametrize("form", list(_forms()))
def test_each_form_is_covered_and_exact(form):
    """Per-sample norms and the clipped sum equal the float64 oracle's to 1e-10 (and vmap's), the
    uses are sites of the expected kind (not per-sample copies): coverage 100%."""
    loss, shapes, kind = _forms()[form]
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    x = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    x[2, :, 0] = 0.0
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
    plan = fn.prepare(params, x)
    assert plan.other == [] and coverage(plan, params) == 1.0, plan.describe(params)
    assert kind in {k for kinds in _uses(fn, params, x).values() for k in kinds}
    mask = torch.tensor([True, False, True])
    summed, norms, _ = fn(params, x, mask=mask)
    want_summed, want_norms = vmapdp.clip_and_sum(microbatch_grads(loss, params, x), C, mask=mask)
    assert (norms - want_norms).abs().max() <= 1e-10 * want_norms.abs().max()
    assert (want_norms[[0, 2]] > C).all()  # clipping is active
    total = math.sqrt(sum(float(v.square().sum()) for v in want_summed.values()))
    for k in want_summed:
        assert float((summed[k] - want_summed[k]).norm()) <= 1e-10 * total, k
    by_vmap, vmap_norms, _ = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="vmap")(params, x, mask=mask)
    torch.testing.assert_close(norms, vmap_norms, rtol=1e-10, atol=0)
    for k in by_vmap:
        torch.testing.assert_close(summed[k], by_vmap[k], rtol=1e-10, atol=1e-14)


def test_what_is_still_not_covered_is_named():
    """Forms no rule covers stay exact through per-sample views and are named, with their ops."""
    params = {"w": torch.randn(4, 3, 2, dtype=torch.float64), "b": torch.randn(2, dtype=torch.float64), "d": torch.randn(4, 4, dtype=torch.float64)}

    def loss(p, x):
        h = torch.einsum("ti,ijk->tj", x, p["w"])  # W summed over a letter of its own
        h = h + p["b"].repeat(2)[None, :3]  # a tile within a dim, then a slice: not a box
        return t(h).sum() + t(torch.einsum("ti,ii->ti", x, p["d"])).sum()  # a diagonal

    x = torch.randn(3, 5, 4, dtype=torch.float64)
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
    plan = fn.prepare(params, x)
    assert plan.other == ["b", "d", "w"]
    assert plan.uncovered["w"] == ["torch.functional.einsum"] and plan.uncovered["d"] == ["torch.functional.einsum"], plan.uncovered
    assert "Tensor.repeat" in plan.uncovered["b"], plan.uncovered
    text = plan.describe(params)
    assert "covers 0.0%" in text and "w (4, 3, 2) used by torch.functional.einsum" in text and "b (2,) used by Tensor.repeat" in text
    summed, norms, _ = fn(params, x)
    want_summed, want_norms = vmapdp.clip_and_sum(microbatch_grads(loss, params, x), C)
    torch.testing.assert_close(norms, want_norms, rtol=1e-10, atol=0)
    for k in want_summed:
        torch.testing.assert_close(summed[k], want_summed[k], rtol=1e-10, atol=1e-14)


class Heads(nn.Module):
    """Attention-free per-head projections by einsum with 3-D params in three orders, a bias
    broadcast by ``view(1, 1, d).expand(b, t, d)`` and a ``[1, d]`` scale expanded: every use one
    this file covers."""

    def __init__(self, d=6, h=2, k=3):
        super().__init__()
        self.q = nn.Parameter(0.3 * torch.randn(d, h, k))  # "btd,dhk->bthk"
        self.v = nn.Parameter(0.3 * torch.randn(h, d, k))  # "btd,hdk->bthk" (permuted)
        self.o = nn.Parameter(0.3 * torch.randn(d, h, k))  # "bthk,dhk->btd" (transposed)
        self.bias = nn.Parameter(0.1 * torch.randn(d))
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(1, d))

    def forward(self, x):
        b, n, d = x.shape
        h = torch.einsum("btd,dhk->bthk", x, self.q) * torch.einsum("btd,hdk->bthk", x, self.v)
        y = torch.einsum("bthk,dhk->btd", h, self.o) + self.bias.view(1, 1, d).expand(b, n, d)
        return y * self.scale.expand(n, d)


def _heads(precision=None, seed=0):
    torch.manual_seed(seed)
    apply, params, buffers = vmapdp.functionalize(Pool(Heads(), 6))
    g = torch.Generator().manual_seed(seed + 1)
    batch = (_floats((5, 6), _alternating)(g), torch.randint(0, 3, (B,), generator=g))

    def loss_fn(params, buffers, sample):
        x, y = sample
        return F.cross_entropy(apply(params, buffers, x[None]), y[None])

    return (loss_fn if precision is None else vmapdp.mixed_precision(loss_fn, precision)), params, buffers, batch


@pytest.mark.parametrize("precision", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_neighbour_difference_is_at_most_C_on_crafted_samples(precision):
    """tests/test_sensitivity.py's property on the model above: a sample of huge cancelling terms
    (1e7, alternating signs over the positions), a milder one, a NaN sample; ``TOL`` there."""
    loss_fn, params, buffers, batch = _heads(precision)
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=0.05, method="ghost")
    plan = fn.prepare(params, buffers, batch)
    assert plan.other == [] and coverage(plan, params) == 1.0, plan.describe(params)
    diffs = neighbour_differences(fn, params, buffers, batch, 0.05)
    assert max(diffs) <= 1 + TOL, [f"{d:.6f}" for d in diffs]
    assert diffs[1] == 0.0  # the NaN sample is dropped
    assert max(diffs) > 0.5  # clipping is active


def test_the_sum_is_vmaps_sum_of_clipped_per_sample_grads_in_float32():
    loss_fn, params, buffers, batch = _heads()
    mask = torch.ones(B, dtype=torch.bool)
    mask[CRAFTED] = False
    want = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=0.05, method="vmap")(params, buffers, batch, mask=mask)[0]
    got = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=0.05, method="ghost")(params, buffers, batch, mask=mask)[0]
    total = sum(float(v.double().square().sum()) for v in want.values()) ** 0.5
    for k in want:
        assert float((got[k].double() - want[k].double()).norm()) <= 1e-4 * total, k


def test_compiled_ghost_on_einsum_and_broadcast_params_equals_eager():
    """The new uses under torch.compile(fullgraph=True) (dynamo's capture, backend "eager": the
    same graph inductor would get, without inductor's minutes of codegen on this CPU)."""
    loss_fn, params, buffers, batch = _heads()
    mask = torch.ones(B, dtype=torch.bool)
    mask[1] = False
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=0.05, method="ghost")
    fn.prepare(params, buffers, batch)
    compiled = torch.compile(lambda p, b, x: fn(p, b, x, mask=mask), fullgraph=True, dynamic=False, backend="eager")
    got, want = compiled(params, buffers, batch), fn(params, buffers, batch, mask=mask)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    for k in want[0]:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-5, atol=1e-7)
