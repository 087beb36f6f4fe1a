"""The client's crash safety: progress.json, where a restarted client resumes, the buffer rewrite,
and a real client agent killed in each phase and started again (it resumes where it was and uploads
the same adapter; a round that closed without its upload is skipped; another run's state is set
aside).

The resumable transfers it resumes with: tests/test_client_transport.py."""

from __future__ import annotations

import os

import pytest

from services.client_agent.resume import (
    Progress,
    ProgressError,
    decide_resume,
    read_progress,
    write_progress,
)
from services.client_agent.training.buffer import Buffer, Trajectory
from services.client_agent.config import ClientConfig
from support import FakeAggregator, env_server_in_process, serve_fake


# ---- progress.json -------------------------------------------------------------------------------
def test_progress_round_trips_and_replaces_atomically(tmp_path):
    path = tmp_path / "progress.json"
    assert read_progress(path) is None
    p = Progress("run-a", 3, "trained", sha256="ab" * 32, num_examples=120, num_successes=7,
                 transport_dtype="bfloat16", metrics={"test_success": 0.25, "train_loss": 1.5})
    write_progress(path, p)
    assert read_progress(path) == p
    write_progress(path, Progress("run-a", 3, "uploaded", metrics={"x": 1.0}))
    assert read_progress(path).phase == "uploaded"
    assert sorted(os.listdir(tmp_path)) == ["progress.json"]  # no temp files left behind


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "progress.json"
    write_progress(path, Progress("run-a", 1, "explored"))

    def crash(*_a, **_k):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_progress(path, Progress("run-a", 1, "trained", sha256="cd" * 32))
    monkeypatch.undo()
    assert read_progress(path) == Progress("run-a", 1, "explored")
    write_progress(path, Progress("run-a", 1, "trained", sha256="cd" * 32))
    assert read_progress(path).phase == "trained"
    assert sorted(os.listdir(tmp_path)) == ["progress.json"]


@pytest.mark.parametrize("text", ["", "{", '{"run_id": "r", "round": 1}', '{"run_id": "r", "round": 1, "phase": "x"}',
                                  '{"run_id": "r", "round": "one", "phase": "explored"}'])
def test_a_damaged_progress_file_says_so(tmp_path, text):
    path = tmp_path / "progress.json"
    path.write_text(text)
    with pytest.raises(ProgressError):
        read_progress(path)


# ---- where to resume -----------------------------------------------------------------------------
def P(round_, phase, run="run-a", metrics=None):
    return Progress(run, round_, phase, metrics=metrics if metrics is not None else {"test_success": 0.5})


@pytest.mark.parametrize("progress,open_round,expected", [
    # (action, round, phase done, drop trajectories from round, missed round to report)
    (None, 0, ("fresh", 0, "", -1, None)),
    (P(2, "trained", run="old-run"), 2, ("fresh", 2, "", -1, None)),
    (P(5, "explored"), 3, ("fresh", 3, "", -1, None)),  # ahead of the aggregator: never trusted
    (P(-1, "seeded", metrics={}), 0, ("catch_up", 0, "", 0, None)),
    (P(-1, "seeded", metrics={}), 2, ("catch_up", 2, "", 0, None)),
    (P(2, "explored"), 2, ("continue", 2, "explored", 3, None)),
    (P(2, "trained"), 2, ("continue", 2, "trained", 3, None)),
    (P(2, "uploaded"), 2, ("continue", 2, "uploaded", 3, None)),
    (P(2, "reported"), 2, ("continue", 2, "reported", 3, None)),
    (P(2, "reported"), 3, ("catch_up", 3, "", 3, None)),
    (P(2, "uploaded"), 3, ("catch_up", 3, "", 3, 2)),  # crashed before reporting: report late
    (P(2, "trained"), 4, ("catch_up", 4, "", 3, 2)),  # round closed at quorum without us
    (P(2, "explored"), 3, ("catch_up", 3, "", 3, 2)),
    (P(5, "reported"), 5, ("continue", 5, "reported", 6, None)),  # finished run, final round reported
])
def test_decide_resume(progress, open_round, expected):
    r = decide_resume(progress, "run-a", open_round)
    assert (r.action, r.round, r.phase, r.drop_from, r.missed) == expected, r.reason
    assert r.reason


# ---- buffer rewrite --------------------------------------------------------------------------------
def traj(i: int, round_: int, source: str = "explore") -> Trajectory:
    return Trajectory(env="maze", task_id=i, instruction="go", turns=(("at 1, 1", "move up"),),
                      success=True, reward=1.0, source=source, round=round_)


def test_drop_rounds_from_rewrites_the_buffer(tmp_path):
    path = tmp_path / "buffer.jsonl"
    b = Buffer(path)
    b.extend([traj(1, -1, "expert"), traj(2, -1, "expert")])
    b.extend([traj(3, 0), traj(4, 1)])
    b.extend([traj(5, 2), traj(6, 2)])  # round 2's exploration was never recorded as finished
    assert b.drop_rounds_from(2) == 2
    assert [t.task_id for t in b.trajectories] == [1, 2, 3, 4]
    assert [t.task_id for t in Buffer(path).trajectories] == [1, 2, 3, 4]
    inode = path.stat().st_ino
    assert b.drop_rounds_from(2) == 0 and path.stat().st_ino == inode  # nothing to drop: untouched
    b.extend([traj(7, 2)])
    assert [t.task_id for t in Buffer(path).trajectories] == [1, 2, 3, 4, 7]
    assert b.drop_rounds_from(0) == 3
    assert [t.round for t in Buffer(path).trajectories] == [-1, -1]
    assert sorted(os.listdir(tmp_path)) == ["buffer.jsonl"]


def test_drop_rounds_from_keeps_the_old_file_if_the_rename_fails(tmp_path, monkeypatch):
    path = tmp_path / "buffer.jsonl"
    b = Buffer(path)
    b.extend([traj(1, 0), traj(2, 1)])

    def crash(*_a, **_k):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        b.drop_rounds_from(1)
    monkeypatch.undo()
    assert [t.task_id for t in Buffer(path).trajectories] == [1, 2]
    assert [t.task_id for t in b.trajectories] == [1, 2]


# ---- the agent killed and started again ----------------------------------------------------------
# A fake aggregator (one client, each upload closes its round) and a real env server in-process.
class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def env_target():
    with env_server_in_process() as target:
        yield target


def agent_config(env_target: str, agg_target: str, state_dir, **kw) -> ClientConfig:
    base = dict(client_id="org-a", env="maze", env_server=env_target, aggregator=agg_target, state_dir=str(state_dir),
                metrics_port=-1, expert_demos=4, explore_tasks=6, eval_tasks=2, epochs=1, concurrency=6,
                torch_threads=1, round_timeout_s=60.0)
    base.update(kw)
    return ClientConfig(**base)


def run_agent(cfg: ClientConfig, crash_in: str | None = None, when=lambda *a: True):
    """Runs an agent to the end, or until `crash_in` (a method name) is called with `when(args)` true."""
    from services.client_agent.agent import ClientAgent

    agent = ClientAgent(cfg)
    if crash_in:
        real = getattr(agent, crash_in)

        def crashing(*args, **kw):
            if when(*args):
                raise Crash(crash_in)
            return real(*args, **kw)
        setattr(agent, crash_in, crashing)
    try:
        return agent.run(), agent
    except Crash:
        return None, agent
    finally:
        agent.close()


@pytest.fixture(scope="module")
def uninterrupted(env_target, tmp_path_factory):
    agg = FakeAggregator(round_=0, num_rounds=1, advance=True)
    server, target = serve_fake(agg)
    try:
        state = tmp_path_factory.mktemp("plain")
        history, _ = run_agent(agent_config(env_target, target, state))
    finally:
        server.stop(0)
    assert [r for r, _ in agg.reports] == [0, 1] and len(agg.accepted) == 1
    return agg, history, Buffer(state / "org-a" / "buffer.jsonl").trajectories


@pytest.mark.parametrize("crash_in,when,phase", [
    ("train", lambda r: True, "explored"),  # killed while training: resumes without exploring again
    ("record", lambda p: p.phase == "explored", "seeded"),  # killed mid-exploration: the round is redone
    ("finish_round", lambda r, m: r == 0, "uploaded"),  # uploaded, killed before reporting: reports late
])
def test_a_killed_agent_resumes_where_it_was_and_uploads_the_same_adapter(
        env_target, tmp_path, uninterrupted, crash_in, when, phase):
    plain, plain_history, plain_buffer = uninterrupted
    agg = FakeAggregator(round_=0, num_rounds=1, advance=True)
    server, target = serve_fake(agg)
    try:
        cfg = agent_config(env_target, target, tmp_path)
        history, _ = run_agent(cfg, crash_in, when)
        assert history is None
        state = tmp_path / "org-a"
        progress = read_progress(state / "progress.json")
        assert (progress.run_id, progress.phase) == ("run-a", phase)
        if phase == "seeded":
            # Trajectories of the unfinished exploration were on disk when the agent died.
            Buffer(state / "buffer.jsonl").extend([traj(900, 0), traj(901, 0)])
        # Exploring again is a failure unless the exploration never finished.
        history, _ = run_agent(cfg, None if phase == "seeded" else "explore")
    finally:
        server.stop(0)
    assert history is not None, "the resumed agent explored a round it had explored"
    assert agg.accepted == plain.accepted  # the same adapter, byte for byte
    assert Buffer(state / "buffer.jsonl").trajectories == plain_buffer
    assert [r for r, _ in agg.reports] == [0, 1]  # every round reported once, none redone
    assert agg.reports[0][1]["test_success"] == plain.reports[0][1]["test_success"]
    assert read_progress(state / "progress.json") == Progress("run-a", 1, "reported", metrics=agg.reports[-1][1])
    assert {"evaluating", "training", "waiting", "done"} <= {ph for _, ph in agg.heartbeats}


def test_a_round_that_closed_without_our_upload_is_skipped(env_target, tmp_path):
    agg = FakeAggregator(round_=0, num_rounds=2, advance=True)
    server, target = serve_fake(agg)
    from services.client_agent.agent import ClientAgent

    agent = ClientAgent(agent_config(env_target, target, tmp_path))
    real_train = agent.train

    def train_while_the_round_closes(round_):
        out = real_train(round_)
        if round_ == 0:
            agg.open(1, agg.globals[0])  # closed at quorum without us
        return out
    agent.train = train_while_the_round_closes
    try:
        history = agent.run()
    finally:
        agent.close()
        server.stop(0)
    assert [r for r, _ in agg.reports] == [0, 1, 2]
    assert agg.reports[0][1]["upload_stale"] == 1.0 and "upload_stale" not in agg.reports[1][1]
    assert set(agg.accepted) == {("org-a", 1)}
    assert [h["round"] for h in history] == [0, 1, 2]


def test_state_of_another_run_is_set_aside(env_target, tmp_path, uninterrupted):
    plain, _, plain_buffer = uninterrupted
    state = tmp_path / "org-a"
    state.mkdir()
    write_progress(state / "progress.json", Progress("old-run", 4, "reported"))
    Buffer(state / "buffer.jsonl").extend([traj(1, 3)])
    agg = FakeAggregator(round_=0, num_rounds=1, advance=True)
    server, target = serve_fake(agg)
    try:
        history, _ = run_agent(agent_config(env_target, target, tmp_path))
    finally:
        server.stop(0)
    assert history is not None and agg.accepted == plain.accepted
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("org-a.aside-old-run-")]
    assert len(aside) == 1
    assert read_progress(aside[0] / "progress.json").run_id == "old-run"
    assert [t.task_id for t in Buffer(aside[0] / "buffer.jsonl").trajectories] == [1]
    assert Buffer(state / "buffer.jsonl").trajectories == plain_buffer
