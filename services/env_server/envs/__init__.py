"""The built-in environments; registry.py finds these, installed plugins and bridged servers by name."""

from __future__ import annotations

from fedse.env import Environment

# The built-in environments' names (registry.BUILTIN_NAMES).
KNOWN_ENVS = ("maze", "wordle", "babyai", "textcraft", "webshop")


def make_environment(name: str, *, seed: int = 0, **options) -> Environment:
    """Builds one registered environment with its options (registry.RegistryError if it cannot)."""
    from ..registry import EnvSpec, build

    return build(EnvSpec(name, name, tuple((k, str(v)) for k, v in options.items())), seed)
