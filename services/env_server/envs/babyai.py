"""BabyAI as AgentGym serves it (agentenv-babyai), on minigrid's own BabyAI levels.

Tasks. A task id is AgentGym's `data_idx`: level number `id % 40 + 1` of AgentGym's 40 levels,
minigrid seed `id // 40` (plus `seed` * SEED_STRIDE for a non-zero env seed). Only the levels in
`levels` are served (by default DEFAULT_LEVELS, those whose every task our expert finishes in
20 turns); the first 90 of their ids are the test split, the next 810 the training split.

Text. The reset observation is "Your goal: <mission>" and the description of what the agent sees
in its 7x7 egocentric view, in AgentGym's sentences: every door, key, ball and box seen, nearest
first and numbered per name ("There is a red ball 1 3 steps in front of you and 1 steps to your
right."), the nearest wall or box straight ahead ("You are facing a wall 4 steps away."), and what
the agent carries. With `actions_in_observation` (the default, as AgentGym does) every
observation ends with the admissible actions ("Available actions: [...]").

Actions, as AgentGym names and expands them into minigrid moves: "turn left", "turn right",
"move forward" (unless a wall or box is right ahead), "pickup <obj> <n>" (a shortest path to face a
seen key, ball or box, then pick it up; "pick up <obj> <n>" is accepted too), "drop", "go to <obj>
<n>" (a shortest path to face a seen object or door), "go through <open door> <n>" (onto the
door), "toggle and go through <closed or locked door> <n>" (face it, toggle, step forward; a
locked door needs the key of its colour in hand), "toggle" (a closed or locked door right ahead)
and "check available actions". Paths run over cells the agent can see and avoid objects. The moves
of an action stop early when one of them has no effect or the level's mission ends.

Reward and success. Success is the level's own verdict: minigrid's verifier says the mission is
accomplished (reward 1, done). A mission that can no longer be accomplished (a strict level's wrong
door) ends the episode with reward 0. Minigrid's own step limit does not apply: the session's
20 turns do.

Differences from AgentGym, all deliberate: the goal is minigrid's mission verbatim (AgentGym
rewrites "then" and "after you" to "and", which loses the order the level checks); objects are
numbered the same way in the description and in the action names (AgentGym's action numbers skip
unreachable objects); paths avoid cells the agent cannot see and pass closed doors only as the
destination; an action with no moves ("go to <obj> <n>" when already facing it) lets the level
check the mission (minigrid's no-op "done") instead of answering "No change in state."; an
invalid action is answered with AgentGym's error message followed by the current description;
"drop" is not offered onto a door (minigrid would not drop there); a move "has no effect" when the
agent's cell, direction, load and the cell ahead stay the same (AgentGym compares view images,
which a turn in a symmetric room leaves equal); reward is 1 on success (AgentGym passes on
minigrid's 1 - 0.9 * steps / max_steps). The instruction is AgentGym's prompt without its
"Thought:/Action:" format lines, with "drop" and "check available actions" added to its list.

Levels. DEFAULT_LEVELS are 27 of AgentGym's 40: the expert finishes every one of the 900 tasks
they give (seed 0) within 20 turns. Left out: KeyInBox (the key is inside a box, and no AgentGym
action opens a box); OpenDoorsOrderN4Debug (minigrid 3.2.0 fails every two-door mission of it: in
strict mode the toggle that completes the first clause is checked again against the second); and
levels whose missions can need more than 20 high-level turns from the expert (GoToImpUnlock,
UnblockPickup, Unlock, UnlockLocalDist, KeyCorridorS6R3, MoveTwoAcrossS8N9, SynthS5R2, SynthSeq,
MiniBossLevel, BossLevel, BossLevelNoUnlock). Any of the 40 can be served through `levels`.

Expert. A planner over the high-level actions with the whole map in view: it follows the
mission's pending clause (minigrid's verifier state), computes the shortest low-level distance to
it over the full grid, and takes the admissible action that finishes the clause or, failing that,
lands nearest to it (so "go to" a seen object serves as a long stride). A locked door on the way
makes the matching key the subgoal, an object in the way makes moving it the subgoal, and
an object in hand that must be put down goes away from doors.
"""

from __future__ import annotations

import collections
import heapq
import logging
from typing import Iterable, Sequence

import gymnasium
import minigrid  # noqa: F401  (registers the BabyAI levels with gymnasium)
from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT, STATE_TO_IDX
from minigrid.envs.babyai.core import roomgrid_level
from minigrid.envs.babyai.core.verifier import (
    ActionInstr,
    AfterInstr,
    AndInstr,
    BeforeInstr,
    GoToInstr,
    OpenInstr,
    PickupInstr,
    PutNextInstr,
)

from .base import Environment, Episode, StepResult, UnknownTask, check_split

log = logging.getLogger(__name__)

# minigrid prints rejected samplings while generating a level; send them to the log instead.
roomgrid_level.print = lambda *args, **kwargs: log.debug("minigrid: %s", " ".join(map(str, args)))

# AgentGym's level list, in its order: task id i is level AGENTGYM_LEVELS[i % 40].
AGENTGYM_LEVELS = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7",
    "GoToObjMazeS7", "GoToImpUnlock", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor",
    "GoToObjDoor", "Open", "OpenRedDoor", "OpenDoorLoc", "OpenRedBlueDoorsDebug",
    "OpenDoorsOrderN4Debug", "Pickup", "UnblockPickup", "PickupLoc", "PickupDistDebug",
    "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying", "Unlock", "UnlockLocalDist",
    "KeyInBox", "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor",
    "FindObjS7", "KeyCorridorS6R3", "OneRoomS20", "MoveTwoAcrossS8N9", "SynthS5R2",
    "SynthLoc", "SynthSeq", "MiniBossLevel", "BossLevel", "BossLevelNoUnlock",
)
# minigrid 3 retired BabyAI-GoToObjS6-v0 for v1 (same level, a generation bug fixed).
GYM_IDS = {name: f"BabyAI-{name}-v1" if name == "GoToObjS6" else f"BabyAI-{name}-v0" for name in AGENTGYM_LEVELS}

# The levels whose every task (test and train, seed 0) the expert finishes within 20 turns.
DEFAULT_LEVELS = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7",
    "GoToObjMazeS7", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor", "GoToObjDoor",
    "Open", "OpenRedDoor", "OpenDoorLoc", "OpenRedBlueDoorsDebug", "Pickup",
    "PickupLoc", "PickupDistDebug", "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying",
    "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor", "FindObjS7",
    "OneRoomS20", "SynthLoc",
)

NUM_TRAIN, NUM_TEST = 810, 90
MAX_TURNS = 20
# A non-zero env seed shifts every task's minigrid seed by seed * SEED_STRIDE.
SEED_STRIDE = 1_000_003
# Minigrid's own step limit would end long episodes early; the session's turn limit applies instead.
MINIGRID_MAX_STEPS = 1_000_000

IDX_TO_STATE = {i: state for state, i in STATE_TO_IDX.items()}
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)
DIR_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))
CHECK = "check available actions"
SUCCESS_TEXT = "The task is completed."
FAILURE_TEXT = "The task has failed: the mission can no longer be accomplished."
UNRECOGNIZED = "The action is not recognized. Please check valid actions."

# What blocks "move forward" and is reported as "You are facing a ... steps away" (AgentGym's).
BARRIERS = frozenset({"box", "wall"})
DESCRIBED = frozenset({"door", "key", "ball", "box", "goal", "lava", "wall"})
PICKABLE = frozenset({"key", "ball", "box"})

INSTRUCTION = (
    "You are an exploration master that wants to finish every goal you are given. Every round I will "
    "give you an observation, and you have to respond an action based on the observation to finish the "
    "given task. You are placed in a room and you need to accomplish the given goal with actions.\n\n"
    "You can use the following actions: \n\n"
    "- turn right \n\n"
    "- turn left \n\n"
    "- move forward \n\n"
    "- go to <obj> <id> \n\n"
    "- pickup <obj> <id> \n\n"
    "- go through <door> <id>: <door> must be an open door. \n\n"
    "- toggle and go through <door> <id>: <door> can be a closed door or a locked door. If you want to "
    "open a locked door, you need to carry a key that is of the same color as the locked door. \n\n"
    "- toggle: there is a closed or locked door right in front of you and you can toggle it.\n\n"
    "- drop: put down the object you carry in front of you.\n\n"
    "- check available actions\n\n"
    "Your goal: {goal}"
)


def _make_level(level: str):
    """A fresh, unwrapped minigrid level (gymnasium's checking wrappers cost time per step)."""
    return gymnasium.make(GYM_IDS[level], max_steps=MINIGRID_MAX_STEPS).unwrapped


def _add(a: tuple[int, int], b: tuple[int, int], k: int = 1) -> tuple[int, int]:
    return a[0] + k * b[0], a[1] + k * b[1]


def _seen_objects(env) -> tuple[list[dict], dict[tuple[int, int], str]]:
    """What the agent sees: described objects nearest first, and the type of every seen cell.

    Cells are visited as AgentGym visits the encoded view (far row first, left to right), and the
    sort by Manhattan distance is stable, so ties keep that order.
    """
    grid, vis_mask = env.gen_obs_grid()
    image = grid.encode(vis_mask)
    view = env.agent_view_size
    pos = (int(env.agent_pos[0]), int(env.agent_pos[1]))
    f = DIR_VEC[env.agent_dir]
    r = DIR_VEC[(env.agent_dir + 1) % 4]
    top_left = _add(_add(pos, f, view - 1), r, -(view // 2))
    objects: list[dict] = []
    cells: dict[tuple[int, int], str] = {}
    for vj in range(view):
        for vi in range(view):
            cell = _add(_add(top_left, f, -vj), r, vi)
            if not (0 <= cell[0] < env.width and 0 <= cell[1] < env.height):
                continue
            type_idx, color_idx, state_idx = (int(v) for v in image[vi, vj])
            obj_type = IDX_TO_OBJECT[type_idx]
            if obj_type == "unseen":
                continue
            cells[cell] = obj_type
            distance = abs(cell[0] - pos[0]) + abs(cell[1] - pos[1])
            if distance == 0 or obj_type not in DESCRIBED:
                continue
            color = IDX_TO_COLOR[color_idx]
            if obj_type == "door":
                state = IDX_TO_STATE[state_idx]
                name = f"{color} {state} door"
            else:
                state, name = "", f"{color} {obj_type}"
            rel = (cell[0] - pos[0], cell[1] - pos[1])
            objects.append({
                "name": name, "type": obj_type, "color": color, "state": state, "pos": cell,
                "dist": distance, "front": rel[0] * f[0] + rel[1] * f[1], "right": rel[0] * r[0] + rel[1] * r[1],
            })
    objects.sort(key=lambda o: o["dist"])
    counts: collections.Counter[str] = collections.Counter()
    for obj in objects:
        if obj["type"] != "wall":
            counts[obj["name"]] += 1
            obj["n"] = counts[obj["name"]]
    return objects, cells


def _paths_in_view(env, cells: dict[tuple[int, int], str]) -> dict[tuple[tuple[int, int], int], list[int]]:
    """Shortest low-level move lists from the agent's pose to every pose reachable over seen cells.

    Breadth first over (cell, direction), moves tried in AgentGym's order (forward, left, right).
    A cell can be entered when it is seen and empty or an open door.
    """
    start = ((int(env.agent_pos[0]), int(env.agent_pos[1])), int(env.agent_dir))
    parent: dict[tuple[tuple[int, int], int], tuple[tuple[tuple[int, int], int], int] | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        pose = queue.popleft()
        pos, d = pose
        for move in (FORWARD, LEFT, RIGHT):
            if move == FORWARD:
                nxt = _add(pos, DIR_VEC[d])
                kind = cells.get(nxt)
                if kind not in ("empty", "floor", "goal") and not (kind == "door" and _is_open(env, nxt)):
                    continue
                new = (nxt, d)
            else:
                new = (pos, (d - 1) % 4 if move == LEFT else (d + 1) % 4)
            if new not in parent:
                parent[new] = (pose, move)
                queue.append(new)
    paths: dict[tuple[tuple[int, int], int], list[int]] = {}
    for pose in parent:
        moves, cur = [], pose
        while parent[cur] is not None:
            cur, move = parent[cur]
            moves.append(move)
        paths[pose] = moves[::-1]
    return paths


def _is_open(env, pos: tuple[int, int]) -> bool:
    cell = env.grid.get(*pos)
    return cell is not None and cell.type == "door" and cell.is_open


def _path_to_face(paths, target: tuple[int, int]) -> tuple[list[int], tuple[tuple[int, int], int]] | None:
    """The shortest path (and the pose it ends in) that leaves the agent facing target."""
    best = None
    for d, vec in enumerate(DIR_VEC):
        pose = ((target[0] - vec[0], target[1] - vec[1]), d)
        if pose in paths and (best is None or len(paths[pose]) < len(best[0])):
            best = (paths[pose], pose)
    return best


def _path_onto(paths, target: tuple[int, int]) -> tuple[list[int], tuple[tuple[int, int], int]] | None:
    """The shortest path that ends standing on target (an open door)."""
    best = None
    for d in range(4):
        pose = (target, d)
        if pose in paths and (best is None or len(paths[pose]) < len(best[0])):
            best = (paths[pose], pose)
    return best


class _View:
    """One state's text and high-level action table, as AgentGym's postprocess_obs builds them."""

    def __init__(self, env):
        objects, cells = _seen_objects(env)
        pos = (int(env.agent_pos[0]), int(env.agent_pos[1]))
        carrying = env.carrying
        paths = _paths_in_view(env, cells)
        # action name -> (low-level moves, the pose they end in, the object they act on)
        self.actions: dict[str, tuple[list[int], tuple[tuple[int, int], int], dict | None]] = {}
        self.errors: dict[str, str] = {}
        here = (pos, int(env.agent_dir))

        sentences = []
        seen = [o for o in objects if o["type"] != "wall"]
        if objects:
            sentences.append("In front of you in this room, you can see several objects:")
            for o in seen:
                if o["right"] == 0:
                    where = f"right in front of you {o['front']} steps away."
                elif o["right"] > 0:
                    where = f"{o['front']} steps in front of you and {o['right']} steps to your right."
                else:
                    where = f"{o['front']} steps in front of you and {-o['right']} steps to your left."
                sentences.append(f"There is a {o['name']} {o['n']} {where}")
        else:
            sentences.append("You cannot see any objects within sight.")
        sentences.append("The room has walls around you.")
        ahead = [o for o in objects if o["type"] in BARRIERS and o["right"] == 0 and o["front"] > 0]
        ahead.sort(key=lambda o: o["front"])
        if ahead:
            sentences.append(f"You are facing a {ahead[0]['type']} {ahead[0]['front']} steps away.")
        if carrying is not None:
            sentences.append(f"You are carrying a {carrying.color} {carrying.type}.")
        else:
            sentences.append("You are not carrying anything.")
        self.description = " ".join(sentences)

        left, right = (pos, (here[1] - 1) % 4), (pos, (here[1] + 1) % 4)
        self.actions["turn left"] = ([LEFT], left, None)
        self.actions["turn right"] = ([RIGHT], right, None)
        if not ahead or ahead[0]["front"] > 1:
            front = _add(pos, DIR_VEC[here[1]])
            cell = env.grid.get(*front)
            moved = cell is None or cell.can_overlap()
            self.actions["move forward"] = ([FORWARD], (front, here[1]) if moved else here, None)
        else:
            self.errors["move forward"] = "There is a barrier in front of you, you can't move forward."

        if carrying is None:
            for o in seen:
                if o["type"] not in PICKABLE:
                    continue
                name = f"pickup {o['name']} {o['n']}"
                found = _path_to_face(paths, o["pos"])
                if found is None:
                    self.errors[name] = f"You cannot pickup {o['name']} {o['n']}, as there is no path leading to it."
                else:
                    self.actions[name] = (found[0] + [PICKUP], found[1], o)

        if carrying is not None:
            front = _add(pos, DIR_VEC[here[1]])
            if front in cells and env.grid.get(*front) is None:
                self.actions["drop"] = ([DROP], here, None)
            else:
                self.errors["drop"] = "You cannot drop the object, as there is already an object in front of you."
        else:
            self.errors["drop"] = "You cannot drop the object, as you are not carrying anything."

        for o in seen:
            if o["type"] != "door":
                continue
            label = f"{o['name']} {o['n']}"
            through = f"go through {label}"
            if o["state"] == "open":
                found = _path_onto(paths, o["pos"])
                if found is None:
                    self.errors[through] = f"You cannot go through {label}, as there is no path leading to it."
                else:
                    self.actions[through] = (found[0], found[1], o)
                continue
            self.errors[through] = f"You cannot go through {label}, as it is closed. You should toggle it first."
            name = f"toggle and go through {label}"
            if o["state"] == "locked":
                if carrying is None or carrying.type != "key":
                    self.errors[name] = f"You cannot toggle and go through {label}, as you are not carrying a key."
                    continue
                if carrying.color != o["color"]:
                    self.errors[name] = (f"You cannot toggle and go through {label}, as the color of the key you are "
                                         "carrying does not match the color of door.")
                    continue
            found = _path_to_face(paths, o["pos"])
            if found is None:
                self.errors[name] = f"You cannot toggle and go through {label}, as there is no path leading to it."
                continue
            self.actions[name] = (found[0] + [TOGGLE, FORWARD], (o["pos"], found[1][1]), o)
            if not found[0]:
                self.actions["toggle"] = ([TOGGLE], here, o)

        for o in seen:
            if o["type"] == "goal":
                continue
            name = f"go to {o['name']} {o['n']}"
            found = _path_to_face(paths, o["pos"])
            if found is None:
                self.errors[name] = f"You cannot go to {o['name']} {o['n']}, as there is no path leading to it."
            else:
                self.actions[name] = (found[0], found[1], o)
        self.actions[CHECK] = ([], here, None)

    def action_list(self) -> str:
        return "Available actions: [" + ", ".join(f'"{a}"' for a in self.actions) + "]"


def normalize_action(action: str) -> str:
    """Lower case, single spaces, and "pick up" read as AgentGym's "pickup"."""
    text = " ".join(action.strip().lower().split())
    if text.startswith("pick up "):
        text = "pickup " + text[len("pick up "):]
    return text


# ---------------------------------------------------------------- expert


def _pending_clause(instr) -> ActionInstr:
    """The action clause of a mission that the level's verifier still waits for."""
    if isinstance(instr, ActionInstr):
        return instr
    if isinstance(instr, BeforeInstr):
        return _pending_clause(instr.instr_a if instr.a_done != "success" else instr.instr_b)
    if isinstance(instr, AfterInstr):
        return _pending_clause(instr.instr_b if instr.b_done != "success" else instr.instr_a)
    if isinstance(instr, AndInstr):
        return _pending_clause(instr.instr_a if instr.a_done != "success" else instr.instr_b)
    raise TypeError(f"unknown BabyAI instruction {type(instr).__name__}")


class _Unreachable(Exception):
    pass


class _Planner:
    """Distances over the whole grid for one state; see the module docstring for the policy."""

    def __init__(self, env, strict_doors: frozenset[tuple[int, int]] | None):
        self.env = env
        self.pos = (int(env.agent_pos[0]), int(env.agent_pos[1]))
        self.dir = int(env.agent_dir)
        self.carrying = env.carrying
        # Doors that may not be toggled (a strict clause fails on any other door); None: all may.
        self.strict_doors = strict_doors

    # Extra cost of entering a cell only a relaxed plan may enter, so that plans go around when they can.
    DETOUR = 20

    def entry_cost(self, pos: tuple[int, int], relax: int) -> int | None:
        """Moves it costs to enter pos (1), plus DETOUR for a cell only the relaxed plan may enter.

        relax 0: nothing in the way may be moved; relax 1: locked doors count as passable;
        relax 2: keys, balls and boxes too. None where a path may not enter.
        """
        if pos == self.pos:
            return 1
        x, y = pos
        if not (0 <= x < self.env.width and 0 <= y < self.env.height):
            return None
        cell = self.env.grid.get(x, y)
        if cell is None or cell.type in ("goal", "floor"):
            return 1
        if cell.type == "door":
            if cell.is_open:
                return 1
            if self.strict_doors is not None and pos not in self.strict_doors:
                return None
            key = self.carrying
            if not cell.is_locked or (key is not None and key.type == "key" and key.color == cell.color):
                return 1
            return 1 + self.DETOUR if relax >= 1 else None
        if cell.type in PICKABLE and relax >= 2:
            return 1 + self.DETOUR
        return None

    def distances(self, goals: Iterable[tuple[tuple[int, int], int]], relax: int = 0) -> dict:
        """Cost (low-level moves, plus detours) from every pose to the nearest goal pose (reverse Dijkstra)."""
        dist: dict[tuple[tuple[int, int], int], int] = {}
        heap: list[tuple[int, int, tuple[tuple[int, int], int]]] = []
        order = 0
        for g in goals:
            if g not in dist and self.entry_cost(g[0], relax) is not None:
                dist[g] = 0
                heap.append((0, order, g))
                order += 1
        heapq.heapify(heap)
        while heap:
            cost, _, pose = heapq.heappop(heap)
            if cost > dist[pose]:
                continue
            pos, d = pose
            enter = self.entry_cost(pos, relax)
            back = (pos[0] - DIR_VEC[d][0], pos[1] - DIR_VEC[d][1])
            for prev, step in (((pos, (d + 1) % 4), 1), ((pos, (d - 1) % 4), 1), ((back, d), enter)):
                if self.entry_cost(prev[0], relax) is None:
                    continue
                new = cost + step
                if new < dist.get(prev, new + 1):
                    dist[prev] = new
                    order += 1
                    heapq.heappush(heap, (new, order, prev))
        return dist

    @staticmethod
    def facing(targets: Iterable[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
        return [((t[0] - v[0], t[1] - v[1]), d) for t in targets for d, v in enumerate(DIR_VEC)]

    def path_cells(self, dist: dict, relax: int, start=None) -> list[tuple[int, int]]:
        """Cells entered along a cheapest path from start (the agent's pose), in order."""
        pose, cells = start or (self.pos, self.dir), []
        while dist[pose] > 0:
            pos, d = pose
            fwd = _add(pos, DIR_VEC[d])
            options = (((fwd, d), self.entry_cost(fwd, relax)), ((pos, (d - 1) % 4), 1), ((pos, (d + 1) % 4), 1))
            for nxt, step in options:
                if step is not None and nxt in dist and dist[nxt] == dist[pose] - step:
                    break
            else:
                raise AssertionError("no step down the distance field")
            if nxt[0] != pos:
                cells.append(nxt[0])
            pose = nxt
        return cells


class _Expert:
    MAX_DEPTH = 4

    def __init__(self, env, view: _View):
        self.env = env
        self.view = view
        clause = _pending_clause(env.instrs)
        strict = getattr(clause, "strict", False) or getattr(env.instrs, "strict", False)
        self.strict_doors = None
        if strict:
            self.strict_doors = frozenset(
                tuple(p) for c in self._clauses(env.instrs) if isinstance(c, OpenInstr) for p in c.desc.obj_poss)
        self.planner = _Planner(env, self.strict_doors)
        self.clause = clause
        # Cells the plan for the clause passes; nothing is put down there.
        self.keep_clear: set[tuple[int, int]] = set()

    @staticmethod
    def _clauses(instr) -> list[ActionInstr]:
        if isinstance(instr, ActionInstr):
            return [instr]
        return _Expert._clauses(instr.instr_a) + _Expert._clauses(instr.instr_b)

    def action(self) -> str:
        clause, env = self.clause, self.env
        if isinstance(clause, GoToInstr):
            return self.reach("goto", [tuple(p) for p in clause.desc.obj_poss], 0)
        if isinstance(clause, OpenInstr):
            return self.reach("open", [tuple(p) for p in clause.desc.obj_poss], 0)
        if isinstance(clause, PickupInstr):
            if env.carrying is not None and any(env.carrying is o for o in clause.desc.obj_set):
                # Picked up before it counted (an earlier clause was pending): put it down, pick it up again.
                return self.reach("drop", self._drop_cells(), 0)
            return self.reach("pickup", self._positions(clause.desc.obj_set), 0)
        if isinstance(clause, PutNextInstr):
            if env.carrying is not None and any(env.carrying is o for o in clause.desc_move.obj_set):
                return self.reach("putnext", self._next_to_cells([tuple(p) for p in clause.desc_fixed.obj_poss]), 0)
            return self.reach("pickup", self._positions(clause.desc_move.obj_set), 0)
        raise TypeError(f"the expert cannot follow {type(clause).__name__}")

    @staticmethod
    def _positions(objs) -> list[tuple[int, int]]:
        return [tuple(int(v) for v in o.cur_pos) for o in objs if o.cur_pos is not None and o.cur_pos[0] >= 0]

    def _empty(self, pos: tuple[int, int]) -> bool:
        x, y = pos
        return 0 < x < self.env.width - 1 and 0 < y < self.env.height - 1 and self.env.grid.get(x, y) is None

    def _next_to_cells(self, fixed: list[tuple[int, int]]) -> list[tuple[int, int]]:
        cells = []
        for p in fixed:
            for v in DIR_VEC:
                c = _add(p, v)
                if self._empty(c) and c not in cells:
                    cells.append(c)
        return cells

    def _drop_cells(self) -> list[tuple[int, int]]:
        """Empty cells where an object in hand can be put down without blocking a way."""
        env, cells = self.env, []
        for x in range(1, env.width - 1):
            for y in range(1, env.height - 1):
                if not self._empty((x, y)):
                    continue
                around = [env.grid.get(*_add((x, y), v)) for v in DIR_VEC]
                if any(c is not None and c.type == "door" for c in around):
                    continue
                solid = [c is not None and c.type == "wall" for c in around]
                if (solid[0] and solid[2]) or (solid[1] and solid[3]):  # a corridor
                    continue
                if (x, y) in self.keep_clear:
                    continue
                cells.append((x, y))
        return cells

    def reach(self, kind: str, targets: list[tuple[int, int]], depth: int) -> str:
        """The next action towards facing one of targets and then doing kind there."""
        if depth > self.MAX_DEPTH or not targets:
            raise _Unreachable(kind)
        planner, view = self.planner, self.view
        if kind == "open":
            # Head for a door that can be opened now, if the clause names one.
            openable = [t for t in targets if not self.env.grid.get(*t).is_locked or self._opens(self.env.grid.get(*t))]
            targets = openable or targets
        if kind == "drop":
            here = planner.pos
            for turns, name in ((0, "drop"), (1, "turn left"), (1, "turn right"), (2, "turn left")):
                d = (planner.dir + {"drop": 0, "turn left": -1, "turn right": 1}[name] * turns) % 4
                if _add(here, DIR_VEC[d]) in targets:
                    if name != "drop" or name in view.actions:
                        return name
        finish = self._finishing(kind, set(targets))
        if finish is not None:
            return finish
        for relax in (0, 1, 2):
            dist = planner.distances(planner.facing(targets), relax)
            if (planner.pos, planner.dir) in dist:
                break
        else:
            raise _Unreachable(kind)
        path = planner.path_cells(dist, relax)
        if depth == 0:
            self.keep_clear = set(targets)
            for d in range(4):
                if (planner.pos, d) in dist:
                    self.keep_clear.update(planner.path_cells(dist, relax, (planner.pos, d)))
        for cell in path:
            obj = self.env.grid.get(*cell)
            if obj is None:
                continue
            if obj.type == "door" and obj.is_locked and not self._opens(obj):
                return self.reach("pickup", self._keys({obj.color}), depth + 1)
            if obj.type in PICKABLE:
                return self.reach("pickup", [cell], depth + 1)
        if kind == "open":
            doors = [self.env.grid.get(*t) for t in targets]
            if all(d.is_locked and not self._opens(d) for d in doors):
                return self.reach("pickup", self._keys({d.color for d in doors}), depth + 1)
        if kind == "pickup" and planner.carrying is not None:
            # Keep a key in hand while a door it unlocks is still on the way; then put it down.
            if any(self.env.grid.get(*c) is not None and self.env.grid.get(*c).type == "door"
                   and self.env.grid.get(*c).is_locked for c in path):
                return self._closest(dist)
            return self.reach("drop", self._drop_cells(), depth + 1)
        return self._closest(dist)

    def _opens(self, door) -> bool:
        key = self.planner.carrying
        return key is not None and key.type == "key" and key.color == door.color

    def _keys(self, colors: set[str]) -> list[tuple[int, int]]:
        return [tuple(int(v) for v in k.cur_pos) for k in self._all_objects() if k.type == "key" and k.color in colors]

    def _all_objects(self):
        grid = self.env.grid
        return [c for c in grid.grid if c is not None and c.type in PICKABLE and c.cur_pos is not None]

    def _finishing(self, kind: str, targets: set[tuple[int, int]]) -> str | None:
        """An admissible action that completes the subgoal right away, the fewest moves first."""
        view, here = self.view, (self.planner.pos, self.planner.dir)
        front = _add(here[0], DIR_VEC[here[1]])
        if kind in ("drop", "putnext"):
            return "drop" if front in targets and "drop" in view.actions else None
        if kind == "open" and front in targets and "toggle" in view.actions:
            return "toggle"
        prefix = {"goto": "go to ", "pickup": "pickup ", "open": "toggle and go through "}[kind]
        best = None
        for name, (moves, _, obj) in view.actions.items():
            if name.startswith(prefix) and obj is not None and obj["pos"] in targets:
                if best is None or len(moves) < len(view.actions[best][0]):
                    best = name
        return best

    def _closest(self, dist: dict) -> str:
        """The navigation action that lands nearest (in low-level moves) to the subgoal."""
        best, best_d = None, None
        for name, (_, pose, obj) in self.view.actions.items():
            if name == CHECK or name == "drop" or name.startswith("pickup "):
                continue
            if name.startswith("toggle") and obj is not None and self.strict_doors is not None \
                    and obj["pos"] not in self.strict_doors:
                continue
            d = dist.get(pose)
            if d is not None and (best_d is None or d < best_d):
                best, best_d = name, d
        if best is None:
            raise _Unreachable("no admissible action gets closer")
        return best


# ---------------------------------------------------------------- episodes


class BabyAIEpisode(Episode):
    def __init__(self, level: str, minigrid_seed: int, actions_in_observation: bool = True):
        self.level = level
        self.minigrid_seed = minigrid_seed
        self.env = _make_level(level)
        self.env.reset(seed=minigrid_seed)
        self.mission = self.env.mission
        self.instruction = INSTRUCTION.format(goal=self.mission)
        self._listing = actions_in_observation
        self._done = False
        self._success = False
        self._view = _View(self.env)
        self.observation = self._text(f"Your goal: {self.mission}\n{self._view.description}")

    def _text(self, body: str) -> str:
        if self._listing and not self._done:
            return f"{body}\n{self._view.action_list()}"
        return body

    def available_actions(self) -> list[str]:
        return [] if self._done else list(self._view.actions)

    def step(self, action: str) -> StepResult:
        if self._done:
            return StepResult(self.observation, 0.0, True, self._success, valid=False)
        name = normalize_action(action)
        entry = self._view.actions.get(name)
        if entry is None:
            error = self._view.errors.get(name, UNRECOGNIZED)
            self.observation = self._text(f"{error} {self._view.description}")
            return StepResult(self.observation, 0.0, False, False, valid=False)
        if name == CHECK:
            self.observation = self._text("You can take the following actions: " + ", ".join(self._view.actions))
            return StepResult(self.observation, 0.0, False, False)
        terminated, reward = self._execute(entry[0] or [DONE])
        self._view = _View(self.env)
        if terminated:
            self._done, self._success = True, reward > 0
            ending = SUCCESS_TEXT if self._success else FAILURE_TEXT
            self.observation = f"{self._view.description}\n{ending}"
            return StepResult(self.observation, 1.0 if self._success else 0.0, True, self._success)
        self.observation = self._text(self._view.description)
        return StepResult(self.observation, 0.0, False, False)

    def _execute(self, moves: Sequence[int]) -> tuple[bool, float]:
        """Runs moves until one has no effect or the mission ends."""
        env = self.env
        for move in moves:
            before = (tuple(env.agent_pos), env.agent_dir, env.carrying, self._front_state())
            _, reward, terminated, _, _ = env.step(move)
            if terminated:
                return True, float(reward)
            after = (tuple(env.agent_pos), env.agent_dir, env.carrying, self._front_state())
            if after == before and move != DONE:
                break
        return False, 0.0

    def _front_state(self):
        cell = self.env.grid.get(*self.env.front_pos)
        return None if cell is None else (cell.type, getattr(cell, "is_open", None), getattr(cell, "is_locked", None))

    def expert_action(self) -> str:
        if self._done:
            return CHECK
        try:
            return _Expert(self.env, self._view).action()
        except _Unreachable:
            log.debug("babyai expert found no plan for %s seed %d; turning", self.level, self.minigrid_seed)
            return "turn left"


class BabyAIEnv(Environment):
    """AgentGym's BabyAI tasks over `levels`: the first 90 ids of those levels are the test split."""

    name = "babyai"
    max_turns = MAX_TURNS
    has_expert = lists_actions = True

    def __init__(self, seed: int = 0, levels: Sequence[str] | None = None, actions_in_observation: bool = True):
        levels = tuple(DEFAULT_LEVELS if levels is None else levels)
        unknown = [lvl for lvl in levels if lvl not in GYM_IDS]
        if unknown or not levels:
            raise ValueError(f"unknown BabyAI levels {unknown}: choose from {', '.join(AGENTGYM_LEVELS)}")
        self.seed = seed
        self.levels = levels
        self.actions_in_observation = actions_in_observation
        wanted = {AGENTGYM_LEVELS.index(lvl) for lvl in levels}
        ids: list[int] = []
        i = 0
        while len(ids) < NUM_TEST + NUM_TRAIN:
            if i % len(AGENTGYM_LEVELS) in wanted:
                ids.append(i)
            i += 1
        self._test, self._train = ids[:NUM_TEST], ids[NUM_TEST:]
        self._ids = frozenset(ids)

    def tasks(self, split: str) -> list[int]:
        check_split(split)
        return list(self._test) if split == "test" else list(self._train)

    def task(self, task_id: int) -> tuple[str, int]:
        """(level, minigrid seed) of a task id."""
        if task_id not in self._ids:
            raise UnknownTask(f"babyai has no task {task_id}: list the task ids of a split with tasks()")
        seed, level = divmod(task_id, len(AGENTGYM_LEVELS))
        return AGENTGYM_LEVELS[level], seed + self.seed * SEED_STRIDE

    def reset(self, task_id: int) -> BabyAIEpisode:
        level, minigrid_seed = self.task(task_id)
        return BabyAIEpisode(level, minigrid_seed, self.actions_in_observation)
