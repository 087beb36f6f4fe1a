"""Demonstration files (--demos): AgentTraj records read as JSON arrays or JSON Lines, checked (each
malformed kind stops the client with one line and exit status 2), turned into trajectories that keep
the agent's whole text, and trained on as the agent acts."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from fedse.model.tinymodel import build_tiny_tokenizer
from services.client_agent.training.buffer import Trajectory
from services.client_agent.training.demos import DemoError, conversation_to_trajectory, load_demos, load_file
from services.client_agent.playing.prompts import REACT_FORMAT, ChatFormat, PlainFormat, TokenCache

REPO = pathlib.Path(__file__).resolve().parent.parent
ACK = "OK. I'll follow your instructions and try my best to solve the task."
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def turn(who: str, value, loss=None) -> dict:
    return {"from": who, "loss": loss, "value": value}


def record(item_id: str = "textcraft_7", *, final_observation: bool = True) -> dict:
    """An AgentTraj record as AgentGym writes them: instruction, acknowledgement, then observations
    and ReAct answers."""
    conv = [turn("human", "Craft what the goal names. Answer as Thought:\n...\n\nAction:\n..."),
            turn("gpt", ACK, False),
            turn("human", "Crafting commands: craft 1 stick using 2 planks.\nGoal: craft stick."),
            turn("gpt", "Thought:\nI need planks first.\n\nAction:\nget 2 planks", True),
            turn("human", "Got 2 planks"),
            turn("gpt", "Thought:\nNow I can craft it.\n\nAction:\ncraft 1 stick using 2 planks", True)]
    if final_observation:
        conv.append(turn("human", "Crafted 1 minecraft:stick"))
    return {"item_id": item_id, "conversations": conv}


# ---- reading and converting ---------------------------------------------------------------------------
def test_a_record_becomes_a_trajectory_that_keeps_every_thought(tmp_path):
    path = tmp_path / "textcraft.json"
    path.write_text(json.dumps([record("textcraft_7"), record("textcraft_12", final_observation=False)], indent=2))
    first, second = load_file(path, ["textcraft"])
    rec = record()["conversations"]
    assert first.instruction == rec[0]["value"]  # the acknowledgement is left out
    assert first.turns == ((rec[2]["value"], "get 2 planks"), ("Got 2 planks", "craft 1 stick using 2 planks"))
    assert first.texts == (rec[3]["value"], rec[5]["value"])  # the whole gpt text, thought included
    assert (first.env, first.task_id, first.source, first.round, first.success) == ("textcraft", 7, "file", -1, True)
    assert second.task_id == 12 and second.turns == first.turns  # the last observation teaches nothing
    # JSON Lines give the same, and survive the buffer's round trip.
    lines = tmp_path / "textcraft.jsonl"
    lines.write_text(json.dumps(record("textcraft_7")) + "\n\n" + json.dumps(record("textcraft_12")) + "\n")
    assert load_file(lines, ["textcraft"]) == [first, second]
    assert Trajectory.from_json(first.to_json()) == first


def test_conversations_without_an_acknowledgement_or_with_same_line_actions():
    conv = [turn("human", "Reach the goal."), turn("human", "You are at 1, 1."), turn("human", "A wall is above you."),
            turn("gpt", "Action: move down")]
    t = conversation_to_trajectory(conv, "maze")
    assert t.instruction == "Reach the goal." and t.task_id == -1
    assert t.turns == (("You are at 1, 1.\n\nA wall is above you.", "move down"),)  # observations in a row: joined
    # A first answer that names an action is the agent's first turn, not an acknowledgement.
    t = conversation_to_trajectory([turn("human", "Reach the goal. You are at 1, 1."),
                                    turn("gpt", "Thought: down.\nAction: move down", True)], "maze")
    assert t.turns == (("", "move down"),) and t.texts == ("Thought: down.\nAction: move down",)


def test_several_environments_take_their_records_by_item_id(tmp_path):
    path = tmp_path / "mixed.jsonl"
    recs = [record("textcraft_1"), record("maze_3"), record("lmrlgym_maze_4"), record("textcraft_2")]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs[:2] + recs[3:]))
    by_env = load_demos([str(path)], ["maze", "textcraft"])
    assert [t.task_id for t in by_env["textcraft"]] == [1, 2] and [t.task_id for t in by_env["maze"]] == [3]
    # One environment takes every record, whatever its item_id says.
    assert [t.env for t in load_demos([str(path)], ["mine"])["mine"]] == ["mine"] * 3
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(DemoError, match=r"record 2 \(line 3, item_id 'lmrlgym_maze_4'\): item_id names no "
                                        r"environment of this client: 'lmrlgym_maze' is not one of maze, textcraft"):
        load_demos([str(path)], ["maze", "textcraft"])


# ---- malformed files: one line each ----------------------------------------------------------------------
GOOD = json.dumps(record("say_4"))


def jsonl(second: object) -> str:
    return GOOD + "\n" + (second if isinstance(second, str) else json.dumps(second)) + "\n"


def conv(*turns_) -> dict:
    return {"item_id": "say_5", "conversations": list(turns_)}


MALFORMED = [
    ("", "the file is empty"),
    ("  \n\n", "the file is empty"),
    ("[]", "the array holds no records"),
    ('[{"item_id": "say_1", "conversations": []', "not JSON (Expecting"),
    (b"\xff\xfe\x00garbage", "not UTF-8 text"),
    (jsonl("{not json"), "record 1 (line 2): not JSON"),
    (jsonl([1, 2]), "record 1 (line 2): a list, not an object"),
    (jsonl({"item_id": "say_5"}), "record 1 (line 2, item_id 'say_5'): no \"conversations\""),
    (jsonl({"item_id": 5, "conversations": []}), "record 1 (line 2): \"item_id\" is a int"),
    (jsonl({"item_id": "say_5", "conversations": "hello"}), "\"conversations\" is a str, not a list"),
    (jsonl(conv()), "\"conversations\" is empty"),
    (jsonl(conv("hello")), "turn 0 is a str, not an object"),
    (jsonl(conv(turn("human", "x"), turn("system", "y"))), "turn 1 has an unknown \"from\" 'system'"),
    (jsonl(conv(turn("human", None))), "turn 0 (human) has no text"),
    (jsonl(conv(turn("human", "x", "yes"))), "turn 0 (human) has \"loss\" 'yes'"),
    (jsonl(conv(turn("gpt", "Action: go"))), "turn 0 is from gpt"),
    (jsonl(conv(turn("human", "x"), turn("gpt", ACK, False), turn("human", "obs"))), "no gpt turn with an action"),
    (jsonl(conv(turn("human", "x"), turn("gpt", ACK, False), turn("human", "obs"), turn("gpt", "I think so."))),
     "turn 3 (gpt) names no action"),
    (jsonl(conv(turn("human", "x"), turn("human", "o"), turn("gpt", "Action: a"), turn("gpt", "Action: b"))),
     "turns 2 and 3 are both from gpt"),
]


@pytest.mark.parametrize("content,expected", MALFORMED, ids=[m[1][:40] for m in MALFORMED])
def test_each_malformed_kind_says_where_and_what_in_one_line(tmp_path, content, expected):
    path = tmp_path / "demos.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DemoError) as err:
        load_demos([str(path)], ["say"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"--demos {path}: ")
    assert expected in message, message


def test_a_missing_file_and_a_record_of_no_environment_say_so(tmp_path):
    with pytest.raises(DemoError, match=r"nowhere\.json: cannot read it: No such file"):
        load_demos([str(tmp_path / "nowhere.json")], ["say"])
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"conversations": record()["conversations"]}]))
    with pytest.raises(DemoError, match=r"record 0: no \"item_id\": with several environments"):
        load_demos([str(path)], ["say", "maze"])


def test_the_client_stops_before_joining_with_exit_status_2_and_one_line(tmp_path):
    """The real entry point: nothing listens at the aggregator or env server addresses, so only a
    check made before joining can end the process this way."""
    path = tmp_path / "say.jsonl"
    path.write_text(jsonl(conv(turn("human", "x"), turn("system", "y"))))
    proc = subprocess.run(
        [sys.executable, "-m", "services.client_agent", "--env", "say", "--demos", str(path), "--metrics-port", "-1",
         "--address", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"), "--aggregator", "127.0.0.1:9",
         "--env-server", "127.0.0.1:9"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"configuration error: --demos {path}: record 1 (line 2, item_id 'say_5'): "
                     "turn 1 has an unknown \"from\" 'system': expected \"human\" or \"gpt\""], proc.stderr


# ---- training on what was written --------------------------------------------------------------------------
def test_training_covers_the_whole_gpt_text_where_the_agent_writes_and_the_action_where_it_picks():
    from services.client_agent.training.trainer import training_examples

    tok = build_tiny_tokenizer()
    tok.chat_template = CHATML
    tokenize = TokenCache(tok)
    chat = ChatFormat(tok, 4096)
    t = conversation_to_trajectory(record()["conversations"], "textcraft")
    writes = training_examples([t], chat, tokenize, 4096, chat.as_react(), {"textcraft"})
    picks = training_examples([t], chat, tokenize, 4096, chat.as_react(), set())
    assert len(writes) == len(picks) == 1  # the whole episode in one window
    (w,), (p,) = writes, picks

    def covered(e):
        return [tok.decode(list(e.ids[s:end])) for s, end in e.spans]
    # The prompt ends with the answer's opening, "Thought:"; the loss covers the rest of the text.
    assert all(text.startswith("Thought:") for text in t.texts)
    assert covered(w) == [text[len("Thought:"):] + "<|im_end|>" for text in t.texts]
    assert covered(p) == [f"Action: {a}<|im_end|>" for _, a in t.turns]
    # What the writing agent sees: the ReAct instructions, and its earlier thought in the history.
    seen = tok.decode(list(w.ids))
    assert REACT_FORMAT in seen and "I need planks first." in seen
    assert "I need planks first." not in tok.decode(list(p.ids))
    # The plain format (the tiny model's) trains on the text too, a sequence per turn.
    plain = training_examples([t], PlainFormat(max_history=1), tokenize, 4096, PlainFormat(1, None, True),
                              {"textcraft"})
    assert [covered(e) for e in plain] == [[text[len("Thought:"):] + "\n"] for text in t.texts]
