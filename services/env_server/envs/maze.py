"""LMRL-Gym's double-T maze as AgentGym serves it.

A 10x13 grid, the goal at (8, 6) at the foot of the stem, the agent starting from any other open
cell (25 starts), moves "move up/down/left/right", 15 turns, reward 1 on reaching the goal.
Observations give the goal, the current position and the adjacent walls in LMRL-Gym's sentences;
multi-digit coordinates are written digit by digit ("1 0"), as LMRL-Gym writes them.
"""

from __future__ import annotations

import collections
import random

from .base import Environment, Episode, NumberedTasks, StepResult

WALL, OPEN = 1, 0

DOUBLE_T_MAZE = (
    (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1),
    (1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1),
    (1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1),
    (1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1),
    (1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1),
    (1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1),
    (1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1),
    (1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1),
    (1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1),
    (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1),
)
GOAL = (8, 6)
MOVES = {"move up": (-1, 0), "move down": (1, 0), "move left": (0, -1), "move right": (0, 1)}
# LMRL-Gym's order of wall relations in an observation.
WALL_RELATIONS = (("to your right", (0, 1)), ("to your left", (0, -1)), ("above you", (-1, 0)), ("below you", (1, 0)))
# All open cells but the goal, row by row.
STARTS = tuple(
    (r, c) for r, row in enumerate(DOUBLE_T_MAZE) for c, v in enumerate(row) if v == OPEN and (r, c) != GOAL
)

INSTRUCTION = (
    "Your objective is to reach the goal in as few steps as possible. At each step you will be given "
    "information about where the goal is, your current position, and the walls that surround you. "
    "When you move right you increase your y position by 1, when you move down you increase your x "
    "position by 1. Your possible actions are \"move up\", \"move down\", \"move left\", \"move right\"."
)

NUM_TRAIN, NUM_TEST = 215, 25


def _coord(v: int) -> str:
    return " ".join(str(v))


def _describe_objects(obj: str, relations: list[str]) -> str:
    if not relations:
        return f"There are no {obj}s near you."
    if len(relations) == 1:
        return f"There is a {obj} {relations[0]}."
    return f"There are {obj}s {', '.join(relations)}."


def describe(position: tuple[int, int], goal: tuple[int, int] = GOAL) -> str:
    r, c = position
    walls = [name for name, (dr, dc) in WALL_RELATIONS if DOUBLE_T_MAZE[r + dr][c + dc] == WALL]
    return (
        f"The goal is at position {_coord(goal[0])}, {_coord(goal[1])}. "
        f"Your current position is at position {_coord(r)}, {_coord(c)}. "
        f"{_describe_objects('wall', walls)}"
    )


def shortest_path_actions(start: tuple[int, int], goal: tuple[int, int] = GOAL) -> list[str]:
    """BFS over open cells; the expert's action sequence from start to goal."""
    prev: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            break
        for action, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if DOUBLE_T_MAZE[nxt[0]][nxt[1]] == OPEN and nxt not in prev:
                prev[nxt] = (cell, action)
                queue.append(nxt)
    actions: list[str] = []
    cell = goal
    while prev[cell] is not None:
        cell, action = prev[cell]
        actions.append(action)
    return actions[::-1]


class MazeEpisode(Episode):
    def __init__(self, start: tuple[int, int]):
        self.position = start
        self.instruction = INSTRUCTION
        self.observation = describe(start)

    def available_actions(self) -> list[str]:
        return list(MOVES)

    def step(self, action: str) -> StepResult:
        move = MOVES.get(action.strip().lower())
        if move is None:
            self.observation = f"Invalid action: {action!r}. Valid actions are: {', '.join(MOVES)}. " + describe(self.position)
            return StepResult(self.observation, 0.0, False, False, valid=False)
        nxt = (self.position[0] + move[0], self.position[1] + move[1])
        if DOUBLE_T_MAZE[nxt[0]][nxt[1]] == OPEN:
            self.position = nxt
        if self.position == GOAL:
            self.observation = "Success"
            return StepResult(self.observation, 1.0, True, True)
        self.observation = describe(self.position)
        return StepResult(self.observation, 0.0, False, False)

    def expert_action(self) -> str:
        return shortest_path_actions(self.position)[0]


class MazeEnv(Environment):
    """Tasks 0..24 are the test split (each start once); 25..239 the training split."""

    name = "maze"
    max_turns = 15
    has_expert = lists_actions = True

    def __init__(self, seed: int = 0):
        rng = random.Random(seed)
        train = [STARTS[rng.randrange(len(STARTS))] for _ in range(NUM_TRAIN)]
        self._starts = NumberedTasks(self.name, STARTS[:NUM_TEST], train)

    def tasks(self, split: str) -> list[int]:
        return self._starts.ids(split)

    def reset(self, task_id: int) -> MazeEpisode:
        return MazeEpisode(self._starts[task_id])
