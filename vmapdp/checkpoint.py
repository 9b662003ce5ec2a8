"""Save and restore a training run: atomic, complete, and safe to load.

``save_state(path, state, sampler=...)`` writes the params, the optimizer state, the noise seed,
the step count, the privacy ledger and (optionally) the Poisson sampler's RNG state to a file
beside ``path`` and renames it into place, so a crash mid-write never leaves half a checkpoint.
``load_state(path)`` reads it with ``torch.load(weights_only=True)``: no arbitrary code runs, only
tensors, numbers, strings and vmapdp's own optimizer-state classes are accepted.

Resuming from a checkpoint gives the same trajectory as not stopping: the noise of step ``t`` is
derived from ``(noise_seed, t)``, and the sampler continues from its saved generator state.

The file holds the noise seed: anyone who has it can remove the noise from released updates.
Keep checkpoints as private as the training data.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import zipfile
from typing import Any

import torch

from vmapdp.accounting import Ledger
from vmapdp.optim import SAFE_GLOBALS
from vmapdp.train import TrainState

__all__ = ["save_state", "load_state"]

_FORMAT = "vmapdp.TrainState"
_VERSION = 1


def save_state(path: str | os.PathLike, state: TrainState, *, sampler: Any = None) -> None:
    """Write ``state`` (and the sampler's RNG state) to ``path`` atomically.

    Args:
        path: the checkpoint file; replaced only once the new file is complete.
        state: a :class:`vmapdp.TrainState`.
        sampler: optional :class:`vmapdp.data.PoissonSampler` whose generator state is saved too.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"save_state(path, state): state must be a vmapdp.TrainState, got {type(state).__name__}.")
    payload = {
        "format": _FORMAT,
        "version": _VERSION,
        "params": state.params,
        "opt_state": state.opt_state,
        "noise_seed": state.noise_seed,
        "step": state.step,
        "ledger": state.ledger.to_json(),
        "sampler": None if sampler is None else sampler.state_dict(),
    }
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".vmapdp-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
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


def load_state(path: str | os.PathLike, *, sampler: Any = None, map_location: Any = None) -> TrainState:
    """Read a checkpoint written by :func:`save_state`.

    Args:
        path: the checkpoint file.
        sampler: optional :class:`vmapdp.data.PoissonSampler` to restore the sampling RNG into.
        map_location: as for ``torch.load`` (e.g. ``"cpu"``).

    Raises:
        ValueError: the file is truncated, corrupted, not a vmapdp checkpoint, or of another
            version; nothing is restored in that case (the sampler is left as it was).
    """
    path = os.fspath(path)
    call = f"load_state({path!r})"
    try:
        with _allowing(SAFE_GLOBALS):
            payload = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as err:  # truncated, foreign, disallowed
        raise ValueError(
            f"{call}: not a complete vmapdp checkpoint ({type(err).__name__}: {str(err).splitlines()[0][:200]}). "
            "The file is truncated or corrupted, or was not written by vmapdp.save_state; nothing was loaded."
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError(f"{call}: not a vmapdp checkpoint (no format marker {_FORMAT!r}).")
    if payload.get("version") != _VERSION:
        raise ValueError(f"{call}: checkpoint version {payload.get('version')!r} is not supported (expected {_VERSION}); upgrade vmapdp.")
    missing = [k for k in ("params", "opt_state", "noise_seed", "step", "ledger", "sampler") if k not in payload]
    if missing:
        raise ValueError(f"{call}: the checkpoint lacks {missing}; nothing was loaded.")
    params = payload["params"]
    if not isinstance(params, dict) or not all(isinstance(v, torch.Tensor) for v in params.values()):
        raise ValueError(f"{call}: 'params' is not a dict of tensors; nothing was loaded.")
    if not isinstance(payload["step"], int) or payload["step"] < 0:
        raise ValueError(f"{call}: 'step' must be an int >= 0, got {payload['step']!r}.")
    ledger = Ledger.from_json(payload["ledger"])
    if ledger.steps != payload["step"]:
        raise ValueError(f"{call}: the ledger records {ledger.steps} steps but the state says {payload['step']}; the checkpoint is inconsistent.")
    state = TrainState(params, payload["opt_state"], payload["noise_seed"], payload["step"], ledger)
    if sampler is not None:
        if payload["sampler"] is None:
            raise ValueError(f"{call}: a sampler was given but the checkpoint holds no sampler state (save with sampler=...).")
        sampler.load_state_dict(payload["sampler"])
    return state
