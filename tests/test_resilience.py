"""A federation that survives real life, with real processes: the aggregator SIGKILLed mid-round
and restarted, a client SIGKILLed mid-round and restarted, the env server SIGKILLed mid-exploration
and restarted, and the operator's status command.

Two maze clients that differ in how many tasks they explore (so one uploads well before the
other) run three rounds of the tiny model against one env server and the aggregator; the env
server's restart is tried on a smaller federation (one client, one round).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from apps.processes import Proc
from fedse.transport.serving import insecure_channel
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from support import wait_for

pytestmark = pytest.mark.slow

ROUNDS = 3
CLIENTS = {"org-a": 2, "org-b": 10}  # client id -> explore tasks per round


class Federation:
    """One env server, the aggregator and client agents (id -> explore tasks per round) as processes,
    on loopback."""

    def __init__(self, root: pathlib.Path, clients: dict[str, int] = CLIENTS, rounds: int = ROUNDS,
                 client_flags: tuple[str, ...] = (), **aggregator_flags: str):
        self.root = root
        self.explore = clients
        self.rounds = rounds
        self.client_flags = list(client_flags)
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.env = self.start_env_server("0")
        self.agg_flags = ["--metrics-port", "-1", "--state-dir", str(root / "aggregator"), "--run-id", "r",
                          "--rounds", str(rounds), "--min-clients", str(len(clients)),
                          "--round-deadline-s", "600"]
        for k, v in aggregator_flags.items():
            self.agg_flags += [f"--{k.replace('_', '-')}", v]
        self.agg = self._start("aggregator", ["services.aggregator", "--address", "127.0.0.1:0", *self.agg_flags])
        self.agg_port = self.agg.port()
        self.env_port = self.env.port()
        self.clients = {cid: self.start_client(cid) for cid in clients}

    def _start(self, name: str, argv: list[str]) -> Proc:
        n = sum(p.name.startswith(name) for p in self.procs)
        p = Proc(f"{name}-{n}", argv, self.logs)
        self.procs.append(p)
        return p

    def start_env_server(self, port: str) -> Proc:
        return self._start("env_server", ["services.env_server", "--address", f"127.0.0.1:{port}", "--envs", "maze",
                                          "--metrics-port", "0"])

    def env_metrics_port(self) -> int:
        """The /metrics port the env server logged once serving (it binds port 0 here)."""
        return next(e["metrics_port"] for e in log_entries(self.env) if "metrics_port" in e)

    def restart_env_server(self) -> None:
        self.env = self.start_env_server(str(self.env_port))
        self.env.port()

    def start_client(self, cid: str) -> Proc:
        return self._start(cid, [
            "services.client_agent", "--client-id", cid, "--env", "maze", "--env-server", f"127.0.0.1:{self.env_port}",
            "--aggregator", f"127.0.0.1:{self.agg_port}", "--address", "127.0.0.1:0", "--metrics-port", "-1",
            "--state-dir", str(self.root / "clients"), "--expert-demos", "6", "--explore-tasks", str(self.explore[cid]),
            "--eval-tasks", "3", "--epochs", "1", "--torch-threads", "1", "--heartbeat-interval-s", "0.5",
            *self.client_flags])

    def restart_aggregator(self) -> None:
        self.agg = self._start("aggregator", ["services.aggregator", "--address", f"127.0.0.1:{self.agg_port}",
                                              *self.agg_flags])
        self.agg.port()

    @property
    def run_dir(self) -> pathlib.Path:
        return self.root / "aggregator" / "r"

    def accepted(self, round_: int) -> set[str]:
        folder = self.run_dir / "uploads" / f"round_{round_:04d}"
        return {p.stem for p in folder.glob("*.json") if not p.name.endswith(".part.json")} if folder.exists() else set()

    def wait_clients(self, timeout: float = 300.0) -> None:
        wait_for("the clients to finish", lambda: all(c.popen.poll() == 0 for c in self.clients.values()),
                 timeout, list(self.clients.values()))

    def final_adapter(self) -> bytes:
        return (self.run_dir / "global" / f"round_{self.rounds:04d}" / "adapter_model.safetensors").read_bytes()

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def log_entries(proc: Proc) -> list[dict]:
    out = []
    for line in proc.log_path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def open_sessions(metrics_port: int) -> float:
    """An env server's fedse_env_open_sessions, read from its /metrics as Prometheus would."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "fedse_env_open_sessions" for sample in family.samples)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> bytes:
    fed = Federation(tmp_path_factory.mktemp("plain"))
    try:
        fed.wait_clients()
        return fed.final_adapter()
    finally:
        fed.stop()


def test_aggregator_killed_mid_round_resumes_with_every_acknowledged_upload(tmp_path, uninterrupted):
    fed = Federation(tmp_path)
    try:
        # Round 1: org-a (2 tasks) has uploaded and been acknowledged, org-b (10 tasks) has not.
        wait_for("org-a's round-1 upload", lambda: "org-a" in fed.accepted(1), procs=list(fed.clients.values()))
        assert "org-b" not in fed.accepted(1), "org-b was too fast for a mid-round kill"
        os.kill(fed.agg.popen.pid, signal.SIGKILL)
        fed.agg.popen.wait()
        time.sleep(1.0)  # org-b's calls now fail and are retried with backoff
        fed.restart_aggregator()
        resumed = wait_for("the resume log line", lambda: next(
            (e for e in log_entries(fed.agg) if e.get("msg") == "run resumed"), None))
        assert resumed["round"] == 1 and resumed["uploads"] == 1  # the acknowledged upload was kept
        fed.wait_clients()
        # The same seeds give the same final adapter as the run that was never interrupted.
        assert fed.final_adapter() == uninterrupted
        # org-a's round-1 upload was stored once, not redone.
        closes = [e for e in log_entries(fed.agg) if e.get("msg") == "upload accepted" and e.get("round") == 1]
        assert [e["client"] for e in closes] == ["org-b"]
    finally:
        fed.stop()


def test_client_killed_mid_round_the_round_closes_at_quorum_and_it_rejoins(tmp_path):
    fed = Federation(tmp_path, min_clients="1", heartbeat_timeout_s="3", wait_after_min_s="600")
    try:
        # Kill org-b while it works on round 1; org-a's upload then closes the round without it.
        wait_for("round 1 to open", lambda: (fed.run_dir / "global" / "round_0001").exists(),
                 procs=list(fed.clients.values()))
        os.kill(fed.clients["org-b"].popen.pid, signal.SIGKILL)
        fed.clients["org-b"].popen.wait()
        wait_for("round 2 to open without org-b", lambda: (fed.run_dir / "global" / "round_0002").exists(),
                 procs=[fed.clients["org-a"]])
        assert fed.accepted(1) == {"org-a"}

        def close_reasons() -> list[str]:
            return [e["reason"] for e in log_entries(fed.agg) if e.get("msg") == "round closed"]
        # The round's folder may appear before its log line is written: wait for the line itself.
        wait_for("round 1's close to be logged", lambda: len(close_reasons()) >= 2, procs=[fed.clients["org-a"]])
        assert close_reasons()[1] == "all alive clients uploaded"

        # The operator sees org-b as not alive.
        out = subprocess.run([sys.executable, "-m", "apps.cli", "status", "--aggregator",
                              f"127.0.0.1:{fed.agg_port}", "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        alive = {c["clientId"]: c["alive"] for c in status["clients"]}
        assert alive == {"org-a": True, "org-b": False}
        assert status["round"]["round"] >= 2 and len(status["roundSeconds"]) >= 2
        table = subprocess.run([sys.executable, "-m", "apps.cli", "status", "--aggregator",
                                f"127.0.0.1:{fed.agg_port}"], capture_output=True, text=True, timeout=60)
        assert "org-b" in table.stdout and "NO" in table.stdout

        # Restarted, org-b rejoins, catches up with the open round and finishes the run.
        fed.clients["org-b"] = fed.start_client("org-b")
        fed.wait_clients()
        reports = [json.loads(line) for line in (fed.run_dir / "metrics.jsonl").read_text().splitlines()]
        b_rounds = sorted(r["round"] for r in reports if r["client_id"] == "org-b")
        assert ROUNDS in b_rounds and b_rounds.count(0) == 1  # finished rounds were not redone
        assert (fed.run_dir / "global" / f"round_{ROUNDS:04d}").exists()
    finally:
        fed.stop()


# One client exploring 16 tasks one at a time, so that its exploration lasts long enough to be cut, and
# training on every explored trajectory (--keep all), so that the adapter depends on each of them.
ENV_RESTART_CLIENTS = {"org-a": 16}
ENV_RESTART_FLAGS = ("--concurrency", "1", "--keep", "all")


def round_metrics(fed: Federation, round_: int) -> dict[str, float]:
    reports = [json.loads(line) for line in (fed.run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reports if r["round"] == round_)["metrics"]


@pytest.fixture(scope="module")
def uninterrupted_one_round(tmp_path_factory) -> tuple[bytes, dict[str, float]]:
    """The final adapter and round 0's metrics of the one-client, one-round federation."""
    fed = Federation(tmp_path_factory.mktemp("plain-one-round"), ENV_RESTART_CLIENTS, 1, ENV_RESTART_FLAGS)
    try:
        fed.wait_clients()
        return fed.final_adapter(), round_metrics(fed, 0)
    finally:
        fed.stop()


def test_env_server_killed_mid_exploration_and_restarted_the_agent_finishes_with_the_same_adapter(
        tmp_path, uninterrupted_one_round):
    """The agent used to exit 1 (UNAVAILABLE from Step: env calls were not retried). Now its calls wait
    for the server with backoff, the exploration whose sessions the restarted server lost starts again
    (no partial trajectory kept), and the run ends with the uninterrupted run's adapter, byte for byte."""
    fed = Federation(tmp_path, ENV_RESTART_CLIENTS, 1, ENV_RESTART_FLAGS)
    try:
        with insecure_channel(f"127.0.0.1:{fed.agg_port}") as channel:
            stub = fpb_grpc.FederationServiceStub(channel)

            def exploring() -> bool:
                try:
                    clients = stub.GetRunStatus(fpb.RunStatusRequest(), timeout=5).clients
                except grpc.RpcError:
                    return False
                return any(c.phase == "exploring" for c in clients)

            wait_for("org-a to explore", exploring, procs=[fed.clients["org-a"]])
        # The kill lands inside an episode, not before the first Reset: org-a is stopped (SIGSTOP) at a
        # moment the env server holds its session open, and goes on only once the server is dead.
        agent, metrics_port = fed.clients["org-a"].popen, fed.env_metrics_port()

        def stopped_inside_an_episode() -> bool:
            os.kill(agent.pid, signal.SIGSTOP)
            if open_sessions(metrics_port) > 0:
                return True
            os.kill(agent.pid, signal.SIGCONT)
            return False

        wait_for("an exploration episode under way", stopped_inside_an_episode, procs=[fed.clients["org-a"]])
        os.kill(fed.env.popen.pid, signal.SIGKILL)
        fed.env.popen.wait()
        os.kill(agent.pid, signal.SIGCONT)
        time.sleep(3.0)
        fed.restart_env_server()
        fed.wait_clients(timeout=120)
        plain_adapter, plain = uninterrupted_one_round
        assert fed.final_adapter() == plain_adapter
        entries = log_entries(fed.clients["org-a"])
        retried = [e for e in entries if e.get("msg") == "env server unavailable, retrying"]
        restarted = [e for e in entries if e.get("msg") == "env server lost our sessions; the episodes start again"]
        calls = {e["call"] for e in retried}
        assert calls and calls <= {"Reset", "Step", "Close"} and calls != {"Reset"}, calls  # inside an episode
        # A Step the restarted server cannot place plays the phase's episodes again; a Close alone (the
        # episode had ended when the server died) finds its session closed already, which it is.
        assert [e["phase"] for e in restarted] == (["explore"] if "Step" in calls else []), (calls, restarted)
        # Each task was kept once, as explored after the restart: nothing of the lost attempt was kept.
        got = round_metrics(fed, 0)
        assert {k: got[k] for k in ("kept", "buffer", "explore_success", "examples", "test_success")} == \
            {k: plain[k] for k in ("kept", "buffer", "explore_success", "examples", "test_success")}
    finally:
        fed.stop()
