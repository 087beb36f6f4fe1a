"""Aggregator configuration and server construction (separate from serving, so tests bind port 0)."""

from __future__ import annotations

import dataclasses
import pathlib
import threading

from fedse.config import ConfigError, field
from fedse.serving import Service
from fedse.v1 import federation_pb2_grpc as fpb_grpc

from .rounds import Federation, RunSettings
from .servicer import FederationServicer
from .store import Store
from .strategies import STRATEGIES


@dataclasses.dataclass(frozen=True)
class AggregatorConfig:
    """The Fed-SE aggregator: synchronous rounds over LoRA adapters."""

    address: str = field("0.0.0.0:50060", "gRPC listen address (port 0 picks a free port)")
    metrics_port: int = field(9100, "Prometheus /metrics port (0 picks one, -1 disables)")
    run_id: str = field("fedse-run", "name of the run; files go under <state-dir>/<run-id>/")
    state_dir: str = field("state/aggregator", "directory for global adapters, uploads and metrics")
    num_rounds: int = field(5, "number of federated rounds T")
    min_clients: int = field(1, "clients needed to open round 0, and uploads needed to close a round at its deadline")
    round_deadline_s: float = field(3600.0, "seconds after which a round closes if at least min-clients uploaded")
    strategy: str = field("fedavg", f"aggregation strategy: {', '.join(STRATEGIES)}")
    max_adapter_mb: float = field(512.0, "largest adapter accepted, in MB")
    seed: int = field(0, "seed of the round-0 LoRA initialisation")
    log_level: str = field("INFO", "log level")

    def __post_init__(self) -> None:
        if self.num_rounds < 1:
            raise ConfigError(f"--num-rounds must be at least 1, got {self.num_rounds}")
        if self.min_clients < 1:
            raise ConfigError(f"--min-clients must be at least 1, got {self.min_clients}")
        if self.round_deadline_s <= 0:
            raise ConfigError(f"--round-deadline-s must be positive, got {self.round_deadline_s}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy {self.strategy!r} is unknown: use one of {', '.join(STRATEGIES)}")
        if self.max_adapter_mb <= 0:
            raise ConfigError(f"--max-adapter-mb must be positive, got {self.max_adapter_mb}")

    def settings(self) -> RunSettings:
        return RunSettings(
            run_id=self.run_id, num_rounds=self.num_rounds, min_clients=self.min_clients,
            round_deadline_s=self.round_deadline_s, strategy=self.strategy,
            max_adapter_bytes=int(self.max_adapter_mb * 1024 * 1024), seed=self.seed,
        )


class Aggregator:
    """The running aggregator: the gRPC service plus the ticker that enforces round deadlines."""

    def __init__(self, config: AggregatorConfig):
        self.config = config
        self.federation = Federation(config.settings(), Store(pathlib.Path(config.state_dir), config.run_id))
        self.service = Service("aggregator", config.address)
        fpb_grpc.add_FederationServiceServicer_to_server(FederationServicer(self.federation), self.service.server)
        self.port = self.service.port
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="round-ticker", daemon=True)

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self.federation.tick()

    def start(self) -> "Aggregator":
        self.service.start()
        self._ticker.start()
        self.service.ready(["fedse.v1.FederationService"])
        return self

    def wait(self) -> None:
        """Serves until SIGTERM or SIGINT, then shuts down gracefully."""
        self.service.wait_for_termination()
        self._stop.set()

    def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        self.service.stop(grace)


def create_server(config: AggregatorConfig) -> tuple[Aggregator, int]:
    agg = Aggregator(config)
    return agg, agg.port
