"""The client agent's view of an env_server: EnvService calls as plain Python."""

from __future__ import annotations

import copy
import dataclasses

from fedse.security import Security, channel
from fedse.serving import insecure_channel
from fedse.v1 import env_pb2 as epb
from fedse.v1 import env_pb2_grpc as epb_grpc


@dataclasses.dataclass
class Observation:
    text: str
    actions: list[str]
    reward: float = 0.0
    done: bool = False
    success: bool = False


@dataclasses.dataclass
class Session:
    session_id: str
    task_id: int
    instruction: str
    max_turns: int


class EnvClient:
    def __init__(self, target: str, env: str, timeout_s: float = 60.0, security: Security | None = None):
        self.env = env
        self.timeout_s = timeout_s
        self.channel = channel(target, security) if security is not None else insecure_channel(target)
        self.stub = epb_grpc.EnvServiceStub(self.channel)

    def with_env(self, env: str) -> "EnvClient":
        """A client for another environment of the same env server, over this client's channel
        (closing either closes it)."""
        other = copy.copy(self)
        other.env = env
        return other

    def close_channel(self) -> None:
        self.channel.close()

    def tasks(self, split: str) -> tuple[list[int], int]:
        resp = self.stub.ListTasks(epb.ListTasksRequest(env=self.env, split=split), timeout=self.timeout_s,
                                   wait_for_ready=True)
        return list(resp.task_ids), resp.max_turns

    def reset(self, task_id: int) -> tuple[Session, Observation]:
        resp = self.stub.Reset(epb.ResetRequest(env=self.env, task_id=task_id), timeout=self.timeout_s)
        return (Session(resp.session_id, task_id, resp.instruction, resp.max_turns),
                Observation(resp.observation, list(resp.available_actions)))

    def step(self, session: Session, action: str) -> Observation:
        resp = self.stub.Step(epb.StepRequest(session_id=session.session_id, action=action), timeout=self.timeout_s)
        return Observation(resp.observation, list(resp.available_actions), resp.reward, resp.done, resp.success)

    def expert_action(self, session: Session) -> str:
        return self.stub.ExpertAction(epb.ExpertActionRequest(session_id=session.session_id),
                                      timeout=self.timeout_s).action

    def close(self, session: Session) -> None:
        self.stub.Close(epb.CloseRequest(session_id=session.session_id), timeout=self.timeout_s)
