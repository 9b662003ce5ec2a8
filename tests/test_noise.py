"""add_noise: distribution (KS test with a negative control), reproducibility, dtype, no global RNG."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from scipy import stats

import vmapdp
from vmapdp import add_noise, make_generator

# Each statistical test below runs at a false-alarm rate of ALPHA with fixed seeds (so the suite
# is deterministic); the negative controls show the same test rejects a std that is 10% off.
ALPHA = 1e-3


def _noise(std, n=20_000, seed=0, dtype=torch.float32):
    tree = {"a": torch.zeros(n // 2, dtype=dtype), "b": torch.zeros(n // 4, 2, dtype=dtype)}
    out = add_noise(tree, std, make_generator(seed))
    return torch.cat([v.reshape(-1) for v in out.values()]).double().numpy()


@pytest.mark.parametrize("std", [0.1, 1.0, 3.7])
@pytest.mark.parametrize("seed", [0, 1])
def test_noise_is_gaussian_with_the_requested_std(std, seed):
    z = _noise(std, seed=seed)
    assert stats.kstest(z, "norm", args=(0.0, std)).pvalue > ALPHA
    # moments: mean within 4 standard errors, variance by the chi-square interval
    n = z.size
    assert abs(z.mean()) < 4 * std / math.sqrt(n)
    lo, hi = stats.chi2.ppf([ALPHA / 2, 1 - ALPHA / 2], n) / n
    assert lo * std**2 < z.var() < hi * std**2


def test_secure_noise_is_gaussian_and_rejects_generators():
    # the OS CSPRNG cannot be seeded, so this test draws afresh each run: its false-alarm rate is
    # 1e-6 (not ALPHA: at 1e-3 it failed once in a full-suite run here); the negative control
    # (10% too wide) has p ~ 1e-10 at this size, far below it
    alpha = 1e-6
    tree = {"a": torch.zeros(20_000)}
    z = add_noise(tree, 2.0, secure=True)["a"].double().numpy()
    assert stats.kstest(z, "norm", args=(0.0, 2.0)).pvalue > alpha
    assert stats.kstest(z, "norm", args=(0.0, 2.0 * 1.1)).pvalue < alpha  # negative control
    torch.manual_seed(0)
    again = add_noise(tree, 2.0, secure=True)["a"].double().numpy()
    assert not (z == again).all()
    with pytest.raises(ValueError, match=r"secure=True .* takes no generator"):
        add_noise(tree, 1.0, make_generator(0), secure=True)
    # secure_normal: the OS's bytes themselves through the same Box-Muller (same alpha, same control)
    raw = vmapdp.noise.secure_normal((20_000,)).double().numpy()
    assert stats.kstest(raw, "norm").pvalue > alpha
    assert stats.kstest(raw, "norm", args=(0.0, 1.1)).pvalue < alpha
    assert vmapdp.noise.secure_normal((3, 2), dtype=torch.float64).dtype == torch.float64
    assert vmapdp.noise.secure_normal((0, 4)).shape == (0, 4)
    # the step's secure privatizer draws at its std too (found by mutation testing: halved, no test failed;
    # the ledger would report epsilon 1.83 for a run at 13.4); same alpha and control
    noisy, _ = vmapdp.noise.gaussian_privatizer(0.7, secure=True).privatize(tree, (), None)
    z = noisy["a"].double().numpy()
    assert stats.kstest(z, "norm", args=(0.0, 0.7)).pvalue > alpha
    assert stats.kstest(z, "norm", args=(0.0, 0.7 * 1.1)).pvalue < alpha


@pytest.mark.parametrize("wrong", [0.9, 1.1, 1 / math.sqrt(2)])
def test_negative_control_wrong_std_is_rejected(wrong):
    # noise drawn at std 1 must fail the same test when the claimed std is off
    z = _noise(1.0, seed=3)
    assert stats.kstest(z, "norm", args=(0.0, wrong)).pvalue < ALPHA


def test_noise_is_added_not_replaced_and_keys_kept():
    tree = {"w": torch.full((1000,), 5.0), "b": torch.full((3, 2), -2.0)}
    out = add_noise(tree, 0.01, make_generator(0))
    assert set(out) == {"w", "b"} and out["b"].shape == (3, 2)
    assert abs(float(out["w"].mean()) - 5.0) < 0.01
    assert torch.equal(add_noise(tree, 0.0, make_generator(0))["w"], tree["w"])


def test_same_generator_state_same_noise_different_seed_different_noise():
    tree = {"w": torch.zeros(100)}
    a = add_noise(tree, 1.0, make_generator(7))
    b = add_noise(tree, 1.0, make_generator(7))
    c = add_noise(tree, 1.0, make_generator(8))
    assert torch.equal(a["w"], b["w"]) and not torch.equal(a["w"], c["w"])
    g = make_generator(7)
    first, second = add_noise(tree, 1.0, g), add_noise(tree, 1.0, g)
    assert not torch.equal(first["w"], second["w"]), "the generator's state must advance"


def test_global_rng_is_never_used():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    out1 = add_noise({"w": torch.zeros(10)}, 1.0)  # generator=None: OS entropy
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(0)
    out2 = add_noise({"w": torch.zeros(10)}, 1.0)
    assert not torch.equal(out1["w"], out2["w"]), "seeding torch's global RNG must not fix the noise"


def test_half_precision_leaves_are_noised_in_float32():
    tree = {"w": torch.zeros(4096, dtype=torch.bfloat16)}
    out = add_noise(tree, 1.0, make_generator(0), snap=False)["w"]
    assert out.dtype == torch.float32
    # a draw made in bfloat16 would only hold bfloat16-representable values
    assert not torch.equal(out, out.to(torch.bfloat16).float())
    assert add_noise({"w": torch.zeros(3, dtype=torch.float64)}, 1.0, make_generator(0))["w"].dtype == torch.float64


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, torch.tensor(-1.0), torch.tensor(math.nan), torch.tensor(math.inf)])
def test_bad_std(bad):
    with pytest.raises(ValueError, match=r"add_noise\(tree, std, generator\): std=.* must be finite and >= 0"):
        add_noise({"w": torch.zeros(2)}, bad, make_generator(0))
    with pytest.raises(ValueError, match=r"std=.* must be finite and >= 0"):
        add_noise({"w": torch.zeros(2)}, bad, key=b"k")


def test_std_type_and_shape():
    with pytest.raises(TypeError, match=r"add_noise\(tree, std, generator\): std must be a real number .*got str"):
        add_noise({"w": torch.zeros(2)}, "1.0")
    with pytest.raises(ValueError, match=r"std must be a 0-dim tensor, got shape \(2,\)"):
        add_noise({"w": torch.zeros(2)}, torch.ones(2))
    out = add_noise({"w": torch.zeros(2)}, torch.tensor(2.0), key=b"k")["w"]
    assert torch.equal(out, add_noise({"w": torch.zeros(2)}, 2.0, key=b"k")["w"])
    # found by review: real noise cast to complex left the imaginary parts noiseless
    for source in ({"key": b"k"}, {"secure": True}, {"generator": make_generator(0)}):
        with pytest.raises(TypeError, match=r"leaves \[1\] are complex.*imaginary parts would be released without any.*view_as_real"):
            add_noise({"a": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex64)}, 1.0, **source)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_bad_tensor_std_releases_nothing_when_traced(bad):
    """Batched by vmap (or traced), the std cannot be read: a NaN/inf/negative one must give NaN (nothing released),
    never the sum with less noise than asked."""
    out = torch.func.vmap(lambda s: add_noise({"w": torch.ones(3)}, s, key=b"k")["w"])(torch.tensor([1.0, bad]))
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


def test_bad_generator_and_seed():
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator or None.*make_generator"):
        add_noise({"w": torch.zeros(2)}, 1.0, 123)
    with pytest.raises(ValueError, match=r"seed=-1 must be an int >= 0"):
        make_generator(-1)
    assert "add_noise" in vmapdp.__all__


def test_keyed_noise_is_reproducible_per_key_and_gaussian():
    tree = {"a": torch.zeros(20_000), "b": torch.zeros(3)}
    n1 = add_noise(tree, 1.5, key=b"k1")
    n2 = add_noise(tree, 1.5, key=b"k1")
    n3 = add_noise(tree, 1.5, key=b"k2")
    assert torch.equal(n1["a"], n2["a"]) and not torch.equal(n1["a"], n3["a"])
    assert not torch.equal(n1["a"][:3], n1["b"]), "leaves must get different noise"
    z = n1["a"].double().numpy()
    assert stats.kstest(z, "norm", args=(0.0, 1.5)).pvalue > ALPHA
    assert stats.kstest(z, "norm", args=(0.0, 1.5 * 1.1)).pvalue < ALPHA  # negative control
    with pytest.raises(ValueError, match=r"at most one source of randomness"):
        add_noise(tree, 1.0, make_generator(0), key=b"k")


def test_keys_beyond_32_bits_matter():
    # torch's CPU generator keeps 32 bits of a seed; keyed noise must depend on the whole key
    a = vmapdp.noise.keyed_normal((8,), 5)
    b = vmapdp.noise.keyed_normal((8,), 5 + 2**32)
    assert not torch.equal(a, b)


def test_gaussian_privatizer_is_add_noise_under_the_steps_key():
    tree = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16)}
    priv = vmapdp.noise.gaussian_privatizer(0.7)
    assert priv.init(tree) == ()
    noisy, state = priv.privatize(tree, (), b"step-key")
    expected = add_noise(tree, 0.7, key=b"step-key")
    assert state == () and all(torch.equal(noisy[k], expected[k]) for k in tree)
    with pytest.raises(ValueError, match=r"needs the step's noise key"):
        priv.privatize(tree, (), None)
    secure = vmapdp.noise.gaussian_privatizer(0.7, secure=True)
    assert secure.privatize(tree, (), None)[0]["b"].dtype == torch.float32
    with pytest.raises(ValueError, match=r"takes no key"):
        secure.privatize(tree, (), b"step-key")
    with pytest.raises(ValueError, match=r"std"):
        vmapdp.noise.gaussian_privatizer(-1.0)


# --- keyed noise: the ChaCha20 stream and its Box-Muller transform (vmapdp.noise.keyed_normal) ---

from vmapdp.noise import gaussian as _g  # noqa: E402
from vmapdp.noise import keyed_normal  # noqa: E402

Z_CRIT = stats.norm.ppf(1 - ALPHA / 2)  # two-sided, at the false-alarm rate ALPHA
KEY = b"test-key-0123456789"
DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_keyed_normals_pass_ks_and_a_10_percent_std_error_fails(dtype):
    z = keyed_normal((200_000,), KEY, leaf=2, dtype=dtype).double().numpy()
    assert stats.kstest(z, "norm").pvalue > ALPHA
    for wrong in (0.9, 1.1):  # negative controls: the same test rejects a std 10% off
        assert stats.kstest(z, "norm", args=(0.0, wrong)).pvalue < ALPHA


@pytest.mark.parametrize("dtype", DTYPES)
def test_keyed_normals_first_four_moments(dtype):
    z = keyed_normal((400_000,), KEY, leaf=5, dtype=dtype).double().numpy()
    n = z.size
    # each statistic against N(0, 1)'s value, in standard errors: mean 1/sqrt(n), variance sqrt(2/n),
    # skewness sqrt(6/n), excess kurtosis sqrt(24/n) (asymptotic, fine at n = 4e5)
    moments = [z.mean(), z.var() - 1, stats.skew(z), stats.kurtosis(z)]
    errors = [1 / n**0.5, (2 / n) ** 0.5, (6 / n) ** 0.5, (24 / n) ** 0.5]
    for m, se in zip(moments, errors):
        assert abs(m) / se < Z_CRIT, (moments, errors)
    # negative control: a uniform of variance 1 has the right mean and variance, not the kurtosis (-1.2)
    u = (torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64).numpy() - 0.5) * 12**0.5
    assert abs(stats.kurtosis(u)) / errors[3] > Z_CRIT
    assert abs((1.1 * z).var() - 1) / errors[1] > Z_CRIT  # and a std 10% off fails the variance


def _corr_z(a, b):
    """The sample correlation of a and b in standard errors (1/sqrt(n) under independence)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).mean() / (a.std() * b.std())) * a.numel() ** 0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_keyed_normals_are_uncorrelated_across_keys_leaves_and_elements(dtype):
    n = 100_000
    step1 = keyed_normal((n,), b"seed:1", dtype=dtype)
    pairs = {
        "steps": (step1, keyed_normal((n,), b"seed:2", dtype=dtype)),
        "leaves": (step1, keyed_normal((n,), b"seed:1", leaf=1, dtype=dtype)),
        "precisions": (keyed_normal((n,), b"seed:1", dtype=torch.float32), keyed_normal((n,), b"seed:1", dtype=torch.float64)),
        "adjacent": (step1[:-1], step1[1:]),
    }
    per_group = 2 * _g._LAYOUT[_g._FP64 if dtype == torch.float64 else _g._FP32][1]
    k = per_group // 2  # an element and its Box-Muller partner (same radius): independent, so their squares are uncorrelated
    pairs["partner squares"] = (step1.view(-1, 2, k)[:, 0].reshape(-1) ** 2, step1.view(-1, 2, k)[:, 1].reshape(-1) ** 2) if n % per_group == 0 else None
    for name, (a, b) in ((k_, v) for k_, v in pairs.items() if v is not None):
        assert abs(_corr_z(a, b)) < Z_CRIT, name
    # negative control: 5% of one stream mixed into another is detected
    a, b = pairs["steps"]
    assert abs(_corr_z(a, b + 0.05 * a)) > Z_CRIT


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_element_range_regenerates_the_slice_of_the_whole(dtype):
    whole = keyed_normal((5000,), KEY, leaf=7, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    ranges = [(0, 1), (0, 5000), (31, 2), (32, 32), (33, 100), (4999, 1), (8, 4)]
    ranges += [tuple(int(x) for x in (o, torch.randint(1, 5000 - o + 1, (1,), generator=g))) for o in torch.randint(0, 4999, (20,), generator=g)]
    for offset, n in ranges:
        part = keyed_normal((n,), KEY, leaf=7, offset=offset, dtype=dtype)
        assert torch.equal(part, whole[offset : offset + n]), (offset, n)
    # shapes are the flattened range reshaped; a range past the first chunk of keystream too
    assert torch.equal(keyed_normal((3, 4), KEY, leaf=7, offset=100, dtype=dtype).reshape(-1), whole[100:112])
    big = keyed_normal((300_000,), KEY, dtype=dtype)
    assert torch.equal(keyed_normal((1000,), KEY, offset=262_000, dtype=dtype), big[262_000:263_000])
    # a slice larger than one call of the small leaves' batch (16k elements, its own path) at an offset, on each
    # backend (found by mutation testing: the large path's offset dropped, every rank's shard noise a copy of rank 0's)
    for backend in ("openssl", "torch"):
        part = keyed_normal((20_000,), KEY, offset=12_345, dtype=dtype, backend=backend)
        assert torch.equal(part, big[12_345:32_345]), backend
    assert torch.equal(vmapdp.add_noise({"w": torch.zeros(30_000, dtype=dtype)}, 1.0, key=KEY, offsets={"w": 15_000}, snap=False)["w"], big[15_000:45_000])


@pytest.mark.parametrize("dtype", DTYPES)
def test_keyed_normals_same_on_the_torch_backend(dtype):
    a = keyed_normal((3000,), KEY, leaf=3, offset=17, dtype=dtype, backend="auto")
    b = keyed_normal((3000,), KEY, leaf=3, offset=17, dtype=dtype, backend="torch")
    assert torch.equal(a, b)
    eager = keyed_normal((3000,), KEY, leaf=3, offset=17, dtype=dtype, fused=False)
    torch.testing.assert_close(eager, a, rtol=4 * torch.finfo(dtype).eps, atol=8 * torch.finfo(dtype).eps)


def test_same_key_same_bits_different_keys_different_bits():
    a = keyed_normal((64,), KEY)
    assert torch.equal(a, keyed_normal((64,), KEY))
    assert torch.equal(keyed_normal((8,), 12345), keyed_normal((8,), "12345"))  # int and str keys are their decimal bytes
    for other in (KEY + b"x", KEY[:-1], b"", 0):
        b = keyed_normal((64,), other)
        assert not (a == b).any(), other  # a different key: no element in common
    assert not (keyed_normal((64,), KEY, leaf=1) == a).any()
    assert keyed_normal((0,), KEY).shape == (0,)
    with pytest.raises(ValueError, match=r"offset=-1 must be an int >= 0"):
        keyed_normal((2,), KEY, offset=-1)
    with pytest.raises(ValueError, match=r"leaf=-1 must be an int"):
        keyed_normal((2,), KEY, leaf=-1)


def test_the_stream_is_versioned_and_not_the_old_shake_stream():
    import hashlib

    # the ChaCha20 key is SHA-256 of a versioned label and the key, never the key's bare hash
    assert _g.stream_key(KEY) == hashlib.sha256(b"vmapdp/keyed-normal/chacha20/v1\x00" + KEY).digest()
    assert _g.stream_key(KEY) != hashlib.sha256(KEY).digest()
    # the former SHAKE-256 stream of the same key (bytes 8..15 of each pair's 16 were its first uniforms' words)
    old = torch.frombuffer(bytearray(hashlib.shake_256(b"vmapdp-keyed-normal:" + KEY + b":leaf:0").digest(64 * 8)), dtype=torch.int64)
    raw = torch.frombuffer(bytearray(bytes(chacha_bytes(KEY, 8))), dtype=torch.int64)
    assert not (old == raw).any()


def chacha_bytes(key, nblocks):
    from vmapdp.noise import chacha

    return chacha.keystream(_g.stream_key(key), _g._nonce(0, _g._FP32), 0, nblocks).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_transform_known_answers_and_the_open_interval(dtype):
    """Crafted words: the radius word 0 gives the largest radius sqrt(128 ln 2), never inf; the word
    -2**63 (|w| = 2**63) gives u < 1, so a radius > 0, never NaN; an angle word 0 gives (r, 0)."""
    precision = _g._FP64 if dtype == torch.float64 else _g._FP32
    blocks, pairs = _g._LAYOUT[precision]
    words = torch.zeros(1, 8 * blocks, dtype=torch.int64)
    words[0, 1] = -(2**63)
    words[0, 2] = 2**62  # u = 1/2: r = sqrt(2 ln 2)
    for fused in (False, True):
        out = torch.empty(1, 2, pairs, dtype=dtype)
        _g._normals_into(words, precision, fused, out)
        cos, sin = out[0, 0], out[0, 1]
        assert torch.isfinite(out).all()
        assert float(cos[0]) == pytest.approx((128 * math.log(2)) ** 0.5, rel=1e-6) and float(sin[0]) == 0.0
        assert 0 < float(cos[1]) < 1e-3  # u just below 1
        assert float(cos[2]) == pytest.approx((2 * math.log(2)) ** 0.5, rel=1e-6)
    # the largest |z| over many draws stays below the bound
    assert float(keyed_normal((200_000,), KEY, dtype=dtype).abs().max()) < (128 * math.log(2)) ** 0.5


def test_keyed_noise_on_a_dict_is_the_same_before_and_after_the_first_vmap():
    """optree flattens a dict in sorted key order until torch.utils._cxx_pytree is imported (the
    first vmap imports it) and in insertion order after: without vmapdp fixing the order at
    import, the same add_noise call drew different leaves' streams before and after a vmap.
    Run in a fresh interpreter, where no vmap has run yet."""
    import subprocess
    import sys

    code = (
        "import torch, vmapdp\n"
        "tree = {'b': torch.zeros(3), 'a': torch.zeros(5)}\n"
        "before = vmapdp.add_noise(tree, 1.0, key=7)\n"
        "torch.func.vmap(torch.sin)(torch.ones(2, 2))\n"
        "after = vmapdp.add_noise(tree, 1.0, key=7)\n"
        "assert 'torch.utils._cxx_pytree' in __import__('sys').modules\n"
        "print(all(torch.equal(before[k], after[k]) for k in tree))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize("dtype", DTYPES)
def test_keyed_normals_for_an_accelerator_are_made_on_it_and_match_the_host(monkeypatch, dtype):
    """The accelerator path, run on the CPU by declaring the CPU an accelerator. By default one
    kernel makes the keystream and the transform on the device (here the very function Inductor
    compiles there, run uncompiled: compiling it for the CPU takes minutes); with fused=False, or
    where that kernel does not compile, the same ops run one by one. Either way no host keystream is
    made (OpenSSL's chunks are never asked for), the draws are bitwise the host's op-by-op transform
    of the same words over several device-sized pieces (offsets and slices compose), and within the
    stated ulp bound of the default (fused) host draws. A kernel that does not compile is fallen back
    from once and remembered; asked for with fused=True, its error is raised."""
    host = keyed_normal((3000,), KEY, leaf=3, offset=17, dtype=dtype)
    eager = keyed_normal((3000,), KEY, leaf=3, offset=17, dtype=dtype, fused=False)

    def refuse(*args, **kwargs):
        raise AssertionError("the host keystream was made for an accelerator")

    compiled = []
    monkeypatch.setattr(_g, "_host", lambda device: False)
    monkeypatch.setattr(_g.chacha, "keystream_chunks", refuse)
    monkeypatch.setattr(_g, "_device_ok", {})
    monkeypatch.setattr(_g, "_device_fused", lambda precision, device: compiled.append(precision) or _g._INTO_DEVICE[precision])
    monkeypatch.setattr(_g, "_DEVICE_FUSED_GROUPS", 5)  # pieces of 5 groups: 3000 elements span several
    monkeypatch.setattr(_g, "_DEVICE_CHUNK_GROUPS", 7)
    one_kernel = keyed_normal((3000,), KEY, leaf=3, offset=17, dtype=dtype)
    assert compiled and _g._device_ok == {"cpu": True}
    assert torch.equal(one_kernel, eager)
    torch.testing.assert_close(one_kernel, host, rtol=4 * torch.finfo(dtype).eps, atol=8 * torch.finfo(dtype).eps)
    assert torch.equal(keyed_normal((100,), KEY, leaf=3, offset=1017, dtype=dtype), one_kernel[1000:1100])
    op_by_op = keyed_normal((3000,), KEY, leaf=3, offset=17, dtype=dtype, fused=False)
    assert torch.equal(op_by_op, eager)
    blocks, pairs = _g._LAYOUT[_g._FP64 if dtype == torch.float64 else _g._FP32]
    last = (2**32 // blocks) * 2 * pairs  # elements in a stream: it ends at the 32-bit block counter
    assert torch.equal(keyed_normal((7,), KEY, offset=last - 7, dtype=dtype), keyed_normal((7,), KEY, offset=last - 7, dtype=dtype, fused=False))
    for fused in (None, False):
        with pytest.raises(ValueError, match=r"outside the 32-bit counter"):
            keyed_normal((8,), KEY, offset=last - 7, dtype=dtype, fused=fused)

    def no_compiler(precision, device):
        raise RuntimeError("no compiler for this device")

    monkeypatch.setattr(_g, "_device_ok", {})
    monkeypatch.setattr(_g, "_device_fused", no_compiler)
    assert torch.equal(keyed_normal((3000,), KEY, leaf=3, offset=17, dtype=dtype), eager)
    assert _g._device_ok == {"cpu": False}
    with pytest.raises(RuntimeError, match="no compiler"):
        keyed_normal((10,), KEY, fused=True)
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'openssl' or 'torch'"):
        keyed_normal((10,), KEY, backend="cuda")


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The CUDA kernel of vmapdp.noise._triton run on CPU tensors by Triton's interpreter (where
    triton is installed: it comes with torch's CUDA wheels, not with the CPU ones CI installs; the
    CUDA test below runs the same checks compiled)."""
    pytest.importorskip("triton", reason="the Triton kernel's checks need triton (pip install triton), here run by its interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delitem(sys.modules, "vmapdp.noise._triton_kernels", raising=False)  # re-jitted under the interpreter
    monkeypatch.setattr(_g._triton, "available", lambda device: True)
    monkeypatch.setattr(_g, "_triton_ok", {})
    monkeypatch.setattr(_g, "_triton_checked", set())
    yield _g._triton
    sys.modules.pop("vmapdp.noise._triton_kernels", None)  # (a later import jits for the device again)


def test_triton_keystream_is_openssls_bit_for_bit(triton_on_cpu):
    """The kernel's block function (native 32-bit words) against OpenSSL's ChaCha20, for leaf
    nonces of both precisions, a leaf index past 2**32 and the last counters of a stream."""
    skey = _g.stream_key(KEY)
    for leaf, precision, first, n in [(0, 32, 0, 300), (5, 64, 1000, 130), (2**40 + 3, 32, 2**32 - 140, 140)]:
        nonce = _g._nonce(leaf, precision)
        ours = triton_on_cpu.keystream(skey, nonce, first, n, device="cpu")
        openssl = _g.chacha.keystream(skey, nonce, first, n).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        assert torch.equal(ours.reshape(-1), openssl)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernel_draws_every_leaf_in_one_launch_within_the_ulp_bound(triton_on_cpu, monkeypatch, dtype):
    """add_noise's leaves on a CUDA device are drawn by one launch (here: several, the batch cut
    small), each leaf its own stream at its own offset: bitwise what keyed_normal draws for that leaf
    alone (the same kernel), within the stated ulp bound of the host's draws (interpreted here:
    numpy's log/cos/sin; the CUDA test checks the device's). A range past the counter is refused
    before anything is drawn; a kernel that does not build is fallen back from once and
    remembered, or raised with fused=True."""
    launches = []
    fill = triton_on_cpu.fill
    _g._triton_self_check(torch.device("cpu"), _g._FP64 if dtype == torch.float64 else _g._FP32)  # (its launch before the counted ones)
    monkeypatch.setattr(triton_on_cpu, "fill", lambda *a, **k: launches.append(len(a[2])) or fill(*a, **k))
    shapes = {"a": (3, 50), "b": (7,), "c": (0, 4), "d": (40, 41)}
    tree = {k: torch.zeros(v, dtype=dtype) for k, v in shapes.items()}
    offsets = {"a": 5, "b": 0, "c": 0, "d": 123}
    noisy = vmapdp.add_noise(tree, 1.0, key=KEY, offsets=offsets)
    assert launches == [3] and _g._triton_ok == {"cpu": True}  # the empty leaf needs no segment
    for i, k in enumerate(sorted(shapes)):
        alone = keyed_normal(shapes[k], KEY, leaf=i, offset=offsets[k], dtype=dtype)
        assert torch.equal(noisy[k], alone)
        host = keyed_normal(shapes[k], KEY, leaf=i, offset=offsets[k], dtype=dtype, fused=False, backend="openssl")
        torch.testing.assert_close(alone, host, rtol=4 * torch.finfo(dtype).eps, atol=8 * torch.finfo(dtype).eps)
    monkeypatch.setattr(_g, "_TRITON_BATCH_GROUPS", 40)  # "d" alone is larger: a launch of its own
    launches.clear()
    again = vmapdp.add_noise(tree, 1.0, key=KEY, offsets=offsets)
    assert launches == [2, 1] and all(torch.equal(again[k], noisy[k]) for k in shapes)
    blocks, pairs = _g._LAYOUT[_g._FP64 if dtype == torch.float64 else _g._FP32]
    last = (2**32 // blocks) * 2 * pairs
    ulps = {"rtol": 4 * torch.finfo(dtype).eps, "atol": 8 * torch.finfo(dtype).eps}
    torch.testing.assert_close(keyed_normal((7,), KEY, offset=last - 7, dtype=dtype), keyed_normal((7,), KEY, offset=last - 7, dtype=dtype, backend="openssl"), **ulps)
    launches.clear()
    with pytest.raises(ValueError, match=r"outside the 32-bit counter"):
        vmapdp.add_noise({"a": torch.zeros(3, dtype=dtype), "b": torch.zeros(8, dtype=dtype)}, 1.0, key=KEY, offsets={"a": 0, "b": last - 7})
    assert launches == []

    def broken(*args, **kwargs):
        raise RuntimeError("triton cannot build here")

    monkeypatch.setattr(triton_on_cpu, "fill", broken)
    monkeypatch.setattr(_g, "_triton_ok", {})
    torch.testing.assert_close(keyed_normal((40, 41), KEY, leaf=3, offset=123, dtype=dtype), noisy["d"], **ulps)  # (the host's draw here)
    assert _g._triton_ok == {"cpu": False}
    with pytest.raises(RuntimeError, match="triton cannot build"):
        keyed_normal((10,), KEY, dtype=dtype, fused=True)


def test_triton_kernel_that_fails_its_known_answers_never_releases(triton_on_cpu, monkeypatch):
    """Before its first draw on a device the kernel is checked against known answers (its keystream
    against the torch twin's bits, its normals against the host's transform): a kernel that is off
    (here by one part in 10**4, by one keystream bit, or by a radius blind to its word's low bits) is never used. Its noise falls back to the
    torch twin with a warning naming the difference (fused=None), or the error is raised (fused=True)."""
    fill = triton_on_cpu.fill

    def skewed(out, *args, **kwargs):
        fill(out, *args, **kwargs)
        out.mul_(1 + 1e-4)

    monkeypatch.setattr(triton_on_cpu, "fill", skewed)
    with pytest.raises(RuntimeError, match=r"normals on cpu differ from the host's Box-Muller"):
        keyed_normal((10,), KEY, fused=True)
    assert _g._triton_checked == set()
    with pytest.warns(RuntimeWarning, match=r"normals on cpu differ .* Falling back to the torch twin"):
        z = keyed_normal((40, 41), KEY, leaf=3, offset=123)
    assert _g._triton_ok == {"cpu": False}
    torch.testing.assert_close(z, keyed_normal((40, 41), KEY, leaf=3, offset=123, backend="openssl"), rtol=0, atol=0)
    monkeypatch.setattr(triton_on_cpu, "fill", fill)
    keystream = triton_on_cpu.keystream
    monkeypatch.setattr(triton_on_cpu, "keystream", lambda *a, **k: keystream(*a, **k) ^ (torch.arange(16) == 5))
    monkeypatch.setattr(_g, "_triton_ok", {})
    with pytest.raises(RuntimeError, match=r"keystream on cpu differs from RFC 8439"):
        keyed_normal((10,), KEY, dtype=torch.float64, fused=True)
    monkeypatch.setattr(triton_on_cpu, "keystream", keystream)
    radii = triton_on_cpu.radii  # a radius that ignores the words' low 32 bits (random words seldom show it)
    monkeypatch.setattr(triton_on_cpu, "radii", lambda words, **k: radii(words & ~0xFFFFFFFF, **k))
    with pytest.raises(RuntimeError, match=r"Box-Muller radius on cpu of the word"):
        keyed_normal((10,), KEY, fused=True)
    monkeypatch.setattr(triton_on_cpu, "radii", radii)
    keyed_normal((10,), KEY, fused=True)
    assert _g._triton_checked == {("cpu", 32)}
    # a kernel that passed for float32 and then fails float64's known answers: still never used for float64
    monkeypatch.setattr(_g, "_triton_ok", {})
    keyed_normal((10,), KEY)
    assert _g._triton_ok == {"cpu": True}
    monkeypatch.setattr(triton_on_cpu, "fill", lambda out, *a, **k: (fill(out, *a, **k), out.mul_(1 + 1e-4))[0] if out.dtype == torch.float64 else fill(out, *a, **k))
    with pytest.warns(RuntimeWarning, match=r"float64 normals on cpu differ .* Falling back"):
        z = keyed_normal((50,), KEY, dtype=torch.float64)
    assert _g._triton_ok == {"cpu": False}
    torch.testing.assert_close(z, keyed_normal((50,), KEY, dtype=torch.float64, backend="openssl"), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_keyed_normals_on_cuda_match_the_cpu(dtype):
    """On CUDA the keystream and the transform run on the device: the Triton kernel by default (all
    of add_noise's leaves in one launch; it passed its known answers), op by op with fused=False.
    The keystream bits equal the CPU's (also at a stream's last counters) and the normals agree
    within the stated ulp bound (CUDA's log/cos/sin are not the CPU's)."""
    ulps = {"rtol": 4 * torch.finfo(dtype).eps, "atol": 8 * torch.finfo(dtype).eps}
    cpu = keyed_normal((5000,), KEY, leaf=2, offset=33, dtype=dtype)
    for fused in (None, False):
        cuda = keyed_normal((5000,), KEY, leaf=2, offset=33, dtype=dtype, device="cuda", fused=fused)
        assert cuda.device.type == "cuda"
        torch.testing.assert_close(cuda.cpu(), cpu, **ulps)
    assert _g._triton_ok.get("cuda") is True and ("cuda", 64 if dtype == torch.float64 else 32) in _g._triton_checked
    tree = {"a": torch.zeros(5000, dtype=dtype, device="cuda"), "b": torch.zeros(3, 7, dtype=dtype, device="cuda")}
    noisy = vmapdp.add_noise(tree, 1.0, key=KEY, offsets={"a": 33, "b": 2})
    torch.testing.assert_close(noisy["a"].cpu(), keyed_normal((5000,), KEY, leaf=0, offset=33, dtype=dtype), **ulps)
    torch.testing.assert_close(noisy["b"].cpu(), keyed_normal((3, 7), KEY, leaf=1, offset=2, dtype=dtype), **ulps)
    big = keyed_normal((3_000_000,), KEY, leaf=9, dtype=dtype, device="cuda")
    torch.testing.assert_close(big.cpu(), keyed_normal((3_000_000,), KEY, leaf=9, dtype=dtype), **ulps)
    skey = _g.stream_key(KEY)
    for leaf in (1, 2, 2**32 + 1):  # (a nonce word equal to 1 once made Triton specialise the raw-words kernel)
        nonce = _g._nonce(leaf, 32)
        for first in (5, 2**32 - 300):
            ours = _g._triton.keystream(skey, nonce, first, 300, device="cuda").cpu().reshape(-1)
            assert torch.equal(ours, _g.chacha.keystream(skey, nonce, first, 300).view(torch.int32).to(torch.int64) & 0xFFFFFFFF)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_keyed_normals_on_cuda_without_triton_match_the_cpu(monkeypatch, dtype):
    """Where triton is missing: Inductor's compile of the int64 torch twin (~30 s to compile per
    precision on a cold machine), within the same ulp bound; the twin's words equal the CPU's."""
    ulps = {"rtol": 4 * torch.finfo(dtype).eps, "atol": 8 * torch.finfo(dtype).eps}
    monkeypatch.setattr(_g._triton, "available", lambda device: False)
    cpu = keyed_normal((5000,), KEY, leaf=2, offset=33, dtype=dtype)
    torch.testing.assert_close(keyed_normal((5000,), KEY, leaf=2, offset=33, dtype=dtype, device="cuda").cpu(), cpu, **ulps)
    assert _g._device_ok.get("cuda") is True
    skey, nonce = _g.stream_key(KEY), _g._nonce(2, 32)
    words = _g.chacha.keystream_words(skey, nonce, 5, 40, device="cuda")
    assert torch.equal(words.cpu(), _g.chacha.keystream_words(skey, nonce, 5, 40))


def test_triton_kernel_is_not_switched_off_by_a_callers_error(triton_on_cpu):
    """A range past the counter (the caller's error) on the process's first keyed draw is raised and
    leaves the kernel in use: the noise path of the run does not depend on an earlier error."""
    with pytest.raises(ValueError, match=r"outside the 32-bit counter"):
        vmapdp.add_noise({"a": torch.zeros(8)}, 1.0, key=KEY, offsets={"a": 2**37})
    assert _g._triton_ok == {}
    keyed_normal((10,), KEY)
    assert _g._triton_ok == {"cpu": True}


def test_add_noise_never_holds_the_whole_trees_noise(monkeypatch):
    """Each leaf's sum is made as soon as its noise is drawn (peak: one leaf's noise, not the tree's)."""
    import weakref

    live = {"now": 0, "peak": 0}
    one = _g._keyed_one

    def tracked(*a, **k):
        z = one(*a, **k)
        n = z.untyped_storage().nbytes()
        live["now"] += n
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(z.untyped_storage(), lambda: live.__setitem__("now", live["now"] - n))
        return z

    monkeypatch.setattr(_g, "_keyed_one", tracked)
    n = _g._SMALL_LEAF + 4000  # (leaves made one by one: smaller ones share a transform, test below)
    vmapdp.add_noise({f"p{i}": torch.zeros(n) for i in range(10)}, 1.0, key=KEY)
    assert 0 < live["peak"] <= 2 * n * 4 + 1024


@pytest.mark.parametrize("fused", [None, False])
def test_small_leaves_share_one_transform_and_keep_their_own_bits(monkeypatch, fused):
    """Leaves of at most _SMALL_LEAF elements made on the host share one call of the transform per
    precision (each call of the compiled kernel cost more than such a leaf's noise: 100 leaves of 768
    took 5.2 ms, 2.5 ms shared); each leaf's noise is bitwise what keyed_normal makes for it alone
    (its own nonce, its offset), float32 and float64 leaves, empty ones and large ones among them."""
    calls = []
    into = _g._normals_into
    monkeypatch.setattr(_g, "_normals_into", lambda words, *a: calls.append(words.shape[0]) or into(words, *a))
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (7, 5), (0,), (_g._SMALL_LEAF + 1,), (1,), (64, 12), (2, 3, 4)] + [(int(k),) for k in torch.randint(1, 900, (40,), generator=g)]
    tree = {f"p{i:02d}": torch.zeros(s, dtype=torch.float64 if i % 3 == 1 else torch.float32) for i, s in enumerate(shapes)}
    offsets = {k: int(o) for k, o in zip(tree, torch.randint(0, 5000, (len(tree),), generator=g))}
    noisy = _g.add_noise(tree, 1.0, key=KEY, offsets=offsets, snap=False) if fused is None else None
    if fused is False:  # (the eager transform: the same sharing)
        noisy = dict(zip(tree, _g._keyed_normals(KEY, [(tuple(v.shape), i, offsets[k], v.dtype, v.device) for i, (k, v) in enumerate(tree.items())], fused=False)))
    assert len(calls) == 3, calls  # the tree's: one per precision for its small leaves, and the large leaf's own
    for i, (k, v) in enumerate(tree.items()):
        alone = keyed_normal(tuple(v.shape), KEY, leaf=i, offset=offsets[k], dtype=v.dtype, fused=fused)
        assert noisy[k].dtype == v.dtype and torch.equal(noisy[k], alone), k


def test_keyed_noise_under_grad():
    """add_noise under torch.func.grad: the noise is a constant of the function (plain tensors drawn outside the transform)."""
    f = lambda x: vmapdp.add_noise({"a": x}, 1.0, key=KEY, snap=False)["a"]  # noqa: E731
    g, val = torch.func.grad(lambda x: (f(x).sum(), f(x)), has_aux=True)(torch.zeros(10))
    assert torch.equal(g, torch.ones(10)) and torch.equal(val, f(torch.zeros(10)))


def test_secure_noise_is_a_stream_under_a_fresh_os_key(monkeypatch):
    """add_noise(secure=True) (and the secure privatizers) draw a fresh 256-bit key from the OS
    CSPRNG per call and expand it by the keyed stream: with the OS's bytes fixed, the noise is the
    keyed draw under them; the OS is asked once per call, and two calls differ."""
    tree = {"a": torch.zeros(3, 50), "b": torch.zeros(7, dtype=torch.float64)}
    asked = []
    real = _g.secrets.token_bytes
    monkeypatch.setattr(_g.secrets, "token_bytes", lambda n: asked.append(n) or b"\x07" * n)
    noisy = vmapdp.add_noise(tree, 2.0, secure=True, snap=False)
    assert asked == [32]
    assert torch.equal(noisy["a"], keyed_normal((3, 50), b"\x07" * 32, leaf=0) * 2.0)
    assert torch.equal(noisy["b"], keyed_normal((7,), b"\x07" * 32, leaf=1, dtype=torch.float64) * 2.0)
    monkeypatch.setattr(_g.secrets, "token_bytes", real)
    first, second = vmapdp.add_noise(tree, 1.0, secure=True), vmapdp.add_noise(tree, 1.0, secure=True)
    assert not torch.equal(first["a"], second["a"])


# --- snapping (Mironov 2012, for Gaussian noise): releases rounded to a grid of the public std ---


def _on_grid(t: torch.Tensor, grid: float) -> bool:
    return torch.equal(torch.remainder(t.double(), grid), torch.zeros_like(t, dtype=torch.float64))


@pytest.mark.parametrize("std", [1.0, 0.7, 1.3, 2.0**-20 * 3, 1e3])
def test_releases_are_snapped_to_a_power_of_two_grid_of_the_std(std):
    """Every released value, from every source and leaf dtype, is a multiple of snap_grid(std), a
    power of two in (std/128, std/64], and within half a grid step of the plain x + std * z (a leaf
    larger than the CPU's piece of the computation among them)."""
    grid = _g.snap_grid(std)
    assert std / 128 < grid <= std / 64 and math.frexp(grid)[0] == 0.5
    g = torch.Generator().manual_seed(0)
    tree = {"a": torch.randn(150_000, generator=g) * 5 * std, "b": torch.randn(7, 3, generator=g, dtype=torch.float64), "c": torch.randn(40, generator=g).bfloat16()}
    for source in ({"key": KEY}, {"generator": make_generator(1)}, {"secure": True}):
        out = add_noise(tree, std, **source)
        for k, v in out.items():
            assert v.dtype == _g._dt(tree[k]) and _on_grid(v, grid), (source, k)
    snapped, plain = add_noise(tree, std, key=KEY), add_noise(tree, std, key=KEY, snap=False)
    for k in tree:
        cast = plain[k].double().abs() * torch.finfo(plain[k].dtype).eps  # (each side cast to the leaf's dtype, half an ulp each: float32 at a tiny std)
        assert ((snapped[k].double() - plain[k].double()).abs() <= grid / 2 * (1 + 1e-6) + cast * 1.01).all(), k
        assert not torch.equal(snapped[k], plain[k]), k  # (the plain sum is not on the grid)
    zero = add_noise(tree, 0.0, key=KEY)  # no noise, nothing to snap: the sum itself
    assert all(torch.equal(zero[k], tree[k].to(_g._dt(tree[k]))) for k in tree)


def test_snapping_drops_the_low_bits_of_the_input():
    """The point of snapping: with one noise, inputs that differ by delta << grid release the same
    value except where x + noise lies within delta of a cell's edge (a fraction delta / grid =
    1e-3 of the coordinates here; the bound of 250 among 10**5 has a false-alarm rate below 1e-20
    under Binomial(10**5, 1e-3)); the plain sums differ in every coordinate, each carrying delta in
    its low bits, from which a released value rules inputs out (Mironov's attack)."""
    std, n = 1.0, 100_000
    grid = _g.snap_grid(std)
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    y = x + grid / 1000
    assert (y != x).float().mean() > 0.99
    a, b = add_noise({"w": x}, std, key=KEY)["w"], add_noise({"w": y}, std, key=KEY)["w"]
    moved = int((a != b).sum())
    assert 0 < moved <= 250, moved
    pa, pb = add_noise({"w": x}, std, key=KEY, snap=False)["w"], add_noise({"w": y}, std, key=KEY, snap=False)["w"]
    assert (pa != pb).float().mean() > 0.99


def test_snapping_is_one_function_on_every_path(monkeypatch):
    """The CPU's compiled loop, the expression op by op (under a transform, with grad, where nothing
    compiles) and a tensor std give the same bits; check_sensitivity's runs (_unsnapped) are not snapped."""
    std = 0.9
    x = torch.randn(100_005, generator=torch.Generator().manual_seed(3)) * 30
    z = keyed_normal(tuple(x.shape), KEY)
    pieces = _g._release(x, z, std)
    assert _on_grid(pieces, _g.snap_grid(std))
    assert torch.equal(pieces, _g._release(x.clone().requires_grad_(True), z, std).detach())
    assert torch.equal(pieces, _g._release(x, z, torch.tensor(std, dtype=torch.float64)))
    assert torch.equal(pieces, add_noise({"w": x}, std, key=KEY)["w"])
    monkeypatch.setattr(_g, "_snap_ok", False)  # (no C++ compiler: op by op, in pieces)
    monkeypatch.setattr(_g, "_SNAP_PIECE", 4099)
    assert torch.equal(pieces, _g._release(x, z, std))
    monkeypatch.undo()
    # a kernel that does not compile here: op by op from then on, the same bits; once it has compiled, an error is raised
    def broken(*a):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(_g, "_snap_kernel", broken)
    monkeypatch.setattr(_g, "_snap_ok", None)
    assert torch.equal(pieces, _g._release(x, z, std)) and _g._snap_ok is False
    monkeypatch.setattr(_g, "_snap_ok", True)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler"):
        _g._release(x, z, std)
    monkeypatch.undo()
    # leaves that are views: a column, an expanded one, a transposed matrix (found by review: the kernel asserted stride 1)
    m = x[:60_000].reshape(300, 200)
    zm = z[:60_000].reshape(300, 200)
    for view, zv in ((m[:, 3], zm[:, 3]), (m[:1, 0].expand(50), zm[:50, 0]), (m.t(), zm.t())):
        assert torch.equal(_g._release(view, zv, std), _g._snapped(view, zv, std, _g.snap_grid(std)).float())
    # the exact float64 reference, written out here: the sum rounded once in float64, ties to even (a sum
    # rounded to float32 first, at |x| up to 4096 std, differs in ~0.5% of the coordinates)
    wide = (torch.rand(100_000, generator=torch.Generator().manual_seed(5)) * 2 - 1) * 4096 * std
    zw = keyed_normal(tuple(wide.shape), KEY, leaf=1)
    grid = _g.snap_grid(std)
    exact = (torch.round((zw.double() * std + wide.double()) / grid) * grid).float()
    assert torch.equal(_g._release(wide, zw, std), exact)
    assert torch.equal(_g._release(torch.tensor([grid / 2, 3 * grid / 2]), torch.zeros(2), 1.0 * std), torch.tensor([0.0, 2 * grid]))  # ties: even
    # the release is not differentiable in x: round() has gradient 0 (snap=False keeps the plain sum's)
    assert torch.equal(torch.func.grad(lambda t: _g._release(t, z, std).sum())(x), torch.zeros_like(x))
    value = torch.func.vmap(lambda t: _g._release(t, z[:3], std))(x[:6].reshape(2, 3))
    assert torch.equal(value.reshape(-1), torch.cat([_g._release(x[:3], z[:3], std), _g._release(x[3:6], z[:3], std)]))
    with _g._unsnapped():
        assert torch.equal(add_noise({"w": x}, std, key=KEY)["w"], x + z * std)
    # where the float64 sum is coarser than the grid it is kept (|v| >= 2**52 grid), even where v / grid overflows
    big = torch.tensor([2.0**60, -(2.0**70), 3.0, 1e308], dtype=torch.float64)
    assert torch.equal(_g._release(big, torch.zeros(4, dtype=torch.float64), 2.0**-900), big)
    assert torch.equal(_g._release(big[-1:], torch.zeros(1, dtype=torch.float64), 1.0), big[-1:])
    # a tensor std of 0 adds nothing and snaps nothing (its exponent would give a grid of 1/128)
    assert torch.equal(_g._release(torch.tensor([0.3]), torch.ones(1), torch.tensor(0.0, dtype=torch.float64)), torch.tensor([0.3]))


def test_snapped_noise_keeps_its_moments():
    """mean 0 and variance std**2 + grid**2 / 12 (the rounding's share, <= std**2 / 49152): each
    within 5 standard errors over 400k draws (false-alarm rate ~1e-6 each)."""
    std, n = 1.3, 400_000
    out = add_noise({"w": torch.zeros(n)}, std, key=KEY)["w"].double()
    var = std**2 + _g.snap_grid(std) ** 2 / 12
    assert abs(float(out.mean())) < 5 * math.sqrt(var / n)
    assert abs(float(out.var()) - var) < 5 * var * math.sqrt(2 / n)


def test_the_default_privatizer_snaps_and_the_audits_do_not():
    """gaussian_privatizer (the step's default) releases add_noise's snapped sum, bit for bit;
    check_sensitivity's runs are unsnapped (it sees the release inside its step) and snapping is on
    again after it, after a failing one and after an exception inside _unsnapped()."""
    summed = {"w": torch.randn(300, generator=torch.Generator().manual_seed(4))}
    priv = vmapdp.noise.gaussian_privatizer(0.8)
    out, _ = priv.privatize(summed, (), KEY)
    assert torch.equal(out["w"], add_noise(summed, 0.8, key=KEY)["w"]) and _on_grid(out["w"], _g.snap_grid(0.8))

    seen = []

    def loss(p, sample):
        x, y = sample
        return (p["w"] @ x - y) ** 2

    params = {"w": torch.zeros(3)}
    batch = (torch.randn(4, 3, generator=torch.Generator().manual_seed(6)), torch.randn(4, generator=torch.Generator().manual_seed(7)))
    mask = torch.tensor([True, True, True, False])
    for divisor in (4.0, 1.0):  # (1.0: a step the check fails, raising inside its _unsnapped block)
        step = vmapdp.make_train_step(loss, vmapdp.optim.sgd(1.0), l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.5, compile=False, method="vmap",
                                      privatizer=vmapdp.noise.Privatizer(priv.init, lambda s, st, k: seen.append(_g._SNAPPING.get()) or vmapdp.noise.gaussian_privatizer(1.0).privatize(s, st, k), config="spy", std=1.0))
        state = vmapdp.init_train_state(params, vmapdp.optim.sgd(1.0), seed=0)
        try:
            vmapdp.audit.check_sensitivity(step, state, batch, mask, lr=1.0, l2_clip_norm=1.0, expected_batch_size=divisor)
        except vmapdp.audit.PrivacyCheckError:
            assert divisor == 1.0
        assert seen and not any(seen) and _g._SNAPPING.get()
        seen.clear()
    try:
        with _g._unsnapped():
            raise KeyError("inside")
    except KeyError:
        pass
    assert _g._SNAPPING.get() and _on_grid(add_noise(summed, 0.8, key=KEY)["w"], _g.snap_grid(0.8))


def test_float64_noise_where_asked():
    """noise_dtype=torch.float64: a float32 leaf is noised from keyed_normal's float64 stream and
    released (snapped, or plain) in its own dtype; a privatizer with it binds its own configuration
    (other noise than the default's) and runs in a step; other dtypes are refused."""
    x = {"w": torch.randn(2000, generator=torch.Generator().manual_seed(8))}
    z64 = keyed_normal((2000,), KEY, dtype=torch.float64)
    out = add_noise(x, 0.7, key=KEY, noise_dtype=torch.float64)["w"]
    assert out.dtype == torch.float32 and torch.equal(out, _g._release(x["w"], z64, 0.7)) and _on_grid(out, _g.snap_grid(0.7))
    assert not torch.equal(out, add_noise(x, 0.7, key=KEY)["w"])
    plain = add_noise(x, 0.7, key=KEY, noise_dtype=torch.float64, snap=False)["w"]
    assert plain.dtype == torch.float32 and torch.equal(plain, (x["w"].double() + z64 * 0.7).float())
    with pytest.raises(ValueError, match=r"noise_dtype=torch.float16 must be None"):
        add_noise(x, 0.7, key=KEY, noise_dtype=torch.float16)
    for bad in ("float64", True):
        with pytest.raises(TypeError, match=r"noise_dtype must be None .* got (str|bool)"):
            add_noise(x, 0.7, key=KEY, noise_dtype=bad)
    wide = vmapdp.noise.gaussian_privatizer(0.7, noise_dtype=torch.float64)
    assert wide.config != vmapdp.noise.gaussian_privatizer(0.7).config and torch.equal(wide.privatize(x, (), KEY)[0]["w"], out)
    # float32 is the default: the same noise and configuration (found by review: another key for the same noise)
    assert vmapdp.noise.gaussian_privatizer(0.7, noise_dtype=torch.float32).config == vmapdp.noise.gaussian_privatizer(0.7).config
    assert torch.equal(add_noise(x, 0.7, key=KEY, noise_dtype=torch.float32)["w"], add_noise(x, 0.7, key=KEY)["w"])
    # every source draws the float64 stream (secure: under the OS's key), sharded offsets its slice
    assert torch.equal(add_noise(x, 0.7, key=KEY, offsets={"w": 0}, noise_dtype=torch.float64)["w"], out)
    part = add_noise({"w": x["w"][500:]}, 0.7, key=KEY, offsets={"w": 500}, noise_dtype=torch.float64)["w"]
    assert torch.equal(part, out[500:])
    g64 = add_noise(x, 0.7, make_generator(2), noise_dtype=torch.float64, snap=False)["w"]
    assert torch.equal(g64, (x["w"].double() + torch.randn(2000, dtype=torch.float64, generator=make_generator(2)) * 0.7).float())

    def loss(p, sample):
        return (p["w"] * sample).sum() * 0.0

    step = vmapdp.make_train_step(loss, vmapdp.optim.sgd(1.0), l2_clip_norm=1.0, noise_multiplier=0.7, expected_batch_size=1.0, sample_rate=0.5,
                                  compile=False, method="vmap", privatizer=vmapdp.noise.gaussian_privatizer(0.7, noise_dtype=torch.float64))
    state, _ = step(vmapdp.init_train_state({"w": torch.zeros(50)}, vmapdp.optim.sgd(1.0), seed=3), torch.ones(2, 50), torch.ones(2, dtype=torch.bool))
    assert state.params["w"].dtype == torch.float32 and _on_grid(state.params["w"], _g.snap_grid(0.7)) and state.params["w"].ne(0).any()


def test_snapped_release_is_add_noises_for_a_privatizer_of_yours():
    """snapped_release(x, z, std): the release add_noise makes from the same z, bit for bit (float32,
    bfloat16 and float64 sums); another power-of-two grid is taken; bad arguments refused by name."""
    g = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(3000, generator=g).to(dtype)
        z = keyed_normal((3000,), KEY, dtype=_g._dt(x))
        assert torch.equal(vmapdp.noise.snapped_release(x, z, 1.7), add_noise({"w": x}, 1.7, key=KEY)["w"]), dtype
    x, z = torch.randn(50, generator=g), torch.randn(50, generator=g)
    assert _on_grid(vmapdp.noise.snapped_release(x, z, 1.7, grid=2.0**-3), 2.0**-3)
    assert not _on_grid(vmapdp.noise.snapped_release(x, z, 1.7), 2.0**-3)
    with pytest.raises(ValueError, match=r"grid=0.1 must be a power of two"):
        vmapdp.noise.snapped_release(x, z, 1.7, grid=0.1)
    with pytest.raises(ValueError, match=r"z must have x's shape \(50,\), got \(49,\)"):
        vmapdp.noise.snapped_release(x, z[:49], 1.7)
    with pytest.raises(TypeError, match=r"x and z must be floating-point tensors"):
        vmapdp.noise.snapped_release(x.tolist(), z, 1.7)
    with pytest.raises(TypeError, match=r"std must be a number"):
        vmapdp.noise.snapped_release(x, z, torch.tensor(1.7))
