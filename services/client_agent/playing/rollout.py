"""Episodes against an env_server, batched across concurrent sessions.

Every step, the policy gets the states of all live sessions at once (one batched model call),
then each session takes its action. Finished sessions are closed and replaced by the next task.

A session the env server lost (envclient.SessionLost: the server restarted mid-episode) ends the
call: its partial trajectory is dropped, never returned, and the other live sessions are closed
(best effort). The caller plays the episodes again from the start (playing.Player.episodes), since
the policy's draws for one episode depend on the others played beside it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence, Union

from services.client_agent.training.buffer import Trajectory
from services.client_agent.playing.envclient import EnvClient, Observation, Session, SessionLost


@dataclasses.dataclass
class Live:
    session: Session
    observation: Observation
    turns: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # The text the agent wrote at each turn ("" where it only picked an action).
    texts: list[str] = dataclasses.field(default_factory=list)


class WrittenAction(Protocol):
    """An action the agent wrote itself (actions.Written): the action sent and the whole text."""

    action: str
    text: str


# A policy maps the live sessions to one action each: the action string, or a WrittenAction where
# the agent wrote a text the action was parsed from (the trajectory keeps the text).
Policy = Callable[[Sequence[Live]], Sequence[Union[str, WrittenAction]]]


def run_episodes(env: EnvClient, task_ids: Sequence[int], policy: Policy, concurrency: int, round_: int,
                 source: str, on_episode: Callable[[Trajectory], None] | None = None,
                 on_turns: Callable[[int, int], None] | None = None) -> list[Trajectory]:
    """Plays the tasks, `concurrency` at a time; each finished episode goes to on_episode, and after
    every step of the live sessions on_turns gets the turns played so far and the most that can be
    left (the live episodes' turns left to their limit, and whole episodes for the tasks not yet
    started)."""
    pending = list(task_ids)[::-1]
    live: list[Live] = []
    done: list[Trajectory] = []
    played = 0

    def refill() -> None:
        while pending and len(live) < concurrency:
            session, obs = env.reset(pending.pop())
            live.append(Live(session, obs))

    def step(state: Live, move: str | WrittenAction) -> bool:
        """Takes the action; True once the episode is over (its trajectory kept, its session closed)."""
        action, text = (move, "") if isinstance(move, str) else (move.action, move.text)
        shown = state.observation.text
        obs = env.step(state.session, action)
        if obs.turn and obs.turn != len(state.turns) + 1:
            raise SessionLost(f"task {state.session.task_id}: the env server counts {obs.turn} turns where "
                              f"{len(state.turns) + 1} were played (an action retried after a broken call was "
                              "applied twice)")
        state.observation = obs
        state.turns.append((shown, action))
        state.texts.append(text)
        if not obs.done:
            return False
        env.close(state.session)
        traj = Trajectory(
            env=env.env, task_id=state.session.task_id, instruction=state.session.instruction,
            turns=tuple(state.turns), success=obs.success, reward=obs.reward, source=source, round=round_,
            texts=tuple(state.texts) if any(state.texts) else ())
        done.append(traj)
        if on_episode:
            on_episode(traj)
        return True

    try:
        refill()
        while live:
            actions = policy(live)
            played += len(live)
            limit = live[0].session.max_turns
            live[:] = [state for state, action in zip(live, actions) if not step(state, action)]
            refill()
            if on_turns and limit > 0:
                on_turns(played, sum(max(limit - len(s.turns), 0) for s in live) + len(pending) * limit)
    except SessionLost:
        for state in live:
            env.abandon(state.session)
        raise
    return done


def expert_policy(env: EnvClient) -> Policy:
    return lambda states: [env.expert_action(s.session) for s in states]
