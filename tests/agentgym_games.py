"""Small AgentGym-like env servers of the embodied and text-game kinds (textcraft, babyai, sciworld,
alfworld), each following its AgentGym server's API and quirks and playing a tiny deterministic game;
see agentgym_servers.py, which gathers every server.
"""

from __future__ import annotations

import re
from typing import Any

from agentgym_http import AgentGymServer, Route


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
