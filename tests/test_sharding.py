"""DP-SGD on sharded params (vmapdp.sharding): 2 and 4 gloo processes equal one process on all rows.

Three spawns run every multi-process check and write their results to files that the tests read
(each spawned process imports torch, the slow part, so the cases share processes):

* world 4: an MLP (Adam) and a GPT-2-like block (SGD with momentum) trained for a few steps; a
  checkpoint at step 2, resumed on the same 4 ranks;
* world 2: the same two runs; the world-4 checkpoint resumed on 2 ranks; ranks that disagree;
  the MLP wrapped with FSDP2's fully_shard, read by functionalize, trained and written back; the
  noise of secure=True (each owner's CSPRNG) on zero gradients; then a run whose rank 1 dies while a checkpoint is being written (the spawn fails there);
* world 2 again: the restart from the last complete checkpoint, to the end.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import weakref

import optree
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import vmapdp
from transformer_blocks import BLOCKS
from vmapdp import distributed as vdist
from vmapdp import optim
from vmapdp import sharded_checkpoint as sc
from vmapdp.data import CyclicPoissonSampler, PoissonSampler, gather
from vmapdp.mf import BandedToeplitz, BufferedToeplitz, correlated_noise
from vmapdp.noise import add_noise
from vmapdp.sharding import Sharding, local_bytes
from vmapdp.noise.spent import forget_spent_keys

N, Q, STEPS, CAPACITY, SEED = 48, 0.25, 4, 16, 1234
SAMPLER_KEY = b"sharding-test-sampler"
DELTA = 1e-5
# correlated noise: banded (band 3 <= cycle: amplified) and BLT, on cyclic Poisson batches of ~6 rows
MF = {"banded": BandedToeplitz((1.0, 0.6, 0.25)), "blt": BufferedToeplitz((0.9, 0.5), (0.3, 0.1)), "identity": BandedToeplitz((1.0,))}
MF_Q, CYCLE = 0.5, 4
ADAPTIVE = vmapdp.AdaptiveClipping(count_noise_multiplier=2.0, learning_rate=0.5)


def problem(kind, wrap=None):
    """``wrap(model)``: applied to the model before functionalize (fully_shard)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
        inputs = torch.randn(N, 5, generator=g)
        opt = optim.adam(0.05)
    else:
        build, make = BLOCKS["gpt2"]
        model = build()
        inputs = make(N, 5, g)
        opt = optim.sgd(0.2, momentum=0.9)
    if wrap is not None:
        wrap(model)
    apply, params, buffers = vmapdp.functionalize(model)
    data = (inputs, torch.randint(0, 3, (N,), generator=g))

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    return params, buffers, data, loss_fn, opt


def make_sampler(noise, steps, key=SAMPLER_KEY):
    """Poisson batches; cyclic Poisson ones for correlated noise (its accounting needs them)."""
    if noise is None:
        return PoissonSampler(N, Q, steps, key=key, capacity=CAPACITY)
    return CyclicPoissonSampler(N, MF_Q, CYCLE, steps, key=key, capacity=CAPACITY)


def train(kind, *, sharded, steps=STEPS, seed=SEED, state=None, sampler=None, until=None, on_step=None, wrap=None, noise=None, adaptive=False, secure=False,
          unshard="step", method="ghost", batches=None):
    """``steps`` DP steps (Poisson batches, the same sampler key everywhere); sharded: this rank's
    share of each batch, the state sharded (``unshard``: Sharding's). ``noise``: a key of ``MF``
    (correlated noise over a run of ``STEPS``); ``adaptive``: adaptive clipping; ``batches``: global
    ``(indices, mask)`` batches instead of the sampler's (each rank takes its ``vdist.shard``). Returns
    (state, sharding, sampler)."""
    forget_spent_keys()  # each call is its own run, compared with others of the same seed noise for noise (vmapdp.noise.spent)
    params, buffers, data, loss_fn, opt = problem(kind, wrap)
    sharding = Sharding(params, unshard=unshard) if sharded else None
    priv = None if noise is None else correlated_noise(MF[noise], steps=STEPS)
    if sampler is None:
        sampler = make_sampler(noise, steps)
    scheme = {"sample_rate": Q, "expected_batch_size": N * Q} if noise is None else {"sampler": sampler}
    step = vmapdp.make_train_step(
        loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.1, **scheme, privatizer=priv, secure=secure,
        adaptive_clipping=ADAPTIVE if adaptive else None,
        physical_batch_size=vdist.local_capacity(CAPACITY) if sharded else CAPACITY,
        compile=False, method=method, sharding=sharding,
    )
    if state is None:
        state = vmapdp.init_train_state(params, opt, seed=None if secure else seed, secure=secure, privatizer=priv, sharding=sharding)
    if batches is not None:
        batches = [vdist.shard(i, m, CAPACITY) for i, m in batches] if sharded else batches
    for indices, mask in batches if batches is not None else vdist.sharded(sampler) if sharded else sampler:
        state, _ = step(state, gather(data, indices), mask, buffers)
        if on_step is not None:
            on_step(state, sharding, sampler)
    return state, sharding, sampler


def summary(state, sharding):
    """What the parent compares: the full params, the ledger, epsilon, this rank's bytes, this
    rank's noise buffers (correlated noise) with its bounds, the clip norm (adaptive clipping)."""
    noise = state.noise_state
    return {
        "buffers": {k: v.clone() for k, v in noise["buffers"].items()} if noise else None,
        "noise_t": int(noise["t"]) if noise else None,
        "bounds": {k: sharding.bounds(k) for k in sharding.names},
        "clip_norm": state.clip_norm,
        "params": {k: v.clone() for k, v in sharding.gather(state.params).items()},
        "ledger": state.ledger.to_json(),
        "epsilon": state.epsilon(DELTA),
        "step": state.step,
        "run_id": state.run_id,
        "param_bytes": local_bytes(state.params),
        "opt_bytes": local_bytes(state.opt_state),
    }


X_FORWARD = torch.randn(6, 5, generator=torch.Generator().manual_seed(7))


def fsdp_run():
    """The MLP under FSDP2 (each Linear and the root fully_shard-ed), read by functionalize, trained
    by the sharded step, written back; the module's own forward on X_FORWARD afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh, wrapped = init_device_mesh("cpu", (dist.get_world_size(),)), []

    def wrap(model):
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        wrapped.append(fully_shard(model, mesh=mesh))

    state, sharding, _ = train("mlp", sharded=True, wrap=wrap)
    model = wrapped[0]
    before = {k: p.to_local().clone() for k, p in model.named_parameters()}
    bad = {**state.params, "0.bias": state.params["0.bias"][:0]}
    res = {"bad_error": _error(lambda: sharding.write_to_module(model, bad))}  # refused before anything is written
    res["untouched"] = all(torch.equal(p.to_local(), before[k]) for k, p in model.named_parameters())
    sharding.write_to_module(model, state.params)
    with torch.no_grad():
        res["forward"] = model(X_FORWARD).clone()
    res["still_fsdp"] = isinstance(model, FSDPModule) and isinstance(model[0], FSDPModule)
    res["summary"] = summary(state, sharding)
    # functionalize gathers nothing: its params are the module's DTensor shards (FSDP2's rows), which
    # the unsharded entry points refuse with the fix
    from torch.distributed.tensor import DTensor

    apply, params, buffers = vmapdp.functionalize(model)
    res["params_are_shards"] = all(isinstance(v, DTensor) for v in params.values())
    res["local_elements"] = sum(v.to_local().numel() for v in params.values())
    res["dtensor_error"] = _error(lambda: vmapdp.clipped_grad_sum(lambda p, b, x: apply(p, b, x[None]).sum(), l2_clip_norm=1.0)(params, buffers, X_FORWARD))
    # the curvature functions, make_private and validate (with inputs) refuse it too, with the fix,
    # not with a DTensor error from inside (make_private: before any step; the module is untouched)
    def any_error(fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 (the test reads which one)
            return f"{type(err).__name__}: {err}"
        return None

    out1 = lambda p, b, x: apply(p, b, x[None])[0]  # noqa: E731
    res["curvature_errors"] = [
        any_error(lambda: vmapdp.per_sample_jacobian(out1)(params, buffers, X_FORWARD)),
        any_error(lambda: vmapdp.empirical_ntk(out1)(params, buffers, X_FORWARD, X_FORWARD)),
        any_error(lambda: vmapdp.hutchinson_trace(lambda p, b, x: out1(p, b, x).sum(), num_probes=1, generator=torch.Generator().manual_seed(0))(params, buffers, X_FORWARD)),
    ]
    before = {k: p.to_local().clone() for k, p in model.named_parameters()}
    rows = list(zip(X_FORWARD, torch.zeros(len(X_FORWARD), dtype=torch.long)))
    res["make_private_error"] = any_error(lambda: vmapdp.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), rows, l2_clip_norm=1.0, delta=1e-3,
                                                                      noise_multiplier=1.0, batch_size=2, compile=False, method="ghost", seed=1).fit(1))
    res["make_private_untouched"] = all(torch.equal(p.to_local(), before[k]) for k, p in model.named_parameters())
    res["validate_error"] = any_error(lambda: vmapdp.validate(model, X_FORWARD))
    # a module left unsharded (a forward with reshard_after_forward=False) holds plain full params, and
    # apply would run FSDP2's hooks inside vmap: functionalize refuses it with the fix, which works
    # (every unit resharded: the root's reshard() alone leaves its children unsharded)
    lazy = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
    fully_shard(lazy[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(lazy[2], mesh=mesh, reshard_after_forward=False)
    fully_shard(lazy, mesh=mesh, reshard_after_forward=False)
    with torch.no_grad():
        lazy(X_FORWARD)
    res["unsharded_error"] = any_error(lambda: vmapdp.functionalize(lazy))
    for m in lazy.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    res["resharded_are_shards"] = all(isinstance(v, DTensor) for v in vmapdp.functionalize(lazy)[1].values())
    # the same run with each parameter gathered on use
    state, sharding, _ = train("mlp", sharded=True, wrap=wrap, unshard="use")
    res["use_summary"] = summary(state, sharding)
    return res


SECURE_STD, SECURE_STEPS = 2.0, 2


def secure_problem():
    """Zero gradients (the loss times 0) through a Linear(200, 100) (20,100 noised elements): with
    sgd(1), expected_batch_size 1, each step's parameter change is minus its noise."""
    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(nn.Linear(200, 100))

    def loss_fn(p, b, x):
        return 0.0 * apply(p, b, x[None]).sum()

    return params, buffers, loss_fn, optim.sgd(1.0)


def secure_step(sharding):
    params, buffers, loss_fn, opt = secure_problem()
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=SECURE_STD, expected_batch_size=1.0, sample_rate=Q,
                                  physical_batch_size=4, compile=False, method="ghost", secure=True, sharding=sharding)
    return params, buffers, step, vmapdp.init_train_state(params, opt, secure=True, sharding=sharding)


def secure_run():
    """Each step's noise on this rank's shards (old minus new params), and the ledger."""
    params = secure_problem()[0]
    sharding = Sharding(params)
    _, buffers, step, state = secure_step(sharding)
    noises = []
    for _ in range(SECURE_STEPS):
        new, _ = step(state, torch.randn(4, 200), torch.ones(4, dtype=torch.bool), buffers)
        noises.append({k: state.params[k] - new.params[k] for k in sharding.names})
        state = new
    return {"noises": noises, "ledger": state.ledger.to_json(), "epsilon": state.epsilon(DELTA), "seed": state.noise_seed}


RUNS = {"banded": {"noise": "banded"}, "blt": {"noise": "blt"}, "adaptive": {"adaptive": True}}


def resume(path, *, noise=None, adaptive=False):
    """A fresh state of this world loaded from the step-2 checkpoint ``path``, then trained to STEPS."""
    params, _, _, _, opt = problem("mlp")
    sharding = Sharding(params)
    priv = None if noise is None else correlated_noise(MF[noise], steps=STEPS)
    like = vmapdp.init_train_state(params, opt, seed=SEED, privatizer=priv, sharding=sharding)
    sampler = make_sampler(noise, STEPS - 2, key=b"overwritten-by-the-load")
    # (saved on 4 ranks: on another world size with the caller's word that nothing was released after it)
    loaded = sc.load_sharded(path, like=like, sharding=sharding, sampler=sampler, saved_after_last_step=sharding.world_size != 4)
    resumed, _, _ = train("mlp", sharded=True, state=loaded, sampler=sampler, noise=noise, adaptive=adaptive)
    return loaded, resumed, sharding


def same_state(a, b):
    """Bitwise: params, optimizer state, noise state, clip norm, step and ledger."""
    la, lb = (optree.tree_leaves((s.params, s.opt_state, s.noise_state), namespace="torch") for s in (a, b))
    clips = (a.clip_norm is None and b.clip_norm is None) or torch.equal(a.clip_norm, b.clip_norm)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb)) and clips and a.step == b.step and a.ledger.to_json() == b.ledger.to_json()


def mf_adaptive_runs(out, world):
    """Correlated noise (banded, BLT) and adaptive clipping, sharded; world 4 also checkpoints the
    BLT and adaptive runs at step 2 and resumes them here, world 2 resumes those checkpoints on 2
    ranks and runs both kinds with secure=True for 2 steps."""
    res = {}
    for tag, kw in RUNS.items():
        state, sharding, _ = train("mlp", sharded=True, **kw)
        res[tag] = summary(state, sharding)
    for tag in ("blt", "adaptive"):
        path = os.path.join(out, f"ckpt4-{tag}")
        if world == 4:
            half, sharding, sampler = train("mlp", sharded=True, steps=2, **RUNS[tag])
            sc.save_sharded(path, half, sharding, sampler=sampler)
            loaded, resumed, sharding = resume(path, **RUNS[tag])
            res[f"{tag}-loaded_equal"] = same_state(loaded, half)
            res[f"{tag}-resumed"] = summary(resumed, sharding)
        else:
            loaded, resumed, sharding = resume(path, **RUNS[tag])
            res[f"{tag}-resharded_step"] = loaded.step
            res[f"{tag}-resharded"] = summary(resumed, sharding)
    if world == 2:
        for tag in ("banded", "adaptive"):
            state, sharding, _ = train("mlp", sharded=True, steps=2, secure=True, **RUNS[tag])
            res[f"{tag}-secure"] = summary(state, sharding)
    return res


def use_runs(world):
    """``Sharding(unshard="use")``: the MLP and the GPT-2 block by ghost clipping, the block by
    two_pass (world 2) or vmap (world 4). Each run also reports how many all_gathers its steps made
    and the most gathered buffers alive at once (a finalizer on each; freed means no view of it
    is left, autograd's saved tensors included)."""
    real, live, stats = dist.all_gather_single, [0], {}

    def counted(out, inp, *args, **kwargs):
        live[0] += 1
        stats["calls"] += 1
        stats["peak"] = max(stats["peak"], live[0])
        weakref.finalize(out, lambda: live.__setitem__(0, live[0] - 1))
        return real(out, inp, *args, **kwargs)

    res = {}
    for kind, method in (("mlp", "ghost"), ("gpt2", "ghost"), ("gpt2", "two_pass" if world == 2 else "vmap")):
        stats.update(calls=0, peak=0)
        dist.all_gather_single = counted
        try:
            state, sharding, _ = train(kind, sharded=True, unshard="use", method=method)
        finally:
            dist.all_gather_single = real
        res[f"{kind}-{method}"] = {**summary(state, sharding), "gathers": stats["calls"], "peak_gathered": stats["peak"], "alive_after": live[0]}
    return res


def uneven_batches():
    """Two global batches of 17 rows (padded to 2 * CAPACITY): one row past W * local_capacity at
    W = 2 and 4, so vdist.shard gives rank 0 two chunks and the other ranks one."""
    g, out = torch.Generator().manual_seed(11), []
    for _ in range(2):
        mask = torch.arange(2 * CAPACITY) < 17
        out.append((torch.where(mask, torch.randperm(N, generator=g)[: 2 * CAPACITY], 0), mask))
    return out


class FourWeights(nn.Module):
    """Four 4x4 weights in ghost's order of sums: ``a`` is also used outside its linear (an
    uncovered op), so ghost keeps its per-sample grads only within the keep budget, which depends on
    the chunk's row count; ``r`` (on 3 positions: direct) is always kept; kept sums come first."""

    def __init__(self):
        super().__init__()
        self.a, self.r, self.b, self.h = (nn.Linear(4, 4, bias=False) for _ in range(4))

    def forward(self, x):
        h = self.a(x.mean(1)) + self.r(x).mean(1) + 0.1 * torch.sin(self.a.weight).sum()
        return self.h(torch.tanh(self.b(torch.tanh(h))))


ROWS_DATA = (torch.randn(13, 3, 4, generator=torch.Generator().manual_seed(0)), torch.randint(0, 4, (13,), generator=torch.Generator().manual_seed(1)))


def rows_step(rows, sharded):
    """One ghost step of FourWeights (sgd(1)) on ``ROWS_DATA[rows]``, physical_batch_size
    None, ghost's keep budget 80 elements (5 rows of a 4x4 weight): 5 rows keep ``a``'s per-sample
    grads, 8 do not. The full params after it."""
    from vmapdp.ghost import limits

    torch.manual_seed(0)
    apply, params, buffers = vmapdp.functionalize(FourWeights())

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    opt, sharding = optim.sgd(1.0), Sharding(params, unshard="use") if sharded else None
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, expected_batch_size=1.0,
                                  compile=False, method="ghost", sharding=sharding)
    state = vmapdp.init_train_state(params, opt, seed=SEED, sharding=sharding)
    batch = tuple(t[rows] for t in ROWS_DATA)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, keep_elements=80))
        state, _ = step(state, batch, torch.ones(len(batch[0]), dtype=torch.bool), buffers)
    return sharding.gather(state.params) if sharded else state.params


def _error(fn):
    try:
        fn()
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _init(rank, world, init_file):
    # the workers draw noise with the eager Box-Muller (within a few ulps of the fused kernel the
    # parent's reference runs use; the comparisons with it have a tolerance): compiling the fused
    # kernel costs each fresh process ~15 s on a loaded 2-core machine
    vmapdp.noise.gaussian._fused_ok = False
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))


def review_loads(rank, out, like, sharding):
    """Loads refused on every rank (2 ranks; found by review): a sampler refused on one rank only
    (the other's sampler stays as it was), ranks given different checkpoints, and node-local copies
    one of which is corrupted in a file the other rank would have checked."""
    import shutil

    res = {}
    sampler = PoissonSampler(N + rank, Q, STEPS - 2, key=b"overwritten-by-the-load", capacity=CAPACITY)  # rank 1's: another size
    before = sampler.state_dict()
    # (the 4-rank checkpoint on 2 ranks: with the caller's word that nothing was released after it)
    res["sampler_refused_error"] = _error(lambda: sc.load_sharded(os.path.join(out, "ckpt4"), like=like, sharding=sharding, sampler=sampler, saved_after_last_step=True))
    res["sampler_refused_untouched"] = sampler.state_dict() == before
    state, _, smp = train("mlp", sharded=True, steps=1)
    sc.save_sharded(os.path.join(out, "ckpt1"), state, sharding, sampler=smp)
    sampler = PoissonSampler(N, Q, STEPS - 2, key=b"overwritten-by-the-load", capacity=CAPACITY)
    mine = os.path.join(out, "ckpt4" if rank == 0 else "ckpt1")
    res["different_error"] = _error(lambda: sc.load_sharded(mine, like=like, sharding=sharding, sampler=sampler, saved_after_last_step=True))
    if rank == 0:
        for node in (0, 1):
            shutil.copytree(os.path.join(out, "ckpt4"), os.path.join(out, f"node{node}", "ckpt4"))
        name = sorted(n for n in os.listdir(os.path.join(out, "ckpt4")) if n != "vmapdp-meta")[1]  # (the old split: rank 1 checked it)
        with open(os.path.join(out, "node0", "ckpt4", name), "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 1]))
    dist.barrier()
    res["node_error"] = _error(lambda: sc.load_sharded(os.path.join(out, f"node{rank}", "ckpt4"), like=like, sharding=sharding, sampler=sampler, saved_after_last_step=True))
    return res


def forked_sharded_step(rank):
    """One state stepped twice, with batches whose sums agree on rank 0's shard and differ on rank
    1's: every rank raises (the verdict is collective; found by review: rank 0 returned, rank 1
    raised, and rank 0 then waited in its next collective)."""
    forget_spent_keys()

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2))

        def forward(self, x):
            return (x * self.w).sum(-1)

    apply, params, buffers = vmapdp.functionalize(Two())
    sharding = Sharding(params)
    x = torch.tensor([[0.1, 0.1], [0.1, 0.2], [0.1, 0.3], [0.1, 0.4]])
    step = vmapdp.make_train_step(lambda p, b, s: apply(p, b, s[None]).sum(), optim.sgd(1.0), l2_clip_norm=10.0, noise_multiplier=1.0,
                                  sample_rate=0.5, expected_batch_size=1.0, physical_batch_size=1, compile=False, method="vmap", sharding=sharding)
    state = vmapdp.init_train_state(params, optim.sgd(1.0), seed=SEED, sharding=sharding)
    idx, mask = vdist.shard(torch.tensor([0, 1]), torch.ones(2, dtype=torch.bool), 2)
    step(state, x[idx], mask, buffers)
    idx, mask = vdist.shard(torch.tensor([2, 3]), torch.ones(2, dtype=torch.bool), 2)
    step(state, x[idx], mask, buffers)


def sensitivity_runs():
    """check_sensitivity on the sharded step, every rank with its own rows: rank 0 adds the adversarial
    sample and the distance is summed over the ranks' shards (found by review: every rank added one, and
    each measured its own shards only, which could pass an update that moved too far), at the step's
    bound and at half of it."""
    params, buffers, data, loss_fn, _ = problem("mlp")
    sgd = optim.sgd(0.5)
    sharding = Sharding(params)
    step = vmapdp.make_train_step(loss_fn, sgd, l2_clip_norm=1.0, noise_multiplier=1.1, sample_rate=Q, expected_batch_size=N * Q,
                                  physical_batch_size=4, compile=False, method="ghost", sharding=sharding)
    state = vmapdp.init_train_state(params, sgd, seed=SEED, sharding=sharding)
    rows, mask = torch.arange(4) + 4 * vdist.rank(), torch.tensor([True, True, True, False])
    reports = [vmapdp.audit.check_sensitivity(step, state, gather(data, rows), mask, buffers, lr=0.5, l2_clip_norm=1.0, expected_batch_size=ebs,
                                              raise_on_failure=False) for ebs in (N * Q, 2 * N * Q)]
    return [(r.passed, r.max_distance, r.ratio, r.padding_inert) for r in reports]


def _worker4(rank, world, init_file, out):
    _init(rank, world, init_file)
    try:
        res = {}
        for kind in ("mlp", "gpt2"):
            state, sharding, _ = train(kind, sharded=True)
            res[kind] = summary(state, sharding)
        res["use"] = use_runs(world)
        res["use-uneven"] = summary(*train("mlp", sharded=True, steps=2, unshard="use", batches=uneven_batches())[:2])
        # a checkpoint at step 2 (the MLP, Adam), then resumed on these 4 ranks
        half, sharding, sampler = train("mlp", sharded=True, steps=2)
        sc.save_sharded(os.path.join(out, "ckpt4"), half, sharding, sampler=sampler)
        params, _, _, _, opt = problem("mlp")
        like = vmapdp.init_train_state(params, opt, seed=SEED, sharding=sharding)
        sampler = PoissonSampler(N, Q, STEPS - 2, key=b"overwritten-by-the-load", capacity=CAPACITY)
        loaded = sc.load_sharded(os.path.join(out, "ckpt4"), like=like, sharding=sharding, sampler=sampler)
        res["loaded_equal"] = all(torch.equal(loaded.params[k], half.params[k]) for k in half.params)
        resumed, _, _ = train("mlp", sharded=True, state=loaded, sampler=sampler)
        res["resumed"] = summary(resumed, sharding)
        res.update(mf_adaptive_runs(out, world))
        torch.save(res, os.path.join(out, f"w4-rank{rank}.pt"))
    finally:
        vdist.shutdown()


def _worker2(rank, world, init_file, out):
    _init(rank, world, init_file)
    try:
        res = {}
        for kind in ("mlp", "gpt2"):
            state, sharding, _ = train(kind, sharded=True)
            res[kind] = summary(state, sharding)
        res["use"] = use_runs(world)
        res["use-uneven"] = summary(*train("mlp", sharded=True, steps=2, unshard="use", batches=uneven_batches())[:2])
        res["use-rows"] = rows_step(slice(0, 5) if rank == 0 else slice(5, 13), sharded=True)  # 5 rows here, 8 there
        # the 4-rank checkpoint of step 2, resumed on 2 ranks
        params, _, _, _, opt = problem("mlp")
        sharding = Sharding(params)
        like = vmapdp.init_train_state(params, opt, seed=SEED, sharding=sharding)
        sampler = PoissonSampler(N, Q, STEPS - 2, key=b"overwritten-by-the-load", capacity=CAPACITY)
        # on another world size only with the caller's word that nothing was released after it (a lost step repeated
        # here would not be repeated bit for bit)
        res["world_error"] = _error(lambda: sc.load_sharded(os.path.join(out, "ckpt4"), like=like, sharding=sharding, sampler=sampler))
        loaded = sc.load_sharded(os.path.join(out, "ckpt4"), like=like, sharding=sharding, sampler=sampler, saved_after_last_step=True)
        res["resharded_step"] = loaded.step
        resumed, _, _ = train("mlp", sharded=True, state=loaded, sampler=sampler)
        res["resharded"] = summary(resumed, sharding)
        # a corrupted file: refused on every rank, before anything is restored
        bad = os.path.join(out, "ckpt4-bad")
        if rank == 0:
            import shutil

            shutil.copytree(os.path.join(out, "ckpt4"), bad)
            name = sorted(n for n in os.listdir(bad) if n.endswith(".distcp"))[0]
            with open(os.path.join(bad, name), "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 1]))
        dist.barrier()
        before = sampler.state_dict()
        res["corrupt_error"] = _error(lambda: sc.load_sharded(bad, like=like, sharding=sharding, sampler=sampler, saved_after_last_step=True))
        res["sampler_untouched"] = sampler.state_dict() == before
        # ranks that step different states fail together
        res["seed_error"] = _error(lambda: train("mlp", sharded=True, steps=1, seed=SEED + rank))
        # ... also where each parameter is gathered at its uses (the ranks would make different gathers),
        # and where they gather at different times
        res["use_method_error"] = _error(lambda: train("mlp", sharded=True, steps=1, unshard="use", method="ghost" if rank == 0 else "vmap"))
        res["unshard_error"] = _error(lambda: train("mlp", sharded=True, steps=1, unshard="use" if rank == 0 else "step"))
        # ... and so do ranks whose ledgers differ (same seed and step count, another event on rank 1)
        other = vmapdp.accounting.PoissonGaussianEvent(noise_multiplier=1.1 if rank == 0 else 2.0, sample_rate=Q)
        forged = like._replace(ledger=like.ledger.append(other), step=1)
        res["ledger_error"] = _error(lambda: train("mlp", sharded=True, steps=1, state=forged))
        # an existing checkpoint is never overwritten
        res["exists_error"] = _error(lambda: sc.save_sharded(os.path.join(out, "ckpt4"), loaded, sharding, sampler=sampler))
        res.update(review_loads(rank, out, like, sharding))
        res["fork_error"] = _error(lambda: forked_sharded_step(rank))
        res["fsdp"] = fsdp_run()
        res["secure"] = secure_run()
        res["sensitivity"] = sensitivity_runs()
        # ranks whose states hold other optimizers' states: refused on every rank, by name (found by review: torch's raw
        # CheckpointException)
        p2 = problem("mlp")[0]
        sh2 = Sharding(p2)
        mixed = vmapdp.init_train_state(p2, optim.adam(0.05) if rank == 0 else optim.sgd(0.1, momentum=0.9), seed=SEED, sharding=sh2)
        res["optimizer_error"] = _error(lambda: sc.save_sharded(os.path.join(out, "ckpt-mixed"), mixed, sh2))
        res.update(mf_adaptive_runs(out, world))
        torch.save(res, os.path.join(out, f"w2-rank{rank}.pt"))
        dist.barrier()
        # the faulty run: a checkpoint every 2 steps; rank 1 dies while the step-4 one is written
        root = os.path.join(out, "run")
        real_state_dict = sc._state_dict

        def dying_state_dict(call, state, sharding, *, copy):
            if rank == 1 and state.step == 4:
                os._exit(3)
            return real_state_dict(call, state, sharding, copy=copy)

        sc._state_dict = dying_state_dict

        def checkpoint(state, sharding, sampler):
            if state.step % 2 == 0:
                sc.save_sharded(sc.checkpoint_path(root, state.step), state, sharding, sampler=sampler)

        train("mlp", sharded=True, steps=STEPS + 2, on_step=checkpoint)
    finally:
        vdist.shutdown()


def _worker_restart(rank, world, init_file, out):
    _init(rank, world, init_file)
    try:
        root = os.path.join(out, "run")
        path = sc.latest_checkpoint(root)
        params, _, _, _, opt = problem("mlp")
        sharding = Sharding(params)
        like = vmapdp.init_train_state(params, opt, seed=SEED, sharding=sharding)
        sampler = PoissonSampler(N, Q, STEPS + 2, key=b"overwritten-by-the-load", capacity=CAPACITY)
        state = sc.load_sharded(path, like=like, sharding=sharding, sampler=sampler)
        res = {"path": os.path.basename(path), "listing": sorted(os.listdir(root)), "loaded_step": state.step}
        # the sampler continues where the checkpoint left it: STEPS + 2 - state.step more batches
        sampler.steps = STEPS + 2 - state.step
        final, _, _ = train("mlp", sharded=True, state=state, sampler=sampler)
        res["final"] = summary(final, sharding)
        torch.save(res, os.path.join(out, f"restart-rank{rank}.pt"))
    finally:
        vdist.shutdown()


def _spawn(fn, world, out, tag):
    mp.spawn(fn, args=(world, str(out / f"init-{tag}"), str(out)), nprocs=world, join=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding")
    _spawn(_worker4, 4, out, "w4")
    with pytest.raises(mp.ProcessExitedException, match="exit code 3"):
        _spawn(_worker2, 2, out, "w2")
    _spawn(_worker_restart, 2, out, "restart")
    load = lambda name: torch.load(out / name, weights_only=True)  # noqa: E731
    return {
        "w4": [load(f"w4-rank{r}.pt") for r in range(4)],
        "w2": [load(f"w2-rank{r}.pt") for r in range(2)],
        "restart": [load(f"restart-rank{r}.pt") for r in range(2)],
    }


def _close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
@pytest.mark.parametrize("world", ["w2", "w4"])
def test_sharded_run_equals_one_process(runs, kind, world):
    single, _, _ = train(kind, sharded=False)
    ranks = runs[world]
    for r in ranks:
        _close(r[kind]["params"], single.params)
        assert r[kind]["ledger"] == single.ledger.to_json() and r[kind]["step"] == STEPS
        assert r[kind]["epsilon"] == single.epsilon(DELTA)
        assert r[kind]["run_id"] == single.run_id
    for r in ranks[1:]:  # every rank gathers the same bits
        for k, v in ranks[0][kind]["params"].items():
            assert torch.equal(r[kind]["params"][k], v)


@pytest.mark.parametrize("world", ["w2", "w4"])
def test_gathering_each_parameter_on_use_equals_one_process_with_one_full_parameter_at_a_time(runs, world):
    ranks = runs[world]
    assert sorted(ranks[0]["use"]) == ["gpt2-ghost", "gpt2-" + ("two_pass" if world == "w2" else "vmap"), "mlp-ghost"]
    for tag in ranks[0]["use"]:
        kind, method = tag.split("-")
        single, _, _ = train(kind, sharded=False, method=method)
        for r in ranks:
            run = r["use"][tag]
            _close(run["params"], single.params)
            assert run["ledger"] == single.ledger.to_json() and run["epsilon"] == single.epsilon(DELTA) and run["step"] == STEPS
            if method == "ghost":  # the same bits as the step that gathers the whole model (the same values, the same ops)
                assert all(torch.equal(run["params"][k], r[kind]["params"][k]) for k in run["params"])
            # each parameter is gathered at its uses (in the forward, and again in the backward where
            # an input grad needs it), not the whole model once per step ...
            assert run["gathers"] > STEPS * len(single.params)
            # ... and freed before the next is gathered: never two full parameters at once
            assert run["peak_gathered"] == 1 and run["alive_after"] == 0


@pytest.mark.parametrize("world", ["w2", "w4"])
def test_gathering_on_use_when_the_ranks_shares_span_different_numbers_of_chunks(runs, world):
    # a global batch one row past the ranks' capacity: rank 0's share spans two chunks, the others'
    # one; every rank must still make the same gathers and reduce-scatters (else: a hang, or sums of
    # parameters of one size paired up wrongly), and the run equals one process
    single, _, _ = train("mlp", sharded=False, steps=2, batches=uneven_batches())
    w = len(runs[world])
    indices, mask = uneven_batches()[0]
    c = vdist.local_capacity(CAPACITY, w)
    assert [len(vdist.shard(indices, mask, CAPACITY, rank=r, world_size=w)[0]) for r in range(w)] == [2 * c] + [c] * (w - 1)
    for r in runs[world]:
        _close(r["use-uneven"]["params"], single.params)
        assert r["use-uneven"]["ledger"] == single.ledger.to_json() and r["use-uneven"]["step"] == 2


def test_gathering_on_use_with_different_row_counts_pairs_each_sum_with_its_own(runs):
    # physical_batch_size=None, 5 rows on rank 0 and 8 on rank 1: ghost forms the sums in another
    # order on each rank (a's kept on rank 0 only); every reduce-scatter must still pair a param's
    # sum with the same param's (a.weight and r.weight, both 4x4, were silently swapped)
    single = rows_step(slice(0, 13), sharded=False)
    for r in runs["w2"]:
        _close(r["use-rows"], single)


@pytest.mark.parametrize("world", ["w2", "w4"])
def test_each_rank_holds_its_share_of_params_and_optimizer_state(runs, world):
    ranks = runs[world]
    w = len(ranks)
    for kind in ("mlp", "gpt2"):
        single, _, _ = train(kind, sharded=False, steps=1)
        full_p, full_o = local_bytes(single.params), local_bytes(single.opt_state)
        replicated = 4  # the optimizer's float32 step count, on every rank
        assert sum(r[kind]["param_bytes"] for r in ranks) == full_p  # no padding is stored
        assert sum(r[kind]["opt_bytes"] for r in ranks) == full_o + (w - 1) * replicated
        slack = 4 * len(single.params)  # at most one element per parameter above an even split
        for r in ranks:
            assert r[kind]["param_bytes"] <= full_p / w + slack
            assert r[kind]["opt_bytes"] <= (full_o - replicated) / w + replicated + slack * (len(optree.tree_leaves(single.opt_state, namespace="torch")) // len(single.params))


def test_checkpoint_resumes_bitwise_on_the_same_world(runs):
    for r in runs["w4"]:
        assert r["loaded_equal"]
        for k, v in r["mlp"]["params"].items():
            assert torch.equal(r["resumed"]["params"][k], v)
        assert r["resumed"]["ledger"] == r["mlp"]["ledger"]


def test_checkpoint_of_four_ranks_resumes_on_two(runs):
    single, _, _ = train("mlp", sharded=False)
    for r in runs["w2"]:
        assert "saved by 4 ranks and this world has 2" in r["world_error"] and "saved_after_last_step=True" in r["world_error"]
        assert r["resharded_step"] == 2
        _close(r["resharded"]["params"], single.params)
        assert r["resharded"]["ledger"] == single.ledger.to_json()
        assert r["resharded"]["epsilon"] == single.epsilon(DELTA)


def test_corrupted_checkpoint_is_refused_on_every_rank(runs):
    errors = [r["corrupt_error"] for r in runs["w2"]]
    assert all(e is not None for e in errors)
    assert any("integrity check failed" in e and ".distcp" in e for e in errors)
    assert all("integrity check failed" in e or "failed on another rank" in e for e in errors)
    assert all(r["sampler_untouched"] for r in runs["w2"])
    # ... and a corrupted node-local copy, whichever rank's share the file was (every rank checks every file)
    errors = [r["node_error"] for r in runs["w2"]]
    assert "integrity check failed" in errors[0] and "failed on another rank" in errors[1]


def test_a_load_refused_on_one_rank_leaves_every_sampler_and_ranks_read_one_checkpoint(runs):
    first, second = runs["w2"]
    assert "num_samples" in second["sampler_refused_error"] and "failed on another rank" in first["sampler_refused_error"]
    assert first["sampler_refused_untouched"] and second["sampler_refused_untouched"]
    for r in runs["w2"]:
        assert "the ranks disagree on the checkpoint" in r["different_error"]


def test_a_forked_sharded_state_is_refused_on_every_rank(runs):
    for r in runs["w2"]:
        assert r["fork_error"] is not None and "already released step 0 of this run" in r["fork_error"], r["fork_error"]


def test_ranks_that_disagree_fail_together_and_checkpoints_are_not_overwritten(runs):
    for r in runs["w2"]:
        assert r["seed_error"] is not None and "disagree on the state's noise seed, step, run and ledger" in r["seed_error"]
        assert r["ledger_error"] is not None and "disagree on the state's noise seed, step, run and ledger" in r["ledger_error"]
        for key in ("use_method_error", "unshard_error"):  # refused before the first gather, not a hang
            assert r[key] is not None and "the ranks disagree on the state's noise seed, step, run and ledger" in r[key], key
        assert r["exists_error"] is not None and "never overwritten" in r["exists_error"]


def test_restart_after_a_rank_died_mid_checkpoint_equals_an_uninterrupted_run(runs):
    uninterrupted, _, _ = train("mlp", sharded=False, steps=STEPS + 2)
    for r in runs["restart"]:
        # the step-4 save was interrupted: its temporary directory is left, no step-4 checkpoint
        assert r["path"] == "step-000000002" and r["loaded_step"] == 2
        assert "step-000000004" not in r["listing"] and any(n.startswith("step-000000004.tmp-") for n in r["listing"])
        _close(r["final"]["params"], uninterrupted.params)
        assert r["final"]["ledger"] == uninterrupted.ledger.to_json()  # every step counted once
        assert json.loads(r["final"]["ledger"]) and r["final"]["step"] == STEPS + 2
        assert r["final"]["epsilon"] == uninterrupted.epsilon(DELTA)


def test_a_fully_shard_model_trains_through_the_sharded_step_and_takes_the_params_back(runs):
    single, _, _ = train("mlp", sharded=False)
    model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
    model.load_state_dict(single.params)
    expected = model(X_FORWARD).detach()
    for r in runs["w2"]:
        f = r["fsdp"]
        _close(f["summary"]["params"], single.params)  # the same initial params (read shard by shard), the same noise
        assert f["summary"]["ledger"] == single.ledger.to_json() and f["summary"]["run_id"] == single.run_id
        assert f["bad_error"] is not None and "the shard of '0.bias' has shape" in f["bad_error"] and f["untouched"]
        assert f["still_fsdp"]
        torch.testing.assert_close(f["forward"], expected, rtol=1e-5, atol=1e-6)  # FSDP2's own forward, trained params
        assert f["params_are_shards"] and f["local_elements"] < sum(v.numel() for v in single.params.values())
        assert f["dtensor_error"] is not None and "FSDP2 DTensor shards" in f["dtensor_error"] and "sharding=Sharding(params)" in f["dtensor_error"]
        for err in f["curvature_errors"]:
            assert err is not None and err.startswith("ValueError") and "FSDP2 DTensor shards" in err and "full_tensor()" in err, err
        assert f["make_private_error"] is not None and f["make_private_error"].startswith("ValueError") and "fully_shard" in f["make_private_error"], f["make_private_error"]
        assert f["make_private_untouched"]
        assert f["unsharded_error"] is not None and f["unsharded_error"].startswith("ValueError") and "reshard()" in f["unsharded_error"], f["unsharded_error"]
        assert f["resharded_are_shards"]
        assert f["validate_error"] is not None and f["validate_error"].startswith("ValueError") and "fully_shard" in f["validate_error"], f["validate_error"]
        _close(f["use_summary"]["params"], single.params)
        assert f["use_summary"]["run_id"] == single.run_id


def _chi2_p(z, std):
    """Two-sided p-value of sum((z/std)^2) under chi-square with z.numel() degrees of freedom."""
    from scipy import stats

    t = float(((z.double() / std) ** 2).sum())
    return 2 * min(stats.chi2.cdf(t, z.numel()), stats.chi2.sf(t, z.numel()))


def test_secure_sharded_noise_has_the_right_std_differs_per_owner_and_the_ledger_is_global(runs):
    ranks = [r["secure"] for r in runs["w2"]]
    params = secure_problem()[0]
    noise = [[torch.cat([n[k] for k in params]) for n in r["noises"]] for r in ranks]  # [rank][step]: that rank's shards
    assert sum(x.numel() for x in (noise[0][0], noise[1][0])) == sum(v.numel() for v in params.values())
    # the std of every owner's noise at every step: chi-square, false alarm 1e-4 for the 4 tests together
    alpha = 1e-4 / (len(ranks) * SECURE_STEPS)
    for rank in noise:
        for z in rank:
            assert _chi2_p(z, SECURE_STD) > alpha
    # no two owners (and no two steps) share noise: not equal, and uncorrelated (|r| < 5 / sqrt(m): false alarm < 1e-6)
    pairs = [(noise[0][0], noise[1][0]), (noise[0][1], noise[1][1]), (noise[0][0], noise[0][1]), (noise[1][0], noise[1][1])]
    for a, b in pairs:
        m = min(a.numel(), b.numel())
        a, b = a[:m].double(), b[:m].double()
        assert not torch.equal(a, b) and not torch.equal(a, -b)
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 5 / m**0.5
    # the ledger: that of the unsharded secure run, on every rank; no seed is held
    _, buffers, step, state = secure_step(None)
    for _ in range(SECURE_STEPS):
        state, _ = step(state, torch.randn(4, 200), torch.ones(4, dtype=torch.bool), buffers)
    for r in ranks:
        assert r["seed"] is None and r["ledger"] == state.ledger.to_json() and r["epsilon"] == state.epsilon(DELTA)
    assert state.step == SECURE_STEPS and state.epsilon(DELTA) > 0


@pytest.fixture(scope="module")
def singles():
    """The one-process runs of RUNS (4 steps, and 2 for the secure ledgers), drawing noise with the
    eager Box-Muller as the ranks do: the same bits, so the noise buffers compare bitwise."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(vmapdp.noise.gaussian, "_fused_ok", False)
        out = {tag: train("mlp", sharded=False, **kw)[0] for tag, kw in RUNS.items()}
        out.update({f"{tag}-2": train("mlp", sharded=False, steps=2, **RUNS[tag])[0] for tag in ("banded", "adaptive")})
    return out


def _noise_slices_are_bitwise(r, single):
    """This rank's correlated-noise buffers are the slices [:, start:stop] of the one-process ones."""
    assert r["noise_t"] == single.noise_state["t"]
    for k, full in single.noise_state["buffers"].items():
        start, stop = r["bounds"][k]
        assert torch.equal(r["buffers"][k], full.flatten(1)[:, start:stop]), k


def _equals_one_process(r, single, tag):
    _close(r["params"], single.params)  # the sums differ in summation order only
    assert r["ledger"] == single.ledger.to_json() and r["epsilon"] == single.epsilon(DELTA) and r["run_id"] == single.run_id
    if tag == "adaptive":
        torch.testing.assert_close(r["clip_norm"], single.clip_norm, rtol=1e-6, atol=0)
    else:
        _noise_slices_are_bitwise(r, single)


@pytest.mark.parametrize("tag", list(RUNS))
@pytest.mark.parametrize("world", ["w2", "w4"])
def test_correlated_noise_and_adaptive_clipping_on_shards_equal_one_process(runs, singles, world, tag):
    single, ranks = singles[tag], runs[world]
    for r in ranks:
        assert r[tag]["step"] == STEPS
        _equals_one_process(r[tag], single, tag)
    if tag == "adaptive":  # one noisy count for all ranks: the same next clip norm, bitwise; it moved
        assert all(torch.equal(r[tag]["clip_norm"], ranks[0][tag]["clip_norm"]) for r in ranks)
        assert float(single.clip_norm) != 1.0
    else:  # each rank holds its shards' buffers only: together exactly the one-process buffers
        assert single.noise_state["buffers"]["0.weight"].shape[0] == 2  # (band 3 / two thetas: 2 rows)
        total = sum(v.numel() for v in single.noise_state["buffers"].values())
        assert sum(v.numel() for r in ranks for v in r[tag]["buffers"].values()) == total
        slack = 2 * 4 * len(single.params)  # at most one float32 element per row and parameter above an even split
        assert all(local_bytes(r[tag]["buffers"]) <= local_bytes(single.noise_state["buffers"]) / len(ranks) + slack for r in ranks)


def test_noise_state_and_clip_norm_checkpoints_resume_bitwise_and_on_another_world(runs, singles):
    for r in runs["w4"]:  # step 2 saved and loaded on 4 ranks: bitwise the saved state, and the resumed run continues bit for bit
        for tag in ("blt", "adaptive"):
            assert r[f"{tag}-loaded_equal"]
            resumed, whole = r[f"{tag}-resumed"], r[tag]
            assert all(torch.equal(resumed["params"][k], v) for k, v in whole["params"].items())
            assert resumed["ledger"] == whole["ledger"]
            if tag == "blt":
                assert all(torch.equal(resumed["buffers"][k], v) for k, v in whole["buffers"].items())
            else:
                assert torch.equal(resumed["clip_norm"], whole["clip_norm"])
    for r in runs["w2"]:  # the same checkpoints read into 2 ranks' shards (the buffers reshard like the params)
        for tag in ("blt", "adaptive"):
            assert r[f"{tag}-resharded_step"] == 2
            _equals_one_process(r[f"{tag}-resharded"], singles[tag], tag)


def test_secure_correlated_noise_and_adaptive_clipping_on_shards(runs, singles):
    ranks = [r["adaptive-secure"] for r in runs["w2"]]
    # each owner drew its own gradient noise, but rank 0 drew the one count: the same clip norm everywhere
    # (a second step ran, so the ranks also passed its agreement check on the clip norm), and it moved
    assert torch.equal(ranks[0]["clip_norm"], ranks[1]["clip_norm"]) and float(ranks[0]["clip_norm"]) != 1.0
    assert all(r["ledger"] == singles["adaptive-2"].ledger.to_json() for r in ranks)
    ranks = [r["banded-secure"] for r in runs["w2"]]
    assert all(r["noise_t"] == 2 and r["ledger"] == singles["banded-2"].ledger.to_json() for r in ranks)
    # the oldest row of the buffers is y_1 = z_1 (c_0 = 1): standard normal over the owners' shards together
    # (chi-square, false alarm 1e-4), and not the keyed one-process draw
    y1 = torch.cat([r["buffers"][k][1] for r in ranks for k in r["buffers"]])
    assert y1.numel() == sum(v.numel() for v in singles["banded"].params.values()) and _chi2_p(y1, 1.0) > 1e-4
    keyed = torch.cat([singles["banded-2"].noise_state["buffers"][k][1].reshape(-1)[slice(*r["bounds"][k])] for r in ranks for k in r["buffers"]])
    assert not torch.equal(y1, keyed)


# ---- in one process ----


BAND16 = BandedToeplitz(tuple(0.8**k for k in range(16)))  # 15 buffer rows: a matrix product over them rounds slices differently


@pytest.mark.parametrize("noise", [*MF, "band16"])
def test_each_owner_releases_the_slice_of_the_one_process_correlated_noise_bitwise(noise):
    """White-box: the bound privatizer on each rank's shards of a sum, over 3 steps, releases the
    slices of the one-process release and keeps the slices of its buffers, bit for bit."""
    params = problem("gpt2")[0]
    g = torch.Generator().manual_seed(3)
    sums = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(3)]
    strategy = BAND16 if noise == "band16" else MF[noise]
    priv = correlated_noise(strategy, steps=STEPS)

    def bound(**layout):
        s = CyclicPoissonSampler(N, MF_Q, 16, STEPS, key=SAMPLER_KEY) if noise == "band16" else make_sampler(noise, STEPS)
        return priv.bind("test", noise_multiplier=1.1, l2_sensitivity=1.0, sample_rate=MF_Q, sampler=s, secure=False, **layout)[0]

    one, state, released = bound(), priv.init(params), []
    for t, summed in enumerate(sums):
        out, state = one.privatize(summed, state, b"step-%d" % t)
        released.append(out)
    for world in (2, 3, 4):
        for rank in range(world):
            sharding = Sharding(params, rank=rank, world_size=world)
            mine, shard_state = bound(offsets=sharding.offsets), priv.init(sharding.shard(params))
            for t, summed in enumerate(sums):
                out, shard_state = mine.privatize(sharding.shard(summed), shard_state, b"step-%d" % t)
                for k in params:
                    start, stop = sharding.bounds(k)
                    assert torch.equal(out[k], released[t][k].reshape(-1)[start:stop]), (noise, world, rank, t, k)
            for k, full in state["buffers"].items():
                start, stop = sharding.bounds(k)
                assert torch.equal(shard_state["buffers"][k], full.flatten(1)[:, start:stop])
            assert int(shard_state["t"]) == int(state["t"]) == 3


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_shard_gets_the_slice_of_the_single_process_noise_bitwise(world):
    params = problem("gpt2")[0]
    full = add_noise({k: torch.zeros_like(v) for k, v in params.items()}, 1.0, key=b"step-key")
    for rank in range(world):
        sharding = Sharding(params, rank=rank, world_size=world)
        shards = sharding.shard({k: torch.zeros_like(v) for k, v in params.items()})
        noisy = add_noise(shards, 1.0, key=b"step-key", offsets=sharding.offsets)
        for k in params:
            start, stop = sharding.bounds(k)
            assert torch.equal(noisy[k], full[k].reshape(-1)[start:stop]), (k, rank)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_the_shards_partition_every_parameter(world):
    params = {"w": torch.randn(5, 3), "b": torch.randn(2), "s": torch.randn(())}
    pieces = {k: [] for k in params}
    for rank in range(world):
        sharding = Sharding(params, rank=rank, world_size=world)
        assert sharding.names == ("w", "b", "s")
        for k, v in sharding.shard(params).items():
            assert v.shape == sharding.local_shape(k) and v.numel() <= -(-params[k].numel() // world)
            pieces[k].append(v)
    for k, v in params.items():
        assert torch.equal(torch.cat(pieces[k]), v.reshape(-1))


def test_bad_arguments_are_refused_with_the_fix(tmp_path):
    params, _, _, loss_fn, opt = problem("mlp")
    with pytest.raises(TypeError, match=r"sharding must be a vmapdp\.sharding\.Sharding"):
        vmapdp.init_train_state(params, opt, seed=1, sharding="rows")
    with pytest.raises(ValueError, match="rank 1 of 2, this process is rank 0 of 1"):
        vmapdp.init_train_state(params, opt, seed=1, sharding=Sharding(params, rank=1, world_size=2))
    with pytest.raises(ValueError, match="offsets= places each leaf in a keyed stream and needs key="):
        add_noise({"a": torch.zeros(3)}, 1.0, secure=True, offsets={"a": 1})
    with pytest.raises(ValueError, match="must be a pytree like the tree"):
        add_noise({"a": torch.zeros(3)}, 1.0, key=b"k", offsets={"b": 1})
    with pytest.raises(ValueError, match="expected the names"):
        Sharding(params).shard({"x": torch.zeros(2)})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        sharding = Sharding(params)
        with pytest.raises(TypeError, match=r"state must be a vmapdp\.TrainState, got dict"):  # (found by review: an AttributeError)
            sc.save_sharded(tmp_path / "not-a-state", {"params": params}, sharding)
        with pytest.raises(ValueError, match=r"unshard='layer'.*one of 'step', 'use'"):
            Sharding(params, unshard="layer")
        per_use = Sharding(params, unshard="use")
        with pytest.raises(ValueError, match=r"compile=True with Sharding\(unshard='use'\).*Pass compile=False"):
            vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=Q, expected_batch_size=12.0, sharding=per_use, method="ghost")
        with pytest.raises(ValueError, match=r"method='auto' with Sharding\(unshard='use'\).*Name the method"):
            vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=Q, expected_batch_size=12.0, sharding=per_use, compile=False)
        # an optimizer whose update of a coordinate reads others cannot update slices (found by review: Adafactor)
        with pytest.raises(ValueError, match=r"from_torch\[torch.optim.Adafactor\] is not known to be one.*Use vmapdp.optim's sgd"):
            vmapdp.make_train_step(loss_fn, vmapdp.optim.from_torch(torch.optim.Adafactor), l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=Q,
                                   expected_batch_size=12.0, sharding=sharding, compile=False)
        vmapdp.make_train_step(loss_fn, vmapdp.optim.from_torch(torch.optim.RMSprop, lr=0.1), l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=Q,
                               expected_batch_size=12.0, sharding=sharding, compile=False)
        with pytest.raises(ValueError, match="has no bind hook that takes offsets=.*Leave privatizer=None"):
            vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=Q, expected_batch_size=12.0,
                                   sharding=sharding, privatizer=vmapdp.noise.gaussian_privatizer(1.0))
        priv = correlated_noise(MF["banded"], steps=STEPS)
        bound = priv.bind("test", noise_multiplier=1.0, l2_sensitivity=1.0, sample_rate=MF_Q, sampler=make_sampler("banded", STEPS), secure=False)[0]
        with pytest.raises(ValueError, match="already bound"):  # its own refusal, not the shard layout's
            vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sampler=make_sampler("banded", STEPS), sharding=sharding, privatizer=bound)
        with pytest.raises(ValueError, match="no published analysis covers the pair"):  # still refused, sharded or not
            vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sampler=make_sampler("banded", STEPS), sharding=sharding,
                                   privatizer=priv, adaptive_clipping=ADAPTIVE)
        mf_sampler = make_sampler("banded", STEPS)
        mf_step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sampler=mf_sampler,
                                         sharding=sharding, privatizer=priv, compile=False, method="ghost")
        # the step's batch is this rank's share of a draw of its own sampler (an undrawn one is refused first)
        indices, mask = vdist.shard(*mf_sampler.sample(), mf_sampler.capacity)
        unsharded = vmapdp.init_train_state(params, opt, seed=1, privatizer=priv)._replace(params=sharding.shard(params))
        opt_state = opt.init(unsharded.params)
        with pytest.raises(ValueError, match=r"the buffer of .* privatizer=, sharding=\) for a sharded step"):
            mf_step(unsharded._replace(opt_state=opt_state), gather(problem("mlp")[2], indices), mask, problem("mlp")[1])
        state = vmapdp.init_train_state(params, opt, seed=1)  # unsharded: the step refuses it
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=Q, expected_batch_size=12.0,
                                      sharding=sharding, compile=False, method="ghost")
        _, buffers, data, _, _ = problem("mlp")
        with pytest.raises(ValueError, match="the shard of .* has shape"):
            step(state, gather(data, torch.arange(4)), torch.ones(4, dtype=torch.bool), buffers)
        # writing params back: into a module with other parameters, or an FSDP2 layout other than Shard(0) on a 1-D mesh
        shards = sharding.shard({k: v + 1 for k, v in params.items()})
        with pytest.raises(ValueError, match="are not the sharded ones"):
            sharding.write_to_module(nn.Linear(2, 2), shards)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)), shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
        before = [p.to_local().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=r"'0.weight' is sharded \(Shard\(dim=1\),\).*only fully_shard's default layout"):
            sharding.write_to_module(model, shards)
        assert all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
        plain = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))  # a plain module takes the full values
        sharding.write_to_module(plain, shards)
        assert all(torch.equal(p, params[k] + 1) for k, p in plain.named_parameters())
        with pytest.raises(ValueError, match="no vmapdp-meta"):
            sc.load_sharded(tmp_path, like=vmapdp.init_train_state(params, opt, seed=1, sharding=sharding), sharding=sharding)
        # saved_after_last_step=True beside a save of a later step (an interrupted one: latest_checkpoint skips it) is refused
        fresh = vmapdp.init_train_state(params, opt, seed=1, sharding=sharding)
        sc.save_sharded(sc.checkpoint_path(tmp_path / "run", 0), fresh, sharding)
        os.makedirs(sc.checkpoint_path(tmp_path / "run", 1) + ".tmp-ab")
        assert sc.latest_checkpoint(tmp_path / "run") == sc.checkpoint_path(tmp_path / "run", 0)
        for step in (999_999_999, 10**9):  # by number, not by name (the names outgrow 9 digits; found by review)
            os.makedirs(sc.checkpoint_path(tmp_path / "late", step))
            open(os.path.join(sc.checkpoint_path(tmp_path / "late", step), sc._META), "w").close()
        assert sc.latest_checkpoint(tmp_path / "late") == sc.checkpoint_path(tmp_path / "late", 10**9)
        with pytest.raises(ValueError, match=r"step-000000001.tmp-ab is a save of step 1, after this checkpoint's step 0 \(interrupted\)"):
            sc.load_sharded(sc.latest_checkpoint(tmp_path / "run"), like=fresh, sharding=sharding, saved_after_last_step=True)
        assert sc.load_sharded(sc.latest_checkpoint(tmp_path / "run"), like=fresh, sharding=sharding).step == 0
        # a correlated-noise checkpoint saved before noise states had an owner (found by review: refused as "another
        # optimizer or noise state") loads into a like that has one, the owner bound by load
        mf_fresh = vmapdp.init_train_state(params, opt, seed=1, privatizer=priv, sharding=sharding)
        sc.save_sharded(tmp_path / "pre-owner", mf_fresh._replace(noise_state={k: v for k, v in mf_fresh.noise_state.items() if k != "owner"}), sharding)
        assert torch.equal(sc.load_sharded(tmp_path / "pre-owner", like=mf_fresh, sharding=sharding).noise_state["owner"], torch.zeros(32, dtype=torch.uint8))
        # a from_torch optimizer's state is made by its first update: a fresh like has no layout for it (named, not "another optimizer")
        rms = optim.from_torch(torch.optim.RMSprop, lr=0.01)
        lazy = vmapdp.init_train_state(params, rms, seed=1, sharding=sharding)
        _, opt_state = rms.update({k: torch.ones_like(v) for k, v in lazy.params.items()}, lazy.opt_state, lazy.params)
        sc.save_sharded(tmp_path / "rms", lazy._replace(opt_state=opt_state), sharding)
        with pytest.raises(ValueError, match=r"fresh optim.from_torch one.*sgd, adam or adamw"):
            sc.load_sharded(tmp_path / "rms", like=lazy, sharding=sharding)
        # a noise state (identity's: buffers of 0 rows) is saved; a run without it (or with another one) cannot load it
        for name, other in (("identity", "banded"), ("banded", None)):
            priv = correlated_noise(MF[name], steps=STEPS)
            state = vmapdp.init_train_state(params, opt, seed=1, privatizer=priv, sharding=sharding)
            state = state._replace(noise_state={**state.noise_state, "buffers": {k: torch.randn_like(v) for k, v in state.noise_state["buffers"].items()}})
            sc.save_sharded(tmp_path / name, state, sharding)
            loaded = sc.load_sharded(tmp_path / name, like=vmapdp.init_train_state(params, opt, seed=1, privatizer=priv, sharding=sharding), sharding=sharding)
            assert same_state(loaded, state)
            other = None if other is None else correlated_noise(MF[other], steps=STEPS)
            like = vmapdp.init_train_state(params, opt, seed=1, privatizer=other, sharding=sharding)
            with pytest.raises(ValueError, match=r"tensors do not fit this run's state .*init_train_state\(\.\.\., privatizer=\)"):
                sc.load_sharded(tmp_path / name, like=like, sharding=sharding)
    finally:
        vdist.shutdown()


def test_a_gathered_on_use_param_never_leaks_its_gathered_buffer_nor_takes_a_write(monkeypatch):
    """White-box, one process: each gather is a fresh buffer (as on W ranks). Ops that return views of
    a param (unsafe_split, view(dtype), view_as_complex included) give another gathered-on-use
    tensor, never a plain tensor on the gathered buffer (which autograd would then save whole); an
    in-place write into a param (it would go to a temporary gather and be lost, and the forward
    would use the unwritten value) is refused with the fix."""
    from vmapdp.sharding import _GatheredOnUse

    buffers = []

    def gather_one(self, name, shard):
        every = shard.clone()
        buffers.append(every.untyped_storage().data_ptr())
        return every.view(self.shapes[name])

    monkeypatch.setattr(Sharding, "gather_one", gather_one)
    w = torch.randn(4, 6)
    params = Sharding({"w": w}, unshard="use").step_params({"w": w.reshape(-1)})
    views = {
        "unsafe_split": lambda t: t.unsafe_split(2, 1)[1], "unsafe_chunk": lambda t: torch.unsafe_chunk(t, 3, 1)[2],
        "view(dtype)": lambda t: t.view(torch.int32), "view_as_complex": lambda t: torch.view_as_complex(t.view(4, 3, 2)),
        "split": lambda t: t.split([1, 3])[1], "narrow": lambda t: t.narrow(1, 2, 3),
    }
    for tag, op in views.items():
        out = op(params["w"])
        assert isinstance(out, _GatheredOnUse), tag
        assert torch.equal(out.full(), op(w)), tag
        assert not any(isinstance(o, torch.Tensor) and type(o) is torch.Tensor and o.untyped_storage().data_ptr() in buffers for o in [out]), tag
    for write in {"mul_": lambda t: t.mul_(2), "clamp_": lambda t: t.clamp_(max=0.5), "t_": lambda t: t.t_(), "copy_": lambda t: t.copy_(torch.zeros(4, 6))}.values():
        with pytest.raises(RuntimeError, match=r"writes into the parameter 'w' in place.*unshard='step'"):
            write(params["w"])


@pytest.mark.parametrize("keep_elements", [0, 40])  # 40: only 0.bias (5 x 6) is kept
def test_the_sink_takes_every_sum_once_in_the_params_order_whatever_ghost_kept(monkeypatch, keep_elements):
    """The sharded step's sink is a collective: every rank must call it for the same params in the
    same order, whichever per-sample grads ghost kept (the keep budget depends on the row count)."""
    from dataclasses import replace

    from vmapdp.ghost import limits

    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, keep_elements=keep_elements, keep_ratio=0.0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    apply, params, buffers = vmapdp.functionalize(model)
    params = {k: params[k] for k in ("2.weight", "0.bias", "0.weight", "2.bias")}  # not the module's order

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    seen = []
    fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=0.5, method="ghost")
    summed, _, _ = fn(params, buffers, batch, sink=lambda k, v: seen.append(k) or -v)
    expected, _, _ = fn(params, buffers, batch)
    assert seen == list(params)
    for k in params:
        assert torch.equal(summed[k], -expected[k])


def test_write_to_module_refuses_a_plain_module_of_other_shapes_before_writing():
    """A plain module whose parameter has another shape than the sharding's: refused before any
    write (the check compared the module's parameter with itself: the (1,) bias was broadcast into
    the module's (4,) one, silently, and the weight written; found in review)."""
    torch.manual_seed(0)
    src = nn.Linear(5, 4)
    src.bias = nn.Parameter(torch.randn(1))
    _, params, _ = vmapdp.functionalize(src)
    sharding = Sharding(params, rank=0, world_size=1)
    dst = nn.Linear(5, 4)
    before = {k: v.detach().clone() for k, v in dst.named_parameters()}
    err = _error(lambda: sharding.write_to_module(dst, sharding.shard(params)))
    assert err is not None and "'bias'" in err and "(4,)" in err, err
    assert all(torch.equal(p, before[k]) for k, p in dst.named_parameters())


def _other_shapes_worker(rank, world, init_file, out):
    """The sharding of a Linear(5, 8), a fully_shard Linear(5, 9) (rank 0 holds 5 rows, rank 1 4:
    rank 1's rows fit). Each rank's error, and whether the module was left untouched."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    _, params, _ = vmapdp.functionalize(nn.Linear(5, 8))
    sharding = Sharding(params)
    module = fully_shard(nn.Linear(5, 9), mesh=init_device_mesh("cpu", (world,)))
    before = {k: p.to_local().clone() for k, p in module.named_parameters()}
    err = _error(lambda: sharding.write_to_module(module, sharding.shard(params)))
    untouched = all(torch.equal(p.to_local(), before[k]) for k, p in module.named_parameters())
    dist.barrier()  # (both ranks still in step)
    torch.save({"error": err, "untouched": untouched}, os.path.join(out, f"other-shapes-{rank}.pt"))
    vdist.shutdown()


def test_write_to_module_refuses_an_fsdp_module_of_other_shapes_on_every_rank(tmp_path):
    """The refusal must not depend on the rank's rows: rank 0 refused (5 rows held, 4 expected)
    while rank 1 (4 and 4) went on into the first parameter's all_gather alone (a dead peer or a
    hang; found in review). The full shapes are compared, the same on every rank."""
    mp.spawn(_other_shapes_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        res = torch.load(tmp_path / f"other-shapes-{r}.pt", weights_only=True)
        assert res["error"] is not None and "'weight'" in res["error"] and "(9, 5)" in res["error"] and "(8, 5)" in res["error"], res["error"]
        assert res["untouched"]


def _chunking_worker(rank, world, init_file, out, setting):
    """One unshard='use' step of the MLP on 4 rows per rank, the ranks told different chunk sizes
    (``setting``: physical_batch_size, or two_pass's norm_chunk_size). Each rank's error."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        params, buffers, data, loss_fn, opt = problem("mlp")
        sharding = Sharding(params, unshard="use")
        kw = {"physical_batch_size": 2 if rank == 0 else 4, "method": "ghost"} if setting == "physical_batch_size" else {"norm_chunk_size": 2 if rank == 0 else 4, "method": "two_pass"}
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.1, sample_rate=Q, expected_batch_size=N * Q, compile=False, sharding=sharding, **kw)
        state = vmapdp.init_train_state(params, opt, seed=SEED, sharding=sharding)
        rows = slice(4 * rank, 4 * rank + 4)
        err = _error(lambda: step(state, (data[0][rows], data[1][rows]), torch.ones(4, dtype=torch.bool), buffers))
        torch.save({"error": err}, os.path.join(out, f"chunking-{rank}.pt"))
    finally:
        vdist.shutdown()


@pytest.mark.parametrize("setting", ["physical_batch_size", "norm_chunk_size"])
def test_gathering_on_use_ranks_that_chunk_differently_fail_together(tmp_path, setting):
    """With unshard='use' every chunk (and two_pass's norm chunk) makes its own gathers and
    reduce-scatters, so ranks told different chunk sizes make different collectives: they must be
    refused together with the same-state error, before the first gather (found in review: both
    ranks waited in gloo until its timeout; with unshard='step' such ranks equal one process)."""
    mp.spawn(_chunking_worker, args=(2, str(tmp_path / "init"), str(tmp_path), setting), nprocs=2, join=True)
    for r in range(2):
        err = torch.load(tmp_path / f"chunking-{r}.pt", weights_only=True)["error"]
        assert err is not None and "the ranks disagree" in err and setting in err, err


def _order_worker(rank, world, init_file, out, unshard):
    """One sharded ghost step of two 4x4 weights, rank 1's params dict in the reverse order (its
    Sharding then lays out, gathers and reduce-scatters the params in another order). Each rank's
    error, and the full params it gathers after the step if there was none."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        apply, params, buffers = vmapdp.functionalize(nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False)))
        if rank == 1:
            params = dict(reversed(list(params.items())))

        def loss_fn(p, b, sample):
            x, y = sample
            return F.cross_entropy(apply(p, b, x[None]), y[None])

        opt, sharding = optim.sgd(1.0), Sharding(params, unshard=unshard)
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, expected_batch_size=1.0,
                                      compile=False, method="ghost", sharding=sharding)
        state = vmapdp.init_train_state(params, opt, seed=SEED, sharding=sharding)
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(8, 4, generator=g)[4 * rank : 4 * rank + 4], torch.randint(0, 4, (8,), generator=g)[4 * rank : 4 * rank + 4]
        res = {"error": None, "params": None}
        try:
            state, _ = step(state, (x, y), torch.ones(4, dtype=torch.bool), buffers)
            res["params"] = sharding.gather(state.params)
        except (ValueError, RuntimeError) as err:
            res["error"] = f"{type(err).__name__}: {err}"
        torch.save(res, os.path.join(out, f"order-{rank}.pt"))
    finally:
        vdist.shutdown()


@pytest.mark.parametrize("unshard", ["step", "use"])
def test_ranks_whose_params_are_in_another_order_fail_together(tmp_path, unshard):
    """The shards are laid out, gathered (unshard='step': one buffer per dtype in the params' order)
    and reduce-scattered (unshard='use': one parameter at a time, in the params' order) by the order
    of the params dict: ranks whose dicts list the same params in another order (a dict built from a
    set: hash-randomised per process) must be refused together. Found in review: they released
    silently, each rank's sum of one 4x4 weight added into the other's shard, and the ranks then
    gathered different models (a max abs difference of 1.2 to 2.7 from one process)."""
    mp.spawn(_order_worker, args=(2, str(tmp_path / "init"), str(tmp_path), unshard), nprocs=2, join=True)
    for r in range(2):
        res = torch.load(tmp_path / f"order-{r}.pt", weights_only=True)
        assert res["error"] is not None and "the ranks disagree" in res["error"] and "order" in res["error"], (res["error"], res["params"])


def _one_rank_refused_worker(rank, world, init_file, out, unshard, case):
    """One sharded step in which rank 0's own checks refuse its inputs (``case``: "mask", a mask of
    the wrong length; "unsharded", a state made without sharding=, which holds the full params, not
    its shards), then (mask) a good step on both ranks. Each rank's error and the step count after."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        params, buffers, data, own_loss, opt = problem("mlp")
        failing = {"now": (rank, case) == (0, "work")}

        def loss_fn(p, b, sample):  # ("work": rank 0's model fails on its rows in the first step, after the check)
            if failing["now"]:
                raise RuntimeError("rank 0's model failed on its rows")
            return own_loss(p, b, sample)

        sharding = Sharding(params, unshard=unshard)
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.1, sample_rate=Q, expected_batch_size=N * Q, compile=False,
                                      method="ghost", sharding=sharding)
        state = vmapdp.init_train_state(params, opt, seed=SEED, sharding=None if (rank, case) == (0, "unsharded") else sharding)
        batch = (data[0][4 * rank : 4 * rank + 4], data[1][4 * rank : 4 * rank + 4])
        rows = 3 if (rank, case) == (0, "mask") else 4
        res = {"error": _error(lambda: step(state, batch, torch.ones(rows, dtype=torch.bool), buffers)), "after": None}
        failing["now"] = False
        if case in ("mask", "work"):
            res["after"] = step(state, batch, torch.ones(4, dtype=torch.bool), buffers)[0].step
        torch.save(res, os.path.join(out, f"refused-{rank}.pt"))
    finally:
        vdist.shutdown()


@pytest.mark.parametrize("unshard", ["step", "use"])
def test_a_rank_whose_own_inputs_are_refused_makes_every_rank_raise(tmp_path, unshard):
    """Found in review: an input only one rank refuses (here a mask of the wrong length on rank 0)
    left the other rank waiting in the same-state check's all_reduce until gloo's timeout. Now the
    check carries the failure: rank 0 raises its error, rank 1 that another rank failed, nothing is
    released, and the next step runs on both."""
    mp.spawn(_one_rank_refused_worker, args=(2, str(tmp_path / "init"), str(tmp_path), unshard, "mask"), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"refused-{r}.pt", weights_only=True) for r in range(2))
    assert r0["error"] is not None and r0["error"].startswith("ValueError: step(state, batch, mask): mask"), r0["error"]
    assert r1["error"] is not None and "another rank failed" in r1["error"] and "nothing was released" in r1["error"], r1["error"]
    assert r0["after"] == r1["after"] == 1


def test_a_rank_whose_model_fails_on_its_rows_makes_every_rank_raise_after_the_reduction(tmp_path):
    """Found by review: with unshard="step" (the whole model gathered before the forward), a rank
    whose model raised on its rows left the other waiting in the reduce-scatter until the group's
    timeout. It joins the reduction with zero sums, and every rank raises before the noise (as a
    data-parallel step does); the next step runs on both. (unshard="use": the next test.)"""
    mp.spawn(_one_rank_refused_worker, args=(2, str(tmp_path / "init"), str(tmp_path), "step", "work"), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"refused-{r}.pt", weights_only=True) for r in range(2))
    assert r0["error"] == "RuntimeError: rank 0's model failed on its rows", r0["error"]
    assert r1["error"] is not None and r1["error"].startswith("RuntimeError: step(state, batch, mask): another rank failed while computing its clipped sums"), r1["error"]
    assert r0["after"] == r1["after"] == 1


def _fails_inside_worker(rank, world, init_file, out, method):
    """``unshard="use"`` steps of the MLP (written with F.linear on the params) on 4 rows per rank in
    which one rank fails inside its chunk, where the ranks' gathers and reduce-scatters run: before
    its first gather ("start", rank 0's loss), after its first layer ("middle", rank 0's loss, after
    the first gather), at a nonfinite row ("nonfinite", rank 1's row, ``nonfinite="raise"``: after
    the norms), after its last reduce-scatter ("late", rank 0). After each, a good step from the same
    state. Each case's errors and the step count after it."""
    _init(rank, world, init_file)
    try:
        params, buffers, data, _, opt = problem("mlp")
        failing = {"now": None}

        def loss_fn(p, b, sample):
            x, y = sample
            if failing["now"] == "start":
                raise RuntimeError("rank 0's model failed on its rows")
            if failing["now"] == "interrupt":
                raise KeyboardInterrupt()
            h = torch.tanh(F.linear(x[None], p["0.weight"], p["0.bias"]))
            if failing["now"] == "middle":
                raise RuntimeError("rank 0's model failed after its first layer")
            return F.cross_entropy(F.linear(h, p["2.weight"], p["2.bias"]), y[None])

        sharding = Sharding(params, unshard="use")
        scatter, last = sharding.reduce_scatter_one, sharding.names[-1]

        def late(name, full):  # rank 0 fails after its last reduce-scatter of the chunk
            out = scatter(name, full)
            if failing["now"] == "late" and name == last:
                raise RuntimeError("rank 0 failed after its last reduce-scatter")
            return out

        sharding.reduce_scatter_one = late
        shard_size = sharding.chunk

        def chunk(name):  # rank 1: an allocation before a gather fails (found by review: after the flag, it hung the others)
            if failing["now"] == "alloc" and rank == 1 and sharding._told:
                failing["now"] = None
                raise torch.OutOfMemoryError("rank 1 ran out of memory gathering a parameter")
            return shard_size(name)

        sharding.chunk = chunk
        steps = {
            nonfinite: vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.1, sample_rate=Q, expected_batch_size=N * Q,
                                              compile=False, method=method, sharding=sharding, nonfinite=nonfinite)
            for nonfinite in ("zero", "raise")
        }
        state = vmapdp.init_train_state(params, opt, seed=SEED, sharding=sharding)
        batch = (data[0][4 * rank : 4 * rank + 4], data[1][4 * rank : 4 * rank + 4])
        mask = torch.ones(4, dtype=torch.bool)
        res = {}
        for case in ("start", "middle", "nonfinite", "late", "alloc", "interrupt"):
            forget_spent_keys()
            failing["now"] = case if (rank, case) == (1, "alloc") or rank == 0 and case not in ("nonfinite", "alloc") else None
            x = batch[0].clone()
            if case == "nonfinite" and rank == 1:
                x[2, 1] = float("nan")
            try:
                steps["raise" if case == "nonfinite" else "zero"](state, (x, batch[1]), mask, buffers)
                error = None
            except BaseException as err:  # (nonfinite="raise": a FloatingPointError; a KeyboardInterrupt)
                error = f"{type(err).__name__}: {err}"
            failing["now"] = None
            forget_spent_keys()
            res[case] = (error, steps["zero"](state, batch, mask, buffers)[0].step)
        torch.save(res, os.path.join(out, f"inside-{rank}.pt"))
    finally:
        vdist.shutdown()


@pytest.mark.parametrize("method", ["ghost", "vmap"])  # (two_pass gathers and reduce-scatters as vmap does: the suite's time)
def test_gathering_on_use_a_rank_that_fails_inside_its_chunk_makes_every_rank_raise(tmp_path, method):
    """With unshard="use" the gathers and reduce-scatters run inside the forward and backward: a rank
    whose model raised there (or ``nonfinite="raise"`` found a row, or anything after its last
    reduce-scatter) left the others waiting in their next collective until the group's timeout.
    Now every collective of the chunks first asks whether a rank failed (Sharding.failures_told):
    the failed rank raises its own error, the other that another rank failed, nothing is released,
    and the next step runs on both (their collectives still pair up). Found by review: an
    allocation failing after the flag, before its gather ("alloc"), still hung the other rank; a
    KeyboardInterrupt ("interrupt") left the rank that raised it with its plans while the others
    reset theirs, and the next step's gathers paired up wrongly (gloo aborted)."""
    mp.spawn(_fails_inside_worker, args=(2, str(tmp_path / "init"), str(tmp_path), method), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"inside-{r}.pt", weights_only=True) for r in range(2))
    other = "RuntimeError: step(state, batch, mask): another rank failed while computing its clipped sums"
    assert r0["start"][0] == "RuntimeError: rank 0's model failed on its rows", r0["start"]
    assert r0["middle"][0] == "RuntimeError: rank 0's model failed after its first layer", r0["middle"]
    assert r0["late"][0] == "RuntimeError: rank 0 failed after its last reduce-scatter", r0["late"]
    assert r1["nonfinite"][0] is not None and r1["nonfinite"][0].startswith("FloatingPointError") and "samples [2]" in r1["nonfinite"][0], r1["nonfinite"]
    assert r1["alloc"][0] == "OutOfMemoryError: rank 1 ran out of memory gathering a parameter", r1["alloc"]
    assert r0["interrupt"][0] == "KeyboardInterrupt: ", r0["interrupt"]
    for r, case in ((1, "start"), (1, "middle"), (1, "late"), (0, "nonfinite"), (0, "alloc"), (1, "interrupt")):
        error = (r0, r1)[r][case][0]
        assert error is not None and error.startswith(other) and "nothing was released" in error, (r, case, error)
    for res in (r0, r1):
        assert all(after == 1 for _, after in res.values()), res


def _uneven_rows_worker(rank, world, init_file, out, unshard):
    """One step where rank 0's batch (3 rows, a mask that fits) is not a multiple of
    physical_batch_size=2 and rank 1's (4 rows) is: data-parallel (``unshard=None``: no Sharding)
    or sharded. Each rank's error. (No step after it: with the refusal raised after the same-state
    check, the ranks' next collectives pair up wrongly and gloo aborts the process.)"""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        params, buffers, data, loss_fn, opt = problem("mlp")
        sharding = None if unshard is None else Sharding(params, unshard=unshard)
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.1, sample_rate=Q, expected_batch_size=N * Q, compile=False,
                                      method="ghost", physical_batch_size=2, distributed=True, sharding=sharding)
        state = vmapdp.init_train_state(params, opt, seed=SEED, sharding=sharding)
        k = 3 if rank == 0 else 4
        batch = (data[0][4 * rank : 4 * rank + k], data[1][4 * rank : 4 * rank + k])
        res = {"error": _error(lambda: step(state, batch, torch.ones(k, dtype=torch.bool), buffers))}
        torch.save(res, os.path.join(out, f"uneven-{rank}.pt"))
    finally:
        vdist.shutdown()


@pytest.mark.parametrize("unshard", [None, "step"])
def test_a_batch_one_rank_cannot_chunk_makes_every_rank_raise_at_the_check(tmp_path, unshard):
    """Found in review: the refusal of a batch that is not a multiple of physical_batch_size (a
    step input only the rank that holds it checks) ran in the chunk loop, after the same-state
    check that carries a rank's own refusal to the others: rank 1 went on into the step's
    reduction and waited there (or, had rank 0 caught its error and stepped again, their next
    collectives paired up wrongly: gloo aborted). It must be raised at the check, like a bad mask:
    rank 0 its own error, rank 1 that another rank failed."""
    mp.spawn(_uneven_rows_worker, args=(2, str(tmp_path / "init"), str(tmp_path), unshard), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"uneven-{r}.pt", weights_only=True) for r in range(2))
    assert r0["error"] is not None and "not a multiple of physical_batch_size=2" in r0["error"], r0["error"]
    assert r1["error"] is not None and r1["error"].startswith("RuntimeError: step(state, batch, mask): another rank failed"), r1["error"]


@pytest.mark.parametrize("unshard", ["step", "use"])
def test_a_rank_whose_state_is_not_its_shards_makes_every_rank_raise_at_the_check(tmp_path, unshard):
    """Found in review: a state whose params are not this rank's shards (a bad state, refused by
    Sharding.check_local) was refused when the step gathered the params, after the same-state check
    that carries a rank's own refusal: the other rank went on into the gather and waited there. It
    must be raised at the check: rank 0 its own error, rank 1 that another rank failed."""
    mp.spawn(_one_rank_refused_worker, args=(2, str(tmp_path / "init"), str(tmp_path), unshard, "unsharded"), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"refused-{r}.pt", weights_only=True) for r in range(2))
    assert r0["error"] is not None and "the state was sharded for another world size or layout" in r0["error"], r0["error"]
    assert r1["error"] is not None and r1["error"].startswith("RuntimeError: step(state, batch, mask): another rank failed"), r1["error"]


def _secure_resume_worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        from vmapdp.data import FixedSizeSampler

        torch.manual_seed(0)
        apply, params, buffers = vmapdp.functionalize(nn.Linear(4, 3))
        g = torch.Generator().manual_seed(1)
        data = (torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g))
        opt, sharding = optim.sgd(0.1), Sharding(params)

        def run(state, sampler, steps):
            step = vmapdp.make_train_step(lambda p, b, s: F.cross_entropy(apply(p, b, s[0][None]), s[1][None]), opt, l2_clip_norm=1.0,
                                          noise_multiplier=1.0, sampler=sampler, physical_batch_size=vdist.local_capacity(sampler.capacity),
                                          compile=False, method="vmap", sharding=sharding)
            batches = vdist.sharded(sampler)
            for _ in range(steps):
                indices, mask = next(batches)
                state, _ = step(state, gather(data, indices), mask, buffers)
            return state

        forget_spent_keys()
        first = FixedSizeSampler(24, 6, steps=8, secure=True)
        state = run(vmapdp.init_train_state(params, opt, seed=7, sharding=sharding), first, 2)
        sc.save_sharded(os.path.join(out, "c2"), state, sharding, sampler=first)
        resumed = FixedSizeSampler(24, 6, steps=8, secure=True)
        like = vmapdp.init_train_state(params, opt, seed=7, sharding=sharding)
        state = sc.load_sharded(os.path.join(out, "c2"), like=like, sharding=sharding, sampler=resumed, saved_after_last_step=True)
        state = run(state, resumed, 2)
        error = None
        try:
            sc.save_sharded(os.path.join(out, "c4"), state, sharding, sampler=resumed)
        except (ValueError, RuntimeError) as err:
            error = f"{type(err).__name__}: {err}"
        torch.save({"error": error, "drawn": resumed.steps_drawn, "step": state.step}, os.path.join(out, f"secure-{rank}.pt"))
    finally:
        vdist.shutdown()


def test_a_resumed_secure_sharded_run_saves_again(tmp_path):
    """Found by review: the save's check of the sampler's position ran on every rank, but a secure
    sampler draws on rank 0 alone and the others keep the count the last load gave them, so a
    resumed run could never save again ("the sampler is behind the state"). Only rank 0's sampler
    state is written, and only rank 0's is checked."""
    mp.spawn(_secure_resume_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"secure-{r}.pt", weights_only=True) for r in range(2))
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert (r0["drawn"], r0["step"], r1["drawn"]) == (4, 4, 2)
    assert os.path.isdir(tmp_path / "c4")


def test_check_sensitivity_of_a_sharded_step_measures_the_whole_update(runs):
    """The verdict and the distance are every rank's (the shards' distances summed); one sample
    moves the update near the bound, a bound half as large fails on every rank."""
    right, half = zip(*(r["sensitivity"] for r in runs["w2"]))
    assert right[0] == right[1] and half[0] == half[1]
    passed, distance, ratio, inert = right[0]
    assert passed and inert and 0.5 <= ratio <= 1.001, right[0]
    assert not half[0][0] and half[0][1] == distance


def test_ranks_saving_other_optimizers_states_are_refused_by_name(runs):
    for r in runs["w2"]:
        assert r["optimizer_error"] is not None and "optimizer state" in r["optimizer_error"], r["optimizer_error"]
