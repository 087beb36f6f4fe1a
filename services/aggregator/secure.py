"""The secure-aggregation desk: the stages of an attempt of the open round (proto: FederationService's
secure stages), what each client sent in them, and when each stage closes.

An attempt lives only in memory: keys, sealed shares and revealed shares are never written to disk,
so an aggregator that restarts starts a new attempt of the open round (the round keeper does that,
and drops the masked uploads of the attempt it lost). The desk works under the round keeper's lock
and calls `changed()`, with that lock held, when what a round status shows has changed.

With signed keys (RunConfig.secure_signed) the desk checks each advertisement's certificate and
signature and runs the consistency stage, where each uploader signs the uploader list it was shown.
Whatever the mode it abandons an attempt whose uploaders' masking graph is in pieces, since the
unmasking would then give each piece's sum.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, Sequence

from fedse.privacy import masking

from fedse.model import ranks
from fedse.privacy import secagg
from fedse.security.tls_files import read_pem
from fedse.security import signatures
from fedse.transport.inputs import shown
from fedse.privacy.secagg import Member
from fedse.transport.serving import log_fields
from fedse.security.signatures import SignatureError, Verifier

from . import metrics
from .attempt import Attempt, Dealt, Kind, Stage, View
from .closing import OpenRound, Rule, close_reason
from .errors import DuplicateUpload, StaleRound

log = logging.getLogger("aggregator.secure")

SEALED_BYTES = masking.NONCE_BYTES + secagg.SHARE_PLAINTEXT + 16  # nonce, both shares, Poly1305 tag
DIGEST_BYTES = 32
# What a signed advertisement may carry: an mTLS certificate in DER, and a signature of the advertisement.
MAX_CERTIFICATE_BYTES = 16 * 1024
MAX_SIGNATURE_BYTES = 1024


class NotInRoster(StaleRound):
    """A stage call from a client that is not in the stage's set: it sits out this attempt."""


class SecureDesk:
    def __init__(self, run_id: str, configured_threshold: int, stage_timeout_s: float, rule: Rule,
                 changed: Callable[[], None], degree: int = 0, ca_file: str = "", max_roster: int = 1024,
                 joined_rank: Callable[[str], int] | None = None):
        """`degree`: each member's neighbours besides itself (0: everyone; secagg.neighbours);
        `ca_file`: the federation CA's PEM file, to check signed keys ("": keys are not signed), read
        again at every attempt so that a renewed CA is taken; `max_roster`: the most members of a roster;
        `joined_rank`: in a mixed-rank run, the LoRA rank a client joined with (None: one rank)."""
        self.run_id = run_id
        self.joined_rank = joined_rank
        self.degree = degree
        self.ca_file = ca_file
        self.verifier: Verifier | None = None
        self.max_roster = max_roster
        self.configured_threshold = configured_threshold
        self.stage_timeout_s = stage_timeout_s
        self.rule = rule
        self._changed = changed
        self.attempt: Attempt | None = None

    # ---- the attempt -------------------------------------------------------------------------
    def begin(self, round_: int, nonce: str, now: float) -> None:
        """A new attempt of round `round_` (its round nonce new), at key advertisement."""
        if self.attempt is not None:
            self._forget(self.attempt)
        if self.ca_file:
            self.verifier = Verifier(read_pem("--tls-ca", self.ca_file))
        self.attempt = Attempt(nonce, secagg.context(self.run_id, round_, nonce), stage_opened=now)
        self._changed()

    def end(self) -> None:
        """The round closed or the run finished: nothing of the attempt is kept."""
        if self.attempt is not None:
            self._forget(self.attempt)
        self.attempt = None

    def stage(self) -> Stage | None:
        return self.attempt.stage if self.attempt is not None else None

    def step_of(self, client_id: str) -> str:
        """How far the client has got in the attempt (ClientStatus.secure_step)."""
        a = self.attempt
        if a is None:
            return ""
        for step, done in (("unmasked", client_id in a.revealed), ("signed", client_id in a.signed),
                           ("uploaded", client_id in a.uploaded),
                           ("shared", client_id in a.dealt), ("advertised", client_id in a.adverts)):
            if done:
                return step
        return ""

    # ---- the stage calls ---------------------------------------------------------------------
    @property
    def signed(self) -> bool:
        return bool(self.ca_file)

    def advertise(self, client_id: str, encryption_key: bytes, masking_key: bytes, self_commitment: bytes,
                  now: float, certificate: bytes = b"", signature: bytes = b"", lora_rank: int = 0) -> None:
        a = self._at(Stage.ADVERTISING)
        joined = self.joined_rank(client_id) if self.joined_rank is not None else 0
        if lora_rank != joined:
            raise ValueError(f"lora_rank {lora_rank}: advertise the LoRA rank this client joined with ({joined})"
                             if joined else f"lora_rank {lora_rank}: this run has one LoRA rank; send 0")
        for name, value, size in (("encryption_key", encryption_key, masking.KEY_BYTES),
                                  ("masking_key", masking_key, masking.KEY_BYTES),
                                  ("self_mask_commitment", self_commitment, DIGEST_BYTES)):
            if len(value) != size:
                raise ValueError(f"{name} is {len(value)} bytes: send {size} (a fresh X25519 public key, or the "
                                 "SHA-256 commitment)")
        if encryption_key == masking_key:
            raise ValueError("encryption_key and masking_key are the same key: make two key pairs")
        if not self.signed:  # nobody checks them: kept, they would only swell every member's roster
            certificate = signature = b""
        if len(certificate) > MAX_CERTIFICATE_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
            raise ValueError(f"the certificate is {len(certificate)} bytes and the signature {len(signature)}: send "
                             f"at most {MAX_CERTIFICATE_BYTES} and {MAX_SIGNATURE_BYTES} (your mTLS certificate in "
                             "DER, and the signature of the advertisement)")
        member = Member(client_id, 0, encryption_key, masking_key, self_commitment, certificate, signature, lora_rank)
        if self.signed:
            assert self.verifier is not None
            try:
                cert = self.verifier.member(certificate, client_id)
                signed = signatures.advertisement(a.context, client_id, encryption_key, masking_key, self_commitment,
                                                  lora_rank)
                self.verifier.signature(cert, signed, signature, f"{client_id}'s signature of its keys")
            except SignatureError as exc:
                raise ValueError(f"{exc}: this run signs keys (RunConfig.secure_signed); sign the advertisement "
                                 "with the key of your mTLS certificate and send that certificate") from None
            a.certificates.setdefault(client_id, cert)
        held = a.adverts.get(client_id)
        if held is None:
            for other, (m, _) in a.adverts.items():
                if {m.encryption_key, m.masking_key} & {encryption_key, masking_key}:
                    raise ValueError(f"these keys are {other}'s: every client advertises its own fresh keys")
        self._record(a.adverts, client_id, (member, held[1] if held else now), "advertised other keys",
                     same=lambda old: old[0] == member)

    def share(self, client_id: str, shares: Sequence[tuple[str, bytes, bytes, bytes]]) -> None:
        """A roster member's shares: (recipient, sealed, self commitment, masking commitment) for every
        member of its neighbourhood (secagg.neighbours), itself included."""
        a = self._at(Stage.SHARING)
        self._in(a.roster, client_id, "the roster (it did not advertise keys in time)")
        near = a.neighbours[client_id]
        dealt: dict[str, Dealt] = {}
        for recipient, sealed, b_commit, s_commit in shares:
            if recipient not in near:
                where = "not among its neighbours" if recipient in a.roster else "not in this attempt's roster"
                raise ValueError(f"a share is addressed to {shown(recipient)}, who is {where}: send one share to "
                                 "each member of your neighbourhood (secagg.neighbours of GetSecureRound.roster)")
            if recipient in dealt:
                raise ValueError(f"two shares are addressed to {recipient}: send one to each neighbour")
            if len(sealed) != SEALED_BYTES or len(b_commit) != DIGEST_BYTES or len(s_commit) != DIGEST_BYTES:
                raise ValueError(f"the share for {recipient} is malformed: a sealed share is {SEALED_BYTES} bytes "
                                 f"and each commitment {DIGEST_BYTES}")
            dealt[recipient] = Dealt(sealed, b_commit, s_commit)
        if near - set(dealt):
            raise ValueError(f"no share for {_few(near - set(dealt))}: send one share to each member of your "
                             "neighbourhood, this client included")
        self._record(a.dealt, client_id, dealt, "shared other shares")

    def view(self, client_id: str) -> View:
        """What the client may read of the attempt so far."""
        a = self._current()
        at = a.stage.order  # each set is shown once the stage that makes it is over
        roster = tuple(sorted(a.roster.values(), key=lambda m: m.index)) if at > Stage.ADVERTISING.order else ()
        shared = a.shared if at > Stage.SHARING.order else ()
        inbound = tuple((sender, a.dealt[sender][client_id]) for sender in shared if client_id in a.dealt[sender])
        consistency = tuple((c, a.signed[c]) for c in a.consistent) if at > Stage.CONSISTENCY.order else ()
        return View(a.stage, a.threshold, roster, shared, inbound, a.uploaded if at > Stage.UPLOADING.order else (),
                    consistency)

    def check_upload(self, client_id: str) -> None:
        """Raises unless the client may upload its masked vector now."""
        a = self._at(Stage.UPLOADING)
        self._in(a.shared, client_id, "those who shared keys")

    def check_consistency(self, client_id: str, signature: bytes) -> None:
        """An uploader's signature over the uploader list (signed keys only)."""
        a = self._at(Stage.CONSISTENCY)
        self._in(a.uploaded, client_id, "the uploaders")
        assert self.verifier is not None, "the consistency stage runs with signed keys only"
        try:
            signed = signatures.consistency(a.context, client_id, a.threshold, self.degree, a.digest, a.uploaded)
            self.verifier.signature(a.certificates[client_id], signed, signature,
                                    f"{client_id}'s signature of the uploader list")
        except SignatureError as exc:
            raise ValueError(f"{exc}: sign the uploader list GetSecureRound.uploaded shows") from None
        self._record(a.signed, client_id, signature, "signed another uploader list")

    def unmask(self, client_id: str, revealed: Sequence[tuple[str, Kind, bytes]]) -> None:
        """An uploader's revealed shares: of the self mask of every uploader and of the pairwise masks of
        every member that shared and did not upload, never both of one client."""
        a = self._at(Stage.UNMASKING)
        if self.signed:
            self._in(a.consistent, client_id, "the uploaders that signed the uploader list")
        else:
            self._in(a.uploaded, client_id, "the uploaders")
        want = a.wanted(client_id)
        got: dict[tuple[str, Kind], bytes] = {}
        for owner, kind, share in revealed:
            key = (owner, kind)
            if key not in want:
                other = Kind.MASKING if kind is Kind.SELF_MASK else Kind.SELF_MASK
                why = (f"{shown(owner)} is not in this attempt" if owner not in a.roster else
                       f"{owner}'s {kind.value} share is not asked for (its {other.value} share is)"
                       if (owner, other) in want else
                       f"{owner} is not {client_id}'s neighbour" if owner not in a.neighbours[client_id] else
                       f"{owner} did not share keys")
                raise ValueError(f"a revealed share cannot be used: {why}; reveal the self-mask shares of the "
                                 "uploaders and the masking shares of those who shared and did not upload")
            if key in got:
                raise ValueError(f"{owner}'s {kind.value} share is revealed twice")
            dealt = a.dealt[owner][client_id]
            committed = dealt.self_commitment if kind is Kind.SELF_MASK else dealt.masking_commitment
            if len(share) != masking.SEED_BYTES or \
                    secagg.commitment(a.context, kind.value, owner, client_id, share) != committed:
                raise ValueError(f"the {kind.value} share of {owner} that {client_id} reveals is not the one {owner} "
                                 f"dealt to {client_id}: reveal the shares GetSecureRound.inbound sealed for you")
            got[key] = share
        if set(got) != want:
            raise ValueError(f"shares missing: {_few(f'{o} ({k.value})' for o, k in want - set(got))}")
        self._record(a.revealed, client_id, got, "revealed other shares")

    # ---- closing stages ----------------------------------------------------------------------
    def due(self, last_seen: Mapping[str, float], accepted: Mapping[str, float], busy: bool, deadline: float,
            now: float) -> str | None:
        """Why the attempt's stage closes now, or None while it stays open. `last_seen`: every joined
        client; `accepted`: the masked uploads accepted (UPLOADING); `busy`: an upload is making progress."""
        a = self.attempt
        if a is None:
            return None
        if a.stage is Stage.ADVERTISING:
            if len(a.adverts) >= self.max_roster:
                return "the roster is full"
            return close_reason(self.rule, OpenRound(last_seen, {c: t for c, (_, t) in a.adverts.items()}, False,
                                                     0.0, deadline), now)
        members, acted = {
            Stage.SHARING: (set(a.roster), set(a.dealt)),
            Stage.UPLOADING: (set(a.shared), set(accepted)),
            Stage.CONSISTENCY: (set(a.uploaded), set(a.signed)),
            Stage.UNMASKING: (set(a.consistent if self.signed else a.uploaded), set(a.revealed)),
        }[a.stage]
        if a.stage is Stage.UNMASKING and not a.short(a.revealed):
            return "threshold unmasked"
        if acted >= members:
            return "all answered"
        if busy:
            return None
        if not any(self.rule.alive(last_seen.get(c, 0.0), now) for c in members - acted):
            return "the others are not alive"
        if now >= a.stage_opened + self.stage_timeout_s:
            return "stage timeout"
        return None

    def advance(self, accepted: Sequence[str], now: float) -> str | None:
        """Closes the stage that is due. Returns why the attempt must be abandoned (fewer than the
        threshold took part), else None; after UNMASKING closes the caller unmasks (`unmasking`)."""
        a = self.attempt
        assert a is not None
        metrics.SECURE_STAGE_SECONDS.labels(a.stage.value).observe(max(0.0, now - a.stage_opened))
        if a.stage is Stage.ADVERTISING:  # the first max_roster to advertise make the roster
            first = sorted(a.adverts, key=lambda c: (a.adverts[c][1], c))[:self.max_roster]
            ids = sorted(first)
            a.roster = {cid: dataclasses.replace(a.adverts[cid][0], index=i + 1) for i, cid in enumerate(ids)}
            a.digest = secagg.roster_digest(a.context, a.roster.values())
            a.neighbours = secagg.neighbours(ids, a.context, self.degree, a.digest)
            a.threshold = secagg.threshold(self.configured_threshold, len(a.neighbours[ids[0]]) if ids else 0,
                                           self.signed)
            took = ids
        elif a.stage is Stage.SHARING:
            a.shared = tuple(sorted(a.dealt))
            took = list(a.shared)
        elif a.stage is Stage.UPLOADING:
            a.uploaded = tuple(sorted(c for c in accepted if c in a.shared))
            took = list(a.uploaded)
            pieces = secagg.parts(a.uploaded, a.neighbours)
            if len(pieces) > 1:
                metrics.SECURE_ATTEMPTS_ABORTED.labels(a.stage.value).inc()
                return (f"the uploaders' masking graph is in {len(pieces)} pieces (sizes "
                        f"{', '.join(str(len(p)) for p in pieces)}): unmasking would give each piece's sum")
            thin = self._thinly_held(a)
            if thin:
                metrics.SECURE_ATTEMPTS_ABORTED.labels(a.stage.value).inc()
                return (f"LoRA component {thin} is held by fewer than the threshold of {a.threshold} uploads: "
                        "unmasking would give their few values")
        elif a.stage is Stage.CONSISTENCY:
            a.consistent = tuple(sorted(a.signed))
            took = list(a.consistent)
        else:
            took = sorted(a.revealed)
        short = a.short(took) if a.stage in (Stage.UPLOADING, Stage.CONSISTENCY, Stage.UNMASKING) else []
        if len(took) < max(a.threshold, 2) or short:
            metrics.SECURE_ATTEMPTS_ABORTED.labels(a.stage.value).inc()
            if short:
                return (f"fewer than the threshold of {a.threshold} of the neighbours of {_few(short)} took "
                        f"part in {a.stage.value}: their masks cannot be rebuilt")
            return (f"{len(took)} clients took part in {a.stage.value}, fewer than the threshold of "
                    f"{max(a.threshold, 2)}")
        if a.stage is not Stage.UNMASKING:
            a.stage = a.stage.next(self.signed)
            a.stage_opened = now
            log.info("secure stage opened", extra=log_fields(stage=a.stage.value, members=len(took),
                                                             threshold=a.threshold))
            self._changed()
        return None

    def unmasking(self) -> Attempt:
        """The attempt as the unmasking needs it, taken under the lock: a copy of its revealed shares
        (holder -> (owner, kind) -> share), which a new attempt clears in the original."""
        a = self.attempt
        assert a is not None and a.stage is Stage.UNMASKING
        return dataclasses.replace(a, revealed={h: dict(s) for h, s in a.revealed.items()}, dealt={})

    # ---- internals -----------------------------------------------------------------------
    def _thinly_held(self, a: Attempt) -> int:
        """In a mixed-rank run, the highest LoRA component that some but fewer than the threshold of the
        uploads hold (each sent min(its rank, r*), r* from the members that shared: fedse.model.ranks); 0 if none."""
        if self.joined_rank is None:
            return 0
        r_star = ranks.held_rank([a.roster[c].lora_rank for c in a.shared], a.threshold)
        return ranks.thinly_held([min(a.roster[c].lora_rank, r_star) for c in a.uploaded], a.threshold)

    def _record(self, book: dict, client_id: str, value: object, other: str,
                same: Callable[[object], bool] | None = None) -> None:
        """Keeps a client's message of a stage: once; the same message again is acknowledged (a retry),
        a different one refused (ALREADY_EXISTS)."""
        if client_id in book:
            if not (same(book[client_id]) if same else book[client_id] == value):
                raise DuplicateUpload(f"client {client_id} {other} in this attempt already: a client's message of "
                                      "a stage is fixed once sent")
            return
        book[client_id] = value
        self._changed()

    def _current(self) -> Attempt:
        if self.attempt is None:
            raise StaleRound("no secure round is open: wait for the round status to show an open round")
        return self.attempt

    def _at(self, stage: Stage) -> Attempt:
        a = self._current()
        if a.stage is not stage:
            later = a.stage.order > stage.order
            raise StaleRound(f"the {stage.value} stage of this attempt is {'over' if later else 'not open yet'} (the "
                             f"attempt is {a.stage.value}): follow RoundStatus.secure_stage")
        return a

    @staticmethod
    def _in(members: Mapping[str, object] | Sequence[str], client_id: str, what: str) -> None:
        if client_id not in members:
            raise NotInRoster(f"client {shown(client_id)} is not among {what} in this attempt: it sits this attempt "
                              "out and takes part in the next attempt or round")

    @staticmethod
    def _forget(a: Attempt) -> None:
        a.dealt.clear()
        a.revealed.clear()
        a.signed.clear()
        a.certificates.clear()


def _few(names) -> str:
    """Up to five names, sorted, and '...' for the rest."""
    names = sorted(names)
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
