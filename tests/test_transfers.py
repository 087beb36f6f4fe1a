"""Transfers that resume, against the real aggregator over real gRPC: a TCP proxy between the client
and the aggregator cuts the connection halfway through an upload and then a download; the client
resumes from the bytes held, and the aggregator stores the upload once. bf16 transport halves the
bytes; uploads are kept as sent and the global adapter stays in the schema's dtype. A client that keeps
every gRPC default (4 MiB received) moves adapters larger than that both ways."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch

from fedse.model import adapter as ad
from fedse.transport import serde
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from support import aggregator_in_process
from services.client_agent.federation.link import FederationClient

MB = 1024 * 1024
A, B = "x.lora_A.weight", "x.lora_B.weight"
WIDTH = 163_840  # 2 tensors of 8 x 163,840 fp32: 10.5 MB, three chunks


class CuttingProxy:
    """Forwards loopback TCP to `target`. The first connection to carry more than `cut_after` bytes
    in the chosen direction is held there until `ready()` says so, then cut (both sockets closed);
    later connections pass untouched."""

    def __init__(self, target_port: int, cut_after: int, direction: str, ready=lambda: True):
        self.target_port = target_port
        self.cut_after = cut_after
        self.ready = ready
        self.direction = direction  # "up" (client to server) or "down"
        self.cut = False
        self.forwarded = {"up": 0, "down": 0}
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            state = {"sent": 0, "armed": not self.cut}
            for src, dst, way in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, way, state, (client, server)),
                                 daemon=True).start()

    def _pump(self, src, dst, way, state, pair) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if way == self.direction and state["armed"] and not self.cut:
                    state["sent"] += len(data)
                    if state["sent"] > self.cut_after:
                        deadline = time.monotonic() + 30
                        while not self.ready() and time.monotonic() < deadline:
                            time.sleep(0.01)
                        self.cut = True
                        for s in pair:
                            s.shutdown(socket.SHUT_RDWR)
                        return
                with self.lock:
                    self.forwarded[way] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in pair:
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def big_adapter(seed: int) -> ad.Adapter:
    g = torch.Generator().manual_seed(seed)
    return {A: torch.randn(8, WIDTH, generator=g), B: torch.randn(WIDTH, 8, generator=g)}


@pytest.fixture
def aggregator(tmp_path):
    with aggregator_in_process(tmp_path) as running:
        yield running


def joined_pair(port: int, proxy_port: int) -> tuple[FederationClient, FederationClient]:
    schema = ad.Schema.of(big_adapter(0), '{"r": 8}')
    cut = FederationClient(f"127.0.0.1:{proxy_port}", "org-a", backoff_s=0.05)
    other = FederationClient(f"127.0.0.1:{port}", "org-b")
    cut.join("maze", "tiny", schema)
    other.join("maze", "tiny", schema)
    return cut, other


def test_an_upload_cut_halfway_resumes_and_is_stored_once(aggregator):
    agg, port, run_dir = aggregator
    partial = run_dir / "uploads" / "round_0000" / "org-a.part"
    # Cut once the aggregator has kept at least one whole chunk.
    proxy = CuttingProxy(port, cut_after=6 * MB, direction="up",
                         ready=lambda: partial.exists() and partial.stat().st_size >= ad.CHUNK_BYTES)
    cut, other = joined_pair(port, proxy.port)
    try:
        data = ad.encode(big_adapter(1))
        ack = cut.upload(0, data, num_examples=3, num_successes=2)
        assert proxy.cut, "the proxy never cut the upload"
        assert (ack.sha256, ack.size) == (ad.sha256_hex(data), len(data))
        # Resumed, not restarted: the bytes sent are the cut-off part plus the rest after the
        # last whole chunk the aggregator kept (restarting would send 6 + 10.5 MB).
        assert proxy.forwarded["up"] < len(data) + 2.5 * MB, proxy.forwarded
        stored = run_dir / "uploads" / "round_0000" / "org-a.safetensors"
        assert stored.read_bytes() == data
        assert agg.federation.status().uploaded == ("org-a",)
        assert not (run_dir / "uploads" / "round_0000" / "org-a.part").exists()
    finally:
        cut.close(), other.close(), proxy.close()


def test_a_download_cut_halfway_resumes_from_the_bytes_held(aggregator, monkeypatch):
    from services.client_agent.federation import link as federation

    agg, port, run_dir = aggregator
    # Cut once the client holds at least one whole chunk (a cut that lands while the chunk is still
    # in the socket's buffer loses it, and the client rightly starts again from 0).
    held = [0]
    add = federation._Download.add

    def counted(self, data):
        add(self, data)
        held[0] = max(held[0], self.held)

    monkeypatch.setattr(federation._Download, "add", counted)
    proxy = CuttingProxy(port, cut_after=6 * MB, direction="down", ready=lambda: held[0] >= ad.CHUNK_BYTES)
    cut, other = joined_pair(port, proxy.port)
    try:
        other.upload(0, ad.encode(big_adapter(2)), 1, 1)
        cut.upload(0, ad.encode(big_adapter(3)), 1, 1)  # the round closes: phi_1 exists
        other.wait_until(lambda s: s.round >= 1, timeout_s=30)
        before = proxy.forwarded["down"]
        g = cut.download(1)
        assert proxy.cut, "the proxy never cut the download"
        expected = (run_dir / "global" / "round_0001" / "adapter_model.safetensors").read_bytes()
        assert g.data == expected and g.sha256 == ad.sha256_hex(expected)
        assert proxy.forwarded["down"] - before < len(expected) + 2.5 * MB
    finally:
        cut.close(), other.close(), proxy.close()


def test_bf16_transport_halves_the_bytes_and_phi_stays_fp32(aggregator):
    agg, port, run_dir = aggregator
    schema = ad.Schema.of(big_adapter(0), '{"r": 8}')
    a = FederationClient(f"127.0.0.1:{port}", "org-a", transport_dtype="bfloat16")
    b = FederationClient(f"127.0.0.1:{port}", "org-b")
    try:
        a.join("maze", "tiny", schema), b.join("maze", "tiny", schema)
        mine = big_adapter(4)
        wire = ad.encode_transport(mine, "bfloat16")
        assert abs(len(wire) / len(ad.encode(mine)) - 0.5) < 0.01
        a.upload(0, wire, 1, 1)
        assert (run_dir / "uploads" / "round_0000" / "org-a.safetensors").read_bytes() == wire  # kept as sent
        theirs = big_adapter(5)
        b.upload(0, ad.encode(theirs), 1, 1)
        b.wait_until(lambda s: s.round >= 1, timeout_s=30)
        full = b.download(1)
        half = a.download(1)
        assert abs(len(half.data) / len(full.data) - 0.5) < 0.01
        # phi_1 is the fp32 mean of the bf16 values as sent and the fp32 upload.
        expected = ((mine[A].to(torch.bfloat16).double() + theirs[A].double()) / 2).float()
        assert torch.equal(full.adapter()[A], expected)
    finally:
        a.close(), b.close()


def test_a_client_with_grpc_default_limits_downloads_and_uploads_adapters_over_4_mib(aggregator):
    """A stock channel (no options: gRPC's default 4 MiB receive limit), as a client written from
    proto/ alone has: the 10.5 MB global adapter comes down and an upload goes up in the chunks
    the aggregator states in RunConfig.max_chunk_bytes; a larger chunk is refused with a clear status."""
    agg, port, run_dir = aggregator
    schema = ad.Schema.of(big_adapter(0), '{"r": 8}')
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = fpb_grpc.FederationServiceStub(channel)
        joined = stub.Join(fpb.JoinRequest(client_id="org-a", env="maze", base_model="tiny",
                                           schema=serde.schema_to_proto(schema)), timeout=30)
        limit = joined.config.max_chunk_bytes
        assert 0 < limit and fpb.AdapterChunk(data=bytes(limit)).ByteSize() <= 4 * MB
        other = FederationClient(f"127.0.0.1:{port}", "org-b")
        other.join("maze", "tiny", schema)
        try:
            chunks = list(stub.DownloadAdapter(fpb.DownloadRequest(round=0), timeout=60))
            data = b"".join(c.data for c in chunks[1:])
            assert len(data) > 4 * MB and data == (run_dir / "global" / "round_0000" / ad.WEIGHTS_NAME).read_bytes()
            assert ad.sha256_hex(data) == chunks[0].header.sha256

            nonce = stub.GetRoundStatus(fpb.RoundStatusRequest(client_id="org-a"), timeout=30).round_nonce
            mine = ad.encode(big_adapter(6))
            header = fpb.AdapterHeader(client_id="org-a", round=0, round_nonce=nonce, sha256=ad.sha256_hex(mine),
                                       size=len(mine), num_examples=1, num_successes=1)

            def stream(size: int):
                yield fpb.AdapterChunk(header=header)
                for start in range(0, len(mine), size):
                    yield fpb.AdapterChunk(data=mine[start:start + size])

            with pytest.raises(grpc.RpcError) as refused:
                stub.UploadAdapter(stream(limit + 1), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"limit of {limit} bytes" in refused.value.details()
            ack = stub.UploadAdapter(stream(limit), timeout=60)
            assert (ack.sha256, ack.size) == (ad.sha256_hex(mine), len(mine))
            assert (run_dir / "uploads" / "round_0000" / "org-a.safetensors").read_bytes() == mine
        finally:
            other.close()
