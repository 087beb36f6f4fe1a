"""The client's part in secure aggregation (proto: FederationService's secure stages): for its saved
adapter, advertise fresh keys, deal sealed shares of its seeds to the roster, upload the masked
vector, sign the uploader list (signed keys), and reveal the shares the aggregator needs to unmask the
round's sum.

Each attempt of a round has its own keys, made here and held only in memory (a restarted client sits
out the attempt it was in); an attempt abandoned by the aggregator (fewer than the threshold took
part, or it restarted) is taken part in again from key advertisement, with the same adapter and the
same noise.

The aggregator may lie, so the client checks what it is told before it acts, and the organisation's
protection (`Protection`) is its own setting, never the aggregator's word:
- the threshold is at least its floor and at most its neighbourhood; the roster's keys are distinct and
  its own entry holds its own keys; with signed keys every member's certificate and signature verify;
- it masks only with at least the threshold of neighbours that shared, and the shares relayed to it
  open and match their commitments;
- before revealing anything: the uploaders are clients that shared, itself among them, at least the
  threshold of its neighbours, their masking graph is connected and, with signed keys, at least the
  threshold of its neighbours signed the very uploader list it was shown;
- it reveals shares in at most one attempt of a round, remembered across restarts (`ReleaseBook`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Callable

import grpc
import torch

from fedse import fixedpoint, secagg, signatures
from fedse.files import atomic_write
from fedse.secagg import Member, Participant, SecureError
from fedse.serving import log_fields
from fedse.signatures import SignatureError, Signer, Verifier
from fedse.v1 import federation_pb2 as fpb

from .federation import FederationClient, NotSelected, StaleRound, selected

log = logging.getLogger("client_agent.secure")

_ORDER = [fpb.SECURE_STAGE_ADVERTISING, fpb.SECURE_STAGE_SHARING, fpb.SECURE_STAGE_UPLOADING,
          fpb.SECURE_STAGE_CONSISTENCY, fpb.SECURE_STAGE_UNMASKING]


class AttemptOver(Exception):
    """The attempt this client was in ended without it (abandoned, or it is not in a stage's set)."""


@dataclasses.dataclass(frozen=True)
class Contribution:
    """What a client adds to a secure round: its adapter's values, the global adapter it trained from
    (to clip its update against; None when the run does not clip), its weight and the counts its
    upload header carries."""

    values: dict[str, torch.Tensor]
    previous: dict[str, torch.Tensor] | None
    weight: int
    num_examples: int
    num_successes: int


class ReleaseBook:
    """The rounds of a run in which this client revealed shares for an unmasked sum. It takes part in
    no other attempt of such a round: a second sum over other clients would give their difference.
    Kept in a file (None: in memory only) so that a restarted client remembers."""

    def __init__(self, path: pathlib.Path | None = None):
        self.path = path
        self._run, self._rounds = "", set()
        if path is not None and path.exists():
            saved = json.loads(path.read_text())
            self._run, self._rounds = saved.get("run_id", ""), set(saved.get("rounds", []))

    def has(self, run_id: str, round_: int) -> bool:
        return run_id == self._run and round_ in self._rounds

    def mark(self, run_id: str, round_: int) -> None:
        if run_id != self._run:
            self._run, self._rounds = run_id, set()
        self._rounds.add(round_)
        if self.path is not None:
            atomic_write(self.path, json.dumps({"run_id": run_id, "rounds": sorted(self._rounds)}).encode())


@dataclasses.dataclass(frozen=True)
class Protection:
    """What this organisation requires of a secure round, whatever the aggregator says: the least
    threshold it accepts (a share of its neighbourhood the threshold must exceed), and, with its mTLS
    files, signed keys: `signer` signs its own keys and the uploader list, `verifier` (the federation's
    CA) checks every other member's."""

    min_threshold: float = 0.5
    signer: Signer | None = None
    verifier: Verifier | None = None
    book: ReleaseBook = dataclasses.field(default_factory=ReleaseBook)

    @property
    def signed(self) -> bool:
        return self.verifier is not None

    @staticmethod
    def of(min_threshold: float, tls_ca: str, tls_cert: str, tls_key: str,
           book: ReleaseBook | None = None) -> "Protection":
        """From a client's settings: signed keys where it has its mTLS files (CA, certificate, key)."""
        book = book or ReleaseBook()
        if not (tls_ca and tls_cert and tls_key):
            return Protection(min_threshold, book=book)
        signer = Signer(pathlib.Path(tls_cert).read_bytes(), pathlib.Path(tls_key).read_bytes())
        return Protection(min_threshold, signer, Verifier(pathlib.Path(tls_ca).read_bytes()), book)


@dataclasses.dataclass
class _View:
    """What this client holds of an attempt once the roster is checked."""

    roster: dict[str, Member]
    threshold: int
    graph: dict[str, frozenset[str]]
    certificates: dict


class SecureRound:
    """Takes part in the secure stages of one round with one contribution (`take_part`)."""

    def __init__(self, fed: FederationClient, run_id: str, config: fpb.RunConfig, layout: secagg.Layout,
                 wait_s: float | None = None, protection: Protection | None = None):
        self.fed = fed
        self.run_id = run_id
        self.config = config
        self.layout = layout
        self.wait_s = wait_s
        self.protection = protection or Protection()
        self._noised: tuple[int, dict[str, torch.Tensor]] | None = None  # (threshold, values): drawn once

    def take_part(self, round_: int, c: Contribution, on_step: Callable[[str], None] = lambda step: None) -> bool:
        """True once the round closed with this client's masked upload in its sum; False when it closed
        without it (the client missed key advertisement, or the round moved on). Raises StaleRound when
        the round is over before this client could take part, SecureError (before any stage) when its
        adapter cannot be masked or the run cannot give the protection this client requires, and
        SecureError when the aggregator asks for what this client refuses (the reason names it)."""
        self.layout.check(c.values, c.weight)
        if self.protection.signed and not self.config.secure_signed:
            raise SecureError("this client has mTLS files and requires signed keys, but the run does not sign them "
                              "(RunConfig.secure_signed is false): the aggregator must run secure aggregation over "
                              "mTLS")
        if self.protection.book.has(self.run_id, round_):
            raise SecureError(f"this client already revealed shares for an unmasked sum of round {round_}: it takes "
                              "part in no other attempt of that round (a second sum would reveal the difference)")
        while True:
            st = self.fed.status()
            if st.state == fpb.ROUND_STATE_WAITING_FOR_CLIENTS:  # round 0 opens once enough clients joined
                self._wait(lambda s: s.state != fpb.ROUND_STATE_WAITING_FOR_CLIENTS)
                continue
            if st.round != round_ or st.state not in (fpb.ROUND_STATE_OPEN, fpb.ROUND_STATE_AGGREGATING):
                raise StaleRound(round_, st, "the round is over")
            if not selected(st, self.fed.client_id):
                raise NotSelected(round_, st, "the aggregator chose other clients for this round")
            if self.protection.book.has(self.run_id, round_):
                raise SecureError(f"the aggregator started another attempt of round {round_} after this client "
                                  "revealed shares for its sum: this client takes part in no other attempt of it")
            if st.state == fpb.ROUND_STATE_OPEN and st.secure_stage == fpb.SECURE_STAGE_ADVERTISING:
                try:
                    return self._attempt(round_, st.round_nonce, c, on_step)
                except AttemptOver as exc:
                    log.info("secure attempt over without us; waiting for the next", extra=log_fields(
                        round=round_, reason=str(exc)))
            else:
                log.info("key advertisement of this attempt is over; waiting for the next attempt or round",
                         extra=log_fields(round=round_, stage=fpb.SecureStage.Name(st.secure_stage)))
            self._wait(lambda s, n=st.round_nonce: s.round != round_ or s.round_nonce != n)

    # ---- one attempt ---------------------------------------------------------------------------
    def _attempt(self, round_: int, nonce: str, c: Contribution, on_step: Callable[[str], None]) -> bool:
        me = Participant(self.fed.client_id, secagg.context(self.run_id, nonce))
        signer = self.protection.signer
        try:
            certificate, signature = b"", b""
            if signer is not None:
                certificate = signer.der
                signature = signer.sign(signatures.advertisement(me.ctx, me.client_id, me.sealing.public,
                                                                 me.masking.public, me.self_commitment))
            self._call(lambda: self.fed.advertise_keys(round_, nonce, me.sealing.public, me.masking.public,
                                                       me.self_commitment, certificate, signature))
            on_step("advertised")
            view = self._roster(self._reached(round_, nonce, fpb.SECURE_STAGE_SHARING), me)
            roster, t, near = view.roster, view.threshold, view.graph[me.client_id]
            self._call(lambda: self.fed.share_keys(round_, nonce, [
                fpb.SealedShare(client_id=to, sealed=sealed, self_mask_commitment=b, masking_commitment=s)
                for to, sealed, b, s in me.shares([roster[v] for v in sorted(near)], t)]))
            on_step("shared")
            sr = self._reached(round_, nonce, fpb.SECURE_STAGE_UPLOADING)
            assert sr is not None
            shared = list(sr.shared)
            if me.client_id not in shared:
                raise AttemptOver("our shares arrived after the sharing stage closed")
            peers = [v for v in shared if v in near]  # the neighbours that shared: the masks' peers
            if len(peers) < t:
                raise SecureError(f"the aggregator says {len(peers)} of this client's neighbourhood shared keys "
                                  f"(itself included), fewer than the threshold of {t}: this client masks with no "
                                  "fewer and does not upload in this attempt")
            held = self._open(me, roster, sr, near)
            if set(held) != set(peers):
                raise SecureError(f"the aggregator relayed shares from {sorted(held)}, not from every neighbour that "
                                  f"shared ({peers}): this client will not take part in this attempt")
            self._upload(round_, nonce, me, c, [roster[v] for v in peers], t)
            on_step("uploaded")
            try:
                sr = self._before_reveal(round_, nonce, me, view, shared, held, on_step)
                if sr is not None:
                    revealed = self._reveal(sr, held)
                    self.protection.book.mark(self.run_id, round_)  # before a share leaves
                    self._call(lambda: self.fed.unmask(round_, nonce, revealed))
                    on_step("unmasked")
            except AttemptOver:
                pass  # the unmasking closed without our shares: the status below says how it ended
            st = self._wait(lambda s: s.round != round_ or s.round_nonce != nonce)
            if st.round == round_:
                raise AttemptOver("the aggregator abandoned the attempt after our upload")
            return True
        finally:
            me.wipe()

    def _open(self, me: Participant, roster: dict[str, Member], sr: fpb.SecureRound,
              near: frozenset[str]) -> dict[str, tuple[bytes, bytes]]:
        """The shares the neighbours that shared dealt to this client, opened and checked against the
        commitments they came with; SecureError naming a dealer whose shares do not match."""
        held = {}
        for s in sr.inbound:
            if s.client_id not in near:
                continue
            b, m = me.open(roster[s.client_id], s.sealed)
            if secagg.commitment(me.ctx, "self", s.client_id, me.client_id, b) != s.self_mask_commitment or \
                    secagg.commitment(me.ctx, "masking", s.client_id, me.client_id, m) != s.masking_commitment:
                raise SecureError(f"the shares {s.client_id} dealt to this client do not match their commitments: "
                                  f"{s.client_id} dealt dishonestly (or the aggregator altered them); this client "
                                  "will not take part in this attempt")
            held[s.client_id] = (b, m)
        return held

    def _upload(self, round_: int, nonce: str, me: Participant, c: Contribution, peers: list[Member], t: int) -> None:
        """Masks the contribution (clipped, and noised for a threshold of `t`: drawn at the round's first
        attempt and kept, so that every attempt masks the same values) for `peers` and uploads it."""
        values = c.values
        clip, std = self.config.clip_norm, secagg.noise_std(self.config.clip_norm, self.config.noise_multiplier, t)
        if clip > 0 or std > 0:
            if self._noised is None:
                assert c.previous is not None, "a run that clips needs the global adapter the client trained from"
                self._noised = (t, secagg.clip_and_noise(values, c.previous, clip, std))
            drawn_for, values = self._noised
            if std > 0 and t < drawn_for:
                raise AttemptOver(f"this attempt's threshold {t} is below the {drawn_for} this client's noise was "
                                  "drawn for: its noise would not cover the sum")
        vector = me.mask(self.layout.encode(values, c.weight), peers)
        data = secagg.pack_u64(vector)
        del vector
        self._call(lambda: self.fed.upload(round_, data, num_examples=c.num_examples, num_successes=c.num_successes,
                                           transport_dtype=secagg.MASKED_DTYPE, round_nonce=nonce,
                                           follow_nonce=False))

    def _before_reveal(self, round_: int, nonce: str, me: Participant, view: _View, shared: list[str],
                       held: dict[str, tuple[bytes, bytes]], on_step: Callable[[str], None]) -> fpb.SecureRound | None:
        """The attempt's view at UNMASKING once the uploader list is checked (and, with signed keys,
        signed by this client and by at least the threshold of its neighbours); None when the round
        closed meanwhile (the others' shares sufficed)."""
        if not self.protection.signed:
            sr = self._reached(round_, nonce, fpb.SECURE_STAGE_UNMASKING, closed_ok=True)
            if sr is not None:
                self._check_uploaders(me.client_id, sr, view, shared, held)
            return sr
        sr = self._reached(round_, nonce, fpb.SECURE_STAGE_CONSISTENCY, closed_ok=True)
        if sr is None:
            return None
        uploaded = sorted(sr.uploaded)
        self._check_uploaders(me.client_id, sr, view, shared, held)
        assert self.protection.signer is not None
        signature = self.protection.signer.sign(signatures.consistency(me.ctx, me.client_id, uploaded))
        self._call(lambda: self.fed.check_consistency(round_, nonce, signature))
        on_step("signed")
        sr = self._reached(round_, nonce, fpb.SECURE_STAGE_UNMASKING, closed_ok=True)
        if sr is None:
            return None
        if sorted(sr.uploaded) != uploaded:
            raise SecureError("the aggregator shows another uploader list at unmasking than the one this client "
                              "signed: this client reveals nothing")
        near = view.graph[me.client_id]
        assert self.protection.verifier is not None
        good = self.protection.verifier.signed_by_all(
            {c: cert for c, cert in view.certificates.items() if c in near and c in uploaded},
            [(s.client_id, s.signature) for s in sr.consistency],
            lambda cid: signatures.consistency(me.ctx, cid, uploaded))
        if len(set(good)) < view.threshold:
            raise SecureError(f"{len(set(good))} of this client's neighbours signed the uploader list it was shown, "
                              f"fewer than the threshold of {view.threshold}: the aggregator may show others another "
                              "list; this client reveals nothing")
        return sr

    def _check_uploaders(self, me: str, sr: fpb.SecureRound, view: _View, shared: list[str],
                         held: dict[str, tuple[bytes, bytes]]) -> None:
        """SecureError unless the uploaders are clients that shared, this client among them, at least the
        threshold of its neighbours (`held`: the shares of its neighbours that shared), and their masking
        graph is connected (else the unmasking would give each part's sum)."""
        uploaded = set(sr.uploaded)
        t = view.threshold
        if not uploaded <= set(shared) or len(uploaded & set(held)) < t or me not in uploaded:
            raise SecureError(f"the aggregator asks to unmask {len(uploaded)} uploads of clients that shared "
                              f"({len(shared)}), with a threshold of {t} among neighbours: this client reveals nothing")
        pieces = secagg.parts(uploaded, view.graph)
        if len(pieces) > 1:
            raise SecureError(f"the uploaders' masking graph is in {len(pieces)} pieces (sizes "
                              f"{', '.join(str(len(p)) for p in pieces)}): unmasking would give each piece's sum; "
                              "this client reveals nothing")

    @staticmethod
    def _reveal(sr: fpb.SecureRound, held: dict[str, tuple[bytes, bytes]]) -> list[fpb.RevealedShare]:
        """The shares the unmasking needs: of each neighbour that shared, its self-mask share if it
        uploaded, else its masking share; never both of one client."""
        uploaded = set(sr.uploaded)
        kinds = {True: (fpb.SHARE_KIND_SELF_MASK, 0), False: (fpb.SHARE_KIND_MASKING, 1)}
        return [fpb.RevealedShare(client_id=v, kind=kinds[v in uploaded][0], share=held[v][kinds[v in uploaded][1]])
                for v in sorted(held)]

    # ---- following the attempt -----------------------------------------------------------------
    def _roster(self, sr: fpb.SecureRound | None, me: Participant) -> _View:
        """The attempt's roster, graph and threshold, checked against this client's own protection."""
        assert sr is not None
        roster = {m.client_id: Member(m.client_id, m.index, m.encryption_key, m.masking_key, m.self_mask_commitment,
                                      m.certificate, m.signature) for m in sr.roster}
        mine = roster.get(me.client_id)
        if mine is None:
            raise AttemptOver("our keys arrived after key advertisement closed")
        refuse = "this client will not take part"
        if len(roster) != len(sr.roster) or len(roster) > fixedpoint.MAX_CLIENTS:
            raise SecureError(f"the roster names a client twice or holds more than {fixedpoint.MAX_CLIENTS}: {refuse}")
        if sorted(m.index for m in roster.values()) != list(range(1, len(roster) + 1)):
            raise SecureError(f"the roster's share indices are not 1..n: {refuse}")
        if (mine.encryption_key, mine.masking_key, mine.self_commitment) != \
                (me.sealing.public, me.masking.public, me.self_commitment):
            raise SecureError(f"the roster's entry for this client holds keys that are not its own: {refuse}")
        keys = [k for m in roster.values() for k in (m.encryption_key, m.masking_key)]
        if len(set(keys)) != len(keys):
            raise SecureError(f"two roster entries share a key: {refuse}")
        certificates = {}
        if self.protection.verifier is not None:
            for m in roster.values():  # its own too: its signature of the uploader list counts like the others'
                try:
                    cert = self.protection.verifier.certificate(m.certificate, m.client_id)
                    self.protection.verifier.signature(
                        cert, signatures.advertisement(me.ctx, m.client_id, m.encryption_key, m.masking_key,
                                                       m.self_commitment), m.signature,
                        f"{m.client_id}'s signature of its keys")
                except SignatureError as exc:
                    raise SecureError(f"{exc}: {refuse}") from None
                certificates[m.client_id] = cert
        graph = secagg.neighbours(sorted(roster), me.ctx, self.config.secure_neighbours,
                                  secagg.roster_digest(me.ctx, roster.values()))
        near = graph[me.client_id]
        least = secagg.floor(len(near), self.protection.min_threshold)
        if not least <= sr.threshold <= len(near):
            raise SecureError(f"the aggregator asks for a threshold of {sr.threshold} in a neighbourhood of "
                              f"{len(near)}: this client requires {least} to {len(near)} (--secure-min-threshold "
                              f"{self.protection.min_threshold:g}): {refuse}")
        return _View(roster, int(sr.threshold), graph, certificates)

    def _reached(self, round_: int, nonce: str, stage: int, closed_ok: bool = False) -> fpb.SecureRound | None:
        """The attempt's view once it reached `stage`; AttemptOver if the attempt ended first. With
        `closed_ok`, None when the round closed meanwhile (the others unmasked it)."""
        at = _ORDER.index(stage)
        st = self._wait(lambda s: s.round != round_ or s.round_nonce != nonce or s.state != fpb.ROUND_STATE_OPEN
                        or (s.secure_stage in _ORDER and _ORDER.index(s.secure_stage) >= at))
        if st.round == round_ and st.round_nonce == nonce and st.state == fpb.ROUND_STATE_OPEN:
            return self._call(lambda: self.fed.secure_round(round_, nonce))
        if closed_ok and st.round_nonce == nonce and st.round == round_:
            return None  # aggregating: the others' shares sufficed
        if closed_ok and st.round > round_:
            return None
        raise AttemptOver(f"the attempt ended before the {fpb.SecureStage.Name(stage)} stage")

    def _wait(self, done: Callable[[fpb.RoundStatus], bool]) -> fpb.RoundStatus:
        return self.fed.wait_until(lambda s: done(s) or s.state == fpb.ROUND_STATE_FINISHED, timeout_s=self.wait_s)

    @staticmethod
    def _call(call: Callable[[], object]):
        """A stage call; a refusal because the attempt moved on (FAILED_PRECONDITION) ends the attempt."""
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise AttemptOver(exc.details() or "refused") from None
            raise
