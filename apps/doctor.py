"""`fedse doctor`: checks, with a client's own settings, that it could join its federation, in the
order a join needs them, and stops at the first failure with one line saying what to fix. It is a
dry run: it joins nothing, uploads nothing and reports nothing.

    fedse doctor --client-id org-wordle --env wordle --aggregator HOST:PORT --env-server HOST:PORT \\
        --tls-ca ca.pem --tls-cert org-wordle.pem --tls-key org-wordle-key.pem [--base-model DIR]

The checks: the aggregator's address answers; TLS (or plain) as the server speaks; the server's
certificate; this client's own certificate (valid now, its key's, signed by the CA, its first name
the client id); the aggregator admits the client (and, with --require-secure-aggregation, its run is
secure: the client agent would refuse it otherwise); the env server answers and hosts every --env; the
base model loads, and its LoRA has the run's base model and adapter schema.
"""

from __future__ import annotations

import datetime
import pathlib
import sys
from typing import Callable

import grpc

from fedse.transport import reach
from fedse.config import ConfigError, parse
from fedse.security.admission import Security, channel
from services.client_agent.config import ClientConfig


# The client's settings doctor reads (it takes every client flag, so that the client's own command line
# or FEDSE_* variables work as they are; --help lists these).
SHOWN = ("client_id", "env", "env_server", "aggregator", "base_model", "device", "lora_r", "lora_alpha",
         "lora_dropout", "target_modules", "seed", "require_secure_aggregation", "env_server_plain", "tls_ca",
         "tls_cert", "tls_key", "token_file", "tls_server_name")


class Failed(Exception):
    """A check that failed; the text says what to fix."""


# The failures a check expects, whose message says what to fix: its own, a setting or file the client would
# refuse at start (ConfigError: a missing base model, an unreadable TLS file), a file it cannot read, a server
# that answers with an error.
EXPECTED = (Failed, reach.Unreachable, ConfigError, OSError, ValueError, grpc.RpcError)


def _fail(name: str, exc: BaseException) -> int:
    """Prints a failed check's one line (never a traceback: doctor is what an organisation runs first) and
    returns doctor's exit status for a failure, 1."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        reason = f"the server answered {exc.code().name}: {exc.details()}"
    elif isinstance(exc, EXPECTED):
        reason = str(exc) or type(exc).__name__
    else:  # a check that broke: still one line, with what to report
        reason = f"{type(exc).__name__}: {exc} (unexpected: please report it with this line)"
    print(f"FAIL {name}: {reason}")
    return 1


def doctor(argv: list[str]) -> int:
    """Runs the checks in order; 0 when all pass, 1 at the first failure (including settings the client would
    refuse at start, e.g. a --tls-cert or --secure-members file it cannot read), each as one line on stdout."""
    try:
        cfg = parse(ClientConfig, argv, prog="fedse doctor", shown=SHOWN,
                    description="Checks that this client could join its federation, in the order a join needs "
                                "it, and stops at the first failure with one line saying what to fix: a dry run "
                                "(it joins, uploads and reports nothing). It takes the client's own flags and "
                                "FEDSE_* variables; those it reads are listed here.")
        sec = Security.from_config(cfg)
        problem = reach.diagnose(cfg.aggregator, sec, "--aggregator")  # one probe answers the first four checks
    except Exception as exc:  # noqa: BLE001 - every failure is one line
        return _fail("this client's settings", exc)
    steps: list[tuple[str, Callable[[ClientConfig], str]]] = [
        ("the aggregator's address", lambda c: _connection(c, sec, problem, reach.ADDRESS)),
        ("TLS or plain, as the aggregator", lambda c: _connection(c, sec, problem, reach.TRANSPORT)),
        ("the aggregator's certificate", lambda c: _connection(c, sec, problem, reach.SERVER_CERTIFICATE)),
        ("this client's certificate", lambda c: own_certificate(c, problem)),
        ("the aggregator admits this client", admitted),
        ("the env server", env_server),
        ("the base model and its LoRA", base_model),
    ]
    for name, check in steps:
        try:
            detail = check(cfg)
        except Exception as exc:  # noqa: BLE001 - every failure is one line
            return _fail(name, exc)
        print(f"ok   {name}: {detail}")
    print(f"{cfg.client_id} can join the run at {cfg.aggregator}")
    return 0


_STEPS = [reach.ADDRESS, reach.TRANSPORT, reach.SERVER_CERTIFICATE, reach.CLIENT_CERTIFICATE]


def _failed_by(problem: reach.Unreachable | None, kind: str) -> None:
    """Raises the connection's problem if it lies at the step `kind` or before it."""
    if problem is not None and _STEPS.index(problem.kind) <= _STEPS.index(kind):
        raise problem


def _connection(cfg: ClientConfig, sec: Security, problem: reach.Unreachable | None, kind: str) -> str:
    """The connection to the aggregator up to the step `kind`, as reach.diagnose found it."""
    _failed_by(problem, kind)
    if kind == reach.ADDRESS:
        return f"{cfg.aggregator} answers"
    if kind == reach.TRANSPORT:
        return "TLS" + (" with a client certificate (mTLS)" if sec.tls_cert else "") if sec.tls.enabled else "plain"
    if not sec.tls.enabled:
        return "none (plain gRPC)"
    name = sec.tls_server_name or reach.split_target(cfg.aggregator)[0]  # type: ignore[index]
    return f"signed by {sec.tls_ca or 'the system CAs'}, names {name}, valid now"


def own_certificate(cfg: ClientConfig, problem: reach.Unreachable | None) -> str:
    """This client's certificate, checked here: its key's, valid now, signed by --tls-ca, first name the
    client id; then whether the aggregator took it in the handshake."""
    if not cfg.tls_cert:
        return "none (the aggregator does not ask for one unless it runs mTLS)"
    from cryptography import x509

    from fedse.security import certs

    files = Security.from_config(cfg).tls
    try:
        cert = files.check(files.read())  # parses, and the key is the certificate's
    except ConfigError as exc:
        raise Failed(str(exc)) from None
    assert cert is not None
    now = datetime.datetime.now(datetime.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise Failed(f"--tls-cert {cfg.tls_cert} is valid from {cert.not_valid_before_utc:%Y-%m-%d} to "
                     f"{cert.not_valid_after_utc:%Y-%m-%d}, not now: get a renewed one from the federation's operator")
    if cfg.tls_ca and not certs.signed_by(cert, x509.load_pem_x509_certificates(pathlib.Path(cfg.tls_ca).read_bytes())):
        raise Failed(f"--tls-cert {cfg.tls_cert} is not signed by --tls-ca {cfg.tls_ca}: have the federation's "
                     "operator sign it")
    first = certs.identity(cert)
    if first != cfg.client_id:
        raise Failed(f"--tls-cert {cfg.tls_cert} names {first!r} first, and --client-id is {cfg.client_id!r}: the "
                     "aggregator takes a client's id from its certificate; use the same id")
    _failed_by(problem, reach.CLIENT_CERTIFICATE)
    return f"{first}, valid until {cert.not_valid_after_utc:%Y-%m-%d}, taken by the aggregator"


def admitted(cfg: ClientConfig) -> str:
    """The aggregator admits this client, and its run is one this client would upload to."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fedse.v1 import federation_pb2 as fpb
    from fedse.v1 import federation_pb2_grpc as fpb_grpc
    from services.client_agent.federation.link import InsecureRun, refuse_insecure

    with channel(cfg.aggregator, Security.from_config(cfg)) as ch:
        try:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                raise Failed(f"--aggregator {cfg.aggregator} is not serving yet (health "
                             f"{health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}): try again shortly")
            stub = fpb_grpc.FederationServiceStub(ch)
            stub.GetRoundStatus(fpb.RoundStatusRequest(client_id=cfg.client_id), timeout=10)
            run = stub.GetRunStatus(fpb.RunStatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            raise Failed(_refusal(exc, cfg)) from None
    try:
        # The reason the client agent ends with, and what either side can do about it.
        refuse_insecure(cfg.require_secure_aggregation, run.config, cfg.signs_keys)
    except InsecureRun as exc:
        raise Failed(f"{str(exc).removesuffix('; nothing was uploaded')}: {_secure_fix(run.config)}") from None
    secure = ", secure aggregation" if run.config.secure_aggregation else ", no secure aggregation"
    secure += " with signed keys" if run.config.secure_signed else ""
    return f"run {run.config.run_id}, round {run.round.round} of {run.config.num_rounds}{secure}"


def _secure_fix(run) -> str:
    """What to do about a run this client refuses as not secure enough: the operator's flag, or this
    client's own setting."""
    if not run.secure_aggregation:
        return ("ask the federation's operator to start the aggregator with --secure-aggregation, or, to join a run "
                "whose aggregator sees your adapter, drop --require-secure-aggregation "
                '(FEDSE_REQUIRE_SECURE_AGGREGATION "false")')
    return ("ask the federation's operator to serve the aggregator over mTLS (--tls-ca, --tls-cert, --tls-key), "
            "which signs the keys, or drop this client's --tls-cert and --tls-key (keeping --tls-ca)")


def _refusal(exc: grpc.RpcError, cfg: ClientConfig) -> str:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return f"the aggregator refuses {cfg.client_id}: {details} (its operator lists who may join: --allowed-clients)"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"the aggregator wants the federation's token: {details} (--token-file)"
    return f"--aggregator {cfg.aggregator} answered {code.name}: {details}"


def env_server(cfg: ClientConfig) -> str:
    from services.client_agent.playing.envclient import EnvClient
    from fedse.v1 import env_pb2 as epb

    names = cfg.env_list()
    env = EnvClient(cfg.env_server, names[0], security=None if cfg.env_server_plain else cfg, retry_s=10)
    try:
        reach.wait_ready(env.channel, cfg.env_server, env.security, "--env-server", timeout_s=10)
        try:
            hosted = {e.name for e in env.stub.ListEnvironments(epb.ListEnvironmentsRequest(), timeout=10).environments}
        except grpc.RpcError as exc:
            raise Failed(f"--env-server {cfg.env_server} answered {exc.code().name}: {exc.details()}") from None
    finally:
        env.close_channel()
    missing = [n for n in names if n not in hosted]
    if missing:
        raise Failed(f"--env-server {cfg.env_server} hosts {', '.join(sorted(hosted))}, not {', '.join(missing)}: "
                     "check --env, or start the env server with it (--envs)")
    return f"{cfg.env_server} hosts {', '.join(names)}"


def base_model(cfg: ClientConfig) -> str:
    """Loads the base model with this client's LoRA settings and compares it with the run's: its base
    model, and the schema of the run's global adapter (once the first client joined)."""
    from fedse.model import adapter as ad
    from fedse.model import ranks
    from fedse.v1 import federation_pb2 as fpb
    from services.client_agent.model import loading as mdl
    from services.client_agent.federation.link import FederationClient

    base, _tokenizer = mdl.load_base(cfg.base_model, cfg.device or None, seed=cfg.seed)
    # --guardian --lora-r 0: the guardian chooses the rank at start; the modules are checked at rank 1 here
    # (at the run's own rank where the run takes one).
    peft = mdl.add_lora(base, r=cfg.lora_r or 1, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                        target_modules=cfg.lora_targets(), seed=cfg.seed)
    ours = ad.Schema.of(mdl.get_adapter_state(peft), mdl.adapter_config_json(peft))
    fed = FederationClient(cfg.aggregator, cfg.client_id, retries=1, timeout_s=60, security=cfg)
    try:
        run = fed.stub.GetRunStatus(fpb.RunStatusRequest(), timeout=10)
        if run.base_model and run.base_model != cfg.base_model:
            raise Failed(f"the run federates base model {run.base_model!r}, this client has --base-model "
                         f"{cfg.base_model!r}: use the run's (the same path on every client)")
        if not run.base_model:
            return f"{cfg.base_model} loads ({len(ours.tensors)} LoRA tensors); no client has joined yet"
        theirs = ad.decode_transport(fed.download(-1).data)
        top = run.config.max_lora_rank
        try:
            if top:  # mixed ranks: the run's adapter is at its maximum rank, ours at any rank up to it
                ranks.check_fits(ad.Schema.of(theirs, ours.adapter_config_json), ours, top)
            else:
                if not cfg.lora_r:  # the guardian will take the run's rank
                    ours = ranks.at_rank(ours, ranks.rank_or_zero(ad.Schema.of(theirs, "")) or 1, cfg.lora_alpha)
                ad.check_tensors(ours, {n: ad.TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                        for n, t in theirs.items()}, dtypes=False, expected_by="this client's LoRA")
        except ad.AdapterError as exc:
            raise Failed(f"this client's LoRA does not fit the run's adapter: {exc} (check --lora-r and "
                         "--target-modules against the other clients')") from None
    finally:
        fed.close()
    return f"{cfg.base_model} loads; its LoRA ({len(ours.tensors)} tensors) fits the run's adapter"


def main(argv: list[str] | None = None) -> int:
    return doctor(list(sys.argv[1:] if argv is None else argv))
