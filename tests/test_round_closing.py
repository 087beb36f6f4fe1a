"""When a round closes, as a pure function of one moment (no threads, clocks or files)."""

import pytest

from services.aggregator.closing import OpenRound, Rule, close_reason

RULE = Rule(min_clients=2, wait_after_min_s=50.0, heartbeat_timeout_s=10.0)


def open_round(accepted: dict[str, float], last_seen: dict[str, float] | None = None, receiving: bool = False,
               progress_at: float = 0.0, deadline: float = 1000.0) -> OpenRound:
    """Clients a, b, c joined, all heard from at t=100 unless `last_seen` says otherwise."""
    seen = {"a": 100.0, "b": 100.0, "c": 100.0, **(last_seen or {})}
    return OpenRound(last_seen=seen, accepted=accepted, receiving=receiving, progress_at=progress_at,
                     deadline=deadline)


def test_a_round_without_uploads_stays_open_whatever_the_time():
    assert close_reason(RULE, open_round({}), now=10 ** 6) is None


def test_every_joined_client_uploaded_closes_it_even_below_min_clients():
    lone = OpenRound(last_seen={"a": 100.0}, accepted={"a": 105.0}, receiving=False, progress_at=0.0,
                     deadline=1000.0)
    assert close_reason(RULE, lone, now=106.0) == "all uploaded"


@pytest.mark.parametrize("now, reason", [
    (105.0, None),  # c was heard from 5 s ago: wait for it
    (111.0, "all alive clients uploaded"),  # c silent for 11 s > 10 s
])
def test_a_quorum_waits_for_live_clients_only(now, reason):
    assert close_reason(RULE, open_round({"a": 101.0, "b": 102.0}, {"a": 101.0, "b": 102.0}), now) == reason


def test_below_min_clients_neither_the_deadline_nor_dead_clients_close_it():
    r = open_round({"a": 101.0}, deadline=200.0)
    assert close_reason(RULE, r, now=10 ** 6) is None


@pytest.mark.parametrize("now, deadline, reason", [
    (151.0, 10 ** 6, None),  # 49 s after the 2nd upload
    (152.0, 10 ** 6, "waited after quorum"),  # 50 s after it
    (120.0, 120.0, "deadline with quorum"),
])
def test_wait_after_quorum_counts_from_the_min_clients_th_upload_and_the_deadline_closes_too(now, deadline, reason):
    alive = {"c": now}  # c is alive and has not uploaded
    assert close_reason(RULE, open_round({"b": 102.0, "a": 101.0}, alive, deadline=deadline), now) == reason


def test_a_transfer_making_progress_holds_the_round_until_it_stalls():
    def at(now: float) -> str | None:
        r = open_round({"a": 101.0, "b": 102.0}, {"c": now}, receiving=True, progress_at=190.0, deadline=150.0)
        return close_reason(RULE, r, now)

    assert at(200.0) is None  # bytes arrived 10 s ago
    assert at(201.0) == "waited after quorum"  # stalled for longer than the heartbeat timeout
