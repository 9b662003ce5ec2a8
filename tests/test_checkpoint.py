"""Checkpoints: complete, verified (every flipped bit, truncation and edited field refused), all or nothing."""

from __future__ import annotations

import hashlib
import io
import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vmapdp
from vmapdp import optim
from vmapdp.data import PoissonSampler, gather
from vmapdp.optim import SAFE_GLOBALS

N, Q = 40, 0.2
KEY = b"a-secret-checkpoint-key-of-32-by"


def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    apply, params, buffers = vmapdp.functionalize(model)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g))

    def loss_fn(p, b, sample):
        x, y = sample
        return F.cross_entropy(apply(p, b, x[None]), y[None])

    return params, buffers, data, loss_fn


def sampler(key=b"sampler-key"):
    return PoissonSampler(N, Q, 2, key=key)


def at_step(s, state):
    """``s`` drawn to ``state``'s step (a checkpoint's sampler must be at the state's step)."""
    for _ in range(state.step):
        s.sample()
    return s


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small state after two steps: with a sampler, a ledger, a budget and a recorded method."""
    params, buffers, data, loss_fn = problem()
    opt = optim.adam(1e-2)
    step = vmapdp.make_train_step(
        loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=N * Q, sample_rate=Q, compile=False, method="ghost", budget=(50.0, 1e-5)
    )
    s = sampler()
    state = vmapdp.init_train_state(params, opt, seed=7)
    for indices, mask in s:
        state, _ = step(state, gather(data, indices), mask, buffers)
    path = tmp_path_factory.mktemp("ckpt") / "s.pt"
    vmapdp.save_state(path, state, sampler=s)
    return path, state, s.state_dict(), step, (buffers, data)


def split(raw: bytes) -> tuple[bytes, bytes, bytes]:
    end = raw.index(b"\n") + 1
    return raw[:end], raw[end : end + 32], raw[end + 32 :]


def edited(raw: bytes, change, *, rehash: bool = False) -> bytes:
    """The file with one field changed in its body (the digest kept, or naively re-computed)."""
    header, digest, body = split(raw)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        payload = torch.load(io.BytesIO(body), weights_only=True)
    change(payload)
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    if rehash:
        digest = hashlib.sha256(header + body).digest()
    return header + digest + body


def _ledger_sigma(p):
    ledger = json.loads(p["ledger"])
    ledger["events"][0]["noise_multiplier"] = 190.0  # would under-report epsilon
    p["ledger"] = json.dumps(ledger)


def _weight(p):
    p["params"]["0.weight"][0, 0] += 1e-3


EDITS = {
    "ledger noise_multiplier": _ledger_sigma,
    "step": lambda p: p.update(step=p["step"] + 1),
    "seed": lambda p: p.update(noise_seed=p["noise_seed"] + 1),
    "weight element": _weight,
    "budget": lambda p: p.update(budgets=[[1e9, 1e-5, "rdp"]]),
    "budget removed": lambda p: p.update(budgets=[]),
    "sampler draws": lambda p: p["sampler"].update(draws=0),
    "run id": lambda p: p.update(run_id="0" * 64),
    "methods": lambda p: p.update(methods=[[k, "vmap"] for k, _ in p["methods"]]),
    "noise state": lambda p: p.update(noise_state=(torch.zeros(1),)),
}


def test_round_trip_keeps_every_field_and_steps_like_the_original(saved, tmp_path):
    path, state, sampler_state, step, (buffers, data) = saved
    s = sampler(key=b"overwritten-by-load")
    loaded = vmapdp.load_state(path, sampler=s)
    assert s.state_dict() == sampler_state
    assert loaded.step == 2 and loaded.noise_seed == 7 and loaded.ledger == state.ledger
    assert loaded.run_id == state.run_id and len(loaded.run_id) == 64
    assert loaded.budgets == state.budgets == ((50.0, 1e-5, "pld"),)
    assert loaded.methods == state.methods and {m for _, m in loaded.methods} == {"ghost"}
    assert torch.equal(loaded.opt_state.exp_avg["0.weight"], state.opt_state.exp_avg["0.weight"])
    batch, mask = gather(data, torch.arange(8)), torch.ones(8, dtype=torch.bool)
    a, _ = step(state, batch, mask, buffers)
    b, _ = step(loaded, batch, mask, buffers)
    assert all(torch.equal(a.params[k], b.params[k]) for k in state.params)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".vmapdp-")] == []  # no temp files left


def test_a_state_with_nan_params_is_refused_at_load(saved, tmp_path):
    """Found by review: init_train_state refused NaN params but a checkpoint of them loaded (a run
    that then released noise alone, every row dropped as non-finite)."""
    path, state, *_ = saved
    bad = state._replace(params={k: torch.full_like(v, float("nan")) for k, v in state.params.items()})
    vmapdp.save_state(tmp_path / "nan.pt", bad)
    with pytest.raises(ValueError, match=r"hold NaN or infinite values.*params had diverged; nothing was loaded"):
        vmapdp.load_state(tmp_path / "nan.pt")


def test_foreign_and_old_files_are_refused(saved, tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"not a vmapdp checkpoint: the file does not start with the header .*plain torch.save file"):
        vmapdp.load_state(tmp_path / "other.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a vmapdp checkpoint"):
        vmapdp.load_state(tmp_path / "empty.pt")


def test_a_directory_or_a_missing_directory_is_refused_before_writing(saved, tmp_path):
    state = vmapdp.load_state(saved[0], sampler=sampler())
    with pytest.raises(ValueError, match=r"is a directory; give a file path inside it.*Nothing was written"):
        vmapdp.save_state(tmp_path, state)
    with pytest.raises(ValueError, match=r"does not exist; create it first.*Nothing was written"):
        vmapdp.save_state(tmp_path / "no" / "s.pt", state)
    assert list(tmp_path.iterdir()) == []


def _refused(path, *, key=None, match=r"integrity check failed|not a (complete )?vmapdp checkpoint|not supported|unknown digest|saved with key="):
    s = sampler(key=b"the-callers-own-sampler")
    before = s.state_dict()
    with pytest.raises(ValueError, match=match):
        vmapdp.load_state(path, sampler=s, key=key)
    assert s.state_dict() == before  # a failed load leaves the sampler as it was


def test_fuzz_every_single_bit_flip_and_truncation_is_refused(saved, tmp_path):
    path, *_ = saved
    raw = path.read_bytes()
    header, _, _ = split(raw)
    rng = random.Random(0)
    # every bit of the header and digest, then 300 seeded random bits across the whole file
    offsets = [(i, b) for i in range(len(header) + 32) for b in range(8)]
    offsets += [(rng.randrange(len(raw)), rng.randrange(8)) for _ in range(300)]
    bad = tmp_path / "bad.pt"
    for i, bit in offsets:
        flipped = bytearray(raw)
        flipped[i] ^= 1 << bit
        bad.write_bytes(bytes(flipped))
        _refused(bad)
    for cut in (0, 1, len(header) - 1, len(header), len(header) + 31, len(header) + 32, len(header) + 100, len(raw) // 2, len(raw) - 1):
        bad.write_bytes(raw[:cut])
        _refused(bad)
    bad.write_bytes(raw + b"\0")  # an appended byte too
    _refused(bad)


@pytest.mark.parametrize("field", list(EDITS))
def test_every_field_edited_in_place_is_refused(saved, tmp_path, field):
    path, *_ = saved
    bad = tmp_path / "edited.pt"
    raw = path.read_bytes()
    bad.write_bytes(edited(raw, EDITS[field]))
    assert bad.read_bytes() != raw  # the edit changed something
    _refused(bad, match=r"integrity check failed: the SHA-256 stored in the file does not match")


def test_a_keyed_checkpoint_refuses_a_forger_who_recomputes_the_hash(saved, tmp_path):
    path, state, _, _, _ = saved
    s = at_step(sampler(), state)
    keyed = tmp_path / "keyed.pt"
    vmapdp.save_state(keyed, state, sampler=s, key=KEY)
    assert vmapdp.load_state(keyed, sampler=sampler(), key=KEY).step == 2
    forged = tmp_path / "forged.pt"
    # the documented limit of a plain SHA-256: a forger who re-computes it is not detected ...
    forged.write_bytes(edited(path.read_bytes(), _ledger_sigma, rehash=True))
    assert vmapdp.load_state(forged, sampler=sampler()).ledger.events[0].noise_multiplier == 190.0
    # ... a keyed checkpoint is: re-hashing with SHA-256, or with the wrong key, does not pass
    _refused(forged, key=KEY, match=r"key= was given but the checkpoint carries a plain SHA-256")
    forged.write_bytes(edited(keyed.read_bytes(), _ledger_sigma))
    _refused(forged, key=KEY, match=r"integrity check failed: the HMAC-SHA256 under this key")
    _refused(keyed, key=b"another-key-another-key-another-", match=r"integrity check failed.*or the key is wrong")
    _refused(keyed, match=r"saved with key= .* pass the same key=")
    with pytest.raises(TypeError, match=r"key must be bytes or str"):
        vmapdp.load_state(keyed, key=123)
    with pytest.raises(ValueError, match=r"key has 3 bytes; use at least 16"):
        vmapdp.save_state(keyed, state, key=b"abc")


def test_a_ledger_that_counts_fewer_steps_than_the_state_is_refused(saved, tmp_path):
    """Found by mutation testing: the load's check that the ledger records the state's step count was
    never exercised. A file whose digest is valid (a plain SHA-256 re-computed, as the format is public)
    but whose ledger misses a step would resume with an epsilon that leaves that release out."""
    path, state, _, _, _ = saved

    def drop_a_step(p):
        ledger = json.loads(p["ledger"])
        ledger["events"][0]["count"] -= 1
        p["ledger"] = json.dumps(ledger)

    forged = tmp_path / "fewer.pt"
    forged.write_bytes(edited(path.read_bytes(), drop_a_step, rehash=True))
    _refused(forged, match=r"the ledger records 1 steps but the state says 2; the checkpoint is inconsistent")


def test_sampler_state_is_restored_or_the_load_refused(saved, tmp_path):
    path, state, sampler_state, _, _ = saved
    with pytest.raises(ValueError, match=r"holds the sampler's state .* but no sampler was given.*Pass sampler=PoissonSampler"):
        vmapdp.load_state(path)
    assert vmapdp.load_state(path, ignore_sampler=True).step == 2  # for evaluation only
    bare = tmp_path / "bare.pt"
    vmapdp.save_state(bare, state)
    _refused(bare, match=r"a sampler was given but the checkpoint holds no sampler state")
    assert vmapdp.load_state(bare).step == 2
    secure = tmp_path / "secure.pt"  # a secure sampler cannot redraw the steps a resume repeats: the caller's word is required
    vmapdp.save_state(secure, state, sampler=PoissonSampler(N, Q, secure=True))
    for kw in ({}, {"sampler": PoissonSampler(N, Q, secure=True)}):
        with pytest.raises(ValueError, match=r"saved with a secure sampler .* pass saved_after_last_step=True.*Nothing was loaded"):
            vmapdp.load_state(secure, **kw)
    assert vmapdp.load_state(secure, saved_after_last_step=True).step == 2
    assert vmapdp.load_state(secure, sampler=PoissonSampler(N, Q, secure=True), saved_after_last_step=True).step == 2
    assert vmapdp.load_state(secure, ignore_sampler=True).step == 2  # for evaluation
    seeded = PoissonSampler(N, Q, generator=torch.Generator().manual_seed(0))
    before = seeded.state_dict()
    with pytest.raises(ValueError, match=r"comes from a keyed sampler"):
        vmapdp.load_state(path, sampler=seeded)
    assert torch.equal(seeded.state_dict()["generator"], before["generator"])


def test_like_refuses_another_models_checkpoint_before_touching_the_sampler(saved, tmp_path):
    path, state, _, _, _ = saved
    other = dict(state.params, **{"2.weight": torch.zeros(5, 4)})
    like = vmapdp.init_train_state(other, optim.adam(1e-2), seed=1)
    s = sampler(key=b"untouched")
    before = s.state_dict()
    with pytest.raises(ValueError, match=r"params\['2.weight'\] is \(3, 4\) torch.float32 in the file, expected \(5, 4\) torch.float32"):
        vmapdp.load_state(path, sampler=s, like=like)
    assert s.state_dict() == before
    sgd_like = vmapdp.init_train_state(state.params, optim.sgd(0.1), seed=1)
    with pytest.raises(ValueError, match=r"optimizer state \(AdamState\) does not fit this run's \(SGDState\)"):
        vmapdp.load_state(path, sampler=s, like=sgd_like)
    stateful = vmapdp.noise.Privatizer(lambda params: (torch.zeros(3),), lambda summed, state, key: (summed, state))
    with pytest.raises(ValueError, match=r"noise state \(tuple\) does not fit this run's \(tuple\)"):
        vmapdp.load_state(path, sampler=s, like=vmapdp.init_train_state(state.params, optim.adam(1e-2), seed=1, privatizer=stateful))
    assert vmapdp.load_state(path, sampler=s, like=vmapdp.init_train_state(state.params, optim.adam(1e-2), seed=1)).step == 2


def test_a_trainer_refusing_a_damaged_checkpoint_keeps_its_module_state_and_sampler(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 5, generator=g)
    ds = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    trainer = vmapdp.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), ds, batch_size=12, l2_clip_norm=1.0, target_epsilon=5.0, epochs=2, delta=1e-3, seed=0, compile=False)
    next(trainer.train_epoch())
    path = tmp_path / "t.pt"
    trainer.save(str(path))
    next(trainer.train_epoch())  # the trainer moves on: a good load would move it back
    raw = path.read_bytes()
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    state, sampler_state = trainer.state, trainer.sampler.state_dict()
    rng = random.Random(1)
    damaged = [edited(raw, _ledger_sigma), edited(raw, lambda p: p.update(budgets=[])), raw[: len(raw) - 7]]
    assert len(set(damaged)) == 3 and raw not in damaged
    for _ in range(50):
        flipped = bytearray(raw)
        flipped[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        damaged.append(bytes(flipped))
    for content in damaged:
        path.write_bytes(content)
        with pytest.raises(ValueError, match=r"integrity check failed|not a (complete )?vmapdp checkpoint|not supported|unknown digest"):
            trainer.load(str(path))
        assert trainer.state is state and trainer.sampler.state_dict() == sampler_state
        assert all(torch.equal(m.state_dict()[k], v) for k, v in weights.items())
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=r"at step 1, behind this run's step 2: rolling back"):
        trainer.load(str(path))  # the intact file, but a rollback of a run that moved on
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    fresh = vmapdp.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), ds, batch_size=12, l2_clip_norm=1.0, target_epsilon=5.0, epochs=2, delta=1e-3, seed=0, compile=False)
    fresh.load(str(path))
    assert fresh.state.step == 1 and all(torch.equal(p.detach(), fresh.state.params[k]) for k, p in m.named_parameters())


def test_like_refuses_another_runs_checkpoint_and_rollbacks_once_the_run_has_stepped(saved, tmp_path):
    """A run that has already released steps cannot load another run's checkpoint (its releases
    would drop out of the ledger) nor an older one of its own (repeated releases the ledger no
    longer counts); a fresh run may load either. Budgets of `like` are kept, never loosened."""
    path, state, _, step, (buffers, data) = saved
    batch, mask = gather(data, torch.arange(8)), torch.ones(8, dtype=torch.bool)
    other, _ = step(vmapdp.init_train_state({k: v + 1 for k, v in state.params.items()}, optim.adam(1e-2), seed=7), batch, mask, buffers)
    with pytest.raises(ValueError, match=r"is of another run .* has already taken 1 steps.*Load it into a fresh run"):
        vmapdp.load_state(path, sampler=sampler(), like=other)
    ahead, _ = step(state, batch, mask, buffers)  # this run, one step past the checkpoint
    with pytest.raises(ValueError, match=r"at step 2, behind this run's step 3: rolling back would repeat releases"):
        vmapdp.load_state(path, sampler=sampler(), like=ahead)
    assert vmapdp.load_state(path, sampler=sampler(), like=state).step == 2  # the same step: fine
    tight = ahead._replace(step=2, ledger=state.ledger, budgets=((3.0, 1e-5, "pld"),))
    loaded = vmapdp.load_state(path, sampler=sampler(), like=tight)
    assert loaded.budgets == ((3.0, 1e-5, "pld"),)  # the tighter budget of `like` replaces the file's looser one


def test_runs_of_the_same_initial_params_are_told_apart_by_seed_and_sampler(tmp_path):
    """Found by review: two fine-tuning runs of one pretrained model share the run id (a digest of
    the initial params); a run that had stepped loaded the other's checkpoint and its ledger lost
    its own releases. The noise seed and the sampler tell them apart. A checkpoint saved with a
    sampler that did not draw the state's batches is refused at the save, not at the resumed step."""
    params, buffers, data, loss_fn = problem()
    opt = optim.sgd(0.1)

    def run(seed, key, steps):
        s = sampler(key)
        step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=N * Q, sampler=s, compile=False, method="vmap")
        state = vmapdp.init_train_state(params, opt, seed=seed)
        for _ in range(steps):
            indices, mask = s.sample()
            state, _ = step(state, gather(data, indices), mask, buffers)
        return state, s

    a, _ = run(7, b"sampler-key", 1)
    b, sb = run(8, b"other-key", 2)  # (same seed and another sampler in one process: refused as noise reuse at the step)
    assert b.run_id == a.run_id
    path = tmp_path / "b.pt"
    vmapdp.save_state(path, b, sampler=sb)
    for like, what in ((a, "another noise seed"), (a._replace(noise_seed=b.noise_seed), "another sampler")):
        with pytest.raises(ValueError, match=rf"is of another run \({what}\) and this run has already taken 1 steps"):
            vmapdp.load_state(path, sampler=sampler(), like=like)
    assert vmapdp.load_state(path, sampler=sampler(b"other-key"), like=b).step == 2  # its own run: fine
    with pytest.raises(ValueError, match=r"this PoissonSampler is not the sampler the state's 2 steps were drawn by.*Nothing was written"):
        vmapdp.save_state(tmp_path / "x.pt", b, sampler=at_step(sampler(), b))
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("make", [lambda: PoissonSampler(N, Q, secure=True), lambda: vmapdp.data.ShuffledSampler(N, 4, epochs=2, secure=True)])
def test_a_secure_samplers_checkpoint_resumes_only_on_the_callers_word(make, saved, tmp_path):
    """Found by review (hunt2/f6_secure_sampler_resume.py): a checkpoint saved with a secure
    sampler loaded with or without one; the resumed run repeated the lost step with a NEW batch
    under the SAME keyed noise (release 1 - release 2 = clipped sum 1 - clipped sum 2, exactly).
    Epoch samplers keep their assignment in the checkpoint, but a new epoch is drawn fresh."""
    _, state, _, _, _ = saved
    s = make()
    for _ in range(state.step):  # (the sampler in step with the state: one drawn past it is refused at the save)
        s.sample()
    path = tmp_path / "secure.pt"
    vmapdp.save_state(path, state, sampler=s)
    with pytest.raises(ValueError, match=r"saved with a secure sampler"):
        vmapdp.load_state(path, sampler=make())
    assert vmapdp.load_state(path, sampler=make(), saved_after_last_step=True).step == state.step


def test_a_secure_noise_runs_checkpoint_resumes_only_on_the_callers_word(saved, tmp_path):
    """Found by a reviewer (review3/secure_noise_resume.py): secure noise (no seed) with a keyed
    sampler resumed freely; the repeated steps redraw the same batches under FRESH noise, a second
    release of the same sums (their average halves the noise variance) that the ledger lacks."""
    path, state, _, _, _ = saved
    secure_state = state._replace(noise_seed=None)
    s = at_step(sampler(key=b"k" * 16), state)
    out = tmp_path / "secure_noise.pt"
    vmapdp.save_state(out, secure_state, sampler=s)
    with pytest.raises(ValueError, match=r"saved with secure noise .*saved_after_last_step=True"):
        vmapdp.load_state(out, sampler=sampler(key=b"k" * 16))
    assert vmapdp.load_state(out, sampler=sampler(key=b"k" * 16), saved_after_last_step=True).noise_seed is None


def test_a_callers_own_sampler_state_is_not_taken_for_a_secure_one(saved, tmp_path):
    """A reviewer's regression check (review3/custom_sampler_ckpt.py): a sampler whose state_dict
    has neither "generator" nor "key" is not vmapdp's secure sampler."""
    _, state, _, _, _ = saved

    class Mine:
        def __init__(self):
            self.position = 0

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, d):
            self.position = d["position"]

    mine = Mine()
    mine.position = 5
    out = tmp_path / "mine.pt"
    vmapdp.save_state(out, state, sampler=mine)
    back = Mine()
    assert vmapdp.load_state(out, sampler=back).step == state.step and back.position == 5


def test_a_from_torch_optimizers_checkpoint_resumes_into_a_fresh_run(tmp_path):
    """from_torch's state is made by its first update, so a fresh run's (the `like` of a new process)
    has nothing to compare: its checkpoint loads into it and the run continues bit for bit (it was
    refused as another optimizer's). Another model's checkpoint is still refused."""
    params, buffers, data, loss_fn = problem()
    opt = optim.from_torch(torch.optim.RMSprop, lr=1e-2)
    step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=N * Q, sample_rate=Q, compile=False, method="vmap")
    batches = [(gather(data, i), m) for i, m in PoissonSampler(N, Q, 3, key=b"k")]
    state = vmapdp.init_train_state(params, opt, seed=7)
    for b, m in batches[:2]:
        state, _ = step(state, b, m, buffers)
    vmapdp.save_state(tmp_path / "s.pt", state)
    ahead, _ = step(state, *batches[2], buffers)
    vmapdp.noise.spent.forget_spent_keys()  # (a new process)
    resumed = vmapdp.load_state(tmp_path / "s.pt", like=vmapdp.init_train_state(params, opt, seed=7))
    resumed, _ = step(resumed, *batches[2], buffers)
    assert all(torch.equal(resumed.params[k], ahead.params[k]) for k in params)
    other = {k: torch.zeros(2, 2) for k in ("a", "b")}
    with pytest.raises(ValueError, match="do not fit this run"):
        vmapdp.load_state(tmp_path / "s.pt", like=vmapdp.init_train_state(other, opt, seed=7))


def test_another_torch_optimizers_checkpoint_is_refused_at_its_first_update(tmp_path):
    """A fresh from_torch state has nothing to compare at load (the optimizer makes its state at its
    first update), so an RMSprop run's checkpoint loads into an SGD run; its first update then finds
    keys SGD does not keep (with momentum 0 SGD would have ignored them silently) and the step
    raises, returning nothing. The same checkpoint resumes under RMSprop."""
    params, buffers, data, loss_fn = problem()
    batches = [(gather(data, i), m) for i, m in PoissonSampler(N, Q, 3, key=b"k")]

    def run(opt):
        return vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=N * Q, sample_rate=Q, compile=False, method="vmap")

    rms = optim.from_torch(torch.optim.RMSprop, lr=1e-2)
    state = vmapdp.init_train_state(params, rms, seed=7)
    for b, m in batches[:2]:
        state, _ = run(rms)(state, b, m, buffers)
    vmapdp.save_state(tmp_path / "s.pt", state)
    for sgd in (optim.from_torch(torch.optim.SGD, lr=1e-2), optim.from_torch(torch.optim.SGD, lr=1e-2, momentum=0.9)):
        vmapdp.noise.spent.forget_spent_keys()  # (a new process)
        # (saved after its last step, as it was)
        loaded = vmapdp.load_state(tmp_path / "s.pt", like=vmapdp.init_train_state(params, sgd, seed=7), saved_after_last_step=True)
        with pytest.raises(ValueError, match=r"holds \[.square_avg., .step.\], but SGD\(lr=0.01.*made by another optimizer"):
            run(sgd)(loaded, *batches[2], buffers)
    vmapdp.noise.spent.forget_spent_keys()
    loaded = vmapdp.load_state(tmp_path / "s.pt", like=vmapdp.init_train_state(params, rms, seed=7))
    assert run(rms)(loaded, *batches[2], buffers)[0].step == 3


def test_a_sampler_drawn_past_the_state_is_refused_at_the_save(saved, tmp_path):
    """Found by review (rev4/a03): saved between a draw and its step, the checkpoint held a sampler
    past its batch; resumed, that batch could not be drawn again, and another batch was released
    under the step's noise key (the two releases of one step differed by 0.127, without noise)."""
    path, state, sampler_state, _, _ = saved
    ahead = sampler()
    ahead.load_state_dict(sampler_state)
    ahead.sample()  # the batch of the state's next step, drawn before the save
    out = tmp_path / "ahead.pt"
    with pytest.raises(ValueError, match=r"the sampler has drawn 3 batches but the state has taken 2 steps: 1 drawn batch\(es\) not stepped yet.*Save after the step.*Nothing was written"):
        vmapdp.save_state(out, state, sampler=ahead)
    assert not out.exists()
    behind = sampler()
    behind.sample()
    with pytest.raises(ValueError, match=r"the sampler is behind the state"):
        vmapdp.save_state(out, state, sampler=behind)
    with pytest.raises(ValueError, match=r"has drawn none of the state's batches \(one given to the step for its events only\?\)"):
        vmapdp.save_state(out, state, sampler=sampler())  # (found by review: an events-only sampler saved for the one that drew)
    vmapdp.save_state(out, state, sampler=at_step(sampler(), state))
