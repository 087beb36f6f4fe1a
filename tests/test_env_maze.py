"""Maze rules: moves, walls, invalid actions, the turn limit, the expert, the task splits."""

from __future__ import annotations

import pytest

from lockstep import play_side_by_side
from services.env_server.envs.maze import GOAL, NUM_TEST, NUM_TRAIN, STARTS, MazeEnv, describe, shortest_path_actions
from services.env_server.sessions import Outcome, SessionManager

# From the top-left corner (1, 1): along the top, down the left arm, along the bar, down the stem.
PATH_FROM_1_1 = ["move right"] * 2 + ["move down"] * 4 + ["move right"] * 3 + ["move down"] * 3


@pytest.fixture(scope="module")
def env() -> MazeEnv:
    return MazeEnv(seed=0)


def test_splits_have_the_papers_counts_and_disjoint_ids(env):
    test, train = env.tasks("test"), env.tasks("train")
    assert (len(train), len(test)) == (NUM_TRAIN, NUM_TEST) == (215, 25)
    assert not set(test) & set(train)
    assert len(STARTS) == 25 and GOAL not in STARTS
    # Each of the 25 starts is one test task.
    assert {env.reset(t).position for t in test} == set(STARTS)


def test_known_path_succeeds_on_exactly_its_last_move(env):
    episode = env.reset(0)
    assert episode.position == (1, 1)
    for action in PATH_FROM_1_1[:-1]:
        result = episode.step(action)
        assert not result.done and result.reward == 0.0 and result.valid
    result = episode.step(PATH_FROM_1_1[-1])
    assert (result.done, result.success, result.reward, result.observation) == (True, True, 1.0, "Success")
    assert episode.position == GOAL
    assert len(PATH_FROM_1_1) == 12 == len(shortest_path_actions((1, 1)))


def test_observation_names_goal_position_and_walls_in_lmrl_gym_words(env):
    episode = env.reset(0)
    assert episode.observation == (
        "The goal is at position 8, 6. Your current position is at position 1, 1. "
        "There are walls to your left, above you, below you.")
    # Two-digit coordinates are written digit by digit, as LMRL-Gym writes them.
    assert describe((1, 10)) == (
        "The goal is at position 8, 6. Your current position is at position 1, 1 0. "
        "There are walls above you, below you.")
    assert describe((5, 6)).endswith("There is a wall above you.")


def test_walking_into_a_wall_keeps_the_position(env):
    episode = env.reset(0)
    before = episode.observation
    result = episode.step("move up")
    assert episode.position == (1, 1)
    assert result.valid and not result.done and result.observation == before


def test_invalid_action_costs_a_turn_and_says_so():
    manager = SessionManager({"maze": MazeEnv()})
    session = manager.reset("maze", 0).session_id
    step = manager.step(session, "jump over the wall")
    assert not step.valid and step.turn == 1 and not step.done
    assert step.observation.startswith("Invalid action: 'jump over the wall'. Valid actions are: move up")
    assert "Your current position is at position 1, 1." in step.observation
    # The next valid move is the second turn.
    assert manager.step(session, "move right").turn == 2


def test_actions_are_case_and_space_insensitive(env):
    episode = env.reset(0)
    assert episode.step("  Move Right ").valid
    assert episode.position == (1, 2)


def test_turn_limit_truncates_the_episode():
    manager = SessionManager({"maze": MazeEnv()})
    session = manager.reset("maze", 0).session_id
    for turn in range(1, 16):
        step = manager.step(session, "move up")
    assert (step.turn, step.done, step.success, step.outcome) == (15, True, False, Outcome.TRUNCATED)
    assert step.available_actions == []


@pytest.mark.parametrize("split", ["test", "train"])
def test_expert_solves_every_task_within_the_turn_limit(env, split):
    manager = SessionManager({"maze": env})
    for task in env.tasks(split):
        session = manager.reset("maze", task).session_id
        step = None
        while step is None or not step.done:
            step = manager.step(session, manager.expert_action(session))
        assert step.success and step.reward == 1.0, f"task {task}"
        assert step.turn <= env.max_turns
        manager.close(session)


def test_tasks_are_deterministic_per_seed():
    a, b, c = MazeEnv(seed=1), MazeEnv(seed=1), MazeEnv(seed=2)
    starts = lambda env: [env.reset(t).position for t in env.tasks("train")]  # noqa: E731
    assert starts(a) == starts(b)
    assert starts(a) != starts(c)


def test_play_side_by_side_records_every_turn_and_whether_it_was_the_experts_choice():
    env = MazeEnv()
    tasks = env.tasks("test")[:6]
    expert = play_side_by_side(env, tasks, None, lambda instruction, turns, obs: obs)
    assert [p.task_id for p in expert] == tasks and all(p.success and p.agree == len(p.steps) for p in expert)

    calls = []

    def each_in_turn(prompts, cands):  # turn k: the k-th candidate
        calls.append(len(prompts))
        return [(len(calls) - 1) % len(c) for c in cands]

    played = play_side_by_side(env, tasks, each_in_turn, lambda instruction, turns, obs: f"{len(turns)}|{obs}", max_turns=4)
    assert calls[0] == len(tasks) and len(calls) <= 4
    for p in played:
        episode = env.reset(p.task_id)
        assert 1 <= len(p.steps) <= 4 and len(p.agreed) == len(p.steps)
        for k, (prompt, action) in enumerate(p.steps):
            assert prompt == f"{k}|{episode.observation}" and action == episode.available_actions()[k % 4]
            assert p.agreed[k] == (action == episode.expert_action())
            result = episode.step(action)
        assert p.success == result.success
    assert 0 < sum(p.agree for p in played) < sum(len(p.steps) for p in played)
