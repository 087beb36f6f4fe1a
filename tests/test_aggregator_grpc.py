"""The aggregator over real gRPC on port 0: rounds, averaging, PEFT export, bad uploads refused,
joins with another schema or dtype spelling refused or taken, secure and asynchronous rounds."""

import json
import struct
import time

import grpc
import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict

from aggregator_support import (A_NAME, B_NAME, _join_raw, aggregator, join_two, peft_model,  # noqa: F401 - fixtures
                                perturbed, raw_upload)
from fedse.model import adapter as ad
from fedse.model.tinymodel import TINY_MODEL_NAME, build_tiny_model
from fedse.transport import serde
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from support import aggregator_in_process
from services.client_agent.federation.link import FederationClient


def test_two_clients_two_rounds_average_and_peft_export(aggregator, peft_model):
    agg, target, run_dir = aggregator
    pm, state, config_json = peft_model
    c1, c2 = join_two(target, state, config_json)

    g0 = c1.download(0)
    fresh = ad.decode(g0.data)
    assert set(fresh) == set(state)
    assert all(torch.count_nonzero(v) == 0 for k, v in fresh.items() if "lora_B" in k)

    uploads = {}
    for rnd in range(2):
        start = ad.decode(c1.download(rnd).data)
        for i, c in enumerate((c1, c2)):
            mine = perturbed(start, seed=10 * rnd + i)
            uploads[(rnd, c.client_id)] = mine
            ack = c.upload(rnd, ad.encode(mine), num_examples=5, num_successes=i + 1)
            assert ack.round == rnd
        st = c1.wait_until(lambda s: s.round > rnd, timeout_s=10)
        assert st.round == rnd + 1

    assert c1.status().state == fpb.ROUND_STATE_FINISHED
    final = c2.download(2)
    got = ad.decode(final.data)
    for k in got:
        expected = (uploads[(1, "org-a")][k].double() + uploads[(1, "org-b")][k].double()) / 2
        assert torch.allclose(got[k].double(), expected, atol=1e-7), k

    # The exported directory is a standard PEFT adapter: stock from_pretrained, nothing missing.
    export = run_dir / "global" / "round_0002"
    base, _ = build_tiny_model(seed=0)
    loaded = PeftModel.from_pretrained(base, str(export))
    loaded_state = get_peft_model_state_dict(loaded, save_embedding_layers=False)
    assert set(loaded_state) == set(got)
    for k in got:
        assert torch.equal(loaded_state[k], got[k])
    assert json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"] == TINY_MODEL_NAME
    c1.close(), c2.close()


class RawUploads:
    """org-a's raw uploads for round 0 of the adapter `good`: headers to vary, refusals to check, and
    what the aggregator holds of an upload."""

    def __init__(self, client: FederationClient, good: bytes):
        self.client, self.good, self.sha = client, good, ad.sha256_hex(good)
        self.nonce = client.status().round_nonce

    def header(self, **kw):
        base = dict(client_id="org-a", round=0, round_nonce=self.nonce, sha256=self.sha, size=len(self.good),
                    num_examples=1, num_successes=1)
        base.update(kw)
        return fpb.AdapterHeader(**base)

    def refused(self, code, hdr, parts, match):
        with pytest.raises(grpc.RpcError) as err:
            raw_upload(self.client, hdr, parts)
        assert err.value.code() == code, err.value.details()
        assert match in err.value.details()

    def held(self, sha256=None):
        return self.client.stub.GetUploadState(fpb.UploadStateRequest(client_id="org-a", round=0,
                                                                       sha256=sha256 or self.sha))


def refuse_bad_adapters_and_headers(up: RawUploads, state: ad.Adapter) -> None:
    """An adapter that is not what its header says, or not a valid one, and a header for another
    round, run or client or out of bounds: each refused with its reason, leaving nothing behind."""
    refused, header, held, good = up.refused, up.header, up.held, up.good
    refused(grpc.StatusCode.INVALID_ARGUMENT, header(sha256="ab" * 32), [good], "sha256 mismatch")
    assert held("ab" * 32).received_bytes == 0  # a bad upload leaves nothing behind
    wrong = dict(state)
    key = next(k for k in wrong if "lora_A" in k)
    wrong[key] = torch.zeros(wrong[key].shape[0] + 1, wrong[key].shape[1])
    wb = ad.encode(wrong)
    refused(grpc.StatusCode.INVALID_ARGUMENT, header(sha256=ad.sha256_hex(wb), size=len(wb)), [wb], "shape")
    nan = dict(state)
    nan[key] = torch.full(state[key].shape, float("nan"))
    nb = ad.encode(nan)
    refused(grpc.StatusCode.INVALID_ARGUMENT, header(sha256=ad.sha256_hex(nb), size=len(nb)), [nb], "NaN")
    refused(grpc.StatusCode.FAILED_PRECONDITION, header(round=1), [good], "round 0 is open")
    refused(grpc.StatusCode.FAILED_PRECONDITION, header(round_nonce="0" * 32), [good], "nonce")
    refused(grpc.StatusCode.FAILED_PRECONDITION, header(run_id="another-run"), [good], "another-run")
    refused(grpc.StatusCode.FAILED_PRECONDITION, header(client_id="stranger"), [good], "Join first")
    refused(grpc.StatusCode.INVALID_ARGUMENT, header(sha256="not-a-hash"), [good], "hex")
    refused(grpc.StatusCode.INVALID_ARGUMENT, header(transport_dtype="int4"), [good], "transport dtype")
    refused(grpc.StatusCode.INVALID_ARGUMENT, header(size=10 ** 12), [good], "exceeds the limit")
    deep = struct.pack("<Q", 200_000) + b"[" * 200_000  # JSON nested 200,000 deep
    refused(grpc.StatusCode.INVALID_ARGUMENT, header(sha256=ad.sha256_hex(deep), size=len(deep)), [deep],
            "nests deeper than")
    huge = struct.pack("<Q", ad.MAX_HEADER_BYTES + 1)
    refused(grpc.StatusCode.INVALID_ARGUMENT, header(sha256=ad.sha256_hex(huge), size=ad.MAX_HEADER_BYTES + 9),
            [huge], "more than the limit")


def resume_an_incomplete_and_an_abandoned_upload(up: RawUploads, run_dir) -> None:
    """A stream that ends early, or that the client abandons, keeps what arrived and accepts nothing;
    the upload resumes from what the aggregator holds, and the accepted adapter is stored whole."""
    refused, header, held, good, sha, c1 = up.refused, up.header, up.held, up.good, up.sha, up.client
    # A stream that ends early is incomplete; what arrived is kept and the upload resumes from it.
    half = len(good) // 2
    refused(grpc.StatusCode.FAILED_PRECONDITION, header(), [good[:half]], f"resume from offset {half}")
    assert (held().received_bytes, held().complete) == (half, False)
    refused(grpc.StatusCode.FAILED_PRECONDITION, header(offset=half + 7), [good[half + 7:]],
            f"resume from offset {half}")

    # A stream the client abandons halfway keeps what arrived too, and accepts nothing.
    def abandoned():
        yield fpb.AdapterChunk(header=header(offset=half))
        yield fpb.AdapterChunk(data=good[half:half + 1000])
        raise RuntimeError("client died mid-upload")
    with pytest.raises(grpc.RpcError):
        c1.stub.UploadAdapter(abandoned(), timeout=10)
    st = c1.status()
    assert st.round == 0 and list(st.uploaded) == []
    # (Whether the last chunk got out before the client's stream died is up to timing.)
    resume_at = held().received_bytes
    assert resume_at in (half, half + 1000)
    ack = raw_upload(c1, header(offset=resume_at), [good[resume_at:]])
    assert (ack.sha256, ack.size) == (sha, len(good))
    assert (held().received_bytes, held().complete) == (len(good), True)
    assert list(c1.status().uploaded) == ["org-a"]
    stored = run_dir / "uploads" / "round_0000" / "org-a.safetensors"
    assert stored.read_bytes() == good and not (run_dir / "uploads" / "round_0000" / "org-a.part").exists()


def test_bad_uploads_are_refused_and_the_round_completes(aggregator, peft_model):
    _agg, target, run_dir = aggregator
    _pm, state, config_json = peft_model
    c1, c2 = join_two(target, state, config_json)
    up = RawUploads(c1, ad.encode(perturbed(state, 1)))
    refused, header, held, good, sha = up.refused, up.header, up.held, up.good, up.sha
    refuse_bad_adapters_and_headers(up, state)
    resume_an_incomplete_and_an_abandoned_upload(up, run_dir)
    # Another adapter from the same client for the same round is refused; the accepted one stays.
    other_bytes = ad.encode(perturbed(state, 3))
    refused(grpc.StatusCode.ALREADY_EXISTS, header(sha256=ad.sha256_hex(other_bytes), size=len(other_bytes)),
            [other_bytes], "different adapter")

    # An identical retry is acknowledged again, stored once; then the round completes normally.
    assert raw_upload(c1, header(), [good]).sha256 == sha
    assert list(c1.status().uploaded) == ["org-a"]
    other = ad.encode(perturbed(state, 2))
    c2.upload(0, other, 1, 1)
    st = c1.wait_until(lambda s: s.round >= 1, timeout_s=10)
    assert st.round == 1
    # A retry whose acknowledgement was lost as the round closed is still acknowledged, not stale.
    assert raw_upload(c1, header(), [good]).sha256 == sha
    assert held().complete
    refused(grpc.StatusCode.FAILED_PRECONDITION, header(sha256=ad.sha256_hex(other_bytes), size=len(other_bytes)),
            [other_bytes], "round 1 is open")
    merged = ad.decode(c1.download(1).data)
    a, b = ad.decode(good), ad.decode(other)
    assert all(torch.allclose(merged[k].double(), (a[k].double() + b[k].double()) / 2, atol=1e-7) for k in merged)
    c1.close(), c2.close()


def test_join_with_a_different_adapter_schema_is_refused(aggregator, peft_model):
    _agg, target, _ = aggregator
    _pm, state, config_json = peft_model
    c1 = FederationClient(target, "org-a")
    c1.join("maze", TINY_MODEL_NAME, ad.Schema.of(state, config_json))
    smaller = {k: v for i, (k, v) in enumerate(sorted(state.items())) if i > 1}
    c2 = FederationClient(target, "org-b")
    with pytest.raises(grpc.RpcError) as err:
        c2.join("maze", TINY_MODEL_NAME, ad.Schema.of(smaller, config_json))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        c2.join("maze", "other-model", ad.Schema.of(state, config_json))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        FederationClient(target, "../evil").join("maze", TINY_MODEL_NAME, ad.Schema.of(state, config_json))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    c1.close(), c2.close()


def test_weighted_rounds_refuse_negative_counts_and_fall_back_to_the_mean_at_zero_weight(tmp_path, peft_model):
    """--strategy weighted: an upload of all 1.0 with 5 successes and one of all 0.0 with -3 gave a global
    adapter of 2.5, outside every upload. Negative counts are refused; a round whose weights sum to 0 (no
    client had a success) takes the unweighted mean, as documented."""
    _pm, state, config_json = peft_model
    with aggregator_in_process(tmp_path, strategy="weighted", round_deadline_s=60.0) as (_agg, port, _run_dir):
        c1, c2 = join_two(f"127.0.0.1:{port}", state, config_json)
        ones = ad.encode({k: torch.ones_like(v) for k, v in state.items()})
        zeros = ad.encode({k: torch.zeros_like(v) for k, v in state.items()})
        c1.upload(0, ones, num_examples=5, num_successes=5)
        for examples, successes in ((1, -3), (-1, 0)):
            with pytest.raises(grpc.RpcError) as err:
                c2.upload(0, zeros, num_examples=examples, num_successes=successes)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cannot be negative" in err.value.details()
        assert list(c1.status().uploaded) == ["org-a"]  # the refused upload left the round as it was
        c2.upload(0, zeros, num_examples=1, num_successes=0)
        c1.wait_until(lambda s: s.round >= 1, timeout_s=10)
        # Weights 5 and 0: the successful client's adapter.
        assert all(torch.equal(v, torch.ones_like(v)) for v in ad.decode(c1.download(1).data).values())
        c1.upload(1, ones, num_examples=5, num_successes=0)
        c2.upload(1, zeros, num_examples=5, num_successes=0)
        c1.wait_until(lambda s: s.round >= 2, timeout_s=10)
        # Weights 0 and 0: the unweighted mean.
        assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in ad.decode(c1.download(2).data).values())
        c1.close(), c2.close()


def test_join_takes_tensor_dtypes_in_torch_or_safetensors_spelling(aggregator, peft_model):
    """A client written from proto/ alone may name dtypes as safetensors does ("F32"); it used to be
    refused ("the run expects float32")."""
    _agg, target, _ = aggregator
    _pm, state, config_json = peft_model
    schema = serde.schema_to_proto(ad.Schema.of(state, config_json))
    assert {t.dtype for t in schema.tensors} == {"float32"}

    def spelled(dtype: str) -> fpb.AdapterSchema:
        return fpb.AdapterSchema(adapter_config_json=config_json, tensors=[
            fpb.TensorSpec(name=t.name, shape=t.shape, dtype=dtype) for t in schema.tensors])

    with grpc.insecure_channel(target) as channel:
        stub = fpb_grpc.FederationServiceStub(channel)
        stub.Join(fpb.JoinRequest(client_id="org-a", env="maze", base_model=TINY_MODEL_NAME, schema=spelled("F32")))
        c2 = FederationClient(target, "org-b")
        c2.join("maze", TINY_MODEL_NAME, ad.Schema.of(state, config_json))  # torch's spelling: the same schema
        fresh = ad.decode(c2.download(0).data)
        assert {str(v.dtype) for v in fresh.values()} == {"torch.float32"}
        for dtype, code, says in (("fp32", grpc.StatusCode.INVALID_ARGUMENT, "float32 (F32), "),
                                  ("BF16", grpc.StatusCode.FAILED_PRECONDITION, "the run expects float32")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Join(fpb.JoinRequest(client_id="org-c", env="maze", base_model=TINY_MODEL_NAME,
                                          schema=spelled(dtype)))
            assert err.value.code() == code and says in err.value.details(), err.value.details()
        c2.close()


@pytest.mark.parametrize("specs", [
    [(A_NAME, [8]), (B_NAME, [8, 2])],  # a LoRA factor of one dimension
    [(A_NAME, []), (B_NAME, [8, 2])],
    [(A_NAME, [2, 0]), (B_NAME, [8, 2])],  # zero-size: no bytes, no rank
    [(A_NAME, [2, 8]), (B_NAME, [8, 2]), ("base_model.model.m.bias", [2**62, 2**62, 0])],  # 0 bytes, huge dims
], ids=["1-d", "0-d", "zero-size", "huge-dims"])
def test_a_first_join_with_a_schema_no_adapter_has_is_refused_and_leaves_the_run_to_the_next(tmp_path, specs):
    """The first Join fixes the run's schema and makes phi_0 from it: a schema phi_0 cannot be made of
    is INVALID_ARGUMENT saying what to fix, and the run is as before (status served, a valid Join fixes it)."""
    with aggregator_in_process(tmp_path) as (_agg, port, _), grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = fpb_grpc.FederationServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            _join_raw(stub, "org-a", specs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "shape" in err.value.details()
        assert stub.GetRoundStatus(fpb.RoundStatusRequest(client_id="org-a"), timeout=10).state == \
            fpb.ROUND_STATE_WAITING_FOR_CLIENTS
        joined = _join_raw(stub, "org-b")
        assert joined.current_round == 0
        assert len(stub.GetRoundStatus(fpb.RoundStatusRequest(client_id="org-b"), timeout=10).joined) == 1


def test_an_unsigned_secure_round_keeps_no_certificate_a_member_sends_so_every_roster_stays_readable(tmp_path):
    """In a run that does not sign keys nobody checks an advertisement's certificate and signature: one
    member's 3 MB of them must not reach every member's roster (over the 4 MB a default client reads)."""
    import os

    with aggregator_in_process(tmp_path, secure_aggregation=True) as (_agg, port, _), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = fpb_grpc.FederationServiceStub(ch)
        for cid in ("org-a", "org-b"):
            _join_raw(stub, cid)
        nonce = stub.GetRoundStatus(fpb.RoundStatusRequest(client_id="org-a"), timeout=10).round_nonce
        for cid in ("org-a", "org-b"):
            stub.AdvertiseKeys(fpb.AdvertiseKeysRequest(
                client_id=cid, round=0, round_nonce=nonce, encryption_key=os.urandom(32), masking_key=os.urandom(32),
                self_mask_commitment=os.urandom(32), certificate=os.urandom(1_500_000), signature=os.urandom(64)),
                timeout=10)
        deadline = time.monotonic() + 10
        while True:
            secure = stub.GetSecureRound(fpb.SecureRoundRequest(client_id="org-a", round=0, round_nonce=nonce),
                                         timeout=10)
            if secure.stage == fpb.SECURE_STAGE_SHARING or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert secure.stage == fpb.SECURE_STAGE_SHARING
        assert len(secure.roster) == 2
        assert all(not m.certificate and not m.signature for m in secure.roster)


def test_an_asynchronous_upload_from_a_negative_version_is_refused_and_the_run_goes_on(tmp_path):
    with aggregator_in_process(tmp_path, mode="async", min_clients=1, async_buffer=1, rounds=3) as (_agg, port, run), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = fpb_grpc.FederationServiceStub(ch)
        for cid in ("org-a", "org-b"):
            _join_raw(stub, cid)
        nonce = stub.GetRoundStatus(fpb.RoundStatusRequest(client_id="org-a"), timeout=10).round_nonce
        data = ad.encode({A_NAME: torch.full((2, 8), 0.1), B_NAME: torch.full((8, 2), 0.1)})

        def upload(cid, round_):
            header = fpb.AdapterHeader(client_id=cid, round=round_, round_nonce=nonce, sha256=ad.sha256_hex(data),
                                       size=len(data), num_examples=1, num_successes=1)
            return stub.UploadAdapter(iter([fpb.AdapterChunk(header=header), fpb.AdapterChunk(data=data)]), timeout=10)

        with pytest.raises(grpc.RpcError) as err:
            upload("org-a", -1)  # it was stored as version -1 and every aggregation after failed on it
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "0 to 0" in err.value.details()
        upload("org-b", 0)
        deadline = time.monotonic() + 10
        while stub.GetRoundStatus(fpb.RoundStatusRequest(client_id="org-a"), timeout=10).round < 1:
            assert time.monotonic() < deadline, "the run did not publish version 1"
            time.sleep(0.2)


def test_a_download_resumes_with_the_sha256_in_either_case(aggregator, peft_model):
    _, state, config_json = peft_model
    _agg, target, _ = aggregator
    c1, c2 = join_two(target, state, config_json)
    try:
        whole = list(c1.stub.DownloadAdapter(fpb.DownloadRequest(round=0), timeout=30))
        data = b"".join(ch.data for ch in whole)
        sha = whole[0].header.sha256
        rest = list(c1.stub.DownloadAdapter(fpb.DownloadRequest(round=0, offset=100, sha256=sha.upper()), timeout=30))
        assert b"".join(ch.data for ch in rest) == data[100:]
    finally:
        c1.close()
        c2.close()
