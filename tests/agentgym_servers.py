"""Small AgentGym-like env servers over real HTTP, for testing the AgentGym bridge without AgentGym.

Each follows its AgentGym server's API (routes, field names, answers) and quirks: errors as HTTP 200
with an "error" key (webshop: a wordless HTTP 500), 404 for a route it lacks (lmrlgym and webshop
have no /close), 422 for a body without a field the route requires, ids from 0 per process (webshop:
random ints), environments that refuse steps once done (textcraft's do not), babyai's actions inside
the observation text. Each plays a tiny deterministic game (a crafting goal, a corridor, a word), so
an episode can succeed or fail. A server runs on 127.0.0.1 in a thread; `restart()` stops it and
starts a fresh "process" (no environments, ids from 0 again) on the same port, and `stop()` alone
leaves the port refusing connections. Every call is recorded (`calls`); two calls on one id at once
are recorded in `overlaps` (AgentGym's servers do not lock per id: the bridge must serialise).

The HTTP plumbing is in agentgym_http.py and the textcraft, babyai, sciworld and alfworld servers in
agentgym_games.py; this module holds lmrlgym's (maze, wordle) and webshop's and gathers every server
(SERVERS) and a plan that wins each game (PLANS).
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable

# Every server and its helpers, importable from here as before: the HTTP plumbing and the other servers.
from agentgym_games import (ALFWorldServer, BabyAIServer, SciWorldServer, TextCraftServer,  # noqa: F401
                            alfworld_plan, babyai_plan, sciworld_plan, textcraft_plan)
from agentgym_http import AgentGymServer, Raw, Route  # noqa: F401


# ---------------------------------------------------------------- lmrlgym: maze and wordle

MAZE_ACTIONS = ["move left", "move right", "move up", "move down"]
MAZE_GAMES = 26
WORDLE_VOCAB = ("crane", "slate", "pious", "ghost", "knelt", "vivid")


def maze_plan(game: int) -> list[str]:
    return ["move right"] * (3 - game % 3)


def wordle_plan(seed: int) -> list[str]:
    return [" ".join(WORDLE_VOCAB[seed % len(WORDLE_VOCAB)])]


def wordle_feedback(guess: str, word: str) -> str:
    marks = ["b"] * 5
    left = [w for g, w in zip(guess, word) if g != w]
    for i, (g, w) in enumerate(zip(guess, word)):
        if g == w:
            marks[i] = "g"
        elif g in left:
            marks[i] = "y"
            left.remove(g)
    return " ".join(marks)


class LMRLGymServer(AgentGymServer):
    """agentenv-lmrlgym: maze under /maze (reset {id, game}, game < 26; the actions from a route without
    an id) and wordle under /wordle (reset {id, seed}; "invalid word"; rewards moved from [-1, 0] to
    [0, 1]), each with its own ids; no /close."""

    def fresh(self) -> None:
        super().fresh()
        self.words: dict[int, dict[str, Any]] = {}
        self.next_word_id = 0

    def routes(self) -> dict[tuple[str, str], Route]:
        g = self.guarded
        return {
            ("POST", "/maze/create"): Route(g(self.maze_create), body=False),
            ("POST", "/maze/step"): Route(g(self.maze_step), ("id", "action"), ("id",)),
            ("POST", "/maze/reset"): Route(g(self.maze_reset), ("id", "game"), ("id", "game")),
            ("GET", "/maze/available_actions"): Route(lambda: list(MAZE_ACTIONS)),
            ("GET", "/maze/observation"): Route(g(lambda id: self.check(id)["observation"]), ("id",), ("id",)),
            ("GET", "/maze/detail"): Route(g(lambda id: self.check(id)), ("id",), ("id",)),
            ("POST", "/wordle/create"): Route(g(self.wordle_create), body=False),
            ("POST", "/wordle/step"): Route(g(self.wordle_step), ("id", "action"), ("id",)),
            ("POST", "/wordle/reset"): Route(g(self.wordle_reset), ("id", "seed"), ("id", "seed")),
            ("GET", "/wordle/filtered_vocab"): Route(g(lambda id: (self._word(id), list(WORDLE_VOCAB))[1]),
                                                     ("id",), ("id",)),
            ("GET", "/wordle/observation"): Route(g(lambda id: self._word(id)["observation"]), ("id",), ("id",)),
        }

    # maze: a corridor along row 1 to the goal at (1, 5)

    def maze_create(self) -> Any:
        rid = self.new_id()
        self.envs[rid] = {"done": False, "reward": 0, "deleted": False}
        return {"id": rid}

    @staticmethod
    def _maze_text(col: int) -> str:
        return (f"The goal is at position 1, 5. Your current position is at position 1, {col}. There are walls "
                "above you, below you.")

    def maze_reset(self, id: int, game: int) -> Any:  # noqa: A002
        self.check(id, resetting=True)
        if game >= MAZE_GAMES:
            raise NameError(f"The game {game} is not valid.")
        col = 2 + game % 3
        self.envs[id] = {"col": col, "observation": self._maze_text(col), "done": False, "reward": 0,
                         "deleted": False}
        return {"observation": self.envs[id]["observation"]}

    def maze_step(self, id: int, action: str) -> Any:  # noqa: A002
        env = self.check(id)
        moves = {"move right": 1, "move left": -1}
        env["col"] = max(1, env["col"] + moves.get(action.strip(), 0))
        reward = 1.0 if env["col"] == 5 else 0
        env["done"] = reward == 1.0
        env["observation"] = "Success" if env["done"] else self._maze_text(env["col"])
        return {"observation": env["observation"], "reward": reward, "done": env["done"]}

    # wordle

    def _word(self, rid: int) -> dict[str, Any]:
        if rid not in self.words:
            raise NameError(f"The id {rid} is not valid.")
        if self.words[rid]["done"]:
            raise NameError(f"The task with environment {rid} has finished.")
        return self.words[rid]

    def wordle_create(self) -> Any:
        with self._lock:
            rid = self.next_word_id
            self.next_word_id += 1
        self.words[rid] = {"done": False, "reward": 0, "deleted": False}
        return {"id": rid}

    def wordle_reset(self, id: int, seed: int) -> Any:  # noqa: A002
        if id not in self.words:
            raise NameError(f"The id {id} is not valid.")
        self.words[id] = {"word": WORDLE_VOCAB[seed % len(WORDLE_VOCAB)], "guesses": 0, "done": False, "reward": 0,
                          "observation": "Let's start Wordle!", "deleted": False}
        return {"id": id, "observation": "Let's start Wordle!"}

    def wordle_step(self, id: int, action: str) -> Any:  # noqa: A002
        env = self._word(id)
        guess = "".join(action.split())
        if len(action.split()) != 5 or guess not in WORDLE_VOCAB:
            observation, reward = "invalid word", 0.0
        else:
            env["guesses"] += 1
            observation = wordle_feedback(guess, env["word"])
            reward = 1.0 if guess == env["word"] else 0.0
            env["done"] = reward == 1.0 or env["guesses"] >= 6
        env["observation"] = observation
        return {"observation": observation, "reward": reward, "done": env["done"]}


# ---------------------------------------------------------------- webshop

WEBSHOP_PRODUCTS = (("b01", "red mug"), ("b02", "blue lamp"))


def webshop_goal(session: int) -> tuple[str, str]:
    return WEBSHOP_PRODUCTS[session % 2]


def webshop_plan(session: int) -> list[str]:
    asin, name = webshop_goal(session)
    return [f"search[{name}]", f"click[{asin}]", "click[buy now]"]


class WebShopServer(AgentGymServer):
    """agentenv-webshop: env_idx, not id; /create answers a bare random int; /reset {env_idx,
    session_id} answers [observation, null]; steps answer {state, reward, done, info}; failures are a
    wordless HTTP 500 (an unknown env_idx is a KeyError); no /close. "click[crash]" fails the step."""

    id_field = "env_idx"

    def __init__(self, delay_s: float = 0.0, seed: int = 0):
        self._rng = random.Random(seed)
        super().__init__(delay_s)

    def routes(self) -> dict[tuple[str, str], Route]:
        return {
            ("GET", "/"): Route(lambda: "ok"),
            ("GET", "/list_envs"): Route(lambda: list(self.envs)),
            ("POST", "/create"): Route(self.create, body=False),
            ("POST", "/step"): Route(self.step, ("env_idx", "action"), ("env_idx",)),
            ("POST", "/reset"): Route(self.reset, ("env_idx",), ("env_idx",), optional={"session_id": None}),
            ("GET", "/observation"): Route(lambda env_idx: self.envs[env_idx]["page"][0], ("env_idx",), ("env_idx",)),
            ("GET", "/available_actions"): Route(self.available_actions, ("env_idx",), ("env_idx",)),
            ("GET", "/instruction_text"): Route(lambda env_idx: self.envs[env_idx]["instruction"], ("env_idx",),
                                                ("env_idx",)),
        }

    def create(self) -> int:
        rid = self._rng.randint(0, 48950076)
        self.envs[rid] = {}
        self._search_page(rid, 0)
        return rid

    def _search_page(self, rid: int, session: int) -> None:
        asin, name = webshop_goal(session)
        instruction = f"i want to buy a {name}, and price lower than 10.00 dollars"
        env = self.envs[rid]
        env.update(goal=asin, instruction=instruction, done=False, chosen=None)
        env["page"] = (f"WebShop [SEP] Instruction: [SEP] {instruction} [SEP] Search", True, ["search"])

    def reset(self, env_idx: int, session_id: Any) -> Any:
        if env_idx not in self.envs:
            raise KeyError(env_idx)
        self._search_page(env_idx, session_id or 0)
        return [self.envs[env_idx]["page"][0], None]

    def available_actions(self, env_idx: int) -> Any:
        _, bar, clickables = self.envs[env_idx]["page"]
        return {"has_search_bar": bar, "clickables": clickables}

    def step(self, env_idx: int, action: str) -> Any:
        env = self.envs[env_idx]  # KeyError -> 500, as WebShop's server answers
        if env["done"] or action == "click[crash]":
            raise RuntimeError("the simulator failed")
        head = f"Instruction: [SEP] {env['instruction']} [SEP] "
        text, bar, clickables = env["page"]
        reward = 0.0
        m = re.fullmatch(r"(search|click)\[(.*)\]", action.strip())
        if m and m[1] == "search" and bar:
            rows = " [SEP] ".join(f"{a.upper()} [SEP] {n.capitalize()} [SEP] $5.00" for a, n in WEBSHOP_PRODUCTS)
            env["page"] = (f"{head}Back to Search [SEP] Page 1 (Total results: 2) [SEP] Next > [SEP] {rows}", False,
                           ["back to search", "next >", *[a for a, _ in WEBSHOP_PRODUCTS]])
        elif m and m[1] == "click" and m[2].lower() in clickables:
            value = m[2].lower()
            if value == "back to search":
                self._search_page(env_idx, 0 if env["goal"] == "b01" else 1)
            elif value == "buy now":
                reward = 1.0 if env["chosen"] == env["goal"] else 0.25
                env["done"] = True
                env["page"] = (f"Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] {reward}",
                               False, [])
            elif value in dict(WEBSHOP_PRODUCTS):
                env["chosen"] = value
                env["page"] = (f"{head}Back to Search [SEP] < Prev [SEP] {dict(WEBSHOP_PRODUCTS)[value]} [SEP] "
                               "Price: $5.00 [SEP] Buy Now", False, ["back to search", "< prev", "buy now"])
        return {"state": env["page"][0], "reward": reward, "done": env["done"], "info": None}


SERVERS: dict[str, type[AgentGymServer]] = {
    "textcraft": TextCraftServer, "babyai": BabyAIServer, "sciworld": SciWorldServer, "alfworld": ALFWorldServer,
    "maze": LMRLGymServer, "wordle": LMRLGymServer, "webshop": WebShopServer,
}
PLANS: dict[str, Callable[[int], list[str]]] = {
    "textcraft": textcraft_plan, "babyai": babyai_plan, "sciworld": sciworld_plan, "alfworld": alfworld_plan,
    "maze": maze_plan, "wordle": wordle_plan, "webshop": webshop_plan,
}
