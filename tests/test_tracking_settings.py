"""Tracked runs can be told apart and read back: fedse run's settings and each client's reach
MLflow (its SQLite store) and TensorBoard (typed hparams) through the aggregator that `fedse run`
configures; runs are named by method, seed and the user's name; nothing secret is recorded.
Everything is read back with MLflow's and TensorBoard's own readers."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sqlite3

import pytest

from apps.experiment import BY_KEY, ExperimentConfig, run_name
from apps.launcher import claim
from apps.planning import RunConfig, aggregator_config, plan, tracked
from fedse.config import ConfigError, parse
from services.aggregator.server import Aggregator, AggregatorConfig
from services.aggregator.tracking import Target, Tracker, mlflow_uri
from support import history

SMALL = {"envs": "maze", "rounds": 1, "expert_demos": 2, "explore_tasks": 2, "eval_tasks": 2}


def small(**settings) -> RunConfig:
    return RunConfig(**{**SMALL, **settings})


def tensorboard_hparams(run_dir: pathlib.Path) -> dict[str, bool | float | str]:
    """The hyperparameters a TensorBoard run directory holds, each with the type it was written with."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    out = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    for name, v in data.session_start_info.hparams.items():
                        out[name] = getattr(v, v.WhichOneof("kind"))
    return out


def mlflow_runs(store: pathlib.Path) -> dict[str, object]:
    """{run name: run} of the MLflow experiment fedse in STORE/mlflow.db, and the client, read by MLflow."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fedse")
    return client, {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}


def tracked_run(tmp_path: pathlib.Path, results: str, **settings) -> RunConfig:
    """A fedse run's aggregator, as `fedse run` configures it (run.json written by claim), started
    and stopped with one round reported."""
    cfg = RunConfig(results=str(tmp_path / results), track=(f"tensorboard:{tmp_path / 'tb'}",
                                                           f"mlflow:{tmp_path / 'mlruns'}"), **{**SMALL, **settings})
    claim(cfg, print)
    (fed,) = plan(cfg)
    agg = Aggregator(aggregator_config(cfg, fed, tmp_path / results / "state"))
    agg.tracker.report("org-maze", 0, {"test_success": 0.25}, members=1)
    agg.tracker.round_closed(0, uploads=1, seconds=1.0, aggregate_seconds=0.1)
    agg.stop(0)
    return cfg


def test_two_runs_differing_in_lora_r_and_lr_are_told_apart_by_what_they_recorded(tmp_path):
    tracked_run(tmp_path, "a", lora_r=4, lr=1e-3)
    tracked_run(tmp_path, "b", lora_r=16, lr=3e-3)

    client, runs = mlflow_runs(tmp_path / "mlruns")
    assert set(runs) == {"fedse-r4-seed0", "fedse-r16-seed0"}
    a, b = runs["fedse-r4-seed0"].data.params, runs["fedse-r16-seed0"].data.params
    differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    # The run's settings and the client's, beside where each was written and its name: nothing else.
    assert differ == {"run/lora_r", "run/lr", "client/org-maze/lora_r", "client/org-maze/lr", "run/results",
                      "run_settings", "state_dir", "run_name"}
    assert (a["run/lora_r"], b["run/lora_r"], a["client/org-maze/lr"], b["client/org-maze/lr"]) == \
        ("4", "16", "0.001", "0.003")
    assert a["run/envs"] == "maze" and a["client/org-maze/explore_tasks"] == "2" and a["run/seed"] == "0"
    assert a["client/org-maze/base_model"] == "fedse-tiny" and a["client/org-maze/keep"] == "successes"
    assert history(client, runs["fedse-r4-seed0"], "test_success/mean") == {0: 0.25}

    dirs = {d.name.rsplit("-", 2)[0]: d for d in (tmp_path / "tb").iterdir()}  # NAME-<date>-<time>
    assert set(dirs) == {"fedse-r4-seed0", "fedse-r16-seed0"}
    ha, hb = tensorboard_hparams(dirs["fedse-r4-seed0"]), tensorboard_hparams(dirs["fedse-r16-seed0"])
    # Typed: numbers as numbers, booleans as booleans, so the HParams dashboard sorts and plots them.
    assert (ha["run/lora_r"], hb["run/lora_r"], ha["client/org-maze/lr"], hb["run/lr"]) == (4, 16, 1e-3, 3e-3)
    assert ha["run/guardian"] is False and ha["secure_aggregation"] is False and ha["rounds"] == 1
    assert ha["run/envs"] == "maze" and ha["client/org-maze/env"] == "maze"
    assert {k for k in ha if ha[k] != hb[k]} == differ


def test_runs_are_named_by_method_seed_and_the_name_given(tmp_path):
    assert small().method() == "fedse-r8"
    assert small(explore_tasks=0).method() == "fedit-r8"
    assert small(topology="local", explore_tasks=0, lora_r=4).method() == "local-r4"
    assert small(keep="all", strategy="weighted").method() == "fedse-weighted-keep-all-r8"
    assert small(envs="maze,wordle", strategy="hlora", lora_ranks="4,16").method() == \
        "fedse-hlora-ranks4,16"
    track = ("tensorboard:tb",)
    cfg = small(seed=3, track=track)
    assert tracked(cfg, plan(cfg)[0])["run_name"] == "fedse-r8-seed3"
    cfg = small(seed=3, track=track, run_name="lr sweep")
    assert tracked(cfg, plan(cfg)[0])["run_name"] == "lr sweep-seed3"
    cfg = small(envs="maze,wordle", topology="local", explore_tasks=0, track=track)
    assert [tracked(cfg, f)["run_name"] for f in plan(cfg)] == ["local-r8-seed0-maze", "local-r8-seed0-wordle"]
    # fedse experiment names each run by its method and seed, as its folder runs/<method>-seed<k>.
    rc = ExperimentConfig().run_config(BY_KEY["rank16"], 1, tmp_path / "x")
    assert tracked(dataclasses.replace(rc, track=track), plan(rc)[0])["run_name"] == \
        run_name(BY_KEY["rank16"], 1) == "rank16-seed1"

    # The aggregator's --run-name names the MLflow run and the TensorBoard folder (made safe as a name).
    tb, ml = tmp_path / "tb", tmp_path / "mlruns"
    settings = {"run_name": "my run/1", "rounds": 1}
    Tracker([Target("tensorboard", str(tb)), Target("mlflow", str(ml))], tmp_path / "state", "local", 1,
            settings).close()
    (run_dir,) = tb.iterdir()
    assert run_dir.name.startswith("my_run_1-")
    assert set(mlflow_runs(ml)[1]) == {"my run/1"}


def test_no_secret_is_recorded_wherever_it_stands(tmp_path):
    secrets = ["/run/secret/token", "hf_abc123", "/keys/org.pem", "sk-999", "pa55word"]
    run_settings = tmp_path / "run.json"
    run_settings.write_text(json.dumps({
        "config": {"lr": 0.001, "token_file": secrets[0], "hf_token": secrets[1],
                   "track": ["mlflow:https://alice:pa55word@mlflow.example"]},
        "clients": {"org-maze": {"lr": 0.001, "tls_key": secrets[2], "api_key": secrets[3], "Password": "x"}}}))
    tb, ml = tmp_path / "tb", tmp_path / "mlruns"
    settings = {"run_settings": str(run_settings), "token_file": "/agg/token", "tls_key": "/agg/key.pem"}
    Tracker([Target("tensorboard", str(tb)), Target("mlflow", str(ml))], tmp_path / "state", "run", 1,
            settings).close()
    _, runs = mlflow_runs(ml)
    (params,) = [r.data.params for r in runs.values()]
    assert params["run/lr"] == "0.001" and params["client/org-maze/lr"] == "0.001"
    assert params["run/track"] == "mlflow:https://***@mlflow.example"
    assert not [k for k in params if any(w in k.lower() for w in ("token", "key", "password"))], params
    # Not in any file either destination wrote: TensorBoard's events and MLflow's database, byte for byte.
    written = b"".join(p.read_bytes() for p in [*tb.rglob("*"), *ml.rglob("*")] if p.is_file())
    assert b"0.001" in written or b"org-maze" in written
    for secret in [*secrets, "/agg/token", "/agg/key.pem"]:
        assert secret.encode() not in written, secret
    # And the database is MLflow's maintained store, SQLite, at PATH/mlflow.db.
    assert sqlite3.connect(ml / "mlflow.db").execute("select count(*) from params").fetchone()[0] == len(params)


def test_mlflow_paths_become_sqlite_stores_and_a_bad_settings_file_is_one_clear_error(tmp_path, monkeypatch):
    assert mlflow_uri(str(tmp_path / "runs")) == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert mlflow_uri(str(tmp_path / "x.db")) == f"sqlite:///{tmp_path / 'x.db'}"
    for uri in ("http://mlflow:5000", "https://m.example/x", "sqlite:///runs/m.db", "databricks"):
        assert mlflow_uri(uri) == uri
    with pytest.raises(ConfigError, match="--run-settings .*cannot be read"):
        parse(AggregatorConfig, ["--run-settings", str(tmp_path / "missing.json")], environ={})
    (tmp_path / "bad.json").write_text('{"clients": [1]}')
    with pytest.raises(ConfigError, match='"config" .* "clients"'):
        parse(AggregatorConfig, ["--run-settings", str(tmp_path / "bad.json")], environ={})

    # The database needs SQLAlchemy and Alembic, which mlflow-skinny leaves out: said at start, in one line.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "alembic" else real(name, *a))
    with pytest.raises(ConfigError, match="needs the alembic package.*pip install fedse.track"):
        parse(AggregatorConfig, ["--track", f"mlflow:{tmp_path / 'runs'}"], environ={})
    parse(AggregatorConfig, ["--track", "mlflow:http://mlflow:5000"], environ={})  # a server needs neither


def test_values_keep_their_type_and_all_says_all():
    from fedse.config import ALL, Count
    from services.aggregator.tracked_settings import public_settings

    assert public_settings({"lr": 0.003, "lora_r": 8, "keep": False, "eval_tasks": ALL, "tasks": Count("5"),
                            "envs": ("maze", "wordle"), "track": "mlflow:http://u:p@host"}) == {
        "envs": "maze,wordle", "eval_tasks": "all", "keep": False, "lora_r": 8, "lr": 0.003, "tasks": 5,
        "track": "mlflow:http://***@host"}
