"""`fedse run` never overwrites another run: a finished run's folder is refused (or moved aside with
--replace), an interrupted run with the same settings is resumed from its state, and one with other
settings is refused. Checked through apps.launcher.run with the federation itself stubbed out."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

import apps.launcher as launcher
from apps.launcher import RunFolderError, resumes
from apps.planning import RunConfig


class StubLaunch(launcher.Launch):
    """A Launch that starts no process: what run() does to the folder is all that is checked."""

    def start(self) -> None:
        (self.state / "aggregator").mkdir(parents=True, exist_ok=True)

    def follow(self) -> None:
        pass

    def finish(self) -> dict:
        results = {"config": {"results": self.cfg.results}, "complete": True}
        (self.dir / "results.json").write_text(json.dumps(results))
        return results


@pytest.fixture(autouse=True)
def stub(monkeypatch):
    monkeypatch.setattr(launcher, "Launch", StubLaunch)


def config(tmp_path, **kw) -> RunConfig:
    return RunConfig(envs="maze,wordle", rounds=2, results=str(tmp_path / "results"), **kw)


def interrupted(cfg: RunConfig) -> None:
    """Leaves in cfg.results what a run that Ctrl-C ended leaves: run.json, state, logs and results
    that say it did not finish."""
    folder = launcher.pathlib.Path(cfg.results)
    (folder / "state" / "aggregator").mkdir(parents=True)
    (folder / "state" / "aggregator" / "round_0000").write_text("phi_1")
    (folder / "logs").mkdir()
    (folder / "logs" / "aggregator.log").write_text("the first run's log")
    (folder / "run.json").write_text(json.dumps({"config": dataclasses.asdict(cfg)}))
    (folder / "results.json").write_text(json.dumps({"config": dataclasses.asdict(cfg), "complete": False,
                                                     "stopped": "interrupted"}))


def test_a_finished_runs_folder_is_refused_and_left_intact(tmp_path):
    cfg = config(tmp_path)
    launcher.run(cfg, out=io.StringIO())
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(RunFolderError, match="holds a finished run: pass another --results, or --replace"):
        launcher.run(cfg, out=io.StringIO())
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_replace_moves_the_earlier_run_aside(tmp_path):
    cfg = config(tmp_path)
    interrupted(cfg)
    (tmp_path / "results" / "notes.txt").write_text("mine")  # not the run's: it stays
    out = io.StringIO()
    launcher.run(dataclasses.replace(cfg, replace=True), out=out)
    [aside] = tmp_path.glob("results.replaced-*")
    assert (aside / "state" / "aggregator" / "round_0000").read_text() == "phi_1"
    assert (aside / "logs" / "aggregator.log").read_text() == "the first run's log"
    assert not (tmp_path / "results" / "state" / "aggregator" / "round_0000").exists()
    assert (tmp_path / "results" / "notes.txt").read_text() == "mine"
    assert f"aside to {aside}" in out.getvalue()
    assert "replace" not in json.loads((tmp_path / "results" / "run.json").read_text())["config"]


def test_an_interrupted_run_with_the_same_settings_is_resumed_not_wiped(tmp_path):
    cfg = config(tmp_path)
    interrupted(cfg)
    assert resumes(cfg)
    out = io.StringIO()
    launcher.run(cfg, out=out)
    assert f"resuming the interrupted run in {cfg.results}" in out.getvalue()
    folder = tmp_path / "results"
    assert (folder / "state" / "aggregator" / "round_0000").read_text() == "phi_1"
    [kept] = (folder / "logs").glob("interrupted-*/aggregator.log")
    assert kept.read_text() == "the first run's log"
    assert not list(tmp_path.glob("results.replaced-*"))


def test_an_interrupted_run_with_other_settings_is_refused(tmp_path):
    cfg = config(tmp_path)
    interrupted(cfg)
    other = dataclasses.replace(cfg, rounds=3)
    assert not resumes(other)
    with pytest.raises(RunFolderError, match=r"interrupted run with other settings \(--rounds\)"):
        launcher.run(other, out=io.StringIO())
    assert (tmp_path / "results" / "state" / "aggregator" / "round_0000").read_text() == "phi_1"
    assert json.loads((tmp_path / "results" / "run.json").read_text())["config"]["rounds"] == 2


def test_a_run_recorded_before_a_setting_existed_resumes_with_it_at_its_default(tmp_path):
    """An interrupted run recorded by an older fedse lacks the settings added since; at their
    defaults they change nothing, so upgrading mid-experiment resumes it (another value refuses)."""
    cfg = config(tmp_path)
    interrupted(cfg)
    for name in ("run.json", "results.json"):
        path = tmp_path / "results" / name
        record = json.loads(path.read_text())
        del record["config"]["scoring"]  # as if --scoring came later
        path.write_text(json.dumps(record))
    assert resumes(cfg)
    other = dataclasses.replace(cfg, scoring="sum")
    assert not resumes(other)
    with pytest.raises(RunFolderError, match=r"other settings \(--scoring\)"):
        launcher.run(other, out=io.StringIO())
    launcher.run(cfg, out=io.StringIO())
    assert json.loads((tmp_path / "results" / "run.json").read_text())["config"]["scoring"] == "auto"


def test_state_without_recorded_settings_is_refused(tmp_path):
    (tmp_path / "results" / "state").mkdir(parents=True)
    with pytest.raises(RunFolderError, match="interrupted run with unknown settings"):
        launcher.run(config(tmp_path), out=io.StringIO())
