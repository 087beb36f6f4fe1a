"""How long a run will take on this machine, said before it starts (`fedse run`, `fedse experiment`).

The work is what the run plans: per client, its start (imports, loading the model), the episodes it
plays (each environment's test tasks every round from 0, its exploration tasks every trained round)
and its training (the demonstrations, and what exploration keeps, once per epoch a round). Each
part's cost in seconds is as measured in timed runs on a reference machine (a 2-core CPU, REFERENCE):
the tiny model's, and SmolLM2-135M's for a real model, scaled by its parameters (a model's work per
token grows with them). The clients share the machine's cores: on two cores they take turns, with
more, up to one pair of cores per client runs at once. This machine's speed is measured (well under a
second of single-threaded matrix products: fedse.machine.matmul_peak, the best of four) and
the whole is scaled by how it compares with the reference machine's. It is an estimate: episodes end
early or late as the model plays, and other work on the machine slows a run down.

Timed on the reference machine (sharing its cores with other work), against the estimate: `make run`
461 s (7 minutes), one client and round of Maze 13-33 s (16 s), two clients and rounds 36 s (50 s),
the quick experiment's Fed-SE run 69 s (89 s), the 9 runs of the ranks experiment 17 minutes (18),
SmolLM2-135M one round of Maze with 2 tasks of each kind 213 s (3 minutes).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Iterable

from apps.planning import RunConfig, plan
from fedse.machine import available_cores
from fedse.model.pretrained import names_tiny_model
from fedse.progress import duration

REFERENCE = "a 2-core AMD EPYC"
REFERENCE_CORE_FLOPS = 9.0e10  # its single-threaded fp32 matmul rate (machine_speed)
REFERENCE_CORES = 2
ALL_TEST_TASKS = 100  # an environment's test tasks where --eval-tasks all takes them and they are not known
SMOLLM2_PARAMS = 134.5e6
FIXED_S = 4.0  # the launcher's own: the services started, the plot and results written at the end
KEPT = 0.15  # the share of explored episodes kept for training (successes)
# An episode's work by environment, as a multiple of a Maze episode's (the time the tiny model took
# per episode in the timed runs: turns times prompt length); others count as OTHER_ENV.
ENV_WEIGHT = {"maze": 1.0, "wordle": 2.5, "babyai": 2.0, "textcraft": 6.0, "webshop": 1.4}
OTHER_ENV = 2.0


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a client's work adds to a run's wall time on the reference machine (its two cores
    shared by every client of the run)."""

    start_s: float  # a client's start: imports, the model loaded, its env server and aggregator reached
    episode_s: float  # one Maze episode (evaluated or explored; other environments' by ENV_WEIGHT)
    demo_epoch_s: float  # training on one trajectory for one epoch
    round_s: float  # a round's fixed part: the global adapter fetched, the upload, waiting for the others


TINY = Cost(start_s=4.0, episode_s=0.11, demo_epoch_s=0.08, round_s=1.0)
SMOLLM2 = Cost(start_s=10.0, episode_s=20.0, demo_epoch_s=12.0, round_s=2.0)


def model_params(base_model: str) -> float | None:
    """A model directory's parameters, from its weights' size and dtype (None if unknown)."""
    folder = pathlib.Path(base_model)
    try:
        config = json.loads((folder / "config.json").read_text())
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    except (OSError, ValueError):
        return None
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return size / (2 if "16" in dtype else 4) if size else None


def model_cost(base_model: str) -> Cost:
    """The tiny model's costs, or SmolLM2-135M's scaled by the model's parameters (the start only
    in part: much of it is imports)."""
    if names_tiny_model(base_model):
        return TINY
    scale = (model_params(base_model) or SMOLLM2_PARAMS) / SMOLLM2_PARAMS
    return Cost(start_s=SMOLLM2.start_s * (0.5 + 0.5 * scale), episode_s=SMOLLM2.episode_s * scale,
                demo_epoch_s=SMOLLM2.demo_epoch_s * scale, round_s=SMOLLM2.round_s)


@functools.lru_cache(maxsize=None)
def machine_speed(seconds: float = 0.6) -> float:
    """This machine's single-threaded fp32 matmul rate in FLOP/s: the best of four runs of about a
    quarter of `seconds` each (the others' share of the cores, where other work runs, is left out).
    Measured once per process: an experiment's forecast and each of its runs ask it again."""
    import torch

    from fedse.machine import matmul_peak

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return matmul_peak("fp32", "cpu", seconds=seconds / 4, sizes=(512,) * 4)
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def all_test_tasks(envs: str) -> dict[str, int]:
    """Each environment's test tasks, where --eval-tasks all takes them all: a built-in's (it is
    built to count them, in a second at most), ALL_TEST_TASKS for any other (a plugin, AgentGym's)."""
    from services.env_server import registry

    counts = {}
    for spec in registry.parse_specs(envs):
        try:
            built = registry.build(spec) if spec.name in registry.BUILTIN_NAMES and spec.kind == "registered" else None
            counts[spec.name] = len(built.tasks("test")) if built is not None else ALL_TEST_TASKS
        except Exception:  # noqa: BLE001 - an estimate does without
            counts[spec.name] = ALL_TEST_TASKS
    return counts


def taking_share(cfg: RunConfig, clients: int) -> float:
    """The share of the rounds a client takes part in: every one, unless a selector takes some of the
    clients a round, or FedBuff folds some clients' uploads into each version."""
    if cfg.mode == "async":
        return min(1.0, (cfg.async_buffer or clients) / clients)
    if cfg.selector == "all":
        return 1.0
    if cfg.clients_per_round:
        return min(1.0, cfg.clients_per_round / clients)
    return cfg.selection_fraction or 1.0


def run_seconds(cfg: RunConfig, speed: float, cores: int | None = None) -> float:
    """The expected wall time of `cfg` on a machine of `speed` (machine_speed) and `cores` cores."""
    cost = model_cost(cfg.base_model)
    clients = [c for f in plan(cfg) for c in f.clients]
    counts = all_test_tasks(",".join(cfg.env_specs().values()))  # less the :N of members
    work = 0.0
    played = cfg.rounds * taking_share(cfg, len(clients))  # the rounds a client takes part in
    for c in clients:
        work += cost.start_s + cost.round_s * (played + 1)
        for env in c.envs:
            tests = min(cfg.eval_tasks or counts.get(env, ALL_TEST_TASKS), counts.get(env, ALL_TEST_TASKS))
            episodes = (played + 1) * tests + played * cfg.explore_tasks
            # each trained round's set: the demonstrations and what exploration kept (--history cumulative)
            trained = sum(cfg.expert_demos + KEPT * cfg.explore_tasks * r for r in range(round(played)))
            work += (cost.episode_s * ENV_WEIGHT.get(env, OTHER_ENV) * episodes
                     + cost.demo_epoch_s * cfg.epochs * trained)
    at_once = min(len(clients), max(1, (cores or available_cores()) // REFERENCE_CORES))
    return FIXED_S + work / at_once * REFERENCE_CORE_FLOPS / speed


def words(seconds: float) -> str:
    """"about 8 minutes", "about 2.5 hours"."""
    if seconds < 90:
        return f"about {duration(seconds)}"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} minutes"
    return f"about {seconds / 3600:.1f} hours"


def on_gpu() -> bool:
    """Whether the clients will run on a GPU (they pick CUDA where present): the costs are a CPU's."""
    import torch

    return torch.cuda.is_available()


def estimate_line(seconds: float, what: str = "this run") -> str:
    """What `fedse run` and `fedse experiment` say before they start."""
    line = (f"{what}: {words(seconds)} expected on this machine (an estimate from the work planned, scaled "
            "by a quick measurement of this machine's speed)")
    return line + ("; calibrated on CPUs: this machine's GPU should take less" if on_gpu() else "")


class Forecast:
    """The runs of an experiment still to run: their estimates, and the time left as the runs go,
    the estimates scaled by how the finished runs compared with theirs."""

    def __init__(self, configs: Iterable[RunConfig], speed: float | None = None):
        speed = speed or machine_speed()
        self.estimates = [run_seconds(cfg, speed) for cfg in configs]
        self.spent: list[float | None] = []

    def line(self, what: str) -> str:
        return estimate_line(sum(self.estimates), what)

    def done(self, seconds: float | None) -> None:
        """The next run ended after `seconds` (None: a resumed run, whose time covers only part of its
        work, so it does not rescale the others)."""
        self.spent.append(seconds)

    def scale(self) -> float:
        """How the finished runs' times compared with their estimates (1 before any finished)."""
        timed = [(s, e) for s, e in zip(self.spent, self.estimates) if s is not None]
        return sum(s for s, _ in timed) / max(1e-9, sum(e for _, e in timed)) if timed else 1.0

    def left_s(self) -> float:
        return self.scale() * sum(self.estimates[len(self.spent):])

    def after_current_s(self) -> float:
        """The time left for the runs after the one under way."""
        return self.scale() * sum(self.estimates[len(self.spent) + 1:])
