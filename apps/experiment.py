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
client at rank 8.

All methods share seeds, tasks and budgets: for each seed the runs start from the same base model
and phi_0 and see the same training and test tasks. The score of a run is the held-out success of
its last global adapter phi_T; an environment's average is micro-averaged over test tasks. Each
method runs once per seed and the table shows mean +- sample standard deviation over seeds.

Output in --results: table.md (the paper's layout), results.csv (every run, environment and
round), methods.png, ablations.png, selectors.png and ranks.png (success per round per environment), bytes.png (adapter
bytes each client sends per round), and runs/<method>-seed<k>/ with each run's own results and
logs. A run whose results.json exists with the same settings is not run again, and one it
interrupted resumes, so an interrupted experiment picks up where it stopped (--fresh runs everything
again; an earlier run's files are moved aside to runs/<method>-seed<k>.replaced-<time>, never deleted).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from typing import IO, Any, Iterable

from fedse.config import ALL, ConfigError, Count, field, refuse_zero
from apps.estimate import Forecast, words
from apps.launcher import resumes, settings
from apps.launcher import run as run_federation
from apps.planning import RunConfig
from apps.results import round_mean, shortfall
from fedse.model.pretrained import check_base_model


@dataclasses.dataclass(frozen=True)
class Method:
    key: str  # what --methods names
    name: str  # what the table shows
    group: str  # "main" (Table 1) or "ablation"
    settings: dict[str, Any]  # the RunConfig fields that make it differ from Fed-SE


METHODS: tuple[Method, ...] = (
    Method("local", "Local", "main", {"topology": "local", "explore_tasks": 0}),
    Method("centralized", "Centralized", "main", {"topology": "centralized", "explore_tasks": 0}),
    Method("fedit", "FedIT", "main", {"explore_tasks": 0}),
    Method("fedse", "Fed-SE", "main", {}),
    Method("no-filter", "w/o success filter", "ablation", {"keep": "all"}),
    Method("no-history", "w/o history", "ablation", {"history": "round"}),
    Method("weighted", "weighted averaging", "ablation", {"strategy": "weighted"}),
    Method("rank2", "LoRA rank 2", "ablation", {"lora_r": 2, "lora_alpha": 4}),
    Method("rank4", "LoRA rank 4", "ablation", {"lora_r": 4, "lora_alpha": 8}),
    Method("rank16", "LoRA rank 16", "ablation", {"lora_r": 16, "lora_alpha": 32}),
    # Fed-SE with half the clients a round, chosen by each selector (Fed-SE itself takes every client).
    Method("sample", "sample half", "selection", {"selector": "sample", "selection_fraction": 0.5}),
    Method("utility", "utility (Oort) half", "selection", {"selector": "utility", "selection_fraction": 0.5}),
    Method("agent-tools", "agent-tools half", "selection", {"selector": "agent-tools", "selection_fraction": 0.5}),
    Method("agent-llm", "agent-llm half", "selection", {"selector": "agent-llm", "selection_fraction": 0.5}),
    # Fed-SE with clients at mixed LoRA ranks (4, 16, 8 in turn; Fed-SE itself: every client at rank 8).
    Method("hlora", "hlora, ranks 4/16/8", "ranks", {"strategy": "hlora", "lora_ranks": "4,16,8"}),
    Method("zero-pad", "zero-pad, ranks 4/16/8", "ranks", {"strategy": "zero-pad", "lora_ranks": "4,16,8"}),
    Method("flexlora", "flexlora, ranks 4/16/8", "ranks", {"strategy": "flexlora", "lora_ranks": "4,16,8"}),
)
BY_KEY = {m.key: m for m in METHODS}
# What --methods accepts besides method keys.
GROUPS = {"all": [m.key for m in METHODS if m.group not in ("selection", "ranks")],
          "selectors": ["fedse"] + [m.key for m in METHODS if m.group == "selection"],
          "ranks": ["fedse", "hlora", "zero-pad"]}
PRETRAINED = "Pre-trained"

# Budgets: what a run of each method costs. "quick" is sized to finish every method for every seed
# in under 15 minutes on a 2-core CPU machine with the embedded tiny model; "cpu-real" runs the
# paper's table (no ablations) with SmolLM2-135M on a 2-core CPU in about 2 hours; "full" is for a
# GPU machine and a real model (--base-model /path/to/model): all five environments and all test tasks.
BUDGETS: dict[str, dict[str, Any]] = {
    "quick": {"envs": "maze,wordle?vocab_size=30", "methods": "all", "seeds": 2, "rounds": 3, "expert_demos": 10,
              "explore_tasks": 16, "eval_tasks": ALL, "epochs": 2, "lr": 3e-3},
    "cpu-real": {"envs": "maze,babyai", "methods": "local,centralized,fedit,fedse", "seeds": 1, "rounds": 1,
                 "expert_demos": 10, "explore_tasks": 8, "eval_tasks": 10, "epochs": 2, "lr": 2e-3},
    "full": {"envs": "babyai,webshop,textcraft,maze,wordle", "methods": "all", "seeds": 3, "rounds": 5,
             "expert_demos": 20, "explore_tasks": 32, "eval_tasks": ALL, "epochs": 2, "lr": 3e-3},
}
BUDGET_FIELDS = ("envs", "seeds", "rounds", "expert_demos", "explore_tasks", "eval_tasks", "epochs")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Runs Pre-trained, Local, Centralized, FedIT, Fed-SE and Fed-SE's ablations over several seeds and
    writes the paper-style table, a CSV and plots. Numbers left at -1 (or empty) take the budget's."""

    budget: str = field("quick", "'quick' (under 15 min on a 2-core CPU with the tiny model), 'cpu-real' "
                                 "(SmolLM2-135M on a 2-core CPU, the paper's table without ablations, about two "
                                 "hours) or 'full' (GPU machine, real model: all five environments, all test tasks)")
    methods: str = field("", "comma-separated subset of: " + ", ".join(m.key for m in METHODS)
                             + " ('all' = the paper's methods and ablations; 'selectors' = fedse and the client "
                               "selectors, each taking half the clients a round; 'ranks' = fedse at rank 8 beside "
                               "hlora and zero-pad with clients at ranks 4, 16 and 8; Pre-trained comes with fedse; "
                               "'' = the budget's)")
    results: str = field("results/experiment", "folder for table.md, results.csv, the plots and each run")
    base_model: str = field("fedse-tiny", "'fedse-tiny' (built in code) or a local Hugging Face model directory "
                                          "(`make model` writes models/smollm2-135m-instruct)")
    lr: float = field(-1.0, "client learning rate (the paper's 5e-5 suits 7B models; -1 = the budget's)")
    envs: str = field("", "environment specs, one client each, as fedse run --envs takes them ('' = the budget's)")
    seeds: int = field(-1, "repeats with seeds 0..N-1 (-1 = the budget's)")
    rounds: int = field(-1, "federated rounds T (-1 = the budget's)")
    expert_demos: int = field(-1, "expert demonstrations per environment (-1 = the budget's)")
    explore_tasks: int = field(-1, "Fed-SE's exploration tasks per client and round (-1 = the budget's)")
    eval_tasks: Count = field(-1, "held-out test tasks per environment, or 'all' (-1 = the budget's)")
    epochs: int = field(-1, "training epochs per round (-1 = the budget's)")
    fresh: bool = field(False, "run every method again even where a finished run with the same settings exists")

    def __post_init__(self) -> None:
        if self.budget not in BUDGETS:
            raise ConfigError(f"--budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}")
        unknown = [k for k in self.method_keys() if k not in BY_KEY]
        if unknown:
            raise ConfigError(f"--methods: unknown {', '.join(unknown)}; choose from "
                              f"{', '.join(m.key for m in METHODS)}, 'all', 'selectors' or 'ranks'")
        if not self.method_keys():
            raise ConfigError("--methods is empty: name at least one method, or 'all'")
        if self.lr != -1 and not self.lr > 0:
            raise ConfigError(f"--lr must be positive (or -1: the budget's, {BUDGETS[self.budget]['lr']}), got {self.lr}")
        for name in BUDGET_FIELDS:
            value = getattr(self, name)
            if name != "envs" and value < -1:
                raise ConfigError(f"--{name.replace('_', '-')} must be -1 (the budget's) or at least 0, got {value}")
        refuse_zero(self.eval_tasks, "--eval-tasks", "test task evaluated")
        if self.setting("seeds") < 1 or self.setting("rounds") < 1:
            raise ConfigError("--seeds and --rounds must be at least 1")
        check_base_model(self.base_model)

    def method_keys(self) -> list[str]:
        methods = self.setting("methods").strip()
        keys = [k.strip() for k in methods.split(",") if k.strip()]
        return list(dict.fromkeys(k for key in keys for k in GROUPS.get(key, [key])))

    def setting(self, name: str) -> Any:
        """A budget field: the flag's value if given, else the budget's."""
        value = getattr(self, name)
        return BUDGETS[self.budget][name] if value in (-1, "") else value

    def env_list(self) -> list[str]:
        """The environments' names (a spec's options are not part of its name)."""
        from services.env_server.registry import RegistryError, parse_specs

        try:
            return [spec.name for spec in parse_specs(self.setting("envs"))]
        except RegistryError as exc:
            raise ConfigError(f"--envs: {exc}") from None

    def run_config(self, method: Method, seed: int, results: pathlib.Path) -> RunConfig:
        common = {name: self.setting(name) for name in BUDGET_FIELDS if name != "seeds"}
        return RunConfig(results=str(results), base_model=self.base_model, lr=self.setting("lr"), seed=seed,
                         run_name=method.key, **{**common, **method.settings})


# ---- running ---------------------------------------------------------------------------------------
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
    return results if done else None


def run(cfg: ExperimentConfig, out: IO[str] = sys.stdout) -> dict[str, Any]:
    """Runs every (method, seed), then writes and returns the summary."""
    root = pathlib.Path(cfg.results)
    (root / "runs").mkdir(parents=True, exist_ok=True)
    methods = [BY_KEY[k] for k in cfg.method_keys()]
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
    say(forecast.line(f"{len(jobs) - len(kept)} of its {len(jobs)} runs to run"))
    for i, (method, seed) in enumerate(jobs, 1):
        rc = configs[method.key, seed]
        path, results = pathlib.Path(rc.results), kept.get((method.key, seed))
        if results is not None:
            say(f"[{i}/{len(jobs)}] {method.name}, seed {seed}: kept from an earlier run")
        else:
            eta = f", {words(forecast.left_s())} left in all"
            say(f"[{i}/{len(jobs)}] {method.name}, seed {seed}: running{eta} (log: {path / 'progress.log'})")
            t0 = time.monotonic()
            path.mkdir(parents=True, exist_ok=True)
            # An interrupted run with these settings goes on; any other earlier run is moved aside.
            rc = dataclasses.replace(rc, replace=cfg.fresh or not resumes(rc))
            with open(path / "progress.log", "w") as log:
                results = run_federation(rc, out=log)
            if not results["complete"]:  # a table of runs that lost clients would compare unlike things
                raise RuntimeError(f"{method.name}, seed {seed} did not finish: {shortfall(results)}; see "
                                   f"{path / 'progress.log'} (the next fedse experiment runs it again)")
            forecast.done(time.monotonic() - t0)
        runs[(method.key, seed)] = results
        final = micro_average(results, rc.rounds)
        say(f"    {time.monotonic() - started:6.0f}s  held-out success after round {rc.rounds}: "
            + (f"{100 * final:.1f}%" if final is not None else "-"))
    summary = summarise(cfg, methods, seeds, runs)
    write_outputs(summary, runs, root)
    say("\n" + summary["table"])
    say(f"\ndone in {time.monotonic() - started:.0f}s; wrote {root / 'table.md'}, {root / 'results.csv'}, "
        f"{root / 'methods.png'}, {root / 'ablations.png'}, {root / 'bytes.png'}")
    return summary


# ---- scores ----------------------------------------------------------------------------------------
def rows_at(results: dict[str, Any], round_: int) -> dict[str, dict[str, float]]:
    """env -> that environment's metrics row for `round_` (envs without one are left out)."""
    out = {}
    for env, rows in results["envs"].items():
        row = next((r for r in rows if r["round"] == round_ and "test_success" in r), None)
        if row is not None:
            out[env] = row
    return out


def micro_average(results: dict[str, Any], round_: int) -> float | None:
    """Successes over test tasks across every environment of a run, for `round_`'s global adapter."""
    return round_mean(results["envs"], list(results["envs"]), round_)


def mean_sd(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value); NaN mean for none."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return math.nan, math.nan
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def upload_mb_per_round(results: dict[str, Any]) -> float:
    """Mean MB (10^6 bytes) one client sent the aggregator per round."""
    sent = [r["upload_bytes"] for rows in results["envs"].values() for r in rows if "upload_bytes" in r]
    return statistics.mean(sent) / 1e6 if sent else math.nan


WORK_PHASES = ("eval", "explore", "train")


def work_rates(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per phase, the mean over a run's client rounds of tokens/s and MFU (where reported): how fast
    its model ran (work.py counts what)."""
    rows = [r for rows in results["envs"].values() for r in rows]
    out: dict[str, dict[str, float]] = {}
    for phase in WORK_PHASES:
        for key in ("tokens_per_s", "mfu"):
            got = [r[f"{phase}_{key}"] for r in rows if f"{phase}_{key}" in r]
            if got:
                out.setdefault(phase, {})[key] = statistics.mean(got)
    return out


def summarise(cfg: ExperimentConfig, methods: list[Method], seeds: list[int],
              runs: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """Per method: per-seed final success per env and micro average, gains, bytes; plus the table."""
    envs = cfg.env_list()
    last = cfg.setting("rounds")
    scored: dict[str, dict[str, Any]] = {}

    def score(name: str, group: str, key: str, round_: int) -> None:
        per_seed = [runs[(key, s)] for s in seeds if (key, s) in runs]
        if not per_seed:
            return
        env_values = {e: [rows_at(r, round_).get(e, {}).get("test_success") for r in per_seed] for e in envs}
        scored[name] = {"group": group, "key": key, "round": round_, "env": env_values,
                        "avg": [micro_average(r, round_) for r in per_seed],
                        "mb_per_round": statistics.mean(upload_mb_per_round(r) for r in per_seed)
                        if round_ else 0.0,
                        "work": [work_rates(r) for r in per_seed]}

    if "fedse" in cfg.method_keys():
        score(PRETRAINED, "main", "fedse", 0)
    for m in methods:
        score(m.name, m.group, m.key, last)
    summary = {"envs": envs, "seeds": seeds, "rounds": last, "budget": cfg.budget, "base_model": cfg.base_model,
               "methods": scored, "curves": curves(methods, seeds, runs, envs, last)}
    summary["table"] = table(summary)
    return summary


def _paired_gain(a: list[float | None], b: list[float | None]) -> tuple[float, float]:
    return mean_sd(x - y for x, y in zip(a, b) if x is not None and y is not None)


def _cell(mean: float, sd: float, n: int, signed: bool = False) -> str:
    """A percentage, ± the spread over seeds; a difference (signed) no larger than its spread is
    marked "≈": the seeds cannot tell it from noise."""
    if math.isnan(mean):
        return "-"
    value = round(100 * mean, 1) + 0.0  # + 0.0: no "-0.0"
    text = f"{value:+.1f}" if signed else f"{value:.1f}"
    if n < 2:
        return text
    noise = " ≈" if signed and abs(mean) <= sd else ""
    return f"{text} ± {100 * sd:.1f}{noise}"


def table(summary: dict[str, Any]) -> str:
    """Markdown: Table 1's layout (methods x environments, the average, the gain over Pre-trained),
    then the ablations beside Fed-SE with the bytes each client sends per round."""
    envs, n, scored = summary["envs"], len(summary["seeds"]), summary["methods"]
    head = "| Method | " + " | ".join(envs) + " | Avg. | Δ vs Pre-trained |"
    rule = "|---|" + "---:|" * (len(envs) + 2)
    lines = [f"Held-out success (%) after round {summary['rounds']}, mean ± sd over {n} seed(s); "
             f"Avg. micro-averaged over test tasks; Δ: paired difference per seed, ≈ where it is no larger "
             f"than its sd (noise); {summary['base_model']}, budget {summary['budget']}.", "", head, rule]
    base = scored.get(PRETRAINED)
    for name, s in scored.items():
        if s["group"] != "main":
            continue
        gain = _cell(*_paired_gain(s["avg"], base["avg"]), n, signed=True) if base and name != PRETRAINED else "-"
        lines.append(f"| {name} | " + " | ".join(_cell(*mean_sd(s["env"][e]), n) for e in envs)
                     + f" | {_cell(*mean_sd(s['avg']), n)} | {gain} |")
    ref = scored.get("Fed-SE")
    for group, head, fedse in (("ablation", "Variant", "Fed-SE (rank 8)"), ("selection", "Selector", "Fed-SE (all)"),
                               ("ranks", "Mixed ranks", "Fed-SE (every client at rank 8)")):
        variants = [name for name, s in scored.items() if s["group"] == group]
        if not variants:
            continue
        lines += ["", f"| {head} | " + " | ".join(envs) + " | Avg. | Δ vs Fed-SE | MB sent / client / round |",
                  "|---|" + "---:|" * (len(envs) + 3)]
        for name in (["Fed-SE"] if ref else []) + variants:
            s = scored[name]
            gain = _cell(*_paired_gain(s["avg"], ref["avg"]), n, signed=True) if ref and name != "Fed-SE" else "-"
            label = fedse if name == "Fed-SE" else name
            lines.append(f"| {label} | " + " | ".join(_cell(*mean_sd(s["env"][e]), n) for e in envs)
                         + f" | {_cell(*mean_sd(s['avg']), n)} | {gain} | {s['mb_per_round']:.2f} |")
    return "\n".join(lines + work_table(scored))


def work_table(scored: dict[str, Any]) -> list[str]:
    """The model's throughput per method and phase, tokens/s (MFU), means over seeds and client
    rounds; no lines where no run reported any."""
    def cell(s: dict[str, Any], phase: str) -> str:
        rates = [w[phase]["tokens_per_s"] for w in s.get("work", []) if phase in w]
        if not rates:
            return "-"
        mfu = [w[phase]["mfu"] for w in s["work"] if "mfu" in w.get(phase, {})]
        return f"{statistics.mean(rates):,.0f}" + (f" ({100 * statistics.mean(mfu):.0f}%)" if mfu else "")

    rows = [(name, [cell(s, p) for p in WORK_PHASES]) for name, s in scored.items() if name != PRETRAINED]
    rows = [(name, cells) for name, cells in rows if any(c != "-" for c in cells)]
    if not rows:
        return []
    return ["", "Model throughput, tokens/s (MFU against this machine's measured matmul peak), mean over seeds and "
                "client rounds:", "", "| Method | " + " | ".join(WORK_PHASES) + " |", "|---|" + "---:|" * len(WORK_PHASES)] \
        + [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]


def curves(methods: list[Method], seeds: list[int], runs: dict[tuple[str, int], dict[str, Any]],
           envs: list[str], last: int) -> dict[str, dict[str, list[list[float | None]]]]:
    """method name -> env (and "Avg.") -> per round, the values over seeds."""
    out: dict[str, dict[str, list[list[float | None]]]] = {}
    for m in methods:
        per_seed = [runs[(m.key, s)] for s in seeds if (m.key, s) in runs]
        by_env: dict[str, list[list[float | None]]] = {}
        for e in envs:
            by_env[e] = [[rows_at(r, t).get(e, {}).get("test_success") for r in per_seed] for t in range(last + 1)]
        by_env["Avg."] = [[micro_average(r, t) for r in per_seed] for t in range(last + 1)]
        out[m.name] = by_env
    return out


# ---- files -----------------------------------------------------------------------------------------
def write_outputs(summary: dict[str, Any], runs: dict[tuple[str, int], dict[str, Any]],
                  root: pathlib.Path) -> None:
    (root / "table.md").write_text(summary["table"] + "\n")
    write_csv(runs, root / "results.csv")
    plot_curves(summary, [m.name for m in METHODS if m.group == "main"], root / "methods.png",
                "Local, Centralized, FedIT and Fed-SE")
    plot_curves(summary, ["Fed-SE"] + [m.name for m in METHODS if m.group == "ablation"], root / "ablations.png",
                "Fed-SE and its ablations")
    if any(s["group"] == "selection" for s in summary["methods"].values()):
        plot_curves(summary, ["Fed-SE"] + [m.name for m in METHODS if m.group == "selection"],
                    root / "selectors.png", "Fed-SE (every client a round) and the selectors (half)")
    if any(s["group"] == "ranks" for s in summary["methods"].values()):
        plot_curves(summary, ["Fed-SE"] + [m.name for m in METHODS if m.group == "ranks"],
                    root / "ranks.png", "Fed-SE (every client at rank 8) and mixed ranks 4/16/8")
    plot_bytes(summary, root / "bytes.png")
    (root / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "table"}, indent=1))


def write_csv(runs: dict[tuple[str, int], dict[str, Any]], path: pathlib.Path) -> None:
    """One row per method, seed, environment and round (`runs`: (method key, seed) -> run results)."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "seed", "env", "round", "test_success", "test_tasks", "upload_bytes"])
        for (key, seed), results in sorted(runs.items(), key=lambda item: item[0][1]):
            for env, rows in results["envs"].items():
                for r in rows:
                    w.writerow([BY_KEY[key].name, seed, env, r["round"], r.get("test_success", ""),
                                r.get("test_tasks", ""), r.get("upload_bytes", "")])


def plot_curves(summary: dict[str, Any], names: list[str], path: pathlib.Path, title: str) -> None:
    """One panel per environment and one for the average: mean success per round, band = seeds' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = summary["envs"] + ["Avg."]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False, sharey=True)
    shown = [n for n in names if n in summary["curves"]]
    for ax, panel in zip(axes.flat, panels):
        for name in shown:
            per_round = summary["curves"][name][panel]
            xs = [t for t, vals in enumerate(per_round) if any(v is not None for v in vals)]
            vals = [[100 * v for v in per_round[t] if v is not None] for t in xs]
            ax.plot(xs, [statistics.mean(v) for v in vals], marker="o", markersize=3, label=name)
            if len(summary["seeds"]) > 1:
                ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], alpha=0.15)
        ax.set_title(panel)
        ax.set_xlabel("round (0 = base model)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("held-out success (%)")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False)
    fig.suptitle(f"{title}: mean over {len(summary['seeds'])} seed(s), band = min..max "
                 f"({summary['base_model']}, budget {summary['budget']})", fontsize=10)
    legend_rows = -(-len(labels) // 4)
    fig.tight_layout(rect=(0, (0.025 + 0.05 * legend_rows) / rows, 1, 1 - 0.05 / rows))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bytes(summary: dict[str, Any], path: pathlib.Path) -> None:
    """MB each client sends the aggregator per round, per method (a download of phi_t is the same size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [(name, s["mb_per_round"]) for name, s in summary["methods"].items()
             if name != PRETRAINED and not math.isnan(s["mb_per_round"])]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar([n for n, _ in items], [mb for _, mb in items], color="tab:blue")
    ax.bar_label(bars, labels=[f"{mb:.2f}" for _, mb in items], fontsize=8)
    ax.set_ylabel("MB sent per client per round")
    ax.set_title(f"Adapter bytes per round ({summary['base_model']})", fontsize=10)
    ax.tick_params(axis="x", rotation=30)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
