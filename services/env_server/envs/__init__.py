"""The environments an env server can host, by name."""

from __future__ import annotations

from .babyai import BabyAIEnv
from .base import Environment
from .maze import MazeEnv
from .textcraft import TextCraftEnv
from .webshop import WebShopEnv
from .wordle import DEFAULT_VOCAB_SIZE, WordleEnv

KNOWN_ENVS = ("maze", "wordle", "babyai", "textcraft", "webshop")


def make_environment(name: str, *, seed: int = 0, wordle_vocab_size: int = DEFAULT_VOCAB_SIZE) -> Environment:
    """Builds one environment; raises ValueError for a name not in KNOWN_ENVS."""
    if name == "maze":
        return MazeEnv(seed=seed)
    if name == "wordle":
        return WordleEnv(seed=seed, vocab_size=wordle_vocab_size)
    if name == "babyai":
        return BabyAIEnv(seed=seed)
    if name == "textcraft":
        return TextCraftEnv(seed=seed)
    if name == "webshop":
        return WebShopEnv(seed=seed)
    raise ValueError(f"unknown environment {name!r}: known environments are {', '.join(KNOWN_ENVS)}")
