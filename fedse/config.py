"""Service configuration: a frozen dataclass filled from flags, then environment variables, then defaults.

Every field `foo_bar` of a config class is the flag `--foo-bar` and the environment variable
`FEDSE_FOO_BAR`; a flag wins over the variable. A field's `metadata["help"]` documents it.
Validation lives in the dataclass's `__post_init__` and raises ConfigError with one clear line.

A field annotated `tuple[T, ...]` holds a list: its flag may be given several times (each adds one
item, in order), and its variable holds the items separated by `os.pathsep` (':' on Linux, as in
PATH), since such lists are lists of paths, unless the field says another separator (`sep`; " "
splits on whitespace, for lists of URIs). Flags given replace the variable's items, not add to them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any, Collection, Sequence, TypeVar

T = TypeVar("T")

# What a client agent ranks admissible actions by (--scoring; its policy.ActionScorer.score): "sum",
# an action's log-likelihood, or "calibrated", that less its log-likelihood after the content-free
# prompt under the same weights.
SCORINGS = ("sum", "calibrated")


def scoring_rules(spec: str, flag: str = "--scoring") -> dict[str, str]:
    """A scoring spec as {environment: rule}: one rule for all ("sum"), or ENV=RULE pairs separated by
    commas, with an optional bare rule for the environments not named ("sum,babyai=calibrated"); the
    key "" holds that rule ("sum" unless given). ConfigError naming `flag` for anything else."""
    rules = {"": "sum"}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        env, sep, rule = part.partition("=")
        if sep and not env.strip():
            raise ConfigError(f"{flag} {spec!r}: write one rule (sum or calibrated) or env=rule pairs "
                              f"separated by commas, e.g. babyai=calibrated,webshop=calibrated")
        rules[env.strip() if sep else ""] = (rule if sep else env).strip()
    for rule in rules.values():
        if rule not in SCORINGS:
            raise ConfigError(f"{flag} {spec!r}: {rule!r} is not a rule; use one of {', '.join(SCORINGS)}")
    return rules


class ConfigError(ValueError):
    """A missing or malformed setting; the message says which and what is expected."""


class Count(int):
    """A setting that counts things or takes all of them: a number, or `all` (ALL in code; it equals
    0 as a number, so `items[:n] if n else items` takes all). A field so typed refuses a bare 0,
    which readers take for "none": its __post_init__ calls refuse_zero()."""

    def __new__(cls, raw: Any = 0) -> "Count":
        if raw is ALL or isinstance(raw, str) and raw.strip().lower() == "all":
            return ALL
        return super().__new__(cls, raw)

    def __repr__(self) -> str:
        return "'all'" if self is ALL else int.__repr__(self)

    def __str__(self) -> str:
        return "all" if self is ALL else int.__repr__(self)

    def __reduce__(self) -> tuple[Any, ...]:  # a copy of ALL is ALL (dataclasses.asdict copies deeply)
        return Count, (str(self),)



ALL = int.__new__(Count, 0)


def plain(value: Any) -> Any:
    """`value` as JSON should hold it: ALL as "all" (JSON would write the 0 it equals, which reads as
    "none"), in dicts, lists and tuples too."""
    if value is ALL:
        return "all"
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def refuse_zero(value: int, flag: str, what: str) -> None:
    """A Count setting given as 0 (which reads as "none" but used to mean all) is refused, saying what
    to write instead."""
    if value == 0 and value is not ALL:
        raise ConfigError(f"{flag} 0 would mean no {what}: give how many, or 'all' for every one")


def field(default: Any, help: str, old: str = "", sep: str = "") -> Any:  # noqa: A002 - mirrors argparse's name
    """A setting: its flag is --NAME (the field's name, dashed) and its variable FEDSE_NAME. `old`: a
    field name the setting had before, still read (--old-name, FEDSE_OLD_NAME) for a release, with a
    warning on stderr saying the new name. `sep`: for a list, what separates the items in its variable
    (default os.pathsep; " " = whitespace)."""
    return dataclasses.field(default=default, metadata={"help": help, **({"old": old} if old else {}),
                                                        **({"sep": sep} if sep else {})})


def deprecated(old: str, new: str, variable: bool = False) -> None:
    """Says on stderr that a setting's old name goes in the next release, and its new one."""
    if variable:
        print(f"warning: {env_name(old)} is deprecated and goes in the next release: set {env_name(new)}",
              file=sys.stderr)
    else:
        print(f"warning: --{old.replace('_', '-')} is deprecated and goes in the next release: use "
              f"--{new.replace('_', '-')}", file=sys.stderr)


def env_name(field_name: str) -> str:
    return "FEDSE_" + field_name.upper()


def item_type(hint: Any) -> type | None:
    """T for a list-valued field annotated `tuple[T, ...]`, else None."""
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
    return None


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
        expected = "a number or 'all'" if kind is Count else kind.__name__
        raise ConfigError(f"{name}: expected {expected}, got {raw!r}") from None


def parse(cls: type[T], argv: Sequence[str] | None = None, description: str | None = None,
          environ: dict[str, str] | None = None, prog: str | None = None,
          shown: Collection[str] | None = None) -> T:
    """Builds cls from argv and the environment; raises ConfigError on a bad value. `prog` names the
    command in --help's usage line (default: the program's file name). `shown`: the fields --help
    lists (default: all); the others are still read, from flags and the environment alike."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=description or cls.__doc__)  # each help names its default
    for f in dataclasses.fields(cls):
        flag: dict[str, Any] = {"nargs": "?", "const": "true"} if hints[f.name] is bool else {}  # bare --flag: true
        env_help = f"env {env_name(f.name)}"
        if item_type(hints[f.name]) is not None:
            flag = {"action": "append"}
            sep = f.metadata.get("sep", os.pathsep)
            env_help += f", items separated by {'whitespace' if sep == ' ' else repr(sep)}; the flag may be repeated"
        listed = shown is None or f.name in shown
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None, type=str, **flag,
                            help=f"{f.metadata.get('help', '')} [{env_help}] (default: {f.default!r})" if listed
                            else argparse.SUPPRESS)
        if f.metadata.get("old"):
            parser.add_argument("--" + f.metadata["old"].replace("_", "-"), dest="old:" + f.name, default=None,
                                type=str, **flag, help=argparse.SUPPRESS)
    ns = parser.parse_args(list(argv) if argv is not None else None)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = getattr(ns, f.name)
        source = "--" + f.name.replace("_", "-")
        kind = item_type(hints[f.name])
        old = f.metadata.get("old", "")
        if raw is None and old and getattr(ns, "old:" + f.name) is not None:
            raw, source = getattr(ns, "old:" + f.name), "--" + old.replace("_", "-")
            deprecated(old, f.name)
        variable = next((name for name in (f.name, old) if name and env_name(name) in environ), None)
        if raw is None and variable is not None:
            raw, source = environ[env_name(variable)], env_name(variable)
            if variable != f.name:
                deprecated(old, f.name, variable=True)
            if kind is not None:  # one variable holds every item
                sep = f.metadata.get("sep", os.pathsep)
                raw = [part for part in (raw.split() if sep == " " else raw.split(sep)) if part.strip()]
        if raw is None:
            continue
        if kind is not None:
            values[f.name] = tuple(_convert(kind, item, source) for item in raw)
        else:
            values[f.name] = _convert(hints[f.name], raw, source)
    return cls(**values)


def parse_or_exit(cls: type[T], argv: Sequence[str] | None = None, prog: str | None = None,
                  description: str | None = None, shown: Collection[str] | None = None) -> T:
    """For entry points only: a bad setting stops the process with one line on stderr."""
    try:
        return parse(cls, argv, description=description, prog=prog, shown=shown)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def to_argv(config: Any) -> list[str]:
    """The flags that rebuild a config, every field given (the launcher starts service processes
    with them)."""
    return flags({f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def flags(settings: dict[str, Any]) -> list[str]:
    """The flags of settings named as their fields are: --foo-bar VALUE for foo_bar, and for a list
    (a tuple) the flag once per item."""
    argv: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        for item in value if isinstance(value, tuple) else (value,):
            argv += [flag, str(item)]
    return argv
