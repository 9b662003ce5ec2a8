"""add_noise: distribution (KS test with a negative control), reproducibility, dtype, no global RNG."""

from __future__ import annotations

import math

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
    tree = {"a": torch.zeros(20_000)}
    z = add_noise(tree, 2.0, secure=True)["a"].double().numpy()
    assert stats.kstest(z, "norm", args=(0.0, 2.0)).pvalue > ALPHA
    assert stats.kstest(z, "norm", args=(0.0, 2.0 * 1.1)).pvalue < ALPHA  # negative control
    torch.manual_seed(0)
    again = add_noise(tree, 2.0, secure=True)["a"].double().numpy()
    assert not (z == again).all()
    with pytest.raises(ValueError, match=r"secure=True .* takes no generator"):
        add_noise(tree, 1.0, make_generator(0), secure=True)


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
    out = add_noise(tree, 1.0, make_generator(0))["w"]
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
