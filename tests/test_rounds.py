"""The round state machine on a hand-driven clock: when rounds close, what a restart keeps."""

from __future__ import annotations

import time

import pytest
import torch

from fedse.model import adapter as ad
from services.aggregator.errors import StaleRound
from services.aggregator.rounds import RoundKeeper
from services.aggregator.state import RunSettings, State
from services.aggregator.store import Store
from services.aggregator.strategies import StrategyParams
from services.aggregator.uploads import UploadHeader

A, B = "m.lora_A.weight", "m.lora_B.weight"
SCHEMA = ad.Schema.of({A: torch.zeros(2, 3), B: torch.zeros(3, 2)}, '{"r": 2}')


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(**kw) -> RunSettings:
    base = dict(run_id="r", num_rounds=3, min_clients=1, round_deadline_s=100.0, strategy="fedavg",
                max_adapter_bytes=10 ** 6, wait_after_min_s=50.0, heartbeat_timeout_s=10.0)
    base.update(kw)
    return RunSettings(**base)


def federation(tmp_path, clock, **kw) -> RoundKeeper:
    return RoundKeeper(settings(**kw), Store(tmp_path, "r"), clock=clock)


def adapter_bytes(value: float) -> bytes:
    return ad.encode({A: torch.full((2, 3), value), B: torch.full((3, 2), value)})


def settle(fed: RoundKeeper) -> None:
    """Closes the round now if it is due and waits for any aggregation under way (the aggregator
    aggregates on a thread beside the acknowledgement)."""
    fed.close_if_due()
    deadline = time.monotonic() + 30
    while fed.status().state is State.AGGREGATING and time.monotonic() < deadline:
        time.sleep(0.01)


def upload(fed: RoundKeeper, client: str, value: float) -> None:
    data = adapter_bytes(value)
    st = fed.status()
    h = UploadHeader(client, st.round, st.round_nonce, ad.sha256_hex(data), len(data))
    done, held, gen = fed.begin_upload(h)
    assert not done and held == 0
    fed.receive(h, gen, 0, data)
    fed.finish_upload(h, gen)
    fed.end_stream(h, gen)
    settle(fed)


def join(fed: RoundKeeper, *clients: str) -> None:
    for c in clients:
        fed.join(c, "maze", "tiny", SCHEMA)


def test_a_round_waits_for_every_live_client_then_closes(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock)
    join(fed, "a", "b")
    upload(fed, "a", 1.0)
    assert fed.status().round == 0  # b is alive (joined just now): wait for it
    clock.now += 5
    fed.seen("b", 0, "training")  # b's heartbeat
    clock.now += 6  # a has been silent 11 s (> 10 s timeout) but has uploaded; b is alive
    fed.tick()
    assert fed.status().round == 0
    upload(fed, "b", 3.0)
    st = fed.status()
    assert st.round == 1 and st.state is State.OPEN
    # phi_1 = mean of the two uploads.
    got = ad.decode(fed.global_adapter(1)[1])
    assert torch.equal(got[A], torch.full((2, 3), 2.0))


def test_a_silent_client_is_not_waited_for_once_there_is_a_quorum(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock)  # heartbeat timeout 10 s
    join(fed, "a", "b")
    upload(fed, "a", 1.0)
    clock.now += 9
    fed.tick()
    assert fed.status().round == 0  # b still counts as alive
    clock.now += 2  # b silent for 11 s
    fed.tick()
    assert fed.status().round == 1


def test_wait_after_quorum_and_the_deadline_close_a_round_unless_a_transfer_progresses(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock, wait_after_min_s=20.0, heartbeat_timeout_s=30.0)
    join(fed, "a", "b")
    clock.now += 30
    upload(fed, "a", 1.0)  # quorum reached at t+30
    # b is alive and sending: a transfer making progress holds the round open past wait-after-min.
    data = adapter_bytes(5.0)
    st = fed.status()
    h = UploadHeader("b", 0, st.round_nonce, ad.sha256_hex(data), len(data))
    _, held, gen = fed.begin_upload(h)  # progress at t+30
    clock.now += 29  # 29 s after quorum: wait-after-min has passed, b's stream started 29 s ago
    fed.tick()
    assert fed.status().round == 0
    clock.now += 2  # 31 s since b's stream began: it counts as progressing only if bytes arrive...
    fed.receive(h, gen, held, data[:100])  # ...and they do
    fed.tick()
    assert fed.status().round == 0  # a transfer is making progress
    clock.now += 31  # the transfer stalled for longer than the heartbeat timeout
    fed.tick()
    assert fed.status().round == 1
    assert fed.status().uploaded == ()
    # b's stale stream cannot land in round 1.
    with pytest.raises(StaleRound):
        fed.begin_upload(h)


def test_the_deadline_closes_a_round_with_a_quorum_and_not_without(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock, min_clients=2, wait_after_min_s=10 ** 6, round_deadline_s=100.0,
                     heartbeat_timeout_s=10 ** 6)
    join(fed, "a", "b", "c")
    upload(fed, "a", 1.0)
    clock.now += 101
    fed.tick()
    assert fed.status().round == 0  # past the deadline but below min-clients: keep waiting
    upload(fed, "b", 3.0)
    assert fed.status().round == 1  # quorum, and the deadline has passed


def test_start_clients_opens_round_0_for_everyone_then_min_clients_lets_rounds_close_without_the_dead(tmp_path):
    """What `fedse run` asks for: round 0 waits for every client to join, a later round closes
    without a client that stopped beating once one client has uploaded."""
    clock = Clock()
    fed = federation(tmp_path, clock, start_clients=3, min_clients=1, wait_after_min_s=10 ** 6,
                     round_deadline_s=10 ** 6)
    join(fed, "a", "b")
    assert fed.status().state is State.WAITING_FOR_CLIENTS  # min_clients alone would have opened it
    join(fed, "c")
    assert fed.status().state is State.OPEN
    upload(fed, "a", 1.0)
    upload(fed, "b", 1.0)
    assert fed.status().round == 0  # c is alive: wait for it
    upload(fed, "c", 1.0)
    assert fed.status().round == 1
    clock.now += 5
    fed.seen("a", 1, "training")
    fed.seen("b", 1, "training")  # c dies here: it beats no more
    upload(fed, "a", 1.0)
    upload(fed, "b", 1.0)
    assert fed.status().round == 1  # c was heard from 5 s ago (timeout 10 s)
    clock.now += 6
    fed.tick()
    settle(fed)
    assert fed.status().round == 2


def test_a_restarted_federation_resumes_the_round_with_its_uploads(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock, min_clients=2)
    join(fed, "a", "b")
    upload(fed, "a", 1.0)
    upload(fed, "b", 3.0)
    upload(fed, "a", 5.0)  # round 1: one of two
    # A partial upload of b's, cut off halfway.
    data = adapter_bytes(7.0)
    st = fed.status()
    h = UploadHeader("b", 1, st.round_nonce, ad.sha256_hex(data), len(data))
    _, held, gen = fed.begin_upload(h)
    fed.receive(h, gen, 0, data[:200])
    before = fed.status()
    del fed  # the process dies; only the files remain

    again = federation(tmp_path, clock, min_clients=2)
    st = again.status()
    assert (st.round, st.state, st.uploaded, st.round_nonce) == (1, State.OPEN, ("a",), before.round_nonce)
    assert st.global_sha256 == before.global_sha256
    assert again.upload_state("b", 1, h.sha256) == (200, False)
    _, held, gen = again.begin_upload(UploadHeader("b", 1, st.round_nonce, h.sha256, len(data), offset=200))
    assert held == 200
    again.receive(h, gen, 200, data[200:])
    again.finish_upload(h, gen)
    again.end_stream(h, gen)
    settle(again)
    assert again.status().round == 2
    assert torch.equal(ad.decode(again.global_adapter(2)[1])[A], torch.full((2, 3), 6.0))


def test_a_restart_with_settings_that_change_the_result_is_refused(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock)
    join(fed, "a")
    with pytest.raises(ValueError, match="same settings"):
        federation(tmp_path, clock, strategy="median")
    with pytest.raises(ValueError, match="same settings"):
        RoundKeeper(settings(params=StrategyParams(clip_norm=1.0)), Store(tmp_path, "r"), clock=clock)
    # Settings that do not change the result (deadlines, quorum) may change across a restart.
    assert federation(tmp_path, clock, round_deadline_s=5.0, min_clients=1).status().joined == ("a",)


def test_a_bad_upload_is_refused_at_the_chunk_that_shows_it_and_leaves_nothing(tmp_path):
    fed = federation(tmp_path, Clock())
    join(fed, "a")
    st = fed.status()
    wrong = ad.encode({A: torch.zeros(3, 3), B: torch.zeros(3, 2)})  # A's shape is not the run's
    h = UploadHeader("a", st.round, st.round_nonce, ad.sha256_hex(wrong), len(wrong))
    _, held, gen = fed.begin_upload(h)
    with pytest.raises(ad.AdapterError, match=r"shape \[3, 3\]"):
        fed.receive(h, gen, 0, wrong[:-8])  # the header is complete; the values are not all here yet
    assert fed.upload_state("a", st.round, h.sha256) == (0, False)
    fed.end_stream(h, gen)
    nan = ad.encode({A: torch.full((2, 3), float("nan")), B: torch.zeros(3, 2)})
    h = UploadHeader("a", st.round, st.round_nonce, ad.sha256_hex(nan), len(nan))
    _, held, gen = fed.begin_upload(h)
    with pytest.raises(ad.AdapterError, match="NaN"):
        for start in range(0, len(nan), 64):
            fed.receive(h, gen, start, nan[start:start + 64])
    fed.end_stream(h, gen)
    assert fed.status().uploaded == ()
    upload(fed, "a", 1.0)  # a good one still goes through
    assert fed.status().round == 1
