"""TextCraft (ADaPT's Minecraft crafting game) as AgentGym serves it.

The recipes are Minecraft 1.16's crafting recipes as the `minecraft-data` package ships them, with
the variants of a recipe over a tag ("planks": any wood's planks) folded back into one recipe, as
AgentGym lists them; textcraft_recipes.py builds them (tags, clean-up, depths).

Text and rules follow AgentGym's TextCraft:
- The reset observation is "Crafting commands:\\n<one recipe a line>\\n\\nGoal: craft <goal>.",
  the recipes being every recipe of the goal and, recursively, of its ingredients, plus up to 10
  distractors (recipes that use one of those ingredients), shuffled.
- `get N item` gives N of a base item (one no recipe makes): "Got N item"; anything else
  (craftable items, tags, unknown names) answers "Could not find item".
- `craft N X using M a, K b` makes one batch of a recipe of X whose ingredients match the named
  ones exactly (items and counts; no extra ones); it answers "Crafted <count> minecraft:<id>" with
  the recipe's result count (AgentGym ignores the N written in the command). Missing items answer
  "Could not find enough items to craft minecraft:<id>", a recipe that does not exist "Could not
  find a valid recipe for <X>", an ingredient without a count "Wrong item format: <it>".
- `inventory` answers "Inventory: [oak planks] (4) [stick] (1)" (in the order items arrived), or
  "Inventory: You are not carrying anything." Anything else answers "Could not execute <action>".
- A recipe lists a tag by its name ("craft 4 stick using 2 planks") and a craft command names a
  member ("craft 4 stick using 2 oak planks"); a tag cannot be got and is not an inventory item.
- Reward 1 and success when the goal item is in the inventory.

Departures, for our agent's interface: AgentGym's actions are free text, and they still are here,
but each step also lists a bounded admissible set (see `TextCraftEpisode.available_actions`).
Action text is matched case-insensitively with surrounding spaces and a final period ignored;
underscores in item names are read as spaces (AgentGym reads them so too).
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
from typing import Mapping

from .base import Environment, Episode, NumberedTasks, StepResult, shuffled_cycle
from .textcraft_recipes import GAME_VERSION, CraftingBook, Recipe, command, crafting_book, display

NUM_TRAIN, NUM_TEST = 374, 100
MAX_TURNS = 20
MIN_GOAL_DEPTH, MAX_GOAL_DEPTH = 1, 4
# A goal whose expert plan (from an empty inventory) takes more turns than this is not used.
MAX_PLAN_TURNS = MAX_TURNS
MAX_DISTRACTORS = 10
# Recipes sampled per ingredient as distractor candidates (AgentGym's numbers).
DISTRACTORS_PER_INGREDIENT = 10
MAX_ACTIONS = 40

INVENTORY = "inventory"
EMPTY_INVENTORY = "Inventory: You are not carrying anything."

INSTRUCTION = (
    "You are given a few useful crafting recipes to craft items in Minecraft. Crafting commands are of "
    "the format \"craft [target object] using [input ingredients]\". Every round I will give you an "
    "observation, and you respond with one action. You can \"get\" an object (an ingredient) from the "
    "environment, look up your inventory with \"inventory\", or \"craft\" (a target) using any of the "
    "crafting commands.\n"
    "Reminders:\n"
    "1. Always give the quantity with \"get\" and \"craft\". Examples: get 1 lapis lazuli; craft 1 blue "
    "dye using 1 lapis lazuli; craft 1 golden carrot using 8 gold nugget, 1 carrot.\n"
    "2. Only base items can be got; an item that has a recipe must be crafted.\n"
    "3. Use ONLY the crafting commands provided, with their ingredients and counts as written; one "
    "command crafts one batch. If a command uses a generic ingredient like \"planks\", name a special "
    "type of it, e.g. \"dark oak planks\", in your command instead.\n"
    "4. You succeed when the goal item is in your inventory."
)

_CRAFT = re.compile(r"craft (.*) using (.*)")
_GET = re.compile(r"get ([0-9]+) (.*)")
_COUNTED = re.compile(r"([0-9]+) (.*)")


def _item_key(text: str) -> str:
    """The id an item name written by the agent stands for: "Oak Planks" / "oak_planks" -> "oak_planks"."""
    return "_".join(text.strip().lower().replace("_", " ").split())


# ---- the expert


def _choose(book: CraftingBook, name: str, n: int, inventory: Mapping[str, int]) -> str:
    """The item that stands for an ingredient: the item itself, or for a tag a member held at least
    n times (the most held), else the tag's preferred shallowest member."""
    if name not in book.tags:
        return name
    held = [m for m in book.tags[name] if inventory.get(m, 0) >= n]
    if held:
        return max(held, key=lambda m: (inventory[m], -book.tags[name].index(m)))
    return book.shallowest(name)[0]


def concrete_command(book: CraftingBook, r: Recipe, inventory: Mapping[str, int]) -> str:
    """A recipe as a command the game accepts: each tag replaced by the member `_choose` picks."""
    return command(r.output, r.count, ((_choose(book, name, n, inventory), n) for name, n in r.inputs))


def plan(book: CraftingBook, goal: str, inventory: Mapping[str, int]) -> list[str]:
    """The expert's actions from this inventory to the goal: every `get` first, then the crafts.

    Simulates crafting down the expert recipes (each strictly shallower than its output, so it
    ends), getting base items as they run short; the gets are then done up front, in one action per
    item. Empty when the goal is already held.
    """
    inv = collections.Counter({k: v for k, v in inventory.items() if v > 0})
    gets: dict[str, int] = {}
    crafts: list[str] = []

    def obtain(item: str, n: int) -> None:
        while inv[item] < n:
            if book.is_base(item):
                gets[item] = gets.get(item, 0) + n - inv[item]
                inv[item] = n
                return
            r = book.expert_recipe(item)
            while True:  # getting one ingredient may use up another one
                chosen = [(_choose(book, name, k, inv), k) for name, k in r.inputs]
                missing = [(c, k) for c, k in chosen if inv[c] < k]
                if not missing:
                    break
                for c, k in missing:
                    obtain(c, k)
            crafts.append(command(r.output, r.count, chosen))
            for c, k in chosen:
                inv[c] -= k
            inv[item] += r.count

    obtain(goal, 1)
    return [_get(item, n) for item, n in gets.items()] + crafts


# ---- episodes


@dataclasses.dataclass(frozen=True)
class Task:
    goal: str
    # The recipes shown, in the order shown; and which of them are distractors.
    shown: tuple[Recipe, ...]
    distractors: frozenset[Recipe]

    @property
    def observation(self) -> str:
        listed = "\n".join(r.text for r in self.shown)
        return f"Crafting commands:\n{listed}\n\nGoal: craft {display(self.goal)}."


def make_task(book: CraftingBook, goal: str, rng: random.Random) -> Task:
    """AgentGym's recipe set: the needed recipes, up to 10 distractors using their ingredients, shuffled."""
    needed = book.needed_recipes(goal)
    needed_set = set(needed)
    candidates: list[Recipe] = []
    for r in needed:
        for name, _ in r.inputs:
            uses = book.uses.get(name, [])
            candidates.extend(rng.sample(uses, min(len(uses), DISTRACTORS_PER_INGREDIENT)))
    pool = [r for r in dict.fromkeys(candidates) if r not in needed_set]
    distractors = rng.sample(pool, min(len(pool), MAX_DISTRACTORS))
    shown = needed + distractors
    rng.shuffle(shown)
    return Task(goal, tuple(shown), frozenset(distractors))


def _get(item: str, n: int) -> str:
    return f"get {n} {display(item)}"


class _Failed(Exception):
    """An action the game refuses; the message is the observation."""


class TextCraftEpisode(Episode):
    def __init__(self, book: CraftingBook, task: Task):
        self.book = book
        self.task = task
        self.instruction = INSTRUCTION
        self.observation = task.observation
        self.inventory: dict[str, int] = {}  # insertion order: the order items arrived
        self._finished = False
        # Base items of the shown recipes with the counts the recipes use (a tag stands for its
        # preferred shallowest member): those of the needed recipes, then the distractors'.
        self._bases: dict[str, set[int]] = {}
        for r in sorted(task.shown, key=lambda r: r in task.distractors):
            for name, n in r.inputs:
                item = book.shallowest(name)[0] if name in book.tags else name
                if book.is_base(item):
                    self._bases.setdefault(item, set()).add(n)

    @property
    def goal(self) -> str:
        return self.task.goal

    def available_actions(self) -> list[str]:
        """`inventory`, then `get N item` for the base items of the shown recipes (N: each count a
        recipe uses; by item, then N), then each shown recipe as a command, in the order shown (a
        tag replaced by a member held in the needed count, else by its preferred member).

        The expert's next action is always one of them: when it gets a total that no recipe uses,
        that get is listed too. At most MAX_ACTIONS: when there are more, the actions only the
        distractors need are left out first.
        """
        if self._finished:
            return []
        expert = self.expert_action()
        gets = {(item, n) for item, counts in self._bases.items() for n in counts}
        m = _GET.fullmatch(expert)
        if m:
            gets.add((_item_key(m.group(2)), int(m.group(1))))
        needed = [r for r in self.task.shown if r not in self.task.distractors]
        needed_items = {item for r in needed for item in self._input_items(r)}
        crafts = {r: concrete_command(self.book, r, self.inventory) for r in self.task.shown}
        get_order = sorted(gets, key=lambda g: (display(g[0]), g[1]))
        ranked = ([expert, INVENTORY]
                  + [_get(i, n) for i, n in get_order if i in needed_items]
                  + [crafts[r] for r in needed]
                  + [_get(i, n) for i, n in get_order if i not in needed_items]
                  + [crafts[r] for r in self.task.shown if r in self.task.distractors])
        kept = set(list(dict.fromkeys(ranked))[:MAX_ACTIONS])
        ordered = [INVENTORY] + [_get(i, n) for i, n in get_order] + list(crafts.values())
        return [a for a in dict.fromkeys(ordered) if a in kept]

    def _input_items(self, r: Recipe) -> list[str]:
        return [self.book.shallowest(name)[0] if name in self.book.tags else name for name, _ in r.inputs]

    def step(self, action: str) -> StepResult:
        if self._finished:
            return StepResult(self.observation, 0.0, True, False, valid=False)
        text = " ".join(action.strip().lower().split()).removesuffix(".").strip()
        try:
            self.observation = self._act(text, action.strip())
        except _Failed as failed:
            self.observation = str(failed)
            return StepResult(self.observation, 0.0, False, False, valid=False)
        if self.inventory.get(self.task.goal, 0) > 0:
            self._finished = True
            return StepResult(self.observation, 1.0, True, True)
        return StepResult(self.observation, 0.0, False, False)

    def _act(self, text: str, original: str) -> str:
        if text == INVENTORY:
            if not self.inventory:
                return EMPTY_INVENTORY
            return "Inventory: " + " ".join(f"[{display(i)}] ({n})" for i, n in self.inventory.items())
        m = _CRAFT.fullmatch(text)
        if m:
            return self._craft(m.group(1), m.group(2))
        m = _GET.fullmatch(text)
        if m:
            n, written = int(m.group(1)), m.group(2).strip()
            item = _item_key(written)
            if n < 1 or not self.book.is_base(item):
                raise _Failed(f"Could not find {written}")
            self._add(item, n)
            return f"Got {n} {written}"
        raise _Failed(f"Could not execute {original}")

    def _craft(self, output_text: str, inputs_text: str) -> str:
        m = _COUNTED.fullmatch(output_text.strip())
        output = _item_key(m.group(2) if m else output_text)
        given: dict[str, int] = {}
        for part in inputs_text.split(","):
            counted = _COUNTED.fullmatch(part.strip())
            if not counted:
                raise _Failed(f"Wrong item format: {part.strip()}")
            name = _item_key(counted.group(2))
            given[name] = given.get(name, 0) + int(counted.group(1))
        if any(self.inventory.get(name, 0) < n or n < 1 for name, n in given.items()):
            raise _Failed(f"Could not find enough items to craft minecraft:{output}")
        recipe = self.book.match(output, given)
        if recipe is None:
            raise _Failed(f"Could not find a valid recipe for {display(output)}")
        for name, n in given.items():
            self.inventory[name] -= n
            if self.inventory[name] == 0:
                del self.inventory[name]
        self._add(recipe.output, recipe.count)
        return f"Crafted {recipe.count} minecraft:{recipe.output}"

    def _add(self, item: str, n: int) -> None:
        self.inventory[item] = self.inventory.get(item, 0) + n

    def plan(self) -> list[str]:
        return plan(self.book, self.task.goal, self.inventory)

    def expert_action(self) -> str:
        actions = self.plan()
        return actions[0] if actions else INVENTORY


# ---- the environment


def goal_pool(book: CraftingBook) -> list[str]:
    """Craftable items of depth MIN_GOAL_DEPTH..MAX_GOAL_DEPTH that the expert makes from nothing
    within MAX_PLAN_TURNS turns, by depth then name."""
    pool = [item for item in book.recipes_of if MIN_GOAL_DEPTH <= book.depth[item] <= MAX_GOAL_DEPTH]
    pool = [item for item in pool if len(plan(book, item, {})) <= MAX_PLAN_TURNS]
    return sorted(pool, key=lambda item: (book.depth[item], item))


class TextCraftEnv(Environment):
    """Tasks 0..99 are the test split, 100..473 the training split.

    Goals come from `goal_pool`: items of recipe depth 1..4 whose expert plan from nothing takes at
    most 20 turns (with 1.16's recipes, 531 items: 151, 271, 102 and 7 of depths 1 to 4; the 14
    colored banners, 21 to 28 turns, are left out). The 100 test goals are held out: a seeded sample
    of the pool, stratified by depth (each depth gives its share); no training task has one of them
    as its goal. Training tasks take goals from seeded shuffles of the remaining goals, so no goal
    repeats while at least 374 remain (431 do with 1.16). Each task's recipe list (distractors,
    order) is drawn from its own seeded generator.
    """

    name = "textcraft"
    max_turns = MAX_TURNS
    has_expert = lists_actions = True

    def __init__(self, seed: int = 0, game_version: str = GAME_VERSION):
        self.book = crafting_book(game_version)
        self.seed = seed
        pool = goal_pool(self.book)
        rng = random.Random(seed)
        by_depth: dict[float, list[str]] = collections.defaultdict(list)
        for item in pool:
            by_depth[self.book.depth[item]].append(item)
        if len(pool) <= NUM_TEST:
            raise ValueError(f"only {len(pool)} goal items, too few for {NUM_TEST} held-out test goals")
        # Largest remainder apportionment of the test goals over depths.
        quota = {d: NUM_TEST * len(items) / len(pool) for d, items in sorted(by_depth.items())}
        counts = {d: int(q) for d, q in quota.items()}
        for d in sorted(quota, key=lambda d: (counts[d] - quota[d], d))[: NUM_TEST - sum(counts.values())]:
            counts[d] += 1
        test_goals = [g for d, items in sorted(by_depth.items()) for g in rng.sample(items, counts[d])]
        rng.shuffle(test_goals)
        held_out = set(test_goals)
        train_goals = shuffled_cycle([g for g in pool if g not in held_out], rng)
        self._goals = NumberedTasks(self.name, test_goals, [next(train_goals) for _ in range(NUM_TRAIN)])

    def tasks(self, split: str) -> list[int]:
        return self._goals.ids(split)

    def goal(self, task_id: int) -> str:
        return self._goals[task_id]

    def task(self, task_id: int) -> Task:
        goal = self.goal(task_id)
        return make_task(self.book, goal, random.Random(f"textcraft:{self.seed}:{task_id}"))

    def reset(self, task_id: int) -> TextCraftEpisode:
        return TextCraftEpisode(self.book, self.task(task_id))
