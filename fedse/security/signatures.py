"""Signatures that bind secure aggregation's messages to an organisation's certificate, so that an
aggregator that lies cannot put keys of its own in a client's place, nor show clients different lists
of uploaders without being caught (proto: RunConfig.secure_signed).

A client signs with the private key of its mTLS certificate (ECDSA over SHA-256, Ed25519, or RSA-PSS
over SHA-256, as the key is), and every client checks every other member's certificate against the
federation's CA, its identity against the member's client id, and its signature. The messages
signed are framed (masking.frame) and start with the protocol's domain and the attempt's context.
"""

from __future__ import annotations

import datetime
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from fedse.security import certs

from fedse.privacy import masking


class SignatureError(ValueError):
    """A certificate or signature that does not verify; the text says whose and why."""


def advertisement(ctx: bytes, client_id: str, encryption_key: bytes, masking_key: bytes, commitment: bytes,
                  lora_rank: int = 0) -> bytes:
    """What a client signs of its key advertisement: its keys and its LoRA rank (0 in a run of one rank),
    which decides the components every member sends (fedse.model.ranks.held_rank)."""
    return masking.frame(masking.DOMAIN, "advertise", ctx, client_id, encryption_key, masking_key, commitment,
                         str(lora_rank))


def consistency(ctx: bytes, client_id: str, threshold: int, degree: int, roster_digest: bytes,
                uploaders: Iterable[str]) -> bytes:
    """What an uploader signs of the uploader list it was shown (in client-id order), bound to all the
    list vouches for: the run, round and attempt (`ctx`), the threshold, the masking graph's degree
    (RunConfig.secure_neighbours) and every member's keys (secagg.roster_digest, fresh each attempt).
    A signature shown in one attempt then verifies in no other, whatever nonce the aggregator reuses."""
    return masking.frame(masking.DOMAIN, "consistency", ctx, client_id, str(threshold), str(degree), roster_digest,
                         *sorted(uploaders))


def names(cert: x509.Certificate) -> frozenset[str]:
    """Every name a certificate holds: its subject alternative names' values and its common name."""
    out = {text.split(":", 1)[1] for text in certs.san_texts(cert)}
    out.update(str(a.value) for a in cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME))
    return frozenset(out)


_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)


class Signer:
    """A client's certificate and its private key, read from its mTLS files at each attempt (a renewed
    certificate is taken at the next one)."""

    def __init__(self, cert_pem: bytes, key_pem: bytes):
        self.certificate = x509.load_pem_x509_certificates(cert_pem)[0]
        self._key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(self._key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey, rsa.RSAPrivateKey)):
            raise SignatureError(f"the key of this client's certificate is a {type(self._key).__name__}: secure "
                                 "aggregation signs with ECDSA, Ed25519 or RSA keys")

    @property
    def der(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.DER)

    def sign(self, message: bytes) -> bytes:
        key = self._key
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return key.sign(message, ec.ECDSA(hashes.SHA256()))
        if isinstance(key, rsa.RSAPrivateKey):
            return key.sign(message, _PSS, hashes.SHA256())
        return key.sign(message)


class Verifier:
    """Checks members' certificates against the federation's CA certificates and their signatures."""

    def __init__(self, ca_pem: bytes):
        self.cas = x509.load_pem_x509_certificates(ca_pem)

    def certificate(self, der: bytes, client_id: str, now: datetime.datetime | None = None) -> x509.Certificate:
        """The member's certificate once checked: signed by the CA, valid now, naming `client_id`."""
        if not der:
            raise SignatureError(f"{client_id} has no certificate in the roster: its keys are not signed")
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError:
            raise SignatureError(f"{client_id}'s certificate is not a DER certificate") from None
        if not certs.signed_by(cert, self.cas):
            raise SignatureError(f"{client_id}'s certificate is not signed by the federation's CA")
        now = now or certs.now()
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise SignatureError(f"{client_id}'s certificate is not valid now (valid "
                                 f"{cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d})")
        named = certs.identity(cert)
        if named != client_id:
            raise SignatureError(f"the certificate given for {client_id} names {named!r}")
        return cert

    def member(self, der: bytes, client_id: str, not_names: frozenset[str] = frozenset(),
               now: datetime.datetime | None = None) -> x509.Certificate:
        """The certificate of a federation member once checked: as `certificate` checks it, and a member's
        own, as `fedse certs sign` issues it: not a CA, for client authentication (its extended key usage
        holds clientAuth), and naming none of `not_names` (the aggregator's names). A server certificate
        from the same CA, such as the aggregator's, is then no member."""
        cert = self.certificate(der, client_id, now)
        try:
            is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if is_ca:
            raise SignatureError(f"{client_id}'s certificate is a CA's, not a member's")
        uses = certs.purposes(cert)
        if "client" not in uses:
            raise SignatureError(f"{client_id}'s certificate is for {', '.join(uses)}, not for client authentication: "
                                 "a member's certificate is one `fedse certs sign` issued (a server certificate, such "
                                 "as the aggregator's, is no member)")
        named = names(cert) & not_names
        if named:
            raise SignatureError(f"{client_id}'s certificate names the aggregator ({', '.join(sorted(named))}): the "
                                 "aggregator is no member")
        return cert

    @staticmethod
    def signature(cert: x509.Certificate, message: bytes, signature: bytes, what: str) -> None:
        """SignatureError unless `signature` is the certificate key's signature of `message`."""
        key = cert.public_key()
        try:
            if isinstance(key, ec.EllipticCurvePublicKey):
                key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
            elif isinstance(key, rsa.RSAPublicKey):
                key.verify(signature, message, _PSS, hashes.SHA256())
            elif isinstance(key, ed25519.Ed25519PublicKey):
                key.verify(signature, message)
            else:
                raise SignatureError(f"{what}: a {type(key).__name__} key cannot sign here")
        except (InvalidSignature, ValueError):
            raise SignatureError(f"{what} does not verify") from None

    def signed_by_all(self, certs_by_id: dict[str, x509.Certificate], signed: Sequence[tuple[str, bytes]],
                      message_of) -> list[str]:
        """The signers among `signed` ((client_id, signature)) whose signature of message_of(client_id)
        verifies with their (already checked) certificate, in order; others are left out."""
        good = []
        for cid, sig in signed:
            cert = certs_by_id.get(cid)
            if cert is None:
                continue
            try:
                self.signature(cert, message_of(cid), sig, cid)
            except SignatureError:
                continue
            good.append(cid)
        return good
