"""How far a long phase is, as log lines that people and `fedse run` read.

A client agent's round with a real model takes minutes per phase (evaluating, exploring, training).
`PhaseProgress` logs a "progress" line when a phase starts, at most every `every_s` seconds while it
runs, and when it ends:

    {"msg": "progress", "phase": "training", "round": 1, "done": 12, "total": 40, "unit": "steps",
     "elapsed_s": 61.2, "left_s": 142.8, ...}

Given a count of the model's tokens (`tokens`: computed and padding so far), a line also says how
fast the phase runs through them (`tokens_per_s`, since the phase started) and what share of the
positions computed were padding (`padding`).

`fedse run` reads the last such line of each client's log (`last_progress`) and shows it
(`describe`) while no new round result arrives:
`round 1 training: 12/40 steps, 1m01s, ~2m23s left, 410 tokens/s, 3% padding`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable

from fedse.serving import log_fields

PROGRESS_MSG = "progress"
EVERY_S = 30.0
TAIL_BYTES = 64 * 1024  # how much of a log's end `last_progress` reads


class PhaseProgress:
    """Counts the units of work of one phase (episodes, optimizer steps) and logs progress lines."""

    def __init__(self, log: logging.Logger, phase: str, total: int, unit: str, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 tokens: Callable[[], tuple[int, int]] | None = None, **fields: Any):
        self.log, self.phase, self.total, self.unit = log, phase, total, unit
        self.tokens = tokens
        self.tokens_at_start = tokens() if tokens is not None else (0, 0)
        self.every_s, self.clock, self.fields = every_s, clock, fields
        self.done = 0
        self.steps_done = 0
        self.steps_left: int | None = None
        self.started = self.last = clock()
        self._emit()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            self._emit()

    def steps(self, done: int, most_left: int) -> None:
        """For units made of steps that run side by side (episodes of turns, played concurrently):
        the steps taken so far and the most that can be left. The first episodes to end are the
        short ones, while the others are well under way: "1 of 20 episodes in 45 s" alone foretells
        14 more minutes for an evaluation that ends within the next one. The time left is then the
        lesser of the two rates' estimates (the steps' is an upper bound: episodes may end early)."""
        self.steps_done, self.steps_left = done, most_left

    def _emit(self) -> None:
        elapsed = self.clock() - self.started
        left = elapsed * (self.total - self.done) / self.done if 0 < self.done < self.total else None
        if self.steps_left is not None and self.steps_done > 0 and self.done < self.total:
            by_steps = elapsed * self.steps_left / self.steps_done
            left = by_steps if left is None else min(left, by_steps)
        rates = {}
        if self.tokens is not None:
            (t0, p0), (t1, p1) = self.tokens_at_start, self.tokens()
            if t1 > t0 and elapsed > 0:
                rates = {"tokens_per_s": round((t1 - t0) / elapsed, 1),
                         "padding": round((p1 - p0) / (t1 - t0 + p1 - p0), 3)}
        self.log.info(PROGRESS_MSG, extra=log_fields(
            phase=self.phase, **self.fields, done=self.done, total=self.total, unit=self.unit,
            elapsed_s=round(elapsed, 1), **({"left_s": round(left, 1)} if left is not None else {}), **rates))


def tail_lines(path: str | os.PathLike, max_bytes: int = TAIL_BYTES) -> list[str] | None:
    """The whole lines in the last max_bytes of a file (a line cut by the start is left out), None
    if it cannot be read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            start = max(0, fh.tell() - max_bytes)
            fh.seek(start)
            return fh.read().decode(errors="replace").splitlines()[1 if start else 0:]
    except OSError:
        return None


def last_progress(path: str | os.PathLike) -> dict[str, Any] | None:
    """The last progress line of a JSON log (its end only is read), None if it has none."""
    for line in reversed(tail_lines(path) or []):
        if f'"{PROGRESS_MSG}"' not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("msg") == PROGRESS_MSG:
            return entry
    return None


def duration(seconds: float) -> str:
    """12s, 2m03s, 1h05m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def describe(entry: dict[str, Any]) -> str:
    """A progress line in words: "round 1 training: 12/40 steps, 1m01s, ~2m23s left"."""
    where = f"round {entry['round']} " if isinstance(entry.get("round"), int) and entry["round"] >= 0 else ""
    env = f" {entry['env']}" if entry.get("env") else ""
    text = (f"{where}{entry.get('phase', '?')}{env}: {entry.get('done', 0)}/{entry.get('total', '?')} "
            f"{entry.get('unit', '')}, {duration(float(entry.get('elapsed_s', 0)))}")
    if entry.get("left_s") is not None:
        text += f", ~{duration(float(entry['left_s']))} left"
    if entry.get("tokens_per_s") is not None:
        text += f", {float(entry['tokens_per_s']):,.0f} tokens/s, {100 * float(entry.get('padding', 0)):.0f}% padding"
    return text

