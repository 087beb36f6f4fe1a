"""The round schedules (services.aggregator.schedules) and releases (services.aggregator.release) as
objects: the factories pick them by name, FedBuff's training slots, the synchronous due rule, which
uploads fold and how, what a round's opening keeps."""

from __future__ import annotations

import pytest

from services.aggregator.attempt import Stage
from services.aggregator.errors import StaleRound
from services.aggregator.release import PlainRelease, SecureRelease, release_for
from services.aggregator.rounds import RoundKeeper
from services.aggregator.schedules import DECLINED, SCHEDULES, FedBuff, SyncRounds, schedule_for
from services.aggregator.state import State
from services.aggregator.store import Store
from services.aggregator.uploads import Accepted
from test_async_rounds import send
from test_rounds import Clock, federation, join, settings, upload


def accepted(base: int, collected: int) -> Accepted:
    return Accepted("0" * 64, 1, "", 1, 0, 0.0, base, collected)


def test_the_factories_pick_by_name_and_refuse_an_unknown_mode(tmp_path):
    assert schedule_for("sync") is SyncRounds and schedule_for("async") is FedBuff
    assert sorted(SCHEDULES) == ["async", "sync"]
    with pytest.raises(ValueError, match=r"mode 'fedbuff' is not a round schedule: give one of sync, async"):
        schedule_for("fedbuff")
    with pytest.raises(ValueError, match="mode 'asynchronous' is not a round schedule"):
        RoundKeeper(settings(mode="asynchronous"), Store(tmp_path, "r"), clock=Clock())
    assert release_for(settings()) is PlainRelease and release_for(settings(secure=True)) is SecureRelease
    fed = federation(tmp_path / "a", Clock(), mode="async")
    assert type(fed.schedule) is FedBuff and type(fed.release) is PlainRelease and fed.secure is None
    assert fed.schedule.max_staleness == 8 and federation(tmp_path / "s", Clock()).schedule.max_staleness == 0


def test_fedbuff_grants_free_slots_to_the_longest_waiting_and_takes_back_a_dead_clients(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock, mode="async", start_clients=3, async_concurrency=2)
    join(fed, "a", "b", "c")
    s = fed.schedule
    assert s.selected_locked() == ("a", "b")  # equal waits: by client id
    assert [m.client.client_id for m in s.eligible_locked(clock())] == ["c"]
    assert s.selected_view("c") == (False, "waits for a free training slot")
    assert s.selected_view("a") == (True, "training from version 0")
    clock.now += 11  # past the 10 s heartbeat timeout: a is dead, b and c answer
    fed.seen("b", 0, "training")
    fed.seen("c", 0, "waiting")
    with fed._cond:
        s.grant_locked()
    run = fed.run
    assert s.selected_locked() == ("b", "c")
    assert run.members["a"].slot_lost == 0 and run.members["a"].dropouts == 1
    assert run.members["c"].slot_version == 0 and run.members["c"].rounds_selected == [0]
    # A client that declines gets no slot, and gives its slot back.
    fed.seen("a", 0, DECLINED)
    fed.seen("c", 0, DECLINED)
    with fed._cond:
        s.grant_locked()
        assert s.selected_locked() == ("b",) and s.eligible_locked(clock()) == []
    assert s.selected_view("c") == (False, "declines: its privacy budget is spent")
    assert run.members["c"].dropouts == 0  # alive: declining is no dropout


def test_fedbuff_folds_its_buffer_with_staleness_and_keeps_the_runs_nonce(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock, mode="async", start_clients=2, async_concurrency=2, async_buffer=2)
    join(fed, "a", "b")
    s = fed.schedule
    nonce = fed.status().round_nonce
    send(fed, "a", 0, 1.0)
    assert list(s.folding_locked()) == ["a"] and s.due_locked(choosing=True) is None  # waits for b
    assert s.collecting() == 0 and s.holds(5)
    send(fed, "b", 0, 3.0)
    assert fed.status().round == 1 and fed.status().round_nonce == nonce and s.keeps_nonce
    assert s.folds(3, [("a", accepted(3, 3))]) is False  # every update from this version: the strategy
    assert s.folds(3, [("a", accepted(3, 3)), ("b", accepted(2, 3))]) is True
    lr = federation(tmp_path / "lr", Clock(), mode="async", async_server_lr=0.5).schedule
    assert lr.folds(3, [("a", accepted(3, 3))]) is True
    assert FedBuff.open_uploads(fed.settings, fed.store, 1) == {}


def test_a_synchronous_round_is_due_over_the_clients_taking_part(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock, min_clients=2, start_clients=3)
    join(fed, "a", "b", "c")
    s = fed.schedule
    assert s.selected_locked() is None and s.selected_view("b") == (True, "every client takes part")
    assert not s.all_declined_locked()
    upload(fed, "a", 1.0)
    with fed._cond:
        assert s.due_locked(choosing=False) is None  # b and c are alive, one upload is short of min_clients
        fed.seen("b", 0, DECLINED)
        fed.seen("c", 0, DECLINED)
        assert s.due_locked(choosing=False) == "all uploaded"  # the decliners take no part
        assert s.due_locked(choosing=True) is None  # the selector's model is still choosing
        assert not s.all_declined_locked()  # a uploaded: the round closes with its upload
    assert list(s.folding_locked()) == ["a"] and s.collecting() == -1 and not s.holds(1)
    assert s.folds(0, [("a", accepted(-1, -1))]) is False
    first = fed.status().round_nonce
    assert not s.keeps_nonce
    fed.close_if_due()  # the round closes with a's upload; the next has a new nonce
    assert fed.status().round == 1 and fed.status().round_nonce not in (first, "")


def test_a_synchronous_round_every_client_declines_closes_without_an_update(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock, start_clients=2)
    join(fed, "a", "b")
    for c in ("a", "b"):
        fed.seen(c, 0, DECLINED)
    assert fed.schedule.all_declined_locked()
    fed.close_if_due()
    assert fed.status().round == 1 and fed.global_adapter(1)[2] == fed.global_adapter(0)[2]
    asynchronous = federation(tmp_path / "async", clock, mode="async", start_clients=2)
    join(asynchronous, "a", "b")
    for c in ("a", "b"):
        asynchronous.seen(c, 0, DECLINED)
    assert not asynchronous.schedule.all_declined_locked()


def test_the_secure_release_runs_the_stages_and_a_plain_run_refuses_them(tmp_path):
    fed = federation(tmp_path, Clock(), min_clients=2, secure=True)
    join(fed, "a", "b")
    assert fed.secure is fed.release.secure and fed.release.masked_bytes is not None
    st = fed.status()
    assert st.state is State.OPEN and st.secure_stage is Stage.ADVERTISING
    assert fed.release.step_of("a") == ""
    plain = federation(tmp_path / "plain", Clock(), start_clients=2)
    join(plain, "a", "b")
    assert plain.status().secure_stage is None and plain.release.masked_bytes is None
    with pytest.raises(StaleRound, match="does not use secure aggregation"):
        plain.secure_call("a", 0, plain.status().round_nonce, lambda desk: None)


@pytest.mark.parametrize("flags, refused", [
    (["--mode", "fedbuff"], "--mode: mode 'fedbuff' is not a round schedule: give one of sync, async"),
    (["--mode", "async", "--strategy", "median"], "--mode async folds updates with FedBuff's staleness-weighted mean"),
    (["--mode", "async", "--selector", "sample", "--clients-per-round", "2"], "--selector sample chooses whole rounds"),
    (["--mode", "async", "--strategy", "hlora", "--max-lora-rank", "8"], "--mode async folds updates of one rank"),
    (["--async-server-lr", "0.5"], "--async-server-lr 0.5 is FedBuff's, for --mode async"),
])
def test_each_schedule_refuses_the_settings_it_cannot_run_with(flags, refused):
    """The aggregator's settings are checked by the schedule --mode names, not by mode flags in the config."""
    from fedse.config import ConfigError, parse
    from services.aggregator.server import AggregatorConfig

    with pytest.raises(ConfigError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        parse(AggregatorConfig, flags, environ={})
    SyncRounds.check_settings(parse(AggregatorConfig, ["--async-server-lr", "1"], environ={}))  # the default: fine
    FedBuff.check_settings(parse(AggregatorConfig, ["--mode", "async"], environ={}))
