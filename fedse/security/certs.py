"""A federation's certificates, for processes run by hand and for Kubernetes (k8s/components/mtls makes
its Secrets from these files). `fedse certs` is the command; this module makes and reads the files,
on the operator's offline machine for the CA's part: the CA key never goes where the aggregator runs.

- init: the operator makes the federation CA, `ca.pem` and its key `ca-key.pem` (a CA that signs
  only end certificates: path length 0, key usage cert sign).
- request: an organisation makes its key `<id>-key.pem` and a certificate request `<id>.csr` whose
  common name and first subject alternative name are its client id. Only the request is sent; the
  key never leaves the organisation.
- sign: the operator signs a request: the client id (its common name) becomes the certificate's
  first subject alternative name, the identity the aggregator reads, for TLS client authentication.
- issue: the operator makes a server's key and certificate (the aggregator's, an env server's) for
  the DNS names and IP addresses clients dial, for TLS server authentication.
- show: a certificate's identity, names, issuer, validity and purpose, how soon it expires, and
  whether a given CA signed it.
- members: the operator signs the federation's member list with the CA key (fedse/security/members.py).

Keys are ECDSA P-256 (PKCS#8 PEM, unencrypted, as gRPC reads them), written with mode 0600;
certificates and requests 0644. Nothing is overwritten unless `force` is set.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib
import re
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedse.security.tls_files import public_bytes
from fedse.files import atomic_write
from fedse.transport.inputs import CLIENT_ID, CLIENT_ID_RULE, shown

CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
CA_NAME = "fedse federation CA"
CA_DAYS = 3650  # 10 years
LEAF_DAYS = 365
WARN_DAYS = 30  # `show` warns when a certificate expires within this many days
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates start this long before they are made
KEY_MODE, PUBLIC_MODE = 0o600, 0o644
DNS_NAME = re.compile(r"^(\*\.)?[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")
PURPOSES = {ExtendedKeyUsageOID.CLIENT_AUTH: "client", ExtendedKeyUsageOID.SERVER_AUTH: "server"}


class CertError(ValueError):
    """A request fedse certs cannot carry out; the message says what is wrong and what to do."""


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Output:
    path: pathlib.Path
    data: bytes
    private: bool = False  # a private key: mode 0600


def write_all(outputs: Sequence[Output], force: bool) -> list[pathlib.Path]:
    """Writes every output, or none where one exists already and force is not set."""
    for out in outputs:
        if out.path.exists() and not force:
            raise CertError(f"{out.path} exists already: pass --force to replace it, or choose another directory")
    for out in outputs:
        atomic_write(out.path, out.data, KEY_MODE if out.private else PUBLIC_MODE)
    return [out.path for out in outputs]


def _days(days: int) -> datetime.timedelta:
    if days < 1:
        raise CertError(f"--days {days}: a certificate must be valid for at least 1 day")
    return datetime.timedelta(days=days)


def _checked_id(value: str, what: str) -> str:
    if not CLIENT_ID.match(value):
        raise CertError(f"{what} {shown(value)} is not valid: {CLIENT_ID_RULE}")
    return value


def _new_key() -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return key, pem


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _usage(signs_certificates: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=signs_certificates,
                         crl_sign=signs_certificates, encipher_only=False, decipher_only=False)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# ---- the operator's CA -------------------------------------------------------------------------------
def init_ca(directory: pathlib.Path, name: str = CA_NAME, days: int = CA_DAYS,
            force: bool = False) -> list[pathlib.Path]:
    """The federation CA in directory: ca.pem and ca-key.pem."""
    if not name.strip():
        raise CertError("--name is empty: give the CA a name, e.g. 'Example federation CA'")
    start, lifetime = now(), _days(days)
    key, key_pem = _new_key()
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start - CLOCK_SKEW).not_valid_after(start + lifetime)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(signs_certificates=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    directory = pathlib.Path(directory)
    return write_all([Output(directory / CA_CERT, _pem(cert)), Output(directory / CA_KEY, key_pem, private=True)],
                     force)


@dataclasses.dataclass(frozen=True)
class Ca:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    directory: pathlib.Path

    def issue(self, common_name: str, public_key, names: Iterable[x509.GeneralName], purpose: x509.ObjectIdentifier,
              days: int) -> x509.Certificate:
        """An end certificate: `names` as its subject alternative names, in order; `purpose` its only
        extended key usage."""
        start, lifetime = now(), _days(days)
        ends = self.cert.not_valid_after_utc
        if start + lifetime > ends:
            raise CertError(f"--days {days} outlives the CA in {self.directory}, which expires on {_date(ends)}: "
                            f"pass fewer days, or make a new CA (fedse certs init)")
        return (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self.cert.subject)
                .public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(start - CLOCK_SKEW).not_valid_after(start + lifetime)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(_usage(signs_certificates=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
                .add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.cert.public_key()),
                               critical=False)
                .sign(self.key, hashes.SHA256()))


def _read(path: pathlib.Path, what: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise CertError(f"{path}: cannot read {what} ({exc.strerror or exc}); check the path") from None


def load_ca(directory: pathlib.Path) -> Ca:
    """The CA `init_ca` wrote in directory."""
    directory = pathlib.Path(directory)
    hint = "give --ca-dir the directory fedse certs init wrote"
    cert_pem = _read(directory / CA_CERT, f"the CA's certificate ({hint})")
    key_pem = _read(directory / CA_KEY, f"the CA's key ({hint})")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise CertError(f"{directory}: {CA_CERT} or {CA_KEY} is not a PEM certificate or unencrypted key: "
                        f"{hint}") from None
    if public_bytes(key.public_key()) != public_bytes(cert.public_key()):
        raise CertError(f"{directory / CA_KEY} is not the key of {directory / CA_CERT}: put the pair fedse certs "
                        f"init made together")
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not _is_ca(cert):
        raise CertError(f"{directory / CA_CERT} is not a CA fedse certs init made: {hint}")
    return Ca(cert, key, directory)


def _is_ca(cert: x509.Certificate) -> bool:
    """Whether the certificate says it is a CA's (BasicConstraints ca=True)."""
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


is_ca = _is_ca  # the public name (fedse.security.members checks that a member list's signer is a CA)


# ---- an organisation's request, and the operator's signature --------------------------------------------
def request(client_id: str, directory: pathlib.Path, force: bool = False) -> list[pathlib.Path]:
    """The organisation's key `<id>-key.pem` and request `<id>.csr` in directory."""
    _checked_id(client_id, "--client-id")
    key, key_pem = _new_key()
    csr = (x509.CertificateSigningRequestBuilder().subject_name(_name(client_id))
           .add_extension(x509.SubjectAlternativeName([x509.DNSName(client_id)]), critical=False)
           .sign(key, hashes.SHA256()))
    directory = pathlib.Path(directory)
    return write_all([Output(directory / f"{client_id}-key.pem", key_pem, private=True),
                      Output(directory / f"{client_id}.csr", csr.public_bytes(serialization.Encoding.PEM))], force)


def load_csr(path: pathlib.Path) -> x509.CertificateSigningRequest:
    data = _read(path, "the certificate request")
    try:
        return x509.load_pem_x509_csr(data)
    except ValueError:
        raise CertError(f"{path} is not a PEM certificate request: give the .csr fedse certs request made") from None


def requested_id(csr: x509.CertificateSigningRequest, path: pathlib.Path) -> str:
    """The client id a request names (its common name), checked: one CN, a valid id, and the same
    as its first subject alternative name where it has any."""
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise CertError(f"{path} names {len(names)} common names, not one client id: ask the organisation for a "
                        f"request made with fedse certs request --client-id ID")
    client_id = _checked_id(str(names[0].value), f"{path}: the client id")
    try:
        sans = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return client_id
    first = next(iter(sans), None)
    if first is not None and first.value != client_id:
        raise CertError(f"{path} names the client {client_id!r} but its first subject alternative name is "
                        f"{shown(str(first.value))}: ask the organisation for a request made with fedse certs request")
    return client_id


def sign(ca_dir: pathlib.Path, csr_path: pathlib.Path, out: pathlib.Path, days: int = LEAF_DAYS,
         force: bool = False) -> tuple[x509.Certificate, list[pathlib.Path]]:
    """The organisation's client certificate at out: its id as the first subject alternative name."""
    csr = load_csr(csr_path)
    if not csr.is_signature_valid:
        raise CertError(f"{csr_path}: its signature does not verify (altered on the way, or not signed by its "
                        f"key): ask the organisation to send the request again")
    client_id = requested_id(csr, csr_path)
    cert = load_ca(ca_dir).issue(client_id, csr.public_key(), [x509.DNSName(client_id)],
                                 ExtendedKeyUsageOID.CLIENT_AUTH, days)
    return cert, write_all([Output(pathlib.Path(out), _pem(cert))], force)


# ---- servers -------------------------------------------------------------------------------------------
def server_names(dns: Iterable[str], ips: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for name in dns:
        if not DNS_NAME.match(name) or len(name) > 253:
            raise CertError(f"--dns {shown(name)} is not a DNS name: give names such as "
                            f"aggregator.example.org, separated by commas")
        names.append(x509.DNSName(name))
    for ip in ips:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(ip)))
        except ValueError:
            raise CertError(f"--ip {shown(ip)} is not an IP address: give addresses such as 10.0.0.5, "
                            f"separated by commas") from None
    if not names:
        raise CertError("no --dns or --ip: name what clients dial, e.g. --dns aggregator.example.org --ip 10.0.0.5")
    return names


def issue(ca_dir: pathlib.Path, name: str, dns: Sequence[str], ips: Sequence[str], out_dir: pathlib.Path,
          days: int = LEAF_DAYS, force: bool = False) -> tuple[x509.Certificate, list[pathlib.Path]]:
    """A server's certificate `<name>.pem` and key `<name>-key.pem` in out_dir, for dns and ips."""
    _checked_id(name, "--name")
    names = server_names(dns, ips)
    ca = load_ca(ca_dir)
    key, key_pem = _new_key()
    cert = ca.issue(name, key.public_key(), names, ExtendedKeyUsageOID.SERVER_AUTH, days)
    out_dir = pathlib.Path(out_dir)
    return cert, write_all([Output(out_dir / f"{name}.pem", _pem(cert)),
                            Output(out_dir / f"{name}-key.pem", key_pem, private=True)], force)


# ---- reading them back ---------------------------------------------------------------------------------
def _date(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M UTC")


def san_texts(cert) -> list[str]:
    """The subject alternative names of a certificate or request, in order, as `DNS:x` or `IP:x`."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    kinds = {x509.DNSName: "DNS", x509.IPAddress: "IP", x509.UniformResourceIdentifier: "URI",
             x509.RFC822Name: "email"}
    return [f"{kinds.get(type(n), type(n).__name__)}:{n.value}" for n in sans]


def identity(cert) -> str:
    """Who a certificate says it is, as the aggregator reads it: the first SAN, else the CN."""
    sans = san_texts(cert)
    if sans:
        return sans[0].split(":", 1)[1]
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def purposes(cert: x509.Certificate) -> list[str]:
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return ["signs certificates"] if _is_ca(cert) else ["any (no extended key usage)"]
    return [PURPOSES.get(u, u.dotted_string) for u in usages]


@dataclasses.dataclass(frozen=True)
class Shown:
    """What `show` prints: lines, a warning (or ""), and whether the file is usable now."""

    lines: list[str]
    warning: str
    ok: bool


def _renewal(cert: x509.Certificate) -> str:
    if _is_ca(cert):
        return "make a new CA (fedse certs init) and new certificates signed by it"
    if "client" in purposes(cert):
        return "send a new request (fedse certs request) for the operator to sign"
    return "the operator issues a new one (fedse certs issue)"


def _certificates(path: pathlib.Path, data: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise CertError(f"{path} holds no PEM certificate or certificate request: give a .pem certificate or a "
                        f".csr") from None


def signed_by(cert: x509.Certificate, cas: Iterable[x509.Certificate]) -> bool:
    """Whether one of `cas` signed `cert` directly."""
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


def show(path: pathlib.Path, ca: pathlib.Path | None = None) -> Shown:
    """A certificate's (the first of a chain) or a certificate request's identity and validity; with
    `ca`, whether that CA signed the certificate."""
    data = _read(path, "the file")
    if b"CERTIFICATE REQUEST-----" in data:
        return _show_request(path, load_csr(path))
    chain = _certificates(path, data)
    cert, at = chain[0], now()
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    left = (end - at).total_seconds() / 86400
    lines = [f"{path}: certificate" + (f" (the first of a chain of {len(chain)})" if len(chain) > 1 else ""),
             f"  identity (first SAN, else CN): {identity(cert)}",
             f"  subject: {cert.subject.rfc4514_string()}",
             f"  subject alternative names: {', '.join(san_texts(cert)) or '-'}",
             f"  issuer: {cert.issuer.rfc4514_string()}",
             f"  valid: {_date(start)} to {_date(end)}",
             f"  purpose: {', '.join(purposes(cert))}",
             f"  CA: {'yes' if _is_ca(cert) else 'no'}"]
    if ca is not None:
        signed = signed_by(cert, _certificates(ca, _read(ca, "the CA's certificate (--ca)")))
        lines.append(f"  signed by {ca}: {'yes' if signed else 'NO'}")
        if not signed:
            return Shown(lines, f"{path} is not signed by the CA in {ca}: ask the federation's operator for the "
                                f"CA that signed it, or for a certificate this CA signed", False)
    if at < start:
        return Shown(lines, f"{path} is not valid before {_date(start)}: check this machine's clock", False)
    if left <= 0:
        return Shown(lines, f"{path} expired on {_date(end)}: {_renewal(cert)}", False)
    if left <= WARN_DAYS:
        return Shown(lines, f"{path} expires in {max(1, round(left))} days, on {_date(end)}: {_renewal(cert)}", True)
    return Shown(lines, "", True)


def _show_request(path: pathlib.Path, csr: x509.CertificateSigningRequest) -> Shown:
    lines = [f"{path}: certificate request",
             f"  identity (first SAN, else CN): {identity(csr)}",
             f"  subject: {csr.subject.rfc4514_string()}",
             f"  subject alternative names: {', '.join(san_texts(csr)) or '-'}"]
    if not csr.is_signature_valid:
        return Shown(lines, f"{path}: its signature does not verify: ask for the request again", False)
    return Shown(lines, "", True)
