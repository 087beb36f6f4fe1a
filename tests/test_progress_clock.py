"""Progress on a clock: a phase logs a progress line every `every_s` while it runs, even when no unit
of it ends (an episode of a real model takes minutes), and stops when the phase ends, however it
ends; a phase without units (loading the model) or whose count comes later (training) says so."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from fedse.progress import PhaseProgress, describe


class Lines(logging.Handler):
    """The progress lines logged, as the fields a JSON log line would hold."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.entries.append(dict(record.fields))


def logger(name: str) -> tuple[logging.Logger, Lines]:
    log, lines = logging.getLogger(name), Lines()
    log.handlers[:] = [lines]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log, lines


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    """The threads started since `before` (threading.enumerate()) that still run."""
    return [t for t in threading.enumerate() if t not in before]


def test_lines_come_on_the_clock_without_any_unit_ending_and_stop_when_the_phase_ends():
    log, lines = logger("progress-clock-1")
    before = set(threading.enumerate())
    with PhaseProgress(log, "evaluating", 20, "episodes", every_s=0.05, round=0, env="maze") as p:
        p.steps(15, 45)  # turns taken so far, the most left: enough for a time left
        assert [t.name for t in started_since(before)] == ["progress-evaluating"]
        assert wait_for(lambda: len(lines.entries) >= 3)  # the start, then two on the clock
        ticked = lines.entries[1]
        assert ticked["done"] == 0 and ticked["elapsed_s"] >= 0.0 and "left_s" in ticked
    ended = len(lines.entries)
    assert lines.entries[-1].get("ended") is True  # it stopped before its 20th episode
    time.sleep(0.3)  # six intervals: the ticker is gone
    assert len(lines.entries) == ended and not started_since(before)


def test_a_phase_that_fails_stops_its_ticker_and_says_it_ended():
    log, lines = logger("progress-clock-2")
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError):
        with PhaseProgress(log, "training", None, "steps", every_s=0.05, round=1):
            raise RuntimeError("out of memory")
    count = len(lines.entries)
    assert lines.entries[-1]["ended"] is True and lines.entries[-1]["total"] is None
    time.sleep(0.3)
    assert len(lines.entries) == count and not started_since(before)


def test_a_phase_that_counts_its_last_unit_ends_there():
    log, lines = logger("progress-clock-3")
    before = set(threading.enumerate())
    p = PhaseProgress(log, "training", None, "steps", every_s=30.0, round=1)
    p.advance(total=2)  # the count comes with the first step
    p.advance()
    assert lines.entries[-1]["done"] == 2 and lines.entries[-1]["total"] == 2 and "ended" not in lines.entries[-1]
    assert wait_for(lambda: not started_since(before))
    p.close()  # nothing more to say
    assert len(lines.entries) == 2


def test_tick_logs_only_once_every_interval_on_a_fake_clock():
    log, lines = logger("progress-clock-4")
    now = [100.0]
    with PhaseProgress(log, "loading the model", None, "", every_s=30.0, clock=lambda: now[0]) as p:
        p.tick()
        assert len(lines.entries) == 1  # the start only
        now[0] += 31.0
        p.tick()
        p.tick()
        assert len(lines.entries) == 2 and lines.entries[-1]["elapsed_s"] == 31.0
        assert describe(lines.entries[-1]) == "loading the model: 31s"
        now[0] += 5.0
    assert describe(lines.entries[-1]) == "loading the model: 36s"  # its end: it has no units to miss
