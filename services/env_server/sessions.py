"""Sessions over environment episodes: ids, the turn limit, idle expiry, a cap on open sessions.

Pure Python and thread-safe; the gRPC servicer maps the errors below to status codes. A session
is one episode of one task. It stays open after its episode ends (steps are then refused with
EpisodeDone) until the client closes it or it idles past the TTL.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
import time
import uuid
from typing import Callable, Mapping

from fedse.transport.inputs import shown
from fedse.transport.serving import log_fields

from . import metrics
from fedse.env import Environment, Episode, EpisodeLost, NoExpert, UnknownTask, check_split

log = logging.getLogger(__name__)

MAX_ACTION_CHARS = 1000
# How many closed or expired session ids are remembered, to say why an id is unknown.
REMEMBERED_ENDED = 4096


class EnvServerError(Exception):
    """A request the env server cannot serve; the message says what to fix."""


class UnknownEnvironment(EnvServerError):
    pass


class UnknownTaskId(EnvServerError):
    pass


class UnknownSession(EnvServerError):
    pass


class TooManySessions(EnvServerError):
    pass


class EpisodeDone(EnvServerError):
    pass


class BadAction(EnvServerError):
    """An empty or oversized action (a well-formed but inadmissible action is not an error)."""


class BadSplit(EnvServerError):
    pass


class NoExpertHere(EnvServerError):
    """ExpertAction on an environment without an expert."""


class Outcome(str, enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    # The turn limit ended the episode before the environment did.
    TRUNCATED = "truncated"


@dataclasses.dataclass(frozen=True)
class ResetResult:
    session_id: str
    instruction: str
    observation: str
    available_actions: list[str]
    max_turns: int


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    observation: str
    reward: float
    done: bool
    success: bool
    available_actions: list[str]
    # Turns used so far, this one included.
    turn: int
    # False when the action was not admissible (the turn was still used).
    valid: bool
    # Set when done.
    outcome: Outcome | None = None


@dataclasses.dataclass(eq=False)
class _Session:
    id: str
    env: Environment
    task_id: int
    episode: Episode
    last_used: float
    turn: int = 0
    outcome: Outcome | None = None
    closed: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def check_action(action: str) -> None:
    if not action.strip():
        raise BadAction("action is empty: send one of the available actions")
    if len(action) > MAX_ACTION_CHARS:
        raise BadAction(f"action is {len(action)} characters long, more than the limit of {MAX_ACTION_CHARS}: "
                        "send only the action itself, not the reasoning around it")


def _close_episode(episode: Episode, env: str, session_id: str) -> None:
    """episode.close(); a failure is logged, not raised (the session is gone either way)."""
    try:
        episode.close()
    except Exception as exc:  # noqa: BLE001
        log.warning("closing an episode failed", extra=log_fields(
            session_id=session_id, env=env, error=f"{type(exc).__name__}: {exc}"[:500]))


class SessionManager:
    """Open episodes by session id, over a fixed set of environments."""

    def __init__(self, envs: Mapping[str, Environment], ttl_s: float = 600.0, max_sessions: int = 1024,
                 clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self._envs = dict(envs)
        for env in self._envs.values():
            metrics.init_env(env.name, tuple(o.value for o in Outcome))
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()

    # ---- environments and tasks

    def env_names(self) -> list[str]:
        return list(self._envs)

    def environments(self) -> list[Environment]:
        return list(self._envs.values())

    def environment(self, name: str) -> Environment:
        try:
            return self._envs[name]
        except KeyError:
            raise UnknownEnvironment(
                f"unknown environment {shown(name)}: this server hosts {', '.join(self._envs) or 'none'}") from None

    def list_tasks(self, env: str, split: str) -> tuple[list[int], int]:
        """Task ids of a split and the environment's turn limit."""
        environment = self.environment(env)
        try:
            check_split(split)
        except ValueError as exc:
            raise BadSplit(str(exc)) from None
        return environment.tasks(split), environment.max_turns

    # ---- sessions

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def reset(self, env: str, task_id: int) -> ResetResult:
        environment = self.environment(env)
        try:
            episode = environment.reset(task_id)
        except UnknownTask as exc:
            raise UnknownTaskId(f"{exc.args[0] if exc.args else exc}; list them with ListTasks") from None
        with self._lock:
            expired = self._sweep_locked() if len(self._sessions) >= self.max_sessions else []
            full = len(self._sessions) >= self.max_sessions
            if not full:
                session = _Session(uuid.uuid4().hex, environment, task_id, episode, self._clock())
                self._sessions[session.id] = session
        self._end_episodes(expired)
        if full:
            _close_episode(episode, environment.name, "")  # made before the cap was known to be reached
            raise TooManySessions(
                f"{self.max_sessions} sessions are open, the limit of this server: close finished "
                f"sessions with Close (idle ones expire after {self.ttl_s:g} s) or raise --max-sessions")
        metrics.OPEN_SESSIONS.labels(environment.name).inc()
        return ResetResult(session.id, episode.instruction, episode.observation, episode.available_actions(),
                           environment.max_turns)

    def step(self, session_id: str, action: str) -> StepOutcome:
        check_action(action)
        session = self._get(session_id)
        env = session.env
        with session.lock:
            self._check_open(session)
            try:
                result = session.episode.step(action)
            except EpisodeLost as exc:
                self._lose(session, str(exc))
                raise
            session.turn += 1
            outcome: Outcome | None = None
            if result.done:
                outcome = Outcome.SUCCESS if result.success else Outcome.FAILURE
            elif session.turn >= env.max_turns:
                outcome = Outcome.TRUNCATED
            session.outcome = outcome
            session.last_used = self._clock()
            done = outcome is not None
            available = [] if done else session.episode.available_actions()
        metrics.STEPS.labels(env.name).inc()
        if not result.valid:
            metrics.INVALID_ACTIONS.labels(env.name).inc()
        if outcome is not None:
            metrics.EPISODES_FINISHED.labels(env.name, outcome.value).inc()
        return StepOutcome(result.observation, result.reward, done, result.success and done, available,
                           session.turn, result.valid, outcome)

    def expert_action(self, session_id: str) -> str:
        session = self._get(session_id)
        if not session.env.has_expert:
            raise NoExpertHere(f"environment {session.env.name} has no expert: seed demonstrations from files "
                               "(the client's --demos) or explore without any (--expert-demos 0)")
        with session.lock:
            self._check_open(session)
            try:
                return session.episode.expert_action()
            except NoExpert as exc:
                raise NoExpertHere(f"environment {session.env.name}: {exc}") from None

    def close(self, session_id: str) -> None:
        with self._lock:
            session = self._pop_locked(session_id)
            if session is None:
                raise self._unknown(session_id)
            self._forget_locked(session, "was closed")
        self._end_episodes([session])

    def sweep(self) -> int:
        """Expires the sessions idle longer than the TTL; returns how many."""
        with self._lock:
            expired = self._sweep_locked()
        self._end_episodes(expired)
        return len(expired)

    def _end_episodes(self, sessions: list[_Session]) -> None:
        """Lets ended sessions' episodes free what they hold (a bridged server's session), outside the
        manager's lock and after any call still running on the session; a failure is logged, not raised."""
        for session in sessions:
            with session.lock:
                _close_episode(session.episode, session.env.name, session.id)

    # ---- internals (the callers hold the locks the names say)

    def _check_open(self, session: _Session) -> None:
        if session.closed:
            raise UnknownSession(f"session {session.id} was closed or expired while this call waited; "
                                 "start a new one with Reset")
        if session.outcome is not None:
            raise EpisodeDone(
                f"session {session.id}: the episode already ended ({session.outcome.value} after "
                f"{session.turn} turns); Close it and Reset to start another")

    def _get(self, session_id: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise self._unknown(session_id)
            now = self._clock()
            expired = now - session.last_used > self.ttl_s
            if expired:
                self._expire_locked(session)
            else:
                session.last_used = now
        if expired:
            self._end_episodes([session])
            raise self._unknown(session_id)
        return session

    def _unknown(self, session_id: str) -> UnknownSession:
        why = self._ended.get(session_id)
        if why is not None:
            return UnknownSession(f"session {session_id} {why}: start a new one with Reset")
        return UnknownSession(f"no session {shown(session_id)} on this server: start one with Reset "
                              "(sessions do not survive a server restart)")

    def _lose(self, session: _Session, why: str) -> None:
        """Ends a session whose episode the service behind it lost (EpisodeLost); the caller holds
        session.lock, so the episode is not closed again."""
        with self._lock:
            if self._pop_locked(session.id) is not None:
                self._forget_locked(session, f"was lost by the service behind {session.env.name} ({why[:200]})")

    def _pop_locked(self, session_id: str) -> _Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.closed = True
            metrics.OPEN_SESSIONS.labels(session.env.name).dec()
        return session

    def _forget_locked(self, session: _Session, why: str) -> None:
        self._ended[session.id] = why
        while len(self._ended) > REMEMBERED_ENDED:
            self._ended.popitem(last=False)

    def _expire_locked(self, session: _Session) -> None:
        self._pop_locked(session.id)
        self._forget_locked(session, f"expired after idling more than {self.ttl_s:g} s")
        metrics.SESSIONS_EXPIRED.labels(session.env.name).inc()
        log.info("session expired", extra=log_fields(session_id=session.id, env=session.env.name,
                                                     task_id=session.task_id, turn=session.turn))

    def _sweep_locked(self) -> list[_Session]:
        """Expires the idle sessions; the caller ends their episodes once it has let go of the lock."""
        now = self._clock()
        idle = [s for s in self._sessions.values() if now - s.last_used > self.ttl_s]
        for session in idle:
            self._expire_locked(session)
        return idle
