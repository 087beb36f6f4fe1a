"""The client's heartbeats: which round it works on and what it is doing (the phases of a round,
listed once in RoundPhase), sent every interval and at every change of phase."""

from __future__ import annotations

import enum
import logging
import threading

import grpc

from fedse.transport.serving import log_fields

from services.client_agent.federation.link import FederationClient
from services.client_agent.metrics import HEARTBEATS

log = logging.getLogger("client_agent.federation")


class RoundPhase(enum.Enum):
    """What a client is doing in a run, as its heartbeats (HeartbeatRequest.phase) and its progress
    lines name it: the one list of the phases of a round."""

    JOINING = "joining"
    EVALUATING = "evaluating"
    EXPLORING = "exploring"
    TRAINING = "training"
    UPLOADING = "uploading"
    WAITING = "waiting"
    NOT_SELECTED = "not selected"  # the aggregator chose other clients for the open round
    DECLINED = "declined"  # this client's guardian declines the open round (its privacy budget is spent)
    DONE = "done"


DEFAULT_HEARTBEAT_INTERVAL_S = 5.0


class Heartbeat:
    """Tells the aggregator, every `interval_s` and at every phase change, which round and phase
    this client is in. A daemon thread; a failed beat is logged and the next one tried, it never
    raises into the agent."""

    def __init__(self, fed: FederationClient, interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 phase: RoundPhase | str = RoundPhase.JOINING, round_: int = -1):
        self.fed = fed
        self.interval_s = interval_s if interval_s > 0 else DEFAULT_HEARTBEAT_INTERVAL_S
        self._lock = threading.Lock()
        self._round = round_
        self._phase = self._checked(phase)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_sent: tuple[int, str] | None = None
        self._failing = 0

    @staticmethod
    def _checked(phase: RoundPhase | str) -> str:
        try:
            return RoundPhase(phase).value
        except ValueError:
            raise ValueError(f"heartbeat phase must be one of {', '.join(p.value for p in RoundPhase)}, "
                             f"got {phase!r}") from None

    @property
    def phase(self) -> tuple[int, str]:
        with self._lock:
            return self._round, self._phase

    def set(self, phase: RoundPhase | str, round_: int | None = None) -> None:
        """Sets what the client is doing (and on which round); the new phase is sent at once."""
        with self._lock:
            self._phase = self._checked(phase)
            if round_ is not None:
                self._round = round_
        self._wake.set()

    def start(self) -> "Heartbeat":
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops beating (after one last beat carrying the current phase, e.g. "done")."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def beat(self) -> bool:
        round_, phase = self.phase
        self._last_sent = (round_, phase)
        try:
            self.fed.heartbeat(round_, phase, timeout_s=max(1.0, min(10.0, self.interval_s)))
        except Exception as exc:  # noqa: BLE001 - a heartbeat never takes the agent down
            HEARTBEATS.labels("failed").inc()
            self._failing += 1
            code = exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__
            # The first failure of a streak is a warning, the rest debug: an aggregator that is down
            # for a minute should not flood the log.
            (log.warning if self._failing == 1 else log.debug)(
                "heartbeat failed", extra=log_fields(round=round_, phase=phase, error=code, streak=self._failing))
            return False
        if self._failing:
            log.info("heartbeat back", extra=log_fields(after_failures=self._failing))
        self._failing = 0
        HEARTBEATS.labels("sent").inc()
        return True

    def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                self.beat()
                if self._stop.is_set() and self._last_sent != self.phase:
                    self.beat()  # the phase set just before stop() came during that beat: send it too
            except Exception:  # noqa: BLE001 - belt and braces: logging itself failed
                pass
            if self._stop.is_set():
                return
            self._wake.wait(self.interval_s)
