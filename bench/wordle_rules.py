"""How far does what the tiny model's window shows go in Wordle? Simple rules, no model.

The tiny model's 160-byte window holds the last guess and its feedback ("Action: l a t e r\\n
Observation: b y g b b\\n"). Each rule here reads only that, opens with the expert's first guess
and then guesses at random among the vocabulary words the rule allows (any word where none is),
never repeating a guess. It plays the 25 held-out words `--games` times each and prints the share
won within Wordle's 6 guesses. "consistent with every feedback" reads the whole game instead: the
information the expert has.

    .venv/bin/python bench/wordle_rules.py [--games 20] [--seed 1]

Each game's random choices come from its own generator, seeded from --seed, the game's number and
the word's; --seed 0 is not the default because WordleEnv(seed=0) draws the held-out words from
random.Random(0).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.env_server.envs.wordle import (  # noqa: E402
    BLACK, GREEN, MAX_GUESSES, YELLOW, WordleEnv, consistent, score)

Rule = Callable[[str, str, str], bool]  # (word, last guess, its feedback) -> allowed


def greens(word: str, guess: str, feedback: str) -> bool:
    return all(word[i] == c for i, (c, f) in enumerate(zip(guess, feedback)) if f == GREEN)


def yellows(word: str, guess: str, feedback: str) -> bool:
    return all(c in word and word[i] != c for i, (c, f) in enumerate(zip(guess, feedback)) if f == YELLOW)


def blacks(word: str, guess: str, feedback: str) -> bool:
    """No letter the feedback marks absent (a letter also marked green or yellow is present)."""
    present = {c for c, f in zip(guess, feedback) if f != BLACK}
    return all(c not in word for c, f in zip(guess, feedback) if f == BLACK and c not in present)


def both(*rules: Rule) -> Rule:
    return lambda word, guess, feedback: all(r(word, guess, feedback) for r in rules)


RULES: dict[str, Rule | None] = {
    "any word": lambda *_: True,
    "keep greens": greens,
    "keep yellows": yellows,
    "drop blacks": blacks,
    "greens and blacks": both(greens, blacks),
    "consistent with the last feedback": lambda word, guess, feedback: consistent(word, [(guess, feedback)]),
    "consistent with every feedback": None,
}


def play(env: WordleEnv, target: str, rule: Rule | None, rng: random.Random) -> bool:
    history: list[tuple[str, str]] = []
    for turn in range(MAX_GUESSES):
        if turn == 0:
            guess = env.expert.guess([])
        else:
            fresh = [w for w in env.vocab if w not in {g for g, _ in history}]
            last = history[-1]
            allowed = [w for w in fresh if (consistent(w, history) if rule is None else rule(w, *last))]
            guess = rng.choice(allowed or fresh)
        feedback = score(guess, target)
        if guess == target:
            return True
        history.append((guess, feedback))
    return False


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--games", type=int, default=20, help="games per held-out word and rule")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    env = WordleEnv()
    targets = [env.target(t) for t in env.tasks("test")]
    print(f"{len(targets)} held-out words, {len(env.vocab)}-word vocabulary, opening {env.expert.guess([])!r}, "
          f"{a.games} games each")
    for name, rule in RULES.items():
        won = sum(play(env, t, rule, random.Random(a.seed * 1_000_003 + g * 101 + i))
                  for i, t in enumerate(targets) for g in range(a.games))
        print(f"{name:>36}: {won / (a.games * len(targets)):6.1%}", flush=True)


if __name__ == "__main__":
    main()
