"""Why a channel cannot be made, in one line that names the flag to check.

gRPC reports every failed connection the same way: the channel stays in TRANSIENT_FAILURE and a call
ends in UNAVAILABLE or DEADLINE_EXCEEDED. `diagnose` finds the reason by doing what gRPC does one
step at a time with the standard library: resolve the host, open the port, and make the TLS handshake
(or try one, for a plain client, to tell a TLS server). `wait_ready` waits for a channel and fails fast
on a reason that waiting cannot mend (TLS against plain, a certificate from another CA, a name
mismatch, an expired or refused certificate); a server not up yet is waited for, with its reason logged.
"""

from __future__ import annotations

import datetime
import logging
import pathlib
import socket
import ssl
import time

import grpc
from cryptography import x509

from fedse.security.admission import Security
from fedse.transport.serving import log_fields
from fedse.security.signatures import names

log = logging.getLogger("fedse.transport.reach")

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# OpenSSL's reasons that mean the other side does not speak TLS at all.
_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNEXPECTED_EOF",
            "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "EOF occurred")
# The server's alerts about this client's certificate.
_REFUSED = ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA", "CERTIFICATE_EXPIRED", "CERTIFICATE_UNKNOWN",
            "CERTIFICATE_REVOKED", "UNSUPPORTED_CERTIFICATE", "DECRYPT_ERROR", "HANDSHAKE_FAILURE")


# What an Unreachable is about, in the order a connection is made (fedse doctor checks in this order).
ADDRESS, TRANSPORT, SERVER_CERTIFICATE, CLIENT_CERTIFICATE = "address", "transport", "server certificate", \
    "client certificate"


class Unreachable(ConnectionError):
    """A channel that cannot be made, and why. `lasting`: waiting will not mend it (a setting is wrong);
    `kind`: which step of making it failed (ADDRESS, TRANSPORT, SERVER_CERTIFICATE, CLIENT_CERTIFICATE)."""

    def __init__(self, reason: str, lasting: bool, kind: str = ADDRESS):
        super().__init__(reason)
        self.reason = reason
        self.lasting = lasting
        self.kind = kind


def split_target(target: str) -> tuple[str, int] | None:
    """(host, port) of a host:port target ([v6]:port too); None for other gRPC target forms."""
    text = target.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or "/" in text:
        return None
    return host.strip("[]") or "localhost", int(port)


def diagnose(target: str, sec: Security, flag: str, timeout_s: float = 5.0) -> Unreachable | None:
    """Why a channel to `target` (the setting `flag` names it) with `sec` cannot be made; None when the
    address answers and TLS (or plain) is as the settings expect."""
    where = split_target(target)
    if where is None:
        return None
    host, port = where
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return Unreachable(f"{flag} {target}: the host {host} does not resolve ({exc.strerror}): check the address",
                           lasting=False)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return Unreachable(f"{flag} {target}: nothing listens there (connection refused): is the server up, and is "
                           "the port right?", lasting=False)
    except OSError as exc:
        return Unreachable(f"{flag} {target}: no answer ({exc.strerror or 'timed out'}): is the server up, and does "
                           "a firewall let the port through?", lasting=False)
    with sock:
        if sec.tls.enabled:
            return _tls_problem(sock, host, target, sec, flag, timeout_s)
        return _speaks_tls(sock, host, target, flag)


def _speaks_tls(sock: socket.socket, host: str, target: str, flag: str) -> Unreachable | None:
    """A plain client's probe: a server that completes a TLS handshake is a TLS server."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with ctx.wrap_socket(sock, server_hostname=host):
            pass
    except (ssl.SSLError, OSError):
        return None  # not a TLS server, as expected
    return Unreachable(f"{flag} {target} serves TLS, and this client speaks plain gRPC: give --tls-ca (the "
                       "federation's CA certificate) and, where the server asks for client certificates, --tls-cert "
                       "and --tls-key", lasting=True, kind=TRANSPORT)


def _tls_problem(sock: socket.socket, host: str, target: str, sec: Security, flag: str,
                 timeout_s: float) -> Unreachable | None:
    name = sec.tls_server_name or host
    try:
        ctx = ssl.create_default_context(cafile=sec.tls_ca or None)
        if sec.tls_cert:
            ctx.load_cert_chain(sec.tls_cert, sec.tls_key)
    except (ssl.SSLError, OSError) as exc:
        return Unreachable(f"--tls-cert {sec.tls_cert} and --tls-key {sec.tls_key} cannot be used together "
                           f"({exc}): give the certificate and its own private key", lasting=True,
                           kind=CLIENT_CERTIFICATE)
    ctx.set_alpn_protocols(["h2"])
    try:
        with ctx.wrap_socket(sock, server_hostname=name) as tls:
            tls.settimeout(timeout_s)
            tls.sendall(H2_PREFACE)  # TLS 1.3: a server's verdict on our certificate comes after the handshake
            if tls.recv(1) == b"":  # a gRPC server answers the preface; one that hangs up refused us
                return Unreachable(_refused("it hung up right after the handshake", target, sec, flag), lasting=True,
                                   kind=CLIENT_CERTIFICATE)
    except ssl.SSLCertVerificationError as exc:
        return _server_certificate(exc, name, target, sec, flag)
    except ssl.SSLError as exc:
        text = f"{exc.reason or ''} {exc}"
        if any(r in text for r in _NOT_TLS):
            return Unreachable(f"{flag} {target} serves plain gRPC, not TLS: drop --tls-ca, --tls-cert and --tls-key "
                               "for it, or use its TLS address", lasting=True, kind=TRANSPORT)
        if any(r in text for r in _REFUSED):
            return Unreachable(_refused(exc.reason or str(exc), target, sec, flag), lasting=True,
                               kind=CLIENT_CERTIFICATE)
        return Unreachable(f"{flag} {target}: the TLS handshake failed ({exc.reason or exc})", lasting=True,
                           kind=TRANSPORT)
    except (socket.timeout, OSError):
        return None  # the handshake went through; what follows is gRPC's
    return None


def _server_certificate(exc: ssl.SSLCertVerificationError, name: str, target: str, sec: Security,
                        flag: str) -> Unreachable:
    code = exc.verify_code
    if code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
        why = (f"the server's certificate does not name {name}: connect by a name it holds, or set "
               "--tls-server-name to one")
    elif code in (9, 10):  # not yet valid, expired
        why = f"the server's certificate {exc.verify_message}: its operator must renew it"
    else:
        ca = f"--tls-ca {sec.tls_ca}" if sec.tls_ca else "the system's CA certificates (no --tls-ca given)"
        why = (f"the server's certificate is not signed by {ca} ({exc.verify_message}): give the federation's CA "
               "certificate, from its operator")
    return Unreachable(f"{flag} {target}: {why}", lasting=True, kind=SERVER_CERTIFICATE)


def _refused(alert: str, target: str, sec: Security, flag: str) -> str:
    """Why the server refused this client's certificate, checked here where it can be."""
    if not sec.tls_cert:
        return (f"{flag} {target} asks for a client certificate (mTLS) and none was given: give --tls-cert and "
                "--tls-key (fedse certs request, signed by the federation's operator)")
    try:
        cert = x509.load_pem_x509_certificate(pathlib.Path(sec.tls_cert).read_bytes())
        now = datetime.datetime.now(datetime.timezone.utc)
        if cert.not_valid_after_utc < now:
            return (f"{flag} {target} refused this client's certificate: --tls-cert {sec.tls_cert} expired on "
                    f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: get a renewed one from the federation's operator")
        if cert.not_valid_before_utc > now:
            return (f"{flag} {target} refused this client's certificate: --tls-cert {sec.tls_cert} is not valid yet: "
                    "check this machine's clock")
    except (OSError, ValueError):
        pass
    return (f"{flag} {target} refused this client's certificate ({alert}): --tls-cert {sec.tls_cert} must be signed "
            "by the federation's CA (the one the server trusts) and valid now")


def wait_ready(ch: grpc.Channel, target: str, sec: Security, flag: str, timeout_s: float, poll_s: float = 5.0) -> None:
    """Waits for `ch` to connect: raises Unreachable at once for a reason waiting cannot mend, and after
    `timeout_s` for any other (logged as it waits)."""
    deadline = time.monotonic() + timeout_s
    wait = min(1.0, poll_s)  # a channel that connects does so at once: look for a reason soon
    while True:
        try:
            grpc.channel_ready_future(ch).result(timeout=max(0.1, min(wait, deadline - time.monotonic())))
            return
        except grpc.FutureTimeoutError:
            wait = poll_s
        problem = diagnose(target, sec, flag)
        if problem is not None and problem.lasting:
            raise problem
        if time.monotonic() >= deadline:
            raise problem or Unreachable(f"{flag} {target}: the connection was not made within {timeout_s:.0f} s",
                                         lasting=False)
        log.warning("waiting for the server", extra=log_fields(target=target, reason=problem.reason if problem
                                                                else "not connected yet"))


def server_names(target: str, sec: Security, timeout_s: float = 5.0) -> frozenset[str]:
    """The names the server at `target` answers to: the host dialled, the TLS name expected of it, and
    every name its certificate holds (read in a TLS handshake with this client's own mTLS files). What
    a secure-aggregation client refuses to see as a member's identity: the aggregator is no member.
    Only the names from the settings where the handshake cannot be made."""
    where = split_target(target)
    out = {n for n in (where[0] if where else "", sec.tls_server_name) if n}
    if where is None or not sec.tls.enabled:
        return frozenset(out)
    try:
        ctx = ssl.create_default_context(cafile=sec.tls_ca or None)
        if sec.tls_cert:
            ctx.load_cert_chain(sec.tls_cert, sec.tls_key)
        ctx.set_alpn_protocols(["h2"])
        with socket.create_connection(where, timeout=timeout_s) as sock, \
                ctx.wrap_socket(sock, server_hostname=sec.tls_server_name or where[0]) as tls:
            der = tls.getpeercert(binary_form=True)
    except (ssl.SSLError, OSError) as exc:
        log.warning("could not read the aggregator's certificate; its names from the settings only",
                    extra=log_fields(target=target, reason=str(exc)[:200]))
        return frozenset(out)
    return frozenset(out | (names(x509.load_der_x509_certificate(der)) if der else set()))
