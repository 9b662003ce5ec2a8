"""Checkpoints of a sharded run (:mod:`vmapdp.sharding`) through ``torch.distributed.checkpoint``.

``save_sharded(path, state, sharding, sampler=)`` writes, collectively on every rank, a directory:

* the tensors (each rank's shards of the params, of the optimizer state and of the noise state,
  i.e. correlated noise's buffers) with ``torch.distributed.checkpoint`` (DCP), each shard as a
  ``DTensor`` of the flattened parameter (``Shard(0)``; a buffer ``[rows, c]`` as ``Shard(1)`` of
  ``[rows, numel]``), so DCP can read them back into another world size's layout; replicated
  leaves (step counts, the noise's fingerprint) as plain tensors;
* ``vmapdp-meta``: everything else, once (rank 0), in :mod:`vmapdp.checkpoint`'s verified file
  format (a SHA-256, or an HMAC-SHA256 under ``key=``, over every byte): the noise seed, the
  step, the ledger, the run id, the budgets, the methods ``"auto"`` chose, the adaptive clip
  norm, the sampler's state, the layout (names, shapes, dtypes, world size) and the SHA-256 of
  every file DCP wrote.

Atomic: every rank writes into ``path + ".tmp-<nonce>"``; rank 0 renames it to ``path`` only
after every rank has finished and the manifest is written. A rank that dies or raises before
that leaves a ``.tmp-`` directory and no ``path`` (:func:`latest_checkpoint` ignores such
directories); an existing ``path`` is never overwritten (save each checkpoint under its own name,
``checkpoint_path(root, step)``).

``load_sharded(path, like=, sharding=, sampler=)`` verifies the metadata's digest and every
file's SHA-256 (every rank every file: the bytes it reads), that every rank reads the same
checkpoint, checks the layout and that the saved tensors are
``like``'s (names, global shapes, dtypes), reads them into the shards of ``like`` (a fresh
``init_train_state(..., privatizer=, sharding=)`` of this world: any world size), checks the
result against ``like`` as ``load_state(like=)`` does (another run's checkpoint, a rollback) and
restores the sampler last; a refused load changes nothing. On the world size that
saved it, the state is bitwise the saved one, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import Any

import optree
import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp import checkpoint as _ckpt
from vmapdp import distributed as _dist
from vmapdp._tree import path_str
from vmapdp.noise.privatizers import is_correlated_state
from vmapdp.sharding import Sharding
from vmapdp.train import TrainState

__all__ = ["save_sharded", "load_sharded", "checkpoint_path", "latest_checkpoint"]

_META = "vmapdp-meta"
_TMP = ".tmp-"


def checkpoint_path(root: str | os.PathLike, step: int) -> str:
    """``root/step-000000123``: the directory name :func:`latest_checkpoint` orders by."""
    return os.path.join(os.fspath(root), f"step-{int(step):09d}")


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The complete checkpoint under ``root`` with the largest step (``checkpoint_path`` names),
    or None. Directories left by an interrupted save (``.tmp-``) are never complete and are skipped."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    done = [d for d in os.listdir(root) if _saved_step(d) is not None and os.path.isfile(os.path.join(root, d, _META))]
    # by the step's number: past step 10**9 the names outgrow their 9 digits and no longer sort as text (found by review)
    return os.path.join(root, max(done, key=_saved_step)) if done else None


def _saved_step(name: str) -> int | None:
    """The step of a ``checkpoint_path`` directory name, or None (another name, or a ``.tmp-`` one)."""
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def _check_nothing_later(call: str, path: str, step: int) -> None:
    """``saved_after_last_step=True`` cannot hold where the checkpoint's directory holds a save of a
    later step, complete or interrupted (``.tmp-``): that step was computed after this checkpoint
    (found by review: after an interrupted save, ``latest_checkpoint`` returned the one before it,
    and the resumed run released the lost step again)."""
    root = os.path.dirname(path)
    for name in sorted(os.listdir(root)):
        later = _saved_step(name.split(_TMP)[0])
        if later is not None and later > step and os.path.join(root, name) != path:
            raise ValueError(
                f"{call}: saved_after_last_step=True, but {os.path.join(root, name)} is a save of step {later}, "
                f"after this checkpoint's step {step} ({'interrupted' if _TMP in name else 'complete'}): steps after this checkpoint were "
                "computed, and a resumed run would release them again. Resume from the later save, or, if nothing of those steps was "
                "released, remove it first. Nothing was loaded."
            )


def _mesh(device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (_dist.world_size(),))


_TREES = (("opt", "opt_state", "optimizer state", "use vmapdp.optim's sgd/adam/adamw"), ("noise", "noise_state", "noise state", "use vmapdp.mf.correlated_noise"))


def _state_leaves(call: str, state: TrainState, sharding: Sharding) -> list[tuple[str, Tensor, str | None]]:
    """``(name, tensor, param)`` per leaf of the optimizer and noise states; ``param`` is the
    parameter whose shard the leaf holds along its last dim (:meth:`Sharding.owner`: Adam's
    moments, correlated noise's buffers), None for a replicated leaf (a step count, the noise's
    step count and fingerprint)."""
    out = []
    for prefix, field, what, fix in _TREES:
        paths, leaves, _ = optree.tree_flatten_with_path(getattr(state, field), namespace="torch")
        for path, leaf in zip(paths, leaves):
            if not isinstance(leaf, Tensor):
                raise TypeError(f"{call}: the {what} holds a {type(leaf).__name__} at {path_str(path)}; a sharded checkpoint holds tensors only ({fix}).")
            out.append((f"{prefix}/{path_str(path)}", leaf, sharding.owner(path, leaf)))
    return out


def _entries(call: str, state: TrainState, sharding: Sharding) -> list[list]:
    """``[name, global shape, dtype]`` of each tensor a checkpoint of ``state`` holds (:func:`_state_dict`'s keys), in order."""
    out = [[f"params/{k}", [sharding.numels[k]], str(sharding.dtypes[k])] for k in sharding.names]
    for name, leaf, owner in _state_leaves(call, state, sharding):
        shape = list(leaf.shape) if owner is None else [*leaf.shape[:-1], sharding.numels[owner]]
        out.append([name, shape, str(leaf.dtype)])
    return out


def _state_dict(call: str, state: TrainState, sharding: Sharding, *, copy: bool) -> dict[str, Any]:
    """The DCP state dict of ``state``: shards as DTensors of the flattened params (a leaf
    ``[*lead, c]`` as ``Shard(len(lead))`` of ``[*lead, numel]``), the rest plain."""
    from torch.distributed.tensor import DTensor, Shard

    device = next(iter(state.params.values())).device
    mesh = _mesh(device.type)

    def shard(local: Tensor, name: str) -> Any:
        local = local.detach().clone() if copy else local.detach()
        shape = (*local.shape[:-1], sharding.numels[name])
        stride = tuple(torch.empty(shape, device="meta").stride())
        return DTensor.from_local(local, mesh, [Shard(local.dim() - 1)], run_check=False, shape=shape, stride=stride)

    sd: dict[str, Any] = {f"params/{k}": shard(state.params[k], k) for k in sharding.names}
    for name, leaf, owner in _state_leaves(call, state, sharding):
        sd[name] = shard(leaf, owner) if owner is not None else (leaf.detach().clone() if copy else leaf.detach())
    return sd


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _layout(sharding: Sharding) -> list:
    return [[k, list(sharding.shapes[k]), str(sharding.dtypes[k])] for k in sharding.names]


def _fail_together(call: str, error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed (``error`` not None): its own error on a rank that
    failed, a RuntimeError naming the stage on the others (none is left waiting in a collective)."""
    nothing = "saved" if "save" in call else "loaded"
    _dist.check_same(call, what, None, fix="", error=error, elsewhere=f"{call}: {what} failed on another rank (its error is raised there); nothing was {nothing}.")


def save_sharded(path: str | os.PathLike, state: TrainState, sharding: Sharding, *, sampler: Any = None, key: bytes | str | None = None) -> None:
    """Write ``state`` (this rank's shards) and the sampler's state to the directory ``path``,
    collectively: call it on every rank with the same arguments. See the module docstring.

    Raises:
        ValueError: (on every rank, before anything is written) ``path`` exists, the ranks
            disagree on the state's step, run or ledger, the state does not fit ``sharding``, or
            the sampler has drawn a batch the state has not stepped.
        RuntimeError: a rank failed while writing; ``path`` was not created.
    """
    path = os.path.abspath(os.fspath(path))
    call = f"save_sharded({path!r})"
    _dist.require_initialized(call)
    _checks.sharding(call, sharding)
    secret = _ckpt.checked_key(call, key)
    _ckpt.require_train_state(call, state)  # (before its fields are read: state_payload comes after the collectives)
    sharding.check_local(call, state.params)
    clip = None if state.clip_norm is None else float(state.clip_norm)
    # (the optimizer state's structure too: ranks with other optimizers met a raw CheckpointException from torch; found by review)
    opt_paths = [str(p) for p in optree.tree_paths(state.opt_state, namespace="torch")]
    _dist.check_same(
        call,
        "the state's step, run, ledger and optimizer state (and the checkpoint path)",
        (state.step, state.run_id, state.ledger.to_json(), state.noise_seed, path, sharding.replicated(state.noise_state), clip,
         opt_paths, sharding.replicated(state.opt_state)),
        fix="Call save_sharded on every rank with the same path and the state every rank stepped together (one optimizer).",
    )
    exists = os.path.exists(path)
    _fail_together(call, ValueError(f"{call}: {path} exists; a checkpoint is never overwritten. Save under a new name (checkpoint_path(root, state.step)).") if exists else None, "the existence check")
    # (a sampler not at the state's step is refused there, on every rank, none left waiting in the next collective; checked
    # on rank 0, whose sampler state is written: a secure sampler draws there alone, and the others' stay where the last
    # load put them; found by review)
    try:
        payload, error = _ckpt.state_payload(call, state, sampler, check_sampler=_dist.rank() == 0), None
    except ValueError as err:
        payload, error = None, err
    _fail_together(call, error, "the check of the state and its sampler")
    tmp = path + _TMP + format(_dist.broadcast_int(secrets.randbits(62)), "x")
    sd = _state_dict(call, state, sharding, copy=False)
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, checkpoint_id=tmp)  # every rank's files, then rank 0's .metadata once all are written
    error = None
    if _dist.rank() == 0:
        try:
            files = {name: _sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
            payload["params"], payload["opt_state"], payload["noise_state"] = {}, (), ()  # the tensors are DCP's (the clip norm, replicated, is here)
            payload["sharded"] = {"world_size": sharding.world_size, "layout": _layout(sharding), "files": files, "entries": _entries(call, state, sharding)}
            _ckpt.write_payload(os.path.join(tmp, _META), payload, secret)
            os.rename(tmp, path)  # the checkpoint appears whole, or not at all
            fd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as err:  # noqa: BLE001 (raised on this rank by _fail_together)
            error = err
    _fail_together(call, error, "writing the checkpoint")


def load_sharded(
    path: str | os.PathLike,
    *,
    like: TrainState,
    sharding: Sharding,
    sampler: Any = None,
    key: bytes | str | None = None,
    ignore_sampler: bool = False,
    saved_after_last_step: bool = False,
) -> TrainState:
    """Read a checkpoint written by :func:`save_sharded` into this world's layout, collectively.

    Args:
        path: the checkpoint directory.
        like: this rank's state of the run to continue: ``init_train_state(params, optimizer,
            sharding=sharding)`` (with the run's ``privatizer=`` for correlated noise) for a fresh
            process (its shards give the layout to read into; any world size), or the run's
            current state (then the checkpoint must be of the same run and not behind it, as with
            ``load_state(like=)``).
        sharding: this world's :class:`vmapdp.sharding.Sharding` (the one ``like`` was made with).
        sampler, key, ignore_sampler, saved_after_last_step: as for :func:`vmapdp.load_state`.

    Raises:
        ValueError: (on every rank; nothing restored) the metadata or a tensor file is corrupted
            or missing, the layout (names, shapes, dtypes) is not ``sharding``'s, the saved tensors
            are not those of ``like``'s optimizer and noise state (checked before reading any:
            another optimizer, a correlated-noise run loaded without its ``privatizer=`` or the
            reverse), the state does not fit ``like`` or the sampler, the ranks read different
            checkpoints, or ``saved_after_last_step=True`` where the checkpoint's directory holds a
            save (complete or interrupted) of a later step. A sampler is left as it was.
    """
    path = os.path.abspath(os.fspath(path))
    call = f"load_sharded({path!r})"
    ignore_sampler, saved_after_last_step = (_checks.flag(call, k, v) for k, v in (("ignore_sampler", ignore_sampler), ("saved_after_last_step", saved_after_last_step)))
    _dist.require_initialized(call)
    _checks.sharding(call, sharding)
    secret = _ckpt.checked_key(call, key)
    if not isinstance(like, TrainState):
        raise TypeError(f"{call}: like must be a vmapdp.TrainState (init_train_state(params, optimizer, sharding=sharding)), got {type(like).__name__}.")
    entries = _entries(call, like, sharding)
    layout = like  # the state whose layout the checkpoint's tensors are read into
    error, payload, digest = None, None, None
    try:
        meta = os.path.join(path, _META)
        if not os.path.isfile(meta):
            raise ValueError(f"{call}: no {_META} in {path}: not a complete sharded checkpoint (an interrupted save leaves a '{_TMP}' directory and no checkpoint); nothing was loaded.")
        payload = _ckpt.read_payload(call, meta, secret)
        info = payload.get("sharded")
        if not isinstance(info, dict) or not isinstance(info.get("files"), dict):
            raise ValueError(f"{call}: {meta} is not the metadata of a sharded checkpoint (a load_state file?); nothing was loaded.")
        if info.get("layout") != _layout(sharding):
            raise ValueError(f"{call}: the checkpoint's params (names, shapes, dtypes) are not this sharding's; it was saved from another model. Nothing was loaded.")
        saved = info.get("entries", entries)  # (absent from checkpoints written before the noise state was saved)
        if saved != entries and is_correlated_state(like.noise_state) and "owner" in like.noise_state:
            # a correlated-noise state saved before noise states had an owner: read without it, then bound
            # to its run by state_from_payload, as load_state does (found by review)
            older = like._replace(noise_state={k: v for k, v in like.noise_state.items() if k != "owner"})
            if saved == _entries(call, older, sharding):
                layout, entries = older, saved
        if saved != entries:
            ours, theirs = ({e[0]: f"{tuple(e[1])} {e[2]}" for e in x} for x in (entries, saved))
            differ = "; ".join(f"{k}: {theirs.get(k, 'absent')} saved, {ours.get(k, 'absent')} here" for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))
            lazy = _ckpt.fresh_from_torch(like.opt_state)  # made at the first update
            raise ValueError(
                f"{call}: the checkpoint's tensors do not fit this run's state ({differ}): "
                + (
                    "like's optimizer is a fresh optim.from_torch one, whose state is made by its first update, so a sharded "
                    "load has no layout to read it into; train sharded runs with vmapdp.optim's sgd, adam or adamw to resume "
                    "them. Nothing was loaded."
                    if lazy else
                    "it was saved by a run with another optimizer or noise state. Make like with the optimizer and "
                    "init_train_state(..., privatizer=) of the run that saved it. Nothing was loaded."
                )
            )
        files = info["files"]
        present = sorted(n for n in os.listdir(path) if n != _META)
        if present != sorted(files):
            raise ValueError(f"{call}: the directory holds {present}, the manifest lists {sorted(files)}: files are missing or were added; nothing was loaded.")
        # every rank checks every file: the bytes it reads are its own (node-local copies of one
        # checkpoint: a file corrupted on one node and checked only by a rank of another was read
        # unchecked, found by review)
        for name in sorted(files):
            if _sha256(os.path.join(path, name)) != files[name]:
                raise ValueError(f"{call}: integrity check failed: {name} does not match the SHA-256 in the metadata (truncated, corrupted or edited); nothing was loaded.")
        saved_world = info.get("world_size")
        if saved_world != sharding.world_size and not saved_after_last_step:
            # (found by review: recorded and never read) a step lost after the checkpoint and repeated on another world
            # size is not the same release: its sums are reduced in another order, and with random layers the world size
            # joins the noise key
            raise ValueError(
                f"{call}: the checkpoint was saved by {saved_world} ranks and this world has {sharding.world_size}: steps released "
                "after it and repeated here would not be repeated bit for bit (the sums reduced in another order; with random "
                "layers, other noise), releases the ledger does not hold. Resume on the same world size, or, if the checkpoint was "
                "saved after the run's last released step, pass saved_after_last_step=True. Nothing was loaded."
            )
        if saved_after_last_step:
            _check_nothing_later(call, path, payload["step"])
        digest = _sha256(meta)
    except (ValueError, OSError, KeyError, TypeError) as err:
        error = err
    _fail_together(call, error, "verifying the checkpoint")
    # every rank reads the same checkpoint (ranks given different paths, or copies of different
    # saves, would each load their own: found by review)
    _dist.check_same(
        call, "the checkpoint (the SHA-256 of its metadata)", digest,
        fix="Load the same checkpoint on every rank (the same path, or identical copies of it). Nothing was loaded.",
    )
    sd = _state_dict(call, layout, sharding, copy=True)  # fresh tensors in this world's layout, filled by DCP
    import torch.distributed.checkpoint as dcp

    from torch.distributed.tensor import DTensor

    dcp.load(sd, checkpoint_id=path)
    params = {k: sd[f"params/{k}"].to_local() for k in sharding.names}
    loaded = {name: sd[name].to_local() if isinstance(sd[name], DTensor) else sd[name] for name, _, _ in _state_leaves(call, layout, sharding)}
    for prefix, field, _, _ in _TREES:
        spec = optree.tree_structure(getattr(layout, field), namespace="torch")
        payload[field] = optree.tree_unflatten(spec, [v for name, v in loaded.items() if name.startswith(prefix + "/")])
    payload["params"] = params
    state = None
    before = None if sampler is None else sampler.state_dict()
    try:
        state = _ckpt.state_from_payload(call, payload, sampler=sampler, like=like, ignore_sampler=ignore_sampler, saved_after_last_step=saved_after_last_step)
    except (ValueError, TypeError) as err:
        error = err
    try:
        _fail_together(call, error, "restoring the state")
    except BaseException:
        if sampler is not None and error is None:  # restored here, refused on another rank: put back (found by review)
            sampler.load_state_dict(before)
        raise
    return state
