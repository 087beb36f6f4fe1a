"""Connections that cannot be made end with their reason and the flag to check, never a bare
DEADLINE_EXCEEDED: real certificates, a real aggregator over real TLS, each failure kind."""

from __future__ import annotations

import datetime
import re

import pytest

from fedse.transport import reach
from fedse.security.admission import Security, channel
from support import Pki, aggregator_in_process, free_ports


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    p = Pki(tmp_path_factory.mktemp("pki"))
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=30)
    expired = p.ca.issue_cert("localhost", "127.0.0.1", not_before=past - datetime.timedelta(days=30), not_after=past)
    p.expired_server = p._write("expired-server.pem", b"".join(x.bytes() for x in expired.cert_chain_pems)), \
        p._write("expired-server-key.pem", expired.private_key_pem.bytes())
    old = p.ca.issue_cert("org-a", not_before=past - datetime.timedelta(days=30), not_after=past)
    p.expired_client = p._write("expired-org-a.pem", b"".join(x.bytes() for x in old.cert_chain_pems)), \
        p._write("expired-org-a-key.pem", old.private_key_pem.bytes())
    p.other_ca_pem = p._write("other-ca.pem", p.other_ca.cert_pem.bytes())
    return p


def tls_server(tmp_path, pki, cert=None, mtls=True):
    cert = cert or pki.server
    return aggregator_in_process(tmp_path, tls_ca=pki.ca_pem if mtls else "", tls_cert=cert[0], tls_key=cert[1])


def reason(target, **sec) -> str:
    ch = channel(target, Security(**sec))
    try:
        with pytest.raises(reach.Unreachable) as err:
            reach.wait_ready(ch, target, Security(**sec), "--aggregator", timeout_s=3, poll_s=1)
    finally:
        ch.close()
    assert "\n" not in err.value.reason
    return err.value.reason


def client(pki, cert=None, ca=None, **over):
    cert = cert if cert is not None else pki.org_a
    return {"tls_ca": ca or pki.ca_pem, "tls_cert": cert[0] if cert else "", "tls_key": cert[1] if cert else "", **over}


def test_a_certificate_from_another_ca(tmp_path, pki):
    with tls_server(tmp_path, pki) as (_, port, _):
        why = reason(f"127.0.0.1:{port}", **client(pki, ca=pki.other_ca_pem))
    assert "--aggregator" in why and "not signed by --tls-ca" in why and "federation's CA" in why


def test_a_name_the_server_certificate_does_not_hold(tmp_path, pki):
    with tls_server(tmp_path, pki, cert=pki.named_server) as (_, port, _):
        why = reason(f"127.0.0.1:{port}", **client(pki))
    assert "does not name 127.0.0.1" in why and "--tls-server-name" in why


def test_an_expired_server_certificate(tmp_path, pki):
    with tls_server(tmp_path, pki, cert=pki.expired_server) as (_, port, _):
        why = reason(f"127.0.0.1:{port}", **client(pki))
    assert "expired" in why and "renew" in why


def test_tls_against_plain_and_the_reverse(tmp_path, pki):
    with aggregator_in_process(tmp_path / "plain") as (_, port, _):
        why = reason(f"127.0.0.1:{port}", **client(pki))
    assert "serves plain gRPC, not TLS" in why
    with tls_server(tmp_path / "tls", pki) as (_, port, _):
        why = reason(f"127.0.0.1:{port}")
    assert "serves TLS" in why and "--tls-ca" in why


@pytest.mark.parametrize("case, expect", [
    ("stranger", "refused this client's certificate"),
    ("none", "asks for a client certificate (mTLS) and none was given"),
    ("expired", "refused this client's certificate: --tls-cert"),
])
def test_a_client_certificate_the_server_refuses(tmp_path, pki, case, expect):
    cert = {"stranger": pki.stranger, "none": (), "expired": pki.expired_client}[case]
    with tls_server(tmp_path, pki) as (_, port, _):
        why = reason(f"127.0.0.1:{port}", **client(pki, cert=cert))
    assert expect in why, why
    if case == "expired":
        assert "expired on" in why


def test_nothing_listening_is_waited_for_and_then_said():
    (port,) = free_ports(1)
    why = reason(f"127.0.0.1:{port}")
    assert "nothing listens there (connection refused)" in why
    problem = reach.diagnose(f"127.0.0.1:{port}", Security(), "--aggregator")
    assert problem is not None and not problem.lasting  # a server not up yet may come


def test_a_good_connection_has_no_reason(tmp_path, pki):
    with tls_server(tmp_path, pki) as (_, port, _):
        target = f"127.0.0.1:{port}"
        assert reach.diagnose(target, Security(**client(pki)), "--aggregator") is None
        ch = channel(target, Security(**client(pki)))
        reach.wait_ready(ch, target, Security(**client(pki)), "--aggregator", timeout_s=10)
        ch.close()


GRPC_LOG_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d")  # gRPC's C core logs: I1127 22:18:29.049631 ...


def run_client(tmp_path, aggregator: str, env_server: str, *flags: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "apps.cli", "client", "--client-id", "org-a", "--env", "maze",
                           "--aggregator", aggregator, "--env-server", env_server, "--state-dir", str(tmp_path / "c"),
                           "--metrics-port", "-1", "--address", "127.0.0.1:0", "--expert-demos", "1", *flags],
                          capture_output=True, text=True, timeout=180)


def test_the_client_agent_ends_with_the_reason(tmp_path, pki):
    """A client agent with mTLS settings against a plain aggregator, and a plain one against a TLS env
    server: each ends at once with one line saying why and which flag, exit status 2."""
    from services.env_server.server import EnvServerConfig, create_server

    env, env_port = create_server(EnvServerConfig(address="127.0.0.1:0", envs="maze", metrics_port=-1))
    env.start()
    tls_env, tls_env_port = create_server(EnvServerConfig(address="127.0.0.1:0", envs="maze", metrics_port=-1,
                                                          tls_cert=pki.server[0], tls_key=pki.server[1]))
    tls_env.start()
    try:
        with aggregator_in_process(tmp_path / "agg") as (_, port, _):
            mtls = ["--tls-ca", pki.ca_pem, "--tls-cert", pki.org_a[0], "--tls-key", pki.org_a[1]]
            out = run_client(tmp_path, f"127.0.0.1:{port}", f"127.0.0.1:{env_port}", "--env-server-plain", *mtls)
            assert out.returncode == 2, out.stderr[-2000:]
            assert out.stderr.strip().splitlines()[-1] == (
                f"cannot connect: --aggregator 127.0.0.1:{port} serves plain gRPC, not TLS: drop --tls-ca, "
                "--tls-cert and --tls-key for it, or use its TLS address")
            # gRPC's own line for each handshake it retried ("I1127 ... Handshake failed ...") is not
            # shown unless GRPC_VERBOSITY asks for it; it once came after the reason.
            assert not [line for line in out.stderr.splitlines() if GRPC_LOG_LINE.match(line)], out.stderr[-2000:]
            out = run_client(tmp_path, f"127.0.0.1:{port}", f"127.0.0.1:{tls_env_port}")
            assert out.returncode == 2, out.stderr[-2000:]
            last = out.stderr.strip().splitlines()[-1]
            assert last.startswith(f"cannot connect: --env-server 127.0.0.1:{tls_env_port} serves TLS"), last
    finally:
        env.stop(0)
        tls_env.stop(0)


def test_fedse_status_and_tasks_say_why(tmp_path, pki, capsys):
    from apps.cli import status, tasks

    with tls_server(tmp_path, pki) as (_, port, _):
        assert status(["--aggregator", f"127.0.0.1:{port}", "--timeout-s", "5"]) == 1
        assert "cannot connect: --aggregator" in capsys.readouterr().err
        assert tasks(["--env-server", f"127.0.0.1:{port}"]) == 1  # fedse tasks speaks plain gRPC
        assert f"fedse tasks: cannot connect: --env-server 127.0.0.1:{port} serves TLS" in capsys.readouterr().err


@pytest.mark.parametrize("case, expect", [
    ("another CA", "not signed by --tls-ca"),
    ("name mismatch", "does not name 127.0.0.1"),
    ("expired server", "expired"),
    ("TLS against plain", "serves plain gRPC, not TLS"),
    ("plain against TLS", "serves TLS"),
    ("handshake refused", "refused this client's certificate"),
])
def test_the_client_agent_s_join_ends_with_each_reason(tmp_path, pki, case, expect):
    """The client agent joins through FederationClient.join: each failure kind raises its reason at once
    (the agent's process prints it and exits 2, as test_the_client_agent_ends_with_the_reason shows)."""
    from fedse.model import adapter as ad
    from services.client_agent.federation.link import FederationClient

    cert = {"name mismatch": pki.named_server, "expired server": pki.expired_server}.get(case)
    flags = {"another CA": client(pki, ca=pki.other_ca_pem), "plain against TLS": {},
             "handshake refused": client(pki, cert=pki.stranger)}.get(case, client(pki))
    server = aggregator_in_process(tmp_path) if case == "TLS against plain" else tls_server(tmp_path, pki, cert=cert)
    with server as (_, port, _):
        fed = FederationClient(f"127.0.0.1:{port}", "org-a", security=Security(**flags), timeout_s=60)
        with pytest.raises(reach.Unreachable) as err:
            fed.join("maze", "fedse-tiny", ad.Schema((ad.TensorSpec("a", (1,), "float32"),), "{}"))
        fed.close()
    assert err.value.lasting and expect in err.value.reason and err.value.reason.startswith("--aggregator")


@pytest.mark.parametrize("service", ["aggregator", "env-server"])
def test_a_server_whose_key_is_not_its_certificate_s_says_so_in_one_line(tmp_path, pki, service):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "apps.cli", service, "--address", "127.0.0.1:0", "--metrics-port",
                          "-1", "--tls-cert", pki.server[0], "--tls-key", pki.org_a[1]],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("configuration error: ") and "Traceback" not in out.stderr, out.stderr[-2000:]
