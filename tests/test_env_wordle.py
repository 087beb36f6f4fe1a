"""Wordle: standard scoring, AgentGym's text, invalid guesses, splits, and the expert."""

from __future__ import annotations

import pytest

from services.env_server.envs.base import UnknownTask
from services.env_server.envs.wordle import (
    MAX_GUESSES,
    NUM_TEST,
    NUM_TRAIN,
    START_OBSERVATION,
    WordleEnv,
    format_feedback,
    parse_guess,
    score,
    spell,
    vocabulary,
)
from services.env_server.sessions import Outcome, SessionManager


@pytest.fixture(scope="module")
def env() -> WordleEnv:
    return WordleEnv(seed=0)


@pytest.mark.parametrize("guess,target,expected", [
    ("crane", "crane", "ggggg"),
    ("crane", "moist", "bbbbb"),
    ("crane", "react", "yygby"),
    # One "e" in the target: the first "e" of the guess is yellow, the second black.
    ("speed", "abide", "bbyby"),
    # Greens are matched first: the "e"s of "these" at 2 and 4 leave none for position 1.
    ("geese", "these", "bbggg"),
    # Two "l"s in the target, both elsewhere: both yellow.
    ("llama", "hello", "yybbb"),
    # The green "e" at 4 uses one "e"; the target's other "e" makes the first guessed "e" yellow.
    ("eerie", "there", "ybybg"),
    ("array", "ready", "yybbg"),
    ("abbey", "babes", "yyggb"),
])
def test_feedback_is_scored_letter_by_letter(guess, target, expected):
    assert score(guess, target) == expected


def test_action_and_observation_text_follow_agentgym():
    assert spell("shire") == "s h i r e"
    assert format_feedback("byggb") == "b y g g b"
    assert parse_guess("s h i r e") == parse_guess("shire") == parse_guess(" S H I R E ") == "shire"


def test_vocabulary_is_the_most_frequent_five_letter_words():
    vocab = vocabulary(100)
    assert len(vocab) == len(set(vocab)) == 100
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in vocab)
    assert vocab[0] == "about"  # the most frequent 5-letter English word in wordfreq
    assert vocabulary(200)[:100] == vocab
    with pytest.raises(ValueError, match="vocabulary size"):
        vocabulary(25)


def test_splits_have_the_papers_counts_and_held_out_targets(env):
    test, train = env.tasks("test"), env.tasks("train")
    assert (len(train), len(test)) == (NUM_TRAIN, NUM_TEST) == (955, 25)
    assert not set(test) & set(train)
    test_targets = {env.target(t) for t in test}
    train_targets = {env.target(t) for t in train}
    assert len(test_targets) == 25
    assert not test_targets & train_targets
    # All 75 remaining words are training targets.
    assert test_targets | train_targets == set(env.vocab)
    with pytest.raises(UnknownTask):
        env.reset(NUM_TEST + NUM_TRAIN)


def test_tasks_are_deterministic_per_task_id_and_seed(env):
    again = WordleEnv(seed=0)
    ids = env.tasks("test") + env.tasks("train")
    assert [env.target(t) for t in ids] == [again.target(t) for t in ids]
    assert env.reset(7).target == env.reset(7).target
    assert [WordleEnv(seed=1).target(t) for t in ids] != [env.target(t) for t in ids]


def test_episode_text_and_a_win(env):
    episode = env.reset(0)
    target = env.target(0)
    assert episode.observation == START_OBSERVATION == "Let's start Wordle!"
    assert "s h i r e" in episode.instruction and spell(target) in episode.instruction
    assert episode.available_actions() == [spell(w) for w in env.vocab]
    other = next(w for w in env.vocab if w != target)
    result = episode.step(spell(other))
    assert result.observation == format_feedback(score(other, target))
    assert (result.reward, result.done, result.success, result.valid) == (0.0, False, False, True)
    # Every vocabulary word stays guessable; narrowing them down is the agent's job.
    assert episode.available_actions() == [spell(w) for w in env.vocab]
    result = episode.step(spell(target))
    assert (result.observation, result.reward, result.done, result.success) == ("g g g g g", 1.0, True, True)


def test_invalid_guesses_say_so_and_do_not_count_as_guesses(env):
    episode = env.reset(0)
    target = env.target(0)
    wrong = [w for w in env.vocab if w != target][:MAX_GUESSES]
    not_a_word = episode.step("x y z z y")
    assert not not_a_word.valid and not not_a_word.done
    assert not_a_word.observation.startswith("invalid word: 'x y z z y' is not in the vocabulary")
    too_short = episode.step("cat")
    assert not too_short.valid and too_short.observation.startswith("invalid word: 'cat' is not a 5 letter word")
    for i, word in enumerate(wrong):
        result = episode.step(word)  # unspaced words are accepted too
        assert result.valid and result.done == (i == MAX_GUESSES - 1)
    assert not result.success and result.reward == 0.0


def test_invalid_guesses_use_turns_of_the_session():
    manager = SessionManager({"wordle": WordleEnv()})
    session = manager.reset("wordle", 0).session_id
    for _ in range(8):
        step = manager.step(session, "qqqqq")
    assert (step.turn, step.done, step.success, step.outcome) == (8, True, False, Outcome.TRUNCATED)


def _expert_guesses(env: WordleEnv, task: int) -> int:
    episode = env.reset(task)
    for guess in range(1, MAX_GUESSES + 1):
        result = episode.step(episode.expert_action())
        assert result.valid
        if result.done:
            assert result.success, f"task {task} ({env.target(task)}) failed"
            return guess
    raise AssertionError("the episode did not end after 6 guesses")


def test_expert_solves_every_test_task_within_six_guesses(env):
    assert all(_expert_guesses(env, t) <= MAX_GUESSES for t in env.tasks("test"))


def test_expert_guesses_are_consistent_with_the_feedback_before_the_endgame(env):
    episode = env.reset(3)
    while True:
        guess = parse_guess(episode.expert_action())
        assert guess in env.expert.candidates(episode.history)
        if episode.step(spell(guess)).done:
            break


@pytest.mark.parametrize("vocab_size", [26, 30, 50, 1000])
def test_expert_solves_every_test_task_at_other_vocabulary_sizes(vocab_size):
    env = WordleEnv(vocab_size=vocab_size)
    assert all(_expert_guesses(env, t) <= MAX_GUESSES for t in env.tasks("test"))


def test_expert_escapes_a_hard_mode_trap():
    # "_ i n d s" has many completions at 5000 words; hard mode alone loses this one.
    env = WordleEnv(vocab_size=5000)
    task = next(t for t in env.tasks("test") if env.target(t) == "hinds")
    assert _expert_guesses(env, task) <= MAX_GUESSES
