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
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


class Raw:
    """A non-JSON answer (webshop's "Internal Server Error")."""

    def __init__(self, status: int, text: str):
        self.status, self.text = status, text


class Route:
    def __init__(self, handler: Callable[..., Any], fields: tuple[str, ...] = (), ints: tuple[str, ...] = (),
                 optional: dict[str, Any] | None = None, body: bool = True):
        self.handler = handler
        self.fields = fields            # required, in the body (POST) or the query (GET)
        self.ints = ints                # those that must be integers
        self.optional = optional or {}  # with their defaults
        self.body = body                # a POST whose model needs a JSON object body


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    app: "AgentGymServer"

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up waiting (a timeout test) is no error of the server's


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.server.app.handle(self, "GET")  # type: ignore[attr-defined]

    def do_POST(self) -> None:  # noqa: N802
        self.server.app.handle(self, "POST")  # type: ignore[attr-defined]


class AgentGymServer:
    """The HTTP plumbing: routes, FastAPI-like validation, the calls and overlaps recorded."""

    id_field = "id"
    prefix = ""

    def __init__(self, delay_s: float = 0.0):
        self.port = 0
        self.delay_s = delay_s          # each call on an id takes at least this long (to provoke overlaps)
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.overlaps: list[tuple[str, int]] = []
        self.closed: list[int] = []
        self._lock = threading.Lock()
        self._busy: dict[tuple[str, int], int] = {}
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.fresh()

    # -- life

    def fresh(self) -> None:
        """The state of a just-started server process."""
        self.envs: dict[int, dict[str, Any]] = {}
        self.next_id = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "AgentGymServer":
        httpd = _HTTPServer(("127.0.0.1", self.port), _Handler)
        httpd.app = self
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join()
            self._httpd = None

    def restart(self) -> None:
        """A new server process on the same port: nothing of the old one's environments survives."""
        self.stop()
        self.fresh()
        self.start()

    def __enter__(self) -> "AgentGymServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def routes(self) -> dict[tuple[str, str], Route]:
        raise NotImplementedError

    def count(self, path: str) -> int:
        return sum(1 for _, p, _ in self.calls if p == self.prefix + path)

    # -- requests

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        parsed = urllib.parse.urlsplit(h.path)
        path = parsed.path
        args: dict[str, Any] = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query).items()}
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0)) if method == "POST" else b""
        routes = self.routes()
        route = routes.get((method, path))
        if route is None:
            self.calls.append((method, path, {}))
            if any(p == path for _, p in routes):
                return self._send(h, 405, {"detail": "Method Not Allowed"})
            return self._send(h, 404, {"detail": "Not Found"})
        if method == "POST" and (raw or route.body):
            try:
                body = json.loads(raw or b"null")
            except ValueError:
                return self._send(h, 422, {"detail": [{"loc": ["body"], "msg": "invalid JSON"}]})
            if not isinstance(body, dict):
                return self._send(h, 422, {"detail": [{"loc": ["body"], "msg": "field required"}]})
            args = body
        for name in route.fields:
            if name not in args:
                where = "body" if method == "POST" else "query"
                return self._send(h, 422, {"detail": [{"loc": [where, name], "msg": "field required"}]})
        for name in route.ints:
            try:
                args[name] = int(args[name]) if not isinstance(args[name], bool) else None
            except (TypeError, ValueError):
                args[name] = None
            if args[name] is None:
                return self._send(h, 422, {"detail": [{"loc": [name], "msg": "value is not a valid integer"}]})
        for name, default in route.optional.items():
            args.setdefault(name, default)
        self.calls.append((method, path, dict(args)))
        rid = args.get(self.id_field) if self.id_field in route.fields else None
        key = (path.rsplit("/", 1)[0], rid)  # lmrlgym: maze and wordle number their ids apart
        if rid is not None:
            with self._lock:
                if self._busy.get(key):
                    self.overlaps.append((path, rid))
                self._busy[key] = self._busy.get(key, 0) + 1
        try:
            if self.delay_s and rid is not None:
                time.sleep(self.delay_s)
            try:
                result = route.handler(**{k: v for k, v in args.items()
                                          if k in route.fields or k in route.optional})
            except Exception:  # noqa: BLE001 - an unhandled error: a wordless 500, as uvicorn answers
                result = Raw(500, "Internal Server Error")
        finally:
            if rid is not None:
                with self._lock:
                    self._busy[key] -= 1
        if isinstance(result, Raw):
            return self._send(h, result.status, result.text)
        self._send(h, 200, result)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
        if isinstance(payload, str) and status != 200:
            data, kind = payload.encode(), "text/plain; charset=utf-8"
        else:
            data, kind = json.dumps(payload).encode(), "application/json"
        h.send_response(status)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    # -- AgentGym's usual bookkeeping

    def new_id(self) -> int:
        with self._lock:
            rid = self.next_id
            self.next_id += 1
        return rid

    def check(self, rid: int, resetting: bool = False, refuse_done: bool = True) -> dict[str, Any]:
        """AgentGym's _check_id: raises what its servers then answer as {"error": ...}."""
        if rid not in self.envs:
            raise ValueError(f"The id {rid} is not valid.")
        env = self.envs[rid]
        if env.get("deleted"):
            raise ValueError(f"The task with environment {rid} has been deleted.")
        if refuse_done and not resetting and env.get("done"):
            raise ValueError(f"The task with environment {rid} has finished.")
        return env

    def guarded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Errors as HTTP 200 {"error": "..."}, as AgentGym's servers answer them."""
        def wrapped(**kwargs: Any) -> Any:
            try:
                return fn(**kwargs)
            except Exception as exc:  # noqa: BLE001
                return {"error": str(exc)}
        return wrapped

    def create(self) -> Any:
        """POST /create as babyai, sciworld and alfworld answer it: a new id and nothing else."""
        rid = self.new_id()
        self.envs[rid] = {"deleted": False, "done": False}
        return {"id": rid}

    def close_env(self, id: int) -> Any:  # noqa: A002 - AgentGym's field name
        env = self.check(id, resetting=True)
        env["deleted"] = True
        self.closed.append(id)
        return {"closed": True}


# ---------------------------------------------------------------- textcraft

TEXTCRAFT_GOALS = (("stick", "oak planks", 2), ("torch", "coal", 1), ("ladder", "stick", 7))


def textcraft_plan(task: int) -> list[str]:
    goal, base, n = TEXTCRAFT_GOALS[task % len(TEXTCRAFT_GOALS)]
    return [f"get {n} {base}", f"craft 1 {goal} using {n} {base}"]


class TextCraftServer(AgentGymServer):
    """agentenv-textcraft: /create {commands?, goal?} answers {id, observation, done, reward}; steps
    are allowed after the goal is crafted; no admissible actions."""

    def routes(self) -> dict[tuple[str, str], Route]:
        g = self.guarded
        return {
            ("POST", "/create"): Route(g(self.create), optional={"commands": None, "goal": None}),
            ("POST", "/step"): Route(g(self.step), ("id", "action"), ("id",)),
            ("POST", "/reset"): Route(g(self.reset), ("id",), ("id",), optional={"data_idx": 0}),
            ("GET", "/observation"): Route(g(lambda id: self.check(id)["observation"]), ("id",), ("id",)),
            ("GET", "/detail"): Route(g(lambda id: self.check(id)), ("id",), ("id",)),
            ("POST", "/close"): Route(g(self.close_env), ("id",), ("id",)),
        }

    def check(self, rid: int, resetting: bool = False, refuse_done: bool = False) -> dict[str, Any]:
        return super().check(rid, resetting, refuse_done)  # TextCraft lets a finished episode go on

    def create(self, commands: Any = None, goal: Any = None) -> Any:
        rid = self.new_id()
        self.envs[rid] = {"deleted": False}
        observation = self._start(rid, rid)
        return {"id": rid, "observation": observation, "done": False, "reward": 0}

    def _start(self, rid: int, data_idx: int) -> str:
        goal, base, n = TEXTCRAFT_GOALS[data_idx % len(TEXTCRAFT_GOALS)]
        observation = f"Crafting commands:\ncraft 1 {goal} using {n} {base}\n\nGoal: craft {goal}."
        self.envs[rid].update(goal=goal, base=base, n=n, inventory={}, observation=observation, done=False)
        return observation

    def reset(self, id: int, data_idx: int) -> Any:  # noqa: A002
        self.check(id)
        return {"id": id, "observation": self._start(id, data_idx), "done": False, "reward": 0}

    def step(self, id: int, action: str) -> Any:  # noqa: A002
        env = self.check(id, refuse_done=False)
        inv: dict[str, int] = env["inventory"]
        reward, done = 0, False
        if m := re.match(r"craft (.*) using (.*)", action):
            target, using = m[1], m[2]
            want_target, want_using = f"1 {env['goal']}", f"{env['n']} {env['base']}"
            if target != want_target or using != want_using:
                observation = f"Could not find a valid recipe for {target}"
            elif inv.get(env["base"], 0) < env["n"]:
                observation = f"Could not find enough items to craft minecraft:{env['goal']}"
            else:
                inv[env["base"]] -= env["n"]
                inv[env["goal"]] = inv.get(env["goal"], 0) + 1
                observation, reward, done = f"Crafted 1 minecraft:{env['goal']}", 1, True
        elif m := re.match(r"get ([0-9]+) (.*)", action):
            if m[2] != env["base"]:
                observation = f"Could not find {m[2]}"
            else:
                inv[m[2]] = inv.get(m[2], 0) + int(m[1])
                observation = f"Got {m[1]} {m[2]}"
        elif action == "inventory":
            observation = "Inventory: " + (" ".join(f"[{k}] ({v})" for k, v in inv.items() if v)
                                           or "You are not carrying anything.")
        else:
            observation = f"Could not execute {action}"
        env.update(observation=observation, done=done, reward=reward)
        return {"observation": observation, "reward": reward, "done": done}


# ---------------------------------------------------------------- babyai

BABYAI_ACTIONS = ("turn left", "turn right", "move forward")


def babyai_plan(task: int) -> list[str]:
    return ["move forward"] * (1 + task % 3)


class BabyAIServer(AgentGymServer):
    """agentenv-babyai: /create answers {id}; the actions come inside the observation ("Available
    actions: [...]"); the score is the reward summed; the reward at the goal is MiniGrid's
    1 - 0.9 * steps / max_steps; /close as newer versions have it."""

    MAX_STEPS = 64

    def routes(self) -> dict[tuple[str, str], Route]:
        g = self.guarded
        return {
            ("POST", "/create"): Route(g(self.create), body=False),
            ("POST", "/step"): Route(g(self.step), ("id", "action"), ("id",)),
            ("POST", "/reset"): Route(g(self.reset), ("id", "data_idx"), ("id", "data_idx")),
            ("POST", "/close"): Route(g(self.close_env), ("id",), ("id",)),
        }

    @staticmethod
    def _listed(actions: tuple[str, ...]) -> str:
        return "\nAvailable actions: [" + ", ".join(f'"{a}"' for a in actions) + "]"

    def _view(self, env: dict[str, Any]) -> str:
        return (f"In front of you in this room, you can see several objects: There is a red ball 1 right in front "
                f"of you {env['distance']} steps away. The room has walls around you. You are not carrying anything.")

    def reset(self, id: int, data_idx: int) -> Any:  # noqa: A002
        env = self.check(id, resetting=True)
        env.update(distance=1 + data_idx % 3, steps=0, score=0.0, reward=0.0, done=False)
        observation = "Your goal: go to the red ball\n" + self._view(env) + self._listed(BABYAI_ACTIONS)
        return {"observation": observation, "reward": 0, "score": 0, "deleted": False, "done": False}

    def step(self, id: int, action: str) -> Any:  # noqa: A002
        env = self.check(id)
        action = action.lower().strip()
        env["steps"] += 1
        if action not in BABYAI_ACTIONS:
            text = "The action is not recognized. Please check valid actions."
        elif action == "move forward":
            env["distance"] -= 1
            text = self._view(env) if env["distance"] else "You reach the red ball.\n The task is completed."
        else:
            text = self._view(env)
        reward = 0.0
        if env["distance"] == 0:
            reward = round(1 - 0.9 * env["steps"] / self.MAX_STEPS, 4)
            env["done"] = True
        env["score"] += reward
        return {"observation": text + self._listed(BABYAI_ACTIONS), "reward": reward, "score": env["score"],
                "done": env["done"]}


# ---------------------------------------------------------------- sciworld

SCIWORLD_SUBSTANCES = ("water", "ice", "chocolate")
SCIWORLD_GAMES = 60


def sciworld_plan(task: int) -> list[str]:
    s = SCIWORLD_SUBSTANCES[task % 3]
    return [f"focus on {s}", f"move {s} to stove"]


class SciWorldServer(AgentGymServer):
    """agentenv-sciworld: scores 0-100 (-100 for a failed task), the reset answers the task description
    apart, /action_hint lists templates and objects, an index past its games fails with IndexError's
    text; /close as newer versions have it."""

    def routes(self) -> dict[tuple[str, str], Route]:
        g = self.guarded
        return {
            ("POST", "/create"): Route(g(self.create), body=False),
            ("POST", "/step"): Route(g(self.step), ("id", "action"), ("id",)),
            ("POST", "/reset"): Route(g(self.reset), ("id", "data_idx"), ("id", "data_idx")),
            ("GET", "/observation"): Route(g(lambda id: self.check(id)["observation"]), ("id",), ("id",)),
            ("GET", "/action_hint"): Route(g(self.action_hint), ("id",), ("id",)),
            ("GET", "/detail"): Route(g(lambda id: self.check(id)), ("id",), ("id",)),
            ("POST", "/close"): Route(g(self.close_env), ("id",), ("id",)),
        }

    def reset(self, id: int, data_idx: int) -> Any:  # noqa: A002
        env = self.check(id, resetting=True)
        if not 0 <= data_idx < SCIWORLD_GAMES:
            raise IndexError("list index out of range")
        s = SCIWORLD_SUBSTANCES[data_idx % 3]
        observation = f"This room is called the kitchen. In it, you see: \n\ta stove\n\ta pot\n\tsome {s}\n"
        env.update(substance=s, focused=False, score=0, done=False, observation=observation)
        return {"task_name": "heat", "var_num": data_idx, "task_description": f"Your task is to heat {s}. First, "
                f"focus on the {s}. Then, move it to the stove.", "observation": observation, "reward": 0,
                "score": 0, "deleted": False, "done": False}

    def step(self, id: int, action: str) -> Any:  # noqa: A002
        env = self.check(id)
        s, reward = env["substance"], 0
        if m := re.fullmatch(r"focus on (.+)", action):
            observation = f"You focus on the {m[1]}."
            if m[1] == s and not env["focused"]:
                env["focused"], reward = True, 50
            elif m[1] != s:
                reward, env["done"] = -100 - env["score"], True
        elif action == f"move {s} to stove" and env["focused"]:
            observation, reward, env["done"] = f"You move the {s} to the stove.", 50, True
        elif action == "look around":
            observation = env["observation"]
        else:
            observation = "No known action matches that input."
        env["score"] += reward
        return {"observation": observation, "reward": reward, "score": env["score"], "done": env["done"]}

    def action_hint(self, id: int) -> Any:  # noqa: A002
        env = self.check(id)
        return {"possible_actions": ["look around", "focus on OBJ", "move OBJ to OBJ", "open OBJ"],
                "possible_objects": [env["substance"], "stove", "pot"]}


# ---------------------------------------------------------------- alfworld

ALFWORLD_TASKS = (("apple", "fridge"), ("mug", "shelf"), ("book", "desk"))


def alfworld_plan(game: int) -> list[str]:
    obj, place = ALFWORLD_TASKS[game % 3]
    return [f"take {obj} 1 from table 1", f"put {obj} 1 in/on {place} 1"]


class ALFWorldServer(AgentGymServer):
    """agentenv-alfworld: /reset takes game and world_type, answers and steps carry
    available_actions, the reward is float(won), "Nothing happens." for an inadmissible action."""

    def routes(self) -> dict[tuple[str, str], Route]:
        g = self.guarded
        return {
            ("POST", "/create"): Route(g(self.create), body=False),
            ("POST", "/step"): Route(g(self.step), ("id", "action"), ("id",)),
            ("POST", "/reset"): Route(g(self.reset), ("id", "game", "world_type"), ("id", "game")),
            ("GET", "/available_actions"): Route(g(lambda id: self.check(id)["actions"]), ("id",), ("id",)),
            ("GET", "/observation"): Route(g(lambda id: self.check(id)["observation"]), ("id",), ("id",)),
            ("GET", "/detail"): Route(g(lambda id: self.check(id)), ("id",), ("id",)),
            ("POST", "/close"): Route(g(self.close_env), ("id",), ("id",)),
        }

    @staticmethod
    def _actions(env: dict[str, Any]) -> list[str]:
        obj, place = env["task"]
        carry = [f"put {obj} 1 in/on {place} 1"] if env["holding"] else [f"take {obj} 1 from table 1"]
        return ["go to table 1", f"go to {place} 1", "go to sinkbasin 1", *carry, "inventory", "look"]

    def reset(self, id: int, game: int, world_type: str) -> Any:  # noqa: A002
        if world_type not in ("Text", "Embody", "Hybrid"):
            return {"error": 'world_type must be one of "Text", "Embody" and "Hybrid"'}
        env = self.check(id, resetting=True)
        obj, place = ALFWORLD_TASKS[game % 3]
        observation = (f"You are in the middle of a room. Looking quickly around you, you see a table 1, a {place} 1, "
                       f"and a sinkbasin 1.\n\nYour task is to: put some {obj} in {place}.")
        env.update(task=(obj, place), holding=False, done=False, observation=observation)
        env["actions"] = self._actions(env)
        return {"id": id, "observation": observation, "available_actions": env["actions"],
                "task_type": f"pick_and_place_simple-{obj}/trial_{game}"}

    def step(self, id: int, action: str) -> Any:  # noqa: A002
        env = self.check(id)
        obj, place = env["task"]
        reward = 0.0
        if action not in env["actions"]:
            observation = "Nothing happens."
        elif action.startswith("take "):
            env["holding"], observation = True, f"You pick up the {obj} 1 from the table 1."
        elif action.startswith("put "):
            observation, reward, env["done"] = f"You put the {obj} 1 in/on the {place} 1.", 1.0, True
        elif action.startswith("go to "):
            observation = f"You arrive at {action[6:]}. On it, you see nothing."
        else:
            observation = "You are carrying: nothing." if action == "inventory" else env["observation"]
        env["actions"] = self._actions(env)
        env["observation"] = observation
        return {"observation": observation, "reward": reward, "available_actions": env["actions"],
                "done": env["done"]}


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
