"""Countdown: start at a number, reach the target with "add 1", "add 2" and "double".

A complete fedse environment in a few dozen lines: task splits, episodes, admissible actions and an
expert (the shortest way there), all optional parts included.
"""

from __future__ import annotations

import random
from collections import deque

from fedse.env import Environment, Episode, NumberedTasks, StepResult

MOVES = {"add 1": lambda n: n + 1, "add 2": lambda n: n + 2, "double": lambda n: 2 * n}


def shortest(start: int, target: int) -> list[str]:
    """The fewest moves from start to target (breadth-first; no move ever goes down)."""
    came: dict[int, tuple[int, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        n = queue.popleft()
        if n == target:
            break
        for move, apply in MOVES.items():
            m = apply(n)
            if m <= target and m not in came:
                came[m] = (n, move)
                queue.append(m)
    path, n = [], target
    while came[n] is not None:
        n, move = came[n]
        path.append(move)
    return path[::-1]


class CountdownEpisode(Episode):
    def __init__(self, start: int, target: int):
        self.number, self.target = start, target
        self.instruction = (f"You hold a number. Reach exactly {target}. Each turn choose one action: "
                            f"{', '.join(MOVES)}. Going past {target} loses.")
        self.observation = f"You hold {start}. The target is {target}."

    def available_actions(self) -> list[str]:
        return list(MOVES)

    def step(self, action: str) -> StepResult:
        move = MOVES.get(action.strip().lower())
        if move is None:
            return StepResult(f"{action!r} is not a valid action; choose one of {', '.join(MOVES)}.", 0.0,
                              False, False, valid=False)
        self.number = move(self.number)
        won, lost = self.number == self.target, self.number > self.target
        self.observation = f"You hold {self.number}. The target is {self.target}."
        return StepResult(self.observation + (" You reached it!" if won else " Too far." if lost else ""),
                          float(won), won or lost, won)

    def expert_action(self) -> str:
        return shortest(self.number, self.target)[0]


class Countdown(Environment):
    max_turns = 10
    has_expert = lists_actions = True

    def __init__(self, seed: int = 0, largest: int = 40):
        if largest < 10:
            raise ValueError(f"largest must be at least 10, got {largest}")
        pairs = [(s, t) for s in range(1, 6) for t in range(s + 3, largest + 1)]
        random.Random(seed).shuffle(pairs)
        test = len(pairs) // 5
        self.tasks_ = NumberedTasks("countdown", pairs[:test], pairs[test:])

    def tasks(self, split: str) -> list[int]:
        return self.tasks_.ids(split)

    def reset(self, task_id: int) -> Episode:
        return CountdownEpisode(*self.tasks_[task_id])
