"""Secure aggregation against an aggregator that lies, run as an attacker would run it: the real
aggregator behind a servicer that edits its answers (lying_aggregator.py), talking real gRPC to fedse's
real client code. Each attack that recovered a client's adapter before is refused before the victim
uploads or reveals anything, with the reason:
- a client told that nobody else shared keys (it would mask with its self mask alone);
- a threshold below the client's floor (two groups shown different uploader lists could then give
  both seeds of one client);
- keys of the aggregator's own in place of other members' (signed keys catch them);
- two uploader lists shown to two groups (the consistency stage catches them);
- a masking graph in pieces after dropouts (both the aggregator and every client refuse to unmask);
and a round's sum is released once: a client that masked a wrong count makes the round close without an
update, never a second attempt, and a client's noised values are the same in every attempt."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
import types

import grpc
import numpy as np
import pytest
import torch

from fedse.model import adapter as ad
from fedse.privacy import masking
from fedse.privacy import secagg
from fedse.security import signatures
from fedse.config import ConfigError
from fedse.v1 import federation_pb2 as fpb
from lying_aggregator import at_least, lying_aggregator
from secure_party import Party, close_to
from services.aggregator import metrics
from services.aggregator.server import AggregatorConfig
from services.client_agent.federation.secure import Protection, ReleaseBook
from support import Pki, env_server_in_process


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def mtls(pki: Pki) -> dict:
    return {"tls_ca": pki.ca_pem, "tls_cert": pki.server[0], "tls_key": pki.server[1]}


@contextlib.contextmanager
def federation(tmp_path, n: int, pki: Pki | None = None, parties: dict | None = None, **settings):
    """A lying aggregator (signed keys over mTLS where `pki` is given) and `n` joined parties org-0..;
    `parties` maps an index to extra Party settings."""
    over = {**(mtls(pki) if pki else {}), **settings}
    with lying_aggregator(tmp_path / "agg", start_clients=n, **over) as (agg, port, run_dir, liar):
        target = f"127.0.0.1:{port}"
        made = []
        for i in range(n):
            kw = {**(parties or {}).get(i, {})}
            made.append(Party.signed(target, f"org-{i}", 100 + i, pki, **kw) if pki else
                        Party(target, f"org-{i}", 100 + i, **kw))
        made = [p.join() for p in made]
        try:
            yield agg, liar, made
        finally:
            for p in made:
                p.close()


def finish(parties, timeout=60.0):
    threads = [p.start() for p in parties]
    for t in threads:
        t.join(timeout)
    return [p.result for p in parties]


def mean_of(parties) -> dict[str, torch.Tensor]:
    return {k: sum(p.adapter[k].double() for p in parties) / len(parties) for k in parties[0].adapter}


def assert_published(party, want, round_=1):
    glob = ad.decode(party.fed.download(round_).data)
    for name, t in want.items():
        assert close_to(glob[name], t), name


def refused(result, *words: str) -> bool:
    return isinstance(result, secagg.SecureError) and all(w in str(result) for w in words)


# ---- the honest path with signed keys ------------------------------------------------------------
def test_signed_keys_and_the_consistency_stage_publish_the_mean(tmp_path, pki):
    with federation(tmp_path, 4, pki) as (agg, liar, parties):
        assert parties[0].config.secure_signed
        assert finish(parties) == [True] * 4
        assert_published(parties[0], mean_of(parties))
        assert all(p.steps[:4] == ["advertised", "shared", "uploaded", "signed"] for p in parties)
        # The unmasking closes as soon as the threshold (3 of 4 with signed keys) revealed.
        assert len(set(liar.unmasked_by)) >= 3


def test_the_aggregator_refuses_keys_signed_by_another_or_not_signed(tmp_path, pki):
    with federation(tmp_path, 2, pki) as (agg, liar, parties):
        a, b = parties
        st = a.fed.status()
        me = secagg.Participant("org-0", secagg.context("t", 0, st.round_nonce))
        signed_b = Protection.of(0.5, pki.ca_pem, *pki.issue(pki.ca, "org-1", "org-1")).signer
        message = signatures.advertisement(me.ctx, "org-0", me.sealing.public, me.masking.public, me.self_commitment)
        attempts = {
            "not signed": (b"", b""),
            "signed by org-1": (a.protection.signer.der, signed_b.sign(message)),
            "org-1's certificate": (signed_b.der, signed_b.sign(message)),
            "a certificate from another CA": (Protection.of(0.5, pki.ca_pem, *pki.stranger).signer.der,
                                              a.protection.signer.sign(message)),
        }
        for what, (cert, sig) in attempts.items():
            with pytest.raises(grpc.RpcError) as err:
                a.fed.stub.AdvertiseKeys(fpb.AdvertiseKeysRequest(
                    client_id="org-0", round=0, round_nonce=st.round_nonce, encryption_key=me.sealing.public,
                    masking_key=me.masking.public, self_mask_commitment=me.self_commitment, certificate=cert,
                    signature=sig), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert "secure_signed" in err.value.details(), what


# ---- the attacks -------------------------------------------------------------------------------------
def told_alone(victim: str):
    """A lie: the victim is shown that nobody but itself shared keys (and only its own shares)."""
    def lie(cid, sr):
        if cid == victim and at_least(fpb.SECURE_STAGE_UPLOADING)(sr):
            sr.ClearField("shared")
            sr.shared.append(victim)
            own = [s for s in sr.inbound if s.client_id == victim]
            sr.ClearField("inbound")
            sr.inbound.extend(own)
    return lie


def test_a_client_told_it_is_alone_masks_nothing(tmp_path):
    """The aggregator tells org-0 alone that nobody else shared keys: org-0 would mask with its self mask
    only, whose shares the others would then reveal. It refuses; the others' round goes on without it."""
    with federation(tmp_path, 4) as (agg, liar, parties):
        liar.secure_lies.append(told_alone("org-0"))
        results = finish(parties)
        assert refused(results[0], "1 of this client's neighbourhood shared keys", "fewer than the threshold of 3")
        assert results[1:] == [True] * 3
        assert "org-0" not in liar.uploaders and "org-0" not in liar.unmasked_by
        assert_published(parties[1], mean_of(parties[1:]))


@pytest.mark.parametrize("threshold, min_threshold, need", [(2, 0.5, "3 to 5"), (3, 0.66, "4 to 5")])
def test_a_threshold_below_the_client_s_own_floor_is_refused(tmp_path, threshold, min_threshold, need):
    """A threshold of 2 lets two groups, shown different uploader lists, reveal both seeds of one client.
    The client's floor is its own setting: a majority at least, more where its organisation says so."""
    def low(cid, sr):
        if cid == "org-0" and at_least(fpb.SECURE_STAGE_SHARING)(sr):
            sr.threshold = threshold

    with federation(tmp_path, 5, parties={0: {"protection": Protection(min_threshold)}}) as (agg, liar, parties):
        liar.secure_lies.append(low)
        results = finish(parties)
        assert refused(results[0], f"threshold of {threshold} in a neighbourhood of 5", f"requires {need}")
        assert parties[0].steps == ["advertised"]  # no share dealt, nothing masked
        assert results[1:] == [True] * 4 and "org-0" not in liar.uploaders


def swap_keys(cid, sr):  # the aggregator's own keys in place of org-1's
    for m in sr.roster:
        if m.client_id == "org-1":
            m.encryption_key = masking.KeyPair(masking.Secret()).public
            m.masking_key = masking.KeyPair(masking.Secret()).public


def swap_certificate(pki):
    mallory = Protection.of(0.5, pki.ca_pem, *pki.issue(pki.ca, "mallory", "mallory")).signer

    def lie(cid, sr):
        for m in sr.roster:
            if m.client_id == "org-1":
                m.encryption_key = masking.KeyPair(masking.Secret()).public
                ctx = secagg.context("t", 0, sr.round_nonce)
                m.certificate = mallory.der
                m.signature = mallory.sign(signatures.advertisement(ctx, "org-1", m.encryption_key, m.masking_key,
                                                                    m.self_mask_commitment))
    return lie


def replace_own(cid, sr):
    for m in sr.roster:
        if m.client_id == "org-0":
            m.masking_key = masking.KeyPair(masking.Secret()).public


def duplicate(cid, sr):
    keys = {m.client_id: m for m in sr.roster}
    keys["org-2"].masking_key = keys["org-1"].masking_key


@pytest.mark.parametrize("lie, reason", [
    (swap_keys, "org-1's signature of its keys does not verify"),
    ("certificate", "the certificate given for org-1 names 'mallory'"),
    (replace_own, "the roster's entry for this client holds keys that are not its own"),
    (duplicate, "two roster entries share a key"),
])
def test_keys_put_in_another_member_s_place_are_refused(tmp_path, pki, lie, reason):
    lie = swap_certificate(pki) if lie == "certificate" else lie

    def to_org0(cid, sr):
        if cid == "org-0" and at_least(fpb.SECURE_STAGE_SHARING)(sr):
            lie(cid, sr)

    with federation(tmp_path, 4, pki) as (agg, liar, parties):
        liar.secure_lies.append(to_org0)
        results = finish(parties)
        assert refused(results[0], reason, "will not take part")
        assert parties[0].steps == ["advertised"] and "org-0" not in liar.uploaders
        assert results[1:] == [True] * 3


def test_two_uploader_lists_are_caught_by_the_consistency_stage(tmp_path, pki):
    """Group A (org-0, the victim, and org-1) is shown every upload; group B (org-2..4) a list without
    org-0, so that A would reveal org-0's self-mask shares and B its masking shares. Each group signs the
    list it saw; neither holds the threshold (4 of 5) of signatures over its list, so nobody reveals."""
    group_b = {"org-2", "org-3", "org-4"}

    def two_lists(cid, sr):
        if cid in group_b and at_least(fpb.SECURE_STAGE_CONSISTENCY)(sr):
            kept = [c for c in sr.uploaded if c != "org-0"]
            sr.ClearField("uploaded")
            sr.uploaded.extend(kept)

    def take_b(req):  # B's signatures are over another list: the liar keeps them without the desk's checks
        if req.client_id not in group_b:
            return False
        with agg.federation._cond:
            agg.federation.secure.attempt.signed[req.client_id] = req.signature
        return True

    with federation(tmp_path, 5, pki, secure_stage_timeout_s=4.0) as (agg, liar, parties):
        liar.secure_lies.append(two_lists)
        liar.consistency_takeover = take_b
        results = finish(parties)
        assert all(refused(r, "signed the uploader list it was shown", "fewer than the threshold of 4")
                   for r in results), results
        assert liar.unmasked_by == []
        assert all(p.steps[-1] == "signed" for p in parties)
        # The attempt reached unmasking: each booked the round, revealing or not (the others' shares could
        # unmask its upload), and takes part in no later attempt of it.
        assert all(p.protection.book.has("t", 0) for p in parties)


def split_ring(agg, k: int):
    """hold_if for parties: after sharing, the members at two runs of ceil(k/2) consecutive places of the
    ring stop, which splits the ring of those who go on to upload in two."""
    chosen: list[set[str]] = []
    lock = threading.Lock()

    def hold(party, step):
        if step != "shared":
            return False
        with lock:
            if not chosen:
                a = agg.federation.secure.attempt
                order = secagg.ring(sorted(a.roster), a.context, secagg.roster_digest(a.context, a.roster.values()))
                h, n = math.ceil(k / 2), len(order)
                chosen.append(set(order[:h]) | set(order[n // 2:n // 2 + h]))
            return party.client_id in chosen[0]
    return hold, chosen


def sparse_parties(n: int) -> dict:
    """Parties that expect as few dropouts as the aggregator is told (0.1 %): each accepts its ring."""
    return {i: {"protection": Protection(min_colluders=0, dropout_rate=0.001)} for i in range(n)}


RINGS = [(2, 8), (4, 10)]  # (neighbours, clients): every survivor keeps the threshold; only the split is wrong


@pytest.mark.parametrize("k, n", RINGS)
def test_an_aggregator_aborts_an_attempt_whose_ring_is_split(tmp_path, caplog, k, n):
    caplog.set_level(logging.WARNING, logger="aggregator")

    def abandoned() -> list[str]:
        return [str(getattr(r, "fields", "")) for r in caplog.records if "secure attempt abandoned" in r.getMessage()]

    with federation(tmp_path, n, secure_neighbours=k, secure_max_roster=n, secure_dropout_rate=0.001,
                    parties=sparse_parties(n)) as (agg, liar, parties):
        hold, chosen = split_ring(agg, k)
        for p in parties:
            p.hold_if = hold
        for p in parties:
            p.start()
        deadline = time.monotonic() + 60
        while not abandoned() and time.monotonic() < deadline:
            time.sleep(0.05)
        revealed = list(liar.unmasked_by)  # before a next attempt, of the survivors alone, may begin
        assert abandoned() and "masking graph is in 2 pieces" in abandoned()[0]
        assert revealed == [] and len(chosen[0]) == 2 * math.ceil(k / 2)


@pytest.mark.parametrize("k, n", RINGS)
def test_clients_refuse_to_unmask_a_split_ring_the_aggregator_would_unmask(tmp_path, monkeypatch, k, n):
    import services.aggregator.secure as desk_module

    # An aggregator that leaves out its own check of the graph: only the clients' check stands.
    blind = {name: getattr(secagg, name) for name in dir(secagg) if not name.startswith("__")}
    blind["parts"] = lambda members, graph: [sorted(members)]
    monkeypatch.setattr(desk_module, "secagg", types.SimpleNamespace(**blind))
    with federation(tmp_path, n, secure_neighbours=k, secure_max_roster=n, secure_dropout_rate=0.001,
                    parties=sparse_parties(n)) as (agg, liar, parties):
        hold, chosen = split_ring(agg, k)
        for p in parties:
            p.hold_if = hold
        threads = {p.client_id: p.start() for p in parties}
        deadline = time.monotonic() + 60
        while not chosen and time.monotonic() < deadline:
            time.sleep(0.05)
        uploaders = [p for p in parties if p.client_id not in chosen[0]]
        for p in uploaders:
            threads[p.client_id].join(60)
        assert len(uploaders) == n - 2 * math.ceil(k / 2)
        assert all(refused(p.result, "masking graph is in 2 pieces", "reveals nothing") for p in uploaders), \
            [p.result for p in uploaders]
        assert liar.unmasked_by == []


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


# ---- a real client agent process -------------------------------------------------------------------
def test_a_client_agent_process_told_it_is_alone_masks_nothing(tmp_path):
    """The attack on a client agent as organisations run it (`fedse client`, the tiny model, a maze env
    server): it trains, is told nobody else shared keys, uploads nothing, says why in its log and goes
    on; the two other members' round closes with their mean."""
    import os
    import subprocess
    import sys

    from services.client_agent.model import loading as mdl
    from fedse.model.tinymodel import TINY_MODEL_NAME

    peft = mdl.add_lora(mdl.load_base(TINY_MODEL_NAME, "cpu", seed=0)[0])
    base = {k: v.detach().clone() for k, v in mdl.get_adapter_state(peft).items()}
    schema = ad.Schema.of(base, mdl.adapter_config_json(peft))

    with env_server_in_process() as env_target, \
            lying_aggregator(tmp_path / "agg", start_clients=3, min_clients=3) as (agg, port, run_dir, liar):
        liar.secure_lies.append(told_alone("org-a"))
        target = f"127.0.0.1:{port}"
        parties = [Party(target, f"org-{i}", 100 + i, schema=schema, base=base).join() for i in range(2)]
        threads = [p.start() for p in parties]
        out = subprocess.run(
            [sys.executable, "-m", "apps.cli", "client", "--client-id", "org-a", "--env", "maze",
             "--aggregator", target, "--env-server", env_target, "--state-dir", str(tmp_path / "c"),
             "--metrics-port", "-1", "--address", "127.0.0.1:0", "--expert-demos", "1", "--explore-tasks", "0",
             "--eval-tasks", "1", "--epochs", "1", "--torch-threads", "1", "--secure-tolerate-colluders", "0"],
            capture_output=True, text=True, timeout=240, env={**os.environ})
        for t in threads:
            t.join(60)
        assert out.returncode == 0, out.stderr[-3000:]
        log = out.stdout + out.stderr
        assert "sits this round out of secure aggregation" in log and "fewer than the threshold of 2" in log
        assert "org-a" not in liar.uploaders and "org-a" not in liar.unmasked_by
        assert [p.result for p in parties] == [True, True]
        assert_published(parties[0], mean_of(parties))
        for p in parties:
            p.close()
