"""Secure aggregation, the protocol's arithmetic shared by clients and aggregator (proto/fedse/v1/
federation.proto says the stages; fedse.privacy.masking holds the cryptographic primitives; fedse.privacy.fixedpoint
the ring Z_2^64).

A client's masked vector is its encoded values plus a self mask and pairwise masks:
    y_u = enc(x_u) + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)   (mod 2^64)
over the members v of U2 (those that shared), clients ordered by client id. Summed over the
uploaders U3 the pairwise masks of two uploaders cancel; the aggregator removes the rest with the
seeds it rebuilds in the unmasking stage: b_u of every uploader, and s_v of every member of U2 that
did not upload (whose pairwise key it then agrees with each uploader's public key).

Every key is bound to the run, the attempt (its round_nonce), the pair and the purpose through
HKDF's info, so no mask or seal is ever used twice. Vectors are masked block by block: a mask is
never held whole.

What a client checks before it acts, against an aggregator that may lie, is here too: the least
threshold it accepts (`floor`), the masking graph of the uploaders (`parts`: unmasking a graph in
pieces would give each piece's sum), the least neighbourhood that keeps a ring of a given size from
splitting (`min_neighbours`), and the ring's order, drawn from the roster's own keys (`roster_digest`)
so that the aggregator cannot pick a nonce that seats colluders around a client.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import BinaryIO, Iterable, Mapping, Sequence

import numpy as np
import torch

from fedse.privacy import fixedpoint as fx
from fedse.privacy import masking
from fedse.model.adapter import Schema, clip_factor

MASKED_DTYPE = "masked-uint64"  # AdapterHeader.transport_dtype of a masked upload
BLOCK = 1 << 15  # ring elements masked at a time (256 KiB: the block stays in cache while every mask is added)
SHARE_PLAINTEXT = 2 * masking.SEED_BYTES
STRATEGIES = ("fedavg", "weighted", "zero-pad")  # the strategies a masked sum can give (zero-pad: clients pad)


class SecureError(ValueError):
    """A secure-aggregation message or value that cannot be used; the text says what is wrong."""


# ---- the masked vector's layout ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each value sits in the vector: the schema's tensors in order, then (`weighted` only) the
    weight, then the count (1 per upload; the unmasked sum must count its uploads, else a mask was
    left in). fedavg and zero-pad: [x, 1]. weighted: [w*x, w, 1], w*x made exactly in the ring
    (fixedpoint.times), so that the sum holds the weighted sum, the summed weight and the count, and
    neither the plain sum nor any one client's weight: clients whose weights differ cannot be told apart."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    weighted: bool

    @staticmethod
    def of(schema: Schema, strategy: str) -> "Layout":
        if strategy not in STRATEGIES:
            raise SecureError(f"strategy {strategy!r} cannot work on a masked sum: use {' or '.join(STRATEGIES)}")
        floating = {"float32", "float16", "bfloat16", "float64"}
        other = next((t for t in schema.tensors if t.dtype not in floating), None)
        if other is not None:
            raise SecureError(f"tensor {other.name} has dtype {other.dtype}: secure aggregation sums floating "
                              "tensors only")
        return Layout(tuple(t.name for t in schema.tensors), tuple(tuple(t.shape) for t in schema.tensors),
                      strategy == "weighted")

    @property
    def values(self) -> int:
        """The adapter's values (the vector without its weight and count)."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def length(self) -> int:
        """Ring elements in the vector."""
        return self.values + (2 if self.weighted else 1)

    @property
    def nbytes(self) -> int:
        return 8 * self.length

    def encode(self, adapter: Mapping[str, torch.Tensor], weight: int) -> np.ndarray:
        """The vector [enc(x), enc(1)] (weighted: [w * enc(x), enc(w), enc(1)]), uint64, made tensor by
        tensor (no float64 copy of the whole adapter); SecureError for a value or weight outside the
        fixed-point range (`check`)."""
        self._check_weight(weight)
        out = np.empty(self.length, dtype=np.uint64)
        at = 0
        for name, x in self._pieces(adapter, weight):
            enc = fx.encode(x)
            out[at:at + x.size] = fx.times(enc, weight) if self.weighted else enc
            at += x.size
        if self.weighted:
            out[-2] = fx.encode(np.array([float(weight)]))[0]
        out[-1] = fx.encode(np.ones(1))[0]
        return out

    def check(self, adapter: Mapping[str, torch.Tensor], weight: int) -> None:
        """SecureError unless `encode` can make the vector: every value finite and within ±CLIP, and for
        weighted the weight a whole number from 0 to CLIP and every weight * value (in float64) within
        ±CLIP, so that a sum of up to MAX_CLIENTS vectors never wraps. Asked before any stage."""
        self._check_weight(weight)
        for _ in self._pieces(adapter, weight):
            pass

    def _check_weight(self, weight: int) -> None:
        if self.weighted:
            try:
                fx.times(np.zeros(0, dtype=np.uint64), weight)
            except ValueError as exc:
                raise SecureError(f"this adapter cannot be masked: its weight {weight}: {exc}") from None

    def _pieces(self, adapter: Mapping[str, torch.Tensor], weight: int):
        """(name, float64 values) per tensor, in order, once checked: SecureError naming the tensor with
        a value (or, for weighted, a weight * value) that is not finite or lies outside ±CLIP."""
        for name in self.names:
            x = adapter[name].detach().cpu().to(torch.float64).reshape(-1).numpy()
            try:
                fx.check(x)
                if self.weighted:
                    fx.check(x * float(weight))
            except ValueError as exc:
                what = f"{name} times its weight {weight}" if self.weighted and weight > 1 else name
                raise SecureError(f"this adapter cannot be masked: {what}: {exc}") from None
            yield name, x

    def decode_mean(self, total: np.ndarray, count: int) -> dict[str, torch.Tensor]:
        """The mean adapter (float64 tensors) of the `count` vectors whose wrapped sum is `total`:
        sum(x) / count, or for weighted sum(w * x) / sum(w). The count (and the summed weight) must
        come out whole and as expected, else the masks were not all removed; SecureError for a weighted
        sum whose weights sum to 0 (no uploader succeeded): its mean is undefined, and the sum holds
        nothing else to publish."""
        s = fx.decode_sum(total, count)
        n = self.values
        if s[-1] != count:
            raise SecureError(f"the unmasked sum counts {s[-1]:.6g} clients, not {count}: a mask was not removed "
                              "(a wrong share, or a client that masked for another set of peers)")
        if self.weighted:
            weights = s[-2]
            if weights != round(weights) or weights < 0:
                raise SecureError(f"the unmasked weights sum to {weights:.6g}, not a whole number: a mask was not "
                                  "removed")
            if weights == 0:
                raise SecureError(f"no uploader succeeded (the {count} weights sum to 0): the weighted mean is "
                                  "undefined, and the round keeps the global adapter")
            mean = s[:n] / weights
        else:
            mean = s[:n] / count
        out, at = {}, 0
        for name, shape in zip(self.names, self.shapes):
            size = math.prod(shape)
            out[name] = torch.from_numpy(mean[at:at + size].reshape(shape).copy())
            at += size
        return out


def clip_and_noise(adapter: Mapping[str, torch.Tensor], previous: Mapping[str, torch.Tensor], clip_norm: float,
                   noise_std: float, key: bytes | None = None,
                   held: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The client's side of distributed differential privacy: its update (adapter - previous) clipped to
    `clip_norm` (0: not clipped), plus Gaussian noise of `noise_std` on every value, drawn from a
    cryptographic generator (masking.gaussian) keyed by `key` (each tensor's stream derived from it and
    the tensor's name; None: a random key). Every attempt of a round masks the same values, so a retried
    round gives no second noise sample: with the same `key` (ReleaseBook.draw), a restart neither.

    `held` (boolean masks by tensor name; None or a name left out: every value) marks the values this
    client holds: with mixed ranks, its own components of the run's rank-R adapter. The clip's norm
    counts only those (the others are padding, not its update), and only those are clipped; the
    values it does not hold stay as `adapter` has them (a scale that depends on its data would make
    them depend on it too), noised like every value, so that the sum's noise covers every component."""
    out = {n: t.detach().to(torch.float64) for n, t in adapter.items()}
    if clip_norm > 0:
        masks = {n: held[n] if held is not None and n in held else None for n in out}
        delta = {n: t - previous[n].to(torch.float64) for n, t in out.items()}
        delta = {n: d if masks[n] is None else torch.where(masks[n], d, torch.zeros_like(d)) for n, d in delta.items()}
        scale = clip_factor(sum(float((d ** 2).sum()) for d in delta.values()), clip_norm)
        clipped = {n: previous[n].to(torch.float64) + scale * d for n, d in delta.items()}
        out = {n: c if masks[n] is None else torch.where(masks[n], c, out[n]) for n, c in clipped.items()}
    if noise_std > 0:
        out = {n: t + torch.from_numpy(masking.gaussian(
            t.numel(), noise_std, None if key is None else masking.derive(key, "dp noise tensor", n)
        ).reshape(tuple(t.shape))) for n, t in out.items()}
    return out


def release_digest(adapter: Mapping[str, torch.Tensor], previous: Mapping[str, torch.Tensor], clip_norm: float,
                   noise_multiplier: float) -> bytes:
    """SHA-256 of what one release is made from: the adapter, the global adapter it is clipped against,
    the clip norm and the noise multiplier (every tensor's name, dtype, shape and bytes). What a
    client's noise for it is drawn from (ReleaseBook.draw): the same release, the same noise."""
    h = hashlib.sha256(masking.frame(masking.DOMAIN, "release", repr(float(clip_norm)), repr(float(noise_multiplier))))
    for part, tensors in (("adapter", adapter), ("previous", previous)):
        h.update(masking.frame(part, str(len(tensors))))
        for name in sorted(tensors):
            t = tensors[name].detach().cpu().contiguous()
            h.update(masking.frame(name, str(t.dtype), repr(tuple(t.shape))))
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def noise_std(clip_norm: float, noise_multiplier: float, threshold: int) -> float:
    """Each client's noise: a sum of at least `threshold` uploads then carries noise of std
    noise_multiplier * clip_norm, what central DP adds to the sum."""
    return noise_multiplier * clip_norm / math.sqrt(threshold) if noise_multiplier > 0 else 0.0


# ---- keys, contexts and commitments ----------------------------------------------------------
def context(run_id: str, round_: int, round_nonce: str) -> bytes:
    """What binds an attempt's keys, seals and signatures: the run, the round and the attempt's nonce."""
    return masking.frame(run_id, str(round_), round_nonce)


def commitment(ctx: bytes, purpose: str, owner: str, holder: str, value: bytes) -> bytes:
    """SHA-256 commitment to a 16-byte secret (a seed or a share; 128 bits of entropy, so the hash
    reveals nothing a search could find)."""
    return hashlib.sha256(masking.frame(masking.DOMAIN, "commit", ctx, purpose, owner, holder, value)).digest()


def seal_associated(ctx: bytes, sender: str, recipient: str) -> bytes:
    return masking.frame(masking.DOMAIN, "seal", ctx, sender, recipient)


def roster_digest(ctx: bytes, members: Iterable["Member"]) -> bytes:
    """SHA-256 over every member's keys, in client-id order: what the ring's order is drawn from. The
    aggregator cannot choose it (it would have to change a member's signed keys); it can only leave
    members out, and a member left out learns it."""
    parts: list[bytes | str] = [masking.DOMAIN, "roster", ctx]
    for m in sorted(members, key=lambda m: m.client_id):
        parts += [m.client_id, m.encryption_key, m.masking_key, m.self_commitment]
    return hashlib.sha256(masking.frame(*parts)).digest()


def neighbours(ids: Sequence[str], ctx: bytes, degree: int, digest: bytes = b"") -> dict[str, frozenset[str]]:
    """Each roster member's neighbourhood, itself included: those it shares its seeds with and masks
    against. Everyone where `degree` is 0 or reaches the others; else a random Harary graph (Bell et
    al. 2020): the members in an order drawn from the attempt's context and the roster's digest, each
    joined to the ceil(degree/2) members on either side of it, so every neighbourhood has the same size."""
    n = len(ids)
    if degree <= 0 or degree >= n - 1:
        everyone = frozenset(ids)
        return {cid: everyone for cid in ids}
    order = ring(ids, ctx, digest)
    half = (degree + 1) // 2
    return {cid: frozenset(order[(i + j) % n] for j in range(-half, half + 1)) for i, cid in enumerate(order)}


def ring(ids: Iterable[str], ctx: bytes, digest: bytes) -> list[str]:
    """The members in the ring's order: by SHA-256 of the attempt's context, the roster's digest and the id."""
    def place(cid: str) -> bytes:
        return hashlib.sha256(masking.frame(masking.DOMAIN, "order", ctx, digest, cid)).digest()
    return sorted(ids, key=place)


# A ring is sized so that one run of ceil(k/2) consecutive dropouts is expected in at most 1 attempt
# of 100; a split, which takes two such runs, then comes in about 1 attempt of 20,000.
SPLIT_BUDGET = 0.01


def min_neighbours(members: int, dropout_rate: float) -> int:
    """The fewest neighbours (k) that keep a Harary ring of `members` whole at `dropout_rate`: the ring
    splits only where two runs of ceil(k/2) consecutive members all drop out, and k is the least for
    which members * rate^ceil(k/2) <= SPLIT_BUDGET. Bell et al. 2020 show O(log n) neighbours suffice;
    this is that bound for a stated dropout rate. members - 1 (everyone) where no sparser ring does."""
    everyone = max(members - 1, 0)
    if dropout_rate >= 1:
        return everyone
    half = 1
    while members * dropout_rate ** half > SPLIT_BUDGET and 2 * half - 1 < everyone:
        half += 1
    return min(max(2, 2 * half - 1), everyone)


def parts(members: Iterable[str], graph: Mapping[str, frozenset[str]]) -> list[list[str]]:
    """The connected parts of the masking graph among `members` (two joined where they are neighbours),
    each sorted, in order. More than one part and unmasking would give each part's own sum."""
    left, out = set(members), []
    while left:
        start = min(left)
        seen, todo = {start}, [start]
        while todo:
            for v in graph.get(todo.pop(), ()):
                if v in left and v not in seen:
                    seen.add(v)
                    todo.append(v)
        left -= seen
        out.append(sorted(seen))
    return out


def threshold(configured: int, members: int, signed: bool = False) -> int:
    """Shares that rebuild a seed: the configured number, or by default more than half of a
    neighbourhood of `members` (the roster, where everyone is everyone's neighbour), more than two
    thirds with signed keys (where it is meant to hold against an aggregator that lies); never less than
    a majority (clients refuse less: `floor`), and at least 2."""
    default = 2 * members // 3 + 1 if signed else members // 2 + 1
    return max(2, configured or default, members // 2 + 1)


def floor(members: int, fraction: float) -> int:
    """The least threshold a client accepts in a neighbourhood of `members`: more than `fraction` of
    it (its organisation's setting, at least a majority), at least 2. With a threshold t, the
    aggregator learns a client's adapter only with 2t - members colluding neighbours or more."""
    return max(2, math.floor(max(fraction, 0.5) * members) + 1)


class Participant:
    """One client's secrets for one attempt: a key pair to seal shares, a seed for its pairwise-mask
    key pair and a self-mask seed. Never persisted; `wipe()` when the attempt is over."""

    def __init__(self, client_id: str, ctx: bytes):
        self.client_id = client_id
        self.ctx = ctx
        self._seal_seed = masking.Secret()
        self._mask_seed = masking.Secret()
        self._self_seed = masking.Secret()
        self.sealing = masking.KeyPair(self._seal_seed)
        self.masking = masking.KeyPair(self._mask_seed)
        self.self_commitment = commitment(ctx, "self", client_id, "", self._self_seed.reveal())

    def shares(self, roster: Sequence["Member"], t: int) -> list[tuple[str, bytes, bytes, bytes]]:
        """For every member given (the client's neighbourhood): (recipient, sealed shares, self-share
        commitment, masking-share commitment). The member of roster index i gets share i of each seed."""
        n = max(m.index for m in roster)
        self_shares = dict(masking.split(self._self_seed, t, n))
        mask_shares = dict(masking.split(self._mask_seed, t, n))
        out = []
        for m in roster:
            b, s = self_shares[m.index], mask_shares[m.index]
            key = self.sealing.agree(m.encryption_key, self.ctx, "seal")
            sealed = masking.encrypt(key, b + s, seal_associated(self.ctx, self.client_id, m.client_id))
            out.append((m.client_id, sealed, commitment(self.ctx, "self", self.client_id, m.client_id, b),
                        commitment(self.ctx, "masking", self.client_id, m.client_id, s)))
        return out

    def open(self, sender: Member, sealed: bytes) -> tuple[bytes, bytes]:
        """(self-mask share, masking share) that `sender` sealed for this client; SecureError if the seal
        does not open (a tampered or misdirected share)."""
        key = self.sealing.agree(sender.encryption_key, self.ctx, "seal")
        try:
            plain = masking.decrypt(key, sealed, seal_associated(self.ctx, sender.client_id, self.client_id))
        except Exception:  # cryptography's InvalidTag, or a sealed text too short
            raise SecureError(f"the share from {sender.client_id} does not open: it was not sealed for "
                              f"{self.client_id} in this attempt") from None
        if len(plain) != SHARE_PLAINTEXT:
            raise SecureError(f"the share from {sender.client_id} holds {len(plain)} bytes, not {SHARE_PLAINTEXT}")
        return plain[:masking.SEED_BYTES], plain[masking.SEED_BYTES:]

    def mask(self, vector: np.ndarray, peers: Iterable["Member"]) -> np.ndarray:
        """y = vector + PRG(b) +- PRG(s_uv) for every peer v (members of U2 but this client), in place."""
        terms = [(self_mask_key(self.ctx, self._self_seed.reveal()), +1)]
        terms += [(pair_key(self.masking, peer.masking_key, self.ctx), +1 if peer.client_id > self.client_id else -1)
                  for peer in peers if peer.client_id != self.client_id]
        add_streams(vector, terms)
        return vector

    def wipe(self) -> None:
        for s in (self._seal_seed, self._mask_seed, self._self_seed):
            s.wipe()


@dataclasses.dataclass(frozen=True)
class Member:
    """A roster member as every party sees it (RosterMember)."""

    client_id: str
    index: int
    encryption_key: bytes
    masking_key: bytes
    self_commitment: bytes
    certificate: bytes = b""  # DER, signed keys only
    signature: bytes = b""  # of its advertisement (signatures.advertisement)
    lora_rank: int = 0  # its advertised LoRA rank in a mixed-rank run (0: the run has one rank)


def self_mask_key(ctx: bytes, seed: bytes) -> bytes:
    return masking.derive(seed, ctx, "self mask")


def pair_key(pair: masking.KeyPair, peer_public: bytes, ctx: bytes) -> bytes:
    return pair.agree(peer_public, ctx, "pair mask")


def add_streams(vector: np.ndarray, terms: Sequence[tuple[bytes, int]]) -> None:
    """vector += sum(sign * PRG(key)) over `terms` in Z_2^64, in place: block by block, each block
    taking every mask while it sits in the CPU's cache."""
    streams = [(masking.MaskStream(key), sign) for key, sign in terms]
    for at in range(0, len(vector), BLOCK):
        _add_masks(vector[at:at + BLOCK], streams)


def _add_masks(part: np.ndarray, streams: Sequence[tuple[masking.MaskStream, int]]) -> None:
    for stream, sign in streams:
        mask = stream.next(len(part))
        if sign > 0:
            np.add(part, mask, out=part)
        else:
            np.subtract(part, mask, out=part)


# ---- the aggregator's side -------------------------------------------------------------------
def rebuild(shares: Sequence[tuple[int, bytes]], t: int) -> masking.Secret:
    """The seed that the first `t` shares rebuild."""
    if len(shares) < t:
        raise SecureError(f"{len(shares)} shares cannot rebuild a seed shared with threshold {t}")
    return masking.combine(list(shares[:t]))


def unmasked_sum(uploads: Sequence[BinaryIO], length: int, self_keys: Sequence[bytes],
                 pair_terms: Sequence[tuple[bytes, int]]) -> np.ndarray:
    """sum(uploads) - sum(PRG(self key)) - sum(sign * PRG(pair key)) in Z_2^64, a block at a time.
    `uploads`: the masked files, read from their start; `pair_terms`: (key, sign) of each pairwise
    mask left in the sum (an uploader's with a client that dropped, with the sign it was added with)."""
    total = np.zeros(length, dtype=np.uint64)
    streams = [(masking.MaskStream(k), -1) for k in self_keys] + \
              [(masking.MaskStream(k), -sign) for k, sign in pair_terms]
    for at in range(0, length, BLOCK):
        part = total[at:at + BLOCK]
        for fh in uploads:
            raw = fh.read(8 * len(part))
            if len(raw) != 8 * len(part):
                raise SecureError(f"a masked upload ended at element {at + len(raw) // 8} of {length}")
            np.add(part, np.frombuffer(raw, dtype="<u8"), out=part)
        _add_masks(part, streams)
    return total


def pack_u64(values: np.ndarray) -> np.ndarray:
    """The vector's little-endian bytes, as a view where the machine is little-endian (no copy): what
    a masked upload carries."""
    return values.astype("<u8", copy=False).view(np.uint8)

