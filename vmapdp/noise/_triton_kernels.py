"""The Triton kernels of :mod:`vmapdp.noise._triton` (imported on first use: importing triton is
not free, and the module needs it at import: a jitted function finds the functions it calls among
its module's globals)."""

import triton
import triton.language as tl

TOP32 = tl.constexpr(9223371487098961920.0)  # the largest float32 below 2**63 (gaussian._radius's clamp)
TOP64 = tl.constexpr(9223372036854774784.0)  # the largest float64 below 2**63

@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))

@triton.jit
def _quarter(a, b, c, d):
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d

@triton.jit
def _block(k0, k1, k2, k3, k4, k5, k6, k7, ctr, n0, n1, n2):
    """The 16 output words (uint32) of the blocks at counters ``ctr`` (RFC 8439, 2.3)."""
    s0 = tl.full(ctr.shape, 0x61707865, tl.uint32)
    s1 = tl.full(ctr.shape, 0x3320646E, tl.uint32)
    s2 = tl.full(ctr.shape, 0x79622D32, tl.uint32)
    s3 = tl.full(ctr.shape, 0x6B206574, tl.uint32)
    z = tl.full(ctr.shape, 0, tl.uint32)  # (every word a vector: the loop carries one type per word)
    x0, x1, x2, x3 = s0, s1, s2, s3
    x4, x5, x6, x7, x8, x9, x10, x11 = k0 + z, k1 + z, k2 + z, k3 + z, k4 + z, k5 + z, k6 + z, k7 + z
    x12, x13, x14, x15 = ctr, n0 + z, n1 + z, n2 + z
    for _ in range(10):  # 20 rounds: column, then diagonal quarter rounds (a loop, not unrolled: the float32 kernel's
        # three blocks unrolled took 34 s to compile on an H200, at about the same speed)
        x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    return (x0 + s0, x1 + s1, x2 + s2, x3 + s3, x4 + k0, x5 + k1, x6 + k2, x7 + k3,
            x8 + k4, x9 + k5, x10 + k6, x11 + k7, x12 + ctr, x13 + n0, x14 + n1, x15 + n2)  # fmt: skip

@triton.jit
def _key(key0, key1, key2, key3, key4, key5, key6, key7):
    # (passed as int32 bit patterns: one specialisation for every key)
    return (key0.to(tl.uint32, bitcast=True), key1.to(tl.uint32, bitcast=True), key2.to(tl.uint32, bitcast=True),
            key3.to(tl.uint32, bitcast=True), key4.to(tl.uint32, bitcast=True), key5.to(tl.uint32, bitcast=True),
            key6.to(tl.uint32, bitcast=True), key7.to(tl.uint32, bitcast=True))  # fmt: skip

@triton.jit
def _word64(lo, hi):
    """Two uint32 words as the int64 ``lo | hi << 32`` (the keystream bytes' int64 view)."""
    return lo.to(tl.int64) | (hi.to(tl.int64) << 32)

@triton.jit
def _radius(w, FLOAT: tl.constexpr, TOP: tl.constexpr):
    """``sqrt(-2 ln u)``, ``u = |w| / 2**63`` clamped into ``[2**-64, 1 - ulp]`` (gaussian._radius)."""
    f = tl.abs(w.to(FLOAT))
    f = tl.minimum(tl.maximum(f, 0.5), tl.full(f.shape, TOP, FLOAT))  # (tl.full: TOP exactly, in FLOAT)
    x = -2.0 * tl.log(f * 1.0842021724855044e-19)  # (2**-63: exact)
    if FLOAT == tl.float32:
        return tl.sqrt_rn(x)  # (tl.sqrt is the approximate one in float32)
    return tl.sqrt(x)  # (correctly rounded in float64)

@triton.jit
def _pair(r, theta, ptr, k, PAIRS: tl.constexpr, mask):
    tl.store(ptr + k, r * tl.cos(theta), mask=mask)
    tl.store(ptr + PAIRS + k, r * tl.sin(theta), mask=mask)

@triton.jit
def _setup(table_ptr, PRECISION: tl.constexpr, BLOCKS: tl.constexpr, B: tl.constexpr):
    row = table_ptr + 4 * tl.program_id(0).to(tl.int64)
    out_group, groups = tl.load(row), tl.load(row + 1)
    first, leaf = tl.load(row + 2), tl.load(row + 3)
    lane = tl.arange(0, B)
    ctr = first + lane.to(tl.int64) * BLOCKS  # < 2**32 (checked on the host)
    n0 = tl.full((B,), PRECISION, tl.uint32)  # the nonce: (precision, leaf as a little-endian uint64)
    n1 = (leaf & 0xFFFFFFFF).to(tl.uint32)
    n2 = ((leaf >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return out_group + lane.to(tl.int64), lane < groups, ctr, n0, n1, n2

@triton.jit(do_not_specialize=["key0", "key1", "key2", "key3", "key4", "key5", "key6", "key7"])
def normals32(out_ptr, table_ptr, key0, key1, key2, key3, key4, key5, key6, key7, B: tl.constexpr):
    """float32 groups: 3 blocks -> 16 radius words (int64), 16 angle words (int32) -> 32 normals."""
    k0, k1, k2, k3, k4, k5, k6, k7 = _key(key0, key1, key2, key3, key4, key5, key6, key7)
    group, mask, ctr, n0, n1, n2 = _setup(table_ptr, 32, 3, B)
    ptr = out_ptr + group * 32
    s = tl.full((B,), 3.1415926535897931 / 2147483648.0, tl.float32)  # pi / 2**31, rounded to float32 as torch rounds the scalar
    key = (k0, k1, k2, k3, k4, k5, k6, k7)
    a = _block(*key, (ctr + 2).to(tl.uint32), n0, n1, n2)  # the group's third block: 16 angle words
    for half in tl.static_range(2):  # its first and second blocks: 8 radius words (int64) each
        w = _block(*key, (ctr + half).to(tl.uint32), n0, n1, n2)
        for k in tl.static_range(8):
            theta = a[8 * half + k].to(tl.int32, bitcast=True).to(tl.float32) * s
            _pair(_radius(_word64(w[2 * k], w[2 * k + 1]), tl.float32, TOP32), theta, ptr, 8 * half + k, 16, mask)

@triton.jit(do_not_specialize=["key0", "key1", "key2", "key3", "key4", "key5", "key6", "key7"])
def normals64(out_ptr, table_ptr, key0, key1, key2, key3, key4, key5, key6, key7, B: tl.constexpr):
    """float64 groups: 1 block -> 4 radius words, 4 angle words (int64) -> 8 normals."""
    k0, k1, k2, k3, k4, k5, k6, k7 = _key(key0, key1, key2, key3, key4, key5, key6, key7)
    group, mask, ctr, n0, n1, n2 = _setup(table_ptr, 64, 1, B)
    ptr = out_ptr + group * 8
    s = tl.full((B,), 3.1415926535897931 / 9223372036854775808.0, tl.float64)  # pi / 2**63
    w = _block(k0, k1, k2, k3, k4, k5, k6, k7, ctr.to(tl.uint32), n0, n1, n2)
    for k in tl.static_range(4):  # radius from words 2k, 2k + 1; angle from words 8 + 2k, 9 + 2k
        _pair(_radius(_word64(w[2 * k], w[2 * k + 1]), tl.float64, TOP64), _word64(w[8 + 2 * k], w[9 + 2 * k]).to(tl.float64) * s, ptr, k, 4, mask)

@triton.jit(do_not_specialize=["first", "nblocks", "n0", "n1", "n2", "key0", "key1", "key2", "key3", "key4", "key5", "key6", "key7"])
def words(out_ptr, first, nblocks, n0, n1, n2, key0, key1, key2, key3, key4, key5, key6, key7, B: tl.constexpr):
    """The raw keystream: 16 words (as int64 in [0, 2**32)) per block, for the tests."""
    k0, k1, k2, k3, k4, k5, k6, k7 = _key(key0, key1, key2, key3, key4, key5, key6, key7)
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mask = i < nblocks
    u = tl.full((B,), 0, tl.uint32)
    w = _block(k0, k1, k2, k3, k4, k5, k6, k7, (first + i).to(tl.uint32), u + n0.to(tl.uint32, bitcast=True), u + n1.to(tl.uint32, bitcast=True), u + n2.to(tl.uint32, bitcast=True))
    for j in tl.static_range(16):
        tl.store(out_ptr + 16 * i + j, w[j].to(tl.int64), mask=mask)


@triton.jit(do_not_specialize=["n"])
def radii(words_ptr, out_ptr, n, PRECISION: tl.constexpr, B: tl.constexpr):
    """The kernels' radius (``_radius`` of ``_word64``) of given words (``[n, 2]`` int64: the low and
    high 32 bits of each): the self-check's probe of the clamp and of every bit of a radius word."""
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mask = i < n
    lo = tl.load(words_ptr + 2 * i, mask=mask, other=0).to(tl.uint32)
    hi = tl.load(words_ptr + 2 * i + 1, mask=mask, other=0).to(tl.uint32)
    if PRECISION == 32:
        tl.store(out_ptr + i, _radius(_word64(lo, hi), tl.float32, TOP32), mask=mask)
    else:
        tl.store(out_ptr + i, _radius(_word64(lo, hi), tl.float64, TOP64), mask=mask)
