"""The Kubernetes manifests' certificates, in every scenario (k8s_support), without a cluster.

The mtls component's Secrets are generated from certificates made offline; its scenarios build from
a copy of k8s/ holding ones made as docs/deploy.md makes them (support.offline_certs). Each workload
mounts the certificate made for it, naming what its clients dial; and no object of any scenario may
hold the CA's private key, or anything that makes a CA in the cluster.
"""

from __future__ import annotations

import base64
import json
import pathlib
import re

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedse.security import certs
from fedse.security.tls_files import public_bytes
from k8s_support import (NAMESPACE, NEEDS_KUBECTL, _render, by_name, configs, module_of, mounted_secret,
                         scenario, scenario_dirs, scenario_tmp, secret_files)  # noqa: F401 - fixtures

pytestmark = NEEDS_KUBECTL


def test_certificates_name_what_is_dialled(scenario, configs):
    """Each workload mounts the certificate made for it: signed by the CA it is given, its key the
    certificate's, a client's naming its client id first for client authentication only, and the
    certificate of each server it dials naming the address dialled, for server authentication only."""
    name, docs = scenario
    secrets = {n: secret_files(s) for n, s in by_name(docs, "Secret").items()}
    if not secrets:
        pytest.skip(f"{name} makes no Secrets (the on-prem overlay's is created by hand)")
    by_workload = {w["metadata"]["name"]: secrets[mounted_secret(w, c)] for w, c, _ in configs}
    for w, c, cfg in configs:
        files = by_workload[w["metadata"]["name"]]
        cert = x509.load_pem_x509_certificate(files["tls.crt"])
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(files["ca.crt"]))
        key = serialization.load_pem_private_key(files["tls.key"], password=None)
        assert public_bytes(key.public_key()) == public_bytes(cert.public_key()), w["metadata"]["name"]
        assert not certs.is_ca(cert), f"{w['metadata']['name']} mounts a CA's certificate as its own"
        if module_of(c) != "services.client_agent":
            assert certs.purposes(cert) == ["server"], w["metadata"]["name"]
            continue
        assert certs.identity(cert) == cfg.client_id and certs.purposes(cert) == ["client"], w["metadata"]["name"]
        for address in (cfg.aggregator, cfg.env_server):
            host = address.rsplit(":", 1)[0]
            server = x509.load_pem_x509_certificate(by_workload[host.split(".")[0]]["tls.crt"])
            names = certs.san_texts(server)
            assert f"DNS:{host}" in names and certs.purposes(server) == ["server"], (host, names)
            assert f"DNS:{host.split('.')[0]}.{NAMESPACE}.svc.cluster.local" in names


# Secret keys that name a CA's private key file (fedse certs init's, openssl's, cert-manager's CA Secret's).
CA_KEY_NAMES = {"ca-key.pem", "ca.key", "ca-key", "ca.key.pem", "ca-private-key.pem"}
PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----.+?-----END \1-----", re.S)


def _texts(value, where: str):
    """(where, bytes) for every string in an object, a Secret's data decoded."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _texts(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _texts(v, f"{where}[{i}]")
    elif isinstance(value, str):
        yield where, value.encode()
        if ".data." in where:
            try:
                yield where, base64.b64decode("".join(value.split()), validate=True)  # kustomize wraps lines
            except ValueError:
                pass


def ca_key_holders(docs: list[dict]) -> list[str]:
    """Where the objects hold the CA's private key, or what would make a CA in the cluster: a private
    key whose public key is a CA certificate's (any in the objects), a Secret key named as a CA key
    file, a cert-manager CA Certificate, or a CA or self-signed Issuer."""
    cas, keys, found = set(), [], []
    for d in docs:
        what = f"{d['kind']}/{d['metadata']['name']}"
        for where, data in _texts(d, what):
            for block in PEM_BLOCK.finditer(data):
                if block[1] == b"CERTIFICATE":
                    cert = x509.load_pem_x509_certificate(block[0])
                    if certs.is_ca(cert):
                        cas.add(public_bytes(cert.public_key()))
                elif block[1].endswith(b"PRIVATE KEY"):
                    keys.append((where, block[0]))
        if d["kind"] == "Secret":
            found += [f"{what}: a key named {k}" for k in {*d.get("data", {}), *d.get("stringData", {})}
                      if k.lower() in CA_KEY_NAMES]
        spec = d.get("spec") or {}
        if (d["kind"] == "Certificate" and spec.get("isCA")) or (d["kind"] in ("Issuer", "ClusterIssuer")
                                                                   and ("ca" in spec or "selfSigned" in spec)):
            found.append(f"{what}: makes a CA in the cluster")
    for where, pem in keys:
        key = serialization.load_pem_private_key(pem, password=None)
        if public_bytes(key.public_key()) in cas:
            found.append(f"{where}: the CA's private key")
    return found


def test_no_object_holds_a_ca_private_key(scenario):
    """The CA key never sits where the aggregator runs: the cluster holds certificates made offline."""
    name, docs = scenario
    assert ca_key_holders(docs) == [], name
    secrets = [secret_files(s) for s in by_name(docs, "Secret").values()]
    if "mtls" in scenario_dirs().get(name, []):
        # Not vacuous: these hold every service's key and the CA's certificate, and nothing else.
        assert len(secrets) == 11 and all(certs.is_ca(x509.load_pem_x509_certificate(s["ca.crt"])) for s in secrets)
        assert all(b"PRIVATE KEY" not in s["ca.crt"] + s["tls.crt"] for s in secrets), name


def test_the_ca_key_check_finds_a_ca_key_put_in_the_cluster(scenario_tmp):
    """ca_key_holders is not vacuous: the CA key in place of a service's key, under a CA key's name, or
    a cert-manager CA, is each found."""
    docs = [json.loads(json.dumps(d)) for d in _render("mtls", scenario_tmp)]
    ca_key = (pathlib.Path(scenario_tmp) / "mtls" / "offline-ca" / "ca-key.pem").read_bytes()
    secret = by_name(docs, "Secret")["aggregator-tls"]
    secret["data"]["tls.key"] = base64.b64encode(ca_key).decode()
    assert ca_key_holders(docs) == ["Secret/aggregator-tls.data.tls.key: the CA's private key"]
    named = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "fedse-ca"}, "stringData": {"ca.key": "x"}}
    in_cluster = {"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": {"name": "fedse-ca"},
                  "spec": {"isCA": True, "secretName": "fedse-ca"}}
    assert ca_key_holders([named, in_cluster]) == ["Secret/fedse-ca: a key named ca.key",
                                                   "Certificate/fedse-ca: makes a CA in the cluster"]
