"""`fedse experiment`'s round-by-round files (rounds.csv, why.png) from known per-round reports,
without running a federation."""

import csv

import pytest

from apps import experiment as ex
from apps import experiment_rounds as er


def reports(success: list[float], kept: list[float] | None, loss: list[float]) -> list[dict]:
    """One environment's per-round rows as the launcher writes them: round 0 evaluates the base model
    only; later rounds add what the client reported (explore_success and kept only where it explored)."""
    rows = [{"round": 0, "test_success": success[0], "test_tasks": 10}]
    for t in range(1, len(success)):
        row = {"round": t, "test_success": success[t], "test_tasks": 10, "buffer": 10.0 + 5 * t,
               "train_loss": loss[t - 1]}
        if kept is not None:
            row.update(kept=kept[t - 1], explore_success=kept[t - 1] / 16)
        rows.append(row)
    return rows


def two_methods() -> dict:
    """Fed-SE over two seeds, FedIT (no exploration: no kept, no explore_success) over one."""
    return {
        ("fedse", 0): {"envs": {"maze": reports([0.1, 0.3, 0.5], [4.0, 8.0], [1.0, 0.5]),
                                "wordle": reports([0.0, 0.1, 0.2], [2.0, 2.0], [2.0, 1.5])}},
        ("fedse", 1): {"envs": {"maze": reports([0.1, 0.5, 0.7], [6.0, 10.0], [0.8, 0.4]),
                                "wordle": reports([0.0, 0.1, 0.1], [0.0, 2.0], [2.2, 1.9])}},
        ("fedit", 0): {"envs": {"maze": reports([0.1, 0.2, 0.2], None, [1.1, 0.9]),
                                "wordle": reports([0.0, 0.0, 0.1], None, [2.1, 2.0])}},
    }


def test_rounds_csv_has_every_method_seed_env_and_round_and_leaves_missing_metrics_empty(tmp_path):
    er.write_rounds_csv(two_methods(), tmp_path / "rounds.csv")
    with open(tmp_path / "rounds.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["method", "seed", "env", "round", "test_success", "explore_success", "kept",
                             "buffer", "train_loss"]
    assert len(rows) == 3 * 2 * 3  # 3 runs x 2 environments x 3 rounds
    at = {(r["method"], r["seed"], r["env"], r["round"]): r for r in rows}
    assert at["Fed-SE", "1", "maze", "2"] == {
        "method": "Fed-SE", "seed": "1", "env": "maze", "round": "2", "test_success": "0.7",
        "explore_success": "0.625", "kept": "10.0", "buffer": "20.0", "train_loss": "0.4"}
    base = at["Fed-SE", "0", "wordle", "0"]  # the base model's round: held-out success only
    assert (base["test_success"], base["kept"], base["buffer"], base["train_loss"]) == ("0.0", "", "", "")
    fedit = at["FedIT", "0", "maze", "1"]  # trained, did not explore
    assert (fedit["explore_success"], fedit["kept"], fedit["buffer"], fedit["train_loss"]) == ("", "", "15.0", "1.1")
    assert [r["method"] for r in rows][::6] == ["FedIT", "Fed-SE", "Fed-SE"]  # the methods' order, then seeds


def test_a_runs_value_averages_client_metrics_over_environments_and_micro_averages_success():
    run = two_methods()["fedse", 0]
    assert er.run_value(run, "kept", 1) == pytest.approx(3.0)  # (4 + 2) / 2
    assert er.run_value(run, "test_success", 2) == pytest.approx(0.35)  # (5 + 2) / 20
    assert er.run_value(run, "kept", 0) is None  # nothing explored before round 1
    s = er.series(two_methods(), "train_loss")
    assert s["Fed-SE"] == {1: [pytest.approx(1.5), pytest.approx(1.5)], 2: [pytest.approx(1.0), pytest.approx(1.15)]}
    assert er.series(two_methods(), "kept")["FedIT"] == {}  # it explored nothing
    # One environment's own values, not the mean: the Maze kept 4 and 6 in round 1 (Wordle 2 and 0).
    assert er.series(two_methods(), "kept", "maze")["Fed-SE"] == {1: [4.0, 6.0], 2: [8.0, 10.0]}
    assert er.series(two_methods(), "test_success", "wordle")["FedIT"] == {0: [0.0], 1: [0.0], 2: [0.1]}
    assert er.run_value(run, "kept", 1, "nowhere") is None
    # A Centralized client reports its buffer and loss for all its environments at once: not one's own.
    central = {("centralized", 0): dict(two_methods()["fedse", 0], topology="centralized")}
    assert er.series(central, "buffer", "maze") == {"Centralized": {}}
    assert er.series(central, "test_success", "maze")["Centralized"][2] == [0.5]
    assert er.series(central, "buffer")["Centralized"][1] == [15.0]  # the figure over every environment keeps it


def test_why_png_has_a_curve_per_method_in_every_panel_it_can_and_write_outputs_writes_it(tmp_path):
    runs = two_methods()
    drawn = er.plot_why(runs, tmp_path / "alone.png")
    assert drawn == {"test_success": ["FedIT", "Fed-SE"], "kept": ["Fed-SE"],  # FedIT kept nothing to plot
                     "buffer": ["FedIT", "Fed-SE"], "train_loss": ["FedIT", "Fed-SE"]}
    by_env = er.plot_why(runs, tmp_path / "envs.png", by_env=True)  # a row of the same panels per environment
    assert sorted(by_env) == sorted(f"{env}/{metric}" for env in ("maze", "wordle") for metric in drawn)
    assert by_env["maze/kept"] == ["Fed-SE"] and by_env["wordle/buffer"] == ["FedIT", "Fed-SE"]
    cfg = ex.ExperimentConfig(envs="maze,wordle", seeds=2, rounds=2, methods="fedit,fedse")
    summary = ex.summarise(cfg, [ex.BY_KEY[k] for k in cfg.method_keys()], [0, 1], runs)
    ex.write_outputs(summary, runs, tmp_path)
    import matplotlib.image

    for png in ("alone.png", "why.png", "envs.png", "why-envs.png"):
        assert (tmp_path / png).stat().st_size > 0
        image = matplotlib.image.imread(tmp_path / png)  # a real PNG, not just a name
        assert image.shape[0] > 100 and image.shape[1] > 100
    assert (tmp_path / "rounds.csv").read_text().startswith("method,seed,env,round,test_success")


def test_each_methods_band_takes_its_lines_colour():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.colors
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    for name in ("FedIT", "Fed-SE"):  # no colour given: the axes' cycle picks one for each line
        er.mean_band(ax, [0, 1], [[0.1, 0.3], [0.2, 0.6]], name)
    lines, bands = ax.get_lines(), ax.collections
    assert len(bands) == 2 and lines[0].get_color() != lines[1].get_color()
    for line, band in zip(lines, bands):
        assert matplotlib.colors.to_hex(band.get_facecolor()[0], keep_alpha=False) == \
            matplotlib.colors.to_hex(line.get_color())
    plt.close(fig)
