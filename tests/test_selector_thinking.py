"""agent-llm's model is asked outside the round keeper's lock (services/aggregator/selection/thinking.py): status
calls and heartbeats go on meanwhile and nobody is counted a dropout for them; an answer past the
deadline falls back, counted; an answer for a round that moved on is discarded; the model is loaded
when the aggregator starts."""

from __future__ import annotations

import threading
import time

import pytest

from fedse.config import ConfigError
from services.aggregator.rounds import RoundKeeper
from services.aggregator.selection.policies import SelectionSettings
from services.aggregator.server import load_selector_model
from services.aggregator.state import State
from services.aggregator.store import Store
from test_rounds import Clock, join, settings


def keeper(tmp_path, clock, model: str = "any", per_round: int = 1) -> RoundKeeper:
    chosen = SelectionSettings("agent-llm", clients_per_round=per_round, model=model)
    return RoundKeeper(settings(selection=chosen, start_clients=3, heartbeat_timeout_s=10.0), Store(tmp_path, "r"),
                       clock=clock)


def within(call, seconds: float = 2.0):
    """call()'s result, which must come within `seconds` (a call that waits on a held lock would not)."""
    box = []
    worker = threading.Thread(target=lambda: box.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert box, f"no answer within {seconds} s: the round keeper's lock is held"
    return box[0]


def test_status_and_heartbeats_go_on_while_the_model_thinks_and_nobody_is_a_dropout(tmp_path):
    clock, asking, release = Clock(), threading.Event(), threading.Event()
    fed = keeper(tmp_path, clock)

    def slow(name, prompt, schema=None):
        asking.set()
        assert release.wait(30)
        return '{"clients": ["b"], "reason": "b is quick"}'
    fed.policy.policy.generate = slow
    join(fed, "a", "b", "c")
    assert asking.wait(10)
    st = within(fed.status)
    assert st.state is State.AGGREGATING and st.selected == ()  # clients wait: the round has not begun
    for _ in range(3):  # 24 s of heartbeats, every 8 s, past the 10 s timeout since the join
        clock.now += 8
        for cid in "abc":
            within(lambda cid=cid: fed.seen(cid, 0, "waiting"))
        within(fed.tick)
    assert within(fed.clients_alive) == 3
    release.set()
    assert fed.thinking.wait()
    sel, fallbacks = fed.selection()
    assert sel.chosen == ("b",) and fallbacks == 0 and not sel.fallback_reason
    st = fed.status()
    assert st.state is State.OPEN and st.selected == ("b",)
    assert fed.run.deadline == clock.now + 100.0  # the round's clock starts with its selection
    assert all(m.dropouts == 0 for m in fed.run.members.values())
    assert not any(r.startswith("chosen again") for r in sel.reasoning)


def test_a_model_past_its_deadline_falls_back_to_the_tools_counted(tmp_path):
    fed = keeper(tmp_path, Clock(), model="fedse-tiny")
    agent = fed.policy.policy
    agent.asker.max_seconds = 0.5
    agent.asker._generate = lambda *args: time.sleep(5) or '{"clients": ["a"], "reason": "late"}'
    started = time.monotonic()
    join(fed, "a", "b", "c")
    assert fed.thinking.wait(10)
    assert time.monotonic() - started < 4  # the deadline, not the model, ended the wait
    sel, fallbacks = fed.selection()
    assert fallbacks == 1 and sel.fallback_reason.startswith("the model could not answer: no answer within 0.5 s")
    assert len(sel.chosen) == 1 and fed.status().state is State.OPEN


def test_an_answer_for_a_round_that_moved_on_is_not_applied(tmp_path):
    clock, release = Clock(), threading.Event()
    fed = keeper(tmp_path, clock)
    calls = []

    def answer(name, prompt, schema=None):
        calls.append(prompt)
        if len(calls) == 1:  # the first question: answered after a newer selection began
            assert release.wait(30)
            return '{"clients": ["a"], "reason": "stale"}'
        return '{"clients": ["c"], "reason": "current"}'
    fed.policy.policy.generate = answer
    join(fed, "a", "b", "c")
    while not calls:
        time.sleep(0.01)
    with fed._cond:  # the round is chosen again (as when every chosen client died) while the model thinks
        fed._select_locked(fed.run.round, "chosen again for the test")
    deadline = time.monotonic() + 10
    while fed.selection()[0].chosen != ("c",) and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    assert fed.thinking.wait()
    sel, fallbacks = fed.selection()
    assert sel.chosen == ("c",) and fallbacks == 0
    assert [s["chosen"] for s in fed.store.selections()] == [["c"]]  # the stale answer never recorded
    assert fed.run.members["a"].rounds_selected == []


def test_the_model_is_loaded_at_start_and_one_that_cannot_load_stops_the_aggregator(tmp_path):
    fed = keeper(tmp_path / "ok", Clock(), model="fedse-tiny")
    assert not fed.policy.policy.asker.loaded
    load_selector_model(fed)
    assert fed.policy.policy.asker.loaded
    broken = keeper(tmp_path / "broken", Clock(), model=str(tmp_path / "no-model"))
    with pytest.raises(ConfigError, match=r"^--selector agent-llm cannot load its model '.*no-model'"):
        load_selector_model(broken)
