"""What every environment provides: task splits, episodes, an expert.

Environments are pure Python and know nothing of gRPC; the session layer adds ids, the turn
limit, idle expiry and the session cap, and the servicer maps it to the EnvService protocol.
"""

from __future__ import annotations

import abc
import dataclasses

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
