"""The DP-SGD step: exactly the update the accountant assumes, nothing more, nothing less."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from scipy import stats
from torch import nn

import vmapdp
from vmapdp import accounting, optim
from vmapdp.data import PoissonSampler, gather
from vmapdp.train import PrivacyBudgetExceeded
from vmapdp.noise.spent import unreleased

ALPHA = 1e-3  # false-alarm rate of the statistical tests (fixed seeds: the suite is deterministic)


def problem(n=40, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    apply, params, buffers = vmapdp.functionalize(model)
    g = torch.Generator().manual_seed(seed + 1)
    data = (torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    return apply, params, buffers, data, loss_fn


def make(loss_fn, *, noise=1.0, clip=1.0, ebs=8.0, q=0.2, lr=0.5, compile=False, **kw):
    return vmapdp.make_train_step(
        loss_fn, optim.sgd(lr), l2_clip_norm=clip, noise_multiplier=noise, expected_batch_size=ebs, sample_rate=q, compile=compile, **kw
    )


def no_noise_step(loss_fn, **kw):
    with pytest.warns(UserWarning, match=r"noise_multiplier=0 trains WITHOUT differential privacy"):
        return make(loss_fn, noise=0.0, **kw)


def test_no_noise_no_clipping_equals_sgd_on_the_mean_gradient():
    apply, params, buffers, (x, y), loss_fn = problem()
    b = 8
    step = no_noise_step(loss_fn, clip=math.inf, ebs=float(b), lr=0.3)
    state = vmapdp.init_train_state(params, optim.sgd(0.3), seed=0)
    new, metrics = step(state, (x[:b], y[:b]), torch.ones(b, dtype=torch.bool), buffers)
    live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss = F.cross_entropy(apply(live, buffers, x[:b]), y[:b])
    grads = torch.autograd.grad(loss, list(live.values()))
    for (k, p), g in zip(params.items(), grads):
        torch.testing.assert_close(new.params[k], p - 0.3 * g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["loss"], loss.detach())
    assert new.step == 1 and math.isinf(new.epsilon(1e-5))


def test_divisor_is_the_expected_batch_size_never_the_realised_one():
    apply, params, buffers, (x, y), loss_fn = problem()
    step = no_noise_step(loss_fn, clip=math.inf, ebs=10.0, lr=1.0)
    state = vmapdp.init_train_state(params, optim.sgd(1.0), seed=0)
    mask = torch.tensor([True, True, True, False, False, False])
    new, metrics = step(state, (x[:6], y[:6]), mask, buffers)
    grads = vmapdp.per_sample_grads(loss_fn)(params, buffers, (x[:3], y[:3]))
    for k in params:
        torch.testing.assert_close(params[k] - new.params[k], grads[k].sum(0) / 10.0, rtol=1e-5, atol=1e-7)
    assert metrics["batch_size"] == 3


def test_padded_rows_contribute_nothing_even_nan():
    _, params, buffers, (x, y), loss_fn = problem()
    step = make(loss_fn)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=3)
    mask = torch.tensor([True] * 5 + [False] * 3)
    x_bad = x[:8].clone()
    x_bad[5:] = math.nan
    poisoned, m1 = step(state, (x_bad, y[:8]), mask, buffers)
    # the same real rows with other (finite) padding: the same update, bit for bit
    clean, m2 = step(state, (x[:8], y[:8]), mask, buffers)
    for k in params:
        assert torch.isfinite(poisoned.params[k]).all()
        assert torch.equal(poisoned.params[k], clean.params[k])
    assert m1["nonfinite"] == 0 and m1["batch_size"] == 5


@pytest.mark.parametrize("seed", range(4))
def test_one_added_example_moves_the_update_by_at_most_lr_c_over_ebs(seed):
    _, params, buffers, (x, y), loss_fn = problem(seed=seed)
    lr, clip, ebs = 0.7, 0.05, 8.0
    step = no_noise_step(loss_fn, clip=clip, ebs=ebs, lr=lr)
    state = vmapdp.init_train_state(params, optim.sgd(lr), seed=0)
    mask = torch.tensor([True] * 6 + [False])
    with_x = mask.clone()
    with_x[6] = True
    x_adv = x[:7].clone()
    x_adv[6] *= 1000.0  # an adversarial, huge-gradient example
    a, _ = step(state, (x_adv, y[:7]), mask, buffers)
    b, _ = step(state, (x_adv, y[:7]), with_x, buffers)
    diff = math.sqrt(sum(float((a.params[k] - b.params[k]).double().square().sum()) for k in params))
    assert diff <= lr * clip / ebs * (1 + 1e-5)
    assert diff > 0.5 * lr * clip / ebs  # the example was clipped to (about) C, not dropped


def _released_noise(noise_multiplier, clip, ebs, seed=0, n_params=4000):
    """The update of a model whose gradients are all zero: pure noise / expected batch size."""
    params = {"w": torch.zeros(n_params)}

    def loss_fn(p, sample):
        return (p["w"] * 0.0).sum() + sample.sum() * 0.0

    step = vmapdp.make_train_step(
        loss_fn, optim.sgd(1.0), l2_clip_norm=clip, noise_multiplier=noise_multiplier, expected_batch_size=ebs, sample_rate=0.1, compile=False
    )
    state = vmapdp.init_train_state(params, optim.sgd(1.0), seed=seed)
    deltas = []
    for _ in range(3):
        new, _ = step(state, torch.zeros(4, 1), torch.ones(4, dtype=torch.bool))
        deltas.append(state.params["w"] - new.params["w"])
        state = new
    return torch.cat(deltas).double().numpy()


@pytest.mark.parametrize("sigma, clip, ebs", [(1.0, 1.0, 10.0), (2.5, 0.3, 64.0)])
def test_noise_std_is_sigma_c_over_ebs(sigma, clip, ebs):
    z = _released_noise(sigma, clip, ebs)
    std = sigma * clip / ebs
    assert stats.kstest(z, "norm", args=(0.0, std)).pvalue > ALPHA
    for wrong in (std / math.sqrt(2), std * 1.1):  # negative controls: a std off by sqrt(2) or 10% fails
        assert stats.kstest(z, "norm", args=(0.0, wrong)).pvalue < ALPHA


def test_noise_is_fresh_each_step_and_fixed_by_the_state():
    z1 = _released_noise(1.0, 1.0, 1.0, seed=5)
    z2 = _released_noise(1.0, 1.0, 1.0, seed=5)
    z3 = _released_noise(1.0, 1.0, 1.0, seed=6)
    assert (z1 == z2).all() and not (z1 == z3).all()
    n = z1.size // 3
    assert abs(stats.pearsonr(z1[:n], z1[n : 2 * n])[0]) < 0.1  # consecutive steps are not reusing noise


def test_ledger_and_epsilon_follow_the_steps():
    _, params, buffers, (x, y), loss_fn = problem()
    step = make(loss_fn, noise=1.3, q=0.2)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=0)
    for _ in range(5):
        state, _ = step(state, (x[:8], y[:8]), torch.ones(8, dtype=torch.bool), buffers)
    assert state.ledger == accounting.Ledger().record(noise_multiplier=1.3, sample_rate=0.2, count=5)
    assert state.epsilon(1e-5) == pytest.approx(accounting.epsilon(noise_multiplier=1.3, sample_rate=0.2, steps=5, delta=1e-5))  # TrainState.epsilon defaults to PLD, as the accountants do


def test_budget_stops_before_the_step_that_would_exceed_it():
    _, params, buffers, (x, y), loss_fn = problem()
    eps_after = [accounting.epsilon(noise_multiplier=1.0, sample_rate=0.2, steps=t, delta=1e-5) for t in (1, 2, 3, 4)]
    budget = (eps_after[2] + eps_after[3]) / 2  # three steps fit, the fourth would not
    step = make(loss_fn, noise=1.0, q=0.2, budget=(budget, 1e-5))
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=0)
    for _ in range(3):
        state, _ = step(state, (x[:8], y[:8]), torch.ones(8, dtype=torch.bool), buffers)
    with pytest.raises(PrivacyBudgetExceeded, match=r"step 4 would spend epsilon=.* > budget"):
        step(state, (x[:8], y[:8]), torch.ones(8, dtype=torch.bool), buffers)
    assert state.step == 3 and state.epsilon(1e-5) <= budget


def test_compiled_equals_eager_and_compiles_once_over_poisson_steps():
    _, params, buffers, data, loss_fn = problem(n=60)
    sampler = PoissonSampler(60, 0.1, 6, torch.Generator().manual_seed(0))
    batches = [(gather(data, i), m) for i, m in sampler]
    eager = make(loss_fn, noise=0.7, ebs=6.0, q=0.1, physical_batch_size=sampler.capacity)
    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = make(loss_fn, noise=0.7, ebs=6.0, q=0.1, physical_batch_size=sampler.capacity, compile=True)
    s_e = s_c = vmapdp.init_train_state(params, optim.sgd(0.5), seed=1)
    for batch, mask in batches:
        with unreleased():  # the eager twin: the same noise, compared (vmapdp.noise.spent)
            s_e, m_e = eager(s_e, batch, mask, buffers)
        s_c, m_c = compiled(s_c, batch, mask, buffers)
    for k in params:
        torch.testing.assert_close(s_c.params[k], s_e.params[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m_c["loss"], m_e["loss"])
    # six Poisson steps, one chunk shape: "auto" races ghost and vmap eagerly and compiles the winner alone, once
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
    assert list(compiled.chosen_methods.values())[0] in ("ghost", "vmap") and len(compiled.chosen_methods) == 1


@pytest.mark.parametrize("faster", ["ghost", "vmap", "two_pass"])
def test_auto_step_runs_the_method_that_timed_faster(monkeypatch, faster):
    """The race's winner runs, bit for bit the named method. ``two_pass`` is raced (in vmap's
    place) where vmap's per-sample grads pass ``Limits.auto_vmap_elements`` and two_pass's chunk is
    smaller than the batch: a large model, here shrunk to two samples at a time."""
    from vmapdp import clipped, train
    from vmapdp.ghost import limits

    rival = "two_pass" if faster == "two_pass" else "vmap"
    if rival == "two_pass":
        elements = sum(p.numel() for p in problem()[1].values())
        monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, auto_vmap_elements=6 * elements - 1, two_pass_elements=2 * elements))
    config = train.step_config  # the noise key binds the method asked for: unbind it, to compare the computations
    monkeypatch.setattr(train, "step_config", lambda **kw: config(**dict(kw, method="any")))

    timed = []

    def elapsed(name, run, device):
        run()
        timed.append(name)
        return {faster: 1.0}.get(name, 2.0)

    monkeypatch.setattr(clipped, "_elapsed", elapsed)
    _, params, buffers, data, loss_fn = problem(n=12)
    mask = torch.ones(12, dtype=torch.bool)
    auto, named = make(loss_fn, physical_batch_size=6), make(loss_fn, physical_batch_size=6, method=faster)
    s_a = s_n = vmapdp.init_train_state(params, optim.sgd(0.5), seed=3)
    for _ in range(2):
        s_a, _ = auto(s_a, data, mask, buffers)
        s_n, _ = named(s_n, data, mask, buffers)
    for k in params:  # bitwise: the auto step ran the named method's computation
        assert torch.equal(s_a.params[k], s_n.params[k]), k
    assert list(auto.chosen_methods.values()) == [faster]
    assert sorted(timed) == sorted(["ghost", rival] * limits.LIMITS.auto_rounds)  # one race: one chunk shape


RESUME_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import vmapdp
    from vmapdp import optim
    from vmapdp.data import PoissonSampler, gather
    from test_train import problem, make
    _, params, buffers, data, loss_fn = problem(n=50)
    sampler = PoissonSampler(50, 0.2, 3, torch.Generator().manual_seed(123))
    state = vmapdp.load_state({path!r}, sampler=sampler)
    step = make(loss_fn, noise=1.0, ebs=10.0, q=0.2, physical_batch_size=sampler.capacity, method="ghost")
    for indices, mask in sampler:
        state, _ = step(state, gather(data, indices), mask, buffers)
    vmapdp.save_state({out!r}, state, sampler=sampler)
    """
)


def test_resume_in_a_new_process_is_bitwise_identical(tmp_path):
    _, params, buffers, data, loss_fn = problem(n=50)
    sampler = PoissonSampler(50, 0.2, 6, torch.Generator().manual_seed(7))
    # a named method: "auto" times its candidates again in the new process (see vmapdp.train)
    step = make(loss_fn, noise=1.0, ebs=10.0, q=0.2, physical_batch_size=sampler.capacity, method="ghost")
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=11)
    for t, (indices, mask) in enumerate(sampler):
        state, _ = step(state, gather(data, indices), mask, buffers)
        if t == 2:
            vmapdp.save_state(tmp_path / "mid.pt", state, sampler=sampler)
    out = tmp_path / "end.pt"
    script = RESUME_SCRIPT.format(tests=os.path.dirname(__file__), path=str(tmp_path / "mid.pt"), out=str(out))
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    resumed = vmapdp.load_state(out, ignore_sampler=True)  # compared, not resumed
    assert resumed.step == state.step == 6 and resumed.ledger == state.ledger
    for k in params:
        assert torch.equal(resumed.params[k], state.params[k]), k


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(l2_clip_norm=0.0), r"l2_clip_norm=0.0 must be finite and > 0"),
        (dict(l2_clip_norm=math.inf), r"l2_clip_norm=inf must be finite and > 0"),
        (dict(noise_multiplier=-1.0), r"noise_multiplier=-1.0 must be finite and >= 0"),
        (dict(expected_batch_size=0), r"expected_batch_size=0 must be finite and > 0"),
        (dict(sample_rate=0.0), r"sample_rate=0.0 must be in \(0, 1\]"),
        (dict(physical_batch_size=0), r"physical_batch_size=0 must be an int >= 1"),
        (dict(budget=(1.0, 2.0)), r"budget delta=2.0 must be in \(0, 1\)"),
    ],
)
def test_bad_arguments(kwargs, match):
    _, _, _, _, loss_fn = problem()
    args = dict(l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, sample_rate=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        vmapdp.make_train_step(loss_fn, optim.sgd(0.1), **args)


def test_a_missing_expected_batch_size_is_named_as_required_with_the_fix():
    """Found by review: "expected_batch_size must be a real number, got NoneType" said neither that it is
    required with sample_rate= alone nor what to pass."""
    _, _, _, _, loss_fn = problem()
    with pytest.raises(TypeError, match=r"expected_batch_size is required with sample_rate= alone: .*sample_rate \* num_samples.*Or pass sampler="):
        vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.1)


def test_bad_state_and_batch():
    _, params, buffers, (x, y), loss_fn = problem()
    step = make(loss_fn)
    with pytest.raises(ValueError, match=r"secure=True rejects seeds"):
        vmapdp.init_train_state(params, optim.sgd(0.1), seed=1, secure=True)
    # found by review: NaN params made every row non-finite, dropped; the steps released noise alone, silently
    nan = dict(params)
    nan[next(iter(params))] = torch.full_like(params[next(iter(params))], float("nan"))
    with pytest.raises(ValueError, match=r"params \['.*'\] hold NaN or infinite values.*Initialise finite params"):
        vmapdp.init_train_state(nan, optim.sgd(0.1), seed=1)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=1)
    with pytest.raises(TypeError, match=r"mask must have dtype torch.bool"):
        step(state, (x[:4], y[:4]), torch.ones(4), buffers)
    secure_step = make(loss_fn, secure=True)
    with pytest.raises(ValueError, match=r"secure=True but the state holds a noise seed"):
        secure_step(state, (x[:4], y[:4]), torch.ones(4, dtype=torch.bool), buffers)
    s_state = vmapdp.init_train_state(params, optim.sgd(0.1), secure=True)
    new, _ = secure_step(s_state, (x[:4], y[:4]), torch.ones(4, dtype=torch.bool), buffers)
    assert new.noise_seed is None and new.step == 1


def test_empty_batch_still_releases_noise_without_a_physical_batch_size():
    _, params, buffers, (x, y), loss_fn = problem()
    step = make(loss_fn, noise=1.0)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=0)
    new, metrics = step(state, (x[:0], y[:0]), torch.zeros(0, dtype=torch.bool), buffers)
    assert new.step == 1 and metrics["batch_size"] == 0
    assert any(not torch.equal(new.params[k], params[k]) for k in params)  # noise moved the params


def test_budget_needs_an_upper_bound_accountant_and_distributed_is_not_silently_ignored():
    _, _, _, _, loss_fn = problem()
    for bad in ("gdp", "bogus"):
        with pytest.raises(ValueError, match=r"accountant=.* must be one of 'rdp', 'pld', 'prv'; a budget is only enforced against an upper bound"):
            make(loss_fn, budget=(1.0, 1e-5), accountant=bad)
    with pytest.raises(RuntimeError, match=r"distributed=True needs an initialized torch\.distributed process group"):
        make(loss_fn, distributed=True)  # no process group in this process (tests/test_distributed.py has the rest)


def test_state_repr_never_shows_the_noise_seed():
    _, params, _, _, _ = problem()
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=123456789)
    assert "123456789" not in repr(state) and "<secret>" in repr(state)


def test_many_compiled_steps_in_one_process_do_not_exhaust_the_compile_cache():
    params = {"w": torch.zeros(3)}

    def loss_fn(p, x):
        return (p["w"] * x).sum()

    x, mask = torch.ones(4, 3), torch.ones(4, dtype=torch.bool)
    for i in range(10):  # more than dynamo's default limit of 8 recompiles per code object (dynamo's cache: any backend shows it)
        step = vmapdp.make_train_step(
            loss_fn, optim.sgd(1.0), l2_clip_norm=0.5 + i, noise_multiplier=1.0, expected_batch_size=4, sample_rate=0.5, compile="eager"
        )
        state, metrics = step(vmapdp.init_train_state(params, optim.sgd(1.0), seed=i), x, mask)
        assert metrics["clip_fraction"] == (1.0 if 0.5 + i < 3**0.5 else 0.0)


def _noise_of(params, *, seed=5, n_steps=1, **config):
    """The noise a zero-gradient model releases (update * ebs / (sigma * C): standard normal)."""
    cfg = dict(l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, method="vmap")
    cfg.update(config)
    lr = cfg.pop("lr", 1.0)

    def loss_fn(p, sample):
        return (p["w"] * 0.0).sum() + sample.sum() * 0.0

    step = vmapdp.make_train_step(loss_fn, optim.sgd(lr), compile=False, **cfg)
    state = vmapdp.init_train_state(params, optim.sgd(lr), seed=seed)
    new, _ = step(state, torch.zeros(4, 1), torch.ones(4, dtype=torch.bool))
    scale = lr * cfg["noise_multiplier"] * cfg["l2_clip_norm"] / cfg["expected_batch_size"]
    return ((state.params["w"] - new.params["w"]) / scale).double().numpy()


@pytest.mark.parametrize(
    "change",
    [
        dict(l2_clip_norm=2.0),
        dict(noise_multiplier=1.5),
        dict(expected_batch_size=5.0),
        dict(sample_rate=0.2),
        dict(method="ghost"),
        dict(rule="normalize"),
        dict(lr=0.5),  # a learning-rate sweep on one seed (found by an adversarial review)
        dict(precision=torch.bfloat16),
        "initial params",
    ],
    ids=str,
)
def test_one_seed_reused_across_configurations_draws_independent_noise(change):
    # 4000 standard normals: |pearson r| has std 1/sqrt(4000) = 0.016, so |r| < 0.1 fails by chance
    # with probability < 1e-9; without the binding the two noises are equal (r = 1)
    params = {"w": torch.zeros(4000)}
    base = _noise_of(params)
    assert (_noise_of(params) == base).all()  # same seed, same configuration, same run: reproducible
    other = _noise_of({"w": torch.full((4000,), 1e-3)}) if change == "initial params" else _noise_of(params, **change)
    assert abs(stats.pearsonr(base, other)[0]) < 0.1


def test_run_id_is_the_digest_of_the_initial_params_and_survives_steps():
    _, params, buffers, (x, y), loss_fn = problem()
    a = vmapdp.init_train_state(params, optim.sgd(0.5), seed=0)
    b = vmapdp.init_train_state({k: v.clone() for k, v in params.items()}, optim.sgd(0.5), seed=1)
    assert a.run_id == b.run_id == vmapdp.train.params_digest(params) and len(a.run_id) == 64
    moved = dict(params, **{"0.bias": params["0.bias"] + 1e-6})
    assert vmapdp.init_train_state(moved, optim.sgd(0.5), seed=0).run_id != a.run_id
    # found by review: the same params listed in another order got the same run id, and, noise streams
    # going by position, two runs of one seed swapped streams between params (their difference cancelled it)
    reordered = dict(reversed(list(params.items())))
    assert vmapdp.init_train_state(reordered, optim.sgd(0.5), seed=0).run_id != a.run_id
    new, _ = make(loss_fn)(a, (x[:8], y[:8]), torch.ones(8, dtype=torch.bool), buffers)
    assert new.run_id == a.run_id


def test_every_budget_a_state_was_given_is_enforced_by_any_later_step():
    _, params, buffers, (x, y), loss_fn = problem()
    batch, mask = (x[:8], y[:8]), torch.ones(8, dtype=torch.bool)
    eps = [accounting.epsilon(noise_multiplier=1.0, sample_rate=0.2, steps=t, delta=1e-5) for t in (1, 2, 3)]
    tight = (eps[1] + eps[2]) / 2  # two steps fit, the third does not
    # (a named method: two "auto" steps race apart, and the state re-stepped below by another step object would
    # release step 0 again in other rounding if its race chose the other method: NoiseKeyReused, a flaky test)
    budgeted, unbudgeted, loose = (make(loss_fn, method="ghost", **kw) for kw in ({"budget": (tight, 1e-5)}, {}, {"budget": (100.0, 1e-5)}))
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=0)
    state, _ = budgeted(state, batch, mask, buffers)
    assert state.budgets == ((tight, 1e-5, "pld"),)
    state, _ = loose(state, batch, mask, buffers)  # the looser budget is recorded beside, the tight one kept
    assert state.budgets == ((tight, 1e-5, "pld"),)
    for step in (unbudgeted, loose, budgeted):  # no step spends past the tight budget
        with pytest.raises(PrivacyBudgetExceeded, match=r"step 3 would spend epsilon=.* > budget .*the budget recorded in the state|given to this step"):
            step(state, batch, mask, buffers)
    assert state.step == 2 and state.epsilon(1e-5) <= tight
    # a budget given at init is enforced from the first step; another delta is a budget of its own
    born = vmapdp.init_train_state(params, optim.sgd(0.5), seed=0, budget=(eps[0] * 1.01, 1e-5))
    born, _ = unbudgeted(born, batch, mask, buffers)
    with pytest.raises(PrivacyBudgetExceeded, match=r"step 2 would spend .*the budget recorded in the state"):
        make(loss_fn, method="ghost", budget=(100.0, 1e-3))(born, batch, mask, buffers)
    with pytest.raises(ValueError, match=r"budget delta=2.0 must be in \(0, 1\)"):
        vmapdp.init_train_state(params, optim.sgd(0.5), budget=(1.0, 2.0))


def test_a_resumed_budgeted_run_cannot_be_continued_past_its_budget(tmp_path):
    _, params, buffers, data, loss_fn = problem(n=50)
    eps = [accounting.epsilon(noise_multiplier=1.0, sample_rate=0.2, steps=t, delta=1e-5) for t in (2, 3)]
    budget = ((eps[0] + eps[1]) / 2, 1e-5)
    sampler = PoissonSampler(50, 0.2, 2, key=b"k")
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=3)
    budgeted = make(loss_fn, ebs=10.0, budget=budget, physical_batch_size=sampler.capacity)
    for indices, mask in sampler:
        state, _ = budgeted(state, gather(data, indices), mask, buffers)
    vmapdp.save_state(tmp_path / "s.pt", state, sampler=sampler)
    resumed_sampler = PoissonSampler(50, 0.2, 1, key=b"other")
    resumed = vmapdp.load_state(tmp_path / "s.pt", sampler=resumed_sampler)
    (indices, mask), = list(resumed_sampler)
    with pytest.raises(PrivacyBudgetExceeded, match=r"step 3 would spend .*recorded in the state"):
        make(loss_fn, ebs=10.0, physical_batch_size=resumed_sampler.capacity)(resumed, gather(data, indices), mask, buffers)


AUTO_RESUME_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import vmapdp
    from vmapdp import clipped
    from vmapdp.data import PoissonSampler, gather
    from test_train import problem, make
    timed = []
    def elapsed(name, run, device):  # this process's clock: {faster} is faster
        run(); timed.append(name)
        return 1.0 if name == {faster!r} else 2.0
    clipped._elapsed = elapsed
    _, params, buffers, data, loss_fn = problem(n=50)
    sampler = PoissonSampler(50, 0.2, 4, key=b"resume")
    state = vmapdp.load_state({path!r}, sampler=sampler)
    step = make(loss_fn, noise=1.0, ebs=10.0, q=0.2, physical_batch_size=sampler.capacity)  # method="auto"
    for indices, mask in sampler:
        state, _ = step(state, gather(data, indices), mask, buffers)
    assert timed == [], timed  # the saved choice was replayed: no race
    vmapdp.save_state({out!r}, state, sampler=sampler)
    """
)


def test_auto_resume_in_a_new_process_replays_the_saved_choice_bitwise(tmp_path, monkeypatch):
    """8 steps straight vs 4 + save + a new process whose clock favours the other method + 4."""
    from vmapdp import clipped

    monkeypatch.setattr(clipped, "_elapsed", lambda name, run, device: (run(), 1.0 if name == "vmap" else 2.0)[1])
    _, params, buffers, data, loss_fn = problem(n=50)
    sampler = PoissonSampler(50, 0.2, 8, key=b"resume")
    step = make(loss_fn, noise=1.0, ebs=10.0, q=0.2, physical_batch_size=sampler.capacity)  # method="auto"
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=11)
    for t, (indices, mask) in enumerate(sampler):
        state, _ = step(state, gather(data, indices), mask, buffers)
        if t == 3:
            vmapdp.save_state(tmp_path / "mid.pt", state, sampler=sampler)
    assert {m for _, m in state.methods} == {"vmap"}
    out = tmp_path / "end.pt"
    script = AUTO_RESUME_SCRIPT.format(tests=os.path.dirname(__file__), path=str(tmp_path / "mid.pt"), out=str(out), faster="ghost")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = vmapdp.load_state(out, ignore_sampler=True)  # compared, not resumed
    assert resumed.step == 8 and resumed.ledger == state.ledger and resumed.methods == state.methods
    for k in params:
        assert torch.equal(resumed.params[k], state.params[k]), k


def test_a_named_method_is_recorded_and_an_auto_step_on_its_state_replays_it(monkeypatch):
    from vmapdp import clipped

    timed = []
    monkeypatch.setattr(clipped, "_elapsed", lambda name, run, device: (run(), timed.append(name), 1.0 if name == "ghost" else 2.0)[2])
    _, params, buffers, data, loss_fn = problem(n=12)
    mask = torch.ones(12, dtype=torch.bool)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=3)
    state, _ = make(loss_fn, physical_batch_size=6, method="vmap")(state, data, mask, buffers)
    assert [m for _, m in state.methods] == ["vmap"]
    auto = make(loss_fn, physical_batch_size=6)
    state, _ = auto(state, data, mask, buffers)  # the clock favours ghost, the state says vmap
    assert timed == [] and list(auto.chosen_methods.values()) == ["vmap"] and [m for _, m in state.methods] == ["vmap"]
    fresh, _ = auto(vmapdp.init_train_state({k: v + 1 for k, v in params.items()}, optim.sgd(0.5), seed=3), data, mask, buffers)
    assert [m for _, m in fresh.methods] == ["vmap"]  # this step object's choice, made on the same shape


def recording_privatizer(calls, offset=0.25):
    """A privatizer that records what it is given, adds ``offset`` to every coordinate and counts
    its calls in its state (a tensor carried from step to step)."""

    def init(params):
        return (torch.zeros((), dtype=torch.int64),)

    def privatize(summed, state, key):
        calls.append(({k: v.clone() for k, v in summed.items()}, state, key))
        return {k: v + offset for k, v in summed.items()}, (state[0] + 1,)

    return vmapdp.noise.Privatizer(init, privatize)


def test_a_custom_privatizer_is_called_once_per_step_after_aggregation_with_the_states_key(tmp_path):
    from vmapdp.train import _step_key, noise_binding, step_config

    _, params, buffers, (x, y), loss_fn = problem()
    calls = []
    priv = recording_privatizer(calls)
    step = make(loss_fn, ebs=4.0, lr=1.0, physical_batch_size=4, method="vmap", privatizer=priv)
    state = vmapdp.init_train_state(params, optim.sgd(1.0), seed=11, privatizer=priv)
    assert state.noise_state == (0,)
    mask = torch.tensor([True] * 6 + [False, False])
    batch = (x[:8], y[:8])
    new, _ = step(state, batch, mask, buffers)
    assert len(calls) == 1
    summed, given_state, key = calls[0]
    whole = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=1.0, method="vmap")(params, buffers, (x[:6], y[:6]))[0]
    for k in params:  # the sum over both chunks, then the privatizer; then / ebs and sgd
        torch.testing.assert_close(summed[k], whole[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new.params[k], params[k] - (summed[k] + 0.25) / 4.0)
    config = step_config(
        l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.2, method="vmap", optimizer=optim.sgd(1.0).config, noise="privatizer="
    )  # (a caller's privatizer joins the key by its config: "" here)
    assert given_state == state.noise_state and key == _step_key(11, 0, noise_binding(state.run_id, config))
    assert int(new.noise_state[0]) == 1

    # its state is carried across steps and a save/resume
    vmapdp.save_state(tmp_path / "s.pt", new)
    loaded = vmapdp.load_state(tmp_path / "s.pt", like=new)
    assert int(loaded.noise_state[0]) == 1
    a, _ = step(new, batch, mask, buffers)
    b, _ = step(loaded, batch, mask, buffers)
    assert int(a.noise_state[0]) == int(b.noise_state[0]) == 2 and len(calls) == 3
    assert calls[1][2] == calls[2][2] == _step_key(11, 1, noise_binding(state.run_id, config))
    assert all(torch.equal(a.params[k], b.params[k]) for k in params)


def test_the_privatizer_runs_after_the_budget_check_and_the_default_is_the_gaussian():
    _, params, buffers, (x, y), loss_fn = problem()
    calls = []
    priv = recording_privatizer(calls)
    step = make(loss_fn, noise=0.5, privatizer=priv, budget=(1e-3, 1e-5))
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=3, privatizer=priv)
    with pytest.raises(PrivacyBudgetExceeded):
        step(state, (x[:8], y[:8]), torch.ones(8, dtype=torch.bool), buffers)
    assert calls == []  # nothing reached the privatizer

    gaussian = vmapdp.noise.gaussian_privatizer(1.5 * 0.7)
    default, explicit = make(loss_fn, noise=1.5, clip=0.7, method="vmap"), make(loss_fn, noise=1.5, clip=0.7, method="vmap", privatizer=gaussian)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=3)
    a, _ = default(state, (x[:8], y[:8]), torch.ones(8, dtype=torch.bool), buffers)
    b, _ = explicit(state, (x[:8], y[:8]), torch.ones(8, dtype=torch.bool), buffers)
    assert a.noise_state == b.noise_state == () and all(torch.equal(a.params[k], b.params[k]) for k in params)


def test_a_privatizer_that_is_not_an_init_privatize_pair_is_refused():
    _, params, _, _, loss_fn = problem()
    with pytest.raises(TypeError, match=r"privatizer must be an init/privatize pair"):
        make(loss_fn, privatizer=lambda s: s)
    with pytest.raises(TypeError, match=r"privatizer must be an init/privatize pair"):
        vmapdp.init_train_state(params, optim.sgd(0.5), seed=3, privatizer=object())


def test_step_stats_sum_leaf_wise_and_name_the_metrics():
    from vmapdp.train import StepStats

    mask = torch.tensor([True, True, True, False])
    norms = torch.tensor([0.5, 2.0, math.inf, 9.0])
    losses = torch.tensor([1.0, 3.0, 7.0, 100.0])
    one = StepStats.of_chunk(mask, norms, losses, 1.0)
    assert [float(v) for v in one] == [4.0, 3.0, 1.0, 2.5, 1.0]
    both = vmapdp.distributed.all_reduce_step("test", {}, StepStats.zeros(torch.device("cpu")), (0, 0, ""))[1]  # no process group: a copy
    assert isinstance(both, StepStats) and [float(v) for v in both] == [0.0] * 5
    m = one.metrics()
    assert m["batch_size"] == 3 and m["loss"] == 4.0 / 3 and m["clip_fraction"] == 1.0 / 3 and m["mean_grad_norm"] == 2.5 / 3 and m["nonfinite"] == 1


def test_the_run_id_needs_no_numpy(monkeypatch):
    """numpy is not a dependency: the README's plain install has none, and the demo failed there
    ('Numpy is not available') when the run id was hashed through .numpy()."""
    params = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(0)}
    expected = vmapdp.train.params_digest(params)

    def no_numpy(self, *a, **k):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    assert vmapdp.init_train_state(params, optim.sgd(0.1), seed=0).run_id == expected
    import hashlib
    import struct

    # a known answer: the digest is over the names, dtypes, shapes and raw little-endian bytes
    h = hashlib.sha256(b"vmapdp-params:")
    h.update(repr(("b", "torch.float32", (0,))).encode())
    h.update(repr(("w", "torch.float32", (2, 3))).encode())
    h.update(struct.pack("<6f", *range(6)))
    h.update(repr(("order", ("w", "b"))).encode())
    assert expected == h.hexdigest()


def test_two_callers_privatizers_never_draw_the_same_noise_from_one_state():
    """Found by review (hunt2/f8_privatizer_unbound.py): privatizers without ``bind`` were left out
    of the noise key, so gaussian_privatizer(2.0) and (3.0) stepped from one state drew the same
    normals (noise in the ratio 1.5 exactly). Their configs now join the key."""
    from vmapdp.noise import gaussian_privatizer

    _, params, buffers, data, loss_fn = problem(n=12)
    mask = torch.ones(12, dtype=torch.bool)
    state = vmapdp.init_train_state(params, optim.sgd(1.0), seed=3)
    noises = []
    for std in (2.0, 3.0):
        step = make(loss_fn, lr=1.0, ebs=1.0, privatizer=gaussian_privatizer(std), physical_batch_size=12)
        zero = no_noise_step(loss_fn, lr=1.0, ebs=1.0, physical_batch_size=12)
        noisy, _ = step(state, data, mask, buffers)
        clean, _ = zero(state, data, mask, buffers)
        noises.append(torch.cat([(clean.params[k] - noisy.params[k]).flatten() / std for k in params]))
    assert not torch.allclose(noises[0], noises[1], rtol=1e-3, atol=1e-4)  # (the same draws before)
    assert gaussian_privatizer(2.0).config != gaussian_privatizer(3.0).config


def _dropout_problem():
    """A one-matrix model with dropout on its input: ``(w, loss_fn, (x, y), mask, state)``."""
    torch.manual_seed(0)
    w = torch.randn(3, 5)

    def loss_fn(p, sample):
        x, y = sample
        return F.cross_entropy(F.linear(F.dropout(x, 0.5, training=True)[None], p["w"]), y[None])

    _, _, _, data, _ = problem(n=8)
    return w, loss_fn, data, torch.ones(8, dtype=torch.bool), vmapdp.init_train_state({"w": w}, optim.sgd(0.5), seed=3)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_random_layers_draw_from_the_state_so_a_repeated_step_is_bit_for_bit(method):
    """Found by review: dropout drew from torch's global generator, so a step repeated after a
    resume (a fresh process: the in-process registry cannot see the first release) added the
    same noise to another clipped sum, and the two releases differed by a noise-free vector.
    A step's random layers now draw from ``step_seed(state)``: the same state gives the same
    release whatever the global generator holds (without that, the repeat here raises
    NoiseKeyReused), the caller's generator is left as it was, and later steps draw afresh."""
    from vmapdp.train import step_seed

    w, loss_fn, (x, y), mask, state = _dropout_problem()
    step = make(loss_fn, noise=100.0, method=method, randomness="different")
    torch.manual_seed(1)
    a, _ = step(state, (x, y), mask)
    torch.manual_seed(2)
    before = torch.get_rng_state()
    b, _ = step(state, (x, y), mask)  # the same step again: the same dropout masks, the same release
    assert torch.equal(a.params["w"], b.params["w"])
    assert torch.equal(torch.get_rng_state(), before)  # (forked: the caller's generator did not move)
    assert step_seed(state) != step_seed(a) and step_seed(state, rank=1) != step_seed(state) != step_seed(state, "data")
    assert step_seed(vmapdp.init_train_state({"w": w}, optim.sgd(0.5), secure=True)) is None
    clean = no_noise_step(loss_fn, method=method, randomness="different")
    with unreleased():  # dropout is on: the masks differ from step to step (the sums differ)
        s1, _ = clean(state, (x, y), mask)
        s2, _ = clean(s1._replace(params=state.params), (x, y), mask)
    assert not torch.equal(s1.params["w"], s2.params["w"])


def test_with_random_layers_the_batch_split_joins_the_noise_key_and_auto_does_not_race(monkeypatch):
    """Found by review: random layers draw per chunk (and per rank, per method), so a step
    repeated with another physical_batch_size released another value under the same key (3.27 C
    between the two), and a repeat whose "auto" race chose another method likewise. With random
    layers the split joins the noise key (the repeat here raised NoiseKeyReused), and "auto" runs
    its first candidate untimed; without random layers neither changes (rounding only)."""
    from vmapdp import clipped

    timed = []
    monkeypatch.setattr(clipped, "_elapsed", lambda name, run, device: (run(), timed.append(name), 1.0)[2])
    _, loss_fn, (x, y), mask, state = _dropout_problem()
    whole = make(loss_fn, randomness="different")
    whole(state, (x, y), mask)
    make(loss_fn, randomness="different", physical_batch_size=4)(state, (x, y), mask)  # another key: no NoiseKeyReused
    assert timed == [] and list(whole.chosen_methods.values()) == ["ghost"]
    config = dict(l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.2)
    assert "layout" not in vmapdp.train.step_config(**config)


def test_a_gaussian_privatizer_below_the_charged_noise_is_refused():
    """Found by review: ``gaussian_privatizer(0.0)`` with ``noise_multiplier=1`` released the bare
    sum while the ledger charged sigma 1; with adaptive clipping the non-adaptive default's std
    (``noise_multiplier * C``) was applied in units of the threshold, 20x too little at C = 0.05.
    A privatizer whose std is known is refused below the std its ledger event charges; at it or
    above it steps (more noise is as private)."""
    from vmapdp.noise import gaussian_privatizer

    _, params, buffers, data, loss_fn = problem(n=12)
    for std in (0.0, 0.7 * 1.5 * (1 - 1e-9)):
        with pytest.raises(ValueError, match=r"privatizer adds Gaussian noise of std .* ledger charges .* = 1.0499.*Nothing was released"):
            make(loss_fn, noise=1.5, clip=0.7, privatizer=gaussian_privatizer(std))
    make(loss_fn, noise=1.5, clip=0.7, privatizer=gaussian_privatizer(0.7 * 1.5))
    make(loss_fn, noise=1.5, clip=0.7, privatizer=gaussian_privatizer(2.0))
    adaptive = vmapdp.AdaptiveClipping(count_noise_multiplier=10.0)
    with pytest.raises(ValueError, match=r"in units of the clip threshold"):
        make(loss_fn, noise=1.0, clip=0.05, privatizer=gaussian_privatizer(1.0 * 0.05), adaptive_clipping=adaptive)
    make(loss_fn, noise=1.0, clip=0.05, privatizer=gaussian_privatizer(adaptive.gradient_noise_multiplier(1.0)), adaptive_clipping=adaptive)


def test_a_batch_whose_per_sample_shapes_change_is_refused_unless_asked():
    """Padding to each batch's longest row makes a sample's computation depend on the others'
    lengths: the step refuses per-sample shapes that differ from its first batch's, before the
    ledger or anything else moves; fixed_shapes=False (shapes on a public schedule) lets them through."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    apply, params, buffers = vmapdp.functionalize(model)

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x).mean(0, keepdim=True), y[None])

    def batch(t):
        return (torch.randn(4, t, 3), torch.randint(0, 2, (4,))), torch.ones(4, dtype=torch.bool)

    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    step = make(loss_fn, method="ghost")
    (x, y), m = batch(5)
    with pytest.raises(ValueError, match=r"a layer got inputs of another size"):  # a first call that fails (4 features for a Linear(3, 2)) sets no shapes
        step(state, (torch.randn(4, 5, 4), y), m, buffers)
    state, _ = step(state, *batch(5), buffers)
    with pytest.raises(ValueError, match=r"per-sample shapes \{'\[0\]': \(7, 3\), '\[1\]': \(\)\} are not the first batch's \{'\[0\]': \(5, 3\).*padding='max_length'.*Nothing was released"):
        step(state, *batch(7), buffers)
    state, _ = step(state, *batch(5), buffers)  # the same shapes go on
    assert state.step == 2 and state.ledger.steps == 2
    free = make(loss_fn, method="ghost", fixed_shapes=False)
    for t in (5, 7, 2):
        state, _ = free(state, *batch(t), buffers)
    assert state.step == 5


def test_a_step_called_without_its_mask_says_so():
    """Found by review: step(state, batch, buffers) said only that the mask was a dict."""
    _, params, buffers, data, loss_fn = problem()
    opt = vmapdp.optim.sgd(0.1)
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, compile=False)
    with pytest.raises(TypeError, match=r"got dict\. Was the mask left out\? The step is called step\(state, batch, mask, \*shared\)"):
        step(vmapdp.init_train_state(params, opt, seed=1), gather(data, torch.arange(4)), buffers)
