"""The cryptography of secure aggregation (fedse/privacy/masking.py): keys from seeds, agreement, share
encryption, masks and Shamir shares, with the libraries underneath; and that pairwise masks from
agreed keys cancel in a fixed-point sum."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from cryptography.exceptions import InvalidTag

from fedse.privacy import fixedpoint as fp
from fedse.privacy import masking as m


def expand(key: bytes, count: int) -> np.ndarray:
    """The first `count` elements of the mask stream of `key`, as an array of their own."""
    return m.MaskStream(key).next(count).copy()


def test_two_clients_agree_on_a_key_bound_to_its_context():
    a, b, c = (m.KeyPair(m.Secret()) for _ in range(3))
    ab = a.agree(b.public, b"run r round 3 mask")
    assert ab == b.agree(a.public, b"run r round 3 mask") and len(ab) == m.KEY_BYTES
    assert ab != a.agree(b.public, b"run r round 4 mask")  # another context
    assert ab != a.agree(c.public, b"run r round 3 mask")  # another peer
    with pytest.raises(ValueError, match="32 bytes"):
        a.agree(b.public[:31], b"x")
    with pytest.raises(ValueError):
        a.agree(bytes(32), b"x")  # a small-order point gives the all-zero secret: refused


def test_a_key_pair_is_rebuilt_from_shares_of_its_seed():
    seed = m.Secret()
    pair = m.KeyPair(seed)
    shares = m.split(seed, threshold=3, holders=5)
    assert len(shares) == 5
    for chosen in itertools.combinations(shares, 3):
        assert m.KeyPair(m.combine(list(chosen))).public == pair.public
    assert m.KeyPair(m.combine(shares[:2])).public != pair.public  # below the threshold: something else
    with pytest.raises(ValueError, match="distinct"):
        m.combine([shares[0], shares[0], shares[1]])
    with pytest.raises(ValueError, match="threshold"):
        m.split(seed, threshold=6, holders=5)


def test_a_sealed_share_opens_only_with_its_key_and_context():
    key = m.KeyPair(m.Secret()).agree(m.KeyPair(m.Secret()).public, b"shares")
    sealed = m.encrypt(key, b"share bytes", b"from a to b, round 1")
    assert m.decrypt(key, sealed, b"from a to b, round 1") == b"share bytes"
    for bad_key, bad_aad, bad_sealed in [(bytes(32), b"from a to b, round 1", sealed),
                                         (key, b"from a to c, round 1", sealed),
                                         (key, b"from a to b, round 1", sealed[:-1] + bytes([sealed[-1] ^ 1]))]:
        with pytest.raises(InvalidTag):
            m.decrypt(bad_key, bad_sealed, bad_aad)


def test_masks_are_a_keyed_stream_and_pairwise_masks_cancel_in_the_sum():
    key = bytes(range(32))
    mask = expand(key, 1000)
    assert mask.dtype == np.uint64 and np.array_equal(mask, expand(key, 1000))
    assert np.array_equal(expand(key, 10), mask[:10]) and len(np.unique(mask)) == 1000
    assert not np.array_equal(mask, expand(bytes(32), 1000))
    # Three clients mask their encoded values pairwise: the lower id adds, the higher subtracts.
    pairs = [m.KeyPair(m.Secret()) for _ in range(3)]
    values = [np.random.default_rng(k).normal(0, 0.02, size=50) for k in range(3)]
    uploads = []
    for i, own in enumerate(pairs):
        up = fp.encode(values[i])
        for j, peer in enumerate(pairs):
            if j != i:
                mk = expand(own.agree(peer.public, b"round 0 mask"), 50)
                up = fp.add(up, mk) if i < j else fp.subtract(up, mk)
        uploads.append(up)
    assert np.abs(fp.decode_sum(uploads[0], 1) - values[0]).max() > 1.0  # one upload shows nothing
    total = np.zeros(50, dtype=np.uint64)
    for up in uploads:
        total = fp.add(total, up)
    assert np.abs(fp.decode_sum(total, 3) / 3 - np.mean(values, axis=0)).max() <= fp.MEAN_ERROR_BOUND + 1e-16


def test_a_secret_is_never_shown_and_can_be_wiped():
    seed = m.Secret(bytes(range(1, 17)))
    assert "hidden" in repr(seed) and "\\x01" not in repr(seed) and "1, 2" not in repr(seed)
    seed.wipe()
    with pytest.raises(ValueError, match="wiped"):
        seed.reveal()
    with pytest.raises(ValueError, match="16 bytes"):
        m.Secret(b"short")
