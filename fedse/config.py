"""Service configuration: a frozen dataclass filled from flags, then environment variables, then defaults.

Every field `foo_bar` of a config class is the flag `--foo-bar` and the environment variable
`FEDSE_FOO_BAR`; a flag wins over the variable. A field's `metadata["help"]` documents it.
Validation lives in the dataclass's `__post_init__` and raises ConfigError with one clear line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any, Sequence, TypeVar

T = TypeVar("T")

# What a client agent ranks admissible actions by (--scoring; its policy.ActionScorer.score): "sum",
# an action's log-likelihood, or "calibrated", that less its log-likelihood after the content-free
# prompt under the same weights.
SCORINGS = ("sum", "calibrated")


class ConfigError(ValueError):
    """A missing or malformed setting; the message says which and what is expected."""


def field(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse's name
    return dataclasses.field(default=default, metadata={"help": help})


def env_name(field_name: str) -> str:
    return "FEDSE_" + field_name.upper()


def _convert(kind: type, raw: str, name: str) -> Any:
    if kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{name}: expected true or false, got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected {kind.__name__}, got {raw!r}") from None


def parse(cls: type[T], argv: Sequence[str] | None = None, description: str | None = None,
          environ: dict[str, str] | None = None) -> T:
    """Builds cls from argv and the environment; raises ConfigError on a bad value."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description or cls.__doc__)  # each help names its default
    for f in dataclasses.fields(cls):
        flag = {"nargs": "?", "const": "true"} if hints[f.name] is bool else {}  # a bare --flag means true
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None, type=str, **flag,
                            help=f"{f.metadata.get('help', '')} [env {env_name(f.name)}] (default: {f.default!r})")
    ns = parser.parse_args(list(argv) if argv is not None else None)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = getattr(ns, f.name)
        source = "--" + f.name.replace("_", "-")
        if raw is None and env_name(f.name) in environ:
            raw, source = environ[env_name(f.name)], env_name(f.name)
        if raw is not None:
            values[f.name] = _convert(hints[f.name], raw, source)
    return cls(**values)


def parse_or_exit(cls: type[T], argv: Sequence[str] | None = None) -> T:
    """For entry points only: a bad setting stops the process with one line on stderr."""
    try:
        return parse(cls, argv)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def to_argv(config: Any) -> list[str]:
    """The flags that rebuild a config (used by the launcher to start service processes)."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        argv += ["--" + f.name.replace("_", "-"), str(getattr(config, f.name))]
    return argv
