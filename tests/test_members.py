"""The federation's member list (fedse/security/members.py, `fedse certs members`): the operator signs it with
the CA key; a client reads it back only if that CA signed exactly these bytes. A list edited after
signing, signed by another CA, or signed by a member's key instead of the CA's is refused with a
reason, and so is one that is malformed or names something that is not a client id. A plain list
(one id a line, unsigned) is read as --allowed-clients @FILE is."""

from __future__ import annotations

import base64
import json
import pathlib

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from apps import certs as command
from fedse.privacy import masking
from fedse.security import members
from fedse.security.members import MemberListError
from support import Pki

IDS = ["org-maze", "org-wordle", "org-babyai"]


def fedse_certs(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = command.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def new_ca(capsys, directory: pathlib.Path, name: str) -> pathlib.Path:
    assert fedse_certs(capsys, "init", "--out-dir", directory, "--name", name)[0] == 0
    return directory


@pytest.fixture
def ca(tmp_path, capsys) -> pathlib.Path:
    return new_ca(capsys, tmp_path / "ca", "Example federation CA")


@pytest.fixture
def signed(ca, tmp_path, capsys) -> pathlib.Path:
    """members.json for IDS, two of them from an @FILE, signed by `ca`."""
    listing = tmp_path / "ids.txt"
    listing.write_text("# the members\norg-wordle\norg-babyai  # joined in March\n")
    out = tmp_path / "members.json"
    rc, stdout, err = fedse_certs(capsys, "members", "--ca-dir", ca, "--out", out, "org-maze", f"@{listing}")
    assert rc == 0, err
    assert f"wrote {out}: 3 members (org-babyai, org-maze, org-wordle), signed by CN=Example federation CA" in stdout
    return out


def ca_pem(ca: pathlib.Path) -> bytes:
    return (ca / "ca.pem").read_bytes()


def test_a_signed_list_round_trips(signed, ca):
    doc = json.loads(signed.read_text())
    assert list(doc) == ["federation", "members", "issued", "signature"]
    assert doc["federation"] == "CN=Example federation CA" and doc["members"] == sorted(IDS)
    assert signed.stat().st_mode & 0o777 == 0o644 and b"PRIVATE KEY" not in signed.read_bytes()
    assert members.read_member_list(signed, ca_pem(ca)) == frozenset(IDS)
    full = members.read_signed_member_list(signed, ca_pem(ca))
    assert full.federation == doc["federation"] and full.issued.isoformat().replace("+00:00", "Z") == doc["issued"]
    # The signature is the CA key's ECDSA-SHA256 over the framed, domain-separated list, nothing else.
    ca_cert = x509.load_pem_x509_certificate(ca_pem(ca))
    framed = masking.frame("fedse member list v1", doc["federation"], doc["issued"], *sorted(IDS))
    ca_cert.public_key().verify(base64.b64decode(doc["signature"]), framed, ec.ECDSA(hashes.SHA256()))


@pytest.mark.parametrize("edit", [
    lambda d: d["members"].append("org-zz"),  # an aggregator's own id added
    lambda d: d["members"].remove("org-maze"),  # a member dropped
    lambda d: d.update(members=sorted([*d["members"][:-1], "org-x"])),  # one replaced
    lambda d: d.update(federation="CN=Another federation"),
    lambda d: d.update(issued="2099-01-01T00:00:00Z"),
])
def test_a_list_edited_after_signing_is_refused(signed, ca, edit):
    doc = json.loads(signed.read_text())
    edit(doc)
    signed.write_text(json.dumps(doc))
    with pytest.raises(MemberListError, match="is not signed by the federation CA \\(CN=Example federation CA\\): "
                                              "it was changed after it was signed"):
        members.read_member_list(signed, ca_pem(ca))


def test_a_list_signed_by_another_ca_is_refused(signed, ca, tmp_path, capsys):
    other = new_ca(capsys, tmp_path / "other", "Example federation CA")  # even under the same name
    with pytest.raises(MemberListError, match="is not signed by the federation CA"):
        members.read_member_list(signed, ca_pem(other))
    # Nor against a CA of another make (support.Pki's, trustme): the same refusal, naming that CA.
    pki = Pki(tmp_path)
    with pytest.raises(MemberListError, match="is not signed by the federation CA \\(.*fedse federation"):
        members.read_member_list(signed, pathlib.Path(pki.ca_pem).read_bytes())
    # A bundle holding another CA beside the right one still verifies (a CA being replaced).
    assert members.read_member_list(signed, ca_pem(other) + ca_pem(ca)) == frozenset(IDS)


def test_a_list_signed_by_a_members_key_instead_of_the_cas_is_refused(signed, ca, tmp_path, capsys):
    assert fedse_certs(capsys, "request", "--client-id", "org-maze", "--out-dir", tmp_path)[0] == 0
    assert fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", tmp_path / "org-maze.csr",
                       "--out", tmp_path / "org-maze.pem")[0] == 0
    key = serialization.load_pem_private_key((tmp_path / "org-maze-key.pem").read_bytes(), password=None)
    doc = json.loads(signed.read_text())
    doc["members"] = sorted([*doc["members"], "org-evil"])
    framed = members.message(doc["federation"], doc["members"], doc["issued"])
    doc["signature"] = base64.b64encode(key.sign(framed, ec.ECDSA(hashes.SHA256()))).decode()
    signed.write_text(json.dumps(doc))
    with pytest.raises(MemberListError, match="is not signed by the federation CA"):
        members.read_member_list(signed, ca_pem(ca))
    # Even where the member's certificate is in the bundle given as the CA: only a CA's key signs the list.
    with pytest.raises(MemberListError, match="is not signed by the federation CA"):
        members.read_member_list(signed, ca_pem(ca) + (tmp_path / "org-maze.pem").read_bytes())
    with pytest.raises(MemberListError, match="holds no CA certificate"):
        members.read_member_list(signed, (tmp_path / "org-maze.pem").read_bytes())
    # And `fedse certs members` will not sign with a member's key posing as a CA directory.
    fake = tmp_path / "fake-ca"
    fake.mkdir()
    (fake / "ca.pem").write_bytes((tmp_path / "org-maze.pem").read_bytes())
    (fake / "ca-key.pem").write_bytes((tmp_path / "org-maze-key.pem").read_bytes())
    rc, _, err = fedse_certs(capsys, "members", "--ca-dir", fake, "--out", tmp_path / "x.json", "org-a")
    assert rc == 1 and "is not a CA fedse certs init made" in err and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("text, message", [
    ("not json", "is not JSON"),
    ("[]", "holds list, not the fields federation, members, issued, signature"),
    ('{"members": ["org-a"]}', "holds ['members'], not the fields"),
    ('{"federation": "f", "members": "org-a", "issued": "2025-01-01T00:00:00Z", "signature": "AA=="}',
     "members a list of client ids"),
    ('{"federation": "f", "members": ["org a"], "issued": "2025-01-01T00:00:00Z", "signature": "AA=="}',
     "'org a' is not a client id: use 1-63"),
    ('{"federation": "f", "members": [], "issued": "2025-01-01T00:00:00Z", "signature": "AA=="}',
     "names no member"),
    ('{"federation": "f", "members": ["org-b", "org-a"], "issued": "2025-01-01T00:00:00Z", "signature": "AA=="}',
     "not sorted and unique"),
    ('{"federation": "f", "members": ["org-a", "org-a"], "issued": "2025-01-01T00:00:00Z", "signature": "AA=="}',
     "not sorted and unique"),
    ('{"federation": "f", "members": ["org-a"], "issued": "2025-01-01T00:00:00Z", "signature": "not base64!"}',
     "its signature is not base64"),
    ('{"federation": "f", "members": ["org-a"], "issued": "yesterday", "signature": "AA=="}',
     "issued 'yesterday' is not an ISO time"),
    ('{"federation": "f", "members": ["org-a"], "issued": "2025-01-01T00:00:00", "signature": "AA=="}',
     "is not an ISO time with its zone"),
])
def test_a_malformed_list_is_refused_saying_what_is_wrong(ca, tmp_path, text, message):
    path = tmp_path / "members.json"
    path.write_text(text)
    with pytest.raises(MemberListError) as info:
        members.read_member_list(path, ca_pem(ca))
    assert message in str(info.value) and isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_a_plain_list_given_to_each_client(tmp_path):
    path = tmp_path / "members.txt"
    path.write_text("# the federation's members\norg-maze\norg-wordle, org-babyai\n\norg-maze  # twice is once\n")
    assert members.read_plain_list(path) == frozenset(IDS)
    path.write_text("org-maze\norg wordle\n")
    with pytest.raises(MemberListError, match="'org wordle' is not a client id"):
        members.read_plain_list(path)
    path.write_text("# nobody\n")
    with pytest.raises(MemberListError, match="names no member"):
        members.read_plain_list(path)
    with pytest.raises(MemberListError, match="cannot read the member list"):
        members.read_plain_list(tmp_path / "missing.txt")


def test_a_signed_list_is_told_from_a_plain_one(signed, tmp_path):
    plain = tmp_path / "members.txt"
    plain.write_text("org-maze\n")
    assert members.is_signed(signed) and not members.is_signed(plain)
    # Anything starting with `{` is checked as signed (no client id starts so), never read as plain.
    plain.write_text('  {"members": ["org-maze"]}')
    assert members.is_signed(plain)


@pytest.mark.parametrize("ids, message", [
    (["org/a"], "the member ids: 'org/a' is not a client id"),
    (["@{tmp}/missing.txt"], "cannot read a list of client ids"),
])
def test_members_refusals_say_in_one_line_what_to_do(ca, tmp_path, capsys, ids, message):
    out = tmp_path / "members.json"
    rc, _, err = fedse_certs(capsys, "members", "--ca-dir", ca, "--out", out, *[i.format(tmp=tmp_path) for i in ids])
    assert rc == 1 and message in err and err.startswith("fedse certs members: ") and err.count("\n") == 1, err
    assert not out.exists()


def test_a_list_is_not_overwritten_without_force(signed, ca, capsys):
    before = signed.read_bytes()
    rc, _, err = fedse_certs(capsys, "members", "--ca-dir", ca, "--out", signed, "org-a")
    assert rc == 1 and "exists already: pass --force" in err and signed.read_bytes() == before
    assert fedse_certs(capsys, "members", "--ca-dir", ca, "--out", signed, "--force", "org-a")[0] == 0
    assert members.read_member_list(signed, ca_pem(ca)) == {"org-a"}
