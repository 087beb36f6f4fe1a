"""What `fedse experiment` says as it goes: which runs are done, which is under way and how far it
got, and how long the rest should take.

Before the first run it names the runs kept from an earlier sitting and those still to run; while a
run goes (`RunProgress`, called by the launcher with the rows reported so far) it says each round
that every environment has reported, with that round's held-out success, and, where a round takes
long, at most every QUIET_S that the round is under way; each line gives the time left for the run
(its pace so far) and for the whole experiment (apps.estimate.Forecast for the runs after it).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from apps.estimate import Forecast, words
from apps.results import round_mean

QUIET_S = 300.0  # the longest a run under way goes unmentioned


def roster(done: Sequence[str], to_run: Sequence[str], pending: str = "runs to run") -> list[str]:
    """The lines that name the runs kept from an earlier sitting and those still to run (`pending`
    names them: `fedse experiment --report` runs none of them)."""
    lines = [f"runs done: {len(done)}" + (f" ({', '.join(done)})" if done else "")]
    lines.append(f"{pending}: {len(to_run)}" + (f" ({', '.join(to_run)})" if to_run else ""))
    return lines


def last_full_round(rows: dict[str, list[dict[str, Any]]], envs: list[str]) -> tuple[int, float | None]:
    """The last round every environment reported and its micro-averaged held-out success ((-1, None)
    before round 0 is in)."""
    rounds = sorted({row["round"] for env_rows in rows.values() for row in env_rows}, reverse=True)
    for rnd in rounds:
        mean = round_mean(rows, envs, rnd)
        if mean is not None:
            return rnd, mean
    return -1, None


class RunProgress:
    """Follows one run of an experiment (the launcher's `on_rows`) and says how far it got."""

    def __init__(self, name: str, envs: list[str], rounds: int, forecast: Forecast, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, quiet_s: float = QUIET_S):
        self.name, self.envs, self.rounds, self.forecast, self.say = name, envs, rounds, forecast, say
        self.clock, self.quiet_s = clock, quiet_s
        self.started = self.said_at = clock()
        self.shown = -1  # the last full round said
        self.base: int | None = None  # the last full round at the first call: a resumed run's pace counts from there

    def __call__(self, rows: dict[str, list[dict[str, Any]]]) -> None:
        rnd, mean = last_full_round(rows, self.envs)
        now = self.clock()
        if self.base is None:  # the first call, once the services started: the run's pace counts from here
            self.base = self.shown = rnd
            self.started = self.said_at = now
            if rnd >= 0:
                self.say(f"    {self.name}: resumed after round {rnd} of {self.rounds}")
            return
        if rnd > self.shown:
            self.shown, self.said_at = rnd, now
            success = "-" if mean is None else f"{100 * mean:.1f}%"
            self.say(f"    {self.name}: round {rnd} of {self.rounds} in, held-out success {success}; {self.left(rnd)}")
        elif now - self.said_at >= self.quiet_s:
            self.said_at = now
            self.say(f"    {self.name}: round {rnd + 1} of {self.rounds} under way; {self.left(rnd)}")

    def left(self, rnd: int) -> str:
        """The time left for this run, at its pace since it (re)started, and for the experiment."""
        gone = self.clock() - self.started
        if self.base is not None and rnd > self.base:
            run_left = gone / (rnd - self.base) * (self.rounds - rnd)
            return (f"this run {words(run_left)} left, the experiment "
                    f"{words(run_left + self.forecast.after_current_s())}")
        return f"the experiment {words(self.forecast.left_s())} left"
