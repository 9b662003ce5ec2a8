"""Tests for vmapdp.validation: validate, fix, explain_failure, group_norm_groups."""

from __future__ import annotations

import copy
import dataclasses

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import vmapdp
import vmapdp.nn as vnn
from vmapdp.errors import UnsupportedModuleError
from vmapdp.validation import (
    ATTRIBUTE_UPDATE,
    BATCH_NORM,
    BUFFER_UPDATE,
    RUNNING_STATS,
    VMAP_FAILURE,
    VMAP_SLOW,
    VMAP_UNSUPPORTED,
    Problem,
    explain_failure,
    fix,
    group_norm_groups,
    validate,
)
from zoo import BufferCounter

F64 = torch.float64


# --- models ---------------------------------------------------------------------------------------


def conv_bn_model(channels: int = 4, dtype=torch.float32) -> nn.Module:
    """BatchNorm2d nested at path '1.0'."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, channels, 3),
        nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU()),
        nn.Flatten(),
        nn.Linear(channels * 9, 2),
    ).to(dtype)


def clean_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(),
        nn.LayerNorm(36),
        nn.Dropout(0.1),
        nn.Linear(36, 8),
        nn.Unflatten(1, (2, 4)),
        nn.TransformerEncoderLayer(4, 2, 8, batch_first=True),
    )


class RunningMean(nn.Module):
    """Replaces (not in place) a buffer with a statistic of the data."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return x


class PythonCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


class CachesInput(nn.Module):
    def forward(self, x):
        self.last_input = x.detach()
        return x


class DataDependentBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.linear(x)
        return x


def nested(inner: nn.Module) -> nn.Module:
    """`inner` at path 'block.inner'."""
    model = nn.Sequential()
    model.add_module("block", nn.Sequential())
    model.block.add_module("pre", nn.Linear(3, 3))
    model.block.add_module("inner", inner)
    model.add_module("head", nn.Linear(3, 1))
    return model


def kinds(problems):
    return [(p.path, p.kind) for p in problems]


# --- validate: static ------------------------------------------------------------------------------


def test_batch_norm_in_train_mode_found_at_nested_path():
    problems = validate(conv_bn_model())
    assert kinds(problems) == [("1.0", BATCH_NORM)]
    (problem,) = problems
    assert problem.module == "BatchNorm2d"
    assert problem.fixable
    assert "DP guarantee" in problem.reason and "running_mean" in problem.reason
    assert "GroupNorm" in problem.fix and "vmapdp.fix" in problem.fix
    assert str(problem).startswith("'1.0' (BatchNorm2d): in training mode")
    assert "Fix: replace it by GroupNorm" in str(problem)


def test_batch_norm_in_eval_mode_is_not_a_problem():
    model = conv_bn_model().eval()
    assert validate(model) == []
    assert validate(model, torch.randn(2, 3, 5, 5)) == []


def test_batch_norm_without_running_stats_mixes_samples_even_in_eval_mode():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False)).eval()
    (problem,) = validate(model)
    assert (problem.path, problem.kind) == ("1", BATCH_NORM)
    assert "even in eval mode" in problem.reason


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.BatchNorm1d(4),
        lambda: nn.BatchNorm3d(4),
        lambda: nn.SyncBatchNorm(4),
        lambda: nn.LazyBatchNorm2d(),
    ],
    ids=["BatchNorm1d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm2d"],
)
def test_every_batch_norm_variant_is_found(make):
    model = nested(make())
    assert kinds(validate(model)) == [("block.inner", BATCH_NORM)]


def test_instance_norm_with_running_stats_found_in_train_mode_only():
    model = nested(nn.InstanceNorm1d(3, track_running_stats=True))
    (problem,) = validate(model)
    assert (problem.path, problem.kind, problem.module) == ("block.inner", RUNNING_STATS, "InstanceNorm1d")
    assert "track_running_stats=False" in problem.fix
    assert validate(model.eval()) == []
    assert validate(nested(nn.InstanceNorm1d(3, affine=True))) == []


@pytest.mark.parametrize(
    "torch_class, twin, kind",
    [
        (nn.GRU, "GRU", VMAP_UNSUPPORTED),
        (nn.RNN, "RNN", VMAP_UNSUPPORTED),
        (nn.GRUCell, "GRUCell", VMAP_UNSUPPORTED),
        (nn.LSTMCell, "LSTMCell", VMAP_UNSUPPORTED),
        (nn.LSTM, "LSTM", VMAP_SLOW),
    ],
)
def test_recurrent_layers_found_statically(torch_class, twin, kind):
    (problem,) = validate(nested(torch_class(3, 3)))
    assert (problem.path, problem.kind, problem.module) == ("block.inner", kind, torch_class.__name__)
    assert f"vmapdp.nn.{twin}" in problem.fix
    assert problem.fixable


def test_embedding_max_norm_and_training_spectral_norm_found_statically():
    """Found by review: validate(model) without inputs said nothing of them (only the step, or the
    dynamic check, refused them); both are flags or types a static check sees."""
    assert kinds(validate(nested(nn.Embedding(10, 4, max_norm=1.0)))) == [("block.inner", VMAP_UNSUPPORTED)]
    assert kinds(validate(nn.EmbeddingBag(10, 4, max_norm=1.0))) == [("", VMAP_UNSUPPORTED)]
    assert kinds(validate(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)))) == [("parametrizations.weight.0", BUFFER_UPDATE)]
    assert kinds(validate(nn.utils.spectral_norm(nn.Linear(4, 4)))) == [("", BUFFER_UPDATE)]
    # eval mode uses the stored estimate (nothing updated): clean, as a plain embedding is
    assert validate(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)).eval()) == []
    assert validate(nn.utils.spectral_norm(nn.Linear(4, 4)).eval()) == []
    assert validate(nn.Embedding(10, 4)) == []


def test_vmapdp_recurrent_layers_are_clean():
    model = nested(vnn.GRU(3, 3))
    assert validate(model) == []


def test_clean_model_has_no_problems_static_or_dynamic():
    model = clean_model()
    assert validate(model) == []
    assert validate(model, torch.randn(2, 3, 5, 5)) == []
    assert validate(model, torch.randn(2, 3, 5, 5), raise_on_problem=True) == []


# --- validate: dynamic -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "inner, kind, names",
    [
        (BufferCounter(), BUFFER_UPDATE, "'count'"),
        (RunningMean(), BUFFER_UPDATE, "'mean'"),
        (PythonCounter(), ATTRIBUTE_UPDATE, "'calls'"),
        (CachesInput(), ATTRIBUTE_UPDATE, "'last_input'"),
    ],
    ids=["buffer-in-place", "buffer-reassigned", "python-counter", "cached-input"],
)
def test_forward_that_changes_module_state_is_found_dynamically(inner, kind, names):
    model = nested(inner)
    assert validate(model) == []  # invisible statically
    problems = validate(model, torch.randn(2, 3))
    assert kinds(problems)[0] == ("block.inner", kind)
    assert names in problems[0].reason
    assert ("block.pre", kind) not in kinds(problems)


def test_dynamic_check_leaves_module_and_inputs_unchanged():
    model = nested(BufferCounter())
    model.add_module("bn", nn.BatchNorm1d(1))
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3)
    x_before = x.clone()
    validate(model, x)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert torch.equal(x, x_before)


def test_vmap_failure_attributed_to_innermost_running_module():
    model = nested(DataDependentBranch())
    assert validate(model) == []
    problems = validate(model, torch.randn(2, 3))
    assert kinds(problems) == [("block.inner", VMAP_FAILURE)]
    assert "data-dependent control flow" in problems[0].reason
    assert "torch.where" in problems[0].fix


def test_vmap_trial_looks_past_fixable_problems():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), DataDependentBranch())
    assert kinds(validate(model, torch.randn(4, 3))) == [("1", BATCH_NORM), ("2", VMAP_FAILURE)]


def test_slow_vmap_fallback_found_dynamically():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(10, 3)

        def forward(self, idx):
            return self.bag(idx)

    problems = validate(Bag(), torch.randint(0, 10, (2, 4)))
    assert kinds(problems) == [("bag", VMAP_SLOW)]
    assert "aten::_embedding_bag" in problems[0].reason


def test_failing_example_forward_is_reraised_with_a_note():
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        validate(nn.Linear(3, 2), torch.randn(2, 5))
    assert "the forward pass on the example inputs failed" in "".join(info.value.__notes__)


def test_raise_on_problem_lists_every_problem():
    model = nn.Sequential(conv_bn_model(), nn.Unflatten(1, (1, 2)), nn.GRU(2, 2))
    with pytest.raises(UnsupportedModuleError, match=r"validate\(Sequential\): 2 problems") as info:
        validate(model, raise_on_problem=True)
    message = str(info.value)
    assert "'0.1.0' (BatchNorm2d)" in message and "'2' (GRU)" in message
    assert "vmapdp.fix(module) returns a copy" in message


def test_problem_is_frozen_and_validate_rejects_non_modules():
    problem = validate(conv_bn_model())[0]
    assert isinstance(problem, Problem)
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.path = "x"
    with pytest.raises(TypeError, match=r"validate\(module\): expected a torch.nn.Module, got function"):
        validate(lambda x: x)
    root = validate(nn.BatchNorm1d(3))[0]
    assert root.path == "" and str(root).startswith("<root module> (BatchNorm1d)")


# --- fix -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "channels, groups", [(1, 1), (2, 1), (3, 1), (6, 3), (16, 8), (32, 16), (64, 32), (100, 25), (97, 1)]
)
def test_group_norm_groups(channels, groups):
    g = group_norm_groups(channels)
    assert g == groups
    assert 0 < g <= 32 and channels % g == 0
    assert channels == 1 or channels // g >= 2


def test_group_norm_groups_rejects_nonpositive():
    with pytest.raises(ValueError, match=r"group_norm_groups\(num_channels\): num_channels=0 must be an int >= 1"):
        group_norm_groups(0)
    with pytest.raises(TypeError, match=r"num_channels must be an int >= 1, got float"):
        group_norm_groups(4.0)


@pytest.mark.parametrize("channels", [1, 3, 6, 16, 64, 100])
def test_fix_swaps_batch_norm_for_group_norm_and_copies_affine(channels):
    model = conv_bn_model(channels, dtype=F64)
    bn = model[1][0]
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    bn.eps = 1e-3
    state_before = copy.deepcopy(model.state_dict())

    fixed = fix(model)

    gn = fixed[1][0]
    assert type(gn) is nn.GroupNorm
    assert gn.num_channels == channels and gn.num_groups == group_norm_groups(channels)
    assert channels % gn.num_groups == 0 and gn.num_groups > 0
    assert gn.eps == 1e-3 and gn.training
    assert gn.weight.dtype == F64
    assert torch.equal(gn.weight, bn.weight) and torch.equal(gn.bias, bn.bias)
    assert gn.weight is not bn.weight
    # the input is untouched
    assert type(model[1][0]) is nn.BatchNorm2d
    assert model.state_dict().keys() == state_before.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, state_before[key]), key
    assert validate(fixed) == []
    assert validate(fixed, torch.randn(2, 3, 5, 5, dtype=F64)) == []


def test_fixed_model_per_sample_grads_match_per_sample_autograd():
    model = fix(conv_bn_model(6, dtype=F64))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(3, 3, 5, 5, dtype=F64)
    y = torch.tensor([0, 1, 1])

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi[None],))
        return nn.functional.cross_entropy(out, yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(3):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(per_sample[name][i], param.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_fix_without_affine_and_in_eval_mode():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False))
    fixed = fix(model)
    assert type(fixed[1]) is nn.GroupNorm and not fixed[1].affine
    assert fixed[1].num_groups == 2
    eval_model = conv_bn_model().eval()
    assert type(fix(eval_model)[1][0]) is nn.BatchNorm2d  # eval-mode BatchNorm is kept


def test_fix_keeps_frozen_flags_and_sharing_and_root():
    bn = nn.BatchNorm1d(4)
    bn.weight.requires_grad_(False)
    model = nn.Sequential(nn.Linear(4, 4), bn, nn.Linear(4, 4), bn)
    fixed = fix(model)
    assert fixed[1] is fixed[3] and type(fixed[1]) is nn.GroupNorm
    assert not fixed[1].weight.requires_grad and fixed[1].bias.requires_grad
    assert type(fix(nn.BatchNorm2d(8))) is nn.GroupNorm


def test_fix_instance_norm_drops_running_stats_keeps_affine():
    norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
    with torch.no_grad():
        norm.weight.uniform_()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), norm)
    fixed = fix(model)
    assert type(fixed[1]) is nn.InstanceNorm2d and not fixed[1].track_running_stats
    assert set(fixed.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert torch.equal(fixed[1].weight, norm.weight)
    assert norm.track_running_stats and norm.running_mean is not None  # input untouched
    x = torch.randn(2, 3, 6, 6)
    assert validate(fixed, x) == []
    torch.testing.assert_close(fixed(x), nn.functional.instance_norm(
        model[0](x), weight=norm.weight, bias=norm.bias, eps=norm.eps))


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.GRU(3, 4, num_layers=2, bidirectional=True),
        lambda: nn.RNN(3, 4, nonlinearity="relu"),
        lambda: nn.LSTM(3, 4, proj_size=2),
        lambda: nn.GRUCell(3, 4),
    ],
    ids=["GRU", "RNN", "LSTM", "GRUCell"],
)
def test_fix_swaps_recurrent_layers_with_equal_parameters_and_outputs(make):
    torch.manual_seed(0)
    original = make().double()
    fixed = fix(original)
    assert type(fixed) is getattr(vnn, type(original).__name__)
    assert list(fixed.state_dict()) == list(original.state_dict())
    for key, value in original.state_dict().items():
        assert torch.equal(fixed.state_dict()[key], value), key
    x = torch.randn(5, 2, 3, dtype=F64) if not isinstance(original, nn.GRUCell) else torch.randn(2, 3, dtype=F64)
    expected, got = original(x), fixed(x)
    for e, g in zip(optree.tree_leaves(expected), optree.tree_leaves(got)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    assert validate(fixed) == []


def test_fix_raises_for_what_it_cannot_repair_and_leaves_input_alone():
    class MyGRU(nn.GRU):
        pass

    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Unflatten(1, (1, 3)), MyGRU(3, 3))
    with pytest.raises(
        UnsupportedModuleError,
        match=r"(?s)fix\(Sequential\): 1 problem that vmapdp.fix cannot repair:.*'3' \(MyGRU\).*derive MyGRU from vmapdp.nn.GRU",
    ):
        fix(model)
    assert type(model[1]) is nn.BatchNorm1d

    with pytest.raises(UnsupportedModuleError, match="run one forward pass .* to initialize it"):
        fix(nn.Sequential(nn.Linear(3, 3), nn.LazyBatchNorm1d()))


# --- explain_failure -------------------------------------------------------------------------------


def per_sample_grads_through(model, x):
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p, xi):
        out = functional_call(model, (p, buffers), (xi[None],))
        return out[0].sum() if isinstance(out, tuple) else out.sum()

    return vmap(grad(loss), in_dims=(None, 0))(params, x)


def test_explain_failure_names_train_mode_batch_norm_and_group_norm():
    model = conv_bn_model()
    with pytest.raises(RuntimeError, match="in-place operation") as info:
        per_sample_grads_through(model, torch.randn(3, 3, 5, 5))
    explained = explain_failure(model, info.value)
    assert isinstance(explained, UnsupportedModuleError)
    message = str(explained)
    assert message.startswith("per-sample gradients of Sequential failed inside torch.func (RuntimeError: ")
    assert "'1.0' (BatchNorm2d)" in message and "GroupNorm" in message


def test_explain_failure_names_torch_gru():
    model = nn.Sequential(nn.Linear(3, 3), nn.GRU(3, 4, batch_first=True))
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape") as info:
        per_sample_grads_through(model, torch.randn(2, 5, 3))
    message = str(explain_failure(model, info.value))
    assert "'1' (GRU)" in message and "vmapdp.nn.GRU" in message
    assert "Linear" not in message


def test_explain_failure_returns_none_when_it_cannot_attribute():
    err = RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x5 and 3x2)")
    assert explain_failure(conv_bn_model(), err) is None  # unrelated message
    inplace = RuntimeError("vmap: inplace arithmetic(self, *extra_args) is not possible")
    assert explain_failure(clean_model(), inplace) is None  # nothing to blame statically
    assert explain_failure(conv_bn_model(), inplace) is not None


def test_the_vmap_trial_runs_each_sample_as_a_batch_of_one():
    """Found by review: the trial mapped over two copies of the whole example batch, while the
    per-sample engine runs each sample as a batch of one: a custom module normalising with
    F.batch_norm(training=True) passed validate, and every method raised."""

    class BatchStats(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return F.batch_norm(x, None, None, self.w, self.b, training=True)

    problems = vmapdp.validate(nn.Sequential(nn.Linear(3, 4), BatchStats(), nn.Linear(4, 2)), torch.randn(8, 3))
    assert [(p.path, p.kind) for p in problems] == [("1", "vmap_failure")]
    assert "each a batch of one" in problems[0].reason and "more than 1 value per channel" in problems[0].reason
    assert vmapdp.validate(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(8, 3)) == []

    class Masked(nn.Module):  # a shared [T, T] mask: with T equal to the batch size it was cut as a sample (found by review)
        def __init__(self):
            super().__init__()
            self.fc, self.mha = nn.Linear(6, 8), nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, mask):
            h = self.fc(x)
            return self.mha(h, h, h, attn_mask=mask, need_weights=False)[0].sum(1)

    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    assert [p.kind for p in vmapdp.validate(Masked(), torch.randn(5, 5, 6), causal) if p.kind == "vmap_failure"] == []

    class TwoInputs(Masked):  # ... and beside a second per-sample input (found by review of the fix)
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(12, 8)

        def forward(self, x, y, mask):
            h = self.fc(torch.cat([x, y], -1))
            return self.mha(h, h, h, attn_mask=mask, need_weights=False)[0].sum(1)

    assert [p.kind for p in vmapdp.validate(TwoInputs(), torch.randn(5, 5, 6), torch.randn(5, 5, 6), causal) if p.kind == "vmap_failure"] == []
