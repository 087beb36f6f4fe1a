"""TextCraft (ADaPT's Minecraft crafting game) as AgentGym serves it.

The recipes are Minecraft 1.16's crafting recipes (shaped and shapeless) as the `minecraft-data`
package ships them. A shaped recipe's ingredient counts come from its shape; the result count is
the recipe's. Items are named as AgentGym names them: the id without "minecraft:" and with spaces
for underscores ("oak_planks" -> "oak planks").

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
- Reward 1 and success when the goal item is in the inventory.

Tags. Minecraft recipes may take any item of a tag ("planks": any wood's planks); minecraft-data
writes such a recipe once per member. Variants of one recipe that differ only in one ingredient
are folded back into one recipe over a tag when that ingredient's set is one of the vanilla tags
used in crafting (planks, wool, logs, "<wood> logs", "<nether wood> stems", wooden slabs, coals,
stone crafting / tool materials, soul fire base blocks); other variants (a dye from any of three
flowers) stay separate recipes, as in the vanilla recipe files. As in AgentGym, a recipe lists a
tag by its name ("craft 4 stick using 2 planks") and a craft command names a member ("craft 4
stick using 2 oak planks"); a tag cannot be got and is not an inventory item.

Recipe clean-up, as AgentGym does it: recipes that unpack a "_block" (9 iron ingot from 1 iron
block) are dropped. The recipes left form a few 2-cycles (iron ingot <-> iron nugget, honey block
<-> honey bottle, ...): of each, the recipe that uses more items than it makes (1 iron ingot from 9
iron nuggets) is dropped, so the larger unit is a base item. (AgentGym drops whichever of the two
its directory listing gives second.)

Depth, as AgentGym computes it: 0 for a base item; a recipe's depth is one more than its deepest
ingredient's; an item's the least of its recipes'; a tag's the least of its members'.

Departures, for our agent's interface: AgentGym's actions are free text, and they still are here,
but each step also lists a bounded admissible set (see `TextCraftEpisode.available_actions`).
Action text is matched case-insensitively with surrounding spaces and a final period ignored;
underscores in item names are read as spaces (AgentGym reads them so too).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import random
import re
from typing import Iterable, Mapping, Sequence

from .base import Environment, Episode, NumberedTasks, StepResult, shuffled_cycle

GAME_VERSION = "1.16"
NUM_TRAIN, NUM_TEST = 374, 100
MAX_TURNS = 20
MIN_GOAL_DEPTH, MAX_GOAL_DEPTH = 1, 4
# A goal whose expert plan (from an empty inventory) takes more turns than this is not used.
MAX_PLAN_TURNS = MAX_TURNS
MAX_DISTRACTORS = 10
# Recipes sampled per ingredient as distractor candidates (AgentGym's numbers).
DISTRACTORS_PER_INGREDIENT = 10
MAX_ACTIONS = 40

TAG_MARK = "#"
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
_TOOLS = ("_pickaxe", "_axe", "_shovel", "_hoe", "_sword")
_LOG_SUFFIXES = ("_log", "_wood", "_stem", "_hyphae")


def display(name: str) -> str:
    """An item or tag id as AgentGym writes it: "oak_planks" -> "oak planks", "#planks" -> "planks"."""
    return name.removeprefix(TAG_MARK).replace("_", " ")


def _item_key(text: str) -> str:
    """The id an item name written by the agent stands for: "Oak Planks" / "oak_planks" -> "oak_planks"."""
    return "_".join(text.strip().lower().replace("_", " ").split())


@dataclasses.dataclass(frozen=True)
class Recipe:
    output: str
    count: int
    # (item or tag id, count) in the order the recipe first names them.
    inputs: tuple[tuple[str, int], ...]

    @property
    def text(self) -> str:
        """The crafting command as AgentGym lists it: "craft 4 stick using 2 planks"."""
        return command(self.output, self.count, self.inputs)


def command(output: str, count: int, inputs: Iterable[tuple[str, int]]) -> str:
    used = ", ".join(f"{n} {display(name)}" for name, n in inputs)
    return f"craft {count} {display(output)} using {used}"


# ---- loading minecraft-data


def _data_dir() -> str:
    import minecraft_data  # the package's data files; its loader reads every file of a version

    return os.path.join(os.path.dirname(minecraft_data.__file__), "data", "data")


def _load_raw(version: str) -> list[tuple[str, int, tuple[tuple[str, int], ...]]]:
    """(output, count, inputs) of every crafting recipe of a pc game version."""
    root = _data_dir()
    with open(os.path.join(root, "dataPaths.json")) as f:
        paths = json.load(f)["pc"]
    if version not in paths or "recipes" not in paths[version]:
        raise ValueError(f"minecraft-data has no recipes for game version {version!r}")
    with open(os.path.join(root, paths[version]["items"], "items.json")) as f:
        names = {item["id"]: item["name"] for item in json.load(f)}
    with open(os.path.join(root, paths[version]["recipes"], "recipes.json")) as f:
        raw = json.load(f)
    recipes = []
    for variants in raw.values():
        for r in variants:
            if "inShape" in r:
                ids = [i for row in r["inShape"] for i in row if i is not None]
            else:
                ids = list(r["ingredients"])
            counts: dict[str, int] = {}  # insertion order: first named first
            for i in ids:
                counts[names[i]] = counts.get(names[i], 0) + 1
            recipes.append((names[r["result"]["id"]], int(r["result"].get("count", 1)), tuple(counts.items())))
    return recipes


def _tag_of(members: frozenset[str], output: str, items: frozenset[str]) -> tuple[str, str] | None:
    """(tag id, preferred member) when members are one of the vanilla tags used in crafting."""
    if len(members) < 2:
        return None
    if all(m.endswith("_planks") for m in members):
        return TAG_MARK + "planks", "oak_planks"
    if all(m.endswith("_wool") for m in members):
        return TAG_MARK + "wool", "white_wool"
    if members == {"coal", "charcoal"}:
        return TAG_MARK + "coals", "coal"
    if members == {"soul_sand", "soul_soil"}:
        return TAG_MARK + "soul_fire_base_blocks", "soul_sand"
    if members == {"cobblestone", "blackstone"}:
        kind = "stone_tool_materials" if output.endswith(_TOOLS) else "stone_crafting_materials"
        return TAG_MARK + kind, "cobblestone"
    if all(m.endswith("_slab") and m.removesuffix("_slab") + "_planks" in items for m in members):
        return TAG_MARK + "wooden_slabs", "oak_slab"
    if all(m.endswith(_LOG_SUFFIXES) for m in members):
        woods = set()
        for m in members:
            base = m.removeprefix("stripped_")
            woods.add(next(base.removesuffix(s) for s in _LOG_SUFFIXES if base.endswith(s)))
        if len(woods) > 1:
            return TAG_MARK + "logs", "oak_log"
        (wood,) = woods
        if f"{wood}_stem" in members:
            return f"{TAG_MARK}{wood}_stems", f"{wood}_stem"
        return f"{TAG_MARK}{wood}_logs", f"{wood}_log"
    return None


def _fold_tags(raw, items: frozenset[str]):
    """Folds the per-member variants of a recipe back into one recipe over a tag.

    Returns (recipes, tags, preferred): recipes in a deterministic order, tag id -> members
    (sorted), tag id -> preferred member.
    """
    recipes = list(dict.fromkeys(raw))  # drop exact duplicates, keep order
    tags: dict[str, tuple[str, ...]] = {}
    preferred: dict[str, str] = {}
    while True:
        groups: dict[tuple, list[tuple[str, tuple]]] = collections.defaultdict(list)
        for r in recipes:
            output, count, inputs = r
            for name, _ in inputs:
                if not name.startswith(TAG_MARK):
                    sig = (output, count, tuple(("?" if n == name else n, c) for n, c in inputs))
                    groups[sig].append((name, r))
        best = None
        for sig, group in groups.items():
            members = frozenset(name for name, _ in group)
            tag = _tag_of(members, sig[0], items) if len(members) == len(group) else None
            if tag and (best is None or len(group) > len(best[1])):
                best = (sig, group, tag, members)
        if best is None:
            return recipes, tags, preferred
        sig, group, (tag, pref), members = best
        if tags.setdefault(tag, tuple(sorted(members))) != tuple(sorted(members)):
            raise ValueError(f"tag {tag} would stand for two different item sets")
        preferred[tag] = pref
        folded = (sig[0], sig[1], tuple((tag if n == "?" else n, c) for n, c in sig[2]))
        gone = {id(r) for _, r in group}
        at = min(i for i, r in enumerate(recipes) if id(r) in gone)
        recipes = [r for r in recipes if id(r) not in gone]
        recipes.insert(at, folded)


def _break_cycles(recipes: list[Recipe]) -> list[Recipe]:
    """Drops, of each pair of recipes making each other's ingredient, the one using more than it makes."""
    makers: dict[str, list[Recipe]] = collections.defaultdict(list)
    for r in recipes:
        makers[r.output].append(r)
    dropped = set()
    for r in recipes:
        for name, n in r.inputs:
            for back in makers.get(name, ()):
                if any(m == r.output for m, _ in back.inputs):
                    back_uses = dict(back.inputs)[r.output]
                    # r: n `name` -> r.count output; back: back_uses output -> back.count `name`.
                    if n / r.count > back_uses / back.count:
                        dropped.add(r)
    return [r for r in recipes if r not in dropped]


def _check_acyclic(recipes: Sequence[Recipe], tags: Mapping[str, Sequence[str]]) -> None:
    """Raises when an item is (through recipes and tag members) one of its own ingredients."""
    needs: dict[str, set[str]] = collections.defaultdict(set)
    for r in recipes:
        needs[r.output].update(name for name, _ in r.inputs)
    for tag, members in tags.items():
        needs[tag].update(members)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(needs.get(name, ())):
            if state.get(nxt) == 1:
                raise ValueError(f"recipe cycle: {' -> '.join(path + [name, nxt])}")
            if nxt not in state:
                visit(nxt, path + [name])
        state[name] = 2

    for name in sorted(needs):
        if name not in state:
            visit(name, [])


class CraftingBook:
    """The recipes of one game version, their tags, depths, and the item names."""

    def __init__(self, version: str = GAME_VERSION):
        raw = _load_raw(version)
        self.version = version
        self.items: frozenset[str] = frozenset(
            {out for out, _, _ in raw} | {name for _, _, inputs in raw for name, _ in inputs})
        folded, self.tags, self.preferred = _fold_tags(raw, self.items)
        recipes = [Recipe(out, count, inputs) for out, count, inputs in folded]
        # AgentGym drops the recipes that unpack a block (9 iron ingot from 1 iron block).
        recipes = [r for r in recipes if not (len(r.inputs) == 1 and r.inputs[0][0].endswith("_block"))]
        self.recipes: tuple[Recipe, ...] = tuple(_break_cycles(recipes))
        self.recipes_of: dict[str, tuple[Recipe, ...]] = {}
        self.uses: dict[str, list[Recipe]] = collections.defaultdict(list)
        for r in self.recipes:
            self.recipes_of[r.output] = self.recipes_of.get(r.output, ()) + (r,)
            for name, _ in r.inputs:
                self.uses[name].append(r)
        clash = {display(t) for t in self.tags} & {display(i) for i in self.items}
        if clash:
            raise ValueError(f"tag names that are also item names: {sorted(clash)}")
        self.depth = self._depths()
        unreachable = [i for i in self.recipes_of if self.depth[i] == float("inf")]
        if unreachable:
            raise ValueError(f"items no recipe chain reaches from base items: {sorted(unreachable)}")
        _check_acyclic(self.recipes, self.tags)
        self.unit_crafts = self._unit_crafts()
        self._expert_recipe = {
            item: min(rs, key=lambda r: (round(self._recipe_crafts(r), 9), self.recipe_depth(r), len(r.inputs)))
            for item, rs in self.recipes_of.items()}
        for tag, pref in self.preferred.items():
            if self.depth[pref] != self.depth[tag]:
                raise ValueError(f"the preferred member {pref} of {tag} is not one of its shallowest")

    def is_base(self, name: str) -> bool:
        """Whether `get` gives this: a known item that no recipe makes (AgentGym's "gettable")."""
        return name in self.items and name not in self.recipes_of

    def _depths(self) -> dict[str, float]:
        depth: dict[str, float] = {i: (float("inf") if i in self.recipes_of else 0) for i in self.items}
        for tag, members in self.tags.items():
            depth[tag] = min(depth[m] for m in members)
        changed = True
        while changed:
            changed = False
            for r in self.recipes:
                d = 1 + max(depth[name] for name, _ in r.inputs)
                if d < depth[r.output]:
                    depth[r.output] = d
                    changed = True
            for tag, members in self.tags.items():
                d = min(depth[m] for m in members)
                if d < depth[tag]:
                    depth[tag] = d
                    changed = True
        return depth

    def recipe_depth(self, r: Recipe) -> float:
        return 1 + max(self.depth[name] for name, _ in r.inputs)

    def shallowest(self, tag: str) -> list[str]:
        """A tag's members of least depth, the preferred one first."""
        d = self.depth[tag]
        members = [m for m in self.tags[tag] if self.depth[m] == d]
        return sorted(members, key=lambda m: (m != self.preferred[tag], m))

    def expert_recipe(self, item: str) -> Recipe:
        """The recipe the expert uses: the fewest crafts per item made (`unit_crafts`), then the
        shallowest, then the fewest ingredient kinds, then the first."""
        return self._expert_recipe[item]

    def _unit_crafts(self) -> dict[str, float]:
        """Crafts per item made, counting batches fractionally and gets as free:
        0 for a base item; for a recipe (1 + sum of count x ingredient's) / result count; an item's
        the least of its recipes'; a tag's the least of its members'. Finite: the recipes are acyclic."""
        cost: dict[str, float] = {i: (float("inf") if i in self.recipes_of else 0.0) for i in self.items}
        for tag, members in self.tags.items():
            cost[tag] = min(cost[m] for m in members)
        changed = True
        while changed:
            changed = False
            for r in self.recipes:
                c = (1 + sum(n * cost[name] for name, n in r.inputs)) / r.count
                if c < cost[r.output] - 1e-12:
                    cost[r.output] = c
                    changed = True
            for tag, members in self.tags.items():
                c = min(cost[m] for m in members)
                if c < cost[tag] - 1e-12:
                    cost[tag] = c
                    changed = True
        return cost

    def _recipe_crafts(self, r: Recipe) -> float:
        return (1 + sum(n * self.unit_crafts[name] for name, n in r.inputs)) / r.count

    def needed_recipes(self, goal: str) -> list[Recipe]:
        """Every recipe of the goal and, recursively, of its ingredients (of a tag: its shallowest members')."""
        seen: set[str] = set()
        out: list[Recipe] = []

        def visit(name: str) -> None:
            if name in seen:
                return
            seen.add(name)
            if name in self.tags:
                for m in self.shallowest(name):
                    visit(m)
                return
            for r in self.recipes_of.get(name, ()):
                out.append(r)
                for ingredient, _ in r.inputs:
                    visit(ingredient)

        visit(goal)
        return out

    def match(self, output: str, given: Mapping[str, int]) -> Recipe | None:
        """The recipe of `output` whose ingredients are exactly `given` (items and counts), if any."""
        for r in self.recipes_of.get(output, ()):
            left = dict(given)
            ok = True
            # Items before tags, so a named item is not taken by a tag the recipe also has.
            for name, n in sorted(r.inputs, key=lambda x: x[0] in self.tags):
                if name in self.tags:
                    hit = next((m for m in self.tags[name] if left.get(m) == n), None)
                else:
                    hit = name if left.get(name) == n else None
                if hit is None:
                    ok = False
                    break
                del left[hit]
            if ok and not left:
                return r
        return None


@functools.lru_cache(maxsize=4)
def crafting_book(version: str = GAME_VERSION) -> CraftingBook:
    return CraftingBook(version)


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
