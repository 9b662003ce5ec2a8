"""Correlated noise in the train step (vmapdp.mf.correlated_noise), white-box.

The released noise is read exactly: the loss has zero gradient (so the clipped sum is 0), the
divisor is 1 and a recording optimizer keeps each step's update, which is then the noise itself.
It is compared with ``std_z * C^{-1} Z`` computed densely in float64 from the same keyed draws
(``keyed_normal`` under each step's key, rebuilt from the seed, the step and the configuration):
exactly with snapping off (``vmapdp.noise.gaussian._unsnapped()``, the audits'), and as released, on the snapping grid
and within half a grid step of it.
"""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch
import torch.nn.functional as F

import vmapdp
import vmapdp.mf as mf
from vmapdp import accounting, optim
from vmapdp.accounting import CyclicPoissonGaussianEvent, Ledger
from vmapdp.data import CyclicPoissonSampler, PoissonSampler, ShuffledSampler, gather
from vmapdp.mf import BandedMFEvent, BandedToeplitz, BufferedToeplitz, MinSeparationMFEvent, calibrate_mf_noise, correlated_noise
from vmapdp.mf.privatizer import describe
from vmapdp.mf.streaming import MAX_RECURSION_GAIN, recursion_gain
from vmapdp.noise import keyed_normal, snap_grid, unreleased
from vmapdp.noise.gaussian import _release, _unsnapped
from vmapdp.train import _step_key, noise_binding, scheme_description, step_config

N_DATA, Q, CYCLE, STEPS, SEED = 40, 0.5, 4, 8, 7
NM, CLIP = 1.3, 0.7
BANDED = BandedToeplitz((1.0, 0.6, 0.25))
BLT = BufferedToeplitz((0.9, 0.5), (0.3, 0.1))
IDENTITY = BandedToeplitz((1.0,))
X = torch.randn(N_DATA, 3, generator=torch.Generator().manual_seed(0))
Y = torch.randn(N_DATA, generator=torch.Generator().manual_seed(1))
PARAMS = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}


def zero_loss(p, sample):
    x, _ = sample
    return (p["w"] @ x).sum() * 0.0 + p["b"].sum() * 0.0


def recording_sgd(seen):
    def init(params):
        return ()

    def update(grads, state, params):
        seen.append({k: v.clone() for k, v in grads.items()})
        return {k: params[k] - grads[k] for k in params}, state

    return optim.Optimizer(init, update, "recording-sgd")


def sampler(steps=STEPS, cycle=CYCLE):
    return CyclicPoissonSampler(N_DATA, Q, cycle=cycle, steps=steps, key=b"mf-sampler")


def make(strategy, s, opt, *, n=STEPS, loss_fn=zero_loss, ebs=1.0, **kw):
    priv = correlated_noise(strategy, steps=n)
    kw.setdefault("method", "vmap")
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=CLIP, noise_multiplier=NM, sampler=s, expected_batch_size=ebs, compile=False, privatizer=priv, **kw)
    return priv, step


def run(strategy, steps, *, state=None, s=None, seen=None, **kw):
    seen = [] if seen is None else seen
    s = sampler() if s is None else s
    opt = recording_sgd(seen)
    priv, step = make(strategy, s, opt, **kw)
    state = vmapdp.init_train_state(PARAMS, opt, seed=SEED, privatizer=priv) if state is None else state
    for _ in range(steps):
        idx, mask = s.sample()
        state, _ = step(state, gather((X, Y), idx), mask)
    return state, seen, s


def step_keys(strategy, state, s, n_steps, n=STEPS):
    config = step_config(
        l2_clip_norm=CLIP, noise_multiplier=NM, expected_batch_size=1.0, sample_rate=Q, method="vmap",
        optimizer="recording-sgd", sampler=scheme_description(s), noise=describe(strategy, n),
    )
    binding = noise_binding(state.run_id, config)
    return [_step_key(SEED, t, binding) for t in range(n_steps)]


def sens_oracle(strategy, n=STEPS, cycle=CYCLE):
    """float64: the largest column norm (banded, amplified) or the norm of the sum of the columns
    of the earliest-start pattern 0, cycle, 2 cycle, ... and every other pattern (brute force)."""
    C = strategy.matrix(n)
    if isinstance(strategy, BandedToeplitz):
        return float(C.norm(dim=0).max())
    best = 0.0
    for start in range(cycle):
        cols = list(range(start, n, cycle))
        for mask in range(1, 1 << len(cols)):
            pick = [c for i, c in enumerate(cols) if mask >> i & 1]
            best = max(best, float(C[:, pick].sum(1).norm()))
    return best


@pytest.mark.parametrize("strategy", [BANDED, BLT, IDENTITY, BandedToeplitz((2.0, 0.5))], ids=["banded", "blt", "identity", "c0=2"])
def test_released_noise_is_std_times_C_inverse_Z_from_the_steps_keyed_draws(strategy):
    std = NM * CLIP * sens_oracle(strategy)
    grid = snap_grid(std / strategy.coeffs[0] if isinstance(strategy, BandedToeplitz) else std)
    for snapped in (True, False):
        if snapped:
            state, seen, s = run(strategy, STEPS)
        else:  # the noise read exactly: unsnapped, and not a release (the run's keys a second time)
            with unreleased(), _unsnapped():
                state, seen, s = run(strategy, STEPS)
        keys = step_keys(strategy, state, s, STEPS)
        for i, name in enumerate(seen[0]):  # the order of the sum's leaves: the leaf index of the draws
            shape = PARAMS[name].shape
            Z = torch.stack([keyed_normal(shape, k, leaf=i).reshape(-1) for k in keys]).double()
            want = std * torch.linalg.solve_triangular(strategy.matrix(STEPS), Z, upper=False)
            got = torch.stack([u[name].reshape(-1) for u in seen]).double()
            if strategy is IDENTITY:  # plain DP-SGD: 0 + z * std in float32 (snapped: add_noise's release), bit for bit
                assert torch.equal(got.float(), _release(torch.zeros_like(Z.float()), Z.float(), NM * CLIP, snap=snapped))
            if snapped:  # on the grid of the step's fresh noise, and within half a step of the formula
                assert torch.equal(torch.remainder(got, grid), torch.zeros_like(got)) and got.ne(0).any()
                torch.testing.assert_close(got, want, rtol=0, atol=grid / 2 + 2e-6 * std)
            else:
                torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * std)
        assert int(state.noise_state["t"]) == STEPS and state.step == STEPS


def test_identity_is_the_gaussian_privatizer_bit_for_bit():
    priv = correlated_noise(IDENTITY, steps=4)
    bound, event, _ = priv.bind("t", noise_multiplier=NM, l2_sensitivity=CLIP, sample_rate=Q, sampler=sampler(steps=4), secure=False)
    summed = {"b": torch.randn(2), "w": torch.randn(2, 3)}
    a, state = bound.privatize(summed, priv.init(PARAMS), b"key")
    b, _ = vmapdp.noise.gaussian_privatizer(NM * CLIP).privatize(summed, (), b"key")
    assert all(torch.equal(a[k], b[k]) for k in summed) and int(state["t"]) == 1
    assert event() == BandedMFEvent(noise_multiplier=NM, sample_rate=Q, cycle=CYCLE, band=1)


def test_a_resume_from_a_checkpoint_continues_bit_for_bit(tmp_path):
    straight, seen_a, _ = run(BANDED, STEPS)
    half, seen_b, s = run(BANDED, STEPS // 2)
    path = tmp_path / "ckpt.pt"
    vmapdp.save_state(path, half, sampler=s)
    s2 = sampler()
    opt = recording_sgd(seen_b)
    loaded = vmapdp.load_state(path, sampler=s2, like=vmapdp.init_train_state(PARAMS, opt, seed=SEED, privatizer=correlated_noise(BANDED, steps=STEPS)))
    assert torch.equal(loaded.noise_state["buffers"]["w"], half.noise_state["buffers"]["w"])
    resumed, _, _ = run(BANDED, STEPS - STEPS // 2, state=loaded, s=s2, seen=seen_b)
    for a, b in zip(seen_a, seen_b):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for k in PARAMS:
        assert torch.equal(straight.params[k], resumed.params[k])
        assert torch.equal(straight.noise_state["buffers"][k], resumed.noise_state["buffers"][k])
    assert resumed.ledger == straight.ledger


def test_the_ledger_records_amplified_banded_mf_as_cyclic_poisson_dp_sgd():
    state, _, s = run(BANDED, STEPS)
    assert state.ledger == Ledger((BandedMFEvent(noise_multiplier=NM, sample_rate=Q, cycle=CYCLE, band=BANDED.band, count=STEPS),))
    want = accounting.epsilon(noise_multiplier=NM, sample_rate=Q, steps=math.ceil(STEPS / CYCLE), delta=1e-5)
    assert state.epsilon(1e-5) == want
    assert accounting.epsilon(Ledger((CyclicPoissonGaussianEvent(noise_multiplier=NM, sample_rate=Q, cycle=CYCLE, count=STEPS),)), delta=1e-5) == want
    assert Ledger.from_json(state.ledger.to_json()) == state.ledger


def gaussian_epsilon(mu, delta):
    """The exact epsilon(delta) of the Gaussian mechanism (Balle and Wang 2018), by bisection."""
    def d(eps):
        return scipy.stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * scipy.stats.norm.cdf(-eps / mu - mu / 2)
    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if d(mid) <= delta else (mid, hi)
    return hi


def test_the_min_separation_event_is_one_gaussian_mechanism_per_run():
    e = MinSeparationMFEvent(noise_multiplier=NM, steps=STEPS, min_separation=CYCLE, max_participations=2, mechanism="blt", size=2, count=3)
    exact = gaussian_epsilon(1.0 / NM, 1e-5)
    for acc, slack in (("pld", 0.02), ("rdp", 0.5)):
        eps = accounting.epsilon(Ledger((e,)), delta=1e-5, accountant=acc)
        assert exact <= eps <= exact * (1 + slack), (acc, eps, exact)
    two_runs = accounting.epsilon(Ledger((e._with_count(STEPS + 1),)), delta=1e-5)  # a second run: mu * sqrt(2)
    assert gaussian_epsilon(math.sqrt(2) / NM, 1e-5) <= two_runs <= gaussian_epsilon(math.sqrt(2) / NM, 1e-5) * 1.02
    assert Ledger.from_json(Ledger((e,)).to_json()) == Ledger((e,))


@pytest.mark.parametrize("strategy", [BANDED, BLT], ids=["banded", "blt"])
def test_calibration_never_overshoots_the_target(strategy):
    s = sampler()
    for target in (2.0,) if isinstance(strategy, BandedToeplitz) else (0.5, 8.0):  # (a banded calibration is a PLD search: slower)
        nm = calibrate_mf_noise(strategy, sampler=s, steps=STEPS, target_epsilon=target, delta=1e-5)
        priv = correlated_noise(strategy, steps=STEPS)
        _, event, _ = priv.bind("t", noise_multiplier=nm, l2_sensitivity=1.0, sample_rate=Q, sampler=s, secure=False)
        eps = accounting.epsilon(Ledger((event()._with_count(STEPS),)), delta=1e-5)
        assert 0.99 * target <= eps <= target, (target, nm, eps)


def test_refusals_name_the_fix():
    opt = optim.sgd(0.1)
    with pytest.raises(ValueError, match="cyclic Poisson sampling only"):
        vmapdp.make_train_step(zero_loss, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sampler=PoissonSampler(N_DATA, 0.1, 4, key=b"k"), privatizer=correlated_noise(BANDED, steps=4))
    with pytest.raises(ValueError, match="cyclic Poisson sampling only"):
        vmapdp.make_train_step(zero_loss, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sampler=ShuffledSampler(N_DATA, 10, key=b"k"), privatizer=correlated_noise(BLT, steps=4))
    with pytest.raises(ValueError, match="cycle >= 3"):
        make(BANDED, sampler(cycle=2), opt)
    with pytest.raises(ValueError, match="steps <= 8"):
        make(BANDED, sampler(steps=9), opt)
    with pytest.raises(ValueError, match="noise_multiplier > 0"):
        vmapdp.make_train_step(zero_loss, opt, l2_clip_norm=1.0, noise_multiplier=0.0, sampler=sampler(), privatizer=correlated_noise(BANDED, steps=8))
    with pytest.raises(TypeError, match="BandedToeplitz or BufferedToeplitz"):
        correlated_noise(torch.eye(3), steps=3)
    with pytest.raises(ValueError, match="cannot run with adaptive_clipping"):  # no published analysis of the pair
        make(BANDED, sampler(), opt, adaptive_clipping=vmapdp.AdaptiveClipping(count_noise_multiplier=10.0))
    with pytest.raises(ValueError, match="cycle >= band"):
        BandedMFEvent(noise_multiplier=1.0, sample_rate=0.1, cycle=2, band=3)
    with pytest.raises(ValueError, match="make_train_step"):
        correlated_noise(BANDED, steps=8).privatize({"b": torch.zeros(1)}, (), b"k")
    # a state without the buffers, and a step past the run: refused, nothing released
    s0 = sampler()
    _, step = make(BANDED, s0, opt)
    idx, mask = s0.sample()
    with pytest.raises(ValueError, match="init_train_state"):
        step(vmapdp.init_train_state(PARAMS, opt, seed=1), gather((X, Y), idx), mask)
    other = vmapdp.init_train_state(PARAMS, opt, seed=1, privatizer=correlated_noise(BandedToeplitz((1.0, 0.5, 0.2)), steps=STEPS))
    with pytest.raises(ValueError, match="another correlated noise"):  # same buffer shapes, another strategy
        step(other, gather((X, Y), idx), mask)
    s = sampler(steps=2)
    priv, step = make(BANDED, s, opt, n=2)
    state = vmapdp.init_train_state(PARAMS, opt, seed=1, privatizer=priv)
    for idx, mask in s:
        state, _ = step(state, gather((X, Y), idx), mask)
    idx, mask = s.sample()  # a third batch
    with pytest.raises(ValueError, match="past steps=2"):
        step(state, gather((X, Y), idx), mask)


def _recovered_draws_error(strategy, n, width=1024):
    """The largest error of the step draws ``z_t`` recovered from the float32 streamed noise
    ``y = C^-1 z`` (``C y``, streamed in float64), over ``n`` steps of ``width`` elements."""
    from vmapdp.mf.streaming import next_noise, state_rows

    z = torch.randn(n, width, generator=torch.Generator().manual_seed(0))
    buf, ys = torch.zeros(state_rows(strategy), width), []
    for t in range(n):
        y, buf = next_noise(strategy, z[t], buf)
        ys.append(y)
    y = torch.stack(ys).double()
    if isinstance(strategy, BandedToeplitz):  # C y, in float64 (no n x n matrix: long runs too)
        cy = sum(c * torch.cat([y.new_zeros(k, width), y[: n - k]]) for k, c in enumerate(strategy.coeffs[:n]))
    else:
        theta, omega = (torch.tensor(v, dtype=torch.float64)[:, None] for v in (strategy.theta, strategy.omega))
        s, rows = torch.zeros(strategy.buffers, width, dtype=torch.float64), []
        for t in range(n):
            rows.append(y[t] + (omega * s).sum(0))
            s = theta * s + y[t]
        cy = torch.stack(rows)
    err = (cy - z.double()).abs().max()
    return float(err) if bool(torch.isfinite(err)) else math.inf


STABLE = [mf.sqrt_prefix(16), mf.optimal_banded(64, 8), mf.optimal_blt(64, 3), BANDED, BLT, BandedToeplitz((1.0, -0.9999)),
          BandedToeplitz((1.0, 1.0)), BufferedToeplitz((1.0,), (0.5,))]
UNSTABLE = [(BandedToeplitz((1.0, 2.0)), 48), (BandedToeplitz((1.0, 1.05)), 300), (BufferedToeplitz((0.5,), (3.0,)), 48),
            (BufferedToeplitz((0.5,), (-0.9,)), 48), (BufferedToeplitz((1.5,), (1.0,)), 100), (BufferedToeplitz((1.5,), (0.0,)), 300)]


@pytest.mark.parametrize("strategy", STABLE, ids=lambda s: repr(s)[:40])
def test_a_strategy_taken_keeps_every_fresh_draw_in_float32(strategy):
    """The refusal's boundary is sound: every strategy correlated_noise takes (the library's optima,
    and marginal ones: C^-1 a running sum, alternating signs, a BLT buffer of theta = 1) streams its
    noise in float32 with each step's draw recoverable from the noise to within 64 * gain * 2**-24
    (measured: at most 17) over 300 steps."""
    n = 300
    gain = recursion_gain(strategy, n)
    assert gain <= MAX_RECURSION_GAIN
    correlated_noise(strategy, steps=n)  # taken
    assert _recovered_draws_error(strategy, n) <= 64 * max(gain, 1.0) * 2.0**-24


def test_the_gain_counts_what_a_buffer_keeps_over_a_long_run():
    """Found by review: a BLT buffer of theta = 1 keeps its rounding errors for the whole run, where
    they add up (151 x gain x 2**-24 over 30000 steps before the gain counted it). With the gain
    counting sqrt(min(steps, 1 / (1 - theta^2))), the bound holds over 20000 steps."""
    n = 20000
    for strategy in (BufferedToeplitz((1.0,), (0.5,)), BufferedToeplitz((1.0,), (1.9,))):
        gain = recursion_gain(strategy, n)
        assert gain <= MAX_RECURSION_GAIN
        assert _recovered_draws_error(strategy, n, width=64) <= 64 * gain * 2.0**-24


@pytest.mark.parametrize("strategy,steps", UNSTABLE, ids=lambda s: repr(s)[:40])
def test_a_strategy_whose_inverse_or_buffers_grow_is_refused(strategy, steps):
    """Found by review: correlated_noise took any finite strategy. One whose C^-1 grows (a banded
    polynomial with a root inside the unit disk; a BLT whose inverse has |theta| > 1) or whose
    buffers grow (|theta| > 1) streams noise that float32 rounds the fresh draws out of: the
    released noise becomes a function of the earlier noise (with (1.0, 2.0): zero fresh noise in
    every coordinate by step 39, an epsilon of 3.6 reported), or overflows. Each is refused with the
    cause, and each does lose its draws in float32 (the reason)."""
    with pytest.raises(ValueError, match=r"grow to .* times each step's fresh draw.*rounded away.*optimal_banded"):
        correlated_noise(strategy, steps=steps)
    assert _recovered_draws_error(strategy, steps) >= 0.5


def mlp_loss(p, sample):
    x, y = sample
    return F.mse_loss(torch.tanh(F.linear(x[None], p["w"], p["b"])).sum(), y)


def mlp_params():
    return {"w": torch.randn(2, 3, generator=torch.Generator().manual_seed(3)), "b": torch.zeros(2)}


@pytest.mark.parametrize("method,precision", [("vmap", None), ("ghost", None), ("two_pass", None), ("vmap", torch.bfloat16)])
def test_the_noise_sits_after_every_clipping_method_and_mixed_precision(method, precision):
    """released - clipped sum (recomputed by clipped_grad_sum, under the same precision) = the formula
    (unsnapped: the noise read exactly; the snapped release is tested above)."""
    seen, s = [], sampler()
    opt = recording_sgd(seen)
    priv, step = make(BANDED, s, opt, loss_fn=mlp_loss, method=method, precision=precision)
    state = vmapdp.init_train_state(mlp_params(), opt, seed=SEED, privatizer=priv)
    inputs = []
    for _ in range(3):
        idx, mask = s.sample()
        inputs.append((state.params, gather((X, Y), idx), mask))
        with _unsnapped():
            state, _ = step(state, inputs[-1][1], mask)
    config = step_config(
        l2_clip_norm=CLIP, noise_multiplier=NM, expected_batch_size=1.0, sample_rate=Q, method=method, precision=precision,
        optimizer="recording-sgd", sampler=scheme_description(s), noise=describe(BANDED, STEPS),
    )
    keys = [_step_key(SEED, t, noise_binding(state.run_id, config)) for t in range(3)]
    loss = mlp_loss if precision is None else vmapdp.mixed_precision(mlp_loss, precision)
    sums = [vmapdp.clipped_grad_sum(loss, l2_clip_norm=CLIP, method="vmap")(p, b, mask=m)[0] for p, b, m in inputs]
    std = NM * CLIP * sens_oracle(BANDED)
    for i, name in enumerate(seen[0]):
        Z = torch.stack([keyed_normal(PARAMS[name].shape, k, leaf=i).reshape(-1) for k in keys]).double()
        want = std * torch.linalg.solve_triangular(BANDED.matrix(3), Z, upper=False)
        got = torch.stack([(u[name] - sm[name]).reshape(-1) for u, sm in zip(seen, sums)]).double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert state.ledger == Ledger((BandedMFEvent(noise_multiplier=NM, sample_rate=Q, cycle=CYCLE, band=3, count=3),))


def test_the_sensitivity_self_check_holds_with_correlated_noise():
    s = sampler()
    priv, step = make(BANDED, s, optim.sgd(0.5), loss_fn=mlp_loss, ebs=s.expected_batch_size)
    state = vmapdp.init_train_state(mlp_params(), optim.sgd(0.5), seed=SEED, privatizer=priv)
    idx, mask = s.sample()
    mask = torch.cat([mask, torch.zeros(1, dtype=torch.bool)])
    idx = torch.cat([idx, idx[:1]])
    batch = gather((X, Y), idx)
    vmapdp.testing.check_sensitivity(step, state, batch, mask, lr=0.5, l2_clip_norm=CLIP, expected_batch_size=s.expected_batch_size)
    # after a step the buffers are not zero; the noise still cancels between the two runs
    state, _ = step(state, batch, mask)
    idx, mask = s.sample()  # the next step's batch (the step refuses a sampler behind the state)
    mask = torch.cat([mask, torch.zeros(1, dtype=torch.bool)])
    batch = gather((X, Y), torch.cat([idx, idx[:1]]))
    vmapdp.testing.check_sensitivity(step, state, batch, mask, lr=0.5, l2_clip_norm=CLIP, expected_batch_size=s.expected_batch_size)


def _distributed_run(distributed):
    import vmapdp.distributed as vdist

    s = CyclicPoissonSampler(N_DATA, Q, cycle=CYCLE, steps=4, key=b"mf-sampler", capacity=8)
    opt = optim.sgd(0.5, momentum=0.9)
    priv = correlated_noise(BLT, steps=STEPS)
    step = vmapdp.make_train_step(
        mlp_loss, opt, l2_clip_norm=CLIP, noise_multiplier=NM, sampler=s, compile=False, method="vmap", privatizer=priv,
        physical_batch_size=vdist.local_capacity(8) if distributed else 8, distributed=distributed,
    )
    state = vmapdp.init_train_state(mlp_params(), opt, seed=SEED, privatizer=priv)
    for idx, mask in vdist.sharded(s) if distributed else s:
        state, _ = step(state, gather((X, Y), idx), mask)
    return {"params": state.params, "noise": state.noise_state["buffers"], "t": int(state.noise_state["t"]), "ledger": state.ledger.to_json()}


def _worker(rank, world, init_file, out_dir):
    import datetime
    import os

    import torch.distributed as dist

    import vmapdp.distributed as vdist

    vmapdp.noise.gaussian._fused_ok = False  # the eager Box-Muller: no Inductor compile per process (the parent does the same)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(_distributed_run(True), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        vdist.shutdown()


def test_two_ranks_carry_the_same_noise_state_and_equal_one_process(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(vmapdp.noise.gaussian, "_fused_ok", False)  # eager draws, as in the ranks: the same bits
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    one = _distributed_run(False)
    for k in PARAMS:
        assert torch.equal(ranks[0]["noise"][k], ranks[1]["noise"][k]) and torch.equal(ranks[0]["noise"][k], one["noise"][k])
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k])
        torch.testing.assert_close(ranks[0]["params"][k], one["params"][k], rtol=1e-6, atol=1e-6)
    assert ranks[0]["t"] == ranks[1]["t"] == one["t"] == 4
    assert ranks[0]["ledger"] == ranks[1]["ledger"] == one["ledger"]


def test_the_noise_and_ledger_self_checks_cover_correlated_noise():
    """check_noise_calibration at the fresh draw's std passes (and at DP-SGD's noise multiplier,
    which the banded strategy's sens / c_0 = 1.19 exceeds, it fails: the check sees the
    difference); check_ledger with the privatizer passes, and without it flags the ledger.
    Each noise check runs at alpha = 1e-3 (its stated false-alarm rate)."""
    s = sampler()
    priv, step = make(BANDED, s, optim.sgd(0.5), loss_fn=mlp_loss, ebs=s.expected_batch_size)
    wide = {"w": torch.randn(100, 3, generator=torch.Generator().manual_seed(3)), "b": torch.zeros(100)}  # 400 coordinates a pair
    state = vmapdp.init_train_state(wide, optim.sgd(0.5), seed=SEED, privatizer=priv)
    idx, mask = s.sample()  # (the step wants its sampler exactly one batch past the state: each state's checks come with its batch)
    batch = gather((X, Y), idx)
    fresh = vmapdp.mf.fresh_noise_multiplier(BANDED, noise_multiplier=NM, sampler=s, steps=STEPS)
    assert fresh == pytest.approx(NM * math.sqrt(1 + 0.6**2 + 0.25**2))
    kw = dict(lr=0.5, l2_clip_norm=CLIP, expected_batch_size=s.expected_batch_size, min_samples=1200)
    vmapdp.testing.check_noise_calibration(step, state, batch, mask, noise_multiplier=fresh, **kw)  # from zero buffers
    report = vmapdp.testing.check_noise_calibration(step, state, batch, mask, noise_multiplier=NM, raise_on_failure=False, **kw)
    assert not report.passed and report.std_ratio == pytest.approx(fresh / NM, rel=0.05)
    with pytest.raises(ValueError, match="fresh_noise_multiplier"):
        vmapdp.testing.check_noise_calibration(step, state, batch, mask, **kw)
    after, _ = step(state, batch, mask)
    idx, mask = s.sample()  # the batch of the step from `after`
    batch = gather((X, Y), idx)
    vmapdp.testing.check_noise_calibration(step, after, batch, mask, noise_multiplier=fresh, **kw)  # from filled buffers: their part cancels
    vmapdp.testing.check_ledger(state, after, steps=1, noise_multiplier=NM, sampler=s, privatizer=priv)
    report = vmapdp.testing.check_ledger(state, after, steps=1, noise_multiplier=NM, sampler=s, raise_on_failure=False)
    # (found by review: blamed on a ledger written by hand, with "epsilon 4.704 instead of 4.704")
    assert not report.passed and "pass privatizer= (the correlated_noise(...)" in report.message
    same = f"{report.epsilon_expected:.4g}" == f"{report.epsilon_recorded:.4g}"
    assert ("for both, from other events" in report.message) == same and ("instead of" in report.message.split("Likely")[0]) == (not same)
    with pytest.raises(TypeError, match=r"check_ledger\(state_before, state_after\): privatizer"):
        vmapdp.testing.check_ledger(state, after, steps=1, noise_multiplier=NM, sampler=s, privatizer="banded")


def test_make_private_takes_a_strategy():
    from torch import nn

    data = torch.utils.data.TensorDataset(X, (Y > 0).long())
    model = nn.Linear(3, 2)
    trainer = vmapdp.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, l2_clip_norm=1.0, delta=1e-3, target_epsilon=4.0, epochs=2,
        batch_size=5, strategy=BANDED, compile=False, method="vmap", seed=3,
    )
    assert isinstance(trainer.sampler, CyclicPoissonSampler) and trainer.sampler.cycle == BANDED.band
    assert trainer.sampler.expected_batch_size == pytest.approx(5.0)
    trainer.fit(2)  # 2 epochs of 8 steps: the whole run
    (event,) = trainer.state.ledger.events
    assert event == BandedMFEvent(noise_multiplier=trainer.noise_multiplier, sample_rate=5 * 3 / N_DATA, cycle=3, band=3, count=16)
    assert 0.99 * 4.0 <= trainer.epsilon() <= 4.0
    with pytest.raises(ValueError, match="past steps=16"):
        trainer.fit(1)
    with pytest.raises(ValueError, match="cycle= applies to correlated noise only"):
        vmapdp.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, l2_clip_norm=1.0, delta=1e-3, noise_multiplier=1.0, batch_size=5, cycle=4)
    with pytest.raises(ValueError, match="needs cycle="):
        vmapdp.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, l2_clip_norm=1.0, delta=1e-3, noise_multiplier=1.0, epochs=1, batch_size=5, strategy=BLT)


def test_secure_noise_carries_the_same_recursion():
    """secure=True: the draws come from the OS CSPRNG (not reproducible), the recursion is the same:
    with a zero clipped sum the release is std * y_t (snapped: within half a grid step) and the state
    keeps y_t (banded: row 0)."""
    seen, s = [], sampler()
    opt = recording_sgd(seen)
    priv, step = make(BANDED, s, opt, secure=True)
    state = vmapdp.init_train_state(PARAMS, opt, secure=True, privatizer=priv)
    std = NM * CLIP * sens_oracle(BANDED)
    previous = None
    for _ in range(3):
        idx, mask = s.sample()
        state, _ = step(state, gather((X, Y), idx), mask)
        for k in PARAMS:
            torch.testing.assert_close(seen[-1][k] / std, state.noise_state["buffers"][k][0], rtol=0, atol=snap_grid(std) / std / 2 + 1e-6)
            if previous is not None:
                assert torch.equal(state.noise_state["buffers"][k][1], previous[k])
        previous = {k: state.noise_state["buffers"][k][0].clone() for k in PARAMS}
    assert int(state.noise_state["t"]) == 3 and state.ledger.events[0].count == 3


def test_secure_draws_are_a_stream_under_one_fresh_os_key_per_step(monkeypatch):
    """secure=True: each step asks the OS CSPRNG for one 256-bit key and draws every leaf's z_t from
    the keyed stream under it (as add_noise(secure=True)): with the OS's bytes fixed, the release of a
    zero sum is std * z_t of that keyed draw (snapped, as add_noise's), float32 and float64 leaves alike."""
    import secrets

    priv = correlated_noise(IDENTITY, steps=STEPS)
    bound, _, _ = priv.bind("t", noise_multiplier=NM, l2_sensitivity=CLIP, sample_rate=Q, sampler=sampler(), secure=True)
    params = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float64)}
    asked = []
    monkeypatch.setattr(secrets, "token_bytes", lambda n: asked.append(n) or b"\x07" * n)
    noisy, _ = bound.privatize(params, priv.init(params), None)
    assert asked == [32]
    std = NM * CLIP * sens_oracle(IDENTITY)
    assert torch.equal(noisy["a"], _release(params["a"], keyed_normal((3, 4), b"\x07" * 32, leaf=0), std))
    assert torch.equal(noisy["b"], _release(params["b"], keyed_normal((5,), b"\x07" * 32, leaf=1, dtype=torch.float64), std))


def test_float64_leaves_get_float64_noise_and_buffers():
    """A float64 sum is noised with float64 draws (keyed_normal's float64 stream) and float64 buffers."""
    priv = correlated_noise(BLT, steps=STEPS)
    bound, _, _ = priv.bind("t", noise_multiplier=NM, l2_sensitivity=CLIP, sample_rate=Q, sampler=sampler(), secure=False)
    params64 = {"w": torch.zeros(5, dtype=torch.float64)}
    state, got = priv.init(params64), []
    assert state["buffers"]["w"].dtype == torch.float64 and state["buffers"]["w"].shape == (2, 5)
    for t in range(4):
        noisy, state = bound.privatize({"w": torch.zeros(5, dtype=torch.float64)}, state, f"k{t}".encode())
        got.append(noisy["w"])
    Z = torch.stack([keyed_normal((5,), f"k{t}".encode(), dtype=torch.float64) for t in range(4)])
    std = NM * CLIP * sens_oracle(BLT)
    want = std * torch.linalg.solve_triangular(BLT.matrix(4), Z, upper=False)
    got = torch.stack(got)  # snapped: on the grid, within half a step of the formula
    assert got.dtype == torch.float64 and torch.equal(torch.remainder(got, snap_grid(std)), torch.zeros_like(got))
    torch.testing.assert_close(got, want, rtol=0, atol=snap_grid(std) / 2 + 1e-12)


def test_a_bound_privatizer_is_refused_where_it_would_be_charged_as_gaussian_noise():
    """A privatizer returned by .bind() carries no accounting of its own: passed back to
    make_train_step it would be charged as plain DP-SGD (a BLT, or banded noise under Poisson
    sampling, with an epsilon far below the truth). Refused; so is rebinding it."""
    opt = optim.sgd(0.1)
    bound, _, _ = correlated_noise(BLT, steps=STEPS).bind("test", noise_multiplier=NM, l2_sensitivity=CLIP, sample_rate=None, sampler=sampler(), secure=False)
    with pytest.raises(ValueError, match="already bound"):
        vmapdp.make_train_step(zero_loss, opt, l2_clip_norm=CLIP, noise_multiplier=NM, sampler=PoissonSampler(N_DATA, 1.0, STEPS, key=b"k"), privatizer=bound, compile=False)
    with pytest.raises(ValueError, match="already bound"):
        bound.bind("test", noise_multiplier=NM, l2_sensitivity=CLIP, sample_rate=None, sampler=sampler(), secure=False)


def test_a_fresh_sampler_on_a_resumed_run_is_refused(tmp_path):
    """A resumed run whose sampler restarted would put an example's participations closer than
    the band (group 0 again after step 4): the step refuses before anything is released; a
    checkpoint that holds a secure cyclic sampler's groups cannot be loaded without a sampler."""
    half, _, s = run(BANDED, STEPS // 2)
    fresh = sampler()
    _, step = make(BANDED, fresh, recording_sgd([]))
    idx, mask = fresh.sample()  # drawn 1 batch; the state is at step 4
    with pytest.raises(ValueError, match="has drawn only 1 batches"):
        step(half, gather((X, Y), idx), mask)
    # the sampler resumed with the state is accepted
    _, step = make(BANDED, s, recording_sgd([]))
    idx, mask = s.sample()
    step(half, gather((X, Y), idx), mask)
    secure = CyclicPoissonSampler(N_DATA, Q, cycle=CYCLE, steps=STEPS, secure=True)  # (its groups drawn, no batch: the state is at step 0)
    opt = optim.sgd(0.1)
    state = vmapdp.init_train_state(PARAMS, opt, seed=SEED)
    path = tmp_path / "secure.pt"
    vmapdp.save_state(path, state, sampler=secure)
    with pytest.raises(ValueError, match="saved with a secure sampler"):  # (its lost steps cannot be redrawn)
        vmapdp.load_state(path)
    with pytest.raises(ValueError, match="holds the sampler's state"):
        vmapdp.load_state(path, saved_after_last_step=True)


def test_a_correlated_noise_state_is_refused_by_a_step_without_its_privatizer():
    """Found by review (hunt4/gauss_on_mf_state.py): the default Gaussian step accepted a banded
    state and passed its buffers through with their step count unchanged; later correlated steps
    then lagged the sampler's groups, putting an example's participations 3 rows apart under a
    band of 4 (sensitivity 1.54 column norms where the ledger charged 1.41)."""
    s = sampler()
    priv, _ = make(BANDED, s, optim.sgd(0.5))
    state = vmapdp.init_train_state(PARAMS, optim.sgd(0.5), seed=SEED, privatizer=priv)
    plain = vmapdp.make_train_step(zero_loss, optim.sgd(0.5), l2_clip_norm=CLIP, noise_multiplier=NM, sampler=s, physical_batch_size=s.capacity, compile=False)
    idx, mask = s.sample()
    with pytest.raises(ValueError, match=r"carries a privatizer's noise state .* pass the privatizer the state was made with.*Nothing was released"):
        plain(state, gather((X, Y), idx), mask)


def test_a_correlated_noise_state_is_refused_by_any_other_privatizer():
    """Found by review: an explicit gaussian_privatizer (not bound) passed a banded state's buffers
    through; correlated steps resumed 6 steps later (a multiple of the run) had their step count
    6 behind the sampler's groups, participations 2 rows apart under a band of 3 (1.323 against
    the 1.204 charged)."""
    s = sampler()
    priv, _ = make(BANDED, s, optim.sgd(0.5))
    state = vmapdp.init_train_state(PARAMS, optim.sgd(0.5), seed=SEED, privatizer=priv)
    plain = vmapdp.make_train_step(zero_loss, optim.sgd(0.5), l2_clip_norm=CLIP, noise_multiplier=NM, sampler=s, physical_batch_size=s.capacity,
                                   compile=False, privatizer=vmapdp.noise.gaussian_privatizer(NM * CLIP))
    idx, mask = s.sample()
    with pytest.raises(ValueError, match=r"carries correlated noise's state .* privatizer=correlated_noise\(\.\.\.\).*Nothing was released"):
        plain(state, gather((X, Y), idx), mask)


def test_a_batch_not_drawn_from_the_steps_own_sampler_is_refused():
    """Correlated noise is charged for the separation of each example's participations that its
    sampler guarantees: a batch drawn elsewhere while that sampler has drawn nothing (full
    batches at every step, say) is refused before anything is released."""
    opt = recording_sgd([])
    s = sampler()
    priv, step = make(BANDED, s, opt)
    state = vmapdp.init_train_state(PARAMS, opt, seed=SEED, privatizer=priv)
    full = torch.ones(N_DATA, dtype=torch.bool)
    with pytest.raises(ValueError, match="has drawn no batch"):
        step(state, (X, Y), full)
    assert state.step == 0 and len(state.ledger.events) == 0


def test_a_noise_state_of_another_step_is_refused_by_the_step_and_by_load(tmp_path):
    """The buffers of correlated noise belong to one point of the run: a noise state reset to
    ``init`` mid-run (its ``t`` 0 at state step 4), or a checkpoint whose noise state was saved
    at another step, would release ``C^{-1} z`` rows that are not the mechanism's while the
    ledger charges it. Both are refused, naming the fix, before anything is released or loaded."""
    half, _, s = run(BANDED, STEPS // 2)
    priv, step = make(BANDED, s, recording_sgd([]))
    reset = half._replace(noise_state=priv.init(PARAMS))
    idx, mask = s.sample()
    with pytest.raises(ValueError, match=r"has noised 0 steps but the state is at step 4.*init_train_state\(\.\.\., privatizer=\).*Nothing was released"):
        step(reset, gather((X, Y), idx), mask)
    step(half, gather((X, Y), idx), mask)  # the consistent state takes the same batch
    s2 = sampler()
    [s2.sample() for _ in range(5)]
    _, step2 = make(BANDED, s2, recording_sgd([]))
    idx, mask = s2.sample()
    with pytest.raises(ValueError, match=r"has noised 3 steps but the state is at step 5 \(runs of 8 steps"):  # (one step behind)
        step2(half._replace(noise_state={**half.noise_state, "t": torch.tensor(3)}, step=5), gather((X, Y), idx), mask)
    path = tmp_path / "mixed.pt"
    s4 = sampler()  # (the sampler at the state's step: one drawn past it is refused at the save)
    [s4.sample() for _ in range(4)]
    vmapdp.save_state(path, half._replace(noise_state={**half.noise_state, "t": torch.tensor(5)}), sampler=s4)
    with pytest.raises(ValueError, match="has noised 5 steps but the state is at step 4.*inconsistent; nothing was loaded"):
        vmapdp.load_state(path, sampler=sampler())


def test_a_fresh_noise_state_starts_the_next_run_at_a_multiple_of_steps_only():
    """After a whole run of ``steps``, a fresh noise state (t = 0) continues the same TrainState as
    the next run, which the ledger charges as one more run (BLT: one more Gaussian mechanism);
    the spent state itself is refused as past its run."""
    s = sampler()
    full, _, _ = run(BLT, STEPS, s=s)
    priv, step = make(BLT, s, recording_sgd([]))
    idx, mask = s.sample()  # (a sampler draws past its steps when asked; iterating it stops there)
    with pytest.raises(ValueError, match=r"step 9 is past steps=8.*fresh noise state"):
        step(full, gather((X, Y), idx), mask)
    nxt, _ = step(full._replace(noise_state=priv.init(PARAMS)), gather((X, Y), idx), mask)
    assert int(nxt.noise_state["t"]) == 1 and nxt.step == STEPS + 1
    assert nxt.ledger.events[-1].charged_runs == 2


def test_a_privatizer_of_yours_may_keep_a_step_count_of_its_own():
    """Only correlated noise's state layout is checked: a privatizer of yours whose state holds a
    't' (here a float, counting from 1) runs and is saved and loaded as it likes."""
    def init(params):
        return {"t": torch.tensor(1.0)}

    def privatize(summed, state, key):
        return vmapdp.noise.add_noise(summed, NM * CLIP, key=key), {"t": state["t"] + 1}

    mine = vmapdp.noise.Privatizer(init, privatize, config="mine")
    s = PoissonSampler(N_DATA, Q, steps=2, key=b"k")
    step = vmapdp.make_train_step(zero_loss, optim.sgd(0.1), l2_clip_norm=CLIP, noise_multiplier=NM, sampler=s, expected_batch_size=1.0,
                                  compile=False, method="vmap", privatizer=mine)
    state = vmapdp.init_train_state(PARAMS, optim.sgd(0.1), seed=SEED, privatizer=mine)
    idx, mask = s.sample()
    state, _ = step(state, gather((X, Y), idx), mask)
    assert float(state.noise_state["t"]) == 2.0


def test_a_fresh_sampler_under_another_key_fast_forwarded_to_the_state_is_refused(tmp_path):
    """Found by review: a run saved without its sampler, resumed with a fresh cyclic sampler under
    another key and drawn to the state's position, passed the position check while its groups
    (so where an example takes part) differ from the ones the ledger charged. The sampler's
    stream_id is recorded in the state (and its checkpoints) and another one is refused; the
    same key, or the run's own sampler restored, continues."""
    half, _, s = run(BANDED, STEPS // 2)
    assert half.sampler_id == s.stream_id != ""
    other = CyclicPoissonSampler(N_DATA, Q, cycle=CYCLE, steps=STEPS, key=b"another-key")
    same = sampler()
    for fresh in (other, same):
        [fresh.sample() for _ in range(STEPS // 2)]
    _, step = make(BANDED, other, recording_sgd([]))
    idx, mask = other.sample()
    with pytest.raises(ValueError, match=r"is not the sampler the state's 4 steps were drawn by.*load_state\(\.\.\., sampler=\).*Nothing was released"):
        step(half, gather((X, Y), idx), mask)
    _, step = make(BANDED, same, recording_sgd([]))
    idx, mask = same.sample()
    assert step(half, gather((X, Y), idx), mask)[0].step == STEPS // 2 + 1
    # through a checkpoint: the id is saved; a secure sampler's own token is restored with its state
    secure = CyclicPoissonSampler(N_DATA, Q, cycle=CYCLE, steps=STEPS, secure=True)
    state, _, _ = run(BANDED, 2, s=secure, secure=True, state=vmapdp.init_train_state(PARAMS, recording_sgd([]), seed=None, privatizer=correlated_noise(BANDED, steps=STEPS), secure=True))
    path = tmp_path / "secure.pt"
    vmapdp.save_state(path, state, sampler=secure)
    like = vmapdp.init_train_state(PARAMS, recording_sgd([]), seed=None, privatizer=correlated_noise(BANDED, steps=STEPS), secure=True)
    restored = CyclicPoissonSampler(N_DATA, Q, cycle=CYCLE, steps=STEPS, secure=True)
    assert restored.stream_id != secure.stream_id
    loaded = vmapdp.load_state(path, sampler=restored, like=like, saved_after_last_step=True)
    assert loaded.sampler_id == restored.stream_id == secure.stream_id


def test_a_noise_state_of_another_run_or_segment_is_refused():
    """Found by review: a correlated-noise state was checked for its mechanism and its position
    only, so the buffers of another run (another seed), or of an earlier noise run of the same
    state, at the same t were continued: their released draws entered the new releases too (a
    column norm of C 1.36 where the ledger charged 1.19). The buffers are bound to their run
    segment now (the noise state's owner: seed, run, start), and a segment starts from zeros."""
    def setup(seed):
        s = CyclicPoissonSampler(N_DATA, Q, cycle=4, steps=4, key=b"mf-owner-%d" % seed)
        opt = optim.sgd(0.1)
        priv, step = make(BANDED, s, opt, n=4)
        return s, step, vmapdp.init_train_state(PARAMS, opt, seed=seed, privatizer=priv), priv

    def go(step, s, state, k):
        for _ in range(k):
            idx, mask = s.sample()
            state, _ = step(state, gather((X, Y), idx), mask)
        return state

    s, step, state, priv = setup(SEED)
    state = go(step, s, state, 2)
    own_t2 = state.noise_state  # this run, t = 2 (its first noise run)
    so, stepo, other, _ = setup(SEED + 1)
    other_t2 = go(stepo, so, other, 2).noise_state  # another run (seed), t = 2
    state = go(step, s, state, 2)
    idx, mask = s.sample()  # step 4 starts the next noise run
    stale = {**own_t2, "t": torch.zeros((), dtype=torch.int64)}  # a "fresh" state holding released draws
    with pytest.raises(ValueError, match=r"starts a correlated-noise run \(t = 0\) but its buffers are not zeros.*Nothing was released"):
        step(state._replace(noise_state=stale), gather((X, Y), idx), mask)
    state, _ = step(state._replace(noise_state=priv.init(state.params)), gather((X, Y), idx), mask)  # from a fresh noise state
    state = go(step, s, state, 1)  # steps 4, 5: t = 2
    idx, mask = s.sample()
    for swapped in (own_t2, other_t2):
        with pytest.raises(ValueError, match=r"buffers belong to another run, or to another noise run of this one.*Nothing was released"):
            step(state._replace(noise_state=swapped), gather((X, Y), idx), mask)
    assert step(state, gather((X, Y), idx), mask)[0].step == 7  # its own state steps on


def test_a_checkpoint_saved_before_noise_owners_loads_and_resumes(tmp_path):
    """Found by review: a correlated-noise checkpoint saved before noise states had an owner no
    longer loaded with like= (make_private's resume passes it): load_state binds it to its run;
    a state without an owner given to a step directly is refused with that fix."""
    s = CyclicPoissonSampler(N_DATA, Q, cycle=4, steps=4, key=b"mf-legacy")
    opt = optim.sgd(0.1)
    priv, step = make(BANDED, s, opt, n=4)
    fresh = vmapdp.init_train_state(PARAMS, opt, seed=SEED, privatizer=priv)
    state = fresh
    for _ in range(2):
        idx, mask = s.sample()
        state, _ = step(state, gather((X, Y), idx), mask)
    legacy = state._replace(noise_state={k: v for k, v in state.noise_state.items() if k != "owner"})
    at_state = CyclicPoissonSampler(N_DATA, Q, cycle=4, steps=4, key=b"mf-legacy")
    at_state.load_state_dict(s.state_dict())  # (the sampler at the state's step, for the files below)
    idx, mask = s.sample()
    with pytest.raises(ValueError, match=r"the noise state has no owner.*read it through load_state"):
        step(legacy, gather((X, Y), idx), mask)
    with pytest.raises(ValueError, match=r"has no owner .* though it has noised 2 steps.*Nothing was written"):
        vmapdp.save_state(tmp_path / "old.pt", legacy, sampler=at_state)  # (another review: stripped, saved, loaded: rebound)
    from vmapdp import checkpoint as ckpt  # an older version's file: written without the check

    ckpt.write_payload(tmp_path / "old.pt", {**ckpt.state_payload("save", state, at_state), "noise_state": legacy.noise_state}, None)
    again = CyclicPoissonSampler(N_DATA, Q, cycle=4, steps=4, key=b"mf-legacy")
    loaded = vmapdp.load_state(tmp_path / "old.pt", like=fresh, sampler=again)
    assert torch.equal(loaded.noise_state["owner"], state.noise_state["owner"])
    idx, mask = again.sample()
    with vmapdp.noise.spent.unreleased():
        assert step(loaded, gather((X, Y), idx), mask)[0].step == 3

