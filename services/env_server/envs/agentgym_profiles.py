"""The AgentGym bridge's profiles (see agentgym.py): one class per AgentGym env server, knowing its routes,
id fields, reset bodies, value field and where its admissible actions come from."""

from __future__ import annotations

import itertools
import json
import logging
import re
from typing import Any

from fedse.env import EnvironmentFailed, EnvironmentUnavailable
from fedse.transport.serving import log_fields

from .agentgym_http import HttpError, IdUnknown, NoRoute, Remote, quote

# The bridge logs under one name, whichever of its modules speaks.
log = logging.getLogger(f"{__package__}.agentgym")

DEFAULT_MAX_ACTIONS = 256
ALFWORLD_WORLD_TYPES = ("Text", "Embody", "Hybrid")


class Profile:
    """One AgentGym server's API. The defaults are the common shape (textcraft's, babyai's, ...);
    subclasses set or override what differs."""

    name = ""
    prefix = ""                 # route prefix: lmrlgym serves maze under /maze and wordle under /wordle
    id_field = "id"
    task_field = "data_idx"
    value_field = "reward"      # what AgentGym's client reports as the step's reward
    scale = 1.0                 # the value that means full marks
    closes = True               # has POST /close (a 404 there: an older version; ids are then reused)
    distinct_ids = True         # ids are handed out once per server lifetime (0, 1, 2, ...)
    lists_actions = False
    invalid: re.Pattern[str] | None = None  # how the observation says an action was not admissible
    num_tasks: int | None = None            # the task indexes the server has, where it has few
    max_turns = 20
    test = ""                   # default held-out tasks
    train_span = ""             # default training tasks: this span less the test tasks
    instruction = ""

    def __init__(self) -> None:
        self.max_actions = DEFAULT_MAX_ACTIONS

    # -- calls

    def create(self, r: Remote) -> int:
        what = "creating an environment (POST /create)"
        return r.field(r.post("/create", None, what), "id", int, what)

    def reset_body(self, rid: int, task: int) -> dict[str, Any]:
        return {self.id_field: rid, self.task_field: task}

    def reset(self, r: Remote, rid: int, task: int) -> tuple[str, list[str]]:
        what = f"the reset to task {task}"
        data = r.post("/reset", self.reset_body(rid, task), what)
        observation = self.first_observation(r, rid, data, what)
        return observation, self.actions(r, rid, data, observation)

    def step(self, r: Remote, rid: int, action: str) -> tuple[str, float, bool, list[str]]:
        what = "a step"
        data = r.post("/step", {self.id_field: rid, "action": action}, what)
        observation = r.field(data, "observation", str, what)
        value = float(r.field(data, self.value_field, (int, float), what)) / self.scale
        done = bool(r.field(data, "done", (bool, int), what))
        return observation, value, done, self.actions_after_step(r, rid, data, observation, done)

    def actions_after_step(self, r: Remote, rid: int, data: Any, observation: str, done: bool) -> list[str]:
        """The actions after a step that was applied: a failure to list them fails nothing (failing
        the step would have the client do it again), it lists none."""
        if done:
            return []
        try:
            return self.actions(r, rid, data, observation)
        except (EnvironmentFailed, EnvironmentUnavailable) as exc:
            log.warning("listing the actions after a step failed", extra=log_fields(
                profile=self.name, url=r.env.url, error=str(exc)[:500]))
            return []

    def close(self, r: Remote, rid: int) -> None:
        r.post("/close", {self.id_field: rid}, "closing an environment (POST /close)")

    # -- reading the answers

    def first_observation(self, r: Remote, rid: int, data: Any, what: str) -> str:
        return r.field(data, "observation", str, what)

    def actions(self, r: Remote, rid: int, data: Any, observation: str) -> list[str]:
        """The admissible actions after a reset or step (lists_actions profiles)."""
        return []

    def normalize(self, action: str) -> str:
        return " ".join(action.split())

    def succeeded(self, value: float) -> bool:
        return value >= 1.0 - 1e-6

    def valid(self, observation: str) -> bool:
        return not (self.invalid and self.invalid.search(observation))


class TextCraft(Profile):
    name = "textcraft"
    invalid = re.compile(r"^\s*Could not execute ")
    test = "0-495/5"           # its goals are sorted by crafting depth: spread the held-out ones
    train_span = "0-467"
    instruction = (
        "Craft the goal item in a Minecraft-like crafting game. The first observation lists the crafting "
        "commands (recipes) you may use and names the goal. One action per turn: \"get N ITEM\" takes N of a "
        "base item (one that no recipe makes), \"craft N ITEM using M A, K B\" applies one of the listed "
        "recipes (where a recipe names a generic ingredient such as planks, name a specific kind such as oak "
        "planks), and \"inventory\" shows what you hold. Always write the counts. The episode succeeds once the "
        "goal item is crafted."
    )

    def create(self, r: Remote) -> int:
        what = "creating an environment (POST /create)"
        return r.field(r.post("/create", {"commands": None, "goal": None}, what), "id", int, what)


class BabyAI(Profile):
    name = "babyai"
    value_field = "score"
    lists_actions = True
    invalid = re.compile(r"^\s*The action is not recognized")
    test = "0-89"               # task i is level i % 40 + 1 with seed i // 40: 0-89 covers every level
    train_span = "0-899"
    instruction = (
        "Reach the goal stated in the first observation, in a grid world of rooms, doors, keys, balls and "
        "boxes. Each observation says what you see and ends with the actions available now; answer with one "
        "of them. They are: turn left, turn right, move forward, go to OBJECT N, pick up OBJECT N, go through "
        "DOOR N (an open door), toggle and go through DOOR N (a closed or locked door; a locked one opens with "
        "the key of its colour, carried), and toggle (the door right in front of you)."
    )
    _LIST = "Available actions: ["

    def actions(self, r: Remote, rid: int, data: Any, observation: str) -> list[str]:
        at = observation.rfind(self._LIST)
        if at < 0:
            return []
        listed = observation[at + len(self._LIST):].rstrip().removesuffix("]")
        return [a for a in re.findall(r'"([^"]*)"', listed) if a.strip()][: self.max_actions]

    def succeeded(self, value: float) -> bool:
        # MiniGrid's reward shrinks with the steps taken, and BabyAI's server ends an episode only once the
        # goal is reached (a reward above 0.5): any positive value at the end is a solve.
        return value > 0


class SciWorld(Profile):
    name = "sciworld"
    value_field = "score"
    scale = 100.0
    lists_actions = True
    invalid = re.compile(r"^\s*No known action matches that input")
    # Its task indexes run task by task (every variation of the first task, then of the next, ...):
    # spread both splits across the task types.
    test = "0-3999/20"
    train_span = "1-4239/2"
    max_turns = 30
    instruction = (
        "Carry out a science task in a simulated world of rooms, objects, substances and devices; the first "
        "observation states the task. One action per turn, e.g. look around, look at OBJ, look in OBJ, go to "
        "LOCATION, open OBJ, close OBJ, pick up OBJ, put down OBJ, move OBJ to OBJ, pour OBJ into OBJ, mix OBJ, "
        "activate OBJ, deactivate OBJ, use OBJ on OBJ, connect OBJ to OBJ, read OBJ, wait, wait1, inventory, "
        "task (repeats the task). \"focus on OBJ\" declares the object the task is about: focusing on a wrong "
        "one fails the task. The episode succeeds when the task is complete (score 100)."
    )
    _SLOT = re.compile(r"\b(?:OBJ|LOC)\b")

    def first_observation(self, r: Remote, rid: int, data: Any, what: str) -> str:
        return r.field(data, "task_description", str, what) + "\n" + r.field(data, "observation", str, what)

    def actions(self, r: Remote, rid: int, data: Any, observation: str) -> list[str]:
        """ScienceWorld's action templates ("open OBJ", "move OBJ to OBJ") filled with the objects in
        view, fewest slots first, each object in turn, up to max_actions (its server lists templates and
        objects, not the admissible actions)."""
        what = "the action hint (GET /action_hint)"
        hint = r.get("/action_hint", {self.id_field: rid}, what)
        templates = [t for t in r.field(hint, "possible_actions", list, what) if isinstance(t, str)]
        objects = [o for o in r.field(hint, "possible_objects", list, what) if isinstance(o, str) and o.strip()]
        out: list[str] = []
        seen: set[str] = set()
        by_slots = sorted(templates, key=lambda t: len(self._SLOT.findall(t)))
        for slots, group in itertools.groupby(by_slots, key=lambda t: len(self._SLOT.findall(t))):
            group = list(group)
            for combo in itertools.product(objects, repeat=slots):
                if len(set(combo)) < slots:
                    continue
                for template in group:
                    fill = iter(combo)
                    action = " ".join(self._SLOT.sub(lambda _: next(fill), template).split())
                    if action and action not in seen:
                        seen.add(action)
                        out.append(action)
                        if len(out) >= self.max_actions:
                            return out
        return out


class ALFWorld(Profile):
    name = "alfworld"
    task_field = "game"
    lists_actions = True
    invalid = re.compile(r"^\s*Nothing happens\.?\s*$")
    # Its games 0-2419 are AgentGym's training games, 2420-2619 its test games (configs/mappings_*.json).
    test = "2420-2619"
    train_span = "0-2419"
    max_turns = 30
    instruction = (
        "Carry out a household task in a text world; the first observation describes the room and states "
        "the task. Each turn you get the admissible actions (go to, take X from Y, put X in/on Y, open, close, "
        "heat/cool/clean X with Y, use, examine, look, inventory); answer with one of them. \"Nothing "
        "happens.\" means the action had no effect. The episode succeeds when the task is done."
    )

    def __init__(self) -> None:
        super().__init__()
        self.world_type = "Text"

    def reset_body(self, rid: int, task: int) -> dict[str, Any]:
        return {self.id_field: rid, "game": task, "world_type": self.world_type}

    def actions(self, r: Remote, rid: int, data: Any, observation: str) -> list[str]:
        listed = data.get("available_actions") if isinstance(data, dict) else None
        return [a for a in listed if isinstance(a, str)][: self.max_actions] if isinstance(listed, list) else []


class Maze(Profile):
    name = "maze"
    prefix = "/maze"
    task_field = "game"
    closes = False
    lists_actions = True
    num_tasks = 26              # its server knows 26 start positions in one maze (game < 26)
    test = "2+7+12+17+22"       # one start in five, spread over the maze
    train_span = "0-25"
    max_turns = 15
    MOVES = ("move up", "move down", "move left", "move right")
    instruction = (
        "Reach the goal square of a maze in as few moves as you can. Each observation gives the goal's "
        "position, yours, and the walls next to you; moving down adds 1 to your first coordinate, moving "
        "right adds 1 to the second. Actions: move up, move down, move left, move right."
    )

    def __init__(self) -> None:
        super().__init__()
        self._listed: list[str] | None = None   # its actions are the same in every state: asked once

    def actions(self, r: Remote, rid: int, data: Any, observation: str) -> list[str]:
        if self._listed is None:
            what = "the available actions (GET /maze/available_actions)"
            try:
                listed = r.get("/available_actions", None, what)
            except NoRoute:
                listed = list(self.MOVES)  # a version without the route: LMRL-Gym's maze has these four
            if not isinstance(listed, list) or not all(isinstance(a, str) for a in listed):
                raise EnvironmentFailed(f"{r.env.server} answered {what} with {quote(json.dumps(listed))}, not a "
                                        "list of actions")
            self._listed = listed[: self.max_actions]
        return list(self._listed)

    def normalize(self, action: str) -> str:
        action = " ".join(action.split())
        return f"move {action.lower()}" if action.lower() in ("up", "down", "left", "right") else action


class Wordle(Profile):
    name = "wordle"
    prefix = "/wordle"
    task_field = "seed"
    closes = False
    invalid = re.compile(r"^\s*invalid word\s*$", re.I)
    test = "0-24"
    train_span = "0-979"
    max_turns = 8
    instruction = (
        "Guess a hidden five-letter English word in at most six guesses. Write a guess as its five letters "
        "separated by spaces, e.g. \"c r a n e\"; a word the game does not know is answered \"invalid word\". "
        "Each guess is answered with five letters, one per position: g, the letter is in the word at that "
        "place; y, it is in the word elsewhere; b, it is not in the word. The episode succeeds when you guess "
        "the word."
    )

    def normalize(self, action: str) -> str:
        action = " ".join(action.split())
        word = action.lower()
        return " ".join(word) if len(word) == 5 and word.isalpha() else action


class WebShop(Profile):
    name = "webshop"
    id_field = "env_idx"
    task_field = "session_id"
    distinct_ids = False        # its /create answers a random int (and recycles ids past 8000 envs)
    lists_actions = True
    # WebShop's goals 0-499 are its own test goals.
    test = "0-199"
    train_span = "500-4429"
    max_turns = 10
    instruction = (
        "Buy the product the instruction in the observation asks for, with the options it names, within its "
        "price limit. Pages are shown as text, their parts separated by [SEP]. One action per turn: "
        "search[keywords] on the search page, or click[VALUE] where VALUE is a button, product or option shown "
        "on the page (Back to Search, Next >, < Prev, a product id, a size or colour, Buy Now). Buying ends the "
        "episode; the purchase scores from 0 to 1 by how well it matches, and only a full match is a success."
    )
    _INSTRUCTION = re.compile(r"Instruction:\s*\[SEP\]\s*(.*?)\s*\[SEP\]")

    def create(self, r: Remote) -> int:
        what = "creating an environment (POST /create)"
        rid = r.post("/create", None, what)
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise EnvironmentFailed(f"{r.env.server} answered {what} with {quote(json.dumps(rid))}, not an "
                                    "environment index: is it an AgentGym webshop server?")
        return rid

    def reset(self, r: Remote, rid: int, task: int) -> tuple[str, list[str]]:
        what = f"the reset to task {task}"
        self._call(r, rid, lambda: r.post("/reset", self.reset_body(rid, task), what))
        # As AgentGym's client does: the page comes from /observation, not from the reset's answer.
        observation = self._call(r, rid, lambda: r.get("/observation", {self.id_field: rid},
                                                       "the observation (GET /observation)"))
        if not isinstance(observation, str):
            raise EnvironmentFailed(f"{r.env.server} answered GET /observation with {quote(json.dumps(observation))}")
        return observation, self.actions(r, rid, None, observation)

    def step(self, r: Remote, rid: int, action: str) -> tuple[str, float, bool, list[str]]:
        what = "a step"
        data = self._call(r, rid, lambda: r.post("/step", {self.id_field: rid, "action": action}, what))
        observation = r.field(data, "state", str, what)
        value = float(r.field(data, "reward", (int, float), what))
        done = bool(r.field(data, "done", (bool, int), what))
        return observation, value, done, self.actions_after_step(r, rid, data, observation, done)

    def actions(self, r: Remote, rid: int, data: Any, observation: str) -> list[str]:
        """search[<the instruction>] where the page has a search bar (WebShop's own baseline searches with
        the instruction), and click[...] for each clickable but the search button."""
        what = "the available actions (GET /available_actions)"
        listed = self._call(r, rid, lambda: r.get("/available_actions", {self.id_field: rid}, what))
        out: list[str] = []
        if r.field(listed, "has_search_bar", (bool, int), what):
            m = self._INSTRUCTION.search(observation)
            if m and m[1].strip():
                out.append(f"search[{m[1].strip()}]")
        out += [f"click[{c}]" for c in r.field(listed, "clickables", list, what)
                if isinstance(c, str) and c.strip() and c.lower() != "search"]
        return out[: self.max_actions]

    def _call(self, r: Remote, rid: int, call) -> Any:
        """WebShop fails with HTTP 500 and no words (a KeyError for an index it does not hold, among
        others): /list_envs tells a lost environment from another failure."""
        try:
            return call()
        except HttpError as exc:
            if exc.status != 500:
                raise
            try:
                held = r.get("/list_envs", None, "the environment list (GET /list_envs)")
            except EnvironmentFailed:
                raise exc from None
            if isinstance(held, list) and rid not in held:
                raise IdUnknown(f"{r.env.server} no longer holds environment {rid} ({exc})") from None
            raise


PROFILES: dict[str, type[Profile]] = {p.name: p for p in (TextCraft, BabyAI, SciWorld, ALFWorld, Maze, Wordle,
                                                           WebShop)}

