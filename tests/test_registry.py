"""The environment registry (specs, factories, typed options) and what the env server does with an
environment's optional capabilities and outside-service failures, over real gRPC."""

from __future__ import annotations

import grpc
import pytest

from fedse.env import (Environment, EnvironmentFailed, EnvironmentUnavailable, Episode, EpisodeLost, NumberedTasks,
                       StepResult)
from fedse.transport.serving import insecure_channel
from fedse.v1 import env_pb2 as epb
from fedse.v1 import env_pb2_grpc as epb_grpc
from services.env_server import registry
from services.env_server.registry import EnvSpec, RegistryError, parse_spec, parse_specs
from services.env_server.server import EnvServerConfig, create_server
from services.env_server.sessions import SessionManager


# ---- specs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,spec", [
    ("maze", EnvSpec("maze", "maze", (), "maze")),
    (" wordle?vocab_size=30 ", EnvSpec("wordle", "wordle", (("vocab_size", "30"),), "wordle?vocab_size=30")),
    ("w2=wordle?vocab_size=40&x=1", EnvSpec("w2", "wordle", (("vocab_size", "40"), ("x", "1")),
                                            "w2=wordle?vocab_size=40&x=1")),
    ("mine=pkg.mod:Make.env", EnvSpec("mine", "pkg.mod:Make.env", (), "mine=pkg.mod:Make.env")),
    ("tc=agentgym:textcraft@http://127.0.0.1:36001?test=0-9",
     EnvSpec("tc", "agentgym:textcraft@http://127.0.0.1:36001", (("test", "0-9"),),
             "tc=agentgym:textcraft@http://127.0.0.1:36001?test=0-9")),
])
def test_specs_parse_into_name_source_and_options(text, spec):
    assert parse_spec(text) == spec


@pytest.mark.parametrize("text,says", [
    ("", "the name '' must be"),
    ("a b", "the name 'a b' must be"),
    ("x=", "nothing after '='"),
    ("x=pkg.mod:", "is not package.module:factory"),
    ("x=agentgym:textcraft@ftp://h", "an AgentGym bridge is NAME=agentgym:PROFILE@URL"),
    ("maze?vocab", "option 'vocab' is not KEY=VALUE"),
    ("maze?a=1&a=2", "option 'a' is given twice"),
])
def test_malformed_specs_say_what_is_wrong(text, says):
    with pytest.raises(RegistryError, match=says):
        parse_spec(text)


def test_a_name_given_twice_is_refused_but_another_name_may_serve_the_same_environment():
    with pytest.raises(RegistryError, match="named twice"):
        parse_specs("maze,maze?x=1")
    assert [s.name for s in parse_specs("maze,maze2=maze")] == ["maze", "maze2"]


# ---- factories and typed options ---------------------------------------------------------------------
class Flip(Episode):
    """Guess the hidden side; no expert, no listed actions: the smallest environment there is."""

    def __init__(self, side: str, fail: Exception | None = None):
        self.side, self.fail = side, fail
        self.instruction, self.observation = "Say heads or tails.", "A coin was flipped."
        self.closed = 0

    def step(self, action: str) -> StepResult:
        if self.fail is not None:
            raise self.fail
        won = action.strip() == self.side
        return StepResult("right" if won else "wrong", float(won), True, won)

    def close(self) -> None:
        self.closed += 1


class Coin(Environment):
    max_turns = 1
    episodes: list[Flip] = []

    def __init__(self, seed: int = 0, sides: int = 2, loud: bool = False, label: str = "", fail: str = ""):
        self.options = (seed, sides, loud, label)
        self.split = NumberedTasks("coin", ["heads"], ["tails"] * sides)
        self.fail = {"": None, "unavailable": EnvironmentUnavailable("coin server at http://x unreachable"),
                     "failed": EnvironmentFailed("coin server said: bad id 7"),
                     "lost": EpisodeLost("coin server forgot id 7")}[fail]

    def tasks(self, split: str) -> list[int]:
        return self.split.ids(split)

    def reset(self, task_id: int) -> Episode:
        episode = Flip(self.split[task_id], self.fail)
        Coin.episodes.append(episode)
        return episode


def make_coin(**kwargs) -> Coin:
    return Coin(**kwargs)


def test_options_reach_the_factory_typed_and_the_name_is_the_specs():
    env = registry.build(parse_spec("c=test_registry:Coin?sides=3&loud=yes&label=a b"), seed=7)
    assert env.name == "c" and env.options == (7, 3, True, "a b")
    assert len(env.tasks("train")) == 3
    # A factory taking **kwargs gets every option, as text.
    assert registry.build(parse_spec("d=test_registry:make_coin?label=x"), seed=1).options == (1, 2, False, "x")


@pytest.mark.parametrize("text,says", [
    ("c=test_registry:Coin?sides=two", "option sides='two' is not an int"),
    ("c=test_registry:Coin?loud=maybe", "option loud='maybe' is not true or false"),
    ("c=test_registry:Coin?colour=red", "no option 'colour'; it takes fail, label, loud, sides"),
    ("c=test_registry:Coin?seed=3", "the seed is the server's"),
    ("c=test_registry:Flip", "its factory failed: TypeError"),
    ("c=test_registry:SPECS", "is a list, not a callable"),
    ("c=fedse.env:StepResult", "its factory failed: TypeError"),
    ("c=test_registry:make_flip", "returned a Flip, not a fedse.env.Environment"),
])
def test_a_factory_that_cannot_build_says_why(text, says):
    with pytest.raises(RegistryError, match=says):
        registry.build(parse_spec(text))


SPECS: list = []


def make_flip() -> Flip:
    return Flip("heads")


def test_wordle_takes_its_vocabulary_as_an_option():
    small = registry.build(parse_spec("wordle?vocab_size=30"))
    assert len(small.vocab) == 30
    with pytest.raises(RegistryError, match="its factory failed: ValueError: wordle vocabulary size"):
        registry.build(parse_spec("wordle?vocab_size=3"))


# ---- capabilities and failures over gRPC ---------------------------------------------------------------
@pytest.fixture()
def stub():
    server, port = create_server(EnvServerConfig(
        address="127.0.0.1:0", metrics_port=-1,
        envs="coin=test_registry:Coin,down=test_registry:Coin?fail=unavailable,"
             "refused=test_registry:Coin?fail=failed,lost=test_registry:Coin?fail=lost,maze"))
    server.start()
    with insecure_channel(f"127.0.0.1:{port}") as channel:
        yield epb_grpc.EnvServiceStub(channel)
    server.stop(0)


def test_capabilities_are_listed_and_an_environment_without_expert_answers_unimplemented(stub):
    info = {e.name: e for e in stub.ListEnvironments(epb.ListEnvironmentsRequest(), timeout=5).environments}
    assert (info["coin"].has_expert, info["coin"].lists_actions, info["coin"].max_turns) == (False, False, 1)
    assert (info["maze"].has_expert, info["maze"].lists_actions, info["maze"].max_turns) == (True, True, 15)
    reset = stub.Reset(epb.ResetRequest(env="coin", task_id=0), timeout=5)
    assert list(reset.available_actions) == []
    with pytest.raises(grpc.RpcError) as err:
        stub.ExpertAction(epb.ExpertActionRequest(session_id=reset.session_id), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "coin has no expert" in err.value.details() and "--demos" in err.value.details()
    step = stub.Step(epb.StepRequest(session_id=reset.session_id, action="heads"), timeout=5)
    assert step.done and step.success


def test_outside_service_failures_get_their_statuses_and_a_lost_episode_ends_its_session(stub):
    for env, code, says in (("down", grpc.StatusCode.UNAVAILABLE, "unreachable"),
                            ("refused", grpc.StatusCode.FAILED_PRECONDITION, "bad id 7"),
                            ("lost", grpc.StatusCode.NOT_FOUND, "forgot id 7")):
        reset = stub.Reset(epb.ResetRequest(env=env, task_id=0), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            stub.Step(epb.StepRequest(session_id=reset.session_id, action="heads"), timeout=5)
        assert err.value.code() == code and says in err.value.details(), env
    # The lost one's session is gone, and says why.
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(epb.StepRequest(session_id=reset.session_id, action="heads"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "was lost by the service" in err.value.details()


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_episodes_are_closed_once_when_their_sessions_close_expire_or_do_not_fit():
    clock = Clock()
    manager = SessionManager({"coin": Coin()}, ttl_s=10, max_sessions=2, clock=clock)
    Coin.episodes.clear()
    closed = manager.reset("coin", 0)
    manager.reset("coin", 1)
    manager.close(closed.session_id)
    assert [e.closed for e in Coin.episodes] == [1, 0]
    clock.now += 11
    assert manager.sweep() == 1
    assert [e.closed for e in Coin.episodes] == [1, 1]
    manager.reset("coin", 0)
    manager.reset("coin", 1)
    with pytest.raises(Exception, match="limit of this server"):
        manager.reset("coin", 2)
    assert [e.closed for e in Coin.episodes] == [1, 1, 0, 0, 1]  # the one that did not fit
