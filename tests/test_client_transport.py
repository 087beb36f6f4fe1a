"""The client's transfers and liveness: bf16 transport, upload chunks from an offset, the transport
and heartbeat settings, heartbeats that survive failures, and resumable uploads and downloads
against a small fake aggregator over real gRPC that breaks streams on purpose (support.FakeAggregator).

The client's crash safety (progress.json, where a restarted agent resumes): tests/test_client_progress.py."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import REGISTRY
import torch

from fedse.model import adapter as ad
from fedse.config import ConfigError
from fedse.v1 import federation_pb2 as fpb
from services.client_agent.config import ClientConfig
from services.client_agent.federation.link import (
    FederationClient,
    StaleRound,
    TransferError,
    upload_chunks,
)
from services.client_agent.federation.heartbeat import Heartbeat
from support import FakeAggregator, serve_fake


# ---- transport dtype -----------------------------------------------------------------------------
def adapter(seed: int = 0) -> ad.Adapter:
    g = torch.Generator().manual_seed(seed)
    return {f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight": torch.randn(64, 128, generator=g)
            for i in range(2) for ab in "AB"}


def test_bfloat16_transport_halves_the_bytes_and_decodes_to_fp32():
    a = adapter()
    full, half = ad.encode_transport(a, ""), ad.encode_transport(a, "bfloat16")
    assert full == ad.encode(a)
    assert 0.45 < len(half) / len(full) < 0.55
    assert {str(t.dtype) for t in ad.decode(half).values()} == {"torch.bfloat16"}
    back = ad.decode_transport(half)
    for k, v in a.items():
        assert back[k].dtype == torch.float32
        assert torch.allclose(back[k], v, rtol=2 ** -8, atol=0), k
        assert not torch.equal(back[k], v)  # it really was rounded
    assert ad.encode_transport(back, "bfloat16") == half  # bf16 -> fp32 -> bf16 is exact
    with pytest.raises(ValueError, match="bfloat16"):
        ad.encode_transport(a, "float16")


# ---- chunks and offsets --------------------------------------------------------------------------
@pytest.mark.parametrize("size,offset,chunk", [(10, 0, 4), (10, 3, 4), (10, 8, 4), (10, 10, 4), (4096, 1000, 1024)])
def test_upload_chunks_resume_at_offset(size, offset, chunk):
    data = bytes(range(256)) * (size // 256 + 1)
    data = data[:size]
    header = fpb.AdapterHeader(client_id="c", round=1, sha256=ad.sha256_hex(data), size=size, offset=offset)
    msgs = list(upload_chunks(header, data, chunk))
    assert msgs[0].WhichOneof("kind") == "header" and msgs[0].header.offset == offset
    parts = [m.data for m in msgs[1:]]
    assert all(m.WhichOneof("kind") == "data" for m in msgs[1:])
    assert b"".join(parts) == data[offset:]
    assert all(0 < len(p) <= chunk for p in parts)
    assert len(parts) == -(-(size - offset) // chunk)


def test_upload_chunks_refuse_an_offset_outside_the_data():
    header = fpb.AdapterHeader(size=10, offset=11)
    with pytest.raises(ValueError, match="offset 11"):
        list(upload_chunks(header, b"x" * 10, 4))


# ---- configuration -------------------------------------------------------------------------------
def test_client_config_transport_and_heartbeat_settings():
    assert ClientConfig(transport_dtype="bfloat16").transport_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="--transport-dtype"):
        ClientConfig(transport_dtype="fp8")
    with pytest.raises(ConfigError, match="--heartbeat-interval-s"):
        ClientConfig(heartbeat_interval_s=-1)


# ---- heartbeat -----------------------------------------------------------------------------------
class FlakyHeartbeats:
    def __init__(self):
        self.calls: list[tuple[int, str]] = []

    def heartbeat(self, round_, phase, timeout_s=10.0):
        self.calls.append((round_, phase))
        if len(self.calls) % 2:
            raise RuntimeError("aggregator restarting")
        return fpb.HeartbeatAck(status=fpb.RoundStatus(round=round_))


def wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_heartbeat_survives_failures_and_sends_phase_changes_at_once():
    def beats(outcome: str) -> float:
        return REGISTRY.get_sample_value("fedse_client_heartbeats_total", {"outcome": outcome}) or 0.0
    failed, sent = beats("failed"), beats("sent")
    fed = FlakyHeartbeats()
    hb = Heartbeat(fed, interval_s=60.0).start()  # long interval: only phase changes trigger beats
    wait_for(lambda: len(fed.calls) >= 1)  # first beat failed; the thread lives on
    hb.set("training", 4)
    wait_for(lambda: (4, "training") in fed.calls)
    hb.set("uploading")
    wait_for(lambda: (4, "uploading") in fed.calls)
    assert hb._thread.is_alive() and beats("failed") >= failed + 1 and beats("sent") >= sent + 1
    with pytest.raises(ValueError, match="phase"):
        hb.set("dancing")
    hb.set("done")
    hb.stop()
    assert not hb._thread.is_alive()
    assert fed.calls[-1] == (4, "done")


def test_heartbeat_sends_the_last_phase_even_when_stop_comes_during_a_beat():
    """set("done") then stop() while a beat was on the wire used to end the thread without sending "done"."""
    release, sent = threading.Event(), []

    class SlowBeats:
        def heartbeat(self, round_, phase, timeout_s):
            sent.append(phase)
            if len(sent) == 1:
                release.wait(5)
            return fpb.HeartbeatAck()

    hb = Heartbeat(SlowBeats(), interval_s=60.0, phase="training").start()
    wait_for(lambda: sent == ["training"])
    hb.set("done")
    threading.Timer(0.2, release.set).start()
    hb.stop()
    assert sent == ["training", "done"]


# ---- against a fake aggregator speaking the resumable protocol (tests/support.py) ---------------------
@pytest.fixture
def fake():
    agg = FakeAggregator(ad.encode(adapter(7)))
    server, target = serve_fake(agg)
    client = FederationClient(target, "org-a", retries=3, backoff_s=0.01, max_backoff_s=0.02,
                              timeout_s=10)
    client.chunk_bytes = 1000
    yield agg, client
    client.close()
    server.stop(0)


def test_a_broken_upload_resumes_from_what_the_aggregator_kept(fake):
    agg, client = fake
    data = ad.encode_transport(adapter(1), "bfloat16")
    agg.break_upload_after = [3000, 5000]  # two breaks, each after some chunks were kept
    ack = client.upload(1, data, num_examples=3, num_successes=2, transport_dtype="bfloat16")
    assert ack.sha256 == ad.sha256_hex(data)
    assert agg.accepted[("org-a", 1)] == data
    assert agg.received == len(data)  # no byte was sent twice


def test_an_incomplete_or_misplaced_upload_follows_the_offset_the_aggregator_names(fake):
    agg, client = fake
    data = ad.encode(adapter(2))
    agg.held[("org-a", 1, ad.sha256_hex(data))] = bytearray(data[:4000])  # kept before a client restart
    agg.end_upload_after = [2000]  # then a stream that ends short without an error
    client.upload(1, data, num_examples=3, num_successes=2)
    assert agg.accepted[("org-a", 1)] == data
    assert agg.received == len(data) - 4000


def test_an_upload_for_a_closed_round_raises_stale_round(fake):
    agg, client = fake
    agg.round, agg.nonce = 2, "nonce-2"
    with pytest.raises(StaleRound) as err:
        client.upload(1, ad.encode(adapter(3)), num_examples=1, num_successes=1)
    assert err.value.open_round == 2 and err.value.round == 1
    agg.round, agg.state = 1, fpb.ROUND_STATE_AGGREGATING  # closed, being aggregated
    with pytest.raises(StaleRound, match="AGGREGATING"):
        client.upload(1, ad.encode(adapter(3)), num_examples=1, num_successes=1)
    assert not agg.accepted


def test_a_stale_nonce_is_refreshed(fake):
    agg, client = fake
    data = ad.encode(adapter(4))
    client.upload(1, data, num_examples=1, num_successes=1, round_nonce="nonce-from-before-a-restart")
    assert agg.accepted[("org-a", 1)] == data


def test_a_broken_download_resumes_and_a_damaged_one_restarts(fake):
    agg, client = fake
    agg.break_download_after = [2500]
    g = client.download(-1)
    assert g.data == agg.global_fp32 and g.round == 1
    resumed = agg.download_requests[-1]
    assert resumed.offset == 3000 and resumed.sha256 == g.sha256 and resumed.round == 1
    agg.download_requests.clear()
    agg.corrupt_downloads = 1
    g = client.download(1)
    assert g.data == agg.global_fp32
    assert [r.offset for r in agg.download_requests] == [0, 0]  # damaged: the whole adapter again


def test_download_in_bfloat16(fake):
    agg, client = fake
    g = client.download(1, transport_dtype="bfloat16")
    assert g.transport_dtype == "bfloat16"
    assert len(g.data) < 0.55 * len(agg.global_fp32)
    got, want = g.adapter(), ad.decode(agg.global_fp32)
    assert all(torch.allclose(got[k], want[k], rtol=2 ** -8, atol=0) for k in want)


def test_a_download_that_keeps_arriving_damaged_fails(fake):
    agg, client = fake
    agg.corrupt_downloads = 100
    with pytest.raises(TransferError, match="damaged"):
        client.download(1)
