"""ChaCha20 (vmapdp.noise.chacha): RFC 8439's known answers, and OpenSSL's keystream == the torch twin, bitwise."""

from __future__ import annotations

import pytest
import torch

from vmapdp.noise import chacha

RFC_KEY = bytes(range(32))
LADIES = (
    b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, sunscreen would be it."
)
BACKENDS = ["torch", pytest.param("openssl", marks=pytest.mark.skipif(not chacha.have_openssl(), reason="cryptography not installed"))]


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rfc8439_block_function_2_3_2(backend):
    nonce = bytes.fromhex("000000090000004a00000000")
    expected = bytes.fromhex(
        "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
        "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
    )
    assert _bytes(chacha.keystream(RFC_KEY, nonce, 1, 1, backend=backend)) == expected
    # the state words the RFC lists after adding the initial state (2.3.2, first and last)
    words = chacha.chacha20_blocks(RFC_KEY, torch.tensor([1]), nonce)[0]
    assert int(words[0]) == 0xE4E7F110 and int(words[15]) == 0x4E3C50A2


@pytest.mark.parametrize("backend", BACKENDS)
def test_rfc8439_encryption_2_4_2(backend):
    nonce = bytes.fromhex("000000000000004a00000000")
    expected = bytes.fromhex(
        "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
        "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
        "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
        "5af90bbf74a35be6b40b8eedf2785e42874d"
    )
    ks = _bytes(chacha.keystream(RFC_KEY, nonce, 1, 2, backend=backend))
    assert bytes(p ^ k for p, k in zip(LADIES, ks)) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_rfc8439_appendix_a1_zero_key(backend):
    expected = bytes.fromhex(
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    )
    assert _bytes(chacha.keystream(bytes(32), bytes(12), 0, 1, backend=backend)) == expected


@pytest.mark.skipif(not chacha.have_openssl(), reason="cryptography not installed")
@pytest.mark.parametrize(
    "first, n",
    [(0, 1), (7, 33), (0, 65_536 + 5), (2**32 - 3, 3), (123_456_789, 1000)],  # 65,541 blocks: across OpenSSL's 4 MiB chunks; the last counters
)
def test_openssl_keystream_equals_the_torch_twin_bitwise(first, n):
    g = torch.Generator().manual_seed(first + n)
    key = bytes(torch.randint(0, 256, (32,), generator=g).tolist())
    nonce = bytes(torch.randint(0, 256, (12,), generator=g).tolist())
    a = chacha.keystream(key, nonce, first, n, backend="openssl")
    b = chacha.keystream(key, nonce, first, n, backend="torch")
    assert a.dtype == b.dtype == torch.uint8 and a.numel() == 64 * n
    assert torch.equal(a, b)


def test_block_ranges_compose_and_bad_arguments_raise():
    whole = chacha.keystream(RFC_KEY, bytes(12), 10, 20)
    assert torch.equal(torch.cat([chacha.keystream(RFC_KEY, bytes(12), 10, 7), chacha.keystream(RFC_KEY, bytes(12), 17, 13)]), whole)
    assert not torch.equal(whole, chacha.keystream(RFC_KEY, b"\x01" + bytes(11), 10, 20))  # another nonce, another stream
    assert chacha.keystream(RFC_KEY, bytes(12), 5, 0).numel() == 0
    with pytest.raises(ValueError, match=r"outside the 32-bit counter"):
        chacha.keystream(RFC_KEY, bytes(12), 2**32 - 1, 2)  # would wrap around: refused
    with pytest.raises(ValueError, match=r"key must be 32 bytes"):
        chacha.keystream(b"short", bytes(12), 0, 1)
    with pytest.raises(ValueError, match=r"nonce must be 12 bytes"):
        chacha.keystream(RFC_KEY, bytes(8), 0, 1)
    with pytest.raises(ValueError, match=r"backend must be"):
        chacha.keystream(RFC_KEY, bytes(12), 0, 1, backend="gpu")
    with pytest.raises(ValueError, match=r"counters must be in"):
        chacha.chacha20_blocks(RFC_KEY, torch.tensor([2**32]), bytes(12))


@pytest.mark.parametrize("first, n", [(0, 1), (7, 33), (2**32 - 3, 3), (123_456_789, 1000)])
def test_keystream_words_are_the_keystream_bytes_read_as_int64(first, n):
    """The words the keyed noise of an accelerator is made from (computed where the noise is
    needed) are the keystream bytes' little-endian int64 view, bit for bit; the sign bit too (the
    high 32-bit word shifted into it)."""
    g = torch.Generator().manual_seed(first + n)
    key = bytes(torch.randint(0, 256, (32,), generator=g).tolist())
    nonce = bytes(torch.randint(0, 256, (12,), generator=g).tolist())
    words = chacha.keystream_words(key, nonce, first, n)
    assert words.dtype == torch.int64 and words.shape == (n, 8)
    assert torch.equal(words, chacha.keystream(key, nonce, first, n).view(torch.int64).view(n, 8))
    assert (words < 0).any() or n < 8  # (about half the words have the top bit set)
    with pytest.raises(ValueError, match=r"outside the 32-bit counter"):
        chacha.keystream_words(key, nonce, 2**32 - n, n + 1)
