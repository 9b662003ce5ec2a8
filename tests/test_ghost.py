"""Ghost clipping and the other methods of clipped_grad_sum, against the per-sample-gradient engine.

The reference is ``clip_and_sum(per_sample_grads(loss_fn)(...))`` (itself checked against the
float64 one-sample-at-a-time oracle in test_per_sample.py). Tolerances: relative 1e-5 in float64
(measured: ~1e-15) and 1e-4 in float32, relative to the largest norm / the sum's norm.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vmapdp
from dataclasses import replace

from vmapdp import clipped, ghost, precision
from vmapdp.ghost import conv, limits, linear, uses
from vmapdp.noise.spent import unreleased
from optree import tree_leaves as _leaves
from zoo import CASES, Case, Recurrent, _fixed, _seq, setup

C = 0.3  # below most per-sample norms of the zoo, so clipping is active


def _to(tree, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tree.items()}


def _case(name, b=6, dtype=torch.float64, cases=CASES):
    case = next(c for c in cases if c.name == name)
    model, apply, params, buffers, batch, loss_fn = setup(case, b)
    batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
    return _to(params, dtype), _to(buffers, dtype), batch, loss_fn


def _reference(loss_fn, params, buffers, batch, mask, rule="clip"):
    grads = vmapdp.per_sample_grads(loss_fn)(params, buffers, batch)
    return vmapdp.clip_and_sum(grads, C, mask=mask, rule=rule)


def _assert_close(summed, norms, ref_summed, ref_norms, rtol):
    scale = ref_norms.abs().max().clamp_min(1e-12)
    assert (norms - ref_norms).abs().max() <= rtol * scale, (norms, ref_norms)
    total = math.sqrt(sum(float(v.square().sum()) for v in ref_summed.values()))
    for k in ref_summed:
        assert summed[k].shape == ref_summed[k].shape, k
        err = float((summed[k] - ref_summed[k]).norm())
        assert err <= rtol * max(total, 1e-12), (k, err, total)


MASK = torch.tensor([True, True, False, True, True, True])
METHODS = ["ghost", "two_pass", "auto"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_every_zoo_model_float64(name, method):
    params, buffers, batch, loss_fn = _case(name)
    ref = _reference(loss_fn, params, buffers, batch, MASK)
    summed, norms, losses = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method=method, norm_chunk_size=4)(params, buffers, batch, mask=MASK)
    _assert_close(summed, norms, *ref, rtol=1e-5)
    assert summed.keys() == params.keys() and all(v.dtype == torch.float64 for v in summed.values())
    assert losses.shape == (6,) and losses[2] == 0 and norms[2] == 0


@pytest.mark.parametrize(
    "name",
    ["linear", "conv2d_groups_reflect", "conv3d_same_replicate", "embedding_repeated_tokens", "tied_weights", "multihead_attention", "lstm_via_fix"],
)
def test_float32(name):
    params, buffers, batch, loss_fn = _case(name, dtype=torch.float32)
    ref = _reference(loss_fn, params, buffers, batch, MASK)
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, buffers, batch, mask=MASK)
    _assert_close(summed, norms, *ref, rtol=1e-4)
    assert norms.dtype == torch.float32


@pytest.mark.parametrize("path", ["patches", "grouped-recomputed", "grouped-kept-sliced"])
@pytest.mark.parametrize("name", ["conv1d_stride_dilation_padding", "conv2d_groups_reflect", "conv2d_circular_stride", "conv3d_same_replicate", "groupnorm",
                                  "conv_transpose1d_dilation", "conv_transpose3d", "conv_transpose2d_stride_output_padding_groups"])
def test_conv_paths(name, path, monkeypatch):
    """The zoo's small convs take the grouped path with kept per-sample grads of the whole batch
    in one grouped backward (tested above); force the others: unfolded patches (wide convs), a
    clipped sum by conv backward (over the keep budget), and kept grads made one sample per
    grouped backward (many input channels), copied into one tensor."""
    if path == "patches":
        monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, grouped_conv_max=0))
    elif path == "grouped-kept-sliced":
        monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, grouped_channels=1))
    else:
        monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0))
    params, buffers, batch, loss_fn = _case(name)
    ref = _reference(loss_fn, params, buffers, batch, MASK)
    out = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, buffers, batch, mask=MASK)
    _assert_close(out[0], out[1], *ref, rtol=1e-5)


# (dims, n, C_in, C_out, padded input size, kernel, stride, dilation)
GRAM_CONVS = [
    (2, 1, 5, 7, (6, 6), (3, 3), (1, 1), (1, 1)),
    (2, 1, 4, 6, (9, 7), (3, 2), (2, 1), (1, 2)),
    (2, 3, 4, 5, (6, 5), (2, 3), (1, 2), (2, 1)),  # n = 3: a sample holding 3 images
    (1, 1, 6, 4, (11,), (3,), (2,), (3,)),
    (3, 2, 3, 4, (5, 4, 6), (2, 2, 3), (1, 2, 1), (2, 1, 1)),
]


@pytest.mark.parametrize("dims, n, c_in, c_out, size, kernel, stride, dilation", GRAM_CONVS)
def test_conv_grams_from_the_input_gram_equal_the_patches_grams(dims, n, c_in, c_out, size, kernel, stride, dilation):
    """<patch_t, patch_s> = sum_k <x[i_tk], x[i_sk]>: the Gram without unfolded patches, for
    every conv geometry (1-3 dims, strides, dilations, several images per sample)."""
    g = torch.Generator().manual_seed(len(size) + n)
    b = 3
    x = torch.randn((b, n, c_in) + size, generator=g, dtype=torch.float64)
    out = tuple((s - dl * (k - 1) - 1) // st + 1 for s, k, st, dl in zip(size, kernel, stride, dilation))
    gout = torch.randn((b, n, c_out) + out, generator=g, dtype=torch.float64)
    use = uses.Use(conv.CONV, gout, x, (c_out, c_in) + kernel, (dims, stride, dilation, 1))
    gu, gv = conv.conv_grams(use)
    u, v = conv.conv_pair(use, torch.float64)
    torch.testing.assert_close(gu, u @ u.transpose(1, 2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gv, v @ v.transpose(1, 2), rtol=1e-12, atol=1e-12)
    # and the norms they give are the per-sample grads' (the conv backward of each sample alone)
    sq, _ = uses.from_grams(gu, gv, torch.float64)
    per = conv.conv_per_sample(use)
    torch.testing.assert_close(sq, per.flatten(1).square().sum(1), rtol=1e-10, atol=0)


def _conv_path_spied(monkeypatch, input_gram: bool) -> list:
    """Forces the patches' Gram from the input's Gram (or from unfolded patches) and returns the
    list that records each call of the forced path's function."""
    monkeypatch.setattr(conv, "input_gram_cheaper", lambda *a: input_gram)
    calls = []
    spied = "conv_grams" if input_gram else "conv_pair"
    real = getattr(conv, spied)
    monkeypatch.setattr(conv, spied, lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.mark.parametrize("input_gram", [True, False])
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_wide_convs_take_the_gram_path_and_match_the_reference(input_gram, dtype, rtol, monkeypatch):
    """Wide channels on small feature maps: ghost norms from float64 Grams, the patches' Gram
    either from the input's Gram or from unfolded patches (both forced), and a conv backward for
    the clipped sum; equal to the per-sample-gradient engine. A float64 model's convs take the
    direct path instead (their squares can underflow: ``uses.float64_factors``): patches, no Grams."""
    calls = _conv_path_spied(monkeypatch, input_gram)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 40, 3, padding=1), nn.ReLU(), nn.Conv2d(40, 128, 3, stride=2, padding=1), nn.ReLU(),
                          nn.Conv2d(128, 64, (2, 3), dilation=(2, 1)), nn.Flatten(), nn.LazyLinear(4))
    x = torch.randn(6, 3, 7, 7)
    model(x[:1])
    model = model.to(dtype)
    apply, params, buffers = vmapdp.functionalize(model)
    y = torch.randint(0, 4, (6,))

    def loss_fn(p, b, sample):
        xs, ys = sample
        return F.cross_entropy(apply(p, b, xs[None]), ys[None])

    batch = (x.to(dtype), y)
    ref = _reference(loss_fn, params, buffers, batch, MASK)
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, buffers, batch, mask=MASK)
    _assert_close(summed, norms, *ref, rtol=rtol)
    if dtype == torch.float32:
        assert len(calls) == 2  # the two wide convs went through the Grams
    else:
        assert len(calls) == (0 if input_gram else 2)  # float64: no input Grams; the patches, for the direct outer products


@pytest.mark.parametrize("input_gram", [True, False])
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_transposed_convs_are_covered_on_every_path(input_gram, dtype, rtol, monkeypatch):
    """Transposed convs (a generator's upsampling, a U-Net's decoder): ghost covers them fully (the
    conv's use with the roles of input and output grads swapped), small ones by the grouped conv
    backward, wide ones (float32) by Grams from the output grads' own Gram or from patches; equal
    to the per-sample-gradient engine, stride, padding, output_padding, dilation and groups."""
    calls = _conv_path_spied(monkeypatch, input_gram)
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(3, 48, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),  # few channels: grouped
                          nn.ConvTranspose2d(48, 96, (2, 3), stride=(1, 2), dilation=(2, 1)), nn.Tanh(),  # wide: Grams (float32)
                          nn.ConvTranspose2d(96, 4, 3, padding=1, groups=4), nn.Flatten(), nn.LazyLinear(4))  # groups: grouped
    x = torch.randn(6, 3, 2, 2)  # (small maps: T^2 (du + dv) < T du dv, the Grams are cheaper)
    model(x[:1])
    model = model.to(dtype)
    apply, params, buffers = vmapdp.functionalize(model)

    def loss_fn(p, b, sample):
        xs, ys = sample
        return F.cross_entropy(apply(p, b, xs[None]), ys[None])

    batch = (x.to(dtype), torch.randint(0, 4, (6,)))
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
    plan = fn.prepare(params, buffers, batch)
    assert plan.other == [] and vmapdp.ghost.coverage(plan, params) == 1.0, plan.describe(params)
    calls.clear()
    summed, norms, _ = fn(params, buffers, batch, mask=MASK)
    _assert_close(summed, norms, *_reference(loss_fn, params, buffers, batch, MASK), rtol=rtol)
    # the wide one went through the Grams (float32), or the patches of the direct path (float64)
    assert len(calls) == (0 if dtype == torch.float64 and input_gram else 1)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("mode", ["instance statistics", "running statistics (eval)", "running statistics updated (train)"])
def test_instance_norm_affines_are_covered(dims, mode):
    """``F.instance_norm``'s affine runs as ``mul`` and ``add`` on views of its weight and bias
    (plan.TRACED_THROUGH): covered, exact, with the sample's own statistics or the running ones
    (eval). Running statistics updated in place (training with ``track_running_stats=True``) run
    the op itself, which is refused with the fix, as before."""
    torch.manual_seed(dims)
    norm = getattr(nn, f"InstanceNorm{dims}d")(4, affine=True, track_running_stats=mode != "instance statistics")
    model = nn.Sequential(getattr(nn, f"Conv{dims}d")(2, 4, 3, padding=1), norm, nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4**dims, 3)).double()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
        if norm.running_mean is not None:
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
    model.train(mode != "running statistics (eval)")
    apply, params, buffers = vmapdp.functionalize(model)
    x = torch.randn((6, 2) + (4,) * dims, dtype=torch.float64)
    batch = (x, torch.randint(0, 3, (6,)))

    def loss_fn(p, b, sample):
        xs, ys = sample
        return F.cross_entropy(apply(p, b, xs[None]), ys[None])

    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
    if mode == "running statistics updated (train)":
        with pytest.raises(vmapdp.errors.UnsupportedModuleError, match=r"InstanceNorm.d\): track_running_stats=True in training mode"):
            fn.prepare(params, buffers, batch)  # (refused with the fix, as before: it releases batch statistics)
        return
    plan = fn.prepare(params, buffers, batch)
    assert plan.other == [] and vmapdp.ghost.coverage(plan, params) == 1.0, plan.describe(params)
    summed, norms, _ = fn(params, buffers, batch, mask=MASK)
    _assert_close(summed, norms, *_reference(loss_fn, params, buffers, batch, MASK), rtol=1e-10)


TRANSPOSED = {  # name: (dims, C_in, C_out, kwargs of the call, a sample's input shape)
    "output_padding >= stride (dilation > stride)": (1, 2, 3, dict(stride=1, dilation=2, output_padding=1), (1, 2, 3)),
    "2-D, output_padding 2 >= stride 2, dilation 3": (2, 2, 4, dict(stride=2, dilation=3, output_padding=2, padding=1), (1, 2, 3, 3)),
    "padding differs per dim": (2, 3, 2, dict(stride=(2, 1), padding=(2, 0), output_padding=(1, 0)), (1, 3, 4, 3)),
    "3 images per sample, groups": (2, 4, 6, dict(stride=2, padding=1, groups=2), (3, 4, 3, 3)),
    "unbatched input, 3-D": (3, 2, 2, dict(stride=(1, 2, 1), padding=(0, 1, 1), dilation=(2, 1, 1)), (2, 2, 3, 2)),
}


@pytest.mark.parametrize("path", ["kept", "grouped-recomputed", "patches-recomputed"])
@pytest.mark.parametrize("name", list(TRANSPOSED))
def test_transposed_conv_geometries(name, path, monkeypatch):
    """Transposed convs called as functions (keyword arguments), over geometries the module tests
    do not reach: an output_padding past the stride (legal where dilation > stride: the adjoint
    conv would read rows past the input's last position), padding that differs per dim, a sample
    holding several images, an unbatched 3-D input; every per-sample path; exact in float64."""
    dims, c_in, c_out, kwargs, shape = TRANSPOSED[name]
    if path != "kept":
        monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0, grouped_conv_max=0 if path.startswith("patches") else 4096))
    g = torch.Generator().manual_seed(len(name))
    groups = kwargs.get("groups", 1)
    params = {"w": torch.randn((c_in, c_out // groups) + (3,) * dims, generator=g, dtype=torch.float64),
              "b": torch.randn(c_out, generator=g, dtype=torch.float64)}
    conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]

    def loss(p, x):
        return torch.tanh(conv_t(input=x, weight=p["w"], bias=p["b"], **kwargs)).square().sum()

    x = torch.randn((5,) + shape, generator=g, dtype=torch.float64)
    fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
    assert fn.prepare(params, x).other == []
    mask = torch.tensor([True, False, True, True, True])
    summed, norms, _ = fn(params, x, mask=mask)
    _assert_close(summed, norms, *vmapdp.clip_and_sum(vmapdp.testing.microbatch_grads(loss, params, x), C, mask=mask), rtol=1e-10)


@pytest.mark.parametrize("mode, padding_idx, weighted", [("sum", None, False), ("sum", 0, True), ("mean", 0, False), ("mean", -20, False), ("max", 0, False), ("max", None, False)])
def test_embedding_bags_are_covered_as_embeddings(mode, padding_idx, weighted):
    """``nn.EmbeddingBag`` on bags given as rows (several bags per sample): the tracer runs it as
    ``F.embedding`` and each bag's sum / weighted sum / mean / max over its non-padding entries
    (an empty bag gives 0), so the embedding rule covers the table; exact against the one-sample
    oracle. Bags given by offsets run the op itself (a per-sample view, exact)."""

    class Bags(nn.Module):
        def __init__(self, offsets=False):
            super().__init__()
            self.bag, self.head, self.offsets = nn.EmbeddingBag(20, 4, mode=mode), nn.Linear(4, 3), offsets
            with torch.no_grad():
                self.bag.weight[3] = self.bag.weight[4]  # tied maxima: the op's gradient goes to the first
                self.bag.weight[0] *= 5  # a padding row that is not zero (as after a noisy step): excluded all the same

        def forward(self, x):
            if self.offsets:  # (F.embedding_bag called as a function: a negative padding_idx reaches it as it is)
                return self.head(F.embedding_bag(x.reshape(-1), self.bag.weight, torch.arange(0, x.numel(), x.shape[-1]), mode=mode, padding_idx=padding_idx))
            w = x.double() / 10 if weighted else None
            return self.head(F.embedding_bag(x, self.bag.weight, mode=mode, per_sample_weights=w, padding_idx=padding_idx))

    torch.manual_seed(0)
    x = torch.randint(0, 20, (6, 2, 5))
    x[0, 0, :3] = 0
    x[1, 1] = 0  # a bag of padding only (when padding_idx is 0)
    x[3, 0] = torch.tensor([3, 4, 3, 4, 4])  # a bag of two tokens with equal rows: tied in every dim (row 2 is masked)
    batch = (x, torch.randint(0, 3, (6, 2)))
    for offsets in (False, True):
        if offsets and (weighted or mode == "max"):
            continue
        apply, params, buffers = vmapdp.functionalize(Bags(offsets).double())

        def loss_fn(p, b, sample):
            return F.cross_entropy(apply(p, b, sample[0]), sample[1])

        fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
        with warnings.catch_warnings():  # (the offsets case: torch's per-sample loop for embedding_bag warns)
            if offsets:
                warnings.filterwarnings("ignore", "There is a performance drop", UserWarning)
            assert fn.prepare(params, buffers, batch).other == (["bag.weight"] if offsets else [])
            summed, norms, _ = fn(params, buffers, batch, mask=MASK)
        want = vmapdp.clip_and_sum(vmapdp.testing.microbatch_grads(loss_fn, params, buffers, batch), C, mask=MASK)
        _assert_close(summed, norms, *want, rtol=1e-10)


def test_the_replaced_norm_and_bag_ops_keep_their_errors_and_compile():
    """What the ops refuse is refused as before (a one-element instance norm in training, an
    embedding bag's max_norm, with vmapdp's fix), and the compiled step over both and a transposed
    conv equals the eager one (dynamo, backend "eager")."""
    norm = nn.Sequential(nn.Conv2d(2, 4, 1), nn.InstanceNorm2d(4, affine=True), nn.Flatten(), nn.Linear(4, 3))
    apply, params, buffers = vmapdp.functionalize(norm)

    def loss_fn(p, b, sample):
        return F.cross_entropy(apply(p, b, sample[0][None]), sample[1][None])

    one = (torch.randn(4, 2, 1, 1), torch.randint(0, 3, (4,)))
    with pytest.raises(ValueError, match="Expected more than 1 spatial element"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, buffers, one)
    renorm = nn.Sequential(nn.EmbeddingBag(10, 4, max_norm=1.0), nn.Linear(4, 3))
    apply_r, params_r, buffers_r = vmapdp.functionalize(renorm)
    with pytest.raises(vmapdp.errors.UnsupportedModuleError, match="max_norm=1.0"):
        vmapdp.clipped_grad_sum(lambda p, b, s: apply_r(p, b, s[None]).sum(), l2_clip_norm=C, method="ghost")(params_r, buffers_r, torch.randint(0, 10, (4, 3)))

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag, self.conv, self.norm = nn.EmbeddingBag(10, 4, mode="max", padding_idx=0), nn.Conv1d(1, 3, 2), nn.InstanceNorm1d(3, affine=True)
            self.up, self.head = nn.ConvTranspose1d(3, 2, 3, stride=2, padding=1, output_padding=1), nn.Linear(12, 3)

        def forward(self, tokens):
            return self.head(self.up(self.norm(self.conv(self.bag(tokens)[:, None]))).flatten(1))

    torch.manual_seed(0)
    apply_b, params_b, buffers_b = vmapdp.functionalize(Both())

    def loss_b(p, b, sample):
        return F.cross_entropy(apply_b(p, b, sample[0]), sample[1])

    g = torch.Generator().manual_seed(0)
    probe_batch = (torch.randint(0, 10, (4, 1, 5), generator=g), torch.randint(0, 3, (4, 1), generator=g))
    assert vmapdp.clipped_grad_sum(loss_b, l2_clip_norm=C, method="ghost").prepare(params_b, buffers_b, probe_batch).other == []
    sgd = vmapdp.optim.sgd(0.1)

    def make(compile):
        return vmapdp.make_train_step(loss_b, sgd, l2_clip_norm=C, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, method="ghost", compile=compile)

    eager, compiled = make(False), make("eager")
    s_e = s_c = vmapdp.init_train_state(params_b, sgd, seed=0)
    g = torch.Generator().manual_seed(0)
    for mask in (torch.tensor([True, True, False, True]), torch.tensor([False, True, True, True])):
        batch = (torch.randint(0, 10, (4, 1, 5), generator=g), torch.randint(0, 3, (4, 1), generator=g))
        s_e, _ = eager(s_e, batch, mask, buffers_b)
        s_c, _ = compiled(s_c, batch, mask, buffers_b)
    for k in params_b:
        torch.testing.assert_close(s_c.params[k], s_e.params[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t, d_in, d_out", [(2, 8, 8), (9, 3, 4), (1, 5, 1)])
def test_pair_norms_ghost_and_direct_agree_with_the_outer_product(t, d_in, d_out):
    """Both branches of the per-layer choice (Gram matrices when 2T small, else g^T x)."""
    g = torch.Generator().manual_seed(t)
    u, v = torch.randn(4, t, d_out, generator=g, dtype=torch.float64), torch.randn(4, t, d_in, generator=g, dtype=torch.float64)
    want = torch.einsum("bto,bti->boi", u, v).square().sum((1, 2))
    sq, margin, _ = linear.pair_sq_norms(u, v)
    torch.testing.assert_close(sq, want, rtol=1e-12, atol=0)
    assert (margin > 0).all() and (margin < 1e-10 * want.sqrt()).all()  # float64: a negligible margin
    assert (t * (d_in + d_out) < d_in * d_out) == (t == 2)  # the cases cover both branches


def test_embedding_padding_idx_and_long_sequences():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=1), nn.Flatten(), nn.Linear(4 * 30, 2)).double()
    apply, params, buffers = vmapdp.functionalize(model)
    tokens = torch.randint(0, 6, (5, 30))  # 30 positions over 6 tokens: many repeats, and the padding token

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    batch = (tokens, torch.tensor([0, 1, 0, 1, 1]))
    ref = _reference(loss_fn, params, buffers, batch, None)
    out = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, buffers, batch)
    _assert_close(out[0], out[1], *ref, rtol=1e-5)
    assert out[0]["0.weight"][1].abs().max() == 0  # the padding row never gets a gradient


def test_normalize_rule_and_frozen_params():
    params, buffers, batch, loss_fn = _case("frozen_params")
    ref = _reference(loss_fn, params, buffers, batch, MASK, rule="normalize")
    out = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost", rule="normalize")(params, buffers, batch, mask=MASK)
    _assert_close(out[0], out[1], *ref, rtol=1e-5)
    assert "0.weight" not in out[0]  # frozen: a buffer, never clipped or summed


def _nan_setup():
    params, buffers, batch, loss_fn = _case("linear")
    x, y = batch
    x = x.clone()
    x[2] = math.nan  # a padded row full of NaN
    x[4, 0] = math.inf  # a real row whose gradient is not finite
    return params, buffers, (x, y), loss_fn


@pytest.mark.parametrize("method", METHODS)
def test_nan_rows_contribute_exactly_nothing(method):
    params, buffers, batch, loss_fn = _nan_setup()
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method=method)
    summed, norms, _ = fn(params, buffers, batch, mask=MASK)
    keep = torch.tensor([True, True, False, True, False, True])
    ref = _reference(loss_fn, params, buffers, tuple(t[keep] for t in batch), None)
    assert all(torch.isfinite(v).all() for v in summed.values())
    _assert_close(summed, norms[keep], ref[0], ref[1], rtol=1e-5)
    assert norms[2] == 0 and not torch.isfinite(norms[4])  # padded: 0; dropped: visible as non-finite
    with pytest.raises(FloatingPointError, match=r"samples \[4\] are not finite"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method=method, nonfinite="raise")(params, buffers, batch, mask=MASK)


@pytest.mark.parametrize("name", ["linear", "linear_on_sequence_mse", "embedding_repeated_tokens"])
def test_a_non_finite_row_adds_nothing_through_the_book_keeping_sums(monkeypatch, name):
    """Found by mutation testing: the test above keeps every per-sample grad (a small model), so a
    NaN row is zeroed there and ghost's book-keeping sums were never reached; with nothing kept, a
    non-finite row's weight 0 times its NaN would make the whole param's sum NaN (a release that
    depends on one example). Rows dropped, every sum finite and equal to the finite rows' alone."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0))
    params, buffers, batch, loss_fn = _case(name)
    first = batch[0].clone()
    if first.is_floating_point():
        first[1] = math.nan
    else:  # (token ids: the NaN enters through a param's use, the embedding's output scaled by the sample)
        params = {k: v.clone() for k, v in params.items()}
        first[1] = 0
        params[next(iter(params))][0, 0] = math.inf
    batch = (first, *batch[1:])
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, buffers, batch)
    finite = torch.isfinite(norms)
    assert not bool(finite[1]) and bool(finite.sum() >= 3)
    assert all(torch.isfinite(v).all() for v in summed.values())
    ref = _reference(loss_fn, params, buffers, tuple(t[finite] for t in batch), None)
    _assert_close(summed, norms[finite], ref[0], ref[1], rtol=1e-5)


def test_every_method_bounds_each_contribution_by_C():
    """One sample at a time: the clipped sum of a single sample has norm exactly min(norm, C)."""
    params, buffers, batch, loss_fn = _case("conv2d_circular_stride")
    for method in ("ghost", "two_pass"):
        fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method=method)
        for i in range(3):
            summed, norms, _ = fn(params, buffers, tuple(t[i : i + 1] for t in batch))
            total = math.sqrt(sum(float(v.square().sum()) for v in summed.values()))
            assert total == pytest.approx(min(float(norms[0]), C), rel=1e-9)


def _tree(x):
    return _leaves(x, namespace="torch")


def _fake_clock(monkeypatch, seconds):
    """Replace auto's timer: each method 'takes' ``seconds[name]``; returns the list of timed names."""
    timed = []

    def elapsed(name, run, device):
        run()
        timed.append(name)
        return seconds[name]

    monkeypatch.setattr(clipped, "_elapsed", elapsed)
    return timed


@pytest.mark.parametrize("faster", ["ghost", "vmap"])
def test_auto_times_ghost_and_vmap_once_per_shape_and_runs_the_faster(monkeypatch, faster):
    timed = _fake_clock(monkeypatch, {"ghost": 1.0, "vmap": 2.0} if faster == "ghost" else {"ghost": 2.0, "vmap": 1.0})
    params, buffers, batch, loss_fn = _case("linear")
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C)
    want = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method=faster)(params, buffers, batch, mask=MASK)
    got = fn(params, buffers, batch, mask=MASK)
    assert sorted(timed) == ["ghost"] * limits.LIMITS.auto_rounds + ["vmap"] * limits.LIMITS.auto_rounds
    assert list(fn.chosen_methods.values()) == [faster]
    for a, b in zip(_tree(got), _tree(want)):  # the faster method's very numbers
        assert torch.equal(a, b)
    fn(params, buffers, batch, mask=MASK)  # same shapes: no second race
    fn(params, buffers, tuple(t[:3] for t in batch))  # a new shape: a new race
    assert len(timed) == 4 * limits.LIMITS.auto_rounds and len(fn.chosen_methods) == 2


def test_auto_races_only_the_methods_that_apply(monkeypatch):
    timed = _fake_clock(monkeypatch, {"ghost": 1.0, "vmap": 2.0})
    params, buffers, batch, loss_fn = _case("linear")
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, auto_vmap_elements=6 * sum(v.numel() for v in params.values()) - 1))
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C)
    fn(params, buffers, batch)  # vmap's per-sample grads would not fit: ghost, untimed
    assert timed == [] and list(fn.chosen_methods.values()) == ["ghost"]

    w = torch.randn(2, 3, dtype=torch.float64)  # only `x * W.sum(0)` (a reduced copy): no covered op, so vmap, untimed

    def matmul_loss(p, sample):
        return (sample * p["w"].sum(0)).square().sum()

    fn = vmapdp.clipped_grad_sum(matmul_loss, l2_clip_norm=C)
    x = torch.randn(4, 3, dtype=torch.float64)
    summed, norms, _ = fn({"w": w}, x)
    assert timed == [] and list(fn.chosen_methods.values()) == ["vmap"]
    ref = vmapdp.clip_and_sum(vmapdp.per_sample_grads(matmul_loss)({"w": w}, x), C)
    _assert_close(summed, norms, *ref, 1e-12)
    assert clipped.auto_candidates(None, {"w": w}, 10) == ["vmap"]  # (the only method left)


def test_auto_races_two_pass_where_vmap_would_not_fit_and_its_chunk_is_smaller_than_the_batch(monkeypatch):
    """A model too large for vmap's whole batch (GPT-2 small: 32 x 124M per-sample elements) gets
    ``two_pass`` in the race, its default chunk or the one named; where that chunk holds the whole
    batch (vmap's memory, over the budget) it is not raced. The winner's very numbers are returned."""
    params, buffers, batch, loss_fn = _case("linear")
    elements = sum(v.numel() for v in params.values())
    plan = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C).prepare(params, buffers, batch)
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, auto_vmap_elements=6 * elements - 1, two_pass_elements=2 * elements))
    assert clipped.auto_candidates(plan, params, 6) == ["ghost", "two_pass"]
    assert clipped.auto_candidates(plan, params, 2) == ["ghost", "vmap"]  # (within the budget)
    assert clipped.auto_candidates(None, params, 6) == ["two_pass"]  # (no ghost: chunks, not the whole batch)
    assert clipped.auto_candidates(plan, params, 6, norm_chunk_size=6) == ["ghost"]  # (the whole batch at once)
    assert clipped.auto_candidates(None, params, 6, norm_chunk_size=6) == ["vmap"]
    timed = _fake_clock(monkeypatch, {"ghost": 2.0, "two_pass": 1.0})
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C)
    got = fn(params, buffers, batch, mask=MASK)
    assert sorted(timed) == ["ghost"] * limits.LIMITS.auto_rounds + ["two_pass"] * limits.LIMITS.auto_rounds
    assert list(fn.chosen_methods.values()) == ["two_pass"]
    want = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="two_pass", norm_chunk_size=2)(params, buffers, batch, mask=MASK)
    for a, b in zip(_tree(got), _tree(want)):
        assert torch.equal(a, b)


def test_data_dependent_control_flow_is_refused():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(3, 3).double(), nn.Linear(3, 2).double()
    params = {"a": lin1.weight.detach(), "b": lin2.weight.detach()}

    def loss_fn(p, sample):
        x, y = sample
        h = F.linear(x, p["a"])
        for _ in range(int(y)):  # the number of layers depends on the label (not vmap-able anyway)
            h = F.linear(h, p["a"])
        return F.linear(h, p["b"]).sum()

    with pytest.raises(ValueError, match=r"reads a per-sample tensor's value in Python.*torch.where\(cond, a, b\) instead of an if"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, (torch.randn(2, 3, dtype=torch.float64), torch.tensor([0, 1])))


def test_an_op_vmap_cannot_batch_on_a_per_sample_copy_is_explained():
    """Found by review: W.narrow(0, a tensor start, n), a use no rule covers, ran on ghost's per-sample
    copies of W and gave torch's raw "Batching rule not implemented for aten::narrow.Tensor". The
    error names the op and the fixes; method='vmap' (W not batched) runs it."""
    params = {"pos": torch.randn(16, 3), "head": torch.randn(2, 3)}
    off = torch.tensor(2)

    def loss(p, x):
        return F.linear(torch.tanh(x + p["pos"].narrow(0, off, 4)), p["head"]).square().mean()

    x = torch.randn(3, 4, 3)
    assert vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="vmap")(params, x)[1].shape == (3,)
    with pytest.raises(vmapdp.UnsupportedModuleError, match=r"no batching rule for aten::narrow.Tensor.*int\(start\).*method='vmap'"):
        vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")(params, x)


def test_bad_arguments():
    loss_fn = lambda p, s: p["w"].sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"method='fast' must be one of"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="fast")
    with pytest.raises(ValueError, match=r"norm_chunk_size=0"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, norm_chunk_size=0)
    with pytest.raises(ValueError, match=r"l2_clip_norm=-1"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=-1.0)
    with pytest.raises(ValueError, match=r"make_train_step.*method='fast'"):
        vmapdp.make_train_step(loss_fn, vmapdp.optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, sample_rate=0.1, method="fast")


@pytest.mark.parametrize("method", ["vmap", "ghost", "two_pass"])
def test_train_step_methods_agree(method, monkeypatch):
    """The whole DP step (same seed, so the same noise) is the same whatever the method."""
    config = vmapdp.train.step_config  # the noise key binds the method: unbind it here, to compare the rest
    monkeypatch.setattr(vmapdp.train, "step_config", lambda **kw: config(**dict(kw, method="any")))
    params, buffers, batch, loss_fn = _case("conv2d_circular_stride", dtype=torch.float32)
    opt = vmapdp.optim.sgd(0.1)
    states = {}
    for m in ("vmap", method):
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=C, noise_multiplier=1.0, expected_batch_size=5.0, sample_rate=0.1, method=m, compile=False)
        state = vmapdp.init_train_state(params, opt, seed=3)
        with unreleased() if m != "vmap" else contextlib.nullcontext():  # the twin: the same noise, compared (vmapdp.noise.spent)
            for _ in range(2):
                state, metrics = step(state, batch, MASK, buffers)
        states[m] = (state, metrics)
    for k in params:
        torch.testing.assert_close(states[method][0].params[k], states["vmap"][0].params[k], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(states[method][1]["mean_grad_norm"], states["vmap"][1]["mean_grad_norm"], rtol=1e-4, atol=0)


def test_two_pass_runs_random_layers_once_per_sample():
    """two_pass sums the very per-sample grads it clipped, so a random layer (dropout) draws once per
    sample: with a forked RNG it equals vmap's clipped sum in one chunk."""
    params, buffers, batch, loss_fn = _case("linear")

    def dropout_loss(p, b, sample):
        x, y = sample
        return loss_fn(p, b, (F.dropout(x, 0.5, training=True), y))

    sums = []
    for method in ("vmap", "two_pass"):
        torch.manual_seed(0)
        sums.append(vmapdp.clipped_grad_sum(dropout_loss, l2_clip_norm=C, method=method, randomness="different")(params, buffers, batch, mask=MASK))
    _assert_close(sums[1][0], sums[1][1], sums[0][0], sums[0][1], rtol=1e-12)


def test_two_pass_takes_as_many_samples_at_a_time_as_its_limit_allows(monkeypatch):
    """Without norm_chunk_size, two_pass forms the per-sample grads of as many samples at a time
    as keep them under ``Limits.two_pass_elements`` (at least one): here 3 samples' worth, so
    chunks of 3; the sums are those of an explicit norm_chunk_size=3 (found: GPT-2 small's whole
    batch of per-sample grads, 16 GB, was killed by the OOM killer)."""
    params, buffers, batch, loss_fn = _case("linear")
    elements = sum(p.numel() for p in params.values())
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, two_pass_elements=3 * elements + 1))
    assert clipped.two_pass_chunk(params) == 3
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, two_pass_elements=1))
    assert clipped.two_pass_chunk(params) == 1  # (at least one sample)
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, two_pass_elements=3 * elements + 1))
    seen = []
    default = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="two_pass")
    real = default._grads_fn
    object.__setattr__(default, "_grads_fn", lambda p, *rest: (seen.append(_leaves(rest[-1], namespace="torch")[0].shape[0]), real(p, *rest))[1])
    got = default(params, buffers, batch, mask=MASK)
    b = MASK.numel()
    assert seen == [min(3, b - s) for s in range(0, b, 3)]
    want = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="two_pass", norm_chunk_size=3)(params, buffers, batch, mask=MASK)
    for k in got[0]:
        assert torch.equal(got[0][k], want[0][k])
    assert torch.equal(got[1], want[1])


def test_per_sample_grads_past_the_free_memory_are_refused_before_anything_runs(monkeypatch):
    """vmap's whole batch, or two_pass's chunk, of per-sample grads larger than the device's free
    memory is refused with the figures and the fix (the OOM killer gave no message at all); the
    same calls run where the memory fits or cannot be read."""
    free = clipped.available_bytes(torch.device("cpu"))  # (Linux: /proc/meminfo's MemAvailable and SwapFree)
    assert isinstance(free, int) and 2**20 < free < 2**50
    assert clipped.available_bytes(torch.device("meta")) is None
    params, buffers, batch, loss_fn = _case("linear")
    per_sample = sum(p.numel() * p.element_size() for p in params.values())
    b = MASK.numel()
    monkeypatch.setattr(clipped, "available_bytes", lambda device: 2 * per_sample)  # two samples' worth
    with pytest.raises(MemoryError, match=rf"method='vmap' would form the per-sample grads of {b} samples at once.*method='ghost'.*Nothing was computed"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="vmap")(params, buffers, batch, mask=MASK)
    with pytest.raises(MemoryError, match=r"method='two_pass' would form the per-sample grads of 3 samples.*norm_chunk_size=1 or smaller"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="two_pass", norm_chunk_size=3)(params, buffers, batch, mask=MASK)
    vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="two_pass", norm_chunk_size=2)(params, buffers, batch)  # (no masked row)
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, two_pass_elements=3 * sum(p.numel() for p in params.values())))
    with pytest.raises(MemoryError, match="two_pass.*3 samples"):  # (its default chunk, from the limit)
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="two_pass")(params, buffers, batch, mask=MASK)
    # a masked row makes clipping copy the grads once: twice the figure (found by review)
    monkeypatch.setattr(clipped, "available_bytes", lambda device: 3 * per_sample)
    vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="two_pass", norm_chunk_size=2)(params, buffers, batch)
    with pytest.raises(MemoryError, match=r"x 2: a masked row copies them"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="two_pass", norm_chunk_size=2)(params, buffers, batch, mask=~torch.eye(b, dtype=torch.bool)[0])
    # auto's race drops a refused vmap and runs ghost, as it drops one that ran out of memory (found by review)
    monkeypatch.setattr(clipped, "available_bytes", lambda device: 2 * per_sample)
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="auto")
    fn(params, buffers, batch, mask=MASK)
    assert set(fn.chosen_methods.values()) == {"ghost"}
    monkeypatch.setattr(clipped, "available_bytes", lambda device: None)  # (unknown: not checked)
    vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="vmap")(params, buffers, batch, mask=MASK)
    # params as any pytree of tensors, as every method takes them (found by review: .values() broke a tuple)
    names = sorted(params)
    tuple_loss = lambda p, b, sample: loss_fn(dict(zip(names, p)), b, sample)  # noqa: E731
    got = vmapdp.clipped_grad_sum(tuple_loss, l2_clip_norm=C, method="vmap")(tuple(params[k] for k in names), buffers, batch, mask=MASK)
    assert clipped.two_pass_chunk(tuple(params[k] for k in names)) == clipped.two_pass_chunk(params)
    assert len(got[0]) == len(names)


def test_ghost_with_dropout_clips_each_sample_by_its_own_mask():
    """One forward: the norm and the sum see the same dropout draw, so each contribution is <= C."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 2)).double()
    apply, params, buffers = vmapdp.functionalize(model)

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost", randomness="different")
    x = torch.randn(1, 4, dtype=torch.float64) * 10
    for _ in range(5):
        summed, norms, _ = fn(params, buffers, (x, torch.tensor([1])))
        total = math.sqrt(sum(float(v.square().sum()) for v in summed.values()))
        assert total == pytest.approx(min(float(norms[0]), C), rel=1e-9)


def test_one_function_serves_params_with_other_names_and_shapes():
    """The plan is cached per argument structure and shapes: a new layout gets a new plan."""

    def loss_fn(p, sample):
        x, y = sample
        w1, w2 = p.values()
        return F.cross_entropy(F.linear(torch.tanh(F.linear(x, w1)), w2)[None], y[None])

    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 3, dtype=torch.float64, generator=g), torch.tensor([0, 1, 0, 1]))
    for names, hidden in [(("a", "b"), 5), (("c", "d"), 5), (("a", "b"), 7)]:
        params = {names[0]: torch.randn(hidden, 3, dtype=torch.float64, generator=g), names[1]: torch.randn(2, hidden, dtype=torch.float64, generator=g)}
        ref = vmapdp.clip_and_sum(vmapdp.per_sample_grads(loss_fn)(params, batch), C)
        summed, norms, _ = fn(params, batch)
        _assert_close(summed, norms, *ref, rtol=1e-9)


# ---------------------------------------------------------------- found in review: each once a bug


def test_adversarial_cancellation_cannot_push_a_contribution_past_C():
    """Tokens sharing a large component with output grads of alternating sign: the T^2 terms of
    the ghost Gram sum cancel (in float32 the computed norm was 0.33 for a true 2.0, and the sample
    released 2C). Float64 Gram sums plus a rounding margin keep the contribution within C."""
    t, d = 256, 600
    w = torch.randn(d, d, generator=torch.Generator().manual_seed(0)) / d**0.5

    def loss_fn(p, sample):
        x, c = sample
        return (F.linear(x, p["W"])[:, 0] * c).sum()

    g = torch.Generator().manual_seed(5)
    shared, noise = 12.0 * torch.randn(d, generator=g), torch.randn(t, d, generator=g)
    sign = torch.ones(t)
    sign[1::2] = -1
    noise = noise * (2.0 / (sign[:, None] * noise).sum(0).norm())  # true per-sample norm: 2
    batch = ((shared + noise)[None], sign[None])
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="ghost")({"W": w}, batch)
    assert norms[0] == pytest.approx(2.0, rel=1e-3)
    assert float(summed["W"].norm()) <= 1.0 * (1 + 1e-6)


def test_long_sequences_are_clipped_accurately():
    """The clipped sum's error against float64 grew with the sequence length (relative 2e-6 at
    T = 8, 5.2e-4 at T = 256, 1.4e-3 at T = 512 on this model): every norm carried the float32
    rounding margin ``2 (T + 2) eps32 * mass`` (``~ T^1.5 eps32`` relative for benign samples),
    although sequences are summed in float64. Now the margin is float64's, with the float32 one as
    a floor that only samples with cancelling terms reach (engine._bound): bound 1e-5 at T = 256
    (measured 4e-7, flat in T). Float32, every sample clipped, the first layer on the Gram path."""
    from vmapdp.ghost.uses import gram_cheaper

    b, t, d = 3, 256, 640
    assert gram_cheaper(t, d, d)
    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 5)))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(b, t, d, generator=g), torch.randint(0, 5, (b, t), generator=g)

    def loss_fn(p, buffers, sample):
        return F.cross_entropy(apply(p, buffers, sample[0]), sample[1])

    c = 1e-4
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=c, method="ghost")(params, buffers, (x, y))
    p64 = {k: v.double() for k, v in params.items()}
    want, want_norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=c, method="vmap")(p64, buffers, (x.double(), y))
    assert (want_norms > c).all()
    total = sum(float(v.square().sum()) for v in want.values()) ** 0.5
    err = sum(float((summed[k].double() - want[k]).square().sum()) for k in want) ** 0.5
    assert err <= 1e-5 * total, err / total
    assert float(((norms.double() - want_norms) / want_norms).abs().max()) <= 1e-5


def test_a_branch_on_a_shared_value_is_refused_not_silently_replanned():
    p = {"W": torch.randn(4, 5, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}

    def loss_fn(p, flag, x):
        y = F.linear(x, p["W"], p["b"]) if bool(flag) else F.linear(x, p["W"]) + p["b"]
        return (y.tanh() ** 2).sum()

    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="ghost")
    x = torch.randn(3, 6, 5, dtype=torch.float64)
    fn(p, torch.tensor(False), x)
    with pytest.raises(RuntimeError, match=r"control flow.*method='vmap'"):
        fn(p, torch.tensor(True), x)


def test_writing_in_place_into_a_layer_input_is_refused():
    def loss_fn(p, x):
        h = x * 1.0
        y = F.linear(h, p["W"])
        h.mul_(3.0)  # the layer's saved input changes after the layer read it
        return (y * h.sum()).sum()

    with pytest.raises(RuntimeError, match=r"wrote in place into the input"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="ghost")({"W": torch.randn(3, 5)}, torch.randn(2, 5))


_WRITES = {
    "cast": lambda p: p["W"].double().mul_(2.0),
    "view": lambda p: p["W"][0:1].mul_(2.0),
    "operator": lambda p: p["W"].double().__iadd__(1.0),
    # found by review: item assignment and a functional's inplace=True (keyword or position) were
    # not seen (F.relu(W.double(), inplace=True): norms of another model, released silently)
    "setitem": lambda p: p["W"].__setitem__((0, 0), 5.0),
    "setitem of a cast": lambda p: p["W"].double().__setitem__(slice(0, 1), torch.zeros(5, dtype=torch.float64)),
    "inplace keyword": lambda p: F.relu(p["W"].double(), inplace=True),
    "inplace by position": lambda p: F.hardtanh(p["W"], -0.1, 0.1, True),
    # any other write shows in the cast's version counter (an aten overload's name has no trailing _;
    # the write lands first, so on a cast here: float64 params, a float32 cast)
    "version counter": lambda p: torch.ops.aten.mul_.Tensor(p["W"].float(), torch.tensor(2.0)),
    # found by the review of that fix: views the tracer does not follow (permute, select, diagonal...) of a
    # cast or of the param itself; the probe runs on copies, so the caller's params stay unchanged
    "an unfollowed view of a cast": lambda p: p["W"].float().permute(1, 0).mul_(2.0),
    "an unfollowed view of the param": lambda p: p["W"].diagonal().mul_(2.0),
    # a write the tracer does not see at all (torch functions disabled, through a detached alias): the params' own
    # counters, read once the forward is done
    "unseen": lambda p: _unseen_write(p["W"]),
}


def _unseen_write(w):
    with torch._C.DisableTorchFunction():
        w.detach().mul_(2.0)


@pytest.mark.parametrize("write", list(_WRITES))
def test_writing_in_place_into_a_param_or_its_cast_is_refused_before_it_lands(write):
    """Found by review: an in-place op on a cast of a param (W.double().mul_(2)) ran on the tracer's
    per-sample copy, not on the cast, and ghost differentiated another model than the user's (norms
    4x off); a write into a view of a param changed the caller's params before the refusal."""
    def loss_fn(p, x):
        w = _WRITES[write](p)
        if w is None or w.shape != p["W"].shape:
            w = p["W"]
        return F.linear(x, w).square().sum()

    params = {"W": torch.randn(3, 5, dtype=torch.float64)}
    before = params["W"].clone()
    with pytest.raises(vmapdp.UnsupportedModuleError, match=r"writes in place into a parameter, a cast of one.*out of place"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="ghost")(params, torch.randn(2, 5, dtype=torch.float64))
    assert torch.equal(params["W"], before)


def test_a_param_read_through_as_strided_gets_its_own_per_sample_grad():
    """Found by review: uncovered params ran as a stride-0 expand shared by the batch, whose
    as_strided backward gave every sample the batch's mean gradient: each sample's norm and share
    came from the others' data (a Toeplitz weight made with as_strided: 6.4 C between neighbouring
    sums). Each sample gets a copy laid out as the param is (a transposed one too)."""
    g = torch.Generator().manual_seed(0)
    n, k, b = 4, 3, 8
    params = {"v": 0.1 * torch.randn(2 * n - 1, dtype=torch.float64, generator=g), "head": 0.1 * torch.randn(n, k, dtype=torch.float64, generator=g).t()}

    def loss_fn(p, sample):
        x, y = sample
        toeplitz = p["v"].as_strided((n, n), (1, 1))  # T[i, j] = v[i + j]
        head = p["head"].as_strided((k, n), (1, k))  # the transposed param's own layout, read by strides
        return ((F.linear(toeplitz @ x, head) - y) ** 2).sum()

    x, y = torch.ones(b, n, dtype=torch.float64), torch.full((b, k), 5.0, dtype=torch.float64)
    x[0], y[0] = -40.0, -500.0  # one sample that pulls against the others
    ref = vmapdp.clip_and_sum(vmapdp.testing.microbatch_grads(loss_fn, params, (x, y)), C)
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, (x, y))
    _assert_close(summed, norms, *ref, rtol=1e-9)
    without = torch.ones(b, dtype=torch.bool)
    without[0] = False
    rest, _, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, (x, y), mask=without)
    moved = math.sqrt(sum(float((summed[key] - rest[key]).square().sum()) for key in summed))
    assert moved <= C * (1 + 1e-9), moved


def _check_against_vmap(loss_fn, params, batch, rtol=1e-9):
    ref = vmapdp.clip_and_sum(vmapdp.per_sample_grads(loss_fn)(params, batch), C)
    for method in ("ghost", "auto"):
        summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method=method)(params, batch)
        _assert_close(summed, norms, *ref, rtol=rtol)


def test_layers_inside_the_users_own_vmap_or_grad_are_uses_like_any_other():
    g = torch.Generator().manual_seed(0)
    p = {k: torch.randn(*s, dtype=torch.float64, generator=g) for k, s in [("W", (4, 5)), ("b", (4,)), ("W2", (2, 4))]}
    batch = (torch.randn(3, 6, 5, dtype=torch.float64, generator=g), torch.randn(3, 6, 2, dtype=torch.float64, generator=g))

    def inner_vmap(p, sample):
        x, y = sample
        h = torch.func.vmap(lambda xt: F.linear(xt, p["W"], p["b"]).tanh())(x)
        return ((F.linear(h, p["W2"]) - y) ** 2).sum()

    def input_gradient_penalty(p, sample):
        x, y = sample
        f = lambda xx: F.linear(torch.tanh(F.linear(xx, p["W"], p["b"])), p["W2"]).sum()  # noqa: E731
        return ((F.linear(x, p["W"], p["b"]).sum() - y.sum()) ** 2) + torch.func.grad(f)(x).square().sum()

    for loss_fn in (inner_vmap, input_gradient_penalty):
        _check_against_vmap(loss_fn, p, batch)


def test_nonstandard_linear_and_conv_arguments():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 5, dtype=torch.float64, generator=g)
    cases = [
        ({"w": torch.randn(5, dtype=torch.float64, generator=g)}, lambda p, s: F.linear(s, p["w"]).pow(2).sum()),
        ({"W": torch.randn(3, 5, dtype=torch.float64, generator=g), "b": torch.randn((), dtype=torch.float64, generator=g)}, lambda p, s: F.linear(s, p["W"], p["b"]).pow(2).sum()),
        ({"W": torch.randn(3, 5, dtype=torch.float64, generator=g), "b": torch.randn(2, 3, dtype=torch.float64, generator=g)}, lambda p, s: F.linear(s, p["W"], p["b"]).pow(2).sum()),
    ]
    for params, loss_fn in cases:
        _check_against_vmap(loss_fn, params, x)
    k = {"K": torch.randn(3, 2, 3, 3, dtype=torch.float64, generator=g)}
    images = torch.randn(2, 2, 5, 5, dtype=torch.float64, generator=g)
    _check_against_vmap(lambda p, s: F.conv2d(s, p["K"], padding=(1,), stride=[1]).pow(2).sum(), k, images)


def test_shape_and_dtype_queries_and_casts_keep_the_layers_covered():
    """Mixed precision casts every param (reading its dtype first): still all ghost, no per-sample copies."""
    params, buffers, batch, loss_fn = _case("linear", dtype=torch.float32)
    wrapped = vmapdp.mixed_precision(loss_fn, torch.bfloat16)
    plan = ghost.probe(wrapped, params, (buffers,), batch, "error")
    assert plan.other == [] and ghost.coverage(plan, params) == 1.0
    ref = vmapdp.clip_and_sum(vmapdp.per_sample_grads(wrapped)(params, buffers, batch), C)
    summed, norms, _ = vmapdp.clipped_grad_sum(wrapped, l2_clip_norm=C, method="ghost")(params, buffers, batch)
    _assert_close(summed, norms, *ref, rtol=2e-2)  # bf16 compute: the two paths round differently


@pytest.mark.parametrize("cast", [lambda w, x: w.contiguous(), lambda w, x: w.type_as(x), lambda w, x: w.cpu(), lambda w, x: w.resolve_conj(),
                                  lambda w, x: w.t().contiguous().t()])
def test_value_preserving_ops_on_a_param_keep_it_covered(cast):
    """Found by review: F.linear(x, W.contiguous()) (and type_as, cpu, resolve_conj) was refused
    as data-dependent control flow; they return the param's values as they are."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, generator=g), "v": torch.randn(2, 3, generator=g)}
    batch = (torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g))

    def loss_fn(p, sample):
        x, y = sample
        h = torch.tanh(F.linear(x, cast(p["w"], x)))
        return F.cross_entropy(F.linear(h, p["v"])[None], y[None])

    plan = ghost.probe(loss_fn, params, (), batch, "error")
    assert plan.other == [] and ghost.coverage(plan, params) == 1.0
    ref = vmapdp.clip_and_sum(vmapdp.per_sample_grads(loss_fn)(params, batch), C)
    _assert_close(*vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, batch)[:2], *ref, rtol=1e-5)


@pytest.mark.parametrize("method", ["vmap", "ghost", "two_pass"])
def test_chunked_step_equals_the_unchunked_one(method):
    """physical_batch_size bounds memory (B x params for vmap); the clipped sum is the same."""
    params, buffers, batch, loss_fn = _case("linear_on_sequence_mse", b=8)
    mask = torch.tensor([True, False, True, True, True, False, True, True])
    opt = vmapdp.optim.sgd(0.1)
    out = []
    for chunk in (None, 2, 4):
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=C, noise_multiplier=1.0, expected_batch_size=6.0, sample_rate=0.1,
                                      method=method, physical_batch_size=chunk, norm_chunk_size=3 if method == "two_pass" else None, compile=False)
        with unreleased():  # one state, three chunkings: the same noise, compared (vmapdp.noise.spent)
            state, _ = step(vmapdp.init_train_state(params, opt, seed=5), batch, mask, buffers)
        out.append(state.params)
    for other in out[1:]:
        for k in params:
            torch.testing.assert_close(other[k], out[0][k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype, big, small", [(torch.float32, 1e30, 1e-24), (torch.float64, 1e200, 1e-180)])
@pytest.mark.parametrize("rule", ["clip", "normalize"])
def test_extreme_values_cannot_overflow_the_rounding_margin(dtype, big, small, rule, monkeypatch):
    """Huge output grads times tiny inputs: a finite gradient whose margin's squares overflow
    (inf * 0 = NaN) once gave clip factor 1, an unclipped release (found in review). Now such a
    sample is dropped and counted as non-finite, like a sample whose gradient overflows."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0))  # the margin path, not kept per-sample grads
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(2, 2, dtype=dtype, generator=g)}
    x, y = torch.randn(3, 8, 2, dtype=dtype, generator=g), torch.randn(3, 8, 2, dtype=dtype, generator=g)
    x[0] *= small
    y[0] *= big

    def loss_fn(p, sample):
        xs, ys = sample
        return (ys * F.linear(xs, p["w"])).sum()

    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="ghost", rule=rule)(params, (x, y))
    assert torch.isfinite(summed["w"]).all() and float(summed["w"].norm()) <= 3.0
    if dtype == torch.float64:  # its factors are normalised per sample before they are squared (uses.pow2_normalized): clipped like vmap's
        ref = vmapdp.clip_and_sum(vmapdp.per_sample_grads(loss_fn)(params, (x, y)), 1.0, rule=rule)
        _assert_close(summed, norms, *ref, rtol=1e-9)
        return
    # float32: the margin's squares overflow: the sample is dropped, visibly (norm inf), never released unclipped
    assert norms[0] == math.inf
    ref = vmapdp.clip_and_sum(vmapdp.per_sample_grads(loss_fn)(params, (x[1:], y[1:])), 1.0, rule=rule)
    _assert_close(summed, norms[1:], *ref, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
@pytest.mark.parametrize("conv", [lambda: nn.Conv1d(2, 3, 4, padding="same"), lambda: nn.Conv2d(2, 3, (2, 4), padding="same", dilation=(1, 2))])
def test_same_padding_with_an_even_kernel_matches_the_per_sample_oracle(conv):
    """Found by mutation testing (the zoo's kernels are all odd): an even kernel's 'same' padding is
    uneven (one more on the right), and ghost pads the input itself: norms and sums equal vmap's."""
    torch.manual_seed(0)
    layer = conv().double()
    apply, params, buffers = vmapdp.functionalize(layer)
    x = torch.randn(4, 2, *([9] if isinstance(layer, nn.Conv1d) else [5, 11]), dtype=torch.float64)
    t = torch.randn(4, 3, *x.shape[2:], dtype=torch.float64)

    def loss_fn(p, b, s):
        return (apply(p, b, s[0][None]) * s[1][None]).sum()

    for c in (1e9, 0.5):
        summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=c, method="ghost")(params, buffers, (x, t))
        ref = vmapdp.clip_and_sum(vmapdp.per_sample_grads(loss_fn)(params, buffers, (x, t)), c)
        _assert_close(summed, norms, *ref, rtol=1e-9)


def test_the_mass_of_float64_factors_of_extreme_scale_is_not_lost_to_underflow():
    """Found by mutation testing (no test failed with the scaling dropped): sum_t |u_t| |v_t| of float64
    factors near 1e-170 and 1e150 is a normal number (about 1e-19) though |u_t| underflows; the
    margins and the float32 floor scale with it. Against the same sum taken in exact scaled steps."""
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(2, 3, 8, dtype=torch.float64, generator=g) * 1e-170, torch.randn(2, 3, 5, dtype=torch.float64, generator=g) * 1e150
    want = ((u * 1e170).norm(dim=2) * (v * 1e-150).norm(dim=2)).sum(1) * 1e-20
    got = linear.pair_mass(u, v)
    assert bool((got > 0).all())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_float64_factors_of_extreme_scale_on_a_wide_layer_are_clipped_like_vmap(monkeypatch):
    """Found by mutation testing: the test above uses a 2 x 2 weight over 8 positions, where the direct
    norm is cheaper anyway; on a wide layer over few positions the Gram path would run, and the squares
    of float64 factors at 1e152 and 1e-163 underflow: norm 0, the sample released unclipped (its true
    norm about 100 C at C = 1e-12). Such factors take the direct norm, as vmap's."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0))
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 16, dtype=torch.float64, generator=g)}
    x, y = torch.randn(3, 2, 16, dtype=torch.float64, generator=g), torch.randn(3, 2, 16, dtype=torch.float64, generator=g)
    x[0] *= 1e152
    y[0] *= 1e-163
    assert linear.gram_cheaper(2, 16, 16)  # (the shape where the Gram path is the cheaper one)

    def loss_fn(p, sample):
        xs, ys = sample
        return (ys * F.linear(xs, p["w"])).sum()

    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1e-12, method="ghost")(params, (x, y))
    ref = vmapdp.clip_and_sum(vmapdp.per_sample_grads(loss_fn)(params, (x, y)), 1e-12)
    assert float(norms[0]) > 10 * 1e-12
    _assert_close(summed, norms, *ref, rtol=1e-9)


# the zoo's two-layer LSTM over 6 steps made Inductor's compile 28 s of the suite; one layer over 3 steps uses the cell as often as the path needs
_SHORT_LSTM = Case("short_lstm", _fixed(lambda: Recurrent(nn.LSTM(4, 5, batch_first=True))), _seq(3, 4, 3))


@pytest.mark.parametrize("name", ["short_lstm", "embedding_repeated_tokens"])
def test_merged_uses_compile_with_fullgraph(name):
    """Params used many times (an RNN cell per time step, an embedding looked up twice) are
    joined once for the norms and the sum; that path compiles without graph breaks."""
    params, buffers, batch, loss_fn = _case(name, b=4, dtype=torch.float32, cases=[*CASES, _SHORT_LSTM])
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
    fn.prepare(params, buffers, batch)
    compiled = torch.compile(lambda p, b, x: fn(p, b, x, mask=MASK[:4]), fullgraph=True, dynamic=False)  # as make_train_step
    got, want = compiled(params, buffers, batch), fn(params, buffers, batch, mask=MASK[:4])
    _assert_close(got[0], got[1], want[0], want[1], rtol=1e-5)


def test_full_float32_turns_tf32_off_on_cuda_only_and_restores_it(monkeypatch):
    """cuDNN's default TF32 would break ghost clipping's float32 rounding margins on CUDA. The
    legacy allow_tf32 flags are used only on a torch without the fp32_precision API."""
    monkeypatch.setattr(precision, "_fp32_precision_flags", lambda: [])  # a torch < 2.9
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        with precision.full_float32("cpu"):
            assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        with pytest.raises(KeyError), precision.full_float32("cuda"):
            assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
            raise KeyError  # restored on the way out, also after an error
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul


def test_full_float32_uses_the_fp32_precision_api_when_torch_has_it():
    """TF32 set through torch's fp32_precision API (torch >= 2.9): writing or reading the legacy
    allow_tf32 flags then raises in torch, which made every step fail. The guard sets and restores
    fp32_precision only (the attributes exist on CPU builds too)."""
    b = torch.backends
    objs = [b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn]
    assert precision._fp32_precision_flags() == objs  # torch 2.13 has the API
    saved = [o.fp32_precision for o in objs]
    try:
        for o in objs:
            o.fp32_precision = "tf32"
        with pytest.raises(KeyError), precision.full_float32("cuda"):
            assert [o.fp32_precision for o in objs] == ["ieee"] * 3
            raise KeyError
        assert [o.fp32_precision for o in objs] == ["tf32"] * 3
        b.cuda.matmul.fp32_precision = "none"  # inherit: restored as it was
        with precision.full_float32("cuda"):
            assert b.cuda.matmul.fp32_precision == "ieee"
        assert b.cuda.matmul.fp32_precision == "none"
        with precision.full_float32("cpu"):
            assert b.cudnn.conv.fp32_precision == "tf32"
    finally:
        for o, v in zip(objs, saved):
            o.fp32_precision = v


def test_auto_vmap_budget_is_inclusive_and_the_race_leaves_the_rng_alone(monkeypatch):
    params, buffers, batch, loss_fn = _case("linear")
    n = 6 * sum(v.numel() for v in params.values())
    plan = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C).prepare(params, buffers, batch)
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, auto_vmap_elements=n))
    assert clipped.auto_candidates(plan, params, 6) == ["ghost", "vmap"]
    assert clipped.auto_candidates(plan, params, 7) == ["ghost"]

    # dropout draws from the global RNG: the race's runs must not move it
    _fake_clock(monkeypatch, {"ghost": 1.0, "vmap": 2.0})

    def dropout_loss(p, b, sample):
        x, y = sample
        return loss_fn(p, b, (F.dropout(x, 0.5, training=True), y))

    sums = []
    for method in ("auto", "ghost"):
        torch.manual_seed(0)
        sums.append(vmapdp.clipped_grad_sum(dropout_loss, l2_clip_norm=C, method=method, randomness="different")(params, buffers, batch))
    for a, b in zip(_tree(sums[0]), _tree(sums[1])):
        assert torch.equal(a, b)


def test_auto_races_with_tf32_off_and_drops_a_method_that_runs_out_of_memory(monkeypatch):
    import contextlib

    from vmapdp import train

    held = []

    @contextlib.contextmanager
    def guard(device_type):
        held.append(True)
        try:
            yield
        finally:
            held.pop()

    monkeypatch.setattr(clipped, "full_float32", guard)
    monkeypatch.setattr(train, "full_float32", guard)
    seen = []

    def elapsed(name, run, device):
        run()
        seen.append(bool(held))
        return 1.0

    monkeypatch.setattr(clipped, "_elapsed", elapsed)
    params, buffers, batch, loss_fn = _case("linear")
    vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C)(params, buffers, batch)
    step = vmapdp.make_train_step(loss_fn, vmapdp.optim.sgd(0.1), l2_clip_norm=C, noise_multiplier=1.0, expected_batch_size=6.0, sample_rate=0.1, compile=False)
    step(vmapdp.init_train_state(params, vmapdp.optim.sgd(0.1), seed=0), batch, torch.ones(6, dtype=torch.bool), buffers)
    assert len(seen) == 4 * limits.LIMITS.auto_rounds and all(seen)

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert clipped.race({"vmap": oom, "ghost": lambda: None}, torch.device("cpu")) == "ghost"
    with pytest.raises(torch.OutOfMemoryError):
        clipped.race({"vmap": oom, "ghost": oom}, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="a bug"):  # other errors are not swallowed
        clipped.race({"vmap": lambda: (_ for _ in ()).throw(RuntimeError("a bug")), "ghost": lambda: None}, torch.device("cpu"))


# ---------------------------------------------------------------- issue #15 (ghost part)


@pytest.mark.parametrize("method", ["ghost", "auto"])
def test_the_probe_leaves_the_rng_alone_a_first_step_equals_vmap(method, monkeypatch):
    """The probe (first call per shape) runs the loss once; its dropout draws must not move the
    global RNG (they did: the first ghost/auto step then differed from a vmap step from one seed)."""
    _fake_clock(monkeypatch, {"ghost": 1.0, "vmap": 2.0})  # auto picks ghost
    params, buffers, batch, loss_fn = _case("linear")

    def dropout_loss(p, b, sample):
        x, y = sample
        return loss_fn(p, b, (F.dropout(x, 0.5, training=True), y))

    sums = {}
    for m in ("vmap", method):
        torch.manual_seed(0)
        sums[m] = vmapdp.clipped_grad_sum(dropout_loss, l2_clip_norm=C, method=m, randomness="different")(params, buffers, batch)
    _assert_close(sums[method][0], sums[method][1], sums["vmap"][0], sums["vmap"][1], rtol=1e-9)
    torch.manual_seed(0)
    ghost.probe(dropout_loss, params, (buffers,), batch, "different")
    after_probe = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after_probe, torch.rand(3))


@pytest.mark.parametrize("form", ["weight_of_param", "scale_grad_by_freq", "inside_users_vmap"])
def test_embedding_padding_idx_on_per_sample_views_matches_the_oracle(form):
    """torch's batching rule zeroes the padding row's gradient for sample 0 only when the weight is
    batched (ghost's per-sample views): ~50% wrong gradients. Ghost now zeroes it by a where."""
    g = torch.Generator().manual_seed(0)
    params = {"E": torch.randn(7, 4, dtype=torch.float64, generator=g), "W": torch.randn(3, 4, dtype=torch.float64, generator=g)}
    x = torch.randint(0, 7, (6, 9), generator=g)
    x[:, ::3] = 2  # padding, at index -5 == 2
    y = torch.randint(0, 3, (6,), generator=g)

    def loss_fn(p, sample):
        tok, label = sample
        w = p["E"] * 1.0 if form == "weight_of_param" else p["E"]
        if form == "inside_users_vmap":
            e = torch.func.vmap(lambda t: F.embedding(t, w, padding_idx=-5))(tok[None])
        else:
            e = F.embedding(tok[None], w, padding_idx=-5, scale_grad_by_freq=form == "scale_grad_by_freq")
        return F.cross_entropy(F.linear(e.mean(1), p["W"]), label[None])

    ref = vmapdp.clip_and_sum(vmapdp.testing.microbatch_grads(loss_fn, params, (x, y)), C)
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, (x, y))
    _assert_close(summed, norms, *ref, rtol=1e-9)


def test_models_ghost_cannot_run_are_refused_with_the_feature_and_the_fix():
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))

    def run(model, wrap=None):
        apply, params, buffers = vmapdp.functionalize(model)

        def loss_fn(p, b, sample):
            xi, yi = sample
            out = wrap(lambda z: apply(p, b, z), xi[None]) if wrap else apply(p, b, xi[None])
            return F.cross_entropy(out, yi[None])

        return vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="ghost")(params, buffers, (x, y))

    for norm in (nn.utils.spectral_norm, nn.utils.parametrizations.spectral_norm):
        with pytest.raises(vmapdp.UnsupportedModuleError, match=r"out=.*spectral_norm.*model.eval\(\)"):
            run(nn.Sequential(norm(nn.Linear(5, 4)), nn.Tanh(), nn.Linear(4, 3)))
    tokens = torch.randint(0, 6, (4, 3))
    emb = nn.Sequential(nn.Embedding(6, 5, max_norm=1.0), nn.Flatten(), nn.Linear(15, 3))
    apply, params, buffers = vmapdp.functionalize(emb)
    with pytest.raises(vmapdp.UnsupportedModuleError, match=r"max_norm=1.0 .*renormalises .* in place.*expected max_norm=None"):
        vmapdp.clipped_grad_sum(lambda p, b, s: F.cross_entropy(apply(p, b, s[0][None]), s[1][None]), l2_clip_norm=1.0, method="ghost")(params, buffers, (tokens, y))
    from torch.utils.checkpoint import checkpoint

    mlp = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    with pytest.raises(vmapdp.UnsupportedModuleError, match=r"torch.utils.checkpoint.*saved tensor hooks.*without checkpoint"):
        run(mlp, wrap=lambda f, z: checkpoint(f, z, use_reentrant=False))


@pytest.mark.parametrize("training", [False, True])
def test_traced_batch_norm_keeps_the_ops_output_dtype(training):
    """Ghost runs F.batch_norm as its normalisation and affine (affine.batch_norm_affine): with a
    bfloat16 input and a float32 affine the op returns bfloat16, and so must the traced form, or
    the rest of the model would run in another dtype under ghost than under vmap (found by review)."""
    from vmapdp.ghost.affine import batch_norm_affine

    x = torch.randn(4, 3, 5).to(torch.bfloat16)
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    stats = (None, None) if training else (torch.randn(3), torch.rand(3) + 0.5)
    ref = F.batch_norm(x, *stats, w, b, training)
    out = batch_norm_affine(x, *stats, w, b, training)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_a_transpose_the_compiler_hides_is_refused_with_the_fix():
    """Under torch.compile, ``W.T`` (a property) never reaches ghost's tracer, so the compiled
    call sees the param used differently than the eager probe did: refused (never a wrong sum), and
    the error names the fix (``W.t()``, which compiles: the second half). Found by review."""
    params = {"w": torch.randn(5, 5, generator=torch.Generator().manual_seed(0))}
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1))
    for form, ok in (("T", False), ("t", True)):
        def loss(p, s, form=form):
            return (torch.tanh(s @ (p["w"].T if form == "T" else p["w"].t())) ** 2).sum()

        fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=1.0, method="ghost")
        fn.prepare(params, x)
        eager = fn(params, x)[0]["w"]
        torch._dynamo.reset()
        compiled = torch.compile(lambda p, s: fn(p, s), fullgraph=True, dynamic=False)
        if ok:
            assert torch.allclose(compiled(params, x)[0]["w"], eager, rtol=1e-5, atol=1e-7)
        else:
            with pytest.raises(Exception, match=r"write W\.t\(\) instead of W\.T"):
                compiled(params, x)


@pytest.mark.parametrize("keep", [0, 23, 24])
def test_a_param_only_an_uncovered_op_uses_beyond_the_keep_budget(monkeypatch, keep):
    """A param whose only use no ghost rule covers (its per-sample grads come from the per-sample
    view, ``other_grads``) and whose B x numel exceeds what is left of the keep budget (here 6 x 4 = 24
    elements > 0 or 23; 24 fits; by default 2**23, e.g. a 4.2M-element param at batch 2) once hit ``uses[0]`` of an
    empty list in ``_sq_norms`` (IndexError; found in review). Its norm comes from those grads."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=keep))
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 5, generator=g), "odd": torch.randn(4, generator=g)}
    x = torch.randn(len(MASK), 5, generator=g)

    def loss_fn(p, b, xi):
        return (torch.cumsum(p["odd"], 0) * F.linear(xi[None], p["w"])).sum()

    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, {}, x, mask=MASK)
    _assert_close(summed, norms, *_reference(loss_fn, params, {}, x, MASK), rtol=1e-5)


def _ghost_equals_vmap(loss, params, batch, *, keep_elements=None, monkeypatch=None):
    if keep_elements is not None:
        monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=keep_elements, keep_ratio=0.0))
    for c in (1e6, 1.0):  # unclipped, then clipped
        ref_summed, ref_norms, _ = vmapdp.clipped_grad_sum(loss, l2_clip_norm=c, method="vmap")(params, batch)
        summed, norms, _ = vmapdp.clipped_grad_sum(loss, l2_clip_norm=c, method="ghost")(params, batch)
        _assert_close(summed, norms, ref_summed, ref_norms, rtol=1e-5)


@pytest.mark.parametrize("keep_elements", [None, 0])
@pytest.mark.parametrize("form", ["cat([p, x, p])", "cat([x, p, x, p[:, :d]])"])
def test_a_param_twice_in_one_cat_counts_both_uses(form, keep_elements, monkeypatch):
    """Found by review (hunt/cat_dup.py): the cat rule took the param's first occurrence and the
    tracer only checked that no *other* param was among the arguments, so the second occurrence's
    gradient was dropped from norm and sum alike (norm 2.24 against 13.4): silently wrong
    training. A weight listed twice (itself, or a view of it) now takes the generic path."""
    b, t, d = 4, 3, 5
    torch.manual_seed(0)
    if form == "cat([p, x, p])":
        def loss(p, x):
            return (torch.cat([p["p"], x, p["p"]], 0) * torch.arange(1.0, t + 3).unsqueeze(1)).sum()
    else:
        def loss(p, x):
            return (torch.cat([x, p["p"], x, p["p"][:, :d]], 0).square() * torch.arange(1.0, 2 * t + 3).unsqueeze(1)).sum()
    _ghost_equals_vmap(loss, {"p": torch.randn(1, d)}, torch.randn(b, t, d), keep_elements=keep_elements, monkeypatch=monkeypatch)


@pytest.mark.parametrize("keep_elements", [None, 0])
def test_one_param_used_as_weights_of_two_shapes(keep_elements, monkeypatch):
    """Found by review (hunt/reshape_two_ways.py): ``w.view(4, 2)`` and ``w.view(2, 4)`` as linear
    weights are uses of one box with different shapes; joining them along T raised (torch.cat)."""
    torch.manual_seed(0)

    def loss(p, x):
        return F.linear(x, p["w"].view(4, 2)).sin().sum() + F.linear(x.repeat(1, 2), p["w"].view(2, 4)).cos().sum()

    _ghost_equals_vmap(loss, {"w": torch.randn(8)}, torch.randn(3, 5, 2), keep_elements=keep_elements, monkeypatch=monkeypatch)


def test_the_tracer_finds_the_tensors_optree_finds_in_a_calls_arguments():
    """Ghost's tracer flattens each call's arguments itself (plan._arg_leaves, not optree: dynamo
    traced optree's flatten for every call). A param it missed would be a use the plan never sees,
    so its tensors must be optree's, whatever the containers: nested tuples, lists, dicts, named
    tuples, and types only optree knows (a registered node, a deque)."""
    import collections
    import dataclasses

    import optree

    from vmapdp.ghost.plan import _arg_leaves

    @dataclasses.dataclass
    class Box:
        a: torch.Tensor

    class Seq(tuple):  # unknown to optree (one leaf there); torch's parser reads its items
        pass

    optree.register_pytree_node(Box, lambda d: ((d.a,), None), lambda _, c: Box(*c), namespace="torch")
    try:
        Pair = collections.namedtuple("Pair", "x y")
        t = [torch.full((i + 1,), float(i)) for i in range(7)]
        tree = ((t[0], [2, None, {"b": t[1], "a": 3}], Pair(t[2], slice(1, 2))), {"k": Box(t[3]), "d": collections.deque([t[4]])}, torch.float32, ..., torch.Size([2]), t[5])
        tensors = lambda xs: sorted(id(x) for x in xs if isinstance(x, torch.Tensor))  # noqa: E731
        assert tensors(_arg_leaves(tree)) == tensors(optree.tree_leaves(tree, namespace="torch")) == sorted(map(id, t[:6]))
        assert tensors(_arg_leaves((Seq([t[6], 1]), tree))) == sorted(map(id, t))
    finally:
        optree.unregister_pytree_node(Box, namespace="torch")


def test_a_param_in_a_tuple_subclass_gets_its_per_sample_grads_or_a_refusal(monkeypatch):
    """``torch.stack`` reads a tuple subclass's items: the param inside is a use no rule covers, so
    it gets per-sample grads through its per-sample copy, swapped into the same container. (Before,
    the tracer's optree flatten saw the subclass as one leaf and the use's grad was dropped: norm 0.)
    Were a found param ever left in place, the call is refused rather than its grad lost."""
    from vmapdp.ghost import plan as ghost_plan

    class Seq(tuple):
        pass

    def loss_fn(p, x):
        return torch.stack(Seq([p["w"], x.sum() + torch.zeros(5, 5)])).square().sum() * x.sum()

    params, x = {"w": torch.randn(5, 5, dtype=torch.float64)}, torch.randn(4, 3, 5, dtype=torch.float64)
    want = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="vmap")(params, x)
    got = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, x)
    _assert_close(got[0], got[1], want[0], want[1], rtol=1e-10)
    monkeypatch.setattr(ghost_plan, "_arg_map", lambda fn, tree: tree)  # a swap that misses the param
    with pytest.raises(vmapdp.UnsupportedModuleError, match="container it cannot rebuild"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, x)


def test_the_stacked_safe_bounds_are_each_params_norm_plus_margin_or_its_floor():
    """engine._bounds reduces all params' bounds at once: each param's safe norm must still be
    max(sqrt(its squared norm cast to the model's dtype, clamped at 0) + its margin, its floor),
    the whole the root of their squares, and the squared norms' sum that of the casts. Random
    parts of mixed dtypes, negative squared norms (a float64 Gram sum rounds below 0), parts with
    and without a floor; against that formula param by param (the order of the additions may
    differ: float64 to 1e-13, float32 to 1e-6)."""
    from vmapdp.ghost.engine import _bounds

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        dtype = (torch.float32, torch.float64)[trial % 2]
        parts = []
        for k in range(1 + trial % 5):
            sq = torch.randn(6, generator=gen, dtype=torch.float64) * 10.0 ** float(torch.randint(-6, 7, (), generator=gen))
            margin = torch.rand(6, generator=gen, dtype=torch.float64) * 10.0 ** float(torch.randint(-4, 2, (), generator=gen))
            floor = None if (trial + k) % 3 else torch.rand(6, generator=gen, dtype=torch.float64) * 10.0 ** float(torch.randint(-3, 4, (), generator=gen))
            parts.append((sq.to((torch.float32, torch.float64)[k % 2]), margin.to((torch.float64, torch.float32)[k % 2]), floor))
        want_sq = torch.zeros(6, dtype=dtype)
        want_safe_sq = torch.zeros(6, dtype=torch.float64)
        for sq, margin, floor in parts:
            sq = sq.to(dtype).clamp_min(0.0)
            safe = sq.double().sqrt() + margin.double()
            if floor is not None:
                safe = torch.maximum(safe, floor)
            want_sq, want_safe_sq = want_sq + sq, want_safe_sq + safe.square()
        got_sq, got_safe = _bounds(parts, dtype)
        assert got_sq.dtype == dtype and got_safe.dtype == torch.float64
        torch.testing.assert_close(got_sq, want_sq, rtol=1e-6 if dtype == torch.float32 else 1e-13, atol=0.0)
        torch.testing.assert_close(got_safe, want_safe_sq.sqrt(), rtol=1e-13, atol=0.0)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_book_keeping_sums_a_slice_of_the_batch_at_a_time_when_their_copies_are_large(name, monkeypatch):
    """With ``slice_elements`` at 1 every use's book-keeping sum is made one sample at a time (an
    LM head's float64 copy of its output grads is bounded so; pairs are added into the first
    sample's sum in place): the same clipped sum as the reference, masked NaN rows contributing
    nothing."""
    from vmapdp.ghost import engine

    params, buffers, batch, loss_fn = _case(name, dtype=torch.float32)
    ref = _reference(loss_fn, params, buffers, batch, MASK)
    batch = tuple(t.index_fill(0, torch.tensor([2]), float("nan")) if t.is_floating_point() else t for t in batch)
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, slice_elements=1, keep_elements=0, keep_ratio=0.0))
    rows_summed = []
    sides = engine._weighted_sides
    monkeypatch.setattr(engine, "_weighted_sides", lambda use, *a: rows_summed.append(use.u.shape[0]) or sides(use, *a))
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, buffers, batch, mask=MASK)
    _assert_close(summed, norms, *ref, rtol=1e-4)
    assert all(torch.isfinite(v).all() for v in summed.values())
    if rows_summed:  # (models whose every param is kept or uncovered make no book-keeping sum)
        assert set(rows_summed) == {1}, rows_summed


def test_sliced_book_keeping_sums_compile_with_fullgraph(monkeypatch):
    """The sliced book-keeping sum (a pair added in place into the first slice's sum) compiles
    without graph breaks and gives the eager sum."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, slice_elements=1, keep_elements=0, keep_ratio=0.0))
    params, buffers, batch, loss_fn = _case("embedding_repeated_tokens", b=4, dtype=torch.float32)
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
    fn.prepare(params, buffers, batch)
    compiled = torch.compile(lambda p, b, x: fn(p, b, x, mask=MASK[:4]), fullgraph=True, dynamic=False)
    got, want = compiled(params, buffers, batch), fn(params, buffers, batch, mask=MASK[:4])
    _assert_close(got[0], got[1], want[0], want[1], rtol=1e-5)


def test_an_in_place_op_on_an_empty_tensor_is_not_a_write_into_an_empty_param():
    """Found by review: the probe matched a write to its params by storage pointer, which every
    empty storage shares: with a 0-element param, any in-place op on an empty tensor was refused."""
    params = {"W": torch.randn(2, 3, dtype=torch.float64), "E": torch.zeros(0, dtype=torch.float64)}

    def loss_fn(p, x):
        pad = torch.zeros(0, dtype=torch.float64).add_(1.0)
        return (F.linear(torch.cat([x, pad]), p["W"]) + p["E"].sum()).square().sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    ref = vmapdp.clip_and_sum(vmapdp.testing.microbatch_grads(loss_fn, params, x), C)
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")(params, x)
    _assert_close(summed, norms, *ref, rtol=1e-9)


def test_a_loss_that_stops_reading_its_sample_after_the_probe_is_refused_by_the_eager_run():
    """Found by review: a flag outside the loss's arguments that switched it to a captured dataset
    row after the probe was released by eager ghost (the taps make any loss depend on the batch, and
    the site looked the same to the plan). The probe records which sites' inputs depend on the
    sample; the real run refuses one that no longer does, even where the loss still reads its
    sample elsewhere (a conditioning input dropped by a flag); a loss that reads it nowhere is
    refused before the run, by the one-row check every eager ghost call makes."""
    params = {"W": torch.randn(2, 3, dtype=torch.float64)}
    x_out = torch.randn(5, 3, dtype=torch.float64)
    switched = []

    def partly(p, xi):
        return F.linear(x_out[0] if switched else xi, p["W"]).square().sum() + xi.sum()

    def wholly(p, xi):
        return F.linear(x_out[0] if switched else xi, p["W"]).square().sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    for loss_fn, refusal in (
        (partly, r"input of the layer using 'W' \(torch.linear\) depended on the sample when the loss was probed and does not now.*Pass such a flag as an argument"),
        (wholly, r"loss_fn's value does not depend on its sample"),
    ):
        switched.clear()
        fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=C, method="ghost")
        ref = vmapdp.clip_and_sum(vmapdp.testing.microbatch_grads(loss_fn, params, x), C)
        _assert_close(*fn(params, x)[:2], *ref, rtol=1e-9)
        switched.append(True)
        with pytest.raises(ValueError, match=refusal):
            fn(params, x)


def test_a_param_wider_than_its_use_gets_its_sum_in_its_own_dtype_as_under_vmap():
    """Found by review: ghost summed a float64 param that the model casts to float32 in float32,
    vmap in float64; a sharded rank without rows then met it with a float64 zero sum in the
    reduce-scatter (gloo aborted), and correlated noise refused the float64 buffer."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, dtype=torch.float64, generator=g), "b": torch.randn(3, dtype=torch.float64, generator=g),
              "v": torch.randn(2, 3, generator=g)}

    def loss_fn(p, sample):
        x, y = sample
        return F.cross_entropy(F.linear(torch.tanh(F.linear(x, p["w"].to(x.dtype), p["b"].to(x.dtype))), p["v"])[None], y[None])

    batch = (torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g))
    sums = {m: vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=0.5, method=m)(params, batch)[0] for m in ("vmap", "ghost")}
    assert {k: v.dtype for k, v in sums["ghost"].items()} == {k: v.dtype for k, v in sums["vmap"].items()} == {"w": torch.float64, "b": torch.float64, "v": torch.float32}
    for k in params:
        torch.testing.assert_close(sums["ghost"][k], sums["vmap"][k], rtol=1e-5, atol=1e-6, check_dtype=False)
