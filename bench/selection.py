"""Who takes part, and rounds that do not wait: six tiny-model clients, one of them made 3x slower
(bench/slow_client.py, a bench-only delay before each upload), run as a whole local federation
(`fedse run`'s processes: env servers, an aggregator, client agents, real gRPC) once per setting and
seed, each to the same number of client updates:

  all          every client every round (Fed-SE's setting), R rounds: 6R updates
  sample       half the clients a round, at random (--selector sample --selection-fraction 0.5), 2R rounds
  agent-tools  half the clients a round, chosen by the tool planner, 2R rounds
  agent-llm    half, asked of the run's base model (the embedded tiny model: its answers fail the
               check and agent-tools decides; the fallbacks are counted), 2R rounds
  async        FedBuff (--mode async): every client may train at once, buffers of 3 (--async-buffer 3),
               2R versions

For each: the training wall time (round 0's opening to the last round's close, as the aggregator
measured its rounds), the run's whole wall time, the client updates accepted, and the held-out
success of the final global adapter (every client evaluates it; micro-averaged over test tasks),
mean and spread over seeds. Written to --results: selection.json and selection.png.

    .venv/bin/python bench/selection.py [--rounds 2] [--seeds 2] [--settings all,sample,agent-tools,agent-llm,async]
        [--envs babyai:40,maze:30,wordle:30 --per-round 5 --members-per-host 50]   # 100 members, 5 a round
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps import launcher  # noqa: E402
from apps.planning import RunConfig  # noqa: E402
from apps.processes import Proc  # noqa: E402
from apps.results import round_mean  # noqa: E402
from fedse.config import to_argv  # noqa: E402
from fedse.machine import describe_cpu  # noqa: E402

ENVS = "maze,maze2=maze,wordle?vocab_size=30,wordle2=wordle?vocab_size=30,babyai,babyai2=babyai"
SLOW, FACTOR = "org-babyai2", 3.0
# Each setting's flags, and how many rounds (versions) make the same client updates as R of `all`.
SETTINGS = {
    "all": ({}, 1),
    "sample": ({"selector": "sample", "selection_fraction": 0.5}, 2),
    "agent-tools": ({"selector": "agent-tools", "selection_fraction": 0.5}, 2),
    "agent-llm": ({"selector": "agent-llm", "selection_fraction": 0.5}, 2),
    "async": ({"mode": "async", "async_buffer": 3}, 2),
}


class SlowLaunch(launcher.Launch):
    """fedse run's launch, with one client agent started through bench/slow_client.py."""

    def process(self, name, service, config):
        if service == "client" and config.client_id == SLOW:
            self.procs.append(Proc(name, ["bench.slow_client", str(FACTOR), *to_argv(config)], self.logs))
            return self.procs[-1]
        return super().process(name, service, config)


def taking(name: str, per_round: int) -> dict:
    """--per-round K: a selector takes K clients a round; FedBuff folds K uploads a version, 2K training."""
    if not per_round or name == "all":
        return {}
    if name == "async":
        return {"async_buffer": per_round, "async_concurrency": 2 * per_round}
    return {"clients_per_round": per_round, "selection_fraction": 0.0}


def run_fresh(launch: launcher.Launch) -> dict:
    """Runs `launch` in its emptied results folder (a benchmark's run is never resumed): its results."""
    shutil.rmtree(launch.dir, ignore_errors=True)
    launch.logs.mkdir(parents=True)
    try:
        launch.start()
        launch.follow()
    finally:
        results = launch.finish()
    return results


def run_one(cfg: RunConfig) -> dict:
    launch = SlowLaunch(cfg, open(os.devnull, "w"))
    results = run_fresh(launch)
    state = launch.state / "aggregator" / "local"
    run = json.loads((state / "run.json").read_text())
    updates = [p for p in state.glob("uploads/*/*.json") if not p.name.endswith(".part.json")]
    return {"complete": results["complete"], "wall_s": results["wall_s"], "train_s": round(sum(run["round_seconds"]), 1),
            "updates": len(updates), "final": round_mean(results["envs"], cfg.env_list(), cfg.rounds),
            "fallbacks": run.get("selector_fallbacks", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of `all` (R)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--results", default="results/bench-selection")
    ap.add_argument("--envs", default=ENVS, help="fedse run's --envs: many members with NAME:N, e.g. "
                                                "babyai:40,maze:30,wordle:30 (the slow client is org-babyai2's only)")
    ap.add_argument("--per-round", type=int, default=0, help="clients a round for the selectors, a version's "
                                                             "uploads for async, twice that training at once "
                                                             "(0 = half the clients, async's buffer of 3)")
    ap.add_argument("--members-per-host", type=int, default=0, help="members in client hosts of at most this many")
    args = ap.parse_args()
    root = pathlib.Path(args.results)
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    print(f"machine: {describe_cpu()}; clients {args.envs}, {SLOW} (if there) {FACTOR:g}x slower; R = {args.rounds}",
          flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for seed in range(args.seeds):
        for name in names:
            flags, per = SETTINGS[name]
            cfg = RunConfig(envs=args.envs, rounds=args.rounds * per, results=str(root / f"{name}-seed{seed}"),
                            seed=seed, expert_demos=4, explore_tasks=4, eval_tasks=10, epochs=1,
                            members_per_host=args.members_per_host, **{**flags, **taking(name, args.per_round)})
            t0 = time.monotonic()
            out = run_one(cfg)
            runs[name].append(out)
            print(f"  {name:<12} seed {seed}: {out['updates']} updates, training {out['train_s']:.1f} s "
                  f"(whole run {time.monotonic() - t0:.0f} s), final success "
                  + (f"{100 * out['final']:.1f}%" if out["final"] is not None else "-")
                  + (f", {out['fallbacks']} selector fallbacks" if out["fallbacks"] else "")
                  + ("" if out["complete"] else " (INCOMPLETE)"), flush=True)
    base = statistics.mean(r["train_s"] for r in runs[names[0]])
    print(f"\n{'setting':<12} {'updates':>8} {'training s':>11} {'vs ' + names[0]:>8} {'final success %':>16}")
    table = {}
    for name in names:
        rs = runs[name]
        finals = [100 * r["final"] for r in rs if r["final"] is not None]
        mean_s = statistics.mean(r["train_s"] for r in rs)
        spread = f" ± {statistics.stdev(finals):.1f}" if len(finals) > 1 else ""
        table[name] = {"updates": statistics.mean(r["updates"] for r in rs), "train_s": mean_s,
                       "ratio": mean_s / base, "final": statistics.mean(finals) if finals else None,
                       "final_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0, "runs": rs}
        print(f"{name:<12} {table[name]['updates']:>8.1f} {mean_s:>11.1f} {mean_s / base:>8.2f} "
              f"{(f'{statistics.mean(finals):.1f}' if finals else '-') + spread:>16}")
    (root / "selection.json").write_text(json.dumps({"machine": describe_cpu(), "rounds": args.rounds, "seeds": args.seeds,
                                                     "settings": table}, indent=1))
    plot(table, root / "selection.png")
    print(f"\nwrote {root / 'selection.json'} and {root / 'selection.png'}")


def plot(table: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(names, [table[n]["train_s"] for n in names], color="tab:blue")
    left.set_ylabel("training wall time (s)")
    left.set_title(f"to the same client updates; {SLOW} {FACTOR:g}x slower", fontsize=9)
    finals = [table[n]["final"] or 0.0 for n in names]
    right.bar(names, finals, yerr=[table[n]["final_sd"] for n in names], color="tab:green", capsize=4)
    right.set_ylabel("held-out success of the final adapter (%)")
    right.set_title("mean ± sd over seeds", fontsize=9)
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
