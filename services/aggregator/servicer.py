"""FederationService: translates protobuf to Federation calls and domain errors to status codes."""

from __future__ import annotations

import logging
from typing import Iterator

import grpc
import prometheus_client

from fedse import adapter as ad
from fedse import serde
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc

from . import rounds

log = logging.getLogger("aggregator.servicer")

UPLOADS = prometheus_client.Counter(
    "fedse_aggregator_uploads", "Adapter uploads, by outcome (accepted or the refusal's reason).", ["outcome"])
BYTES_RECEIVED = prometheus_client.Counter("fedse_aggregator_received_bytes", "Adapter bytes received.")
BYTES_SENT = prometheus_client.Counter("fedse_aggregator_sent_bytes", "Adapter bytes sent.")
ROUND = prometheus_client.Gauge("fedse_aggregator_round", "The open round (num_rounds once the run is finished).")
CLIENTS = prometheus_client.Gauge("fedse_aggregator_clients_joined", "Clients that joined the run.")

_STATE = {
    rounds.State.WAITING_FOR_CLIENTS: fpb.ROUND_STATE_WAITING_FOR_CLIENTS,
    rounds.State.OPEN: fpb.ROUND_STATE_OPEN,
    rounds.State.FINISHED: fpb.ROUND_STATE_FINISHED,
}

# Domain error -> (status code, metric reason).
_CODES: list[tuple[type[Exception], grpc.StatusCode, str]] = [
    (rounds.NotJoined, grpc.StatusCode.FAILED_PRECONDITION, "not_joined"),
    (rounds.StaleRound, grpc.StatusCode.FAILED_PRECONDITION, "stale_round"),
    (rounds.RunFinished, grpc.StatusCode.FAILED_PRECONDITION, "run_finished"),
    (rounds.SchemaMismatch, grpc.StatusCode.FAILED_PRECONDITION, "schema_mismatch"),
    (rounds.DuplicateUpload, grpc.StatusCode.ALREADY_EXISTS, "duplicate"),
    (rounds.NotAvailable, grpc.StatusCode.NOT_FOUND, "not_available"),
    (ad.AdapterError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_adapter"),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
]


for _kind, _code, _reason in _CODES:
    UPLOADS.labels(_reason)
UPLOADS.labels("accepted")


def _abort(context: grpc.ServicerContext, exc: Exception, counted: bool = False) -> None:
    for kind, code, reason in _CODES:
        if isinstance(exc, kind):
            if counted:
                UPLOADS.labels(reason).inc()
            context.abort(code, str(exc))
    raise exc


def status_to_proto(st: rounds.Status) -> fpb.RoundStatus:
    return fpb.RoundStatus(
        run_id=st.run_id, round=st.round, state=_STATE[st.state], num_rounds=st.num_rounds,
        joined=list(st.joined), uploaded=list(st.uploaded), deadline_unix=st.deadline_unix,
        global_sha256=st.global_sha256,
    )


class FederationServicer(fpb_grpc.FederationServiceServicer):
    def __init__(self, federation: rounds.Federation, chunk_bytes: int = ad.CHUNK_BYTES):
        self.fed = federation
        self.chunk_bytes = chunk_bytes

    def _observe(self, st: rounds.Status) -> None:
        ROUND.set(st.round)
        CLIENTS.set(len(st.joined))

    def Join(self, request, context):
        try:
            st = self.fed.join(request.client_id, request.env, request.base_model,
                               serde.schema_from_proto(request.schema))
        except Exception as exc:  # noqa: BLE001 - mapped to a status or re-raised
            _abort(context, exc)
        self._observe(st)
        s = self.fed.settings
        return fpb.JoinResponse(
            config=fpb.RunConfig(run_id=s.run_id, num_rounds=s.num_rounds, min_clients=s.min_clients,
                                 round_deadline_s=s.round_deadline_s, strategy=s.strategy,
                                 max_chunk_bytes=self.chunk_bytes),
            current_round=st.round,
        )

    def GetRoundStatus(self, request, context):
        return status_to_proto(self.fed.status())

    def WatchRound(self, request, context) -> Iterator[fpb.RoundStatus]:
        st = self.fed.status()
        yield status_to_proto(st)
        while context.is_active() and st.state is not rounds.State.FINISHED:
            new = self.fed.wait_for_change(st.version, timeout=1.0)
            if new.version != st.version:
                st = new
                yield status_to_proto(st)

    def DownloadAdapter(self, request, context) -> Iterator[fpb.AdapterChunk]:
        try:
            data, sha, config_json = self.fed.global_adapter(request.round)
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc)
        st = self.fed.status()
        round_ = request.round if request.round >= 0 else st.round
        yield fpb.AdapterChunk(header=fpb.AdapterHeader(
            run_id=st.run_id, round=round_, sha256=sha, size=len(data), adapter_config_json=config_json))
        for part in ad.chunks(data, self.chunk_bytes):
            BYTES_SENT.inc(len(part))
            yield fpb.AdapterChunk(data=part)

    def UploadAdapter(self, request_iterator, context):
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise ValueError("an upload starts with a header chunk (client_id, round, sha256, size)")
            h = first.header
            self.fed.precheck_upload(h.client_id, h.round, h.size)
            parts: list[bytes] = []
            received = 0
            for chunk in request_iterator:
                if chunk.WhichOneof("kind") != "data":
                    raise ValueError("only data chunks may follow the header")
                if len(chunk.data) > self.chunk_bytes:
                    raise ValueError(f"chunk of {len(chunk.data)} bytes exceeds {self.chunk_bytes}: split it")
                received += len(chunk.data)
                if received > h.size:
                    raise ad.AdapterError(f"received more than the {h.size} bytes the header declared")
                parts.append(chunk.data)
            BYTES_RECEIVED.inc(received)
            st = self.fed.submit(h.client_id, h.round, b"".join(parts), h.sha256, h.size,
                                 h.num_examples, h.num_successes)
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc, counted=True)
        UPLOADS.labels("accepted").inc()
        self._observe(st)
        return fpb.UploadAck(round=h.round, sha256=h.sha256, size=h.size)

    def ReportMetrics(self, request, context):
        try:
            self.fed.report_metrics(request.client_id, request.round, dict(request.metrics))
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc)
        return fpb.MetricsAck()
