"""`fedse experiment`'s "why, round by round" files: rounds.csv (per method, seed, environment and
round: held-out success, exploration's success rate and what it kept, the buffer, the training loss,
as each run's client reported them), why.png (those per round and method, mean over seeds with
the seeds' min..max as a band) and why-envs.png (the same for each environment), to show where Fed-SE's data advantage comes from, or why it does not."""

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


def run_value(results: dict[str, Any], metric: str, round_: int, env: str | None = None) -> float | None:
    """One run's value of `metric` for `round_`: held-out success micro-averaged over every
    environment's test tasks, any other metric the mean over the environments reporting it; or, given
    `env`, that environment's own value."""
    if env is not None:
        found = [r[metric] for r in results["envs"].get(env, []) if r["round"] == round_ and metric in r]
        return found[0] if found else None
    if metric == "test_success":
        return micro_average(results, round_)
    found = [r[metric] for rows in results["envs"].values() for r in rows if r["round"] == round_ and metric in r]
    return statistics.mean(found) if found else None


def series(runs: dict[tuple[str, int], dict[str, Any]], metric: str,
           env: str | None = None) -> dict[str, dict[int, list[float]]]:
    """Method name -> round -> the seeds' values of `metric` (rounds no seed reported are left out);
    over every environment, or `env`'s alone (there, a Centralized client's own metrics are left out:
    its one client reports them for every environment together)."""
    out: dict[str, dict[int, list[float]]] = {}
    for key, seed in _ordered(runs):
        results = runs[key, seed]
        per_round = out.setdefault(BY_KEY[key].name, {})
        if env is not None and metric != "test_success" and results.get("topology") == "centralized":
            continue
        rounds = sorted({r["round"] for rows in results["envs"].values() for r in rows})
        for t in rounds:
            value = run_value(results, metric, t, env)
            if value is not None:
                per_round.setdefault(t, []).append(value)
    return out


def plot_why(runs: dict[tuple[str, int], dict[str, Any]], path: pathlib.Path, subtitle: str = "",
             by_env: bool = False) -> dict[str, list[str]]:
    """The panels of PANELS, one line per method (mean over seeds, band = min..max): 2x2 over every
    environment, or (by_env) a row of them per environment. Returns per panel ("env/metric" by
    environment) the methods it drew a line for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(BY_KEY[key].name for key, _ in _ordered(runs)))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colours = {name: cmap(i % cmap.N) for i, name in enumerate(names)}
    envs = sorted({env for results in runs.values() for env in results["envs"]}) if by_env else [None]
    shape = (len(envs), len(PANELS)) if by_env else (2, 2)
    fig, axes = plt.subplots(*shape, figsize=(3.4 * shape[1], 2.6 * shape[0]) if by_env else (10, 7.2),
                             squeeze=False)
    drawn: dict[str, list[str]] = {}
    for row, env in enumerate(envs):
        for col, panel in enumerate(PANELS):
            ax = axes[row, col] if by_env else axes.flat[col]
            drawn[f"{env}/{panel[0]}" if env else panel[0]] = _panel(ax, series(runs, panel[0], env), panel, colours)
            if env:
                ax.set_title(f"{env}: {panel[1]}", fontsize=9)
                ax.set_ylabel("")
    handles = [plt.Line2D([], [], color=colours[n], marker="o", markersize=3) for n in names]
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), frameon=False)
    fig.suptitle("Why, round by round: mean over seeds, band = min..max; "
                 + ("each environment's own (Centralized: held-out success only)" if by_env
                    else "client metrics averaged over environments")
                 + (f" ({subtitle})" if subtitle else ""), fontsize=10)
    legend_rows = -(-len(names) // 4)
    fig.tight_layout(rect=(0, (0.02 + 0.03 * legend_rows) * (2 / shape[0]), 1, 1 - 0.03 * 2 / shape[0]))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _panel(ax: Any, per_method: dict[str, dict[int, list[float]]], panel: tuple[str, str, float],
           colours: dict[str, Any]) -> list[str]:
    """One panel: each method's mean over seeds per round with its band; the methods drawn."""
    from matplotlib.ticker import MaxNLocator

    metric, label, scale = panel
    for name, per_round in per_method.items():
        if per_round:
            xs = sorted(per_round)
            mean_band(ax, xs, [[scale * v for v in per_round[t]] for t in xs], name, colours[name])
    ax.set_ylabel(label)
    ax.set_xlabel("round (0 = base model)" if metric == "test_success" else "round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return ax.get_legend_handles_labels()[1]


def mean_band(ax: Any, xs: list[int], vals: list[list[float]], label: str, color: Any = None) -> None:
    """One method's line on `ax`: the mean of each x's values, and their min..max as a band where an x
    has more than one (the seeds')."""
    line, = ax.plot(xs, [statistics.mean(v) for v in vals], marker="o", markersize=3, label=label, color=color)
    if any(len(v) > 1 for v in vals):  # in the line's colour, whichever the axes gave it
        ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], alpha=0.15, color=line.get_color())


def write_rounds(summary: dict[str, Any], runs: dict[tuple[str, int], dict[str, Any]],
                 root: pathlib.Path) -> None:
    """rounds.csv, why.png and why-envs.png in `root`."""
    write_rounds_csv(runs, root / "rounds.csv")
    subtitle = f"{summary['base_model']}, budget {summary['budget']}"
    plot_why(runs, root / "why.png", subtitle)
    plot_why(runs, root / "why-envs.png", subtitle, by_env=True)
