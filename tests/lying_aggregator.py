"""A malicious aggregator for tests: the real aggregator (round keeper, secure desk, gRPC servicer)
whose answers pass through the test's lies before they leave, as an attacker who runs the aggregator
would change them. It speaks the real protocol to real clients (fedse's SecureRound in threads, or a
client agent process), so an attack is refused only where the client's own checks refuse it.

    with lying_aggregator(tmp_path, start_clients=4) as (agg, port, run_dir, liar):
        liar.secure_lies.append(lambda client_id, secure_round: ...)   # edit what GetSecureRound says

`liar.uploaders` and `liar.unmasked_by` record who sent a masked upload and who revealed shares: what
an attack needs from its victim.
"""

from __future__ import annotations

import contextlib
import pathlib
import threading
from typing import Callable, Iterator

from fedse.v1 import federation_pb2 as fpb
from services.aggregator.server import AggregatorConfig, create_server
from services.aggregator.servicer import FederationServicer


class LyingServicer(FederationServicer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.secure_lies: list[Callable[[str, fpb.SecureRound], None]] = []
        # Takes a client's CheckConsistency instead of the desk (True: handled, acknowledged without checks).
        self.consistency_takeover: Callable[[fpb.ConsistencyRequest], bool] | None = None
        self.uploaders: list[str] = []
        self.unmasked_by: list[str] = []
        self._lock = threading.Lock()

    def GetSecureRound(self, request, context):
        out = super().GetSecureRound(request, context)
        for lie in self.secure_lies:
            lie(request.client_id, out)
        return out

    def UploadAdapter(self, request_iterator, context):
        def watched():
            for chunk in request_iterator:
                if chunk.HasField("header"):
                    with self._lock:
                        self.uploaders.append(chunk.header.client_id)
                yield chunk
        return super().UploadAdapter(watched(), context)

    def CheckConsistency(self, request, context):
        if self.consistency_takeover is not None and self.consistency_takeover(request):
            return fpb.StageAck()
        return super().CheckConsistency(request, context)

    def Unmask(self, request, context):
        with self._lock:
            self.unmasked_by.append(request.client_id)
        return super().Unmask(request, context)


def secure_settings(**over) -> dict:
    return {"secure_aggregation": True, "rounds": 1, "min_clients": 2, "heartbeat_timeout_s": 1.5,
            "heartbeat_interval_s": 0.3, "secure_stage_timeout_s": 5.0, **over}


@contextlib.contextmanager
def lying_aggregator(state_dir: pathlib.Path, **settings) -> Iterator[tuple[object, int, pathlib.Path, LyingServicer]]:
    """A real secure aggregator on a free port behind a LyingServicer: (aggregator, port, run dir, liar)."""
    cfg = AggregatorConfig(**{"address": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(state_dir),
                              "run_id": "t", "torch_threads": 0, **secure_settings(**settings)})
    agg, port = create_server(cfg, LyingServicer)
    agg.start()
    try:
        yield agg, port, pathlib.Path(state_dir) / cfg.run_id, agg.servicer
    finally:
        agg.stop(0)


def at_least(stage: int) -> Callable[[fpb.SecureRound], bool]:
    """Whether an answer is of `stage` or later (in the stages' order, CONSISTENCY before UNMASKING)."""
    order = [fpb.SECURE_STAGE_ADVERTISING, fpb.SECURE_STAGE_SHARING, fpb.SECURE_STAGE_UPLOADING,
             fpb.SECURE_STAGE_CONSISTENCY, fpb.SECURE_STAGE_UNMASKING]
    return lambda sr: sr.stage in order and order.index(sr.stage) >= order.index(stage)
