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
and the first attack run on a client agent process as organisations run it.

A round's sum released once, and the smaller checks: tests/test_secure_lying_release.py."""

from __future__ import annotations

import logging
import math
import threading
import time
import types

import grpc
import pytest

from fedse.model import adapter as ad
from fedse.privacy import masking
from fedse.privacy import secagg
from fedse.security import signatures
from fedse.v1 import federation_pb2 as fpb
from lying_aggregator import at_least, lying_aggregator
from lying_federation import assert_published, federation, finish, mean_of, refused
from secure_party import Party
from services.client_agent.federation.secure import Protection
from support import Pki, env_server_in_process


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


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
