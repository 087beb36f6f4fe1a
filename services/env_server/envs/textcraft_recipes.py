"""TextCraft's crafting book (see textcraft.py): the recipes of a Minecraft version, their tags and depths.

The recipes are Minecraft 1.16's crafting recipes (shaped and shapeless) as the `minecraft-data`
package ships them. A shaped recipe's ingredient counts come from its shape; the result count is
the recipe's. Items are named as AgentGym names them: the id without "minecraft:" and with spaces
for underscores ("oak_planks" -> "oak planks").

Tags. Minecraft recipes may take any item of a tag ("planks": any wood's planks); minecraft-data
writes such a recipe once per member. Variants of one recipe that differ only in one ingredient
are folded back into one recipe over a tag when that ingredient's set is one of the vanilla tags
used in crafting (planks, wool, logs, "<wood> logs", "<nether wood> stems", wooden slabs, coals,
stone crafting / tool materials, soul fire base blocks); other variants (a dye from any of three
flowers) stay separate recipes, as in the vanilla recipe files.

Recipe clean-up, as AgentGym does it: recipes that unpack a "_block" (9 iron ingot from 1 iron
block) are dropped. The recipes left form a few 2-cycles (iron ingot <-> iron nugget, honey block
<-> honey bottle, ...): of each, the recipe that uses more items than it makes (1 iron ingot from 9
iron nuggets) is dropped, so the larger unit is a base item. (AgentGym drops whichever of the two
its directory listing gives second.)

Depth, as AgentGym computes it: 0 for a base item; a recipe's depth is one more than its deepest
ingredient's; an item's the least of its recipes'; a tag's the least of its members'.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
from typing import Callable, Iterable, Mapping, Sequence

GAME_VERSION = "1.16"
TAG_MARK = "#"

_TOOLS = ("_pickaxe", "_axe", "_shovel", "_hoe", "_sword")
_LOG_SUFFIXES = ("_log", "_wood", "_stem", "_hyphae")


def display(name: str) -> str:
    """An item or tag id as AgentGym writes it: "oak_planks" -> "oak planks", "#planks" -> "planks"."""
    return name.removeprefix(TAG_MARK).replace("_", " ")


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
        return self._least(0, lambda r, depth: 1 + max(depth[name] for name, _ in r.inputs), 0.0)

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
        return self._least(0.0, lambda r, cost: (1 + sum(n * cost[name] for name, n in r.inputs)) / r.count, 1e-12)

    def _least(self, base: float, of_recipe: Callable[[Recipe, dict[str, float]], float],
               tolerance: float) -> dict[str, float]:
        """A value per item and tag, lowered until nothing changes by more than `tolerance`: `base` for a
        base item; an item's the least `of_recipe` of its recipes (given the values so far); a tag's
        the least of its members'."""
        value: dict[str, float] = {i: (float("inf") if i in self.recipes_of else base) for i in self.items}
        for tag, members in self.tags.items():
            value[tag] = min(value[m] for m in members)
        changed = True
        while changed:
            changed = False
            for r in self.recipes:
                v = of_recipe(r, value)
                if v < value[r.output] - tolerance:
                    value[r.output] = v
                    changed = True
            for tag, members in self.tags.items():
                v = min(value[m] for m in members)
                if v < value[tag] - tolerance:
                    value[tag] = v
                    changed = True
        return value

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
