"""One argument, one check: every public entry point that takes an argument refuses the same bad
values with the same exception type (TypeError for a wrong type, ValueError for a wrong range)
and a message that names the call and the argument. A new entry point that hand-rolls its own
check (and accepts what the others refuse) fails here."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vmapdp
from vmapdp import _checks
from vmapdp import accounting as acc
from vmapdp.accounting import Ledger, PoissonGaussianEvent
from vmapdp.data import PoissonSampler

# --- tiny fixtures ------------------------------------------------------------------------------

_X = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
_Y = torch.tensor([0, 1, 0, 1, 1, 0])
_PARAMS = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(1))}
_GRADS = {"w": torch.randn(6, 3, 2, generator=torch.Generator().manual_seed(2))}


def _loss(params, sample):
    x, y = sample
    return F.cross_entropy((x @ params["w"])[None], y[None])


def _step(**kw):
    args = dict(l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=3.0, sample_rate=0.5, compile=False, method="vmap")
    args.update(kw)
    return vmapdp.make_train_step(_loss, vmapdp.optim.sgd(0.1), **args)


def _private(**kw):
    model = nn.Linear(3, 2)
    ds = torch.utils.data.TensorDataset(torch.randn(200, 3), torch.zeros(200, dtype=torch.long))
    args = dict(batch_size=10, l2_clip_norm=1.0, noise_multiplier=1.0, delta=1e-5, compile=False, method="vmap")
    args.update(kw)
    return vmapdp.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, **args)


_ACC = dict(noise_multiplier=1.0, sample_rate=0.01, steps=100)
_STATE = vmapdp.init_train_state(_PARAMS, vmapdp.optim.sgd(0.1), seed=0)


def _grid(**kw):
    args = dict(noise_multiplier=[1.0], sample_rate=[0.01], steps=[100], delta=[1e-5])
    args.update({k: [v] for k, v in kw.items() if k != "accountant"})
    if "accountant" in kw:
        args["accountant"] = kw["accountant"]
    return acc.epsilon_grid(**args)


# --- the table: argument -> {entry point: call with that argument set} ----------------------------

ENTRY_POINTS = {
    "l2_clip_norm": {
        "clip_and_sum": lambda v: vmapdp.clip_and_sum(_GRADS, v),
        "clip_per_sample": lambda v: vmapdp.clip_per_sample(_GRADS, v),
        "clip_factors": lambda v: vmapdp.clipping.clip_factors(torch.ones(3), v),
        "clip_and_sum_per_layer": lambda v: vmapdp.clip_and_sum_per_layer(_GRADS, {"w": v}),
        "clipped_grad_sum": lambda v: vmapdp.clipped_grad_sum(_loss, l2_clip_norm=v),
        "make_train_step": lambda v: _step(l2_clip_norm=v),
        "make_private": lambda v: _private(l2_clip_norm=v),
    },
    "noise_multiplier": {
        "accounting.epsilon": lambda v: acc.epsilon(**{**_ACC, "noise_multiplier": v}, delta=1e-5),
        "accounting.delta": lambda v: acc.delta(**{**_ACC, "noise_multiplier": v}, epsilon=1.0),
        "accounting.epsilon_bounds": lambda v: acc.epsilon_bounds(**{**_ACC, "noise_multiplier": v}, delta=1e-5),
        "accounting.epsilon_grid": lambda v: _grid(noise_multiplier=v),
        "PoissonGaussianEvent": lambda v: PoissonGaussianEvent(noise_multiplier=v, sample_rate=0.1),
        "Ledger.record": lambda v: Ledger().record(noise_multiplier=v, sample_rate=0.1),
        "make_train_step": lambda v: _step(noise_multiplier=v),
        "make_private": lambda v: _private(noise_multiplier=v),
    },
    "sample_rate": {
        "accounting.epsilon": lambda v: acc.epsilon(**{**_ACC, "sample_rate": v}, delta=1e-5),
        "accounting.delta": lambda v: acc.delta(**{**_ACC, "sample_rate": v}, epsilon=1.0),
        "accounting.epsilon_bounds": lambda v: acc.epsilon_bounds(**{**_ACC, "sample_rate": v}, delta=1e-5),
        "accounting.epsilon_grid": lambda v: _grid(sample_rate=v),
        "calibrate_noise": lambda v: acc.calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=v, steps=100),
        "PoissonGaussianEvent": lambda v: PoissonGaussianEvent(noise_multiplier=1.0, sample_rate=v),
        "Ledger.record": lambda v: Ledger().record(noise_multiplier=1.0, sample_rate=v),
        "PoissonSampler": lambda v: PoissonSampler(100, v),
        "make_train_step": lambda v: _step(sample_rate=v),
    },
    "delta": {
        "accounting.epsilon": lambda v: acc.epsilon(**_ACC, delta=v),
        "accounting.epsilon_bounds": lambda v: acc.epsilon_bounds(**_ACC, delta=v),
        "accounting.epsilon_grid": lambda v: _grid(delta=v),
        "calibrate_noise": lambda v: acc.calibrate_noise(target_epsilon=1.0, delta=v, sample_rate=0.01, steps=100),
        "make_train_step(budget=)": lambda v: _step(budget=(1.0, v)),
        "make_private": lambda v: _private(delta=v),
        "TrainState.epsilon": lambda v: _STATE.epsilon(v),  # checked even before the first step
    },
    "accountant": {
        "accounting.epsilon": lambda v: acc.epsilon(**_ACC, delta=1e-5, accountant=v),
        "accounting.delta": lambda v: acc.delta(**_ACC, epsilon=1.0, accountant=v),
        "accounting.epsilon_grid": lambda v: _grid(accountant=v),
        "calibrate_noise": lambda v: acc.calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=100, accountant=v),
        "make_train_step": lambda v: _step(budget=(1.0, 1e-5), accountant=v),
        "TrainState.epsilon": lambda v: _STATE.epsilon(1e-5, accountant=v),
    },
    "steps": {
        "accounting.epsilon": lambda v: acc.epsilon(**{**_ACC, "steps": v}, delta=1e-5),
        "accounting.delta": lambda v: acc.delta(**{**_ACC, "steps": v}, epsilon=1.0),
        "calibrate_noise": lambda v: acc.calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=v),
        "PoissonSampler": lambda v: PoissonSampler(100, 0.1, steps=v),
    },
    "batch rows (physical_batch_size / capacity / batch_size / chunk sizes)": {
        "make_train_step(physical_batch_size=)": lambda v: _step(physical_batch_size=v),
        "PoissonSampler(capacity=)": lambda v: PoissonSampler(100, 0.1, capacity=v),
        "make_private(batch_size=)": lambda v: _private(batch_size=v),
        "per_sample_grads(chunk_size=)": lambda v: vmapdp.per_sample_grads(_loss, chunk_size=v),
        "clipped_grad_sum(norm_chunk_size=)": lambda v: vmapdp.clipped_grad_sum(_loss, l2_clip_norm=1.0, norm_chunk_size=v),
    },
    "method": {
        "clipped_grad_sum": lambda v: vmapdp.clipped_grad_sum(_loss, l2_clip_norm=1.0, method=v),
        "make_train_step": lambda v: _step(method=v),
        "make_private": lambda v: _private(method=v),
    },
    "std": {
        "add_noise(generator=)": lambda v: vmapdp.add_noise({"w": torch.zeros(2)}, v, vmapdp.make_generator(0)),
        "add_noise(key=)": lambda v: vmapdp.add_noise({"w": torch.zeros(2)}, v, key=b"k"),
    },
    # (found by review: flags were read for their truth, secure="no" as True, hf.loss_fn(causal=0) past its refusal)
    "flags (secure / fixed_shapes / distributed / raise_on_problem)": {
        "PoissonSampler(secure=)": lambda v: PoissonSampler(100, 0.1, secure=v),
        "FixedSizeSampler(secure=)": lambda v: vmapdp.data.FixedSizeSampler(100, 10, secure=v),
        "make_train_step(secure=)": lambda v: _step(secure=v),
        "make_train_step(fixed_shapes=)": lambda v: _step(fixed_shapes=v),
        "make_train_step(distributed=)": lambda v: _step(distributed=v),
        "init_train_state(secure=)": lambda v: vmapdp.init_train_state(_PARAMS, vmapdp.optim.sgd(0.1), secure=v),
        "make_private(secure=)": lambda v: _private(secure=v),
        "add_noise(secure=)": lambda v: vmapdp.add_noise({"w": torch.zeros(2)}, 1.0, secure=v),
        "gaussian_privatizer(secure=)": lambda v: vmapdp.noise.gaussian_privatizer(1.0, secure=v),
        "validate(raise_on_problem=)": lambda v: vmapdp.validate(nn.Linear(2, 2), raise_on_problem=v),
    },
}

# argument -> (name the message must carry, [(bad value, exception type)])
BAD = {
    "l2_clip_norm": ("l2_clip_norm", [("1.0", TypeError), (None, TypeError), (True, TypeError), (math.nan, ValueError), (-1.0, ValueError), (0.0, ValueError), (0, ValueError)]),
    "noise_multiplier": ("noise_multiplier", [("1", TypeError), (True, TypeError), (math.nan, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                                          (1e300, ValueError), (1e-300, ValueError)]),  # (outside float64 arithmetic: found by review)
    "sample_rate": ("sample_rate", [("0.1", TypeError), (True, TypeError), (0.0, ValueError), (0, ValueError), (-0.1, ValueError), (1.5, ValueError), (math.nan, ValueError)]),
    "delta": ("delta", [("1e-5", TypeError), (None, TypeError), (0.0, ValueError), (1.0, ValueError), (-1e-5, ValueError), (1.5, ValueError), (math.nan, ValueError)]),
    "accountant": ("accountant", [(1, TypeError), (None, TypeError), ("PLD", ValueError), ("Rdp", ValueError), ("moments", ValueError)]),
    "steps": ("steps", [(10.0, TypeError), ("10", TypeError), (True, TypeError), (-1, ValueError)]),
    "batch rows (physical_batch_size / capacity / batch_size / chunk sizes)": (None, [(2.0, TypeError), ("2", TypeError), (True, TypeError), (0, ValueError), (-1, ValueError)]),
    "method": ("method", [(1, TypeError), ("GHOST", ValueError), ("fast", ValueError)]),
    "std": ("std", [("1.0", TypeError), (None, TypeError), (-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError)]),
    "flags (secure / fixed_shapes / distributed / raise_on_problem)": (None, [("no", TypeError), (0, TypeError), (None, TypeError)]),
}

CASES = [
    pytest.param(arg, entry, value, exc, id=f"{arg.split(' ')[0]}-{entry}-{value!r}")
    for arg, entries in ENTRY_POINTS.items()
    for entry in entries
    for value, exc in BAD[arg][1]
]


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0:UserWarning")
@pytest.mark.parametrize("arg, entry, value, exc", CASES)
def test_same_argument_same_check_everywhere(arg, entry, value, exc):
    name = BAD[arg][0] or re.search(r"\((\w+)=\)", entry).group(1)
    with pytest.raises(exc) as info:
        ENTRY_POINTS[arg][entry](value)
    message = str(info.value)
    assert type(info.value) is exc, f"{entry} raised {type(info.value).__name__} for {arg}={value!r}: {message}"
    assert re.search(rf"\b{re.escape(name)}\b", message), f"{entry}: the message does not name {name}: {message}"
    assert ": " in message and not message.startswith(name), f"{entry}: the message does not start with the call: {message}"


def test_good_values_pass_every_entry_point():
    """The table's calls are right apart from the bad value (so the test above can fail)."""
    good = {"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 0.05, "delta": 1e-5, "accountant": "rdp", "steps": 100,
            "batch rows (physical_batch_size / capacity / batch_size / chunk sizes)": 4, "method": "vmap", "std": 1.0,
            "flags (secure / fixed_shapes / distributed / raise_on_problem)": False}
    for arg, entries in ENTRY_POINTS.items():
        for call in entries.values():
            call(good[arg])


# --- tensor clipping bounds: raise eagerly, release nothing when they cannot be read ---------------

TENSOR_ENTRIES = {
    "clip_and_sum": lambda c: vmapdp.clip_and_sum(_GRADS, c)[0],
    "clip_per_sample": lambda c: vmapdp.clip_per_sample(_GRADS, c),
    "clipped_grad_sum(vmap)": lambda c: vmapdp.clipped_grad_sum(_loss, l2_clip_norm=c, method="vmap")(_PARAMS, (_X, _Y))[0],
    "clipped_grad_sum(ghost)": lambda c: vmapdp.clipped_grad_sum(_loss, l2_clip_norm=c, method="ghost")(_PARAMS, (_X, _Y))[0],
    "clipped_grad_sum(two_pass)": lambda c: vmapdp.clipped_grad_sum(_loss, l2_clip_norm=c, method="two_pass")(_PARAMS, (_X, _Y))[0],
}
BAD_TENSORS = {"nan": torch.tensor(math.nan), "inf": torch.tensor(math.inf), "neg": torch.tensor(-1.0), "zero": torch.tensor(0.0)}


@pytest.mark.parametrize("entry", list(TENSOR_ENTRIES))
@pytest.mark.parametrize("bad", list(BAD_TENSORS))
def test_bad_tensor_clip_norm_raises_eagerly(entry, bad):
    with pytest.raises(ValueError, match=r"l2_clip_norm=tensor\(.*\) must be finite and > 0"):
        TENSOR_ENTRIES[entry](BAD_TENSORS[bad])


@pytest.mark.parametrize("entry", list(TENSOR_ENTRIES))
def test_tensor_clip_norm_of_wrong_shape_is_refused(entry):
    with pytest.raises(ValueError, match=r"l2_clip_norm must be a 0-dim tensor .*got shape \(2,\)"):
        TENSOR_ENTRIES[entry](torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("entry", ["clip_and_sum", "clip_per_sample", "clipped_grad_sum(vmap)"])
def test_bad_tensor_clip_norm_releases_nothing_when_it_cannot_be_read(entry):
    """Batched by vmap the bound cannot be read on the host: a valid bound in the same batch clips
    as usual, every invalid one releases exactly 0 (never an unclipped or flipped sum)."""
    cs = torch.stack([torch.tensor(0.5), *BAD_TENSORS.values()])
    out = torch.func.vmap(TENSOR_ENTRIES[entry], randomness="error")(cs)
    ref = TENSOR_ENTRIES[entry](torch.tensor(0.5))
    for k in out:
        torch.testing.assert_close(out[k][0], ref[k])
        assert torch.equal(out[k][1:], torch.zeros_like(out[k][1:])), f"{entry} released something for an invalid bound"


def test_make_train_step_and_make_private_take_numbers_only():
    for call in (lambda: _step(l2_clip_norm=torch.tensor(1.0)), lambda: _private(l2_clip_norm=torch.tensor(1.0))):
        with pytest.raises(TypeError, match=r"l2_clip_norm must be a real number"):
            call()


def test_load_flags_and_a_torch_optimizer_are_refused_by_name(tmp_path):
    """Found by review: load_state read its flags for their truth; init_train_state given a
    torch.optim.SGD raised a bare AttributeError (make_train_step named the fix)."""
    path = str(tmp_path / "ckpt.pt")
    vmapdp.save_state(path, _STATE)
    for name in ("saved_after_last_step", "ignore_sampler"):
        with pytest.raises(TypeError, match=rf"load_state\(.*\): {name} must be True or False, got str \('yes'\)"):
            vmapdp.load_state(path, **{name: "yes"})
    vmapdp.load_state(path, saved_after_last_step=False, ignore_sampler=False)
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"init_train_state\(params, optimizer\): optimizer must be an init/update pair .*got SGD\. Wrap a torch "
                                        r"optimizer's class instead: vmapdp.optim.from_torch\(torch.optim.SGD, lr=0.1\)"):
        vmapdp.init_train_state(_PARAMS, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0:UserWarning")
def test_a_budget_without_noise_is_refused_when_the_step_is_made():
    """Found by review: make_train_step(noise_multiplier=0, budget=) was taken, and refused only at the
    first step (epsilon inf)."""
    with pytest.raises(ValueError, match=r"make_train_step\(loss_fn, optimizer\): budget=\(3.0, 1e-05\) with noise_multiplier=0: a step without noise is not private"):
        _step(noise_multiplier=0.0, budget=(3.0, 1e-5))
    _step(noise_multiplier=0.0)  # a non-private run without a budget: fine


@pytest.mark.parametrize("entry", [
    lambda f: vmapdp.per_sample_grads(f),
    lambda f: vmapdp.clipped_grad_sum(f, l2_clip_norm=1.0),
    lambda f: vmapdp.make_train_step(f, vmapdp.optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, expected_batch_size=3.0, compile=False),
    lambda f: vmapdp.precision.mixed_precision(f, torch.bfloat16),
    lambda f: vmapdp.curvature.per_sample_hessian(f),
], ids=["per_sample_grads", "clipped_grad_sum", "make_train_step", "mixed_precision", "per_sample_hessian"])
def test_a_module_passed_as_the_loss_is_named_with_the_fix(entry):
    """Found by review: the module itself as loss_fn met a raw 'forward() takes 2 positional arguments
    but 4 were given' at the first call."""
    with pytest.raises(TypeError, match=r"loss_fn is a torch.nn.Module \(Linear\); the transforms take a function of the params.*vmapdp.functionalize"):
        entry(nn.Linear(3, 2))
    with pytest.raises(TypeError, match=r"loss_fn must be callable, got int"):
        entry(3)

    class Loss(nn.Module):  # (a loss written as a module of its own, without parameters: taken)
        def forward(self, p, *rest):
            return (p["w"] * rest[-1]).sum()

    entry(Loss())


def test_arguments_of_the_wrong_kind_are_named(tmp_path):
    """Found by review: each raised a bare AttributeError or TypeError (or, for criterion, was taken
    and failed at the first step)."""
    with pytest.raises(TypeError, match=r"Ledger: events must be an iterable of events \(Ledger\(\[event, ...\]\)\), got NoneType"):
        Ledger(None)
    with pytest.raises(TypeError, match=r"Ledger: events must be an iterable .*got PoissonGaussianEvent"):
        Ledger(PoissonGaussianEvent(noise_multiplier=1.0, sample_rate=0.1))
    with pytest.raises(TypeError, match=r"add_noise\(tree, std, generator\): leaves \[1\] are not tensors \(float\).*torch.as_tensor"):
        vmapdp.add_noise({"a": torch.zeros(2), "b": 3.0}, 1.0, key=b"k" * 16)
    with pytest.raises(TypeError, match=r"save_state\(path, state\): sampler must be the sampler that drew the state's batches .*got str. Nothing was written"):
        vmapdp.save_state(str(tmp_path / "s.pt"), _STATE, sampler="s")
    assert not (tmp_path / "s.pt").exists()
    with pytest.raises(TypeError, match=r"make_private\(model, optimizer, data\): criterion must be a function .*got str"):
        _private(criterion="ce")
    # gather: a negative index wrapped around and could name a row twice (one example stepped as two rows)
    from vmapdp.data import gather

    with pytest.raises(IndexError, match=r"gather\(data, indices\): indices must be in \[0, 6\) \(the data's rows\), got -1"):
        gather((_X, _Y), torch.tensor([-1, 5]))
    with pytest.raises(IndexError, match=r"indices must be in \[0, 6\) .*got 6"):
        gather((_X, _Y), torch.tensor([0, 6]))
    for bad in (torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]]), [0, 1]):
        with pytest.raises(TypeError, match=r"gather\(data, indices\): indices must be a 1-D integer tensor"):
            gather((_X, _Y), bad)
    assert torch.equal(gather((_X, _Y), torch.tensor([5, 0]))[0], _X[[5, 0]])
    # adaptive clipping's initial threshold outside its range was clamped after the first step without a word
    with pytest.raises(ValueError, match=r"the initial l2_clip_norm=10000.0 is outside adaptive clipping's clip_norm_range=\(0.1, 10.0\)"):
        _step(l2_clip_norm=1e4, adaptive_clipping=vmapdp.AdaptiveClipping(count_noise_multiplier=10.0, clip_norm_range=(0.1, 10)))


def test_checks_module_basics():
    assert _checks.positive("f(x)", "x", 2) == 2.0 and isinstance(_checks.positive("f(x)", "x", 2), float)
    assert _checks.accountant("f", "prv") == "pld"
    assert _checks.positive("f", "x", math.inf, allow_inf=True) == math.inf
    assert _checks.probability("f", "q", 0.0, allow_zero=True) == 0.0
    with pytest.raises(ValueError, match=r"f: x=0 must be finite and > 0"):
        _checks.positive("f", "x", 0)
    with pytest.raises(ValueError, match=r"delta=0.01 must be below 1/num_samples = 1/100 = 0.01"):
        _checks.delta("f", 0.01, num_samples=100)


def test_finite_params_reads_float8_params():
    """Found by review: torch has no isfinite for float8 dtypes, and the NaN check crashed on them."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        _checks.finite_params("init_train_state", {"w": torch.randn(4).to(dtype)}, "fix")
        bad = torch.tensor([1.0, float("nan")]).to(dtype)
        with pytest.raises(ValueError, match=r"params \['w'\] hold NaN or infinite values.*fix"):
            _checks.finite_params("init_train_state", {"w": bad}, "fix")
    # float4 holds neither NaN nor inf (torch has no isfinite for it either)
    _checks.finite_params("init_train_state", {"w": torch.zeros(2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, "fix")


def test_a_step_refuses_nan_in_its_shared_inputs_before_charging():
    """Found by review: NaN BatchNorm running statistics made every row non-finite and dropped, and
    each step released noise alone and was charged, silently. NaN in a shared input is refused
    before the ledger is touched (float8 read through float32); -inf passes (an additive mask)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
    apply, params, buffers = vmapdp.functionalize(model)

    def loss(p, b, bias, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]) + bias.clamp(min=-1.0), y[None])

    step = vmapdp.make_train_step(loss, vmapdp.optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=3.0, sample_rate=0.5, compile=False, method="vmap")
    state = vmapdp.init_train_state(params, vmapdp.optim.sgd(0.1), seed=0)
    mask, bias = torch.ones(6, dtype=torch.bool), torch.tensor([0.0, -math.inf])
    bad = {k: v.clone() for k, v in buffers.items()}
    bad["1.running_var"][2] = math.nan
    with pytest.raises(ValueError, match=r"step\(state, batch, mask\): the shared inputs .* hold NaN at \[\(0, '1.running_var'\)\].*Nothing was released"):
        step(state, (_X, _Y), mask, bad, bias)
    with pytest.raises(ValueError, match=r"hold NaN at \[\(1,\)\]"):
        step(state, (_X, _Y), mask, buffers, torch.tensor([0.0, math.nan]).to(torch.float8_e4m3fn))
    new, metrics = step(state, (_X, _Y), mask, buffers, bias)  # -inf is fine; nothing was charged before
    assert state.ledger.steps == 0 and new.ledger.steps == 1 and int(metrics["nonfinite"]) == 0
    # read at every step: a NaN written after a clean step through .data (no version bump) is refused too (found by
    # review: a cache by version missed it), and a sparse input's stored values are read
    buffers["1.running_mean"].data[0] = math.nan
    with pytest.raises(ValueError, match=r"hold NaN at \[\(0, '1.running_mean'\)\]"):
        step(new, (_X, _Y), mask, buffers, bias)
    buffers["1.running_mean"].data[0] = 0.0
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([0.0, math.nan]), (2,), check_invariants=True)
    with pytest.raises(ValueError, match=r"hold NaN at \[\(1,\)\]"):
        _checks.no_nan_shared("step(state, batch, mask)", (buffers, sparse))


def test_guessable_seeds_keys_and_generators_warn_at_the_callers_line():
    """Found by review: small-int seeds were taken silently, and the demo and notebooks used them
    (a second process regenerated a released step's noise from the demo's seed). A seed or key that
    can be known or guessed (an int below 2**64, a str or bytes of fewer than 16 bytes, a
    torch.Generator) now gives a PublicSeedWarning naming the fix, reported at the caller's line
    (this file); a fresh secret, 128 random bits or a 32-byte key give none."""
    import secrets
    import warnings

    params, opt = {"w": torch.zeros(2)}, vmapdp.optim.sgd(0.1)
    guessable = {
        "init_train_state seed": lambda: vmapdp.init_train_state(params, opt, seed=1),
        "sampler generator": lambda: PoissonSampler(100, 0.1, 5, torch.Generator().manual_seed(0)),
        "sampler short key": lambda: PoissonSampler(100, 0.1, 5, key="my-key"),
        "sampler int key": lambda: vmapdp.data.ShuffledSampler(100, 10, key=7),
        "add_noise key": lambda: vmapdp.add_noise({"w": torch.zeros(2)}, 1.0, key=3),
        "add_noise generator": lambda: vmapdp.add_noise({"w": torch.zeros(2)}, 1.0, torch.Generator()),
        # (found by review: these passed) a NumPy-like or 0-dim tensor int, a negative key, keyed_normal
        "0-dim tensor seed": lambda: vmapdp.init_train_state(params, opt, seed=torch.tensor(3)),
        "negative sampler key": lambda: PoissonSampler(100, 0.1, 5, key=-1),
        "keyed_normal key": lambda: vmapdp.noise.keyed_normal((3,), 3),
    }
    for name, make in guessable.items():
        # the fix named fits the argument (found by review: a seed was told to be bytes, which it cannot be)
        fix = r"seed=secrets.randbits\(128\)" if "seed" in name else r"key=secrets.(token_bytes\(16\)|randbits\(128\))"
        with pytest.warns(vmapdp.PublicSeedWarning, match=rf"can be (guessed|predicted).*{fix}") as caught:
            make()
        assert all(w.filename == __file__ for w in caught if issubclass(w.category, vmapdp.PublicSeedWarning)), name
    secret = {
        "no seed": lambda: vmapdp.init_train_state(params, opt),
        "128-bit seed": lambda: vmapdp.init_train_state(params, opt, seed=secrets.randbits(128) | 1 << 127),
        "32-byte key": lambda: PoissonSampler(100, 0.1, 5, key=secrets.token_bytes(32)),
        "no key": lambda: PoissonSampler(100, 0.1, 5),
        "add_noise secure": lambda: vmapdp.add_noise({"w": torch.zeros(2)}, 1.0, secure=True),
    }
    for make in secret.values():
        with warnings.catch_warnings():
            warnings.simplefilter("error", vmapdp.PublicSeedWarning)
            make()
