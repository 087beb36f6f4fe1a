"""`fedse certs`: the files each command writes (modes, names, purposes, lifetimes), what `show` says,
the refusals (a file that exists, an altered request, a bad client id), and the whole request flow:
certificates made by init, request, sign and issue admit one organisation to a real aggregator over
mTLS, while another, signed by the same CA but not on the allowed list, is refused."""

from __future__ import annotations

import datetime
import pathlib

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from apps import certs as command
from apps import cli
from fedse.model import adapter as ad
from fedse.security import certs
from fedse.security.admission import Security, channel
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from services.client_agent.federation.link import FederationClient
from support import aggregator_in_process

DAY = datetime.timedelta(days=1)


def fedse_certs(capsys, *argv: str) -> tuple[int, str, str]:
    """`fedse certs ARGV`: (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = command.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def mode(path: pathlib.Path) -> int:
    return path.stat().st_mode & 0o777


def load(path: pathlib.Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def ext(cert, kind):
    return cert.extensions.get_extension_for_class(kind)


def lifetime(cert: x509.Certificate) -> datetime.timedelta:
    """How long from now the certificate stays valid."""
    return cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)


@pytest.fixture
def ca(tmp_path, capsys) -> pathlib.Path:
    rc, _, err = fedse_certs(capsys, "init", "--out-dir", tmp_path / "ca", "--name", "Example federation CA")
    assert rc == 0, err
    return tmp_path / "ca"


def requested(tmp_path, capsys, client_id: str) -> pathlib.Path:
    rc, _, err = fedse_certs(capsys, "request", "--client-id", client_id, "--out-dir", tmp_path / client_id)
    assert rc == 0, err
    return tmp_path / client_id / f"{client_id}.csr"


def csr_of(subject: str, sans: list[str] | None = None) -> bytes:
    """A request made without fedse (as any tool may make one), signed by its own key."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(s) for s in sans]), critical=False)
    return builder.sign(ec.generate_private_key(ec.SECP256R1()), hashes.SHA256()).public_bytes(
        serialization.Encoding.PEM)


# ---- what each command writes ------------------------------------------------------------------------
def test_init_makes_a_self_signed_ca_that_signs_only_end_certificates(tmp_path, capsys):
    rc, out, _ = fedse_certs(capsys, "init", "--out-dir", tmp_path / "ca", "--name", "Example federation CA")
    assert rc == 0
    cert_path, key_path = tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem"
    assert (mode(cert_path), mode(key_path)) == (0o644, 0o600)
    assert f"wrote {cert_path}" in out and f"wrote {key_path}" in out and "keep it offline" in out
    cert = load(cert_path)
    cert.verify_directly_issued_by(cert)
    assert cert.subject.rfc4514_string() == "CN=Example federation CA"
    constraints = ext(cert, x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    assert ext(cert, x509.KeyUsage).value.key_cert_sign
    assert 3649 * DAY < lifetime(cert) <= 3650 * DAY
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"


def test_request_makes_the_organisations_key_and_a_request_named_by_its_client_id(tmp_path, capsys):
    rc, out, _ = fedse_certs(capsys, "request", "--client-id", "org-a", "--out-dir", tmp_path)
    assert rc == 0
    key_path, csr_path = tmp_path / "org-a-key.pem", tmp_path / "org-a.csr"
    assert (mode(key_path), mode(csr_path)) == (0o600, 0o644)
    assert "never leaves your organisation" in out and f"{csr_path}: your certificate request; send it" in out
    csr = x509.load_pem_x509_csr(csr_path.read_bytes())
    assert csr.is_signature_valid
    assert csr.subject.rfc4514_string() == "CN=org-a"
    assert [n.value for n in ext(csr, x509.SubjectAlternativeName).value] == ["org-a"]
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert key.public_key() == csr.public_key()
    assert b"PRIVATE KEY" not in csr_path.read_bytes()


def test_sign_puts_the_client_id_first_for_client_authentication_for_the_days_asked(ca, tmp_path, capsys):
    csr = requested(tmp_path, capsys, "org-a")
    out_path = tmp_path / "org-a.pem"
    rc, out, _ = fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", csr, "--out", out_path, "--days", "90")
    assert rc == 0 and mode(out_path) == 0o644
    assert f"send {out_path} and {ca / 'ca.pem'} to org-a" in out and "--allowed-clients" in out
    cert = load(out_path)
    cert.verify_directly_issued_by(load(ca / "ca.pem"))
    assert cert.public_key() == x509.load_pem_x509_csr(csr.read_bytes()).public_key()
    assert [n.value for n in ext(cert, x509.SubjectAlternativeName).value] == ["org-a"]
    assert certs.identity(cert) == "org-a" and cert.subject.rfc4514_string() == "CN=org-a"
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not ext(cert, x509.BasicConstraints).value.ca
    assert 89 * DAY < lifetime(cert) <= 90 * DAY
    rc, _, _ = fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", csr, "--out", tmp_path / "default.pem")
    assert 364 * DAY < lifetime(load(tmp_path / "default.pem")) <= 365 * DAY


def test_issue_makes_a_server_certificate_for_the_names_and_addresses_dialled(ca, tmp_path, capsys):
    rc, out, _ = fedse_certs(capsys, "issue", "--ca-dir", ca, "--name", "aggregator", "--dns",
                             "aggregator.example.org,localhost", "--ip", "127.0.0.1", "--ip", "::1",
                             "--out-dir", tmp_path / "srv")
    assert rc == 0
    cert_path, key_path = tmp_path / "srv" / "aggregator.pem", tmp_path / "srv" / "aggregator-key.pem"
    assert (mode(cert_path), mode(key_path)) == (0o644, 0o600)
    assert f"--tls-cert {cert_path} --tls-key {key_path}" in out
    cert = load(cert_path)
    cert.verify_directly_issued_by(load(ca / "ca.pem"))
    assert certs.san_texts(cert) == ["DNS:aggregator.example.org", "DNS:localhost", "IP:127.0.0.1", "IP:::1"]
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert 364 * DAY < lifetime(cert) <= 365 * DAY


def end_certificate_checks(cert: x509.Certificate, purpose: x509.ObjectIdentifier) -> None:
    """An end certificate for one purpose only: its extended key usage that purpose alone, not a CA
    (critical BasicConstraints ca=False, no path length), and its key signs neither certificates nor CRLs."""
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [purpose]
    constraints = ext(cert, x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca is False and constraints.value.path_length is None
    usage = ext(cert, x509.KeyUsage)
    assert usage.critical and usage.value.digital_signature
    assert not usage.value.key_cert_sign and not usage.value.crl_sign
    assert certs.purposes(cert) == [{ExtendedKeyUsageOID.CLIENT_AUTH: "client",
                                     ExtendedKeyUsageOID.SERVER_AUTH: "server"}[purpose]]


def test_members_get_client_auth_only_and_servers_server_auth_only(ca, tmp_path, capsys):
    """A member's certificate cannot serve (an organisation cannot pose as the aggregator to another), and
    the aggregator's cannot join as a client nor sign certificates: one purpose each, never a CA."""
    csr = requested(tmp_path, capsys, "org-a")
    assert fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", csr, "--out", tmp_path / "org-a.pem")[0] == 0
    assert fedse_certs(capsys, "issue", "--ca-dir", ca, "--name", "aggregator", "--dns", "aggregator.example.org",
                       "--out-dir", tmp_path)[0] == 0
    member, server = load(tmp_path / "org-a.pem"), load(tmp_path / "aggregator.pem")
    end_certificate_checks(member, ExtendedKeyUsageOID.CLIENT_AUTH)
    end_certificate_checks(server, ExtendedKeyUsageOID.SERVER_AUTH)
    # And `show` says so, from the files.
    for path, purpose in ((tmp_path / "org-a.pem", "client"), (tmp_path / "aggregator.pem", "server")):
        rc, out, _ = fedse_certs(capsys, "show", path, "--ca-cert", ca / "ca.pem")
        assert rc == 0 and f"  purpose: {purpose}\n" in out and "  CA: no\n" in out


# ---- show --------------------------------------------------------------------------------------------
def test_show_prints_identity_names_issuer_validity_and_purpose(ca, tmp_path, capsys):
    fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", requested(tmp_path, capsys, "org-a"),
                "--out", tmp_path / "org-a.pem")
    rc, out, err = fedse_certs(capsys, "show", tmp_path / "org-a.pem")
    assert rc == 0 and err == ""
    assert "identity (first SAN, else CN): org-a\n" in out and "subject alternative names: DNS:org-a\n" in out
    assert "issuer: CN=Example federation CA\n" in out and "purpose: client\n" in out and "CA: no" in out
    assert f"to {load(tmp_path / 'org-a.pem').not_valid_after_utc:%Y-%m-%d %H:%M} UTC" in out
    rc, out, _ = fedse_certs(capsys, "show", ca / "ca.pem")
    assert rc == 0 and "CA: yes" in out and "purpose: signs certificates" in out
    rc, out, _ = fedse_certs(capsys, "show", tmp_path / "org-a" / "org-a.csr")
    assert rc == 0 and "certificate request" in out and "identity (first SAN, else CN): org-a" in out


def test_show_with_ca_checks_that_the_ca_signed_it(ca, tmp_path, capsys):
    cert = tmp_path / "org-a.pem"
    fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", requested(tmp_path, capsys, "org-a"), "--out", cert)
    rc, out, err = fedse_certs(capsys, "show", cert, "--ca-cert", ca / "ca.pem")
    assert rc == 0 and f"  signed by {ca / 'ca.pem'}: yes\n" in out and err == ""
    fedse_certs(capsys, "init", "--out-dir", tmp_path / "other", "--name", "Example federation CA")  # the same name
    rc, out, err = fedse_certs(capsys, "show", cert, "--ca-cert", tmp_path / "other" / "ca.pem")
    assert rc == 1 and "signed by" in out and out.rstrip().endswith(": NO")
    assert err.startswith(f"warning: {cert} is not signed by the CA in ") and err.count("\n") == 1


def test_show_warns_a_month_before_expiry_and_fails_once_expired(ca, tmp_path, capsys, monkeypatch):
    short = tmp_path / "short.pem"
    fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", requested(tmp_path, capsys, "org-a"), "--out", short,
                "--days", "10")
    rc, out, err = fedse_certs(capsys, "show", short)
    assert rc == 0 and "identity (first SAN, else CN): org-a" in out
    assert err.startswith(f"warning: {short} expires in 10 days, on ") and "fedse certs request" in err
    later = certs.now() + 11 * DAY
    monkeypatch.setattr(certs, "now", lambda: later)
    rc, out, err = fedse_certs(capsys, "show", short)
    assert rc == 1 and "identity (first SAN, else CN): org-a" in out
    assert err.startswith(f"warning: {short} expired on ") and err.count("\n") == 1


# ---- refusals ----------------------------------------------------------------------------------------
def test_nothing_is_overwritten_without_force(ca, tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in ca.iterdir()}
    rc, out, err = fedse_certs(capsys, "init", "--out-dir", ca)
    assert rc == 1 and out == ""
    assert err == f"fedse certs init: {ca / 'ca.pem'} exists already: pass --force to replace it, or choose " \
                  f"another directory\n"
    assert {p.name: p.read_bytes() for p in ca.iterdir()} == before
    # A request whose key exists writes neither file (the key is checked before anything is written).
    (tmp_path / "org-a-key.pem").write_text("a key of its own")
    rc, _, err = fedse_certs(capsys, "request", "--client-id", "org-a", "--out-dir", tmp_path)
    assert rc == 1 and "org-a-key.pem exists already: pass --force" in err
    assert not (tmp_path / "org-a.csr").exists()
    rc, _, _ = fedse_certs(capsys, "init", "--out-dir", ca, "--force")
    assert rc == 0 and (ca / "ca-key.pem").read_bytes() != before["ca-key.pem"] and mode(ca / "ca-key.pem") == 0o600


def test_an_altered_request_is_refused(ca, tmp_path, capsys):
    csr = requested(tmp_path, capsys, "org-a")
    der = x509.load_pem_x509_csr(csr.read_bytes()).public_bytes(serialization.Encoding.DER)
    forged = x509.load_der_x509_csr(der.replace(b"org-a", b"org-z", 1))  # the subject, on the way
    assert forged.subject.rfc4514_string() == "CN=org-z"
    csr.write_bytes(forged.public_bytes(serialization.Encoding.PEM))
    rc, _, err = fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", csr, "--out", tmp_path / "org-z.pem")
    assert rc == 1 and "signature does not verify" in err and err.count("\n") == 1
    assert not (tmp_path / "org-z.pem").exists()


@pytest.mark.parametrize("subject, sans, message", [
    ("org a", None, "the client id 'org a' is not valid: use 1-63 letters"),
    ("-org", ["-org"], "the client id '-org' is not valid"),
    ("x" * 64, None, "is not valid: use 1-63 letters"),
    ("org-a", ["org-b"], "names the client 'org-a' but its first subject alternative name is 'org-b'"),
])
def test_a_request_for_a_bad_client_id_is_refused(ca, tmp_path, capsys, subject, sans, message):
    csr = tmp_path / "bad.csr"
    csr.write_bytes(csr_of(subject, sans))
    rc, _, err = fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", csr, "--out", tmp_path / "bad.pem")
    assert rc == 1 and message in err and err.count("\n") == 1
    assert not (tmp_path / "bad.pem").exists()


@pytest.mark.parametrize("argv, message", [
    (["request", "--client-id", "org/a", "--out-dir", "{tmp}"], "--client-id 'org/a' is not valid: use 1-63"),
    (["sign", "--ca-dir", "{tmp}", "--csr", "{tmp}/x.csr", "--out", "{tmp}/x.pem"], "cannot read the certificate "
                                                                                    "request"),
    (["sign", "--ca-dir", "{tmp}", "--csr", "{csr}", "--out", "{tmp}/x.pem"], "give --ca-dir the directory "
                                                                              "fedse certs init wrote"),
    (["sign", "--ca-dir", "{ca}", "--csr", "{csr}", "--out", "{tmp}/x.pem", "--days", "4000"], "outlives the CA"),
    (["sign", "--ca-dir", "{ca}", "--csr", "{csr}", "--out", "{tmp}/x.pem", "--days", "0"], "at least 1 day"),
    (["sign", "--ca-dir", "{ca}", "--csr", "{ca}/ca.pem", "--out", "{tmp}/x.pem"], "is not a PEM certificate "
                                                                                   "request"),
    (["issue", "--ca-dir", "{ca}", "--name", "agg", "--out-dir", "{tmp}"], "no --dns or --ip"),
    (["issue", "--ca-dir", "{ca}", "--name", "agg", "--ip", "10.0.0.300", "--out-dir", "{tmp}"], "not an IP"),
    (["issue", "--ca-dir", "{ca}", "--name", "agg", "--dns", "a b", "--out-dir", "{tmp}"], "not a DNS name"),
    (["show", "{ca}/ca-key.pem"], "holds no PEM certificate or certificate request"),
])
def test_refusals_say_in_one_line_what_to_do(ca, tmp_path, capsys, argv, message):
    csr = requested(tmp_path, capsys, "org-a")
    argv = [a.format(tmp=tmp_path, ca=ca, csr=csr) for a in argv]
    rc, _, err = fedse_certs(capsys, *argv)
    assert rc == 1 and message in err and err.count("\n") == 1, err
    assert err.startswith(f"fedse certs {argv[0]}: ")


def test_fedse_help_names_certs(capsys, monkeypatch):
    monkeypatch.setattr(cli.signal, "signal", lambda *_: None)  # leave pytest's handlers alone
    assert cli.main(["--help"]) == 0
    assert "fedse certs COMMAND" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["certs", "--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: fedse certs [-h] COMMAND")


# ---- the whole flow, over mTLS -----------------------------------------------------------------------
def test_the_request_flow_admits_an_allowed_organisation_and_refuses_another(ca, tmp_path, capsys):
    """The operator makes the CA and the aggregator's certificate; two organisations send requests, the
    operator signs both; the aggregator admits only org-a. org-a joins with what it made and received;
    org-b, whose certificate the same CA signed, is refused by name."""
    issued = {}
    for org in ("org-a", "org-b"):
        csr = requested(tmp_path, capsys, org)  # in the organisation's own directory, with its key
        issued[org] = tmp_path / "operator" / f"{org}.pem"
        assert fedse_certs(capsys, "sign", "--ca-dir", ca, "--csr", csr, "--out", issued[org])[0] == 0
    assert fedse_certs(capsys, "issue", "--ca-dir", ca, "--name", "aggregator", "--dns", "localhost", "--ip",
                       "127.0.0.1", "--out-dir", tmp_path / "aggregator")[0] == 0
    server = {"tls_ca": str(ca / "ca.pem"), "tls_cert": str(tmp_path / "aggregator" / "aggregator.pem"),
              "tls_key": str(tmp_path / "aggregator" / "aggregator-key.pem")}

    def member(org: str, cert: pathlib.Path | None = None) -> Security:
        return Security(tls_ca=str(ca / "ca.pem"), tls_cert=str(cert or issued[org]),
                        tls_key=str(tmp_path / org / f"{org}-key.pem") if cert is None else server["tls_key"])

    schema = ad.Schema.of({"x.lora_A.weight": torch.zeros(2, 4), "x.lora_B.weight": torch.zeros(4, 2)}, '{"r": 2}')
    with aggregator_in_process(tmp_path / "state", allowed_clients="org-a", **server) as (agg, port, _):
        target = f"127.0.0.1:{port}"
        admitted = FederationClient(target, "org-a", retries=1, timeout_s=30, security=member("org-a"))
        refused = FederationClient(target, "org-b", retries=1, timeout_s=30, security=member("org-b"))
        try:
            assert admitted.join("maze", "tiny", schema).config.run_id == "t"
            with pytest.raises(grpc.RpcError) as info:
                refused.join("maze", "tiny", schema)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "'org-b'" in info.value.details()
        finally:
            admitted.close(), refused.close()
        # The aggregator's own certificate is for serving: it cannot stand in for a client.
        with channel(target, member("org-a", cert=pathlib.Path(server["tls_cert"]))) as ch:
            with pytest.raises(grpc.RpcError) as info:
                fpb_grpc.FederationServiceStub(ch).GetRoundStatus(fpb.RoundStatusRequest(client_id="org-a"),
                                                                  timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_old_flag_spellings_work_for_a_release_with_a_warning(tmp_path, capsys):
    rc, _, err = fedse_certs(capsys, "init", "--dir", tmp_path / "ca")
    assert rc == 0 and (tmp_path / "ca" / "ca.pem").exists()
    assert "--dir is deprecated" in err and "use --out-dir" in err
    rc, _, err = fedse_certs(capsys, "request", "--client-id", "org-a", "--dir", tmp_path / "org-a")
    assert rc == 0 and (tmp_path / "org-a" / "org-a.csr").exists() and "use --out-dir" in err
    fedse_certs(capsys, "sign", "--ca-dir", tmp_path / "ca", "--csr", tmp_path / "org-a" / "org-a.csr",
                "--out", tmp_path / "org-a.pem")
    rc, out, err = fedse_certs(capsys, "show", tmp_path / "org-a.pem", "--ca", tmp_path / "ca" / "ca.pem")
    assert rc == 0 and "ca.pem: yes" in out and "use --ca-cert" in err
    with pytest.raises(SystemExit) as stopped:  # neither spelling: argparse's own line, exit 2
        fedse_certs(capsys, "init")
    assert stopped.value.code == 2 and "--out-dir" in capsys.readouterr().err


# ---- keys stay out of git ----------------------------------------------------------------------------
def test_gitignore_covers_what_the_guides_write_and_git_holds_no_key():
    """The guides run `fedse certs`, services and experiments at the checkout's root: the CA's key, member keys,
    requests, member lists, runs and logs must all be ignored, so that `git add -A` never commits one."""
    import shutil
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    written = ["ca-key.pem", "ca.pem", "ca/ca-key.pem", "offline-ca/ca-key.pem", "org-a-key.pem", "org-a.pem",
               "org-a.csr", "aggregator-key.pem", "mtls-certs/org-a-key.pem", "members.json", "members.txt",
               "runs/tb/x", "runs/mlflow/x", "tracked/x", "state/aggregator/x", "results/x", "models/x", "run.log",
               "mlruns/x", "logs/x"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=root, capture_output=True, text=True)
    assert sorted(done.stdout.split()) == sorted(written), f"not ignored: {set(written) - set(done.stdout.split())}"
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    keys = [f for f in tracked if f.endswith((".pem", ".key", ".csr", ".p12")) or f.endswith("members.json")]
    assert keys == [], keys
