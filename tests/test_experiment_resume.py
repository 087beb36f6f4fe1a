"""`fedse experiment` survives being killed: SIGKILL to its whole process group (as a batch system's
time limit would), between rounds and inside one, then the same command again. Each run resumes
from its last closed round, finished runs are kept, and the table and every run's final global
adapter equal an uninterrupted experiment's with the same seeds. Real processes throughout."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

METHODS = ("fedse", "fedit")
ROUNDS = 2
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def argv(out: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "apps.cli", "experiment", "--budget", "quick", "--results", str(out),
            "--envs", "maze", "--seeds", "1", "--rounds", str(ROUNDS), "--expert-demos", "4",
            "--explore-tasks", "4", "--eval-tasks", "4", "--epochs", "1", "--methods", ",".join(METHODS)]


def experiment(out: pathlib.Path) -> str:
    done = subprocess.run(argv(out), capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def outcome(out: pathlib.Path) -> dict[str, object]:
    """What must not depend on an interruption: the success table (not the throughput below it),
    results.csv (successes and bytes per round, no timings) and each run's final global adapter."""
    adapters = {m: [p.read_bytes() for p in (out / "runs" / f"{m}-seed0" / "state" / "aggregator").glob(
        f"*/global/round_{ROUNDS:04d}/adapter_model.safetensors")] for m in METHODS}
    assert all(len(a) == 1 for a in adapters.values()), {m: len(a) for m, a in adapters.items()}
    return {"table": (out / "table.md").read_text().split("Model throughput")[0],
            "csv": (out / "results.csv").read_text(), "adapters": adapters}


def living(out: pathlib.Path) -> list[str]:
    """The command lines of the processes still working on `out` (their arguments name it)."""
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(out) in text:
            found.append(text[:200])
    return found


def killed_when(out: pathlib.Path, ready, timeout: float = 300.0) -> None:
    """Starts the experiment in its own process group and SIGKILLs the whole group once ready()."""
    with open(f"{out}.stdout", "w") as log:
        proc = subprocess.Popen(argv(out), stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the experiment ended before the kill: {pathlib.Path(f'{out}.stdout').read_text()}"
        assert time.monotonic() < deadline, "never ready to kill"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # The services run in their own sessions, yet die with the experiment: none writes on.
    deadline = time.monotonic() + 10
    while living(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not living(out), living(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("uninterrupted") / "exp"
    experiment(out)
    return outcome(out)


def test_killed_between_rounds_the_experiment_resumes_to_the_same_table_and_adapters(tmp_path, uninterrupted):
    out = tmp_path / "exp"
    closed = out / "runs" / "fedse-seed0" / "state" / "aggregator"
    killed_when(out, lambda: any(closed.glob("*/global/round_0002")))  # rounds 0 and 1 closed, phi_2 released
    assert not (out / "runs" / "fedse-seed0" / "results.json").exists()
    said = experiment(out)
    assert "Fed-SE, seed 0: running" in said
    assert re.search(r"fedse-seed0: resumed after round [01] of 2\n", said), said  # progress names the run
    assert re.search(r"fedse-seed0: round 2 of 2 in, held-out success \d+\.\d%; this run about", said), said
    assert "resuming the interrupted run" in (out / "runs" / "fedse-seed0" / "progress.log").read_text()
    assert outcome(out) == uninterrupted


def test_killed_inside_a_round_the_experiment_keeps_finished_runs_and_resumes(tmp_path, uninterrupted):
    out = tmp_path / "exp"
    log = out / "runs" / "fedit-seed0" / "logs" / "client_agent-maze.log"
    training = '"phase": "training", "round": 1,'
    killed_when(out, lambda: log.exists() and training in log.read_text(errors="replace"))
    # Interrupted, it still has the table and figures of the runs it finished.
    table = (out / "table.md").read_text()
    assert "| Fed-SE |" in table and "| FedIT |" not in table and (out / "methods.png").stat().st_size > 0
    said = experiment(out)
    assert "Fed-SE, seed 0: kept from an earlier run" in said and "FedIT, seed 0: running" in said
    assert "runs done: 1 (fedse-seed0)\nruns to run: 1 (fedit-seed0)\n" in said
    assert "resuming the interrupted run" in (out / "runs" / "fedit-seed0" / "progress.log").read_text()
    assert outcome(out) == uninterrupted
    # --report runs nothing and writes the same table from the finished runs.
    (out / "table.md").unlink()
    done = subprocess.run(argv(out) + ["--report"], capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0 and "running" not in done.stdout, done.stdout + done.stderr
    assert outcome(out) == uninterrupted
