"""Progress lines of long phases: written as JSON log lines, at most every `every_s` seconds and at the
end, read back from a log's end and shown in words by `fedse run`."""

from __future__ import annotations

import io
import logging

from apps.display import Display
from apps.logs import progress_texts
from apps.planning import Client
from fedse.progress import PhaseProgress, describe, duration, last_progress
from fedse.transport.serving import JsonFormatter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def json_logger(path, name: str) -> logging.Logger:
    log = logging.getLogger(name)
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = logging.FileHandler(path)
    handler.setFormatter(JsonFormatter("client_agent"))
    log.addHandler(handler)
    return log


def test_a_phase_logs_its_start_then_at_most_every_interval_and_its_end(tmp_path):
    path = tmp_path / "client.log"
    log, clock = json_logger(path, "progress-test-1"), Clock()
    p = PhaseProgress(log, "training", 10, "steps", every_s=30.0, clock=clock, round=1)
    assert last_progress(path)["done"] == 0
    for _ in range(3):  # 3 steps in 20 s: no line yet
        clock.now += 20 / 3
        p.advance()
    assert last_progress(path)["done"] == 0
    clock.now += 15.0  # 35 s in: a line, with the time left at the rate so far
    p.advance()
    entry = last_progress(path)
    assert (entry["phase"], entry["round"], entry["done"], entry["total"], entry["unit"]) == ("training", 1, 4, 10, "steps")
    assert abs(entry["elapsed_s"] - 35.0) < 0.2 and abs(entry["left_s"] - 35.0 * 6 / 4) < 0.2
    clock.now += 1.0
    p.advance(6)  # the end is always logged, without a time left
    entry = last_progress(path)
    assert entry["done"] == 10 and "left_s" not in entry
    assert describe(entry) == "round 1 training: 10/10 steps, 36s"
    log.info("round done")  # later lines of other kinds do not hide it
    assert last_progress(path)["done"] == 10


def test_episodes_played_side_by_side_foretell_the_time_left_from_their_turns(tmp_path):
    path = tmp_path / "client.log"
    log, clock = json_logger(path, "progress-test-steps"), Clock()
    p = PhaseProgress(log, "evaluating", 20, "episodes", every_s=30.0, clock=clock, round=2)
    # 16 episodes side by side, 15 turns each in 45 s, and the first (a short one) has ended: by
    # episodes 19 x 45 s would be left; by turns at most 15 x 5 + 4 x 20 = 155 of 240 played.
    p.steps(16 * 15, 15 * 5 + 4 * 20)
    clock.now += 45.0
    p.advance()
    entry = last_progress(path)
    assert abs(entry["left_s"] - 45.0 * 155 / 240) < 0.2, entry
    # Late in a phase the episodes' own rate can be the lower estimate, and then it counts.
    p.steps(300, 400)
    clock.now += 30.0
    p.advance(15)
    assert abs(last_progress(path)["left_s"] - 75.0 * 4 / 16) < 0.2


def test_words_for_a_progress_line():
    assert duration(5) == "5s" and duration(123) == "2m03s" and duration(3900) == "1h05m"
    entry = {"phase": "exploring", "env": "maze", "round": 0, "done": 3, "total": 16, "unit": "episodes",
             "elapsed_s": 61.0, "left_s": 264.3}
    assert describe(entry) == "round 0 exploring maze: 3/16 episodes, 1m01s, ~4m24s left"
    assert describe({**entry, "round": -1}).startswith("exploring maze: 3/16")  # the expert demonstrations


def test_a_log_without_progress_or_no_log(tmp_path):
    assert last_progress(tmp_path / "missing.log") is None
    path = tmp_path / "text.log"
    path.write_text('not json\n{"msg": "started"}\n{"msg": "progress"' + "\n")  # a cut line is skipped
    assert last_progress(path) is None


def test_fedse_run_shows_what_changed_of_each_running_client(tmp_path):
    class Running:  # a client agent's process, still running
        @staticmethod
        def poll():
            return None

    class Proc:
        def __init__(self, path):
            self.log_path, self.popen = path, Running()

    logs = {name: tmp_path / f"{name}.log" for name in ("maze", "wordle")}
    clients = {Client(f"org-{name}", (name,)): Proc(path) for name, path in logs.items()}
    log = json_logger(logs["maze"], "progress-test-2")
    PhaseProgress(log, "evaluating", 20, "episodes", env="maze", round=2)
    out = io.StringIO()  # not a terminal: lines are appended, those that changed only
    display = Display(out, ["maze", "wordle"], 1)
    display.progress(progress_texts(clients))
    assert out.getvalue().endswith("] org-maze: round 2 evaluating maze: 0/20 episodes, 0s\n")
    shown = out.getvalue()
    display.progress(progress_texts(clients))
    assert out.getvalue() == shown  # nothing new


def test_a_phase_that_runs_the_model_says_its_tokens_per_second_and_padding(tmp_path):
    path = tmp_path / "client.log"
    log, clock = json_logger(path, "progress-test-tokens"), Clock()
    counted = [1000, 0]  # tokens computed and padding positions, as work.Work.totals gives them
    p = PhaseProgress(log, "evaluating", 2, "episodes", clock=clock, round=0, tokens=lambda: tuple(counted))
    assert "tokens_per_s" not in last_progress(path)  # nothing run yet
    clock.now += 4.0
    counted[0] += 3200
    counted[1] += 800
    p.advance(2)
    entry = last_progress(path)
    assert entry["tokens_per_s"] == 800.0 and entry["padding"] == 0.2  # of this phase's only
    assert describe(entry) == "round 0 evaluating: 2/2 episodes, 4s, 800 tokens/s, 20% padding"
