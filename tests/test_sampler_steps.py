"""make_train_step(sampler=): every step records exactly the event of the batch scheme that ran."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vmapdp
from vmapdp import accounting, optim
from vmapdp.accounting import (
    BallsInBinsGaussianEvent,
    CyclicPoissonGaussianEvent,
    EpochGaussianEvent,
    FixedSizeGaussianEvent,
    Ledger,
    PoissonGaussianEvent,
    TruncatedPoissonGaussianEvent,
)
from vmapdp.data import BallsInBinsSampler, CyclicPoissonSampler, FixedSizeSampler, PoissonSampler, ShuffledSampler, TruncatedPoissonSampler, gather
from vmapdp.train import PrivacyBudgetExceeded

N, NOISE = 24, 1.3


def problem():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    apply, params, buffers = vmapdp.functionalize(model)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(N, 3, generator=g), torch.randint(0, 2, (N,), generator=g))

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    return params, buffers, data, loss_fn


def samplers():
    g = lambda: torch.Generator().manual_seed(2)  # noqa: E731
    return {
        "poisson": PoissonSampler(N, 0.25, steps=5, generator=g()),
        "fixed": FixedSizeSampler(N, 6, steps=5, generator=g()),
        "shuffle": ShuffledSampler(N, 8, epochs=2, generator=g()),
        "balls_in_bins": BallsInBinsSampler(N, 4, epochs=2, generator=g()),
        "truncated": TruncatedPoissonSampler(N, 0.25, steps=5, generator=g(), max_batch_size=24),
        "cyclic": CyclicPoissonSampler(N, 0.25, 3, steps=7, generator=g()),
    }


def expected_ledger(name, steps):
    """The ledger each scheme implies, written from the scheme's definition (not from the sampler)."""
    if name == "poisson":
        return Ledger((PoissonGaussianEvent(noise_multiplier=NOISE, sample_rate=0.25, count=steps),))
    if name == "fixed":
        return Ledger((FixedSizeGaussianEvent(noise_multiplier=NOISE, batch_size=6, num_samples=N, count=steps),))
    if name == "truncated":
        return Ledger((TruncatedPoissonGaussianEvent(noise_multiplier=NOISE, sample_rate=0.25, max_batch_size=24, num_samples=N, count=steps),))
    if name == "cyclic":  # 3 groups of 8: any example in at most ceil(7 / 3) = 3 Poisson steps
        return Ledger((CyclicPoissonGaussianEvent(noise_multiplier=NOISE, sample_rate=0.25, cycle=3, count=steps),))
    if name == "balls_in_bins":  # 4 bins; two epochs opened
        return Ledger((BallsInBinsGaussianEvent(noise_multiplier=NOISE, steps_per_epoch=4, count=steps, epochs=2),))
    spe = 3  # ceil(24 / 8) steps; two epochs opened
    return Ledger((EpochGaussianEvent(noise_multiplier=NOISE, steps_per_epoch=spe, scheme=name, count=steps, epochs=2),))


@pytest.mark.parametrize("name", ["poisson", "fixed", "shuffle", "balls_in_bins", "truncated", "cyclic"])
def test_the_ledger_records_exactly_the_sampler_and_mechanism_that_ran(name):
    params, buffers, data, loss_fn = problem()
    sampler = samplers()[name]
    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=sampler, physical_batch_size=sampler.capacity, compile=False)
    state = before = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    for indices, mask in sampler:
        state, _ = step(state, gather(data, indices), mask, buffers)
    assert state.ledger == expected_ledger(name, sampler.steps)
    report = vmapdp.testing.check_ledger(before, state, steps=sampler.steps, noise_multiplier=NOISE, sampler=sampler, raise_on_failure=False)
    assert report.passed, report.message


def test_an_epoch_is_charged_on_the_step_that_opens_it():
    """Step by step: the epoch counter moves only on the first step of each epoch."""
    params, buffers, data, loss_fn = problem()
    sampler = ShuffledSampler(N, 8, epochs=2, generator=torch.Generator().manual_seed(3))
    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=sampler, compile=False)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    epochs = []
    for indices, mask in sampler:
        state, _ = step(state, gather(data, indices), mask, buffers)
        epochs.append(state.ledger.events[-1].epochs)
    assert epochs == [1, 1, 1, 2, 2, 2]


def test_sample_rate_alone_keeps_meaning_poisson_and_a_poisson_sampler_binds_the_same_noise():
    params, buffers, data, loss_fn = problem()
    sampler = PoissonSampler(N, 0.25, steps=1, generator=torch.Generator().manual_seed(4))
    indices, mask = sampler.sample()
    kw = dict(l2_clip_norm=1.0, noise_multiplier=NOISE, expected_batch_size=6.0, compile=False, method="vmap")
    a = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), sample_rate=0.25, **kw)
    b = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), sampler=sampler, **kw)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    sa, _ = a(state, gather(data, indices), mask, buffers)
    sb, _ = b(state, gather(data, indices), mask, buffers)
    assert sa.ledger == sb.ledger == Ledger((PoissonGaussianEvent(noise_multiplier=NOISE, sample_rate=0.25),))
    for k in sa.params:
        assert torch.equal(sa.params[k], sb.params[k])


def test_ambiguous_or_missing_schemes_are_refused():
    _, _, _, loss_fn = problem()
    kw = dict(l2_clip_norm=1.0, noise_multiplier=NOISE, expected_batch_size=6.0, compile=False)
    fixed = FixedSizeSampler(N, 6, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"make_train_step\(loss_fn, optimizer\): sample_rate=0.5 disagrees with the sampler's rate 0.25 \(FixedSizeSampler\)"):
        vmapdp.make_train_step(loss_fn, optim.sgd(0.1), sample_rate=0.5, sampler=fixed, **kw)
    with pytest.raises(ValueError, match=r"got neither sample_rate= nor sampler="):
        vmapdp.make_train_step(loss_fn, optim.sgd(0.1), **kw)
    with pytest.raises(TypeError, match=r"sampler must be a sampler from vmapdp.data .*got list"):
        vmapdp.make_train_step(loss_fn, optim.sgd(0.1), sampler=[1, 2], **kw)
    # agreeing rates are accepted, and the sampler's events are what is recorded
    vmapdp.make_train_step(loss_fn, optim.sgd(0.1), sample_rate=0.25, sampler=fixed, **kw)


def test_a_batch_no_sampling_of_the_charged_size_could_draw_is_refused():
    """Found by review: with a sampler given for its events only the step took the whole dataset
    every step and charged it at the sampler's rate. Without a draw to compare with, the real rows
    must be at most E + 10 sqrt(E) + 20 for the sampler's E (false alarm < 1e-17), and a size the
    sampler can draw (found by review: 50 rows were charged as a FixedSizeSampler's 8, 50 as a
    TruncatedPoissonSampler's capped 36, and a PoissonSampler(40, 0.2)'s whole dataset passed the
    bound): a fixed-size sampler's sizes, a cap, and a binomial draw's exact tail at 1e-17."""
    from scipy import stats

    params, buffers, _, loss_fn = problem()
    g = torch.Generator().manual_seed(3)
    big = (torch.randn(200, 3, generator=g), torch.randint(0, 2, (200,), generator=g))
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)

    def step(sampler, rows):  # (sample_rate= alone: not checked, its dataset size is unknown)
        fn = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=sampler, compile=False, method="vmap")
        new, metrics = fn(state, _first_rows(big, rows), torch.ones(rows, dtype=torch.bool), buffers)
        assert int(metrics["batch_size"]) == rows and new.step == 1

    poisson = PoissonSampler(200, 0.05, key=b"events-only")  # E = 10
    with pytest.raises(ValueError, match=r"the batch has 200 real rows but the step charges PoissonSampler of expected batch size 10 \(more than 61 rows"):
        step(poisson, 200)
    # the binomial tail: the first size drawn with probability below 1e-17 is refused, the one before steps
    first = next(k for k in range(11, 62) if stats.binom.sf(k - 1, 200, 0.05) < 1e-17)
    with pytest.raises(ValueError, match=rf"\({first} or more of its 200 examples are drawn with probability \d"):
        step(poisson, first)
    step(poisson, first - 1)
    with pytest.raises(ValueError, match=r"the batch has 40 real rows .*\(40 or more of its 40 examples are drawn with probability 1.1e-28\)"):
        step(PoissonSampler(40, 0.2, key=b"events-only"), 40)  # the whole dataset, 0.2 ** 40
    with pytest.raises(ValueError, match=r"the batch has 11 real rows but the step charges FixedSizeSampler of expected batch size 10 \(its every draw has 10 real rows\)"):
        step(FixedSizeSampler(200, 10, key=b"events-only"), 11)
    step(FixedSizeSampler(200, 10, key=b"events-only"), 10)
    with pytest.raises(ValueError, match=r"\(it draws at most max_batch_size=36 rows\)"):
        step(TruncatedPoissonSampler(1000, 0.008, max_batch_size=36, key=b"events-only"), 37)
    step(TruncatedPoissonSampler(1000, 0.008, max_batch_size=36, key=b"events-only"), 36)


def _first_rows(data, n):
    return tuple(x[:n] for x in data)


def test_a_budget_stops_a_fixed_size_run_where_pld_says():
    """Fixed-size batches have a PLD bound (replace-one): the default ("pld") budget is enforced
    by it, and the run stops at exactly the first step whose PLD epsilon is past the budget,
    later than RDP's bound would stop it."""
    params, buffers, data, loss_fn = problem()
    sampler = FixedSizeSampler(N, 6, steps=40, generator=torch.Generator().manual_seed(5))
    budget, delta = 10.0, 1e-5

    def eps(k, accountant="pld"):
        return accounting.epsilon(Ledger((FixedSizeGaussianEvent(noise_multiplier=NOISE, batch_size=6, num_samples=N, count=k),)), delta=delta, accountant=accountant)

    lo, hi = 1, 40  # epsilon grows with the count: the last count within the budget, by bisection
    assert eps(lo) <= budget < eps(hi)  # the run crosses the budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps(mid) <= budget else (lo, mid)
    last_ok = lo
    assert eps(last_ok, "rdp") > budget  # RDP alone would have stopped it earlier
    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=sampler, budget=(budget, delta), compile=False)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    with pytest.raises(PrivacyBudgetExceeded, match=rf"step {last_ok + 1} would spend epsilon="):
        for indices, mask in sampler:
            state, _ = step(state, gather(data, indices), mask, buffers)
    assert state.step == last_ok and state.ledger.steps == last_ok


def test_a_budget_stops_a_shuffled_run_at_the_epoch_that_would_cross_it():
    """Epochs are charged whole: one epoch of sigma=1.3 fits a budget of 3 (mu = 2/1.3), two do not."""
    params, buffers, data, loss_fn = problem()
    sampler = ShuffledSampler(N, 8, epochs=2, generator=torch.Generator().manual_seed(6))
    delta = 1e-5
    one = accounting.epsilon(Ledger((EpochGaussianEvent(noise_multiplier=NOISE, steps_per_epoch=3, scheme="shuffle", count=3, epochs=1),)), delta=delta)
    two = accounting.epsilon(Ledger((EpochGaussianEvent(noise_multiplier=NOISE, steps_per_epoch=3, scheme="shuffle", count=4, epochs=2),)), delta=delta)
    budget = (one + two) / 2
    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=sampler, budget=(budget, delta), compile=False)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    with pytest.raises(PrivacyBudgetExceeded, match=r"step 4 would spend"):
        for indices, mask in sampler:
            state, _ = step(state, gather(data, indices), mask, buffers)
    assert state.step == 3


def test_within_budget_decides_replace_one_ledgers_the_pld_accountant_cannot_bound():
    """Poisson steps followed by fixed-size steps: 'pld' refuses the mixed replace-one ledger, so
    the budget is kept by RDP's bound: within exactly when RDP's epsilon is."""
    delta = 1e-5
    for count in (1, 3, 10, 30):
        ledger = Ledger((PoissonGaussianEvent(noise_multiplier=2.0, sample_rate=0.1, count=10), FixedSizeGaussianEvent(noise_multiplier=2.0, batch_size=10, num_samples=100, count=count)))
        rdp = accounting.epsilon(ledger, delta=delta, accountant="rdp")
        for budget in (rdp * 0.99, rdp * 1.01):
            assert accounting.within_budget(ledger, epsilon=budget, delta=delta) == (rdp <= budget)


def test_a_cyclic_run_divides_by_the_group_expectation_and_costs_ceil_steps_over_cycle():
    params, buffers, data, loss_fn = problem()
    sampler = CyclicPoissonSampler(N, 0.25, 3, steps=7, generator=torch.Generator().manual_seed(7))
    assert sampler.expected_batch_size == 0.25 * N / 3  # 2.0: the public divisor, one group's expectation
    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=sampler, compile=False)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    for indices, mask in sampler:
        state, _ = step(state, gather(data, indices), mask, buffers)
    for accountant in ("pld", "rdp"):
        want = accounting.epsilon(noise_multiplier=NOISE, sample_rate=0.25, steps=3, delta=1e-5, accountant=accountant)
        assert accounting.epsilon(state.ledger, delta=1e-5, accountant=accountant) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", ["shuffle", "balls_in_bins", "cyclic"])
def test_a_drawn_batch_that_never_became_a_step_stops_the_run(name):
    """Found by review (hunt2/f3_epoch_skip.py, f5_cyclic_skip.py): a step that raises after its
    batch was drawn, caught by the loop, left the sampler a position ahead; the ledger, whose
    events assume consecutive positions, then charged 20 touched shuffled epochs as 11 and a
    cyclic group that took part in 10 steps as 3. Every later step is refused now, before
    anything is released, and the ledger holds only the released steps."""
    params, buffers, data, loss_fn = problem()
    sampler = samplers()[name]
    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=sampler, physical_batch_size=sampler.capacity, compile=False)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    indices, mask = sampler.sample()
    state, _ = step(state, gather(data, indices), mask, buffers)
    sampler.sample()  # a batch whose step raised (the loop caught it): nothing released
    indices, mask = sampler.sample()
    with pytest.raises(ValueError, match=r"the state is at step 1 but its sampler has drawn 3 batches: 1 drawn batch\(es\) never became a step.*Nothing was released"):
        step(state, gather(data, indices), mask, buffers)
    assert state.step == 1 and state.ledger.events[-1].count == 1


@pytest.mark.parametrize("name", ["poisson", "fixed", "shuffle", "cyclic"])
def test_a_mask_that_marks_padding_real_or_repeats_rows_is_refused(name):
    """Found by review: in one process the step took any mask beside its sampler's draw. With
    torch.ones_like(mask) the padding rows (copies of row 0) were stepped as real: example 0 went in
    up to 21 times, each up to C, in a sum charged as C; a batch of the draw's rows twice passed too.
    The mask's real rows must be the draw's (the sampler's own mask still steps)."""
    params, buffers, data, loss_fn = problem()
    sampler = samplers()[name]
    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=sampler, physical_batch_size=sampler.capacity, compile=False)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    indices, mask = sampler.sample()
    # (the Poisson draws are padded to their capacity; fixed-size and shuffled batches fill theirs)
    assert mask.all() == (name in ("fixed", "shuffle"))
    if not mask.all():
        with pytest.raises(ValueError, match=rf"the mask marks {mask.numel()} real rows but the step's sampler drew {int(mask.sum())}: padding rows marked real.*Nothing was released"):
            step(state, gather(data, indices), torch.ones_like(mask), buffers)
    twice = torch.cat([indices, indices])
    with pytest.raises(ValueError, match=r"real rows but the step's sampler drew.*rows repeated"):
        step(state, gather(data, twice), torch.cat([mask, mask]), buffers)
    assert state.ledger.events == ()
    state, metrics = step(state, gather(data, indices), mask, buffers)  # the draw itself steps
    assert state.step == 1 and int(metrics["batch_size"]) == int(mask.sum())


@pytest.mark.parametrize("name", ["fixed", "poisson"])
def test_a_memoryless_keyed_sampler_that_drew_a_spare_batch_is_refused(name):
    """A spare batch does not change a fixed-size or Poisson step's event, but found by review: a
    step that raised after its batch was drawn, a later step released, then a resume from the
    checkpoint before them repeats that step with the spare batch under the same noise key (1.94 C
    between the two releases). Exactly one batch per step, as for the positional samplers."""
    params, buffers, data, loss_fn = problem()
    sampler = samplers()[name] if name == "fixed" else PoissonSampler(N, 0.25, steps=3, key=b"spare", capacity=12)
    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=sampler, physical_batch_size=sampler.capacity, compile=False)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    sampler.sample()  # a spare batch
    indices, mask = sampler.sample()
    with pytest.raises(ValueError, match=r"the state is at step 0 but its sampler has drawn 2 batches.*Nothing was released"):
        step(state, gather(data, indices), mask, buffers)
    assert state.ledger.events == ()


@pytest.mark.parametrize("source", ["key", "generator"])
@pytest.mark.parametrize("kind", ["poisson", "truncated", "fixed"])
def test_a_run_resumed_with_another_or_a_restarted_keyed_sampler_is_refused(tmp_path, kind, source):
    """Found by review: a checkpoint saved without its (keyed Poisson) sampler resumed with a
    fresh one, which drew another batch for the repeated step under the same noise key (the two
    releases differed by the noise-free difference of two clipped sums). A keyed sampler's
    ``stream_id`` is recorded for every scheme now (not only positional ones), and a keyed Poisson
    sampler must have drawn at least the state's batches: another key is refused, so is the same
    key restarted; the same key fast-forwarded to the state draws the run's own batches and steps.
    Generator-driven samplers alike (a fresh generator of the run's seed restarts the stream)."""
    params, buffers, data, loss_fn = problem()

    def sampler(key):
        if source == "generator":  # (the generator's seed in the key's place)
            g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:4], "little"))
            key, generator = None, g
        else:
            generator = None
        return _sampler(key, generator)

    def _sampler(key, generator):
        if kind == "fixed":
            return FixedSizeSampler(N, 6, steps=4, generator=generator, key=key)
        if kind == "truncated":
            return TruncatedPoissonSampler(N, 0.25, steps=4, generator=generator, key=key, max_batch_size=12)
        return PoissonSampler(N, 0.25, steps=4, generator=generator, key=key, capacity=12)

    def step_for(s):
        return vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=s, physical_batch_size=s.capacity, compile=False)

    first = sampler(b"run-key")
    step = step_for(first)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    for _ in range(2):
        indices, mask = first.sample()
        state, _ = step(state, gather(data, indices), mask, buffers)
    assert state.sampler_id == first.stream_id != sampler(b"other").stream_id
    vmapdp.save_state(tmp_path / "c.pt", state)  # (without its sampler)
    loaded = vmapdp.load_state(tmp_path / "c.pt")
    other = sampler(b"other")
    indices, mask = other.sample()
    with pytest.raises(ValueError, match=r"is not the sampler the state's 2 steps were drawn by.*Nothing was released"):
        step_for(other)(loaded, gather(data, indices), mask, buffers)
    restarted = sampler(b"run-key")
    indices, mask = restarted.sample()
    with pytest.raises(ValueError, match=r"the state is at step 2 but its sampler has drawn only 1 batches.*Nothing was released"):
        step_for(restarted)(loaded, gather(data, indices), mask, buffers)
    forwarded = sampler(b"run-key")
    for _ in range(3):
        indices, mask = forwarded.sample()
    assert step_for(forwarded)(loaded, gather(data, indices), mask, buffers)[0].step == 3


def test_a_state_stepped_with_a_secure_memoryless_sampler_loads_only_as_saved_after_its_last_step(tmp_path):
    """Found by review: a secure Poisson sampler had no stream_id, so a checkpoint saved without it
    loaded and resumed with a fresh one, which drew another batch for a repeated step under the
    same keyed noise (1.87 C between the two releases). Its id now says "secure" (any secure
    memoryless sampler continues it: fresh draws from the OS), and load_state wants
    saved_after_last_step=True for such a state whether or not the sampler was saved with it; a
    keyed sampler cannot continue it."""
    params, buffers, data, loss_fn = problem()

    def step_for(s):
        return vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=s, physical_batch_size=12, compile=False)

    first = PoissonSampler(N, 0.25, steps=4, capacity=12, secure=True)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    indices, mask = first.sample()
    state, _ = step_for(first)(state, gather(data, indices), mask, buffers)
    assert state.sampler_id == vmapdp.data.SECURE_SAMPLER_ID == FixedSizeSampler(N, 6, secure=True).stream_id
    vmapdp.save_state(tmp_path / "bare.pt", state)
    with pytest.raises(ValueError, match=r"saved with a secure sampler .*saved_after_last_step=True.*Nothing was loaded"):
        vmapdp.load_state(tmp_path / "bare.pt")
    loaded = vmapdp.load_state(tmp_path / "bare.pt", saved_after_last_step=True)
    fresh = PoissonSampler(N, 0.25, steps=4, capacity=12, secure=True)
    indices, mask = fresh.sample()
    assert step_for(fresh)(loaded, gather(data, indices), mask, buffers)[0].step == 2
    keyed = PoissonSampler(N, 0.25, steps=4, capacity=12, key=b"k")
    indices, mask = keyed.sample()
    with pytest.raises(ValueError, match=r"is not the sampler the state's 1 steps were drawn by"):
        step_for(keyed)(loaded, gather(data, indices), mask, buffers)


def test_a_state_read_with_ignore_sampler_is_for_evaluation_only(tmp_path):
    """Found by review: load_state(..., ignore_sampler=True) skipped the secure sampler's
    saved_after_last_step check and could restore a sampler, so a run resumed through it repeated
    a released step with another batch under the same noise. It restores no sampler now, and a
    step given a sampler refuses the state it returns."""
    params, buffers, data, loss_fn = problem()
    first = PoissonSampler(N, 0.25, steps=4, capacity=12, secure=True)
    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=first, physical_batch_size=12, compile=False)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    indices, mask = first.sample()
    state, _ = step(state, gather(data, indices), mask, buffers)
    vmapdp.save_state(tmp_path / "c.pt", state, sampler=first)
    fresh = PoissonSampler(N, 0.25, steps=4, capacity=12, secure=True)
    with pytest.raises(ValueError, match=r"ignore_sampler=True reads the checkpoint for evaluation only and restores no sampler.*Nothing was loaded"):
        vmapdp.load_state(tmp_path / "c.pt", sampler=fresh, ignore_sampler=True)
    evaluation = vmapdp.load_state(tmp_path / "c.pt", ignore_sampler=True)
    assert all(torch.equal(evaluation.params[k], state.params[k]) for k in params)
    indices, mask = fresh.sample()
    with pytest.raises(ValueError, match=r"read with load_state\(\.\.\., ignore_sampler=True\), for evaluation only.*Nothing was released"):
        vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sampler=fresh, physical_batch_size=12, compile=False)(
            evaluation, gather(data, indices), mask, buffers)
    # (another review: a step made with sample_rate= alone, no sampler, took it too)
    with pytest.raises(ValueError, match=r"read with load_state\(\.\.\., ignore_sampler=True\), for evaluation only.*Nothing was released"):
        vmapdp.make_train_step(loss_fn, optim.sgd(0.1), l2_clip_norm=1.0, noise_multiplier=NOISE, sample_rate=0.25, expected_batch_size=6.0, compile=False)(
            evaluation, gather(data, indices), mask, buffers)


def test_a_state_a_sampler_stepped_is_refused_by_a_step_given_no_sampler():
    """Found by review (rev4/a06b): a run sampled at rate 0.25 and continued by a step told
    sample_rate=0.01 alone was charged at 0.01 (epsilon 2.93 where its steps cost 4.99 in that
    review's run); the state records its sampler's id, and a step with no sampler to check now
    refuses it. A state that no sampler stepped goes on with sample_rate= alone."""
    params, buffers, data, loss_fn = problem()
    kw = dict(l2_clip_norm=1.0, noise_multiplier=NOISE, expected_batch_size=6.0, compile=False, method="vmap")
    sampler = PoissonSampler(N, 0.25, steps=2, key=b"run-key")
    by_sampler = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), sampler=sampler, **kw)
    by_rate = vmapdp.make_train_step(loss_fn, optim.sgd(0.1), sample_rate=0.01, **kw)
    state = vmapdp.init_train_state(params, optim.sgd(0.1), seed=0)
    indices, mask = sampler.sample()
    state, _ = by_sampler(state, gather(data, indices), mask, buffers)
    assert state.sampler_id
    indices, mask = sampler.sample()
    with pytest.raises(ValueError, match=r"this state's 1 steps were drawn by a sampler .* but this step is given none .*Nothing was released"):
        by_rate(state, gather(data, indices), mask, buffers)
    assert by_sampler(state, gather(data, indices), mask, buffers)[0].step == 2
    fresh = vmapdp.init_train_state(params, optim.sgd(0.1), seed=1)
    assert by_rate(fresh, gather(data, indices), mask, buffers)[0].step == 1
