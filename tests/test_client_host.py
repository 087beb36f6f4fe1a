"""A client host (`fedse client-host`) runs many client agents in one process over one base model, each
a client of its own over real gRPC: real processes throughout (env server, aggregator, host), the
tiny model, maze, the aggregator sampling a few members per round.

- 20 members, 3 a round: a host ends with each member's buffer and last adapter, and the run's final
  global adapter, byte for byte those of the same federation run as 20 separate `fedse client`
  processes; every member joins, the selected ones play their rounds, the others do no work (no
  exploration, no training, no upload: their buffers hold only their seed demonstrations), and every
  member's lines in the host's log name it. So does a host SIGKILLed mid-round (a member has explored
  round 1, not trained) and started again with the same flags (the strongest check that sharing the
  model and being killed changed nothing).
- In process (instant): which members a host holds and what it refuses; a member that fails leaves
  the others running; a member's log lines (those of threads it starts too) carry its client id."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import threading

import pytest

from apps.processes import Proc, stop_all
from fedse.config import ConfigError
from fedse.splits import member_id
from services.client_host.config import HostConfig
from services.client_host.members import Member, tag_member_logs
from support import wait_for

ROUNDS = 2
BUDGET = ["--expert-demos", "2", "--explore-tasks", "2", "--eval-tasks", "2", "--epochs", "1", "--torch-threads", "1",
          "--heartbeat-interval-s", "0.5"]


def shares(k: int, total: int) -> list[str]:
    """The --task-share a host gives member k of `total`."""
    return ["--task-share", f"{k}/{total}"]


class Federation:
    """An env server and an aggregator that samples `per_round` of `members` clients each round."""

    def __init__(self, root: pathlib.Path, members: int, per_round: int):
        self.root, self.members = root, members
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.procs: list[Proc] = []
        env = self.start("env_server", ["services.env_server", "--address", "127.0.0.1:0", "--envs", "maze",
                                        "--metrics-port", "-1"])
        agg = self.start("aggregator", [
            "services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1", "--state-dir",
            str(root / "aggregator"), "--run-id", "r", "--rounds", str(ROUNDS), "--min-clients", str(per_round),
            "--start-clients", str(members), "--selector", "sample", "--clients-per-round", str(per_round),
            "--round-deadline-s", "600", "--heartbeat-timeout-s", "120"])
        self.common = ["--env", "maze", "--env-server", f"127.0.0.1:{env.port()}", "--aggregator",
                       f"127.0.0.1:{agg.port()}", "--address", "127.0.0.1:0", "--metrics-port", "-1",
                       "--state-dir", str(root / "clients"), *BUDGET]

    def start(self, name: str, argv: list[str]) -> Proc:
        p = Proc(f"{name}-{len(self.procs)}", argv, self.logs)
        self.procs.append(p)
        return p

    def host(self) -> Proc:
        return self.start("host", ["services.client_host", "--client-id", "org", "--members", str(self.members),
                                   *self.common])

    def clients(self) -> list[Proc]:
        return [self.start(f"org-{k}", ["services.client_agent", "--client-id", self.member_id(k),
                                        *shares(k, self.members), *self.common]) for k in range(self.members)]

    def member_id(self, k: int) -> str:
        return member_id("org", k, self.members)

    def member_dir(self, k: int) -> pathlib.Path:
        return self.root / "clients" / self.member_id(k)

    def finish(self, procs: list[Proc], timeout: float = 240.0) -> None:
        wait_for("every client to finish", lambda: all(p.popen.poll() == 0 for p in procs), timeout, procs)

    def accepted(self, round_: int) -> set[str]:
        folder = self.root / "aggregator" / "r" / "uploads" / f"round_{round_:04d}"
        return {p.stem for p in folder.glob("*.json") if not p.name.endswith(".part.json")}

    def outcome(self) -> dict[str, object]:
        """What the clients computed: each member's buffer and last adapter, and the final global adapter."""
        files = {f"{self.member_id(k)}/{name}": (self.member_dir(k) / name).read_bytes()
                 for k in range(self.members) for name in ("buffer.jsonl", "upload.safetensors")
                 if (self.member_dir(k) / name).exists()}
        final = self.root / "aggregator" / "r" / "global" / f"round_{ROUNDS:04d}" / "adapter_model.safetensors"
        return {"files": files, "global": final.read_bytes()}

    def stop(self) -> None:
        stop_all(self.procs)


def progress(member_dir: pathlib.Path) -> dict:
    try:
        return json.loads((member_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


MEMBERS, PER_ROUND = 20, 3


@pytest.fixture(scope="module")
def separate(tmp_path_factory) -> dict[str, object]:
    """The reference: 20 members as 20 `fedse client` processes, 3 a round, never interrupted (budget: 45 s
    on an idle 2-core machine, 2 min on a busy one: each process loads the model)."""
    fed = Federation(tmp_path_factory.mktemp("separate"), members=MEMBERS, per_round=PER_ROUND)
    try:
        fed.finish(fed.clients())
        outcome = fed.outcome()
        assert sum(name.endswith("upload.safetensors") for name in outcome["files"]) >= PER_ROUND  # members trained
        return outcome
    finally:
        fed.stop()


@pytest.mark.slow
def test_a_host_killed_mid_round_resumes_to_what_separate_processes_compute(tmp_path, separate):
    """Budget: 25 s idle, 75 s busy (the host twice: killed in round 1, then to the end), after the reference."""
    fed = Federation(tmp_path, members=MEMBERS, per_round=PER_ROUND)
    try:
        host = fed.host()
        # Killed once a member explored round 1: its training (a second or more) has not ended, so the
        # round cannot have closed (its upload comes after it).
        wait_for("a member to explore round 1", lambda: any(
            progress(fed.member_dir(k)).get("round") == 1 and progress(fed.member_dir(k)).get("phase") == "explored"
            for k in range(MEMBERS)), procs=[host])
        os.kill(host.popen.pid, signal.SIGKILL)
        host.popen.wait()
        assert not (tmp_path / "aggregator" / "r" / "global" / "round_0002").exists(), "killed after round 1 closed"
        again = fed.host()
        fed.finish([again])
        resumed = [json.loads(line) for line in again.log_path.read_text().splitlines() if line.startswith("{")]
        assert any(e["msg"] == "resuming" and e.get("round") == 1 for e in resumed), "no member resumed round 1"
        assert fed.outcome() == separate
    finally:
        fed.stop()


@pytest.mark.slow
def test_a_host_of_20_members_computes_what_20_processes_compute_and_plays_only_the_selected_rounds(
        tmp_path, separate):
    """Budget: 20 s idle, 60 s busy (one host, 20 members, 3 of them a round, 2 rounds, the final evaluation),
    after the reference."""
    fed = Federation(tmp_path, members=MEMBERS, per_round=PER_ROUND)
    try:
        host = fed.host()
        fed.finish([host])
        entries = [json.loads(line) for line in host.log_path.read_text().splitlines() if line.startswith("{")]
        # Each member's buffer and last adapter, and the run's final global adapter, byte for byte.
        assert fed.outcome() == separate
    finally:
        fed.stop()
    ids = [fed.member_id(k) for k in range(MEMBERS)]
    selected = {r: fed.accepted(r) for r in range(ROUNDS)}
    assert all(len(s) == PER_ROUND for s in selected.values()), selected
    worked = {(e["client_id"], e["round"]) for e in entries
              if e["msg"] == "progress" and e.get("phase") in ("exploring", "training")}
    assert worked == {(cid, r) for r, s in selected.items() for cid in s}
    for k, cid in enumerate(ids):
        p = progress(fed.member_dir(k))
        assert (p["round"], p["phase"]) == (ROUNDS, "reported"), (cid, p)
        rounds = {json.loads(line)["round"] for line in (fed.member_dir(k) / "buffer.jsonl").read_text().splitlines()}
        if any(cid in s for s in selected.values()):
            assert (fed.member_dir(k) / "upload.safetensors").exists(), cid
        else:  # sat every round out: its seed demonstrations only, no adapter trained
            assert rounds == {-1} and not (fed.member_dir(k) / "upload.safetensors").exists(), cid
        # its final evaluation, in the host's log under its id
        assert any(e["msg"] == "round done" and e.get("client_id") == cid and e.get("round") == ROUNDS
                   for e in entries), cid
    assert {e["client_id"] for e in entries if e["msg"] == "joined"} == set(ids)


def test_members_ids_shares_and_what_a_host_refuses():
    """Budget: instant (configs only)."""
    pod = HostConfig(client_id="org", members=3, member_offset=1, member_stride=4, members_total=12)
    assert pod.numbers() == [1, 5, 9]
    assert [c.client_id for c in pod.member_configs()] == ["org-01", "org-05", "org-09"]
    assert [c.task_share for c in pod.member_configs()] == ["1/12", "5/12", "9/12"]  # member k of all members
    assert HostConfig(members=10).member_id(9) == "client-09"
    assert HostConfig(members=101).member_id(9) == "client-009"
    for bad in (dict(members=0), dict(guardian=True, lora_r=0), dict(reset_privacy_ledger=True),
                dict(members=3, members_total=2), dict(member_stride=0)):
        with pytest.raises(ConfigError):
            HostConfig(**bad)


class FakeAgent:
    def __init__(self, fail: bool):
        self.fail, self.closed = fail, False

    def run(self):
        logging.getLogger("client_agent").info("working")
        ticker = threading.Thread(target=lambda: logging.getLogger("client_agent").info("ticking"))
        ticker.start()
        ticker.join()
        if self.fail:
            raise RuntimeError("boom")

    def close(self):
        self.closed = True


def test_a_failing_member_leaves_the_others_and_every_line_names_its_member(caplog):
    """Budget: instant (two members' threads with fake agents)."""
    caplog.set_level(logging.INFO)
    tag_member_logs()  # on the root's handlers, caplog's among them
    ok, bad = Member("org-0", FakeAgent(False)), Member("org-1", FakeAgent(True))
    for m in (ok, bad):
        m.start()
    for m in (ok, bad):
        m.thread.join(10)
    assert ok.done and ok.failure is None and ok.agent.closed
    assert not bad.done and bad.failure == "RuntimeError: boom" and bad.agent.closed
    named = {(r.getMessage(), r.fields.get("client_id")) for r in caplog.records if hasattr(r, "fields")}
    assert {("working", "org-0"), ("ticking", "org-0"), ("working", "org-1"), ("ticking", "org-1"),
            ("member failed; the others go on", "org-1")} <= named
