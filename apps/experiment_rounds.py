"""`fedse experiment`'s "why, round by round" files: rounds.csv (per method, seed, environment and
round: held-out success, exploration's success rate and what it kept, the buffer, the training loss,
as each run's client reported them) and why.png (those per round and method, mean over seeds with
the seeds' min..max as a band), to show where Fed-SE's data advantage comes from, or why it does not."""

from __future__ import annotations

import csv
import pathlib
import statistics
from typing import Any

from apps.experiment_methods import BY_KEY, METHODS
from apps.experiment_scores import micro_average

FIELDS = ("test_success", "explore_success", "kept", "buffer", "train_loss")

# why.png's panels: (metric, y label, scale); held-out success is micro-averaged over test tasks,
# the client metrics are the mean over environments (a Centralized client's envs share its values).
PANELS = (("test_success", "held-out success (%)", 100.0),
          ("kept", "trajectories exploration kept", 1.0),
          ("buffer", "buffer size (trajectories)", 1.0),
          ("train_loss", "training loss", 1.0))


def _ordered(runs: dict[tuple[str, int], dict[str, Any]]) -> list[tuple[str, int]]:
    """The runs' (method key, seed) in the methods' order, then by seed."""
    order = {m.key: i for i, m in enumerate(METHODS)}
    return sorted(runs, key=lambda job: (order.get(job[0], len(order)), job[0], job[1]))


def write_rounds_csv(runs: dict[tuple[str, int], dict[str, Any]], path: pathlib.Path) -> None:
    """One row per method, seed, environment and round; a metric the round did not report is empty."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "seed", "env", "round", *FIELDS])
        for key, seed in _ordered(runs):
            for env, rows in sorted(runs[key, seed]["envs"].items()):
                for r in sorted(rows, key=lambda row: row["round"]):
                    w.writerow([BY_KEY[key].name, seed, env, r["round"], *(r.get(f, "") for f in FIELDS)])


def run_value(results: dict[str, Any], metric: str, round_: int) -> float | None:
    """One run's value of `metric` for `round_`: held-out success micro-averaged over every
    environment's test tasks, any other metric the mean over the environments reporting it."""
    if metric == "test_success":
        return micro_average(results, round_)
    found = [r[metric] for rows in results["envs"].values() for r in rows if r["round"] == round_ and metric in r]
    return statistics.mean(found) if found else None


def series(runs: dict[tuple[str, int], dict[str, Any]], metric: str) -> dict[str, dict[int, list[float]]]:
    """Method name -> round -> the seeds' values of `metric` (rounds no seed reported are left out)."""
    out: dict[str, dict[int, list[float]]] = {}
    for key, seed in _ordered(runs):
        results = runs[key, seed]
        rounds = sorted({r["round"] for rows in results["envs"].values() for r in rows})
        per_round = out.setdefault(BY_KEY[key].name, {})
        for t in rounds:
            value = run_value(results, metric, t)
            if value is not None:
                per_round.setdefault(t, []).append(value)
    return out


def plot_why(runs: dict[tuple[str, int], dict[str, Any]], path: pathlib.Path,
             subtitle: str = "") -> dict[str, list[str]]:
    """The 2x2 panels of PANELS, one line per method (mean over seeds, band = min..max). Returns per
    panel's metric the methods it drew a line for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(dict.fromkeys(BY_KEY[key].name for key, _ in _ordered(runs)))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colours = {name: cmap(i % cmap.N) for i, name in enumerate(names)}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.2), squeeze=False)
    drawn: dict[str, list[str]] = {}
    for ax, (metric, label, scale) in zip(axes.flat, PANELS):
        for name, per_round in series(runs, metric).items():
            if not per_round:
                continue
            xs = sorted(per_round)
            mean_band(ax, xs, [[scale * v for v in per_round[t]] for t in xs], name, colours[name])
        drawn[metric] = ax.get_legend_handles_labels()[1]
        ax.set_ylabel(label)
        ax.set_xlabel("round (0 = base model)" if metric == "test_success" else "round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colours[n], marker="o", markersize=3) for n in names]
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), frameon=False)
    fig.suptitle("Why, round by round: mean over seeds, band = min..max; client metrics averaged over "
                 "environments" + (f" ({subtitle})" if subtitle else ""), fontsize=10)
    legend_rows = -(-len(names) // 4)
    fig.tight_layout(rect=(0, 0.02 + 0.03 * legend_rows, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def mean_band(ax: Any, xs: list[int], vals: list[list[float]], label: str, color: Any = None) -> None:
    """One method's line on `ax`: the mean of each x's values, and their min..max as a band where an x
    has more than one (the seeds')."""
    ax.plot(xs, [statistics.mean(v) for v in vals], marker="o", markersize=3, label=label, color=color)
    if any(len(v) > 1 for v in vals):
        ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], alpha=0.15, color=color)


def write_rounds(summary: dict[str, Any], runs: dict[tuple[str, int], dict[str, Any]],
                 root: pathlib.Path) -> None:
    """rounds.csv and why.png in `root`."""
    write_rounds_csv(runs, root / "rounds.csv")
    plot_why(runs, root / "why.png", f"{summary['base_model']}, budget {summary['budget']}")
