"""The client's crash safety: progress.json, where a restarted client resumes, the buffer rewrite,
bf16 transport, and resumable uploads and downloads (against a small fake aggregator over real gRPC
that breaks streams on purpose)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from prometheus_client import REGISTRY
import torch

from fedse.model import adapter as ad
from fedse.config import ConfigError
from fedse.v1 import federation_pb2 as fpb
from services.client_agent.resume import (
    Progress,
    ProgressError,
    decide_resume,
    read_progress,
    write_progress,
)
from services.client_agent.training.buffer import Buffer, Trajectory
from services.client_agent.config import ClientConfig
from services.client_agent.federation.link import (
    FederationClient,
    StaleRound,
    TransferError,
    upload_chunks,
)
from services.client_agent.federation.heartbeat import Heartbeat
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


# ---- transport dtype -----------------------------------------------------------------------------
def adapter(seed: int = 0) -> ad.Adapter:
    g = torch.Generator().manual_seed(seed)
    return {f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight": torch.randn(64, 128, generator=g)
            for i in range(2) for ab in "AB"}


def test_bfloat16_transport_halves_the_bytes_and_decodes_to_fp32():
    a = adapter()
    full, half = ad.encode_transport(a, ""), ad.encode_transport(a, "bfloat16")
    assert full == ad.encode(a)
    assert 0.45 < len(half) / len(full) < 0.55
    assert {str(t.dtype) for t in ad.decode(half).values()} == {"torch.bfloat16"}
    back = ad.decode_transport(half)
    for k, v in a.items():
        assert back[k].dtype == torch.float32
        assert torch.allclose(back[k], v, rtol=2 ** -8, atol=0), k
        assert not torch.equal(back[k], v)  # it really was rounded
    assert ad.encode_transport(back, "bfloat16") == half  # bf16 -> fp32 -> bf16 is exact
    with pytest.raises(ValueError, match="bfloat16"):
        ad.encode_transport(a, "float16")


# ---- chunks and offsets --------------------------------------------------------------------------
@pytest.mark.parametrize("size,offset,chunk", [(10, 0, 4), (10, 3, 4), (10, 8, 4), (10, 10, 4), (4096, 1000, 1024)])
def test_upload_chunks_resume_at_offset(size, offset, chunk):
    data = bytes(range(256)) * (size // 256 + 1)
    data = data[:size]
    header = fpb.AdapterHeader(client_id="c", round=1, sha256=ad.sha256_hex(data), size=size, offset=offset)
    msgs = list(upload_chunks(header, data, chunk))
    assert msgs[0].WhichOneof("kind") == "header" and msgs[0].header.offset == offset
    parts = [m.data for m in msgs[1:]]
    assert all(m.WhichOneof("kind") == "data" for m in msgs[1:])
    assert b"".join(parts) == data[offset:]
    assert all(0 < len(p) <= chunk for p in parts)
    assert len(parts) == -(-(size - offset) // chunk)


def test_upload_chunks_refuse_an_offset_outside_the_data():
    header = fpb.AdapterHeader(size=10, offset=11)
    with pytest.raises(ValueError, match="offset 11"):
        list(upload_chunks(header, b"x" * 10, 4))


# ---- configuration -------------------------------------------------------------------------------
def test_client_config_transport_and_heartbeat_settings():
    assert ClientConfig(transport_dtype="bfloat16").transport_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="--transport-dtype"):
        ClientConfig(transport_dtype="fp8")
    with pytest.raises(ConfigError, match="--heartbeat-interval-s"):
        ClientConfig(heartbeat_interval_s=-1)


# ---- heartbeat -----------------------------------------------------------------------------------
class FlakyHeartbeats:
    def __init__(self):
        self.calls: list[tuple[int, str]] = []

    def heartbeat(self, round_, phase, timeout_s=10.0):
        self.calls.append((round_, phase))
        if len(self.calls) % 2:
            raise RuntimeError("aggregator restarting")
        return fpb.HeartbeatAck(status=fpb.RoundStatus(round=round_))


def wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_heartbeat_survives_failures_and_sends_phase_changes_at_once():
    def beats(outcome: str) -> float:
        return REGISTRY.get_sample_value("fedse_client_heartbeats_total", {"outcome": outcome}) or 0.0
    failed, sent = beats("failed"), beats("sent")
    fed = FlakyHeartbeats()
    hb = Heartbeat(fed, interval_s=60.0).start()  # long interval: only phase changes trigger beats
    wait_for(lambda: len(fed.calls) >= 1)  # first beat failed; the thread lives on
    hb.set("training", 4)
    wait_for(lambda: (4, "training") in fed.calls)
    hb.set("uploading")
    wait_for(lambda: (4, "uploading") in fed.calls)
    assert hb._thread.is_alive() and beats("failed") >= failed + 1 and beats("sent") >= sent + 1
    with pytest.raises(ValueError, match="phase"):
        hb.set("dancing")
    hb.set("done")
    hb.stop()
    assert not hb._thread.is_alive()
    assert fed.calls[-1] == (4, "done")


def test_heartbeat_sends_the_last_phase_even_when_stop_comes_during_a_beat():
    """set("done") then stop() while a beat was on the wire used to end the thread without sending "done"."""
    release, sent = threading.Event(), []

    class SlowBeats:
        def heartbeat(self, round_, phase, timeout_s):
            sent.append(phase)
            if len(sent) == 1:
                release.wait(5)
            return fpb.HeartbeatAck()

    hb = Heartbeat(SlowBeats(), interval_s=60.0, phase="training").start()
    wait_for(lambda: sent == ["training"])
    hb.set("done")
    threading.Timer(0.2, release.set).start()
    hb.stop()
    assert sent == ["training", "done"]


# ---- against a fake aggregator speaking the resumable protocol (tests/support.py) ---------------------
@pytest.fixture
def fake():
    agg = FakeAggregator(ad.encode(adapter(7)))
    server, target = serve_fake(agg)
    client = FederationClient(target, "org-a", retries=3, backoff_s=0.01, max_backoff_s=0.02,
                              timeout_s=10)
    client.chunk_bytes = 1000
    yield agg, client
    client.close()
    server.stop(0)


def test_a_broken_upload_resumes_from_what_the_aggregator_kept(fake):
    agg, client = fake
    data = ad.encode_transport(adapter(1), "bfloat16")
    agg.break_upload_after = [3000, 5000]  # two breaks, each after some chunks were kept
    ack = client.upload(1, data, num_examples=3, num_successes=2, transport_dtype="bfloat16")
    assert ack.sha256 == ad.sha256_hex(data)
    assert agg.accepted[("org-a", 1)] == data
    assert agg.received == len(data)  # no byte was sent twice


def test_an_incomplete_or_misplaced_upload_follows_the_offset_the_aggregator_names(fake):
    agg, client = fake
    data = ad.encode(adapter(2))
    agg.held[("org-a", 1, ad.sha256_hex(data))] = bytearray(data[:4000])  # kept before a client restart
    agg.end_upload_after = [2000]  # then a stream that ends short without an error
    client.upload(1, data, num_examples=3, num_successes=2)
    assert agg.accepted[("org-a", 1)] == data
    assert agg.received == len(data) - 4000


def test_an_upload_for_a_closed_round_raises_stale_round(fake):
    agg, client = fake
    agg.round, agg.nonce = 2, "nonce-2"
    with pytest.raises(StaleRound) as err:
        client.upload(1, ad.encode(adapter(3)), num_examples=1, num_successes=1)
    assert err.value.open_round == 2 and err.value.round == 1
    agg.round, agg.state = 1, fpb.ROUND_STATE_AGGREGATING  # closed, being aggregated
    with pytest.raises(StaleRound, match="AGGREGATING"):
        client.upload(1, ad.encode(adapter(3)), num_examples=1, num_successes=1)
    assert not agg.accepted


def test_a_stale_nonce_is_refreshed(fake):
    agg, client = fake
    data = ad.encode(adapter(4))
    client.upload(1, data, num_examples=1, num_successes=1, round_nonce="nonce-from-before-a-restart")
    assert agg.accepted[("org-a", 1)] == data


def test_a_broken_download_resumes_and_a_damaged_one_restarts(fake):
    agg, client = fake
    agg.break_download_after = [2500]
    g = client.download(-1)
    assert g.data == agg.global_fp32 and g.round == 1
    resumed = agg.download_requests[-1]
    assert resumed.offset == 3000 and resumed.sha256 == g.sha256 and resumed.round == 1
    agg.download_requests.clear()
    agg.corrupt_downloads = 1
    g = client.download(1)
    assert g.data == agg.global_fp32
    assert [r.offset for r in agg.download_requests] == [0, 0]  # damaged: the whole adapter again


def test_download_in_bfloat16(fake):
    agg, client = fake
    g = client.download(1, transport_dtype="bfloat16")
    assert g.transport_dtype == "bfloat16"
    assert len(g.data) < 0.55 * len(agg.global_fp32)
    got, want = g.adapter(), ad.decode(agg.global_fp32)
    assert all(torch.allclose(got[k], want[k], rtol=2 ** -8, atol=0) for k in want)


def test_a_download_that_keeps_arriving_damaged_fails(fake):
    agg, client = fake
    agg.corrupt_downloads = 100
    with pytest.raises(TransferError, match="damaged"):
        client.download(1)


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
