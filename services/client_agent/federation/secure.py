"""The client's part in secure aggregation (proto: FederationService's secure stages): for its saved
adapter, advertise fresh keys, deal sealed shares of its seeds to the roster, upload the masked
vector, sign the uploader list (signed keys), and reveal the shares the aggregator needs to unmask the
round's sum.

Each attempt of a round has its own keys, made here and held only in memory (a restarted client sits
out the attempt it was in); an attempt abandoned by the aggregator (fewer than the threshold took
part, or it restarted) is taken part in again from key advertisement, with the same adapter and the
same noise, drawn once per round and release and the same after a restart (releases.ReleaseBook).

The aggregator may lie, so the client checks what it is told before it acts, and the organisation's
protection (`Protection`) is its own setting, never the aggregator's word:
- the threshold is at least its floor and at most its neighbourhood; the roster's keys are distinct and
  its own entry holds its own keys; with signed keys every member's certificate and signature verify;
- it masks only with at least the threshold of neighbours that shared, and the shares relayed to it
  open and match their commitments;
- before revealing anything: the uploaders are clients that shared, itself among them, at least the
  threshold of its neighbours, their masking graph is connected, in a mixed-rank run at least the
  threshold of them hold every LoRA component it sent (it zeroes, before masking, those fewer would
  hold: fedse.model.ranks.held_rank) and, with signed keys, at least the threshold of its neighbours signed
  the very uploader list it was shown;
- once an attempt it uploaded in reaches unmasking, or the round closes with its upload, it takes part
  in no other attempt of that round, under every run id it was ever told, remembered across restarts
  (`ReleaseBook`).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Callable

import grpc
import torch

from fedse.model import ranks

from fedse.transport import reach

from fedse.privacy import secagg

from fedse.security import signatures
from fedse.privacy.secagg import Member, Participant, SecureError
from fedse.transport.inputs import shown
from fedse.transport.serving import log_fields
from fedse.security.signatures import Signer, Verifier
from fedse.v1 import federation_pb2 as fpb

from services.client_agent.federation.link import FederationClient, NotSelected, StaleRound, selected
from services.client_agent.federation.releases import ReleaseBook
from services.client_agent.federation.secure_checks import NotInRoster, SeenAttempts, View, check_roster, load_members

log = logging.getLogger("client_agent.secure")

_ORDER = [fpb.SECURE_STAGE_ADVERTISING, fpb.SECURE_STAGE_SHARING, fpb.SECURE_STAGE_UPLOADING,
          fpb.SECURE_STAGE_CONSISTENCY, fpb.SECURE_STAGE_UNMASKING]


class AttemptOver(Exception):
    """The attempt this client was in ended without it (abandoned, or it is not in a stage's set)."""


@dataclasses.dataclass(frozen=True)
class Contribution:
    """What a client adds to a secure round: its adapter's values, the global adapter it trained from
    (to clip its update against; None when the run does not clip), and its weight (weighted: its
    successes; it travels masked, never in the upload's header, which counts 0); `rank`: in a
    mixed-rank run, its own LoRA rank, the components of the run's rank-R adapter it holds (0: it
    holds every value), which are all its clip counts and which it advertises (ranks.held_rank)."""

    values: dict[str, torch.Tensor]
    previous: dict[str, torch.Tensor] | None
    weight: int
    rank: int = 0


@dataclasses.dataclass(frozen=True)
class Protection:
    """What this organisation requires of a secure round, whatever the aggregator says: the least
    threshold it accepts (a share of its neighbourhood the threshold must exceed); with its mTLS files,
    signed keys: `signer` signs its own keys and the uploader list, `verifier` (the federation's CA)
    checks every other member's, none of which may name the aggregator (`aggregator_names`); the
    federation's member list where it has one (`members`, empty: none); the fewest colluding
    neighbours an attempt must withstand (`min_colluders`) and the dropout rate its least ring is
    sized for (secure_checks). `book` and `attempts` are what it remembers across restarts."""

    min_threshold: float = 0.5
    signer: Signer | None = None
    verifier: Verifier | None = None
    book: ReleaseBook = dataclasses.field(default_factory=ReleaseBook)
    members: frozenset[str] = frozenset()
    aggregator_names: frozenset[str] = frozenset()
    min_colluders: int = 1
    dropout_rate: float = 0.05
    attempts: SeenAttempts = dataclasses.field(default_factory=SeenAttempts)

    @property
    def signed(self) -> bool:
        return self.verifier is not None

    @staticmethod
    def of(min_threshold: float, tls_ca: str, tls_cert: str, tls_key: str,
           book: ReleaseBook | None = None, **more) -> "Protection":
        """From a client's settings: signed keys where it has its mTLS files (CA, certificate, key);
        `more`: the other fields."""
        book = book or ReleaseBook()
        if not (tls_ca and tls_cert and tls_key):
            return Protection(min_threshold, book=book, **more)
        signer = Signer(pathlib.Path(tls_cert).read_bytes(), pathlib.Path(tls_key).read_bytes())
        return Protection(min_threshold, signer, Verifier(pathlib.Path(tls_ca).read_bytes()), book, **more)


_AGGREGATOR_NAMES: dict[str, frozenset[str]] = {}


def client_protection(cfg, state_dir: pathlib.Path) -> Protection:
    """A client agent's protection from its settings (services.client_agent.config.ClientConfig), with
    its books in `state_dir`. The aggregator's names are read from its certificate once per process."""
    names = _AGGREGATOR_NAMES.get(cfg.aggregator)
    if names is None:
        names = _AGGREGATOR_NAMES[cfg.aggregator] = reach.server_names(cfg.aggregator, cfg)
    members = load_members(cfg.secure_members, cfg.tls_ca) if cfg.secure_members else frozenset()
    return Protection.of(cfg.secure_min_threshold, cfg.tls_ca, cfg.tls_cert, cfg.tls_key,
                         ReleaseBook(state_dir / "secure_released.json"), members=members, aggregator_names=names,
                         min_colluders=cfg.secure_tolerate_colluders, dropout_rate=cfg.secure_dropout_rate,
                         attempts=SeenAttempts(state_dir / "secure_attempts.txt"))


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
        self._noised: tuple[bytes, int, dict[str, torch.Tensor]] | None = None  # (release, threshold, values)

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
            seen = self.protection.attempts.step(st.round_nonce)
            advertising = st.state == fpb.ROUND_STATE_OPEN and st.secure_stage == fpb.SECURE_STAGE_ADVERTISING
            if advertising and seen not in (None, "advertised"):
                raise SecureError(f"the aggregator shows round nonce {shown(st.round_nonce)} at key advertisement again, "
                                  f"that of an attempt this client already {seen} in (a reused round nonce): it could "
                                  "show this client's earlier messages as this attempt's; this client takes part in no "
                                  "attempt under it")
            if advertising and seen is None:
                try:
                    return self._attempt(round_, st.round_nonce, c, on_step)
                except AttemptOver as exc:
                    log.info("secure attempt over without us; waiting for the next", extra=log_fields(
                        round=round_, reason=str(exc)))
            elif advertising:
                log.info("this client advertised keys in this attempt before it restarted; waiting for the next",
                         extra=log_fields(round=round_))
            else:
                log.info("key advertisement of this attempt is over; waiting for the next attempt or round",
                         extra=log_fields(round=round_, stage=fpb.SecureStage.Name(st.secure_stage)))
            self._wait(lambda s, n=st.round_nonce: s.round != round_ or s.round_nonce != n)

    # ---- one attempt ---------------------------------------------------------------------------
    def _attempt(self, round_: int, nonce: str, c: Contribution, on_step: Callable[[str], None]) -> bool:
        me = Participant(self.fed.client_id, secagg.context(self.run_id, round_, nonce))
        signer = self.protection.signer
        attempts = self.protection.attempts
        try:
            certificate, signature = b"", b""
            if signer is not None:
                certificate = signer.der
                signature = signer.sign(signatures.advertisement(me.ctx, me.client_id, me.sealing.public,
                                                                 me.masking.public, me.self_commitment, c.rank))
            attempts.mark(nonce, "advertised")  # before the keys leave: never twice under one nonce
            self._call(lambda: self.fed.advertise_keys(round_, nonce, me.sealing.public, me.masking.public,
                                                       me.self_commitment, certificate, signature, c.rank))
            on_step("advertised")
            view = self._roster(self._reached(round_, nonce, fpb.SECURE_STAGE_SHARING), me)
            self._check_ranks(view, me.client_id, c.rank)
            roster, t, near = view.roster, view.threshold, view.graph[me.client_id]
            attempts.mark(nonce, "shared")
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
            attempts.mark(nonce, "uploaded")
            self._upload(round_, nonce, me, c, [roster[v] for v in peers], t, self._held_rank(view, shared))
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
            st = self._wait(lambda s: s.round != round_ or s.round_nonce != nonce
                            or s.secure_stage == fpb.SECURE_STAGE_ADVERTISING)
            if st.round == round_:
                raise AttemptOver("the aggregator abandoned the attempt after our upload")
            # The round closed with our upload in its sum, revealed by the others' shares where ours were not
            # needed: released as much as if we had revealed, so no other sum of this round may hold it.
            self.protection.book.mark(self.run_id, round_)
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

    def _upload(self, round_: int, nonce: str, me: Participant, c: Contribution, peers: list[Member], t: int,
                cut: int = 0) -> None:
        """Masks the contribution (clipped, and noised: `_noised_values`; with `cut`, a mixed-rank run's
        r*, its LoRA components above r* zeroed, held by fewer than t) for `peers` and uploads it. The
        header counts 0 examples and successes: the weight travels masked."""
        values = self._noised_values(round_, c, t)
        if cut:
            values = ranks.zero_above(values, cut)
        vector = me.mask(self.layout.encode(values, c.weight), peers)
        data = secagg.pack_u64(vector)
        del vector
        self._call(lambda: self.fed.upload(round_, data, num_examples=0, num_successes=0,
                                           transport_dtype=secagg.MASKED_DTYPE, round_nonce=nonce,
                                           follow_nonce=False))

    def _noised_values(self, round_: int, c: Contribution, t: int) -> dict[str, torch.Tensor]:
        """The values this client masks in an attempt of threshold `t`: its adapter, clipped (on the
        components it holds) and noised for the threshold the release's noise was first drawn for. The
        draw is the organisation's (ReleaseBook.draw): the same for the same round and release in every
        attempt and after a restart. AttemptOver where `t` is below that threshold: the noise would not
        cover the sum, and re-scaling the same draw by another std would give the values away."""
        cfg = self.config
        if not (cfg.clip_norm > 0 or secagg.noise_std(cfg.clip_norm, cfg.noise_multiplier, t) > 0):
            return c.values
        assert c.previous is not None, "a run that clips needs the global adapter the client trained from"
        release = secagg.release_digest(c.values, c.previous, cfg.clip_norm, cfg.noise_multiplier)
        if self._noised is None or self._noised[0] != release:
            draw = self.protection.book.draw(round_, release, t) if cfg.noise_multiplier > 0 else None
            std = secagg.noise_std(cfg.clip_norm, cfg.noise_multiplier, draw.threshold) if draw else 0.0
            held = ranks.held(c.values, c.rank) if c.rank else None
            self._noised = (release, draw.threshold if draw else t, secagg.clip_and_noise(
                c.values, c.previous, cfg.clip_norm, std, draw.key if draw else None, held))
        _, drawn_for, values = self._noised
        if cfg.noise_multiplier > 0 and t < drawn_for:
            raise AttemptOver(f"this attempt's threshold {t} is below the {drawn_for} this client's noise was "
                              "drawn for: its noise would not cover the sum")
        return values

    def _before_reveal(self, round_: int, nonce: str, me: Participant, view: View, shared: list[str],
                       held: dict[str, tuple[bytes, bytes]], on_step: Callable[[str], None]) -> fpb.SecureRound | None:
        """The attempt's view at UNMASKING once the uploader list is checked (and, with signed keys,
        signed by this client and by at least the threshold of its neighbours); None when the round
        closed meanwhile (the others' shares sufficed). Once the attempt reaches UNMASKING the round is
        booked as released (ReleaseBook), whether or not this client then reveals: the others' shares
        may unmask its upload, so it takes part in no later attempt of the round."""
        if not self.protection.signed:
            sr = self._reached(round_, nonce, fpb.SECURE_STAGE_UNMASKING, closed_ok=True)
            if sr is not None:
                self.protection.book.mark(self.run_id, round_)
                self._check_uploaders(me.client_id, sr, view, shared, held)
            return sr
        sr = self._reached(round_, nonce, fpb.SECURE_STAGE_CONSISTENCY, closed_ok=True)
        if sr is None:
            return None
        uploaded = sorted(sr.uploaded)
        self._check_uploaders(me.client_id, sr, view, shared, held)
        assert self.protection.signer is not None
        degree = self.config.secure_neighbours
        signature = self.protection.signer.sign(signatures.consistency(me.ctx, me.client_id, view.threshold, degree,
                                                                       view.digest, uploaded))
        self.protection.attempts.mark(nonce, "signed")
        self._call(lambda: self.fed.check_consistency(round_, nonce, signature))
        on_step("signed")
        sr = self._reached(round_, nonce, fpb.SECURE_STAGE_UNMASKING, closed_ok=True)
        if sr is None:
            return None
        self.protection.book.mark(self.run_id, round_)
        if sorted(sr.uploaded) != uploaded:
            raise SecureError("the aggregator shows another uploader list at unmasking than the one this client "
                              "signed: this client reveals nothing")
        near = view.graph[me.client_id]
        assert self.protection.verifier is not None
        good = self.protection.verifier.signed_by_all(
            {c: cert for c, cert in view.certificates.items() if c in near and c in uploaded},
            [(s.client_id, s.signature) for s in sr.consistency],
            lambda cid: signatures.consistency(me.ctx, cid, view.threshold, degree, view.digest, uploaded))
        if len(set(good)) < view.threshold:
            raise SecureError(f"{len(set(good))} of this client's neighbours signed the uploader list it was shown, "
                              f"fewer than the threshold of {view.threshold}: the aggregator may show others another "
                              "list; this client reveals nothing")
        return sr

    def _check_uploaders(self, me: str, sr: fpb.SecureRound, view: View, shared: list[str],
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
        cut = self._held_rank(view, shared)
        if cut:
            sent = {u: min(view.roster[u].lora_rank, cut) if u in view.roster else 0 for u in uploaded}
            holders = sum(r >= sent[me] for r in sent.values())
            if holders < t:
                raise SecureError(f"{holders} uploads hold this client's LoRA component {sent[me]}, fewer than the "
                                  f"threshold of {t}: unmasking would give their few values; this client reveals "
                                  "nothing")

    def _check_ranks(self, view: View, me: str, rank: int) -> None:
        """SecureError unless the roster's ranks are this run's: in a mixed-rank run every member's from 1
        to RunConfig.max_lora_rank and this client's own; else all 0."""
        top = self.config.max_lora_rank
        if view.roster[me].lora_rank != rank:
            raise SecureError(f"the roster gives this client LoRA rank {view.roster[me].lora_rank}, not its own "
                              f"{rank}: this client will not take part")
        odd = sorted(m.client_id for m in view.roster.values() if not (1 <= m.lora_rank <= top if top else
                                                                         m.lora_rank == 0))
        if odd:
            raise SecureError(f"the roster gives {', '.join(odd[:5])} a LoRA rank this run cannot have (from 1 to "
                              f"{top}, or 0 in a run of one rank): this client will not take part")

    def _held_rank(self, view: View, shared: list[str]) -> int:
        """A mixed-rank run's r*: the largest rank at least the threshold of the members that shared hold
        (fedse.model.ranks.held_rank); 0 in a run of one rank, where every value is every member's."""
        if not self.config.max_lora_rank:
            return 0
        return ranks.held_rank([view.roster[v].lora_rank for v in shared if v in view.roster], view.threshold)

    @staticmethod
    def _reveal(sr: fpb.SecureRound, held: dict[str, tuple[bytes, bytes]]) -> list[fpb.RevealedShare]:
        """The shares the unmasking needs: of each neighbour that shared, its self-mask share if it
        uploaded, else its masking share; never both of one client."""
        uploaded = set(sr.uploaded)
        kinds = {True: (fpb.SHARE_KIND_SELF_MASK, 0), False: (fpb.SHARE_KIND_MASKING, 1)}
        return [fpb.RevealedShare(client_id=v, kind=kinds[v in uploaded][0], share=held[v][kinds[v in uploaded][1]])
                for v in sorted(held)]

    # ---- following the attempt -----------------------------------------------------------------
    def _roster(self, sr: fpb.SecureRound | None, me: Participant) -> View:
        """The attempt's roster, graph and threshold, checked against this client's own protection."""
        assert sr is not None
        try:
            return check_roster(sr, me, self.protection, self.config.secure_neighbours)
        except NotInRoster as exc:
            raise AttemptOver(str(exc)) from None

    def _reached(self, round_: int, nonce: str, stage: int, closed_ok: bool = False) -> fpb.SecureRound | None:
        """The attempt's view once it reached `stage`; AttemptOver if the attempt ended first. With
        `closed_ok`, None when the round closed meanwhile (the others unmasked it)."""
        at = _ORDER.index(stage)

        def rewound(s: fpb.RoundStatus) -> bool:  # past sharing, the attempt can only go forwards
            return at > 1 and s.secure_stage == fpb.SECURE_STAGE_ADVERTISING

        st = self._wait(lambda s: s.round != round_ or s.round_nonce != nonce or s.state != fpb.ROUND_STATE_OPEN
                        or (s.secure_stage in _ORDER and _ORDER.index(s.secure_stage) >= at) or rewound(s))
        if st.round == round_ and st.round_nonce == nonce and st.state == fpb.ROUND_STATE_OPEN:
            if rewound(st):
                raise SecureError(f"the aggregator took this attempt back to key advertisement under the same round "
                                  f"nonce (a reused round nonce) after this client "
                                  f"{self.protection.attempts.step(nonce)} in it: it could show this client's messages "
                                  "as a new attempt's; this client takes part in no attempt under that nonce")
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
