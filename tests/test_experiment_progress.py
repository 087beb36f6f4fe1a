"""What `fedse experiment` says while it runs: the runs done and to run, each round every environment
reported with the time left, the round under way where one takes long, and a resumed run's pace
counted from where it resumed. Driven with a clock the test sets."""

from __future__ import annotations

from apps.estimate import Forecast
from apps.experiment_progress import RunProgress, last_full_round, roster


def rows(upto: dict[str, int]) -> dict[str, list[dict]]:
    """Rows where each environment reported rounds 0..upto[env], half its 10 tasks solved."""
    return {env: [{"round": r, "test_success": 0.5, "test_tasks": 10} for r in range(last + 1)]
            for env, last in upto.items()}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def follow(forecast: Forecast) -> tuple[RunProgress, Clock, list[str]]:
    said: list[str] = []
    clock = Clock()
    return RunProgress("fedse-seed0", ["maze", "wordle"], 4, forecast, said.append, clock=clock, quiet_s=300), \
        clock, said


def test_roster_names_runs_done_and_to_run():
    assert roster(["local-seed0"], ["fedse-seed0", "fedit-seed1"]) == [
        "runs done: 1 (local-seed0)", "runs to run: 2 (fedse-seed0, fedit-seed1)"]
    assert roster([], ["a"])[0] == "runs done: 0"
    assert roster([], ["a"], "runs not finished")[1] == "runs not finished: 1 (a)"


def test_a_round_counts_once_every_environment_reported_it():
    assert last_full_round(rows({"maze": 2, "wordle": 1}), ["maze", "wordle"]) == (1, 0.5)
    assert last_full_round({}, ["maze"]) == (-1, None)


def test_each_round_in_is_said_with_the_time_left_for_the_run_and_the_experiment():
    forecast = Forecast([], speed=1.0)
    forecast.estimates = [1000.0, 3600.0]  # this run, then one more
    progress, clock, said = follow(forecast)
    clock.now = 10.0
    progress({})  # the services started: nothing reported yet
    clock.now = 70.0
    progress(rows({"maze": 0, "wordle": -1}))
    assert said == []  # round 0 is in only once every environment reported it
    progress(rows({"maze": 0, "wordle": 0}))
    clock.now = 130.0
    progress(rows({"maze": 1, "wordle": 1}))
    # 2 rounds (0 and 1) in 120 s: 3 rounds left take 180 s; then the next run's hour.
    assert said[-1] == ("    fedse-seed0: round 1 of 4 in, held-out success 50.0%; this run about 3 minutes left, "
                        "the experiment about 63 minutes")
    assert len(said) == 2
    progress(rows({"maze": 1, "wordle": 1}))
    assert len(said) == 2  # nothing new, and not quiet for long: nothing said
    clock.now = 431.0
    progress(rows({"maze": 2, "wordle": 1}))
    assert said[-1].startswith("    fedse-seed0: round 2 of 4 under way; this run")


def test_a_resumed_run_says_where_it_resumed_and_counts_its_pace_from_there():
    forecast = Forecast([], speed=1.0)
    forecast.estimates = [1000.0]
    progress, clock, said = follow(forecast)
    clock.now = 5.0
    progress(rows({"maze": 2, "wordle": 2}))  # the reports from before the interruption
    assert said == ["    fedse-seed0: resumed after round 2 of 4"]
    clock.now = 65.0
    progress(rows({"maze": 3, "wordle": 3}))
    assert said[-1].endswith("this run about 1m00s left, the experiment about 1m00s")  # 1 round a minute, 1 left
