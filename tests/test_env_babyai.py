"""BabyAI: AgentGym's text and actions on minigrid levels, invalid actions, splits, and the expert."""

from __future__ import annotations

import pytest

from services.env_server.envs.babyai import (
    AGENTGYM_LEVELS,
    DEFAULT_LEVELS,
    NUM_TEST,
    NUM_TRAIN,
    SUCCESS_TEXT,
    UNRECOGNIZED,
    BabyAIEnv,
)
from services.env_server.envs.babyai_view import CHECK, normalize_action
from services.env_server.envs.base import UnknownTask
from services.env_server.sessions import Outcome, SessionManager

# Task 2 is AgentGym's data_idx 2: level 3 (GoToRedBallNoDists), minigrid seed 0. An 8x8 room; the
# agent stands at (6, 5) facing west (-x), the red ball lies at (2, 2): 4 cells ahead and 3 to the
# right (north), and the west wall (x = 0) is 6 cells ahead.
RED_BALL_TASK = 2
# AgentGym's data_idx 18: PickupLoc, minigrid seed 0, "pick up the grey key".
PICKUP_TASK = 18
RED_BALL_OBSERVATION = (
    "Your goal: go to the red ball\n"
    "In front of you in this room, you can see several objects: There is a red ball 1 4 steps in front of "
    "you and 3 steps to your right. The room has walls around you. You are facing a wall 6 steps away. "
    "You are not carrying anything.\n"
    'Available actions: ["turn left", "turn right", "move forward", "pickup red ball 1", "go to red ball 1", '
    '"check available actions"]'
)


@pytest.fixture(scope="module")
def env() -> BabyAIEnv:
    return BabyAIEnv(seed=0)


def run_expert(manager: SessionManager, task: int):
    """Plays the expert through a session; returns (actions, last step)."""
    reset = manager.reset("babyai", task)
    actions, step = [], None
    while step is None or not step.done:
        action = manager.expert_action(reset.session_id)
        assert action in (step.available_actions if step else reset.available_actions), (task, action)
        actions.append(action)
        step = manager.step(reset.session_id, action)
    manager.close(reset.session_id)
    return actions, step


def test_splits_have_the_papers_counts_and_disjoint_ids(env):
    test, train = env.tasks("test"), env.tasks("train")
    assert (len(train), len(test)) == (NUM_TRAIN, NUM_TEST) == (810, 90)
    assert not set(test) & set(train) and len(set(test)) == 90 and len(set(train)) == 810
    # Ids are AgentGym's data_idx over the served levels; the test split holds the lowest seeds.
    assert test[:3] == [0, 1, 2] and max(test) < min(train)
    assert {env.task(t)[0] for t in test} == set(DEFAULT_LEVELS)
    assert env.task(41) == (AGENTGYM_LEVELS[1], 1)
    with pytest.raises(UnknownTask):
        env.reset(6)  # GoToImpUnlock is not served by default
    with pytest.raises(ValueError, match="unknown split"):
        env.tasks("valid")


def test_observation_text_of_a_hand_checked_task(env):
    episode = env.reset(RED_BALL_TASK)
    assert env.task(RED_BALL_TASK) == ("GoToRedBallNoDists", 0)
    assert (tuple(int(v) for v in episode.env.agent_pos), episode.env.agent_dir) == ((6, 5), 2)
    assert episode.observation == RED_BALL_OBSERVATION
    assert episode.instruction.startswith("You are an exploration master")
    assert episode.instruction.endswith("Your goal: go to the red ball")


def test_success_gives_reward_1_and_ends_the_episode(env):
    episode = env.reset(RED_BALL_TASK)
    result = episode.step("go to red ball 1")
    assert (result.reward, result.done, result.success, result.valid) == (1.0, True, True, True)
    assert result.observation.endswith(SUCCESS_TEXT)
    # The ball is now right ahead.
    assert "There is a red ball 1 right in front of you 1 steps away." in result.observation
    assert episode.available_actions() == []


def test_turns_and_moves_change_the_view(env):
    episode = env.reset(RED_BALL_TASK)
    result = episode.step("move forward")  # to (5, 5): the ball is 3 ahead and 3 to the right
    assert result.valid and not result.done and result.reward == 0.0
    assert "There is a red ball 1 3 steps in front of you and 3 steps to your right." in result.observation
    assert "You are facing a wall 5 steps away." in result.observation
    result = episode.step("turn right")  # facing north: the ball is 3 ahead and 3 to the left
    assert "There is a red ball 1 3 steps in front of you and 3 steps to your left." in result.observation
    result = episode.step("turn right")  # facing east: the ball is behind, out of view
    assert "red ball" not in result.observation and "go to red ball 1" not in episode.available_actions()


def test_every_admissible_action_is_accepted(env):
    for task in env.tasks("test")[:30]:
        for action in env.reset(task).available_actions():
            assert env.reset(task).step(action).valid, (task, action)


def test_pick_up_is_read_as_agentgyms_pickup(env):
    assert normalize_action("  Pick  Up red ball 1 ") == "pickup red ball 1"
    assert env.task(PICKUP_TASK) == ("PickupLoc", 0)
    episode = env.reset(PICKUP_TASK)
    assert episode.mission == "pick up the grey key"
    result = episode.step("pick up red ball 1")  # not the mission's object
    assert result.valid and not result.done and "You are carrying a red ball." in result.observation
    assert "drop" in episode.available_actions()
    assert not any(a.startswith("pickup ") for a in episode.available_actions())
    result = env.reset(PICKUP_TASK).step("Pick up grey key 1")
    assert (result.valid, result.done, result.success, result.reward) == (True, True, True, 1.0)


def test_check_available_actions_lists_them_and_uses_a_turn():
    manager = SessionManager({"babyai": BabyAIEnv()})
    session = manager.reset("babyai", RED_BALL_TASK).session_id
    step = manager.step(session, CHECK)
    assert step.valid and step.turn == 1 and not step.done
    assert step.observation.startswith("You can take the following actions: turn left, turn right, move forward")


def test_invalid_action_costs_a_turn_and_says_so():
    manager = SessionManager({"babyai": BabyAIEnv()})
    session = manager.reset("babyai", RED_BALL_TASK).session_id
    step = manager.step(session, "fly to the red ball")
    assert not step.valid and step.turn == 1 and not step.done and step.reward == 0.0
    assert step.observation.startswith(UNRECOGNIZED + " In front of you in this room")
    # An action AgentGym knows but that is not possible here gets AgentGym's reason.
    step = manager.step(session, "drop")
    assert not step.valid and step.turn == 2
    assert step.observation.startswith("You cannot drop the object, as you are not carrying anything.")
    assert manager.step(session, "go to red ball 1").outcome is Outcome.SUCCESS


def test_turn_limit_truncates_the_episode():
    manager = SessionManager({"babyai": BabyAIEnv()})
    session = manager.reset("babyai", RED_BALL_TASK).session_id
    for _ in range(20):
        step = manager.step(session, "turn left")
    assert (step.turn, step.done, step.success, step.outcome) == (20, True, False, Outcome.TRUNCATED)


def test_expert_solves_every_test_task_within_the_turn_limit(env):
    manager = SessionManager({"babyai": env})
    for task in env.tasks("test"):
        actions, step = run_expert(manager, task)
        assert step.success and step.reward == 1.0, (task, env.task(task), actions)
        assert step.turn <= env.max_turns == 20


def test_tasks_and_expert_are_deterministic_per_task_id():
    a, b = BabyAIEnv(), BabyAIEnv()
    manager_a, manager_b = SessionManager({"babyai": a}), SessionManager({"babyai": b})
    for task in a.tasks("test")[::9] + a.tasks("train")[::200]:
        assert a.reset(task).observation == b.reset(task).observation
        assert run_expert(manager_a, task)[0] == run_expert(manager_b, task)[0]
    # Another env seed gives other layouts.
    assert BabyAIEnv(seed=1).reset(RED_BALL_TASK).observation != a.reset(RED_BALL_TASK).observation


def test_levels_can_be_chosen_and_the_action_list_left_out():
    env = BabyAIEnv(levels=["GoToRedBall"], actions_in_observation=False)
    assert {env.task(t)[0] for t in env.tasks("test") + env.tasks("train")} == {"GoToRedBall"}
    assert env.tasks("test")[:2] == [1, 41]
    assert "Available actions" not in env.reset(1).observation
    with pytest.raises(ValueError, match="unknown BabyAI levels"):
        BabyAIEnv(levels=["NoSuchLevel"])


@pytest.mark.slow
def test_expert_solves_every_training_task_within_the_turn_limit(env):
    manager = SessionManager({"babyai": env})
    for task in env.tasks("train"):
        actions, step = run_expert(manager, task)
        assert step.success and step.turn <= env.max_turns, (task, env.task(task), actions)
