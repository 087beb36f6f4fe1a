"""Who may join, with real processes: an env server and an aggregator serving mTLS, a client agent
with its certificate completing a round, and the refusals (no certificate, a client the
aggregator does not admit, a certificate from another CA, a client acting as another)."""

from __future__ import annotations

import json

import grpc
import pytest

from apps.processes import Proc
from fedse.security.admission import Security, channel
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from support import Pki, wait_for

pytestmark = pytest.mark.slow


def test_mtls_federation_admits_its_clients_and_refuses_the_rest(tmp_path):
    pki = Pki(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    tls = ["--tls-ca", pki.ca_pem, "--tls-cert", pki.server[0], "--tls-key", pki.server[1]]
    env = Proc("env_server", ["services.env_server", "--address", "127.0.0.1:0", "--envs", "maze",
                              "--metrics-port", "-1", *tls], logs)
    agg = Proc("aggregator", ["services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1",
                              "--state-dir", str(tmp_path / "agg"), "--run-id", "m", "--rounds", "2",
                              "--min-clients", "1", "--allowed-clients", "org-a,org-c", *tls], logs)
    procs = [env, agg]
    try:
        target = f"127.0.0.1:{agg.port()}"
        env_target = f"127.0.0.1:{env.port()}"

        def stub(cert: tuple[str, str] | None) -> fpb_grpc.FederationServiceStub:
            sec = Security(tls_ca=pki.ca_pem, tls_cert=cert[0] if cert else "", tls_key=cert[1] if cert else "",
                           tls_server_name="localhost")
            return fpb_grpc.FederationServiceStub(channel(target, sec))

        def code_of(call) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.RpcError) as err:
                call()
            return err.value.code(), err.value.details() or ""

        # No client certificate: the TLS handshake itself is refused.
        code, _ = code_of(lambda: stub(None).GetRoundStatus(fpb.RoundStatusRequest(client_id="org-a"), timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
        # A certificate from the federation's CA, but a client the aggregator does not admit.
        code, details = code_of(lambda: stub(pki.org_b).GetRoundStatus(fpb.RoundStatusRequest(client_id="org-b"),
                                                                       timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "org-b" in details
        # A certificate from another CA that claims to be org-a.
        code, _ = code_of(lambda: stub(pki.stranger).GetRoundStatus(fpb.RoundStatusRequest(client_id="org-a"),
                                                                    timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
        # org-a's certificate used to act as another admitted client.
        code, details = code_of(lambda: stub(pki.org_a).GetRoundStatus(fpb.RoundStatusRequest(client_id="org-c"),
                                                                       timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "org-a" in details

        # The real client agent, with org-a's certificate on both links, completes the run.
        client = Proc("org-a", [
            "services.client_agent", "--client-id", "org-a", "--env", "maze", "--env-server", env_target,
            "--aggregator", target, "--address", "127.0.0.1:0", "--metrics-port", "-1",
            "--state-dir", str(tmp_path / "clients"), "--expert-demos", "4", "--explore-tasks", "2",
            "--eval-tasks", "2", "--epochs", "1", "--torch-threads", "1", "--tls-ca", pki.ca_pem,
            "--tls-cert", pki.org_a[0], "--tls-key", pki.org_a[1], "--tls-server-name", "localhost"], logs)
        procs.append(client)
        wait_for("org-a to finish", lambda: client.popen.poll() == 0, 240, [client])
        run_dir = tmp_path / "agg" / "m"
        assert (run_dir / "global" / "round_0002" / "adapter_model.safetensors").exists()
        reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert sorted(r["round"] for r in reports) == [0, 1, 2]

        # (An upload replayed into another round or run is refused by its round nonce and run id:
        # tests/test_aggregator_grpc.py.)
    finally:
        for p in reversed(procs):
            p.stop()
