"""docs/cli.md, the command-line reference, written from the parsers themselves: each command's
--help as argparse prints it at 100 columns. `make cli-reference` rewrites the page; a test checks
that the page is what this module writes now."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import sys

# Each command, in the order `fedse --help` lists them; `fedse certs` has a page section per step.
COMMANDS = [[], ["aggregator"], ["env-server"], ["client"], ["client-host"], ["run"], ["experiment"], ["tasks"],
            ["status"], ["doctor"], ["model"], ["certs"],
            *[["certs", step] for step in ("init", "request", "sign", "issue", "members", "show")]]
WIDTH = "100"
HEADER = """# Command-line reference

Every `fedse` command and its flags, as `--help` prints them (written by `make cli-reference` from
the parsers; a test keeps this page current). Each service flag `--foo-bar` also reads the variable
`FEDSE_FOO_BAR`; [configuration.md](configuration.md) explains the settings used most.
"""


def help_text(argv: list[str]) -> str:
    """What `fedse ARGV --help` prints."""
    from apps.cli import main

    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*argv, "--help"])
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue().rstrip() + "\n"


def reference() -> str:
    parts = [HEADER]
    for argv in COMMANDS:
        parts.append(f"\n## {' '.join(['fedse', *argv])}\n\n```text\n{help_text(argv)}```\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    path = pathlib.Path(argv[0] if argv else "docs/cli.md")
    path.write_text(reference())
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
