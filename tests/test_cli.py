"""Every service starts from the one `fedse` command: `fedse aggregator`, `fedse env-server` and
`fedse client` take the flags, FEDSE_* variables and help of `python -m services.X`."""

from __future__ import annotations

import importlib

import pytest

from apps import cli
from apps.processes import Proc
from fedse.transport.serving import insecure_channel
from fedse.v1 import env_pb2, env_pb2_grpc


def after_usage(text: str) -> str:
    """--help's text from the description on (the usage line names the program)."""
    return text.split("\n\n", 1)[1]


@pytest.mark.parametrize("name", list(cli.SERVICES))
def test_each_service_subcommand_prints_the_services_own_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0
    ours = capsys.readouterr().out
    with pytest.raises(SystemExit):
        importlib.import_module(f"{cli.SERVICES[name]}.server").main(["--help"])
    theirs = capsys.readouterr().out
    assert ours.startswith(f"usage: fedse {name} [-h]")
    assert after_usage(ours) == after_usage(theirs)
    assert "--seed SEED" in ours and "FEDSE_SEED" in ours


@pytest.mark.parametrize("command", ["run", "experiment", "status"])
def test_the_other_commands_help_names_them_too(command, capsys, monkeypatch):
    monkeypatch.setattr(cli.signal, "signal", lambda *_: None)  # leave pytest's handlers alone
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"usage: fedse {command} [-h]")


@pytest.mark.parametrize("command,theirs", [("aggregator", "--tls-server-name"), ("env-server", "--tls-server-name"),
                                             ("client", "--allowed-clients"), ("tasks", "--allowed-clients"),
                                             ("status", "--allowed-clients")])
def test_help_leaves_out_the_other_sides_settings(command, theirs, capsys):
    """A server's --help has no --tls-server-name (the name a client expects of the server), a client's no
    --allowed-clients (the ids a server admits); each lists its own side's."""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    shown = capsys.readouterr().out
    ours = "--allowed-clients" if theirs == "--tls-server-name" else "--tls-server-name"
    assert theirs not in shown and ours in shown and "--tls-ca" in shown


def test_a_bad_setting_stops_a_service_subcommand_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["aggregator", "--rounds", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "configuration error: --rounds must be at least 1, got 0\n"


def test_fedse_env_server_serves_its_flags_and_variables_over_grpc(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSE_ENVS", "wordle?vocab_size=30,maze")  # a variable, as in the manifests
    proc = Proc("env_server", ["apps.cli", "env-server", "--address", "127.0.0.1:0", "--metrics-port", "-1"],
                tmp_path)
    try:
        with insecure_channel(f"127.0.0.1:{proc.port()}") as channel:
            reply = env_pb2_grpc.EnvServiceStub(channel).ListEnvironments(env_pb2.ListEnvironmentsRequest(),
                                                                         timeout=30)
        assert list(reply.envs) == ["wordle", "maze"]
    finally:
        proc.stop()
    assert proc.popen.returncode == 0  # SIGTERM: a graceful stop, as `python -m services.env_server`'s


def test_fedse_tasks_speaks_mtls_to_an_env_server_that_serves_it(tmp_path, capsys):
    from apps.cli import tasks
    from services.env_server.server import EnvServerConfig, create_server
    from support import Pki

    pki = Pki(tmp_path)
    server, port = create_server(EnvServerConfig(address="127.0.0.1:0", metrics_port=-1, envs="maze",
                                                 tls_ca=pki.ca_pem, tls_cert=pki.server[0], tls_key=pki.server[1]))
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        assert tasks(["--env-server", target, "--tls-ca", pki.ca_pem, "--tls-cert", pki.org_a[0],
                      "--tls-key", pki.org_a[1]]) == 0
        assert capsys.readouterr().out.splitlines()[1].split()[0] == "maze"
        assert tasks(["--env-server", target, "--timeout-s", "3"]) == 1  # plain gRPC against mTLS
        assert "fedse tasks: cannot connect" in capsys.readouterr().err
    finally:
        server.stop(0)
