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

--topology says who federates with whom, which is all that tells the paper's methods apart beside
the client settings (--explore-tasks, --keep, --history, --lora-r): "federated" (one client per
environment, one aggregator: Fed-SE, FedIT), "local" (each client alone with its own aggregator,
nothing averaged across clients: Local) or "centralized" (one client holding every environment:
Centralized).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import IO, Any, Sequence

from fedse.config import SCORINGS, ConfigError, field
from fedse.machine import available_cores
from fedse.progress import EVERY_S as PROGRESS_EVERY_S, describe, last_progress, tail_lines
from fedse.pretrained import check_base_model
from fedse.tinymodel import TINY_MODEL_NAME, names_tiny_model

SERVICE_START_S = 120.0
TOPOLOGIES = ("federated", "local", "centralized")
# Liveness at the aggregator: clients beat every HEARTBEAT_INTERVAL_S; one silent for
# HEARTBEAT_TIMEOUT_S (several missed beats, so a busy but live client is not taken for dead) is
# not waited for, which is how long a round can wait for a client that died.
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TIMEOUT_S = 15.0
LOG_TAIL_BYTES = 64 * 1024  # how much of a failed client's log is read for its last lines


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Run a whole Fed-SE federation locally (the embedded tiny model unless --base-model is a path)."""

    envs: str = field("maze,wordle,babyai,textcraft,webshop", "environment specs, comma-separated (one client each; "
                                                              "one for all of them with --topology centralized): a "
                                                              "built-in or installed plugin by name, "
                                                              "NAME=package.module:factory or "
                                                              "NAME=agentgym:PROFILE@URL, each with ?KEY=VALUE&... "
                                                              "options (e.g. wordle?vocab_size=30)")
    demos: str = field("", "demonstration files (AgentGym's AgentTraj JSON or JSONL) as ENV=PATH pairs, "
                           "comma-separated: the client holding ENV seeds its buffer from PATH (--demos)")
    rounds: int = field(5, "federated rounds T")
    results: str = field("results", "folder for results.json, success.png, logs and state")
    base_model: str = field("fedse-tiny", "'fedse-tiny' (built in code) or a local Hugging Face model directory "
                                          "(`make model` writes models/smollm2-135m-instruct)")
    strategy: str = field("fedavg", "aggregation strategy: fedavg, weighted, exact, median or trimmed_mean")
    expert_demos: int = field(20, "expert demonstrations per client (D_0)")
    explore_tasks: int = field(16, "training tasks each client attempts per round and environment (0 = none: "
                                   "train on the expert demonstrations only)")
    topology: str = field("federated", "'federated' (one client per environment, one aggregator), 'local' (each "
                                       "client alone with its own aggregator) or 'centralized' (one client "
                                       "holding every environment)")
    keep: str = field("successes", "explored trajectories each client keeps: 'successes' or 'all' (no filter)")
    history: str = field("cumulative", "what each client trains on: 'cumulative' (its whole buffer) or 'round' "
                                       "(expert demonstrations plus the round's kept trajectories)")
    lora_r: int = field(8, "LoRA rank")
    lora_alpha: int = field(16, "LoRA alpha")
    eval_tasks: int = field(20, "held-out test tasks per evaluation (0 = all)")
    lr: float = field(3e-3, "client AdamW learning rate")
    policy: str = field("score", "how clients act: 'score' (rank admissible actions by likelihood) or 'generate' "
                                 "(write the action, matched to an admissible one)")
    precision: str = field("auto", "clients' model precision: 'auto' (bf16 autocast for a real model on a CPU with "
                                   "native bfloat16), 'fp32' or 'bf16'")
    epochs: int = field(2, "epochs over the buffer per round")
    scoring: str = field("auto", "what clients rank admissible actions by: 'sum' (log-likelihood) or 'calibrated' "
                                 "(less the log-likelihood after an empty prompt), for all, or per environment as "
                                 "env=rule pairs (the others: sum); 'auto' = babyai=calibrated with the embedded "
                                 "tiny model, sum with a real one")
    seed: int = field(0, "seed of everything")
    round_deadline_s: float = field(1800.0, "round deadline at the aggregator: a round closes then without the "
                                            "clients that have not uploaded")

    def __post_init__(self) -> None:
        if not self.env_list():
            raise ConfigError("--envs is empty: name at least one environment, e.g. maze,wordle")
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be at least 1, got {self.rounds}")
        if self.explore_tasks < 0:
            raise ConfigError(f"--explore-tasks must not be negative, got {self.explore_tasks}")
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if self.policy not in ("score", "generate"):
            raise ConfigError(f"--policy must be 'score' or 'generate', got {self.policy!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"--precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}")
        specs = self.env_specs()
        from services.env_server import registry

        try:  # here, once (each factory imports and takes its options), not in each server after others started
            for text in specs.values():
                registry.check(registry.parse_spec(text), self.seed)
        except registry.RegistryError as exc:
            raise ConfigError(f"--envs: {exc}") from None

        unknown = set(scoring_rules(self.scoring)) - {"", *specs, *registry.known_names()}
        if unknown:
            raise ConfigError(f"--scoring names {', '.join(sorted(unknown))}: environments are "
                              f"{', '.join(specs)}")
        demos = self.demo_files()
        if set(demos) - set(specs):
            raise ConfigError(f"--demos names {', '.join(sorted(set(demos) - set(specs)))}: this run's environments "
                              f"are {', '.join(specs)}")
        from services.client_agent.demos import load_demos

        for env, paths in demos.items():  # every record checked before any process starts
            load_demos(paths, [env])
        check_base_model(self.base_model)  # here, not in each client process after the others have started

    def env_specs(self) -> dict[str, str]:
        """Each environment's name and its spec as the env server takes it (parsed only: __post_init__
        checked that each can be served); ConfigError for a malformed spec."""
        from services.env_server import registry

        try:
            return {spec.name: spec.text for spec in registry.parse_specs(self.envs)}
        except registry.RegistryError as exc:
            raise ConfigError(f"--envs: {exc}") from None

    def env_list(self) -> list[str]:
        return list(self.env_specs()) if self.envs.strip() else []

    def demo_files(self) -> dict[str, list[str]]:
        """ENV -> its demonstration files, in the order given."""
        out: dict[str, list[str]] = {}
        for part in (p.strip() for p in self.demos.split(",") if p.strip()):
            env, sep, path = part.partition("=")
            if not sep or not env.strip() or not path.strip():
                raise ConfigError(f"--demos {part!r}: write ENV=PATH pairs separated by commas, e.g. "
                                  "maze=demos/maze.json")
            out.setdefault(env.strip(), []).append(path.strip())
        return out


@dataclasses.dataclass(frozen=True)
class Client:
    """A client agent to start: its id and the environments it holds (its env server hosts them)."""

    client_id: str
    envs: tuple[str, ...]

    @property
    def label(self) -> str:
        """Names its processes and logs: env_server-maze, client_agent-maze+wordle."""
        return "+".join(self.envs)


@dataclasses.dataclass(frozen=True)
class Federation:
    """One aggregator (process and state folder `name`, run `run_id`) and the clients that join it."""

    name: str
    run_id: str
    clients: tuple[Client, ...]


def plan(cfg: RunConfig) -> list[Federation]:
    """The aggregators and clients of cfg.topology."""
    envs = cfg.env_list()
    if cfg.topology == "local":
        return [Federation(f"aggregator-{e}", f"local-{e}", (Client(f"org-{e}", (e,)),)) for e in envs]
    if cfg.topology == "centralized":
        return [Federation("aggregator", "local", (Client("org-central", tuple(envs)),))]
    return [Federation("aggregator", "local", tuple(Client(f"org-{e}", (e,)) for e in envs))]


# Seconds a stopping process gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 10.0


class Proc:
    """A service process whose stdout (JSON logs) goes to a file."""

    def __init__(self, name: str, argv: list[str], log_dir: pathlib.Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen([sys.executable, "-m", *argv], stdout=self._log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True)

    def port(self, timeout: float = SERVICE_START_S) -> int:
        """The gRPC port the service logged once serving (services bind port 0 here)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and "port" in entry:
                    return int(entry["port"])
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}; see {self.log_path}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not start within {timeout:.0f}s; see {self.log_path}")

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        stop_all([self], timeout)


def stop_all(procs: list[Proc], timeout: float = STOP_GRACE_S) -> None:
    """SIGTERM to every process at once, then at most `timeout` seconds for all of them together
    before SIGKILL: stopping a federation takes one grace period, not one per process."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
        p._log.close()


def read_metrics(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


@dataclasses.dataclass(frozen=True)
class Failure:
    """A client agent that exited non-zero: who, how, and what its log said last (results.json's
    failed_clients)."""

    client_id: str
    process: str  # its process and log name, e.g. client_agent-wordle
    envs: tuple[str, ...]  # the environments it held
    exit_code: int  # the process's return code; negative: killed by that signal
    reason: str  # "killed by SIGKILL (out of memory?)", "exited with status 1"
    last_round: int | None  # the last round it reported (None: none)
    error: str  # the last error or exception in its log ("" if none)
    last_lines: tuple[str, ...]  # its log's last meaningful lines
    log: str  # its log's path


def exit_reason(returncode: int) -> str:
    """How a process ended, from its return code (negative: the signal that killed it)."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")
TRACEBACK_HEADERS = ("Traceback (most recent call last)", "During handling of the above", "The above exception was")
LOG_KEYS = ("ts", "level", "service", "logger", "msg", "exc")


def condense(lines: list[str]) -> list[str]:
    """Text that is not a JSON log line (what Python printed on its way out, mostly tracebacks) as
    the lines worth showing: a traceback's frames are left out and its exception line kept, with
    the lines that carry on its message (a gRPC error's status and details) joined to it."""
    out: list[str] = []
    carry = False
    for line in lines:
        if not line.strip() or line.startswith(TRACEBACK_HEADERS):
            carry = False
        elif carry:
            out[-1] += " " + line.strip()
        elif not line[0].isspace():
            out.append(line.strip())
            carry = bool(EXCEPTION_LINE.match(line))
    return out


def log_summary(path: pathlib.Path, lines: int = 3, width: int = 160) -> tuple[tuple[str, ...], str]:
    """(the last `lines` meaningful lines, the last error) of a service's log, each at most `width`
    characters. JSON log lines are shown as "level: msg key=value ... (exception)", other text as
    condense() leaves it. The error is the last error-level entry, entry with an exception, or
    exception line ("" if none)."""
    text = tail_lines(path, LOG_TAIL_BYTES)
    if text is None:
        return (), ""
    items: list[tuple[str, bool]] = []  # (line to show, whether it is an error)
    block: list[str] = []  # consecutive lines that are not JSON

    def flush() -> None:
        items.extend((t, bool(EXCEPTION_LINE.match(t))) for t in condense(block))
        block.clear()

    for line in text:
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if not isinstance(entry, dict):
            block.append(line)
            continue
        flush()
        extra = "".join(f" {k}={v}" for k, v in entry.items() if k not in LOG_KEYS)
        exc = condense(str(entry.get("exc", "")).splitlines())
        items.append((f"{entry.get('level', '?')}: {entry.get('msg', '')}{extra}" + (f" ({exc[-1]})" if exc else ""),
                      entry.get("level") in ("error", "critical") or bool(exc)))
    flush()
    error = next((t for t, is_error in reversed(items) if is_error), "")

    def cut(text: str) -> str:
        return text if len(text) <= width else text[: width - 3] + "..."

    return tuple(cut(t) for t, _ in items[-lines:]), cut(error)


def env_rows(reports: list[dict[str, Any]],
             client_envs: dict[str, tuple[str, ...]]) -> dict[str, list[dict[str, Any]]]:
    """Per environment, one row per round its client reported (the last report of a round counts):
    that environment's test_success and test_tasks (from test_success/<env>, test_tasks/<env>) and
    the client's other metrics (upload_bytes, train_loss, ...), which a Centralized client's
    environments share."""
    latest = {(r["client_id"], r["round"]): r["metrics"] for r in reports if r["client_id"] in client_envs}
    envs: dict[str, list[dict[str, Any]]] = {}
    for (cid, rnd), m in sorted(latest.items()):
        shared = {k: v for k, v in m.items() if not k.startswith(("test_success", "test_tasks/"))}
        for env in client_envs[cid]:
            envs.setdefault(env, []).append({"round": rnd, **shared, "test_success": m[f"test_success/{env}"],
                                             "test_tasks": m[f"test_tasks/{env}"]})
    return envs


def round_mean(rows: dict[str, list[dict[str, Any]]], envs: list[str], rnd: int) -> float | None:
    """Round `rnd`'s success micro-averaged over the test tasks of every environment (successes over
    tasks, as the paper averages); None until every environment has reported the round."""
    found = [row for env in envs for row in rows.get(env, []) if row["round"] == rnd]
    if len(found) < len(envs):
        return None
    tasks = sum(row["test_tasks"] for row in found)
    return sum(row["test_success"] * row["test_tasks"] for row in found) / max(1.0, tasks)


def success_table(rows: dict[str, list[dict[str, Any]]], envs: list[str], rounds: int) -> str:
    envs = sorted(envs)
    by = {(env, row["round"]): row["test_success"] for env in envs for row in rows.get(env, [])}
    width = max(8, *(len(e) for e in envs))
    head = "round | " + " | ".join(f"{e:>{width}}" for e in envs) + " | " + f"{'mean':>{width}}"
    lines = [head, "-" * len(head)]
    for rnd in range(rounds + 1):
        cells = [f"{100 * by[e, rnd]:>{width - 1}.1f}%" if (e, rnd) in by else f"{'-':>{width}}" for e in envs]
        mean = round_mean(rows, envs, rnd)
        cells.append(f"{100 * mean:>{width - 1}.1f}%" if mean is not None else f"{'-':>{width}}")
        lines.append(f"{rnd:>5} | " + " | ".join(cells))
    return "\n".join(lines)


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lost = {env for f in results["failed_clients"] for env in f["envs"]}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for env, rows in sorted(results["envs"].items()):
        xs = [r["round"] for r in rows if "test_success" in r]
        ys = [100 * r["test_success"] for r in rows if "test_success" in r]
        ax.plot(xs, ys, marker="o", label=f"{env} (client failed)" if env in lost else env)
    mean = results.get("mean_test_success", [])
    if mean:
        ax.plot(range(len(mean)), [100 * m for m in mean], color="black", linestyle="--", marker="s", label="mean")
    ax.set_xlabel("round (0 = base model, before any training)")
    ax.set_ylabel("held-out success (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(f"Fed-SE, {pathlib.Path(results['base_model']).name}, {results['topology']}, "
                 f"{len(results['envs'])} environments, {results['strategy']}")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TINY_SCORING = "babyai=calibrated"  # what --scoring auto means for the embedded tiny model (README)


def scoring_rules(spec: str, base_model: str = TINY_MODEL_NAME) -> dict[str, str]:
    """--scoring as {environment: rule}; the key "" holds the rule of environments not named."""
    if spec.strip() == "auto":
        spec = TINY_SCORING if names_tiny_model(base_model) else "sum"
    if "=" not in spec:
        rules = {"": spec.strip()}
    else:
        rules = {"": "sum"}
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            env, sep, rule = part.partition("=")
            if not sep or not env.strip():
                raise ConfigError(f"--scoring {spec!r}: write one rule (sum or calibrated) or env=rule pairs "
                                  f"separated by commas, e.g. babyai=calibrated,webshop=calibrated")
            rules[env.strip()] = rule.strip()
    for env, rule in rules.items():
        if rule not in SCORINGS:
            raise ConfigError(f"--scoring {spec!r}: {rule!r} is not a rule; use one of {', '.join(SCORINGS)}")
    return rules


def scoring_for(spec: str, envs: Sequence[str], base_model: str = TINY_MODEL_NAME) -> str:
    """The --scoring rule of a client holding `envs`: theirs where they all have the same, else sum."""
    rules = scoring_rules(spec, base_model)
    chosen = {rules.get(e, rules[""]) for e in envs}
    return chosen.pop() if len(chosen) == 1 else "sum"


def collect(reports: list[dict[str, Any]], client_envs: dict[str, tuple[str, ...]], cfg: RunConfig,
            wall_s: float, failed: Sequence[Failure] = (), stopped: str = "") -> dict[str, Any]:
    """The run's results (results.json), what `fedse run` and the experiment driver read:

    {"config": the RunConfig as a dict, "topology", "base_model", "strategy", "rounds", "wall_s",
     "envs": {env: [{"round", "test_success" (that environment's held-out success), "test_tasks"
              (its test tasks evaluated), "upload_bytes" (bytes of the adapter its client uploaded
              that round; absent in the final, evaluation-only round), and its client's other
              metrics: "train_loss", "buffer", "kept", "eval_s", ...}, one per round its client
              reported: 0..rounds, fewer if the client failed (an environment whose client reported
              nothing is absent)]},
     "mean_test_success": [per round from 0, micro-averaged over all test tasks, while every
                           environment has reported: a round that a failed client did not report
                           has no mean, as it would average fewer environments than round 0's],
     "complete": every client finished every round (no client failed, the run was not stopped),
     "failed_clients": [Failure as a dict: client_id, process, envs, exit_code, reason, last_round
                        (the last round it reported, null if none), error, last_lines, log],
     "stopped": why the run was ended before its clients finished ("" if it was not)}
    """
    envs = env_rows(reports, client_envs)
    mean: list[float] = []
    for rnd in range(cfg.rounds + 1):
        m = round_mean(envs, cfg.env_list(), rnd)
        if m is None:
            break
        mean.append(m)
    return {"config": dataclasses.asdict(cfg), "topology": cfg.topology, "base_model": cfg.base_model,
            "strategy": cfg.strategy, "rounds": cfg.rounds, "wall_s": round(wall_s, 1), "envs": envs,
            "mean_test_success": mean, "complete": not failed and not stopped,
            "failed_clients": [dataclasses.asdict(f) for f in failed], "stopped": stopped}


def shortfall(results: dict[str, Any]) -> str:
    """Why a run did not finish, in one line ("" if it did)."""
    why = [f"{f['client_id']} failed ({f['reason']})" for f in results["failed_clients"]]
    return "; ".join(why + ([results["stopped"]] if results["stopped"] else []))


def describe_failure(client: Client, proc: Proc, reports: list[dict[str, Any]]) -> Failure:
    """The Failure of a client agent whose process exited non-zero."""
    code = proc.popen.returncode
    lines, error = log_summary(proc.log_path)
    last = max((r["round"] for r in reports if r["client_id"] == client.client_id), default=None)
    return Failure(client.client_id, proc.name, client.envs, code, exit_reason(code), last, error, lines,
                   str(proc.log_path))


def reported(f: Failure) -> str:
    """Which round a failed client reported last, as words."""
    return f"reported round {f.last_round} last" if f.last_round is not None else "reported no round"


def failure_text(f: Failure) -> str:
    """What `fedse run` says when a client fails: who, how, and how its log ends."""
    lines = [f"client {f.client_id} ({'+'.join(f.envs)}) failed: {f.reason}, exit code {f.exit_code}; it "
             f"{reported(f)}", f"  last error: {f.error or '(none logged)'}", f"  its log {f.log} ends with:"]
    return "\n".join(lines + [f"    {line}" for line in f.last_lines])


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


def progress_lines(clients: dict[Client, Proc], seen: dict[str, str]) -> list[str]:
    """What each running client agent is doing, from the last progress line of its log, for those
    whose line changed since `seen` (updated)."""
    lines = []
    for c, p in clients.items():
        entry = last_progress(p.log_path) if p.popen.poll() is None else None
        text = describe(entry) if entry else ""
        if text and seen.get(c.client_id) != text:
            seen[c.client_id] = text
            lines.append(f"{c.client_id}: {text}")
    return lines


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

    def start(name: str, argv: list[str]) -> Proc:
        procs.append(Proc(name, argv, logs))
        return procs[-1]

    def reports() -> list[dict[str, Any]]:
        return [r for path in metrics_paths for r in read_metrics(path)]

    specs, demos = cfg.env_specs(), cfg.demo_files()
    try:
        env_servers = {
            c: start(f"env_server-{c.label}", [
                "services.env_server", "--address", "127.0.0.1:0", "--envs", ",".join(specs[e] for e in c.envs),
                "--metrics-port", "-1", "--seed", str(cfg.seed)])
            for _, c in members}
        # Round 0 waits for every client to join; a round closes once every client still heard from
        # has uploaded, so without one that died; the deadline alone cuts a healthy round short.
        aggregators = {
            f.name: start(f.name, [
                "services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1",
                "--state-dir", str(state / f.name), "--run-id", f.run_id, "--num-rounds", str(cfg.rounds),
                "--start-clients", str(len(f.clients)), "--min-clients", "1",
                "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S), "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
                "--round-deadline-s", str(cfg.round_deadline_s), "--wait-after-min-s", str(cfg.round_deadline_s),
                "--strategy", cfg.strategy, "--seed", str(cfg.seed)])
            for f in feds}
        env_ports = {c: p.port() for c, p in env_servers.items()}
        agg_ports = {name: p.port() for name, p in aggregators.items()}
        say(f"env servers on {', '.join(f'{c.label}:{port}' for c, port in env_ports.items())}; "
            + ", ".join(f"{name} on {port}" for name, port in agg_ports.items()))
        # The clients share this machine's cores; each gets its share (at least one thread).
        threads = max(1, available_cores() // len(members))
        clients = {c: start(f"client_agent-{c.label}", [
            "services.client_agent", "--client-id", c.client_id, "--env", ",".join(c.envs),
            "--env-server", f"127.0.0.1:{env_ports[c]}", "--aggregator", f"127.0.0.1:{agg_ports[f.name]}",
            "--address", "127.0.0.1:0", "--metrics-port", "-1", "--state-dir", str(state / "clients"),
            "--base-model", cfg.base_model, "--expert-demos", str(cfg.expert_demos),
            "--explore-tasks", str(cfg.explore_tasks), "--eval-tasks", str(cfg.eval_tasks),
            "--keep", cfg.keep, "--history", cfg.history, "--lora-r", str(cfg.lora_r),
            "--lora-alpha", str(cfg.lora_alpha), "--lr", str(cfg.lr), "--epochs", str(cfg.epochs),
            "--policy", cfg.policy, "--precision", cfg.precision,
            "--scoring", scoring_for(cfg.scoring, c.envs, cfg.base_model),
            "--seed", str(cfg.seed), "--torch-threads", str(threads),
            *[arg for e in c.envs for path in demos.get(e, []) for arg in ("--demos", path)]]) for f, c in members}
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
