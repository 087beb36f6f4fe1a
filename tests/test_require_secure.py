"""An organisation decides its own protection: a client agent with --require-secure-aggregation (or
FEDSE_REQUIRE_SECURE_AGGREGATION=true) refuses a run without secure aggregation. A real client agent
process against a real, plain aggregator ends right after Join with one line and exit status 2, and
the aggregator holds nothing from it, though round 0 opened for it; the upload path itself never sends
a plain upload with the setting on, whatever the run's settings say."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import grpc
import pytest

from fedse.config import parse
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from services.client_agent.config import ClientConfig
from support import aggregator_in_process, env_server_in_process

REFUSAL = ("refused: the aggregator's run t is not secure (no secure aggregation) and this client requires it "
           "(--require-secure-aggregation / FEDSE_REQUIRE_SECURE_AGGREGATION); nothing was uploaded")


@pytest.fixture(scope="module")
def env_server():
    with env_server_in_process() as target:
        yield target


def test_a_client_that_requires_it_refuses_a_plain_run(tmp_path, env_server):
    """Set as the on-prem overlay sets it, by its variable (its flag parses the same: the test below)."""
    setting, environ = [], {"FEDSE_REQUIRE_SECURE_AGGREGATION": "true"}
    # min_clients 1: round 0 opens as the client joins, so only the refusal keeps it from playing it.
    with aggregator_in_process(tmp_path / "agg", min_clients=1) as (_, port, run_dir):
        out = subprocess.run(
            [sys.executable, "-m", "apps.cli", "client", "--client-id", "org-a", "--env", "maze",
             "--aggregator", f"127.0.0.1:{port}", "--env-server", env_server, "--state-dir", str(tmp_path / "c"),
             "--metrics-port", "-1", "--address", "127.0.0.1:0", "--expert-demos", "1", "--explore-tasks", "0",
             "--eval-tasks", "1", "--torch-threads", "1", *setting],
            capture_output=True, text=True, timeout=120, env={**os.environ, **environ})
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            run = fpb_grpc.FederationServiceStub(ch).GetRunStatus(fpb.RunStatusRequest(), timeout=10)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = (out.stdout + out.stderr).splitlines()
    assert out.stderr.strip().splitlines()[-1] == REFUSAL and lines.count(REFUSAL) == 1
    # It joined (Join told it the run is not secure) and round 0 is open, yet nothing came from it.
    assert not run.config.secure_aggregation and run.round.round == 0 and run.round.state == fpb.ROUND_STATE_OPEN
    (member,) = run.clients
    assert member.client_id == "org-a" and not member.uploaded and member.partial_upload_bytes == 0
    assert list(run.round.joined) == ["org-a"] and not run.round.uploaded and member.metrics_round == -1
    assert not [p for p in (run_dir / "uploads").rglob("*") if p.is_file()]
    # Nothing was trained either: the client never got past Join.
    assert not list((tmp_path / "c").rglob("upload.safetensors")) and not list((tmp_path / "c").rglob("progress.json"))


def test_the_upload_path_never_sends_a_plain_upload(caplog):
    """Belt and braces: Agent.upload itself refuses, e.g. where a re-join found the run no longer secure."""
    from services.client_agent.agent import ClientAgent
    from services.client_agent.federation.link import InsecureRun
    from services.client_agent.resume import Progress

    sent = []
    agent = types.SimpleNamespace(cfg=ClientConfig(require_secure_aggregation=True),
                                  run_config=fpb.RunConfig(run_id="t", secure_aggregation=False),
                                  fed=types.SimpleNamespace(upload=lambda *a, **k: sent.append(a)))
    with caplog.at_level(logging.ERROR, logger="client_agent"), pytest.raises(InsecureRun) as refused:
        ClientAgent.upload(agent, Progress("t", 0, "trained", sha256="00"), b"adapter", {})
    assert sent == [] and f"refused: {refused.value}" == REFUSAL
    assert "refusing a plain upload: this client requires secure aggregation" in caplog.text


def test_the_setting_parses_from_its_flag_and_its_variable():
    def required(argv, environ):
        return parse(ClientConfig, argv, environ=environ).require_secure_aggregation

    assert not required([], {})
    assert required(["--require-secure-aggregation"], {})
    assert required(["--require-secure-aggregation", "true"], {})
    assert required([], {"FEDSE_REQUIRE_SECURE_AGGREGATION": "true"})
    assert not required([], {"FEDSE_REQUIRE_SECURE_AGGREGATION": "false"})
    assert not required(["--require-secure-aggregation", "false"], {"FEDSE_REQUIRE_SECURE_AGGREGATION": "true"})


def test_a_client_with_mtls_files_refuses_a_secure_run_whose_keys_are_not_signed():
    from services.client_agent.federation.link import InsecureRun, refuse_insecure

    unsigned = fpb.RunConfig(run_id="t", secure_aggregation=True, secure_signed=False)
    with pytest.raises(InsecureRun, match="unsigned keys, and this client, with its mTLS files"):
        refuse_insecure(False, unsigned, signs=True)
    refuse_insecure(False, unsigned, signs=False)  # without a certificate there is nothing to sign with
    refuse_insecure(True, fpb.RunConfig(run_id="t", secure_aggregation=True, secure_signed=True), signs=True)
