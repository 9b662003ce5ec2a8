"""Save and restore a training run: atomic, complete, verified, and safe to load.

``save_state(path, state, sampler=...)`` writes the params, the optimizer state, the noise seed,
the step count, the privacy ledger, the run id, the budgets the run was given, the methods its
chunks ran, the privatizer's noise state and (optionally) the Poisson sampler's RNG state to a file beside ``path`` and renames
it into place, so a crash mid-write never leaves half a checkpoint.

The file is a one-line header (``vmapdp-checkpoint 2 sha256``), a 32-byte digest, then the body
(``torch.save`` of the fields). The digest is SHA-256 over the header line and every byte of
the body (or HMAC-SHA256 under ``key=``), checked by ``load_state`` before anything is parsed:
every flipped bit, truncation or field edited in place is refused, and a refused load changes
nothing. The body is then read with ``torch.load(weights_only=True)``: no arbitrary code runs.

What the digest does and does not do: a plain SHA-256 catches corruption and naive edits, not a
forger who edits a field and re-computes the digest (the format is public). Against that,
save and load with ``key=`` (a secret the user keeps apart from the checkpoints): an HMAC only
the key holder can compute. Either way, resuming from a checkpoint gives the same trajectory as
not stopping: the noise of step ``t`` is derived from ``(noise_seed, t)`` bound to the run and
the step's configuration, the sampler continues from its saved state, and ``"auto"`` replays
the methods it chose.

The file holds the noise seed: anyone who has it can remove the noise from released updates.
Keep checkpoints as private as the training data.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import io
import os
import pickle
import tempfile
import zipfile
from typing import Any

import optree
import torch

from vmapdp import _checks
from vmapdp.accounting import Ledger
from vmapdp.data import EVALUATION_ONLY_ID, SECURE_SAMPLER_ID
from vmapdp.noise.privatizers import check_noise_position, noise_owner, unowned
from vmapdp.optim import SAFE_GLOBALS
from vmapdp.train import TrainState, merge_budgets

__all__ = ["save_state", "load_state", "state_payload", "write_payload", "read_payload", "state_from_payload", "check_like", "checked_key"]

_FORMAT = "vmapdp.TrainState"
_VERSION = 2
_MAGIC = b"vmapdp-checkpoint"
_DIGEST_BYTES = 32
_MAX_HEADER = 64
_FIELDS = ("params", "opt_state", "noise_seed", "step", "ledger", "sampler", "run_id", "budgets", "methods")


def checked_key(call: str, key: Any) -> bytes | None:
    """A checkpoint's HMAC secret as bytes (None: a plain SHA-256); TypeError/ValueError if unusable."""
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"{call}: key must be bytes or str (the secret of the checkpoint's HMAC), got {type(key).__name__}.")
    if len(key) < 16:
        raise ValueError(f"{call}: key has {len(key)} bytes; use at least 16 random bytes (e.g. secrets.token_bytes(32)).")
    return bytes(key)


def _digest(header: bytes, body: bytes, key: bytes | None) -> bytes:
    if key is None:
        return hashlib.sha256(header + body).digest()
    return hmac.new(key, header + body, hashlib.sha256).digest()


def save_state(path: str | os.PathLike, state: TrainState, *, sampler: Any = None, key: bytes | str | None = None) -> None:
    """Write ``state`` (and the sampler's RNG state) to ``path`` atomically, with an integrity digest.

    Args:
        path: the checkpoint file; replaced only once the new file is complete.
        state: a :class:`vmapdp.TrainState`.
        sampler: optional :class:`vmapdp.data.PoissonSampler` whose RNG state is saved too; a
            checkpoint with it must then be loaded with a sampler (see :func:`load_state`).
        key: optional secret (bytes or str, >= 16 bytes) for an HMAC-SHA256 instead of a plain
            SHA-256: only someone with the key can write a file that loads under it.
    """
    call = "save_state(path, state)"
    secret = checked_key(call, key)
    if os.path.isdir(path):  # (found by review: a raw IsADirectoryError after the temporary file was written beside it)
        raise ValueError(f"{call}: {os.fspath(path)!r} is a directory; give a file path inside it (e.g. os.path.join(path, 'state.pt')). Nothing was written.")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{call}: the directory of {os.fspath(path)!r} does not exist; create it first (os.makedirs). Nothing was written.")
    write_payload(path, state_payload(call, state, sampler), secret)


def require_train_state(call: str, state: Any) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"{call}: state must be a vmapdp.TrainState, got {type(state).__name__}.")


def state_payload(call: str, state: TrainState, sampler: Any = None, *, check_sampler: bool = True) -> dict[str, Any]:
    """The fields of ``state`` (and the sampler's state) as the dict a checkpoint file holds.
    ``check_sampler``: refuse a sampler not at the state's step (``save_sharded``: on the rank
    whose sampler state is written only)."""
    require_train_state(call, state)
    if sampler is not None and not all(callable(getattr(sampler, m, None)) for m in ("state_dict", "load_state_dict")):  # (found by review: AttributeError)
        raise TypeError(
            f"{call}: sampler must be the sampler that drew the state's batches (a vmapdp.data sampler, or an object with "
            f"state_dict() and load_state_dict()), got {type(sampler).__name__}. Nothing was written."
        )
    ns = state.noise_state
    if unowned(ns) and int(ns["t"]) > 0:
        # (a state stepped by this version has one: loading binds an owner-less one to the run it is read into,
        # which is for checkpoints of older versions only; found by review: stripped, saved and loaded, another
        # run's buffers were continued)
        raise ValueError(
            f"{call}: the state's correlated-noise state has no owner (noise_state['owner']) though it has noised "
            f"{int(ns['t'])} steps: its buffers are not bound to their run. Save the state the step returned. Nothing was written."
        )
    drawn = None if sampler is None or not check_sampler else getattr(sampler, "steps_drawn", None)
    if drawn is not None and drawn != state.step and (drawn or state.step):
        # (found by review: saved between a draw and its step, the checkpoint held a sampler past its batch; resumed,
        # that batch could not be drawn again, and any other batch was released under the step's noise key; and a
        # sampler given to the step for its events only, which drew nothing, saved in place of the one that drew)
        if drawn > state.step:
            why = (f"{drawn - state.step} drawn batch(es) not stepped yet. A run resumed from this checkpoint could not draw "
                   "that batch again, and would release another batch under the same step's noise. Save after the step, or "
                   "before drawing its batch (a step refused after its draw, by a budget say: restore the sampler's "
                   "state_dict() from before the draw, as make_private does, or save without sampler= for evaluation only).")
        elif drawn == 0:
            why = ("this sampler has drawn none of the state's batches (one given to the step for its events only?). Save the "
                   "sampler that drew them, so that a resumed run repeats the lost steps with the same batches.")
        else:
            why = ("the sampler is behind the state (another sampler, or one restored from an older checkpoint). Save the "
                   "sampler that drew the state's batches.")
        raise ValueError(f"{call}: the sampler has drawn {drawn} batches but the state has taken {state.step} steps: {why} Nothing was written.")
    ident = None if sampler is None or not check_sampler else getattr(sampler, "stream_id", None)
    if ident is not None and state.sampler_id and state.sampler_id != EVALUATION_ONLY_ID and ident != state.sampler_id:
        # (found by review: another sampler drawn to the same count was saved, and the checkpoint was refused only
        # at the first resumed step)
        raise ValueError(
            f"{call}: this {type(sampler).__name__} is not the sampler the state's {state.step} steps were drawn by "
            "(state.sampler_id: another key=, generator or arguments); a run resumed from this checkpoint would be refused "
            "at its first step. Save the sampler that drew the state's batches. Nothing was written."
        )
    return {
        "format": _FORMAT,
        "version": _VERSION,
        "params": state.params,
        "opt_state": state.opt_state,
        "noise_seed": state.noise_seed,
        "step": state.step,
        "ledger": state.ledger.to_json(),
        "sampler": None if sampler is None else sampler.state_dict(),
        "run_id": state.run_id,
        "budgets": [list(b) for b in state.budgets],
        "methods": [list(m) for m in state.methods],
        "noise_state": state.noise_state,
        "clip_norm": state.clip_norm,
        "sampler_id": state.sampler_id,
    }


def write_payload(path: str | os.PathLike, payload: dict[str, Any], secret: bytes | None) -> None:
    """Write ``payload`` to ``path`` atomically: header, digest (SHA-256, or HMAC under ``secret``), body."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    header = _MAGIC + f" {_VERSION} {'sha256' if secret is None else 'hmac-sha256'}\n".encode()
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".vmapdp-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header + _digest(header, body, secret) + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _allowing(classes: tuple) -> Any:
    """A context that lets ``torch.load(weights_only=True)`` rebuild vmapdp's optimizer states."""
    if hasattr(torch.serialization, "safe_globals"):  # torch >= 2.5
        return torch.serialization.safe_globals(list(classes))
    torch.serialization.add_safe_globals(list(classes))  # torch 2.4: a process-wide allowlist
    return contextlib.nullcontext()


def _verified_body(call: str, raw: bytes, secret: bytes | None) -> bytes:
    """The body of a checkpoint file whose header and digest check out; ValueError otherwise."""
    end = raw.find(b"\n", 0, _MAX_HEADER)
    if not raw.startswith(_MAGIC + b" "):
        hint = " (a version-1 vmapdp checkpoint or a plain torch.save file: they carry no integrity digest and are not loaded)" if raw[:2] == b"PK" else ""
        raise ValueError(f"{call}: not a vmapdp checkpoint: the file does not start with the header {_MAGIC.decode()!r}{hint}; nothing was loaded.")
    if end < 0 or len(raw) < end + 1 + _DIGEST_BYTES:
        raise ValueError(
            f"{call}: not a complete vmapdp checkpoint ({len(raw)} bytes: no complete header and digest). "
            "The file is truncated or corrupted; nothing was loaded. Restore it from a good copy."
        )
    header = raw[: end + 1]
    fields = header[len(_MAGIC) + 1 : -1].split(b" ")
    if len(fields) != 2 or fields[0] != str(_VERSION).encode():
        raise ValueError(
            f"{call}: checkpoint header {header[:-1]!r} is not supported (expected version {_VERSION}); "
            "the file is corrupted or from another vmapdp version; nothing was loaded."
        )
    algorithm = fields[1]
    if algorithm not in (b"sha256", b"hmac-sha256"):
        raise ValueError(f"{call}: unknown digest {algorithm!r} in the header (expected b'sha256' or b'hmac-sha256'); the file is corrupted; nothing was loaded.")
    if algorithm == b"hmac-sha256" and secret is None:
        raise ValueError(f"{call}: the checkpoint was saved with key= (HMAC-SHA256) and no key was given: pass the same key=; nothing was loaded.")
    if algorithm == b"sha256" and secret is not None:
        raise ValueError(
            f"{call}: key= was given but the checkpoint carries a plain SHA-256, which anyone can re-compute: "
            "it cannot be authenticated. Load it without key= only if you trust the file; nothing was loaded."
        )
    stored = raw[end + 1 : end + 1 + _DIGEST_BYTES]
    body = raw[end + 1 + _DIGEST_BYTES :]
    if not hmac.compare_digest(stored, _digest(header, body, secret)):
        what = "HMAC-SHA256 under this key" if secret is not None else "SHA-256"
        raise ValueError(
            f"{call}: integrity check failed: the {what} stored in the file does not match its {len(raw)} bytes. "
            "The file is truncated, corrupted or was edited after save_state"
            + (" (or the key is wrong)" if secret is not None else "")
            + "; nothing was loaded. Restore it from a good copy."
        )
    return body


def _leaf_signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype)
    return (type(x).__name__,)


def _signature(tree: Any) -> Any:
    return optree.tree_map(_leaf_signature, tree, namespace="torch")


def check_like(call: str, state: TrainState, like: Any) -> None:
    """Refuse a loaded ``state`` that does not fit ``like`` (same param keys, shapes, dtypes,
    optimizer- and noise-state structure and secure mode): checked before anything is written."""
    if not isinstance(like, TrainState):
        raise TypeError(f"{call}: like must be a vmapdp.TrainState (the run the checkpoint must fit), got {type(like).__name__}.")
    fix = "It was saved from another model or optimizer; load it into a run built like the one that saved it. Nothing was loaded."
    if set(state.params) != set(like.params):
        extra, missing = sorted(set(state.params) - set(like.params)), sorted(set(like.params) - set(state.params))
        raise ValueError(f"{call}: the checkpoint's params do not fit this run: expected keys {sorted(like.params)}, got extra {extra} and missing {missing}. {fix}")
    for k, v in like.params.items():
        got = state.params[k]
        if got.shape != v.shape or got.dtype != v.dtype:
            raise ValueError(
                f"{call}: the checkpoint does not fit this run: params[{k!r}] is {tuple(got.shape)} {got.dtype} in the file, "
                f"expected {tuple(v.shape)} {v.dtype}. {fix}"
            )
    for field, what in (("opt_state", "optimizer state"), ("noise_state", "noise state")):
        ours, theirs = getattr(like, field), getattr(state, field)
        if like.step == 0 and _created_on_update(ours, theirs):
            continue  # from_torch's state is made by its first update: a fresh run's has nothing to compare yet
        if optree.tree_structure(ours, namespace="torch") != optree.tree_structure(theirs, namespace="torch") or _signature(ours) != _signature(theirs):
            raise ValueError(f"{call}: the checkpoint's {what} ({type(theirs).__name__}) does not fit this run's ({type(ours).__name__}). {fix}")
    if (state.noise_seed is None) != (like.noise_seed is None):
        mode = "secure (no seed)" if state.noise_seed is None else "seeded"
        raise ValueError(f"{call}: the checkpoint is {mode} but this run is not; use the same secure= setting. Nothing was loaded.")
    if like.step == 0:
        return  # a fresh run (a new process resuming): any checkpoint of this shape may continue it
    # the run id is a digest of the initial params, which runs fine-tuning one pretrained model share: the noise
    # seed and the sampler tell their runs apart (found by review: a trainer that had stepped 10 times loaded another
    # run's checkpoint of the same pretrained weights, and its ledger lost those 10 releases). Two secure runs
    # (no seed, secure samplers) of the same initial params cannot be told apart here.
    other_seed = state.noise_seed != like.noise_seed
    other_sampler = bool(state.sampler_id and like.sampler_id) and EVALUATION_ONLY_ID not in (state.sampler_id, like.sampler_id) and state.sampler_id != like.sampler_id
    if state.run_id != like.run_id or other_seed or other_sampler:
        what = (
            f"run id {state.run_id[:12]}..., this run's {like.run_id[:12]}..." if state.run_id != like.run_id
            else "another noise seed" if other_seed else "another sampler"
        )
        raise ValueError(
            f"{call}: the checkpoint is of another run ({what}) "
            f"and this run has already taken {like.step} steps: loading it would drop those releases from the ledger. "
            "Load it into a fresh run (a new trainer or init_train_state) instead. Nothing was loaded."
        )
    if state.step < like.step:
        raise ValueError(
            f"{call}: the checkpoint is at step {state.step}, behind this run's step {like.step}: rolling back would repeat "
            "releases that its ledger no longer counts. Load a checkpoint at or after this run's step, or into a fresh run "
            "(a seeded run then replays the same steps bit for bit). Nothing was loaded."
        )


def fresh_from_torch(state: Any) -> bool:
    """``state`` is an ``optim.from_torch`` state before its first update (every param's entry
    empty: the torch optimizer makes its state at the first update)."""
    from vmapdp.optim import TorchOptimizerState

    return isinstance(state, TorchOptimizerState) and not any(state.per_param.values())


def _created_on_update(fresh: Any, saved: Any) -> bool:
    """``fresh`` is a ``from_torch`` state before its first update and ``saved`` a ``from_torch``
    state with the same param keys (which torch optimizer made it cannot be told here: the first
    update checks its state's keys, ``optim.from_torch``)."""
    from vmapdp.optim import TorchOptimizerState

    return (
        fresh_from_torch(fresh) and isinstance(saved, TorchOptimizerState)
        and isinstance(saved.per_param, dict) and set(saved.per_param) == set(fresh.per_param)
    )


def _restore_sampler(call: str, sampler: Any, saved: Any) -> None:
    """Restore ``saved`` into ``sampler``, all or nothing (the sampler's old state is put back on error)."""
    before = sampler.state_dict()
    try:
        sampler.load_state_dict(saved)
    except BaseException:
        sampler.load_state_dict(before)
        raise


def load_state(
    path: str | os.PathLike,
    *,
    sampler: Any = None,
    map_location: Any = None,
    key: bytes | str | None = None,
    like: TrainState | None = None,
    ignore_sampler: bool = False,
    saved_after_last_step: bool = False,
) -> TrainState:
    """Read a checkpoint written by :func:`save_state`, verifying its digest first.

    Args:
        path: the checkpoint file.
        sampler: the :class:`vmapdp.data.PoissonSampler` to restore the sampling state into;
            required when the checkpoint holds one (a run resumed without it would draw new
            batches under the noise keys of steps it repeats), refused when it holds none.
        map_location: as for ``torch.load`` (e.g. ``"cpu"``).
        key: the secret given to ``save_state(key=)``, for an HMAC-SHA256 check.
        like: a state the checkpoint must fit (param keys, shapes, dtypes, optimizer state,
            secure mode); checked before the sampler is touched. If ``like`` has taken steps, the
            checkpoint must also be of the same run (``run_id``, noise seed and sampler) and not behind it (no rollback
            that would repeat releases its ledger no longer counts); ``like``'s budgets are kept.
        ignore_sampler: read a checkpoint without its sampler checks, for evaluation or
            inspection only: no sampler is restored (giving one is refused), and the state is
            marked so (``TrainState.sampler_id``) that a step given a sampler refuses it (found by
            review: a secure-sampler run resumed through it repeated a released step with another
            batch under the same noise).
        saved_after_last_step: the caller's word that nothing was released after this
            checkpoint was saved (it is saved after every step). Required to resume a checkpoint
            saved with a secure sampler (``secure=True``): its batches cannot be redrawn, so steps
            released after the checkpoint and repeated by the resumed run would be releases the
            ledger does not hold (under keyed noise, new batches with the same noise); and one
            saved by a run with secure noise (``secure=True``, no noise seed), for the same reason.
            Not checked: a resumed run must repeat the steps released after the checkpoint under
            the configuration each of them ran with (learning rate, clip norm, noise, privatizer):
            under another, their batches are released again under other noise keys, which the
            ledger does not hold (found by review; the checkpoint cannot know the configuration of
            steps after it).

    Raises:
        ValueError: the file is truncated, corrupted, edited, not a vmapdp checkpoint, of another
            version, keyed differently, holds sampler state that was not asked for (or none for
            a given sampler), or does not fit ``like``; nothing is restored in that case (the
            sampler is left as it was).
        TypeError: ``key`` or ``like`` of the wrong type.
    """
    path = os.fspath(path)
    call = f"load_state({path!r})"
    ignore_sampler, saved_after_last_step = (_checks.flag(call, k, v) for k, v in (("ignore_sampler", ignore_sampler), ("saved_after_last_step", saved_after_last_step)))
    payload = read_payload(call, path, checked_key(call, key), map_location)
    if payload.get("sharded") is not None:
        raise ValueError(f"{call}: this is the metadata of a sharded checkpoint (its tensors are in the directory beside it); load the directory with vmapdp.sharded_checkpoint.load_sharded. Nothing was loaded.")
    return state_from_payload(call, payload, sampler=sampler, like=like, ignore_sampler=ignore_sampler, saved_after_last_step=saved_after_last_step)


def read_payload(call: str, path: str, secret: bytes | None, map_location: Any = None) -> dict[str, Any]:
    """The payload of the checkpoint file at ``path``, its digest verified before anything is parsed."""
    if os.path.isdir(path):  # (found by review: a raw IsADirectoryError)
        raise ValueError(
            f"{call}: {os.fspath(path)!r} is a directory"
            + (", a sharded checkpoint: load it with vmapdp.sharded_checkpoint.load_sharded on every rank" if os.path.exists(os.path.join(path, "vmapdp-meta")) else "; give the checkpoint file's path")
            + ". Nothing was loaded."
        )
    with open(path, "rb") as f:
        raw = f.read()
    body = _verified_body(call, raw, secret)
    try:
        with _allowing(SAFE_GLOBALS):
            payload = torch.load(io.BytesIO(body), map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as err:  # a digest over a bad body
        raise ValueError(
            f"{call}: not a readable vmapdp checkpoint ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            "its digest matches, so it was written that way (not by vmapdp.save_state); nothing was loaded."
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT or payload.get("version") != _VERSION:
        raise ValueError(f"{call}: the body is not a version-{_VERSION} {_FORMAT!r} payload; nothing was loaded.")
    missing = [k for k in _FIELDS if k not in payload]
    if missing:
        raise ValueError(f"{call}: the checkpoint lacks {missing}; nothing was loaded.")
    return payload


def _secure_sampler_state(saved: Any) -> bool:
    """Whether a checkpoint's sampler state is a secure (OS CSPRNG) sampler's: vmapdp's samplers
    say so (``"secure"``); an older checkpoint's has both sources saved as None. A caller's own
    sampler state, with neither entry, is not taken for one."""
    if not isinstance(saved, dict):
        return False
    if "secure" in saved:
        return saved["secure"] is True
    return "generator" in saved and "key" in saved and saved["generator"] is None and saved["key"] is None


def state_from_payload(
    call: str, payload: dict[str, Any], *, sampler: Any = None, like: TrainState | None = None, ignore_sampler: bool = False, saved_after_last_step: bool = False
) -> TrainState:
    """The :class:`TrainState` of a verified payload, checked against ``like``; the sampler restored
    last, all or nothing (see :func:`load_state`)."""
    params = payload["params"]
    if not isinstance(params, dict) or not all(isinstance(v, torch.Tensor) for v in params.values()):
        raise ValueError(f"{call}: 'params' is not a dict of tensors; nothing was loaded.")
    if isinstance(payload["step"], bool) or not isinstance(payload["step"], int) or payload["step"] < 0:
        raise ValueError(f"{call}: 'step' must be an int >= 0, got {payload['step']!r}; nothing was loaded.")
    ledger = Ledger.from_json(payload["ledger"])
    if ledger.steps != payload["step"]:
        raise ValueError(f"{call}: the ledger records {ledger.steps} steps but the state says {payload['step']}; the checkpoint is inconsistent.")
    try:
        budgets = tuple((float(e), float(d), str(a)) for e, d, a in payload["budgets"])
        methods = tuple((str(k), str(m)) for k, m in payload["methods"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{call}: malformed 'budgets' or 'methods' ({err}); nothing was loaded.") from err
    noise_state = payload.get("noise_state", ())  # absent from checkpoints saved before the privatizer seam
    clip_norm = payload.get("clip_norm")  # adaptive clipping's threshold (absent from older checkpoints)
    if clip_norm is not None and not (isinstance(clip_norm, torch.Tensor) and clip_norm.dim() == 0 and clip_norm.is_floating_point()):
        raise ValueError(f"{call}: malformed 'clip_norm' ({type(clip_norm).__name__}); expected a 0-dim float tensor or None. Nothing was loaded.")
    sampler_id = payload.get("sampler_id", "")  # (absent from checkpoints saved before it was recorded)
    if not isinstance(sampler_id, str):
        raise ValueError(f"{call}: malformed 'sampler_id' ({type(sampler_id).__name__}); expected a str. Nothing was loaded.")
    if unowned(noise_state):
        # saved before noise states were bound to their noise run: bound to the run it is read into (unchecked, as then)
        t = int(noise_state["t"])
        owner = noise_owner(payload["noise_seed"], str(payload["run_id"]), payload["step"] - t) if t > 0 else torch.zeros(32, dtype=torch.uint8)
        noise_state = {**noise_state, "owner": owner}
    _checks.finite_params(call, params, "The checkpoint was saved from a run whose params had diverged; nothing was loaded.")
    state = TrainState(params, payload["opt_state"], payload["noise_seed"], payload["step"], ledger, str(payload["run_id"]), budgets, methods, noise_state, clip_norm, sampler_id)
    check_noise_position(call, noise_state, payload["step"], period=None, fix="The checkpoint is inconsistent; nothing was loaded.")
    if like is not None:
        check_like(call, state, like)
        state = state._replace(budgets=functools.reduce(merge_budgets, like.budgets, state.budgets))  # budgets never loosen
    saved = payload["sampler"]
    # a sampler with a position (keyed samplers record "step": a secure cyclic one its groups too) or RNG state
    holds_sampler = saved is not None and (saved.get("generator") is not None or saved.get("key") is not None or "step" in saved)
    # a secure sampler (OS CSPRNG: no generator, no key) cannot redraw the batches of the steps a
    # resumed run repeats: they would be new releases the ledger does not hold, and under keyed
    # noise new batches with the very noise of the lost releases (their difference is the
    # difference of the clipped sums, exactly; found by review)
    # (a state stepped with a secure memoryless sampler says so in its sampler_id, saved with its sampler or not: a
    # checkpoint saved without it resumed a repeated step with another batch; found by review)
    secure_saved = _secure_sampler_state(saved) or state.sampler_id == SECURE_SAMPLER_ID
    # ... and secure noise (no seed) gives the repeated steps fresh noise: a second release of the same sums
    if (secure_saved or payload["noise_seed"] is None) and not ignore_sampler and not saved_after_last_step:
        what = "a secure sampler (the OS CSPRNG), which cannot redraw the batches" if secure_saved else "secure noise (the OS CSPRNG), which cannot redraw the noise"
        raise ValueError(
            f"{call}: the checkpoint was saved with {what} of steps released after it was saved: a resumed run would "
            "repeat those steps as new releases the ledger does not hold (new batches under keyed noise: their difference is that "
            "of the clipped sums, exactly; the same batches under fresh noise: their average halves the noise variance). If the "
            "checkpoint was saved after the run's last released step (save after every step), pass saved_after_last_step=True; "
            "ignore_sampler=True reads it for evaluation only; or train with a keyed sampler and keyed noise, whose resumed run "
            "repeats its steps bit for bit. Nothing was loaded."
        )
    if ignore_sampler:
        if sampler is not None:
            raise ValueError(
                f"{call}: ignore_sampler=True reads the checkpoint for evaluation only and restores no sampler, but a sampler was "
                "given: to resume training pass sampler= without ignore_sampler. Nothing was loaded."
            )
        return state._replace(sampler_id=EVALUATION_ONLY_ID)
    if sampler is not None:
        if saved is None:
            raise ValueError(f"{call}: a sampler was given but the checkpoint holds no sampler state (save with sampler=...); nothing was loaded.")
        _restore_sampler(call, sampler, saved)
    elif holds_sampler and not ignore_sampler:
        raise ValueError(
            f"{call}: the checkpoint holds the sampler's state (saved with sampler=) but no sampler was given: a run "
            "resumed with a fresh sampler would draw new batches under the noise keys of the steps it repeats. Pass "
            "sampler=PoissonSampler(...) made like the saved one (its state is restored), or ignore_sampler=True to "
            "read the state for evaluation only; nothing was loaded."
        )
    return state
