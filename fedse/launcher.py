"""The whole federation on one machine: real processes talking gRPC on loopback.

Starts one env_server per client agent (hosting that client's environments), the aggregator(s),
and the client agents (each its own process, as each is its own pod in k8s/), shows a table of
held-out success per environment and round as the clients report it, stops everything on Ctrl-C,
and writes results.json and success.png to the results folder.

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
import shutil
import signal
import subprocess
import sys
import time
from typing import IO, Any

from fedse.config import ConfigError, field
from fedse.machine import available_cores
from fedse.pretrained import check_base_model

SERVICE_START_S = 120.0
TOPOLOGIES = ("federated", "local", "centralized")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Run a whole Fed-SE federation locally (the embedded tiny model unless --base-model is a path)."""

    envs: str = field("maze,wordle,babyai,textcraft,webshop", "environments (one client each; one for all of them "
                                                              "with --topology centralized)")
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
    epochs: int = field(2, "epochs over the buffer per round")
    wordle_vocab_size: int = field(100, "Wordle's guessable vocabulary size")
    seed: int = field(0, "seed of everything")
    round_deadline_s: float = field(1800.0, "round deadline at the aggregator")

    def __post_init__(self) -> None:
        if not self.env_list():
            raise ConfigError("--envs is empty: name at least one environment, e.g. maze,wordle")
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be at least 1, got {self.rounds}")
        if self.explore_tasks < 0:
            raise ConfigError(f"--explore-tasks must not be negative, got {self.explore_tasks}")
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        check_base_model(self.base_model)  # here, not in each client process after the others have started

    def env_list(self) -> list[str]:
        return [e.strip() for e in self.envs.split(",") if e.strip()]


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

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


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

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for env, rows in sorted(results["envs"].items()):
        xs = [r["round"] for r in rows if "test_success" in r]
        ys = [100 * r["test_success"] for r in rows if "test_success" in r]
        ax.plot(xs, ys, marker="o", label=env)
    mean = results.get("mean_test_success", [])
    if mean:
        ax.plot(range(len(mean)), [100 * m for m in mean], color="black", linestyle="--", marker="s", label="mean")
    ax.set_xlabel("round (0 = base model, before any training)")
    ax.set_ylabel("held-out success (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(f"Fed-SE, {results['base_model']}, {results['topology']}, {len(results['envs'])} environments, "
                 f"{results['strategy']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect(reports: list[dict[str, Any]], client_envs: dict[str, tuple[str, ...]], cfg: RunConfig,
            wall_s: float) -> dict[str, Any]:
    """The run's results (results.json), what `fedse run` and the experiment driver read:

    {"config": the RunConfig as a dict, "topology", "base_model", "strategy", "rounds", "wall_s",
     "envs": {env: [{"round", "test_success" (that environment's held-out success), "test_tasks"
              (its test tasks evaluated), "upload_bytes" (bytes of the adapter its client uploaded
              that round; absent in the final, evaluation-only round), and its client's other
              metrics: "train_loss", "buffer", "kept", "eval_s", ...}, one per round 0..rounds]},
     "mean_test_success": [per round from 0, micro-averaged over all test tasks, while every
                           environment has reported]}
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
            "mean_test_success": mean}


def run(cfg: RunConfig, out: IO[str] = sys.stdout) -> dict[str, Any]:
    results_dir = pathlib.Path(cfg.results)
    state = results_dir / "state"
    logs = results_dir / "logs"
    shutil.rmtree(state, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    feds = plan(cfg)
    members = [(f, c) for f in feds for c in f.clients]
    client_envs = {c.client_id: c.envs for _, c in members}
    procs: list[Proc] = []
    started = time.monotonic()

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    def start(name: str, argv: list[str]) -> Proc:
        procs.append(Proc(name, argv, logs))
        return procs[-1]

    try:
        env_servers = {
            c: start(f"env_server-{c.label}", [
                "services.env_server", "--address", "127.0.0.1:0", "--envs", ",".join(c.envs), "--metrics-port", "-1",
                "--seed", str(cfg.seed), "--wordle-vocab-size", str(cfg.wordle_vocab_size)])
            for _, c in members}
        aggregators = {
            f.name: start(f.name, [
                "services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1",
                "--state-dir", str(state / f.name), "--run-id", f.run_id, "--num-rounds", str(cfg.rounds),
                "--min-clients", str(len(f.clients)), "--round-deadline-s", str(cfg.round_deadline_s),
                "--strategy", cfg.strategy, "--seed", str(cfg.seed)])
            for f in feds}
        env_ports = {c: p.port() for c, p in env_servers.items()}
        agg_ports = {name: p.port() for name, p in aggregators.items()}
        say(f"env servers on {', '.join(f'{c.label}:{port}' for c, port in env_ports.items())}; "
            + ", ".join(f"{name} on {port}" for name, port in agg_ports.items()))
        # The clients share this machine's cores; each gets its share (at least one thread).
        threads = max(1, available_cores() // len(members))
        clients = [start(f"client_agent-{c.label}", [
            "services.client_agent", "--client-id", c.client_id, "--env", ",".join(c.envs),
            "--env-server", f"127.0.0.1:{env_ports[c]}", "--aggregator", f"127.0.0.1:{agg_ports[f.name]}",
            "--address", "127.0.0.1:0", "--metrics-port", "-1", "--state-dir", str(state / "clients"),
            "--base-model", cfg.base_model, "--expert-demos", str(cfg.expert_demos),
            "--explore-tasks", str(cfg.explore_tasks), "--eval-tasks", str(cfg.eval_tasks),
            "--keep", cfg.keep, "--history", cfg.history, "--lora-r", str(cfg.lora_r),
            "--lora-alpha", str(cfg.lora_alpha), "--lr", str(cfg.lr), "--epochs", str(cfg.epochs),
            "--seed", str(cfg.seed), "--torch-threads", str(threads)]) for f, c in members]
        say(f"{len(clients)} clients started ({', '.join(client_envs)}); logs in {logs}/")
        metrics_paths = [state / f.name / f.run_id / "metrics.jsonl" for f in feds]

        def reports() -> list[dict[str, Any]]:
            return [r for path in metrics_paths for r in read_metrics(path)]

        shown = -1
        while True:
            seen = reports()
            if len(seen) != shown:
                shown = len(seen)
                say(f"\n[{time.monotonic() - started:6.1f}s] held-out success per environment and round\n"
                    + success_table(env_rows(seen, client_envs), cfg.env_list(), cfg.rounds))
            failed = [c for c in clients if c.popen.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"{failed[0].name} exited with {failed[0].popen.returncode}; "
                                   f"see {failed[0].log_path}")
            if all(c.popen.poll() == 0 for c in clients):
                break
            time.sleep(1.0)
        results = collect(reports(), client_envs, cfg, time.monotonic() - started)
        (results_dir / "results.json").write_text(json.dumps(results, indent=2))
        plot(results, results_dir / "success.png")
        mean = results["mean_test_success"]
        if mean:
            say(f"\nmean held-out success: {100 * mean[0]:.1f}% before round 1 -> {100 * mean[-1]:.1f}% after round "
                f"{len(mean) - 1}")
        say(f"done in {results['wall_s']:.0f}s; wrote {results_dir / 'results.json'} and {results_dir / 'success.png'}")
        return results
    finally:
        for p in reversed(procs):
            p.stop()
