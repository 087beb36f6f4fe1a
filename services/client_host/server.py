"""The client host's process: its health server and metrics, the base model loaded once, then every
member agent's run, each in its own thread (main)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from fedse.config import ConfigError, parse_or_exit
from fedse.machine import available_cores
from fedse.progress import PhaseProgress
from fedse.security.admission import shown_for
from fedse.transport.serving import log_fields, setup_logging, start_metrics

from services.client_agent.metrics import HOST_MEMBERS as MEMBERS
from services.client_agent.server import config_error, open_health
from services.client_host.config import HostConfig
from services.client_host.members import MEMBER_ATTR, Member, tag_member_logs

# Left out of --help: what the host sets for each member itself (--task-share: member k of
# --members-total), and what a host refuses (HostConfig: one client's certificate, guardian or ledger reset).
NOT_SHOWN = ("task_share", "tls_cert", "tls_key", "guardian", "guardian_model", "guardian_notes",
             "reset_privacy_ledger")


def serve(config: HostConfig) -> int:
    """Runs the client host: its health server at once, then each member's run until all ended or SIGTERM
    (which stops them all: each resumes where it was when the host starts again). Exit status 0 when every
    member finished its run (or SIGTERM stopped them); 1 when one failed (the others went on), each failed
    member and why on stderr; 2 for a setting that cannot work, before any member joins."""
    setup_logging("client_host", config.log_level)
    tag_member_logs()
    log = logging.getLogger("client_host")
    metrics_port = start_metrics(config.metrics_port)
    configs: list = []
    opened = open_health("client_host", config, lambda: configs.extend(config.member_configs()))
    if isinstance(opened, int):
        return opened
    health, demos = opened
    import torch  # heavy imports (torch, transformers) after the port is bound

    from services.client_agent.agent import ClientAgent
    from services.client_agent.model.shared import SharedModel

    def on_signal(signum, _frame):
        log.info("stopping", extra=log_fields(signal=signum))
        health.stop(0)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    torch.set_num_threads(config.torch_threads or available_cores())  # once, for every member
    try:
        with PhaseProgress(log, "loading the model", None, "", base_model=config.base_model):
            shared = SharedModel.load(configs[0])
    except ConfigError as exc:  # a --base-model that is no model directory
        health.stop(0)
        return config_error(exc)
    members = [_member(ClientAgent, cfg, demos, shared) for cfg in configs]
    health.ready([])
    log.info("started", extra=log_fields(port=health.port, metrics_port=metrics_port, members=len(members),
                                         first=configs[0].client_id, last=configs[-1].client_id, env=config.env,
                                         base_model=config.base_model, device=str(shared.device)))
    stopped = False
    try:
        for m in members:
            m.start()
        _wait(members)
    except SystemExit:  # SIGTERM: every member stops where it is, and resumes there at the next start
        stopped = True
    failed = [m for m in members if m.failure is not None]  # before the channels close under the others
    for m in members:  # after SIGTERM: their heartbeats and channels (a finished member closed its own)
        if m.running:
            m.stop()
    if not stopped:
        health.stop(1)
    for m in failed:
        print(f"member {m.client_id} failed: {m.failure}", file=sys.stderr)
    log.info("stopped" if stopped else "run complete",
             extra=log_fields(members=len(members), failed=[m.client_id for m in failed]))
    return 1 if failed else 0


def _member(agent_class, cfg, demos, shared) -> Member:
    """Member `cfg`'s agent over the shared model; one that cannot be built is a failed member, not a
    failed host."""
    main = threading.current_thread()
    setattr(main, MEMBER_ATTR, cfg.client_id)  # the lines its agent logs while it is built name it
    try:
        return Member(cfg.client_id, agent_class(cfg, demos, shared))
    except Exception as exc:  # noqa: BLE001 - one member's failure must not end the others
        logging.getLogger("client_host").error("member could not start", extra=log_fields(
            reason=f"{type(exc).__name__}: {exc}"))
        return Member(cfg.client_id, failure=f"{type(exc).__name__}: {exc}")
    finally:
        delattr(main, MEMBER_ATTR)


def _wait(members: list[Member]) -> None:
    """Until every member's run ended, keeping the members gauge current (the main thread waits in short
    steps, so that SIGTERM's handler runs at once)."""
    while True:
        running = sum(m.running for m in members)
        failed = sum(m.failure is not None for m in members)
        MEMBERS.labels("running").set(running)
        MEMBERS.labels("failed").set(failed)
        MEMBERS.labels("done").set(sum(m.done for m in members))
        if not running:
            return
        time.sleep(0.5)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    shown = [name for name in shown_for(HostConfig, "client") if name not in NOT_SHOWN]
    return serve(parse_or_exit(HostConfig, argv, prog=prog, shown=shown))
