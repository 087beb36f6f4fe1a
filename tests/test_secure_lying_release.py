"""Secure aggregation against an aggregator that lies (lying_aggregator.py, real gRPC, fedse's real
client code): a round's sum is released once. A client that masked a wrong count makes the round
close without an update, never a second attempt, even across a restart while unmasking; a client's
noised values are the same in every attempt, and one that revealed takes part in no other attempt
of the round. Then the smaller checks: the roster is capped, a dishonest dealer is named on receipt,
a weight out of range is refused before any stage, framing keeps parts apart, noise comes from a
cryptographic stream, the ring order is drawn from the roster's keys and a ring below the safe
neighbour count is refused.

The attacks that recovered a client's adapter before: tests/test_secure_lying.py."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from fedse.model import adapter as ad
from fedse.privacy import masking
from fedse.privacy import secagg
from fedse.config import ConfigError
from fedse.v1 import federation_pb2 as fpb
from lying_federation import assert_published, federation, finish, mean_of, refused
from secure_party import Party
from services.aggregator import metrics
from services.aggregator.server import AggregatorConfig
from services.client_agent.federation.secure import Protection, ReleaseBook


# ---- one sample per round ------------------------------------------------------------------------
def test_a_sum_that_does_not_decode_closes_the_round_without_an_update_and_no_second_attempt(tmp_path):
    withheld, aborted = metrics.SECURE_ROUNDS_WITHHELD._value.get(), \
        sum(metrics.SECURE_ATTEMPTS_ABORTED.labels(s)._value.get() for s in ("advertising", "sharing", "uploading",
                                                                             "consistency", "unmasking"))
    with federation(tmp_path, 3, parties={2: {"miscount": True}}) as (agg, liar, parties):
        nonces = []
        watcher = threading.Thread(target=lambda: parties[0].fed.wait_until(
            lambda s: nonces.append(s.round_nonce) or s.state == fpb.ROUND_STATE_FINISHED, timeout_s=60), daemon=True)
        watcher.start()
        assert finish(parties) == [True] * 3
        watcher.join(10)
        glob1 = parties[0].fed.download(1).data
        assert bytes(glob1) == bytes(parties[0].fed.download(0).data), "the global adapter is unchanged"
        assert len({n for n in nonces if n}) == 1, "one attempt only"
        assert len(set(liar.unmasked_by)) >= 2  # the threshold revealed: the sum was unmasked
        assert not list((tmp_path / "agg" / "t").glob("uploads/round_0000/*.masked"))
    assert metrics.SECURE_ROUNDS_WITHHELD._value.get() == withheld + 1
    assert sum(metrics.SECURE_ATTEMPTS_ABORTED.labels(s)._value.get() for s in (
        "advertising", "sharing", "uploading", "consistency", "unmasking")) == aborted


@pytest.mark.parametrize("mean_saved", [False, True])
def test_a_restart_while_unmasking_never_starts_another_attempt(tmp_path, mean_saved):
    """Stopped after it began removing masks: the round closes with phi_0 unchanged, or, where the
    unmasked mean was saved before the stop, with that mean; never with a new attempt."""
    from services.aggregator.server import create_server

    from lying_aggregator import secure_settings
    from secure_party import trained

    cfg = AggregatorConfig(address="127.0.0.1:0", metrics_port=-1, state_dir=str(tmp_path), run_id="t",
                           torch_threads=0, **secure_settings(start_clients=2, rounds=2))
    agg, port = create_server(cfg)
    agg.start()
    parties = [Party(f"127.0.0.1:{port}", f"org-{i}", 100 + i).join() for i in range(2)]
    for p in parties:
        p.close()
    keeper = agg.federation
    with keeper._cond:  # the state it saves just before it removes a round's masks
        keeper.run.released = keeper.run.round
        keeper._persist_locked()
    mean = ad.encode(trained(7))
    if mean_saved:
        keeper.globals.save(1, mean, keeper.run.adapter_config())
    want = mean if mean_saved else bytes(keeper.globals.get(0)[0])
    agg.stop(0)
    again, _ = create_server(cfg)
    try:
        st = again.federation.status()
        assert st.round == 1 and st.state.value == "open"
        assert bytes(again.federation.globals.get(1)[0]) == bytes(want)
    finally:
        again.stop(0)


def test_a_client_s_noised_vector_is_the_same_in_every_attempt(tmp_path, monkeypatch):
    encoded: dict[str, list[str]] = {}
    real_encode = secagg.Layout.encode

    def recording(self, adapter, weight):
        out = real_encode(self, adapter, weight)
        encoded.setdefault(threading.current_thread().name, []).append(hashlib.sha256(out.tobytes()).hexdigest())
        return out

    monkeypatch.setattr(secagg.Layout, "encode", recording)
    with federation(tmp_path, 3, clip_norm=1.0, noise_multiplier=0.5) as (agg, liar, parties):
        desk = agg.federation.secure
        real_advance, forced = desk.advance, []

        def advance(accepted, now):  # the first attempt is abandoned once every masked upload is in
            if desk.attempt.stage.value == "uploading" and not forced:
                forced.append(True)
                real_advance(accepted, now)
                return "abandoned by the test after the uploads"
            return real_advance(accepted, now)

        desk.advance = advance
        assert finish(parties) == [True] * 3
    assert forced and sorted(encoded) == [f"party-org-{i}" for i in range(3)]
    for name, hashes in encoded.items():
        assert len(hashes) == 2 and hashes[0] == hashes[1], name
    unnoised = hashlib.sha256(real_encode(secagg.Layout.of(parties[0].schema, "fedavg"), secagg.clip_and_noise(
        parties[0].adapter, parties[0].base, 1.0, 0.0), 1).tobytes()).hexdigest()
    assert encoded["party-org-0"][0] != unnoised, "noise was added"


def test_a_client_that_revealed_takes_part_in_no_other_attempt_of_the_round(tmp_path):
    book = ReleaseBook(tmp_path / "released.json")
    book.mark("t", 0)
    assert ReleaseBook(tmp_path / "released.json").has("t", 0)  # a restarted client remembers
    assert not book.has("t", 1) and not book.has("other-run", 0)
    remembered = Protection(book=ReleaseBook(tmp_path / "released.json"))
    with federation(tmp_path, 2, parties={0: {"protection": remembered}}) as (agg, liar, parties):
        parties[0].start().join(30)
        assert refused(parties[0].result, "already revealed shares", "round 0")
        assert parties[0].steps == []


# ---- smaller checks ------------------------------------------------------------------------------------
def test_the_roster_is_capped(tmp_path):
    with federation(tmp_path, 4, secure_max_roster=3, wait_after_min_s=1.0) as (agg, liar, parties):
        results = finish(parties)
        members = [p for p in parties if "advertised" in p.steps and "shared" in p.steps]
        assert len(members) == 3 and [r for p, r in zip(parties, results) if p in members] == [True] * 3
        assert_published(parties[0], mean_of(members))


def test_a_dishonest_dealer_is_named_on_receipt(tmp_path, monkeypatch):
    real_shares = secagg.Participant.shares

    def dishonest(self, roster, t):
        out = real_shares(self, roster, t)
        if self.client_id == "org-0":  # commitments that are not of the shares sealed
            out = [(to, sealed, bytes(32), s) for to, sealed, b, s in out]
        return out

    monkeypatch.setattr(secagg.Participant, "shares", dishonest)
    with federation(tmp_path, 3, secure_stage_timeout_s=3.0) as (agg, liar, parties):
        results = finish(parties)
        assert all(refused(r, "the shares org-0 dealt to this client do not match their commitments") for r in results[1:])
        assert "org-1" not in liar.uploaders and "org-2" not in liar.uploaders


def test_a_weight_out_of_range_is_refused_before_any_stage(tmp_path):
    with federation(tmp_path, 3, strategy="weighted", wait_after_min_s=1.0,
                    parties={2: {"successes": 5000}}) as (agg, liar, parties):
        results = finish(parties)
        assert refused(results[2], "its weight 5000") and parties[2].steps == []
        assert results[:2] == [True, True]


def test_framing_keeps_parts_apart():
    assert masking.frame("a|b", "c") != masking.frame("a", "b|c")
    assert secagg.context("run|1", 0, "n") != secagg.context("run", 1, "0|n")
    assert secagg.commitment(b"c", "self", "a|b", "", b"x" * 16) != secagg.commitment(b"c", "self", "a", "b", b"x" * 16)


def test_noise_comes_from_a_cryptographic_stream():
    key = bytes(range(32))
    assert np.array_equal(masking.gaussian(1001, 2.0, key), masking.gaussian(1001, 2.0, key))
    x = masking.gaussian(200_000, 2.0)
    assert abs(x.mean()) < 0.03 and abs(x.std() - 2.0) < 0.03 and x.size == 200_000
    assert not np.array_equal(x[:100], masking.gaussian(100, 2.0))


def test_the_ring_order_is_drawn_from_the_roster_s_keys():
    """The aggregator picks the nonce before clients make their keys: the order it gets then depends on
    keys it has not seen, so no search over nonces seats chosen members around a client."""
    ctx = secagg.context("t", 0, "the-nonce")
    ids = [f"org-{i:02d}" for i in range(20)]
    orders = set()
    for _ in range(5):
        roster = [secagg.Member(c, i + 1, masking.KeyPair(masking.Secret()).public,
                                masking.KeyPair(masking.Secret()).public, bytes(32)) for i, c in enumerate(ids)]
        orders.add(tuple(secagg.ring(ids, ctx, secagg.roster_digest(ctx, roster))))
    assert len(orders) == 5


def test_a_ring_below_the_safe_neighbour_count_is_refused():
    assert secagg.min_neighbours(1024, 0.05) == 7 and secagg.min_neighbours(8, 0.001) == 2
    with pytest.raises(ConfigError, match="--secure-neighbours 4 is too few for a roster of up to 1024 clients"):
        AggregatorConfig(secure_aggregation=True, secure_neighbours=4, metrics_port=-1)
    AggregatorConfig(secure_aggregation=True, secure_neighbours=8, metrics_port=-1)
    AggregatorConfig(secure_aggregation=True, secure_neighbours=4, secure_max_roster=20, secure_dropout_rate=0.01,
                     metrics_port=-1)


def test_parts_and_floor():
    graph = {"a": frozenset("ab"), "b": frozenset("abc"), "c": frozenset("bc"), "d": frozenset("d")}
    assert secagg.parts(["a", "b", "c", "d"], graph) == [["a", "b", "c"], ["d"]]
    assert secagg.parts(["a", "c"], graph) == [["a"], ["c"]]
    assert [secagg.floor(n, 0.5) for n in (3, 4, 5)] == [2, 3, 3]
    assert [secagg.floor(n, 0.66) for n in (3, 5, 20, 100)] == [2, 4, 14, 67]
    assert all(secagg.floor(n, 0.66) <= secagg.threshold(0, n, signed=True) for n in range(2, 1025))
    assert secagg.threshold(0, 5, signed=True) == 4 and secagg.threshold(0, 5) == 3
