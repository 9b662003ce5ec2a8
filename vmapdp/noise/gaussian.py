"""Gaussian noise for DP-SGD, from an explicit source of randomness.

``add_noise(tree, std, ...)`` adds independent ``N(0, std**2)`` to every element of every leaf
and rounds each sum to a grid of ``std/128`` to ``std/64`` (snapping, below). The noise is drawn in float32 or wider (float64 stays float64) whatever the leaves' dtype, and
the sum is returned in that dtype: a half-precision gradient is never noised in half precision.

Sources, exactly one per call:

* ``key=`` (bytes, int or str): reproducible noise that only the key's holder can predict: leaf
  ``i`` is drawn (Box-Muller, 63-bit radius uniforms, :func:`keyed_normal`) from the ChaCha20
  stream (RFC 8439; OpenSSL's, or a torch twin with the same bits) keyed by ``SHA-256(label ||
  key)`` with nonce ``(precision, i)``: counter-based, so any element range can be regenerated.
  ``make_train_step`` uses ``key = (secret seed, step, run, configuration)``. torch's
  generators cannot play this role: the CPU one keeps only 32 bits of a seed (a brute-forceable
  search, and streams of different steps collide by the birthday bound within ~10**5 steps), and
  Mersenne Twister's output is linear in its state, which can be solved for from outputs.
* ``secure=True``: the operating system's CSPRNG (not reproducible): a fresh 256-bit key from it
  (``secrets.token_bytes``) per call, expanded by the keyed stream above, as an OS CSPRNG (e.g.
  Linux's ``getrandom``) expands its own entropy with ChaCha20; so as fast as ``key=``, and made on
  the device on CUDA. The same as giving no source (below); the flag says so explicitly, and
  refuses a generator or key beside it. :func:`secure_normal` transforms the OS's bytes
  themselves (5-7x slower on the CPU).
* ``generator=``: a ``torch.Generator`` you manage: predictable (see above), fine for tests, not
  for releasing models.
* none of them: a fresh random key from OS entropy (unpredictable, not reproducible).

The noise never comes from torch's global RNG: that one is routinely seeded (``torch.manual_seed
(0)`` for reproducible experiments), and noise from a known seed protects nothing.

Snapping (the default, ``snap=True``; Mironov 2012, adapted to Gaussian noise): each noisy value
is computed in float64 and rounded to a multiple of the grid ``L = snap_grid(std) = 2**(floor(
log2 std) - 6)`` (a power of two in ``(std/128, std/64]``, a function of the public std only),
then cast to the leaf's dtype. Why: the floats a plain ``x + std * z`` can produce depend on
``x`` (the noise is a float with its own gaps, and the sum is rounded at ``x``'s scale), so a
released value can rule inputs out whatever the noise (Mironov's least-significant-bits attack;
Jin et al. 2022 for Gaussian samplers). Rounding to ``L`` is post-processing of the real-valued
release; in floating point the float64 sum is within ``~2**-53 (|v| + |std z|)`` of it (the
product is rounded, then the sum), so the snapped value equals the exact one's rounding except
within that distance of a cell's edge, and every multiple of ``L`` within the noise's reach is
reachable from every ``x`` (a cell near the mode holds ~``10**4`` float32 noise values). Its
cost: variance ``L**2 / 12 <= std**2 / 49152`` added, the gradient of the release with respect
to ``x`` is 0, about 3 ms per million elements on a CPU core (one compiled loop). What it is
not: a proof. The float sampler's probability of a cell differs from the Gaussian's by a
relative ``~2**-16`` near the mode, growing to ``~2**-13`` at 8 standard deviations (float32
noise; ``~2**-45`` to ``2**-42`` float64); beyond ~9 the radius takes a few discrete values,
cells apart, so there is no relative bound, only their total mass (~``3e-18`` per draw, an
uncharged delta like the truncation at 9.42, :func:`keyed_normal`). None of it is charged by an
accountant here; a discrete Gaussian with its own accounting (Canonne, Kamath, Steinke 2020)
would close it. ``snap=False`` gives the plain ``x + std * z`` (differentiable in ``x``; exactly ``keyed_normal``'s
draws, for tests of the noise itself), and so do ``check_sensitivity``'s runs (thrown away,
inside ``unreleased()``), whose two runs from one state must add noise that cancels exactly.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import secrets
import struct
import threading
import warnings
from typing import Any

import optree
import torch
from torch import Tensor

from vmapdp import _checks
from vmapdp._tree import acc_dtype
from vmapdp.noise import _triton, chacha

__all__ = ["add_noise", "make_generator", "secure_normal", "keyed_normal", "key_bytes", "snap_grid", "snapped_release", "stream_key"]


def key_bytes(key: bytes | int | str, *, call: str = "noise") -> bytes:
    """A secret key (bytes, int or str) as the bytes that keyed streams hash."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, (int, str)) and not isinstance(key, bool):
        return str(key).encode()
    raise TypeError(f"{call}: key must be bytes, int or str, got {type(key).__name__}.")


_KDF_LABEL = b"vmapdp/keyed-normal/chacha20/v1\x00"  # the version tag: a new stream gets a new label
_FP32, _FP64 = 32, 64  # precision tags, in the nonce
# (ChaCha20 blocks per group, normal pairs per group): a float64 pair takes two 64-bit words (radius,
# angle); a float32 pair a 64-bit radius word and a 32-bit angle word: 3 blocks = 16 int64 + 16 int32
_LAYOUT = {_FP64: (1, 4), _FP32: (3, 16)}
_CHUNK_GROUPS = 4096  # groups of keystream per piece: 768 KiB (float32), 256 KiB (float64), within a core's L2
# on an accelerator (the torch twin, op by op): pieces large enough that the ~2,000 ops of 20 rounds
# are not launch-bound; 12 MiB of keystream (float32) and ~32 int64 words of state per block
_DEVICE_CHUNK_GROUPS = 1 << 16
# ... and for the compiled kernel, which holds no keystream: only the pieces' counters (24 MiB at float32)
_DEVICE_FUSED_GROUPS = 1 << 20


def stream_key(key: bytes | int | str) -> bytes:
    """The 256-bit ChaCha20 key of a noise key: ``SHA-256(version label || key)``.

    The label carries a version (``v1``), so a later change of the stream or of the transform
    gets new keys, and its streams never coincide with this one's.
    """
    return hashlib.sha256(_KDF_LABEL + key_bytes(key)).digest()


def _nonce(leaf: int, precision: int) -> bytes:
    """RFC 8439's 96-bit nonce of one leaf's stream: (precision tag: uint32, leaf index: uint64), little-endian."""
    return struct.pack("<IQ", precision, leaf)


def keyed_normal(
    shape: tuple[int, ...],
    key: bytes | int | str,
    *,
    leaf: int = 0,
    offset: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend: str = "auto",
    fused: bool | None = None,
) -> Tensor:
    """Standard normal samples determined by ``key`` (same key, same samples): a ChaCha20 stream.

    Element ``i`` (flattened) of leaf ``leaf``'s noise is a function of ``(key, leaf, i, precision)``
    only: ``keyed_normal((n,), key, leaf=l, offset=o)`` is elements ``[o, o + n)`` of that stream,
    equal bit for bit to the same slice of a longer draw (so a shard can regenerate its part).

    Args:
        shape: the output shape; ``prod(shape)`` elements from ``offset`` on.
        key: the secret noise key (bytes, int or str); the ChaCha20 key is :func:`stream_key`.
        leaf: the stream's index (``add_noise`` uses the leaf's position in the flattened tree).
        offset: the first element.
        dtype: the output dtype. float64 is computed in float64; every other dtype in float32
            and cast (half precision never draws noise in half precision).
        device: where the samples are returned.
        backend: ``"openssl"``, ``"torch"`` or ``"auto"`` (see :func:`vmapdp.noise.chacha.keystream`;
            the same bits either way). ``"openssl"``: the keystream and the transform on the host,
            then copied to ``device``. ``"torch"``: the keystream and the transform run on
            ``device`` itself (the torch twin of ChaCha20, :func:`vmapdp.noise.chacha.words64`, or
            on CUDA the Triton kernel): on an accelerator nothing is made on the host or copied
            over the bus. ``"auto"``: OpenSSL for the CPU (where it is installed), the Triton
            kernel on CUDA, the torch twin on other accelerators or where triton is missing.
        fused: one compiled kernel or op by op in eager torch. On the CPU the kernel is
            Inductor's transform of each cache-sized piece of OpenSSL's keystream. On a CUDA
            device it is a Triton kernel (:mod:`vmapdp.noise._triton`) that makes the keystream
            and the transform together from the block counters, in native 32-bit words, for all
            of ``add_noise``'s leaves in one launch per 2**21 groups (no keystream in memory; on an H200, 100M
            float32 elements took 1.7 ms, against 4.6 ms for Inductor's compile of the int64
            torch twin, 568 ms from OpenSSL with the copy and ~1 s op by op; benchmarks/README.md);
            before its first draw on a device and precision it is checked against known answers,
            and never used if it fails them (a warning, and the next path from then on). On other
            accelerators, or where triton is missing or fails, Inductor compiles the torch twin
            for the device. ``None``: the first of these that builds (once per process and device
            type; cached on disk), else op by op from then on; ``True``: the first or raise. Fused and op by op agree within a few ulps, not
            bitwise, and so do the CPU's and an accelerator's math functions: a run is
            reproducible on one setting and device type (the keystream bits are the same on all).

    How the bits become normals (Box-Muller, ``z = sqrt(-2 ln u) * (cos, sin)(theta)``), in the
    working precision (float64 for float64, else float32):

    * the radius from a 64-bit word ``w`` read as a signed integer: ``u = |w| / 2**63``, whose 63
      random bits are rounded to the working precision (53 or 24 significant bits, so small ``u``,
      the tails, keep full relative precision) and clamped into ``[2**-64, 1 - ulp]``: inside the
      open interval ``(0, 1)``, never ``log 0``.
    * the angle ``theta = w' * pi / 2**63`` from another 64-bit word (float64), or
      ``w' * pi / 2**31`` from a 32-bit word (float32): uniform on ``[-pi, pi]`` to the working
      precision.
    * element layout: a group of ChaCha20 blocks (1 for float64, 3 for float32) gives ``k`` pairs
      (4; 16), written as ``k`` cosines then ``k`` sines, so element ``i`` lives in group ``i // 2k``.

    Guarantees:
        Same ``(key, leaf, element, dtype)``, same bits, on either backend and for any element
        range (for one ``fused`` setting). The radius comes from a 63-bit uniform, so the tails
        reach ``sqrt(128 ln 2) = 9.42`` standard deviations in both precisions. A 24-bit uniform
        in ``(0, 1)`` would stop them at ``sqrt(50 ln 2) = 5.89`` (``P(|Z| > 5.89) = 4e-9`` per
        coordinate): a shift of the sum by the sensitivity then moves mass to where the unshifted
        noise has none, an unaccounted delta of about ``P(Z > 5.89 - 1/sigma)`` per step
        (``5e-7`` at noise multiplier 1). At 9.42 it is ``P(Z > 9.42 - 1/sigma)``: ``2e-17`` at
        noise multiplier 1, ``6e-14`` at 0.5.

    What is and is not defended (floating-point attacks: Mironov 2012; Jin et al. 2022):
    textbook samplers draw ``u`` as a float in ``[0, 1)`` (``log 0`` possible; few random bits
    near 0, so a truncated and gappy tail) and add noise whose rounding reveals the input. The
    first is defended here (open interval, 63 random bits, full relative precision near 0). The
    second is defended where the noise is added, not here: ``add_noise`` (and so every step)
    snaps each release to a grid of ``std/128`` to ``std/64`` (the module docstring says what that
    covers and what it does not prove); a discrete Gaussian (Canonne, Kamath, Steinke 2020) is not
    implemented.

    References:
        RFC 8439 (ChaCha20). C. Canonne, G. Kamath, T. Steinke, "The discrete Gaussian for
        differential privacy", NeurIPS 2020. G. E. P. Box, M. E. Muller, "A note on the generation of random normal
        deviates" (1958). I. Mironov, "On significance of the least significant bits for
        differential privacy", CCS 2012. J. Jin, E. McMurtry, B. Rubinstein, O. Ohrimenko, "Are
        we there yet? Timing and floating-point attacks on differential privacy systems", IEEE S&P 2022.
    """
    _check_stream(leaf, offset, backend)
    _checks.guessable("keyed_normal(shape, key)", "key", key, "the noise")
    return _keyed_normals(key, [(shape, leaf, offset, dtype, torch.device(device))], backend=backend, fused=fused)[0]


def _check_stream(leaf: int, offset: int, backend: str) -> None:
    if isinstance(leaf, bool) or not isinstance(leaf, int) or not 0 <= leaf < 1 << 64:
        raise ValueError(f"keyed_normal: leaf={leaf!r} must be an int in [0, 2**64).")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"keyed_normal: offset={offset!r} must be an int >= 0.")
    if backend not in ("auto", "openssl", "torch"):
        raise ValueError(f"keyed_normal: backend must be 'auto', 'openssl' or 'torch', got {backend!r}.")


# float32 groups per launch of the Triton kernel (a batch of leaves' noise in one buffer: 256 MiB at most, or one leaf)
_TRITON_BATCH_GROUPS = 1 << 21
_triton_ok: dict[str, bool] = {}  # device type -> whether the Triton kernel ran there (absent: not tried yet)


def _keyed_normals(key: bytes | int | str, items: list[tuple[tuple[int, ...], int, int, torch.dtype, torch.device]], *, backend: str = "auto", fused: bool | None = None, then: Any = None) -> list[Any]:
    """:func:`keyed_normal` of each ``(shape, leaf, offset, dtype, device)`` (checked by the caller):
    the leaves on a CUDA device in as few launches of the Triton kernel as their sizes allow
    (:mod:`vmapdp.noise._triton`), the others one by one (:func:`_keyed_one`). With ``then``, each
    leaf's noise is passed to ``then(i, z)`` as soon as it is drawn and its result is kept instead (so
    at most one batch of noise is alive at a time, not the whole tree's)."""
    skey = stream_key(key)
    done = then if then is not None else (lambda i, z: z)
    out: list[Any] = [None] * len(items)
    batches: dict[tuple[str, int], list[int]] = {}
    small: dict[int, list[int]] = {}  # precision -> small leaves made on the host: one transform for many (_host_batch)
    for shape, _, offset, dtype, _ in items:  # (every range checked before anything is drawn)
        chacha.check_blocks(*_block_range(shape, offset, dtype))
    for i, (shape, _, _, dtype, device) in enumerate(items):
        if math.prod(shape) == 0:
            out[i] = done(i, torch.zeros(shape, dtype=dtype, device=device))
        elif backend != "openssl" and fused is not False and _triton.available(device) and (fused or _triton_ok.get(device.type) is not False):
            batches.setdefault((str(device), _FP64 if dtype == torch.float64 else _FP32), []).append(i)
        elif math.prod(shape) <= _SMALL_LEAF and _host(device) and backend != "torch" and chacha.have_openssl():
            small.setdefault(_FP64 if dtype == torch.float64 else _FP32, []).append(i)
        else:
            with torch._C._DisableFuncTorch():
                z = _keyed_one(skey, *items[i], backend=backend, fused=fused)
            out[i] = done(i, z)
    for precision, members in small.items():
        _host_batch(skey, items, members, precision, fused, out, done)
    for (device, precision), members in batches.items():
        try:
            with torch._C._DisableFuncTorch():  # pure in its own inputs: plain tensors under vmap/grad
                _triton_self_check(torch.device(device), precision)
            _triton_batch(skey, items, members, precision, torch.device(device), out, done)
        except Exception as e:
            # an error of the call (out of memory, or raised by `then`) is not the kernel's: raised, nothing switched
            if isinstance(e, _ThenFailed):
                raise e.__cause__ from None
            # a kernel that ran before fails now: raised, unless it is a failed self-check (another
            # precision or device): that one is never used, whatever ran before
            if fused or isinstance(e, torch.OutOfMemoryError) or (_triton_ok.get(torch.device(device).type) and not isinstance(e, _SelfCheckFailed)):
                raise
            if isinstance(e, _SelfCheckFailed):
                warnings.warn(f"{e} Falling back to the torch twin of ChaCha20 (compiled by Inductor, or op by op) for {device}.", RuntimeWarning, stacklevel=3)
            _triton_ok[torch.device(device).type] = False  # triton cannot build here: Inductor's kernel (or op by op) from now on
            for i in members:
                if out[i] is None:
                    with torch._C._DisableFuncTorch():
                        z = _keyed_one(skey, *items[i], backend=backend, fused=fused)
                    out[i] = done(i, z)
        else:
            _triton_ok[torch.device(device).type] = True
    return out


class _ThenFailed(RuntimeError):
    pass


# host leaves of at most this many elements share one call of the transform (_host_batch): each call of
# the compiled kernel costs tens of microseconds, more than such a leaf's own noise (measured 2026-11-29,
# 2 cores: 100 leaves of 768 elements took 5.2 ms one by one, a single leaf of their size 0.3 ms)
_SMALL_LEAF = 1 << 14


def _host_batch(skey: bytes, items: list, members: list[int], precision: int, fused: bool | None, out: list, done: Any) -> None:
    """:func:`_keyed_one` (OpenSSL's keystream, the transform on the host) of the small leaves
    ``members``, each leaf's keystream (its own nonce) laid after the previous one's in one buffer,
    transformed by one call per ``_CHUNK_GROUPS`` groups: the transform is row by row (a group is a
    row), so each leaf's normals are bitwise those it would get alone."""
    blocks, pairs = _LAYOUT[precision]
    per_group = 2 * pairs
    dtype = torch.float64 if precision == _FP64 else torch.float32
    pending: list[tuple[int, int, int]] = []  # (leaf's item, its first group in the buffer, its first group in its stream)
    raws: list[Tensor] = []
    total = 0

    def flush() -> None:
        nonlocal total
        with torch._C._DisableFuncTorch():  # (pure in its own inputs, as in _keyed_one; `done` is not: called after)
            raw = torch.cat(raws) if len(raws) > 1 else raws[0]
            normals = torch.empty(total, 2, pairs, dtype=dtype)
            _normals_into(_words(raw, precision), precision, fused, normals)
            flat = normals.reshape(-1)
            zs = []
            for i, first, g0 in pending:
                shape, _, offset, leaf_dtype, device = items[i]
                start = first * per_group + offset - g0 * per_group
                zs.append((i, flat[start : start + math.prod(shape)].reshape(shape).to(dtype=leaf_dtype, device=device)))
        for i, z in zs:
            out[i] = done(i, z)
        pending.clear()
        raws.clear()
        total = 0

    for i in members:
        shape, leaf, offset, _, _ = items[i]
        g0, g1 = _groups(math.prod(shape), offset, precision)
        with torch._C._DisableFuncTorch():
            raws.append(chacha.keystream(skey, _nonce(leaf, precision), g0 * blocks, (g1 - g0) * blocks, backend="openssl"))
        pending.append((i, total, g0))
        total += g1 - g0
        if total >= _CHUNK_GROUPS:
            flush()
    if pending:
        flush()


def _groups(n: int, offset: int, precision: int) -> tuple[int, int]:
    """The groups ``[g0, g1)`` of :data:`_LAYOUT` that hold elements ``[offset, offset + n)`` of a stream."""
    per_group = 2 * _LAYOUT[precision][1]
    return offset // per_group, -(-(offset + n) // per_group)


def _block_range(shape: tuple[int, ...], offset: int, dtype: torch.dtype) -> tuple[int, int]:
    """The (first block, blocks) of elements ``[offset, offset + prod(shape))`` of a stream."""
    precision = _FP64 if dtype == torch.float64 else _FP32
    n = math.prod(shape)
    if n == 0:
        return 0, 0
    g0, g1 = _groups(n, offset, precision)
    blocks = _LAYOUT[precision][0]
    return g0 * blocks, (g1 - g0) * blocks


class _SelfCheckFailed(RuntimeError):
    pass


def _radius_probe_words() -> Tensor:
    """int64 words whose radii a kernel must get right and random keystream seldom shows: the
    clamp's ends (0, +-1, the int64 extremes, around float32's and float64's largest value below
    2**63), words whose bits are all in the low half (the low 32 bits decide the radius), each bit
    alone, and both halves' edges."""
    lo, hi = -(1 << 63), (1 << 63) - 1
    words = {0, 1, -1, 2, lo, lo + 1, hi, hi - 1, (1 << 32) - 1, 1 << 32, (1 << 31) - 1, 1 << 31, -(1 << 32), -((1 << 32) - 1)}
    for top in ((1 << 63) - (1 << 39), (1 << 63) - (1 << 10)):  # float32's and float64's TOP as int64 words, and around them
        words |= {top + d for d in (-(1 << 40), -(1 << 38), -1, 0, 1) if lo <= top + d <= hi}
    words |= {1 << k for k in range(63)} | {-(1 << k) for k in range(63)}
    words |= {(1 << k) - 1 for k in range(1, 64)} | {(0x9E3779B97F4A7C15 * k) % (1 << 64) - (1 << 63) for k in range(1, 65)}
    return torch.tensor(sorted(words), dtype=torch.int64)


_triton_checked: set[tuple[str, int]] = set()  # (device, precision) whose kernel passed its known answers


def _triton_self_check(device: torch.device, precision: int) -> None:
    """Known answers before the Triton kernel's first draw for ``device`` and ``precision`` (once per
    process): its block function's words against the torch twin's, bit for bit (the last counters
    of a stream, a leaf index past 2**32; the ``words`` kernel), its radius of hand-picked words
    against the host's (:func:`_radius_probe_words`; the ``radii`` kernel), and a launch of the
    normals kernel for two leaves against the host's op-by-op transform of the same words, within
    the stated ulp bound (4 ulps relative plus 8 absolute). A kernel the local compiler
    miscompiles then never releases noise of another distribution: :class:`_SelfCheckFailed`."""
    if (str(device), precision) in _triton_checked:
        return
    skey = stream_key(b"vmapdp/triton-self-check")
    blocks, pairs = _LAYOUT[precision]
    dtype = torch.float64 if precision == _FP64 else torch.float32
    leaf, first, n = 2**40 + 3, 2**32 - 2 * _triton.BLOCK - 5, 2 * _triton.BLOCK + 5
    ours = _triton.keystream(skey, _nonce(leaf, precision), first, n, device=device).cpu()
    if not torch.equal(ours, chacha.chacha20_blocks(skey, torch.arange(first, first + n), _nonce(leaf, precision))):
        raise _SelfCheckFailed(f"keyed noise: the Triton kernel's ChaCha20 keystream on {device} differs from RFC 8439's (the torch twin's bits).")
    segments = [(7, 5, 2 * _triton.BLOCK + 3, 0), (leaf, 0, 17, 2 * _triton.BLOCK + 3)]  # (a partial program; two streams in one launch)
    buf = torch.empty(sum(g for _, _, g, _ in segments), 2, pairs, dtype=dtype, device=device)
    _triton.fill(buf, skey, segments, precision=precision)
    host = torch.cat([_EAGER[precision](chacha.keystream_words(skey, _nonce(lf, precision), g0 * blocks, g * blocks).view(-1, 8 * blocks)) for lf, g0, g, _ in segments])
    eps = torch.finfo(dtype).eps
    probe = _radius_probe_words()
    radii, host_radii = _triton.radii(probe.to(device), precision=precision).cpu(), _radius(probe, dtype)
    if not torch.allclose(radii, host_radii, rtol=4 * eps, atol=0):
        worst = int((radii - host_radii).abs().argmax())
        raise _SelfCheckFailed(
            f"keyed noise: the Triton kernel's {dtype} Box-Muller radius on {device} of the word {int(probe[worst])} is "
            f"{radii[worst].item()!r}, the host's {host_radii[worst].item()!r} (the bound is 4 ulps)."
        )
    if not torch.allclose(buf.cpu(), host, rtol=4 * eps, atol=8 * eps):
        worst = (buf.cpu() - host).abs().max().item()
        raise _SelfCheckFailed(f"keyed noise: the Triton kernel's {dtype} normals on {device} differ from the host's Box-Muller of the same bits by up to {worst:.3g} (the bound is 4 ulps relative + 8 absolute).")
    _triton_checked.add((str(device), precision))


def _triton_batch(skey: bytes, items: list, members: list[int], precision: int, device: torch.device, out: list, done: Any) -> None:
    """The Triton kernel's draws for ``items[members]`` (one device and precision), a launch per
    batch of at most :data:`_TRITON_BATCH_GROUPS` groups (or one larger leaf). The counter ranges
    were checked by :func:`_keyed_normals`, before anything was drawn."""
    _, pairs = _LAYOUT[precision]
    per_group = 2 * pairs
    spans = []
    for i in members:
        shape, leaf, offset = items[i][:3]
        spans.append((i, leaf, *_groups(math.prod(shape), offset, precision)))
    batch: list[tuple[int, int, int, int]] = []
    total = 0
    for k, span in enumerate(spans):
        batch.append(span)
        total += span[3] - span[2]
        if k + 1 == len(spans) or total + spans[k + 1][3] - spans[k + 1][2] > _TRITON_BATCH_GROUPS:
            segments, at = [], 0
            for _, leaf, g0, g1 in batch:
                segments.append((leaf, g0, g1 - g0, at))
                at += g1 - g0
            with torch._C._DisableFuncTorch():  # pure in its own inputs, as in _normals_into (the buffer too: a plain tensor under grad)
                buf = torch.empty(total, 2, pairs, dtype=torch.float64 if precision == _FP64 else torch.float32, device=device)
                _triton.fill(buf, skey, segments, precision=precision)
                flat = buf.reshape(-1)
                zs = []
                for (i, _, g0, _), (_, _, _, first) in zip(batch, segments):
                    shape, _, offset, dtype, _ = items[i]
                    start = first * per_group + offset - g0 * per_group
                    zs.append((i, flat[start : start + math.prod(shape)].reshape(shape).to(dtype)))
            del buf, flat
            for i, z in zs:
                try:
                    out[i] = done(i, z)
                except Exception as e:
                    raise _ThenFailed() from e
            del zs  # (the batch's buffer goes once its leaves are done)
            batch, total = [], 0


def _keyed_one(skey: bytes, shape: tuple[int, ...], leaf: int, offset: int, dtype: torch.dtype, device: torch.device, *, backend: str, fused: bool | None) -> Tensor:
    """One leaf's :func:`keyed_normal` off the Triton kernel: OpenSSL's keystream and the fused
    transform on the host; or the torch twin where the noise is needed (Inductor's compiled kernel
    on an accelerator, op by op where it does not compile)."""
    n = math.prod(shape)
    if backend == "auto":  # the keystream where the noise is needed: on an accelerator, one compiled kernel
        backend = "torch" if not _host(device) or not chacha.have_openssl() else "openssl"
    where = device if backend == "torch" else torch.device("cpu")  # where the keystream and the transform run (OpenSSL's: the host)
    on_host = _host(where)
    precision = _FP64 if dtype == torch.float64 else _FP32
    blocks, pairs = _LAYOUT[precision]
    per_group = 2 * pairs
    g0, g1 = _groups(n, offset, precision)
    nonce = _nonce(leaf, precision)
    out = torch.empty(g1 - g0, 2, pairs, dtype=torch.float64 if precision == _FP64 else torch.float32, device=where)
    # on an accelerator, the keystream and the transform in one compiled kernel where it compiles
    compiled = backend == "torch" and not on_host and _device_compiled(skey, nonce, g0 * blocks, precision, fused, out)
    if backend == "torch" and not compiled:  # [nblocks, 8] int64 words where the noise is needed, a piece at a time, transformed op by op
        step = blocks * (_CHUNK_GROUPS if on_host else _DEVICE_CHUNK_GROUPS)
        for lo in range(0, (g1 - g0) * blocks, step):
            words = chacha.keystream_words(skey, nonce, g0 * blocks + lo, min(step, (g1 - g0) * blocks - lo), device=where)
            _normals_into(words.view(-1, 8 * blocks), precision, fused if on_host else False, out[lo // blocks : lo // blocks + words.shape[0] // blocks])
    elif backend != "torch":
        chunks = chacha.keystream_chunks(skey, nonce, g0 * blocks, (g1 - g0) * blocks, chunk_blocks=blocks * _CHUNK_GROUPS, backend=backend)
        for start, raw in chunks:  # keystream a cache-sized piece at a time, transformed at once
            _normals_into(_words(raw, precision), precision, fused, out[start // blocks : start // blocks + raw.numel() // (64 * blocks)])
    z = out.reshape(-1)[offset - g0 * per_group : offset - g0 * per_group + n]
    return z.reshape(shape).to(dtype=dtype, device=device)


def _words(raw: Tensor, precision: int) -> Tensor:
    """Keystream (or CSPRNG) bytes as int64 words, one row per group (a view, no copy)."""
    blocks, _ = _LAYOUT[precision]
    return raw.view(torch.int64).view(-1, 8 * blocks)


def _radius(words: Tensor, dtype: torch.dtype) -> Tensor:
    """``sqrt(-2 ln u)`` with ``u = |w| / 2**63`` (``w``: a word as a signed int64) in ``[2**-64, 1 - ulp]``."""
    top = 2.0**63 * (1.0 - torch.finfo(dtype).eps / 2)  # the largest float below 2**63: u < 1
    u = words.to(dtype).abs().clamp(0.5, top) * 2.0**-63
    return torch.sqrt(-2.0 * torch.log(u))


def _transform32(w: Tensor) -> Tensor:
    """int64 ``[G, 24]`` (16 radius words, then 16 int32 angle words in pairs) -> float32 ``[G, 2, 16]``."""
    r = _radius(w[:, :16], torch.float32)
    a = w[:, 16:]  # each int64 holds two int32 angle words: low half first (little-endian)
    angle = torch.stack([(a << 32) >> 32, a >> 32], dim=-1).reshape(-1, 16).to(torch.float32) * (math.pi / 2**31)
    return torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)


def _transform64(w: Tensor) -> Tensor:
    """int64 ``[G, 8]`` (4 radius words, 4 angle words) -> float64 ``[G, 2, 4]``."""
    r = _radius(w[:, :4], torch.float64)
    angle = w[:, 4:].to(torch.float64) * (math.pi / 2**63)
    return torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)


def _into32(words: Tensor, out: Tensor):  # unannotated: a (string) annotation would be a global of the traced graph, which Inductor cannot key its cache on
    out.copy_(_transform32(words))  # written in place: no temporary of the whole output
    return ()


def _into64(words: Tensor, out: Tensor):
    out.copy_(_transform64(words))
    return ()


_EAGER = {_FP32: _transform32, _FP64: _transform64}
_INTO = {_FP32: _into32, _FP64: _into64}
_FUSED: dict[int, Any] = {}
_fused_ok: bool | None = None  # None: not tried yet
_LOCK = threading.Lock()


def _fused(precision: int) -> Any:
    """The transform compiled by Inductor into one loop (once per process and precision).

    ``standalone_compile`` of a symbolically traced graph: one kernel for every size, outside
    dynamo (so no guards, no recompiles, nothing in ``torch._dynamo``'s caches or counters, and
    ``torch._dynamo.reset()`` leaves it alone).
    """
    with _LOCK:
        if precision not in _FUSED:
            from torch.fx.experimental.proxy_tensor import make_fx

            blocks, pairs = _LAYOUT[precision]
            example = torch.zeros(997, 8 * blocks, dtype=torch.int64)  # 997: no size shared with another dim (or 0, 1)
            out = torch.empty(997, 2, pairs, dtype=torch.float64 if precision == _FP64 else torch.float32)
            graph = make_fx(_INTO[precision], tracing_mode="symbolic")(example, out)
            # one thread: a call transforms one cache-sized piece (an OpenMP team per piece costs more than it gives,
            # and much more when other processes hold the cores)
            with torch._inductor.config.patch({"cpp.threads": 1}):
                _FUSED[precision] = torch._inductor.standalone_compile(graph, [example, out])
        return _FUSED[precision]


def _into_device32(counters: Tensor, kn: Tensor, out: Tensor):  # (unannotated, as _into32)
    out.copy_(_transform32(chacha.words64(counters, kn).view(-1, 24)))
    return ()


def _into_device64(counters: Tensor, kn: Tensor, out: Tensor):
    out.copy_(_transform64(chacha.words64(counters, kn).view(-1, 8)))
    return ()


_INTO_DEVICE = {_FP32: _into_device32, _FP64: _into_device64}
_DEVICE_FUSED: dict[tuple[int, str], Any] = {}
_device_ok: dict[str, bool] = {}  # device type -> whether the keystream kernel compiled there (absent: not tried yet)


def _device_fused(precision: int, device: torch.device) -> Any:
    """The keystream (ChaCha20's 20 rounds) and the transform compiled by Inductor into one kernel
    for ``device`` (once per process, precision and device): the counters and the key's words are
    its inputs, so it serves every key, stream and size. No keystream is held in memory."""
    with _LOCK:
        key = (precision, str(device))
        if key not in _DEVICE_FUSED:
            from torch.fx.experimental.proxy_tensor import make_fx

            blocks, pairs = _LAYOUT[precision]
            counters = torch.arange(997 * blocks, dtype=torch.int64, device=device)  # 997: as in _fused
            kn = torch.zeros(11, dtype=torch.int64, device=device)
            out = torch.empty(997, 2, pairs, dtype=torch.float64 if precision == _FP64 else torch.float32, device=device)
            graph = make_fx(_INTO_DEVICE[precision], tracing_mode="symbolic")(counters, kn, out)
            _DEVICE_FUSED[key] = torch._inductor.standalone_compile(graph, [counters, kn, out])
        return _DEVICE_FUSED[key]


def _device_compiled(skey: bytes, nonce: bytes, first_block: int, precision: int, fused: bool | None, out: Tensor) -> bool:
    """Fill ``out`` (``[groups, 2, pairs]`` on an accelerator) from blocks ``first_block, ...`` with
    the compiled kernel (:func:`_device_fused`), a piece at a time; False (nothing written) where
    ``fused`` is False or the kernel does not compile on this device type (then the caller runs
    the same ops one by one: the same keystream, normals within a few ulps)."""
    kind = out.device.type
    if fused is False or (fused is None and _device_ok.get(kind) is False):
        return False
    blocks, _ = _LAYOUT[precision]
    chacha.check_blocks(first_block, out.shape[0] * blocks)  # (a range past the counter is refused before anything is drawn)
    try:
        kernel = _device_fused(precision, out.device)
        kn = chacha.key_words(skey, nonce, device=out.device)
        with torch._C._DisableFuncTorch():  # pure in its own inputs, as in _normals_into
            for lo in range(0, out.shape[0], _DEVICE_FUSED_GROUPS):  # (one piece's counters at a time)
                hi = min(lo + _DEVICE_FUSED_GROUPS, out.shape[0])
                kernel(chacha.block_counters(first_block + lo * blocks, (hi - lo) * blocks, device=out.device), kn, out[lo:hi])
    except Exception:
        if fused or _device_ok.get(kind):
            raise
        _device_ok[kind] = False  # no compiler for this device here: op by op from now on, a few ulps apart
        return False
    _device_ok[kind] = True
    return True


def _host(device: torch.device) -> bool:
    """Whether noise for ``device`` is made on the host (the CPU) or on the device itself."""
    return device.type == "cpu"


def _normals_into(words: Tensor, precision: int, fused: bool | None, out: Tensor) -> None:
    """Box-Muller on keystream (or CSPRNG) words (``_words``), written into ``out`` (``[groups, 2, pairs]``, float32 or float64)."""
    global _fused_ok
    if fused is False or (fused is None and _fused_ok is False):
        out.copy_(_EAGER[precision](words))
        return
    try:
        # pure in its own inputs: run outside any vmap/grad the caller is under (nothing here is batched)
        with torch._C._DisableFuncTorch():
            _fused(precision)(words, out)
    except Exception:
        if fused or _fused_ok:
            raise
        _fused_ok = False  # Inductor cannot compile here (no C++ compiler): eager from now on, a few ulps apart
        out.copy_(_EAGER[precision](words))
        return
    _fused_ok = True


def secure_normal(shape: tuple[int, ...], *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Tensor:
    """Standard normal samples from the operating system's CSPRNG (``secrets``), via Box-Muller.

    The same transform as :func:`keyed_normal` (63-bit radius, float32 unless ``dtype`` is
    float64) on bytes from ``secrets.token_bytes`` instead of a keystream, on the host.
    ``add_noise(secure=True)`` draws from the OS too, but as a ChaCha20 stream under a fresh key
    from it (5-7x faster on the CPU: 44 against 294 ms for 10M float32 elements, 2026-11-27; made
    on the device on CUDA).

    What this defends against: an adversary who knows or guesses the seed of a pseudo-random
    generator (torch's generators are not cryptographic; their output can be predicted from a
    seed or from enough past output). What it does NOT defend against: attacks on the floating-
    point representation of Gaussian samples (Mironov 2012; Jin et al. 2022, "Are We There Yet?
    Timing and Floating-Point Attacks on Differential Privacy Systems"; Haney et al. 2022): those
    concern the noisy sum, which ``add_noise`` snaps to a grid (the module docstring).
    """
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    precision = _FP64 if dtype == torch.float64 else _FP32
    blocks, pairs = _LAYOUT[precision]
    groups = -(-n // (2 * pairs))
    raw = torch.frombuffer(bytearray(secrets.token_bytes(64 * blocks * groups)), dtype=torch.uint8)
    out = torch.empty(groups, 2, pairs, dtype=torch.float64 if precision == _FP64 else torch.float32)
    _normals_into(_words(raw, precision), precision, None, out)
    return out.reshape(-1)[:n].reshape(shape).to(dtype=dtype, device=device)


def make_generator(seed: int | None = None, *, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device``, seeded with ``seed`` or, if None, from OS entropy.

    Torch's CPU generator keeps only 32 bits of its seed, so noise drawn from it can be recovered
    by a 2**32 search: use it for tests and reproducible experiments; for noise that protects
    data use ``add_noise(..., key=secret)`` (a ChaCha20 stream) or ``secure=True``.
    """
    if seed is None:
        seed = secrets.randbits(63)
    else:
        seed = _checks.positive_int("make_generator(seed)", "seed", seed, minimum=0, fix="Or pass seed=None (OS entropy).")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def add_noise(
    tree: Any,
    std: float | Tensor,
    generator: torch.Generator | None = None,
    *,
    key: bytes | int | str | None = None,
    secure: bool = False,
    offsets: Any = None,
    snap: bool = True,
    noise_dtype: torch.dtype | None = None,
) -> Any:
    """Add independent Gaussian noise ``N(0, std**2)`` to every element of every leaf.

    Args:
        tree: a pytree of tensors (e.g. the clipped sum of per-sample gradients).
        std: the noise standard deviation, ``>= 0`` (for DP-SGD, ``noise_multiplier *
            l2_clip_norm``, before dividing by the batch size).
        generator: a ``torch.Generator`` to draw from (its state advances); see the module
            docstring for why a ``key`` is the better choice for real releases.
        key: draw reproducibly from this secret key (a ChaCha20 stream, :func:`keyed_normal`).
        secure: draw from the OS CSPRNG: a fresh 256-bit key from ``secrets`` for this call,
            expanded by ChaCha20 (:func:`keyed_normal`'s stream; see the module docstring).
        With none of the three, a fresh random key from OS entropy is used.
        offsets: with ``key=``: a pytree like ``tree`` with an int per leaf: that leaf is the
            range of its stream that starts at this element, not at 0. A shard of a parameter
            (:mod:`vmapdp.sharding`: a 1-D slice of the flattened leaf from element ``o`` on) then
            gets exactly the slice of the whole leaf's noise.
        snap: round each noisy value (computed in float64) to a multiple of ``snap_grid(std)``
            before the cast to the leaf's dtype, against floating-point attacks on the release
            (module docstring). ``False``: the plain ``leaf + std * z``, differentiable in the leaf.
        noise_dtype: draw the noise in this dtype (``torch.float64``) instead of the leaf's
            (float32, or float64 for a float64 leaf; the release keeps the leaf's dtype). Float64
            noise shrinks the gap between the float sampler's probability of a snapping cell and
            the Gaussian's from ~``2**-16`` to ~``2**-45`` (module docstring), for ~4x the draw's
            time on a CPU, ~2x the whole call's (another stream: ``keyed_normal(dtype=torch.float64)``).

    Returns:
        A pytree like ``tree``; each leaf in ``promote_types(leaf.dtype, float32)``.

    Guarantees:
        Leaves are drawn in a fixed order (the tree's: a dict's in insertion order, as
        ``vmapdp._tree`` flattens it), so the same generator state, or key, gives the same noise;
        with ``key=`` leaf ``i`` of that order draws ``keyed_normal(..., leaf=i)``. The noise is drawn in float32 or wider.

    Raises:
        TypeError: ``std`` not a number or a 0-dim floating tensor; ``noise_dtype`` not a dtype.
        ValueError: ``std`` negative or not finite (a tensor one too: read on the host when not
        tracing; while tracing such a std gives NaN, that is nothing released); a generator on
        another device than a leaf; ``noise_dtype`` another dtype than float32 or float64.
    """
    call = "add_noise(tree, std, generator)"
    secure = _checks.flag(call, "secure", secure)
    snap = _checks.flag(call, "snap", snap)
    noise_dtype = _noise_dtype(call, noise_dtype)
    # a tensor std is read on the host when not tracing; traced, a NaN/inf/negative one gives NaN noise
    std = _checks.noise_std_guarded(_checks.noise_std(call, std))
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{call}: generator must be a torch.Generator or None, got {type(generator).__name__}. "
            "Make one with vmapdp.make_generator(seed)."
        )

    if secure and generator is not None:
        raise ValueError(f"{call}: secure=True draws from the OS CSPRNG and takes no generator (a seeded generator is predictable).")
    if sum(x is not None and x is not False for x in (generator, key, secure or None)) > 1:
        raise ValueError(f"{call}: give at most one source of randomness: generator=, key= or secure=True.")
    for name, value in (("generator", generator), ("key", key)):
        if value is not None:  # (named as called: found by review)
            _checks.guessable(f"add_noise(tree, std, {name}={'...' if name == 'key' else 'generator'})", name, value, "the noise and subtract it")
    leaves, spec = optree.tree_flatten(tree, namespace="torch")
    other = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, Tensor)]
    if other:  # (found by review: a float leaf raised a bare AttributeError)
        raise TypeError(
            f"{call}: leaves {other[:5]} are not tensors ({type(leaves[other[0]]).__name__}); add_noise noises a pytree of "
            "floating-point tensors. Make them tensors: torch.as_tensor(v, dtype=torch.float32)."
        )
    complex_leaves = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and leaf.is_complex()]
    if complex_leaves:  # (real noise cast to a complex dtype leaves the imaginary parts noiseless: found by review)
        raise TypeError(
            f"{call}: leaves {complex_leaves[:5]} are complex; the noise is real, and their imaginary parts would be released "
            "without any. Noise the real and imaginary parts as real leaves: torch.view_as_real(z)."
        )
    if offsets is None:
        starts = [0] * len(leaves)
    elif key is None:
        raise ValueError(f"{call}: offsets= places each leaf in a keyed stream and needs key=; secure=True and generators draw no addressable stream.")
    else:
        starts, offsets_spec = optree.tree_flatten(offsets, namespace="torch")
        if offsets_spec != spec or not all(_checks.is_real(o) and isinstance(o, int) and o >= 0 for o in starts):
            raise ValueError(f"{call}: offsets={offsets!r} must be a pytree like the tree ({spec}) with an int >= 0 per leaf.")
    if generator is None:  # keyed: the given key, or (secure=True, or no source) a fresh one from the OS CSPRNG
        base = key_bytes(key, call=call) if key is not None else secrets.token_bytes(32)
        # each leaf's sum as soon as its noise is drawn: the tree's noise is never alive all at once
        noisy = _keyed_normals(base, [(tuple(leaf.shape), i, starts[i], _nd(leaf, noise_dtype), leaf.device) for i, leaf in enumerate(leaves)], then=lambda i, z: _release(leaves[i], z, std, snap=snap))
        return optree.tree_unflatten(spec, noisy)
    out = []
    for leaf in leaves:
        if generator.device.type != leaf.device.type:
            raise ValueError(
                f"{call}: the generator is on {generator.device} but a leaf is on {leaf.device}; "
                f"make the generator with vmapdp.make_generator(seed, device={str(leaf.device)!r})."
            )
        noise = torch.randn(leaf.shape, dtype=_nd(leaf, noise_dtype), device=leaf.device, generator=generator)
        out.append(_release(leaf, noise, std, snap=snap))
    return optree.tree_unflatten(spec, out)


def _dt(leaf: Tensor) -> torch.dtype:
    return acc_dtype(leaf.dtype)


def _nd(leaf: Tensor, noise_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a leaf's noise is drawn in: its own (float32 or wider), or float64 where asked."""
    return _dt(leaf) if noise_dtype is None else torch.promote_types(_dt(leaf), noise_dtype)


def _noise_dtype(call: str, noise_dtype: Any) -> torch.dtype | None:
    """None (the leaf's own), or torch.float64; torch.float32 is the default's None (the same noise, the same key)."""
    fix = "must be None (the leaf's: float32, or float64 for a float64 leaf), torch.float32 or torch.float64"
    if noise_dtype is not None and not isinstance(noise_dtype, torch.dtype):
        raise TypeError(f"{call}: noise_dtype {fix}, got {type(noise_dtype).__name__} ({noise_dtype!r}).")
    if noise_dtype is not None and noise_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{call}: noise_dtype={noise_dtype!r} {fix}.")
    return None if noise_dtype == torch.float32 else noise_dtype


_SNAP_BITS = 6  # the grid is 2**-6 to 2**-7 of the std
_DEVICE_SNAP_PIECE = 1 << 24  # elements per piece on an accelerator: 128 MiB per float64 temporary
_SNAP_PIECE = 1 << 20  # ... on a host without a compiler (8 MiB)
_SNAPPING: contextvars.ContextVar[bool] = contextvars.ContextVar("vmapdp_snapping", default=True)


@contextlib.contextmanager
def _unsnapped() -> Any:
    """Releases made inside are the plain ``x + std * z``: for the audits' runs (thrown away, inside
    ``vmapdp.noise.unreleased()``), which compare two runs from one state and need their noise to
    cancel exactly (snapping rounds each sum, and neighbouring sums to different cells)."""
    token = _SNAPPING.set(False)
    try:
        yield
    finally:
        _SNAPPING.reset(token)


def snap_grid(std: float) -> float:
    """The grid ``add_noise(snap=True)`` rounds releases of noise ``std`` to: the power of two
    ``2**(floor(log2 std) - 6)``, in ``(std/128, std/64]``; 0.0 for ``std == 0`` (nothing snapped)."""
    std = _checks.noise_std("snap_grid(std)", std)
    return math.ldexp(1.0, math.frexp(std)[1] - 1 - _SNAP_BITS) if std > 0 else 0.0


def snapped_release(x: Tensor, z: Tensor, std: float, *, grid: float | None = None) -> Tensor:
    """``x + std * z`` snapped as ``add_noise`` snaps its releases: for a privatizer of your own that
    draws its noise ``z`` (standard units) itself.

    Args:
        x: the sum to release (any floating dtype; the result is ``promote_types(x.dtype, float32)``).
        z: the noise in units of ``std``, shaped like ``x`` (float32 or float64).
        std: the noise's standard deviation, ``>= 0`` (public: it sets the grid).
        grid: the grid to round to (default ``snap_grid(std)``); a power of two well below ``std``.

    Returns:
        ``round_half_even((z * std + x) / grid) * grid`` computed in float64, cast to ``x``'s noise dtype.

    Raises:
        TypeError / ValueError: a non-tensor ``x`` or ``z``, shapes that differ, a bad ``std`` or ``grid``.
    """
    call = "snapped_release(x, z, std)"
    if not isinstance(x, Tensor) or not isinstance(z, Tensor) or not x.is_floating_point() or not z.is_floating_point():
        raise TypeError(f"{call}: x and z must be floating-point tensors, got {type(x).__name__} and {type(z).__name__}.")
    if x.shape != z.shape:
        raise ValueError(f"{call}: z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)} (one standard normal per element).")
    std = _checks.noise_std(call, std)
    if isinstance(std, Tensor):
        raise TypeError(f"{call}: std must be a number (it sets the grid, which must be public), got a tensor.")
    if grid is not None:
        grid = _checks.positive(call, "grid", grid)
        if math.frexp(grid)[0] != 0.5:
            raise ValueError(f"{call}: grid={grid!r} must be a power of two (so that the division and the product by it are exact): use snap_grid(std).")
    return _release(x, z, std, grid=grid)


def _release(x: Tensor, z: Tensor, std: float | Tensor, *, snap: bool = True, grid: float | None = None) -> Tensor:
    """``x + std * z`` in ``x``'s noise dtype (float32 or wider): with ``snap``, computed in float64
    and rounded to a multiple of ``grid`` (default ``snap_grid(std)``; see the module docstring).

    Every value is ``round_half_even(fl(fl(z * std) + x) / grid) * grid`` (IEEE float64: the same
    bits on every device and for any split of the elements; the division and product by a power
    of two are exact), then cast. Where the float64 sum is already coarser than the grid (``|v| >=
    2**52 grid``) it is its own multiple and kept.
    """
    dtype = _dt(x)
    if not snap or not _SNAPPING.get():
        return _plain(x, z, std, dtype)
    if isinstance(std, Tensor):  # (a traced or device std: one expression, the grid from its exponent)
        s = std.to(torch.float64)
        g = torch.ldexp(torch.ones_like(s), torch.frexp(s).exponent - 1 - _SNAP_BITS) if grid is None else torch.as_tensor(grid, dtype=torch.float64, device=s.device)
        return torch.where(s > 0, _snapped(x, z, s, g), z.to(torch.float64) * s + x.to(torch.float64)).to(dtype)  # (std 0: nothing snapped)
    g = snap_grid(std) if grid is None else grid
    if g == 0.0:
        return _plain(x, z, std, dtype)
    if x.numel() == 0 or x.requires_grad or torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return _snapped(x, z, std, g).to(dtype)  # (under a transform: op by op)
    if _host(x.device):
        kernel = _snap_kernel_or_none(x.dtype, z.dtype, dtype)
        if kernel is not None:  # one compiled loop, one thread (no float64 temporaries; no OpenMP team per op)
            out = torch.empty(x.shape, dtype=dtype)
            with torch._C._DisableFuncTorch():
                kernel(x.reshape(-1).contiguous(), z.reshape(-1).contiguous(), torch.tensor(float(std), dtype=torch.float64), torch.tensor(g, dtype=torch.float64), out.view(-1))
            return out
    # an accelerator's kernels, or a host without a C++ compiler: op by op, a piece at a time (float64 temporaries of one piece)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    xs, zs, os_ = x.reshape(-1), z.reshape(-1), out.view(-1)
    piece = _SNAP_PIECE if _host(x.device) else _DEVICE_SNAP_PIECE
    for lo in range(0, xs.numel(), piece):
        os_[lo : lo + piece] = _snapped(xs[lo : lo + piece], zs[lo : lo + piece], std, g)
    return out


def _plain(x: Tensor, z: Tensor, std: Any, dtype: torch.dtype) -> Tensor:
    """``x + std * z`` in ``dtype`` (computed in ``z``'s dtype where the noise is wider: noise_dtype=)."""
    if z.dtype == dtype:
        return x.to(dtype) + z * std
    return (x.to(z.dtype) + z * std).to(dtype)


def _snapped(x: Tensor, z: Tensor, std: Any, grid: Any) -> Tensor:
    """The snapped release in float64: ``round(v / grid) * grid`` for ``v = z * std + x``, or ``v``
    where ``|v / grid| >= 2**52`` (already a multiple; and no overflow of the quotient)."""
    v = z.to(torch.float64) * std + x.to(torch.float64)
    q = v / grid
    return torch.where(q.abs() < 2.0**52, torch.round(q) * grid, v)


def _snap_into(x: Tensor, z: Tensor, std: Tensor, grid: Tensor, out: Tensor):  # (unannotated return, as _into32)
    out.copy_(_snapped(x, z, std, grid))
    return ()


_SNAP_KERNELS: dict[tuple[torch.dtype, torch.dtype, torch.dtype], Any] = {}
_snap_ok: bool | None = None  # None: not tried yet


def _snap_kernel_or_none(x_dtype: torch.dtype, z_dtype: torch.dtype, out_dtype: torch.dtype) -> Any:
    """:func:`_snap_kernel`, or None where Inductor cannot compile here (no C++ compiler: op by op from
    then on, the same bits). Only compiling is caught: an error of a compiled kernel's call is raised."""
    global _snap_ok
    if _snap_ok is False:
        return None
    try:
        kernel = _snap_kernel(x_dtype, z_dtype, out_dtype)
    except Exception:
        if _snap_ok:
            raise
        _snap_ok = False
        return None
    _snap_ok = True
    return kernel


def _snap_kernel(x_dtype: torch.dtype, z_dtype: torch.dtype, out_dtype: torch.dtype) -> Any:
    """:func:`_snapped` into ``out``, compiled by Inductor into one single-threaded loop over 1-D
    tensors of any size (once per process and dtypes; as :func:`_fused`). Op by op, each of its
    seven float64 passes on a loaded 2-core machine waited ~6 ms for its OpenMP team (a piece of a
    leaf, 10M elements: 3.9 s; in one loop: ~30 ms)."""
    with _LOCK:
        key = (x_dtype, z_dtype, out_dtype)
        if key not in _SNAP_KERNELS:
            from torch.fx.experimental.proxy_tensor import make_fx

            one = torch.ones((), dtype=torch.float64)
            example = [torch.zeros(997, dtype=x_dtype), torch.zeros(997, dtype=z_dtype), one, one.clone(), torch.empty(997, dtype=out_dtype)]
            graph = make_fx(_snap_into, tracing_mode="symbolic")(*example)
            with torch._inductor.config.patch({"cpp.threads": 1}):
                _SNAP_KERNELS[key] = torch._inductor.standalone_compile(graph, example)
        return _SNAP_KERNELS[key]
