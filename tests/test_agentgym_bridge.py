"""The AgentGym bridge (services/env_server/envs/agentgym.py): AgentGym-like HTTP servers over real HTTP
(tests/agentgym_servers.py), served by a real env server and played over real gRPC stubs or the
client's EnvClient."""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading

import grpc
import pytest
import requests

from agentgym_servers import (
    PLANS,
    SERVERS,
    WORDLE_VOCAB,
    AgentGymServer,
    LMRLGymServer,
    TextCraftServer,
    WebShopServer,
)
from fedse.env import EnvironmentUnavailable, EpisodeLost
from fedse.transport.serving import insecure_channel
from fedse.v1 import env_pb2, env_pb2_grpc
from services.client_agent.playing.envclient import EnvClient, SessionLost
from services.env_server.envs.agentgym import PROFILES, bridge, parse_tasks
from services.env_server.registry import RegistryError
from services.env_server.server import EnvServerConfig, create_server

NAMES = ("textcraft", "babyai", "sciworld", "alfworld", "maze", "wordle", "webshop")
LISTS_ACTIONS = {"textcraft": False, "babyai": True, "sciworld": True, "alfworld": True, "maze": True,
                 "wordle": False, "webshop": True}
# A short turn limit keeps failing episodes short; wordle needs its six guesses.
TURNS = {name: 8 if name == "wordle" else 4 for name in NAMES}


def _spec(name: str, url: str, env: str = "", **options: object) -> str:
    options = {"max_turns": TURNS[name], "timeout_s": 2, **options}
    return f"{env or name}=agentgym:{name}@{url}?" + "&".join(f"{k}={v}" for k, v in options.items())


@contextlib.contextmanager
def env_server(envs: str):
    """A real env server on a free port hosting `envs`; yields (stub, target)."""
    server, port = create_server(EnvServerConfig(address="127.0.0.1:0", envs=envs, metrics_port=-1))
    server.start()
    channel = insecure_channel(f"127.0.0.1:{port}")
    try:
        yield env_pb2_grpc.EnvServiceStub(channel), f"127.0.0.1:{port}"
    finally:
        channel.close()
        server.stop(grace=0)


def _client(target: str, env: str) -> EnvClient:
    return EnvClient(target, env, timeout_s=5, retry_s=10, backoff_s=0.05, max_backoff_s=0.2)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remote_ids(fake: AgentGymServer, path: str) -> list[int]:
    return [args[fake.id_field] for _, p, args in fake.calls if p == path]


@pytest.fixture(scope="module")
def fakes():
    """One fake per profile; maze and wordle share the lmrlgym server, as in AgentGym."""
    lmrlgym = LMRLGymServer().start()
    started = {name: lmrlgym if cls is LMRLGymServer else cls().start() for name, cls in SERVERS.items()}
    yield started
    for fake in {id(f): f for f in started.values()}.values():
        fake.stop()


@pytest.fixture(scope="module")
def hosted(fakes):
    """An env server hosting all seven profiles; yields its stub."""
    with env_server(",".join(_spec(name, fakes[name].url) for name in NAMES)) as (stub, _):
        yield stub


def _reset(stub, env: str, task: int) -> env_pb2.ResetResponse:
    return stub.Reset(env_pb2.ResetRequest(env=env, task_id=task))


def _step(stub, session: str, action: str) -> env_pb2.StepResponse:
    return stub.Step(env_pb2.StepRequest(session_id=session, action=action))


# ---------------------------------------------------------------- playing

def _losing_actions(name: str, task: int) -> list[str]:
    if name == "wordle":
        wrong = next(w for w in WORDLE_VOCAB if w != WORDLE_VOCAB[task % len(WORDLE_VOCAB)])
        return [" ".join(wrong)] * 6  # six wrong guesses end the game
    if name == "webshop":
        return ["search[lamp]", "click[b02]", "click[buy now]"]  # the other product: a partial score
    if name == "sciworld":
        return ["focus on pot"]  # focusing on a wrong object fails the task
    return {"textcraft": ["inventory"], "babyai": ["turn left"], "alfworld": ["go to sinkbasin 1"],
            "maze": ["move left"]}[name] * TURNS[name]


@pytest.mark.parametrize("name", NAMES)
def test_each_profile_plays_a_success_and_a_failure(hosted, name):
    task = hosted.ListTasks(env_pb2.ListTasksRequest(env=name, split="train")).task_ids[0]
    reset = _reset(hosted, name, task)
    assert reset.instruction and reset.observation and reset.max_turns == TURNS[name]
    assert bool(reset.available_actions) == LISTS_ACTIONS[name]
    actions = list(reset.available_actions)
    for action in PLANS[name](task):
        if LISTS_ACTIONS[name] and not action.startswith("search["):  # webshop lists one search of its own
            assert action in actions
        step = _step(hosted, reset.session_id, action)
        actions = list(step.available_actions)
    assert step.done and step.success and step.valid_action and not actions
    assert (step.reward == 1.0) if name != "babyai" else (0.5 < step.reward < 1.0)  # BabyAI: MiniGrid's reward
    hosted.Close(env_pb2.CloseRequest(session_id=reset.session_id))

    session = _reset(hosted, name, task).session_id
    for turn, action in enumerate(_losing_actions(name, task), 1):
        step = _step(hosted, session, action)
        assert not step.success and step.turn == turn
    assert step.done and not step.success
    hosted.Close(env_pb2.CloseRequest(session_id=session))


INVALID = {"textcraft": "dance", "babyai": "jump", "sciworld": "dance", "alfworld": "fly to the moon",
           "wordle": "z z z z z"}


@pytest.mark.parametrize("name", NAMES)
def test_an_action_is_invalid_only_where_the_observation_says_so(hosted, name):
    session = _reset(hosted, name, hosted.ListTasks(env_pb2.ListTasksRequest(env=name, split="test")).task_ids[0])
    step = _step(hosted, session.session_id, INVALID.get(name, "something odd"))
    # Maze and webshop answer an odd action without saying it was not admissible: valid, conservatively.
    assert step.valid_action == (name not in INVALID) and not step.done
    hosted.Close(env_pb2.CloseRequest(session_id=session.session_id))


def test_capabilities_no_expert_and_actions_per_profile(hosted):
    infos = {e.name: e for e in hosted.ListEnvironments(env_pb2.ListEnvironmentsRequest()).environments}
    assert set(infos) == set(NAMES)
    for name, info in infos.items():
        assert not info.has_expert and info.lists_actions == LISTS_ACTIONS[name] and info.max_turns == TURNS[name]
    session = _reset(hosted, "babyai", 0).session_id
    code, details = _code(lambda: hosted.ExpertAction(env_pb2.ExpertActionRequest(session_id=session)))
    assert code == grpc.StatusCode.UNIMPLEMENTED and "no expert" in details
    hosted.Close(env_pb2.CloseRequest(session_id=session))


# ---------------------------------------------------------------- tasks

DEFAULT_SIZES = {"textcraft": (374, 100), "babyai": (810, 90), "sciworld": (2120, 200), "alfworld": (2420, 200),
                 "maze": (21, 5), "wordle": (955, 25), "webshop": (3930, 200)}


def test_default_splits_are_disjoint_index_ranges_and_contact_nothing():
    for name in NAMES:
        env = bridge(name, f"http://127.0.0.1:{_free_port()}")  # nothing listens there: building asks nothing
        train, test = env.tasks("train"), env.tasks("test")
        assert (len(train), len(test)) == DEFAULT_SIZES[name] and not set(train) & set(test)
        assert not env.has_expert and env.lists_actions == LISTS_ACTIONS[name]
    assert bridge("alfworld", "http://h:1").tasks("test") == list(range(2420, 2620))
    assert max(bridge("maze", "http://h:1").tasks("train")) == 25
    assert parse_tasks("0-4+10+20-30/5+3") == [0, 1, 2, 3, 4, 10, 20, 25, 30]


def test_options_set_the_splits_and_bad_ones_fail_in_one_line(fakes):
    url = fakes["textcraft"].url
    with env_server(_spec("textcraft", url, env="tc", train="5-9+20", test="0-2/2")) as (stub, _):
        tasks = {split: list(stub.ListTasks(env_pb2.ListTasksRequest(env="tc", split=split)).task_ids)
                 for split in ("train", "test")}
        assert tasks == {"train": [5, 6, 7, 8, 9, 20], "test": [0, 2]}
        code, details = _code(lambda: _reset(stub, "tc", 3))
        assert code == grpc.StatusCode.NOT_FOUND and "no task 3" in details and "0+2 (test)" in details
    # test alone: the training tasks are the profile's span less the test ones
    assert bridge("maze", url, test="0-4").tasks("train") == list(range(5, 26))
    for spec, message in [
        (_spec("textcraft", url, train="0-10", test="5-6"), "overlap on tasks 5-6"),
        ("x=agentgym:chess@" + url, "unknown AgentGym profile 'chess': use one of alfworld, babyai, maze"),
        (_spec("maze", url, test="20-30"), "tasks 0-25 only, not 26-30"),
        (_spec("babyai", url, test="9-x"), "not a task index"),
        (_spec("textcraft", url, world_type="Text"), "world_type is an option of the alfworld profile only"),
    ]:
        with pytest.raises(RegistryError, match=message):
            create_server(EnvServerConfig(address="127.0.0.1:0", envs=spec, metrics_port=-1))


# ---------------------------------------------------------------- failures

def test_server_down_at_start_is_unavailable_until_it_comes_up():
    fake = TextCraftServer()
    fake.port = _free_port()
    with env_server(_spec("textcraft", fake.url)) as (stub, target):
        assert stub.ListTasks(env_pb2.ListTasksRequest(env="textcraft", split="train")).task_ids  # asks nothing
        code, details = _code(lambda: _reset(stub, "textcraft", 1))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert f"AgentGym textcraft server at {fake.url} unreachable: " in details and "is it running?" in details
        timer = threading.Timer(0.3, fake.start)
        timer.start()
        try:
            client = _client(target, "textcraft")
            session, _ = client.reset(1)  # retried until the server is up
            for action in PLANS["textcraft"](1):
                obs = client.step(session, action)
            assert obs.done and obs.success
            client.close_channel()
        finally:
            timer.join()
            fake.stop()


def test_the_servers_own_errors_are_failed_precondition_quoting_them(fakes):
    spec = ",".join([_spec("sciworld", fakes["sciworld"].url, train="100-101", test="0"),
                     _spec("webshop", fakes["webshop"].url)])
    with env_server(spec) as (stub, _):
        code, details = _code(lambda: _reset(stub, "sciworld", 100))  # past its games
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"AgentGym sciworld server at {fakes['sciworld'].url} refused the reset to task 100: " \
               '"list index out of range"' in details
        session = _reset(stub, "webshop", 0).session_id
        code, details = _code(lambda: _step(stub, session, "click[crash]"))  # WebShop fails with a wordless 500
        assert code == grpc.StatusCode.FAILED_PRECONDITION and 'HTTP 500: "Internal Server Error"' in details


@pytest.mark.parametrize("name", ["textcraft", "maze", "webshop"])
def test_the_agentgym_server_dying_mid_episode_is_recovered_by_the_clients_retry(name):
    with SERVERS[name]() as fake, env_server(_spec(name, fake.url)) as (stub, target):
        client = _client(target, name)
        task = client.tasks("train")[0][0]
        session, _ = client.reset(task)
        client.step(session, PLANS[name](task)[0])
        fake.stop()
        fake.fresh()  # what comes back is a new process: nothing of ours
        timer = threading.Timer(0.3, fake.start)
        timer.start()
        with pytest.raises(SessionLost, match="NOT_FOUND"):
            client.step(session, PLANS[name](task)[1])  # UNAVAILABLE, retried, then lost
        timer.join()
        session, _ = client.reset(task)  # the episode, played again
        for action in PLANS[name](task):
            obs = client.step(session, action)
        assert obs.done and obs.success
        client.close(session)
        client.close_channel()


def test_an_episode_begun_before_a_restart_never_steps_on_a_new_environment():
    with TextCraftServer() as fake, env_server(_spec("textcraft", fake.url)) as (stub, target):
        client = _client(target, "textcraft")
        old, _ = client.reset(1)                        # remote id 0
        fake.restart()                                  # unseen by the bridge: no call failed
        new, _ = client.reset(2)                        # remote id 0 again: the server restarted
        steps_before = fake.count("/step")
        with pytest.raises(SessionLost, match="restarted"):
            client.step(old, "inventory")
        assert fake.count("/step") == steps_before      # it never reached the new episode's environment
        for action in PLANS["textcraft"](2):
            obs = client.step(new, action)
        assert obs.success

        lost, _ = client.reset(1)
        fake.restart()                                  # and stepped first: the id is unknown there
        with pytest.raises(SessionLost, match="The id 1 is not valid"):
            client.step(lost, "inventory")
        client.close_channel()


def test_a_step_that_times_out_loses_the_episode():
    with TextCraftServer() as fake:
        env = bridge("textcraft", fake.url, timeout_s=0.2)
        episode = env.reset(1)
        fake.delay_s = 0.5
        lost = r"did not answer a step \(POST /step\) within 0.2 s .*; the action may have been applied"
        with pytest.raises(EpisodeLost, match=lost):
            episode.step("inventory")
        episode.close()
        fake.delay_s = 0.0
        assert fake.closed == []                        # still busy there: neither closed nor reused
        env.reset(1).close()
        assert fake.count("/create") == 2 and fake.closed == [1]
        with pytest.raises(EnvironmentUnavailable, match="unreachable: .*is it running"):
            bridge("textcraft", f"http://127.0.0.1:{_free_port()}").reset(1)


# ---------------------------------------------------------------- remote sessions

def test_close_frees_the_remote_environment_where_the_server_can():
    with TextCraftServer() as textcraft, LMRLGymServer() as lmrlgym, WebShopServer() as webshop:
        spec = ",".join([_spec("textcraft", textcraft.url), _spec("maze", lmrlgym.url), _spec("webshop", webshop.url)])
        with env_server(spec) as (stub, _):
            for _ in range(2):
                for name in ("textcraft", "maze", "webshop"):
                    session = _reset(stub, name, 0).session_id
                    stub.Close(env_pb2.CloseRequest(session_id=session))
        # textcraft has /close: each episode's environment is closed there, and a new one made
        assert textcraft.closed == [0, 1] and textcraft.count("/create") == 2
        # lmrlgym has none: the environment is reset for the next episode instead of leaking
        assert lmrlgym.count("/maze/close") == 0 and lmrlgym.count("/maze/create") == 1
        assert _remote_ids(lmrlgym, "/maze/reset") == [0, 0]
        # this webshop version has none either: asked once (404), then its environment is reused
        assert webshop.count("/close") == 1 and webshop.count("/create") == 1
        assert len(set(_remote_ids(webshop, "/reset"))) == 1


def test_calls_on_one_episode_are_serialised():
    with TextCraftServer(delay_s=0.02) as fake:
        episode = bridge("textcraft", fake.url).reset(1)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: episode.step("inventory"), range(8)))
        assert len(results) == 8 and fake.overlaps == []
        # the fake does see overlapping calls where nothing serialises them
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: requests.post(fake.url + "/step", json={"id": 0, "action": "inventory"},
                                                  timeout=5), range(4)))
        assert fake.overlaps
        episode.close()


def test_babyai_actions_are_read_from_the_observation():
    babyai = PROFILES["babyai"]()
    seen = 'Your goal: go to the red ball\nYou see a red ball.\nAvailable actions: ["turn left", "go to red ball 1"]'
    assert babyai.actions(None, 0, None, seen) == ["turn left", "go to red ball 1"]
    assert babyai.actions(None, 0, None, "You see nothing.\nAvailable actions: [") == []  # none: no bracket
    assert babyai.succeeded(0.62) and not babyai.succeeded(0.0)


def test_profiles_cover_agentgyms_servers():
    assert set(PROFILES) == set(NAMES) == set(SERVERS)
