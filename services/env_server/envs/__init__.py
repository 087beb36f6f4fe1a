"""The built-in environments; registry.py finds these, installed plugins and bridged servers by name
(registry.make_environment builds one)."""

# The built-in environments' names (registry.BUILTIN_NAMES).
KNOWN_ENVS = ("maze", "wordle", "babyai", "textcraft", "webshop")
