"""Who may join a federation: mutual TLS, a shared bearer token, or both.

Modes, chosen by which settings are given (`Security.mode` names the one in force):

- open: nothing set. Plain gRPC; anyone who can reach the port may call. Development only.
- token: `token_file` only. Every call carries `authorization: Bearer <token>`; the server refuses
  calls without it (UNAUTHENTICATED). Without TLS the token crosses the network in clear text, so
  this is for a trusted network; both sides log a warning. grpc refuses call credentials on an
  insecure channel, so in this mode the client adds the header with a client interceptor.
- tls: server `tls_cert` + `tls_key`; clients verify the server against `tls_ca` (or the system
  roots). Traffic is encrypted, clients stay anonymous; combine with a token to admit only members.
- mtls: server `tls_ca` + `tls_cert` + `tls_key`. The server requires a client certificate signed by
  that CA (a client without one, or with one from another CA, fails the handshake: UNAVAILABLE).
  The client's identity is its certificate's first subject alternative name, else its common name
  (the order grpc's own `peer_identities` uses); `allowed_clients` narrows who may call
  (PERMISSION_DENIED otherwise). A token may be added on top.

Servicers read the authenticated caller with `peer_identity(context)` (None unless mTLS); the
aggregator's servicer refuses a call whose `client_id` is not the caller's own.

Renewal: TLS files renewed in place (cert-manager renewing a mounted Secret) are taken without a
restart, by a server at its next TLS handshake and by a client at its next call; a renewal caught
half-way keeps the files in use (fedse/security/tls_files.py).

Health: `grpc.health.v1.Health` is exempt from the token and from `allowed_clients`, so Kubernetes
probes need no secret. Kubernetes' native gRPC probe cannot speak TLS, though, so once a server
serves TLS its probes cannot reach the main port. The simplest sound option, used here: the
server also serves health alone on a plain port (`fedse.transport.serving.Service(health_address=...)`,
e.g. `0.0.0.0:50061`), a separate grpc server that holds only the health service, and the probes
point at that port. It reveals nothing but SERVING / NOT_SERVING. (The alternative, an exec probe
running grpc_health_probe with -tls flags and a client certificate, puts a client key in every pod.)
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import grpc

from fedse.security.tls_files import Pem, Renewal, RenewingChannel, TlsFiles, read_file, read_pem
from fedse.config import ConfigError, field
from fedse.transport.serving import insecure_channel, log_fields, secure_channel

log = logging.getLogger("fedse.security.admission")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTH_HEADER = "authorization"
MIN_TOKEN_CHARS = 16


# Settings only one side of a connection reads: --help leaves them out of the other side's commands
# (still read there, from flags and variables alike, and ignored).
SERVER_ONLY = frozenset({"allowed_clients"})
CLIENT_ONLY = frozenset({"tls_server_name"})


def shown_for(config_class: type, side: str) -> list[str]:
    """The fields a command's --help lists: all but the other side's (side: "server" or "client")."""
    other = SERVER_ONLY if side == "client" else CLIENT_ONLY
    return [f.name for f in dataclasses.fields(config_class) if f.name not in other]


@dataclasses.dataclass(frozen=True)
class Security:
    """Transport security and admission; the same fields on servers and clients.

    The fields are meant to be copied, help texts included, into a service's config dataclass
    (`Security.from_config(config)` then builds this from it).
    """

    tls_ca: str = field("", "PEM file of the federation CA: a server requires client certificates signed by it "
                            "(mTLS); a client verifies the server with it")
    tls_cert: str = field("", "PEM file of this process's certificate (chain), given with --tls-key")
    tls_key: str = field("", "PEM file of the private key of --tls-cert")
    token_file: str = field("", "file holding the federation's shared bearer token (e.g. a mounted Kubernetes Secret)")
    allowed_clients: str = field("", "server, mTLS only: client ids (certificate names) that may call, comma-separated, "
                                     "or @FILE with one per line; empty admits any certificate the CA signed")
    tls_server_name: str = field("", "client: name expected in the server's certificate when it differs from the "
                                     "host in the target address")

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            given, missing = ("--tls-cert", "--tls-key") if self.tls_cert else ("--tls-key", "--tls-cert")
            raise ConfigError(f"{given} is set but {missing} is not: give the certificate and its private key together")
        for flag, path in (("--tls-ca", self.tls_ca), ("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path:
                read_pem(flag, path)
        if self.token_file:
            self.token()
        if self.allowed_clients and not (self.tls_ca and self.tls_cert):
            raise ConfigError("--allowed-clients needs mTLS (--tls-ca, --tls-cert and --tls-key): without client "
                              "certificates there is no identity to check")
        if self.allowed_clients:
            self.allowed()
        if self.tls_server_name and not self.tls.enabled:
            raise ConfigError("--tls-server-name only applies to TLS: also give --tls-ca (or drop it)")

    @classmethod
    def from_config(cls, config: Any) -> "Security":
        """Builds from any object with (some of) the same attribute names, e.g. a service config."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if hasattr(config, f.name)})

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_ca, self.tls_cert, self.tls_key)

    @property
    def mode(self) -> str:
        """open, token, tls, tls+token, mtls or mtls+token (as a server with these settings runs)."""
        base = "mtls" if self.tls_ca and self.tls_cert else "tls" if self.tls.enabled else ""
        if self.token_file:
            return f"{base}+token" if base else "token"
        return base or "open"

    def token(self) -> str | None:
        """The bearer token from token_file (surrounding whitespace removed), or None if unset."""
        if not self.token_file:
            return None
        raw = read_file("--token-file", self.token_file).decode("utf-8", errors="replace").strip()
        if not raw:
            raise ConfigError(f"--token-file {self.token_file} is empty: put the federation's token in it")
        if not all(33 <= ord(c) <= 126 for c in raw):
            raise ConfigError(f"--token-file {self.token_file}: the token must be printable ASCII without spaces "
                              f"(e.g. from `openssl rand -hex 32`)")
        if len(raw) < MIN_TOKEN_CHARS:
            raise ConfigError(f"--token-file {self.token_file}: the token has {len(raw)} characters, use at least "
                              f"{MIN_TOKEN_CHARS} (e.g. from `openssl rand -hex 32`)")
        return raw

    def allowed(self) -> frozenset[str] | None:
        """The client ids allowed_clients names, or None when any authenticated client may call."""
        if not self.allowed_clients:
            return None
        spec = self.allowed_clients.strip()
        if spec.startswith("@"):
            text = read_file("--allowed-clients", spec[1:]).decode("utf-8", errors="replace")
            lines = (line.split("#", 1)[0] for line in text.splitlines())
            items = [item.strip() for line in lines for item in line.split(",")]
        else:
            items = [item.strip() for item in spec.split(",")]
        ids = frozenset(i for i in items if i)
        bad = sorted(i for i in ids if any(c.isspace() for c in i))
        if bad:
            raise ConfigError(f"--allowed-clients: {bad[0]!r} is not a client id (no spaces inside ids)")
        if not ids:
            raise ConfigError(f"--allowed-clients {self.allowed_clients!r} names no client: list ids or leave it empty")
        return ids


# --- server side -------------------------------------------------------------------------------------


def _server_configuration(pem: Pem) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], root_certificates=pem.ca or None)


def server_credentials(sec: Security) -> grpc.ServerCredentials | None:
    """mTLS with ca+cert+key, server-only TLS with cert+key, None (plain) without TLS.

    The files are checked now (a key that is not the certificate's is a ConfigError) and, renewed in
    place, served without a restart: gRPC asks at each new handshake whether they changed
    (fedse.security.tls_files.Renewal).
    """
    if sec.tls_ca and not sec.tls_cert:
        raise ConfigError("--tls-ca is set but --tls-cert and --tls-key are not: a server needs its own "
                          "certificate and key to serve TLS (the CA only checks clients' certificates)")
    if not sec.tls_cert:
        return None
    renewal = Renewal(TlsFiles(sec.tls_ca, sec.tls_cert, sec.tls_key))

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        pem = renewal.renewed()
        return None if pem is None else _server_configuration(pem)

    return grpc.dynamic_ssl_server_credentials(_server_configuration(renewal.pem), fetch,
                                               require_client_authentication=bool(sec.tls_ca))


def server_interceptors(sec: Security) -> list[grpc.ServerInterceptor]:
    """The AuthInterceptor these settings need (none in open mode); warns about a token without TLS."""
    if sec.token_file and not sec.tls_cert:
        log.warning("bearer token without TLS: the token crosses the network in clear text; use this only on a "
                    "trusted network", extra=log_fields(mode=sec.mode))
    if sec.mode in ("open", "tls"):
        return []
    return [AuthInterceptor(token=sec.token(), require_identity=bool(sec.tls_ca), allowed=sec.allowed())]


def _first(values: Sequence[bytes] | None) -> str | None:
    for v in values or ():
        text = v.decode("utf-8", errors="replace").strip()
        if text:
            return text
    return None


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """The caller's id from its verified client certificate (first SAN, else CN); None without mTLS."""
    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    return _first(auth.get("x509_subject_alternative_name")) or _first(auth.get("x509_common_name"))


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the bearer token (UNAUTHENTICATED) or from clients not allowed (PERMISSION_DENIED).

    token: the expected bearer token, or None for no token check. require_identity: refuse calls that
    carry no verified client certificate (mTLS mode; also protects against a plain port on the same
    server). allowed: the client ids that may call, None for any. Health calls pass unchecked.
    """

    def __init__(self, token: str | None = None, require_identity: bool = False,
                 allowed: Iterable[str] | None = None, open_prefixes: Sequence[str] = (HEALTH_PREFIX,)):
        self._expected = f"Bearer {token}".encode() if token else None
        self._require_identity = require_identity or allowed is not None
        self._allowed = frozenset(allowed) if allowed is not None else None
        self._open = tuple(open_prefixes)

    def _refusal(self, context: grpc.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
        if self._expected is not None:
            got = [v for k, v in context.invocation_metadata() if k == AUTH_HEADER]
            value = got[0].encode() if len(got) == 1 and isinstance(got[0], str) else b""
            if not hmac.compare_digest(value, self._expected):
                return (grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token: set --token-file to the federation's token")
        if self._require_identity:
            who = peer_identity(context)
            if who is None:
                return (grpc.StatusCode.UNAUTHENTICATED,
                        "no verified client certificate: connect with TLS and --tls-cert/--tls-key signed by "
                        "the federation CA")
            if self._allowed is not None and who not in self._allowed:
                return (grpc.StatusCode.PERMISSION_DENIED,
                        f"client {who!r} is not in this server's allowed clients: ask its operator to add it")
        return None

    def _refuse(self, context: grpc.ServicerContext, method: str) -> None:
        refusal = self._refusal(context)
        if refusal is not None:
            code, message = refusal
            log.info("call refused", extra=log_fields(method=method, code=code.name, peer=context.peer()))
            context.abort(code, message)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._open):
            return handler

        def wrap_unary(behavior: Callable) -> Callable:
            def wrapped(request_or_iterator, context):
                self._refuse(context, method)
                return behavior(request_or_iterator, context)
            return wrapped

        def wrap_stream(behavior: Callable) -> Callable:
            def wrapped(request_or_iterator, context):
                self._refuse(context, method)
                yield from behavior(request_or_iterator, context)
            return wrapped

        de, ser = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), de, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), de, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), de, ser)
        return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), de, ser)


# --- client side -------------------------------------------------------------------------------------


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call (plain channels, where call credentials are refused)."""

    def __init__(self, token: str):
        self._header = (AUTH_HEADER, f"Bearer {token}")

    def _details(self, d) -> _CallDetails:
        metadata = [*(d.metadata or ()), self._header]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def _tls_credentials(pem: Pem, token: str | None) -> grpc.ChannelCredentials:
    creds = grpc.ssl_channel_credentials(root_certificates=pem.ca or None, private_key=pem.key or None,
                                         certificate_chain=pem.cert or None)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


def channel_credentials(sec: Security) -> grpc.ChannelCredentials | None:
    """TLS (and bearer token) credentials for a channel from the files as they are now, or None when
    TLS is off."""
    if not sec.tls.enabled:
        return None
    return _tls_credentials(sec.tls.load(), sec.token())


def channel(target: str, sec: Security) -> grpc.Channel:
    """A channel to target as sec says: plain, TLS, mTLS, each with or without the bearer token.

    With TLS, the CA (or the system roots when tls_ca is empty) verifies the server and tls_cert /
    tls_key are presented as the client certificate; the token travels as call credentials. The TLS
    files are checked now (ConfigError) and followed: the first call after they were renewed in place
    goes over a new channel made from them (fedse.security.tls_files.RenewingChannel). Without TLS the
    token is added by a client interceptor (logged as a warning: it crosses in clear text).
    """
    if sec.tls.enabled:
        token = sec.token()
        return RenewingChannel(Renewal(sec.tls), lambda pem: secure_channel(
            target, _tls_credentials(pem, token), target_name_override=sec.tls_server_name))
    plain = insecure_channel(target)
    token = sec.token()
    if token is None:
        return plain
    log.warning("bearer token without TLS: the token crosses the network in clear text; use this only on a "
                "trusted network", extra=log_fields(target=target))
    return grpc.intercept_channel(plain, _BearerToken(token))


__all__ = ["AuthInterceptor", "Security", "TlsFiles", "channel", "channel_credentials",
           "peer_identity", "server_credentials", "server_interceptors"]
