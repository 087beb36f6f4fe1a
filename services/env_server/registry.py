"""Every environment an env server can host, found by name: one registry, open to plugins.

An environment spec names what to host and how to build it:

    NAME                              a built-in (maze, wordle, babyai, textcraft, webshop) or an
                                      installed package's entry point in the group fedse.environments
    NAME=package.module:factory       an importable factory
    NAME=agentgym:PROFILE@URL         an AgentGym HTTP env server, bridged (envs/agentgym.py)
    NAME=OTHER                        a registered environment under another name
    ...?KEY=VALUE&KEY=VALUE           options for the factory, e.g. wordle?vocab_size=30

A factory is called with `seed` (where it takes one) and the options, each converted to the type its
parameter is annotated with (int, float, bool, str); an option it does not take is refused before
anything starts. Specs are comma-separated where several are given, so option values hold no commas.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import re
from typing import Any, Callable

from fedse.env import Environment

from .envs import KNOWN_ENVS as BUILTIN_NAMES

ENTRY_POINT_GROUP = "fedse.environments"
AGENTGYM = "agentgym"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
OPTION_KEY = re.compile(r"[A-Za-z_]\w*")
# How much of an import error or a failed factory's message a start-up error repeats.
MAX_ERROR_CHARS = 600
SPEC_FORMS = ("NAME", "NAME=package.module:factory", "NAME=agentgym:PROFILE@URL", "NAME=OTHER",
              "any of them ?KEY=VALUE&...")


class RegistryError(ValueError):
    """An environment spec that cannot be served; the message says what to fix, in one line."""


def _builtins() -> dict[str, Callable[..., Environment]]:
    from .envs.babyai import BabyAIEnv
    from .envs.maze import MazeEnv
    from .envs.textcraft import TextCraftEnv
    from .envs.webshop import WebShopEnv
    from .envs.wordle import WordleEnv

    return {"maze": MazeEnv, "wordle": WordleEnv, "babyai": BabyAIEnv, "textcraft": TextCraftEnv,
            "webshop": WebShopEnv}




def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The environments installed packages declare, by name (not loaded)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_names() -> list[str]:
    """Names a bare spec may use: the built-ins, then installed plugins."""
    return [*BUILTIN_NAMES, *sorted(set(entry_points()) - set(BUILTIN_NAMES))]


def _bounded(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """One parsed spec: the name served, where the factory comes from, and the options as given."""

    name: str
    source: str  # a registered name, "package.module:factory" or "agentgym:PROFILE@URL"
    options: tuple[tuple[str, str], ...] = ()
    text: str = ""

    @property
    def kind(self) -> str:
        """"agentgym", "factory" (module:factory) or "registered"."""
        if self.source.startswith(AGENTGYM + ":"):
            return AGENTGYM
        return "factory" if ":" in self.source else "registered"

    def option_dict(self) -> dict[str, str]:
        return dict(self.options)


def parse_spec(text: str) -> EnvSpec:
    """One spec (see the module docstring); RegistryError says what is malformed."""
    raw = text.strip()
    head, _, query = raw.partition("?")
    name, eq, source = head.partition("=")
    name, source = name.strip(), source.strip()
    if not NAME.fullmatch(name):
        raise RegistryError(f"environment spec {raw!r}: the name {name!r} must be 1-63 letters, digits, '.', "
                            f"'_' or '-', starting with a letter or digit (forms: {'; '.join(SPEC_FORMS)})")
    if eq and not source:
        raise RegistryError(f"environment spec {raw!r}: nothing after '='; give package.module:factory, "
                            f"agentgym:PROFILE@URL or a registered name")
    source = source or name
    if source.startswith(AGENTGYM + ":"):
        profile, at, url = source[len(AGENTGYM) + 1:].partition("@")
        if not profile or not at or not re.match(r"https?://[^/\s]+", url):
            raise RegistryError(f"environment spec {raw!r}: an AgentGym bridge is NAME=agentgym:PROFILE@URL, "
                                "e.g. textcraft-ag=agentgym:textcraft@http://127.0.0.1:36001")
    elif ":" in source and not FACTORY.fullmatch(source):
        raise RegistryError(f"environment spec {raw!r}: {source!r} is not package.module:factory")
    elif ":" not in source and not NAME.fullmatch(source):
        raise RegistryError(f"environment spec {raw!r}: {source!r} is not an environment name")
    options: list[tuple[str, str]] = []
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        if not eq or not OPTION_KEY.fullmatch(key.strip()):
            raise RegistryError(f"environment spec {raw!r}: option {part!r} is not KEY=VALUE")
        if key.strip() in dict(options):
            raise RegistryError(f"environment spec {raw!r}: option {key.strip()!r} is given twice")
        options.append((key.strip(), value.strip()))
    return EnvSpec(name, source, tuple(options), raw)


def parse_specs(text: str) -> list[EnvSpec]:
    """Comma-separated specs, each name once."""
    specs = [parse_spec(part) for part in text.split(",") if part.strip()]
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RegistryError(f"environments {', '.join(twice)} named twice in {text!r}; name each once "
                            "(NAME=OTHER serves one under another name)")
    return specs


def _import_factory(path: str, what: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 - any failure to import is reported, bounded
        raise RegistryError(_bounded(f"{what}: cannot import {path}: {type(exc).__name__}: {exc}")) from None
    if not callable(obj):
        raise RegistryError(f"{what}: {path} is a {type(obj).__name__}, not a callable that returns an Environment")
    return obj


def _registered(name: str, what: str, seen: tuple[str, ...] = ()) -> Callable[..., Any]:
    builtins = _builtins() if name in BUILTIN_NAMES else {}
    if name in builtins:
        return builtins[name]
    eps = entry_points()
    if name in eps:
        try:
            return eps[name].load()
        except Exception as exc:  # noqa: BLE001
            raise RegistryError(_bounded(f"{what}: the installed plugin {name} ({eps[name].value}) fails to import: "
                                         f"{type(exc).__name__}: {exc}")) from None
    raise RegistryError(f"{what}: unknown environment {name!r}; known are {', '.join(known_names())} "
                        f"(or NAME=package.module:factory, NAME=agentgym:PROFILE@URL)")


def factory_of(spec: EnvSpec) -> Callable[..., Any]:
    """The callable that builds the spec's environment (imported, not called)."""
    what = f"environment {spec.name}"
    if spec.kind == AGENTGYM:
        from .envs.agentgym import bridge

        profile, _, url = spec.source[len(AGENTGYM) + 1:].partition("@")
        return functools.partial(bridge, profile, url)
    if spec.kind == "factory":
        return _import_factory(spec.source, what)
    return _registered(spec.source, what)


_TYPES: dict[Any, Callable[[str], Any]] = {int: int, float: float, str: str, "int": int, "float": float,
                                           "str": str, "bool": bool, bool: bool}


def _convert(spec: EnvSpec, key: str, raw: str, annotation: Any) -> Any:
    kind = _TYPES.get(annotation, str)
    if kind is bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise RegistryError(f"environment {spec.name}: option {key}={raw!r} is not true or false")
    try:
        return kind(raw)
    except ValueError:
        raise RegistryError(f"environment {spec.name}: option {key}={raw!r} is not a{'n' if kind is int else ''} "
                            f"{kind.__name__}") from None


def call_arguments(spec: EnvSpec, factory: Callable[..., Any], seed: int) -> dict[str, Any]:
    """The keyword arguments the factory gets: seed where it takes one, and the options, typed.
    RegistryError for an option it does not take (listing those it does) or a value of the wrong type."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {n: p for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    kwargs: dict[str, Any] = {}
    if "seed" in named or takes_any:
        kwargs["seed"] = seed
    options = sorted(n for n in named if n != "seed")
    for key, raw in spec.options:
        if key == "seed":
            raise RegistryError(f"environment {spec.name}: the seed is the server's (--seed), not an option")
        if key not in named and not takes_any:
            raise RegistryError(f"environment {spec.name}: no option {key!r}; it takes "
                                f"{', '.join(options) or 'none'}")
        annotation = named[key].annotation if key in named else str
        kwargs[key] = _convert(spec, key, raw, annotation)
    return kwargs


def check(spec: EnvSpec, seed: int = 0) -> None:
    """Everything about a spec that can be known without building it: the factory imports and takes
    the options given, with values of the right types."""
    call_arguments(spec, factory_of(spec), seed)


def build(spec: EnvSpec, seed: int = 0) -> Environment:
    """The environment of a spec, served under spec.name; RegistryError (bounded) if it cannot be made."""
    factory = factory_of(spec)
    kwargs = call_arguments(spec, factory, seed)
    try:
        env = factory(**kwargs)
    except RegistryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a third party's failure, reported in one bounded line
        raise RegistryError(_bounded(f"environment {spec.name}: its factory failed: {type(exc).__name__}: {exc}")) \
            from None
    if not isinstance(env, Environment):
        raise RegistryError(f"environment {spec.name}: its factory returned a {type(env).__name__}, not a "
                            "fedse.env.Environment")
    env.name = spec.name
    return env


def make_environment(name: str, *, seed: int = 0, **options) -> Environment:
    """Builds one registered environment with its options (RegistryError if it cannot)."""
    return build(EnvSpec(name, name, tuple((k, str(v)) for k, v in options.items())), seed)
