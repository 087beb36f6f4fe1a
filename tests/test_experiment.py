"""`fedse experiment`: the scores and table from known runs, then the whole command at a small budget."""

import csv
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

from apps import experiment as ex
from apps.experiment_outputs import curve_label
from fedse.config import ConfigError
from services.client_agent.config import ClientConfig


def results_of(envs: dict[str, list[tuple[float, int]]], upload_bytes: float = 2e6) -> dict:
    """A launcher results dict: env -> per round (test_success, test_tasks); uploads in every round but the last."""
    out = {}
    for env, per_round in envs.items():
        rows = []
        for t, (success, tasks) in enumerate(per_round):
            row = {"round": t, "test_success": success, "test_tasks": tasks}
            if t < len(per_round) - 1:
                row["upload_bytes"] = upload_bytes
            rows.append(row)
        out[env] = rows
    return {"envs": out}


def test_the_average_is_micro_over_test_tasks():
    r = results_of({"maze": [(0.0, 10), (1.0, 10)], "wordle": [(0.0, 30), (0.0, 30)]})
    assert ex.micro_average(r, 1) == pytest.approx(10 / 40)  # not (1.0 + 0.0) / 2
    assert ex.micro_average(r, 0) == 0.0
    assert ex.micro_average(r, 2) is None  # no such round
    assert ex.upload_mb_per_round(r) == pytest.approx(2.0)


def test_table_has_the_papers_layout_with_spread_and_paired_gains():
    cfg = ex.ExperimentConfig(envs="maze,wordle", seeds=2, rounds=1, methods="fedit,fedse,no-filter,no-history")
    runs = {
        ("fedse", 0): results_of({"maze": [(0.0, 10), (0.6, 10)], "wordle": [(0.1, 10), (0.2, 10)]}),
        ("fedse", 1): results_of({"maze": [(0.2, 10), (0.8, 10)], "wordle": [(0.0, 10), (0.0, 10)]}),
        ("fedit", 0): results_of({"maze": [(0.0, 10), (0.3, 10)], "wordle": [(0.1, 10), (0.1, 10)]}),
        ("fedit", 1): results_of({"maze": [(0.2, 10), (0.5, 10)], "wordle": [(0.0, 10), (0.0, 10)]}),
        ("no-filter", 0): results_of({"maze": [(0.0, 10), (0.0, 10)], "wordle": [(0.1, 10), (0.0, 10)]}, 5e5),
        ("no-filter", 1): results_of({"maze": [(0.2, 10), (0.1, 10)], "wordle": [(0.0, 10), (0.0, 10)]}, 5e5),
        ("no-history", 0): results_of({"maze": [(0.0, 10), (0.7, 10)], "wordle": [(0.1, 10), (0.2, 10)]}),
        ("no-history", 1): results_of({"maze": [(0.2, 10), (0.7, 10)], "wordle": [(0.0, 10), (0.0, 10)]}),
    }
    methods = [ex.BY_KEY[k] for k in cfg.method_keys()]
    summary = ex.summarise(cfg, methods, [0, 1], runs)
    s = summary["methods"]
    # Pre-trained is Fed-SE's round 0; final scores are round 1.
    assert s[ex.PRETRAINED]["avg"] == [pytest.approx(0.05), pytest.approx(0.1)]
    assert s["Fed-SE"]["avg"] == [pytest.approx(0.4), pytest.approx(0.4)]
    lines = summary["table"].splitlines()
    assert lines[2] == "| Method | maze | wordle | Avg. | Δ vs Pre-trained |"
    assert lines[4] == "| Pre-trained | 10.0 ± 14.1 | 5.0 ± 7.1 | 7.5 ± 3.5 | - |"
    assert lines[5] == "| FedIT | 40.0 ± 14.1 | 5.0 ± 7.1 | 22.5 ± 3.5 | +15.0 ± 0.0 |"  # a gain beyond the noise
    assert lines[6] == "| Fed-SE | 70.0 ± 14.1 | 10.0 ± 14.1 | 40.0 ± 0.0 | +32.5 ± 3.5 |"
    # The paper's claim in one line: Fed-SE's paired gain over FedIT (+20 and +15 points).
    assert "Fed-SE - FedIT: +17.5 ± 3.5 points on the average (paired over seeds)." in lines
    ablation = [line for line in lines if line.startswith("| w/o success filter")]
    assert ablation == ["| w/o success filter | 5.0 ± 7.1 | 0.0 ± 0.0 | 2.5 ± 3.5 | -37.5 ± 3.5 | 0.50 |"]
    assert any(line.startswith("| Fed-SE (rank 8) |") and line.endswith("| - | 2.00 |") for line in lines)
    # +5 for seed 0, -5 for seed 1: no larger than its spread, so marked as noise.
    assert [line for line in lines if line.startswith("| w/o history")] == [
        "| w/o history | 70.0 ± 0.0 | 10.0 ± 14.1 | 40.0 ± 7.1 | +0.0 ± 7.1 ≈ | 2.00 |"]


def test_the_table_gives_the_average_round_by_round_and_fedse_less_fedit_paired_by_seed():
    cfg = ex.ExperimentConfig(envs="maze", seeds=2, rounds=3, methods="fedit,fedse")
    runs = {("fedse", 0): results_of({"maze": [(0.0, 10), (0.1, 10), (0.3, 10), (0.5, 10)]}),
            ("fedse", 1): results_of({"maze": [(0.2, 10), (0.2, 10), (0.4, 10), (0.6, 10)]}),
            ("fedit", 1): results_of({"maze": [(0.2, 10), (0.4, 10), (0.4, 10), (0.4, 10)]})}  # seed 0 never ran
    lines = short = ex.summarise(cfg, [ex.BY_KEY[k] for k in cfg.method_keys()], [0, 1], runs)["table"].splitlines()
    at = lines.index("| Method | 0 | 1 | 2 | 3 |")
    assert lines[at + 2:at + 5] == ["| FedIT | 20.0 | 40.0 | 40.0 | 40.0 |",
                                    "| Fed-SE | 10.0 ± 14.1 | 15.0 ± 7.1 | 35.0 ± 7.1 | 55.0 ± 7.1 |",
                                    "| Fed-SE - FedIT | +0.0 | -20.0 | +0.0 | +20.0 |"]  # seed 1 against seed 1 only
    # The final table pairs by seed too: FedIT's seed 1 against Fed-SE's seed 1.
    assert "Fed-SE - FedIT: +20.0 points on the average (paired over seeds)." in lines
    # Twenty rounds show every second one; a single round has no such table.
    long = ex.ExperimentConfig(envs="maze", seeds=1, rounds=20, methods="fedse")
    run = {("fedse", 0): results_of({"maze": [(t / 40, 20) for t in range(21)]})}
    table = ex.summarise(long, [ex.BY_KEY["fedse"]], [0], run)["table"]
    assert "| Method | 0 | 2 | 4 | 6 | 8 | 10 | 12 | 14 | 16 | 18 | 20 |" in table
    assert "| Fed-SE | 0.0 | 5.0 | 10.0 | 15.0 | 20.0 | 25.0 | 30.0 | 35.0 | 40.0 | 45.0 | 50.0 |" in table
    # Then the last five rounds' mean, per seed and paired against FedIT's (seed 0 of FedIT: one round short).
    late = ex.ExperimentConfig(envs="maze", seeds=2, rounds=10, methods="fedit,fedse")
    runs = {("fedse", 0): results_of({"maze": [(t / 20, 20) for t in range(11)]}),  # rounds 6-10: 40.0
            ("fedse", 1): results_of({"maze": [(0.5, 20)] * 11}),
            ("fedit", 0): results_of({"maze": [(0.3, 20)] * 10}),
            ("fedit", 1): results_of({"maze": [(0.3, 20)] * 10 + [(0.8, 20)]})}  # rounds 6-10: 40.0
    lines = ex.summarise(late, [ex.BY_KEY[k] for k in late.method_keys()], [0, 1], runs)["table"].splitlines()
    at = lines.index("| Method | Avg. | Δ vs FedIT |")
    assert lines[at - 2].startswith("Avg. held-out success (%) over rounds 6-10: each seed's mean of the last 5")
    assert lines[at + 2:at + 4] == ["| FedIT (seed 1) | 40.0 | - |", "| Fed-SE | 45.0 ± 7.1 | +10.0 |"]
    assert "| Method | Avg. |\n|---|---:|\n| Fed-SE | 45.0 |" in table  # without FedIT, no Δ column
    assert not any("over rounds" in line for line in short)  # 3 rounds: too few for the last five
    one = ex.ExperimentConfig(envs="maze", seeds=1, rounds=1, methods="fedse")
    assert "by round" not in ex.summarise(one, [ex.BY_KEY["fedse"]], [0], {("fedse", 0): results_of(
        {"maze": [(0.0, 10), (0.5, 10)]})})["table"]


def test_the_selectors_have_their_own_table_beside_fedse(tmp_path):
    cfg = ex.ExperimentConfig(envs="maze", seeds=1, rounds=1, methods="fedse,sample")
    runs = {("fedse", 0): results_of({"maze": [(0.0, 10), (0.6, 10)]}),
            ("sample", 0): results_of({"maze": [(0.0, 10), (0.5, 10)]})}
    summary = ex.summarise(cfg, [ex.BY_KEY[k] for k in cfg.method_keys()], [0], runs)
    lines = summary["table"].splitlines()
    at = lines.index("| Selector | maze | Avg. | Δ vs Fed-SE | MB sent / client / round |")
    assert lines[at + 2:] == ["| Fed-SE (all) | 60.0 | 60.0 | - | 2.00 |",
                              "| sample half | 50.0 | 50.0 | -10.0 | 2.00 |"]
    # The figures of the methods that ran, and no empty one (Fed-SE alone is no ablation figure).
    written = [p.name for p in ex.write_outputs(summary, runs, tmp_path)]
    assert [n for n in written if n.endswith(".png")] == ["methods.png", "selectors.png", "bytes.png", "why.png",
                                                            "why-envs.png"]


def test_the_variants_table_gives_each_change_against_fedit_too():
    cfg = ex.ExperimentConfig(envs="maze", seeds=2, rounds=1, methods="fedit,fedse,expert-half")
    runs = {("fedse", 0): results_of({"maze": [(0.0, 10), (0.4, 10)]}),
            ("fedse", 1): results_of({"maze": [(0.0, 10), (0.6, 10)]}),
            ("fedit", 0): results_of({"maze": [(0.0, 10), (0.5, 10)]}),
            ("fedit", 1): results_of({"maze": [(0.0, 10), (0.5, 10)]}),
            ("expert-half", 0): results_of({"maze": [(0.0, 10), (0.7, 10)]}),
            ("expert-half", 1): results_of({"maze": [(0.0, 10), (0.9, 10)]})}
    lines = ex.summarise(cfg, [ex.BY_KEY[k] for k in cfg.method_keys()], [0, 1], runs)["table"].splitlines()
    at = lines.index("| Within the method | maze | Avg. | Δ vs Fed-SE | Δ vs FedIT | MB sent / client / round |")
    assert lines[at + 1] == "|---|---:|---:|---:|---:|---:|"
    # Fed-SE: -10 and +10 against FedIT (noise); the change: +20 and +40, beyond its spread.
    assert lines[at + 2:at + 4] == ["| Fed-SE | 50.0 ± 14.1 | 50.0 ± 14.1 | - | +0.0 ± 14.1 ≈ | 2.00 |",
                                    "| demonstrations kept at half | 80.0 ± 14.1 | 80.0 ± 14.1 | +30.0 ± 0.0 "
                                    "| +30.0 ± 14.1 | 2.00 |"]
    # Without FedIT the table has no such column.
    alone = ex.ExperimentConfig(envs="maze", seeds=2, rounds=1, methods="fedse,expert-half")
    table = ex.summarise(alone, [ex.BY_KEY[k] for k in alone.method_keys()], [0, 1], runs)["table"]
    assert "| Within the method | maze | Avg. | Δ vs Fed-SE | MB sent / client / round |" in table
    # A change that ran on fewer seeds than the table says which: its mean and Δs are over those alone.
    del runs[("expert-half", 1)]
    summary = ex.summarise(cfg, [ex.BY_KEY[k] for k in cfg.method_keys()], [0, 1], runs)
    lines = summary["table"].splitlines()
    assert lines[0].startswith("Held-out success (%) after round 1, mean ± sd over 2 seed(s);")
    assert lines[at + 2:at + 4] == ["| Fed-SE | 50.0 ± 14.1 | 50.0 ± 14.1 | - | +0.0 ± 14.1 ≈ | 2.00 |",
                                    "| demonstrations kept at half (seed 0) | 70.0 | 70.0 | +30.0 | +20.0 | 2.00 |"]
    # So does its line in the figure's legend.
    assert [curve_label(summary, n) for n in ("Fed-SE", "demonstrations kept at half")] == [
        "Fed-SE", "demonstrations kept at half (seed 0)"]


def test_settings_come_from_the_budget_unless_given():
    cfg = ex.ExperimentConfig(budget="quick", rounds=7, eval_tasks=5)
    assert cfg.setting("rounds") == 7 and cfg.setting("eval_tasks") == 5
    assert cfg.setting("envs") == ex.BUDGETS["quick"]["envs"]
    rc = cfg.run_config(ex.BY_KEY["rank2"], seed=3, results=pathlib.Path("x"))
    assert (rc.lora_r, rc.lora_alpha, rc.seed, rc.rounds, rc.topology) == (2, 4, 3, 7, "federated")
    local = cfg.run_config(ex.BY_KEY["local"], seed=0, results=pathlib.Path("x"))
    assert (local.topology, local.explore_tasks) == ("local", 0)
    with pytest.raises(ConfigError, match="unknown nope"):
        ex.ExperimentConfig(methods="fedse,nope")
    with pytest.raises(ConfigError, match="--budget"):
        ex.ExperimentConfig(budget="huge")
    # The real-model CPU budget: the paper's table without the ablations, at its own learning rate.
    real = ex.ExperimentConfig(budget="cpu-real")
    assert real.method_keys() == ["local", "centralized", "fedit", "fedse"]
    assert real.run_config(ex.BY_KEY["fedse"], seed=0, results=pathlib.Path("x")).lr == 2e-3
    assert ex.ExperimentConfig(budget="cpu-real", methods="fedse", lr=5e-4).run_config(
        ex.BY_KEY["fedse"], seed=0, results=pathlib.Path("x")).lr == 5e-4
    # quick: the paper's methods and ablations; the selectors when asked for, beside Fed-SE
    assert ex.ExperimentConfig().method_keys() == [m.key for m in ex.METHODS
                                                   if m.group not in ("selection", "ranks", "variants")]
    assert ex.ExperimentConfig(methods="variants").method_keys() == ["fedse", "tries3", "lr-cosine", "expert-half",
                                                                     "explore-cool", "shortest", "cap40"]
    long = ex.ExperimentConfig(budget="long")  # the paper's T = 20 on all five environments; a test task is 5 points
    assert (long.setting("rounds"), long.setting("seeds"), long.setting("eval_tasks"), len(long.env_list())) == \
        (20, 3, 20, 5)
    # Many members, a few a round: the selectors take --per-round of them, FedBuff folds as many a version.
    scale = ex.ExperimentConfig(envs="babyai:4,maze:2", methods="at-scale", per_round=2, members_per_host=3)
    assert scale.method_keys() == ["sample", "agent-tools", "async"] and scale.env_list() == ["babyai", "maze"]
    taken = {m: scale.run_config(ex.BY_KEY[m], seed=0, results=pathlib.Path("x")) for m in scale.method_keys()}
    assert [(c.clients_per_round, c.selection_fraction, c.members_per_host) for c in taken.values()][:2] == \
        [(2, 0.0, 3), (2, 0.0, 3)]
    assert (taken["async"].mode, taken["async"].async_buffer, taken["async"].async_concurrency) == ("async", 2, 4)
    half = ex.ExperimentConfig(envs="maze:6", methods="async").run_config(ex.BY_KEY["async"], 0, pathlib.Path("x"))
    assert (half.async_buffer, half.async_concurrency) == (3, 6)
    tries = long.run_config(ex.BY_KEY["tries3"], seed=1, results=pathlib.Path("x"))
    assert (tries.explore_tries, tries.round_lr, tries.rounds) == (3, "constant", 20)
    cool = long.run_config(ex.BY_KEY["explore-cool"], seed=1, results=pathlib.Path("x"))
    assert (cool.temperature, cool.passed_on(ClientConfig)["temperature"], tries.temperature) == (0.5, 0.5, 1.0)
    shortest = long.run_config(ex.BY_KEY["shortest"], seed=1, results=pathlib.Path("x"))
    assert (shortest.history, shortest.passed_on(ClientConfig)["history"], tries.history) == \
        ("shortest", "shortest", "cumulative")
    assert ex.ExperimentConfig(methods="selectors").method_keys() == ["fedse", "sample", "utility", "agent-tools",
                                                                      "agent-llm"]
    sampled = ex.ExperimentConfig(methods="selectors").run_config(ex.BY_KEY["agent-tools"], 0, pathlib.Path("x"))
    assert (sampled.selector, sampled.selection_fraction) == ("agent-tools", 0.5)
    # mixed ranks: Fed-SE at rank 8 beside hlora and zero-pad, whose clients take ranks 4, 16 and 8 in turn
    mixed = ex.ExperimentConfig(methods="ranks", envs="maze,wordle,babyai")
    assert mixed.method_keys() == ["fedse", "hlora", "zero-pad"]
    hlora = mixed.run_config(ex.BY_KEY["hlora"], 0, pathlib.Path("x"))
    assert (hlora.strategy, hlora.run_max_rank()) == ("hlora", 16)
    assert [hlora.client_lora([e]) for e in ("maze", "wordle", "babyai")] == [(4, 8), (16, 32), (8, 16)]
    with pytest.raises(ConfigError, match="--lr must be positive"):
        ex.ExperimentConfig(lr=0.0)
    with pytest.raises(ConfigError, match="--report runs nothing"):
        ex.ExperimentConfig(report=True, fresh=True)


def test_report_with_no_finished_run_says_which_flags_to_give(tmp_path):
    cfg = ex.ExperimentConfig(envs="maze", seeds=1, rounds=1, methods="fedse", report=True, results=str(tmp_path))
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="no run in .* has finished with these settings"):
        ex.run(cfg, out=out)
    assert "runs not finished, left out of the report: 1 (fedse-seed0)" in out.getvalue()
    assert "to run" not in out.getvalue()  # --report runs none of them
    assert not (tmp_path / "table.md").exists() and not (tmp_path / "runs" / "fedse-seed0").exists()


@pytest.mark.slow
def test_quick_experiment_writes_table_csv_and_plots_and_reuses_finished_runs(tmp_path):
    """Three of the methods (a run of each is a whole local federation: 8-20 s each on 2 cores): Fed-SE
    and the two ranks that bracket it; test_methods.py runs the other topologies, the local one included."""
    out = tmp_path / "exp"
    methods = ["fedse", "rank2", "rank16"]
    argv = [sys.executable, "-m", "apps.cli", "experiment", "--budget", "quick", "--results", str(out),
            "--envs", "maze", "--seeds", "1", "--rounds", "1", "--expert-demos", "4", "--explore-tasks", "4",
            "--eval-tasks", "4", "--epochs", "1", "--methods", ",".join(methods)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[3/3] LoRA rank 16, seed 0: running" in done.stdout
    names = [ex.BY_KEY[k].name for k in methods]
    table = (out / "table.md").read_text()
    for name in ("Pre-trained", *names):
        assert f"| {name} |" in table or f"| {name} (rank 8) |" in table, name
    assert "| FedIT |" not in table  # only the methods asked for
    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["method"] for r in rows} == set(names)
    assert all(r["env"] == "maze" and r["round"] in ("0", "1") for r in rows)
    sent = {r["method"]: float(r["upload_bytes"]) for r in rows if r["upload_bytes"]}
    assert sent["LoRA rank 2"] < sent["Fed-SE"] < sent["LoRA rank 16"]
    for png in ("methods.png", "ablations.png", "bytes.png", "why.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["methods"]) == {ex.PRETRAINED, *names}
    # A second call with the same settings runs nothing again.
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("kept from an earlier run") == 3
    assert (out / "table.md").read_text() == table


@pytest.mark.slow
def test_a_model_from_a_local_path_runs_the_experiment(tmp_path):
    """The full budget's path: a Hugging Face model directory (here the tiny model exported as one)."""
    from fedse.model.tinymodel import export_tiny_model

    model_dir = export_tiny_model(str(tmp_path / "model"))
    cfg = ex.ExperimentConfig(budget="full", methods="fedse", base_model=model_dir, envs="maze",
                              seeds=1, rounds=1, expert_demos=4, explore_tasks=4, eval_tasks=4, epochs=1,
                              results=str(tmp_path / "exp"))
    summary = ex.run(cfg, out=io.StringIO())
    assert set(summary["methods"]) == {ex.PRETRAINED, "Fed-SE"}
    results = json.loads((tmp_path / "exp" / "runs" / "fedse-seed0" / "results.json").read_text())
    assert results["base_model"] == model_dir and [r["round"] for r in results["envs"]["maze"]] == [0, 1]
    assert f"{model_dir}, budget full" in (tmp_path / "exp" / "table.md").read_text()


def test_the_models_throughput_per_method_and_phase_follows_the_table():
    cfg = ex.ExperimentConfig(envs="maze", seeds=2, rounds=1, methods="fedse,local")
    runs = {}
    for key, rate in (("fedse", 100.0), ("local", 300.0)):
        for seed in (0, 1):
            r = results_of({"maze": [(0.0, 10), (0.5, 10)]})
            r["envs"]["maze"][0].update({"eval_tokens_per_s": rate + 100 * seed, "eval_mfu": 0.2,
                                         "train_tokens_per_s": 50.0})
            runs[key, seed] = r
    summary = ex.summarise(cfg, [ex.BY_KEY[k] for k in cfg.method_keys()], [0, 1], runs)
    lines = summary["table"].splitlines()
    at = lines.index("| Method | eval | explore | train |")
    # Means over seeds and client rounds: the first round's rate and MFU, where reported.
    assert lines[at + 2:] == ["| Fed-SE | 150 (20%) | - | 50 |", "| Local | 350 (20%) | - | 50 |"]
