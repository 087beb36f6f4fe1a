"""The client agent's process: its health server and metrics, then the agent's run (main)."""

from __future__ import annotations

import logging
import pathlib
import signal
import sys
import threading

from fedse.config import ConfigError, parse_or_exit
from fedse.transport.reach import Unreachable
from fedse.security.admission import shown_for
from fedse.transport.serving import Service, log_fields, setup_logging, start_metrics

from services.client_agent.config import ClientConfig
from services.client_agent.federation.link import InsecureRun


def serve(config: ClientConfig) -> int:
    """Runs the client agent: its health server at once, then the run until it ends or SIGTERM. A
    setting that cannot work (a malformed --demos file, a --base-model that is no model) stops it
    with one line on stderr and exit status 2, before it joins a run; so do a connection that cannot
    be made and, with --require-secure-aggregation, a run that is not secure (right after Join)."""
    setup_logging("client_agent", config.log_level)
    log = logging.getLogger("client_agent")
    if config.reset_privacy_ledger:
        return reset_privacy_ledger(config)
    metrics_port = start_metrics(config.metrics_port)
    opened = open_health("client_agent", config)
    if isinstance(opened, int):
        return opened
    health, demos = opened
    from services.client_agent.agent import ClientAgent  # heavy imports (torch, transformers) after the port is bound

    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("stopping", extra=log_fields(signal=signum))
        stop.set()
        health.stop(0)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    try:
        agent = ClientAgent(config, demos)
    except ConfigError as exc:  # a --base-model that is no model directory shows only where it should load
        health.stop(0)
        return config_error(exc)
    health.ready([])
    log.info("started", extra=log_fields(port=health.port, metrics_port=metrics_port, client_id=config.client_id,
                                         env=config.env, base_model=config.base_model, device=str(agent.device)))
    failure = None
    try:
        agent.run()
    except Unreachable as exc:  # a channel that cannot be made: its reason and the flag to check
        failure = f"cannot connect: {exc.reason}"
    except InsecureRun as exc:  # this organisation's protection, not the aggregator's choice
        failure = f"refused: {exc}"
    finally:
        agent.close()
        if not stop.is_set():
            health.stop(1)
    if failure is not None:
        # Said once the channels are closed: gRPC logs each handshake a channel retries (a TLS client
        # against a plain server), which must not come after the line that says why.
        print(failure, file=sys.stderr)
        return 2
    log.info("run complete", extra=log_fields(client_id=config.client_id))
    return 0


def open_health(name: str, config: ClientConfig, check=None) -> tuple[Service, dict] | int:
    """The health server at once, then every --demos file read and checked (and `check()` run) before
    any model loads: (the started server, the demonstrations by environment), or exit status 2 with
    one line on stderr for an --address in use or a setting that cannot work."""
    try:
        health = Service(name, config.address, max_workers=2)
    except ConfigError as exc:  # --address in use
        return config_error(exc)
    health.start()
    from services.client_agent.training.demos import load_demos

    try:
        if check is not None:
            check()
        return health, load_demos(config.demos, config.env_list())
    except ConfigError as exc:
        health.stop(0)
        return config_error(exc)


def reset_privacy_ledger(config: ClientConfig) -> int:
    """--reset-privacy-ledger: the organisation's reset of its privacy budget (privacy.py). Moves the
    client's ledger aside and exits without joining (exit status 0), so that the flag, left set, never
    resets a running client's ledger; one line says where the old ledger is kept."""
    from services.client_agent.training.privacy import LEDGER_NAME, reset_ledger

    path = pathlib.Path(config.state_dir) / config.client_id / LEDGER_NAME
    kept = reset_ledger(path)
    if kept is None:
        print(f"no privacy ledger at {path}: nothing to reset", file=sys.stderr)
    else:
        print(f"privacy ledger reset: the old one is kept as {kept}; start the client again without "
              "--reset-privacy-ledger, and it spends its budget from zero", file=sys.stderr)
    return 0


def config_error(exc: ConfigError) -> int:
    """One line on stderr, as parse_or_exit writes a bad flag's; exit status 2."""
    print(f"configuration error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return serve(parse_or_exit(ClientConfig, argv, prog=prog, shown=shown_for(ClientConfig, "client")))
