"""The whole federation on one machine: real processes talking gRPC on loopback.

Starts one env_server per client agent (hosting that client's environments), the aggregator(s),
and the client agents (each its own process, as each is its own pod in k8s/), shows a table of
held-out success per environment and round as the clients report it, with what each client is
doing (apps.display: on a terminal, redrawn in place), stops everything on Ctrl-C, and writes
results.json and success.png to the results folder. Before it starts anything it says how long the
run should take on this machine (apps.estimate).

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
the mean over environments is given for the rounds every environment reported (collect()). The
launcher learns what the aggregators know (who joined, what each client reported) through their
GetRunStatus, as any operator's tool would; a status shows each client's latest report only, so a
resumed run's reports from before its interruption are read from the aggregators' state (each
report is recorded there once), and its results.json holds every round, as an uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
import time
from typing import IO, Any, Callable

from fedse.config import plain, to_argv
from fedse.machine import available_cores
from fedse.v1 import federation_pb2 as fpb
from apps.display import Display
from apps.estimate import estimate_line, machine_speed, run_seconds
from apps.logs import progress_texts
from apps.planning import (Client, Federation, RunConfig, aggregator_config, client_config, client_settings,
                           env_server_config, plan)
from apps.hosting import failed_members, host_config, host_plans
from apps.processes import Proc, stop_all
from services.aggregator.store import Store
from apps.results import (POLL_S, Failure, RunWatch, closing_words, collect, describe_failure, env_rows,
                          failure_text, plot, reported)


def unopenable(fed: Federation, status: fpb.RunStatus | None, failed: set[str]) -> str:
    """Why `fed` can never open round 0 ("" if it can or did): a client of it failed before joining,
    and its aggregator opens round 0 only once every client has joined (`status`, its run's: the
    state and the clients that joined; None before the aggregator first answered)."""
    dead = [c.client_id for c in fed.clients if c.client_id in failed]
    if not dead or (status is not None and status.round.state != fpb.ROUND_STATE_WAITING_FOR_CLIENTS):
        return ""
    joined = set(status.round.joined) if status is not None else set()
    missing = [cid for cid in dead if cid not in joined]
    return (f"{', '.join(missing)} failed before joining, and {fed.name} opens round 0 only once every "
            "client has joined") if missing else ""


# What a run writes to its folder, and so what --replace moves aside (other files stay).
RUN_FILES = ("run.json", "results.json", "success.png", "state", "logs")


class RunFolderError(RuntimeError):
    """--results names a folder whose run this one must not overwrite."""


def _as_json(value: Any) -> Any:
    return json.loads(json.dumps(plain(value)))


def _defaults() -> dict[str, Any]:
    return {f.name: _as_json(f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(RunConfig)}


def settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that shape a run (a RunConfig as a dict), as JSON holds them, less where it is
    written, what the trackers call it and how its folder was claimed, and less those at their
    defaults: a run resumes only one with equal settings, and one recorded before a setting existed
    equals one with that setting at its default (the behaviour it had then)."""
    defaults = _defaults()
    return {k: v for k, v in _as_json(config).items()
            if k not in ("results", "replace", "run_name") and not (k in defaults and v == defaults[k])}


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def earlier_run(folder: pathlib.Path) -> tuple[dict[str, Any] | None, bool] | None:
    """What `folder` holds of an earlier run: (its settings, None if none were recorded; whether it
    finished), None if nothing. run.json records the settings at start, so a run killed before
    writing results.json is still known; a results.json without "complete" (older launchers wrote
    one only for finished runs) counts as finished."""
    if not any((folder / name).exists() for name in RUN_FILES):
        return None
    results = _read_json(folder / "results.json")
    config = (_read_json(folder / "run.json") or {}).get("config") or (results or {}).get("config")
    return (settings(config) if config else None), bool(results and results.get("complete", True))


def resumes(cfg: RunConfig) -> bool:
    """Whether cfg.results holds an interrupted run with cfg's settings, which run() resumes."""
    earlier = earlier_run(pathlib.Path(cfg.results))
    return earlier is not None and not earlier[1] and earlier[0] == settings(dataclasses.asdict(cfg))


def move_aside(folder: pathlib.Path) -> pathlib.Path:
    """Moves the run's files (RUN_FILES) out of `folder` into a new sibling FOLDER.replaced-<time>;
    whatever else the folder holds stays."""
    stem = f"{folder.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, n = folder.with_name(stem), 1
    while aside.exists():
        n += 1
        aside = folder.with_name(f"{stem}-{n}")
    aside.mkdir(parents=True)
    for name in RUN_FILES:
        if (folder / name).exists():
            shutil.move(str(folder / name), str(aside / name))
    return aside


def claim(cfg: RunConfig, say: Any) -> None:
    """Makes cfg.results this run's folder without overwriting another run: an empty folder is
    taken; an interrupted run with the same settings is resumed (the services resume from their
    state directories; its logs are kept aside in the folder); with --replace, an earlier run's
    files are moved to RESULTS.replaced-<time>; else a finished run, or one with other or unknown
    settings, is refused (RunFolderError). Then records the settings in run.json, and each client's
    (planning.client_settings), which the aggregators record where the run is tracked."""
    folder = pathlib.Path(cfg.results)
    earlier = earlier_run(folder)
    mine = settings(dataclasses.asdict(cfg))
    if earlier is not None and cfg.replace:
        say(f"moved the earlier run in {folder} aside to {move_aside(folder)}")
    elif earlier is not None and earlier[1]:
        raise RunFolderError(f"{folder} holds a finished run: pass another --results, or --replace to move it "
                             "aside and start again")
    elif earlier is not None and earlier[0] != mine:
        other = ("unknown settings" if earlier[0] is None else "other settings ("
                 + ", ".join(f"--{k.replace('_', '-')}" for k in sorted({*mine, *earlier[0]})
                               if earlier[0].get(k) != mine.get(k)) + ")")
        raise RunFolderError(f"{folder} holds an interrupted run with {other}: pass its settings to resume it, "
                             "another --results, or --replace to move it aside")
    elif earlier is not None:
        kept = folder / "logs" / f"interrupted-{time.strftime('%Y%m%d-%H%M%S')}"
        for log in sorted((folder / "logs").glob("*.log")):  # the restarted processes write new ones
            kept.mkdir(exist_ok=True)
            log.rename(kept / log.name)
        say(f"resuming the interrupted run in {folder}")
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    every = {k: v for k, v in _as_json(dataclasses.asdict(cfg)).items() if k not in ("replace", "run_name")}
    (folder / "run.json").write_text(json.dumps({"config": every,
                                                 "clients": client_settings(cfg)}, indent=2))


class Launch:
    """One local run: its processes, what their aggregators show, the clients that failed and why
    the launcher ended (part of) the run early."""

    def __init__(self, cfg: RunConfig, out: IO[str], on_rows: Callable[[dict[str, list[dict[str, Any]]]], None] | None = None):
        self.cfg, self.out, self.on_rows = cfg, out, on_rows
        self.dir = pathlib.Path(cfg.results)
        self.state, self.logs = self.dir / "state", self.dir / "logs"
        self.feds = plan(cfg)
        self.client_envs = {c.client_id: c.envs for f in self.feds for c in f.clients}
        self.procs: list[Proc] = []  # every process, in the order started
        self.clients: dict[Client, Proc] = {}
        self.watch: RunWatch | None = None  # once the aggregators serve
        self.failed: list[Failure] = []
        self.halted: set[str] = set()  # clients the launcher stopped (their federation could not go on)
        self.stops: list[str] = []  # why the launcher ended (part of) the run early
        self.started = time.monotonic()
        self.display = Display(out, cfg.env_list(), cfg.rounds, self.started)

    def say(self, msg: str) -> None:
        self.display.say(msg)

    def process(self, name: str, service: str, config: Any) -> Proc:
        """`fedse SERVICE` started with the flags of its config, logging to logs/NAME.log."""
        self.procs.append(Proc(name, ["apps.cli", service, *to_argv(config)], self.logs))
        return self.procs[-1]

    def start(self) -> None:
        """Starts the env servers and aggregators, then, once they serve, the client agents; says
        first how long the run should take (apps.estimate)."""
        self.say(estimate_line(run_seconds(self.cfg, machine_speed())))
        members = [(f, c) for f in self.feds for c in f.clients]
        # One env server per set of environments: the members sharing an environment's tasks share its server.
        first = {c.envs: c for _, c in members}
        served = {envs: self.process(f"env_server-{'+'.join(envs)}", "env-server", env_server_config(self.cfg, c))
                  for envs, c in first.items()}
        agg_cfgs = {f.name: aggregator_config(self.cfg, f, self.state) for f in self.feds}
        aggregators = {name: self.process(name, "aggregator", c) for name, c in agg_cfgs.items()}
        ports = {envs: p.port() for envs, p in served.items()}
        env_ports = {c: ports[c.envs] for _, c in members}
        agg_ports = {name: p.port() for name, p in aggregators.items()}
        where = [f"{'+'.join(envs)}:{port}" for envs, port in ports.items()]
        self.say(f"env servers on {', '.join(where)}; "
                 + ", ".join(f"{name} on {port}" for name, port in agg_ports.items()))
        self.watch = RunWatch({name: f"127.0.0.1:{port}" for name, port in agg_ports.items()})
        for c in agg_cfgs.values():  # a resumed run's reports from before it was interrupted, from its state
            self.watch.add(Store(pathlib.Path(c.state_dir), c.run_id).metrics_reports())
        hosts = [(f, h) for f in self.feds for h in host_plans(f, self.cfg.members_per_host)]
        hosted = {c for _, h in hosts for c in h.clients}
        singles = [(f, c) for f, c in members if c not in hosted]
        # The client processes share this machine's cores; each gets its share (at least one thread).
        threads = max(1, available_cores() // (len(singles) + len(hosts)))
        config = lambda f, c: client_config(  # noqa: E731 - a host's from its first member's
            self.cfg, c, f"127.0.0.1:{env_ports[c]}", f"127.0.0.1:{agg_ports[f.name]}", self.state, threads)
        for f, c in singles:
            self.clients[c] = self.process(f"client_agent-{c.label}", "client", config(f, c))
        for f, h in hosts:
            proc = self.process(h.name, "client-host", host_config(config(f, h.clients[0]), h))
            self.clients.update({c: proc for c in h.clients})
        in_hosts = f" ({len(hosted)} of them in {len(hosts)} client hosts)" if hosts else ""
        shown = ", ".join(self.client_envs) if len(self.client_envs) <= 12 else f"{len(self.client_envs)} ids"
        self.say(f"{len(self.clients)} clients started{in_hosts} ({shown}); logs in {self.logs}/")

    def reports(self) -> list[dict[str, Any]]:
        return self.watch.reports() if self.watch else []

    def note_failures(self) -> list[Failure]:
        """The clients that exited non-zero since the last call, each reported as it is found."""
        known = {f.client_id for f in self.failed} | self.halted
        dead = [(c, p) for c, p in self.clients.items() if c.client_id not in known and p.popen.poll() not in (None, 0)]
        dead = [(c, p) for c, p in dead if c.client_id in self.lost_members(p)]
        self.watch.refresh()  # after the polls: it shows every report a dead client had acknowledged
        new = [describe_failure(c, p, self.reports()) for c, p in dead]
        self.failed += new
        for f in new:
            alive = [c.client_id for c, p in self.clients.items() if p.popen.poll() is None]
            self.say(f"\n{failure_text(f)}\n" + (f"the run goes on with {', '.join(alive)}" if alive
                                                 else "no client is left"))
        return new

    def lost_members(self, proc: Proc) -> list[str]:
        """The clients an exited process took down: a client process its client, a host those members
        it names as failed (hosting.failed_members)."""
        mine = [c.client_id for c, p in self.clients.items() if p is proc]
        if len(mine) == 1:
            return mine
        try:
            text = proc.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        return failed_members(text, mine)

    def stop_unopenable(self) -> None:
        """Stops the live clients of a federation that can never open round 0."""
        failed = {f.client_id for f in self.failed}
        for fed in self.feds:
            why = unopenable(fed, self.watch.status.get(fed.name), failed)
            live = [c for c in fed.clients if self.clients[c].popen.poll() is None]
            if why and live:
                self.say(f"\nstopping {', '.join(c.client_id for c in live)}: {why}")
                for c in live:
                    self.clients[c].stop()
                    self.halted.add(c.client_id)
                self.stops.append(why)

    def follow(self) -> None:
        """Until every client agent has exited: failures as they happen, the table of held-out
        success whenever a report comes in (on a terminal, redrawn in place), and what the clients
        are doing (apps.display)."""
        shown, read_at = -1, 0.0
        while True:
            new = self.note_failures()
            self.stop_unopenable()
            seen = self.reports()
            tick = time.monotonic() - read_at >= self.display.progress_every_s
            changed = len(seen) != shown or bool(new)
            if changed:
                shown = len(seen)
                self.show_table()
            if tick:
                read_at = time.monotonic()
                self.display.progress(progress_texts(self.clients))
            if self.on_rows is not None and (tick or changed):
                self.on_rows(env_rows(seen, self.client_envs))
            if all(p.popen.poll() is not None for p in self.clients.values()):
                return
            time.sleep(POLL_S)

    def show_table(self) -> None:
        self.display.table(env_rows(self.reports(), self.client_envs),
                           lost=[e for f in self.failed for e in f.envs],
                           notes=[f"{f.client_id} failed ({f.reason}); it {reported(f)}" for f in self.failed])

    def finish(self) -> dict[str, Any]:
        """Stops every process, then writes results.json and success.png and says how the run went.
        The clients stop first, so that the aggregators still show every report they acknowledged."""
        clients = list(dict.fromkeys(self.clients.values()))  # a host serves several
        stop_all(clients)
        if self.watch:
            self.watch.refresh()
            self.watch.close()
        stop_all([p for p in reversed(self.procs) if p not in clients])
        self.show_table()
        self.display.close()
        results = collect(self.reports(), self.client_envs, self.cfg, time.monotonic() - self.started, self.failed,
                          "; ".join(self.stops))
        (self.dir / "results.json").write_text(json.dumps(results, indent=2))
        plot(results, self.dir / "success.png")
        for line in closing_words(results):
            self.say(line)
        self.say(f"done in {results['wall_s']:.0f}s; wrote {self.dir / 'results.json'} and {self.dir / 'success.png'}")
        return results


def run(cfg: RunConfig, out: IO[str] = sys.stdout,
        on_rows: Callable[[dict[str, list[dict[str, Any]]]], None] | None = None) -> dict[str, Any]:
    """Runs the federation until every client agent has exited, then writes and returns its results
    (collect()). A client that fails is reported and recorded, and the others go on; on Ctrl-C (or
    any other exception) the results so far are written before the exception goes on up. It never
    overwrites another run's folder (claim()): it resumes an interrupted one with its settings.
    `on_rows`, if given, is called with the rows reported so far (results.env_rows) as reports come
    in and on the progress clock (how `fedse experiment` follows its runs)."""
    launch = Launch(cfg, out, on_rows)
    claim(cfg, launch.say)
    try:
        launch.start()
        launch.follow()
    except BaseException as exc:
        launch.stops.append("interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}")
        raise
    finally:
        results = launch.finish()
    return results
