"""Certificates renewed in place, as cert-manager renews a mounted Secret: servers and clients take them
without a restart. Real TLS over loopback, certificates from trustme, the real aggregator and clients."""

import contextlib
import logging
import os
import pathlib
import socket
import ssl
from typing import Iterator

import grpc
import pytest
import trustme
from cryptography import x509

from fedse.security import admission as security
from fedse.security.admission import Security
from fedse.transport.serving import Service
from fedse.v1 import env_pb2 as epb
from fedse.v1 import env_pb2_grpc as epb_grpc
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from services.client_agent.playing.envclient import EnvClient
from services.client_agent.federation.link import FederationClient
from support import FakeAggregator, aggregator_in_process, wait_for

SERVER_NAMES = ("localhost", "127.0.0.1")


def issue(ca: trustme.CA, *names: str, common_name: str | None = None) -> tuple[bytes, bytes]:
    """(certificate chain, key), PEM; each issued certificate has a new serial and a new key."""
    cert = ca.issue_cert(*names, common_name=common_name)
    return b"".join(p.bytes() for p in cert.cert_chain_pems), cert.private_key_pem.bytes()


def serial(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def replace(path: pathlib.Path, data: bytes) -> None:
    """Writes a file whole, then renames it over `path`: one file renewed at a time."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class SecretVolume:
    """A folder laid out as the kubelet mounts a Secret: each file a link through `..data` to a
    folder of this version's files, all renewed at once by renaming a new `..data` link over it."""

    def __init__(self, root: pathlib.Path):
        self.root, self.version = root, 0
        root.mkdir()

    def path(self, name: str) -> str:
        return str(self.root / name)

    def write(self, files: dict[str, bytes]) -> None:
        self.version += 1
        folder = self.root / f"..v{self.version}"
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
        (self.root / "..data_tmp").symlink_to(folder.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")
        for name in files:
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")

    def security(self, **kw) -> Security:
        return Security(tls_ca=self.path("ca.crt"), tls_cert=self.path("tls.crt"), tls_key=self.path("tls.key"), **kw)


class Client:
    """A client's CA and certificate files, plain files in a folder."""

    def __init__(self, root: pathlib.Path, ca: trustme.CA, name: str):
        root.mkdir(exist_ok=True)
        self.ca, self.cert, self.key = root / f"{name}-ca.pem", root / f"{name}.pem", root / f"{name}-key.pem"
        self.ca.write_bytes(ca.cert_pem.bytes())
        self.pem, key = issue(ca, name)
        self.cert.write_bytes(self.pem)
        self.key.write_bytes(key)

    def security(self) -> Security:
        return Security(tls_ca=str(self.ca), tls_cert=str(self.cert), tls_key=str(self.key))


def served(port: int, client: Client) -> x509.Certificate:
    """The certificate the server on `port` presents to a new connection, as Python's ssl sees it."""
    ctx = ssl.create_default_context(cafile=str(client.ca))
    ctx.load_cert_chain(str(client.cert), str(client.key))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, \
            ctx.wrap_socket(sock, server_hostname="localhost") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


def warnings_about(caplog, text: str = "") -> list[logging.LogRecord]:
    """fedse.security.admission's warnings whose fields hold `text`."""
    return [r for r in caplog.records if r.name == "fedse.security.admission" and r.levelno == logging.WARNING
            and text in str(getattr(r, "fields", ""))]


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA(organization_name="fedse federation")


# --- servers ------------------------------------------------------------------------------------------


def test_the_aggregator_serves_a_renewed_certificate_to_new_connections_without_a_restart(tmp_path, ca, caplog):
    secret = SecretVolume(tmp_path / "aggregator-tls")
    first, key = issue(ca, *SERVER_NAMES, common_name="aggregator")
    secret.write({"ca.crt": ca.cert_pem.bytes(), "tls.crt": first, "tls.key": key})
    org_a = Client(tmp_path / "clients", ca, "org-a")
    with aggregator_in_process(tmp_path / "state", **vars(secret.security())) as (agg, port, _):
        kept = FederationClient(f"127.0.0.1:{port}", "org-a", retries=0, timeout_s=5, security=org_a.security())
        assert kept.status().run_id == "t"
        assert served(port, org_a).serial_number == serial(first)

        renewed, key = issue(ca, *SERVER_NAMES, common_name="aggregator renewed")
        with caplog.at_level(logging.INFO, logger="fedse.security.admission"):
            secret.write({"ca.crt": ca.cert_pem.bytes(), "tls.crt": renewed, "tls.key": key})
            seen = served(port, org_a)
        assert seen.serial_number == serial(renewed) != serial(first)
        assert seen.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "aggregator renewed"
        assert any(r.getMessage().startswith("TLS files renewed") for r in caplog.records)
        # The same aggregator all along: a new client joins its run, the one from before still calls.
        fresh = FederationClient(f"127.0.0.1:{port}", "org-a", retries=0, timeout_s=5, security=org_a.security())
        assert fresh.status().run_id == kept.status().run_id == "t"
        assert agg.service.port == port
        fresh.close()
        kept.close()


def test_a_renewal_to_a_new_ca_admits_clients_of_the_new_ca_only(tmp_path, ca):
    secret = SecretVolume(tmp_path / "aggregator-tls")
    cert, key = issue(ca, *SERVER_NAMES)
    secret.write({"ca.crt": ca.cert_pem.bytes(), "tls.crt": cert, "tls.key": key})
    old = Client(tmp_path / "old", ca, "org-a")
    new_ca = trustme.CA(organization_name="fedse federation, second CA")
    new = Client(tmp_path / "new", new_ca, "org-a")
    with aggregator_in_process(tmp_path / "state", **vars(secret.security())) as (_, port, _):
        target = f"127.0.0.1:{port}"
        with pytest.raises(grpc.RpcError) as info:
            FederationClient(target, "org-a", retries=0, timeout_s=5, security=new.security()).status()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert FederationClient(target, "org-a", retries=0, timeout_s=5, security=old.security()).status().run_id

        cert, key = issue(new_ca, *SERVER_NAMES)
        secret.write({"ca.crt": new_ca.cert_pem.bytes(), "tls.crt": cert, "tls.key": key})
        assert served(port, new).serial_number == serial(cert)
        assert FederationClient(target, "org-a", retries=0, timeout_s=5, security=new.security()).status().run_id
        with pytest.raises(grpc.RpcError) as info:
            FederationClient(target, "org-a", retries=0, timeout_s=5, security=old.security()).status()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(ssl.SSLCertVerificationError):
            served(port, old)  # the old CA does not vouch for the new certificate


def test_a_half_written_renewal_keeps_the_last_good_certificate_and_warns_once(tmp_path, ca, caplog):
    files = tmp_path / "tls"
    files.mkdir()
    first, key = issue(ca, *SERVER_NAMES)
    for name, data in (("ca.pem", ca.cert_pem.bytes()), ("cert.pem", first), ("key.pem", key)):
        (files / name).write_bytes(data)
    org_a = Client(tmp_path / "clients", ca, "org-a")
    sec = Security(tls_ca=str(files / "ca.pem"), tls_cert=str(files / "cert.pem"), tls_key=str(files / "key.pem"))
    with aggregator_in_process(tmp_path / "state", **vars(sec)) as (_, port, _):
        renewed, new_key = issue(ca, *SERVER_NAMES)
        with caplog.at_level(logging.INFO, logger="fedse.security.admission"):
            replace(files / "key.pem", new_key)  # the key renewed, the certificate not yet
            for _ in range(3):
                assert served(port, org_a).serial_number == serial(first)
            client = FederationClient(f"127.0.0.1:{port}", "org-a", retries=0, timeout_s=5, security=org_a.security())
            assert client.status().run_id == "t"
            client.close()
            assert len(warnings_about(caplog, str(files / "key.pem"))) == 1
            assert "private key of the certificate" in str(warnings_about(caplog, "key.pem")[0].fields)

            (files / "cert.pem").write_bytes(renewed[:100])  # now cut short, written in place
            assert served(port, org_a).serial_number == serial(first)
            assert len(warnings_about(caplog, "not a whole PEM certificate")) == 1

            replace(files / "cert.pem", renewed)  # the renewal complete
            assert served(port, org_a).serial_number == serial(renewed)
            assert served(port, org_a).serial_number == serial(renewed)
        assert len(warnings_about(caplog)) == 2


# --- clients ------------------------------------------------------------------------------------------


def peer_serial(context: grpc.ServicerContext) -> int:
    return serial(context.auth_context()["x509_pem_cert"][0])


class SeesCertificates(FakeAggregator):
    """Records the serial of the client certificate behind each GetRoundStatus."""

    def __init__(self):
        super().__init__()
        self.serials: list[int] = []

    def GetRoundStatus(self, request, context):
        self.serials.append(peer_serial(context))
        return super().GetRoundStatus(request, context)


@contextlib.contextmanager
def mtls_server(tmp_path: pathlib.Path, ca: trustme.CA, add_servicer) -> Iterator[int]:
    """A Service serving mTLS from a Secret volume, with the servicer `add_servicer(server)` adds: its port."""
    secret = SecretVolume(tmp_path / "server-tls")
    cert, key = issue(ca, *SERVER_NAMES)
    secret.write({"ca.crt": ca.cert_pem.bytes(), "tls.crt": cert, "tls.key": key})
    service = Service("renewal-test", "127.0.0.1:0", max_workers=4,
                      credentials=security.server_credentials(secret.security()))
    add_servicer(service.server)
    service.start()
    try:
        yield service.port
    finally:
        service.stop(0)


@pytest.fixture
def fake(tmp_path, ca):
    """A fake aggregator that records client certificates, serving mTLS, and org-a's FederationClient
    to it: (aggregator, port, org-a's files, client)."""
    agg = SeesCertificates()
    org_a = Client(tmp_path / "org-a", ca, "org-a")
    with mtls_server(tmp_path, ca, lambda server: fpb_grpc.add_FederationServiceServicer_to_server(agg, server)) \
            as port:
        client = FederationClient(f"127.0.0.1:{port}", "org-a", retries=0, timeout_s=5, security=org_a.security())
        yield agg, port, org_a, client
        client.close()


def established(port: int) -> int:
    """TCP connections to `port` from this machine that are open, from /proc/net/tcp."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def test_a_client_presents_its_renewed_certificate_at_its_next_call(fake, ca, caplog):
    agg, _, org_a, client = fake
    client.status()
    renewed, key = issue(ca, "org-a")
    with caplog.at_level(logging.WARNING, logger="fedse.security.admission"):
        replace(org_a.key, key)  # half-way: the old certificate with the new key
        client.status()
        client.status()
    assert agg.serials == [serial(org_a.pem)] * 3
    assert len(warnings_about(caplog, str(org_a.key))) == 1

    replace(org_a.cert, renewed)
    client.status()
    assert agg.serials[-1] == serial(renewed)


def test_a_call_running_when_the_files_are_renewed_goes_on_and_its_channel_closes_after_it(fake, ca):
    agg, port, org_a, client = fake
    watch = client.stub.WatchRound(fpb.RoundStatusRequest(client_id="org-a"), timeout=10)
    assert next(watch).round == 1
    renewed, key = issue(ca, "org-a")
    replace(org_a.key, key)
    replace(org_a.cert, renewed)
    client.status()  # over a new channel, while the stream holds the one before
    assert agg.serials == [serial(renewed)]
    assert established(port) == 2

    agg.open(2, b"")
    assert next(watch).round == 2
    agg.open(3, b"")  # the last round: the stream ends
    assert [st.state for st in watch] == [fpb.ROUND_STATE_FINISHED]
    wait_for("the replaced channel to close", lambda: established(port) == 1, timeout=10)
    client.status()
    assert agg.serials == [serial(renewed)] * 2


class EnvSeesCertificates(epb_grpc.EnvServiceServicer):
    def __init__(self):
        self.serials: list[int] = []

    def ListEnvironments(self, request, context):
        self.serials.append(peer_serial(context))
        return epb.ListEnvironmentsResponse(envs=["maze"])


def test_the_env_client_follows_renewed_files(tmp_path, ca):
    env = EnvSeesCertificates()
    secret = SecretVolume(tmp_path / "client-tls")
    cert, key = issue(ca, "org-a")
    secret.write({"ca.crt": ca.cert_pem.bytes(), "tls.crt": cert, "tls.key": key})
    with mtls_server(tmp_path, ca, lambda server: epb_grpc.add_EnvServiceServicer_to_server(env, server)) as port:
        client = EnvClient(f"127.0.0.1:{port}", "maze", timeout_s=5, retry_s=0, security=secret.security())
        assert set(client.environments()) == {"maze"}
        renewed, key = issue(ca, "org-a")
        secret.write({"ca.crt": ca.cert_pem.bytes(), "tls.crt": renewed, "tls.key": key})
        client.with_env("maze").environments()
        assert env.serials == [serial(cert), serial(renewed)]
        client.close_channel()
