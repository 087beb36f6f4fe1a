"""The federation's member list, for a client to check secure aggregation's roster against something
the aggregator cannot forge (`fedse certs members` writes it; a client reads it).

Mutual TLS says who holds a certificate of the federation's CA, not who is a member of this run: an
aggregator that holds a certificate of its own (or can have one issued) could put its own keys in a
roster. A member list made where the CA key is, offline, and checked by every client, closes that.

- Signed: `members.json`, {"federation", "members", "issued", "signature"}: the CA key's signature
  (ECDSA over SHA-256, the key `fedse certs init` makes) of the framed, domain-separated bytes
  `masking.frame(DOMAIN, federation, issued, *members)`, members sorted and unique. A client checks it
  against the CA certificate(s) it already has (ca.pem): `read_member_list`. `is_signed` tells it
  from a plain list.
- Plain: a file given to each client by hand, one id per line (or comma-separated, `#` comments: the
  format of `--allowed-clients @FILE`), not signed: `read_plain_list`. Whoever can change that file
  on a client's machine is trusted; the signed list needs no such trust in the way it travels.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import json
import pathlib
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from fedse.security import certs

from fedse.privacy import masking
from fedse.transport.inputs import CLIENT_ID, CLIENT_ID_RULE, shown
from fedse.security.signatures import SignatureError, Verifier

DOMAIN = "fedse member list v1"  # the first framed part of what the CA signs: a signature serves nothing else
FIELDS = ("federation", "members", "issued", "signature")


class MemberListError(certs.CertError):
    """A member list that cannot be used: unreadable, malformed, invalid ids, or not signed by the CA."""


@dataclasses.dataclass(frozen=True)
class MemberList:
    """A member list whose signature verified: the federation's name (the CA's subject), its members'
    client ids, and when the operator signed it."""

    federation: str
    members: frozenset[str]
    issued: datetime.datetime


def message(federation: str, members: Iterable[str], issued: str) -> bytes:
    """What the CA signs: the domain, the federation, the time of issue and the sorted ids, framed."""
    return masking.frame(DOMAIN, federation, issued, *sorted(members))


def checked_ids(ids: Iterable[str], where: str) -> list[str]:
    """The ids sorted and unique; MemberListError naming the first that is not a client id, or if none."""
    ids = [i.strip() for i in ids]
    for cid in ids:
        if not CLIENT_ID.match(cid):
            raise MemberListError(f"{where}: {shown(cid)} is not a client id: {CLIENT_ID_RULE}")
    if not ids:
        raise MemberListError(f"{where} names no member: list the members' client ids")
    return sorted(set(ids))


def parse_plain(text: str) -> list[str]:
    """The ids of a plain list: newline- or comma-separated, `#` starting a comment."""
    lines = (line.split("#", 1)[0] for line in text.splitlines())
    return [item.strip() for line in lines for item in line.split(",") if item.strip()]


def _read_text(path: pathlib.Path, what: str) -> str:
    try:
        return pathlib.Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise MemberListError(f"{path}: cannot read {what} ({exc.strerror or exc}); check the path") from None
    except UnicodeDecodeError:
        raise MemberListError(f"{path} is not UTF-8 text: give {what}") from None


def read_plain_list(path: pathlib.Path) -> frozenset[str]:
    """The client ids of a plain, unsigned member list (one a line, or comma-separated; `#` comments)."""
    return frozenset(checked_ids(parse_plain(_read_text(path, "the member list")), str(path)))


def is_signed(path: pathlib.Path) -> bool:
    """Whether the file at `path` is a signed list (a JSON object) rather than a plain one: no client
    id starts with `{`, so a file that does is checked as signed, never read as plain."""
    return _read_text(path, "the member list").lstrip().startswith("{")


def ids_from_arguments(arguments: Iterable[str]) -> list[str]:
    """Ids given on a command line, where `@FILE` stands for the ids of a plain list in FILE."""
    out: list[str] = []
    for arg in arguments:
        if arg.startswith("@"):
            out += parse_plain(_read_text(pathlib.Path(arg[1:]), "a list of client ids, one a line"))
        else:
            out += [item.strip() for item in arg.split(",") if item.strip()]
    return checked_ids(out, "the member ids")


# ---- the operator: sign ----------------------------------------------------------------------------------
def sign_member_list(ca_dir: pathlib.Path, ids: Iterable[str], out: pathlib.Path,
                     force: bool = False) -> tuple[MemberList, pathlib.Path]:
    """members.json at `out`: the ids, signed by the CA key in ca_dir (where `fedse certs init` wrote it)."""
    ca = certs.load_ca(pathlib.Path(ca_dir))  # checks that the key is the certificate's, and an EC CA
    members = checked_ids(ids, "the member ids")
    federation = ca.cert.subject.rfc4514_string()
    when = certs.now().replace(microsecond=0)
    issued = when.isoformat().replace("+00:00", "Z")
    signature = ca.key.sign(message(federation, members, issued), ec.ECDSA(hashes.SHA256()))
    document = {"federation": federation, "members": members, "issued": issued,
                "signature": base64.b64encode(signature).decode("ascii")}
    data = (json.dumps(document, indent=2) + "\n").encode()
    (path,) = certs.write_all([certs.Output(pathlib.Path(out), data)], force)
    return MemberList(federation, frozenset(members), when), path


# ---- a client: read and verify -----------------------------------------------------------------------------
def _fields(path: pathlib.Path, text: str) -> tuple[str, list[str], str, bytes]:
    """The four fields of a signed list, their types checked; MemberListError saying what is wrong."""
    hint = "give the members.json `fedse certs members` wrote"
    try:
        doc = json.loads(text)
    except ValueError:
        raise MemberListError(f"{path} is not JSON: {hint}") from None
    if not isinstance(doc, dict) or set(doc) != set(FIELDS):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise MemberListError(f"{path} holds {got}, not the fields {', '.join(FIELDS)}: {hint}")
    federation, members, issued, signature = (doc[f] for f in FIELDS)
    if not all(isinstance(v, str) for v in (federation, issued, signature)) or not isinstance(members, list) \
            or not all(isinstance(m, str) for m in members):
        raise MemberListError(f"{path}: federation, issued and signature must be text and members a list of "
                              f"client ids: {hint}")
    if checked_ids(members, str(path)) != members:
        raise MemberListError(f"{path}: its members are not sorted and unique, as fedse certs members writes "
                              f"them: {hint}")
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        raise MemberListError(f"{path}: its signature is not base64: {hint}") from None
    return federation, members, issued, raw


def _issued(path: pathlib.Path, issued: str) -> datetime.datetime:
    try:
        when = datetime.datetime.fromisoformat(issued.replace("Z", "+00:00"))
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise MemberListError(f"{path}: issued {shown(issued)} is not an ISO time with its zone: give the "
                              f"members.json fedse certs members wrote")
    return when


def read_signed_member_list(path: pathlib.Path, ca_pem: bytes) -> MemberList:
    """The member list at `path` once its signature verifies with one of the CA certificates in
    `ca_pem` (a certificate that is no CA's is ignored); MemberListError saying what is wrong otherwise."""
    path = pathlib.Path(path)
    federation, members, issued, signature = _fields(path, _read_text(path, "the member list"))
    when = _issued(path, issued)
    try:
        cas = [c for c in x509.load_pem_x509_certificates(ca_pem) if certs.is_ca(c)]
    except ValueError:
        cas = []
    if not cas:
        raise MemberListError("the federation CA given to check the member list holds no CA certificate: give "
                              "the ca.pem fedse certs init made")
    signed = message(federation, members, issued)
    for ca in cas:
        try:
            Verifier.signature(ca, signed, signature, str(path))
        except SignatureError:
            continue
        return MemberList(federation, frozenset(members), when)
    names = "; ".join(ca.subject.rfc4514_string() for ca in cas)
    raise MemberListError(f"{path} is not signed by the federation CA ({names}): it was changed after it was "
                          f"signed, or signed by another CA or a key that is not the CA's; ask the operator "
                          f"for the list fedse certs members signed")


def read_member_list(path: pathlib.Path, ca_pem: bytes) -> frozenset[str]:
    """The members' client ids of the signed list at `path`, verified against the CA certificate(s) in
    `ca_pem`; MemberListError (a ValueError) saying what is wrong otherwise."""
    return read_signed_member_list(path, ca_pem).members
