"""Seed demonstrations from files (--demos): AgentGym's AgentTraj format, read, checked, converted.

An organisation that brings its own environment may have no expert for it but recorded successful
episodes: AgentGym publishes AgentTraj in this format, a JSON array (or JSON Lines, one record a
line) of

    {"item_id": "<env>_<index>",
     "conversations": [{"from": "human", "loss": null,  "value": "<the task's instructions>"},
                       {"from": "gpt",   "loss": false, "value": "OK. I'll follow your instructions ..."},
                       {"from": "human", "loss": null,  "value": "<the first observation>"},
                       {"from": "gpt",   "loss": true,  "value": "Thought:\\n...\\n\\nAction:\\n<action>"},
                       {"from": "human", "loss": null,  "value": "<the next observation>"}, ...]}

Each record becomes one Trajectory of the client's buffer (source "file", round -1, success True:
the files hold successful demonstrations), in the client's own terms:
- the first human turn is the task instruction;
- a gpt turn right after it that names no action, or that AgentGym marks `"loss": false`, is the
  acknowledgement AgentGym's conversations open with, and is left out;
- each later human turn is an observation (several in a row are joined by a blank line), and the gpt
  turn after it is the agent's turn: the action parsed from it (prompts.parse_react: the line after
  its last "Action:") and its whole text, thought included (Trajectory.texts), which training
  trains on wherever the agent writes its own text;
- human turns after the last gpt turn (the episode's last observation) teach nothing and are dropped.
"loss" may be null, true or false and is otherwise not used: every agent turn after the
acknowledgement is trained on.

Which environment a record belongs to: a client holding one environment takes every record of its
files; one holding several reads it from the item_id, "<env>_<index>" (the part before the last
"_" must name one of them). The index, where it is a number, becomes the trajectory's task id
(AgentGym's data_idx); it is never used to reset an environment.

Everything is checked before the client joins its run: the first problem raises DemoError (a
ConfigError, so the client stops with exit status 2) with one line that names the file, the record
(its index from 0, its line in JSON Lines, its item_id) and what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Any, Iterator, Sequence

from fedse.config import ConfigError
from fedse.transport.inputs import shown
from fedse.transport.serving import log_fields

from services.client_agent.training.buffer import Trajectory
from services.client_agent.playing.prompts import parse_react

log = logging.getLogger("client_agent.demos")

SOURCE = "file"
ROLES = ("human", "gpt")
FORMAT_HINT = ("a demonstration file is a JSON array of AgentTraj records, or JSON Lines with one record a line: "
               '{"item_id": "<env>_<index>", "conversations": [{"from": "human" or "gpt", "value": "..."}, ...]}')


class DemoError(ConfigError):
    """A demonstration file that cannot be used; the message names the file, the record and what is wrong."""


class _Bad(ValueError):
    """What is wrong with one record (the caller adds where it is)."""


@dataclasses.dataclass(frozen=True)
class _Record:
    index: int  # from 0, in the file
    line: int | None  # JSON Lines: its line, from 1
    value: Any  # as parsed


def _records(path: pathlib.Path) -> Iterator[_Record]:
    """The records of a file: a JSON array, else JSON Lines (blank lines skipped)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DemoError(f"--demos {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DemoError(f"--demos {path}: not UTF-8 text (byte {exc.start}): {FORMAT_HINT}") from None
    if not text.strip():
        raise DemoError(f"--demos {path}: the file is empty: {FORMAT_HINT}")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DemoError(f"--demos {path}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): "
                            f"{FORMAT_HINT}") from None
        if not records:
            raise DemoError(f"--demos {path}: the array holds no records: {FORMAT_HINT}")
        for index, value in enumerate(records):
            yield _Record(index, None, value)
        return
    index = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DemoError(f"--demos {path}: record {index} (line {number}): not JSON ({exc.msg} at column "
                            f"{exc.colno}): {FORMAT_HINT}") from None
        yield _Record(index, number, value)
        index += 1


def _turns(conversations: Any) -> list[tuple[str, str]]:
    """(from, value) of each turn, checked."""
    if not isinstance(conversations, list):
        raise _Bad(f'"conversations" is a {type(conversations).__name__}, not a list of turns')
    if not conversations:
        raise _Bad('"conversations" is empty')
    out = []
    for k, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            raise _Bad(f"turn {k} is a {type(turn).__name__}, not an object with \"from\" and \"value\"")
        role = turn.get("from")
        if role not in ROLES:
            raise _Bad(f'turn {k} has an unknown "from" {shown(role)}: expected "human" or "gpt"')
        value = turn.get("value")
        if not isinstance(value, str):
            raise _Bad(f'turn {k} ({role}) has no text: "value" must be a string, got '
                       f"{'nothing' if value is None else type(value).__name__}")
        if turn.get("loss") not in (None, True, False):
            raise _Bad(f'turn {k} ({role}) has "loss" {shown(turn.get("loss"))}: expected null, true or false')
        out.append((role, value))
    return out


def conversation_to_trajectory(conversations: Any, env: str, task_id: int = -1) -> Trajectory:
    """One AgentTraj conversation as a Trajectory of `env` (see the module docstring); _Bad says
    what is wrong with it."""
    turns = _turns(conversations)
    if turns[0][0] != "human":
        raise _Bad("turn 0 is from gpt: a conversation starts with the human's task instruction")
    instruction = turns[0][1]
    start = 1
    # AgentGym's acknowledgement of the instruction ("OK. I'll follow your instructions ..."), loss false.
    if len(turns) > 1 and turns[1][0] == "gpt" and (conversations[1].get("loss") is False
                                                     or parse_react(turns[1][1]) is None):
        start = 2
    steps: list[tuple[str, str]] = []
    texts: list[str] = []
    observations: list[str] = []
    for k in range(start, len(turns)):
        role, value = turns[k]
        if role == "human":
            observations.append(value)
            continue
        if k > start and turns[k - 1][0] == "gpt":
            raise _Bad(f"turns {k - 1} and {k} are both from gpt: each agent turn answers a human turn")
        action = parse_react(value)
        if action is None:
            raise _Bad(f'turn {k} (gpt) names no action: expected "Action:" then the action, as in '
                       '"Thought:\\n...\\n\\nAction:\\n<action>"')
        steps.append(("\n\n".join(observations), action))
        texts.append(value)
        observations = []
    if not steps:
        raise _Bad("no gpt turn with an action: nothing the agent did to learn from")
    return Trajectory(env=env, task_id=task_id, instruction=instruction, turns=tuple(steps), success=True,
                      reward=1.0, source=SOURCE, round=-1, texts=tuple(texts))


def _env_of(item_id: str | None, envs: Sequence[str]) -> str:
    if len(envs) == 1:
        return envs[0]
    if item_id is None:
        raise _Bad(f'no "item_id": with several environments ({", ".join(envs)}) each record names its own, '
                   'as "<env>_<index>"')
    prefix = item_id.rsplit("_", 1)[0]
    if prefix not in envs:
        raise _Bad(f"item_id names no environment of this client: {shown(prefix)} is not one of "
                   f"{', '.join(envs)} (write item_id as \"<env>_<index>\", or give each environment's "
                   "client its own files)")
    return prefix


def _task_id(item_id: str | None) -> int:
    index = item_id.rsplit("_", 1)[-1] if item_id else ""
    return int(index) if index.isdigit() else -1


def load_file(path: str | pathlib.Path, envs: Sequence[str]) -> list[Trajectory]:
    """Every record of one file as a Trajectory of one of `envs`; DemoError at the first problem."""
    path = pathlib.Path(path)
    out = []
    for record in _records(path):
        item_id = record.value.get("item_id") if isinstance(record.value, dict) else None
        details = ([f"line {record.line}"] if record.line is not None else []) + \
            ([f"item_id {shown(item_id)}"] if isinstance(item_id, str) else [])
        where = f"--demos {path}: record {record.index}" + (f" ({', '.join(details)})" if details else "")
        try:
            if not isinstance(record.value, dict):
                raise _Bad(f"a {type(record.value).__name__}, not an object with \"item_id\" and \"conversations\"")
            if item_id is not None and not isinstance(item_id, str):
                raise _Bad(f'"item_id" is a {type(item_id).__name__}, not a string "<env>_<index>"')
            if "conversations" not in record.value:
                raise _Bad('no "conversations": the list of the episode\'s turns is missing')
            env = _env_of(item_id, envs)
            out.append(conversation_to_trajectory(record.value["conversations"], env, _task_id(item_id)))
        except _Bad as exc:
            raise DemoError(f"{where}: {exc}") from None
    return out


def load_demos(paths: Sequence[str], envs: Sequence[str]) -> dict[str, list[Trajectory]]:
    """The demonstrations of every file, by environment (each of `envs` present, maybe empty), in
    file and record order; DemoError at the first problem of any file."""
    if not envs:
        raise DemoError("--demos: the client holds no environment to seed")
    out: dict[str, list[Trajectory]] = {env: [] for env in envs}
    for path in paths:
        trajectories = load_file(path, envs)
        for t in trajectories:
            out[t.env].append(t)
        log.info("demonstrations read", extra=log_fields(path=str(path), records=len(trajectories), envs={
            env: n for env in envs if (n := sum(t.env == env for t in trajectories))}))
    return out
