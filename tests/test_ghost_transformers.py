"""Ghost clipping on transformer blocks: the matmul rules (addmm, ``@``, mm, einsum) and the
elementwise-affine rules (layer/group/RMS norm, ``x * w``, ``x + w``) against the float64 oracle
``vmapdp.testing.microbatch_grads`` and method="vmap"; coverage of GPT-2-, BERT-, Llama- and
ViT-like blocks written in plain torch (tests/transformer_blocks.py) is 100%."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vmapdp
from transformer_blocks import BLOCKS
from vmapdp.ghost import coverage, probe
from vmapdp.ghost.matmul import EinsumForm, einsum_form
from vmapdp.testing import microbatch_grads

C = 0.2


def _block(name, b, t, dtype=torch.float64, seed=0):
    build, make = BLOCKS[name]
    torch.manual_seed(seed)
    apply, params, buffers = vmapdp.functionalize(build())
    params = {k: v.to(dtype) for k, v in params.items()}
    g = torch.Generator().manual_seed(seed + 1)
    x = make(b, t, g)
    x = x.to(dtype) if x.is_floating_point() else x
    batch = (x, torch.randint(0, 3, (b,), generator=g))

    def loss_fn(params, buffers, sample):
        x, y = sample
        return F.cross_entropy(apply(params, buffers, x[None]), y[None])

    return loss_fn, params, buffers, batch


def _oracle(loss_fn, params, buffers, batch, mask):
    """Clipped sum and norms from the float64 micro-batch oracle (one sample at a time)."""
    grads = microbatch_grads(loss_fn, {k: v.double() for k, v in params.items()}, buffers, batch)
    return vmapdp.clip_and_sum(grads, C, mask=mask)


def _close(got, want, rtol):
    (summed, norms), (ref_summed, ref_norms) = got, want
    assert (norms.double() - ref_norms).abs().max() <= rtol * ref_norms.abs().max(), (norms, ref_norms)
    total = math.sqrt(sum(float(v.square().sum()) for v in ref_summed.values()))
    for k in ref_summed:
        assert float((summed[k].double() - ref_summed[k]).norm()) <= rtol * total, k


@pytest.mark.parametrize("name", list(BLOCKS))
def test_blocks_are_fully_covered(name):
    loss_fn, params, buffers, batch = _block(name, 3, 4)
    plan = probe(loss_fn, params, (buffers,), batch, "error")
    assert plan.other == [], plan.describe(params)
    assert coverage(plan, params) == 1.0
    assert "covers 100.0%" in plan.describe(params)


@pytest.mark.parametrize("b,t", [(1, 1), (5, 1), (1, 4), (5, 4)])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_blocks_match_the_float64_oracle_and_vmap(name, b, t):
    loss_fn, params, buffers, batch = _block(name, b, t)
    mask = torch.ones(b, dtype=torch.bool)
    if b > 1:
        mask[1] = False  # a padding row
    want = _oracle(loss_fn, params, buffers, batch, mask)
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
    summed, norms, _ = fn(params, buffers, batch, mask=mask)
    _close((summed, norms), want, 1e-9)
    if b > 1:
        assert norms[1] == 0
    by_vmap = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="vmap")(params, buffers, batch, mask=mask)
    _close((summed, norms), (by_vmap[0], by_vmap[1].double()), 1e-9)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_blocks_float32(name):
    loss_fn, params, buffers, batch = _block(name, 5, 4, dtype=torch.float32)
    mask = torch.tensor([True, False, True, True, True])
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, buffers, batch, mask=mask)
    _close((summed, norms), _oracle(loss_fn, params, buffers, batch, mask), 1e-4)
    assert all(v.dtype == torch.float32 for v in summed.values())


@pytest.mark.parametrize("name", ["gpt2", "llama"])  # (GPT-2's addmm and tied head, Llama's RMSNorm and SwiGLU; the suite's time)
def test_blocks_compiled_equal_eager(name):
    """Ghost under torch.compile(fullgraph=True) (dynamo's capture, backend "eager": the graph
    Inductor would get) runs every block and equals the eager run. Found by review: dynamo inlines
    F.rms_norm, so the compiled run saw torch.rms_norm where the probe had seen F.rms_norm, and
    every compiled ghost step of a model with nn.RMSNorm (the Llama block) was refused."""
    loss_fn, params, buffers, batch = _block(name, 3, 4, dtype=torch.float32)
    mask = torch.tensor([True, False, True])
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
    want = fn(params, buffers, batch, mask=mask)
    got = torch.compile(lambda p, b, x: fn(p, b, x, mask=mask), fullgraph=True, dynamic=False, backend="eager")(params, buffers, batch)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    for k in want[0]:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-5, atol=1e-7)


def _each_form():
    """One-param losses, one per covered form, with ``W`` and the input shape of a sample."""
    return {
        "x @ W": (lambda p, x: torch.tanh(x @ p["w"]).sum(), (4, 3), (5, 4)),
        "matmul(x, W) 1-D x": (lambda p, x: torch.tanh(torch.matmul(x[0], p["w"])).sum(), (4, 3), (5, 4)),
        "W @ x": (lambda p, x: torch.tanh(p["w"] @ x.transpose(-1, -2)).sum(), (3, 4), (5, 4)),
        "W @ x 1-D x": (lambda p, x: torch.tanh(p["w"] @ x[0]).sum(), (3, 4), (5, 4)),
        "mm(x, W)": (lambda p, x: torch.tanh(torch.mm(x, p["w"])).sum(), (4, 3), (5, 4)),
        "broadcast x @ W": (lambda p, x: torch.tanh(x.view(5, 2, 2)[None].expand(2, 5, 2, 2).reshape(2, 5, 4) @ p["w"]).sum(), (4, 3), (5, 4)),
        "einsum xw": (lambda p, x: torch.tanh(torch.einsum("ti,ij->tj", x, p["w"])).sum(), (4, 3), (5, 4)),
        "einsum ellipsis xwt list": (lambda p, x: torch.tanh(torch.einsum("...i,ji->...j", [x, p["w"]])).sum(), (3, 4), (5, 4)),
        "einsum W first": (lambda p, x: torch.tanh(torch.einsum("ij,...i->...j", p["w"], x)).sum(), (4, 3), (5, 4)),
        "addmm": (lambda p, x: torch.tanh(torch.addmm(p["b"], x, p["w"])).sum(), (4, 3), (5, 4)),
        # an activation of the output's shape added (a recurrent step's x_proj + h W_hh^T), its grad flowing on
        "addmm, an activation added": (lambda p, x: torch.tanh(torch.addmm(torch.sin(x[:, :3]) * x[:, 3:], x, p["w"])).sum(), (4, 3), (5, 4)),
        "layer_norm 2-D shape": (lambda p, x: torch.tanh(F.layer_norm(x, (5, 4), p["w"], p["b"])).square().sum(), (5, 4), (5, 4)),
        "rms_norm default eps": (lambda p, x: torch.tanh(F.rms_norm(x, (4,), p["w"])).square().sum(), (4,), (5, 4)),
        "group_norm": (lambda p, x: torch.tanh(F.group_norm(x.view(1, 4, 5), 2, p["w"], p["b"])).square().sum(), (4,), (5, 4)),
        "w * x, layer scale": (lambda p, x: torch.tanh(p["w"] * x).square().sum(), (5, 1), (5, 4)),
        "x + w, position embedding": (lambda p, x: torch.tanh(x + p["w"]).square().sum(), (5, 4), (5, 4)),
    }


@pytest.mark.parametrize("form", list(_each_form()))
def test_each_form_is_covered_and_exact(form):
    loss, wshape, xshape = _each_form()[form]
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(wshape, generator=g, dtype=torch.float64)}
    if form in ("addmm", "layer_norm 2-D shape", "group_norm"):
        params["b"] = torch.randn(wshape[-1] if form == "addmm" else wshape, generator=g, dtype=torch.float64)
    x = torch.randn((3,) + xshape, generator=g, dtype=torch.float64)
    x[2, :, 0] = 0.0  # (a row of zeros in one sample)
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
    plan = fn.prepare(params, x)
    assert plan.other == [] and coverage(plan, params) == 1.0, form
    mask = torch.tensor([True, False, True])
    summed, norms, _ = fn(params, x, mask=mask)
    _close((summed, norms), vmapdp.clip_and_sum(microbatch_grads(loss, params, x), C, mask=mask), 1e-10)


def test_uncovered_uses_are_named_with_their_ops():
    params = {"w": torch.randn(3, 4, 2, dtype=torch.float64), "v": torch.randn(6, 4, dtype=torch.float64)}

    def loss(p, x):
        h = torch.einsum("hti,hij->ht", x.expand(3, 5, 4), p["w"])  # W summed over a letter of its own: a per-sample view
        return (h.t() @ p["v"][::2]).sum()  # a strided slice is not a box: a per-sample view

    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
    x = torch.randn(2, 1, 5, 4, dtype=torch.float64)
    plan = fn.prepare(params, x[:, 0])
    assert plan.other == ["v", "w"]
    text = plan.describe(params)
    assert "einsum" in plan.uncovered["w"][0] and "Tensor.__getitem__" in plan.uncovered["v"][0], plan.uncovered
    assert "covers 0.0%" in text and "w (3, 4, 2)" in text
    summed, norms, _ = fn(params, x[:, 0])
    _close((summed, norms), vmapdp.clip_and_sum(microbatch_grads(loss, params, x[:, 0]), C), 1e-10)


def test_addmm_adding_a_param_of_the_outputs_shape_is_an_other_use():
    """``addmm(P, x, W)`` with ``P`` a param of the output's shape: ``W``'s use is covered, ``P``'s
    addend is not a bias (its grad is the output grad itself, per position): a per-sample view."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g, dtype=torch.float64), "p": torch.randn(5, 3, generator=g, dtype=torch.float64)}

    def loss(p, x):
        return torch.tanh(torch.addmm(p["p"], x, p["w"])).sum()

    x = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
    assert fn.prepare(params, x).other == ["p", "w"]
    summed, norms, _ = fn(params, x)
    _close((summed, norms), vmapdp.clip_and_sum(microbatch_grads(loss, params, x), C), 1e-10)


def _view_forms():
    """One-param losses that use a param through views (views.py) or as a batch of matrices
    (``bmm``, batched ``matmul``): ``(loss, param shapes, input shape of a sample)``."""
    t = torch.tanh
    return {
        "x @ W.t()": (lambda p, x: t(x @ p["w"].t()).sum(), {"w": (3, 4)}, (5, 4)),
        "x @ W.T and mm(x, W.transpose)": (lambda p, x: t(x @ p["w"].T).sum() + t(torch.mm(x, p["w"].transpose(0, 1))).square().sum(), {"w": (3, 4)}, (5, 4)),
        "W.mT @ x, transposed twice": (lambda p, x: t(p["w"].mT @ x.t()).sum() + t(x @ p["w"].t().t()).square().sum(), {"w": (4, 3)}, (5, 4)),
        "linear on chunks, bias chunks": (
            lambda p, x: sum(t(F.linear(x, w, b)).square().sum() * (i + 1) for i, (w, b) in enumerate(zip(p["w"].chunk(3), p["b"].chunk(3)))),
            {"w": (6, 4), "b": (6,)}, (5, 4)),
        "linear on split [1, 2, 3]": (lambda p, x: sum(t(F.linear(x, w)).square().sum() for w in p["w"].split([1, 2, 3])), {"w": (6, 4)}, (5, 4)),
        "slices, narrow, a column block": (
            lambda p, x: t(F.linear(x, p["w"][1:4])).sum() + t(F.linear(x[:, :2], p["w"].narrow(0, 4, 2)[:, 2:])).square().sum(), {"w": (6, 4)}, (5, 4)),
        "a block, then the whole param": (lambda p, x: t(F.linear(x, p["w"][:2])).sum() + t(F.linear(x, p["w"])).square().sum(), {"w": (3, 4)}, (5, 4)),
        "overlapping blocks": (lambda p, x: t(F.linear(x, p["w"][:2])).sum() + t(F.linear(x, p["w"][1:])).square().sum(), {"w": (3, 4)}, (5, 4)),
        "a block used otherwise too": (lambda p, x: t(F.linear(x, p["w"][:2])).sum() + (p["w"][:2] * x[0, 0]).square().sum(), {"w": (3, 4)}, (5, 4)),
        "cat with a param, ViT's class token": (
            lambda p, x: t(torch.cat([p["w"].expand(1, -1, -1), x[None]], dim=-2) @ p["v"]).sum(), {"w": (1, 1, 4), "v": (4, 3)}, (5, 4)),
        "cat with a repeated-once param, two cats": (
            lambda p, x: t(torch.cat((x, p["w"].repeat(1, 1))) * 2).square().sum() + t(torch.concat([x.t(), p["w"].t()], 1)).sum(), {"w": (1, 4)}, (5, 4)),
        "two params in one cat": (lambda p, x: t(torch.cat([p["w"], x, p["v"]])).square().sum(), {"w": (1, 4), "v": (2, 4)}, (5, 4)),
        "rows picked by the sample": (lambda p, x: t(F.linear(x, p["w"][(x[0, :2] > 0).long().cumsum(0)])).sum(), {"w": (3, 4)}, (5, 4)),
        "unbind of a 3-D param": (lambda p, x: sum(t(x @ w).square().sum() for w in p["w"].unbind(0)), {"w": (2, 4, 3)}, (5, 4)),
        "bmm with a 3-D param": (lambda p, x: t(torch.bmm(x.expand(2, 5, 4), p["w"])).sum(), {"w": (2, 4, 3)}, (5, 4)),
        "W @ x, W 3-D": (lambda p, x: t(p["w"] @ x.t().expand(2, 4, 5)).sum(), {"w": (2, 3, 4)}, (5, 4)),
        "x[..., H, T, d] @ W[H]": (lambda p, x: t(x.expand(3, 2, 5, 4) @ p["w"]).sum(), {"w": (2, 4, 3)}, (5, 4)),
        "4-D param, a 3-D slice of it": (lambda p, x: t(x.expand(2, 2, 5, 4) @ p["w"]).sum() + t(x.expand(2, 5, 4) @ p["w"][1]).square().sum(), {"w": (2, 2, 4, 3)}, (5, 4)),
    }


@pytest.mark.parametrize("form", list(_view_forms()))
def test_views_and_batched_params_are_covered_and_exact(form):
    """Tight: per-sample norms and the clipped sum equal the float64 oracle's to 1e-10, and the
    view (or batched) uses are sites, not per-sample views (coverage 100%), except where a view
    is also used by an uncovered op."""
    loss, shapes, xshape = _view_forms()[form]
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    x = torch.randn((3,) + xshape, generator=g, dtype=torch.float64)
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
    plan = fn.prepare(params, x)
    if form == "a block used otherwise too":
        assert plan.other == ["w"] and "Tensor.mul" in plan.uncovered["w"][0], plan.uncovered
    elif form == "two params in one cat":  # one site per call: both are per-sample views
        assert plan.other == ["v", "w"] and "torch.cat" in plan.uncovered["w"][0], plan.uncovered
    elif form == "rows picked by the sample":  # an index tensor: not a view (it may differ per sample)
        assert plan.other == ["w"] and "Tensor.__getitem__" in plan.uncovered["w"][0], plan.uncovered
    else:
        assert plan.other == [] and coverage(plan, params) == 1.0, plan.describe(params)
    mask = torch.tensor([True, False, True])
    summed, norms, _ = fn(params, x, mask=mask)
    want = vmapdp.clip_and_sum(microbatch_grads(loss, params, x), C, mask=mask)
    _close((summed, norms), want, 1e-10)
    by_vmap = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="vmap")(params, x, mask=mask)
    _close((summed, norms), (by_vmap[0], by_vmap[1]), 1e-10)


def test_a_block_selected_by_a_tensor_argument_is_refused_when_it_moves_and_exact_by_python_ints():
    """Found by review: the plan records the block of a param each view op selects (``pos[s:s+T]``)
    and is cached per input shape; with ``s = int(start)`` for a 0-dim tensor argument (keyed by its
    shape only) a later call at another offset put the gradient on the probed rows, silently
    (relative error 1.41 against the oracle). A view op whose selecting arguments differ from the
    probe's is refused with the fix; the same offsets as Python ints are each probed, and exact."""
    g = torch.Generator().manual_seed(0)
    params = {"pos": torch.randn(16, 3, generator=g, dtype=torch.float64), "head": torch.randn(2, 3, generator=g, dtype=torch.float64)}

    def loss(p, start, x):
        s = int(start)
        return F.linear(torch.tanh(x + p["pos"][s : s + 4]), p["head"]).square().mean()

    x = torch.randn(6, 4, 3, generator=g, dtype=torch.float64)
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
    fn(params, torch.tensor(0), x)
    with pytest.raises(ValueError, match=r"selects another part of the param 'pos'.*slice\(8, 12.*the probe's \(slice\(0, 4.*Python int"):
        fn(params, torch.tensor(8), x)
    for start in (0, 8, 0):
        summed, norms, _ = fn(params, start, x)
        _close((summed, norms), vmapdp.clip_and_sum(microbatch_grads(loss, params, start, x), C), 1e-10)
        assert summed["pos"][start : start + 4].abs().sum() > 0 and summed["pos"].abs().sum(1).nonzero().flatten().tolist() == list(range(start, start + 4))
    # what selects them changed in place between calls (a captured list, 0-dim tensor bounds): compared by value (found by
    # review: kept by reference, the probe's arguments equalled themselves and the gradient went to rows 0-3 again)
    rows, lo, hi = [0, 1, 2, 3], torch.tensor(0), torch.tensor(4)
    by_list = vmapdp.clipped_grad_sum(lambda p, x: F.linear(torch.tanh(x + p["pos"][rows]), p["head"]).square().mean(), l2_clip_norm=C, method="ghost")
    by_bounds = vmapdp.clipped_grad_sum(lambda p, x: F.linear(torch.tanh(x + p["pos"][lo:hi]), p["head"]).square().mean(), l2_clip_norm=C, method="ghost")
    by_list(params, x), by_bounds(params, x)
    rows[:] = [8, 9, 10, 11]
    lo.add_(8), hi.add_(8)
    for fn in (by_list, by_bounds):
        with pytest.raises(ValueError, match=r"selects another part of the param 'pos'"):
            fn(params, x)


class _Attention(torch.nn.Module):
    """``nn.MultiheadAttention`` in its three in-projection forms: self-attention, key = value
    (``split``: q and kv), cross (``chunk``: q, k, v; with ``add_bias_kv``: ``repeat`` and ``cat``),
    or separate ``kdim`` / ``vdim`` weights; with a key padding mask and the attention weights."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        kv = 4 if how == "kdim" else 8
        self.attn = torch.nn.MultiheadAttention(8, 2, kdim=kv, vdim=kv, batch_first=True, add_bias_kv=how == "cross")
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        if self.how == "encoder":
            return self.head(self.attn.layer(x).mean(1))
        pad = torch.zeros(x.shape[:2], dtype=torch.bool)
        pad[:, -1] = True
        if self.how == "self":
            q = k = v = x
        elif self.how == "kv":
            q, k, v = x, x[:, :3] * 2, x[:, :3] * 2
            pad = pad[:, :3]
        elif self.how == "cross":
            q, k, v = x, x * 2, x + 1
        else:
            q, k, v = x, x[..., :4], x[..., 4:]
        out, weights = self.attn(q, k, v, key_padding_mask=None if self.how == "cross" else pad, need_weights=True)
        return self.head(out.mean(1)) + weights.sum((1, 2))[:, None]


def _attention(how):
    torch.manual_seed(0)
    m = _Attention(how)
    if how == "encoder":
        m.attn.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        del m.attn.in_proj_weight, m.attn.in_proj_bias, m.attn.out_proj
    return m.double()


@pytest.mark.parametrize("how", ["encoder", "self", "kv", "cross", "kdim"])
def test_multihead_attention_is_covered_and_exact(how):
    """``nn.MultiheadAttention`` (and ``nn.TransformerEncoderLayer``): fully covered, norms and
    clipped sums equal to the float64 oracle (1e-10) and to vmap's."""
    apply, params, buffers = vmapdp.functionalize(_attention(how))
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 5, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))

    def loss_fn(params, buffers, sample):
        x, y = sample
        return F.cross_entropy(apply(params, buffers, x[None]), y[None])

    plan = probe(loss_fn, params, (buffers,), batch, "error")
    assert plan.other == [] and coverage(plan, params) == 1.0, plan.describe(params)
    mask = torch.tensor([True, True, False, True])
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, buffers, batch, mask=mask)
    _close((summed, norms), _oracle(loss_fn, params, buffers, batch, mask), 1e-10)
    by_vmap = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="vmap")(params, buffers, batch, mask=mask)
    _close((summed, norms), (by_vmap[0], by_vmap[1]), 1e-10)


def test_einsum_equations():
    assert einsum_form("...i,ij->...j", 2, 2, 1) == EinsumForm("Ai", "ij", "Aj", "", "i", "j")
    assert einsum_form("bti, oi -> bto", 3, 2, 1) == EinsumForm("bti", "oi", "bto", "", "i", "o")
    assert einsum_form("ij,ti->tj", 2, 2, 0) == EinsumForm("ti", "ij", "tj", "", "i", "j")
    assert einsum_form("btd,hdk->bthk", 3, 3, 1) == EinsumForm("btd", "hdk", "bthk", "", "d", "hk")
    assert einsum_form("bthd,dhk->bthk", 4, 3, 1) == EinsumForm("bthd", "dhk", "bthk", "h", "d", "k")
    assert einsum_form("...d,d->...", 3, 1, 1) == EinsumForm("ABd", "d", "AB", "", "d", "")
    # a trace or diagonal, an implicit output, three operands, a letter summed in one operand only,
    # an ellipsis in W, an output letter from nowhere, dims that do not match the operands
    for eq, x_dim, w_dim in (("ti,ii->ti", 2, 2), ("ti,ij", 2, 2), ("tii,ij->tj", 3, 2), ("ti,ij,jk->tk", 2, 2), ("ti,ijk->tj", 2, 3),
                             ("ts,ij->tj", 2, 2), ("ti,...j->tj", 2, 2), ("ti,ij->tjz", 2, 2), ("ti,ij->tj", 3, 2), ("...i,ij->j", 2, 2)):
        assert einsum_form(eq, x_dim, w_dim, 1) is None, eq


def test_compiled_ghost_on_a_transformer_block_equals_eager():
    loss_fn, params, buffers, batch = _block("gpt2", 4, 3, dtype=torch.float32)
    mask = torch.tensor([True, True, False, True])
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
    fn.prepare(params, buffers, batch)
    compiled = torch.compile(lambda p, b, x: fn(p, b, x, mask=mask), fullgraph=True, dynamic=False)
    got, want = compiled(params, buffers, batch), fn(params, buffers, batch, mask=mask)
    _close((got[0], got[1]), ({k: v.double() for k, v in want[0].items()}, want[1].double()), 1e-5)
