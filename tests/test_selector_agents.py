"""The selector agents on a scripted history: agent-tools' plan and memory, agent-llm's answer checked
and its fallback, a real call of the embedded tiny model, and the round keeper counting fallbacks and
keeping the agent's memory across a restart."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.aggregator.selection.policies import SelectionInput, SelectionSettings, make_policy
from services.aggregator.selection.agents import AnswerError, LLMAgent, ToolAgent, check_answer
from test_selection import ALIVE, check, history, inp


def test_agent_tools_leaves_out_the_straggler_and_the_late_client_and_explores_the_newcomer():
    given = inp()
    sel = ToolAgent(clients_per_round=3).select(given)
    check(sel, given)
    # K 3 of the 4 on time; a fifth of the places (one) explores the client never tried; the others go by
    # utility: gainer (0.30 gain) before steady (0.05); slow (4x the median round) is a straggler.
    assert sel.chosen == ("gainer", "newcomer", "steady")
    assert sel.reasons["slow"].startswith("straggler (240 s a round, median 60 s)")
    assert "newcomer" in sel.reasons and sel.reasons["newcomer"].startswith("never tried: exploring")
    assert sel.reasoning[0] == "availability: 4 of 5 alive clients on time; late: late"
    assert sel.reasoning[1] == "stragglers: slow (240 s a round, median 60 s)"
    assert sel.reasoning[3] == "K: 3 asked, 3 with the dropout margin"
    assert sel.memory == {"dropout_rate": 0.0, "round": 5, "chosen": ["gainer", "newcomer", "steady"],
                          "stragglers": {"slow": 1}}


def test_agent_tools_learns_the_dropout_rate_and_chooses_more():
    # Last round it chose three; only gainer uploaded.
    clients = tuple(c if c.client_id != "gainer" else dataclasses.replace(c, rounds_uploaded=(*c.rounds_uploaded, 5))
                    for c in history())
    memory = {"dropout_rate": 0.0, "round": 5, "chosen": ["gainer", "steady", "late"], "stragglers": {"slow": 3}}
    given = SelectionInput("run-1", 6, 7, clients, memory=memory)
    sel = ToolAgent(clients_per_round=2).select(given)
    check(sel, given)
    # 2 of 3 dropped: the rate learns 0.3 * 2/3 = 0.2, and K = ceil(2 / 0.8) = 3.
    assert sel.memory["dropout_rate"] == pytest.approx(0.2)
    assert "dropouts: learnt rate 0.20 (round 5: 2 of 3 chosen did not upload)" in sel.reasoning
    assert "K: 2 asked, 3 with the dropout margin" in sel.reasoning and len(sel.chosen) == 3
    assert sel.memory["stragglers"] == {"slow": 4}  # remembered across rounds


def test_agent_tools_without_a_count_takes_every_candidate_but_the_straggler():
    sel = ToolAgent().select(inp())
    assert set(sel.chosen) == {"gainer", "newcomer", "steady"}
    assert "K: 3, every candidate that is not a straggler" in sel.reasoning


@pytest.mark.parametrize("answer,message", [
    ("I think gainer and steady.", "no JSON object"),
    ('{"clients": ["gainer", ', "does not parse"),
    ('["gainer"]', "no JSON object"),
    ('{"clients": "gainer"}', "not a list of client ids"),
    ('{"clients": []}', "is empty"),
    ('{"clients": ["gainer", "gainer"]}', "names a client twice"),
    ('{"clients": ["gainer", "org-hallucinated"]}', "'org-hallucinated', not a client of this run"),
    ('{"clients": ["gone"]}', "names gone, not alive"),
    ('{"clients": ["gainer", "steady", "slow", "late", "newcomer"]}', "more than the 4 this round may take"),
])
def test_a_models_answer_is_checked_against_the_schema_and_the_run(answer, message):
    with pytest.raises(AnswerError, match=message):
        check_answer(answer, inp(), 4)


def test_a_valid_answer_is_taken_with_its_reason():
    assert check_answer('Sure: {"clients": ["steady", "gainer"], "reason": "fast and learning"} done', inp(), 4) == \
        ({"steady", "gainer"}, "fast and learning")


def scripted(answer: str) -> LLMAgent:
    agent = LLMAgent(clients_per_round=2, model="any")
    agent.generate = lambda name, prompt, schema=None: answer  # the model's answer, scripted
    return agent


def test_agent_llm_takes_a_checked_answer_and_falls_back_on_nonsense():
    given = inp()
    good = scripted('{"clients": ["steady", "late"], "reason": "they are steady"}').select(given)
    check(good, given)
    assert good.chosen == ("late", "steady") and not good.fallback_reason
    assert good.reasons["steady"] == "chosen by the model: they are steady"
    assert good.reasoning[-1].startswith("model answered: ")
    tools = ToolAgent(clients_per_round=2).select(given)
    for nonsense in ("", "}}}{{{", '{"clients": ["org-x"]}'):
        bad = scripted(nonsense).select(given)
        check(bad, given)
        assert bad.chosen == tools.chosen and bad.fallback_reason.startswith("the model's answer was refused: ")


def test_agent_llm_prompts_with_the_history_as_json():
    agent = LLMAgent(clients_per_round=2, model="any")
    prompt = agent.prompt(inp(), ToolAgent(clients_per_round=2)._choose(inp()))
    clients = json.loads(prompt.split("Clients: ", 1)[1].split("\n", 1)[0])
    assert {c["client"] for c in clients} == ALIVE | {"gone"}
    assert next(c for c in clients if c["client"] == "slow")["mean_round_s"] == 240.0


def test_agent_llm_with_the_real_tiny_model_answers_and_is_checked():
    """The embedded tiny model (built in code, random weights) is prompted for real. Unconstrained it
    writes no JSON, and the tools decide; constrained, its answer parses and has the schema's form
    every time (a random model: the constraint, not the model, makes it valid), and the policy's
    checks still judge what it says."""
    given = dataclasses.replace(inp(), base_model="fedse-tiny")
    free = LLMAgent(clients_per_round=2, max_new_tokens=24, max_seconds=60, constrained=False).select(given)
    check(free, given)
    assert free.fallback_reason == "the model's answer was refused: no JSON object in the answer"
    assert free.chosen == ToolAgent(clients_per_round=2).select(given).chosen
    agent = LLMAgent(clients_per_round=2, max_new_tokens=48, max_seconds=60)
    alive = sorted(c.client_id for c in given.alive())
    for round_ in range(4):
        situation = dataclasses.replace(given, round=round_ + 5)
        plan = agent.tools._choose(situation)
        schema = agent.schema(situation, len(alive), 2)
        answer = json.loads(agent.generate("fedse-tiny", agent.prompt(situation, plan), schema))
        assert set(answer) == {"clients", "reason"} and len(answer["clients"]) == 2
        assert set(answer["clients"]) <= set(alive) and isinstance(answer["reason"], str)
        assert len(answer["reason"]) <= schema["properties"]["reason"]["maxLength"]
    sel = agent.select(given)
    check(sel, given)
    assert "does not parse" not in sel.fallback_reason and "no JSON" not in sel.fallback_reason
    assert sel.reasoning[-1].startswith("model answered: ")


def test_a_model_that_cannot_load_falls_back(tmp_path):
    given = dataclasses.replace(inp(), base_model=str(tmp_path / "no-model"))
    sel = LLMAgent(clients_per_round=2).select(given)
    assert sel.fallback_reason.startswith("the model could not answer: ") and "does not exist" in sel.fallback_reason


def test_selector_settings_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="--selector-model is agent-llm's model"):
        SelectionSettings("agent-tools", model="fedse-tiny").policy()
    with pytest.raises(ValueError, match="needs --clients-per-round"):
        SelectionSettings("sample").policy()
    with pytest.raises(ValueError, match="--selector available does not take --clients-per-round"):
        SelectionSettings("available", clients_per_round=2).policy()
    assert make_policy(**SelectionSettings("agent-llm", 3, model="fedse-tiny").policy().config()).policy.model == \
        "fedse-tiny"
    with pytest.raises(ValueError, match="max_seconds must be a number of seconds in"):
        LLMAgent(max_seconds=0)


def test_the_round_keeper_counts_fallbacks_and_keeps_the_agents_memory_across_a_restart(tmp_path):
    from services.aggregator.rounds import RoundKeeper
    from services.aggregator.store import Store
    from test_rounds import Clock, join, settings, upload

    clock = Clock()
    chosen = SelectionSettings("agent-llm", clients_per_round=1, model="any")

    def keeper() -> RoundKeeper:
        fed = RoundKeeper(settings(selection=chosen, start_clients=3), Store(tmp_path, "r"), clock=clock)
        fed.policy.policy.generate = lambda name, prompt, schema=None: "no idea"  # the agent, under the fairness floor
        return fed
    fed = keeper()
    join(fed, "a", "b", "c")
    assert fed.thinking.wait()  # the model is asked outside the round keeper's lock
    sel, fallbacks = fed.selection()
    assert fallbacks == 1 and sel.fallback_reason == "the model's answer was refused: no JSON object in the answer"
    for cid in sel.chosen:
        upload(fed, cid, 1.0)
    assert fed.thinking.wait() and fed.status().round == 1 and fed.selection()[1] == 2
    memory = fed.run.selector_memory
    assert memory["round"] == 1 and memory["chosen"] == list(fed.status().selected)
    again = keeper()
    assert again.run.selector_memory == memory and again.selection()[1] == 2
    assert again.status().selected == fed.status().selected


def test_an_answer_that_breaks_the_policy_falls_back_and_is_counted_and_shown(tmp_path):
    """Under --clients-per-round 3, an answer naming one client is well formed but takes the wrong
    number; an answer leaving out a client the fairness floor requires breaks the floor. Both fall back
    to the tools' plan, counted, and `fedse status` shows the fallback."""
    given = inp()
    agent = LLMAgent(clients_per_round=3, model="any")
    agent.generate = lambda name, prompt, schema=None: '{"clients": ["gainer"], "reason": "the best"}'
    sel = agent.select(given)
    assert sel.fallback_reason == "the model's answer was refused: names 1 client(s); this round takes exactly 3"
    assert sel.chosen == ToolAgent(clients_per_round=3).select(given).chosen
    due = dataclasses.replace(given, must=("slow",))
    agent.generate = lambda name, prompt, schema=None: '{"clients": ["gainer", "steady", "late"], "reason": "fast ones"}'
    sel = agent.select(due)
    assert sel.fallback_reason == "the model's answer was refused: leaves out slow, due under the fairness floor"
    assert "slow" in sel.chosen  # the tools place the client due first
    with pytest.raises(AnswerError, match="this round takes exactly 2"):
        check_answer('{"clients": ["gainer", "steady", "late"]}', given, 4, exactly=2)

    from apps.cli import format_status
    from services.aggregator.rounds import RoundKeeper
    from services.aggregator.servicer import FederationServicer
    from services.aggregator.store import Store
    from test_rounds import Clock, join, settings

    fed = RoundKeeper(settings(selection=SelectionSettings("agent-llm", clients_per_round=2, model="any"),
                               start_clients=3), Store(tmp_path, "r"), clock=Clock())
    fed.policy.policy.generate = lambda name, prompt, schema=None: '{"clients": ["a"], "reason": "a alone"}'
    join(fed, "a", "b", "c")
    assert fed.thinking.wait()
    sel, fallbacks = fed.selection()
    assert fallbacks == 1 and len(sel.chosen) == 2
    assert sel.fallback_reason == "the model's answer was refused: names 1 client(s); this round takes exactly 2"
    from fedse.v1 import federation_pb2 as fpb

    shown = format_status(FederationServicer(fed).GetRunStatus(fpb.RunStatusRequest(), None))
    assert "selector fallbacks so far: 1" in shown
    assert "  fallback: the model's answer was refused: names 1 client(s); this round takes exactly 2" in shown


def test_selector_agents_imports_first_without_a_circle():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import services.aggregator.selection.agents"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
