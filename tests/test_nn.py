"""Tests for vmapdp.nn: recurrent layers equal to torch's and usable under vmap/grad/compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from optree import tree_leaves

import vmapdp.nn as vnn

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


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "L{}-bi{:d}-bf{:d}-batched{:d}-bias{:d}".format(*l))
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
