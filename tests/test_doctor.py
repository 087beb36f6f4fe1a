"""fedse doctor with a client's own flags, against a real aggregator and env server over real TLS: every
check passes for a client that can join, and each failure stops the checks with its one-line reason
(the same reasons a client agent ends with)."""

from __future__ import annotations

import contextlib
import re

import pytest

from apps.doctor import doctor
from services.env_server.server import EnvServerConfig, create_server
from support import aggregator_in_process
from test_reach import pki  # noqa: F401 - the module's certificates, expired ones included


@contextlib.contextmanager
def federation(tmp_path, pki, cert=None, mtls=True, allowed="org-a,org-b", **settings):  # noqa: F811
    cert = cert or pki.server
    env, env_port = create_server(EnvServerConfig(address="127.0.0.1:0", envs="maze", metrics_port=-1))
    env.start()
    tls = {"tls_ca": pki.ca_pem, "tls_cert": cert[0], "tls_key": cert[1], "allowed_clients": allowed} if mtls else {}
    try:
        with aggregator_in_process(tmp_path, **tls, **settings) as (_, port, _):
            yield f"127.0.0.1:{port}", f"127.0.0.1:{env_port}"
    finally:
        env.stop(0)


def run(capsys, agg, env, *flags):
    code = doctor(["--client-id", "org-a", "--env", "maze", "--aggregator", agg, "--env-server", env,
                   "--env-server-plain", *flags])
    return code, capsys.readouterr().out.strip().splitlines()


def mtls(pki, cert=None, ca=None):  # noqa: F811
    cert = cert or pki.org_a
    return ["--tls-ca", ca or pki.ca_pem, "--tls-cert", cert[0], "--tls-key", cert[1]]


def test_a_client_that_can_join_passes_every_check(tmp_path, pki, capsys):  # noqa: F811
    with federation(tmp_path, pki) as (agg, env):
        code, lines = run(capsys, agg, env, *mtls(pki))
    assert code == 0, lines
    assert [line.split(":")[0] for line in lines[:-1]] == [
        "ok   the aggregator's address", "ok   TLS or plain, as the aggregator", "ok   the aggregator's certificate",
        "ok   this client's certificate", "ok   the aggregator admits this client", "ok   the env server",
        "ok   the base model and its LoRA"]
    assert lines[-1] == f"org-a can join the run at {agg}"


@pytest.mark.parametrize("case, step, reason", [
    ("another CA", "the aggregator's certificate", "is not signed by --tls-ca"),
    ("name mismatch", "the aggregator's certificate", "does not name 127.0.0.1"),
    ("expired server", "the aggregator's certificate", "expired"),
    ("TLS against plain", "TLS or plain, as the aggregator", "serves plain gRPC, not TLS"),
    ("plain against TLS", "TLS or plain, as the aggregator", "serves TLS"),
    ("handshake refused", "this client's certificate", "is not signed by --tls-ca"),
    ("expired client", "this client's certificate", "not now"),
    ("another id", "this client's certificate", "names 'org-b' first, and --client-id is 'org-a'"),
    ("not allowed", "the aggregator admits this client", "the aggregator refuses org-a"),
    ("not secure", "the aggregator admits this client",
     "the aggregator's run t is not secure (no secure aggregation) and this client requires it "
     "(--require-secure-aggregation / FEDSE_REQUIRE_SECURE_AGGREGATION): ask the federation's operator to start "
     "the aggregator with --secure-aggregation, or, to join a run whose aggregator sees your adapter, drop "
     "--require-secure-aggregation"),
    ("nothing there", "the aggregator's address", "nothing listens there"),
])
def test_each_failure_stops_the_checks_with_its_reason(tmp_path, pki, capsys, case, step, reason):  # noqa: F811
    server = {"name mismatch": pki.named_server, "expired server": pki.expired_server}.get(case)
    plain = case == "TLS against plain"
    with federation(tmp_path, pki, cert=server, mtls=not plain, allowed="org-b" if case == "not allowed"
                    else "org-a,org-b") as (agg, env):
        flags = {"another CA": mtls(pki, ca=pki.other_ca_pem), "plain against TLS": [],
                 "handshake refused": mtls(pki, cert=pki.stranger), "expired client": mtls(pki, pki.expired_client),
                 "another id": mtls(pki, pki.org_b),
                 "not secure": [*mtls(pki), "--require-secure-aggregation"]}.get(case, mtls(pki))
        if case == "nothing there":
            agg = "127.0.0.1:1"
        code, lines = run(capsys, agg, env, *flags)
    assert code == 1
    assert lines[-1].startswith(f"FAIL {step}: ") and reason in lines[-1], lines
    assert all(line.startswith("ok   ") for line in lines[:-1])


def test_a_secure_run_passes_a_client_that_requires_it(tmp_path, pki, capsys):  # noqa: F811
    with federation(tmp_path, pki, secure_aggregation=True) as (agg, env):
        code, lines = run(capsys, agg, env, *mtls(pki), "--require-secure-aggregation")
    assert code == 0, lines
    admits, secure = "ok   the aggregator admits this client: ", ", secure aggregation with signed keys"
    assert any(line.startswith(admits) and line.endswith(secure) for line in lines), lines


def test_an_env_server_without_the_environment(tmp_path, pki, capsys):  # noqa: F811
    with federation(tmp_path, pki) as (agg, env):
        code, lines = run(capsys, agg, env, *mtls(pki), "--env", "wordle")
    assert code == 1 and lines[-1].startswith("FAIL the env server: ") and "not wordle" in lines[-1]


def test_a_lora_that_does_not_fit_the_run(tmp_path, pki, capsys):  # noqa: F811
    from fedse.model import adapter as ad
    from services.client_agent.federation.link import FederationClient
    from services.client_agent.model import loading as mdl
    from fedse.security.admission import Security

    with federation(tmp_path, pki) as (agg, env):
        base, _ = mdl.load_base("fedse-tiny", None, seed=0)
        peft = mdl.add_lora(base, r=8)
        other = FederationClient(agg, "org-b", security=Security(tls_ca=pki.ca_pem, tls_cert=pki.org_b[0],
                                                                   tls_key=pki.org_b[1]))
        other.join("maze", "fedse-tiny", ad.Schema.of(mdl.get_adapter_state(peft), mdl.adapter_config_json(peft)))
        other.close()
        code, lines = run(capsys, agg, env, *mtls(pki), "--lora-r", "4")
    assert code == 1 and lines[-1].startswith("FAIL the base model and its LoRA: ") and "--lora-r" in lines[-1], lines


def test_doctor_help_lists_only_the_settings_it_reads_but_takes_every_client_flag(capsys):
    from apps.doctor import SHOWN, doctor

    with pytest.raises(SystemExit):
        doctor(["--help"])
    listed = set(re.findall(r"^  --([a-z-]+)", capsys.readouterr().out, flags=re.M))
    assert listed == {name.replace("_", "-") for name in SHOWN}
    assert "explore-tasks" not in listed and "lr" not in listed
    # A client's whole command line still parses (its training flags are read and left alone).
    from fedse.config import parse
    from services.client_agent.config import ClientConfig

    assert parse(ClientConfig, ["--explore-tasks", "3", "--client-id", "org-a"], shown=SHOWN).explore_tasks == 3


def test_a_missing_base_model_is_one_fail_line_not_a_traceback(tmp_path, pki):  # noqa: F811
    """The check an organisation most often fails: the real command, in its own process, ends with one line."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    with federation(tmp_path, pki) as (agg, env):
        done = subprocess.run([sys.executable, "-m", "apps.cli", "doctor", "--client-id", "org-a", "--env", "maze",
                               "--aggregator", agg, "--env-server", env, "--env-server-plain", *mtls(pki),
                               "--base-model", str(tmp_path / "no-such-model")],
                              cwd=root, capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert lines[-1].startswith("FAIL the base model and its LoRA: ") and "does not exist" in lines[-1], lines
    assert all(line.startswith("ok   ") for line in lines[:-1]), lines


@pytest.mark.parametrize("case, reason", [
    ("missing TLS file", "--tls-cert"),
    ("bad members file", "--secure-members"),
])
def test_settings_the_client_would_refuse_are_one_fail_line(tmp_path, pki, capsys, case, reason):  # noqa: F811
    """Settings the client agent refuses at start (before any check could run) fail as doctor's first line,
    on stdout with exit status 1, as every other check does."""
    members = tmp_path / "members.txt"
    members.write_text("org-a\nnot a valid id!\n")
    flags = {"missing TLS file": ["--tls-ca", pki.ca_pem, "--tls-cert", str(tmp_path / "gone.pem"),
                                  "--tls-key", pki.org_a[1]],
             "bad members file": [*mtls(pki), "--secure-members", str(members)]}[case]
    code, lines = run(capsys, "127.0.0.1:1", "127.0.0.1:2", *flags)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert lines == [lines[-1]] and lines[-1].startswith("FAIL this client's settings: ") and reason in lines[-1], lines


def test_an_unreachable_env_server_is_one_fail_line(tmp_path, pki, capsys):  # noqa: F811
    with federation(tmp_path, pki) as (agg, _env):
        code, lines = run(capsys, agg, "127.0.0.1:1", *mtls(pki))
    assert code == 1 and lines[-1].startswith("FAIL the env server: "), lines


def test_a_check_that_breaks_unexpectedly_is_still_one_line(tmp_path, pki, capsys, monkeypatch):  # noqa: F811
    import apps.doctor as doctor_module

    def broken(cfg):
        raise KeyError("surprise")

    monkeypatch.setattr(doctor_module, "base_model", broken)
    with federation(tmp_path, pki) as (agg, env):
        code, lines = run(capsys, agg, env, *mtls(pki))
    assert code == 1 and lines[-1].startswith("FAIL the base model and its LoRA: KeyError"), lines
