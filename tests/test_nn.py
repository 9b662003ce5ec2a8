"""Tests for vmapdp.nn: recurrent layers equal to torch's and usable under vmap/grad/compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from optree import tree_leaves

import vmapdp
import vmapdp.nn as vnn
from vmapdp.testing import assert_grads_close, microbatch_grads

F64 = torch.float64
INPUT, HIDDEN, LENGTH, BATCH = 3, 4, 5, 2

# (torch class, kwargs, vmapdp twin)
KINDS = {
    "rnn-tanh": (nn.RNN, {}, vnn.RNN),
    "rnn-relu": (nn.RNN, {"nonlinearity": "relu"}, vnn.RNN),
    "gru": (nn.GRU, {}, vnn.GRU),
    "lstm": (nn.LSTM, {}, vnn.LSTM),
    "lstm-proj": (nn.LSTM, {"proj_size": 2}, vnn.LSTM),
}
# (num_layers, bidirectional, batch_first, batched, bias)
LAYOUTS = [
    (1, False, False, True, True),
    (2, True, False, True, True),
    (2, False, True, True, False),
    (1, True, True, False, True),
    (2, True, False, False, True),
]


def make_pair(kind, num_layers=1, bidirectional=False, batch_first=False, bias=True, dtype=F64, seed=0):
    torch_class, kwargs, twin = KINDS[kind]
    torch.manual_seed(seed)
    reference = torch_class(
        INPUT, HIDDEN, num_layers=num_layers, bias=bias, batch_first=batch_first,
        bidirectional=bidirectional, dtype=dtype, **kwargs,
    )
    return reference, twin.from_torch(reference)


def make_input(batched, batch_first, dtype=F64, batch=BATCH):
    if not batched:
        return torch.randn(LENGTH, INPUT, dtype=dtype)
    shape = (batch, LENGTH, INPUT) if batch_first else (LENGTH, batch, INPUT)
    return torch.randn(shape, dtype=dtype)


def assert_trees_close(got, expected, **tol):
    got_leaves, expected_leaves = tree_leaves(got), tree_leaves(expected)
    assert len(got_leaves) == len(expected_leaves)
    for g, e in zip(got_leaves, expected_leaves):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, **tol)


TIGHT = {"rtol": 1e-10, "atol": 1e-12}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "L{}-bi{:d}-bf{:d}-batched{:d}-bias{:d}".format(*layout))
@pytest.mark.parametrize("kind", list(KINDS))
def test_outputs_states_and_grads_equal_torch_float64(kind, layout):
    num_layers, bidirectional, batch_first, batched, bias = layout
    reference, ours = make_pair(kind, num_layers, bidirectional, batch_first, bias)
    x = make_input(batched, batch_first)

    expected, got = reference(x), ours(x)
    assert_trees_close(got, expected, **TIGHT)

    def loss(module):
        output, state = module(x)
        return (output**2).sum() + sum(s.sin().sum() for s in tree_leaves(state))

    expected_grads = torch.autograd.grad(loss(reference), list(reference.parameters()))
    got_grads = torch.autograd.grad(loss(ours), list(ours.parameters()))
    names = [n for n, _ in reference.named_parameters()]
    assert names == [n for n, _ in ours.named_parameters()]
    for name, g, e in zip(names, got_grads, expected_grads):
        torch.testing.assert_close(g, e, **TIGHT, msg=name)


@pytest.mark.parametrize("kind", ["rnn-tanh", "gru", "lstm", "lstm-proj"])
@pytest.mark.parametrize("batched", [True, False])
def test_initial_state_is_used(kind, batched):
    reference, ours = make_pair(kind, num_layers=2, bidirectional=True)
    x = make_input(batched, batch_first=False)
    lead = (4, BATCH) if batched else (4,)
    out_size = 2 if kind == "lstm-proj" else HIDDEN
    h0 = torch.randn(*lead, out_size, dtype=F64)
    hx = (h0, torch.randn(*lead, HIDDEN, dtype=F64)) if kind.startswith("lstm") else h0
    assert_trees_close(ours(x, hx), reference(x, hx), **TIGHT)


def test_float32_matches_torch():
    reference, ours = make_pair("lstm", num_layers=2, bidirectional=True, dtype=torch.float32)
    x = make_input(True, False, dtype=torch.float32)
    assert_trees_close(ours(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "torch_class, kwargs",
    [(nn.RNNCell, {}), (nn.RNNCell, {"nonlinearity": "relu", "bias": False}), (nn.GRUCell, {}), (nn.LSTMCell, {})],
    ids=["RNNCell", "RNNCell-relu-nobias", "GRUCell", "LSTMCell"],
)
@pytest.mark.parametrize("batched", [True, False])
def test_cells_equal_torch(torch_class, kwargs, batched):
    torch.manual_seed(0)
    reference = torch_class(INPUT, HIDDEN, dtype=F64, **kwargs)
    ours = getattr(vnn, torch_class.__name__).from_torch(reference)
    lead = (BATCH,) if batched else ()
    x = torch.randn(*lead, INPUT, dtype=F64)
    h = torch.randn(*lead, HIDDEN, dtype=F64)
    hx = (h, torch.randn(*lead, HIDDEN, dtype=F64)) if torch_class is nn.LSTMCell else h
    assert_trees_close(ours(x), reference(x), **TIGHT)
    assert_trees_close(ours(x, hx), reference(x, hx), **TIGHT)


@pytest.mark.parametrize("kind", ["rnn-relu", "gru", "lstm"])
def test_vmap_grad_equals_per_sample_autograd_on_torch_module(kind):
    reference, ours = make_pair(kind, num_layers=2, bidirectional=True, batch_first=True)
    head = nn.Linear(2 * HIDDEN, 1, dtype=F64)
    batch = 3
    x = make_input(True, batch_first=True, batch=batch)
    y = torch.randn(batch, dtype=F64)

    def loss_of(module, params, xi, yi):
        output, _ = functional_call(module, params, (xi[None],))
        return (head(output[:, -1]).squeeze() - yi) ** 2

    params = {k: v.detach() for k, v in ours.named_parameters()}
    per_sample = vmap(grad(lambda p, xi, yi: loss_of(ours, p, xi, yi)), in_dims=(None, 0, 0))(params, x, y)

    for i in range(batch):
        reference.zero_grad()
        output, _ = reference(x[i : i + 1])
        ((head(output[:, -1]).squeeze() - y[i]) ** 2).backward()
        for name, param in reference.named_parameters():
            torch.testing.assert_close(per_sample[name][i], param.grad, **TIGHT, msg=f"sample {i}, {name}")


def test_torch_modules_fail_or_warn_under_vmap_and_ours_do_not():
    """Why vmapdp.nn exists (pins torch's behaviour; update if torch gains batching rules)."""
    x = torch.randn(2, LENGTH, 1, INPUT)

    def per_sample(module):
        params = dict(module.named_parameters())
        loss = lambda p, xi: functional_call(module, p, (xi,))[0].sum()  # noqa: E731
        return vmap(grad(loss), in_dims=(None, 0))(params, x)

    with pytest.raises(RuntimeError, match=r"output with shape \[1, 4\] doesn't match the broadcast shape"):
        per_sample(nn.GRU(INPUT, HIDDEN))
    with pytest.warns(UserWarning, match="performance drop .* aten::mkldnn_rnn_layer"):
        per_sample(nn.LSTM(INPUT, HIDDEN))
    for twin in (vnn.GRU, vnn.RNN, vnn.LSTM):
        grads = per_sample(twin(INPUT, HIDDEN))  # filterwarnings=error: no warning allowed
        assert grads["weight_hh_l0"].shape[0] == 2


def test_torch_compile_forward_equals_eager():
    torch.manual_seed(0)
    module = vnn.GRU(INPUT, HIDDEN, batch_first=True)
    x = torch.randn(BATCH, 3, INPUT)
    compiled = torch.compile(module, fullgraph=True)
    assert_trees_close(compiled(x), module(x), rtol=1e-5, atol=1e-6)


def test_state_dicts_load_both_ways():
    reference, ours = make_pair("lstm-proj", num_layers=2, bidirectional=True)
    fresh_torch = nn.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True, proj_size=2, dtype=F64)
    fresh_torch.load_state_dict(ours.state_dict())
    fresh_ours = vnn.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True, proj_size=2, dtype=F64)
    fresh_ours.load_state_dict(reference.state_dict())
    x = make_input(True, False)
    assert_trees_close(fresh_torch(x), reference(x), **TIGHT)
    assert_trees_close(fresh_ours(x), reference(x), **TIGHT)


def test_constructor_mirrors_torch():
    gru = vnn.GRU(INPUT, HIDDEN)
    assert [n for n, _ in gru.named_parameters()] == [n for n, _ in nn.GRU(INPUT, HIDDEN).named_parameters()]
    bound = HIDDEN**-0.5
    assert all(p.abs().max() <= bound for p in gru.parameters())
    rnn = vnn.RNN(INPUT, HIDDEN, 2, "relu")  # positional like torch.nn.RNN
    assert rnn.num_layers == 2 and rnn.nonlinearity == "relu"
    assert repr(vnn.LSTM(3, 4, 2, bidirectional=True, proj_size=2)) == repr(
        nn.LSTM(3, 4, 2, bidirectional=True, proj_size=2)
    )
    assert len(vnn.LSTM(3, 4, 2, bidirectional=True).all_weights) == 4


def test_dropout_between_layers():
    reference, ours = make_pair("gru", num_layers=3)
    reference.dropout = ours.dropout = 1.0  # deterministic: zeroes every inter-layer input
    x = make_input(True, False)
    reference.train(), ours.train()
    assert_trees_close(ours(x), reference(x), **TIGHT)
    ours.dropout = 0.5
    a, b = ours(x)[0], ours(x)[0]
    assert not torch.equal(a, b)  # active in train mode
    ours.eval()
    torch.testing.assert_close(ours(x)[0], ours(x)[0], rtol=0, atol=0)

    ours.train()
    params = dict(ours.named_parameters())
    loss = lambda p, xi: functional_call(ours, p, (xi,))[0].sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(grad(loss), in_dims=(None, 1))(params, x)
    grads = vmap(grad(loss), in_dims=(None, 1), randomness="different")(params, x)
    assert grads["weight_ih_l1"].shape == (BATCH, 3 * HIDDEN, HIDDEN)


def test_errors():
    packed = nn.utils.rnn.pack_sequence([torch.randn(3, INPUT), torch.randn(2, INPUT)])
    with pytest.raises(TypeError, match="vmapdp.nn.GRU: PackedSequence inputs are not supported"):
        vnn.GRU(INPUT, HIDDEN)(packed)
    with pytest.raises(ValueError, match="Unknown nonlinearity 'gelu'"):
        vnn.RNN(INPUT, HIDDEN, nonlinearity="gelu")
    with pytest.raises(ValueError, match="proj_size has to be smaller than hidden_size"):
        vnn.LSTM(INPUT, HIDDEN, proj_size=HIDDEN)
    with pytest.raises(ValueError, match=r"dropout should be a number in range \[0, 1\]"):
        vnn.GRU(INPUT, HIDDEN, dropout=1.5)
    with pytest.raises(TypeError, match=r"vmapdp.nn.GRU.from_torch: expected a torch.nn.modules.rnn.GRU, got LSTM"):
        vnn.GRU.from_torch(nn.LSTM(INPUT, HIDDEN))
    with pytest.raises(ValueError, match="Expected input to be 2D or 3D, got 4D"):
        vnn.LSTM(INPUT, HIDDEN)(torch.randn(1, 2, 3, INPUT))
    with pytest.raises(RuntimeError, match=r"input.size\(-1\) must be equal to input_size. Expected 3, got 5"):
        vnn.RNN(INPUT, HIDDEN)(torch.randn(2, 2, 5))
    with pytest.raises(RuntimeError, match=r"Expected hx of size \(1, 2, 4\), got \[1, 3, 4\]"):
        vnn.GRU(INPUT, HIDDEN)(torch.randn(5, 2, INPUT), torch.randn(1, 3, HIDDEN))
    with pytest.raises(RuntimeError, match="For unbatched 2-D input, hx should also be 2-D but got 3-D"):
        vnn.GRU(INPUT, HIDDEN)(torch.randn(5, INPUT), torch.randn(1, 1, HIDDEN))


# --- LoRA adapters -------------------------------------------------------------------------------


def _lora_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 3))


def _perturb_adapters(model, seed=1):
    """Nonzero B, so that A gets a gradient too (at init B = 0 and dL/dA = 0 exactly)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, vnn.LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.3)


def _ce_loss(apply):
    def loss_fn(params, buffers, sample):
        x, y = sample
        return F.cross_entropy(apply(params, buffers, x[None]), y[None])

    return loss_fn


def test_lora_linear_starts_as_its_base_and_only_the_adapters_train():
    torch.manual_seed(0)
    base = nn.Linear(5, 4)
    layer = vnn.LoRALinear(base, rank=2, alpha=4.0)
    x = torch.randn(3, 7, 5)
    assert torch.equal(layer(x), base(x))  # B = 0: exactly the base layer
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    assert base.weight.requires_grad and base.bias.requires_grad  # the base module is not modified
    assert layer.weight.data_ptr() == base.weight.data_ptr()  # ... nor copied
    assert layer.lora_A.shape == (2, 5) and layer.lora_B.shape == (4, 2) and not layer.lora_B.any()
    assert layer.scale == 2.0 and "rank=2, alpha=4" in repr(layer)
    _, params, buffers = vmapdp.functionalize(layer)
    assert sorted(params) == ["lora_A", "lora_B"] and sorted(buffers) == ["bias", "weight"]
    # the same state-dict names as the base layer: a pretrained checkpoint loads into the adapted one
    fresh = vnn.LoRALinear(nn.Linear(5, 4), rank=2)
    missing, unexpected = fresh.load_state_dict(base.state_dict(), strict=False)
    assert sorted(missing) == ["lora_A", "lora_B"] and not unexpected
    assert torch.equal(fresh(x), base(x))
    # the update: base(x) + (alpha / rank) x A^T B^T, and merged() folds it into one Linear
    with torch.no_grad():
        layer.lora_B.normal_()
    expected = base(x) + 2.0 * x @ layer.lora_A.T @ layer.lora_B.T
    torch.testing.assert_close(layer(x), expected)
    merged = layer.merged()
    assert type(merged) is nn.Linear
    torch.testing.assert_close(merged(x), layer(x), rtol=1e-5, atol=1e-6)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(vnn.LoRALinear(base, 2, generator=g1).lora_A, vnn.LoRALinear(base, 2, generator=g2).lora_A)


def test_add_lora_copies_wraps_the_targets_and_freezes_everything_else():
    model = _lora_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lora = vnn.add_lora(model, rank=2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 6)
    assert torch.equal(lora(x), model(x))  # the adapted model starts as the base model
    assert [type(m).__name__ for m in lora] == ["LoRALinear", "LayerNorm", "Tanh", "LoRALinear", "ReLU", "LoRALinear"]
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable == ["0.lora_A", "0.lora_B", "3.lora_A", "3.lora_B", "5.lora_A", "5.lora_B"]
    assert not lora[1].weight.requires_grad  # LayerNorm is frozen too
    # the original is untouched: same types, same values, still trainable
    assert [type(m) for m in model] == [nn.Linear, nn.LayerNorm, nn.Tanh, nn.Linear, nn.ReLU, nn.Linear]
    assert all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    _, params, buffers = vmapdp.functionalize(lora)
    assert sorted(params) == sorted(trainable)
    assert sum(b.numel() for b in buffers.values()) == sum(p.numel() for p in model.parameters())

    # a name predicate picks layers; the root itself may be the Linear
    only_last = vnn.add_lora(model, rank=2, targets=lambda name: name == "5")
    assert [type(m).__name__ for m in only_last] == ["Linear", "LayerNorm", "Tanh", "Linear", "ReLU", "LoRALinear"]
    assert [n for n, p in only_last.named_parameters() if p.requires_grad] == ["5.lora_A", "5.lora_B"]
    root = vnn.add_lora(nn.Linear(3, 2), rank=1)
    assert isinstance(root, vnn.LoRALinear)


def test_add_lora_on_attention_skips_out_proj_and_survives_the_fused_eval_path():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    lora = vnn.add_lora(layer, rank=2)
    assert type(lora.self_attn.out_proj) is not vnn.LoRALinear  # attention reads its weight directly
    assert [n for n, p in lora.named_parameters() if p.requires_grad] == ["linear1.lora_A", "linear1.lora_B", "linear2.lora_A", "linear2.lora_B"]
    _perturb_adapters(lora)
    x = torch.randn(3, 4, 8)
    with torch.no_grad():
        train_out = lora.train()(x)
        eval_out = lora.eval()(x)  # the fused fast path would ignore the adapters here
    torch.testing.assert_close(eval_out, train_out, rtol=1e-5, atol=1e-5)
    assert (eval_out - layer.eval()(x)).abs().max() > 1e-3


def test_lora_errors():
    with pytest.raises(ValueError, match=r"LoRALinear\(base, rank\): rank=0 must be a positive int"):
        vnn.LoRALinear(nn.Linear(3, 2), 0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"add_lora\(module, rank\): rank={bad!r} must be a positive int"):
            vnn.add_lora(nn.Linear(3, 2), bad)
    with pytest.raises(ValueError, match=r"alpha=0.0 must be a positive finite number"):
        vnn.LoRALinear(nn.Linear(3, 2), 2, alpha=0.0)
    with pytest.raises(TypeError, match=r"base must be a torch.nn.Linear or a Conv1D-style layer .*got Conv1d"):
        vnn.LoRALinear(nn.Conv1d(3, 2, 1), 2)
    convnet = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    with pytest.raises(ValueError, match=r"no layer matched targets=.*The model has no nn.Linear or Conv1D layer"):
        vnn.add_lora(convnet, 2)
    with pytest.raises(ValueError, match=r"no layer matched targets=.*The model's nn.Linear/Conv1D layers are \['0', '3', '5'\]"):
        vnn.add_lora(_lora_mlp(), 2, targets=lambda name: "attn" in name)
    # found by review: a second add_lora said the model had no Linear layer
    with pytest.raises(ValueError, match=r"already holds LoRA adapters on \['0', '3', '5'\] \(add_lora ran on it before\).*Call add_lora once"):
        vnn.add_lora(vnn.add_lora(_lora_mlp(), 2), 2)
    with pytest.raises(TypeError, match=r"targets=\(<class 'torch.nn.modules.conv.Conv2d'>,\) must be a non-empty tuple of nn.Linear \(or Conv1D-style\) classes"):
        vnn.add_lora(convnet, 2, targets=(nn.Conv2d,))
    with pytest.raises(TypeError, match=r"targets must be None, a tuple of nn.Linear \(or Conv1D-style\) classes or a callable"):
        vnn.add_lora(convnet, 2, targets="linear")


@pytest.mark.parametrize("which", ["mlp", "transformer"])
def test_lora_per_sample_grads_match_the_float64_oracle(which):
    if which == "mlp":
        lora = vnn.add_lora(_lora_mlp(), rank=3, alpha=6.0)
        g = torch.Generator().manual_seed(2)
        batch = (torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g))
    else:
        torch.manual_seed(0)
        body = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        lora = vnn.add_lora(nn.Sequential(body, nn.Flatten(), nn.Linear(4 * 8, 3)), rank=2)
        g = torch.Generator().manual_seed(2)
        batch = (torch.randn(5, 4, 8, generator=g), torch.randint(0, 3, (5,), generator=g))
    apply, params, buffers = vmapdp.functionalize(lora)
    loss_fn = _ce_loss(apply)
    at_init = vmapdp.per_sample_grads(loss_fn)(params, buffers, batch)
    assert all(not at_init[k].any() for k in at_init if k.endswith("lora_A"))  # B = 0: no gradient reaches A yet
    _perturb_adapters(lora)
    apply, params, buffers = vmapdp.functionalize(lora)
    grads = vmapdp.per_sample_grads(loss_fn)(params, buffers, batch)
    assert grads.keys() == params.keys() and all(k.endswith(("lora_A", "lora_B")) for k in grads)
    expected = microbatch_grads(loss_fn, params, buffers, batch)
    assert all(expected[k].abs().max() > 0 for k in expected)
    assert_grads_close(grads, expected, rtol=1e-4, atol=1e-6)


def test_lora_with_make_train_step_updates_only_the_adapters():
    lora = vnn.add_lora(_lora_mlp(), rank=2)
    _perturb_adapters(lora)
    apply, params, buffers = vmapdp.functionalize(lora)
    frozen = {k: v.clone() for k, v in buffers.items()}
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    opt = vmapdp.optim.sgd(0.3)
    with pytest.warns(UserWarning, match="WITHOUT differential privacy"):
        step = vmapdp.make_train_step(
            _ce_loss(apply), opt, l2_clip_norm=math.inf, noise_multiplier=0.0, expected_batch_size=8.0, sample_rate=0.5, compile=False
        )
    state, _ = step(vmapdp.init_train_state(params, opt, seed=0), (x, y), torch.ones(8, dtype=torch.bool), buffers)
    # no clipping, no noise: plain SGD on the adapters' mean gradient, computed by torch autograd
    loss = F.cross_entropy(lora(x), y)
    names = [n for n, p in lora.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for p in lora.parameters() if p.requires_grad])
    assert sorted(state.params) == sorted(names)
    for n, gr in zip(names, grads):
        torch.testing.assert_close(state.params[n], params[n] - 0.3 * gr, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(buffers[k], v) for k, v in frozen.items())  # the backbone never moves

    # and a private step runs, changes the adapters, and the trained adapters merge
    dp = vmapdp.make_train_step(_ce_loss(apply), opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.5, compile=False)
    state, metrics = dp(state, (x, y), torch.ones(8, dtype=torch.bool), buffers)
    assert state.epsilon(1e-5) > 0 and metrics["batch_size"] == 8
    lora.load_state_dict({**lora.state_dict(), **state.params})
    merged = nn.Sequential(*[m.merged() if isinstance(m, vnn.LoRALinear) else m for m in lora])
    torch.testing.assert_close(merged(x), lora(x), rtol=1e-5, atol=1e-5)
