"""AgentGym's HTTP env servers, bridged: `--envs NAME=agentgym:PROFILE@URL` serves over our EnvService an
environment that lives in an AgentGym env server (github.com/WooooDyy/AgentGym, agentenv-* packages).

A profile knows one AgentGym server's routes and quirks, and follows them the way AgentGym's own client
(agentenv/envs/*.py) does:

    profile    routes            id field  task field        /create answers  value   admissible actions
    textcraft  /                 id        data_idx          {id, ...}        reward  none
    babyai     /                 id        data_idx          {id}             score   in the observation text
    sciworld   /                 id        data_idx          {id}             score   GET /action_hint, expanded
    alfworld   /                 id        game, world_type  {id}             reward  in each answer
    maze       /maze (lmrlgym)   id        game (< 26)       {id}             reward  GET /maze/available_actions
    wordle     /wordle (lmrlgym) id        seed              {id}             reward  none
    webshop    /                 env_idx   session_id        a bare int       reward  GET /available_actions

The bridge's parts: this module holds the environment, its episodes and the factory (`bridge`);
agentgym_profiles.py one class per AgentGym server; agentgym_http.py the HTTP calls and their failures.

Every server keeps its environments in memory under ids it hands out from /create, answers most
errors as HTTP 200 with an "error" key (webshop: HTTP 500), and refuses steps once an episode is
done (textcraft does not). AgentGym's servers have no expert, so no bridged profile has one.

Our task ids are AgentGym's task indexes (data_idx, game or seed), split by ranges into train and test
(`?train=...&test=...`, see `parse_tasks`). The defaults hold out as many test tasks as AgentGym's
published evaluation sets have, and train on a span as large as AgentTraj's trajectory set, less the
test tasks.

Success is a value of 1 at the end of the episode: the reward, or the score where AgentGym's client
reports the score (babyai, sciworld). Two servers scale it otherwise: ScienceWorld scores 0-100 (the
bridge divides by 100), and BabyAI's reward is MiniGrid's 1 - 0.9 * steps / max_steps, below 1 for any
real solve (its server ends an episode only when the goal is reached, so any positive value at the
end is a success).

Remote state. One episode holds one remote environment and serialises its calls (AgentGym's servers
do not lock per id). Episodes end with POST /close where the server has it; a server whose version
answers /close with 404 (older textcraft, babyai, sciworld, alfworld, webshop servers; lmrlgym has
none) gets its environments reused by later episodes instead (a reset re-initialises one), so idle
environments never pile up there (webshop's JVM runs out of memory when they do).

Failures map to fedse.env's exceptions: a server that cannot be reached raises EnvironmentUnavailable
(UNAVAILABLE: the client retries), one that refuses a call raises EnvironmentFailed quoting it
(FAILED_PRECONDITION), and a step on an environment the server no longer holds raises EpisodeLost
(NOT_FOUND: the client plays the episode again). AgentGym's servers keep nothing across a restart
and number environments from 0 again, so a restarted server may hand an old episode's id to a new
one: an episode begun before the server was last unreachable, or before it handed out an id twice,
is lost rather than stepped on someone else's environment. A step that times out is lost too (the
server may have applied it: doing it again would apply it twice). Building the environment contacts
nothing, so an env server starts while the AgentGym server is down.
"""

from __future__ import annotations

import logging
import re
import threading

from fedse.env import (
    Environment,
    EnvironmentFailed,
    EnvironmentUnavailable,
    Episode,
    EpisodeLost,
    StepResult,
    UnknownTask,
    check_split,
)
from fedse.transport.serving import log_fields

from .agentgym_http import IdUnknown, NoRoute, Remote, TimedOut
from .agentgym_profiles import ALFWORLD_WORLD_TYPES, DEFAULT_MAX_ACTIONS, PROFILES, ALFWorld, Profile

log = logging.getLogger(__name__)

# The most task ids a split may name (a typo such as 0-99999999 should not eat the memory).
MAX_TASKS = 1_000_000


# ---------------------------------------------------------------- task ranges

_RANGE = re.compile(r"(\d+)(?:-(\d+)(?:/(\d+))?)?")


def parse_tasks(text: str, option: str = "tasks") -> list[int]:
    """Task indexes from "A", "A-B" (inclusive) or "A-B/S" (every S-th from A to B), several joined by
    '+' (spec options cannot hold commas): "0-99+200-249", "0-3999/20". In the order given, each once."""
    ids: list[int] = []
    seen: set[int] = set()
    for part in text.split("+"):
        part = part.replace(" ", "")
        m = _RANGE.fullmatch(part)
        if not m:
            raise ValueError(f"{option}={text!r}: {part!r} is not a task index A, a range A-B or A-B/STEP; join "
                             "several with '+', e.g. 0-99+200-249")
        first = int(m[1])
        last = int(m[2]) if m[2] is not None else first
        step = int(m[3]) if m[3] is not None else 1
        if last < first or step < 1:
            raise ValueError(f"{option}={text!r}: {part!r} is empty (it ends before it starts, or steps by 0)")
        if len(ids) + (last - first) // step + 1 > MAX_TASKS:
            raise ValueError(f"{option}={text!r} names more than {MAX_TASKS} tasks")
        for i in range(first, last + 1, step):
            if i not in seen:
                seen.add(i)
                ids.append(i)
    return ids


def ranges_text(ids: list[int], limit: int = 8) -> str:
    """Sorted ids as a short "0-4+9+12-15" (the first `limit` runs, then "...")."""
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    shown = "+".join(f"{a}-{b}" if a != b else str(a) for a, b in runs[:limit])
    return shown + ("+..." if len(runs) > limit else "") if runs else "none"


# ---------------------------------------------------------------- environment and episodes

class AgentGymEnvironment(Environment):
    """One AgentGym env server's environment, served under its spec's name. It tracks the server's
    lifetime (see the module docstring) and the remote environments free for reuse."""

    has_expert = False

    def __init__(self, profile: Profile, url: str, train: list[int], test: list[int], max_turns: int,
                 timeout_s: float):
        self.profile = profile
        self.url = url.rstrip("/")
        self.server = f"AgentGym {profile.name} server at {self.url}"
        self.lists_actions = profile.lists_actions
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self._splits = {"train": train, "test": test}
        self._known = set(train) | set(test)
        self._lock = threading.Lock()
        # Bumped whenever the server may have restarted: episodes of an older generation are lost.
        self.generation = 0
        self._ids: set[int] = set()               # remote ids handed out in this generation
        self._idle: list[tuple[int, int]] = []    # (remote id, generation) free for reuse
        self._closes = profile.closes

    # -- Environment

    def tasks(self, split: str) -> list[int]:
        check_split(split)
        return list(self._splits[split])

    def reset(self, task_id: int) -> Episode:
        if task_id not in self._known:
            raise UnknownTask(f"{self.name or self.profile.name} has no task {task_id}: its tasks are AgentGym's "
                              f"indexes {ranges_text(self._splits['test'])} (test) and "
                              f"{ranges_text(self._splits['train'])} (train)")
        remote = Remote(self)
        try:
            return self._reset(remote, task_id)
        except BaseException:
            remote.close()
            raise

    def _reset(self, remote: Remote, task_id: int) -> Episode:
        for attempt in range(2):
            taken = self._take_idle()
            if taken is None:
                rid = self.profile.create(remote)
                generation = self._handed_out(rid)
            else:
                rid, generation = taken
            try:
                observation, actions = self.profile.reset(remote, rid, task_id)
            except IdUnknown:
                self._restarted(generation)
                if attempt:
                    raise
                continue  # a reused id the restarted server does not know: once more, on a fresh one
            except TimedOut:
                raise  # the id may still be busy there: never reused
            except EnvironmentFailed:
                try:
                    self._release(remote, rid, generation)  # the server refused the task, not the id
                except (EnvironmentFailed, EnvironmentUnavailable):
                    pass  # the refusal is what the caller needs to hear
                raise
            return AgentGymEpisode(self, remote, rid, generation, observation, actions)
        raise AssertionError("unreachable")

    # -- the server's lifetime

    def unreachable(self, why: str) -> str:
        return f"{self.server} unreachable: {why}; is it running?"

    def lost_contact(self) -> None:
        """The server could not be reached: it may be restarting, so every episode begun is lost."""
        with self._lock:
            self._new_generation()

    def _restarted(self, generation: int) -> None:
        """The server does not know an id of `generation`: it restarted (once per generation)."""
        with self._lock:
            if generation == self.generation:
                self._new_generation()

    def _new_generation(self) -> None:
        self.generation += 1
        self._ids.clear()
        self._idle.clear()

    def _handed_out(self, rid: int) -> int:
        """Notes a fresh remote id; an id handed out twice means the server restarted. Returns the
        generation the id belongs to."""
        with self._lock:
            if self.profile.distinct_ids and rid in self._ids:
                log.warning("AgentGym server restarted: episodes begun before are lost",
                            extra=log_fields(env=self.name, url=self.url, remote_id=rid))
                self._new_generation()
            self._ids.add(rid)
            return self.generation

    def _take_idle(self) -> tuple[int, int] | None:
        with self._lock:
            while self._idle:
                rid, generation = self._idle.pop()
                if generation == self.generation:
                    return rid, generation
            return None

    def _release(self, remote: Remote, rid: int, generation: int) -> None:
        """An episode is done with a remote environment: close it where the server can, else keep it
        for the next episode. Not when the server restarted since (the id may be another's now)."""
        if generation != self.generation:
            return
        if self._closes:
            try:
                self.profile.close(remote, rid)
                return
            except NoRoute:
                if self._closes:
                    self._closes = False
                    log.info("AgentGym server has no /close: its environments are reused instead",
                             extra=log_fields(env=self.name, url=self.url))
            except IdUnknown:
                return
        with self._lock:
            if generation == self.generation:
                self._idle.append((rid, generation))


class AgentGymEpisode(Episode):
    """One episode on one remote environment; its calls are serialised by its lock."""

    def __init__(self, env: AgentGymEnvironment, remote: Remote, rid: int, generation: int, observation: str,
                 actions: list[str]):
        self.env = env
        self.remote = remote
        self.remote_id = rid
        self.generation = generation
        self.instruction = env.profile.instruction
        self.observation = observation
        self._actions = actions
        self._lock = threading.Lock()
        self._closed = False
        self._reusable = True   # False once the remote environment's state is uncertain

    def available_actions(self) -> list[str]:
        with self._lock:
            return list(self._actions)

    def step(self, action: str) -> StepResult:
        env, profile = self.env, self.env.profile
        with self._lock:
            if self._closed:
                raise EnvironmentFailed(f"{env.server}: this episode was closed")
            if env.generation != self.generation:
                self._reusable = False
                raise EpisodeLost(f"{env.server} was unreachable or restarted since this episode began (remote "
                                  f"id {self.remote_id}); its environment there is gone: play the episode again")
            try:
                observation, value, done, actions = profile.step(self.remote, self.remote_id, profile.normalize(action))
            except IdUnknown as exc:
                env._restarted(self.generation)
                self._reusable = False
                raise EpisodeLost(f"{exc}: the server no longer holds this episode (it restarted); play it again") \
                    from None
            except TimedOut as exc:
                self._reusable = False
                raise EpisodeLost(f"{exc}; the action may have been applied there, so the episode cannot go on: "
                                  "play it again") from None
            self.observation = observation
            self._actions = actions
            return StepResult(observation, value, done, done and profile.succeeded(value), profile.valid(observation))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._reusable:
                    self.env._release(self.remote, self.remote_id, self.generation)
            finally:
                self.remote.close()


# ---------------------------------------------------------------- the factory

def _split(profile: Profile, option: str, given: str, default: str) -> list[int]:
    ids = parse_tasks(given or default, option)
    if profile.num_tasks is not None:
        beyond = [i for i in ids if i >= profile.num_tasks]
        if beyond:
            raise ValueError(f"{option}={given or default!r}: AgentGym's {profile.name} server has tasks "
                             f"0-{profile.num_tasks - 1} only, not {ranges_text(beyond)}")
    return ids


def bridge(profile: str, url: str, *, seed: int = 0, train: str = "", test: str = "", max_turns: int = 0,
           timeout_s: float = 30.0, max_actions: int = DEFAULT_MAX_ACTIONS, world_type: str = "") -> Environment:
    """An environment served by the AgentGym env server at `url` (its root, e.g. http://127.0.0.1:36001;
    maze and wordle: the lmrlgym server's root). Contacts nothing: calls fail with
    EnvironmentUnavailable until the server is up.

    train, test: AgentGym task indexes (see parse_tasks); test defaults to the profile's held-out range,
    train to the profile's training span less the test tasks. They must not overlap.
    max_turns: the turn limit (0: the profile's). timeout_s: the limit of each HTTP call.
    max_actions: the most admissible actions listed a turn. world_type: alfworld's (Text, Embody or
    Hybrid; default Text). seed: unused (the tasks are AgentGym's indexes under any seed)."""
    del seed
    if profile not in PROFILES:
        raise ValueError(f"unknown AgentGym profile {profile!r}: use one of {', '.join(sorted(PROFILES))} (maze and "
                         "wordle both live in AgentGym's lmrlgym server)")
    p = PROFILES[profile]()
    if not re.match(r"https?://[^/\s]+", url):
        raise ValueError(f"AgentGym server URL {url!r}: expected http://HOST:PORT")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: expected a positive number of seconds")
    if max_turns < 0:
        raise ValueError(f"max_turns={max_turns}: expected a positive turn limit, or 0 for the profile's "
                         f"({p.max_turns})")
    if max_actions < 1:
        raise ValueError(f"max_actions={max_actions}: expected at least 1")
    p.max_actions = max_actions
    if world_type:
        if not isinstance(p, ALFWorld):
            raise ValueError(f"world_type is an option of the alfworld profile only, not of {profile}")
        if world_type not in ALFWORLD_WORLD_TYPES:
            raise ValueError(f"world_type={world_type!r}: use one of {', '.join(ALFWORLD_WORLD_TYPES)}")
        p.world_type = world_type
    test_ids = _split(p, "test", test, p.test)
    if train:
        train_ids = _split(p, "train", train, "")
        both = set(train_ids) & set(test_ids)
        if both:
            raise ValueError(f"train={train!r} and test={test or p.test!r} overlap on tasks {ranges_text(list(both))}: "
                             "held-out tasks must not be trained on")
    else:
        held = set(test_ids)
        train_ids = [i for i in _split(p, "train", "", p.train_span) if i not in held]
    if not train_ids or not test_ids:
        raise ValueError(f"AgentGym {profile}: the {'train' if not train_ids else 'test'} split is empty; "
                         "give it tasks with train=A-B or test=A-B")
    return AgentGymEnvironment(p, url, train_ids, test_ids, max_turns or p.max_turns, timeout_s)
