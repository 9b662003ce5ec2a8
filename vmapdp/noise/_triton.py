"""Keyed normals on a CUDA device in one Triton kernel: ChaCha20's block function in native 32-bit
words and the Box-Muller transform, for every leaf of a step in one launch (or a few, for large models).

The torch twin of ChaCha20 (:func:`vmapdp.noise.chacha.words64`) emulates 32-bit words in int64
(a mask after every add, three ops for a rotation) and, compiled by Inductor, still needs one
kernel call per leaf (measured on an H200: ~0.5 ms a call, 4.6 ms for 100M float32 normals).
Here each lane computes one group of :mod:`vmapdp.noise.gaussian`'s layout (3 blocks and 32
normals in float32; 1 block and 8 normals in float64) with ``uint32`` adds, xors and rotations,
and a table of ``(first output group, groups, first block counter, leaf)`` rows, one per program,
lets one launch fill the noise of many leaves (each its own stream: the leaf index is in the
nonce) into one buffer.

The bits are the RFC's (tests compare :func:`keystream` with OpenSSL's, bit for bit); the normals
follow :func:`vmapdp.noise.gaussian._transform32` / ``_transform64`` op for op (the same int64 ->
float rounding, clamp and scale; ``log``, ``cos`` and ``sin`` are the device's, ``sqrt`` correctly
rounded), within a few ulps of the CPU's.

Needs ``triton`` (shipped with torch's CUDA wheels); the kernels are built on first use. With
``TRITON_INTERPRET=1`` set before that, they run on CPU tensors in Triton's interpreter (slow; the
tests use it where triton is installed).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import threading
from typing import Any, Sequence

import torch
from torch import Tensor

from vmapdp.noise import chacha

__all__ = ["available", "fill", "keystream", "radii"]

BLOCK = 128  # groups (lanes) per program
_LOCK = threading.Lock()
_TABLES: dict[tuple, Tensor] = {}  # (device, layout, segments) -> the launch's table on the device
_MAX_TABLES = 64


def available(device: torch.device) -> bool:
    """Whether the Triton kernels serve ``device`` (a CUDA device, triton importable)."""
    return device.type == "cuda" and _have_triton()


@functools.lru_cache(maxsize=None)
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernels() -> Any:
    """The kernels' module (imported on first use)."""
    from vmapdp.noise import _triton_kernels

    return _triton_kernels


def _args(b: bytes) -> list[int]:
    """``b``'s little-endian 32-bit words as int32 bit patterns (the kernels' scalar arguments: one
    specialisation for every key and nonce)."""
    return [w - (1 << 32) if w >= 1 << 31 else w for w in chacha._words(b)]


def _on(device: torch.device) -> Any:
    """Launch on ``device`` (a CUDA one need not be current); CPU tensors: the interpreter."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _table(device: torch.device, blocks: int, segments: tuple[tuple[int, int, int, int], ...]) -> Tensor:
    """The launch table, one int64 row per program: (first output group, groups (<= BLOCK), first
    block counter, leaf), for ``segments`` of ``(leaf, first group of its stream, groups, first output group)``.
    Cached per device, layout and segments: a training loop's steps share one (only the key changes)."""
    cache_key = (str(device), blocks, segments)
    with _LOCK:
        table = _TABLES.get(cache_key)
        if table is None:
            rows = []
            for leaf, first, groups, out_group in segments:
                starts = torch.arange(0, groups, BLOCK, dtype=torch.int64)
                rows.append(torch.stack([out_group + starts, (groups - starts).clamp(max=BLOCK), (first + starts) * blocks, torch.full_like(starts, leaf - (1 << 64) if leaf >= 1 << 63 else leaf)], dim=1))
            table = torch.cat(rows).to(device)
            if len(_TABLES) >= _MAX_TABLES:
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[cache_key] = table
        return table


def fill(out: Tensor, key: bytes, segments: Sequence[tuple[int, int, int, int]], *, precision: int) -> None:
    """Write keyed normals into ``out`` (``[groups, 2, pairs]``, float32 for ``precision`` 32, float64
    for 64, contiguous, on a CUDA device): for each ``(leaf, first, groups, out_group)`` of
    ``segments``, groups ``[first, first + groups)`` of leaf ``leaf``'s stream (ChaCha20 key ``key``,
    32 bytes) into rows ``[out_group, out_group + groups)``. Counters are checked by the caller."""
    blocks = 3 if precision == 32 else 1
    segments = tuple((int(leaf), int(first), int(groups), int(at)) for leaf, first, groups, at in segments if groups > 0)
    if not segments:
        return
    table = _table(out.device, blocks, segments)
    kernel = _kernels().normals32 if precision == 32 else _kernels().normals64
    with _on(out.device):
        kernel[(table.shape[0],)](out, table, *_args(key), B=BLOCK)
        if out.device.type == "cuda":  # a cached table read on another stream than it was made on: not reused before this launch ran
            table.record_stream(torch.cuda.current_stream(out.device))


def keystream(key: bytes, nonce: bytes, first_block: int, nblocks: int, *, device: torch.device | str) -> Tensor:
    """Blocks ``[first_block, first_block + nblocks)`` of ``(key, nonce)`` as ``[nblocks, 16]`` int64
    words, from this module's block function (the tests' check of its bits against OpenSSL's)."""
    out = torch.empty(nblocks, 16, dtype=torch.int64, device=device)
    if nblocks:
        with _on(out.device):
            _kernels().words[(math.ceil(nblocks / BLOCK),)](out, first_block, nblocks, *_args(nonce), *_args(key), B=BLOCK)
    return out


def radii(words: Tensor, *, precision: int) -> Tensor:
    """The kernels' Box-Muller radius of each int64 word of ``words`` (1-D, on the kernel's device),
    float32 for ``precision`` 32, float64 for 64 (the self-check compares it with the host's)."""
    pairs = torch.stack([words & 0xFFFFFFFF, (words >> 32) & 0xFFFFFFFF], dim=1).contiguous()
    out = torch.empty(words.numel(), dtype=torch.float32 if precision == 32 else torch.float64, device=words.device)
    if words.numel():
        with _on(words.device):
            _kernels().radii[(math.ceil(words.numel() / BLOCK),)](pairs, out, words.numel(), PRECISION=precision, B=BLOCK)
    return out
