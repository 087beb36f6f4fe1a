"""The client's part in secure aggregation (proto: FederationService's secure stages): for its saved
adapter, advertise fresh keys, deal sealed shares of its seeds to the roster, upload the masked
vector, and reveal the shares the aggregator needs to unmask the round's sum.

Each attempt of a round has its own keys, made here and held only in memory (a restarted client sits
out the attempt it was in); an attempt abandoned by the aggregator (fewer than the threshold took
part, or it restarted) is taken part in again from key advertisement, with the same adapter. The
client checks what the aggregator asks before it reveals anything: uploaders and dropped clients
come from the clients that shared, at least the threshold of them uploaded, and no client's two
seeds are ever asked for both.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import grpc
import torch

from fedse import secagg
from fedse.secagg import Member, Participant, SecureError
from fedse.serving import log_fields
from fedse.v1 import federation_pb2 as fpb

from .federation import FederationClient, StaleRound

log = logging.getLogger("client_agent.secure")

_ORDER = [fpb.SECURE_STAGE_ADVERTISING, fpb.SECURE_STAGE_SHARING, fpb.SECURE_STAGE_UPLOADING,
          fpb.SECURE_STAGE_UNMASKING]


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


class SecureRound:
    """Takes part in the secure stages of one round with one contribution (`take_part`)."""

    def __init__(self, fed: FederationClient, run_id: str, config: fpb.RunConfig, layout: secagg.Layout,
                 wait_s: float | None = None):
        self.fed = fed
        self.run_id = run_id
        self.config = config
        self.layout = layout
        self.wait_s = wait_s

    def take_part(self, round_: int, c: Contribution, on_step: Callable[[str], None] = lambda step: None) -> bool:
        """True once the round closed with this client's masked upload in its sum; False when it closed
        without it (the client missed key advertisement, or the round moved on). Raises StaleRound when
        the round is over before this client could take part, SecureError (before any stage) when its
        adapter cannot be masked."""
        self.layout.check(c.values, c.weight)
        while True:
            st = self.fed.status()
            if st.state == fpb.ROUND_STATE_WAITING_FOR_CLIENTS:  # round 0 opens once enough clients joined
                self._wait(lambda s: s.state != fpb.ROUND_STATE_WAITING_FOR_CLIENTS)
                continue
            if st.round != round_ or st.state not in (fpb.ROUND_STATE_OPEN, fpb.ROUND_STATE_AGGREGATING):
                raise StaleRound(round_, st, "the round is over")
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
        try:
            self._call(lambda: self.fed.advertise_keys(round_, nonce, me.sealing.public, me.masking.public,
                                                       me.self_commitment))
            on_step("advertised")
            roster, t = self._roster(self._reached(round_, nonce, fpb.SECURE_STAGE_SHARING))
            near = secagg.neighbours(sorted(roster), me.ctx, self.config.secure_neighbours)[me.client_id]
            if t > len(near):
                raise SecureError(f"the roster asks for a threshold of {t} in a neighbourhood of {len(near)}: this "
                                  "client will not take part")
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
            held = {s.client_id: me.open(roster[s.client_id], s.sealed) for s in sr.inbound
                    if s.client_id in near}
            if set(held) != set(peers):
                raise SecureError(f"the aggregator relayed shares from {sorted(held)}, not from every neighbour that "
                                  f"shared ({peers}): this client will not take part in this attempt")
            self._upload(round_, nonce, me, c, [roster[v] for v in peers], t)
            on_step("uploaded")
            try:
                sr = self._reached(round_, nonce, fpb.SECURE_STAGE_UNMASKING, closed_ok=True)
                if sr is not None:
                    self._call(lambda: self.fed.unmask(round_, nonce, self._reveal(me.client_id, sr, shared, held, t)))
                    on_step("unmasked")
            except AttemptOver:
                pass  # the unmasking closed without our shares: the status below says how it ended
            st = self._wait(lambda s: s.round != round_ or s.round_nonce != nonce)
            if st.round == round_:
                raise AttemptOver("the aggregator abandoned the attempt after our upload")
            return True
        finally:
            me.wipe()

    def _upload(self, round_: int, nonce: str, me: Participant, c: Contribution, peers: list[Member], t: int) -> None:
        """Masks the contribution (clipped, and noised for a threshold of `t`) for `peers` and uploads it."""
        values = c.values
        clip, std = self.config.clip_norm, secagg.noise_std(self.config.clip_norm, self.config.noise_multiplier, t)
        if clip > 0 or std > 0:
            assert c.previous is not None, "a run that clips needs the global adapter the client trained from"
            values = secagg.clip_and_noise(values, c.previous, clip, std)
        vector = me.mask(self.layout.encode(values, c.weight), peers)
        data = secagg.pack_u64(vector)
        del vector
        self._call(lambda: self.fed.upload(round_, data, num_examples=c.num_examples, num_successes=c.num_successes,
                                           transport_dtype=secagg.MASKED_DTYPE, round_nonce=nonce,
                                           follow_nonce=False))

    @staticmethod
    def _reveal(me: str, sr: fpb.SecureRound, shared: list[str], held: dict[str, tuple[bytes, bytes]],
                t: int) -> list[fpb.RevealedShare]:
        """The shares the unmasking needs, once what the aggregator says is checked: the uploaders are
        clients that shared, this client among them, and at least `t` of its neighbours (`held`: the
        shares of its neighbours that shared)."""
        uploaded = set(sr.uploaded)
        if not uploaded <= set(shared) or len(uploaded & set(held)) < t or me not in uploaded:
            raise SecureError(f"the aggregator asks to unmask {len(uploaded)} uploads of clients that shared "
                              f"({len(shared)}), with a threshold of {t} among neighbours: this client reveals nothing")
        kinds = {True: (fpb.SHARE_KIND_SELF_MASK, 0), False: (fpb.SHARE_KIND_MASKING, 1)}
        return [fpb.RevealedShare(client_id=v, kind=kinds[v in uploaded][0], share=held[v][kinds[v in uploaded][1]])
                for v in sorted(held)]

    # ---- following the attempt -----------------------------------------------------------------
    def _roster(self, sr: fpb.SecureRound | None) -> tuple[dict[str, Member], int]:
        """The attempt's roster and threshold, checked."""
        assert sr is not None
        roster = {m.client_id: Member(m.client_id, m.index, m.encryption_key, m.masking_key, m.self_mask_commitment)
                  for m in sr.roster}
        if self.fed.client_id not in roster:
            raise AttemptOver("our keys arrived after key advertisement closed")
        if sorted(m.index for m in roster.values()) != list(range(1, len(roster) + 1)):
            raise SecureError("the roster's share indices are not 1..n: this client will not take part")
        if not 2 <= sr.threshold <= len(roster):
            raise SecureError(f"the roster asks for a threshold of {sr.threshold} of {len(roster)} clients: this "
                              "client will not take part")
        return roster, int(sr.threshold)

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
