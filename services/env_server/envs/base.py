"""What every environment provides: task splits, episodes, an expert.

Environments are pure Python and know nothing of gRPC; the session layer adds ids, the turn
limit, idle expiry and the session cap, and the servicer maps it to the EnvService protocol.
"""

from __future__ import annotations

import abc
import dataclasses
import random
from typing import Callable, Generic, Iterator, Sequence, TypeVar

from fedse.inputs import shown


class UnknownTask(KeyError):
    """A task id that is not in any split of the environment."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    success: bool
    # False when the action was not admissible; the turn is still used (AgentGym semantics).
    valid: bool = True


class Episode(abc.ABC):
    """One attempt at one task. `turn` limits are enforced by the session layer, not here."""

    instruction: str
    observation: str

    @abc.abstractmethod
    def available_actions(self) -> list[str]:
        """The admissible actions in the current state."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Applies one action. Never raises on a bad action: answers with an observation."""

    @abc.abstractmethod
    def expert_action(self) -> str:
        """The expert's action in the current state."""


class Environment(abc.ABC):
    name: str
    max_turns: int

    @abc.abstractmethod
    def tasks(self, split: str) -> list[int]:
        """Task ids of a split ("train" or "test"); ids are unique across splits."""

    @abc.abstractmethod
    def reset(self, task_id: int) -> Episode:
        """A fresh episode of a task; raises UnknownTask for an id in no split."""


SPLITS = ("train", "test")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {shown(split)}: use one of {', '.join(SPLITS)}")


T = TypeVar("T")


class NumberedTasks(Generic[T]):
    """Task ids numbered from 0: first the test split, then the training split, each id standing for
    one value (a maze start, a hidden word, a crafting goal, a shopping goal)."""

    def __init__(self, env: str, test: Sequence[T], train: Sequence[T]):
        self.env = env
        self.num_test = len(test)
        self._values: list[T] = [*test, *train]

    def ids(self, split: str) -> list[int]:
        check_split(split)
        return list(range(self.num_test)) if split == "test" else list(range(self.num_test, len(self._values)))

    def __getitem__(self, task_id: int) -> T:
        if not (isinstance(task_id, int) and 0 <= task_id < len(self._values)):
            raise UnknownTask(f"{self.env} has no task {task_id}: ids are 0..{len(self._values) - 1}")
        return self._values[task_id]


def shuffled_cycle(values: Sequence[T], rng: random.Random) -> Iterator[T]:
    """The values over and over, each pass in a new seeded order: a training split that draws every
    value about equally often. Lazy, so draws that interleave with other uses of `rng` stay put."""
    while True:
        order = list(values)
        rng.shuffle(order)
        while order:
            yield order.pop()


# ---- playing in one process (tests and benches; the client plays over gRPC: client_agent.rollout)

@dataclasses.dataclass
class Played:
    """One episode played by `play_side_by_side`."""

    task_id: int
    steps: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (prompt, action) each turn
    agreed: list[bool] = dataclasses.field(default_factory=list)  # each turn: the action was the expert's
    success: bool = False

    @property
    def agree(self) -> int:
        return sum(self.agreed)


# choose(prompts, candidate lists) -> the index of each episode's action in its candidates.
Chooser = Callable[[list[str], list[list[str]]], Sequence[int]]
# prompt(instruction, turns so far as (observation, action), current observation) -> what the chooser reads.
Prompter = Callable[[str, Sequence[tuple[str, str]], str], str]


def play_side_by_side(env: Environment, task_ids: Sequence[int], choose: Chooser | None, prompt: Prompter,
                      max_turns: int | None = None) -> list[Played]:
    """Plays the tasks in lock step, up to max_turns (default: the environment's): each turn one
    `choose` call for every episode still running (None: the expert acts). One Played per task."""
    episodes = [env.reset(t) for t in task_ids]
    played = [Played(t) for t in task_ids]
    turns: list[list[tuple[str, str]]] = [[] for _ in task_ids]
    done = [False] * len(episodes)
    for _ in range(max_turns or env.max_turns):
        live = [i for i in range(len(episodes)) if not done[i]]
        if not live:
            break
        prompts = [prompt(episodes[i].instruction, turns[i], episodes[i].observation) for i in live]
        cands = [episodes[i].available_actions() for i in live]
        actions = ([episodes[i].expert_action() for i in live] if choose is None
                   else [c[k] for c, k in zip(cands, choose(prompts, cands))])
        for i, text, action in zip(live, prompts, actions):
            played[i].agreed.append(choose is None or action == episodes[i].expert_action())
            turns[i].append((episodes[i].observation, action))
            played[i].steps.append((text, action))
            result = episodes[i].step(action)
            if result.done:
                done[i], played[i].success = True, bool(result.success)
    return played
