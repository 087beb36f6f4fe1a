"""BabyAI's expert (see babyai.py): a planner over the high-level actions with the whole map in view.

It follows the mission's pending clause (minigrid's verifier state), computes the shortest low-level
distance to it over the full grid, and takes the admissible action that finishes the clause or,
failing that, lands nearest to it (so "go to" a seen object serves as a long stride). A locked door
on the way makes the matching key the subgoal, an object in the way makes moving it the subgoal, and
an object in hand that must be put down goes away from doors.
"""

from __future__ import annotations

import heapq
from typing import Iterable

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

from .babyai_view import CHECK, DIR_VEC, PICKABLE, View, add


def pending_clause(instr) -> ActionInstr:
    """The action clause of a mission that the level's verifier still waits for."""
    if isinstance(instr, ActionInstr):
        return instr
    if isinstance(instr, BeforeInstr):
        return pending_clause(instr.instr_a if instr.a_done != "success" else instr.instr_b)
    if isinstance(instr, AfterInstr):
        return pending_clause(instr.instr_b if instr.b_done != "success" else instr.instr_a)
    if isinstance(instr, AndInstr):
        return pending_clause(instr.instr_a if instr.a_done != "success" else instr.instr_b)
    raise TypeError(f"unknown BabyAI instruction {type(instr).__name__}")


class Unreachable(Exception):
    pass


class Planner:
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
            fwd = add(pos, DIR_VEC[d])
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


class Expert:
    MAX_DEPTH = 4

    def __init__(self, env, view: View):
        self.env = env
        self.view = view
        clause = pending_clause(env.instrs)
        strict = getattr(clause, "strict", False) or getattr(env.instrs, "strict", False)
        self.strict_doors = None
        if strict:
            self.strict_doors = frozenset(
                tuple(p) for c in self._clauses(env.instrs) if isinstance(c, OpenInstr) for p in c.desc.obj_poss)
        self.planner = Planner(env, self.strict_doors)
        self.clause = clause
        # Cells the plan for the clause passes; nothing is put down there.
        self.keep_clear: set[tuple[int, int]] = set()

    @staticmethod
    def _clauses(instr) -> list[ActionInstr]:
        if isinstance(instr, ActionInstr):
            return [instr]
        return Expert._clauses(instr.instr_a) + Expert._clauses(instr.instr_b)

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
                c = add(p, v)
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
                around = [env.grid.get(*add((x, y), v)) for v in DIR_VEC]
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
            raise Unreachable(kind)
        planner, view = self.planner, self.view
        if kind == "open":
            # Head for a door that can be opened now, if the clause names one.
            openable = [t for t in targets if not self.env.grid.get(*t).is_locked or self._opens(self.env.grid.get(*t))]
            targets = openable or targets
        if kind == "drop":
            here = planner.pos
            for turns, name in ((0, "drop"), (1, "turn left"), (1, "turn right"), (2, "turn left")):
                d = (planner.dir + {"drop": 0, "turn left": -1, "turn right": 1}[name] * turns) % 4
                if add(here, DIR_VEC[d]) in targets:
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
            raise Unreachable(kind)
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
        front = add(here[0], DIR_VEC[here[1]])
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
            raise Unreachable("no admissible action gets closer")
        return best

