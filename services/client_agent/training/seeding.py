"""The seed demonstrations D_0 in a client's buffer: adding them once per source (the --demos files',
and the expert's where an environment has one), and counting them by source."""

from __future__ import annotations

import logging
import random
from typing import Callable

from fedse.transport.serving import log_fields

from services.client_agent.training.buffer import DEMO_SOURCES, Buffer, Trajectory
from services.client_agent.metrics import BUFFER, DEMOS
from services.client_agent.playing.tasks import EnvTasks

log = logging.getLogger("client_agent")


def seed_buffer(buffer: Buffer, tasks: list[EnvTasks], files: dict[str, list[Trajectory]], expert_demos: int,
                seed: int, play_expert: Callable[[EnvTasks, list[int]], list[Trajectory]]) -> None:
    """Adds the seed demonstrations D_0 of every environment, each source once (what the buffer
    holds already is never added again, so a resumed client does not seed twice): the demonstrations
    of the --demos files (`files`, by environment), and where the environment has an expert, its
    successful demonstrations (`play_expert`) of `expert_demos` tasks sampled from `seed` alone, per
    environment. An environment without an expert is never asked for one: it is seeded from files,
    or not at all (it explores alone)."""
    have = {(t.env, t.source) for t in buffer.trajectories if t.round < 0}
    for task in tasks:
        mine = files.get(task.name, [])
        if mine and (task.name, "file") not in have:
            buffer.extend(mine)
            log.info("buffer seeded with demonstrations from files",
                     extra=log_fields(env=task.name, demos=len(mine), turns=sum(len(t.turns) for t in mine)))
        if not task.has_expert:
            if mine:
                log.info("the environment has no expert: its seed demonstrations are the files' only",
                         extra=log_fields(env=task.name, demos=len(mine)))
            else:
                log.warning("the environment has no expert and no demonstration files (--demos): the agent "
                            "explores it alone, and trains on nothing there until an exploration succeeds",
                            extra=log_fields(env=task.name))
            continue
        if expert_demos == 0 or (task.name, "expert") in have:
            continue
        ids = random.Random(seed).sample(task.train_ids, min(expert_demos, len(task.train_ids)))
        demos = play_expert(task, ids)
        kept = [t for t in demos if t.success]
        buffer.extend(kept)
        log.info("buffer seeded with expert demonstrations",
                 extra=log_fields(env=task.name, demos=len(demos), successful=len(kept)))
    count_demos(buffer, tasks)


def count_demos(buffer: Buffer, tasks: list[EnvTasks]) -> dict[str, float]:
    """The seed demonstrations in the buffer by source, over all environments (`demos_expert`,
    `demos_file`: round metrics), and per environment in fedse_client_demonstrations."""
    totals = {source: 0 for source in DEMO_SOURCES}
    for task in tasks:
        for source in DEMO_SOURCES:
            n = sum(t.env == task.name and t.source == source for t in buffer.trajectories)
            DEMOS.labels(task.name, source).set(n)
            totals[source] += n
    BUFFER.set(len(buffer))
    return {f"demos_{source}": float(n) for source, n in totals.items()}
