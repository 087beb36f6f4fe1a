"""One attempt of a secure round as the aggregator holds it (services.aggregator.secure runs its
stages): what each member sent, stage by stage, and the mask keys rebuilt from the revealed shares
once the unmasking closed. Nothing here is ever written to disk."""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping, Sequence

from fedse.privacy import masking

from fedse.privacy import secagg
from fedse.privacy.secagg import Member, SecureError


class Stage(enum.Enum):
    ADVERTISING = "advertising"
    SHARING = "sharing"
    UPLOADING = "uploading"
    CONSISTENCY = "consistency"  # signed keys only
    UNMASKING = "unmasking"

    @property
    def order(self) -> int:
        return list(Stage).index(self)

    def next(self, signed: bool) -> "Stage":
        after = list(Stage)[self.order + 1]
        return Stage.UNMASKING if after is Stage.CONSISTENCY and not signed else after


class Kind(enum.Enum):
    SELF_MASK = "self"
    MASKING = "masking"


@dataclasses.dataclass(frozen=True)
class Dealt:
    """One share message a member dealt to another: the seal (relayed) and the commitments (kept)."""

    sealed: bytes
    self_commitment: bytes
    masking_commitment: bytes


@dataclasses.dataclass
class Attempt:
    """One attempt of the open round, as far as it has got. Sets grow stage by stage: advertised
    (U1 = the roster), dealt (U2 = who shared), uploaded (U3), signed (U4, signed keys only: who
    signed the uploader list), revealed (who unmasked)."""

    nonce: str
    context: bytes
    stage: Stage = Stage.ADVERTISING
    stage_opened: float = 0.0
    threshold: int = 0
    digest: bytes = b""  # secagg.roster_digest of the roster, once ADVERTISING closed
    adverts: dict[str, tuple[Member, float]] = dataclasses.field(default_factory=dict)
    roster: dict[str, Member] = dataclasses.field(default_factory=dict)
    neighbours: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)
    dealt: dict[str, dict[str, Dealt]] = dataclasses.field(default_factory=dict)
    shared: tuple[str, ...] = ()
    uploaded: tuple[str, ...] = ()
    signed: dict[str, bytes] = dataclasses.field(default_factory=dict)
    consistent: tuple[str, ...] = ()
    revealed: dict[str, dict[tuple[str, Kind], bytes]] = dataclasses.field(default_factory=dict)
    certificates: dict = dataclasses.field(default_factory=dict)  # client id -> its checked certificate

    def dropped(self) -> list[str]:
        """Members that shared but did not upload: their pairwise masks are rebuilt."""
        return [c for c in self.shared if c not in self.uploaded]

    def wanted(self, holder: str) -> set[tuple[str, Kind]]:
        """The shares `holder` reveals: of its neighbours, the self-mask seeds of those that uploaded
        and the masking seeds of those that shared and did not."""
        near = self.neighbours[holder]
        return {(c, Kind.SELF_MASK) for c in self.uploaded if c in near} | \
            {(c, Kind.MASKING) for c in self.dropped() if c in near}

    def short(self, holders: Sequence[str] | Mapping[str, object]) -> list[str]:
        """The members whose seed the unmasking needs and fewer than the threshold of `holders` (their
        neighbours among them) could reveal."""
        return [c for c in self.shared if sum(h in self.neighbours[c] for h in holders) < self.threshold]


@dataclasses.dataclass(frozen=True)
class View:
    """What GetSecureRound answers a client."""

    stage: Stage
    threshold: int
    roster: tuple[Member, ...]
    shared: tuple[str, ...]
    inbound: tuple[tuple[str, Dealt], ...]
    uploaded: tuple[str, ...]
    consistency: tuple[tuple[str, bytes], ...] = ()


# ---- unmasking (outside the lock) ---------------------------------------------------------------
def mask_keys(u: Attempt) -> tuple[list[bytes], list[tuple[bytes, int]]]:
    """The keys of every mask left in the uploads' sum, rebuilt from the revealed shares: each
    uploader's self mask, and the pairwise masks of uploaders with clients that dropped. SecureError
    where a rebuilt seed is not the one its owner committed to. Nothing is unmasked yet: an attempt
    that fails here may be followed by another."""
    holders = sorted(u.revealed, key=lambda h: u.roster[h].index)

    def seed_of(owner: str, kind: Kind) -> masking.Secret:
        shares = [(u.roster[h].index, u.revealed[h][(owner, kind)]) for h in holders if (owner, kind) in u.revealed[h]]
        return secagg.rebuild(shares, u.threshold)

    self_keys, pair_terms = [], []
    for owner in u.uploaded:
        seed = seed_of(owner, Kind.SELF_MASK)
        try:
            if secagg.commitment(u.context, "self", owner, "", seed.reveal()) != u.roster[owner].self_commitment:
                raise SecureError(f"the self-mask seed rebuilt for {owner} is not the one it committed to")
            self_keys.append(secagg.self_mask_key(u.context, seed.reveal()))
        finally:
            seed.wipe()
    for gone in u.dropped():
        seed = seed_of(gone, Kind.MASKING)
        try:
            pair = masking.KeyPair(seed)
        finally:
            seed.wipe()
        if pair.public != u.roster[gone].masking_key:
            raise SecureError(f"the masking key rebuilt for {gone} is not the one it advertised")
        for owner in (c for c in u.uploaded if c in u.neighbours[gone]):  # +PRG(s) for a peer above, - below
            pair_terms.append((secagg.pair_key(pair, u.roster[owner].masking_key, u.context),
                               +1 if gone > owner else -1))
    return self_keys, pair_terms
