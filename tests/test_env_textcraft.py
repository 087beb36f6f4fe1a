"""TextCraft: recipes from minecraft-data, AgentGym's texts, tags, invalid actions, splits, the expert."""

from __future__ import annotations

import random

import pytest

from services.env_server.envs.base import UnknownTask
from services.env_server.envs.textcraft import (
    EMPTY_INVENTORY,
    MAX_ACTIONS,
    MAX_TURNS,
    NUM_TEST,
    NUM_TRAIN,
    Task,
    TextCraftEnv,
    TextCraftEpisode,
    goal_pool,
    make_task,
    plan,
)
from services.env_server.envs.textcraft_recipes import Recipe, crafting_book, display
from services.env_server.sessions import Outcome, SessionManager


@pytest.fixture(scope="module")
def env() -> TextCraftEnv:
    return TextCraftEnv(seed=0)


@pytest.fixture(scope="module")
def book():
    return crafting_book()


def _texts(book, item: str) -> list[str]:
    return [r.text for r in book.recipes_of[item]]


def _stick_episode(book) -> TextCraftEpisode:
    """Goal stick, shown: its two recipes and oak planks' (no distractors)."""
    shown = book.recipes_of["stick"] + book.recipes_of["oak_planks"]
    return TextCraftEpisode(book, Task("stick", shown, frozenset()))


# ---- recipes


def test_recipes_are_minecraft_116_crafting_recipes_in_agentgym_words(book):
    # Shaped: counts from the shape, in the order the shape first names them; the result count.
    assert _texts(book, "dark_oak_sign") == ["craft 3 dark oak sign using 6 dark oak planks, 1 stick"]
    assert _texts(book, "golden_carrot") == ["craft 1 golden carrot using 8 gold nugget, 1 carrot"]
    assert _texts(book, "chest") == ["craft 1 chest using 8 planks"]
    # Shapeless, and a recipe kept separate per variant (not a tag: the vanilla files list each flower).
    assert _texts(book, "blue_dye") == ["craft 1 blue dye using 1 lapis lazuli", "craft 1 blue dye using 1 cornflower"]
    # minecraft-data writes a recipe once per tag member; they are folded back into tags.
    assert sorted(_texts(book, "stick")) == ["craft 1 stick using 2 bamboo", "craft 4 stick using 2 planks"]
    assert _texts(book, "oak_planks") == ["craft 4 oak planks using 1 oak logs"]
    assert _texts(book, "campfire") == ["craft 1 campfire using 3 stick, 1 coals, 3 logs"]
    assert _texts(book, "stone_pickaxe") == ["craft 1 stone pickaxe using 3 stone tool materials, 2 stick"]
    assert book.tags["#oak_logs"] == ("oak_log", "oak_wood", "stripped_oak_log", "stripped_oak_wood")
    assert len(book.tags["#planks"]) == 8 and len(book.tags["#logs"]) == 32
    assert display("#soul_fire_base_blocks") == "soul fire base blocks"


def test_block_unpacking_and_cycles_are_dropped_so_ingots_are_base_items(book):
    # AgentGym drops "9 iron ingot from 1 iron block"; of the ingot <-> nugget cycle the 9-to-1 goes.
    assert book.is_base("iron_ingot") and book.is_base("gold_ingot") and book.is_base("diamond")
    assert _texts(book, "iron_nugget") == ["craft 9 iron nugget using 1 iron ingot"]
    assert _texts(book, "iron_block") == ["craft 1 iron block using 9 iron ingot"]
    assert book.is_base("honey_block") and "honey_bottle" in book.recipes_of
    assert not book.is_base("stick") and not book.is_base("#planks") and not book.is_base("dirt_block")


def test_depth_is_agentgyms_min_depth(book):
    assert book.depth["oak_log"] == 0 and book.depth["#oak_logs"] == 0
    assert book.depth["oak_planks"] == book.depth["#planks"] == 1
    assert book.depth["stick"] == 1  # 2 bamboo -> 1 stick
    assert book.depth["dark_oak_sign"] == 2
    assert book.depth["hopper_minecart"] == 4  # oak log -> planks -> chest -> hopper -> hopper minecart


# ---- a hand-checked episode


def test_oak_log_to_planks_to_sticks_with_exact_texts(book):
    episode = _stick_episode(book)
    assert episode.observation == (
        "Crafting commands:\ncraft 4 stick using 2 planks\ncraft 1 stick using 2 bamboo\n"
        "craft 4 oak planks using 1 oak logs\n\nGoal: craft stick.")
    assert "Crafting commands are of the format" in episode.instruction
    steps = [
        ("inventory", EMPTY_INVENTORY, True),
        ("get 1 oak log", "Got 1 oak log", True),
        ("inventory", "Inventory: [oak log] (1)", True),
        ("craft 4 oak planks using 1 oak log", "Crafted 4 minecraft:oak_planks", True),
        ("inventory", "Inventory: [oak planks] (4)", True),
        # A tag is named by a member in a command, as in AgentGym.
        ("craft 4 stick using 2 planks", "Could not find enough items to craft minecraft:stick", False),
    ]
    for action, observation, valid in steps:
        result = episode.step(action)
        assert (result.observation, result.valid, result.done, result.reward) == (observation, valid, False, 0.0)
    result = episode.step("craft 4 stick using 2 oak planks")
    assert (result.observation, result.reward, result.done, result.success) == (
        "Crafted 4 minecraft:stick", 1.0, True, True)
    assert episode.inventory == {"oak_planks": 2, "stick": 4}
    assert episode.available_actions() == []
    assert not episode.step("inventory").valid


def test_inventory_lists_items_in_arrival_order_and_forgets_used_up_ones(book):
    episode = _stick_episode(book)
    episode.step("get 2 bamboo")
    episode.step("get 3 birch log")
    assert episode.step("inventory").observation == "Inventory: [bamboo] (2) [birch log] (3)"
    episode.step("craft 4 birch planks using 1 birch log")
    assert episode.step("inventory").observation == "Inventory: [bamboo] (2) [birch log] (2) [birch planks] (4)"
    result = episode.step("craft 1 stick using 2 bamboo")
    assert result.observation == "Crafted 1 minecraft:stick" and result.success


def test_free_text_actions_outside_the_list_work_and_case_and_underscores_do_not_matter(book):
    episode = _stick_episode(book)
    assert "get 5 diamond" not in episode.available_actions()
    assert episode.step("get 5 diamond").observation == "Got 5 diamond"
    assert episode.step("  Get 1 Oak_Log. ").observation == "Got 1 oak_log"
    # The count written for the result is not checked (AgentGym reads it but uses the recipe's).
    assert episode.step("craft oak planks using 1 oak log").observation == "Crafted 4 minecraft:oak_planks"
    assert episode.inventory == {"diamond": 5, "oak_planks": 4}


@pytest.mark.parametrize("action,observation", [
    ("jump", "Could not execute jump"),
    ("get oak log", "Could not execute get oak log"),
    ("get 1 stick", "Could not find stick"),  # craftable
    ("get 1 planks", "Could not find planks"),  # a tag
    ("get 1 oak logs", "Could not find oak logs"),
    ("get 1 unobtainium", "Could not find unobtainium"),
    ("get 0 oak log", "Could not find oak log"),
    ("craft 4 stick using 2 oak planks", "Could not find enough items to craft minecraft:stick"),
    ("craft 4 stick using oak planks", "Wrong item format: oak planks"),
    ("craft 1 dirt using 1 oak log", "Could not find a valid recipe for dirt"),
    ("craft 4 oak planks using 1 oak log, 1 oak log", "Could not find a valid recipe for oak planks"),
])
def test_invalid_actions_say_so_and_change_nothing(book, action, observation):
    episode = _stick_episode(book)
    episode.step("get 2 oak log")
    result = episode.step(action)
    assert (result.observation, result.valid, result.done, result.reward) == (observation, False, False, 0.0)
    assert episode.inventory == {"oak_log": 2}


def test_invalid_actions_use_turns_of_the_session(env):
    manager = SessionManager({"textcraft": env})
    session = manager.reset("textcraft", env.tasks("test")[0]).session_id
    for _ in range(MAX_TURNS):
        step = manager.step(session, "dance")
        assert not step.valid
    assert (step.turn, step.done, step.success, step.outcome) == (MAX_TURNS, True, False, Outcome.TRUNCATED)


# ---- splits and determinism


def test_splits_have_the_papers_counts_and_held_out_goals(env, book):
    test, train = env.tasks("test"), env.tasks("train")
    assert (len(train), len(test)) == (NUM_TRAIN, NUM_TEST) == (374, 100)
    assert not set(test) & set(train)
    test_goals = {env.goal(t) for t in test}
    train_goals = {env.goal(t) for t in train}
    assert len(test_goals) == 100 and not test_goals & train_goals
    assert {book.depth[g] for g in test_goals} == {1, 2, 3, 4}
    assert all(1 <= book.depth[g] <= 4 for g in test_goals | train_goals)
    assert test_goals | train_goals <= set(goal_pool(book))
    with pytest.raises(UnknownTask):
        env.reset(NUM_TEST + NUM_TRAIN)
    with pytest.raises(ValueError, match="unknown split"):
        env.tasks("dev")


def test_tasks_are_deterministic_per_task_id_and_seed(env):
    again = TextCraftEnv(seed=0)
    ids = env.tasks("test") + env.tasks("train")
    assert [env.reset(t).observation for t in ids] == [again.reset(t).observation for t in ids]
    assert env.reset(7).available_actions() == again.reset(7).available_actions()
    other = TextCraftEnv(seed=1)
    assert [other.goal(t) for t in ids] != [env.goal(t) for t in ids]


def test_shown_recipes_are_the_goals_tree_and_at_most_ten_distractors(env, book):
    for t in env.tasks("test"):
        task = env.task(t)
        needed = book.needed_recipes(task.goal)
        assert set(task.shown) == set(needed) | task.distractors
        assert len(task.distractors) <= 10 and not task.distractors & set(needed)
        assert task.observation.endswith(f"\n\nGoal: craft {display(task.goal)}.")
        assert all(isinstance(r, Recipe) for r in task.shown)


# ---- the expert and the admissible actions


def test_expert_solves_every_test_task_within_the_turn_limit_using_listed_actions(env):
    for t in env.tasks("test"):
        episode = env.reset(t)
        for _ in range(MAX_TURNS):
            actions = episode.available_actions()
            assert len(actions) <= MAX_ACTIONS and actions[0] == "inventory"
            assert len(set(actions)) == len(actions)
            action = episode.expert_action()
            assert action in actions
            result = episode.step(action)
            assert result.valid, (t, action, result.observation)
            if result.done:
                break
        assert result.success, f"task {t} ({env.goal(t)}) not crafted in {MAX_TURNS} turns"


def test_expert_plan_for_a_known_goal(book):
    assert plan(book, "dark_oak_sign", {}) == [
        "get 2 dark oak log",
        "craft 4 dark oak planks using 1 dark oak log",
        "craft 4 dark oak planks using 1 dark oak log",
        # Sticks from the dark oak planks it holds rather than a second kind of planks.
        "craft 4 stick using 2 dark oak planks",
        "craft 3 dark oak sign using 6 dark oak planks, 1 stick",
    ]
    assert plan(book, "dark_oak_sign", {"stick": 1, "dark_oak_planks": 6}) == [
        "craft 3 dark oak sign using 6 dark oak planks, 1 stick"]


def solve(episode: TextCraftEpisode, limit: int = MAX_TURNS) -> list[str]:
    """Plays the expert until the episode ends or `limit` actions; returns the actions taken."""
    taken: list[str] = []
    for _ in range(limit):
        action = episode.expert_action()
        taken.append(action)
        if episode.step(action).done:
            break
    return taken


def test_expert_finishes_from_a_messy_state(book):
    episode = TextCraftEpisode(book, make_task(book, "hopper_minecart", random.Random(0)))
    for action in ["get 3 birch log", "craft 4 birch planks using 1 birch log", "get 2 iron ingot",
                   "craft 9 iron nugget using 1 iron ingot", "nonsense"]:
        episode.step(action)
    taken = solve(episode)
    assert episode.inventory.get("hopper_minecart") == 1
    # The chest needs 8 planks of one kind: the 4 birch planks do not do, so it makes oak planks.
    assert "craft 1 chest using 8 oak planks" in taken
    assert len(taken) <= MAX_TURNS - 5


def test_expert_solves_the_training_tasks_too(env):
    for t in env.tasks("train"):
        episode = env.reset(t)
        taken = solve(episode)
        assert episode.inventory.get(env.goal(t), 0) > 0 and len(taken) <= MAX_TURNS, t


def test_session_runs_the_expert_to_success(env):
    manager = SessionManager({"textcraft": env})
    task = env.tasks("test")[0]
    reset = manager.reset("textcraft", task)
    assert reset.max_turns == MAX_TURNS == 20
    assert reset.observation.startswith("Crafting commands:\n")
    while True:
        step = manager.step(reset.session_id, manager.expert_action(reset.session_id))
        if step.done:
            break
    assert step.success and step.outcome == Outcome.SUCCESS and step.turn <= MAX_TURNS
