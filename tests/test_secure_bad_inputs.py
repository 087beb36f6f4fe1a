"""Secure aggregation against bad input, stage by stage, spoken with nothing but the generated stubs
and fedse.privacy.secagg's primitives (as a client written elsewhere would): each bad message is refused with
the status and a message saying what to fix, and the round goes on to the right mean."""

from __future__ import annotations

import grpc
import pytest
import torch

from fedse.model import adapter as ad
from fedse.privacy import secagg
from fedse.privacy.secagg import Member, Participant, SecureError
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from secure_party import SCHEMA, base_adapter, close_to, trained
from services.client_agent.federation.link import FederationClient
from support import aggregator_in_process

IDS = ("org-a", "org-b", "org-c")


def refused(code, match, call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    assert match in err.value.details(), err.value.details()


def wait_stage(fed: FederationClient, stage) -> fpb.RoundStatus:
    return fed.wait_until(lambda s: s.secure_stage == stage or s.state != fpb.ROUND_STATE_OPEN, timeout_s=30)


@pytest.fixture
def run(tmp_path):
    with aggregator_in_process(tmp_path, secure_aggregation=True, rounds=1, min_clients=2, start_clients=3,
                               wait_after_min_s=1.0, heartbeat_timeout_s=60.0) as (agg, port, run_dir):
        target = f"127.0.0.1:{port}"
        feds = {cid: FederationClient(target, cid, retries=1, timeout_s=30) for cid in (*IDS, "org-d")}
        for fed in feds.values():
            fed.join("maze", "fedse-tiny", SCHEMA)
        stub = fpb_grpc.FederationServiceStub(grpc.insecure_channel(target))
        yield feds, stub, run_dir
        for fed in feds.values():
            fed.close()


class Attempt:
    """The round's secure attempt as org-a, org-b and org-c play it by hand: their federation clients
    (org-d too, joined but silent), a raw stub, the attempt's nonce and context, and each one's
    secagg.Participant."""

    def __init__(self, feds: dict[str, FederationClient], stub):
        self.feds, self.stub = feds, stub
        self.a = feds["org-a"]
        st = self.a.status()
        self.nonce, self.run_id = st.round_nonce, st.run_id
        self.ctx = secagg.context(self.run_id, 0, self.nonce)
        self.me = {cid: Participant(cid, self.ctx) for cid in IDS}


def advertise_keys(t: Attempt) -> None:
    """Stage 1: bad key advertisements refused, then every member's keys advertised."""
    feds, stub, a, nonce, ctx, me = t.feds, t.stub, t.a, t.nonce, t.ctx, t.me

    def advertise(cid, nonce=t.nonce, p=None):
        p = p or me[cid]
        feds[cid].advertise_keys(0, nonce, p.sealing.public, p.masking.public, p.self_commitment)

    # ---- 1. key advertisement
    refused(grpc.StatusCode.INVALID_ARGUMENT, "encryption_key is 31 bytes", lambda: a.advertise_keys(
        0, nonce, b"x" * 31, me["org-a"].masking.public, me["org-a"].self_commitment))
    refused(grpc.StatusCode.FAILED_PRECONDITION, "another round nonce", lambda: advertise("org-a", nonce="f" * 32))
    for cid in IDS:
        advertise(cid)
    advertise("org-a")  # the same message again (a retry) is acknowledged
    refused(grpc.StatusCode.ALREADY_EXISTS, "advertised other keys",
            lambda: advertise("org-a", p=Participant("org-a", ctx)))
    wait_stage(a, fpb.SECURE_STAGE_SHARING)  # org-d, joined but silent, is not waited for past 1 s
    from apps.cli import format_status

    shown = format_status(stub.GetRunStatus(fpb.RunStatusRequest()))  # what fedse status prints
    assert f"secure aggregation: attempt {nonce[:8]} at sharing; org-a advertised, org-b advertised" in shown
    refused(grpc.StatusCode.FAILED_PRECONDITION, "stage of this attempt is over", lambda: advertise("org-a"))


def share_keys(t: Attempt) -> dict[str, Member]:
    """Stage 2: bad shares refused, then every member's shares sent; returns the roster."""
    feds, a, nonce, me = t.feds, t.a, t.nonce, t.me
    # ---- 2. shares
    sr = a.secure_round(0, nonce)
    roster = {m.client_id: Member(m.client_id, m.index, m.encryption_key, m.masking_key, m.self_mask_commitment)
              for m in sr.roster}
    assert sorted(roster) == list(IDS) and sr.threshold == 2

    def sealed(cid, to=None):
        return [fpb.SealedShare(client_id=to or r, sealed=s, self_mask_commitment=b, masking_commitment=m)
                for r, s, b, m in me[cid].shares(list(roster.values()), sr.threshold)]

    refused(grpc.StatusCode.FAILED_PRECONDITION, "not among the roster",
            lambda: feds["org-d"].share_keys(0, nonce, sealed("org-a")))  # not in the key advertisement
    wrong = sealed("org-a")
    wrong[1].client_id = "org-d"
    refused(grpc.StatusCode.INVALID_ARGUMENT, "addressed to 'org-d', who is not in this attempt's roster",
            lambda: a.share_keys(0, nonce, wrong))
    refused(grpc.StatusCode.INVALID_ARGUMENT, "no share for org-c", lambda: a.share_keys(0, nonce, sealed("org-a")[:2]))
    for cid in IDS:
        feds[cid].share_keys(0, nonce, sealed(cid))
    wait_stage(a, fpb.SECURE_STAGE_UPLOADING)
    return roster


def upload_masked(t: Attempt, roster: dict[str, Member]) -> tuple[dict, dict]:
    """Stage 3: the shares opened, bad masked uploads refused, then every member's masked adapter
    uploaded; returns the shares each member holds and the adapters they trained."""
    feds, a, nonce, me = t.feds, t.a, t.nonce, t.me
    # ---- 3. masked uploads
    held = {}
    for cid in IDS:
        sr = feds[cid].secure_round(0, nonce)
        held[cid] = {s.client_id: me[cid].open(roster[s.client_id], s.sealed) for s in sr.inbound}
        assert sorted(held[cid]) == list(IDS)
    # A share sealed for org-b does not open for org-a.
    for_b = next(s for s in feds["org-b"].secure_round(0, nonce).inbound if s.client_id == "org-c")
    with pytest.raises(SecureError, match="was not sealed for org-a"):
        me["org-a"].open(roster["org-c"], for_b.sealed)
    layout = secagg.Layout.of(SCHEMA, "fedavg")
    adapters = {cid: trained(i) for i, cid in enumerate(IDS)}
    masked = {cid: secagg.pack_u64(me[cid].mask(layout.encode(adapters[cid], 1), roster.values())) for cid in IDS}

    def upload(cid, data, who=None):
        (who or feds[cid]).upload(0, data, 0, 0, transport_dtype=secagg.MASKED_DTYPE, round_nonce=nonce,
                                  follow_nonce=False)

    refused(grpc.StatusCode.INVALID_ARGUMENT, f"this run's masked vectors are {layout.length} uint64 values",
            lambda: upload("org-a", masked["org-a"][:-8]))
    refused(grpc.StatusCode.FAILED_PRECONDITION, "not among those who shared keys",
            lambda: upload("org-a", masked["org-a"], who=feds["org-d"]))
    refused(grpc.StatusCode.INVALID_ARGUMENT, "send 0 for both", lambda: a.upload(  # a weight in the clear
        0, masked["org-a"], 0, 3, transport_dtype=secagg.MASKED_DTYPE, round_nonce=nonce, follow_nonce=False))
    for cid in IDS:
        upload(cid, masked[cid])
    wait_stage(a, fpb.SECURE_STAGE_UNMASKING)
    return held, adapters


def reveal_shares(t: Attempt, held: dict) -> None:
    """Stage 4: bad reveals refused, then two of three members reveal (the threshold) and the round
    closes; a reveal replayed after that is refused."""
    feds, stub, a, nonce = t.feds, t.stub, t.a, t.nonce
    # ---- 4. unmasking

    def reveal(cid, tamper=None):
        out = [fpb.RevealedShare(client_id=v, kind=fpb.SHARE_KIND_SELF_MASK, share=held[cid][v][0]) for v in IDS]
        if tamper:
            tamper(out)
        return out

    def flip(out):
        out[2].share = bytes([out[2].share[0] ^ 1]) + out[2].share[1:]

    def others(out):  # the share org-c dealt to org-b, shown by org-a
        out[2].share = held["org-b"]["org-c"][0]

    def both(out):
        out.append(fpb.RevealedShare(client_id="org-c", kind=fpb.SHARE_KIND_MASKING, share=held["org-a"]["org-c"][1]))

    unmask = a.unmask
    refused(grpc.StatusCode.INVALID_ARGUMENT, "the self share of org-c that org-a reveals is not the one",
            lambda: unmask(0, nonce, reveal("org-a", flip)))
    refused(grpc.StatusCode.INVALID_ARGUMENT, "the self share of org-c that org-a reveals is not the one",
            lambda: unmask(0, nonce, reveal("org-a", others)))
    refused(grpc.StatusCode.INVALID_ARGUMENT, "org-c's masking share is not asked for",
            lambda: unmask(0, nonce, reveal("org-a", both)))
    refused(grpc.StatusCode.INVALID_ARGUMENT, "has no kind", lambda: stub.Unmask(fpb.UnmaskRequest(
        client_id="org-a", round=0, round_nonce=nonce, shares=[fpb.RevealedShare(client_id="org-b")])))
    refused(grpc.StatusCode.FAILED_PRECONDITION, "not among the uploaders",
            lambda: feds["org-d"].unmask(0, nonce, reveal("org-a")))
    a.unmask(0, nonce, reveal("org-a"))
    feds["org-b"].unmask(0, nonce, reveal("org-b"))  # two of three: the threshold
    st = a.wait_until(lambda s: s.round == 1 or s.state == fpb.ROUND_STATE_FINISHED, timeout_s=30)
    refused(grpc.StatusCode.FAILED_PRECONDITION, "another round nonce",
            lambda: feds["org-c"].unmask(0, nonce, reveal("org-c")))  # replayed after the round closed


def test_every_stage_refuses_bad_input_and_the_round_goes_on(run):
    feds, stub, run_dir = run
    attempt = Attempt(feds, stub)
    advertise_keys(attempt)
    roster = share_keys(attempt)
    held, adapters = upload_masked(attempt, roster)
    reveal_shares(attempt, held)
    a, me = attempt.a, attempt.me
    glob = ad.decode(a.download(1).data)
    for name in base_adapter():
        want = sum(adapters[c][name].double() for c in IDS) / 3
        assert close_to(glob[name], want), name
    for p in me.values():
        p.wipe()


def test_a_masked_vector_of_values_out_of_range_cannot_be_made():
    layout = secagg.Layout.of(SCHEMA, "fedavg")
    bad = {k: v.clone() for k, v in base_adapter().items()}
    next(iter(bad.values()))[0, 0] = float("nan")
    with pytest.raises(SecureError, match="not finite"):
        layout.encode(bad, 1)
    next(iter(bad.values()))[0, 0] = 5000.0
    with pytest.raises(SecureError, match="within ±4096"):
        layout.encode(bad, 1)


def test_a_sum_with_a_mask_left_in_is_caught_by_its_count():
    layout = secagg.Layout.of(SCHEMA, "weighted")
    assert layout.length == sum(t.numel() for t in base_adapter().values()) + 2  # [w*x, w, count]
    ctx = secagg.context("t", 0, "n")
    p = Participant("org-a", ctx)
    total = p.mask(layout.encode(base_adapter(), 2), [])  # its self mask never removed
    with pytest.raises(SecureError, match="a mask was not removed"):
        layout.decode_mean(total, 1)
    clean = layout.decode_mean(layout.encode(base_adapter(), 2), 1)
    assert all(torch.allclose(clean[k], v.double()) for k, v in base_adapter().items())


def test_the_schema_of_a_secure_run_must_be_floating():
    schema = ad.Schema.of({"a": torch.zeros(2, dtype=torch.int64)}, "{}")
    with pytest.raises(SecureError, match="floating tensors only"):
        secagg.Layout.of(schema, "fedavg")
    with pytest.raises(SecureError, match="cannot work on a masked sum"):
        secagg.Layout.of(SCHEMA, "median")
