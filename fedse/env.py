"""The environment API: what an environment written for fedse implements.

An environment is pure Python and knows nothing of gRPC. The env server hosts it: its session layer
adds ids, the turn limit, idle expiry and a cap on open sessions, and its servicer answers the
EnvService protocol (proto/fedse/v1/env.proto). A third-party package implements `Environment` and
`Episode` from this module and declares a factory in the entry-point group `fedse.environments`
(docs/environments.md walks through it):

    class Countdown(Environment):
        max_turns = 10
        has_expert = True              # its episodes answer expert_action()
        lists_actions = True           # its episodes answer available_actions()
        def __init__(self, seed: int = 0, start: int = 5): ...
        def tasks(self, split): ...    # "train" or "test": ids, unique across splits
        def reset(self, task_id): ...  # a fresh Episode; UnknownTask for an id in no split

A factory is any callable that returns an Environment; the env server calls it with `seed` (where
it takes one) and the environment's options from its spec (`name?start=7`), each converted to the
type its parameter is annotated with (int, float, bool or str).

Two capabilities are optional, and an environment says which it has:
- `has_expert`: its episodes' `expert_action()` gives the expert's next action (seed
  demonstrations). Without it, ExpertAction answers UNIMPLEMENTED, and a client seeds its buffer
  from demonstration files, or from nothing but exploration.
- `lists_actions`: its episodes' `available_actions()` lists the admissible actions of each step.
  Without it the lists are empty and the agent writes its action itself.
An environment that stands for an outside service raises `EnvironmentUnavailable` when the
service cannot be reached (the client retries: UNAVAILABLE), `EnvironmentFailed` when the
service refuses a call (FAILED_PRECONDITION, with the service's own words) and `EpisodeLost` from a
step when the service no longer holds the episode (NOT_FOUND: the client plays it again).
"""

from __future__ import annotations

import abc
import dataclasses
import random
from typing import Generic, Iterator, Sequence, TypeVar

from fedse.transport.inputs import shown

SPLITS = ("train", "test")


class UnknownTask(KeyError):
    """A task id that is not in any split of the environment."""


class NoExpert(NotImplementedError):
    """The environment has no expert (has_expert is False)."""


class EnvironmentUnavailable(RuntimeError):
    """The service behind an environment cannot be reached now; the call may succeed later."""


class EnvironmentFailed(RuntimeError):
    """The service behind an environment refused a call; the message quotes what it said."""


class EpisodeLost(RuntimeError):
    """The service behind an episode no longer holds it (it restarted): the episode cannot go on, and
    its session ends (NOT_FOUND: the client plays the episode again)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    success: bool
    # False when the action was not admissible; the turn is still used (AgentGym semantics).
    valid: bool = True


class Episode(abc.ABC):
    """One attempt at one task. Turn limits are enforced by the session layer, not here."""

    instruction: str
    observation: str

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Applies one action. Never raises on a bad action: answers with an observation."""

    def available_actions(self) -> list[str]:
        """The admissible actions in the current state; empty where the environment lists none
        (lists_actions False)."""
        return []

    def expert_action(self) -> str:
        """The expert's action in the current state (has_expert True)."""
        raise NoExpert(f"{type(self).__name__} has no expert")

    def close(self) -> None:
        """Frees what the episode holds (a remote session); called once when its session ends."""


class Environment(abc.ABC):
    # The name it is served under: the env server sets it to the name in its spec.
    name: str = ""
    max_turns: int
    # Optional capabilities (see the module docstring).
    has_expert: bool = False
    lists_actions: bool = False

    @abc.abstractmethod
    def tasks(self, split: str) -> list[int]:
        """Task ids of a split ("train" or "test"); ids are unique across splits."""

    @abc.abstractmethod
    def reset(self, task_id: int) -> Episode:
        """A fresh episode of a task; raises UnknownTask for an id in no split."""


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
