"""The environment API (fedse.env, where it is documented) as the built-in environments import it."""

from __future__ import annotations

from fedse.env import (SPLITS, Environment, EnvironmentFailed, EnvironmentUnavailable, Episode, EpisodeLost,
                       NoExpert, NumberedTasks, StepResult, UnknownTask, check_split, shuffled_cycle)

__all__ = ["SPLITS", "Environment", "EnvironmentFailed", "EnvironmentUnavailable", "Episode", "EpisodeLost",
           "NoExpert", "NumberedTasks", "StepResult", "UnknownTask", "check_split", "shuffled_cycle"]
