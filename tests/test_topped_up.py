"""A client agent that sat a round out takes part in it when the aggregator tops the round up with it
(a chosen client died) while the round is still open: before, it waited for the next round, so the
topped-up place stayed empty until the round's deadline."""

from __future__ import annotations

import types

from fedse.v1 import federation_pb2 as fpb
from services.client_agent.agent import ClientAgent


class Statuses:
    """A federation client whose status moves through `script`, one step per wait."""

    def __init__(self, script: list[fpb.RoundStatus]):
        self.script = list(script)

    def wait_until(self, done, timeout_s=None):
        while self.script:
            st = self.script.pop(0)
            if done(st):
                return st
        raise AssertionError("the agent waited past the end of the script")


def status(round_: int, state: int, *chosen: str) -> fpb.RoundStatus:
    return fpb.RoundStatus(round=round_, state=state, selective=True, selected=list(chosen), num_rounds=2)


def agent(script: list[fpb.RoundStatus]):
    played: list[int] = []
    heartbeat = types.SimpleNamespace(phase=(0, "waiting"))
    heartbeat.set = lambda phase, round_=None: setattr(heartbeat, "phase", (round_, getattr(phase, "value", phase)))
    fake = types.SimpleNamespace(
        cfg=types.SimpleNamespace(client_id="org-c", round_timeout_s=5.0),
        run_config=types.SimpleNamespace(num_rounds=2),
        take_release=lambda round_: True, heartbeat=heartbeat, fed=Statuses(script),
        play_round=lambda round_, done, final, tasks: played.append(round_))
    return fake, played


def test_a_client_topped_up_into_the_open_round_plays_it():
    OPEN, FINISHED = fpb.ROUND_STATE_OPEN, fpb.ROUND_STATE_FINISHED
    fake, played = agent([status(0, OPEN, "org-a", "org-b"),  # org-b dies ...
                          status(0, OPEN, "org-a", "org-c"),  # ... and org-c is put in its place
                          status(1, OPEN, "org-a", "org-b"), status(2, FINISHED)])
    ClientAgent.run_rounds(fake, 0, "", status(0, OPEN, "org-a", "org-b"), [])
    assert played == [0, 2], "round 0 played once topped up; round 1 sat out; the final evaluation"


def test_a_client_that_played_a_round_does_not_play_it_again():
    OPEN, FINISHED = fpb.ROUND_STATE_OPEN, fpb.ROUND_STATE_FINISHED
    fake, played = agent([status(0, OPEN, "org-c"), status(1, OPEN, "org-c"), status(2, FINISHED)])
    ClientAgent.run_rounds(fake, 0, "", status(0, OPEN, "org-c"), [])
    assert played == [0, 1, 2]
