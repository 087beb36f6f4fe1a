"""How far a client got in a run, and where a (re)started client begins.

`progress.json` (written atomically) names the run, the round and the last phase finished;
`decide_resume` turns it and the aggregator's status into where to start. Finished rounds are
never redone.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib

from fedse.files import atomic_write

PROGRESS_NAME = "progress.json"


class Phase(enum.Enum):
    """The last phase of a round that a client finished (START: none yet): its kept trajectories
    are in the buffer, its adapter is saved, the aggregator acknowledged it, its metrics were
    reported."""

    START = ""
    EXPLORED = "explored"
    TRAINED = "trained"
    UPLOADED = "uploaded"
    REPORTED = "reported"


# What progress.json may say: "seeded" (round -1: the expert demonstrations are in the buffer, no
# round explored yet), then a round's last finished phase.
PROGRESS_PHASES = ("seeded", *(p.value for p in Phase if p is not Phase.START))


class ProgressError(ValueError):
    """A progress.json that cannot be read as one."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far this client got in a run (progress.json)."""

    run_id: str
    round: int
    phase: str
    sha256: str = ""  # of upload.safetensors, once trained
    num_examples: int = 0
    num_successes: int = 0
    transport_dtype: str = ""  # dtype of upload.safetensors' tensors ("" = the schema's)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.phase not in PROGRESS_PHASES:
            raise ProgressError(f"progress phase must be one of {', '.join(PROGRESS_PHASES)}, got {self.phase!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Progress":
        try:
            d = json.loads(text)
            return Progress(run_id=str(d["run_id"]), round=int(d["round"]), phase=str(d["phase"]),
                            sha256=str(d.get("sha256", "")), num_examples=int(d.get("num_examples", 0)),
                            num_successes=int(d.get("num_successes", 0)),
                            transport_dtype=str(d.get("transport_dtype", "")),
                            metrics={str(k): float(v) for k, v in d.get("metrics", {}).items()})
        except ProgressError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ProgressError(f"progress file is not valid ({type(exc).__name__}: {exc})") from None


def write_progress(path: pathlib.Path, progress: Progress) -> None:
    """Atomically (fedse.files.atomic_write: temp file, fsync, rename, fsync of the directory)."""
    atomic_write(path, progress.to_json().encode())


def read_progress(path: pathlib.Path) -> Progress | None:
    """The recorded progress, None if there is none; ProgressError if the file is not one."""
    try:
        text = pathlib.Path(path).read_text()
    except FileNotFoundError:
        return None
    return Progress.from_json(text)


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where a (re)started client begins.

    action: "fresh" (no usable progress for this run: set the old state aside, seed, start `round`),
    "continue" (the open round is the recorded one: go on after `phase`) or "catch_up" (the run
    moved past the recorded round: start the open round from its global adapter).
    phase: the last phase already done for `round` ("" = nothing, start by evaluating phi_round).
    drop_from: buffer trajectories of rounds >= this were never recorded as explored (a crash
    mid-exploration) and are dropped before the round is redone.
    missed: a past round whose metrics were recorded but not reported (reported late, best effort).
    """

    action: str
    round: int
    phase: str
    drop_from: int
    missed: int | None = None
    reason: str = ""


def decide_resume(progress: Progress | None, run_id: str, open_round: int) -> Resume:
    """Pure: the recorded progress and the run's status (its run_id and open round, num_rounds once
    finished) -> where to start. Finished rounds are never redone."""
    if progress is None:
        return Resume("fresh", open_round, "", -1, reason="no progress recorded")
    if progress.run_id != run_id:
        return Resume("fresh", open_round, "", -1,
                      reason=f"state is from run {progress.run_id!r}, the aggregator runs {run_id!r}")
    if progress.round > open_round:
        return Resume("fresh", open_round, "", -1,
                      reason=f"progress is at round {progress.round}, past the aggregator's round {open_round}")
    if progress.round == open_round and progress.phase != "seeded":
        return Resume("continue", open_round, progress.phase, open_round + 1,
                      reason=f"round {open_round} is still open, {progress.phase} already")
    unreported = {p.value for p in (Phase.EXPLORED, Phase.TRAINED, Phase.UPLOADED)}
    missed = progress.round if progress.phase in unreported and progress.metrics else None
    return Resume("catch_up", open_round, "", progress.round + 1, missed=missed,
                  reason=f"the run is at round {open_round}, progress at round {progress.round} ({progress.phase})")
