"""The client agent's view of an env_server: EnvService calls as plain Python.

An env server may go away and come back (a restart, a rescheduled pod). Every call is retried with
exponential backoff and jitter while the server is UNAVAILABLE, for at most `retry_s` seconds in
all, each retry logged. A restarted server holds none of the sessions of the one before: a call on
such a session (NOT_FOUND), or one whose retry shows that the first attempt was applied after all,
raises SessionLost, and the episode cannot go on; the rollout drops it (see rollout.run_episodes).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Callable, TypeVar

import grpc

from fedse.transport import reach
from fedse.security.admission import Security, channel
from fedse.transport.serving import log_fields
from fedse.v1 import env_pb2 as epb
from fedse.v1 import env_pb2_grpc as epb_grpc

from services.client_agent.federation.link import backoff_delay

log = logging.getLogger("client_agent.envclient")

T = TypeVar("T")
DEFAULT_RETRY_S = 300.0


class SessionLost(RuntimeError):
    """The env server no longer holds a session of ours (it restarted, or the session expired), or a
    retried action turned out to have been applied already: the episode cannot continue as played."""


@dataclasses.dataclass
class Observation:
    text: str
    actions: list[str]
    reward: float = 0.0
    done: bool = False
    success: bool = False
    # Turns the server counts for the session, this one included (0: not given, as after Reset).
    turn: int = 0


@dataclasses.dataclass(frozen=True)
class EnvInfo:
    """One environment an env server hosts and its optional capabilities (ListEnvironments):
    whether ExpertAction answers for it, and whether its steps list the admissible actions."""

    name: str
    has_expert: bool = True
    lists_actions: bool = True
    max_turns: int = 0


@dataclasses.dataclass
class Session:
    session_id: str
    task_id: int
    instruction: str
    max_turns: int


class EnvClient:
    def __init__(self, target: str, env: str, timeout_s: float = 60.0, security: Security | None = None,
                 retry_s: float = DEFAULT_RETRY_S, backoff_s: float = 0.5, max_backoff_s: float = 10.0):
        self.target = target
        self.env = env
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.security = security if security is not None else Security()
        self.channel = channel(target, self.security)
        self.stub = epb_grpc.EnvServiceStub(self.channel)

    def ready(self) -> None:
        """Waits for the env server (at most retry_s); reach.Unreachable with the reason where the
        connection cannot be made."""
        reach.wait_ready(self.channel, self.target, self.security, "--env-server", self.retry_s)

    def with_env(self, env: str) -> "EnvClient":
        """A client for another environment of the same env server, over this client's channel
        (closing either closes it)."""
        other = copy.copy(self)
        other.env = env
        return other

    def close_channel(self) -> None:
        self.channel.close()

    def _call(self, what: str, call: Callable[[], T], session: Session | None = None,
              retry_on: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})) -> T:
        """call(), retried with backoff on the codes in `retry_on` for at most retry_s seconds in all.
        On a session: NOT_FOUND, or FAILED_PRECONDITION after a retry (the episode ended at the attempt
        that seemed lost), raise SessionLost."""
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                result = call()
            except grpc.RpcError as exc:
                code = exc.code()
                if session is not None and (code == grpc.StatusCode.NOT_FOUND or
                                            (attempt and code == grpc.StatusCode.FAILED_PRECONDITION)):
                    raise SessionLost(f"{what} on session {session.session_id} (task {session.task_id}): "
                                      f"{code.name}: {exc.details()}") from None
                waited = time.monotonic() - started
                if code not in retry_on or waited >= self.retry_s:
                    raise
                delay = min(backoff_delay(attempt, self.backoff_s, self.max_backoff_s), self.retry_s - waited)
                attempt += 1
                log.warning("env server unavailable, retrying", extra=log_fields(
                    call=what, code=code.name, attempt=attempt, waited_s=round(waited, 1), delay_s=round(delay, 2),
                    gives_up_after_s=self.retry_s, target=self.target))
                time.sleep(delay)
                continue
            if attempt:
                log.info("env server back", extra=log_fields(call=what, attempts=attempt + 1,
                                                             waited_s=round(time.monotonic() - started, 1)))
            return result

    def environments(self) -> dict[str, EnvInfo]:
        """The environments the env server hosts, by name, with their capabilities. A server from
        before capabilities were reported names its environments only; each is then taken to have an
        expert and to list actions, as every environment then did. Waits for a server that is still
        starting, like `tasks`."""
        resp = self._call("ListEnvironments", lambda: self.stub.ListEnvironments(
            epb.ListEnvironmentsRequest(), timeout=self.timeout_s, wait_for_ready=True),
            retry_on=frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}))
        infos = {e.name: EnvInfo(e.name, e.has_expert, e.lists_actions, e.max_turns) for e in resp.environments}
        for name in resp.envs:
            infos.setdefault(name, EnvInfo(name))
        return infos

    def tasks(self, split: str) -> tuple[list[int], int]:
        # Waits for a server that is still starting, then retries a slow one too (listing is idempotent).
        resp = self._call("ListTasks", lambda: self.stub.ListTasks(
            epb.ListTasksRequest(env=self.env, split=split), timeout=self.timeout_s, wait_for_ready=True),
            retry_on=frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}))
        return list(resp.task_ids), resp.max_turns

    def reset(self, task_id: int) -> tuple[Session, Observation]:
        resp = self._call("Reset", lambda: self.stub.Reset(epb.ResetRequest(env=self.env, task_id=task_id),
                                                           timeout=self.timeout_s))
        return (Session(resp.session_id, task_id, resp.instruction, resp.max_turns),
                Observation(resp.observation, list(resp.available_actions)))

    def step(self, session: Session, action: str) -> Observation:
        resp = self._call("Step", lambda: self.stub.Step(epb.StepRequest(session_id=session.session_id, action=action),
                                                         timeout=self.timeout_s), session)
        return Observation(resp.observation, list(resp.available_actions), resp.reward, resp.done, resp.success,
                           resp.turn)

    def expert_action(self, session: Session) -> str:
        return self._call("ExpertAction", lambda: self.stub.ExpertAction(
            epb.ExpertActionRequest(session_id=session.session_id), timeout=self.timeout_s), session).action

    def close(self, session: Session) -> None:
        """Closes a session; one the server no longer holds (restarted, expired) is closed already."""
        try:
            self._call("Close", lambda: self.stub.Close(epb.CloseRequest(session_id=session.session_id),
                                                        timeout=self.timeout_s), session)
        except SessionLost:
            pass

    def abandon(self, session: Session) -> None:
        """Closes a session without retrying, ignoring any failure (cleanup after an episode is dropped;
        a session left open expires on the server)."""
        try:
            self.stub.Close(epb.CloseRequest(session_id=session.session_id), timeout=min(5.0, self.timeout_s))
        except grpc.RpcError:
            pass
