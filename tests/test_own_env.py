"""An environment an organisation brings, without an expert and without listed actions, served by a
real env server (`say=say_env:SayEnv`, tests/say_env.py): the client never asks for expert actions,
seeds its buffer from an AgentTraj file, writes its actions as ReAct text (the tiny model writes
nothing valid, and says so), trains on the demonstrations' whole text and federates a round."""

from __future__ import annotations

import json
import logging
import math

import pytest
from prometheus_client import REGISTRY

import say_env
from services.client_agent.training.buffer import Buffer
from services.client_agent.config import ClientConfig
from services.client_agent.playing.envclient import EnvClient
from services.client_agent.playing.prompts import fallback_action, parse_react
from support import FakeAggregator, aggregator_in_process, serve_fake


@pytest.fixture(scope="module")
def env_target():
    from services.env_server.server import EnvServerConfig, create_server

    server, port = create_server(EnvServerConfig(address="127.0.0.1:0", envs="say=say_env:SayEnv,maze",
                                                 metrics_port=-1))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def expert_calls(monkeypatch):
    """The environments ExpertAction was asked about."""
    calls: list[str] = []
    real = EnvClient.expert_action

    def counted(self, session):
        calls.append(self.env)
        return real(self, session)
    monkeypatch.setattr(EnvClient, "expert_action", counted)
    return calls


def written(phase: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("fedse_client_written_actions_total", {"phase": phase, "outcome": outcome}) or 0.0


def test_an_expertless_environment_without_actions_trains_on_files_and_federates_a_round(
        env_target, tmp_path, expert_calls, caplog):
    from services.client_agent.agent import ClientAgent

    demos = tmp_path / "say.jsonl"
    demos.write_text("".join(json.dumps(say_env.demo_record(i)) + "\n" for i in range(4, 10)))
    before = {(p, o): written(p, o) for p in ("eval", "explore") for o in ("parsed", "unparsed")}
    with aggregator_in_process(tmp_path / "agg", rounds=1, min_clients=1) as (agg, port, run_dir):
        cfg = ClientConfig(client_id="org-say", env="say", env_server=env_target, aggregator=f"127.0.0.1:{port}",
                           state_dir=str(tmp_path / "state"), metrics_port=-1, demos=(str(demos),), expert_demos=5,
                           explore_tasks=2, eval_tasks=2, epochs=1, torch_threads=1, concurrency=2, max_new_tokens=24,
                           keep="all", round_timeout_s=60.0)
        agent = ClientAgent(cfg)
        try:
            with caplog.at_level(logging.INFO, logger="client_agent"):
                history = agent.run()
            # Starting again from the recorded state seeds nothing twice.
            seeded = len(agent.buffer)
            agent.seed_buffer([agent.env_tasks(agent.envs[0], agent.envs[0].environments()["say"])])
            assert len(agent.buffer) == seeded
        finally:
            agent.close()
        assert (run_dir / "global" / "round_0001").is_dir()  # the round was aggregated
    assert expert_calls == []  # ExpertAction was never called (the server would answer UNIMPLEMENTED)
    assert [h["round"] for h in history] == [0, 1]
    first, final = history
    # D_0 is the file's six demonstrations, counted apart from what exploration kept.
    assert (first["demos_file"], first["demos_expert"], first["kept"], first["buffer"]) == (6, 0, 2, 8)
    assert final["demos_file"] == 6
    # Every written turn is counted; the tiny model's bytes rarely name an action.
    for m in (first, final):
        assert 0 <= m["parseable_action_rate"] <= 1 and 0 <= m["eval_parseable_action_rate"] <= 1
    assert 0 <= first["explore_parseable_action_rate"] <= 1
    assert math.isfinite(first["train_loss"]) and first["upload_bytes"] > 0
    buffer = Buffer(tmp_path / "state" / "org-say" / "buffer.jsonl").trajectories
    files = [t for t in buffer if t.source == "file"]
    assert [t.task_id for t in files] == list(range(4, 10)) and all(t.round == -1 for t in files)
    assert files[0].texts == (say_env.demo_record(4)["conversations"][3]["value"],)
    explored = [t for t in buffer if t.source == "explore"]
    assert len(explored) == 2 and all(len(t.texts) == len(t.turns) for t in explored)
    for t in explored:  # the whole text kept; the action sent is the one parsed from it, or its fallback
        for (_, action), text in zip(t.turns, t.texts):
            assert action == (parse_react(text) or fallback_action(text))
    # Training covered every turn: the demonstrations' and the explorations'.
    assert first["examples"] == sum(len(t.turns) for t in buffer)
    turns_written = {k: written(*k) - v for k, v in before.items()}
    assert turns_written[("explore", "parsed")] + turns_written[("explore", "unparsed")] == \
        sum(len(t.turns) for t in explored)
    assert REGISTRY.get_sample_value("fedse_client_demonstrations", {"env": "say", "source": "file"}) == 6
    messages = [r.getMessage() for r in caplog.records]
    assert any("has no expert: its seed demonstrations are the files' only" in m for m in messages)
    assert any("tiny model cannot learn where it must write its actions" in m for m in messages)


def test_two_environments_seed_from_the_expert_where_there_is_one_and_route_file_records_by_item_id(
        env_target, tmp_path, expert_calls):
    from services.client_agent.agent import ClientAgent

    maze = {"item_id": "maze_40", "conversations": [
        {"from": "human", "loss": None, "value": "You are an expert maze solver."},
        {"from": "gpt", "loss": False, "value": "OK."},
        {"from": "human", "loss": None, "value": "The goal is at position 8, 6. Your current position is at 1, 1."},
        {"from": "gpt", "loss": True, "value": "Thought:\nDown first.\n\nAction:\nmove down"}]}
    demos = tmp_path / "mixed.json"
    demos.write_text(json.dumps([say_env.demo_record(5), maze, say_env.demo_record(6)]))
    agg = FakeAggregator(round_=0, num_rounds=1, advance=True)
    server, target = serve_fake(agg)
    cfg = ClientConfig(client_id="org-two", env="say,maze", env_server=env_target, aggregator=target,
                       state_dir=str(tmp_path), metrics_port=-1, demos=(str(demos),), expert_demos=2, explore_tasks=1,
                       eval_tasks=1, epochs=1, torch_threads=1, concurrency=2, max_new_tokens=16,
                       round_timeout_s=60.0)
    agent = ClientAgent(cfg)
    try:
        history = agent.run()
    finally:
        agent.close()
        server.stop(0)
    assert set(expert_calls) == {"maze"}  # only the environment that has an expert was asked
    buffer = Buffer(tmp_path / "org-two" / "buffer.jsonl").trajectories
    seeds = sorted((t.env, t.source, t.task_id) for t in buffer if t.round == -1)
    expert = [s for s in seeds if s[1] == "expert"]
    assert [s for s in seeds if s[1] == "file"] == [("maze", "file", 40), ("say", "file", 5), ("say", "file", 6)]
    assert len(expert) == 2 and {s[0] for s in expert} == {"maze"}
    assert history[0]["demos_file"] == 3 and history[0]["demos_expert"] == 2
    # Only the environment without actions was written in; the maze's turns were picked by scoring.
    assert "parseable_action_rate" in history[0]
    assert all(not t.texts for t in buffer if t.env == "maze" and t.source != "file")
