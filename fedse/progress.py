"""How far a long phase is, as log lines that people and `fedse run` read.

A client agent's round with a real model takes minutes per phase (evaluating, exploring, training).
`PhaseProgress` logs a "progress" line when a phase starts, every `every_s` seconds while it runs
(a ticker thread logs one when no unit ended in that time: an episode of a real model can take
minutes), and when it ends; use it as a context manager (or call close()) so that its ticker stops
with the phase, also when the phase fails:

    {"msg": "progress", "phase": "training", "round": 1, "done": 12, "total": 40, "unit": "steps",
     "elapsed_s": 61.2, "left_s": 142.8, ...}

A phase whose count comes later (training learns its steps at the first) or that has no units
(loading the model: `unit` "") gives `total` None; a phase of units that stopped before its last
one (an exception, a restart) says so in its last line ("ended": true).

Given a count of the model's tokens (`tokens`: computed and padding so far), a line also says how
fast the phase runs through them (`tokens_per_s`, since the phase started) and what share of the
positions computed were padding (`padding`).

`fedse run` reads the last such line of each client's log (`last_progress`) and shows it
(`describe`) beneath its table:
`round 1 training: 12/40 steps, 1m01s, ~2m23s left, 410 tokens/s, 3% padding`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable

from fedse.transport.serving import log_fields

PROGRESS_MSG = "progress"
EVERY_S = 30.0
TAIL_BYTES = 64 * 1024  # how much of a log's end `last_progress` reads


class PhaseProgress:
    """Counts the units of work of one phase (episodes, optimizer steps) and logs progress lines, on
    its own every `every_s` until the phase ends: its last unit, or close() (the end of a with block)."""

    def __init__(self, log: logging.Logger, phase: str, total: int | None, unit: str, every_s: float = EVERY_S,
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
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._emit()
        self._ticker = threading.Thread(target=self._tick_until_ended, name=f"progress-{phase}", daemon=True)
        self._ticker.start()

    def __enter__(self) -> PhaseProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total

    def advance(self, n: int = 1, total: int | None = None) -> None:
        """`n` more units done (of `total`, where the phase learns only now how many there are)."""
        with self._lock:
            if total is not None:
                self.total = total
            self.done += n
            if self.finished() or self.clock() - self.last >= self.every_s:
                self._emit()
        if self.finished():
            self._ended.set()

    def tick(self) -> None:
        """Logs a line if none came in the last `every_s` (what the ticker calls)."""
        with self._lock:
            if not self._ended.is_set() and self.clock() - self.last >= self.every_s:
                self._emit()

    def close(self) -> None:
        """Ends the phase: its ticker stops, and its last line is logged; a phase of units that
        stopped before its last one says so ("ended")."""
        with self._lock:
            if not self._ended.is_set() and not self.finished():
                self._emit(**({"ended": True} if self.unit else {}))
            self._ended.set()
        if self._ticker is not threading.current_thread():
            self._ticker.join()

    def _tick_until_ended(self) -> None:
        while not self._ended.wait(min(self.every_s, max(0.01, self.every_s - (self.clock() - self.last)))):
            self.tick()

    def steps(self, done: int, most_left: int) -> None:
        """For units made of steps that run side by side (episodes of turns, played concurrently):
        the steps taken so far and the most that can be left. The first episodes to end are the
        short ones, while the others are well under way: "1 of 20 episodes in 45 s" alone foretells
        14 more minutes for an evaluation that ends within the next one. The time left is then the
        lesser of the two rates' estimates (the steps' is an upper bound: episodes may end early)."""
        self.steps_done, self.steps_left = done, most_left

    def _emit(self, **end: Any) -> None:
        self.last = self.clock()
        elapsed = self.last - self.started
        going = self.total is not None and self.done < self.total and not end
        left = elapsed * (self.total - self.done) / self.done if going and self.done > 0 else None
        if going and self.steps_left is not None and self.steps_done > 0:
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
            elapsed_s=round(elapsed, 1), **({"left_s": round(left, 1)} if left is not None else {}), **rates, **end))


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
    """A progress line in words: "round 1 training: 12/40 steps, 1m01s, ~2m23s left" ("loading the
    model: 12s" for a phase without units, ", ended" after one that stopped before its last)."""
    where = f"round {entry['round']} " if isinstance(entry.get("round"), int) and entry["round"] >= 0 else ""
    env = f" {entry['env']}" if entry.get("env") else ""
    count = (f"{entry.get('done', 0)}/{entry['total'] if entry.get('total') is not None else '?'} "
             f"{entry.get('unit', '')}, " if entry.get("unit") else "")
    text = f"{where}{entry.get('phase', '?')}{env}: {count}{duration(float(entry.get('elapsed_s', 0)))}"
    if entry.get("left_s") is not None:
        text += f", ~{duration(float(entry['left_s']))} left"
    if entry.get("tokens_per_s") is not None:
        text += f", {float(entry['tokens_per_s']):,.0f} tokens/s, {100 * float(entry.get('padding', 0)):.0f}% padding"
    return text + (", ended" if entry.get("ended") else "")

