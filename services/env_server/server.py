"""The env server process: configuration, server construction, serving until SIGTERM."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from typing import Sequence

from fedse.config import ConfigError, field, parse_or_exit
from fedse.security.admission import Security, server_credentials, server_interceptors, shown_for
from fedse.transport.serving import Service, log_fields, setup_logging, start_metrics
from fedse.v1 import env_pb2_grpc

from . import registry
from .servicer import SERVICE_NAME, EnvServicer
from .sessions import SessionManager

log = logging.getLogger("env_server")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclasses.dataclass(frozen=True)
class EnvServerConfig(Security):
    """Serves text environments (AgentGym semantics) over gRPC: fedse.v1.EnvService."""

    address: str = field("0.0.0.0:50051", "gRPC listen address host:port (port 0 picks a free one)")
    envs: str = field("maze,wordle", "comma-separated environment specs to host: a built-in "
                                     f"({','.join(registry.BUILTIN_NAMES)}) or installed plugin by name, "
                                     "NAME=package.module:factory or NAME=agentgym:PROFILE@URL, each with "
                                     "?KEY=VALUE&... options for its factory (e.g. wordle?vocab_size=30)")
    metrics_port: int = field(9100, "Prometheus /metrics port (0 picks a free one, -1 disables)")
    session_ttl_s: float = field(600.0, "seconds a session may idle before the server closes it")
    max_sessions: int = field(1024, "most sessions open at once; Reset beyond it is RESOURCE_EXHAUSTED")
    seed: int = field(0, "seed of the task splits (the same seed gives the same tasks)")
    log_level: str = field("INFO", f"log level, one of {', '.join(LOG_LEVELS)}")
    health_address: str = field("", "extra plain-gRPC address serving only the health service, for Kubernetes "
                                    "probes when TLS is on (empty = none)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if ":" not in self.address or not self.address.rsplit(":", 1)[1].isdigit():
            raise ConfigError(f"address: expected host:port, got {self.address!r}")
        try:
            specs = registry.parse_specs(self.envs)
            if not specs:
                raise registry.RegistryError(f"name at least one of {', '.join(registry.known_names())}")
            for spec in specs:
                registry.check(spec, self.seed)
        except registry.RegistryError as exc:
            raise ConfigError(f"envs: {exc}") from None
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: expected -1 (off), 0 (any) or a port up to 65535, got {self.metrics_port}")
        if not self.session_ttl_s > 0:
            raise ConfigError(f"session_ttl_s: expected a positive number of seconds, got {self.session_ttl_s}")
        if self.max_sessions < 1:
            raise ConfigError(f"max_sessions: expected at least 1, got {self.max_sessions}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level: expected one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def env_specs(self) -> list[registry.EnvSpec]:
        return registry.parse_specs(self.envs)

    @property
    def env_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.env_specs)


class EnvServer(Service):
    """The gRPC server plus the thread that expires idle sessions (started and stopped with it)."""

    def __init__(self, config: EnvServerConfig, manager: SessionManager):
        super().__init__("env_server", config.address, credentials=server_credentials(config),
                         interceptors=server_interceptors(config), health_address=config.health_address)
        self.manager = manager
        env_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(manager), self.server)
        self._sweep_every = min(manager.ttl_s / 2, 30.0)
        self._stop_sweeping = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="env_server-sweeper", daemon=True)

    def start(self) -> None:
        super().start()
        self._sweeper.start()

    def stop(self, grace: float = 5.0) -> None:
        self._stop_sweeping.set()
        super().stop(grace)
        if self._sweeper.is_alive():
            self._sweeper.join()

    def _sweep_loop(self) -> None:
        while not self._stop_sweeping.wait(self._sweep_every):
            try:
                self.manager.sweep()
            except Exception:  # a failed sweep must not stop later ones; lazy expiry still holds
                log.exception("session sweep failed")


def create_server(config: EnvServerConfig) -> tuple[EnvServer, int]:
    """Builds the environments and a bound, not yet started server; returns it and its port.
    registry.RegistryError if an environment's factory fails."""
    envs = {spec.name: registry.build(spec, config.seed) for spec in config.env_specs}
    manager = SessionManager(envs, ttl_s=config.session_ttl_s, max_sessions=config.max_sessions)
    server = EnvServer(config, manager)
    return server, server.port


def serve(config: EnvServerConfig) -> int:
    """Runs the env server until SIGTERM or SIGINT."""
    setup_logging("env_server", config.log_level)
    metrics_port = start_metrics(config.metrics_port)
    try:
        server, port = create_server(config)
    except registry.RegistryError as exc:
        log.error("cannot build an environment", extra=log_fields(error=str(exc)))
        print(f"configuration error: envs: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # e.g. a --tls-key that is not --tls-cert's
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    server.stop_on_signals()
    server.start()
    server.ready([SERVICE_NAME])
    log.info("serving", extra=log_fields(port=port, metrics_port=metrics_port, envs=[
        {"name": e.name, "has_expert": e.has_expert, "lists_actions": e.lists_actions}
        for e in server.manager.environments()]))
    server.wait_for_termination()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    return serve(parse_or_exit(EnvServerConfig, argv, prog=prog, shown=shown_for(EnvServerConfig, "server")))
