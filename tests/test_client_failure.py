"""A client agent that dies does not sink `fedse run`: the launcher names it and says why, the
others finish their rounds, results.json keeps every round reported and records the failure, and
the exit status is non-zero. Real processes, a real SIGKILL; the log reading on real log lines."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from apps.logs import log_summary
from apps.processes import exit_reason
from fedse.transport.serving import JsonFormatter, log_fields
from support import child_running, wait_for

SMALL = ["--expert-demos", "2", "--explore-tasks", "2", "--eval-tasks", "2"]


def test_exit_reason_names_the_signal_and_suspects_the_oom_killer():
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL (out of memory?)"
    assert exit_reason(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_reason(1) == "exited with status 1"


def test_log_summary_keeps_the_last_lines_and_the_last_error_bounded(tmp_path):
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    handler.setFormatter(JsonFormatter("client_agent"))
    log = logging.Logger("client_agent")
    log.addHandler(handler)
    log.info("padding " + "x" * 100)
    for i in range(700):  # more than the 64 KB read: the first, cut line must not show
        log.info("round done", extra=log_fields(round=i))
    try:
        raise ConnectionError("env server gone")
    except ConnectionError:
        log.error("episode failed", exc_info=True)
    log.warning("heartbeat failed", extra=log_fields(error="UNAVAILABLE"))
    try:  # a message over several lines, as a gRPC error's: its status and details carry on indented
        raise ValueError("boom " + "y" * 500 + "\n\tstatus = UNAVAILABLE\n>")
    except ValueError:
        import traceback

        uncaught = traceback.format_exc()  # what Python prints on stderr (same file) on its way out
    path = tmp_path / "client_agent-maze.log"
    path.write_text(text.getvalue() + uncaught)
    assert path.stat().st_size > 64 * 1024

    lines, error = log_summary(path, lines=3, width=80)
    assert lines[0] == "error: episode failed (ConnectionError: env server gone)"
    assert lines[1] == "warning: heartbeat failed error=UNAVAILABLE"
    assert lines[2].startswith("ValueError: boom yyy") and len(lines[2]) == 80 and lines[2].endswith("...")
    assert error == lines[2]  # the exception Python printed last; its traceback's frames are left out
    everything, whole = log_summary(path, lines=10 ** 6, width=10 ** 6)
    assert whole == "ValueError: boom " + "y" * 500 + " status = UNAVAILABLE >"
    assert not any(line.startswith(("Traceback", "File", "  ")) for line in everything)
    assert everything[0].startswith("info: round done round=")  # not the cut line before it
    assert log_summary(tmp_path / "none.log") == ((), "")


def launch(results, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "apps.cli", "run", "--results", str(results), *SMALL, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reports(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_client_killed_mid_run_is_reported_and_the_others_finish_every_round(tmp_path):
    results = tmp_path / "results"
    run_dir = results / "state" / "aggregator" / "local"
    proc = launch(results, "--envs", "maze,wordle?vocab_size=30,babyai", "--rounds", "2")
    try:
        # Mid-run: org-wordle has reported round 0 and round 1 is open.
        wait_for("org-wordle's round-0 report and round 1", lambda: (run_dir / "global" / "round_0001").exists()
                 and any(r["client_id"] == "org-wordle" for r in reports(run_dir)), timeout=180)
        pid = child_running(proc.pid, "--client-id", "org-wordle")
        assert pid is not None, "org-wordle's process is gone already"
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert time.monotonic() - started < 150  # rounds closed without org-wordle, not at the 1800 s deadline

    # The output names the client, the signal and how its log ends, and the table went on.
    assert "client org-wordle (wordle) failed: killed by SIGKILL (out of memory?), exit code -9" in out
    assert "the run goes on with org-maze, org-babyai" in out
    assert "its log " in out and "client_agent-wordle.log ends with:" in out
    assert "run incomplete: org-wordle failed (killed by SIGKILL (out of memory?))" in err

    data = json.loads((results / "results.json").read_text())
    assert data["complete"] is False and data["stopped"] == ""
    [failure] = data["failed_clients"]
    last = failure["last_round"]
    assert {k: failure[k] for k in ("client_id", "process", "envs", "exit_code", "reason")} == {
        "client_id": "org-wordle", "process": "client_agent-wordle", "envs": ["wordle"], "exit_code": -9,
        "reason": "killed by SIGKILL (out of memory?)"}
    assert 0 <= last < 2 and failure["last_lines"]
    # The survivors' every round, the failed client's every reported round.
    assert [r["round"] for r in data["envs"]["maze"]] == [0, 1, 2]
    assert [r["round"] for r in data["envs"]["babyai"]] == [0, 1, 2]
    assert [r["round"] for r in data["envs"]["wordle"]] == list(range(last + 1))
    assert len(data["mean_test_success"]) == last + 1  # the mean covers the rounds every environment reported
    assert (results / "success.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # After the kill the aggregator closed each round once the live clients had uploaded.
    closed = [json.loads(line) for line in (results / "logs" / "aggregator.log").read_text().splitlines()
              if '"round closed"' in line]
    assert [e["round"] for e in closed] == [0, 1]
    for e in closed[last + 1:]:  # (a round org-wordle uploaded but did not report before it died closed with it)
        late = (run_dir / "uploads" / f"round_{e['round']:04d}" / "org-wordle.json").exists()
        assert (e["reason"], e["uploads"]) == (("all uploaded", 3) if late else ("all alive clients uploaded", 2))


@pytest.mark.slow
def test_a_client_dead_before_joining_stops_the_run_cleanly(tmp_path):
    """The aggregator opens round 0 only once every client has joined: with one dead before it
    joined, the launcher stops the others, says why, and still writes its results."""
    results = tmp_path / "results"
    proc = launch(results, "--envs", "maze,wordle?vocab_size=30", "--rounds", "2")
    try:
        pid = wait_for("org-wordle's process", lambda: child_running(proc.pid, "--client-id", "org-wordle"),
                       timeout=120)
        os.kill(pid, signal.SIGKILL)  # still importing torch: long before it joins
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    why = "org-wordle failed before joining, and aggregator opens round 0 only once every client has joined"
    assert f"stopping org-maze: {why}" in out
    assert "it reported no round" in out
    data = json.loads((results / "results.json").read_text())
    assert data["complete"] is False and data["stopped"] == why and data["envs"] == {}
    assert [(f["client_id"], f["last_round"]) for f in data["failed_clients"]] == [("org-wordle", None)]
    assert (results / "success.png").exists()
