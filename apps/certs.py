"""`fedse certs`: the federation's CA and certificates (fedse/security/certs.py makes and reads them)."""

from __future__ import annotations

import argparse
import pathlib
import sys

from fedse.security import certs as pki
from fedse.security.certs import CertError
from fedse.config import deprecated


def main(argv: list[str]) -> int:
    """The federation's CA and certificates, for services run as processes and for Kubernetes
    (k8s/components/mtls mounts them), made on the operator's offline machine. The operator makes the
    CA (init), signs each organisation's request (sign), issues the servers' certificates (issue) and
    signs the member list (members); an organisation makes its key and a request (request), and sends
    only the request. show prints what a certificate says and warns before it expires."""
    parser = _parser()
    ns = parser.parse_args(argv)
    for new, old in RENAMED.items():  # the old spelling works for a release, with a warning
        if getattr(ns, "old_" + new, None) is not None:
            deprecated(old.lstrip("-"), new)
            if not getattr(ns, new):
                setattr(ns, new, getattr(ns, "old_" + new))
    if ns.command in ("init", "request") and not ns.out_dir:
        parser.error(f"{ns.command}: the following argument is required: --out-dir")  # exit 2
    try:
        return ns.handler(ns)
    except CertError as exc:
        print(f"fedse certs {ns.command}: {exc}", file=sys.stderr)
        return 1


# Flags renamed so that one name means one thing: --out-dir a directory written, --out a file
# written, --ca-dir the CA's directory, --ca-cert its certificate. New name -> old spelling.
RENAMED = {"out_dir": "--dir", "ca_cert": "--ca"}


def _renamed(p: argparse.ArgumentParser, new: str) -> None:
    p.add_argument(RENAMED[new], dest="old_" + new, default=None, help=argparse.SUPPRESS)


def _parser():
    parser = argparse.ArgumentParser(prog="fedse certs", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler, help: str, days: int | None = None) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help, description=help)
        p.set_defaults(handler=handler)
        if days is not None:
            p.add_argument("--days", type=int, default=days, help=f"days it is valid (default: {days})")
            p.add_argument("--force", action="store_true", help="replace files that exist already")
        return p

    p = command("init", _init, "the operator: make the federation CA, ca.pem and its key ca-key.pem", pki.CA_DAYS)
    p.add_argument("--out-dir", default="", help="where to write them")
    _renamed(p, "out_dir")
    p.add_argument("--name", default=pki.CA_NAME, help=f"the CA's name (default: {pki.CA_NAME!r})")
    p = command("request", _request, "an organisation: make its key ID-key.pem and the request ID.csr to send "
                "to the operator")
    p.add_argument("--client-id", required=True, help="the organisation's client id")
    p.add_argument("--out-dir", default="", help="where to write them")
    _renamed(p, "out_dir")
    p.add_argument("--force", action="store_true", help="replace files that exist already")
    p = command("sign", _sign, "the operator: sign an organisation's request; its client id becomes the "
                "certificate's first subject alternative name", pki.LEAF_DAYS)
    p.add_argument("--ca-dir", required=True, help="the directory fedse certs init wrote")
    p.add_argument("--csr", required=True, help="the organisation's request (ID.csr)")
    p.add_argument("--out", required=True, help="where to write its certificate (e.g. ID.pem)")
    p = command("issue", _issue, "the operator: make a server's certificate NAME.pem and key NAME-key.pem "
                "(the aggregator's, an env server's)", pki.LEAF_DAYS)
    p.add_argument("--ca-dir", required=True, help="the directory fedse certs init wrote")
    p.add_argument("--name", required=True, help="the server's name, e.g. aggregator")
    p.add_argument("--dns", action="append", default=[], help="DNS names clients dial, comma-separated")
    p.add_argument("--ip", action="append", default=[], help="IP addresses clients dial, comma-separated")
    p.add_argument("--out-dir", required=True, help="where to write them")
    p = command("show", _show, "print a certificate's (or request's) identity, names, issuer and validity; "
                "warn if it expires within 30 days; exit 1 if it has expired (or --ca-cert did not sign it)")
    p.add_argument("file", metavar="FILE", help="a PEM certificate (or a .csr)")
    p.add_argument("--ca-cert", default="", help="the federation CA's certificate (ca.pem): also check that it signed "
                                                 "FILE (exit 1 if not)")
    _renamed(p, "ca_cert")
    p = command("members", _members, "the operator: write the federation's member list, signed by the CA key, for "
                "every client to check secure aggregation's roster against")
    p.add_argument("--ca-dir", required=True, help="the directory fedse certs init wrote")
    p.add_argument("--out", required=True, help="where to write the list (e.g. members.json)")
    p.add_argument("--force", action="store_true", help="replace the file if it exists already")
    p.add_argument("ids", metavar="ID", nargs="+", help="the members' client ids; @FILE reads them from FILE, one a "
                                                        "line (# comments), as --allowed-clients @FILE")
    return parser


def _listed(values: list[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _init(ns) -> int:
    cert, key = pki.init_ca(pathlib.Path(ns.out_dir), ns.name, ns.days, ns.force)
    print(f"wrote {cert}: the federation CA's certificate; send it to every organisation and server (--tls-ca)\n"
          f"wrote {key}: the CA's key (mode 0600); keep it offline, it signs every certificate of the federation")
    return 0


def _request(ns) -> int:
    key, csr = pki.request(ns.client_id, pathlib.Path(ns.out_dir), ns.force)
    print(f"wrote {key}: your private key (mode 0600); it never leaves your organisation\n"
          f"wrote {csr}: your certificate request; send it to the federation's operator, who sends back your "
          f"certificate and the federation CA's")
    return 0


def _sign(ns) -> int:
    cert, (out,) = pki.sign(pathlib.Path(ns.ca_dir), pathlib.Path(ns.csr), pathlib.Path(ns.out), ns.days, ns.force)
    who = pki.identity(cert)
    print(f"wrote {out}: the client certificate of {who}, valid until {cert.not_valid_after_utc:%Y-%m-%d}\n"
          f"send {out} and {pathlib.Path(ns.ca_dir) / pki.CA_CERT} to {who}; the aggregator admits it where "
          f"--allowed-clients names {who}")
    return 0


def _issue(ns) -> int:
    cert, (out, key) = pki.issue(pathlib.Path(ns.ca_dir), ns.name, _listed(ns.dns), _listed(ns.ip),
                                 pathlib.Path(ns.out_dir), ns.days, ns.force)
    print(f"wrote {out}: a server certificate for {', '.join(pki.san_texts(cert))}, valid until "
          f"{cert.not_valid_after_utc:%Y-%m-%d}\n"
          f"wrote {key}: its key (mode 0600); keep it on the server\n"
          f"serve with --tls-ca {pathlib.Path(ns.ca_dir) / pki.CA_CERT} --tls-cert {out} --tls-key {key}")
    return 0


def _members(ns) -> int:
    from fedse.security import members

    signed, out = members.sign_member_list(pathlib.Path(ns.ca_dir), members.ids_from_arguments(ns.ids),
                                           pathlib.Path(ns.out), ns.force)
    print(f"wrote {out}: {len(signed.members)} members ({', '.join(sorted(signed.members))}), signed by "
          f"{signed.federation}\nsend {out} to every organisation with {pathlib.Path(ns.ca_dir) / pki.CA_CERT}; a "
          f"client checks it against that CA certificate")
    return 0


def _show(ns) -> int:
    shown = pki.show(pathlib.Path(ns.file), pathlib.Path(ns.ca_cert) if ns.ca_cert else None)
    print("\n".join(shown.lines))
    if shown.warning:
        print(f"warning: {shown.warning}", file=sys.stderr)
    return 0 if shown.ok else 1
