"""`fedse experiment`'s files in --results: table.md, results.csv, summary.json and the plots
(success per round per environment for each group of methods, and adapter bytes per round); the
round-by-round why.png, why-envs.png and rounds.csv come from experiment_rounds."""

from __future__ import annotations

import csv
import json
import math
import pathlib
from typing import Any

from apps.experiment_methods import BY_KEY, PRETRAINED
from apps.experiment_rounds import mean_band, write_rounds
from apps.experiment_scores import seeds_label


def write_outputs(summary: dict[str, Any], runs: dict[tuple[str, int], dict[str, Any]],
                  root: pathlib.Path) -> list[pathlib.Path]:
    """Writes the table, the CSVs, the plots and summary.json; the files, less summary.json."""
    (root / "table.md").write_text(summary["table"] + "\n")
    write_csv(runs, root / "results.csv")
    of = lambda group: [n for n, s in summary["methods"].items() if s["group"] == group]  # noqa: E731
    figures = (("methods.png", of("main"), "Local, Centralized, FedIT and Fed-SE"),
               ("ablations.png", ["Fed-SE"] + of("ablation"), "Fed-SE and its ablations"),
               ("selectors.png", ["Fed-SE"] + of("selection"),
                "Fed-SE (every client a round), the selectors and FedBuff"),
               ("variants.png", ["Fed-SE"] + of("variants"), "Fed-SE and its variants within the method"),
               ("ranks.png", ["Fed-SE"] + of("ranks"), "Fed-SE (every client at rank 8) and mixed ranks 4/16/8"))
    # Each figure whose own methods ran (Fed-SE, beside the others as their reference, is the main figure's).
    drawn = [name for name, methods, _ in figures
             if any(m in summary["curves"] for m in (methods if name == "methods.png" else methods[1:]))]
    for name, methods, title in figures:  # each figure whose methods ran
        if name in drawn:
            plot_curves(summary, methods, root / name, title)
    plot_bytes(summary, root / "bytes.png")
    write_rounds(summary, runs, root)
    (root / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "table"}, indent=1))
    return [root / name for name in ("table.md", "results.csv", *drawn, "bytes.png", "why.png", "why-envs.png",
                                           "rounds.csv")]


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
    shown = {n: curve_label(summary, n) for n in names if n in summary["curves"]}
    for ax, panel in zip(axes.flat, panels):
        for name, label in shown.items():
            per_round = summary["curves"][name][panel]
            xs = [t for t, vals in enumerate(per_round) if any(v is not None for v in vals)]
            mean_band(ax, xs, [[100 * v for v in per_round[t] if v is not None] for t in xs], label)
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


def curve_label(summary: dict[str, Any], name: str) -> str:
    """A method's name in a figure's legend, with its seeds where it ran on fewer than the title's."""
    per_round, seeds = summary["curves"][name]["Avg."], summary["seeds"]
    return seeds_label(name, [seed for i, seed in enumerate(seeds) if any(vals[i] is not None for vals in per_round)],
                       seeds)


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
