"""AgentGym's HTTP env servers, bridged: `--envs NAME=agentgym:PROFILE@URL` serves over our EnvService an
environment that lives in an AgentGym env server (github.com/WooooDyy/AgentGym, agentenv-* packages).

A profile knows one AgentGym server's routes and quirks, and follows them the way AgentGym's own client
(agentenv/envs/*.py) does:

    profile    routes            id field  task field        /create answers  value   admissible actions
    textcraft  /                 id        data_idx          {id, ...}        reward  none
    babyai     /                 id        data_idx          {id}             score   in the observation text
    sciworld   /                 id        data_idx          {id}             score   GET /action_hint, expanded
    alfworld   /                 id        game, world_type  {id}             reward  in each answer
    maze       /maze (lmrlgym)   id        game (< 26)       {id}             reward  GET /maze/available_actions
    wordle     /wordle (lmrlgym) id        seed              {id}             reward  none
    webshop    /                 env_idx   session_id        a bare int       reward  GET /available_actions

Every server keeps its environments in memory under ids it hands out from /create, answers most
errors as HTTP 200 with an "error" key (webshop: HTTP 500), and refuses steps once an episode is
done (textcraft does not). AgentGym's servers have no expert, so no bridged profile has one.

Our task ids are AgentGym's task indexes (data_idx, game or seed), split by ranges into train and test
(`?train=...&test=...`, see `parse_tasks`). The defaults hold out as many test tasks as AgentGym's
published evaluation sets have, and train on a span as large as AgentTraj's trajectory set, less the
test tasks.

Success is a value of 1 at the end of the episode: the reward, or the score where AgentGym's client
reports the score (babyai, sciworld). Two servers scale it otherwise: ScienceWorld scores 0-100 (the
bridge divides by 100), and BabyAI's reward is MiniGrid's 1 - 0.9 * steps / max_steps, below 1 for any
real solve (its server ends an episode only when the goal is reached, so any positive value at the
end is a success).

Remote state. One episode holds one remote environment and serialises its calls (AgentGym's servers
do not lock per id). Episodes end with POST /close where the server has it; a server whose version
answers /close with 404 (older textcraft, babyai, sciworld, alfworld, webshop servers; lmrlgym has
none) gets its environments reused by later episodes instead (a reset re-initialises one), so idle
environments never pile up there (webshop's JVM runs out of memory when they do).

Failures map to fedse.env's exceptions: a server that cannot be reached raises EnvironmentUnavailable
(UNAVAILABLE: the client retries), one that refuses a call raises EnvironmentFailed quoting it
(FAILED_PRECONDITION), and a step on an environment the server no longer holds raises EpisodeLost
(NOT_FOUND: the client plays the episode again). AgentGym's servers keep nothing across a restart
and number environments from 0 again, so a restarted server may hand an old episode's id to a new
one: an episode begun before the server was last unreachable, or before it handed out an id twice,
is lost rather than stepped on someone else's environment. A step that times out is lost too (the
server may have applied it: doing it again would apply it twice). Building the environment contacts
nothing, so an env server starts while the AgentGym server is down.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
from typing import Any

import requests

from fedse.env import (
    Environment,
    EnvironmentFailed,
    EnvironmentUnavailable,
    Episode,
    EpisodeLost,
    StepResult,
    UnknownTask,
    check_split,
)
from fedse.serving import log_fields

log = logging.getLogger(__name__)

# How much of a server's words an error message quotes.
MAX_QUOTE_CHARS = 300
# The most task ids a split may name (a typo such as 0-99999999 should not eat the memory).
MAX_TASKS = 1_000_000
DEFAULT_MAX_ACTIONS = 256
ALFWORLD_WORLD_TYPES = ("Text", "Embody", "Hybrid")


# ---------------------------------------------------------------- task ranges

_RANGE = re.compile(r"(\d+)(?:-(\d+)(?:/(\d+))?)?")


def parse_tasks(text: str, option: str = "tasks") -> list[int]:
    """Task indexes from "A", "A-B" (inclusive) or "A-B/S" (every S-th from A to B), several joined by
    '+' (spec options cannot hold commas): "0-99+200-249", "0-3999/20". In the order given, each once."""
    ids: list[int] = []
    seen: set[int] = set()
    for part in text.split("+"):
        part = part.replace(" ", "")
        m = _RANGE.fullmatch(part)
        if not m:
            raise ValueError(f"{option}={text!r}: {part!r} is not a task index A, a range A-B or A-B/STEP; join "
                             "several with '+', e.g. 0-99+200-249")
        first = int(m[1])
        last = int(m[2]) if m[2] is not None else first
        step = int(m[3]) if m[3] is not None else 1
        if last < first or step < 1:
            raise ValueError(f"{option}={text!r}: {part!r} is empty (it ends before it starts, or steps by 0)")
        if len(ids) + (last - first) // step + 1 > MAX_TASKS:
            raise ValueError(f"{option}={text!r} names more than {MAX_TASKS} tasks")
        for i in range(first, last + 1, step):
            if i not in seen:
                seen.add(i)
                ids.append(i)
    return ids


def ranges_text(ids: list[int], limit: int = 8) -> str:
    """Sorted ids as a short "0-4+9+12-15" (the first `limit` runs, then "...")."""
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    shown = "+".join(f"{a}-{b}" if a != b else str(a) for a, b in runs[:limit])
    return shown + ("+..." if len(runs) > limit else "") if runs else "none"


# ---------------------------------------------------------------- errors

class _NoRoute(EnvironmentFailed):
    """The server has no such route (HTTP 404 or 405): not this profile's server, or an older version."""


class _HttpError(EnvironmentFailed):
    """The server answered an HTTP error status (webshop's way of failing)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _IdUnknown(EnvironmentFailed):
    """The server does not know the remote id (it restarted since, or the id was closed)."""


class _TimedOut(EnvironmentUnavailable):
    """No answer within the timeout: the call may or may not have been applied."""


# How AgentGym's servers say they do not know an id: "The id 3 is not valid.", "The task with
# environment 3 has been deleted.", or a bare KeyError's text ("3").
_UNKNOWN_ID = re.compile(r"\bid -?\d+ is not valid|has been deleted|^\s*(KeyError:?\s*)?'?-?\d+'?\s*$", re.I)
_WHY = (re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)"), re.compile(r"RemoteDisconnected\('([^']+)'"),
        re.compile(r"(Connection (?:refused|reset by peer|aborted))"))


def _quote(text: str) -> str:
    text = " ".join(str(text).split())
    return '"' + (text if len(text) <= MAX_QUOTE_CHARS else text[:MAX_QUOTE_CHARS - 3] + "...") + '"'


def _why(exc: BaseException) -> str:
    """A connection failure in a few words ("Connection refused"), not urllib3's paragraph."""
    text = str(exc)
    for pattern in _WHY:
        m = pattern.search(text)
        if m:
            return m[1].strip().rstrip(".")
    return type(exc).__name__


# ---------------------------------------------------------------- HTTP

class _Remote:
    """HTTP calls to the server for one episode (one requests.Session, used under the episode's lock),
    with every failure mapped to the public exceptions."""

    def __init__(self, env: "AgentGymEnvironment"):
        self.env = env
        self.session = requests.Session()
        # A new connection a call: a kept-alive one the server drops while idle (uvicorn does after 5 s)
        # would fail a call as if the server had gone, and lose every episode.
        self.session.headers["Connection"] = "close"

    def post(self, path: str, body: dict[str, Any] | None, what: str) -> Any:
        return self.call("POST", path, what, body=body)

    def get(self, path: str, params: dict[str, Any] | None, what: str) -> Any:
        return self.call("GET", path, what, params=params)

    def call(self, method: str, path: str, what: str, body: dict[str, Any] | None = None,
             params: dict[str, Any] | None = None) -> Any:
        env = self.env
        route = env.profile.prefix + path
        try:
            resp = self.session.request(method, env.url + route, json=body, params=params,
                                        timeout=(env.timeout_s, env.timeout_s))
        except requests.ConnectTimeout:
            raise EnvironmentUnavailable(env.unreachable(f"no connection within {env.timeout_s:g} s")) from None
        except requests.ReadTimeout:
            raise _TimedOut(f"{env.server} did not answer {what} ({method} {route}) within {env.timeout_s:g} s "
                            "(raise timeout_s if it is slow)") from None
        except requests.ConnectionError as exc:
            # It may be restarting: every episode begun before is treated as lost (see the module doc).
            env.lost_contact()
            raise EnvironmentUnavailable(env.unreachable(_why(exc))) from None
        except requests.RequestException as exc:
            raise EnvironmentFailed(f"{env.server}: {what} failed: {type(exc).__name__}: {_quote(str(exc))}") from None
        status = resp.status_code
        if status in (404, 405):
            raise _NoRoute(f"{env.server} has no route {method} {route} (HTTP {status}): is {env.url} an AgentGym "
                           f"{env.profile.name} server?")
        if status in (502, 503, 504):
            raise EnvironmentUnavailable(env.unreachable(f"it answered {what} with HTTP {status}"))
        if status != 200:
            raise _HttpError(f"{env.server} refused {what}: HTTP {status}: {_quote(resp.text)}", status)
        try:
            data = resp.json()
        except ValueError:
            raise EnvironmentFailed(f"{env.server} answered {what} with something that is not JSON: "
                                    f"{_quote(resp.text)}") from None
        if isinstance(data, dict) and "error" in data:
            said = str(data["error"])
            kind = _IdUnknown if _UNKNOWN_ID.search(said) else EnvironmentFailed
            raise kind(f"{env.server} refused {what}: {_quote(said)}")
        return data

    def field(self, data: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
        """data[key], checked to be of `kind` (EnvironmentFailed naming what came instead)."""
        value = data.get(key) if isinstance(data, dict) else None
        if not isinstance(value, kind) or (kind in (int, (int, float)) and isinstance(value, bool)):
            raise EnvironmentFailed(f"{self.env.server} answered {what} without a valid {key!r} field: "
                                    f"{_quote(json.dumps(data, default=str))}; is it an AgentGym "
                                    f"{self.env.profile.name} server?")
        return value

    def close(self) -> None:
        self.session.close()


# ---------------------------------------------------------------- profiles

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

    def create(self, r: _Remote) -> int:
        what = "creating an environment (POST /create)"
        return r.field(r.post("/create", None, what), "id", int, what)

    def reset_body(self, rid: int, task: int) -> dict[str, Any]:
        return {self.id_field: rid, self.task_field: task}

    def reset(self, r: _Remote, rid: int, task: int) -> tuple[str, list[str]]:
        what = f"the reset to task {task}"
        data = r.post("/reset", self.reset_body(rid, task), what)
        observation = self.first_observation(r, rid, data, what)
        return observation, self.actions(r, rid, data, observation)

    def step(self, r: _Remote, rid: int, action: str) -> tuple[str, float, bool, list[str]]:
        what = "a step"
        data = r.post("/step", {self.id_field: rid, "action": action}, what)
        observation = r.field(data, "observation", str, what)
        value = float(r.field(data, self.value_field, (int, float), what)) / self.scale
        done = bool(r.field(data, "done", (bool, int), what))
        return observation, value, done, self.actions_after_step(r, rid, data, observation, done)

    def actions_after_step(self, r: _Remote, rid: int, data: Any, observation: str, done: bool) -> list[str]:
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

    def close(self, r: _Remote, rid: int) -> None:
        r.post("/close", {self.id_field: rid}, "closing an environment (POST /close)")

    # -- reading the answers

    def first_observation(self, r: _Remote, rid: int, data: Any, what: str) -> str:
        return r.field(data, "observation", str, what)

    def actions(self, r: _Remote, rid: int, data: Any, observation: str) -> list[str]:
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

    def create(self, r: _Remote) -> int:
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

    def actions(self, r: _Remote, rid: int, data: Any, observation: str) -> list[str]:
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

    def first_observation(self, r: _Remote, rid: int, data: Any, what: str) -> str:
        return r.field(data, "task_description", str, what) + "\n" + r.field(data, "observation", str, what)

    def actions(self, r: _Remote, rid: int, data: Any, observation: str) -> list[str]:
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

    def actions(self, r: _Remote, rid: int, data: Any, observation: str) -> list[str]:
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

    def actions(self, r: _Remote, rid: int, data: Any, observation: str) -> list[str]:
        if self._listed is None:
            what = "the available actions (GET /maze/available_actions)"
            try:
                listed = r.get("/available_actions", None, what)
            except _NoRoute:
                listed = list(self.MOVES)  # a version without the route: LMRL-Gym's maze has these four
            if not isinstance(listed, list) or not all(isinstance(a, str) for a in listed):
                raise EnvironmentFailed(f"{r.env.server} answered {what} with {_quote(json.dumps(listed))}, not a "
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

    def create(self, r: _Remote) -> int:
        what = "creating an environment (POST /create)"
        rid = r.post("/create", None, what)
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise EnvironmentFailed(f"{r.env.server} answered {what} with {_quote(json.dumps(rid))}, not an "
                                    "environment index: is it an AgentGym webshop server?")
        return rid

    def reset(self, r: _Remote, rid: int, task: int) -> tuple[str, list[str]]:
        what = f"the reset to task {task}"
        self._call(r, rid, lambda: r.post("/reset", self.reset_body(rid, task), what))
        # As AgentGym's client does: the page comes from /observation, not from the reset's answer.
        observation = self._call(r, rid, lambda: r.get("/observation", {self.id_field: rid},
                                                       "the observation (GET /observation)"))
        if not isinstance(observation, str):
            raise EnvironmentFailed(f"{r.env.server} answered GET /observation with {_quote(json.dumps(observation))}")
        return observation, self.actions(r, rid, None, observation)

    def step(self, r: _Remote, rid: int, action: str) -> tuple[str, float, bool, list[str]]:
        what = "a step"
        data = self._call(r, rid, lambda: r.post("/step", {self.id_field: rid, "action": action}, what))
        observation = r.field(data, "state", str, what)
        value = float(r.field(data, "reward", (int, float), what))
        done = bool(r.field(data, "done", (bool, int), what))
        return observation, value, done, self.actions_after_step(r, rid, data, observation, done)

    def actions(self, r: _Remote, rid: int, data: Any, observation: str) -> list[str]:
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

    def _call(self, r: _Remote, rid: int, call) -> Any:
        """WebShop fails with HTTP 500 and no words (a KeyError for an index it does not hold, among
        others): /list_envs tells a lost environment from another failure."""
        try:
            return call()
        except _HttpError as exc:
            if exc.status != 500:
                raise
            try:
                held = r.get("/list_envs", None, "the environment list (GET /list_envs)")
            except EnvironmentFailed:
                raise exc from None
            if isinstance(held, list) and rid not in held:
                raise _IdUnknown(f"{r.env.server} no longer holds environment {rid} ({exc})") from None
            raise


PROFILES: dict[str, type[Profile]] = {p.name: p for p in (TextCraft, BabyAI, SciWorld, ALFWorld, Maze, Wordle,
                                                           WebShop)}


# ---------------------------------------------------------------- environment and episodes

class AgentGymEnvironment(Environment):
    """One AgentGym env server's environment, served under its spec's name. It tracks the server's
    lifetime (see the module docstring) and the remote environments free for reuse."""

    has_expert = False

    def __init__(self, profile: Profile, url: str, train: list[int], test: list[int], max_turns: int,
                 timeout_s: float):
        self.profile = profile
        self.url = url.rstrip("/")
        self.server = f"AgentGym {profile.name} server at {self.url}"
        self.lists_actions = profile.lists_actions
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self._splits = {"train": train, "test": test}
        self._known = set(train) | set(test)
        self._lock = threading.Lock()
        # Bumped whenever the server may have restarted: episodes of an older generation are lost.
        self.generation = 0
        self._ids: set[int] = set()               # remote ids handed out in this generation
        self._idle: list[tuple[int, int]] = []    # (remote id, generation) free for reuse
        self._closes = profile.closes

    # -- Environment

    def tasks(self, split: str) -> list[int]:
        check_split(split)
        return list(self._splits[split])

    def reset(self, task_id: int) -> Episode:
        if task_id not in self._known:
            raise UnknownTask(f"{self.name or self.profile.name} has no task {task_id}: its tasks are AgentGym's "
                              f"indexes {ranges_text(self._splits['test'])} (test) and "
                              f"{ranges_text(self._splits['train'])} (train)")
        remote = _Remote(self)
        try:
            return self._reset(remote, task_id)
        except BaseException:
            remote.close()
            raise

    def _reset(self, remote: _Remote, task_id: int) -> Episode:
        for attempt in range(2):
            taken = self._take_idle()
            if taken is None:
                rid = self.profile.create(remote)
                generation = self._handed_out(rid)
            else:
                rid, generation = taken
            try:
                observation, actions = self.profile.reset(remote, rid, task_id)
            except _IdUnknown:
                self._restarted(generation)
                if attempt:
                    raise
                continue  # a reused id the restarted server does not know: once more, on a fresh one
            except _TimedOut:
                raise  # the id may still be busy there: never reused
            except EnvironmentFailed:
                try:
                    self._release(remote, rid, generation)  # the server refused the task, not the id
                except (EnvironmentFailed, EnvironmentUnavailable):
                    pass  # the refusal is what the caller needs to hear
                raise
            return AgentGymEpisode(self, remote, rid, generation, observation, actions)
        raise AssertionError("unreachable")

    # -- the server's lifetime

    def unreachable(self, why: str) -> str:
        return f"{self.server} unreachable: {why}; is it running?"

    def lost_contact(self) -> None:
        """The server could not be reached: it may be restarting, so every episode begun is lost."""
        with self._lock:
            self._new_generation()

    def _restarted(self, generation: int) -> None:
        """The server does not know an id of `generation`: it restarted (once per generation)."""
        with self._lock:
            if generation == self.generation:
                self._new_generation()

    def _new_generation(self) -> None:
        self.generation += 1
        self._ids.clear()
        self._idle.clear()

    def _handed_out(self, rid: int) -> int:
        """Notes a fresh remote id; an id handed out twice means the server restarted. Returns the
        generation the id belongs to."""
        with self._lock:
            if self.profile.distinct_ids and rid in self._ids:
                log.warning("AgentGym server restarted: episodes begun before are lost",
                            extra=log_fields(env=self.name, url=self.url, remote_id=rid))
                self._new_generation()
            self._ids.add(rid)
            return self.generation

    def _take_idle(self) -> tuple[int, int] | None:
        with self._lock:
            while self._idle:
                rid, generation = self._idle.pop()
                if generation == self.generation:
                    return rid, generation
            return None

    def _release(self, remote: _Remote, rid: int, generation: int) -> None:
        """An episode is done with a remote environment: close it where the server can, else keep it
        for the next episode. Not when the server restarted since (the id may be another's now)."""
        if generation != self.generation:
            return
        if self._closes:
            try:
                self.profile.close(remote, rid)
                return
            except _NoRoute:
                if self._closes:
                    self._closes = False
                    log.info("AgentGym server has no /close: its environments are reused instead",
                             extra=log_fields(env=self.name, url=self.url))
            except _IdUnknown:
                return
        with self._lock:
            if generation == self.generation:
                self._idle.append((rid, generation))


class AgentGymEpisode(Episode):
    """One episode on one remote environment; its calls are serialised by its lock."""

    def __init__(self, env: AgentGymEnvironment, remote: _Remote, rid: int, generation: int, observation: str,
                 actions: list[str]):
        self.env = env
        self.remote = remote
        self.remote_id = rid
        self.generation = generation
        self.instruction = env.profile.instruction
        self.observation = observation
        self._actions = actions
        self._lock = threading.Lock()
        self._closed = False
        self._reusable = True   # False once the remote environment's state is uncertain

    def available_actions(self) -> list[str]:
        with self._lock:
            return list(self._actions)

    def step(self, action: str) -> StepResult:
        env, profile = self.env, self.env.profile
        with self._lock:
            if self._closed:
                raise EnvironmentFailed(f"{env.server}: this episode was closed")
            if env.generation != self.generation:
                self._reusable = False
                raise EpisodeLost(f"{env.server} was unreachable or restarted since this episode began (remote "
                                  f"id {self.remote_id}); its environment there is gone: play the episode again")
            try:
                observation, value, done, actions = profile.step(self.remote, self.remote_id, profile.normalize(action))
            except _IdUnknown as exc:
                env._restarted(self.generation)
                self._reusable = False
                raise EpisodeLost(f"{exc}: the server no longer holds this episode (it restarted); play it again") \
                    from None
            except _TimedOut as exc:
                self._reusable = False
                raise EpisodeLost(f"{exc}; the action may have been applied there, so the episode cannot go on: "
                                  "play it again") from None
            self.observation = observation
            self._actions = actions
            return StepResult(observation, value, done, done and profile.succeeded(value), profile.valid(observation))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._reusable:
                    self.env._release(self.remote, self.remote_id, self.generation)
            finally:
                self.remote.close()


# ---------------------------------------------------------------- the factory

def _split(profile: Profile, option: str, given: str, default: str) -> list[int]:
    ids = parse_tasks(given or default, option)
    if profile.num_tasks is not None:
        beyond = [i for i in ids if i >= profile.num_tasks]
        if beyond:
            raise ValueError(f"{option}={given or default!r}: AgentGym's {profile.name} server has tasks "
                             f"0-{profile.num_tasks - 1} only, not {ranges_text(beyond)}")
    return ids


def bridge(profile: str, url: str, *, seed: int = 0, train: str = "", test: str = "", max_turns: int = 0,
           timeout_s: float = 30.0, max_actions: int = DEFAULT_MAX_ACTIONS, world_type: str = "") -> Environment:
    """An environment served by the AgentGym env server at `url` (its root, e.g. http://127.0.0.1:36001;
    maze and wordle: the lmrlgym server's root). Contacts nothing: calls fail with
    EnvironmentUnavailable until the server is up.

    train, test: AgentGym task indexes (see parse_tasks); test defaults to the profile's held-out range,
    train to the profile's training span less the test tasks. They must not overlap.
    max_turns: the turn limit (0: the profile's). timeout_s: the limit of each HTTP call.
    max_actions: the most admissible actions listed a turn. world_type: alfworld's (Text, Embody or
    Hybrid; default Text). seed: unused (the tasks are AgentGym's indexes under any seed)."""
    del seed
    if profile not in PROFILES:
        raise ValueError(f"unknown AgentGym profile {profile!r}: use one of {', '.join(sorted(PROFILES))} (maze and "
                         "wordle both live in AgentGym's lmrlgym server)")
    p = PROFILES[profile]()
    if not re.match(r"https?://[^/\s]+", url):
        raise ValueError(f"AgentGym server URL {url!r}: expected http://HOST:PORT")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: expected a positive number of seconds")
    if max_turns < 0:
        raise ValueError(f"max_turns={max_turns}: expected a positive turn limit, or 0 for the profile's "
                         f"({p.max_turns})")
    if max_actions < 1:
        raise ValueError(f"max_actions={max_actions}: expected at least 1")
    p.max_actions = max_actions
    if world_type:
        if not isinstance(p, ALFWorld):
            raise ValueError(f"world_type is an option of the alfworld profile only, not of {profile}")
        if world_type not in ALFWORLD_WORLD_TYPES:
            raise ValueError(f"world_type={world_type!r}: use one of {', '.join(ALFWORLD_WORLD_TYPES)}")
        p.world_type = world_type
    test_ids = _split(p, "test", test, p.test)
    if train:
        train_ids = _split(p, "train", train, "")
        both = set(train_ids) & set(test_ids)
        if both:
            raise ValueError(f"train={train!r} and test={test or p.test!r} overlap on tasks {ranges_text(list(both))}: "
                             "held-out tasks must not be trained on")
    else:
        held = set(test_ids)
        train_ids = [i for i in _split(p, "train", "", p.train_span) if i not in held]
    if not train_ids or not test_ids:
        raise ValueError(f"AgentGym {profile}: the {'train' if not train_ids else 'test'} split is empty; "
                         "give it tasks with train=A-B or test=A-B")
    return AgentGymEnvironment(p, url, train_ids, test_ids, max_turns or p.max_turns, timeout_s)
