"""`fedse experiment`'s scores: each run's held-out success per environment and round, micro-averaged
over test tasks, its bytes and model throughput; the summary of every method over seeds, and the
paper-style markdown table of it (mean +- sd over seeds, gains as paired differences per seed)."""

from __future__ import annotations

import json
import math
import pathlib
import statistics
from typing import Any, Iterable

from apps.experiment_methods import PRETRAINED, ExperimentConfig, Method
from apps.results import round_mean


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
        by_seed = [runs.get((key, s)) for s in seeds]  # None where a seed did not run: pairs stay by seed
        per_seed = [r for r in by_seed if r]
        if not per_seed:
            return
        env_values = {e: [rows_at(r, round_).get(e, {}).get("test_success") if r else None for r in by_seed]
                      for e in envs}
        scored[name] = {"group": group, "key": key, "round": round_, "env": env_values,
                        "avg": [micro_average(r, round_) if r else None for r in by_seed],
                        "mb_per_round": statistics.mean(upload_mb_per_round(r) for r in per_seed)
                        if round_ else 0.0,
                        "work": [work_rates(r) for r in per_seed],
                        "s_per_round": [statistics.mean(r["round_seconds"]) for r in per_seed
                                        if r.get("round_seconds") and round_]}

    if "fedse" in cfg.method_keys():
        score(PRETRAINED, "main", "fedse", 0)
    for m in methods:
        score(m.name, m.group, m.key, last)
    summary = {"envs": envs, "seeds": seeds, "rounds": last, "budget": cfg.budget, "base_model": cfg.base_model,
               "methods": scored, "curves": curves(methods, seeds, runs, envs, last)}
    summary["table"] = table(summary)
    return summary


def _paired(a: list[float | None], b: list[float | None]) -> list[float]:
    """a - b seed by seed, where both seeds have a value."""
    return [x - y for x, y in zip(a, b) if x is not None and y is not None]


def _cell(values: Iterable[float | None], signed: bool = False) -> str:
    """The values' mean as a percentage, ± their spread where there are two or more (the seeds'); a
    difference (signed) no larger than its spread is marked "≈": the seeds cannot tell it from noise."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return "-"
    mean, sd = mean_sd(xs)
    value = round(100 * mean, 1) + 0.0  # + 0.0: no "-0.0"
    text = f"{value:+.1f}" if signed else f"{value:.1f}"
    if len(xs) < 2:
        return text
    noise = " ≈" if signed and abs(mean) <= sd else ""
    return f"{text} ± {100 * sd:.1f}{noise}"


def row_label(name: str, per_seed: list[float | None], seeds: list[int]) -> str:
    """A row's name, with the seeds it ran on (a value in `per_seed`) where that is fewer than the
    table's: its mean and spread are over those alone (its differences are paired by seed, so over those too)."""
    return seeds_label(name, [seed for seed, v in zip(seeds, per_seed) if v is not None], seeds)


def seeds_label(name: str, ran: list[int], seeds: list[int]) -> str:
    """`name`, naming the seeds in `ran` where they are fewer than all of `seeds`."""
    return name if len(ran) == len(seeds) else f"{name} (seed{'s' * (len(ran) > 1)} {', '.join(map(str, ran))})"


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
    main = [(name, s) for name, s in scored.items() if s["group"] == "main"]
    if not main:
        lines = lines[:2]  # no method of the paper's table ran: only the other tables
    for name, s in main:
        gain = _cell(_paired(s["avg"], base["avg"]), signed=True) if base and name != PRETRAINED else "-"
        cells = " | ".join(_cell(s["env"][e]) for e in envs)
        lines.append(f"| {row_label(name, s['avg'], summary['seeds'])} | {cells} | {_cell(s['avg'])} | {gain} |")
    ref = scored.get("Fed-SE")
    if ref and "FedIT" in scored:  # the paper's claim: self-evolution above static federated tuning
        lines += ["", f"Fed-SE - FedIT: {_cell(_paired(ref['avg'], scored['FedIT']['avg']), signed=True)} "
                      "points on the average (paired over seeds)."]
    lines += round_table(summary)
    for group, head, fedse in (("ablation", "Variant", "Fed-SE (rank 8)"), ("selection", "Selector", "Fed-SE (all)"),
                               ("variants", "Within the method", "Fed-SE"),
                               ("ranks", "Mixed ranks", "Fed-SE (every client at rank 8)")):
        variants = [name for name, s in scored.items() if s["group"] == group]
        if not variants:
            continue
        # A change within Fed-SE is after the paper's claim too: above FedIT by more than the seeds' spread.
        fedit = scored.get("FedIT") if group == "variants" else None
        columns = " | Avg. | Δ vs Fed-SE |" + (" Δ vs FedIT |" if fedit else "") + " MB sent / client / round |"
        lines += ["", f"| {head} | " + " | ".join(envs) + columns, "|---|" + "---:|" * (len(envs) + 3 + bool(fedit))]
        for name in (["Fed-SE"] if ref else []) + variants:
            s = scored[name]
            gain = _cell(_paired(s["avg"], ref["avg"]), signed=True) if ref and name != "Fed-SE" else "-"
            over = f" {_cell(_paired(s['avg'], fedit['avg']), signed=True)} |" if fedit else ""
            label = row_label(fedse if name == "Fed-SE" else name, s["avg"], summary["seeds"])
            lines.append(f"| {label} | " + " | ".join(_cell(s["env"][e]) for e in envs)
                         + f" | {_cell(s['avg'])} | {gain} |{over} {s['mb_per_round']:.2f} |")
        timed = [f"{name} {statistics.mean(scored[name]['s_per_round']):.1f} s" for name in variants
                 if scored[name]["s_per_round"]]
        if group == "selection" and timed:
            lines += ["", "Seconds a round (FedBuff: a version) as the aggregator timed it: " + ", ".join(timed) + "."]
    return "\n".join(lines + work_table(scored))


def round_table(summary: dict[str, Any]) -> list[str]:
    """The average's held-out success round by round (at most 11 rounds shown, the last always), per
    method, and Fed-SE - FedIT paired over seeds where both ran; nothing for a run of one round."""
    last, curves = summary["rounds"], summary["curves"]
    if last < 2 or not curves:
        return []
    step = math.ceil(last / 10)
    shown = sorted(set(range(0, last + 1, step)) | {last})

    def cells(values_of: Any, signed: bool = False) -> str:
        return " | ".join(_cell(values_of(t), signed) for t in shown)

    lines = ["", f"Avg. held-out success (%) by round, mean ± sd over {len(summary['seeds'])} seed(s); round 0 is "
                 "the base model:", "", "| Method | " + " | ".join(str(t) for t in shown) + " |",
             "|---|" + "---:|" * len(shown)]
    lines += [f"| {name} | {cells(lambda t: by_env['Avg.'][t])} |" for name, by_env in curves.items()]
    if "Fed-SE" in curves and "FedIT" in curves:
        se, it = curves["Fed-SE"]["Avg."], curves["FedIT"]["Avg."]
        lines.append(f"| Fed-SE - FedIT | {cells(lambda t: _paired(se[t], it[t]), signed=True)} |")
    return lines + late_table(summary)


LATE_ROUNDS = 5  # the rounds late_table averages: a final round alone moves by a few tasks from one to the next


def late_table(summary: dict[str, Any]) -> list[str]:
    """Each method's average over the last LATE_ROUNDS rounds (a mean per seed, then mean ± sd over
    seeds) and its difference from FedIT's, paired by seed: a less noisy reading of where the methods
    end than the final round alone; nothing for runs of fewer than twice as many rounds."""
    last, curves, seeds = summary["rounds"], summary["curves"], summary["seeds"]
    if last < 2 * LATE_ROUNDS or not curves:
        return []
    window = range(last - LATE_ROUNDS + 1, last + 1)

    def per_seed(name: str) -> list[float | None]:  # None where a round of the window has no value
        avg = curves[name]["Avg."]
        values = [[avg[t][i] for t in window] for i in range(len(seeds))]
        return [None if None in v else statistics.mean(v) for v in values]

    late = {name: per_seed(name) for name in curves}
    fedit = late.get("FedIT")
    lines = ["", f"Avg. held-out success (%) over rounds {window[0]}-{last}: each seed's mean of the last "
                 f"{LATE_ROUNDS} rounds, then mean ± sd over seeds" + ("; Δ paired by seed:" if fedit else ":"),
             "", "| Method | Avg. |" + (" Δ vs FedIT |" if fedit else ""), "|---|---:|" + ("---:|" if fedit else "")]
    for name, values in late.items():
        over = "-" if name == "FedIT" else _cell(_paired(values, fedit), signed=True) if fedit else ""
        lines.append(f"| {row_label(name, values, seeds)} | {_cell(values)} |" + (f" {over} |" if fedit else ""))
    return lines


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
    head = ["", "Model throughput, tokens/s (MFU against this machine's measured matmul peak), mean over seeds and "
                "client rounds:", "", "| Method | " + " | ".join(WORK_PHASES) + " |",
            "|---|" + "---:|" * len(WORK_PHASES)]
    return head + [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]


def curves(methods: list[Method], seeds: list[int], runs: dict[tuple[str, int], dict[str, Any]],
           envs: list[str], last: int) -> dict[str, dict[str, list[list[float | None]]]]:
    """method name -> env (and "Avg.") -> per round, the values over seeds (None where a seed has none)."""
    out: dict[str, dict[str, list[list[float | None]]]] = {}
    for m in methods:
        per_seed = [runs.get((m.key, s)) for s in seeds]  # None where a seed did not run: pairs stay by seed
        if not any(per_seed):
            continue
        by_env: dict[str, list[list[float | None]]] = {}
        for e in envs:
            by_env[e] = [[rows_at(r, t).get(e, {}).get("test_success") if r else None for r in per_seed]
                         for t in range(last + 1)]
        by_env["Avg."] = [[micro_average(r, t) if r else None for r in per_seed] for t in range(last + 1)]
        out[m.name] = by_env
    return out


def round_seconds(folder: pathlib.Path) -> list[float]:
    """A run's rounds (FedBuff's versions), each as long as its aggregator timed it (the state's run.json)."""
    out: list[float] = []
    for path in sorted(folder.glob("state/aggregator*/*/run.json")):
        try:
            out += [float(x) for x in json.loads(path.read_text()).get("round_seconds", [])]
        except (OSError, ValueError, TypeError):
            continue
    return out
