"""The client's trajectory buffer D_t: seed demonstrations plus every kept success, persisted on disk.

D_0, the seed demonstrations (round -1), come from the environment's expert (source "expert") and
from demonstration files (source "file", demos.py); explored trajectories have source "explore".

What goes in and what a round trains on are the parts the paper's ablations change (`to_keep`,
`training_set`): exploration keeps its successes (`--keep successes`, the paper's filter) or every
trajectory, failures too (`--keep all`, "no filter"); round t trains on the whole buffer,
D_t = D_{t-1} ∪ kept_t (`--history cumulative`, the paper), on the seed demonstrations D_0
plus round t's kept trajectories only (`--history round`, "no history": earlier rounds' explored
trajectories stay in the file but are not trained on), or on D_0 plus the shortest success of each
task explored so far (`--history shortest`). `--round-trajectories` bounds what a round trains on
(`capped`): the seed demonstrations and a sample of the rest, so the round's training steps stop
growing with the buffer.

Trajectories never leave the client. The buffer is an append-only JSON-lines file; each append
is flushed and fsynced before it counts, so a crash loses no trajectory that was recorded. The one
rewrite, dropping the trajectories of rounds whose exploration never finished (a crash mid-round),
writes a new file and renames it over the old one, so a crash leaves either file whole.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import random

from fedse.files import atomic_write

# Where seed demonstrations (D_0, round -1) come from: the environment's expert, or files (--demos).
DEMO_SOURCES = ("expert", "file")


@dataclasses.dataclass(frozen=True)
class Trajectory:
    env: str
    task_id: int
    instruction: str
    # (observation shown to the agent, action it took) for every turn.
    turns: tuple[tuple[str, str], ...]
    success: bool
    reward: float
    source: str  # "expert", "file" (a demonstration file) or "explore"
    round: int
    # The whole text the agent wrote at each turn (a ReAct thought and its action), where it wrote
    # one: a file's demonstrations and turns in an environment that lists no actions. Empty, or one
    # per turn with "" where the agent only picked its action; training trains on a turn's text
    # where it has one (prompts.encode_trajectory). Buffers written before it existed have none.
    texts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.texts and len(self.texts) != len(self.turns):
            raise ValueError(f"a trajectory of {len(self.turns)} turns has {len(self.texts)} texts; "
                             "give one per turn or none")

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["turns"] = [list(t) for t in self.turns]
        if self.texts:
            d["texts"] = list(self.texts)
        else:
            del d["texts"]  # lines as they were before texts existed
        return json.dumps(d)

    @staticmethod
    def from_json(line: str) -> "Trajectory":
        d = json.loads(line)
        d["turns"] = tuple((o, a) for o, a in d["turns"])
        d["texts"] = tuple(str(t) for t in d.get("texts", ()))
        return Trajectory(**d)


def to_keep(explored: list[Trajectory], keep: str) -> list[Trajectory]:
    """The explored trajectories that go into the buffer: the successes, the first of each task where
    it was tried several times (--explore-tries), so an easy task does not crowd the buffer
    ("successes"); or all ("all")."""
    if keep == "all":
        return list(explored)
    seen: set[tuple[str, int, int]] = set()
    kept = []
    for t in explored:
        if t.success and (t.env, t.task_id, t.round) not in seen:
            seen.add((t.env, t.task_id, t.round))
            kept.append(t)
    return kept


def with_expert_share(trajectories: list[Trajectory], share: float) -> list[Trajectory]:
    """The trajectories with the seed demonstrations repeated (whole copies, as few as do it) until
    they make up at least `share` of them (--expert-share; 0: as they are), so that a buffer that
    exploration grows keeps learning from the demonstrations as much as it did at first."""
    demos = [t for t in trajectories if t.source in DEMO_SOURCES]
    others = len(trajectories) - len(demos)
    if share <= 0 or not demos or not others:
        return list(trajectories)
    copies = max(1, math.ceil(share * others / ((1 - share) * len(demos))))
    return list(trajectories) + demos * (copies - 1)


def capped(trajectories: list[Trajectory], most: int, seed: int) -> list[Trajectory]:
    """At most `most` of the trajectories, in buffer order (--round-trajectories; 0: all): every seed
    demonstration, and for the room left a sample of the others drawn with `seed` (a round's own, so
    each round sees another sample of the buffer and a retrained round the same one)."""
    if most <= 0:
        return list(trajectories)
    demos = [i for i, t in enumerate(trajectories) if t.source in DEMO_SOURCES]
    others = [i for i, t in enumerate(trajectories) if t.source not in DEMO_SOURCES]
    room = max(0, most - len(demos))
    if len(others) <= room:
        return list(trajectories)
    chosen = set(demos) | set(random.Random(seed).sample(others, room))
    return [t for i, t in enumerate(trajectories) if i in chosen]


def _cumulative(trajectories: list[Trajectory], round_: int) -> list[Trajectory]:
    return [t for t in trajectories if t.round <= round_]


def _this_round(trajectories: list[Trajectory], round_: int) -> list[Trajectory]:
    return [t for t in trajectories if t.source in DEMO_SOURCES or t.round == round_]


def _shortest(trajectories: list[Trajectory], round_: int) -> list[Trajectory]:
    """The cumulative buffer with one explored success per task: its fewest turns so far, the earliest
    of equals. A success found by a long way round teaches the detour; a shorter one replaces it."""
    so_far = _cumulative(trajectories, round_)
    best: dict[tuple[str, int], Trajectory] = {}
    for t in so_far:
        if t.source not in DEMO_SOURCES and t.success:
            key = (t.env, t.task_id)
            if key not in best or len(t.turns) < len(best[key].turns):
                best[key] = t
    chosen = {id(t) for t in best.values()}
    return [t for t in so_far if t.source in DEMO_SOURCES or id(t) in chosen]


# What round t trains on, by --history (ClientConfig checks the name against these).
HISTORIES = {"cumulative": _cumulative, "round": _this_round, "shortest": _shortest}


def training_set(trajectories: list[Trajectory], history: str, round_: int) -> list[Trajectory]:
    """The trajectories round `round_` trains on, in buffer order: every seed demonstration and
    kept trajectory up to this round ("cumulative"), the seed demonstrations (the expert's and the
    files') and this round's kept trajectories only ("round"), or the seed demonstrations and, for
    each task exploration solved so far, its shortest success ("shortest")."""
    return HISTORIES[history](trajectories, round_)


class Buffer:
    def __init__(self, path: pathlib.Path):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trajectories: list[Trajectory] = []
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        good = 0
        with open(self.path, "rb") as fh:
            for line in fh:
                if not line.endswith(b"\n"):
                    break
                try:
                    self.trajectories.append(Trajectory.from_json(line.decode()))
                except (ValueError, TypeError, KeyError):
                    break
                good += len(line)
        if good < self.path.stat().st_size:
            # A torn last record from a crash mid-write: drop it so later appends stay readable.
            with open(self.path, "r+b") as fh:
                fh.truncate(good)

    def __len__(self) -> int:
        return len(self.trajectories)

    def extend(self, trajectories: list[Trajectory]) -> None:
        if not trajectories:
            return
        with open(self.path, "a") as fh:
            for t in trajectories:
                fh.write(t.to_json() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.trajectories.extend(trajectories)

    def drop_rounds_from(self, round_: int) -> int:
        """Drops every trajectory of round >= `round_` (seed demonstrations are round -1), rewriting the
        file atomically (temp file, fsync, rename, fsync of the directory); returns how many."""
        keep = [t for t in self.trajectories if t.round < round_]
        dropped = len(self.trajectories) - len(keep)
        if not dropped:
            return 0
        atomic_write(self.path, "".join(t.to_json() + "\n" for t in keep).encode())
        self.trajectories = keep
        return dropped

