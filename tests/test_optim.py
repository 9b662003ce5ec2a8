"""vmapdp.optim: the functional optimizers against torch.optim, purity, errors, compile."""

from __future__ import annotations

import io
import re

import optree
import pytest
import torch
import torch._dynamo

from vmapdp import optim

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=1e-6, atol=1e-7)}


def make_params(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"fc1.weight": (5, 3), "fc1.bias": (5,), "fc2.weight": (2, 5), "scale": ()}
    return {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}


def make_grad_seq(params, steps, seed=1, dtype=None):
    """Random gradients, each dict in the reverse key order of params: joined by key, not order."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {k: torch.randn(p.shape, generator=gen, dtype=dtype or p.dtype) for k, p in reversed(params.items())}
        for _ in range(steps)
    ]


def torch_trajectory(cls, params, grad_seq, **kwargs):
    """Params after every step of torch.optim's stateful optimizer, and its final per-param state."""
    live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = cls(list(live.values()), **kwargs)
    trajectory = []
    for grads in grad_seq:
        for k, p in live.items():
            p.grad = grads[k].clone().to(p.dtype)
        opt.step()
        trajectory.append({k: p.detach().clone() for k, p in live.items()})
    return trajectory, {k: opt.state[p] for k, p in live.items()}


def run(opt, params, grad_seq):
    state = opt.init(params)
    trajectory = []
    for grads in grad_seq:
        params, state = opt.update(grads, state, params)
        trajectory.append(params)
    return trajectory, state


def assert_same_trajectory(ours, theirs, start, tol):
    prev = start
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert list(a) == list(b), f"step {step}: keys {list(a)} != {list(b)}"
        for k in b:
            assert a[k].dtype == b[k].dtype
            torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m, k=k, step=step: f"step {step}, {k!r}: {m}")
        assert any(not torch.equal(a[k], prev[k]) for k in a), f"step {step}: params did not move"
        prev = a


def lr_value(lr_kind, value):
    return torch.tensor(value) if lr_kind == "tensor" else value


SGD_CASES = {
    "plain": dict(),
    "momentum": dict(momentum=0.9),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "dampening": dict(momentum=0.9, dampening=0.3),
    "weight_decay": dict(weight_decay=0.05),
    "momentum_weight_decay_maximize": dict(momentum=0.5, weight_decay=0.05, maximize=True),
    "nesterov_maximize": dict(momentum=0.9, nesterov=True, maximize=True),
}
ADAM_CASES = {
    "default": dict(),
    "amsgrad": dict(amsgrad=True),
    "weight_decay": dict(weight_decay=0.1),
    "maximize": dict(maximize=True),
    "betas_eps": dict(betas=(0.5, 0.8), eps=1e-3),
    "amsgrad_weight_decay_maximize": dict(amsgrad=True, weight_decay=0.1, maximize=True),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_equals_torch_sgd(case, lr_kind, dtype):
    kwargs = SGD_CASES[case]
    params = make_params(dtype)
    grad_seq = make_grad_seq(params, 5)
    ours, state = run(optim.sgd(lr_value(lr_kind, 0.1), **kwargs), params, grad_seq)
    theirs, torch_state = torch_trajectory(torch.optim.SGD, params, grad_seq, lr=lr_value(lr_kind, 0.1), **kwargs)
    assert_same_trajectory(ours, theirs, params, TOL[dtype])
    assert state.step.item() == 5
    if kwargs.get("momentum", 0) == 0:
        assert state.momentum_buffer is None
    else:
        for k in params:
            torch.testing.assert_close(state.momentum_buffer[k], torch_state[k]["momentum_buffer"], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("case", list(ADAM_CASES))
@pytest.mark.parametrize("which", ["adam", "adamw"])
def test_adam_and_adamw_equal_torch(which, case, lr_kind, dtype):
    kwargs = dict(ADAM_CASES[case])
    factory, cls = (optim.adam, torch.optim.Adam) if which == "adam" else (optim.adamw, torch.optim.AdamW)
    if which == "adamw" and "weight_decay" not in kwargs:
        kwargs["weight_decay"] = 1e-2  # both defaults, stated: the comparison must not rest on them
    params = make_params(dtype)
    grad_seq = make_grad_seq(params, 5)
    ours, state = run(factory(lr_value(lr_kind, 0.05), **kwargs), params, grad_seq)
    theirs, torch_state = torch_trajectory(cls, params, grad_seq, lr=lr_value(lr_kind, 0.05), **kwargs)
    assert_same_trajectory(ours, theirs, params, TOL[dtype])
    assert state.step.dtype == torch.float32 and state.step.item() == 5
    fields = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kwargs.get("amsgrad") else [])
    for field in fields:
        for k in params:
            torch.testing.assert_close(getattr(state, field)[k], torch_state[k][field], **TOL[dtype])
    if not kwargs.get("amsgrad"):
        assert state.max_exp_avg_sq is None


def test_adamw_default_weight_decay_matches_torch():
    assert optim.adamw.__kwdefaults__["weight_decay"] == torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]


@pytest.mark.parametrize("which", ["sgd", "adam"])
def test_bfloat16_params_with_float32_grads(which):
    params = make_params(torch.bfloat16)
    grad_seq = make_grad_seq(params, 3, dtype=torch.float32)  # DP sums come in float32
    if which == "sgd":
        opt, cls, kwargs = optim.sgd(0.1, momentum=0.9), torch.optim.SGD, dict(lr=0.1, momentum=0.9)
    else:
        opt, cls, kwargs = optim.adam(0.05), torch.optim.Adam, dict(lr=0.05)
    ours, state = run(opt, params, grad_seq)
    theirs, _ = torch_trajectory(cls, params, grad_seq, **kwargs)  # torch wants bf16 grads: cast there
    assert_same_trajectory(ours, theirs, params, dict(rtol=0, atol=0))
    buffers = state.momentum_buffer if which == "sgd" else state.exp_avg
    assert {k: v.dtype for k, v in buffers.items()} == {k: torch.bfloat16 for k in params}


def test_lr_tensor_is_read_at_every_update():
    lr = torch.tensor(0.5)
    opt = optim.sgd(lr)
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    grads = {"w": torch.ones(3)}
    params, state = opt.update(grads, state, params)
    torch.testing.assert_close(params["w"], torch.full((3,), 0.5))
    lr.fill_(0.0)  # a schedule changes the rate in place
    params, state = opt.update(grads, state, params)
    torch.testing.assert_close(params["w"], torch.full((3,), 0.5))


# ------------------------------------------------------------------------------------------------
# purity


PURITY_CASES = {
    "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd_dampening": lambda: optim.sgd(torch.tensor(0.1), momentum=0.9, dampening=0.5),
    "adam_amsgrad": lambda: optim.adam(0.01, amsgrad=True, weight_decay=0.1, maximize=True),
    "adamw": lambda: optim.adamw(torch.tensor(0.01)),
    "from_torch_rmsprop": lambda: optim.from_torch(torch.optim.RMSprop, lr=0.01, momentum=0.5),
}


def tensor_leaves(tree):
    return [x for x in optree.tree_leaves(tree, namespace="torch") if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("case", list(PURITY_CASES))
def test_update_is_pure(case):
    opt = PURITY_CASES[case]()
    params = make_params(torch.float32)
    g1, g2 = make_grad_seq(params, 2)
    params, state = opt.update(g1, opt.init(params), params)  # a state that is not all zeros
    inputs = (g2, state, params)
    leaves = tensor_leaves(inputs)
    assert len(leaves) > 2 * len(params)
    copies = [x.clone() for x in leaves]
    versions = [x._version for x in leaves]

    out1 = opt.update(*inputs)
    out2 = opt.update(*inputs)

    for x, c, v in zip(leaves, copies, versions):
        assert torch.equal(x, c), "an input changed"
        assert x._version == v, "an input was written in place"
    a, b = tensor_leaves(out1), tensor_leaves(out2)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), "same inputs, different outputs"
    input_storages = {x.untyped_storage().data_ptr() for x in leaves}
    assert not any(x.untyped_storage().data_ptr() in input_storages for x in a), "an output aliases an input"
    assert list(out1[0]) == list(params)


def test_state_round_trips_through_torch_save_weights_only():
    params = make_params(torch.float32)
    (grads,) = make_grad_seq(params, 1)
    for opt in (optim.sgd(0.1), optim.sgd(0.1, momentum=0.9), optim.adam(amsgrad=True), PURITY_CASES["from_torch_rmsprop"]()):
        _, state = opt.update(grads, opt.init(params), params)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        with torch.serialization.safe_globals(list(optim.SAFE_GLOBALS)):
            loaded = torch.load(buffer, weights_only=True)
        assert type(loaded) is type(state)
        assert optree.tree_structure(loaded, namespace="torch") == optree.tree_structure(state, namespace="torch")
        assert all(torch.equal(x, y) for x, y in zip(tensor_leaves(loaded), tensor_leaves(state)))


# ------------------------------------------------------------------------------------------------
# from_torch


def test_from_torch_rmsprop_equals_rmsprop():
    kwargs = dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.01)
    params = make_params(torch.float64)
    grad_seq = make_grad_seq(params, 3)
    ours, state = run(optim.from_torch(torch.optim.RMSprop, **kwargs), params, grad_seq)
    theirs, torch_state = torch_trajectory(torch.optim.RMSprop, params, grad_seq, **kwargs)
    assert_same_trajectory(ours, theirs, params, TOL[torch.float64])
    assert set(state.per_param) == set(params)
    for k in params:
        assert set(state.per_param[k]) == set(torch_state[k])
        for s, v in torch_state[k].items():
            torch.testing.assert_close(state.per_param[k][s], v, **TOL[torch.float64])


def test_from_torch_rejects_non_optimizers_and_bad_kwargs_at_construction():
    with pytest.raises(TypeError, match=r"from_torch\(optimizer_cls, \*\*kwargs\): optimizer_cls must be a subclass of torch.optim.Optimizer"):
        optim.from_torch(optim.sgd, lr=0.1)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own check, raised early
        optim.from_torch(torch.optim.RMSprop, lr=-1.0)


# ------------------------------------------------------------------------------------------------
# errors


KEYED_OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1, momentum=0.9),
    "adam": lambda: optim.adam(),
    "adamw": lambda: optim.adamw(),
    "from_torch(RMSprop)": lambda: optim.from_torch(torch.optim.RMSprop, lr=0.01),
}


@pytest.mark.parametrize("which", list(KEYED_OPTIMIZERS))
def test_grads_keys_must_equal_params_keys(which):
    opt = KEYED_OPTIMIZERS[which]()
    params = make_params(torch.float32)
    state = opt.init(params)
    (grads,) = make_grad_seq(params, 1)
    del grads["fc1.bias"]
    grads["fc3.weight"] = torch.zeros(2, 2)
    call = f"{which}(...)" if "(" not in which else which
    with pytest.raises(
        ValueError,
        match="^" + re.escape(f"{call}.update(grads, state, params): ") + r"the keys of grads differ from the keys of params \(leaves are joined by key\); "
        r"missing from grads: \['fc1\.bias'\]; extra in grads: \['fc3\.weight'\]\.",
    ):
        opt.update(grads, state, params)


def test_grads_shape_must_equal_params_shape_with_per_sample_hint():
    opt = optim.sgd(0.1)
    params = make_params(torch.float32)
    grads = {k: torch.zeros((4,) + p.shape) for k, p in params.items()}
    with pytest.raises(
        ValueError,
        match=r"grads\['fc1\.weight'\] has shape \(4, 5, 3\), expected the param's shape \(5, 3\)\. "
        r"Did you pass per-sample gradients\? Sum them first \(clip_and_sum\)\.",
    ):
        opt.update(grads, opt.init(params), params)


def test_state_from_another_model_is_rejected():
    opt = optim.adam()
    params = make_params(torch.float32)
    state = opt.init({"other": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"missing from state\.exp_avg: \['fc1\.weight', 'fc1\.bias', 'fc2\.weight', 'scale'\]; extra in state\.exp_avg: \['other'\]"):
        opt.update(make_grad_seq(params, 1)[0], state, params)
    with pytest.raises(TypeError, match=r"state must be the AdamState returned by this optimizer's init or update, got SGDState"):
        opt.update(make_grad_seq(params, 1)[0], optim.sgd(0.1).init(params), params)


BAD_HYPERPARAMETERS = [
    (lambda: optim.sgd(-0.1), r"^sgd: lr=-0\.1 must be >= 0\.$"),
    (lambda: optim.sgd(float("nan")), r"^sgd: lr=nan must be >= 0\.$"),
    (lambda: optim.sgd(float("inf")), r"^sgd: lr=inf must be finite\.$"),
    (lambda: optim.sgd(torch.tensor(-0.5)), r"^sgd: lr=-0\.5 \(a tensor\) must be finite and >= 0\.$"),
    (lambda: optim.sgd(torch.tensor([0.1])), r"^sgd: lr must be a float or a 0-dim floating tensor, got a torch\.float32 tensor of shape \(1,\)"),
    (lambda: optim.sgd(0.1, momentum=-0.1), r"^sgd: momentum=-0\.1 must be >= 0\.$"),
    (lambda: optim.sgd(0.1, weight_decay=-0.01), r"^sgd: weight_decay=-0\.01 must be >= 0\.$"),
    (lambda: optim.sgd(0.1, nesterov=True), r"^sgd: nesterov=True requires momentum > 0 and dampening = 0, got momentum=0\.0, dampening=0\.0\.$"),
    (lambda: optim.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True), r"^sgd: nesterov=True requires momentum > 0 and dampening = 0, got momentum=0\.9, dampening=0\.1\.$"),
    (lambda: optim.adam(-1e-3), r"^adam: lr=-0\.001 must be >= 0\.$"),
    (lambda: optim.adam(betas=(1.0, 0.999)), r"^adam: betas\[0\]=1\.0 must be in \[0, 1\)\.$"),
    (lambda: optim.adam(betas=(0.9, -0.1)), r"^adam: betas\[1\]=-0\.1 must be in \[0, 1\)\.$"),
    (lambda: optim.adam(eps=-1e-8), r"^adam: eps=-1e-08 must be >= 0\.$"),
    (lambda: optim.adam(weight_decay=-0.1), r"^adam: weight_decay=-0\.1 must be >= 0\.$"),
    (lambda: optim.adamw(betas=(0.9, 1.5)), r"^adamw: betas\[1\]=1\.5 must be in \[0, 1\)\.$"),
    (lambda: optim.adamw(weight_decay=-1.0), r"^adamw: weight_decay=-1\.0 must be >= 0\.$"),
]


@pytest.mark.parametrize("make, message", BAD_HYPERPARAMETERS, ids=[m for _, m in BAD_HYPERPARAMETERS])
def test_bad_hyperparameters_raise_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_non_numeric_hyperparameters_raise_type_error():
    with pytest.raises(TypeError, match=r"^sgd: lr must be a float, got str \('0\.1'\)\.$"):
        optim.sgd("0.1")
    with pytest.raises(TypeError, match=r"^adam: betas must be a pair of floats \(beta1, beta2\), got 0\.9\.$"):
        optim.adam(betas=0.9)


# ------------------------------------------------------------------------------------------------
# torch.compile (one compiled function: compiling is slow on 2 cores)


def test_compiled_adam_update_equals_eager_without_graph_breaks_or_recompiles():
    lr = torch.tensor(0.05)
    opt = optim.adam(lr, amsgrad=True, weight_decay=0.1)
    params = make_params(torch.float32)
    grad_seq = make_grad_seq(params, 2)
    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = torch.compile(opt.update, fullgraph=True)  # fullgraph: a graph break is an error

    eager_params, eager_state = params, opt.init(params)
    comp_params, comp_state = params, opt.init(params)
    for step, grads in enumerate(grad_seq):
        if step == 1:
            lr.fill_(0.2)  # a schedule: the compiled graph reads the new rate
        eager_params, eager_state = opt.update(grads, eager_state, eager_params)
        comp_params, comp_state = compiled(grads, comp_state, comp_params)
        for k in params:
            torch.testing.assert_close(comp_params[k], eager_params[k], rtol=1e-6, atol=1e-7)
        for x, y in zip(tensor_leaves(comp_state), tensor_leaves(eager_state)):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    # compiled once: new state tensors and the new rate reuse the graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before + 1


class _NoisyLateKeys(torch.optim.Optimizer):
    """A stand-in optimizer that draws from the global RNG in step() and adds a state key only from
    its second step on (what an optimizer may do; from_torch must accept its own state)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                if state["n"] > 1:
                    state["ema"] = p.detach().clone()
                p.add_(p.grad + torch.randn_like(p), alpha=-group["lr"])


def test_from_torch_accepts_its_own_state_and_refuses_another_optimizers():
    """The first update of a held state probes which keys the optimizer makes (once per param name,
    shape, dtype and device, without drawing from the global RNG): keys an optimizer adds later or
    another setting keeps are fine (Adam(amsgrad=True)'s state under amsgrad=False, as torch's own
    load_state_dict allows); a state lacking them (RMSprop's under Adam or SGD) is refused."""
    p, g = {"w": torch.ones(3)}, {"w": torch.full((3,), 0.5)}
    opt = optim.from_torch(_NoisyLateKeys, lr=0.1)
    state = opt.init(p)
    params = p
    torch.manual_seed(0)
    for _ in range(4):
        params, state = opt.update(g, state, params)
    torch.manual_seed(0)
    ref = torch.ones(3)
    plain = _NoisyLateKeys([ref], lr=0.1)
    for _ in range(4):
        ref.grad = torch.full((3,), 0.5)
        plain.step()
    assert torch.equal(params["w"], ref)  # (the probe drew nothing from the run's RNG)
    ams = optim.from_torch(torch.optim.Adam, lr=0.1, amsgrad=True)
    _, held = ams.update(g, ams.init(p), p)
    optim.from_torch(torch.optim.Adam, lr=0.1).update(g, held, p)
    rms = optim.from_torch(torch.optim.RMSprop, lr=0.1)
    _, held = rms.update(g, rms.init(p), p)
    with pytest.raises(ValueError, match=r"makes \['exp_avg', 'exp_avg_sq', 'step'\] for it: the state was made by another optimizer"):
        optim.from_torch(torch.optim.Adam, lr=0.1).update(g, held, p)
    # one optimizer object over params of different ranks under one name (Adafactor keeps other keys)
    ada = optim.from_torch(torch.optim.Adafactor, lr=0.1)
    for shape in ((3,), (3, 2)):
        q, h = {"w": torch.ones(shape)}, {"w": torch.full(shape, 0.5)}
        _, s = ada.update(h, ada.init(q), q)
        ada.update(h, s, q)
