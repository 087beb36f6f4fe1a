"""Prompt formats: the chat template's prompts, windows and targets, and training sequences that hold
exactly the tokens the agent saw when it acted."""

import pytest

from fedse.model.tinymodel import build_tiny_model, build_tiny_tokenizer
from services.client_agent.playing.prompts import (
    REACT_FORMAT,
    REACT_HINT,
    REACT_SYSTEM_PROMPT,
    ChatFormat,
    Encoded,
    TINY_MAX_PROMPT_TOKENS,
    PlainFormat,
    TokenCache,
    encode_trajectory,
    format_prompt,
    format_target,
    make_format,
)
from services.env_server.registry import make_environment

# ChatML, as SmolLM2 and Qwen2.5 write it.
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TURNS = [("You are at 1, 1.", "move right"), ("You are at 1, 2.", "move down"), ("You are at 2, 2.", "move down")]


def _chat(max_prompt_tokens=4096, max_history=-1):
    tok = build_tiny_tokenizer()  # byte-level: a token per byte, so lengths are easy to reason about
    tok.chat_template = CHATML
    return ChatFormat(tok, max_prompt_tokens, max_history), TokenCache(tok)


def test_chat_prompts_follow_the_template_and_end_at_the_assistant_header():
    fmt, _ = _chat()
    assert fmt.end_of_turn == "<|im_end|>"
    assert fmt.target("move up") == "Action: move up<|im_end|>"
    p = fmt.prompt("Reach the goal.", TURNS[:2], "You are at 2, 2.")
    assert p.startswith("<|im_start|>system\n" + fmt.system + "<|im_end|>\n")
    assert "<|im_start|>user\nReach the goal.\n\nObservation: You are at 1, 1.<|im_end|>\n" in p
    assert "<|im_start|>assistant\nAction: move right<|im_end|>\n<|im_start|>user\nObservation: You are at 1, 2." in p
    assert p.endswith("<|im_start|>user\nObservation: You are at 2, 2.<|im_end|>\n<|im_start|>assistant\n")
    # The next turn's prompt extends this one by the agent's text: the KV cache carries over.
    nxt = fmt.prompt("Reach the goal.", TURNS[:3], "You are at 3, 2.")
    assert nxt.startswith(p + fmt.target("move down"))


def test_the_chat_window_restarts_at_the_current_turn_when_the_episode_no_longer_fits():
    fmt, tokenize = _chat()
    one = len(tokenize(fmt.prompt("Reach the goal.", [], "You are at 1, 1.")))
    two = len(tokenize(fmt.prompt("Reach the goal.", TURNS[:1], "You are at 1, 2.")))
    fmt, tokenize = _chat(max_prompt_tokens=two + 64 + 10)  # room for two turns, not three (64: the answer)
    assert fmt.window_start("Reach the goal.", TURNS[:1], "You are at 1, 2.") == 0
    assert fmt.window_start("Reach the goal.", TURNS[:2], "You are at 2, 2.") == 2
    assert fmt.window_start("Reach the goal.", TURNS[:3], "You are at 3, 2.") == 2  # the new window goes on
    restarted = fmt.prompt("Reach the goal.", TURNS[:2], "You are at 2, 2.")
    assert "Reach the goal.\n\nObservation: You are at 2, 2." in restarted and "1, 1" not in restarted
    assert len(tokenize(restarted)) == one
    # A fixed history (max_history >= 0) shows the last k turns.
    fixed, _ = _chat(max_history=1)
    assert fixed.window_start("g", TURNS, "x") == 2 and fixed.window_start("g", [], "x") == 0


@pytest.mark.parametrize("limit", [4096, 420, 300])
def test_training_sequences_hold_what_the_agent_saw_at_every_turn(limit):
    """Each turn's prompt and target, as acting tokenizes and truncates them, appear in one training
    sequence with the loss on the target; turns of one window share a sequence."""
    fmt, tokenize = _chat(max_prompt_tokens=limit)
    seqs = encode_trajectory(fmt, tokenize, "Reach the goal.", TURNS, limit)
    assert sum(s.turns for s in seqs) == len(TURNS)
    spans = [(s, span) for s in seqs for span in s.spans]
    for i, (obs, action) in enumerate(TURNS):
        seq, (start, end) = spans[i]
        seen = tokenize.prompt(fmt.prompt("Reach the goal.", TURNS[:i], obs), limit)
        target = tokenize(fmt.target(action))
        assert list(seq.ids[:start])[-len(seen):] == seen and list(seq.ids[start:end]) == target
    if limit == 4096:
        assert len(seqs) == 1  # the whole episode in one window: one sequence
    else:
        assert len(seqs) > 1


def test_plain_format_keeps_one_sequence_per_turn():
    tok = build_tiny_tokenizer()
    tokenize = TokenCache(tok)
    fmt = PlainFormat(max_history=1)
    assert fmt.prompt("Do it.", TURNS[:1], "obs") == format_prompt("Do it.", TURNS[:1], "obs", 1)
    assert fmt.target("move up") == format_target("move up")
    seqs = encode_trajectory(fmt, tokenize, "Do it.", TURNS, 160)
    assert [s.turns for s in seqs] == [1, 1, 1]
    assert all(isinstance(s, Encoded) and s.targets == len(tokenize(format_target(a))) for s, (_, a) in zip(seqs, TURNS))


def test_the_tiny_window_shows_the_start_of_an_observation_too_long_for_it():
    model, tok = build_tiny_model(0)
    fmt = make_format(model, tok)
    assert isinstance(fmt, PlainFormat) and fmt.window == TINY_MAX_PROMPT_TOKENS
    # A maze turn fits: the usual prompt, whose end the model sees (previous observation's end,
    # previous action, current observation).
    maze = make_environment("maze").reset(0)
    turns = [(maze.observation, "move right")]
    assert fmt.prompt(maze.instruction, turns, "You are at 1, 2.") == \
        format_prompt(maze.instruction, turns, "You are at 1, 2.", 1)
    # BabyAI's first observation is far longer than the window and starts with the goal: the prompt
    # is the observation's start, which the left truncation of scoring and training then keeps whole.
    ep = make_environment("babyai").reset(0)
    assert len(ep.observation) > 2 * TINY_MAX_PROMPT_TOKENS
    first = fmt.prompt(ep.instruction, [], ep.observation)
    assert first.startswith("Observation: Your goal: go to the red ball\nIn front of you")
    assert first.endswith("\n") and len(first.encode()) <= TINY_MAX_PROMPT_TOKENS
    assert TokenCache(tok).prompt(first, TINY_MAX_PROMPT_TOKENS) == TokenCache(tok)(first)
    # Later turns keep the previous action before the observation's start.
    later = fmt.prompt(ep.instruction, [(ep.observation, "turn left")], ep.observation)
    assert later.startswith("Action: turn left\nObservation: Your goal:")
    assert len(later.encode()) <= TINY_MAX_PROMPT_TOKENS
    # A cut never splits a character: the prompt is still valid UTF-8 of at most the window's bytes.
    wide = fmt.prompt("Do it.", [], "é" * 200)
    assert wide.startswith("Observation: é") and len(wide.encode()) <= TINY_MAX_PROMPT_TOKENS and "\ufffd" not in wide


# ---- turns the agent wrote (a demonstration file's thoughts, environments without listed actions) ----------
WRITTEN = ["Thought:\nRight first.\n\nAction:\nmove right", "Thought:\nNow down.\n\nAction:\nmove down",
           "Thought:\nDown again.\n\nAction:\nmove down"]


def test_the_react_chat_format_says_how_to_answer_and_shows_what_was_written():
    fmt, _ = _chat()
    react = fmt.as_react()
    assert react.system == REACT_SYSTEM_PROMPT
    # The format in words, no template: SmolLM2 learnt to copy a template's placeholders.
    assert REACT_FORMAT in react.system and "<" not in react.system
    assert react.end_of_turn == fmt.end_of_turn
    # The prompt ends with the answer's opening, "Thought:"; the agent writes the rest.
    assert react.target("move up", WRITTEN[0]) == WRITTEN[0].removeprefix("Thought:") + "<|im_end|>"
    assert react.target("move up") == " Action: move up<|im_end|>"  # no text: the action, after the opening
    assert fmt.target("move up") == "Action: move up<|im_end|>" and fmt.opening == ""
    p = react.prompt("Reach the goal.", TURNS[:2], "You are at 2, 2.", WRITTEN[:2])
    assert p.endswith("<|im_start|>assistant\nThought:")
    assert "<|im_start|>assistant\n" + WRITTEN[0] + "<|im_end|>" in p and "Action: move right<|im_end|>" not in p
    # The next prompt extends this one by exactly the written text: one training sequence, reused caches.
    assert react.prompt("Reach the goal.", TURNS, "You are at 3, 2.", WRITTEN).startswith(
        p + react.target("move down", WRITTEN[2]))


@pytest.mark.parametrize("limit", [4096, 300])
def test_training_on_written_turns_covers_each_whole_text_as_the_agent_saw_it(limit):
    fmt, tokenize = _chat(max_prompt_tokens=limit)
    react = fmt.as_react()
    seqs = encode_trajectory(react, tokenize, "Reach the goal.", TURNS, limit, WRITTEN)
    spans = [(s, span) for s in seqs for span in s.spans]
    assert len(spans) == len(TURNS)
    for i, (obs, action) in enumerate(TURNS):
        seq, (start, end) = spans[i]
        seen = tokenize.prompt(react.prompt("Reach the goal.", TURNS[:i], obs, WRITTEN[:i]), limit)
        assert list(seq.ids[:start])[-len(seen):] == seen
        assert list(seq.ids[start:end]) == tokenize(WRITTEN[i].removeprefix("Thought:") + "<|im_end|>")
    assert (len(seqs) == 1) == (limit == 4096)
    # Turns without a text train on their action, as before.
    assert encode_trajectory(fmt, tokenize, "Reach the goal.", TURNS, limit) == \
        encode_trajectory(fmt, tokenize, "Reach the goal.", TURNS, limit, ("", "", ""))


def test_the_plain_react_format_adds_the_answer_format_and_trains_on_each_text():
    tokenize = TokenCache(build_tiny_tokenizer())
    react = PlainFormat(max_history=1).as_react()
    p = react.prompt("Do it.", TURNS[:1], "obs", WRITTEN[:1])
    assert p == ("Do it.\n" + REACT_HINT + "\nObservation: You are at 1, 1.\n" + WRITTEN[0] + "\nObservation: obs\n"
                 "Thought:")
    seqs = encode_trajectory(react, tokenize, "Do it.", TURNS, None, WRITTEN)
    assert [s.targets for s in seqs] == [len(tokenize(w.removeprefix("Thought:") + "\n")) for w in WRITTEN]
    # The tiny window keeps the current observation's start over a long earlier text.
    tiny = PlainFormat(1, TINY_MAX_PROMPT_TOKENS, react=True)
    cut = tiny.prompt("Do it.", TURNS[:1], "x" * 200, ["Thought:\n" + "y" * 120 + "\n\nAction:\nmove"])
    assert cut.startswith("Observation: xxx") and len(cut.encode()) <= TINY_MAX_PROMPT_TOKENS
