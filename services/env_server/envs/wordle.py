"""Wordle as AgentGym serves it (LMRL-Gym's game, AgentGym's text), with standard Wordle scoring.

A hidden 5-letter word, 6 guesses, 8 turns (an invalid guess uses a turn but not a guess).
Text follows AgentGym: a guess is written as its letters separated by spaces ("s h i r e"; "shire"
is accepted too), the reset observation is "Let's start Wordle!", each valid guess is answered with
one feedback letter per guessed letter, space separated ("b y g g b": b = not in the word, y = in
the word elsewhere, g = right place), and an invalid guess with an "invalid word" observation.
Reward 1 and success when the guess is the hidden word.

Unlike LMRL-Gym (whose adversary picks the hidden word as the game goes), the hidden word is fixed
per task, and repeated letters are scored by the standard rules: greens first, then yellows from
left to right while unmatched copies of the letter remain in the hidden word, the rest "b".

Vocabulary: the `vocab_size` most frequent 5-letter lowercase ASCII words of wordfreq's English
list. Every vocabulary word is a guess at every step (the admissible actions); working out which
words are still consistent with the feedback is the agent's job. Only the expert uses that set.
"""

from __future__ import annotations

import collections
import functools
import random
from typing import Sequence


from .base import Environment, Episode, NumberedTasks, StepResult, shuffled_cycle

WORD_LENGTH = 5
MAX_GUESSES = 6
NUM_TRAIN, NUM_TEST = 955, 25
DEFAULT_VOCAB_SIZE = 100
# The 25 held-out test targets and at least one training target. Small vocabularies (tests,
# smoke runs) leave few distinct training targets: the default leaves 75.
MIN_VOCAB_SIZE = NUM_TEST + 1
MAX_VOCAB_SIZE = 5000

GREEN, YELLOW, BLACK = "g", "y", "b"
WIN = GREEN * WORD_LENGTH
START_OBSERVATION = "Let's start Wordle!"

# Work limit (feedback evaluations) for one expert decision; keeps large vocabularies fast.
EXPERT_BUDGET = 250_000


@functools.lru_cache(maxsize=8)
def vocabulary(size: int = DEFAULT_VOCAB_SIZE) -> tuple[str, ...]:
    """The `size` most frequent 5-letter lowercase ASCII alphabetic English words, most frequent first."""
    if not MIN_VOCAB_SIZE <= size <= MAX_VOCAB_SIZE:
        raise ValueError(f"wordle vocabulary size must be in {MIN_VOCAB_SIZE}..{MAX_VOCAB_SIZE}, got {size}")
    n = 20 * size
    while True:
        import wordfreq  # here: an env server without Wordle does not need the word lists

        ranked = wordfreq.top_n_list("en", n)
        words = [w for w in ranked if len(w) == WORD_LENGTH and w.isascii() and w.isalpha() and w.islower()]
        if len(words) >= size:
            return tuple(words[:size])
        if len(ranked) < n:  # the whole list is exhausted
            raise ValueError(f"wordfreq has only {len(words)} usable 5-letter words, fewer than {size}")
        n *= 4


def score(guess: str, target: str) -> str:
    """Standard Wordle feedback for a guess, one letter of "g", "y", "b" per position.

    Greens first; then, left to right, a letter is yellow while the hidden word still has an
    unmatched copy of it, and black otherwise.
    """
    if len(guess) != len(target):
        raise ValueError(f"guess {guess!r} and target {target!r} differ in length")
    result = [BLACK] * len(guess)
    unmatched: collections.Counter[str] = collections.Counter()
    for i, (g, t) in enumerate(zip(guess, target)):
        if g == t:
            result[i] = GREEN
        else:
            unmatched[t] += 1
    for i, g in enumerate(guess):
        if result[i] != GREEN and unmatched[g] > 0:
            result[i] = YELLOW
            unmatched[g] -= 1
    return "".join(result)


def spell(word: str) -> str:
    """A word as an action string: its letters separated by spaces ("shire" -> "s h i r e")."""
    return " ".join(word)


def format_feedback(feedback: str) -> str:
    """Feedback as an observation: "gybbg" -> "g y b b g"."""
    return " ".join(feedback)


def parse_guess(action: str) -> str:
    """The word an action string spells: "s h i r e", "shire" and "S H I R E" all give "shire"."""
    text = action.strip().lower()
    parts = text.split()
    if len(parts) > 1 and all(len(p) == 1 for p in parts):
        return "".join(parts)
    return text


def consistent(word: str, history: Sequence[tuple[str, str]]) -> bool:
    """Whether word could be the hidden word given (guess, feedback) pairs."""
    return all(score(guess, word) == feedback for guess, feedback in history)


class WordleExpert:
    """Guesses the word that best splits the words still consistent with the feedback.

    The candidates are the vocabulary words consistent with all feedback so far. A guess is scored
    by how it partitions the candidates by feedback: the least sum of squared group sizes (the
    expected number of candidates left) wins, the all-green group not counted, ties going to the
    more frequent word. Normally every guess is itself a candidate ("hard mode"), so each expert
    guess can be explained from the feedback alone. When few guesses remain and more candidates than
    guesses (a trap like "_ i n d s"), any vocabulary word may be guessed to tell the candidates
    apart. Deterministic; the opening guess is computed once per vocabulary.
    """

    # Guesses left (this one included) at or below which the expert leaves hard mode if needed.
    ENDGAME_GUESSES = 3

    def __init__(self, vocab: Sequence[str]):
        self.vocab = tuple(vocab)
        self._opening: str | None = None

    def candidates(self, history: Sequence[tuple[str, str]]) -> list[str]:
        return [w for w in self.vocab if consistent(w, history)]

    def guess(self, history: Sequence[tuple[str, str]]) -> str:
        if not history:
            if self._opening is None:
                self._opening = self._best_split(list(self.vocab), list(self.vocab))
            return self._opening
        candidates = self.candidates(history)
        if not candidates:
            raise ValueError("no vocabulary word is consistent with the feedback")
        if len(candidates) <= 2:
            return candidates[0]
        guesses_left = MAX_GUESSES - len(history)
        if guesses_left <= self.ENDGAME_GUESSES and len(candidates) > guesses_left:
            return self._best_split(candidates, candidates + [w for w in self.vocab if w not in set(candidates)])
        return self._best_split(candidates, candidates)

    @staticmethod
    def _best_split(candidates: list[str], pool: list[str]) -> str:
        """The word of pool (in order, within the work budget) that best partitions candidates."""
        pool = pool[: max(1, EXPERT_BUDGET // len(candidates))]
        best, best_cost = pool[0], None
        for guess in pool:
            groups = collections.Counter(score(guess, target) for target in candidates)
            groups.pop(WIN, None)  # guessing the word itself leaves nothing
            cost = sum(n * n for n in groups.values())
            if best_cost is None or cost < best_cost:
                best, best_cost = guess, cost
        return best


def instruction(vocab: Sequence[str]) -> str:
    words = "\n".join(spell(w) for w in vocab)
    return (
        f"Let's play Wordle. A {WORD_LENGTH} letter word is hidden; find it in at most {MAX_GUESSES} "
        "guesses, the fewer the better. Write each guess as its letters separated by spaces, for example "
        "\"s h i r e\". The game answers every guess with one letter per guessed letter, separated by "
        "spaces, for example \"b y g g b\":\n"
        "\"g\" means the letter is in the hidden word at this position;\n"
        "\"y\" means the letter is in the hidden word but at another position;\n"
        "\"b\" means the letter is not in the hidden word (or the hidden word has no more copies of it "
        "than are already marked).\n"
        "A guess that is not a 5 letter word from the vocabulary is answered \"invalid word\"; it is not "
        "counted as a guess but uses one of the 8 turns of the game. Use all the feedback so far to work "
        "out which words are still possible and guess accordingly.\n"
        "The vocabulary (every word the game accepts):\n"
        f"```\n{words}\n```"
    )


class WordleEpisode(Episode):
    def __init__(self, target: str, vocab_set: frozenset[str], actions: list[str], instruction_text: str,
                 expert: WordleExpert):
        self.target = target
        self.instruction = instruction_text
        self.observation = START_OBSERVATION
        # (guess, feedback) of each valid guess so far.
        self.history: list[tuple[str, str]] = []
        self._vocab_set = vocab_set
        self._actions = actions
        self._expert = expert
        self._finished = False

    def available_actions(self) -> list[str]:
        return [] if self._finished else list(self._actions)

    def step(self, action: str) -> StepResult:
        if self._finished:
            return StepResult(self.observation, 0.0, True, False, valid=False)
        word = parse_guess(action)
        if len(word) != WORD_LENGTH or not (word.isascii() and word.isalpha()):
            shown = action.strip()
            shown = shown if len(shown) <= 30 else shown[:27] + "..."
            return self._invalid(f"{shown!r} is not a {WORD_LENGTH} letter word")
        if word not in self._vocab_set:
            return self._invalid(f"{spell(word)!r} is not in the vocabulary")
        feedback = score(word, self.target)
        self.history.append((word, feedback))
        self.observation = format_feedback(feedback)
        if feedback == WIN:
            self._finished = True
            return StepResult(self.observation, 1.0, True, True)
        if len(self.history) >= MAX_GUESSES:
            self._finished = True
            return StepResult(self.observation, 0.0, True, False)
        return StepResult(self.observation, 0.0, False, False)

    def _invalid(self, reason: str) -> StepResult:
        self.observation = f"invalid word: {reason}. Guess a vocabulary word written like \"s h i r e\"."
        return StepResult(self.observation, 0.0, False, False, valid=False)

    def expert_action(self) -> str:
        return spell(self._expert.guess(self.history))


class WordleEnv(Environment):
    """Tasks 0..24 are the test split, 25..979 the training split.

    The 25 test targets are held out: no training task has one of them as its hidden word. Test
    targets are a seeded sample of the vocabulary; training tasks cycle through seeded shuffles of
    the remaining words, so every training word is a target about equally often.
    """

    name = "wordle"
    max_turns = 8
    has_expert = lists_actions = True

    def __init__(self, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE):
        self.vocab = vocabulary(vocab_size)
        self._vocab_set = frozenset(self.vocab)
        self._actions = [spell(w) for w in self.vocab]
        self._instruction = instruction(self.vocab)
        self.expert = WordleExpert(self.vocab)
        rng = random.Random(seed)
        test_words = rng.sample(self.vocab, NUM_TEST)
        held_out = set(test_words)
        train_words = shuffled_cycle([w for w in self.vocab if w not in held_out], rng)
        self._targets = NumberedTasks(self.name, test_words, [next(train_words) for _ in range(NUM_TRAIN)])

    def tasks(self, split: str) -> list[int]:
        return self._targets.ids(split)

    def target(self, task_id: int) -> str:
        return self._targets[task_id]

    def reset(self, task_id: int) -> WordleEpisode:
        return WordleEpisode(self.target(task_id), self._vocab_set, self._actions, self._instruction, self.expert)
