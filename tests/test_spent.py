"""One noise key, one release: a state stepped twice in one process (a fork, a checkpoint loaded
twice) is refused unless the second step recomputes exactly what the first released."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vmapdp
from vmapdp import optim
from vmapdp.noise import spent
from vmapdp.noise.spent import NoiseKeyReused, SpentKeys


def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    apply, params, buffers = vmapdp.functionalize(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
    calls = []

    def loss_fn(p, b, sample):
        calls.append(1)
        xs, ys = sample
        return F.cross_entropy(apply(p, b, xs[None]), ys[None])

    return params, buffers, (x, y), loss_fn, calls


def make(loss_fn, noise=1.0, **kw):
    return vmapdp.make_train_step(loss_fn, optim.sgd(0.5), l2_clip_norm=1.0, noise_multiplier=noise, expected_batch_size=8.0, sample_rate=0.5, method="vmap", compile=False, **kw)


def batch(data, lo, hi=None):
    hi = lo + 8 if hi is None else hi
    return (data[0][lo:hi], data[1][lo:hi]), torch.ones(hi - lo, dtype=torch.bool)


def test_a_forked_state_is_refused_with_another_batch_and_nothing_is_released():
    params, buffers, data, loss_fn, _ = problem()
    step = make(loss_fn)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=7)
    first, _ = step(state, *batch(data, 0), buffers)
    # the same step on one sample fewer: its release minus the first would be one sample's clipped
    # grad exactly (both carry the same noise)
    with pytest.raises(NoiseKeyReused, match=r"already released step 0 of this run under the same noise key.*Nothing was released"):
        step(state, *batch(data, 0, 7), buffers)
    # the run itself goes on
    second, _ = step(first, *batch(data, 8), buffers)
    assert second.step == 2


def test_a_recomputation_releases_nothing_new_and_is_allowed():
    params, buffers, data, loss_fn, _ = problem()
    step = make(loss_fn)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=7)
    a, _ = step(state, *batch(data, 0), buffers)
    b, _ = step(state, *batch(data, 0), buffers)  # a cell run again with the same batch
    for k in params:
        assert torch.equal(a.params[k], b.params[k])


def test_a_checkpoint_loaded_twice_in_one_process_is_stepped_once(tmp_path):
    params, buffers, data, loss_fn, _ = problem()
    step = make(loss_fn)
    state, _ = step(vmapdp.init_train_state(params, optim.sgd(0.5), seed=7), *batch(data, 0), buffers)
    vmapdp.save_state(tmp_path / "ckpt.pt", state)
    one = vmapdp.load_state(tmp_path / "ckpt.pt")
    two = vmapdp.load_state(tmp_path / "ckpt.pt")
    step(one, *batch(data, 8), buffers)
    with pytest.raises(NoiseKeyReused, match="step 1"):
        step(two, *batch(data, 4, 12), buffers)


def test_every_step_is_kept_to_compare_an_in_process_resume_passes():
    """A checkpoint many steps back, resumed in the same process, recomputes its steps bit for bit
    and goes on; a fork from it on other batches is refused (found by review: only 16 releases
    were kept, and an in-process resume more than 16 steps back was refused)."""
    params, buffers, data, loss_fn, _ = problem()
    step = make(loss_fn)
    start = state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=7)
    for i in range(20):
        state, _ = step(state, *batch(data, i % 8), buffers)
    again, _ = step(start, *batch(data, 0), buffers)  # step 0, the same batch: a recomputation
    with pytest.raises(NoiseKeyReused, match="step 1 of this run"):
        step(again, *batch(data, 2), buffers)  # step 1 was released on batch(data, 1)


def test_one_sample_fewer_is_refused_even_where_a_leaf_is_large():
    """The checksum is of the bits: removing one sample from a 4M-element leaf moved each leaf's
    float32 norm by less than an ulp, and 16 of 30 such forks went through (found by review; these
    three seeds among them), releasing that sample's clipped gradient with no noise."""
    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(nn.Linear(4096, 1024, bias=False))
    x, y = torch.randn(4, 4096), torch.randint(0, 1024, (4,))

    def loss_fn(p, b, s):
        return F.cross_entropy(apply(p, b, s[0][None]), s[1][None])

    step = vmapdp.make_train_step(loss_fn, optim.sgd(0.5), l2_clip_norm=1.0, noise_multiplier=10.0, expected_batch_size=4.0, sample_rate=0.01,
                                  method="ghost", compile=False)
    full = torch.ones(4, dtype=torch.bool)
    for seed in (2, 3, 4):
        state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=seed)
        step(state, (x, y), full, buffers)
        with pytest.raises(NoiseKeyReused, match="with another value"):
            step(state, (x, y), full.logical_and(torch.arange(4) != 3), buffers)


def test_two_threads_cannot_release_one_key():
    """Checked before computing, recorded after: without a mark in between two threads stepping one
    state both released (10 of 10 trials; found by review). Exactly one goes through."""
    params, buffers, data, loss_fn, _ = problem()
    step = make(loss_fn)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=7)
    step(state, *batch(data, 8), buffers)  # (the first step pays the one-time set-up)
    spent.forget_spent_keys()
    barrier, results = threading.Barrier(2), []

    def run(lo):
        barrier.wait()
        try:
            step(state, *batch(data, lo), buffers)
            results.append("released")
        except NoiseKeyReused:
            results.append("refused")

    threads = [threading.Thread(target=run, args=(lo,)) for lo in (0, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["refused", "released"]


def test_the_audits_throw_their_steps_away_and_leave_the_run_alone():
    """check_noise_calibration steps the state under other seeds and check_sensitivity on neighbouring
    batches: neither records a key, so they run twice and the run they audit goes on (found by review)."""
    params, buffers, data, loss_fn, _ = problem()
    step = make(loss_fn)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=1)
    m = torch.tensor([True] * 7 + [False])
    hyper = dict(lr=0.5, l2_clip_norm=1.0, expected_batch_size=8.0)
    for lo in (0, 8):  # other batches each time: what a fork would be, were these steps released
        b, _ = batch(data, lo)
        vmapdp.audit.check_noise_calibration(step, state, b, m, buffers, noise_multiplier=1.0, min_samples=1000, **hyper)
        vmapdp.audit.check_sensitivity(step, state, b, m, buffers, **hyper)
    state, _ = step(state, b, m, buffers)
    assert state.step == 1


def test_unreleased_covers_the_code_it_runs_not_the_caller_of_a_generator_suspended_inside_it():
    """Inside `with unreleased():` a state may be stepped on two batches (nothing of it is
    published); a generator suspended inside the block (its frame off the stack) leaves its caller
    recorded, so the caller's fork is refused (it was let through: the flag was the context's, which
    a generator shares with its caller). As a decorator it covers the call. Threads are apart."""
    params, buffers, data, loss_fn, _ = problem()
    step = make(loss_fn)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=9)
    with spent.unreleased():
        step(state, *batch(data, 0), buffers)
        step(state, *batch(data, 8), buffers)

    def audit():
        with spent.unreleased():
            yield step(state, *batch(data, 0), buffers)

    suspended = audit()
    next(suspended)  # the generator waits inside its `with` block
    step(state, *batch(data, 4, 12), buffers)
    with pytest.raises(NoiseKeyReused, match="already released step 0"):
        step(state, *batch(data, 2, 10), buffers)
    suspended.close()

    @spent.unreleased()
    def thrown_away(lo):
        return step(state, *batch(data, lo), buffers)

    thrown_away(1), thrown_away(3)
    seen = []
    with spent.unreleased():
        t = threading.Thread(target=lambda: seen.append(spent.recording()))
        t.start()
        t.join()
    assert seen == [True]


def test_other_runs_other_configurations_and_unnoised_steps_are_not_refused():
    params, buffers, data, loss_fn, _ = problem()
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=7)
    make(loss_fn)(state, *batch(data, 0), buffers)
    make(loss_fn, noise=2.0)(state, *batch(data, 8), buffers)  # another configuration: another key, other noise
    make(loss_fn)(vmapdp.init_train_state(params, optim.sgd(0.5), seed=8), *batch(data, 8), buffers)  # another seed
    secure = vmapdp.init_train_state(params, optim.sgd(0.5), secure=True)
    make(loss_fn, secure=True)(secure, *batch(data, 0), buffers)
    make(loss_fn, secure=True)(secure, *batch(data, 8), buffers)  # fresh OS noise each time: nothing to cancel
    with pytest.warns(UserWarning, match="WITHOUT differential privacy"):
        plain = make(loss_fn, noise=0.0)
    plain(state, *batch(data, 0), buffers)
    plain(state, *batch(data, 8), buffers)  # no noise to cancel (charged as non-private)


def test_the_record_keeps_intervals_of_steps():
    keys = SpentKeys()
    run = SpentKeys.run_digest(1, "binding")
    fp = torch.zeros(1, dtype=torch.float64)
    for step in [0, 1, 2, 5, 4, 3, 9]:
        keys.record(run, step, fp)
    assert keys._runs[run] == [[0, 6], [9, 10]]
    keys.clear()
    for step in [0, 1, 2, 5, 4, 3, 9]:
        assert not keys.check("call", run, step)


def test_a_key_in_flight_is_refused_to_another_caller_until_done():
    keys = SpentKeys()
    run = SpentKeys.run_digest(1, "binding")
    assert keys.check("call", run, 0) is False  # not released before; now in flight
    with pytest.raises(NoiseKeyReused, match="another thread is releasing step 0"):
        keys.check("call", run, 0)
    keys.done(run, 0)
    assert keys.check("call", run, 0) is False
    keys.record(run, 0, torch.tensor(5))
    keys.done(run, 0)
    assert keys.check("call", run, 0) is True and not keys.differs(run, 0, torch.tensor(5)) and keys.differs(run, 0, torch.tensor(6))
    keys.record(run, 4096 + 3, torch.tensor(7))  # another block of checksums
    assert not keys.differs(run, 4096 + 3, torch.tensor(7)) and keys._runs[run] == [[0, 1], [4099, 4100]]


def test_the_checksum_sees_one_ulp_and_reads_any_tensor():
    x = torch.randn(1000)
    y = x.clone()
    y[3] = torch.nextafter(y[3], torch.tensor(10.0))
    assert spent.release_fingerprint({"a": x}) != spent.release_fingerprint({"a": y})
    assert spent.release_fingerprint({"a": x, "b": y}) != spent.release_fingerprint({"a": y, "b": x})  # leaves weighted apart
    for t in (torch.randn(10, dtype=torch.float16)[1:6], torch.ones(3, dtype=torch.bool), torch.randn(3, dtype=torch.bfloat16), torch.tensor(2.0)):
        assert spent.release_fingerprint(t) == spent.release_fingerprint(t.clone())



def test_the_checksum_sees_ulp_changes_that_cancel_in_a_plain_sum():
    """Found by review: the words were summed plainly, so +1 ulp in one entry and -1 ulp in another
    (a fork by one well-fit example: 2% of them) kept the checksum. Weighted by position, a change
    keeps it by a ~2**-31 coincidence: 300 such pairs (and swaps), across block boundaries too, all
    seen (false alarm ~1e-7)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((1 << 20) + 5000, generator=g)
    base = spent.release_fingerprint({"a": x})
    words = x.view(torch.int32)
    for _ in range(300):
        i, j = torch.randint(0, x.numel(), (2,), generator=g).tolist()
        if words[i] == words[j] or i == j:
            continue
        y = x.clone()
        yw = y.view(torch.int32)
        if torch.rand((), generator=g) < 0.5:
            yw[i] += 1
            yw[j] -= 1
        else:
            yw[i], yw[j] = words[j], words[i]
        assert spent.release_fingerprint({"a": y}) != base, (i, j)


def test_unreleased_blocks_left_out_of_order_leave_nothing_behind():
    """A block entered inside another through a generator and left after it: leaving the outer
    block must not be undone by the inner one's exit (a reset to the inner block's entry value
    would restore the outer block's frame while its function runs on: its later steps unrecorded)."""
    params, buffers, data, loss_fn, _ = problem()
    step = make(loss_fn)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=11)

    def inner():
        with spent.unreleased():
            yield

    g = inner()
    with spent.unreleased():
        next(g)  # the inner block entered while the outer one is on
    next(g, None)  # the inner block left after the outer one
    assert spent.recording()
    step(state, *batch(data, 0), buffers)
    with pytest.raises(NoiseKeyReused, match="already released step 0"):
        step(state, *batch(data, 8), buffers)


def test_one_shared_unreleased_left_out_of_order_or_in_another_context_leaves_nothing_behind():
    """One instance shared by two generators and left in the other order, and a block left in another
    context (a generator resumed through contextvars.copy_context().run): after its block, each
    generator's own fork is refused (found by review: each case let it through)."""
    import contextvars

    params, buffers, data, loss_fn, _ = problem()
    step = make(loss_fn)
    quiet = spent.unreleased()

    def audit_then_train(seed):
        state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=seed)
        with quiet:
            yield
        step(state, *batch(data, 0), buffers)
        yield
        step(state, *batch(data, 8), buffers)  # a fork of the step above
        yield

    a, b = audit_then_train(12), audit_then_train(13)
    next(a), next(b)  # both inside the shared block
    next(a), next(b)  # a leaves first, then b; each steps once
    for g in (a, b):
        with pytest.raises(NoiseKeyReused, match="already released step 0"):
            next(g)
    c = audit_then_train(14)
    next(c)
    contextvars.copy_context().run(next, c)  # leaves its block (and steps) in another context
    with pytest.raises(NoiseKeyReused, match="already released step 0"):
        next(c)
    assert spent._INSIDE == {}
