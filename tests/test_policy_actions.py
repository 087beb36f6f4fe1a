"""The actions the agent writes: generation-mode parsing of generated text into an admissible action,
and the ReAct actions it writes where an environment lists none (parsed, or a fallback that is
counted), generation that stops after an action line and writes each token into room made once."""

import pytest
import torch

from fedse.model.tinymodel import build_tiny_tokenizer
from observe import returns
from policy_support import MAZE_ACTIONS, _maze_prompts, _model
from services.client_agent.playing.actions import Written, cut_after_action, parse_action
from services.client_agent.playing.generation import ActionLineDone, ActionWriter
from services.client_agent.playing.policy import ActionScorer
from services.client_agent.playing.prompts import (ACTION_CUE, EMPTY_TEXT_ACTION, MAX_CUED_THOUGHT_CHARS,
                                                   MAX_WRITTEN_ACTION_CHARS, PlainFormat, fallback_action, parse_react,
                                                   thought_before_cue)

torch.set_num_threads(1)


def test_parse_action_matches_generated_text_to_an_admissible_action():
    words = ["crane", "slate", "cranes"]
    assert parse_action("Thought: go up.\nAction: move up\n", MAZE_ACTIONS) == "move up"
    assert parse_action("Thought: hmm\nAction: \"Move Right\".", MAZE_ACTIONS) == "move right"
    assert parse_action("Action: I will move left now", MAZE_ACTIONS) == "move left"
    assert parse_action("Action: crane", words) == "crane"  # exact wins over a longer containing match
    assert parse_action("Action: guess cranes please", words) == "cranes"
    assert parse_action("Action: move rihgt", MAZE_ACTIONS) == "move right"  # close spelling
    assert parse_action("Action: jump", MAZE_ACTIONS) is None
    assert parse_action("", MAZE_ACTIONS) is None
    assert parse_action("move down", MAZE_ACTIONS) == "move down"  # no "Action:" at all


def test_generate_actions_returns_admissible_actions_with_a_fallback():
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160)
    prompts = _maze_prompts(3)
    cands = [MAZE_ACTIONS, ["move left", "move right"], MAZE_ACTIONS]
    writer = ActionWriter(scorer)
    texts = returns(writer, "generate_texts")
    actions = writer.generate_actions(prompts, cands, max_new_tokens=6)
    assert all(a in c for a, c in zip(actions, cands))
    # An untrained byte model does not write "Action: ..."; those rows fall back to greedy scoring.
    greedy = scorer.choose(prompts, cands, greedy=True)
    (generated,) = texts
    for i, text in enumerate(generated):
        if parse_action(text, cands[i]) is None:
            assert actions[i] == cands[i][greedy[i]]


# ---- writing actions (environments that list none) ---------------------------------------------------
@pytest.mark.parametrize("text,action", [
    ("Thought:\nI need planks.\n\nAction:\nget 2 planks", "get 2 planks"),  # AgentGym's format
    ("Thought:\nI need planks.\n\nAction:\nget 2 planks\n", "get 2 planks"),
    ("Thought: go down.\nAction: move down\n", "move down"),  # ours, on one line
    ("Action:   \n\n  craft 1 stick using 2 planks  \nI hope it works.", "craft 1 stick using 2 planks"),
    ("action : look", "look"),
    ('\n"craft 1 torch using 1 coal"\nAction:\n"craft 1 torch using 1 coal"\n', "craft 1 torch using 1 coal"),  # SmolLM2
    ("Action: `look`", "look"),
    ("Action: 'it's'", "it's"),  # one pair of quotes only
    ('Action: ""', '""'),  # nothing inside: kept as written
    ("Thought: the Action: line comes last.\n\nAction:\nsearch[red shoes]", "search[red shoes]"),  # the last one
    ("Thought: a Reaction: is no action\n", None),
    ("Thought: I do not know.", None),
    ("Action:", None),
    ("Action:\n   \n", None),
    ("", None),
])
def test_parse_react_reads_the_line_after_the_last_action_marker(text, action):
    assert parse_react(text) == action


def test_a_text_without_an_action_sends_its_last_line_bounded():
    assert fallback_action("Thought:\nI am lost.\n\ngo north\n\n") == "go north"
    assert fallback_action("x" * 5000) == "x" * MAX_WRITTEN_ACTION_CHARS
    assert fallback_action(" \n\t") == EMPTY_TEXT_ACTION  # an env server refuses an empty action
    assert fallback_action("Thought: lost." + ACTION_CUE) == "Thought: lost."  # the cue, then nothing written
    assert thought_before_cue("\n I go.\nNorth.\n\nAction (no)\n") == " I go.\nNorth."
    assert thought_before_cue("y" * 900) == "y" * MAX_CUED_THOUGHT_CHARS
    assert parse_react("Action: " + "y" * 5000) == "y" * MAX_WRITTEN_ACTION_CHARS


def test_generation_stops_after_an_action_on_its_own_line():
    text = "Thought:\nhmm\n\nAction:\nmove up\n"
    assert cut_after_action(text + "Thought: more") == text
    assert cut_after_action("Action: move up\nmore") == "Action: move up\n"
    assert cut_after_action("Action:\n") == "Action:\n"  # not yet an action: kept whole, generation goes on
    tok = build_tiny_tokenizer()
    done = ActionLineDone(tok, 0)
    rows = ["Thought:\nx\n\nAction:\n", "Thought:\nx\n\nAction:\nmove up\n", "Action: a\n"]
    ids = torch.tensor([tok(r.ljust(30), add_special_tokens=False)["input_ids"][:30] for r in rows])
    assert done(ids, None).tolist() == [False, True, True]


def test_written_actions_are_parsed_or_fall_back_counted_and_sampled_reproducibly():
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160, fmt=PlainFormat(1, 160, react=True))
    prompts = _maze_prompts(3)
    writer = ActionWriter(scorer)
    out = writer.write_actions(prompts, max_new_tokens=12)
    assert len(out) == 3 and all(isinstance(w, Written) for w in out)
    assert not all(w.parsed for w in out)  # the tiny model's bytes rarely name an action by themselves
    for w in out:
        assert w.action == (parse_react(w.text) or fallback_action(w.text)) and w.action.strip()
        if not w.parsed:  # its thought's first paragraph, the cue, and the line the model wrote after it
            thought, line = w.text.split(ACTION_CUE)
            assert "\n\n" not in thought.strip("\n") and len(thought) <= MAX_CUED_THOUGHT_CHARS
            assert (parse_react(w.text) or "") in line and (parse_react(w.text) is not None) == bool(line.strip())
    assert (writer.written, writer.unparsed) == (3, sum(not w.parsed for w in out))
    assert [w.text for w in writer.write_actions(prompts, max_new_tokens=12)] == [w.text for w in out]  # greedy
    # The text kept is the whole answer: the opening the prompts end with, then what the model wrote.
    opened = writer.write_actions(prompts, max_new_tokens=12, opening="Thought:")
    assert [w.text for w in opened] == ["Thought:" + w.text for w in out]
    a = writer.generate_texts(prompts, 12, greedy=False, generator=torch.Generator().manual_seed(3))
    b = writer.generate_texts(prompts, 12, greedy=False, generator=torch.Generator().manual_seed(3))
    c = writer.generate_texts(prompts, 12, greedy=False, generator=torch.Generator().manual_seed(4))
    assert a == b and a != c


def test_generation_writes_each_token_into_room_made_once_and_writes_the_same_texts(monkeypatch):
    """generate's cache (kvcache.generation_cache) makes room for the prompt and max_new_tokens at
    the prompt's pass and writes each token after it: the texts of transformers' own cache, greedy
    and sampled; a model with sliding-window layers keeps transformers' cache."""
    from transformers import DynamicCache, MistralConfig

    from services.client_agent.playing import generation

    from services.client_agent.model import kvcache

    model, tok = _model()
    writer = ActionWriter(ActionScorer(model, tok, max_prompt_tokens=256))
    prompts = _maze_prompts(3)
    made = []

    def spy(config, reserve):
        made.append(kvcache.generation_cache(config, reserve))
        return made[-1]

    monkeypatch.setattr(generation, "generation_cache", spy)
    ours = [writer.generate_texts(prompts, max_new_tokens=24),
            writer.generate_texts(prompts, max_new_tokens=24, greedy=False, generator=torch.Generator().manual_seed(1))]
    monkeypatch.setattr(generation, "generation_cache", lambda config, reserve: None)
    theirs = [writer.generate_texts(prompts, max_new_tokens=24),
              writer.generate_texts(prompts, max_new_tokens=24, greedy=False, generator=torch.Generator().manual_seed(1))]
    assert ours == theirs and any(t for t in ours[0])
    slots = made[0].layers[0]
    longest = max(len(writer.scorer.tokenize.prompt(p, 256)) for p in prompts)
    assert isinstance(slots, kvcache.Slots) and slots._slots[0].shape[-2] == longest + 24  # never grown
    sliding = MistralConfig(num_hidden_layers=2, sliding_window=16, hidden_size=32, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64)
    default = kvcache.generation_cache(sliding, 8)
    assert isinstance(default, DynamicCache) and not any(isinstance(x, kvcache.Slots) for x in default.layers)
