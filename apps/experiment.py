"""`fedse experiment`: the Fed-SE paper's comparison and ablations, with seeds, in one command; and
the client selectors and mixed LoRA ranks compared the same way (--methods selectors, ranks).

Every method is a whole local federation (`apps.launcher.run`: real env servers, aggregator and
client agents talking gRPC) that differs from Fed-SE only in the settings that define it:

  Pre-trained   the base model, no training: the round-0 evaluation (phi_0 adapts nothing), taken
                from the Fed-SE runs (every method with the same seed has the same phi_0)
  Local         each client alone in its own federation, trained on its expert data only
  Centralized   one client holding every environment, trained on all the expert data pooled
  FedIT         federated averaging (FedAvg of A and B) on the static expert data
  Fed-SE        explore, keep successes, train on the cumulative buffer, FedAvg of A and B
and the ablations of Fed-SE: without the success filter (every explored trajectory kept), without
the history (each round trains on the expert data and its own round's successes only), averaging
weighted by successes, and LoRA rank 2, 4 and 16 (Fed-SE itself is rank 8; alpha = 2 x rank).
The selectors (--methods selectors) are Fed-SE with half the clients taking part in each round, chosen
by `sample`, `utility`, `agent-tools` or `agent-llm` (every client evaluates the final adapter).
Mixed ranks (--methods ranks) are Fed-SE with the clients at LoRA ranks 4, 16 and 8 in turn (alpha =
2 x rank), combined by `hlora` (the exact sum of the products, each client taking its best rank) and
by `zero-pad` (the zero-padded factors' mean, the naive baseline HetLoRA builds on), beside Fed-SE with every
client at rank 8. The variants (--methods variants) are Fed-SE with one part of its round changed within
the method: 3 tries per exploration task, a learning rate falling over the rounds, the seed
demonstrations kept at half of what each round trains on, and exploration sampled at temperature 0.5.

All methods share seeds, tasks and budgets: for each seed the runs start from the same base model
and phi_0 and see the same training and test tasks. The score of a run is the held-out success of
its last global adapter phi_T; an environment's average is micro-averaged over test tasks. Each
method runs once per seed and the table shows mean +- sample standard deviation over seeds.

Output in --results: table.md (the paper's layout, then the average round by round), results.csv (every run, environment and
round), methods.png, ablations.png, selectors.png, variants.png and ranks.png (success per round per environment), bytes.png (adapter
bytes each client sends per round), and runs/<method>-seed<k>/ with each run's own results and
logs. A run whose results.json exists with the same settings is not run again, and one it
interrupted resumes, so an interrupted experiment picks up where it stopped (--fresh runs everything
again; an earlier run's files are moved aside to runs/<method>-seed<k>.replaced-<time>, never deleted).
As it goes it names the runs done and to run, and says each round that every environment reported,
with the time left (apps.experiment_progress). After each run it finishes it writes the table and
figures of the runs finished so far, so an experiment interrupted for good still has them; --report
writes them from the runs finished, running none.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from typing import IO, Any

from apps.estimate import Forecast, words
from apps.experiment_methods import (  # noqa: F401 - re-exported: the methods and settings, where they always were
    BUDGET_FIELDS, BUDGETS, BY_KEY, GROUPS, METHODS, PRETRAINED, ExperimentConfig, Method)
from apps.experiment_progress import RunProgress, roster
from apps.experiment_outputs import (  # noqa: F401 - re-exported: the files, where they always were
    plot_bytes, plot_curves, write_csv, write_outputs)
from apps.experiment_scores import (  # noqa: F401 - re-exported: the scores and table, where they always were
    WORK_PHASES, curves, mean_sd, micro_average, round_seconds, rows_at, summarise, table, upload_mb_per_round,
    work_rates, work_table)
from apps.launcher import resumes, settings
from apps.launcher import run as run_federation
from apps.planning import RunConfig
from apps.results import shortfall


def run_name(method: Method, seed: int) -> str:
    return f"{method.key}-seed{seed}"


def _finished(path: pathlib.Path, cfg: RunConfig) -> dict[str, Any] | None:
    """The results of a finished run with exactly these settings, else None (also for a run that a
    failed client or Ctrl-C ended: its results.json holds the rounds reported, but it is not done)."""
    try:
        results = json.loads((path / "results.json").read_text())
    except (OSError, ValueError):
        return None
    # Launchers before "complete" wrote results.json only for finished runs.
    # Compared as JSON holds them (a list setting is a tuple here, a list there), less --replace.
    done = settings(results.get("config") or {}) == settings(dataclasses.asdict(cfg)) and results.get("complete", True)
    if not done:
        return None
    results.setdefault("round_seconds", round_seconds(path))
    return results


def report(cfg: ExperimentConfig, methods: list[Method], runs: dict[tuple[str, int], dict[str, Any]],
           root: pathlib.Path) -> tuple[dict[str, Any], list[pathlib.Path]]:
    """The summary of the finished `runs` ((method key, seed) -> results), over the seeds and methods
    they hold, written to `root`: the summary and the files written."""
    if not runs:
        raise RuntimeError(f"--report: no run in {root / 'runs'} has finished with these settings; give the "
                           "experiment's own flags (--budget, --methods, ...)")
    seeds = sorted({s for _, s in runs})
    summary = summarise(cfg, [m for m in methods if any((m.key, s) in runs for s in seeds)], seeds, runs)
    return summary, write_outputs(summary, runs, root)


def run(cfg: ExperimentConfig, out: IO[str] = sys.stdout) -> dict[str, Any]:
    """Runs every (method, seed), then writes and returns the summary."""
    root = pathlib.Path(cfg.results)
    (root / "runs").mkdir(parents=True, exist_ok=True)
    methods = [cfg.labelled(BY_KEY[k]) for k in cfg.method_keys()]
    seeds = list(range(cfg.setting("seeds")))
    jobs = [(m, s) for s in seeds for m in methods]  # seed by seed: an early stop leaves whole seeds
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    started = time.monotonic()
    configs = {(m.key, s): cfg.run_config(m, s, root / "runs" / run_name(m, s)) for m, s in jobs}
    kept = {job: r for job, rc in configs.items() if not cfg.fresh and (r := _finished(pathlib.Path(rc.results), rc))}
    say = lambda msg: print(msg, file=out, flush=True)  # noqa: E731
    say(f"experiment: {len(methods)} methods x {len(seeds)} seeds on {', '.join(cfg.env_list())}, "
        f"{cfg.setting('rounds')} rounds, budget {cfg.budget}; runs in {root / 'runs'}/")
    forecast = Forecast(rc for job, rc in configs.items() if job not in kept)
    for line in roster([run_name(m, s) for m, s in jobs if (m.key, s) in kept],
                       [run_name(m, s) for m, s in jobs if (m.key, s) not in kept],
                       "runs not finished, left out of the report" if cfg.report else "runs to run"):
        say(line)
    if cfg.report:
        summary, written = report(cfg, methods, kept, root)
        say("\n" + summary["table"])
        say(f"\nfrom {len(kept)} finished runs; wrote {', '.join(str(p) for p in written)}")
        return summary
    say(forecast.line(f"{len(jobs) - len(kept)} of its {len(jobs)} runs to run"))
    for i, (method, seed) in enumerate(jobs, 1):
        rc = configs[method.key, seed]
        path, results = pathlib.Path(rc.results), kept.get((method.key, seed))
        ran = results is None
        if not ran:
            say(f"[{i}/{len(jobs)}] {method.name}, seed {seed}: kept from an earlier run")
        else:
            eta = f", {words(forecast.left_s())} left in all"
            say(f"[{i}/{len(jobs)}] {method.name}, seed {seed}: running{eta} (log: {path / 'progress.log'})")
            t0 = time.monotonic()
            path.mkdir(parents=True, exist_ok=True)
            # An interrupted run with these settings goes on; any other earlier run is moved aside.
            resumed = not cfg.fresh and resumes(rc)
            rc = dataclasses.replace(rc, replace=not resumed)
            with open(path / "progress.log", "w" if rc.replace else "a") as log:  # a resumed run's goes on
                follow = RunProgress(run_name(method, seed), cfg.env_list(), rc.rounds, forecast, say)
                results = run_federation(rc, out=log, on_rows=follow)
            if not results["complete"]:  # a table of runs that lost clients would compare unlike things
                raise RuntimeError(f"{method.name}, seed {seed} did not finish: {shortfall(results)}; see "
                                   f"{path / 'progress.log'} (the next fedse experiment runs it again)")
            forecast.done(None if resumed else time.monotonic() - t0)
            results.setdefault("round_seconds", round_seconds(path))
        runs[(method.key, seed)] = results
        final = micro_average(results, rc.rounds)
        say(f"    {time.monotonic() - started:6.0f}s  held-out success after round {rc.rounds}: "
            + (f"{100 * final:.1f}%" if final is not None else "-"))
        if ran and i < len(jobs):  # so an experiment interrupted for good has the table of what it finished
            report(cfg, methods, runs, root)
            say(f"    the table and figures so far, from {len(runs)} of {len(jobs)} runs: {root / 'table.md'}")
    summary, written = report(cfg, methods, runs, root)  # every run finished: every method and seed
    say("\n" + summary["table"])
    say(f"\ndone in {time.monotonic() - started:.0f}s; wrote {', '.join(str(p) for p in written)}")
    return summary
