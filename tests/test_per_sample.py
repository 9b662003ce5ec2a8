"""per_sample_grads against the float64 one-sample-at-a-time oracle, on every layer type."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import vmapdp
from vmapdp import clipped
from vmapdp.testing import assert_grads_close, microbatch_grads
from zoo import CASES, BufferCounter, setup

IDS = [c.name for c in CASES]


@pytest.mark.parametrize("b", [1, 5])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_float64_oracle_every_sample(case, b):
    model, apply, params, buffers, batch, loss_fn = setup(case, b)
    grads, losses = vmapdp.per_sample_grads(loss_fn, return_loss=True)(params, buffers, batch)
    ref = microbatch_grads(loss_fn, params, buffers, batch)
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert_grads_close(grads, ref, rtol=1e-4, atol=1e-6)
    for k, g in grads.items():
        assert g.shape == (b,) + params[k].shape and g.dtype == params[k].dtype
    ref_losses = torch.stack([loss_fn(params, buffers, tuple(t[i] for t in batch)) for i in range(b)])
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sum_over_samples_equals_batched_autograd(case):
    model, apply, params, buffers, batch, loss_fn = setup(case, 6)
    grads = vmapdp.per_sample_grads(loss_fn)(params, buffers, batch)
    # ordinary autograd on the whole batch, with the per-sample losses summed
    live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    total = sum(loss_fn(live, buffers, tuple(t[i] for t in batch)) for i in range(6))
    ref = torch.autograd.grad(total, list(live.values()))
    for (k, g), r in zip(grads.items(), ref):
        torch.testing.assert_close(g.sum(0), r, rtol=1e-4, atol=1e-5, msg=k)


def test_tied_weight_appears_once_and_gets_both_contributions():
    case = next(c for c in CASES if c.name == "tied_weights")
    model, apply, params, buffers, batch, loss_fn = setup(case, 3)
    assert "emb.weight" in params and "out.weight" not in params
    grads = vmapdp.per_sample_grads(loss_fn)(params, buffers, batch)
    # untie by hand: the tied gradient is the sum of the two uses' gradients
    def untied(p, buffers, sample):
        x, y = sample
        h = torch.tanh(F.linear(F.embedding(x[None], p["emb.weight"]), p["mix.weight"], p["mix.bias"]))
        return F.cross_entropy(F.linear(h.mean(1), p["out.weight"]), y[None])

    p2 = dict(params, **{"out.weight": params["emb.weight"]})
    g2 = vmapdp.per_sample_grads(untied)(p2, buffers, batch)
    torch.testing.assert_close(grads["emb.weight"], g2["emb.weight"] + g2["out.weight"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 2, 4])
def test_chunked_equals_unchunked(chunk_size):
    case = next(c for c in CASES if c.name == "conv2d_groups_reflect")
    _, _, params, buffers, batch, loss_fn = setup(case, 5)
    full = vmapdp.per_sample_grads(loss_fn)(params, buffers, batch)
    chunked = vmapdp.per_sample_grads(loss_fn, chunk_size=chunk_size)(params, buffers, batch)
    assert_grads_close(chunked, full, rtol=1e-6, atol=1e-9)


def test_mask_zeroes_padding_rows_even_nan():
    case = CASES[0]
    _, _, params, buffers, (x, y), loss_fn = setup(case, 6)
    mask = torch.tensor([True, False, True, True, False, True])
    x_bad = x.clone()
    x_bad[~mask] = math.nan
    grads, losses = vmapdp.per_sample_grads(loss_fn, return_loss=True)(params, buffers, (x_bad, y), mask=mask)
    clean = vmapdp.per_sample_grads(loss_fn)(params, buffers, (x, y))
    for k in grads:
        assert torch.equal(grads[k][~mask], torch.zeros_like(grads[k][~mask])), k
        torch.testing.assert_close(grads[k][mask], clean[k][mask])
    assert torch.equal(losses[~mask], torch.zeros(2))
    norms = vmapdp.per_sample_grad_norms(loss_fn)(params, buffers, (x_bad, y), mask=mask)
    assert torch.isfinite(norms).all() and torch.equal(norms[~mask], torch.zeros(2))


def test_has_aux_and_return_loss_forms():
    case = CASES[0]
    _, apply, params, buffers, batch, _ = setup(case, 4)

    def loss_with_aux(p, b, sample):
        x, y = sample
        logits = apply(p, b, x[None])
        return F.cross_entropy(logits, y[None]), {"pred": logits.argmax(-1)[0], "logit0": logits[0, 0]}

    g1 = vmapdp.per_sample_grads(loss_with_aux, has_aux=True)(params, buffers, batch)
    g2 = vmapdp.per_sample_grads(loss_with_aux, has_aux=True, return_loss=True)(params, buffers, batch)
    grads, aux = g1
    grads2, losses, aux2 = g2
    assert aux["pred"].shape == (4,) and aux["logit0"].shape == (4,)
    logits = apply(params, buffers, batch[0])
    torch.testing.assert_close(aux["logit0"], logits[:, 0])
    assert torch.equal(aux["pred"], logits.argmax(-1))
    torch.testing.assert_close(losses, F.cross_entropy(logits, batch[1], reduction="none"))
    for k in grads:
        torch.testing.assert_close(grads[k], grads2[k])


def test_argnums_tuple_and_dict_batch():
    torch.manual_seed(0)
    w = torch.randn(3)
    bias = torch.randn(())

    def loss_fn(w, bias, sample):
        return (sample["x"] @ w + bias - sample["y"]) ** 2

    batch = {"x": torch.randn(4, 3, dtype=torch.float64).float(), "y": torch.randn(4)}
    gw, gb = vmapdp.per_sample_grads(loss_fn, argnums=(0, 1))(w, bias, batch)
    resid = batch["x"] @ w + bias - batch["y"]
    torch.testing.assert_close(gw, 2 * resid[:, None] * batch["x"])
    torch.testing.assert_close(gb, 2 * resid)


def test_empty_batch_gives_empty_leading_dims():
    case = CASES[0]
    _, _, params, buffers, batch, loss_fn = setup(case, 0)
    grads, losses = vmapdp.per_sample_grads(loss_fn, return_loss=True)(params, buffers, batch)
    for k, g in grads.items():
        assert g.shape == (0,) + params[k].shape
    assert losses.shape == (0,)
    assert vmapdp.per_sample_grad_norms(loss_fn)(params, buffers, batch).shape == (0,)


def test_grad_norms_equal_norms_of_grads():
    case = next(c for c in CASES if c.name == "embedding_repeated_tokens")
    _, _, params, buffers, batch, loss_fn = setup(case, 5)
    ref = microbatch_grads(loss_fn, params, buffers, batch)
    expected = torch.sqrt(sum(g.reshape(5, -1).square().sum(1) for g in ref.values()))
    norms, losses = vmapdp.per_sample_grad_norms(loss_fn, return_loss=True)(params, buffers, batch)
    assert norms.dtype == torch.float32 and losses.shape == (5,)
    torch.testing.assert_close(norms.double(), expected, rtol=1e-5, atol=1e-8)


def test_dropout_requires_a_randomness_choice_and_different_gives_independent_masks():
    model = nn.Sequential(nn.Linear(50, 50), nn.Dropout(0.5), nn.Linear(50, 1))
    apply, params, buffers = vmapdp.functionalize(model)

    def loss_fn(p, b, x):
        return apply(p, b, x[None]).sum()

    x = torch.ones(4, 50)  # identical samples: only the dropout mask can tell them apart
    with pytest.raises(RuntimeError, match=r"per_sample_grads\(loss_fn\).*randomness='different'"):
        vmapdp.per_sample_grads(loss_fn)(params, buffers, x)
    torch.manual_seed(0)
    g = vmapdp.per_sample_grads(loss_fn, randomness="different")(params, buffers, x)
    assert not torch.equal(g["0.weight"][0], g["0.weight"][1])
    torch.manual_seed(0)
    g_same = vmapdp.per_sample_grads(loss_fn, randomness="same")(params, buffers, x)
    assert torch.equal(g_same["0.weight"][0], g_same["0.weight"][1])


def test_module_is_never_mutated():
    case = next(c for c in CASES if c.name == "transformer_encoder_layer")
    model, apply, params, buffers, batch, loss_fn = setup(case, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = {k: id(p) for k, p in model.named_parameters()}
    vmapdp.per_sample_grads(loss_fn)(params, buffers, batch)
    new_params = {k: v + 1 for k, v in params.items()}
    apply(new_params, buffers, batch[0])
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert ids == {k: id(p) for k, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- errors


def _linear_setup():
    model = nn.Linear(3, 2)
    apply, params, buffers = vmapdp.functionalize(model)

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    return params, buffers, loss_fn


def test_error_batch_leaves_disagree():
    params, buffers, loss_fn = _linear_setup()
    with pytest.raises(ValueError, match=r"per_sample_grads\(loss_fn\): expected the same batch size.*\[1\]' has 3"):
        vmapdp.per_sample_grads(loss_fn)(params, buffers, (torch.randn(4, 3), torch.zeros(3, dtype=torch.long)))


def test_error_loss_not_scalar():
    params, buffers, _ = _linear_setup()

    def batched_loss(p, b, x):
        return x * p["weight"].sum()

    with pytest.raises(ValueError, match=r"loss_fn must return a scalar"):
        vmapdp.per_sample_grads(batched_loss)(params, buffers, torch.randn(4, 3))


@pytest.mark.parametrize("method", ["vmap", "ghost", "two_pass", "auto"])
def test_a_loss_that_ignores_its_sample_is_refused_before_anything_is_released(method):
    """Found by review: a loss reading the dataset captured from outside (apply(p, b, x) for the
    sample's xi) gave every sample the same gradient of rows never sampled, and every method
    released it. Its value does not depend on the mapped sample: refused, with the fix."""
    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    x, y = torch.randn(50, 3), torch.randint(0, 2, (50,))

    def whole_dataset(p, b, sample):
        return F.cross_entropy(apply(p, b, x), y)

    def own_sample(p, b, sample):
        xi, yi = sample
        return F.cross_entropy(apply(p, b, xi[None]), yi[None])

    opt = vmapdp.optim.sgd(0.1)
    for loss_fn, refused in ((whole_dataset, True), (own_sample, False)):
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=5.0, sample_rate=0.1, compile=False, method=method)
        state = vmapdp.init_train_state(params, opt, seed=3 + refused)
        if refused:
            with pytest.raises(ValueError, match=r"loss_fn's value does not depend on its sample.*Compute the loss from the sample it is given"):
                step(state, (x[:6], y[:6]), torch.ones(6, dtype=torch.bool), buffers)
        else:
            assert step(state, (x[:6], y[:6]), torch.ones(6, dtype=torch.bool), buffers)[0].step == 1
    with pytest.raises(ValueError, match=r"per_sample_grads\(loss_fn\): loss_fn's value does not depend on its sample"):
        vmapdp.per_sample_grads(whole_dataset)(params, buffers, (x[:6], y[:6]))
    # compiled: the loss runs only under the tracer (found by review: compiled vmap and two_pass steps
    # released it); the step's eager prepare checks it, before anything is compiled
    step = vmapdp.make_train_step(whole_dataset, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=5.0, sample_rate=0.1, compile="eager", method=method)
    with pytest.raises(ValueError, match=r"loss_fn's value does not depend on its sample"):
        step(vmapdp.init_train_state(params, opt, seed=5), (x[:6], y[:6]), torch.ones(6, dtype=torch.bool), buffers)


@pytest.mark.parametrize("method", ["vmap", "ghost", "two_pass", "auto"])
@pytest.mark.parametrize("how", ["detach", "no_grad", "buffers only"])
def test_a_loss_that_does_not_depend_on_the_params_is_refused(method, how):
    """Found by review: a detached loss (or one computed under no_grad, or of buffers only) gave every per-sample gradient zero under every method, and a step released its
    noise alone, silently. Refused with the fix; the same loss computed from params passes."""
    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    scale = torch.ones(())
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))

    def loss_fn(p, b, sample, broken=True):
        xi, yi = sample
        loss = F.cross_entropy(apply(p, b, xi[None]), yi[None])
        if not broken:
            return loss
        if how == "detach":
            return loss.detach()
        if how == "no_grad":
            with torch.no_grad():
                return F.cross_entropy(apply(p, b, xi[None]), yi[None])
        return (scale * xi).sum()

    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method)
    with pytest.raises(ValueError, match=r"loss_fn's value does not depend on the parameters.*without detach or no_grad"):
        fn(params, buffers, (x, y))
    # compiled, the loss runs under the tracer only (found by review: compiled vmap, two_pass and ghost
    # steps released it); the step's eager prepare runs the check on one sample, before anything is compiled
    opt = vmapdp.optim.sgd(0.1)
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=5.0, sample_rate=0.1, compile="eager", method=method)
    with pytest.raises(ValueError, match=r"loss_fn's value does not depend on the parameters"):
        step(vmapdp.init_train_state(params, opt, seed=5), (x, y), torch.ones(6, dtype=torch.bool), buffers)
    summed, norms, _ = vmapdp.clipped_grad_sum(functools.partial(loss_fn, broken=False), l2_clip_norm=1.0, method=method)(params, buffers, (x, y))
    assert bool((norms > 0).all())


def _bad_inputs():
    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))

    def base(p, b, s):
        xi, yi = s
        return F.cross_entropy(apply(p, b, xi[None]), yi[None])

    def aux(p, b, s):
        loss = base(p, b, s)
        return loss, loss.detach()

    def item(p, b, s):
        return base(p, b, s) * float(s[0].sum())

    def branch(p, b, s):  # (found by review: torch's raw vmap message under clipped_grad_sum)
        return base(p, b, s) if s[0].sum() > 0 else 2 * base(p, b, s)

    def four(p, b, extra, s):  # (called with one shared argument fewer than it takes)
        return base(p, b, s)

    return params, buffers, {
        "float64 batch": (base, (x.double(), y), TypeError, r"have different dtypes.*Cast the batch's floating-point tensors to the params' dtype .* x.float\(\) for float32"),
        "float labels": (base, (x, y.float()), TypeError, r"got a tensor of another dtype than int64.*Pass the labels \(or token ids\) as int64: y.long\(\)"),
        # (found by review: uint8 labels were called "a float tensor")
        "uint8 labels": (base, (x, y.to(torch.uint8)), TypeError, r"got a tensor of another dtype than int64.*y.long\(\)"),
        "(loss, aux) without has_aux": (aux, (x, y), TypeError, r"returned (a )?tuple where a loss tensor was expected.*has_aux=True"),
        ".item()": (item, (x, y), ValueError, r"reads a per-sample tensor's value in Python.*t instead of t.item\(\)"),
        "if on a value": (branch, (x, y), ValueError, r"reads a per-sample tensor's value in Python.*torch.where"),
        # (found by review: torch's raw errors, the per-sample view's "1x5" among them)
        "wrong width": (base, (x[:, :2], y), ValueError, r"a layer got inputs of another size than it takes \(torch said: mat1 and mat2.*in_features"),
        "label out of range": (base, (x, y + 5), ValueError, r"an index is out of range \(torch said: (?!clipped_grad_sum).*\); most often a label outside \[0, num_classes\)"),
        "a shared argument missing": (four, (x, y), TypeError, r"got another number of arguments than it takes .*loss_fn\(params, \*shared, sample\).*mask=mask"),
        "a None in the batch": (lambda p, b, s: base(p, b, s[:2]), (x, y, None), TypeError, r"the batch holds a leaf that is not a tensor .*such as None"),
    }


@pytest.mark.parametrize("method", ["vmap", "two_pass"])
@pytest.mark.parametrize("kw, match", [({"max_norm": 1.0}, r"nn.Embedding\(max_norm=...\) renormalises rows of its weight in place.*without max_norm"),
                                       ({"sparse": True}, r"a sparse gradient reached the per-sample engine.*sparse=False, or use method='ghost'")])
def test_embeddings_vmap_cannot_batch_are_named_with_the_fix(kw, match, method):
    """Found by review: torch's raw errors (aten::embedding_renorm_, SparseCPU) reached the user."""
    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(nn.Sequential(nn.Embedding(10, 4, **kw), nn.Flatten(), nn.Linear(12, 2)))
    batch = (torch.randint(0, 10, (4, 3)), torch.randint(0, 2, (4,)))

    def loss_fn(p, b, s):
        return F.cross_entropy(apply(p, b, s[0][None]), s[1][None])

    with pytest.raises(vmapdp.UnsupportedModuleError, match=match):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method)(params, buffers, batch)


@pytest.mark.parametrize("method", ["vmap", "ghost", "two_pass"])
def test_a_callers_own_error_is_not_relabelled(method):
    """Found by review: with ValueError and TypeError explained too, a loss's own ValueError("... should
    be the same") came back as a dtype TypeError, and "only supports scalar labels" as "loss_fn must
    return a scalar"; only torch's own errors are explained (and once: not again around the engine)."""
    params, buffers, cases = _bad_inputs()
    base, batch = cases["float labels"][0], (cases["float labels"][1][0], cases["float labels"][1][1].long())

    for text in ("the two inputs should be the same", "this metric only supports scalar labels"):
        def loss(p, b, s, text=text):
            raise ValueError(text)

        with pytest.raises(ValueError, match=rf"^{text}$"):
            vmapdp.clipped_grad_sum(loss, l2_clip_norm=1.0, method=method)(params, buffers, batch)
    assert base(params, buffers, (batch[0][0], batch[1][0])).dim() == 0  # (the problem's loss itself is fine)


@pytest.mark.parametrize("method", ["vmap", "ghost", "two_pass"])
@pytest.mark.parametrize("case", list(_bad_inputs()[2]))
def test_common_mistakes_get_errors_with_the_fix(method, case):
    """Found by review (a new user's mistakes): torch's raw errors (or an AttributeError) reached the
    user with no hint of the fix."""
    params, buffers, cases = _bad_inputs()
    loss_fn, batch, kind, match = cases[case]
    with pytest.raises(kind, match=match):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method)(params, buffers, batch)


@pytest.mark.parametrize("method", ["vmap", "ghost", "two_pass", "auto"])
@pytest.mark.parametrize("model", ["counter", "spectral_norm"])
def test_a_forward_that_writes_into_a_buffer_is_refused_by_every_method_eager_and_compiled(method, model):
    """Found by review: a write that is the same for every sample (a step counter, `self.n += 1`;
    spectral_norm's power iteration in training mode) passed vmap and two_pass silently, the
    caller's buffers changing with each call; compiled, every method released it (ghost's refusal
    was torch's raw error). Refused before anything is released, naming the buffer and the fix;
    in eval mode spectral_norm passes."""
    torch.manual_seed(0)
    module = BufferCounter() if model == "counter" else nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(3, 2)))
    apply, params, buffers = vmapdp.functionalize(module)
    batch = (torch.randn(4, 3), torch.zeros(4, dtype=torch.long))

    def loss_fn(p, b, sample):
        xi, yi = sample
        return F.cross_entropy(apply(p, b, xi[None]), yi[None])

    written = r"loss_fn writes in place into " + (r"count" if model == "counter" else r"0.parametrizations.weight.0._u")
    if model == "spectral_norm" and method in ("ghost", "auto"):  # (ghost's probe sees the write's out= first)
        written = r"calls normalize\(\.\.\., out=\.\.\.\)"
    with pytest.raises((RuntimeError, vmapdp.UnsupportedModuleError), match=rf"{written}.*model.eval\(\)"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method)(params, buffers, batch)
    opt = vmapdp.optim.sgd(0.1)
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, compile="eager", method=method)
    state = vmapdp.init_train_state(params, opt, seed=1)
    with pytest.raises((RuntimeError, vmapdp.UnsupportedModuleError), match=written):
        step(state, batch, torch.ones(4, dtype=torch.bool), buffers)
    if model == "spectral_norm":
        module.eval()
        before = {k: v.clone() for k, v in buffers.items()}
        assert step(state, batch, torch.ones(4, dtype=torch.bool), buffers)[0].step == 1
        assert all(torch.equal(before[k], buffers[k]) for k in buffers)


def test_per_sample_grads_lets_a_write_the_same_for_every_sample_through_as_a_forward_does():
    """per_sample_grads is not a private step: spectral_norm in training mode (its power iteration
    updates u and v, from the weight alone) runs as in a batched forward, one update per call, and
    the gradients are those of the one-sample losses at the updated u, v (found by review: the
    buffer-write refusal had made per_sample_grads refuse it, pointing at validate, which found nothing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(3, 2))).double()
    apply, params, buffers = vmapdp.functionalize(model)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))

    def loss_fn(p, b, sample):
        xi, yi = sample
        return F.cross_entropy(apply(p, b, xi[None]), yi[None])

    before = {k: v.clone() for k, v in buffers.items()}
    grads = vmapdp.per_sample_grads(loss_fn)(params, buffers, (x, y))
    assert not torch.equal(before["0.parametrizations.weight.0._u"], buffers["0.parametrizations.weight.0._u"])
    model.eval()  # (u, v as the vmapped forward left them: the reference at the same point)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    for i in range(4):
        ref = torch.autograd.grad(loss_fn(leaves, buffers, (x[i], y[i])), list(leaves.values()))
        for (k, _), r in zip(params.items(), ref):
            torch.testing.assert_close(grads[k][i], r)


def test_a_lazy_module_is_refused_until_it_has_run():
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias'\] are uninitialized.*Run the model once on a dummy batch first"):
        vmapdp.functionalize(model)
    model(torch.randn(1, 3))
    apply, params, _ = vmapdp.functionalize(model)
    assert params["0.weight"].shape == (4, 3)


def test_error_bad_mask_and_options():
    params, buffers, loss_fn = _linear_setup()
    batch = (torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"mask must have dtype torch.bool"):
        vmapdp.per_sample_grads(loss_fn)(params, buffers, batch, mask=torch.ones(4))
    with pytest.raises(ValueError, match=r"mask must have shape \[4\]"):
        vmapdp.per_sample_grads(loss_fn)(params, buffers, batch, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"chunk_size=0 must be an int >= 1"):
        vmapdp.per_sample_grads(loss_fn, chunk_size=0)
    with pytest.raises(ValueError, match=r"randomness='per-sample' must be one of 'error', 'different', 'same'"):
        vmapdp.per_sample_grads(loss_fn, randomness="per-sample")
    with pytest.raises(TypeError, match=r"expected at least two arguments"):
        vmapdp.per_sample_grads(loss_fn)(batch)
    with pytest.raises(ValueError, match=r"0-dim tensor"):
        vmapdp.per_sample_grads(lambda p, x: (p["weight"] * x).sum())(params, torch.tensor(1.0))


def test_error_wrong_param_keys_names_them():
    params, buffers, loss_fn = _linear_setup()
    bad = {"weight": params["weight"]}
    with pytest.raises(KeyError, match=r"missing \['bias'\]"):
        vmapdp.per_sample_grads(loss_fn)(bad, buffers, (torch.randn(2, 3), torch.zeros(2, dtype=torch.long)))


def test_error_inplace_mutation_is_explained():
    buf = torch.zeros(3)

    def mutating(p, x):
        buf.add_(x)  # writes into a captured tensor
        return (p * x).sum()

    with pytest.raises(RuntimeError, match=r"writes in place into a tensor it did not create.*vmapdp.validate"):
        vmapdp.per_sample_grads(mutating)(torch.ones(3), torch.randn(4, 3))


def test_functional_call_reference_for_apply():
    case = next(c for c in CASES if c.name == "multihead_attention")
    model, apply, params, buffers, (x, _), _ = setup(case, 3)
    torch.testing.assert_close(apply(params, buffers, x), model(x))
    torch.testing.assert_close(apply(params, buffers, x), functional_call(model, {**params, **buffers}, (x,)))


def test_train_mode_batchnorm_is_named_with_the_fix():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Sequential(nn.BatchNorm2d(4)), nn.Flatten(), nn.Linear(4 * 3 * 3, 2))
    apply, params, buffers = vmapdp.functionalize(model)

    def loss_fn(p, b, x):
        return apply(p, b, x[None]).sum()

    with pytest.raises(vmapdp.UnsupportedModuleError, match=r"'1.0'.*BatchNorm2d.*GroupNorm"):
        vmapdp.per_sample_grads(loss_fn)(params, buffers, torch.randn(3, 1, 5, 5))
    fixed = vmapdp.fix(model)
    apply, params, buffers = vmapdp.functionalize(fixed)
    grads = vmapdp.per_sample_grads(loss_fn)(params, buffers, torch.randn(3, 1, 5, 5))
    assert grads["1.0.weight"].shape == (3, 4)
    assert isinstance(model[1][0], nn.BatchNorm2d), "fix must not mutate its input"


def test_empty_params_is_a_clear_error():
    def loss_fn(params, buffers, x):
        return (x**2).sum()

    x = torch.randn(4, 3)
    for fn in (vmapdp.per_sample_grads(loss_fn), vmapdp.per_sample_grad_norms(loss_fn)):
        with pytest.raises(ValueError, match=r"per_sample_grads\(loss_fn\): params=\{\} must hold at least one tensor.*frozen"):
            fn({}, {}, x)
    for method in ("auto", "ghost", "vmap", "two_pass"):  # was a bare StopIteration (ghost.fn's next(iter(params)))
        with pytest.raises(ValueError, match=r"clipped_grad_sum\(loss_fn\): params=\{\} must hold at least one tensor"):
            vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method)({}, {}, x)
    with pytest.raises(ValueError, match=r"init_train_state\(params, optimizer\): params=\{\} must hold at least one tensor"):
        vmapdp.init_train_state({}, vmapdp.optim.sgd(0.1))


def _model_loss(apply):
    def loss_fn(params, buffers, sample):
        out = apply(params, buffers, sample[None])
        return (out[0] if isinstance(out, tuple) else out).square().sum()

    return loss_fn


def test_raw_batch_norm_error_names_batch_norm_and_fix():
    """Train-mode BatchNorm on one sample: torch's 'Expected more than 1 value per channel'
    (a ValueError) becomes an UnsupportedModuleError naming BatchNorm and vmapdp.fix, whether the
    loss goes through vmapdp.functionalize or calls the module's function directly."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    apply, params, buffers = vmapdp.functionalize(model)
    x = torch.randn(5, 3)
    for fn in (
        vmapdp.per_sample_grads(_model_loss(apply)),
        vmapdp.clipped_grad_sum(_model_loss(apply), l2_clip_norm=1.0, method="ghost"),
        vmapdp.clipped_grad_sum(_model_loss(apply), l2_clip_norm=1.0, method="two_pass"),
    ):
        with pytest.raises(vmapdp.UnsupportedModuleError, match=r"BatchNorm1d.*GroupNorm"):
            fn(params, buffers, x)

    def raw(params, x):  # no functionalize: the engine translates torch's error itself
        h = F.batch_norm(x[None] @ params["w"], None, None, training=True)
        return h.sum()

    with pytest.raises(vmapdp.UnsupportedModuleError, match=r"per_sample_grads\(loss_fn\): a BatchNorm layer in training mode.*vmapdp\.fix\(model\)"):
        vmapdp.per_sample_grads(raw)({"w": torch.randn(3, 4)}, x)


@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN", "GRUCell"])
@pytest.mark.parametrize("method", ["per_sample_grads", "ghost", "two_pass", "vmap"])
def test_torch_recurrent_layers_work_without_fix(kind, method):
    """torch's own nn.GRU/LSTM/RNN (whose kernels vmap cannot batch) work with every method after
    functionalize alone, equal to the one-sample-at-a-time oracle on the original module."""
    torch.manual_seed(0)
    cls = getattr(nn, kind)
    model = cls(3, 4) if kind.endswith("Cell") else cls(3, 4, batch_first=True)
    x = torch.randn(4, 3) if kind.endswith("Cell") else torch.randn(4, 5, 3)
    apply, params, buffers = vmapdp.functionalize(model)
    assert type(model) is cls  # functionalize never changes the module
    loss_fn = _model_loss(apply)
    ref = vmapdp.testing.microbatch_grads(loss_fn, params, buffers, x)
    if method == "per_sample_grads":
        vmapdp.testing.assert_grads_close(vmapdp.per_sample_grads(loss_fn)(params, buffers, x), ref, rtol=1e-4)
    else:
        summed, _, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1e6, method=method)(params, buffers, x)
        for k in params:
            torch.testing.assert_close(summed[k], ref[k].sum(0).to(summed[k].dtype), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["vmap", "two_pass", "ghost", "auto"])
def test_a_float_that_changes_at_each_call_races_and_records_once(method):
    """Found by review: the per-shape record keyed a Python float shared by the samples (a
    temperature) by its value, so each call made a new key: a new race and a state record that grew
    one entry per step. The race and the record key floats by type; plans and the one-sample check
    by value (a float may change what the loss reads: next test), at most _PLANS_KEPT of them."""
    torch.manual_seed(0)
    params = {"W": torch.randn(2, 3)}

    def loss_fn(p, temperature, sample):
        xi, yi = sample
        return F.cross_entropy(F.linear(xi[None], p["W"]) / temperature, yi[None])

    batch = (torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method)
    for t in range(clipped._PLANS_KEPT + 5):
        fn(params, 1.0 + t, batch)
    assert len(fn._plans) == clipped._PLANS_KEPT
    assert len(fn.chosen_methods) == (1 if method == "auto" else 0)
    opt = vmapdp.optim.sgd(0.1)
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, compile=False, method=method)
    state = vmapdp.init_train_state(params, opt, seed=2)
    for t in (1.0, 0.5, 2.0):
        state, _ = step(state, batch, torch.ones(4, dtype=torch.bool), t)
    assert len(state.methods) == 1, state.methods


X_OUT, Y_OUT = torch.randn(5, 3), torch.zeros(5, dtype=torch.long)


@pytest.mark.parametrize("method", ["vmap", "two_pass", "ghost", "auto"])
def test_a_float_that_changes_what_the_loss_reads_is_checked_at_each_value(method):
    """Found by review: with floats keyed by type, a flag above 0.5 that made the loss read a
    captured dataset row skipped the one-sample check (ghost's plan saw the same site) and was
    released by ghost eagerly and by every compiled step. A float that adds a layer still works."""
    torch.manual_seed(0)
    params = {"W": torch.randn(2, 3), "V": torch.randn(2, 2)}

    def loss_fn(p, mix, sample):
        xi, yi = sample
        if mix > 0.5:
            xi, yi = X_OUT[0], Y_OUT[0]
        h = F.linear(xi[None], p["W"])
        if mix > 0.2:  # (an extra layer: a plan of its own)
            h = F.linear(torch.tanh(h), p["V"])
        return F.cross_entropy(h, yi[None])

    batch = (torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
    opt = vmapdp.optim.sgd(0.1)
    for compile in (False, "eager"):
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, compile=compile, method=method)
        state = vmapdp.init_train_state(params, opt, seed=3 + bool(compile))
        for mix in (0.1, 0.3):
            state, _ = step(state, batch, torch.ones(4, dtype=torch.bool), mix)
        with pytest.raises(ValueError, match=r"does not depend on its sample"):
            step(state, batch, torch.ones(4, dtype=torch.bool), 1.0)


@pytest.mark.parametrize("method", ["vmap", "two_pass", "ghost", "auto"])
def test_a_forward_that_writes_into_its_params_is_refused_eager_and_compiled(method):
    """Found by review: a forward halving a param under no_grad (a max-norm constraint) passed
    vmap and two_pass, eager and compiled, and the released params told how many chunks had run
    (the private batch size), without noise. The one-sample check watches the params' copies."""
    torch.manual_seed(0)
    params = {"W": torch.randn(2, 3)}

    def loss_fn(p, sample):
        xi, yi = sample
        with torch.no_grad():
            p["W"].mul_(0.5)
        return F.cross_entropy(F.linear(xi[None], p["W"]), yi[None])

    batch = (torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    opt = vmapdp.optim.sgd(0.0)
    for compile in (False, "eager"):
        before = params["W"].clone()
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.1, compile=compile, method=method, physical_batch_size=4)
        with pytest.raises((RuntimeError, vmapdp.UnsupportedModuleError), match=r"writes in place into (the params \['W'\]|a parameter)"):
            step(vmapdp.init_train_state(params, opt, seed=4), batch, torch.ones(8, dtype=torch.bool))
        assert torch.equal(params["W"], before)


@pytest.mark.parametrize("method", ["vmap", "two_pass"])
def test_a_write_made_on_some_calls_only_is_refused_at_the_call_that_makes_it(method):
    """Found by review: a buffer written every third call escaped the once-per-shape check under
    vmap and two_pass (ghost's real run refused it): each eager call compares version counters."""
    params = {"W": torch.randn(2, 3)}
    ema, calls = torch.zeros(()), []

    def loss_fn(p, b, sample):
        calls.append(1)
        if len(calls) % 3 == 0:
            b.add_(1.0)
        xi, yi = sample
        return F.cross_entropy(F.linear(xi[None], p["W"]), yi[None])

    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method)
    batch = (torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"writes in place into loss_fn's argument 2"):
        for _ in range(4):
            fn(params, ema, batch)


@pytest.mark.parametrize("method", ["vmap", "two_pass", "ghost"])
@pytest.mark.parametrize("when", ["later", "compiled only"])
def test_a_compiled_step_refuses_a_write_the_eager_check_did_not_see(method, when):
    """Found by review: compiled vmap and two_pass steps watched no version counter, so a write into
    a param made on later steps only (or only under the compiler) landed on every chunk and the new
    params told how many chunks ran. The compiled chunk's call is watched eagerly."""
    torch.manual_seed(0)
    params = {"W": torch.ones(2, 3)}
    armed = []

    def loss_fn(p, sample):
        if armed if when == "later" else torch.compiler.is_compiling():
            with torch.no_grad():
                p["W"].mul_(0.5)
        xi, yi = sample
        return F.cross_entropy(F.linear(xi[None], p["W"]), yi[None])

    batch, mask = (torch.randn(8, 3), torch.zeros(8, dtype=torch.long)), torch.ones(8, dtype=torch.bool)
    opt = vmapdp.optim.sgd(0.0)
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.1, compile="eager", method=method, physical_batch_size=4)
    state = vmapdp.init_train_state(params, opt, seed=5)
    if when == "later":
        state, _ = step(state, batch, mask)
        armed.append(True)  # (dynamo guards on the flag it read: the same step recompiles, the shape already checked)
    match = r"writes in place into the params \['W'\]" if method != "ghost" else None  # (ghost: torch's own error while tracing)
    with pytest.raises(Exception, match=match):
        step(state, batch, mask)


def test_a_float_that_changes_at_each_compiled_step_gets_the_fix():
    """Found by review: torch.compile specializes a Python float shared argument, compiles a graph
    per value and fails at its recompile limit with its own error; the error names the fix."""
    params = {"W": torch.randn(2, 3)}

    def loss_fn(p, temperature, sample):
        xi, yi = sample
        return F.cross_entropy(F.linear(xi[None], p["W"]) / temperature, yi[None])

    batch, mask = (torch.randn(4, 3), torch.zeros(4, dtype=torch.long)), torch.ones(4, dtype=torch.bool)
    opt = vmapdp.optim.sgd(0.1)
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, compile="eager", method="vmap")
    state = vmapdp.init_train_state(params, opt, seed=6)
    with pytest.raises(RuntimeError, match=r"recompiled until torch.compile's limit.*Pass it as a 0-dim tensor"):
        for t in range(20):
            state, _ = step(state, batch, mask, 1.0 + t)
    torch._dynamo.reset()
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, compile="eager", method="vmap")
    state = vmapdp.init_train_state(params, opt, seed=7)
    for t in range(12):  # (as a tensor: one graph)
        state, _ = step(state, batch, mask, torch.tensor(1.0 + t))


@pytest.mark.parametrize("method", ["vmap", "two_pass", "ghost", "auto"])
def test_a_loss_that_stops_reading_its_sample_at_a_later_compiled_step_is_refused(method):
    """Found by review: a flag outside the loss's arguments that switched it to a captured dataset
    row at a later step was released by every compiled step (its shape was checked once, at the
    first). torch.compile traces anew when the flag changes (a guard fails), and the step runs the
    eager one-sample check again then, before anything is released."""
    torch.manual_seed(0)
    params = {"W": torch.randn(2, 3)}
    switched = []

    def loss_fn(p, sample):
        xi, yi = (X_OUT[0], Y_OUT[0]) if switched else sample
        return F.cross_entropy(F.linear(xi[None], p["W"]), yi[None])

    batch, mask = (torch.randn(8, 3), torch.zeros(8, dtype=torch.long)), torch.ones(8, dtype=torch.bool)
    opt = vmapdp.optim.sgd(0.1)
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.1, compile="eager", method=method)
    state, _ = step(vmapdp.init_train_state(params, opt, seed=8), batch, mask)
    state, _ = step(state, batch, mask)
    switched.append(True)
    for _ in range(2):  # (a retry finds no compiled graph to reuse: found by review, the cached one released it)
        with pytest.raises(ValueError, match=r"does not depend on its sample"):
            step(state, batch, mask)


@pytest.mark.parametrize("method", ["vmap", "ghost", "two_pass", "auto"])
def test_a_loss_reading_a_captured_row_through_dropout_is_refused(method):
    """Found by review: with randomness="different" a dropout mask is drawn per sample, so it is
    batched on its own, and a loss that read only a captured dataset row (the typo the check is
    for) looked as if it read its sample: every method released it, eager and compiled, and the
    released sum moved with a row outside the batch. The checks draw the same for every sample."""
    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 2)))

    def loss_fn(p, b, sample):
        return F.cross_entropy(apply(p, b, X_OUT[0][None]), Y_OUT[0][None])

    batch = (torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"does not depend on its sample"):
        vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method, randomness="different")(params, buffers, batch)
    opt = vmapdp.optim.sgd(0.1)
    for compile in (False, "eager"):
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.1,
                                      compile=compile, method=method, randomness="different")
        with pytest.raises(ValueError, match=r"does not depend on its sample"):
            step(vmapdp.init_train_state(params, opt, seed=9), batch, torch.ones(8, dtype=torch.bool), buffers)


@pytest.mark.parametrize("randomness", ["error", "different"])
def test_ghost_refuses_a_flag_switch_hidden_by_the_copy_of_an_uncovered_param(randomness):
    """Found by review: ghost's eager run compares each covered layer's input with the probe's
    (batched by the sample or not), but a param no rule covers runs as per-sample copies, so
    ``lin(sigmoid(gate) * row)`` is batched through the copy of ``gate`` even when ``row`` is a
    captured dataset row: a flag switched after the probe released a sum of that row alone. Such
    runs (and per-sample random draws) check one forward of the plain loss on every eager call."""
    torch.manual_seed(0)

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Parameter(torch.zeros(3))  # used through sigmoid: no ghost rule, a per-sample copy
            self.lin = nn.Linear(3, 2)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return self.lin(self.drop(torch.sigmoid(self.gate) * x))

    model = Gated()
    if randomness == "error":
        model.eval()
    apply, params, buffers = vmapdp.functionalize(model)
    switched = []

    def loss_fn(p, b, sample):
        xi, yi = (X_OUT[0], Y_OUT[0]) if switched else sample
        return F.cross_entropy(apply(p, b, xi[None]), yi[None])

    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="ghost", randomness=randomness)
    batch = (torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    assert "gate" in fn.prepare(params, buffers, batch).other
    fn(params, buffers, batch)
    switched.append(True)
    with pytest.raises(ValueError, match=r"does not depend on its sample"):
        fn(params, buffers, batch)


@pytest.mark.parametrize("method", ["vmap", "two_pass"])
def test_the_one_sample_check_does_not_write_into_the_callers_batch(method):
    """Found by review: the check ran on a view of the batch's first row, so a loss normalising its
    sample in place wrote into the caller's batch, and vmap's run then divided that row twice."""
    params = {"W": torch.randn(2, 3)}

    def loss_fn(p, sample):
        xi, yi = sample
        return F.cross_entropy(F.linear(xi.div_(2.0)[None], p["W"]), yi[None])

    x = torch.ones(4, 3)
    vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method).prepare(params, (x, torch.zeros(4, dtype=torch.long)))
    assert torch.equal(x, torch.ones(4, 3))


def test_ghost_refuses_a_flag_switch_hidden_by_the_tap_of_an_earlier_layer():
    """Found while fixing the review's finding above: ghost's taps (added to every covered
    layer's output) make everything after that layer batched, so a layer whose input joins the
    sample with such an output (features plus a learned positional embedding) looked batched
    after a flag switched the loss to a captured dataset row. Every eager ghost call checks one
    forward of the plain loss."""
    torch.manual_seed(0)

    class Features(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(4, 3)
            self.lin = nn.Linear(3, 2)

        def forward(self, x):  # x: [1, 4, 3]
            return self.lin(x + self.pos(torch.arange(4))).mean(1)

    apply, params, buffers = vmapdp.functionalize(Features())
    rows = torch.randn(5, 4, 3)
    switched = []

    def loss_fn(p, b, sample):
        xi, yi = (rows[0], Y_OUT[0]) if switched else sample
        return F.cross_entropy(apply(p, b, xi[None]), yi[None])

    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="ghost")
    batch = (torch.randn(8, 4, 3), torch.zeros(8, dtype=torch.long))
    assert not fn.prepare(params, buffers, batch).other  # every param covered: no per-sample copies
    fn(params, buffers, batch)
    switched.append(True)
    with pytest.raises(ValueError, match=r"does not depend on its sample"):
        fn(params, buffers, batch)


@pytest.mark.parametrize("method", ["vmap", "ghost", "two_pass", "auto"])
def test_a_loss_drawing_from_a_per_sample_parameter_still_runs_with_per_sample_randomness(method):
    """Found by review: torch cannot draw randomness="same" from a per-sample parameter
    (torch.normal(mu, std), torch.bernoulli(p)), and the checks' "same" draws refused such losses,
    which ran before, with torch's own error. They are checked with the step's per-sample draws."""
    torch.manual_seed(0)
    params = {"W": torch.randn(2, 3)}

    def loss_fn(p, sample):
        xi, yi = sample
        h = F.linear(xi[None], p["W"])
        return F.cross_entropy(torch.normal(h, 0.1) * torch.bernoulli(torch.sigmoid(h)), yi[None])

    batch = (torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    summed, norms, _ = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method=method, randomness="different")(params, batch)
    assert torch.isfinite(norms).all() and summed["W"].shape == (2, 3)


def test_make_train_step_checks_the_loss_once_per_step_not_per_chunk(monkeypatch):
    """The per-call check that the loss reads its sample runs on a step's first chunk only (found
    by review: per chunk it cost up to 45% of a step of one-row chunks); the next step checks again."""
    from vmapdp import clipped

    calls = []
    real = clipped.check_reads_its_sample
    monkeypatch.setattr(clipped, "check_reads_its_sample", lambda *a: (calls.append(1), real(*a))[1])
    params = {"W": torch.randn(2, 3)}

    def loss_fn(p, sample):
        xi, yi = sample
        return F.cross_entropy(F.linear(xi[None], p["W"]), yi[None])

    opt = vmapdp.optim.sgd(0.1)
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.1,
                                  compile=False, method="ghost", physical_batch_size=2)
    state = vmapdp.init_train_state(params, opt, seed=4)
    batch, mask = (torch.randn(8, 3), torch.zeros(8, dtype=torch.long)), torch.ones(8, dtype=torch.bool)
    state, _ = step(state, batch, mask)
    assert len(calls) == 1
    step(state, batch, mask)
    assert len(calls) == 2
