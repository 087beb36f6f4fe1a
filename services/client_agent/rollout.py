"""Episodes against an env_server, batched across concurrent sessions.

Every step, the policy gets the states of all live sessions at once (one batched model call),
then each session takes its action. Finished sessions are closed and replaced by the next task.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from .buffer import Trajectory
from .envclient import EnvClient, Observation, Session


@dataclasses.dataclass
class Live:
    session: Session
    observation: Observation
    turns: list[tuple[str, str]] = dataclasses.field(default_factory=list)


# A policy maps the live sessions to one admissible action string each.
Policy = Callable[[Sequence[Live]], list[str]]


def run_episodes(env: EnvClient, task_ids: Sequence[int], policy: Policy, concurrency: int, round_: int,
                 source: str, on_episode: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    pending = list(task_ids)[::-1]
    live: list[Live] = []
    done: list[Trajectory] = []

    def refill() -> None:
        while pending and len(live) < concurrency:
            session, obs = env.reset(pending.pop())
            live.append(Live(session, obs))

    refill()
    while live:
        actions = policy(live)
        still: list[Live] = []
        for state, action in zip(live, actions):
            shown = state.observation.text
            state.observation = env.step(state.session, action)
            state.turns.append((shown, action))
            if state.observation.done:
                env.close(state.session)
                traj = Trajectory(
                    env=env.env, task_id=state.session.task_id, instruction=state.session.instruction,
                    turns=tuple(state.turns), success=state.observation.success,
                    reward=state.observation.reward, source=source, round=round_)
                done.append(traj)
                if on_episode:
                    on_episode(traj)
            else:
                still.append(state)
        live[:] = still
        refill()
    return done


def expert_policy(env: EnvClient) -> Policy:
    return lambda states: [env.expert_action(s.session) for s in states]
