"""The whole federation on one machine: real processes talking gRPC on loopback.

Starts one env_server per environment, the aggregator, and one client_agent per environment
(each its own process, as each is its own pod in k8s/), shows a table of held-out success per
environment and round as the clients report it, stops everything on Ctrl-C, and writes
results.json and success.png to the results folder.
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

SERVICE_START_S = 120.0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Run a whole Fed-SE federation locally (the embedded tiny model unless --base-model is a path)."""

    envs: str = field("maze,wordle,babyai,textcraft,webshop", "environments, one client each")
    rounds: int = field(5, "federated rounds T")
    results: str = field("results", "folder for results.json, success.png, logs and state")
    base_model: str = field("fedse-tiny", "'fedse-tiny' (built in code) or a local Hugging Face model directory")
    strategy: str = field("fedavg", "aggregation strategy: fedavg, weighted, exact, median or trimmed_mean")
    expert_demos: int = field(20, "expert demonstrations per client (D_0)")
    explore_tasks: int = field(16, "training tasks each client attempts per round")
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

    def env_list(self) -> list[str]:
        return [e.strip() for e in self.envs.split(",") if e.strip()]


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


def success_table(reports: list[dict[str, Any]], client_env: dict[str, str], rounds: int) -> str:
    envs = sorted(set(client_env.values()))
    by = {(client_env[r["client_id"]], r["round"]): r["metrics"] for r in reports if r["client_id"] in client_env}
    width = max(8, *(len(e) for e in envs))
    head = "round | " + " | ".join(f"{e:>{width}}" for e in envs) + " | " + f"{'mean':>{width}}"
    lines = [head, "-" * len(head)]
    for rnd in range(rounds + 1):
        cells, vals = [], []
        for e in envs:
            m = by.get((e, rnd))
            if m and "test_success" in m:
                vals.append(m["test_success"])
                cells.append(f"{100 * m['test_success']:>{width - 1}.1f}%")
            else:
                cells.append(f"{'-':>{width}}")
        mean = f"{100 * sum(vals) / len(vals):>{width - 1}.1f}%" if len(vals) == len(envs) else f"{'-':>{width}}"
        lines.append(f"{rnd:>5} | " + " | ".join(cells) + " | " + mean)
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
    ax.set_title(f"Fed-SE, {results['base_model']}, {len(results['envs'])} clients, {results['strategy']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect(reports: list[dict[str, Any]], client_env: dict[str, str], cfg: RunConfig, wall_s: float) -> dict[str, Any]:
    envs: dict[str, list[dict[str, float]]] = {}
    for r in sorted(reports, key=lambda r: (r["client_id"], r["round"])):
        if r["client_id"] in client_env:
            envs.setdefault(client_env[r["client_id"]], []).append({"round": r["round"], **r["metrics"]})
    mean: list[float] = []
    for rnd in range(cfg.rounds + 1):
        vals = [row["test_success"] for rows in envs.values() for row in rows if row["round"] == rnd]
        if len(vals) == len(client_env):
            mean.append(sum(vals) / len(vals))
    return {"config": dataclasses.asdict(cfg), "base_model": cfg.base_model, "strategy": cfg.strategy,
            "rounds": cfg.rounds, "wall_s": round(wall_s, 1), "envs": envs, "mean_test_success": mean}


def run(cfg: RunConfig, out: IO[str] = sys.stdout) -> dict[str, Any]:
    results_dir = pathlib.Path(cfg.results)
    state = results_dir / "state"
    logs = results_dir / "logs"
    shutil.rmtree(state, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    envs = cfg.env_list()
    procs: list[Proc] = []
    started = time.monotonic()

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    try:
        env_ports = {}
        for env in envs:
            p = Proc(f"env_server-{env}", ["services.env_server", "--address", "127.0.0.1:0", "--envs", env,
                                           "--metrics-port", "-1", "--seed", str(cfg.seed),
                                           "--wordle-vocab-size", str(cfg.wordle_vocab_size)], logs)
            procs.append(p)
        agg = Proc("aggregator", ["services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1",
                                  "--state-dir", str(state / "aggregator"), "--run-id", "local",
                                  "--num-rounds", str(cfg.rounds), "--min-clients", str(len(envs)),
                                  "--round-deadline-s", str(cfg.round_deadline_s), "--strategy", cfg.strategy,
                                  "--seed", str(cfg.seed)], logs)
        procs.append(agg)
        for env, p in zip(envs, procs):
            env_ports[env] = p.port()
        agg_port = agg.port()
        say(f"env servers on {', '.join(f'{e}:{p}' for e, p in env_ports.items())}; aggregator on {agg_port}")
        client_env: dict[str, str] = {}
        clients: list[Proc] = []
        for env in envs:
            cid = f"org-{env}"
            client_env[cid] = env
            c = Proc(f"client_agent-{env}", [
                "services.client_agent", "--client-id", cid, "--env", env,
                "--env-server", f"127.0.0.1:{env_ports[env]}", "--aggregator", f"127.0.0.1:{agg_port}",
                "--address", "127.0.0.1:0", "--metrics-port", "-1", "--state-dir", str(state / "clients"),
                "--base-model", cfg.base_model, "--expert-demos", str(cfg.expert_demos),
                "--explore-tasks", str(cfg.explore_tasks), "--eval-tasks", str(cfg.eval_tasks),
                "--lr", str(cfg.lr), "--epochs", str(cfg.epochs), "--seed", str(cfg.seed), "--torch-threads", "1"],
                logs)
            procs.append(c)
            clients.append(c)
        say(f"{len(clients)} clients started ({', '.join(client_env)}); logs in {logs}/")
        metrics_path = state / "aggregator" / "local" / "metrics.jsonl"
        shown = -1
        while True:
            reports = read_metrics(metrics_path)
            if len(reports) != shown:
                shown = len(reports)
                say(f"\n[{time.monotonic() - started:6.1f}s] held-out success per environment and round\n"
                    + success_table(reports, client_env, cfg.rounds))
            failed = [c for c in clients if c.popen.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"{failed[0].name} exited with {failed[0].popen.returncode}; "
                                   f"see {failed[0].log_path}")
            if all(c.popen.poll() == 0 for c in clients):
                break
            time.sleep(1.0)
        reports = read_metrics(metrics_path)
        results = collect(reports, client_env, cfg, time.monotonic() - started)
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
