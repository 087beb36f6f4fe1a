"""Secure aggregation with real processes: five client agents of `fedse run --secure-aggregation`
publish the FedAvg of their adapters while the aggregator's files and log hold none of them; and five
client processes, one killed after its masked upload and one before, still close the round, with the
mean of the uploads the round holds."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from fedse.model import adapter as ad
from fedse.v1 import federation_pb2 as fpb
from secure_party import base_adapter, close_to, leaks, trained
from services.client_agent.federation.link import FederationClient
from support import REPO, free_ports

ENVS = "maze,wordle?vocab_size=30,babyai,textcraft,webshop"


@pytest.mark.slow
def test_five_client_agents_publish_fedavg_and_the_aggregator_keeps_none_of_their_adapters(tmp_path):
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "apps.cli", "run", "--secure-aggregation", "--rounds", "1", "--results",
           str(results), "--expert-demos", "2", "--explore-tasks", "2", "--eval-tasks", "1", "--epochs", "1",
           "--envs", ENVS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = results / "state"
    adapters = {d.name: ad.decode((d / "upload.safetensors").read_bytes()) for d in (state / "clients").iterdir()}
    assert len(adapters) == 5
    run_dir = state / "aggregator" / "local"
    glob = ad.decode((run_dir / "global" / "round_0001" / "adapter_model.safetensors").read_bytes())
    base = ad.decode((run_dir / "global" / "round_0000" / "adapter_model.safetensors").read_bytes())
    for name in glob:
        want = sum(a[name].double() for a in adapters.values()) / len(adapters)
        assert close_to(glob[name], want), name
    log = results / "logs" / "aggregator.log"
    unmasked = [json.loads(line) for line in log.read_text().splitlines() if "secure round unmasked" in line]
    assert [(u["uploads"], u["dropped"]) for u in unmasked] == [(5, 0)]
    files = [f for f in run_dir.rglob("*") if f.is_file()] + [log]
    assert leaks(files, adapters, base) == []


def party(target: str, cid: str, seed: int, hold_at: str = "") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.Popen([sys.executable, str(REPO / "tests" / "secure_party.py"), target, cid, str(seed),
                             "--hold-at", hold_at], stdout=subprocess.PIPE, text=True, env=env)


def read_until(p: subprocess.Popen, line: str, timeout: float = 120.0) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = p.stdout.readline()
        if not out:
            break
        seen.append(out.strip())
        if out.strip() == line:
            return seen
    raise AssertionError(f"never printed {line!r}: {seen}")


@pytest.mark.slow
def test_clients_killed_before_and_after_their_masked_upload(tmp_path):
    (port,) = free_ports(1)
    target = f"127.0.0.1:{port}"
    log = open(tmp_path / "aggregator.log", "w")
    agg = subprocess.Popen([sys.executable, "-m", "apps.cli", "aggregator", "--address", target,
                            "--secure-aggregation", "--rounds", "1", "--min-clients", "2", "--start-clients", "5",
                            "--heartbeat-timeout-s", "3", "--heartbeat-interval-s", "0.5", "--metrics-port", "-1",
                            "--state-dir", str(tmp_path / "state"), "--run-id", "r"], stdout=log, stderr=log)
    parties = []
    try:
        parties = [party(target, f"org-{i}", 100 + i, hold) for i, hold in
                   enumerate(["", "", "", "uploaded", "shared"])]
        read_until(parties[3], "AT uploaded")
        parties[3].send_signal(signal.SIGKILL)  # after its masked upload
        read_until(parties[4], "AT shared")
        parties[4].send_signal(signal.SIGKILL)  # after sharing its keys, before uploading
        for p in parties[:3]:
            assert "DONE True" in read_until(p, "DONE True")
        fed = FederationClient(target, "org-0")
        st = fed.status()
        assert st.state == fpb.ROUND_STATE_FINISHED
        glob = ad.decode(fed.download(1).data)
        fed.close()
    finally:
        for p in [*parties, agg]:
            p.kill()
            p.wait()
        log.close()
    survivors = [trained(100 + i) for i in range(4)]  # org-3's accepted upload counts
    for name in base_adapter():
        assert close_to(glob[name], sum(a[name].double() for a in survivors) / 4), name
        assert not close_to(glob[name], sum(a[name].double() for a in survivors[:3]) / 3) or \
            torch.equal(survivors[0][name], base_adapter()[name])
    text = (tmp_path / "aggregator.log").read_text()
    unmasked = [json.loads(line) for line in text.splitlines() if "secure round unmasked" in line]
    assert [(u["uploads"], u["dropped"]) for u in unmasked] == [(4, 1)]
