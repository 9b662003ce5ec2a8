"""Mixed precision: bfloat16/float16 compute, float32 master params, clipping and noise.

Tolerances are measured, not guessed. Relative errors below are ``||g_low - g_32|| / ||g_32||``
per sample (the worst sample of the batch), against the float32 per-sample gradients. Measured on
five zoo models (linear, conv2d_groups_reflect, groupnorm, layernorm, embedding) x seeds 0-2,
B = 16 (2-core CPU, torch 2.13):

============================  ===================  ==================
quantity                      bfloat16 (max seen)  float16 (max seen)
============================  ===================  ==================
per-sample gradient           9.1e-3               1.5e-3
per-sample norm               7.0e-3               1.2e-3
clipped sum (C = 1)           5.5e-3               1.1e-3
============================  ===================  ==================

bfloat16 keeps 8 significant bits (unit roundoff 2**-9 = 2e-3) and the errors of a few layers
add up, hence ~1e-2; float16 keeps 11 (2**-12 = 2.4e-4). The assertions allow about 3x the worst
value seen, and a negative control checks that the low-precision result really differs from
float32 (> 1e-4, where float32 itself agrees to ~1e-7), so a wrapper that forgot to cast would
fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

import vmapdp
import zoo
from vmapdp import clip_and_sum, grad_norms, mixed_precision, optim, per_sample_grads
from vmapdp.testing import assert_grads_close

BF16_GRAD_RTOL = 3e-2  # measured <= 9.1e-3
BF16_NORM_RTOL = 2e-2  # measured <= 7.0e-3
BF16_SUM_RTOL = 2e-2  # measured <= 5.5e-3
FP16_GRAD_RTOL = 5e-3  # measured <= 1.5e-3
CAST_HAPPENED = 1e-4  # float32 vs float32 agrees to ~1e-7; any real low-precision run is far above this
STEP_RTOL = 0.1  # params after 5 DP steps, bf16 vs fp32, relative to the fp32 movement: measured <= 2.3e-2

MODELS = ["linear", "groupnorm"]  # an MLP and a small convnet (conv, GroupNorm, ReLU, linear head)


def _case(name):
    return next(c for c in zoo.CASES if c.name == name)


def _rel(a, b):
    """Per-sample ``||a - b|| / ||b||`` over all leaves -> ``[B]``."""
    return grad_norms({k: a[k] - b[k] for k in b}) / grad_norms(b)


def _total_rel(a, b):
    """``||a - b|| / ||b||`` of unbatched pytrees."""
    diff = math.sqrt(sum(float(((a[k] - b[k]) ** 2).sum()) for k in b))
    return diff / math.sqrt(sum(float((b[k] ** 2).sum()) for k in b))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", MODELS)
def test_bf16_grads_norms_and_clipped_sum_track_float32(name, seed):
    _, _, params, buffers, batch, loss_fn = zoo.setup(_case(name), 16, seed)
    g32, l32 = per_sample_grads(loss_fn, return_loss=True)(params, buffers, batch)
    g16, l16 = per_sample_grads(mixed_precision(loss_fn), return_loss=True)(params, buffers, batch)

    # float32 out: the casts are differentiable, so the grads w.r.t. the float32 params are float32
    assert g16.keys() == g32.keys()
    assert all(g16[k].dtype == torch.float32 and g16[k].shape == g32[k].shape for k in g32)
    assert l16.dtype == torch.float32

    rel = _rel(g16, g32)
    assert rel.max() < BF16_GRAD_RTOL, rel
    assert rel.max() > CAST_HAPPENED, "bf16 equals float32: the wrapper did not cast"
    with pytest.raises(AssertionError):  # negative control: a float32-grade tolerance fails on bf16 grads
        assert_grads_close(g16, g32, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(l16, l32, rtol=BF16_GRAD_RTOL, atol=1e-3)

    n32, n16 = grad_norms(g32), grad_norms(g16)
    assert n16.dtype == torch.float32
    assert ((n16 - n32).abs() / n32).max() < BF16_NORM_RTOL

    s32, _ = clip_and_sum(g32, 1.0)
    s16, norms = clip_and_sum(g16, 1.0)
    assert norms.dtype == torch.float32 and all(v.dtype == torch.float32 for v in s16.values())
    assert CAST_HAPPENED < _total_rel(s16, s32) < BF16_SUM_RTOL
    # the privacy-relevant bound holds on the bf16 gradients themselves, in float32
    clipped = vmapdp.clip_per_sample(g16, 1.0)
    assert (grad_norms(clipped) <= 1.0 + 1e-6).all()


def test_casts_floats_only_and_returns_a_float32_loss():
    seen = {}

    def loss_fn(params, shared, sample):
        x, tokens, y = sample
        seen.update(w=params["w"].dtype, scale=shared["scale"].dtype, count=shared["count"].dtype, flag=shared["flag"].dtype)
        seen.update(x=x.dtype, tokens=tokens.dtype, y=y.dtype, n=type(shared["n"]))
        h = (x * params["w"]).sum() * shared["scale"] + tokens.sum() * 0 + shared["n"]
        return F.softplus(h) + y * 0, {"aux": h}

    params = {"w": torch.randn(3)}
    shared = {"scale": torch.tensor(2.0, dtype=torch.float64), "count": torch.tensor(3), "flag": torch.tensor(True), "n": 1}
    sample = (torch.randn(3), torch.tensor([1, 2]), torch.tensor(1))
    loss, aux = mixed_precision(loss_fn)(params, shared, sample)
    assert seen == dict(
        w=torch.bfloat16, scale=torch.bfloat16, count=torch.int64, flag=torch.bool,
        x=torch.bfloat16, tokens=torch.int64, y=torch.int64, n=int,
    )
    assert loss.dtype == torch.float32 and aux["aux"].dtype == torch.bfloat16  # aux as loss_fn computed it
    assert params["w"].dtype == torch.float32 and shared["scale"].dtype == torch.float64  # inputs not modified

    # labels reach the loss unchanged under vmap too (cross-entropy would reject float labels)
    _, _, params, buffers, (x, y), loss_fn = zoo.setup(_case("linear"), 5)
    grads, aux = per_sample_grads(mixed_precision(lambda p, b, s: (loss_fn(p, b, s), s[1])), has_aux=True)(params, buffers, (x, y))
    assert torch.equal(aux, y) and aux.dtype == torch.int64


@pytest.mark.parametrize("name", MODELS)
def test_fp16_grads_track_float32(name):
    _, _, params, buffers, batch, loss_fn = zoo.setup(_case(name), 16)
    g32 = per_sample_grads(loss_fn)(params, buffers, batch)
    g16 = per_sample_grads(mixed_precision(loss_fn, torch.float16))(params, buffers, batch)
    assert all(v.dtype == torch.float32 for v in g16.values())
    assert CAST_HAPPENED < _rel(g16, g32).max() < FP16_GRAD_RTOL


def test_fp16_loss_scale_is_exact_and_rescues_underflowing_gradients():
    _, _, params, buffers, batch, loss_fn = zoo.setup(_case("linear"), 16)
    plain = per_sample_grads(mixed_precision(loss_fn, torch.float16), return_loss=True)(params, buffers, batch)
    for scale in (2.0**4, 2.0**15):
        scaled = per_sample_grads(mixed_precision(loss_fn, torch.float16, loss_scale=scale), return_loss=True)(params, buffers, batch)
        # no underflow here, so scaling by a power of two and unscaling in float32 is bitwise exact
        assert all(torch.equal(scaled[0][k], plain[0][k]) for k in plain[0]), scale
        assert torch.equal(scaled[1], plain[1])  # the returned loss is unscaled

    def tiny(p, b, s):  # a small loss (2**-20 is exact in float16): its gradients fall below float16's range
        return 2.0**-20 * loss_fn(p, b, s)

    g32 = per_sample_grads(tiny)(params, buffers, batch)
    unscaled = per_sample_grads(mixed_precision(tiny, torch.float16))(params, buffers, batch)
    rescued = per_sample_grads(mixed_precision(tiny, torch.float16, loss_scale=2.0**15))(params, buffers, batch)
    assert _rel(unscaled, g32).max() > 5e-2  # measured 0.13: entries underflow to 0 or to a few bits
    assert _rel(rescued, g32).max() < FP16_GRAD_RTOL  # back to ordinary float16 accuracy


@pytest.fixture
def precision_unbound(monkeypatch):
    """The noise key binds `precision` (a sample that overflows in float16 is dropped there, not in
    float32: not just rounding). These tests compare a bf16 step with the float32 one noise for
    noise, so they unbind it."""
    config = vmapdp.train.step_config
    monkeypatch.setattr(vmapdp.train, "step_config", lambda **kw: config(**dict(kw, precision=None)))
    # and the same keys then release other values: nothing is recorded (vmapdp.noise.spent; its
    # unreleased() covers the frame that enters it, not a test run while a fixture waits inside it)
    monkeypatch.setattr(vmapdp.train._spent, "recording", lambda: False)


@pytest.mark.parametrize("name", MODELS)
def test_dp_step_in_bf16_tracks_the_float32_step(name, precision_unbound):
    _, _, params, buffers, batch, loss_fn = zoo.setup(_case(name), 16)
    mask = torch.ones(16, dtype=torch.bool)
    finals, metrics = {}, {}
    for precision in (None, torch.bfloat16):
        step = vmapdp.make_train_step(
            loss_fn, optim.sgd(0.5), l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=16.0,
            sample_rate=0.1, compile=False, precision=precision,
        )
        state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=0)
        for _ in range(5):
            state, m = step(state, batch, mask, buffers)
        finals[precision], metrics[precision] = state.params, m
        assert all(v.dtype == torch.float32 for v in state.params.values())
        assert all(v.dtype == torch.float32 for v in m.values())
    moved = {k: finals[None][k] - params[k] for k in params}
    deviation = {k: finals[torch.bfloat16][k] - finals[None][k] for k in params}
    rel = _total_rel({k: moved[k] + deviation[k] for k in params}, moved)
    assert CAST_HAPPENED < rel < STEP_RTOL
    torch.testing.assert_close(metrics[torch.bfloat16]["loss"], metrics[None]["loss"], rtol=BF16_GRAD_RTOL, atol=0.0)


def _released_noise(loss_fn, params, buffers, batch, precision, *, sigma, clip, seed):
    """The noise of one step, recovered as (update * expected_batch_size) - clipped sum (lr = 1)."""
    n = batch[1].shape[0]
    step = vmapdp.make_train_step(
        loss_fn, optim.sgd(1.0), l2_clip_norm=clip, noise_multiplier=sigma, expected_batch_size=1.0,
        sample_rate=0.1, compile=False, precision=precision, method="vmap",  # the reference sum below is vmap's
    )
    new, _ = step(vmapdp.init_train_state(params, optim.sgd(1.0), seed=seed), batch, torch.ones(n, dtype=torch.bool), buffers)
    wrapped = loss_fn if precision is None else mixed_precision(loss_fn, precision)
    summed, _ = clip_and_sum(per_sample_grads(wrapped)(params, buffers, batch), clip)
    noise = {k: (params[k] - new.params[k]) - summed[k] for k in params}
    assert all(v.dtype == torch.float32 for v in noise.values())
    return torch.cat([v.flatten() for v in noise.values()])


def test_noise_std_is_unchanged_by_bf16(precision_unbound):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 60), torch.nn.ReLU(), torch.nn.Linear(60, 10))  # 1,870 params
    apply, params, buffers = vmapdp.functionalize(model)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 20, generator=g), torch.randint(0, 10, (8,), generator=g))

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    sigma, clip = 2.0, 0.5
    z16 = torch.cat([_released_noise(loss_fn, params, buffers, batch, torch.bfloat16, sigma=sigma, clip=clip, seed=s) for s in range(3, 9)])
    z32 = torch.cat([_released_noise(loss_fn, params, buffers, batch, None, sigma=sigma, clip=clip, seed=s) for s in range(3, 9)])
    # the same seeds draw the same float32 noise whatever the compute dtype, up to the rounding of the update
    # (measured 2.4e-7 unsnapped) and the snapping of each release: the sums differ, so their cells may (one grid step)
    std = sigma * clip
    torch.testing.assert_close(z16, z32, rtol=0.0, atol=vmapdp.noise.snap_grid(std) + 2e-6)
    z = z16.double().numpy()
    assert stats.kstest(z, "norm", args=(0.0, std)).pvalue > 1e-3
    for wrong in (std / math.sqrt(2), std * 1.1):  # negative controls: a std off by sqrt(2) or 10% fails
        assert stats.kstest(z, "norm", args=(0.0, wrong)).pvalue < 1e-3


def test_compiled_bf16_step_tracks_the_float32_step(precision_unbound):
    _, _, params, buffers, batch, loss_fn = zoo.setup(_case("linear"), 16)
    mask = torch.ones(16, dtype=torch.bool)
    kw = dict(l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=16.0, sample_rate=0.1)
    compiled = vmapdp.make_train_step(loss_fn, optim.sgd(0.5), compile=True, precision=torch.bfloat16, **kw)
    eager32 = vmapdp.make_train_step(loss_fn, optim.sgd(0.5), compile=False, **kw)
    s_c = s_e = vmapdp.init_train_state(params, optim.sgd(0.5), seed=0)
    for _ in range(3):
        s_c, m_c = compiled(s_c, batch, mask, buffers)
        s_e, _ = eager32(s_e, batch, mask, buffers)
    assert all(v.dtype == torch.float32 for v in s_c.params.values()) and m_c["loss"].dtype == torch.float32
    moved = {k: s_e.params[k] - params[k] for k in params}
    assert _total_rel({k: s_c.params[k] - params[k] for k in params}, moved) < STEP_RTOL


def test_errors():
    loss_fn = lambda p, s: (p["w"] * s).sum()  # noqa: E731
    with pytest.raises(TypeError, match=r"mixed_precision\(loss_fn, dtype\): loss_fn must be callable"):
        mixed_precision(None)
    with pytest.raises(ValueError, match=r"dtype=torch.float32 must be torch.bfloat16 or torch.float16"):
        mixed_precision(loss_fn, torch.float32)
    with pytest.raises(ValueError, match=r"loss_scale=1024.0 is for float16 only"):
        mixed_precision(loss_fn, torch.bfloat16, loss_scale=1024.0)
    with pytest.raises(ValueError, match=r"loss_scale=1000.0 must be a power of two \(e.g. 1024.0\)"):
        mixed_precision(loss_fn, torch.float16, loss_scale=1000.0)
    with pytest.raises(ValueError, match=r"loss_scale=65536.0 must be a power of two in \[1, 2\*\*15\]"):
        mixed_precision(loss_fn, torch.float16, loss_scale=2.0**16)
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar tensor"):
        mixed_precision(lambda p, s: 1.0)({"w": torch.ones(1)}, torch.ones(1))
    with pytest.raises(ValueError, match=r"dtype=torch.float64 must be torch.bfloat16"):
        vmapdp.make_train_step(
            loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0, sample_rate=0.1, precision=torch.float64
        )


@pytest.mark.parametrize("name", MODELS)
def test_ghost_covers_an_fp16_loss_with_a_loss_scale(name):
    """mixed_precision's float32-side unscaling hid the params from ghost clipping (coverage 0: every
    param through per-sample views). Ghost now runs the loss-side-scaled form and divides the
    power-of-two scale out itself: full coverage, and the same norms and clipped sum as unscaled."""
    _, _, params, buffers, batch, loss_fn = zoo.setup(_case(name), 8)
    plain = mixed_precision(loss_fn, torch.float16)
    scaled = mixed_precision(loss_fn, torch.float16, loss_scale=2.0**10)
    fn = vmapdp.clipped_grad_sum(scaled, l2_clip_norm=0.3, method="ghost")
    plan = fn.prepare(params, buffers, batch)
    assert plan.other == [] or name == "groupnorm"  # (GroupNorm's affine params are per-sample views)
    assert vmapdp.ghost.coverage(plan, params) == vmapdp.ghost.coverage(vmapdp.clipped_grad_sum(plain, l2_clip_norm=0.3).prepare(params, buffers, batch), params) > 0.5
    mask = torch.tensor([True] * 5 + [False] + [True] * 2)
    got = fn(params, buffers, batch, mask=mask)
    want = vmapdp.clipped_grad_sum(plain, l2_clip_norm=0.3, method="ghost")(params, buffers, batch, mask=mask)
    # no underflow or overflow at this scale: scaling by 2**10 and dividing it out are exact
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert all(torch.equal(got[0][k], want[0][k]) for k in want[0])


def test_a_wrapper_of_an_fp16_loss_with_a_loss_scale_is_what_ghost_differentiates():
    """Found by review: functools.wraps copied the loss-scale form onto a caller's wrapper, and
    ghost ran the inner loss (a wrapper tripling the loss got a third of vmap's norms)."""
    import functools

    _, _, params, buffers, batch, loss_fn = zoo.setup(_case(MODELS[0]), 4)
    base = mixed_precision(loss_fn, torch.float16, loss_scale=2.0**8)

    @functools.wraps(base)
    def tripled(p, b, s):
        return 3.0 * base(p, b, s)

    norms = {m: vmapdp.clipped_grad_sum(tripled, l2_clip_norm=100.0, method=m)(params, buffers, batch)[1] for m in ("vmap", "ghost")}
    torch.testing.assert_close(norms["ghost"], norms["vmap"], rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(norms["vmap"], 3.0 * vmapdp.clipped_grad_sum(base, l2_clip_norm=100.0, method="vmap")(params, buffers, batch)[1], rtol=1e-2, atol=1e-6)


def test_adaptive_clipping_keeps_ghosts_form_of_an_fp16_loss_with_a_loss_scale(monkeypatch):
    """Found by review: with adaptive clipping the step divides the loss by the carried threshold in
    a wrapper of its own, which dropped the loss-side-scaled form mixed_precision(loss_scale=) offers
    ghost clipping, so ghost ran the unscaled form, its params hidden (coverage 0). The wrapper now
    offers the scaled form divided alike: full coverage, and the step's result equals the unscaled
    loss's bit for bit (the power-of-two scale divides out exactly)."""
    _, _, params, buffers, batch, loss_fn = zoo.setup(_case(MODELS[0]), 8)
    made = []
    real = vmapdp.train.clipped_grad_sum
    monkeypatch.setattr(vmapdp.train, "clipped_grad_sum", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    results = []
    for loss in (mixed_precision(loss_fn, torch.float16, loss_scale=2.0**10), mixed_precision(loss_fn, torch.float16)):
        opt = optim.sgd(0.1)
        step = vmapdp.make_train_step(loss, opt, l2_clip_norm=0.3, noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.1,
                                      method="ghost", compile=False, adaptive_clipping=vmapdp.AdaptiveClipping(count_noise_multiplier=2.0))
        with vmapdp.noise.spent.unreleased():
            results.append(step(vmapdp.init_train_state(params, opt, seed=3), batch, torch.ones(8, dtype=torch.bool), buffers)[0].params)
    plan = made[0].prepare(params, torch.tensor(0.3), buffers, batch)
    assert plan.other == [] and vmapdp.ghost.coverage(plan, params) == 1.0, plan.describe(params)
    assert all(torch.equal(results[0][k], results[1][k]) for k in params)
