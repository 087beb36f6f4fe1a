"""One conformance suite that every environment passes, over the real gRPC service.

Parametrised by every registered environment (the built-ins and installed plugins), so an environment
joins the suite by being registered; FEDSE_CONFORMANCE_ENVS (comma-separated specs, as the env server's
--envs takes them) runs it against others, e.g. FEDSE_CONFORMANCE_ENVS="mine=mypkg.envs:make". The
expert's checks run where an environment has one, the admissible actions' where it lists them.
"""

from __future__ import annotations

import os
import re
import threading

import grpc
import pytest

from fedse.transport.serving import insecure_channel
from fedse.v1 import env_pb2 as epb
from fedse.v1 import env_pb2_grpc as epb_grpc
from services.env_server import registry
from services.env_server.server import EnvServerConfig, create_server

SPECS = os.environ.get("FEDSE_CONFORMANCE_ENVS") or ",".join(registry.known_names())
ENVS = [spec.name for spec in registry.parse_specs(SPECS)]

# The train / test task counts of the paper's environments (from AgentGym).
SPLIT_SIZES = {"maze": (215, 25), "wordle": (955, 25), "babyai": (810, 90), "textcraft": (374, 100),
               "webshop": (3930, 200)}
SAYS_INVALID = re.compile(r"invalid|could not|cannot|not a valid|not admissible|not recognized|nothing happens", re.IGNORECASE)
NONSENSE = "xyzzy plugh 42"


@pytest.fixture(scope="module")
def stub():
    server, port = create_server(EnvServerConfig(address="127.0.0.1:0", envs=SPECS, metrics_port=-1,
                                                 max_sessions=256))
    server.start()
    server.ready([])
    with insecure_channel(f"127.0.0.1:{port}") as channel:
        yield epb_grpc.EnvServiceStub(channel)
    server.stop(0)


def tasks(stub, env: str, split: str) -> tuple[list[int], int]:
    resp = stub.ListTasks(epb.ListTasksRequest(env=env, split=split), timeout=30)
    return list(resp.task_ids), resp.max_turns


@pytest.fixture(scope="module")
def info(stub) -> dict[str, epb.EnvironmentInfo]:
    return {e.name: e for e in stub.ListEnvironments(epb.ListEnvironmentsRequest(), timeout=5).environments}


def play_expert(stub, env: str, task_id: int) -> tuple[list[tuple[str, str]], epb.StepResponse]:
    """Plays a task with the expert where the environment has one, else with the first listed action
    (or a fixed one where none are listed): the same task always gets the same actions."""
    reset = stub.Reset(epb.ResetRequest(env=env, task_id=task_id), timeout=30)
    trace = [(reset.instruction, reset.observation)]
    listed = list(reset.available_actions)
    while True:
        try:
            action = stub.ExpertAction(epb.ExpertActionRequest(session_id=reset.session_id), timeout=30).action
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNIMPLEMENTED, err
            action = listed[0] if listed else NONSENSE
        step = stub.Step(epb.StepRequest(session_id=reset.session_id, action=action), timeout=30)
        listed = list(step.available_actions)
        trace.append((action, step.observation))
        if step.done:
            stub.Close(epb.CloseRequest(session_id=reset.session_id), timeout=30)
            return trace, step


def test_every_environment_is_listed_with_its_capabilities(stub, info):
    assert sorted(stub.ListEnvironments(epb.ListEnvironmentsRequest(), timeout=5).envs) == sorted(ENVS)
    assert sorted(info) == sorted(ENVS)
    for name, e in info.items():
        assert e.max_turns == tasks(stub, name, "train")[1] > 0
        if name in SPLIT_SIZES:  # every built-in has an expert and lists its actions
            assert e.has_expert and e.lists_actions


@pytest.mark.parametrize("env", ENVS)
def test_split_sizes_and_disjoint_ids(stub, env):
    train, max_turns = tasks(stub, env, "train")
    test, _ = tasks(stub, env, "test")
    if env in SPLIT_SIZES:
        assert (len(train), len(test)) == SPLIT_SIZES[env]
    assert train and test
    assert not set(train) & set(test)
    assert max_turns > 0


@pytest.mark.parametrize("env", ENVS)
def test_expert_solves_every_test_task_and_reward_agrees_with_success(stub, info, env):
    if not info[env].has_expert:
        reset = stub.Reset(epb.ResetRequest(env=env, task_id=tasks(stub, env, "test")[0][0]), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            stub.ExpertAction(epb.ExpertActionRequest(session_id=reset.session_id), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "no expert" in err.value.details()
        stub.Close(epb.CloseRequest(session_id=reset.session_id), timeout=30)
        return
    test, max_turns = tasks(stub, env, "test")
    failed = []
    for task_id in test:
        trace, last = play_expert(stub, env, task_id)
        assert last.success == (last.reward == 1.0), (task_id, last.reward, last.success)
        assert len(trace) - 1 <= max_turns
        if not last.success:
            failed.append(task_id)
    assert not failed, f"{env}: the expert failed test tasks {failed[:10]}"


@pytest.mark.parametrize("env", ENVS)
def test_same_task_id_same_episode(stub, env):
    test, _ = tasks(stub, env, "test")
    train, _ = tasks(stub, env, "train")
    for task_id in (test[0], train[len(train) // 2]):
        assert play_expert(stub, env, task_id)[0] == play_expert(stub, env, task_id)[0]


@pytest.mark.parametrize("env", ENVS)
def test_admissible_actions_are_accepted(stub, info, env):
    train, _ = tasks(stub, env, "train")
    reset = stub.Reset(epb.ResetRequest(env=env, task_id=train[0]), timeout=30)
    if not info[env].lists_actions:
        assert not reset.available_actions
        stub.Close(epb.CloseRequest(session_id=reset.session_id), timeout=30)
        return
    assert reset.available_actions
    for action in list(reset.available_actions)[:5]:
        r = stub.Reset(epb.ResetRequest(env=env, task_id=train[0]), timeout=30)
        step = stub.Step(epb.StepRequest(session_id=r.session_id, action=action), timeout=30)
        assert step.valid_action, (action, step.observation)
        assert step.turn == 1
        stub.Close(epb.CloseRequest(session_id=r.session_id), timeout=30)
    stub.Close(epb.CloseRequest(session_id=reset.session_id), timeout=30)


@pytest.mark.parametrize("env", ENVS)
def test_invalid_action_costs_a_turn_says_so_and_the_turn_limit_ends_the_episode(stub, info, env):
    train, max_turns = tasks(stub, env, "train")
    reset = stub.Reset(epb.ResetRequest(env=env, task_id=train[1 % len(train)]), timeout=30)
    for turn in range(1, max_turns + 1):
        step = stub.Step(epb.StepRequest(session_id=reset.session_id, action=NONSENSE), timeout=30)
        assert step.turn == turn
        assert step.reward == 0.0 and not step.success
        assert not step.valid_action or not info[env].lists_actions
        if turn == 1 and info[env].lists_actions:
            assert SAYS_INVALID.search(step.observation), step.observation
        assert step.done == (turn == max_turns), (turn, step.done)
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(epb.StepRequest(session_id=reset.session_id, action=NONSENSE), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stub.Close(epb.CloseRequest(session_id=reset.session_id), timeout=30)


@pytest.mark.parametrize("env", ENVS)
def test_sessions_are_independent_under_concurrent_use(stub, env):
    test, _ = tasks(stub, env, "test")
    chosen = test[:6]
    alone = {t: play_expert(stub, env, t)[0] for t in chosen}
    together: dict[int, list] = {}

    def run(task_id: int) -> None:
        together[task_id] = play_expert(stub, env, task_id)[0]

    threads = [threading.Thread(target=run, args=(t,)) for t in chosen for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert together == alone


@pytest.mark.parametrize("env", ENVS)
def test_bad_requests_get_clear_statuses(stub, env):
    train, _ = tasks(stub, env, "train")
    test, _ = tasks(stub, env, "test")
    unknown_task = max(train + test) + 1
    with pytest.raises(grpc.RpcError) as err:
        stub.Reset(epb.ResetRequest(env=env, task_id=unknown_task), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and str(unknown_task) in err.value.details()
    reset = stub.Reset(epb.ResetRequest(env=env, task_id=train[0]), timeout=30)
    for action in ("", "x" * 5000):
        with pytest.raises(grpc.RpcError) as err:
            stub.Step(epb.StepRequest(session_id=reset.session_id, action=action), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.Close(epb.CloseRequest(session_id=reset.session_id), timeout=30)


def test_unknown_environment_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.ListTasks(epb.ListTasksRequest(env="tetris", split="test"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "tetris" in err.value.details()


def test_fedse_tasks_prints_the_counts_from_list_tasks():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "apps.cli", "tasks"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:]}
    for env in SPLIT_SIZES:
        assert rows[env][:2] == [str(n) for n in SPLIT_SIZES[env]]
