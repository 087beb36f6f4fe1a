"""A lock-step player for tests and benches: plays an environment's tasks in one process, one chooser
call a turn for every live episode (the client plays over gRPC: client_agent.rollout)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from fedse.env import Environment


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
