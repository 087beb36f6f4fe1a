"""FederationService: translates protobuf to RoundKeeper calls and domain errors to status codes."""

from __future__ import annotations

import collections
import logging
import math
import threading
from typing import Callable, Iterator

import grpc

from fedse.model import adapter as ad
from fedse.privacy import secagg
from fedse.transport import serde
from fedse.privacy.fixedpoint import MAX_CLIENTS
from fedse.transport.inputs import MAX_NAME_CHARS, bounded, shown
from fedse.transport.serving import StatusMap
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc

from . import errors, rounds
from .attempt import Kind, Stage
from .state import State
from .uploads import UploadHeader
from .metrics import BYTES_RECEIVED, BYTES_SENT, CLIENTS, CLIENTS_ALIVE, ROUND, UPLOADS

log = logging.getLogger("aggregator.servicer")

_STATE = {
    State.WAITING_FOR_CLIENTS: fpb.ROUND_STATE_WAITING_FOR_CLIENTS,
    State.OPEN: fpb.ROUND_STATE_OPEN,
    State.AGGREGATING: fpb.ROUND_STATE_AGGREGATING,
    State.FINISHED: fpb.ROUND_STATE_FINISHED,
}


class IdentityMismatch(errors.FederationError):
    pass


class Incomplete(errors.FederationError):
    pass


# Domain error -> status code, and the reason a refused upload is counted under.
_RULES: list[tuple[type[Exception], grpc.StatusCode, str]] = [
    (IdentityMismatch, grpc.StatusCode.PERMISSION_DENIED, "identity_mismatch"),
    (errors.NotJoined, grpc.StatusCode.FAILED_PRECONDITION, "not_joined"),
    (errors.StaleRound, grpc.StatusCode.FAILED_PRECONDITION, "stale_round"),
    (errors.NotSelected, grpc.StatusCode.FAILED_PRECONDITION, "not_selected"),
    (errors.RunFinished, grpc.StatusCode.FAILED_PRECONDITION, "run_finished"),
    (errors.SchemaMismatch, grpc.StatusCode.FAILED_PRECONDITION, "schema_mismatch"),
    (errors.ResumeMismatch, grpc.StatusCode.FAILED_PRECONDITION, "resume_mismatch"),
    (Incomplete, grpc.StatusCode.FAILED_PRECONDITION, "incomplete"),
    (errors.Superseded, grpc.StatusCode.ABORTED, "superseded"),
    (errors.DuplicateUpload, grpc.StatusCode.ALREADY_EXISTS, "duplicate"),
    (errors.NotAvailable, grpc.StatusCode.NOT_FOUND, "not_available"),
    (ad.AdapterError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_adapter"),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
]
ERRORS = StatusMap([(kind, code) for kind, code, _ in _RULES])
_UPLOAD_REASON = {kind: reason for kind, _, reason in _RULES}

for _reason in _UPLOAD_REASON.values():
    UPLOADS.labels(_reason)
UPLOADS.labels("accepted")


# What GetRunStatus sends at most: under the 4 MB a client with gRPC's default limits receives.
RUN_STATUS_BYTES = 3_500_000


def within_reply_budget(reply: fpb.RunStatus, budget: int = RUN_STATUS_BYTES) -> fpb.RunStatus:
    """`reply`, its last clients' metrics left out (counted in clients_without_metrics) while it is
    over `budget` bytes: many clients, each with up to MAX_METRICS long-named metrics, make more
    than a default client can receive."""
    size = reply.ByteSize()
    for client in reversed(reply.clients):
        if size <= budget:
            break
        if client.metrics:
            before = client.ByteSize()
            client.ClearField("metrics")
            size -= before - client.ByteSize()
            reply.clients_without_metrics += 1
    return reply


_STAGE = {
    None: fpb.SECURE_STAGE_UNSPECIFIED,
    Stage.ADVERTISING: fpb.SECURE_STAGE_ADVERTISING,
    Stage.SHARING: fpb.SECURE_STAGE_SHARING,
    Stage.UPLOADING: fpb.SECURE_STAGE_UPLOADING,
    Stage.CONSISTENCY: fpb.SECURE_STAGE_CONSISTENCY,
    Stage.UNMASKING: fpb.SECURE_STAGE_UNMASKING,
}
_KIND = {fpb.SHARE_KIND_SELF_MASK: Kind.SELF_MASK, fpb.SHARE_KIND_MASKING: Kind.MASKING}
# WatchRound streams one client id may hold at once. A client follows the round with one; a few more
# cover a reconnect that overlaps the stream it replaces. Each stream holds a worker thread, so without
# a cap one client could hold them all and leave everyone else's calls queued.
WATCHES_PER_CLIENT = 8
# WatchRound streams held at once: each holds a server thread, and the pool (server.WORKERS) keeps
# room beyond them for every other call. Ids that have not joined share a few of them.
MAX_WATCHES = MAX_CLIENTS
WATCHES_NOT_JOINED = 32


def status_to_proto(st: rounds.Status) -> fpb.RoundStatus:
    return fpb.RoundStatus(
        run_id=st.run_id, round=st.round, state=_STATE[st.state], num_rounds=st.num_rounds,
        joined=list(st.joined), uploaded=list(st.uploaded), deadline_unix=st.deadline_unix,
        global_sha256=st.global_sha256, round_nonce=st.round_nonce, secure_stage=_STAGE[st.secure_stage],
        selective=st.selected is not None, selected=list(st.selected or ()),
    )


def _member(m: secagg.Member) -> fpb.RosterMember:
    return fpb.RosterMember(client_id=m.client_id, encryption_key=m.encryption_key, masking_key=m.masking_key,
                            self_mask_commitment=m.self_commitment, index=m.index, certificate=m.certificate,
                            signature=m.signature, lora_rank=m.lora_rank)


def _no_identity(context: grpc.ServicerContext) -> str | None:
    return None


class FederationServicer(fpb_grpc.FederationServiceServicer):
    """`identity(context)` gives the authenticated client id (mTLS) or None; when it gives one,
    a call naming another client id is refused with PERMISSION_DENIED."""

    def __init__(self, federation: rounds.RoundKeeper, chunk_bytes: int = ad.CHUNK_BYTES,
                 identity: Callable[[grpc.ServicerContext], str | None] = _no_identity):
        self.fed = federation
        self.chunk_bytes = chunk_bytes
        self.identity = identity
        self._watching: collections.Counter[str] = collections.Counter()
        self._watch_lock = threading.Lock()
        CLIENTS_ALIVE.set_function(federation.clients_alive)
        self._observe(federation.status())

    def _observe(self, st: rounds.Status) -> None:
        ROUND.set(st.round)
        CLIENTS.set(len(st.joined))

    def _client(self, context: grpc.ServicerContext, claimed: str) -> str:
        """The calling client's id: the claimed one, which must match an authenticated identity."""
        bounded("client_id", claimed)
        who = self.identity(context)
        if who is not None and claimed != who:
            raise IdentityMismatch(f"this connection is authenticated as {shown(who)} but the call names client "
                                   f"{shown(claimed)}: a client may only act as itself")
        if claimed:
            self.fed.seen(claimed)
        return claimed

    def config_proto(self) -> fpb.RunConfig:
        s = self.fed.settings
        return fpb.RunConfig(run_id=s.run_id, num_rounds=s.num_rounds, min_clients=s.min_clients,
                             round_deadline_s=s.round_deadline_s, strategy=s.strategy,
                             max_chunk_bytes=self.chunk_bytes, wait_after_min_s=s.wait_after_min_s,
                             heartbeat_timeout_s=s.heartbeat_timeout_s, heartbeat_interval_s=s.heartbeat_interval_s,
                             secure_aggregation=s.secure, secure_threshold=s.secure_threshold,
                             secure_stage_timeout_s=s.secure_stage_timeout_s, secure_neighbours=s.secure_neighbours,
                             clip_norm=s.params.clip_norm if s.secure else 0.0,
                             noise_multiplier=s.params.noise_multiplier if s.secure else 0.0,
                             secure_signed=s.secure_signed, secure_max_roster=s.secure_max_roster if s.secure else 0,
                             dp_delta=s.dp_delta, selector=s.selection.selector,
                             clients_per_round=s.selection.clients_per_round,
                             selection_fraction=s.selection.fraction, fairness_rounds=s.selection.fairness_rounds,
                             mode=s.mode, async_concurrency=s.async_concurrency, async_buffer=s.async_buffer,
                             async_max_staleness=self.fed.schedule.max_staleness,
                             max_lora_rank=s.max_lora_rank)

    @ERRORS.wrap
    def Join(self, request, context):
        self._client(context, request.client_id)
        st = self.fed.join(request.client_id, bounded("env", request.env),
                           bounded("base_model", request.base_model, MAX_NAME_CHARS),
                           serde.schema_from_proto(request.schema))
        self._observe(st)
        return fpb.JoinResponse(config=self.config_proto(), current_round=st.round)

    @ERRORS.wrap
    def GetRoundStatus(self, request, context):
        self._client(context, request.client_id)
        return status_to_proto(self.fed.status())

    def WatchRound(self, request, context) -> Iterator[fpb.RoundStatus]:
        try:
            client = self._client(context, request.client_id)
        except Exception as exc:  # noqa: BLE001 - mapped to a status or re-raised
            ERRORS.abort(context, exc)
        joined = bool(self.fed.joined([client]))
        with self._watch_lock:
            if self._watching[client] >= WATCHES_PER_CLIENT:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"client {shown(client)} already holds {WATCHES_PER_CLIENT} WatchRound streams, the most "
                              "one client may: close one (a client follows the round with one)")
            if self._watching.total() >= MAX_WATCHES or (
                    not joined and self._not_joined_watches() >= WATCHES_NOT_JOINED):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "the aggregator holds as many WatchRound streams as it serves"
                              f"{'' if joined else ' for ids that have not joined'}: join first, or poll "
                              "GetRoundStatus")
            self._watching[client] += 1
        try:
            st = self.fed.status()
            yield status_to_proto(st)
            while context.is_active() and st.state is not State.FINISHED:
                new = self.fed.wait_for_change(st.version, timeout=1.0)
                if new.version != st.version:
                    st = new
                    self._observe(st)
                    yield status_to_proto(st)
        finally:
            with self._watch_lock:
                self._watching[client] -= 1
                if not self._watching[client]:
                    del self._watching[client]

    def _not_joined_watches(self) -> int:
        members = self.fed.joined(self._watching)
        return sum(n for c, n in self._watching.items() if c not in members)

    def DownloadAdapter(self, request, context) -> Iterator[fpb.AdapterChunk]:
        try:
            bounded("sha256", request.sha256)
            round_, data, sha, config_json = self.fed.global_adapter(
                request.round, bounded("transport_dtype", request.transport_dtype))
            if request.sha256 and request.sha256.lower() != sha:
                raise errors.ResumeMismatch(f"the global adapter of round {round_} is {sha[:12]}..., not the "
                                            f"{request.sha256[:12]}... being resumed: download it from offset 0")
            # The bytes come from the round keeper's cache of global adapters; chunks are cut as they
            # go (ad.chunks refuses an offset outside the adapter here, before the header is sent).
            parts = ad.chunks(data, self.chunk_bytes, request.offset)
        except Exception as exc:  # noqa: BLE001 - mapped to a status or re-raised
            ERRORS.abort(context, exc)
        yield fpb.AdapterChunk(header=fpb.AdapterHeader(
            run_id=self.fed.settings.run_id, round=round_, sha256=sha, size=len(data), adapter_config_json=config_json,
            offset=request.offset, transport_dtype=request.transport_dtype))
        for part in parts:
            BYTES_SENT.inc(len(part))
            yield fpb.AdapterChunk(data=part)

    def UploadAdapter(self, request_iterator, context):
        header: UploadHeader | None = None
        generation = 0
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise ValueError("an upload starts with a header chunk (client_id, round, round_nonce, sha256, size)")
            h = first.header
            for name in ("run_id", "round_nonce", "sha256", "transport_dtype"):
                bounded(name, getattr(h, name))
            if h.run_id and h.run_id != self.fed.settings.run_id:
                raise errors.StaleRound(f"the upload is for run {shown(h.run_id)}; this aggregator runs "
                                        f"{self.fed.settings.run_id!r}")
            header = UploadHeader(
                client_id=self._client(context, h.client_id), round=h.round, round_nonce=h.round_nonce,
                sha256=h.sha256.lower(), size=h.size, offset=h.offset, transport=h.transport_dtype,
                num_examples=h.num_examples, num_successes=h.num_successes)
            done, held, generation = self.fed.begin_upload(header)
            if not done:
                for chunk in request_iterator:
                    if chunk.WhichOneof("kind") != "data":
                        raise ValueError("only data chunks may follow the header")
                    if len(chunk.data) > self.chunk_bytes:
                        raise ValueError(f"data chunk of {len(chunk.data)} bytes exceeds this aggregator's limit of "
                                         f"{self.chunk_bytes} bytes (RunConfig.max_chunk_bytes): send chunks of at "
                                         "most that size")
                    BYTES_RECEIVED.inc(len(chunk.data))
                    held = self.fed.receive(header, generation, held, chunk.data)
                if held < header.size:
                    raise Incomplete(f"the stream ended after {held} of {header.size} bytes: the upload is "
                                     f"incomplete; resume from offset {held}")
                st = self.fed.finish_upload(header, generation)
                self._observe(st)
        except Exception as exc:  # noqa: BLE001
            if not context.is_active():  # the client went away: what arrived is kept for a resume
                log.info("upload stream broke off", extra={"fields": {
                    "client": header.client_id if header else "", "round": header.round if header else -1}})
                return fpb.UploadAck()
            rule = ERRORS.rule(exc)
            if rule is not None:
                UPLOADS.labels(_UPLOAD_REASON[rule[0]]).inc()
            ERRORS.abort(context, exc)
        finally:
            if header is not None and generation:
                self.fed.end_stream(header, generation)
        UPLOADS.labels("accepted").inc()
        return fpb.UploadAck(round=header.round, sha256=header.sha256, size=header.size)

    @ERRORS.wrap
    def GetUploadState(self, request, context):
        held, complete = self.fed.upload_state(self._client(context, request.client_id), request.round,
                                               bounded("sha256", request.sha256).lower())
        return fpb.UploadState(received_bytes=held, complete=complete)

    @ERRORS.wrap
    def Heartbeat(self, request, context):
        self._client(context, request.client_id)
        self.fed.seen(request.client_id, request.round, bounded("phase", request.phase, 64) or "alive")
        return fpb.HeartbeatAck(status=status_to_proto(self.fed.status()))

    @ERRORS.wrap
    def ReportMetrics(self, request, context):
        self.fed.report_metrics(self._client(context, request.client_id), request.round, dict(request.metrics))
        return fpb.MetricsAck()

    def GetRunStatus(self, request, context):
        st, views, seconds, base_model = self.fed.run_view()
        eps_round, eps_total, releases = self.fed.privacy()
        extra = dict(dp_accounted=True, dp_epsilon_round=eps_round, dp_epsilon_total=eps_total,
                       dp_releases=releases) if math.isfinite(eps_total) else {}
        sel, fallbacks = self.fed.selection()
        if sel is not None:
            extra["selection"] = fpb.SelectionRecord(round=sel.round, policy=sel.policy, chosen=list(sel.chosen),
                                                       reasoning=list(sel.reasoning),
                                                       fallback_reason=sel.fallback_reason)
        reply = fpb.RunStatus(selector_fallbacks=fallbacks,
            config=self.config_proto(), round=status_to_proto(st), round_seconds=seconds, base_model=base_model,
            clients=[fpb.ClientStatus(
                client_id=v.client_id, env=v.env, uploaded=v.uploaded, alive=v.alive,
                last_seen_unix=v.last_seen_unix, phase_round=v.phase_round, phase=v.phase,
                partial_upload_bytes=v.partial_upload_bytes, metrics_round=v.metrics_round, metrics=v.metrics,
                secure_step=v.secure_step, selected=v.selected, selection_reason=v.selection_reason,
                lora_rank=v.lora_rank)
                for v in views], **extra)
        return within_reply_budget(reply)

    # ---- secure aggregation's stages ---------------------------------------------------------------
    def _stage(self, context: grpc.ServicerContext, request, call):
        """Runs a stage call for the client the request names, on the attempt its round_nonce names."""
        client = self._client(context, request.client_id)
        return self.fed.secure_call(client, request.round, bounded("round_nonce", request.round_nonce), call)

    @ERRORS.wrap
    def AdvertiseKeys(self, request, context):
        self._stage(context, request, lambda desk: desk.advertise(
            request.client_id, request.encryption_key, request.masking_key, request.self_mask_commitment,
            self.fed.clock(), request.certificate, request.signature, request.lora_rank))
        return fpb.StageAck()

    @ERRORS.wrap
    def ShareKeys(self, request, context):
        shares = [(bounded("client_id", s.client_id), s.sealed, s.self_mask_commitment, s.masking_commitment)
                  for s in request.shares]
        self._stage(context, request, lambda desk: desk.share(request.client_id, shares))
        return fpb.StageAck()

    @ERRORS.wrap
    def GetSecureRound(self, request, context):
        v = self._stage(context, request, lambda desk: desk.view(request.client_id))
        return fpb.SecureRound(
            round=request.round, round_nonce=request.round_nonce, stage=_STAGE[v.stage], threshold=v.threshold,
            roster=[_member(m) for m in v.roster], shared=list(v.shared), uploaded=list(v.uploaded),
            inbound=[fpb.SealedShare(client_id=sender, sealed=d.sealed, self_mask_commitment=d.self_commitment,
                                     masking_commitment=d.masking_commitment) for sender, d in v.inbound],
            consistency=[fpb.UploaderSignature(client_id=c, signature=sig) for c, sig in v.consistency])

    @ERRORS.wrap
    def CheckConsistency(self, request, context):
        self._stage(context, request, lambda desk: desk.check_consistency(request.client_id, request.signature))
        return fpb.StageAck()

    @ERRORS.wrap
    def Unmask(self, request, context):
        revealed = []
        for r in request.shares:
            if r.kind not in _KIND:
                raise ValueError(f"a revealed share of {shown(r.client_id)} has no kind: say SHARE_KIND_SELF_MASK or "
                                 "SHARE_KIND_MASKING")
            revealed.append((bounded("client_id", r.client_id), _KIND[r.kind], r.share))
        self._stage(context, request, lambda desk: desk.unmask(request.client_id, revealed))
        return fpb.StageAck()
