"""The whole federation on one machine: real processes talking gRPC on loopback.

Starts one env_server per client agent (hosting that client's environments), the aggregator(s),
and the client agents (each its own process, as each is its own pod in k8s/), shows a table of
held-out success per environment and round as the clients report it, stops everything on Ctrl-C,
and writes results.json and success.png to the results folder.

A client agent that dies (killed by the out-of-memory killer, a crash) does not sink the run: the
launcher says which client failed and why (exit status or signal, the last lines and the last error
of its log), and the others go on. Each aggregator opens round 0 only once every one of its clients
has joined (--start-clients), but closes a round as soon as every client it still hears from has
uploaded (--min-clients 1, heartbeats every HEARTBEAT_INTERVAL_S, silence of HEARTBEAT_TIMEOUT_S
counts as dead), so after a death rounds close with the survivors within seconds while a healthy
run waits for everyone (up to --round-deadline-s). A federation goes on while one of its clients
lives; one whose client died before joining can never open round 0, so its other clients are
stopped. Whatever ends the run (every client done, a failure, Ctrl-C), results.json and
success.png hold every round every client reported, and results.json says which clients failed;
the mean over environments is given for the rounds every environment reported (collect()).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import time
from typing import IO, Any

from fedse.config import to_argv
from fedse.machine import available_cores
from fedse.progress import EVERY_S as PROGRESS_EVERY_S
from apps.logs import progress_lines
from apps.planning import (Client, Federation, RunConfig, aggregator_config, client_config, env_server_config,
                           plan)
from apps.processes import Proc, stop_all
from apps.results import (Failure, collect, describe_failure, env_rows, failure_text, plot, read_metrics, reported,
                          shortfall, success_table)


def unopenable(fed: Federation, run_dir: pathlib.Path, failed: set[str]) -> str:
    """Why `fed` can never open round 0 ("" if it can or did): a client of it failed before joining,
    and its aggregator opens round 0 only once every client has joined (run.json: the state and
    the clients that joined)."""
    dead = [c.client_id for c in fed.clients if c.client_id in failed]
    if not dead:
        return ""
    try:
        saved = json.loads((run_dir / "run.json").read_text())
    except FileNotFoundError:
        saved = {}  # nobody has joined yet
    if saved.get("state", "waiting_for_clients") != "waiting_for_clients":
        return ""
    missing = [cid for cid in dead if cid not in saved.get("clients", {})]
    return (f"{', '.join(missing)} failed before joining, and {fed.name} opens round 0 only once every "
            "client has joined") if missing else ""


def run(cfg: RunConfig, out: IO[str] = sys.stdout) -> dict[str, Any]:
    """Runs the federation until every client agent has exited, then writes and returns its results
    (collect()). A client that fails is reported and recorded, and the others go on; on Ctrl-C (or
    any other exception) the results so far are written before the exception goes on up."""
    results_dir = pathlib.Path(cfg.results)
    state = results_dir / "state"
    logs = results_dir / "logs"
    shutil.rmtree(state, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    feds = plan(cfg)
    members = [(f, c) for f in feds for c in f.clients]
    client_envs = {c.client_id: c.envs for _, c in members}
    metrics_paths = [state / f.name / f.run_id / "metrics.jsonl" for f in feds]
    procs: list[Proc] = []
    clients: dict[Client, Proc] = {}
    failed: list[Failure] = []
    halted: set[str] = set()  # clients the launcher stopped (their federation could not go on)
    stops: list[str] = []  # why the launcher ended (part of) the run early
    started = time.monotonic()

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    def start(name: str, service: str, config: Any) -> Proc:
        """Starts `fedse SERVICE` with the flags of its config, logging to logs/NAME.log."""
        procs.append(Proc(name, ["apps.cli", service, *to_argv(config)], logs))
        return procs[-1]

    def reports() -> list[dict[str, Any]]:
        return [r for path in metrics_paths for r in read_metrics(path)]

    try:
        env_servers = {c: start(f"env_server-{c.label}", "env-server", env_server_config(cfg, c)) for _, c in members}
        aggregators = {f.name: start(f.name, "aggregator", aggregator_config(cfg, f, state)) for f in feds}
        env_ports = {c: p.port() for c, p in env_servers.items()}
        agg_ports = {name: p.port() for name, p in aggregators.items()}
        say(f"env servers on {', '.join(f'{c.label}:{port}' for c, port in env_ports.items())}; "
            + ", ".join(f"{name} on {port}" for name, port in agg_ports.items()))
        # The clients share this machine's cores; each gets its share (at least one thread).
        threads = max(1, available_cores() // len(members))
        clients = {c: start(f"client_agent-{c.label}", "client", client_config(
            cfg, c, f"127.0.0.1:{env_ports[c]}", f"127.0.0.1:{agg_ports[f.name]}", state, threads)) for f, c in members}
        say(f"{len(clients)} clients started ({', '.join(client_envs)}); logs in {logs}/")

        shown = -1
        said_at = time.monotonic()
        progress_seen: dict[str, str] = {}
        while True:
            known = {f.client_id for f in failed} | halted
            dead = [(c, p) for c, p in clients.items() if c.client_id not in known and p.popen.poll() not in (None, 0)]
            seen = reports()  # read after the polls: it holds every report a dead client had acknowledged
            new = [describe_failure(c, p, seen) for c, p in dead]
            failed += new
            for f in new:
                alive = [c.client_id for c, p in clients.items() if p.popen.poll() is None]
                say(f"\n{failure_text(f)}\n" + (f"the run goes on with {', '.join(alive)}" if alive
                                                 else "no client is left"))
            for fed in feds:
                why = unopenable(fed, state / fed.name / fed.run_id, {f.client_id for f in failed})
                live = [c for c in fed.clients if clients[c].popen.poll() is None]
                if why and live:
                    say(f"\nstopping {', '.join(c.client_id for c in live)}: {why}")
                    for c in live:
                        clients[c].stop()
                        halted.add(c.client_id)
                    stops.append(why)
            if len(seen) != shown or new:
                shown = len(seen)
                say(f"\n[{time.monotonic() - started:6.1f}s] held-out success per environment and round\n"
                    + success_table(env_rows(seen, client_envs), cfg.env_list(), cfg.rounds)
                    + "".join(f"\n{f.client_id} failed ({f.reason}); it {reported(f)}" for f in failed))
                said_at = time.monotonic()
            elif time.monotonic() - said_at >= PROGRESS_EVERY_S:
                said_at = time.monotonic()
                lines = progress_lines(clients, progress_seen)
                if lines:
                    say(f"[{time.monotonic() - started:6.1f}s] " + "\n          ".join(lines))
            if all(p.popen.poll() is not None for p in clients.values()):
                break
            time.sleep(1.0)
    except BaseException as exc:
        stops.append("interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}")
        raise
    finally:
        stop_all(list(reversed(procs)))
        results = collect(reports(), client_envs, cfg, time.monotonic() - started, failed, "; ".join(stops))
        (results_dir / "results.json").write_text(json.dumps(results, indent=2))
        plot(results, results_dir / "success.png")
        mean = results["mean_test_success"]
        if len(mean) > 1:
            say(f"\nmean held-out success: {100 * mean[0]:.1f}% before round 1 -> {100 * mean[-1]:.1f}% after round "
                f"{len(mean) - 1}")
        elif mean:
            say(f"\nmean held-out success before round 1: {100 * mean[0]:.1f}%")
        if mean and len(mean) <= cfg.rounds:
            say(f"no mean after round {len(mean) - 1}: an environment did not report it")
        if not results["complete"]:
            say(f"\nthe run did not finish: {shortfall(results)}")
        say(f"done in {results['wall_s']:.0f}s; wrote "
            f"{results_dir / 'results.json'} and {results_dir / 'success.png'}")
    return results
