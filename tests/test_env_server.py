"""The env server: session rules (unit) and the gRPC service (real server on port 0, real stubs)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedse import __version__
from fedse.config import ConfigError, parse
from fedse.transport.serving import insecure_channel
from fedse.v1 import env_pb2, env_pb2_grpc
from services.env_server.envs import KNOWN_ENVS
from services.env_server.envs.maze import MazeEnv
from services.env_server.server import EnvServerConfig, create_server
from services.env_server.servicer import SERVICE_NAME
from services.env_server.sessions import (
    MAX_ACTION_CHARS,
    BadAction,
    EpisodeDone,
    SessionManager,
    TooManySessions,
    UnknownSession,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAZE_PATH_FROM_1_1 = ["move right"] * 2 + ["move down"] * 4 + ["move right"] * 3 + ["move down"] * 3


# ---------------------------------------------------------------- sessions (pure logic)

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_sessions_expire_lazily_and_by_sweep():
    clock = FakeClock()
    manager = SessionManager({"maze": MazeEnv()}, ttl_s=10, clock=clock)
    a = manager.reset("maze", 0).session_id
    b = manager.reset("maze", 1).session_id
    clock.now += 6
    manager.step(a, "move up")  # a is used, b idles on
    clock.now += 6
    assert manager.sweep() == 1 and manager.open_sessions == 1
    with pytest.raises(UnknownSession, match="expired after idling more than 10 s"):
        manager.step(b, "move up")
    clock.now += 11
    with pytest.raises(UnknownSession, match="expired"):
        manager.expert_action(a)  # lazily, without a sweep
    assert manager.open_sessions == 0


def test_session_cap_counts_open_sessions_and_reclaims_expired_ones():
    clock = FakeClock()
    manager = SessionManager({"maze": MazeEnv()}, ttl_s=10, max_sessions=2, clock=clock)
    first = manager.reset("maze", 0).session_id
    manager.reset("maze", 0)
    with pytest.raises(TooManySessions, match="2 sessions are open"):
        manager.reset("maze", 0)
    manager.close(first)
    manager.reset("maze", 0)
    clock.now += 11
    manager.reset("maze", 0)  # the idle ones are swept to make room
    assert manager.open_sessions == 1


def test_closed_session_is_unknown_and_says_why():
    manager = SessionManager({"maze": MazeEnv()})
    session = manager.reset("maze", 0).session_id
    manager.close(session)
    with pytest.raises(UnknownSession, match="was closed"):
        manager.step(session, "move up")
    with pytest.raises(UnknownSession, match="no session 'nope'"):
        manager.close("nope")


def test_actions_are_checked_for_size_not_admissibility():
    manager = SessionManager({"maze": MazeEnv()})
    session = manager.reset("maze", 0).session_id
    with pytest.raises(BadAction, match="empty"):
        manager.step(session, "  ")
    with pytest.raises(BadAction, match="limit of 1000"):
        manager.step(session, "x" * (MAX_ACTION_CHARS + 1))
    assert not manager.step(session, "x" * MAX_ACTION_CHARS).valid


def test_finished_episode_refuses_steps_and_expert_actions():
    manager = SessionManager({"maze": MazeEnv()})
    session = manager.reset("maze", 0).session_id
    for action in MAZE_PATH_FROM_1_1:
        step = manager.step(session, action)
    assert step.done and step.success and step.available_actions == []
    with pytest.raises(EpisodeDone, match="already ended \\(success after 12 turns\\)"):
        manager.step(session, "move up")
    with pytest.raises(EpisodeDone):
        manager.expert_action(session)


# ---------------------------------------------------------------- config

def test_config_from_flags_and_environment():
    config = parse(EnvServerConfig, ["--envs", "wordle", "--max-sessions", "3"],
                   environ={"FEDSE_SESSION_TTL_S": "2.5", "FEDSE_MAX_SESSIONS": "9"})
    assert (config.env_names, config.max_sessions, config.session_ttl_s) == (("wordle",), 3, 2.5)
    assert EnvServerConfig().address == "0.0.0.0:50051" and EnvServerConfig().metrics_port == 9100


@pytest.mark.parametrize("kwargs,message", [
    ({"envs": "maze,chess"}, "envs: environment chess: unknown environment 'chess'"),
    ({"envs": "maze,maze"}, "envs: environments maze named twice"),
    ({"envs": "maze?size=3"}, "envs: environment maze: no option 'size'; it takes none"),
    ({"envs": "wordle?vocab_size=ten"}, "envs: environment wordle: option vocab_size='ten' is not an int"),
    ({"envs": "x=no_such_module:make"}, "envs: environment x: cannot import no_such_module:make: ModuleNotFoundError"),
    ({"envs": "x=agentgym:textcraft"}, "envs: environment spec 'x=agentgym:textcraft': an AgentGym bridge is"),
    ({"envs": ""}, "envs: name at least one"),
    ({"address": "localhost"}, "address: expected host:port"),
    ({"metrics_port": -2}, "metrics_port"),
    ({"session_ttl_s": 0.0}, "session_ttl_s"),
    ({"max_sessions": 0}, "max_sessions"),
    ({"log_level": "loud"}, "log_level"),
])
def test_config_rejects_bad_settings_with_one_clear_line(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EnvServerConfig(**kwargs)


# ---------------------------------------------------------------- gRPC service

def _serve(**overrides):
    config = EnvServerConfig(**{"address": "127.0.0.1:0", "metrics_port": -1, **overrides})
    server, port = create_server(config)
    server.start()
    server.ready([SERVICE_NAME])
    channel = insecure_channel(f"127.0.0.1:{port}")
    return server, channel


@pytest.fixture(scope="module")
def served():
    server, channel = _serve()
    yield server, channel
    channel.close()
    server.stop(grace=0)


@pytest.fixture
def stub(served) -> env_pb2_grpc.EnvServiceStub:
    return env_pb2_grpc.EnvServiceStub(served[1])


@pytest.fixture
def small_server():
    """A server of its own, for tests of the session cap and expiry; yields a function making stubs."""
    started = []

    def start(**overrides) -> env_pb2_grpc.EnvServiceStub:
        server, channel = _serve(**overrides)
        started.append((server, channel))
        return env_pb2_grpc.EnvServiceStub(channel)

    yield start
    for server, channel in started:
        channel.close()
        server.stop(grace=0)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_health_is_serving(served):
    health = health_pb2_grpc.HealthStub(served[1])
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_lists_environments_and_task_counts(stub):
    assert list(stub.ListEnvironments(env_pb2.ListEnvironmentsRequest()).envs) == ["maze", "wordle"]
    counts = {}
    for env in ("maze", "wordle"):
        for split in ("train", "test"):
            reply = stub.ListTasks(env_pb2.ListTasksRequest(env=env, split=split))
            counts[env, split] = (len(reply.task_ids), reply.max_turns)
            assert len(set(reply.task_ids)) == len(reply.task_ids)
    assert counts == {("maze", "train"): (215, 15), ("maze", "test"): (25, 15),
                      ("wordle", "train"): (955, 8), ("wordle", "test"): (25, 8)}


def test_reset_step_close_round_trip(stub):
    before = prometheus_client.REGISTRY.get_sample_value(
        "fedse_env_episodes_finished_total", {"env": "maze", "outcome": "success"}) or 0
    reset = stub.Reset(env_pb2.ResetRequest(env="maze", task_id=0))
    assert len(reset.session_id) == 32 and reset.max_turns == 15
    assert reset.instruction.startswith("Your objective is to reach the goal")
    assert "Your current position is at position 1, 1." in reset.observation
    assert list(reset.available_actions) == ["move up", "move down", "move left", "move right"]
    for turn, action in enumerate(MAZE_PATH_FROM_1_1, start=1):
        expert = stub.ExpertAction(env_pb2.ExpertActionRequest(session_id=reset.session_id)).action
        assert expert == action
        step = stub.Step(env_pb2.StepRequest(session_id=reset.session_id, action=action))
        assert step.turn == turn and step.valid_action
    assert (step.done, step.success, step.reward, step.observation) == (True, True, 1.0, "Success")
    assert list(step.available_actions) == []
    stub.Close(env_pb2.CloseRequest(session_id=reset.session_id))
    after = prometheus_client.REGISTRY.get_sample_value(
        "fedse_env_episodes_finished_total", {"env": "maze", "outcome": "success"})
    assert after == before + 1
    code, _ = _code(lambda: stub.Close(env_pb2.CloseRequest(session_id=reset.session_id)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_wordle_over_grpc(stub):
    reset = stub.Reset(env_pb2.ResetRequest(env="wordle", task_id=0))
    assert reset.observation == "Let's start Wordle!" and reset.max_turns == 8
    assert len(reset.available_actions) == 100 and reset.available_actions[0] == "a b o u t"
    bad = stub.Step(env_pb2.StepRequest(session_id=reset.session_id, action="zzzzz"))
    assert not bad.valid_action and bad.observation.startswith("invalid word") and bad.turn == 1
    step = bad
    while not step.done:
        action = stub.ExpertAction(env_pb2.ExpertActionRequest(session_id=reset.session_id)).action
        step = stub.Step(env_pb2.StepRequest(session_id=reset.session_id, action=action))
    assert step.success and step.observation == "g g g g g" and step.reward == 1.0
    stub.Close(env_pb2.CloseRequest(session_id=reset.session_id))


def test_not_found_for_unknown_session_env_and_task(stub):
    code, details = _code(lambda: stub.Step(env_pb2.StepRequest(session_id="feed", action="move up")))
    assert code == grpc.StatusCode.NOT_FOUND and "start one with Reset" in details
    code, details = _code(lambda: stub.ExpertAction(env_pb2.ExpertActionRequest(session_id="feed")))
    assert code == grpc.StatusCode.NOT_FOUND
    code, details = _code(lambda: stub.Reset(env_pb2.ResetRequest(env="chess", task_id=0)))
    assert code == grpc.StatusCode.NOT_FOUND and "this server hosts maze, wordle" in details
    code, details = _code(lambda: stub.ListTasks(env_pb2.ListTasksRequest(env="chess", split="test")))
    assert code == grpc.StatusCode.NOT_FOUND
    code, details = _code(lambda: stub.Reset(env_pb2.ResetRequest(env="maze", task_id=240)))
    assert code == grpc.StatusCode.NOT_FOUND and "ids are 0..239" in details


def test_megabyte_ids_get_a_short_refusal_that_a_client_with_default_limits_reads(served):
    """An id of 1 MB used to come back in the status message: the reply's metadata then exceeded the
    client's 8 KB default and it saw RESOURCE_EXHAUSTED "Stream removed". Ids are bounded up front and
    messages show a short prefix."""
    huge = "x" * 1_000_000
    with grpc.insecure_channel(f"127.0.0.1:{served[0].port}") as channel:  # every gRPC default
        stock = env_pb2_grpc.EnvServiceStub(channel)
        calls = {
            "ListTasks env": lambda: stock.ListTasks(env_pb2.ListTasksRequest(env=huge, split="train")),
            "ListTasks split": lambda: stock.ListTasks(env_pb2.ListTasksRequest(env="maze", split=huge)),
            "Reset env": lambda: stock.Reset(env_pb2.ResetRequest(env=huge, task_id=0)),
            "Step session": lambda: stock.Step(env_pb2.StepRequest(session_id=huge, action="move up")),
            "Close session": lambda: stock.Close(env_pb2.CloseRequest(session_id=huge)),
            "ExpertAction session": lambda: stock.ExpertAction(env_pb2.ExpertActionRequest(session_id=huge)),
        }
        for what, call in calls.items():
            code, details = _code(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details[:200])
            assert "more than the limit of 256" in details and len(details) < 400, (what, details)
        # Under the bound but unknown: NOT_FOUND, quoting only a prefix.
        code, details = _code(lambda: stock.Step(env_pb2.StepRequest(session_id="y" * 200, action="move up")))
        assert code == grpc.StatusCode.NOT_FOUND and "(200 characters)" in details and "y" * 60 not in details
        # A request that is not a protobuf message of the method's type is the caller's error too.
        raw = channel.unary_unary("/fedse.v1.EnvService/Step", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        code, details = _code(lambda: raw(b"\x0a\x02\xff\xfe", timeout=10))  # session_id: not UTF-8
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf message" in details


def test_invalid_argument_for_bad_split_and_malformed_actions(stub):
    code, details = _code(lambda: stub.ListTasks(env_pb2.ListTasksRequest(env="maze", split="dev")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "use one of train, test" in details
    session = stub.Reset(env_pb2.ResetRequest(env="maze", task_id=0)).session_id
    for action in ("", "x" * 1001):
        code, details = _code(lambda: stub.Step(env_pb2.StepRequest(session_id=session, action=action)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    # A well-formed action that is not admissible is an observation, not an error.
    step = stub.Step(env_pb2.StepRequest(session_id=session, action="fly"))
    assert not step.valid_action and step.turn == 1
    stub.Close(env_pb2.CloseRequest(session_id=session))


def test_turn_limit_ends_the_episode_then_failed_precondition(stub):
    session = stub.Reset(env_pb2.ResetRequest(env="maze", task_id=0)).session_id
    for _ in range(15):
        step = stub.Step(env_pb2.StepRequest(session_id=session, action="move up"))
    assert (step.turn, step.done, step.success) == (15, True, False)
    code, details = _code(lambda: stub.Step(env_pb2.StepRequest(session_id=session, action="move right")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "truncated after 15 turns" in details
    stub.Close(env_pb2.CloseRequest(session_id=session))


def test_concurrent_sessions_are_independent(stub):
    def play(task: int) -> tuple[int, list[str]]:
        session = stub.Reset(env_pb2.ResetRequest(env="maze", task_id=task)).session_id
        observations, step = [], None
        while step is None or not step.done:
            action = stub.ExpertAction(env_pb2.ExpertActionRequest(session_id=session)).action
            step = stub.Step(env_pb2.StepRequest(session_id=session, action=action))
            observations.append(step.observation)
        stub.Close(env_pb2.CloseRequest(session_id=session))
        assert step.success
        return task, observations

    expected, env = {}, MazeEnv()
    for task in range(8):
        episode, observations = env.reset(task), []
        while not observations or observations[-1] != "Success":
            observations.append(episode.step(episode.expert_action()).observation)
        expected[task] = observations
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = dict(pool.map(play, list(range(8)) * 2))
    assert results == expected


def test_resource_exhausted_at_the_session_cap(small_server):
    stub = small_server(max_sessions=2, envs="maze")
    first = stub.Reset(env_pb2.ResetRequest(env="maze", task_id=0)).session_id
    stub.Reset(env_pb2.ResetRequest(env="maze", task_id=1))
    code, details = _code(lambda: stub.Reset(env_pb2.ResetRequest(env="maze", task_id=2)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "close finished sessions with Close" in details
    stub.Close(env_pb2.CloseRequest(session_id=first))
    stub.Reset(env_pb2.ResetRequest(env="maze", task_id=2))


def test_idle_sessions_expire(small_server):
    stub = small_server(session_ttl_s=0.2, envs="maze")
    session = stub.Reset(env_pb2.ResetRequest(env="maze", task_id=0)).session_id
    time.sleep(0.5)
    code, details = _code(lambda: stub.Step(env_pb2.StepRequest(session_id=session, action="move up")))
    assert code == grpc.StatusCode.NOT_FOUND and "expired" in details


def test_the_process_logs_its_port_serves_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.env_server", "--address", "127.0.0.1:0", "--metrics-port", "-1",
         "--envs", "maze"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())  # which fedse this is
        assert first["msg"] == "starting" and first["version"] == __version__
        line = json.loads(proc.stdout.readline())
        assert line["msg"] == "serving" and line["port"] > 0 and line["service"] == "env_server"
        with insecure_channel(f"127.0.0.1:{line['port']}") as channel:
            reply = env_pb2_grpc.EnvServiceStub(channel).ListEnvironments(env_pb2.ListEnvironmentsRequest(),
                                                                         timeout=5)
            assert list(reply.envs) == ["maze"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopped" in proc.stdout.read()


def test_the_process_stops_with_one_line_on_a_bad_setting():
    result = subprocess.run([sys.executable, "-m", "services.env_server", "--envs", "chess"], cwd=REPO,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"configuration error: envs: environment chess: unknown environment 'chess'; "
                                     f"known are {', '.join(KNOWN_ENVS)} (or NAME=package.module:factory, "
                                     "NAME=agentgym:PROFILE@URL)")
