"""functionalize: trainable/frozen split, tied weights, buffers, purity, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapdp


def test_split_trainable_frozen_buffers():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
    model[0].weight.requires_grad_(False)
    apply, params, buffers = vmapdp.functionalize(model)
    assert sorted(params) == ["0.bias", "1.bias", "1.weight", "2.bias", "2.weight"]
    assert sorted(buffers) == ["0.weight", "1.num_batches_tracked", "1.running_mean", "1.running_var"]
    x = torch.randn(5, 3)
    torch.testing.assert_close(apply(params, buffers, x), model(x))


def test_tied_weights_once_and_updates_reach_both_uses():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3, bias=False)
            self.b = nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    model = Tied()
    apply, params, buffers = vmapdp.functionalize(model)
    assert list(params) == ["a.weight"]
    w = torch.eye(3) * 2
    x = torch.randn(2, 3)
    torch.testing.assert_close(apply({"a.weight": w}, buffers, x), 4 * x)


def test_no_copy_and_no_mutation():
    model = nn.Linear(3, 2)
    apply, params, _ = vmapdp.functionalize(model)
    assert params["weight"].data_ptr() == model.weight.data_ptr()
    assert not params["weight"].requires_grad
    before = model.weight.detach().clone()
    apply({"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, {}, torch.ones(1, 3))
    assert torch.equal(model.weight, before)


def test_a_submodule_held_under_two_paths_keeps_its_parameters_and_trains_through_each_path():
    # torch's functional_call set such a slot once per path and restored the originals in the same
    # order, so after one call the module held the passed-in tensor instead of its Parameter
    # (peft's prompt models hold the input embedding as word_embeddings as well)
    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = self.a  # one submodule, two paths
            self.c = nn.Linear(3, 3)
            self.c.weight = self.a.weight  # and a tied parameter in another submodule
            self.register_buffer("s", torch.tensor(2.0))

        def forward(self, x):
            return self.c(self.b(self.a(x))) * self.s

    model = Aliased()
    before = {n: p for n, p in model.named_parameters()}
    apply, params, buffers = vmapdp.functionalize(model)
    assert list(params) == ["a.weight", "a.bias", "c.bias"]
    x = torch.randn(4, 3)
    torch.testing.assert_close(apply(params, buffers, x), model(x))
    grads = torch.func.grad(lambda p: apply(p, buffers, x).square().sum())(params)
    model(x).square().sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)
    moved = {k: v + 1 for k, v in params.items()}
    want = torch.nn.functional.linear
    a = lambda z: want(z, moved["a.weight"], moved["a.bias"])  # noqa: E731
    torch.testing.assert_close(apply(moved, buffers, x), 2 * want(a(a(x)), moved["a.weight"], moved["c.bias"]))
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)  # the module is untouched
    assert model.b.weight is before["a.weight"] and model.c.weight is before["a.weight"]
    with pytest.raises(KeyError, match=r"missing \['a.bias'"):
        apply({"a.weight": params["a.weight"], "c.bias": params["c.bias"]}, buffers, x)
    # the buffers passed are the ones used (not the module's), a frozen param among them
    model.c.bias.requires_grad_(False)
    apply, params, buffers = vmapdp.functionalize(model)
    assert sorted(buffers) == ["c.bias", "s"]
    other = {"s": torch.tensor(3.0), "c.bias": torch.ones(3)}
    torch.testing.assert_close(apply(params, other, x), 1.5 * (model(x) - 2 * model.c.bias) + 3 * torch.ones(3))
    assert model.s == 2.0 and model.c.bias is before["c.bias"]
    # a module changed after functionalize is refused with the names it gained (not run with its own new layer)
    model.extra = nn.Linear(3, 3)
    with pytest.raises(KeyError, match=r"missing \['extra.bias', 'extra.weight'\].*functionalize it again"):
        apply(params, buffers, x)


def test_a_recurrent_layer_held_under_two_paths_gets_one_twin():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(3, 3, batch_first=True)
            self.again = self.rnn

        def forward(self, x):
            return self.again(self.rnn(x)[0])[0].square().sum()

    model = Twice()
    apply, params, buffers = vmapdp.functionalize(model)
    assert apply.module.rnn is apply.module.again and list(params) == ["rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.bias_ih_l0", "rnn.bias_hh_l0"]
    x = torch.randn(2, 4, 3)
    grads = torch.func.grad(lambda p: apply(p, buffers, x))(params)
    model(x).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


def test_kwargs_and_tuple_outputs_pass_through():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, *, scale=1.0):
            return self.lin(x) * scale, x

    model = Two()
    apply, params, buffers = vmapdp.functionalize(model)
    out, same = apply(params, buffers, torch.ones(1, 2), scale=3.0)
    torch.testing.assert_close(out, model(torch.ones(1, 2))[0] * 3)


def test_errors_name_the_problem():
    apply, params, buffers = vmapdp.functionalize(nn.Linear(3, 2))
    with pytest.raises(TypeError, match=r"functionalize\(module\): expected an nn.Module, got function"):
        vmapdp.functionalize(lambda x: x)
    with pytest.raises(KeyError, match=r"missing \['bias'\], unexpected \['bais'\]"):
        apply({"weight": params["weight"], "bais": params["bias"]}, buffers, torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"keys \['bias'\] are in both params and buffers"):
        apply(params, {"bias": params["bias"]}, torch.ones(1, 3))
    with pytest.raises(TypeError, match=r"expected two dicts of tensors first"):
        apply(torch.ones(1, 3), {}, torch.ones(1, 3))
