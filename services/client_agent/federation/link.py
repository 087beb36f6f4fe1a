"""The client side of FederationService: join, follow rounds, resumable adapter transfers (heartbeats:
heartbeat.py).

Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, CANCELLED: a broken
stream or an aggregator that restarted) are retried with exponential backoff and jitter; every
other status is the aggregator's answer and is raised.

Transfers are content-addressed and resumable. An upload is (client, round, sha256 of the bytes):
after a break, or a refusal of a short stream or a misplaced offset, the client asks GetUploadState
how many bytes the aggregator kept and sends only the rest, behind a header carrying that offset. A
download that broke asks again from the bytes it holds, pinned to the sha256 of the first header,
and checks the whole adapter's sha256 at the end. The retry budget (RetryBudget) counts attempts
without progress: a transfer that keeps moving is not cut off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import time
from typing import Callable, Iterator, TypeVar

import grpc

from fedse.model import adapter as ad
from fedse.transport import reach
from fedse.transport import serde
from fedse.privacy.secagg import MASKED_DTYPE
from fedse.security.admission import Security, channel
from fedse.transport.serving import log_fields
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc

log = logging.getLogger("client_agent.federation")

T = TypeVar("T")
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.CANCELLED}


class TransferError(RuntimeError):
    """A download whose bytes do not match their header."""


class StaleRound(RuntimeError):
    """The aggregator refused an upload because its round is over (closed, aggregating or finished).

    `status` is a fresh RoundStatus taken after the refusal: `open_round` is its round (while it
    is AGGREGATING, the round that closed; the next opens shortly).
    """

    def __init__(self, round_: int, status: fpb.RoundStatus, detail: str):
        self.round = round_
        self.status = status
        self.open_round = status.round
        state = fpb.RoundState.Name(status.state)
        super().__init__(f"upload for round {round_} refused: the aggregator is at round {status.round} "
                         f"({state}): {detail}")


BEFORE_UPLOAD = "the round is over"  # what a status checked before an upload says when the round is over


class NotSelected(StaleRound):
    """This client does not take part in the open round (RunConfig.selector chose others; RoundStatus
    says so, or the aggregator refused a call): the round goes on without it, as for one that closed."""

    def __init__(self, round_: int, status: fpb.RoundStatus, detail: str = ""):
        super().__init__(round_, status, detail or f"the aggregator chose {len(status.selected)} other client(s) "
                                                   "for this round; this client waits for a later one")


def selected(status: fpb.RoundStatus, client_id: str) -> bool:
    """Whether the client takes part in the status's round (always in a run without selection)."""
    return not status.selective or client_id in status.selected


class InsecureRun(RuntimeError):
    """A run without the protection this client requires: no secure aggregation where it requires it
    (--require-secure-aggregation), or secure aggregation with unsigned keys where it has mTLS files
    (it then requires signed keys). An organisation decides its own protection, whatever the aggregator
    offers. The client agent ends with this line and exit status 2; fedse doctor fails its admission
    check with it."""

    def __init__(self, run_id: str, unsigned: bool = False):
        if unsigned:
            super().__init__(f"the aggregator's run {run_id} has secure aggregation with unsigned keys, and this "
                             "client, with its mTLS files (--tls-ca, --tls-cert, --tls-key), requires them signed "
                             "(the aggregator signs keys when it runs mTLS with --tls-ca); nothing was uploaded")
        else:
            super().__init__(f"the aggregator's run {run_id} is not secure (no secure aggregation) and this client "
                             "requires it (--require-secure-aggregation / FEDSE_REQUIRE_SECURE_AGGREGATION); nothing "
                             "was uploaded")


def refuse_insecure(required: bool, run: fpb.RunConfig, signs: bool = False) -> None:
    """Raises InsecureRun where this client requires secure aggregation and the run has none, or where
    it signs its keys (`signs`: it has mTLS files) and the run's secure aggregation does not."""
    if required and not run.secure_aggregation:
        raise InsecureRun(run.run_id)
    if signs and run.secure_aggregation and not run.secure_signed:
        raise InsecureRun(run.run_id, unsigned=True)


@dataclasses.dataclass(frozen=True)
class GlobalAdapter:
    round: int
    # The bytes as sent, in `transport_dtype`; `adapter()` gives the tensors in fp32.
    data: bytes
    sha256: str
    adapter_config_json: str
    transport_dtype: str = ""

    def adapter(self) -> ad.Adapter:
        return ad.decode_transport(self.data)


class _Download:
    """A download in progress: the round asked for, the header of the adapter being fetched (pinned
    once the first stream starts) and the chunks held, in order, hashed as they come."""

    def __init__(self, asked: int):
        self.asked = asked
        self.restart()

    def restart(self) -> None:
        """Forget everything held: the next request starts from byte 0 of the round asked for."""
        self.round = self.asked
        self.header: fpb.AdapterHeader | None = None
        self.parts: list[bytes] = []
        self.held = 0
        self.digest = hashlib.sha256()

    def begin(self, h: fpb.AdapterHeader, offset: int) -> None:
        """A stream's header: the first pins the adapter (and the round, for a "latest" download);
        a resumed one must name the same adapter and start where we asked."""
        if self.header is None:
            self.header = h
            self.round = h.round  # a resumed "latest" download must stay on the same round
        elif h.sha256 != self.header.sha256 or h.size != self.header.size:
            raise TransferError(f"global adapter of round {self.round} changed during the download")
        if h.offset != offset:
            raise TransferError(f"asked for bytes from {offset}, the aggregator sent from {h.offset}")

    def add(self, data: bytes) -> None:
        assert self.header is not None
        self.parts.append(data)
        self.digest.update(data)
        self.held += len(data)
        if self.held > self.header.size:
            raise TransferError(f"global adapter of round {self.round} ran past its {self.header.size} bytes")


# ---- chunks -------------------------------------------------------------------------------------
def upload_chunks(header: fpb.AdapterHeader, data: bytes, chunk_bytes: int) -> Iterator[fpb.AdapterChunk]:
    """The header (its `offset` says where the data resumes), then data[offset:] in chunks."""
    parts = ad.chunks(data, chunk_bytes, header.offset)  # checks the offset and size before the header goes
    yield fpb.AdapterChunk(header=header)
    for part in parts:
        yield fpb.AdapterChunk(data=part)


@dataclasses.dataclass
class RetryBudget:
    """The failed attempts in a row that made no progress, of the `retries` a call may spend: an
    attempt that moved a transfer on starts the count again, so one that keeps moving is never cut off."""

    retries: int
    failures: int = 0

    def spent(self, progressed: bool = False) -> bool:
        """Counts a failed attempt (one that `progressed` starts the count again); True once more than
        `retries` in a row made no progress: give up."""
        self.failures = 0 if progressed else self.failures + 1
        return self.failures > self.retries


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential backoff with jitter: base * 2^attempt capped at max, times U(0.5, 1)."""
    return min(max_s, base_s * 2 ** attempt) * random.uniform(0.5, 1.0)


class FederationClient:
    def __init__(self, target: str, client_id: str, retries: int = 8, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, timeout_s: float = 300.0, transport_dtype: str = "",
                 security: Security | None = None):
        self.target = target
        self.client_id = client_id
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.transport_dtype = ad.check_transport_dtype(transport_dtype)
        self.security = security if security is not None else Security()
        self.channel = channel(target, self.security)
        self.stub = fpb_grpc.FederationServiceStub(self.channel)
        self.chunk_bytes = ad.CHUNK_BYTES
        # Asynchronous rounds (RunConfig.mode "async"): how many versions behind an upload may be; None
        # in synchronous rounds, where an upload is for the open round only.
        self.max_staleness: int | None = None

    def close(self) -> None:
        self.channel.close()

    def _sleep(self, what: str, exc: grpc.RpcError, attempt: int, **fields) -> None:
        delay = backoff_delay(attempt, self.backoff_s, self.max_backoff_s)
        log.warning("retrying", extra=log_fields(call=what, code=exc.code().name, attempt=attempt + 1,
                                                 delay_s=round(delay, 2), target=self.target, **fields))
        time.sleep(delay)

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        budget = RetryBudget(self.retries)
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or budget.spent():
                    raise
                self._sleep(what, exc, budget.failures - 1)

    # ---- run and rounds -----------------------------------------------------------------------
    def join(self, env: str, base_model: str, schema: ad.Schema) -> fpb.JoinResponse:
        """Joins the run (idempotent: a restarted client joins again with the same id). A connection
        that cannot be made raises reach.Unreachable with its reason: at once where a setting is wrong
        (TLS against plain, another CA, ...), after `timeout_s` where the aggregator does not answer."""
        reach.wait_ready(self.channel, self.target, self.security, "--aggregator", self.timeout_s)
        req = fpb.JoinRequest(client_id=self.client_id, env=env, base_model=base_model,
                              schema=serde.schema_to_proto(schema))
        resp = self._retry("Join", lambda: self.stub.Join(req, timeout=self.timeout_s, wait_for_ready=True))
        if resp.config.max_chunk_bytes > 0:
            self.chunk_bytes = min(self.chunk_bytes, resp.config.max_chunk_bytes)
        return resp

    def run_status(self) -> fpb.RunStatus:
        """The operator's view of the run (GetRunStatus): its settings and each client's state."""
        return self._retry("run status", lambda: self.stub.GetRunStatus(fpb.RunStatusRequest(), timeout=self.timeout_s,
                                                                                  wait_for_ready=True))

    def status(self) -> fpb.RoundStatus:
        return self._retry("GetRoundStatus", lambda: self.stub.GetRoundStatus(
            fpb.RoundStatusRequest(client_id=self.client_id), timeout=self.timeout_s))

    def wait_until(self, done: Callable[[fpb.RoundStatus], bool], timeout_s: float | None = None) -> fpb.RoundStatus:
        """Follows WatchRound until `done(status)` or the run finished; reconnects if the stream breaks
        (an aggregator restart shows as UNAVAILABLE)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.1, deadline - time.monotonic())
            try:
                for st in self.stub.WatchRound(fpb.RoundStatusRequest(client_id=self.client_id), timeout=remaining):
                    if done(st):
                        return st
                    if st.state == fpb.ROUND_STATE_FINISHED:
                        return st
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None \
                        and time.monotonic() >= deadline:
                    raise TimeoutError(f"round condition not reached within {timeout_s}s") from None
                if exc.code() not in RETRYABLE:
                    raise
                time.sleep(self.backoff_s)
                continue
            # The stream ended without the condition (a server shutting down): reconnect, not in a spin.
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"round condition not reached within {timeout_s}s")
            time.sleep(self.backoff_s)

    def heartbeat(self, round_: int, phase: str, timeout_s: float = 10.0) -> fpb.HeartbeatAck:
        """One heartbeat, not retried (the next beat is the retry)."""
        return self.stub.Heartbeat(fpb.HeartbeatRequest(client_id=self.client_id, round=round_, phase=phase),
                                   timeout=timeout_s)

    def report(self, round_: int, metrics: dict[str, float]) -> None:
        self._retry("ReportMetrics", lambda: self.stub.ReportMetrics(
            fpb.MetricsReport(client_id=self.client_id, round=round_, metrics=metrics), timeout=self.timeout_s))

    # ---- secure aggregation's stages (secure.py takes part in them) -------------------------------
    def advertise_keys(self, round_: int, nonce: str, encryption_key: bytes, masking_key: bytes,
                       self_commitment: bytes, certificate: bytes = b"", signature: bytes = b"",
                       lora_rank: int = 0) -> None:
        req = fpb.AdvertiseKeysRequest(client_id=self.client_id, round=round_, round_nonce=nonce,
                                       encryption_key=encryption_key, masking_key=masking_key,
                                       self_mask_commitment=self_commitment, certificate=certificate,
                                       signature=signature, lora_rank=lora_rank)
        self._retry("AdvertiseKeys", lambda: self.stub.AdvertiseKeys(req, timeout=self.timeout_s))

    def share_keys(self, round_: int, nonce: str, shares: list[fpb.SealedShare]) -> None:
        req = fpb.ShareKeysRequest(client_id=self.client_id, round=round_, round_nonce=nonce, shares=shares)
        self._retry("ShareKeys", lambda: self.stub.ShareKeys(req, timeout=self.timeout_s))

    def secure_round(self, round_: int, nonce: str) -> fpb.SecureRound:
        req = fpb.SecureRoundRequest(client_id=self.client_id, round=round_, round_nonce=nonce)
        return self._retry("GetSecureRound", lambda: self.stub.GetSecureRound(req, timeout=self.timeout_s))

    def check_consistency(self, round_: int, nonce: str, signature: bytes) -> None:
        req = fpb.ConsistencyRequest(client_id=self.client_id, round=round_, round_nonce=nonce, signature=signature)
        self._retry("CheckConsistency", lambda: self.stub.CheckConsistency(req, timeout=self.timeout_s))

    def unmask(self, round_: int, nonce: str, shares: list[fpb.RevealedShare]) -> None:
        req = fpb.UnmaskRequest(client_id=self.client_id, round=round_, round_nonce=nonce, shares=shares)
        self._retry("Unmask", lambda: self.stub.Unmask(req, timeout=self.timeout_s))

    # ---- download -----------------------------------------------------------------------------
    def download(self, round_: int, transport_dtype: str | None = None) -> GlobalAdapter:
        """The global adapter of `round_` (-1: the latest), resumed from the bytes held after a break
        and checked against its sha256 at the end (damaged: TransferError logged, restart from 0)."""
        dtype = ad.check_transport_dtype(self.transport_dtype if transport_dtype is None else transport_dtype)
        d = _Download(round_)
        budget = RetryBudget(self.retries)
        while True:
            offset = d.held
            req = fpb.DownloadRequest(round=d.round, offset=offset, sha256=d.header.sha256 if d.header else "",
                                      transport_dtype=dtype)
            try:
                stream: Iterator[fpb.AdapterChunk] = self.stub.DownloadAdapter(req, timeout=self.timeout_s)
                head = next(stream, None)
                if head is None or head.WhichOneof("kind") != "header":
                    raise TransferError(f"download of round {d.round} did not start with a header")
                d.begin(head.header, offset)
                for chunk in stream:
                    d.add(chunk.data)
                if d.held == d.header.size and d.digest.hexdigest() != d.header.sha256:
                    raise TransferError(f"global adapter of round {d.round} arrived damaged (sha256 mismatch over "
                                        f"{d.held} bytes)")
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION and d.header is not None:
                    # The adapter changed under the pinned sha256: start over.
                    log.warning("download restarts", extra=log_fields(round=d.round, reason=exc.details()))
                    d.restart()
                elif code not in RETRYABLE:
                    raise
                if budget.spent(progressed=d.held > offset):
                    raise
                self._sleep("DownloadAdapter", exc, budget.failures, round=d.round, held_bytes=d.held)
                continue
            except TransferError as exc:
                if budget.spent():
                    raise
                log.warning("download damaged, restarting from 0", extra=log_fields(round=d.round, reason=str(exc)))
                d.restart()
                continue
            assert d.header is not None
            if d.held < d.header.size:
                # The stream ended early without an error: resume from what we hold.
                if budget.spent(progressed=d.held > offset):
                    raise TransferError(f"global adapter of round {d.round}: stream keeps ending at "
                                        f"{d.held} of {d.header.size} bytes")
                continue
            h = d.header
            return GlobalAdapter(h.round, b"".join(d.parts), h.sha256, h.adapter_config_json,
                                 h.transport_dtype or dtype)

    # ---- upload -------------------------------------------------------------------------------
    def upload_state(self, round_: int, sha256: str) -> fpb.UploadState:
        """How many bytes of our upload (round, sha256) the aggregator holds (NOT_FOUND: none)."""
        try:
            return self._retry("GetUploadState", lambda: self.stub.GetUploadState(
                fpb.UploadStateRequest(client_id=self.client_id, round=round_, sha256=sha256),
                timeout=self.timeout_s))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return fpb.UploadState(received_bytes=0, complete=False)
            raise

    def _resume_at(self, round_: int, sha256: str, size: int) -> int:
        """The offset to resume our upload from: the bytes the aggregator holds of it (its size once
        accepted). A refusal of the question (not joined, the run over) is raised, as StaleRound if
        the round is over."""
        try:
            held = self.upload_state(round_, sha256)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self._check_round(round_, exc.details() or "")
            raise
        return min(int(held.received_bytes), size)

    def _check_round(self, round_: int, detail: str) -> fpb.RoundStatus:
        """A fresh status; raises StaleRound unless `round_` is still the open round."""
        st = self.status()
        if self.max_staleness is not None:  # asynchronous rounds: an upload may come from an earlier version
            behind = st.round + (st.state == fpb.ROUND_STATE_AGGREGATING) - round_
            if st.state == fpb.ROUND_STATE_FINISHED or behind > self.max_staleness:
                raise StaleRound(round_, st, detail)
            return st
        if st.state in (fpb.ROUND_STATE_AGGREGATING, fpb.ROUND_STATE_FINISHED) or st.round > round_:
            raise StaleRound(round_, st, detail)
        if st.round == round_ and not selected(st, self.client_id):
            raise NotSelected(round_, st, "" if detail == BEFORE_UPLOAD else detail)
        return st

    def upload(self, round_: int, data: bytes, num_examples: int, num_successes: int,
               adapter_config_json: str = "", transport_dtype: str | None = None,
               round_nonce: str = "", sha256: str = "", follow_nonce: bool = True) -> fpb.UploadAck:
        """Uploads `data` (safetensors bytes whose floating tensors are in `transport_dtype`) for
        `round_`, resuming after breaks from what the aggregator kept. `sha256`: the bytes' hash when
        the caller holds it already (else computed here).

        Raises StaleRound if the round is over, grpc.RpcError for any other refusal, and the last
        transient error once `retries` attempts in a row made no progress. `follow_nonce`: an upload
        refused for a round nonce that has changed is sent again with the new one (not for a masked
        upload, which is made for one attempt: the refusal is raised).
        """
        dtype = MASKED_DTYPE if transport_dtype == MASKED_DTYPE else \
            ad.check_transport_dtype(self.transport_dtype if transport_dtype is None else transport_dtype)
        sha = sha256 or ad.sha256_hex(data)  # a wrong one costs only a refused upload
        if not round_nonce:
            round_nonce = self._check_round(round_, BEFORE_UPLOAD).round_nonce
        offset, budget = 0, RetryBudget(self.retries)
        while True:
            header = fpb.AdapterHeader(
                round=round_, client_id=self.client_id, round_nonce=round_nonce, sha256=sha, size=len(data),
                offset=offset, transport_dtype=dtype, num_examples=num_examples, num_successes=num_successes,
                adapter_config_json=adapter_config_json)
            try:
                ack = self.stub.UploadAdapter(upload_chunks(header, data, self.chunk_bytes), timeout=self.timeout_s)
                if offset:
                    log.info("upload resumed and acknowledged", extra=log_fields(round=round_, offset=offset,
                                                                                 size=len(data)))
                return ack
            except grpc.RpcError as exc:
                code, detail = exc.code(), exc.details() or ""
                before = offset
                if code in RETRYABLE:
                    offset = self._resume_at(round_, sha, len(data))
                    if budget.spent(progressed=offset > before):
                        raise
                    self._sleep("UploadAdapter", exc, budget.failures, round=round_, resume_at=offset)
                    continue
                if code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                st = self._check_round(round_, detail)  # StaleRound if the round is over
                if st.round != round_ or st.state != fpb.ROUND_STATE_OPEN:
                    raise
                if st.round_nonce != round_nonce:
                    # The nonce we carried is not this round's (e.g. taken before a restart): take the new one.
                    if not follow_nonce or budget.spent():
                        raise
                    round_nonce = st.round_nonce
                    continue
                # The round is open and ours: the stream ended short, or our offset was not what the
                # aggregator holds. It says where to go on from.
                offset = self._resume_at(round_, sha, len(data))
                if budget.spent(progressed=offset > before):
                    raise
                log.info("upload resumes", extra=log_fields(round=round_, offset=offset, reason=detail))
                continue
