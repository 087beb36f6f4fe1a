"""The client side of FederationService: join, follow rounds, download and upload adapters.

Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) are retried with
exponential backoff and jitter; every other status is the aggregator's answer and is raised.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Callable, Iterator, TypeVar

import grpc

from fedse import adapter as ad
from fedse import serde
from fedse.serving import insecure_channel, log_fields
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc

log = logging.getLogger("client_agent.federation")

T = TypeVar("T")
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


class TransferError(RuntimeError):
    """A download whose bytes do not match their header."""


@dataclasses.dataclass(frozen=True)
class GlobalAdapter:
    round: int
    data: bytes
    sha256: str
    adapter_config_json: str


class FederationClient:
    def __init__(self, target: str, client_id: str, retries: int = 8, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, timeout_s: float = 300.0):
        self.target = target
        self.client_id = client_id
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.channel = insecure_channel(target)
        self.stub = fpb_grpc.FederationServiceStub(self.channel)
        self.chunk_bytes = ad.CHUNK_BYTES

    def close(self) -> None:
        self.channel.close()

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return call()
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or attempt == self.retries:
                    raise
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * random.uniform(0.5, 1.0)
                log.warning("retrying", extra=log_fields(call=what, code=exc.code().name, attempt=attempt + 1,
                                                         delay_s=round(delay, 2), target=self.target))
                time.sleep(delay)
        raise AssertionError("unreachable")

    def join(self, env: str, base_model: str, schema: ad.Schema) -> fpb.JoinResponse:
        req = fpb.JoinRequest(client_id=self.client_id, env=env, base_model=base_model,
                              schema=serde.schema_to_proto(schema))
        resp = self._retry("Join", lambda: self.stub.Join(req, timeout=self.timeout_s, wait_for_ready=True))
        if resp.config.max_chunk_bytes > 0:
            self.chunk_bytes = min(self.chunk_bytes, resp.config.max_chunk_bytes)
        return resp

    def status(self) -> fpb.RoundStatus:
        return self._retry("GetRoundStatus", lambda: self.stub.GetRoundStatus(
            fpb.RoundStatusRequest(client_id=self.client_id), timeout=self.timeout_s))

    def wait_until(self, done: Callable[[fpb.RoundStatus], bool], timeout_s: float | None = None) -> fpb.RoundStatus:
        """Follows WatchRound until `done(status)`; reconnects if the stream breaks."""
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

    def download(self, round_: int) -> GlobalAdapter:
        def call() -> GlobalAdapter:
            stream: Iterator[fpb.AdapterChunk] = self.stub.DownloadAdapter(
                fpb.DownloadRequest(round=round_), timeout=self.timeout_s)
            header = next(stream).header
            data = b"".join(chunk.data for chunk in stream)
            if len(data) != header.size or ad.sha256_hex(data) != header.sha256:
                raise TransferError(f"global adapter of round {header.round} arrived damaged "
                                    f"({len(data)} of {header.size} bytes or sha256 mismatch)")
            return GlobalAdapter(header.round, data, header.sha256, header.adapter_config_json)
        return self._retry("DownloadAdapter", call)

    def upload(self, round_: int, data: bytes, num_examples: int, num_successes: int,
               adapter_config_json: str = "") -> fpb.UploadAck:
        header = fpb.AdapterHeader(
            round=round_, client_id=self.client_id, sha256=ad.sha256_hex(data), size=len(data),
            adapter_config_json=adapter_config_json, num_examples=num_examples, num_successes=num_successes)

        def chunks() -> Iterator[fpb.AdapterChunk]:
            yield fpb.AdapterChunk(header=header)
            for part in ad.chunks(data, self.chunk_bytes):
                yield fpb.AdapterChunk(data=part)

        return self._retry("UploadAdapter", lambda: self.stub.UploadAdapter(chunks(), timeout=self.timeout_s))

    def report(self, round_: int, metrics: dict[str, float]) -> None:
        self._retry("ReportMetrics", lambda: self.stub.ReportMetrics(
            fpb.MetricsReport(client_id=self.client_id, round=round_, metrics=metrics), timeout=self.timeout_s))
