"""Tracking from the aggregator (--track): TensorBoard and MLflow written by the real libraries and
read back with them; a destination that fails leaves the run going; a restart resumes the same runs.
(The end-to-end `fedse run --track ...` is in tests/test_end_to_end.py.)"""

from __future__ import annotations

import json
import pathlib

import pytest

from fedse.config import ConfigError, parse
from services.aggregator.server import AggregatorConfig
from services.aggregator.tracking import STATE_NAME, Target, Tracker, public_settings
from support import history, mlflow_run, tensorboard_scalars


REPORTS = [("maze", 0, {"test_success": 0.25, "buffer": 4.0}), ("wordle", 0, {"test_success": 0.75, "buffer": 6.0}),
           ("maze", 1, {"test_success": 0.5}), ("wordle", 1, {"test_success": 1.0})]


def run_tracker(root: pathlib.Path, targets: list[Target], reports=REPORTS, closes=(0,), prior=()) -> Tracker:
    settings = {"rounds": 1, "strategy": "fedavg", "token_file": "/run/secret/token", "tls_key": "/k.pem",
                "track": tuple(f"{t.kind}:{t.where}" for t in targets)}
    tracker = Tracker(targets, root, "run-a", num_rounds=1, settings=settings, reports=list(prior))
    for cid, r, values in reports:
        tracker.report(cid, r, values, members=2)
        if r in closes and cid == "wordle":
            tracker.round_closed(r, uploads=2, seconds=3.5, aggregate_seconds=0.25)
    tracker.close()
    return tracker


def test_every_round_of_every_client_and_the_settings_reach_tensorboard_and_mlflow(tmp_path):
    tb, ml = tmp_path / "tb", tmp_path / "mlruns"
    run_tracker(tmp_path / "state", [Target("tensorboard", str(tb)), Target("mlflow", str(ml))])

    (run_dir,) = tb.iterdir()
    assert run_dir.name.startswith("run-a-")
    scalars, text = tensorboard_scalars(run_dir)
    assert scalars["test_success/maze"] == {0: 0.25, 1: 0.5}
    assert scalars["test_success/wordle"] == {0: 0.75, 1: 1.0}
    assert scalars["buffer/wordle"] == {0: 6.0}
    assert scalars["test_success/mean"] == {0: 0.5, 1: 0.75}  # round 1 (the final one) once both reported
    assert scalars["round/uploads"] == {0: 2.0} and scalars["round/seconds"] == {0: 3.5}
    assert "| strategy | fedavg |" in text and "token" not in text and "/k.pem" not in text

    client, run = mlflow_run(ml, "run-a")
    assert history(client, run, "test_success/maze") == {0: 0.25, 1: 0.5}
    assert history(client, run, "test_success/mean") == {0: 0.5, 1: 0.75}
    assert history(client, run, "buffer/mean") == {0: 5.0}
    assert run.data.params["strategy"] == "fedavg" and run.data.params["rounds"] == "1"
    assert "token_file" not in run.data.params and "tls_key" not in run.data.params
    assert run.info.status == "FINISHED"


def test_a_restarted_aggregator_resumes_the_same_runs(tmp_path):
    tb, ml, root = tmp_path / "tb", tmp_path / "mlruns", tmp_path / "state"
    targets = [Target("tensorboard", str(tb)), Target("mlflow", str(ml))]
    run_tracker(root, targets, reports=REPORTS[:2])
    kept = json.loads((root / STATE_NAME).read_text())
    # The restart knows the reports recorded before it (the store's), and takes the final round's.
    run_tracker(root, targets, reports=REPORTS[2:], closes=(), prior=REPORTS[:2])
    assert json.loads((root / STATE_NAME).read_text()) == kept
    (run_dir,) = tb.iterdir()
    scalars, _ = tensorboard_scalars(run_dir)
    assert scalars["test_success/maze"] == {0: 0.25, 1: 0.5} and scalars["test_success/mean"] == {0: 0.5, 1: 0.75}
    client, run = mlflow_run(ml, "run-a")  # one run, not two
    assert history(client, run, "test_success/wordle") == {0: 0.75, 1: 1.0}


def test_a_destination_that_cannot_be_opened_leaves_the_others_and_the_run_going(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where TensorBoard's directory would go")
    ml = tmp_path / "mlruns"
    tracker = run_tracker(tmp_path / "state", [Target("tensorboard", str(blocker)), Target("mlflow", str(ml))])
    assert [d.kind for d in tracker.destinations] == ["mlflow"]
    assert any("could not be opened" in r.getMessage() for r in caplog.records)
    client, run = mlflow_run(ml, "run-a")
    assert history(client, run, "test_success/mean") == {0: 0.5, 1: 0.75}


def test_track_settings_name_a_known_destination():
    assert Target.parse("mlflow:http://mlflow:5000") == Target("mlflow", "http://mlflow:5000")
    for bad in ("tensorboard", "mlflow:", "neptune:proj"):
        with pytest.raises(ConfigError, match="KIND:WHERE"):
            parse(AggregatorConfig, ["--track", bad], environ={})
    # The variable holds URIs, which contain ':', so its items are separated by whitespace.
    cfg = parse(AggregatorConfig, [], environ={"FEDSE_TRACK": "tensorboard:/runs mlflow:http://mlflow:5000"})
    assert cfg.track == ("tensorboard:/runs", "mlflow:http://mlflow:5000")
    assert public_settings({"token_file": "t", "tls_key": "k", "lr": 0.1, "track": ("a", "b")}) == \
        {"lr": 0.1, "track": "a,b"}


def test_a_missing_library_is_a_configuration_error_saying_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        parse(AggregatorConfig, ["--track", "wandb:fedse"], environ={})


def test_wandb_offline_takes_the_rounds(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = run_tracker(tmp_path / "state", [Target("wandb", "fedse-test")])
    assert [d.kind for d in tracker.destinations] == ["wandb"]
    # The offline run's record file (protobuf records in a LevelDB-style log) holds every key and value.
    (records,) = (tmp_path / "state").rglob("run-*.wandb")
    data = records.read_bytes()
    assert all(key in data for key in (b"test_success/maze", b"test_success/wordle", b"test_success/mean",
                                        b"round/uploads", b"strategy", b"fedavg"))
    assert b"0.75" in data and b"/run/secret/token" not in data
