"""Who may join: mTLS and bearer-token modes over real gRPC on loopback, with real certificates (trustme)."""

import contextlib
import logging

import grpc
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedse.security import admission as security
from fedse.config import ConfigError
from fedse.security.admission import Security
from fedse.transport.serving import Service, insecure_channel
from support import Pki

SERVICE = "fedse.test.Echo"
TOKEN = "0123456789abcdef0123456789abcdef"
TIMEOUT = 5.0


def _identity(context) -> bytes:
    return (security.peer_identity(context) or "").encode()


def _collect(request_iterator, context) -> bytes:
    return b"|".join([*request_iterator, _identity(context)])


ECHO = grpc.method_handlers_generic_handler(SERVICE, {
    "Whoami": grpc.unary_unary_rpc_method_handler(lambda request, context: _identity(context)),
    "WhoamiStream": grpc.unary_stream_rpc_method_handler(lambda request, context: iter([_identity(context)])),
    "Collect": grpc.stream_unary_rpc_method_handler(_collect),
    "Chat": grpc.stream_stream_rpc_method_handler(lambda requests, context: (_identity(context) for _ in requests)),
})


def call(ch: grpc.Channel, kind: str = "unary_unary") -> bytes:
    """One call of the given kind; returns the identity the servicer saw."""
    if kind == "unary_unary":
        return ch.unary_unary(f"/{SERVICE}/Whoami")(b"", timeout=TIMEOUT)
    if kind == "unary_stream":
        return b"".join(ch.unary_stream(f"/{SERVICE}/WhoamiStream")(b"", timeout=TIMEOUT))
    if kind == "stream_unary":
        return ch.stream_unary(f"/{SERVICE}/Collect")(iter([b"x"]), timeout=TIMEOUT).split(b"|")[-1]
    return b"".join(ch.stream_stream(f"/{SERVICE}/Chat")(iter([b"x"]), timeout=TIMEOUT))


KINDS = ["unary_unary", "unary_stream", "stream_unary", "stream_stream"]


def refused(ch: grpc.Channel, kind: str = "unary_unary") -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(ch, kind)
    return info.value


def health_status(ch: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def token_file(tmp_path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")  # a Secret's file often ends in a newline
    return str(path)


@contextlib.contextmanager
def serve(sec: Security, health_address: str = ""):
    service = Service("sectest", "127.0.0.1:0", max_workers=4, credentials=security.server_credentials(sec),
                      interceptors=security.server_interceptors(sec), health_address=health_address)
    service.server.add_generic_rpc_handlers((ECHO,))
    service.start()
    service.ready([SERVICE])
    try:
        yield service
    finally:
        service.stop(0)


@contextlib.contextmanager
def connect(target: str, sec: Security):
    ch = security.channel(target, sec)
    try:
        yield ch
    finally:
        ch.close()


def mtls_server(pki: Pki, **kw) -> Security:
    return Security(tls_ca=pki.ca_pem, tls_cert=pki.server[0], tls_key=pki.server[1], **kw)


def client(pki: Pki, pair: tuple[str, str] | None = None, **kw) -> Security:
    cert, key = pair or ("", "")
    return Security(tls_ca=pki.ca_pem, tls_cert=cert, tls_key=key, **kw)


def handled(code: str, method: str = "Whoami") -> float:
    value = prometheus_client.REGISTRY.get_sample_value(
        "grpc_server_handled_total", {"grpc_service": SERVICE, "grpc_method": method, "grpc_code": code})
    return value or 0.0


# --- mTLS ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_mtls_client_signed_by_the_ca_is_identified_by_its_certificate(pki, kind):
    sec = mtls_server(pki)
    assert sec.mode == "mtls"
    with serve(sec) as svc, connect(f"127.0.0.1:{svc.port}", client(pki, pki.org_a)) as ch:
        assert call(ch, kind) == b"org-a"  # the SAN, not the CN


def test_mtls_client_without_certificate_fails_the_handshake(pki):
    with serve(mtls_server(pki)) as svc:
        with connect(f"127.0.0.1:{svc.port}", client(pki)) as ch:
            assert refused(ch).code() == grpc.StatusCode.UNAVAILABLE
        with connect(f"127.0.0.1:{svc.port}", Security()) as plain:
            assert refused(plain).code() == grpc.StatusCode.UNAVAILABLE
        # The same server still admits a proper client: the refusals were about the certificates.
        with connect(f"127.0.0.1:{svc.port}", client(pki, pki.org_a)) as ch:
            assert call(ch) == b"org-a"


def test_mtls_client_with_certificate_from_another_ca_fails(pki):
    with serve(mtls_server(pki)) as svc, connect(f"127.0.0.1:{svc.port}", client(pki, pki.stranger)) as ch:
        assert refused(ch).code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_not_in_allowed_clients_is_denied_by_name(pki):
    with serve(mtls_server(pki, allowed_clients="org-a, org-c")) as svc:
        target = f"127.0.0.1:{svc.port}"
        before = handled("PERMISSION_DENIED")
        with connect(target, client(pki, pki.org_b)) as ch:
            for kind in KINDS:
                err = refused(ch, kind)
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "'org-b'" in err.details()
        # Metrics run before auth, so refused calls are counted.
        assert handled("PERMISSION_DENIED") == before + 1
        with connect(target, client(pki, pki.org_a)) as ch:
            assert call(ch) == b"org-a"


def test_mtls_health_is_served_plain_on_the_health_port_and_nothing_else(pki):
    with serve(mtls_server(pki), health_address="127.0.0.1:0") as svc:
        assert svc.health_port > 0 and svc.health_port != svc.port
        with connect(f"127.0.0.1:{svc.health_port}", Security()) as probe:
            assert health_status(probe) == health_pb2.HealthCheckResponse.SERVING
            assert refused(probe).code() == grpc.StatusCode.UNIMPLEMENTED
        with connect(f"127.0.0.1:{svc.port}", Security()) as plain:
            with pytest.raises(grpc.RpcError) as info:
                health_status(plain)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with connect(f"127.0.0.1:{svc.port}", client(pki, pki.org_b)) as ch:
            assert health_status(ch) == health_pb2.HealthCheckResponse.SERVING
        svc.health.enter_graceful_shutdown()
        with connect(f"127.0.0.1:{svc.health_port}", Security()) as probe:
            assert health_status(probe) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_interceptor_in_mtls_mode_refuses_calls_without_a_verified_certificate():
    # A plain port on an mTLS server (a misconfiguration) must not become a way around the certificates.
    interceptor = security.AuthInterceptor(require_identity=True)
    service = Service("sectest-plain", "127.0.0.1:0", max_workers=2, interceptors=[interceptor])
    service.server.add_generic_rpc_handlers((ECHO,))
    service.start()
    try:
        with connect(f"127.0.0.1:{service.port}", Security()) as ch:
            err = refused(ch)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "client certificate" in err.details()
    finally:
        service.stop(0)


# --- token --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_token_mode_admits_the_right_token_and_refuses_missing_or_wrong(tmp_path, token_file, kind):
    wrong = tmp_path / "wrong"
    wrong.write_text(TOKEN[::-1])
    sec = Security(token_file=token_file)
    assert sec.mode == "token"
    with serve(sec) as svc:
        target = f"127.0.0.1:{svc.port}"
        with connect(target, Security(token_file=token_file)) as ch:
            assert call(ch, kind) == b""  # no certificate, so no identity
        for who in (Security(), Security(token_file=str(wrong))):
            with connect(target, who) as ch:
                err = refused(ch, kind)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "--token-file" in err.details()


def test_token_mode_health_needs_no_token_and_refusals_are_counted(token_file):
    with serve(Security(token_file=token_file)) as svc, insecure_channel(f"127.0.0.1:{svc.port}") as ch:
        assert health_status(ch) == health_pb2.HealthCheckResponse.SERVING
        before = handled("UNAUTHENTICATED")
        assert refused(ch).code() == grpc.StatusCode.UNAUTHENTICATED
        assert handled("UNAUTHENTICATED") == before + 1


def test_token_without_tls_is_logged_as_a_warning(token_file, caplog):
    with caplog.at_level(logging.WARNING, logger="fedse.security.admission"):
        security.channel("127.0.0.1:1", Security(token_file=token_file)).close()
    assert any("clear text" in r.getMessage() for r in caplog.records)


def test_tls_with_token_and_server_name_override(pki, tmp_path, token_file):
    wrong = tmp_path / "wrong"
    wrong.write_text(TOKEN.upper())
    server = Security(tls_cert=pki.named_server[0], tls_key=pki.named_server[1], token_file=token_file)
    assert server.mode == "tls+token"
    with serve(server) as svc:
        target = f"127.0.0.1:{svc.port}"
        good = Security(tls_ca=pki.ca_pem, token_file=token_file, tls_server_name="aggregator.fedse.internal")
        with connect(target, good) as ch:
            assert call(ch) == b""
        # The certificate does not name 127.0.0.1: without the override the client refuses the server.
        with connect(target, Security(tls_ca=pki.ca_pem, token_file=token_file)) as ch:
            assert refused(ch).code() == grpc.StatusCode.UNAVAILABLE
        bad = Security(tls_ca=pki.ca_pem, token_file=str(wrong), tls_server_name="aggregator.fedse.internal")
        with connect(target, bad) as ch:
            assert refused(ch).code() == grpc.StatusCode.UNAUTHENTICATED


def test_mtls_and_token_together_need_both(pki, token_file):
    with serve(mtls_server(pki, token_file=token_file)) as svc:
        target = f"127.0.0.1:{svc.port}"
        with connect(target, client(pki, pki.org_a, token_file=token_file)) as ch:
            assert call(ch) == b"org-a"
        with connect(target, client(pki, pki.org_a)) as ch:
            assert refused(ch).code() == grpc.StatusCode.UNAUTHENTICATED


# --- identity and configuration -------------------------------------------------------------------------


class FakeContext:
    def __init__(self, auth):
        self._auth = auth

    def auth_context(self):
        return self._auth


def test_peer_identity_prefers_san_then_cn_and_is_none_without_tls():
    ssl = {"transport_security_type": [b"ssl"]}
    assert security.peer_identity(FakeContext({**ssl, "x509_common_name": [b"org-cn"],
                                               "x509_subject_alternative_name": [b"org-san", b"x"]})) == "org-san"
    assert security.peer_identity(FakeContext({**ssl, "x509_common_name": [b"org-cn"]})) == "org-cn"
    assert security.peer_identity(FakeContext(ssl)) is None
    assert security.peer_identity(FakeContext({"transport_security_type": [b"insecure"],
                                               "x509_common_name": [b"forged"]})) is None
    assert security.peer_identity(FakeContext({})) is None


def test_allowed_clients_from_a_list_or_a_file(pki, tmp_path):
    assert mtls_server(pki).allowed() is None
    assert mtls_server(pki, allowed_clients=" org-a ,org-b,").allowed() == {"org-a", "org-b"}
    listing = tmp_path / "allowed"
    listing.write_text("# members\norg-a\norg-b, org-c  # joined in May\n\n")
    assert mtls_server(pki, allowed_clients=f"@{listing}").allowed() == {"org-a", "org-b", "org-c"}


def test_open_mode_adds_no_interceptor_and_no_credentials():
    sec = Security()
    assert sec.mode == "open" and not sec.tls.enabled
    assert security.server_credentials(sec) is None and security.server_interceptors(sec) == []


def _files(tmp_path, pki):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    short = tmp_path / "short"
    short.write_text("abc123")
    spaced = tmp_path / "spaced"
    spaced.write_text("a token with spaces in it, long enough")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    none = tmp_path / "none"
    none.write_text("# nobody yet\n")
    return {"empty": str(empty), "short": str(short), "spaced": str(spaced), "not_pem": str(not_pem),
            "missing": str(tmp_path / "missing.pem"), "none": str(none), "cert": pki.server[0],
            "key": pki.server[1], "ca": pki.ca_pem}


@pytest.mark.parametrize("kwargs, message", [
    (dict(tls_cert="cert"), "--tls-cert is set but --tls-key is not"),
    (dict(tls_key="key"), "--tls-key is set but --tls-cert is not"),
    (dict(tls_ca="missing"), "cannot read it"),
    (dict(tls_ca="not_pem"), "is not a PEM file"),
    (dict(token_file="missing"), "--token-file"),
    (dict(token_file="empty"), "is empty: put the federation's token in it"),
    (dict(token_file="short"), "use at least 16"),
    (dict(token_file="spaced"), "printable ASCII without spaces"),
    (dict(tls_cert="cert", tls_key="key", allowed_clients="org-a"), "--allowed-clients needs mTLS"),
    (dict(tls_ca="ca", tls_cert="cert", tls_key="key", allowed_clients="@none"), "names no client"),
    (dict(tls_ca="ca", tls_cert="cert", tls_key="key", allowed_clients="@missing"), "cannot read it"),
    (dict(tls_server_name="aggregator"), "--tls-server-name only applies to TLS"),
])
def test_bad_settings_raise_config_error_saying_what_to_fix(pki, tmp_path, kwargs, message):
    files = _files(tmp_path, pki)
    resolved = {}
    for k, v in kwargs.items():
        if k == "allowed_clients" and v.startswith("@"):
            resolved[k] = "@" + files[v[1:]]
        else:
            resolved[k] = files.get(v, v)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
        Security(**resolved)
    assert "\n" not in str(info.value)


def test_server_with_a_ca_but_no_certificate_is_a_config_error(pki):
    sec = Security(tls_ca=pki.ca_pem)  # fine for a client: it verifies the server with the CA
    with pytest.raises(ConfigError, match="a server needs its own certificate and key"):
        security.server_credentials(sec)


def test_from_config_picks_the_security_fields(pki):
    class Config:
        address = "0.0.0.0:1"
        tls_ca = pki.ca_pem
        tls_cert, tls_key = pki.org_a

    sec = Security.from_config(Config())
    assert sec.tls == security.TlsFiles(pki.ca_pem, *pki.org_a) and sec.token_file == ""


def test_a_key_that_does_not_match_the_certificate_stops_the_server_with_a_clear_error(pki):
    sec = Security(tls_cert=pki.server[0], tls_key=pki.org_a[1])
    with pytest.raises(ConfigError, match="private key of the certificate") as info:
        security.server_credentials(sec)
    assert pki.org_a[1] in str(info.value) and pki.server[0] in str(info.value)
    with pytest.raises(ConfigError, match="private key of the certificate"):
        security.channel("127.0.0.1:1", sec)
