"""The `fedse` command."""

from __future__ import annotations

import sys

from fedse.config import ConfigError, parse


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fedse run [options]            run a whole federation locally (fedse run --help)\n"
              "       fedse tasks [--env-server ADDR]  task counts per environment and split, from ListTasks")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from fedse.launcher import RunConfig, run

        try:
            cfg = parse(RunConfig, rest)
        except ConfigError as exc:
            print(f"configuration error: {exc}", file=sys.stderr)
            return 2
        try:
            results = run(cfg)
        except KeyboardInterrupt:
            print("\ninterrupted: all processes stopped", file=sys.stderr)
            return 130
        except (RuntimeError, TimeoutError) as exc:
            print(f"run failed: {exc}", file=sys.stderr)
            return 1
        return 0 if results["mean_test_success"] else 1
    if command == "tasks":
        return tasks(rest)
    print(f"unknown command {command!r}; try: fedse run, fedse tasks", file=sys.stderr)
    return 2


def tasks(argv: list[str]) -> int:
    """Prints, via ListTasks, the task counts of every environment of an env server (by default
    one started here on a free loopback port, hosting every built-in environment)."""
    import argparse

    from fedse.serving import insecure_channel
    from fedse.v1 import env_pb2 as epb
    from fedse.v1 import env_pb2_grpc as epb_grpc

    parser = argparse.ArgumentParser(prog="fedse tasks", description=tasks.__doc__)
    parser.add_argument("--env-server", default="", help="address of a running env server")
    ns = parser.parse_args(argv)
    server = None
    target = ns.env_server
    if not target:
        from services.env_server.envs import KNOWN_ENVS
        from services.env_server.server import EnvServerConfig, create_server

        server, port = create_server(EnvServerConfig(address="127.0.0.1:0", envs=",".join(KNOWN_ENVS),
                                                     metrics_port=-1))
        server.start()
        target = f"127.0.0.1:{port}"
    try:
        with insecure_channel(target) as channel:
            stub = epb_grpc.EnvServiceStub(channel)
            print(f"{'env':<10} {'train':>6} {'test':>6} {'max turns':>9}")
            for env in stub.ListEnvironments(epb.ListEnvironmentsRequest(), timeout=30, wait_for_ready=True).envs:
                train = stub.ListTasks(epb.ListTasksRequest(env=env, split="train"), timeout=30)
                test = stub.ListTasks(epb.ListTasksRequest(env=env, split="test"), timeout=30)
                print(f"{env:<10} {len(train.task_ids):>6} {len(test.task_ids):>6} {train.max_turns:>9}")
    finally:
        if server is not None:
            server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
