"""The helper processes of bench/transfer.py (it runs itself with a hidden flag to start one) and
what they share with it: the bench adapter's LoRA config and names, the chunk size, and the adapter.

  --serve grpc   a bare grpcio server of raw bytes messages (the gRPC floor);
  --serve tcp    a socket server (the raw TCP floor);
  --round-client one client of the whole-round bench.
"""

from __future__ import annotations

import json
import pathlib
import select
import socket
import sys
import time
from concurrent import futures

import grpc
import torch

from fedse.model import adapter as ad
from fedse.transport.serving import GRPC_OPTIONS
from fedse.v1 import federation_pb2 as fpb
from services.client_agent.federation.link import FederationClient

from llama_lora import MODULES, RANK, schema  # bench/, beside this file

CONFIG_JSON = json.dumps({
    "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 16, "lora_dropout": 0.0,
    "bias": "none", "target_modules": sorted(m.split(".")[-1] for m in MODULES),
})
BASE_MODEL = "llama-2-7b-bench"
ENV = "bench"
CHUNK = ad.CHUNK_BYTES
SERVICE = "fedsebench.Transfer"
START_S = 120.0


def adapter_of(layers: int, seed: int) -> ad.Adapter:
    """PEFT state-dict names: lora_A is (r, in), lora_B is (out, r); small random fp32 values."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * (0.01 if ".lora_A." in name else 0.001)
            for name, shape in schema(layers).items()}


def serve_grpc(path: str) -> None:
    """A bare gRPC server: Upload (stream of raw chunks -> 8-byte count), Download (8-byte size -> chunks)."""
    data = pathlib.Path(path).read_bytes()
    sink = bytearray(len(data))

    def upload(request_iterator, context):
        view, n = memoryview(sink), 0
        for msg in request_iterator:
            view[n:n + len(msg)] = msg
            n += len(msg)
        return n.to_bytes(8, "little")

    def download(request, context):
        n = int.from_bytes(request, "little")
        for start in range(0, n, CHUNK):
            yield data[start:min(n, start + CHUNK)]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
        "Download": grpc.unary_stream_rpc_method_handler(download),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"port": port}), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(0).wait()


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed early")
        got += n


def serve_tcp(path: str) -> None:
    """A socket server: b'U' + 8-byte size + bytes -> b'k'; b'D' + 8-byte size -> that many bytes."""
    data = pathlib.Path(path).read_bytes()
    sink = bytearray(len(data))
    lsock = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": lsock.getsockname()[1]}), flush=True)
    while True:
        ready, _, _ = select.select([lsock, sys.stdin], [], [])
        if sys.stdin in ready:
            return  # the parent closed our stdin
        conn, _ = lsock.accept()
        with conn:
            head = bytearray(9)
            _recv_exact(conn, memoryview(head))
            n = int.from_bytes(head[1:], "little")
            if head[:1] == b"U":
                _recv_exact(conn, memoryview(sink)[:n])
                conn.sendall(b"k")
            else:
                conn.sendall(memoryview(data)[:n])


def round_client(target: str, client_id: str, layers: int, seed: int) -> None:
    """One client of the whole-round bench: prepares its adapter, says ready, waits for 'go' on stdin,
    then joins, waits for OPEN, downloads phi_0, uploads, waits until the round closed; prints stamps."""
    adapter = adapter_of(layers, seed)
    data = ad.encode(adapter)
    sha = ad.sha256_hex(data)  # as the agent does when it saves its trained adapter, before uploading
    schema = ad.Schema.of(adapter, CONFIG_JSON)
    del adapter
    fed = FederationClient(target, client_id)
    print("ready", flush=True)
    sys.stdin.readline()
    t: dict[str, float] = {"join": time.monotonic()}
    fed.join(ENV, BASE_MODEL, schema)
    st = fed.wait_until(lambda s: s.state == fpb.ROUND_STATE_OPEN, timeout_s=START_S)
    t["open"] = time.monotonic()
    phi = fed.download(st.round)
    t["downloaded"] = time.monotonic()
    assert len(phi.data) == len(data)
    t["upload"] = time.monotonic()
    fed.upload(st.round, data, num_examples=1, num_successes=1, adapter_config_json=CONFIG_JSON,
               round_nonce=st.round_nonce, sha256=sha)
    t["acked"] = time.monotonic()
    fed.wait_until(lambda s: s.state == fpb.ROUND_STATE_FINISHED or s.round > st.round, timeout_s=START_S)
    t["closed"] = time.monotonic()
    fed.close()
    print(json.dumps(t), flush=True)
