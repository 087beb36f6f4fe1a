"""The example environment's own test: its splits, its expert and its rules."""

from fedse.env import UnknownTask

import pytest

from fedse_countdown import Countdown


def test_the_expert_reaches_every_test_target_within_the_turn_limit():
    env = Countdown(seed=0)
    for task in env.tasks("test"):
        episode, turns = env.reset(task), 0
        while True:
            result = episode.step(episode.expert_action())
            turns += 1
            if result.done:
                break
        assert result.success and result.reward == 1.0 and turns <= env.max_turns


def test_splits_are_disjoint_seeded_and_sized_by_the_option():
    small, large = Countdown(seed=0, largest=12), Countdown(seed=0)
    assert not set(small.tasks("train")) & set(small.tasks("test"))
    assert len(large.tasks("train")) > len(small.tasks("train"))
    assert small.reset(small.tasks("test")[0]).observation == Countdown(seed=0, largest=12).reset(0).observation
    with pytest.raises(UnknownTask):
        small.reset(10_000)


def test_overshooting_loses_and_a_bad_action_costs_nothing_but_the_turn():
    env = Countdown(seed=0)
    episode = env.reset(env.tasks("train")[0])
    assert not episode.step("jump").valid
    while not (result := episode.step("double")).done:
        pass
    assert result.success == (episode.number == episode.target)
