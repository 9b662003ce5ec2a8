"""ChaCha20 (RFC 8439) as a counter-based keystream: OpenSSL's on the CPU, and a pure-torch twin.

A keyed noise stream needs three things a hash-based stream (SHAKE-256 through hashlib: one
thread, ~0.5 GB/s) lacks: speed, random access (block ``b`` of a stream is computable without
the blocks before it, so any element range of a leaf's noise can be regenerated) and a
reference that runs anywhere torch does. ChaCha20's block function maps
``(key, counter, nonce)`` to 64 bytes; the keystream of ``(key, nonce)`` is the blocks at
counters ``c, c + 1, ...``.

* :func:`keystream` returns ``nblocks`` blocks from ``first_block`` on, from OpenSSL (through the
  ``cryptography`` package, several GB/s with SIMD) when it is installed, else from
  :func:`chacha20_blocks`.
* :func:`chacha20_blocks` is the block function in torch (int64 arithmetic masked to 32 bits,
  vectorised over blocks): for machines without OpenSSL and as the tests' oracle.

Guarantees:
    Both backends return the same bytes (tested bitwise, and against RFC 8439's known answers,
    sections 2.3.2 and 2.4.2). Counters are 32-bit (RFC 8439): a stream is at most ``2**32``
    blocks (256 GiB); asking past that raises instead of wrapping around.

References:
    Y. Nir, A. Langley, "ChaCha20 and Poly1305 for IETF Protocols", RFC 8439 (2018).
    D. J. Bernstein, "ChaCha, a variant of Salsa20" (2008).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["keystream", "keystream_chunks", "keystream_words", "key_words", "words64", "block_counters", "check_blocks", "chacha20_blocks", "words_to_bytes", "have_openssl"]

_MASK = 0xFFFFFFFF
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
_CHUNK = 1 << 22  # OpenSSL is fed zeros this many bytes at a time (one cached buffer)
_ZEROS = memoryview(bytes(_CHUNK))

try:  # OpenSSL's ChaCha20 through `cryptography`; optional (the torch twin gives the same bytes)
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
except ImportError:  # pragma: no cover - exercised only where cryptography is missing
    Cipher = algorithms = None


def have_openssl() -> bool:
    """Whether :func:`keystream` can use OpenSSL (the ``cryptography`` package is importable)."""
    return Cipher is not None


def _check(key: bytes, nonce: bytes, first_block: int, nblocks: int) -> None:
    _check_key(key, nonce)
    check_blocks(first_block, nblocks)


def _check_key(key: bytes, nonce: bytes) -> None:
    if not (isinstance(key, bytes) and len(key) == 32):
        raise ValueError("chacha20: key must be 32 bytes.")
    if not (isinstance(nonce, bytes) and len(nonce) == 12):
        raise ValueError("chacha20: nonce must be 12 bytes.")


def _rotl(x: Tensor, n: int) -> Tensor:
    return ((x << n) | (x >> (32 - n))) & _MASK


def _quarter(x: list[Tensor], a: int, b: int, c: int, d: int) -> None:
    x[a] = (x[a] + x[b]) & _MASK
    x[d] = _rotl(x[d] ^ x[a], 16)
    x[c] = (x[c] + x[d]) & _MASK
    x[b] = _rotl(x[b] ^ x[c], 12)
    x[a] = (x[a] + x[b]) & _MASK
    x[d] = _rotl(x[d] ^ x[a], 8)
    x[c] = (x[c] + x[d]) & _MASK
    x[b] = _rotl(x[b] ^ x[c], 7)


def _words(b: bytes) -> list[int]:
    return [int.from_bytes(b[i : i + 4], "little") for i in range(0, len(b), 4)]


def chacha20_blocks(key: bytes, counters: Tensor, nonce: bytes) -> Tensor:
    """The ChaCha20 block function (RFC 8439, 2.3) at each of ``counters``, in torch.

    Args:
        key: 32 bytes. nonce: 12 bytes.
        counters: a 1-D int64 tensor of block counters in ``[0, 2**32)`` (any order, repeats fine).

    Returns:
        ``[len(counters), 16]`` int64: the 16 little-endian 32-bit output words of each block, in
        ``[0, 2**32)`` (serialise with :func:`words_to_bytes`).
    """
    if counters.dtype != torch.int64 or counters.dim() != 1:
        raise ValueError("chacha20_blocks: counters must be a 1-D int64 tensor.")
    _check_key(key, nonce)
    if counters.numel() and (int(counters.min()) < 0 or int(counters.max()) > _MASK):
        raise ValueError("chacha20_blocks: counters must be in [0, 2**32).")
    return _blocks(key, counters, nonce)


def keystream_words(key: bytes, nonce: bytes, first_block: int, nblocks: int, *, device: torch.device | str = "cpu") -> Tensor:
    """The keystream of blocks ``[first_block, first_block + nblocks)`` as ``[nblocks, 8]`` int64
    words, computed on ``device`` by :func:`chacha20_blocks`'s torch ops: word ``j`` of a block is
    its bytes ``8j .. 8j + 7`` read as a little-endian signed 64-bit integer, i.e.
    ``keystream(...).view(torch.int64)`` bit for bit, without bytes or a trip through the host
    (the keyed noise of tensors on an accelerator is made where they are)."""
    return words64(block_counters(first_block, nblocks, device=device), key_words(key, nonce, device=device))


def check_blocks(first_block: int, nblocks: int) -> None:
    """ValueError unless blocks ``[first_block, first_block + nblocks)`` are within the 32-bit
    counter (a stream never wraps around)."""
    if first_block < 0 or nblocks < 0 or first_block + nblocks > 1 << 32:
        raise ValueError(f"chacha20: blocks [{first_block}, {first_block + nblocks}) are outside the 32-bit counter's [0, 2**32).")


def block_counters(first_block: int, nblocks: int, *, device: torch.device | str = "cpu") -> Tensor:
    """The block counters ``[first_block, first_block + nblocks)`` as an int64 tensor on ``device``
    (checked: :func:`check_blocks`)."""
    check_blocks(first_block, nblocks)
    return torch.arange(first_block, first_block + nblocks, dtype=torch.int64, device=device)


def key_words(key: bytes, nonce: bytes, *, device: torch.device | str = "cpu") -> Tensor:
    """The key's 8 and the nonce's 3 little-endian 32-bit words, an int64 ``[11]`` tensor: the
    block function's inputs as a tensor, so that one compiled kernel serves every key and stream."""
    _check_key(key, nonce)
    return torch.tensor(_words(key) + _words(nonce), dtype=torch.int64, device=device)


def words64(counters: Tensor, kn: Tensor) -> Tensor:
    """The blocks at ``counters`` (int64, in range) of the stream ``kn`` (:func:`key_words`) as
    ``[n, 8]`` int64 words (see :func:`keystream_words`): plain torch ops, traceable and compilable."""
    w = _rounds(counters, kn)
    return torch.stack([w[2 * j] | (w[2 * j + 1] << 32) for j in range(8)], dim=1)  # (the shift wraps into the sign bit, as the bytes' int64 view reads)


def _blocks(key: bytes, counters: Tensor, nonce: bytes) -> Tensor:
    """:func:`chacha20_blocks` without its checks (``counters`` known to be in range)."""
    return torch.stack(_rounds(counters, key_words(key, nonce, device=counters.device)), dim=1)


def _rounds(counters: Tensor, kn: Tensor) -> list[Tensor]:
    """The 16 output words (each ``[n]``, in ``[0, 2**32)``) of the blocks at ``counters``."""
    zero = torch.zeros_like(counters)
    init = [zero + c for c in _SIGMA] + [zero + kn[i] for i in range(8)] + [counters] + [zero + kn[8 + i] for i in range(3)]
    x = list(init)
    for _ in range(10):  # 20 rounds: column then diagonal quarter rounds
        _quarter(x, 0, 4, 8, 12)
        _quarter(x, 1, 5, 9, 13)
        _quarter(x, 2, 6, 10, 14)
        _quarter(x, 3, 7, 11, 15)
        _quarter(x, 0, 5, 10, 15)
        _quarter(x, 1, 6, 11, 12)
        _quarter(x, 2, 7, 8, 13)
        _quarter(x, 3, 4, 9, 14)
    return [(a + b) & _MASK for a, b in zip(x, init)]


def words_to_bytes(words: Tensor) -> Tensor:
    """``[..., 16]`` int64 words in ``[0, 2**32)`` as their little-endian bytes, a flat uint8 tensor."""
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).reshape(-1)


def keystream(key: bytes, nonce: bytes, first_block: int, nblocks: int, *, backend: str = "auto") -> Tensor:
    """``64 * nblocks`` keystream bytes of ``(key, nonce)`` from block counter ``first_block`` on.

    Args:
        key: 32 bytes. nonce: 12 bytes (RFC 8439's 96-bit nonce).
        first_block, nblocks: the counter range ``[first_block, first_block + nblocks)``, within
            ``[0, 2**32)``.
        backend: ``"openssl"`` (needs ``cryptography``), ``"torch"`` (:func:`chacha20_blocks`) or
            ``"auto"`` (OpenSSL when available).

    Returns:
        A flat uint8 CPU tensor; the same bytes whatever the backend.
    """
    out = torch.empty(64 * nblocks, dtype=torch.uint8)
    for start, chunk in keystream_chunks(key, nonce, first_block, nblocks, backend=backend):
        out[64 * start : 64 * start + chunk.numel()] = chunk
    return out


def keystream_chunks(key: bytes, nonce: bytes, first_block: int, nblocks: int, *, chunk_blocks: int = 1 << 14, backend: str = "auto") -> Iterator[tuple[int, Tensor]]:
    """:func:`keystream` in pieces of at most ``chunk_blocks`` blocks: ``(first block - first_block, bytes)``.

    The bytes are a view of one scratch buffer that the next piece overwrites: use each piece
    before asking for the next. Pieces small enough for the cache make a consumer that
    transforms each at once (``keyed_normal``) one pass over memory instead of three.
    """
    _check(key, nonce, first_block, nblocks)
    if backend == "auto":
        backend = "openssl" if have_openssl() else "torch"
    if backend not in ("openssl", "torch"):
        raise ValueError(f"keystream: backend must be 'auto', 'openssl' or 'torch', got {backend!r}.")
    if backend == "openssl" and not have_openssl():
        raise RuntimeError("keystream: backend='openssl' needs the `cryptography` package (pip install cryptography).")
    chunk_blocks = max(1, min(chunk_blocks, _CHUNK // 64, nblocks))
    if nblocks == 0:
        return
    if backend == "torch":
        for lo in range(0, nblocks, chunk_blocks):
            counters = torch.arange(first_block + lo, first_block + min(nblocks, lo + chunk_blocks), dtype=torch.int64)
            yield lo, words_to_bytes(chacha20_blocks(key, counters, nonce))
        return
    # cryptography's 16-byte ChaCha20 nonce is RFC 8439's state words 12-15: the 32-bit counter, then the nonce
    enc = Cipher(algorithms.ChaCha20(key, first_block.to_bytes(4, "little") + nonce), mode=None).encryptor()
    scratch = torch.empty(64 * chunk_blocks, dtype=torch.uint8)
    view = memoryview((ctypes.c_char * scratch.numel()).from_address(scratch.data_ptr())).cast("B")  # no zero-fill
    for lo in range(0, nblocks, chunk_blocks):
        k = 64 * (min(nblocks, lo + chunk_blocks) - lo)
        enc.update_into(_ZEROS[:k], view[:k])  # keystream = encryption of zeros
        yield lo, scratch[:k]


if sys.byteorder != "little":  # pragma: no cover - torch's CPU targets are little-endian
    raise ImportError("vmapdp.noise.chacha reads keystream bytes as little-endian words; this host is big-endian.")
