"""`fedse run` with several members per environment: members in client hosts (--members-per-host)
keep the ids, task shares and state directories they have as processes of their own; the launcher
learns from a host which of its members failed; and a real run with one environment's members in
two hosts beside an ordinary client finishes with every member's reports, one env server per
environment."""

from __future__ import annotations

import io
import json

import pytest

from apps.hosting import failed_members, host_config, host_plans
from apps.launcher import run
from apps.planning import RunConfig, client_config, plan
from apps.results import env_rows, round_mean
from fedse.config import ConfigError

TINY = dict(rounds=1, expert_demos=2, explore_tasks=2, eval_tasks=2, epochs=1)


def test_members_go_to_hosts_as_a_statefulsets_pods_hold_them(tmp_path):
    cfg = RunConfig(envs="maze:5,wordle", members_per_host=2, results=str(tmp_path))
    [fed] = plan(cfg)
    hosts = host_plans(fed, cfg.members_per_host)
    assert [(h.name, [c.client_id for c in h.clients]) for h in hosts] == [
        ("client_host-maze-0", ["org-maze-00", "org-maze-03"]), ("client_host-maze-1", ["org-maze-01", "org-maze-04"]),
        ("client_host-maze-2", ["org-maze-02"])]  # org-wordle, alone in its environment, stays a process
    member = client_config(cfg, hosts[1].clients[0], "127.0.0.1:1", "127.0.0.1:2", tmp_path, threads=1)
    host = host_config(member, hosts[1])
    assert [(c.client_id, c.task_share, c.state_dir) for c in host.member_configs()] == [
        ("org-maze-01", "1/5", member.state_dir), ("org-maze-04", "4/5", member.state_dir)]
    assert host_plans(fed, 0) == []


def test_a_host_names_the_members_it_lost_else_every_one_is_lost():
    log = "...\nmember org-maze-01 failed: RuntimeError: boom\nmember org-other-1 failed: x\n"
    assert failed_members(log, ["org-maze-00", "org-maze-01"]) == ["org-maze-01"]
    assert failed_members("Killed\n", ["org-maze-00", "org-maze-01"]) == ["org-maze-00", "org-maze-01"]


def test_an_environments_members_make_one_row_a_round_and_a_round_counts_once_every_environment_is_in():
    def report(cid, rnd, env, success, **more):
        return {"client_id": cid, "round": rnd, "metrics": {f"test_success/{env}": success, f"test_tasks/{env}": 10.0,
                                                            f"train_tasks/{env}": 50.0, **more}}
    owners = {"org-maze-00": ("maze",), "org-maze-01": ("maze",), "org-wordle": ("wordle",)}
    reports = [report("org-maze-00", 0, "maze", 0.2, kept=2.0, train_loss=1.0),
               report("org-maze-01", 0, "maze", 0.4, kept=3.0, train_loss=3.0),
               report("org-maze-00", 1, "maze", 0.5), report("org-maze-01", 1, "maze", 0.7),
               report("org-wordle", 0, "wordle", 0.0, kept=1.0)]
    rows = env_rows(reports, owners)
    merged = rows["maze"][0]
    assert (merged["members"], merged["kept"], merged["train_tasks"], merged["test_tasks"]) == (2, 5.0, 100.0, 10.0)
    assert merged["test_success"] == pytest.approx(0.3) and merged["train_loss"] == pytest.approx(2.0)
    assert rows["wordle"] == [{"round": 0, "kept": 1.0, "test_success": 0.0, "test_tasks": 10.0, "train_tasks": 50.0}]
    assert round_mean(rows, ["maze", "wordle"], 0) == pytest.approx(3 / 20)  # micro over the two environments
    assert round_mean(rows, ["maze", "wordle"], 1) is None  # two maze members are not the wordle's report


def test_members_per_host_needs_members():
    with pytest.raises(ConfigError, match="--members-per-host needs members"):
        RunConfig(envs="maze,wordle", members_per_host=2)
    with pytest.raises(ConfigError, match="--members-per-host"):
        RunConfig(envs="maze:2", members_per_host=-1)


def test_a_run_with_members_in_hosts_reports_every_member(tmp_path):
    """Budget: ~40 s on 2 cores (4 clients, 1 round, tiny budgets). Maze's 3 members in 2 hosts (members
    0 and 2, and 1), Wordle's one client a process."""
    out = io.StringIO()
    results = run(RunConfig(envs="maze:3,wordle?vocab_size=30", members_per_host=2, results=str(tmp_path), **TINY),
                  out=out)
    assert results["complete"], results
    assert "4 clients started (3 of them in 2 client hosts)" in out.getvalue()
    logs = sorted(p.name for p in (tmp_path / "logs").glob("*.log"))
    assert logs == ["aggregator.log", "client_agent-wordle.log", "client_host-maze-0.log", "client_host-maze-1.log",
                    "env_server-maze.log", "env_server-wordle.log"]  # one env server for the maze's members
    reports = [json.loads(line) for line in (tmp_path / "state" / "aggregator" / "local" / "metrics.jsonl").read_text()
               .splitlines()]
    ids = ["org-maze-00", "org-maze-01", "org-maze-02", "org-wordle"]
    assert sorted({r["client_id"] for r in reports}) == ids
    assert all({r["round"] for r in reports if r["client_id"] == cid} == {0, 1} for cid in ids)
    shares = {r["client_id"]: r["metrics"]["train_tasks/maze"] for r in reports if "train_tasks/maze" in r["metrics"]}
    assert len(shares) == 3 and max(shares.values()) - min(shares.values()) <= 1  # iid: equal shares of the maze
    for cid in ids:  # each member's own state directory, as a process of its own would have it
        assert (tmp_path / "state" / "clients" / cid / "buffer.jsonl").exists(), cid
    settings = json.loads((tmp_path / "run.json").read_text())["clients"]
    assert [settings[c]["task_share"] for c in ids] == ["0/3", "1/3", "2/3", ""]
