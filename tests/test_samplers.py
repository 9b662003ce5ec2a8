"""The samplers besides Poisson: static shapes, statistics (fixed seeds; each statistical check
states its false-alarm rate under a correct sampler), bitwise resume, and their events."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from vmapdp import accounting as acc
from vmapdp.data import BallsInBinsSampler, CyclicPoissonSampler, FixedSizeSampler, PoissonSampler, ShuffledSampler, TruncatedPoissonSampler

KEY = b"test-key-not-secret"


def _rows(sampler):
    return [(i.clone(), m.clone()) for i, m in sampler]


def _counts(sampler, n):
    c = torch.zeros(n)
    for i, m in sampler:
        c.index_add_(0, i[m], torch.ones(int(m.sum())))
    return c


def test_fixed_size_batches_are_uniform_subsets_of_the_right_size():
    n, b, steps = 50, 10, 2000
    s = FixedSizeSampler(n, b, steps, key=KEY)
    counts = torch.zeros(n)
    for i, m in s:
        assert i.shape == (b,) and bool(m.all()) and i.unique().numel() == b  # distinct, static shape
        counts[i] += 1
    # inclusion counts: mean steps * b / n, variance v = steps (b/n)(1 - b/n), pairwise covariance
    # -v / (n - 1) (each step picks exactly b), so sum (c - mean)^2 / v * (n - 1) / n ~ chi2(n - 1);
    # tested at alpha = 1e-3 (a correct sampler fails with probability 1e-3; the key is fixed)
    v = steps * (b / n) * (1 - b / n)
    chi2 = float(((counts - steps * b / n) ** 2).sum()) / v * (n - 1) / n
    assert chi2 < stats.chi2.ppf(1 - 1e-3, n - 1)


def test_shuffled_epochs_are_disjoint_and_cover_the_data():
    n, b = 23, 5
    s = ShuffledSampler(n, b, epochs=3, key=KEY)
    assert s.steps_per_epoch == 5 and len(s) == 15
    rows = _rows(s)
    for e in range(3):
        seen = torch.cat([i[m] for i, m in rows[5 * e : 5 * e + 5]])
        assert sorted(seen.tolist()) == list(range(n))  # every example exactly once per epoch
    assert all(i.shape == (b,) for i, _ in rows) and int(rows[4][1].sum()) == 3  # the short last batch is padded
    # the epochs are fresh permutations (a repeat has probability 1/23!)
    assert not torch.equal(rows[0][0], rows[5][0])


def test_shuffle_positions_are_uniform():
    # the step at which example 0 is used, over 600 epochs, is uniform on 4 steps:
    # chi-square test at alpha = 1e-3 (false-alarm rate 1e-3 for a correct sampler)
    n, b, epochs = 8, 2, 600
    s = ShuffledSampler(n, b, epochs=epochs, key=KEY)
    where = torch.zeros(4)
    for t, (i, m) in enumerate(s):
        if bool((i[m] == 0).any()):
            where[t % 4] += 1
    assert int(where.sum()) == epochs
    assert stats.chisquare(where.numpy()).pvalue > 1e-3


def test_balls_in_bins_batch_sizes_and_once_per_epoch():
    n, S, epochs = 400, 8, 100
    s = BallsInBinsSampler(n, S, epochs=epochs, key=KEY)
    sizes = []
    rows = _rows(s)
    for e in range(epochs):
        seen = torch.cat([i[m] for i, m in rows[S * e : S * e + S]])
        assert sorted(seen.tolist()) == list(range(n))
        sizes += [int(m.sum()) for _, m in rows[S * e : S * e + S]]
    sizes = torch.tensor(sizes, dtype=torch.float64)
    # mean batch size n / S = 50 with std sqrt(n (1/S)(1 - 1/S)) per step; over 800 steps the
    # mean is off by more than 4.4 standard errors with probability ~1e-5 (the false-alarm rate)
    se = math.sqrt(n / S * (1 - 1 / S) / len(sizes))  # steps within an epoch are negatively correlated: conservative
    assert abs(float(sizes.mean()) - n / S) < 4.4 * se
    assert float(sizes.var()) == pytest.approx(n / S * (1 - 1 / S), rel=0.25)  # sample variance of 800: ~5% error


def test_truncated_poisson_caps_the_batch_and_is_poisson_below_the_cap():
    n, q = 200, 0.1
    s = TruncatedPoissonSampler(n, q, 3000, key=KEY, max_batch_size=24)
    sizes = []
    for i, m in s:
        assert i.shape == (24,)
        sizes.append(int(m.sum()))
        assert i[m].unique().numel() == sizes[-1]
    sizes = torch.tensor(sizes)
    # sizes are min(Binomial(200, 0.1), 24): P(size == 24) = P(Bin >= 24); a two-sided binomial
    # test on that frequency at alpha = 1e-3 (false-alarm rate 1e-3)
    p_cap = float(stats.binom.sf(23, n, q))
    assert stats.binomtest(int((sizes == 24).sum()), len(sizes), p_cap).pvalue > 1e-3
    assert int(sizes.max()) == 24
    # default cap: truncation costs nothing visible
    assert TruncatedPoissonSampler(n, q, key=KEY).event(1.0).truncation_probability < 1e-11


def test_steps_are_independent_for_fixed_size():
    # inclusion of example 0 at step t and t + 1: a 2x2 independence test (chi-square, alpha = 1e-3)
    s = FixedSizeSampler(20, 10, 3000, key=KEY)
    inc = torch.tensor([bool((i == 0).any()) for i, _ in s])
    a, b = inc[:-1], inc[1:]
    table = [[int((a & b).sum()), int((a & ~b).sum())], [int((~a & b).sum()), int((~a & ~b).sum())]]
    assert stats.chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: FixedSizeSampler(30, 7, 9, **kw),
        lambda **kw: ShuffledSampler(30, 7, epochs=3, **kw),
        lambda **kw: BallsInBinsSampler(30, 4, epochs=3, **kw),
        lambda **kw: TruncatedPoissonSampler(30, 0.3, 9, max_batch_size=8, **kw),
        lambda **kw: CyclicPoissonSampler(30, 0.3, 4, 11, **kw),
    ],
    ids=["fixed", "shuffle", "balls_in_bins", "truncated", "cyclic"],
)
@pytest.mark.parametrize("source", ["key", "generator"])
def test_resume_from_state_dict_is_bitwise(make, source):
    def fresh():
        return make(key=KEY) if source == "key" else make(generator=torch.Generator().manual_seed(5))

    full = _rows(fresh())
    first = fresh()
    it = iter(first)
    head = [tuple(t.clone() for t in next(it)) for _ in range(5)]  # stop mid-epoch
    state = first.state_dict()
    resumed = fresh()
    if source == "generator":
        resumed.generator.manual_seed(999)  # the state must carry everything
    resumed.load_state_dict(state)
    tail = [resumed.sample() for _ in range(len(full) - 5)]
    for (i, m), (j, k) in zip(head + tail, full):
        assert torch.equal(i, j) and torch.equal(m, k)


@pytest.mark.parametrize("make", [lambda: ShuffledSampler(30, 7, epochs=3, key=KEY), lambda: BallsInBinsSampler(30, 4, epochs=3, key=KEY),
                                  lambda: CyclicPoissonSampler(30, 0.3, 4, 11, key=KEY)], ids=["shuffle", "balls_in_bins", "cyclic"])
def test_a_state_without_its_assignment_is_refused_mid_stream(make):
    """Found by review: a sampler state loaded without its epoch permutation (or groups) drew a
    new one mid-epoch, examples twice in an epoch charged once (6 of 20 on a shuffled sampler), or
    other groups (17 of 20 moved) for a cyclic one; it raises at the draw now."""
    first = make()
    for _ in range(2):
        first.sample()
    state = first.state_dict()
    state.pop("assignment")
    resumed = make()
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"(no epoch assignment|holds no groups).*Nothing was drawn"):
        resumed.sample()


def test_load_state_dict_refuses_another_sampler():
    s = ShuffledSampler(30, 7, key=KEY)
    with pytest.raises(ValueError, match=r"ShuffledSampler.load_state_dict\(state\): the state has batch_size=8, this sampler has batch_size=7"):
        s.load_state_dict(ShuffledSampler(30, 8, key=KEY).state_dict())
    with pytest.raises(ValueError, match=r"the state comes from a generator-driven sampler, this one is key-driven"):
        s.load_state_dict(ShuffledSampler(30, 7, generator=torch.Generator()).state_dict())
    with pytest.raises(ValueError, match=r"ShuffledSampler.load_state_dict\(state\): the state is a PoissonSampler's .*not a ShuffledSampler's"):
        s.load_state_dict(PoissonSampler(30, 0.2, key=KEY).state_dict())  # (found by review: "the state has kind=None")


@pytest.mark.parametrize("make", [
    lambda: PoissonSampler(30, 0.2, key=KEY),
    lambda: PoissonSampler(30, 0.2, generator=torch.Generator().manual_seed(0)),
    lambda: FixedSizeSampler(30, 5, key=KEY),
    lambda: ShuffledSampler(30, 7, generator=torch.Generator().manual_seed(0)),
], ids=["poisson-key", "poisson-generator", "fixed-key", "shuffled-generator"])
def test_load_state_dict_refuses_an_edited_position_and_changes_nothing(make):
    """Found by review: draws=-1 put a keyed stream before its start, draws="2" and 1.5 were read as
    ints, 10**20 was taken, an empty dict was called a secure sampler's state, a str key re-keyed."""
    s = make()
    s.sample()
    saved, before = s.state_dict(), s.state_dict()
    fresh = make()
    for name in ("draws", "step"):
        if name not in saved:
            continue
        for bad in (-1, 1.5, "2", 10**20, None, True):
            with pytest.raises(ValueError, match=rf"load_state_dict\(state\): the state's {name}={bad!r} must be an int in \[0, 2\*\*63\).*Nothing was loaded"):
                fresh.load_state_dict({**saved, name: bad})
    with pytest.raises(ValueError, match=r"load_state_dict\(state\): the state is empty: it is not a dict the sampler's state_dict\(\) returned"):
        fresh.load_state_dict({})
    if saved.get("key") is not None:
        with pytest.raises(ValueError, match=r"the state is malformed \(its key is not bytes\)"):
            fresh.load_state_dict({**saved, "key": "zz"})
    assert str(fresh.state_dict()) == str(make().state_dict())  # untouched by the refused loads
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.sample()[0], s.sample()[0]) and str(s.state_dict()) != str(before)
    assert repr(TruncatedPoissonSampler(30, 0.2, key=KEY)).startswith("TruncatedPoissonSampler(")


def test_sampler_events_give_the_ledger_each_scheme_needs():
    sigma = 2.0
    for sampler, kind, adjacency in [
        (PoissonSampler(100, 0.1, 20, key=KEY), acc.PoissonGaussianEvent, "add_remove"),
        (FixedSizeSampler(100, 10, 20, key=KEY), acc.FixedSizeGaussianEvent, "replace_one"),
        (ShuffledSampler(100, 10, epochs=2, key=KEY), acc.EpochGaussianEvent, "replace_one"),
        (BallsInBinsSampler(100, 10, epochs=2, key=KEY), acc.BallsInBinsGaussianEvent, "add_remove"),
        (TruncatedPoissonSampler(100, 0.1, 20, key=KEY), acc.TruncatedPoissonGaussianEvent, "add_remove"),
        (CyclicPoissonSampler(100, 0.1, 4, 20, key=KEY), acc.CyclicPoissonGaussianEvent, "add_remove"),
    ]:
        ledger = acc.Ledger()
        for _ in sampler:
            ledger = ledger.append(sampler.event(sigma))  # the step records its event before release
        (event,) = ledger.events
        assert isinstance(event, kind) and event.count == 20 and ledger.adjacency == adjacency
        if kind in (acc.EpochGaussianEvent, acc.BallsInBinsGaussianEvent):
            assert event.epochs == 2 and event.charged_epochs == 2
        assert 0 < acc.epsilon(ledger, delta=1e-5, accountant="rdp") < math.inf
    with pytest.raises(ValueError, match=r"ShuffledSampler.event: no step drawn yet"):
        ShuffledSampler(10, 2, key=KEY).event(1.0)


def test_sampler_arguments_are_checked():
    with pytest.raises(ValueError, match=r"FixedSizeSampler: batch_size=11 must be in \[1, num_samples=10\]"):
        FixedSizeSampler(10, 11)
    with pytest.raises(TypeError, match=r"ShuffledSampler: batch_size must be an int >= 1, got float"):
        ShuffledSampler(10, 2.0)
    with pytest.raises(ValueError, match=r"BallsInBinsSampler: give at most one source of randomness"):
        BallsInBinsSampler(10, 2, key=KEY, generator=torch.Generator())
    with pytest.raises(ValueError, match=r"TruncatedPoissonSampler: max_batch_size=0 must be an int >= 1"):
        TruncatedPoissonSampler(10, 0.5, max_batch_size=0)


def test_cyclic_poisson_groups_are_uniform_and_steps_sample_only_their_group():
    n, q, b, steps = 62, 0.3, 4, 400
    s = CyclicPoissonSampler(n, q, b, steps, key=KEY)
    assert s.expected_batch_size == q * n / b and s.capacity >= n * q / b
    rows = _rows(s)
    groups = s.groups()
    # one group per example, each uniform: chi-square of the group sizes (false-alarm rate 1e-3)
    assert groups.shape == (n,) and int(groups.min()) >= 0 and int(groups.max()) <= b - 1
    assert stats.chisquare(torch.bincount(groups, minlength=b).numpy()).pvalue > 1e-3
    # independent per example: one more example leaves the others' groups as they were (the
    # add/remove coupling; a balanced permutation would move other examples between groups)
    assert torch.equal(CyclicPoissonSampler(n + 1, q, b, steps, key=KEY).groups()[:n], groups)
    hits = torch.zeros(b, dtype=torch.int64)
    for t, (i, m) in enumerate(rows):
        used = i[m]
        assert used.unique().numel() == used.numel()
        assert bool((groups[used] == t % b).all())  # exact: only the step's own group (b-min-separation)
        hits[t % b] += used.numel()
    # within its group every example is in with probability q: per group, the inclusions are
    # Binomial(visits * group size, q); two-sided binomial tests at alpha = 1e-3 / b each
    # (false-alarm rate <= 1e-3 for a correct sampler; the key is fixed)
    for g in range(b):
        trials = (steps // b) * int((groups == g).sum())
        assert stats.binomtest(int(hits[g]), trials, q).pvalue > 1e-3 / b
    # the partition is drawn once: the same on every step, and another key gives another one
    assert torch.equal(s.groups(), groups)
    assert not torch.equal(CyclicPoissonSampler(n, q, b, key=b"other").groups(), groups)


def test_cyclic_poisson_refuses_nonsense():
    with pytest.raises(ValueError, match=r"CyclicPoissonSampler: cycle=31 must be in \[1, num_samples=30\]"):
        CyclicPoissonSampler(30, 0.1, 31)
    with pytest.raises(ValueError, match=r"CyclicPoissonSampler: cycle=0 must be an int >= 1"):
        CyclicPoissonSampler(30, 0.1, 0)
    with pytest.raises(ValueError, match=r"CyclicPoissonSampler.load_state_dict\(state\): the state has cycle=3, this sampler has cycle=4"):
        CyclicPoissonSampler(30, 0.1, 4, key=KEY).load_state_dict(CyclicPoissonSampler(30, 0.1, 3, key=KEY).state_dict())
    assert len(CyclicPoissonSampler(30, 0.1, 3, key=KEY)) == 30  # default: round(cycle / sample_rate) steps
