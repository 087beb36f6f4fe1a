"""The `fedse` command."""

from __future__ import annotations

import sys

from fedse.config import ConfigError, parse


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fedse run [options]   run a whole federation locally (fedse run --help)")
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
    print(f"unknown command {command!r}; try: fedse run", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
