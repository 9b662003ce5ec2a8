"""PoissonSampler: Poisson statistics, static shapes, nothing dropped, clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from vmapdp.data import PoissonSampler, default_capacity, gather, gather_dataset

# statistical checks at a stated false-alarm rate, with fixed seeds (deterministic suite)
ALPHA = 1e-4


def _sizes_and_counts(sampler):
    sizes, counts = [], torch.zeros(sampler.num_samples, dtype=torch.int64)
    for indices, mask in sampler:
        assert indices.shape == mask.shape and indices.numel() % sampler.capacity == 0
        real = indices[mask]
        assert real.unique().numel() == real.numel(), "an example appears twice in one step"
        assert torch.equal(indices[~mask], torch.zeros_like(indices[~mask]))
        sizes.append(real.numel())
        counts[real] += 1
    return torch.tensor(sizes, dtype=torch.float64), counts


@pytest.mark.parametrize("source", ["generator", "key", "secure"])
def test_batch_sizes_and_inclusion_rates_are_poisson(source):
    n, q, steps = 500, 0.05, 2000
    kwargs = {"generator": dict(generator=torch.Generator().manual_seed(0)), "key": dict(key=b"k"), "secure": dict(secure=True)}[source]
    sampler = PoissonSampler(n, q, steps, **kwargs)
    sizes, counts = _sizes_and_counts(sampler)
    # batch size ~ Binomial(n, q): mean within its CLT interval, variance by chi-square
    mean, var = n * q, n * q * (1 - q)
    z = stats.norm.ppf(1 - ALPHA / 2)
    assert abs(sizes.mean().item() - mean) < z * math.sqrt(var / steps)
    lo, hi = stats.chi2.ppf([ALPHA / 2, 1 - ALPHA / 2], steps - 1) / (steps - 1)
    assert lo * var < sizes.var().item() < hi * var
    # each example's count ~ Binomial(steps, q), independently: a chi-square goodness of fit over examples
    expected = steps * q
    chi2 = (((counts.double() - expected) ** 2) / (expected * (1 - q))).sum().item()
    assert stats.chi2.sf(chi2, n) > ALPHA and stats.chi2.cdf(chi2, n) > ALPHA


def test_negative_control_fixed_size_shuffled_batches_fail_the_variance_check():
    # fixed-size batches (shuffle + slice) have the right mean but zero variance in batch size
    n, q, steps = 500, 0.05, 2000
    sizes = torch.full((steps,), n * q, dtype=torch.float64)
    var = n * q * (1 - q)
    lo = stats.chi2.ppf(ALPHA / 2, steps - 1) / (steps - 1)
    assert not lo * var < sizes.var().item()


def test_overflow_never_drops_examples():
    n, q = 200, 0.5
    sampler = PoissonSampler(n, q, 50, torch.Generator().manual_seed(1), capacity=16)
    chunks = set()
    for indices, mask in sampler:
        k = int(mask.sum())
        chunks.add(indices.numel() // 16)
        assert indices.numel() == max(1, math.ceil(k / 16)) * 16
    assert len(chunks) > 1  # the step size really varies in whole chunks


def test_same_seed_same_batches_and_state_resume():
    a = PoissonSampler(100, 0.1, 5, torch.Generator().manual_seed(3))
    b = PoissonSampler(100, 0.1, 5, torch.Generator().manual_seed(3))
    first = [i[m] for i, m in a]
    assert all(torch.equal(x, i[m]) for x, (i, m) in zip(first, b))
    c = PoissonSampler(100, 0.1, 5, torch.Generator().manual_seed(3))
    c.sample()
    saved = c.state_dict()
    d = PoissonSampler(100, 0.1, 5, torch.Generator().manual_seed(99))
    d.load_state_dict(saved)
    i, m = d.sample()
    assert torch.equal(i[m], first[1])


def test_stream_id_names_the_sampling_process():
    """Alike with the same key or seed: one id; another key, arguments or a secure sampler's own
    token: another; restored by load_state_dict. A generator-driven sampler is named by its
    generator's state at its first draw (found by review: seeding the generator after the sampler
    was built kept the id of the unseeded state)."""
    from vmapdp.data import CyclicPoissonSampler

    def cyc(**kw):
        return CyclicPoissonSampler(40, 0.5, cycle=4, **kw)

    assert cyc(key=b"a").stream_id == cyc(key=b"a").stream_id != cyc(key=b"b").stream_id
    assert cyc(key=b"a").stream_id != CyclicPoissonSampler(40, 0.5, cycle=2, key=b"a").stream_id
    a, b = cyc(secure=True), cyc(secure=True)
    assert a.stream_id != b.stream_id
    b.load_state_dict(a.state_dict())
    assert b.stream_id == a.stream_id
    g = torch.Generator()
    late = cyc(generator=g)
    g.manual_seed(5)
    late.sample()
    early = cyc(generator=torch.Generator().manual_seed(5))
    assert late.stream_id == early.stream_id  # the state the draws came from
    assert late.stream_id != cyc(generator=torch.Generator().manual_seed(6)).stream_id
    fresh = cyc(generator=torch.Generator().manual_seed(0))
    fresh.load_state_dict(late.state_dict())
    assert fresh.stream_id == late.stream_id
    shared = torch.Generator().manual_seed(1)
    events_only = cyc(generator=shared)  # (never drawn: its id, once read, is kept while others draw from the generator)
    named = events_only.stream_id
    torch.rand(3, generator=shared)
    assert events_only.stream_id == named


def test_default_capacity_bounds_overflow():
    for n, q in [(60_000, 256 / 60_000), (1438, 128 / 1438), (100, 0.5)]:
        cap = default_capacity(n, q, 1e-6)
        assert stats.binom.sf(cap, n, q) <= 1e-6  # P(X > cap)
        assert cap < n or q > 0.4
        assert stats.binom.sf(cap - 10, n, q) > 1e-9  # and it is not absurdly large
    assert default_capacity(10, 1.0) == 10


def test_defaults_and_empty_steps():
    s = PoissonSampler(1000, 0.01, generator=torch.Generator().manual_seed(0))
    assert len(s) == 100 and s.expected_batch_size == pytest.approx(10.0)
    tiny = PoissonSampler(3, 1e-9, 4, torch.Generator().manual_seed(0))
    for indices, mask in tiny:
        assert not mask.any() and indices.numel() == tiny.capacity


def test_gather_pytree_and_dataset():
    x, y = torch.arange(10.0)[:, None], torch.arange(10)
    idx = torch.tensor([3, 0, 7])
    bx, by = gather((x, y), idx)
    assert torch.equal(by, idx) and torch.equal(bx[:, 0], idx.float())
    ds = torch.utils.data.TensorDataset(x, y)
    dx, dy = gather_dataset(ds, idx)
    assert torch.equal(dy, idx)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_samples=0, sample_rate=0.1), r"num_samples=0 must be an int >= 1"),
        (dict(num_samples=10, sample_rate=1.5), r"sample_rate=1.5 must be in \(0, 1\]"),
        (dict(num_samples=10, sample_rate=0.0), r"sample_rate=0.0 must be in \(0, 1\]"),
        (dict(num_samples=10, sample_rate=0.1, steps=-1), r"steps=-1 must be an int >= 0"),
        (dict(num_samples=10, sample_rate=0.1, capacity=0), r"capacity=0 must be an int >= 1"),
        (dict(num_samples=10, sample_rate=0.1, secure=True, generator=torch.Generator()), r"secure=True .* cannot use a seeded generator"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoissonSampler(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_samples=10.0, sample_rate=0.1), r"PoissonSampler: num_samples must be an int >= 1, got float"),
        (dict(num_samples=10, sample_rate="0.1"), r"PoissonSampler: sample_rate must be a real number"),
        (dict(num_samples=10, sample_rate=0.1, steps=2.0), r"steps must be an int >= 0, got float"),
        (dict(num_samples=10, sample_rate=0.1, capacity=True), r"capacity must be an int >= 1, got bool"),
    ],
)
def test_wrong_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        PoissonSampler(**kwargs)


@pytest.mark.parametrize("other", [dict(num_samples=101, sample_rate=0.1), dict(num_samples=100, sample_rate=0.2)])
def test_load_state_dict_refuses_another_size_or_rate(other):
    saved = PoissonSampler(100, 0.1, key=b"k")
    saved.sample()
    with pytest.raises(ValueError, match=r"load_state_dict\(state\): the state comes from a sampler with (num_samples=100|sample_rate=0.1), this one has"):
        PoissonSampler(**other, key=b"k").load_state_dict(saved.state_dict())
    gen = PoissonSampler(100, 0.1, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"the state comes from a sampler with"):
        PoissonSampler(**other, generator=torch.Generator()).load_state_dict(gen.state_dict())
    PoissonSampler(100, 0.1, key=b"x").load_state_dict(saved.state_dict())  # same size and rate: fine


def test_keyed_sampler_is_reproducible_resumable_and_the_default():
    a = PoissonSampler(100, 0.1, 4, key=b"secret")
    b = PoissonSampler(100, 0.1, 4, key=b"secret")
    first = [i[m] for i, m in a]
    assert all(torch.equal(x, i[m]) for x, (i, m) in zip(first, b))
    c = PoissonSampler(100, 0.1, 4, key=b"secret")
    c.sample()
    d = PoissonSampler(100, 0.1, 4)  # default: a random key
    assert d.key is not None and len(d.key) == 32 and d.generator is None
    d.load_state_dict(c.state_dict())
    i, m = d.sample()
    assert torch.equal(i[m], first[1])
    with pytest.raises(ValueError, match=r"at most one source of randomness"):
        PoissonSampler(100, 0.1, key=b"k", generator=torch.Generator())
    with pytest.raises(ValueError, match=r"comes from a keyed sampler"):
        PoissonSampler(100, 0.1, generator=torch.Generator()).load_state_dict(c.state_dict())
