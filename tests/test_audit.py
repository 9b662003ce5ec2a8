"""Privacy self-checks (vmapdp.audit): each check passes vmapdp's own step and catches the bug it is for.

Every mutant below is a deliberately broken DP-SGD step, sampler or per-sample-gradient function
with ONE change from the correct one (the re-implemented step without changes is shown to equal
vmapdp's step exactly). Statistical checks run at the false-alarm rate ALPHA (the audit at
confidence 1 - BETA); all seeds are fixed, so the suite is deterministic.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

import vmapdp
from vmapdp import optim
from vmapdp.accounting import PoissonGaussianEvent
from vmapdp.audit import (
    PrivacyCheckError,
    audit_epsilon_lower_bound,
    check_ledger,
    check_noise_calibration,
    check_per_sample_independence,
    check_sampler,
    check_sensitivity,
    clopper_pearson_upper,
)
from vmapdp.clipping import clip_and_sum
from vmapdp.data import PoissonSampler
from vmapdp.noise import add_noise
from vmapdp.per_sample import per_sample_grads
from vmapdp.train import _step_key, noise_binding, step_config

ALPHA = 1e-3  # false-alarm rate of every statistical check here (sampler, noise)
BETA = 0.05  # the audit's lower bound holds with confidence 1 - BETA
LR, CLIP, EBS, Q = 0.5, 0.1, 8.0, 0.1


def problem(seed=0, n=16, hidden=64):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 3))
    apply, params, buffers = vmapdp.functionalize(model)
    g = torch.Generator().manual_seed(seed + 1)
    data = (torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    return params, buffers, data, loss_fn


MASK = torch.tensor([True] * 10 + [False] * 6)  # 10 real rows, 6 padded (the adversarial slots)


def mutant_train_step(
    loss_fn,
    optimizer,
    *,
    l2_clip_norm,
    noise_multiplier,
    expected_batch_size,
    sample_rate,
    compile=False,
    noise_scale=1.0,
    clip=True,
    divisor="expected",
    use_mask=True,
    key_method="vmap",
    unnoised=(),
    key_ignores_step=False,
    stale=(),
):
    """vmapdp's step composition re-implemented, with at most one deliberate bug switched on."""
    del compile
    grads_fn = per_sample_grads(loss_fn)
    event = PoissonGaussianEvent(noise_multiplier=noise_multiplier, sample_rate=sample_rate)  # the claim

    def step(state, batch, mask, *shared):
        m = mask if use_mask else torch.ones_like(mask)  # bug: padded rows are summed
        grads = grads_fn(state.params, *shared, batch, mask=m)
        summed, _ = clip_and_sum(grads, l2_clip_norm if clip else math.inf, mask=m)  # bug: no clipping
        config = step_config(l2_clip_norm=l2_clip_norm, noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size, sample_rate=sample_rate, method=key_method, optimizer=optimizer.config)
        key = _step_key(state.noise_seed, 0 if key_ignores_step else state.step, noise_binding(state.run_id, config))  # vmapdp's key (bug: the same every step)
        noisy = add_noise(summed, noise_scale * noise_multiplier * l2_clip_norm, key=key)  # bug: noise x scale
        noisy = {k: summed[k] if k in unnoised else v for k, v in noisy.items()}  # bug: tensors released without noise
        if stale:  # bug: these tensors' noise the same every step
            first = add_noise(summed, noise_scale * noise_multiplier * l2_clip_norm, key=_step_key(state.noise_seed, 0, noise_binding(state.run_id, config)))
            noisy = {k: first[k] if k in stale else v for k, v in noisy.items()}
        div = expected_batch_size if divisor == "expected" else m.sum().clamp_min(1)  # bug: realised size
        update = {k: v / div for k, v in noisy.items()}
        params, opt_state = optimizer.update(update, state.opt_state, state.params)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1, ledger=state.ledger.append(event)), {}

    return step


def make_step(loss_fn, *, compile=False, method="auto", **bug):
    builder = functools.partial(mutant_train_step, **bug) if bug else functools.partial(vmapdp.make_train_step, method=method)
    return builder(loss_fn, optim.sgd(LR), l2_clip_norm=CLIP, noise_multiplier=1.0, expected_batch_size=EBS, sample_rate=Q, compile=compile)


@pytest.fixture(scope="module")
def setup():
    params, buffers, data, loss_fn = problem()
    return params, buffers, data, loss_fn, vmapdp.init_train_state(params, optim.sgd(LR), seed=0)


@pytest.fixture(scope="module")
def compiled_step(setup):
    """The ONE compiled step of this file (compiling costs ~10 s); shared by the step-level checks."""
    _, _, _, loss_fn, _ = setup
    return make_step(loss_fn, compile=True)


@pytest.fixture(params=["ghost", "vmap", "two_pass", "compiled"])
def vmapdp_step(request, setup):
    """vmapdp's step with each method of computing the clipped sum (eager), and compiled (auto: ghost)."""
    return request.getfixturevalue("compiled_step") if request.param == "compiled" else make_step(setup[3], method=request.param)


HYPER = dict(lr=LR, l2_clip_norm=CLIP, expected_batch_size=EBS)


# ---------------------------------------------------------------- statistics helpers vs scipy


@pytest.mark.parametrize("k, n", [(0, 10), (3, 10), (1, 1000), (7, 50_000), (2_400, 5_000), (99, 100), (100, 100)])
@pytest.mark.parametrize("beta", [0.025, 1e-3])
def test_clopper_pearson_upper_matches_scipy(k, n, beta):
    ref = 1.0 if k == n else stats.beta.ppf(1 - beta, k + 1, n - k)
    assert clopper_pearson_upper(k, n, beta) == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize("ss, dof", [(0.0, 3), (0.5, 1), (3.0, 3), (90.0, 105), (105.0, 105), (160.0, 105), (1.9e4, 2e4)])
def test_chi2_two_sided_p_matches_scipy(ss, dof):
    from vmapdp.audit.stats import chi2_two_sided_p

    ref = min(1.0, 2 * min(stats.chi2.cdf(ss, dof), stats.chi2.sf(ss, dof)))
    assert chi2_two_sided_p(ss, dof) == pytest.approx(ref, rel=1e-9, abs=1e-300)


def test_ks_pvalue_matches_scipy():
    from vmapdp.audit.stats import ks_normal

    x = torch.randn(5000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for std in (1.0, 1.03, 0.97):
        d, p = ks_normal(x, std)
        ref = stats.kstest(x.numpy(), "norm", args=(0.0, std))
        assert d == pytest.approx(ref.statistic, rel=1e-9)
        assert p == pytest.approx(ref.pvalue, rel=0.05, abs=1e-6)


def test_mutant_builder_without_a_bug_is_vmapdps_step(setup):
    """So each mutant below differs from the real step by exactly its one switched-on bug."""
    params, buffers, data, loss_fn, state = setup
    real, _ = make_step(loss_fn, method="vmap")(state, data, MASK, buffers)
    mine, _ = make_step(loss_fn, noise_scale=1.0)(state, data, MASK, buffers)
    assert all(torch.equal(real.params[k], mine.params[k]) for k in params)
    ghosted, _ = make_step(loss_fn, method="ghost")(state, data, MASK, buffers)  # the default for this MLP
    mine, _ = make_step(loss_fn, noise_scale=1.0, key_method="ghost")(state, data, MASK, buffers)  # the noise key binds the method
    assert all(torch.allclose(ghosted.params[k], mine.params[k], rtol=1e-5, atol=1e-7) for k in params)
    assert real.ledger == mine.ledger


# ---------------------------------------------------------------- per-sample independence


def test_independence_passes_vmapdp_per_sample_grads(setup):
    params, buffers, data, loss_fn, _ = setup
    report = check_per_sample_independence(loss_fn, params, buffers, batch=data)
    assert report.passed and report.max_leak == 0.0 and report.min_self_change > 1e-3
    assert "passed" in str(report)


def batchnorm_grads(params, batch):
    """Mutant: 'per-sample' gradients as the Jacobian of per-example losses of a batched forward
    pass through train-mode BatchNorm; each loss depends on the whole batch's statistics."""
    x, y = batch

    def losses(p):
        h = x @ p["0.weight"].T + p["0.bias"]
        h = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5)
        return F.cross_entropy(torch.tanh(h) @ p["2.weight"].T + p["2.bias"], y, reduction="none")

    return torch.func.jacrev(losses)(params)


def test_independence_catches_batch_mixing(setup):
    params, _, data, _, _ = setup
    with pytest.raises(PrivacyCheckError, match=r"perturbing sample \d+ changed the gradient of sample \d+ by .*BatchNorm") as err:
        check_per_sample_independence(None, params, batch=data, grads_fn=lambda p, b: batchnorm_grads(p, b))
    assert err.value.report.max_leak > 1e-3


def dropout_problem():
    params, _, data, _ = problem()

    def loss_fn(p, sample):
        x, y = sample
        h = torch.tanh(x @ p["0.weight"].T + p["0.bias"])
        h = F.dropout(h, p=0.5, training=True)
        return F.cross_entropy((h @ p["2.weight"].T + p["2.bias"])[None], y[None])

    return params, data, loss_fn


def test_independence_own_dropout_masks_pass():
    params, data, loss_fn = dropout_problem()
    report = check_per_sample_independence(loss_fn, params, batch=data, randomness="different")
    assert report.passed and report.loss_is_random and report.copies_max_diff > 0.1
    assert report.max_leak == 0.0  # dropout draws are fixed by the seed: no false leak


def test_independence_catches_shared_dropout_masks():
    params, data, loss_fn = dropout_problem()
    with pytest.raises(PrivacyCheckError, match=r"identical copies .* identical gradients .*randomness='same'"):
        check_per_sample_independence(loss_fn, params, batch=data, randomness="same")


def test_independence_dropout_part_is_vacuous_for_a_deterministic_loss(setup):
    params, buffers, data, loss_fn, _ = setup
    report = check_per_sample_independence(loss_fn, params, buffers, batch=data, randomness="same")
    assert report.passed and report.loss_is_random is False


# ---------------------------------------------------------------- sensitivity


def test_sensitivity_passes_vmapdp_step(setup, vmapdp_step):
    params, buffers, data, _, state = setup
    report = check_sensitivity(vmapdp_step, state, data, MASK, buffers, **HYPER)
    assert report.passed and report.padding_inert
    assert 0.99 < report.ratio <= 1.0 + 1e-3  # the huge sample was clipped to exactly C


@pytest.mark.parametrize(
    "bug, match, min_ratio",
    [
        (dict(clip=False), r"moved the parameter update by .* x the bound .*clipping missing", 10.0),
        (dict(divisor="realised"), r"FAILED in \d+ of 18 neighbouring pairs.* x the bound .*realised batch size", EBS * 0.99),
        (dict(use_mask=False), r"padded rows \(mask False\) changed the update", None),
    ],
    ids=["no-clipping", "divisor-realised-batch-size", "mask-ignored"],
)
def test_sensitivity_catches(setup, bug, match, min_ratio):
    params, buffers, data, loss_fn, state = setup
    with pytest.raises(PrivacyCheckError, match=match) as err:
        check_sensitivity(make_step(loss_fn, **bug), state, data, MASK, buffers, **HYPER)
    if min_ratio is not None:
        assert err.value.report.ratio > min_ratio
    else:
        assert not err.value.report.padding_inert


def test_sensitivity_rejects_a_mask_without_a_padded_row(setup):
    params, buffers, data, loss_fn, state = setup
    with pytest.raises(ValueError, match=r"at least one of each"):
        check_sensitivity(make_step(loss_fn), state, data, torch.ones(16, dtype=torch.bool), buffers, **HYPER)


# ---------------------------------------------------------------- noise calibration


def test_noise_calibration_passes_vmapdp_step(setup, vmapdp_step):
    params, buffers, data, _, state = setup
    report = check_noise_calibration(vmapdp_step, state, data, MASK, buffers, alpha=ALPHA, **HYPER)
    assert report.passed and abs(report.std_ratio - 1) < 0.03 and report.samples >= 20_000
    assert report.noise_multiplier == 1.0  # read from the ledger the step wrote
    assert abs(report.next_step_correlation) < 0.05  # the next step's noise was compared (and is independent)


def test_noise_calibration_catches_noise_off_by_sqrt2(setup):
    params, buffers, data, loss_fn, state = setup
    with pytest.raises(PrivacyCheckError, match=r"FAILED \(variance, Kolmogorov-Smirnov[^)]*\).*ratio 0\.7.*too small by about sqrt\(2\)") as err:
        check_noise_calibration(make_step(loss_fn, noise_scale=1 / math.sqrt(2)), state, data, MASK, buffers, alpha=ALPHA, **HYPER)
    assert err.value.report.std_ratio == pytest.approx(1 / math.sqrt(2), rel=0.03)


def test_noise_calibration_catches_a_10_percent_error(setup):
    params, buffers, data, loss_fn, state = setup
    report = check_noise_calibration(
        make_step(loss_fn, noise_scale=1.1), state, data, MASK, buffers, alpha=ALPHA, raise_on_failure=False, **HYPER
    )
    assert not report.passed and report.var_pvalue < ALPHA / 4


def test_noise_calibration_catches_the_same_noise_at_consecutive_steps(setup):
    """Found by review: no self-check saw a noise key that ignores the step (the difference of two
    releases then cancels the noise); the next step's noise is compared with this step's."""
    params, buffers, data, loss_fn, state = setup
    with pytest.raises(PrivacyCheckError, match=r"FAILED \(independence across steps\).*correlation with the next step's noise 1.*the same noise at consecutive steps") as err:
        check_noise_calibration(make_step(loss_fn, key_ignores_step=True), state, data, MASK, buffers, alpha=ALPHA, **HYPER)
    assert err.value.report.next_step_correlation > 0.99
    # ... and in one small tensor alone (found by review: 3 of 579 coordinates passed the pooled test)
    with pytest.raises(PrivacyCheckError, match=r"FAILED \(independence across steps of '2.bias'\)"):
        check_noise_calibration(make_step(loss_fn, stale=("2.bias",)), state, data, MASK, buffers, alpha=ALPHA, **HYPER)


def test_noise_calibration_catches_a_small_tensor_released_without_noise(setup):
    """Found by review: the pooled tests passed a step that left a bias (here 3 of 579 coordinates)
    without noise, on every seed; each tensor's own variance is tested too."""
    params, buffers, data, loss_fn, state = setup
    with pytest.raises(PrivacyCheckError, match=r"FAILED \(variance of '2.bias'\).*std ratio 0\.0000.*a tensor noised with another std"):
        check_noise_calibration(make_step(loss_fn, unnoised=("2.bias",)), state, data, MASK, buffers, alpha=ALPHA, **HYPER)


# ---------------------------------------------------------------- sampler


def test_sampler_passes_poisson_sampler():
    sampler = PoissonSampler(2000, 0.02, generator=torch.Generator().manual_seed(0))
    report = check_sampler(sampler, steps=1000, alpha=ALPHA)
    assert report.passed and report.mean_batch_size == pytest.approx(40, rel=0.02)


class ShuffledBatches:
    """Mutant: the usual DataLoader(shuffle=True) -- fixed-size batches from a shuffled epoch."""

    def __init__(self, num_samples, batch, seed=0):
        self.num_samples, self.batch = num_samples, batch
        self.sample_rate = batch / num_samples
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self):
        perm = torch.randperm(self.num_samples, generator=self.gen)
        for i in range(0, self.num_samples - self.batch + 1, self.batch):
            yield perm[i : i + self.batch], torch.ones(self.batch, dtype=torch.bool)


class TruncatingPoisson(PoissonSampler):
    """Mutant: Poisson sampling that drops what overflows the capacity."""

    def sample(self):
        idx, mask = super().sample()
        return idx[: self.capacity], mask[: self.capacity]


def test_sampler_catches_shuffled_fixed_size_batches():
    with pytest.raises(PrivacyCheckError, match=r"batch-size variance.*inclusion-count dispersion.*fixed-size batches") as err:
        check_sampler(ShuffledBatches(2000, 40), steps=1000, alpha=ALPHA)
    assert err.value.report.var_batch_size == 0.0 and err.value.report.overlap_mean == pytest.approx(0.0, abs=0.05)


def test_sampler_and_independence_checks_refuse_what_they_do_not_test():
    """Found by review: check_sampler failed the library's own cyclic and fixed-size samplers, telling
    the user to use a PoissonSampler (they are accounted as what they are); a negative or NaN rtol
    raised a bare TypeError."""
    from vmapdp.data import CyclicPoissonSampler, FixedSizeSampler

    for sampler in (CyclicPoissonSampler(100, 0.2, cycle=2, key=b"k" * 16), FixedSizeSampler(100, 10, key=b"k" * 16)):
        with pytest.raises(ValueError, match=rf"check_sampler tests Poisson sampling .* a {type(sampler).__name__} draws by another scheme"):
            check_sampler(sampler, steps=10, alpha=ALPHA)
    params, data = {"w": torch.zeros(3)}, torch.randn(4, 3)
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match=r"check_per_sample_independence\(.*\): rtol=.* must be"):
            check_per_sample_independence(lambda p, s: (p["w"] * s).sum(), params, batch=data, rtol=bad)


def test_sampler_catches_truncation_at_capacity():
    sampler = TruncatingPoisson(2000, 0.02, generator=torch.Generator().manual_seed(0), capacity=40)
    with pytest.raises(PrivacyCheckError, match=r"batch-size mean.*batch-size variance"):
        check_sampler(sampler, steps=1000, alpha=ALPHA)


def test_sampler_catches_a_rate_other_than_the_reported_one():
    sampler = PoissonSampler(2000, 0.025, generator=torch.Generator().manual_seed(0))  # draws at 0.025
    with pytest.raises(PrivacyCheckError, match=r"batch-size mean.*other than the q=0.02 reported"):
        check_sampler(sampler, steps=1000, alpha=ALPHA, sample_rate=0.02)


class FavouringPoisson(PoissonSampler):
    """Mutant: Poisson sampling that draws example 0 at twice the rate."""

    def sample(self):
        idx, mask = super().sample()
        if 0 not in idx[mask].tolist() and torch.rand((), generator=self.generator) < self.sample_rate:
            free = int((~mask).nonzero()[0]) if bool((~mask).any()) else None
            if free is not None:
                idx, mask = idx.clone(), mask.clone()
                idx[free], mask[free] = 0, True
        return idx, mask


def test_sampler_catches_one_example_drawn_at_twice_the_rate():
    """Found by review: the dispersion test sums over all examples and missed one favoured example
    (1 of 1000 at rate 0.2 for 0.1); the most and least drawn examples are tested too."""
    sampler = FavouringPoisson(1000, 0.1, generator=torch.Generator().manual_seed(0), capacity=200)
    with pytest.raises(PrivacyCheckError, match=r"most / least drawn example.*drawn at another rate"):
        check_sampler(sampler, steps=1000, alpha=ALPHA)


def test_binomial_tails_match_scipy():
    from vmapdp.audit.stats import binomial_tail

    for k, s, q in ((150, 1000, 0.1), (200, 1000, 0.1), (60, 1000, 0.1), (3, 50, 0.02), (0, 1000, 0.01)):
        if k > s * q:
            assert binomial_tail(k, s, q, upper=True) == pytest.approx(stats.binom.sf(k - 1, s, q), rel=1e-9)
        if k < s * q:
            assert binomial_tail(k, s, q, upper=False) == pytest.approx(stats.binom.cdf(k, s, q), rel=1e-9)


# ---------------------------------------------------------------- ledger


def test_ledger_passes_vmapdp_step(setup, vmapdp_step):
    params, buffers, data, _, state = setup
    after = state
    for _ in range(3):
        after, _ = vmapdp_step(after, data, MASK, buffers)
    report = check_ledger(state, after, steps=3, noise_multiplier=1.0, sample_rate=Q)
    assert report.passed and report.epsilon_recorded == report.epsilon_expected


def test_ledger_catches_half_the_real_sample_rate(setup):
    """Mutant: the step is told q/2 while the sampler draws at q (a user passing the wrong rate)."""
    params, buffers, data, loss_fn, state = setup
    step = vmapdp.make_train_step(loss_fn, optim.sgd(LR), l2_clip_norm=CLIP, noise_multiplier=1.0, expected_batch_size=EBS, sample_rate=Q / 2, compile=False)
    after = state
    for _ in range(3):
        after, _ = step(after, data, MASK, buffers)
    with pytest.raises(PrivacyCheckError, match=r"sample_rate=\[0.05\] but the batches were drawn at 0.1") as err:
        check_ledger(state, after, steps=3, noise_multiplier=1.0, sample_rate=Q)
    assert err.value.report.epsilon_recorded < err.value.report.epsilon_expected


# ---------------------------------------------------------------- white-box audit


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_audit_passes_vmapdp_step(method):
    report = audit_epsilon_lower_bound(functools.partial(vmapdp.make_train_step, method=method), trials=30_000, beta=BETA)
    assert report.passed and 1.5 < report.epsilon_lower_bound < report.claimed_epsilon


@pytest.mark.parametrize(
    "bug, trials, min_eps",
    [(dict(noise_scale=1 / math.sqrt(2)), 30_000, 2.4), (dict(clip=False), 5_000, 6.0)],
    ids=["noise-off-by-sqrt2", "no-clipping"],
)
def test_audit_catches(bug, trials, min_eps):
    with pytest.raises(PrivacyCheckError, match=r"epsilon lower bound .* vs claimed 2.319 at delta=0.01") as err:
        audit_epsilon_lower_bound(functools.partial(mutant_train_step, **bug), trials=trials, beta=BETA)
    assert err.value.report.epsilon_lower_bound > min_eps
