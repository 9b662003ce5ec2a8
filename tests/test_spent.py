"""One noise key, one release: a state stepped twice in one process (a fork, a checkpoint loaded
twice) is refused unless the second step recomputes exactly what the first released."""

from __future__ import annotations

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


def test_an_old_key_is_refused_before_anything_is_computed():
    params, buffers, data, loss_fn, calls = problem()
    step = make(loss_fn)
    start = state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=7)
    for i in range(spent.FINGERPRINTS + 1):  # step 0's release falls out of the recent ones
        state, _ = step(state, *batch(data, i % 8), buffers)
    calls.clear()
    with pytest.raises(NoiseKeyReused, match="long ago"):
        step(start, *batch(data, 0), buffers)  # even the same batch: the release is no longer kept to compare
    assert not calls  # refused before the loss was evaluated


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
