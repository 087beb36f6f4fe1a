"""The cryptography of secure aggregation, all from maintained libraries: `cryptography` for key
agreement (X25519), key derivation (HKDF-SHA256), share encryption (ChaCha20-Poly1305) and mask
expansion (the ChaCha20 stream); pycryptodome for Shamir's secret sharing (over GF(2^128)).

Every secret a client must be able to hand out in shares is a 16-byte seed, the size a Shamir share
holds: its X25519 key is derived from a seed (`KeyPair.from_seed`), and so is its self-mask.
Pairwise masks come from the key two clients agree on, bound to the run, the round and the pair by
HKDF's info, so no mask is ever used twice. Every info, commitment and associated data is framed
(`frame`: each part preceded by its length), so no two different lists of parts read alike. Noise
for differential privacy is drawn from the ChaCha20 stream of a random key (`gaussian`).

Nothing here logs, stores or prints a secret; `Secret` keeps a seed in a bytearray that `wipe()`
zeroes (Python cannot promise more: copies made by the libraries it calls are theirs to free).
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SEED_BYTES = 16
KEY_BYTES = 32
NONCE_BYTES = 12
# What every framed message starts with, so that keys, hashes and signatures made here serve nothing else.
DOMAIN = b"fedse secure aggregation v3"


def frame(*parts: bytes | str) -> bytes:
    """The parts, each preceded by its length (4 bytes, big-endian), text as UTF-8: what is hashed,
    derived from or signed, so that no two lists of parts give the same bytes."""
    out = bytearray()
    for part in parts:
        data = part.encode() if isinstance(part, str) else bytes(part)
        out += struct.pack(">I", len(data)) + data
    return bytes(out)


class Secret:
    """A 16-byte seed held in a bytearray that wipe() zeroes; never shown in a repr or a log."""

    def __init__(self, seed: bytes | bytearray | None = None):
        seed = os.urandom(SEED_BYTES) if seed is None else seed
        if len(seed) != SEED_BYTES:
            raise ValueError(f"a seed is {SEED_BYTES} bytes, got {len(seed)}")
        self._seed = bytearray(seed)

    def reveal(self) -> bytes:
        """The seed's bytes, for the one call that needs them (a derivation or a share split)."""
        if not any(self._seed):
            raise ValueError("this secret was wiped")
        return bytes(self._seed)

    def wipe(self) -> None:
        self._seed[:] = bytes(len(self._seed))

    def __repr__(self) -> str:
        return "Secret(<hidden>)"


def derive(secret: bytes, *info: bytes | str, length: int = KEY_BYTES) -> bytes:
    """HKDF-SHA256 of `secret` for the purpose `info`: its info is frame(DOMAIN, *info)."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=frame(DOMAIN, *info)).derive(secret)


class KeyPair:
    """An X25519 key pair derived from a 16-byte seed, so that the seed's Shamir shares can rebuild it."""

    def __init__(self, seed: Secret):
        self._private = X25519PrivateKey.from_private_bytes(derive(seed.reveal(), "x25519 key"))
        self.public = self._private.public_key().public_bytes(serialization.Encoding.Raw,
                                                               serialization.PublicFormat.Raw)

    def agree(self, peer_public: bytes, context: bytes, purpose: str = "") -> bytes:
        """The 32-byte key this pair shares with the owner of `peer_public`, for `context` (the run and
        the attempt) and `purpose`; the same on both sides. ValueError for a public key that is not 32
        bytes or that gives the all-zero secret (a small-order point)."""
        if len(peer_public) != KEY_BYTES:
            raise ValueError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(peer_public)}")
        shared = self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        ends = sorted([self.public, peer_public])
        return derive(shared, context, purpose, ends[0], ends[1])


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """ChaCha20-Poly1305 of `plaintext` under `key`, bound to `associated` (who sends it to whom, in
    which round); a random nonce, then the ciphertext and its tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of encrypt(); cryptography's InvalidTag where the key, the associated data or
    any byte differs (a tampered or misdirected share)."""
    return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)


class MaskStream:
    """The ChaCha20 stream of `key` (32 bytes, zero nonce: each key is derived for one mask only) read
    as uint64 ring elements, a block at a time (`next`), so a mask as long as an adapter is never held."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a mask key is {KEY_BYTES} bytes, got {len(key)}")
        self._cipher = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
        self._zeros = bytearray()
        self._out = bytearray()

    def next(self, count: int) -> np.ndarray:
        """The next `count` elements (a view valid until the next call)."""
        size = 8 * count
        if len(self._zeros) < size:
            self._zeros = bytearray(size)
            self._out = bytearray(size + 15)  # update_into wants room for a block more
        n = self._cipher.update_into(memoryview(self._zeros)[:size], self._out)
        return np.frombuffer(self._out, dtype="<u8", count=n // 8)



def gaussian(count: int, std: float = 1.0, key: bytes | None = None) -> np.ndarray:
    """`count` independent normal values of standard deviation `std`, float64, from the ChaCha20
    stream of `key` (32 random bytes unless given): uniform values of 53 bits, turned normal by the
    Box-Muller transform. A cryptographic generator, so that nobody can predict or replay the noise
    a client adds from values it has seen."""
    stream = MaskStream(key if key is not None else os.urandom(KEY_BYTES))
    pairs = (count + 1) // 2
    bits = stream.next(2 * pairs).copy() >> np.uint64(11)  # 53 random bits each
    u = (bits.astype(np.float64) + 1.0) / float(1 << 53)  # in (0, 1]: log(u) is finite
    radius = np.sqrt(-2.0 * np.log(u[:pairs]))
    angle = 2.0 * math.pi * u[pairs:]
    out = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
    return out * std


def split(secret: Secret, threshold: int, holders: int) -> list[tuple[int, bytes]]:
    """Shamir shares of the seed: `holders` shares (index, 16 bytes), any `threshold` of which
    rebuild it and fewer of which say nothing about it."""
    if not 1 <= threshold <= holders:
        raise ValueError(f"a threshold of {threshold} shares out of {holders} cannot rebuild anything")
    return Shamir.split(threshold, holders, secret.reveal())


def combine(shares: list[tuple[int, bytes]]) -> Secret:
    """The seed that `shares` (at least the threshold of them, distinct indices) rebuild."""
    if len({i for i, _ in shares}) != len(shares):
        raise ValueError("shares to combine must have distinct indices")
    return Secret(Shamir.combine(shares))

