"""Adapter transfer and one whole round: fedse's federation path beside plain gRPC and raw TCP floors.

Builds a Llama-2-7B-shaped LoRA (r = 8 on q, k, v, o, gate, up, down; as many of the 32 layers as
make about --mb MB in fp32) and moves its safetensors bytes over loopback, --repeats times each
(the table shows the median and every run):
  raw TCP floor  sendall / recv_into a bytearray, to and from a subprocess; timed until the
                 receiver's one-byte acknowledgement (upload) or the last byte (download).
  gRPC floor     a bare grpcio server in a subprocess (generic handlers, raw bytes messages, no
                 protobuf): stream-unary upload and unary-stream download in chunks of
                 fedse.model.adapter.CHUNK_BYTES (4 MiB - 64 KiB), with fedse.transport.serving.GRPC_OPTIONS on
                 both sides (8 MB message limit).
  fedse          FederationClient.upload / .download against a real aggregator process
                 (`python -m services.aggregator`), in fp32 and with transport_dtype bfloat16
                 (half the bytes on the wire). An upload is timed from the call to its ack: the
                 client hashes the bytes and asks the round status first; the aggregator checks
                 each chunk as it arrives (sha256, then the safetensors header against the
                 run's schema, then every value finite) and writes it, fsyncs the file when the
                 stream ends and renames it as accepted (in either dtype), all before the ack.
                 Every repeat is a different client of the same open round (the round needs more
                 uploads than the bench makes, so it never closes under an upload: no aggregation
                 is timed there). A download includes the client's sha256 check; the aggregator
                 keeps each round's global adapter in memory from when it is made (built in place,
                 services.aggregator.adapter_files.allocate), its chunk messages made once, and its
                 bf16 variant from the first bf16 download.
"x floor" is the time divided by that floor's time for the same number of bytes on the wire.

Then where an upload's time goes: each step of the path (client hashing and chunking, protobuf,
the aggregator's chunk writes, checks and storing) timed alone in this process
with fedse's own functions on the same bytes; in the real path the client's chunking and the
aggregator's per-chunk check and write overlap the transfer, the client's sha256 comes before it,
the fsync and the rename after.

Then one whole round, --repeats times, each on a fresh aggregator (--rounds 1 --min-clients 2)
with two client processes that join, wait for the round to open, download phi_0, upload their
own adapter (no training) and wait until the round is closed (the run FINISHED): the wall time
from the first upload starting to both clients having seen the round closed, and from the first
join to the same point. Both include the aggregation (FedAvg of A and B, phi_1 written as a PEFT
directory, fsynced), which runs beside the last upload's ack; its seconds, from the
aggregator's log, are shown apart. The first join also makes and stores phi_0 (a fresh LoRA).
Flower 1.42's deployment runtime took 6.9 s for the same round on this machine (measured
separately, not by this script); it is printed beside ours.

    .venv/bin/python bench/transfer.py [--mb 80] [--repeats 3] [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedse.model import adapter as ad  # noqa: E402
from apps.processes import Proc  # noqa: E402
from fedse.transport.serving import GRPC_OPTIONS  # noqa: E402
from fedse.v1 import federation_pb2 as fpb  # noqa: E402
from services.aggregator.store import Store  # noqa: E402
from services.aggregator.upload_check import UploadCheck  # noqa: E402
from services.client_agent.federation.link import FederationClient  # noqa: E402

from llama_lora import BYTES_PER_LAYER, MAX_LAYERS, MODULES, RANK  # noqa: E402  (bench/, beside this file)
# The helper processes this file starts itself as (a hidden flag), and what they share with it.
from transfer_helpers import (BASE_MODEL, CHUNK, CONFIG_JSON, ENV, SERVICE, START_S, _recv_exact,  # noqa: E402
                              adapter_of, round_client, serve_grpc, serve_tcp)

FLOWER_ROUND_S = 6.9


def layers_for(mb: float) -> int:
    return max(1, min(MAX_LAYERS, round(mb * 1e6 / BYTES_PER_LAYER)))


# ---- helper processes (this file run with a hidden flag: transfer_helpers.py) --------------------
class Helper:
    """This file run as a helper process; the first line of its stdout is read as JSON."""

    def __init__(self, *args: str):
        self.popen = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)

    def line(self) -> str:
        out = self.popen.stdout.readline()
        if not out:
            raise RuntimeError(f"helper {self.popen.args[2:]} exited with {self.popen.wait()}")
        return out.strip()

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.stdin.close()
                self.popen.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.popen.kill()
                self.popen.wait()


def aggregator(state_dir: pathlib.Path, num_rounds: int, min_clients: int) -> Proc:
    return Proc("aggregator", ["services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1",
                               "--state-dir", str(state_dir), "--run-id", "bench", "--rounds", str(num_rounds),
                               "--min-clients", str(min_clients), "--round-deadline-s", "3600",
                               "--wait-after-min-s", "3600", "--heartbeat-timeout-s", "3600"], state_dir)


# ---- measurements ---------------------------------------------------------------------------------
def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def tcp_times(port: int, data: bytes, size: int, repeats: int) -> dict[str, list[float]]:
    sink = bytearray(size)

    def up() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"U" + size.to_bytes(8, "little"))
            s.sendall(memoryview(data)[:size])
            ack = bytearray(1)
            _recv_exact(s, memoryview(ack))

    def down() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"D" + size.to_bytes(8, "little"))
            _recv_exact(s, memoryview(sink))

    up(), down()  # warm-up
    return {"upload": [timed(up) for _ in range(repeats)], "download": [timed(down) for _ in range(repeats)]}


def grpc_times(port: int, data: bytes, size: int, repeats: int) -> dict[str, list[float]]:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
        upload = channel.stream_unary(f"/{SERVICE}/Upload")
        download = channel.unary_stream(f"/{SERVICE}/Download")
        view = memoryview(data)

        def up() -> None:
            got = upload(bytes(view[s:min(size, s + CHUNK)]) for s in range(0, size, CHUNK))
            assert int.from_bytes(got, "little") == size

        def down() -> None:
            buf = bytearray()
            for chunk in download(size.to_bytes(8, "little")):
                buf += chunk
            assert len(buf) == size

        up(), down()  # warm-up: channel, server threads
        return {"upload": [timed(up) for _ in range(repeats)], "download": [timed(down) for _ in range(repeats)]}


def federation_times(work: pathlib.Path, adapter: ad.Adapter, data: bytes, repeats: int,
                     say) -> dict[tuple[str, str], list[float]]:
    """Uploads by 2 * repeats different clients of one open round (which needs one more to close),
    and downloads of phi_0 in both transport dtypes."""
    schema = ad.Schema.of(adapter, CONFIG_JSON)
    data_bf16 = ad.encode_transport(adapter, "bfloat16")
    n_clients = 2 * repeats + 1
    state = work / "federation"
    state.mkdir()
    agg = aggregator(state, num_rounds=1, min_clients=n_clients)
    clients: list[FederationClient] = []
    out: dict[tuple[str, str], list[float]] = {}
    try:
        target = f"127.0.0.1:{agg.port()}"
        clients = [FederationClient(target, f"bench-{k}") for k in range(n_clients)]
        for fed in clients:
            fed.join(ENV, BASE_MODEL, schema)
        st = clients[0].wait_until(lambda s: s.state == fpb.ROUND_STATE_OPEN, timeout_s=START_S)
        for dtype in ("", "bfloat16"):
            name = dtype or "fp32"
            say(f"  fedse download {name} x{repeats} ...")
            out[("download", name)] = [timed(lambda: clients[0].download(st.round, transport_dtype=dtype))
                                       for _ in range(repeats)]
        for i, (dtype, payload) in enumerate((("", data), ("bfloat16", data_bf16))):
            name = dtype or "fp32"
            say(f"  fedse upload {name} x{repeats} ...")
            out[("upload", name)] = [
                timed(lambda fed=fed: fed.upload(st.round, payload, 1, 1, CONFIG_JSON, transport_dtype=dtype))
                for fed in clients[1 + i * repeats:1 + (i + 1) * repeats]]
        after = clients[0].status()
        assert after.state == fpb.ROUND_STATE_OPEN and len(after.uploaded) == 2 * repeats, after
        return out
    finally:
        for fed in clients:
            fed.close()
        agg.stop()


def breakdown(work: pathlib.Path, adapter: ad.Adapter, data: bytes, repeats: int) -> list[tuple[str, float, float]]:
    """The steps of an upload, each timed alone in this process with fedse's own code on the same bytes
    (median of `repeats`): (step, fp32 s, bf16 s). In the real path the client's chunking and the
    aggregator's per-chunk check and write overlap the transfer."""
    schema = ad.Schema.of(adapter, CONFIG_JSON)
    store = Store(work / "breakdown", "bench")
    payloads = {"": data, "bfloat16": ad.encode_transport(adapter, "bfloat16")}
    order = ["client: sha256", "client: chunks as AdapterChunk (copies)", "protobuf serialize + parse",
             "aggregator: write chunks, no fsync (for scale)", "aggregator: write chunks, fsync at the end (Store)",
             "aggregator: check as chunks arrive (sha256, header, finite)",
             "  of which: sha256"]
    rows: dict[str, dict[str, float]] = {name: {} for name in order}

    def step(name: str, dtype: str, fn) -> None:
        fn()  # warm-up: first-call costs (allocator, torch kernels) are not the step's
        rows[name][dtype] = statistics.median(timed(fn) for _ in range(repeats))

    for dtype, payload in payloads.items():
        sha = ad.sha256_hex(payload)
        view = memoryview(payload)
        step("client: sha256", dtype, lambda: ad.sha256_hex(payload))
        step("client: chunks as AdapterChunk (copies)", dtype, lambda: [
            fpb.AdapterChunk(data=bytes(view[s:s + CHUNK])) for s in range(0, len(payload), CHUNK)])
        msgs = [fpb.AdapterChunk(data=bytes(view[s:s + CHUNK])) for s in range(0, len(payload), CHUNK)]
        step("protobuf serialize + parse", dtype, lambda: [fpb.AdapterChunk.FromString(m.SerializeToString())
                                                           for m in msgs])
        del msgs

        def receive(fsync: bool) -> None:
            store.start_partial(0, "c", {"sha256": sha})
            if fsync:
                for s in range(0, len(payload), CHUNK):
                    store.append_partial(0, "c", s, payload[s:s + CHUNK])
                store.sync_partial(0, "c")
            else:
                with open(store.upload_dir(0) / "c.part", "r+b") as fh:
                    for s in range(0, len(payload), CHUNK):
                        fh.write(payload[s:s + CHUNK])

        step("aggregator: write chunks, no fsync (for scale)", dtype, lambda: receive(False))
        step("aggregator: write chunks, fsync at the end (Store)", dtype, lambda: receive(True))

        def check() -> None:
            c = UploadCheck(schema, len(payload), 1 << 40, dtype)
            for s in range(0, len(payload), CHUNK):
                c.update(payload[s:s + CHUNK])
            c.finish(sha)

        step("aggregator: check as chunks arrive (sha256, header, finite)", dtype, check)
        step("  of which: sha256", dtype, lambda: ad.sha256_hex(payload))
    return [(name, v.get("", float("nan")), v.get("bfloat16", float("nan"))) for name, v in rows.items()]


def round_times(work: pathlib.Path, layers: int, index: int) -> dict[str, float]:
    state = work / f"round-{index}"
    state.mkdir()
    agg = aggregator(state, num_rounds=1, min_clients=2)
    helpers: list[Helper] = []
    try:
        target = f"127.0.0.1:{agg.port()}"
        helpers = [Helper("--round-client", target, f"org-{k}", "--layers", str(layers), "--seed", str(k + 1))
                   for k in range(2)]
        for h in helpers:
            if h.line() != "ready":
                raise RuntimeError("round client did not get ready")
        for h in helpers:
            h.popen.stdin.write("go\n")
            h.popen.stdin.flush()
        stamps = [json.loads(h.line()) for h in helpers]
        closed = max(s["closed"] for s in stamps)
        aggregate_s = float("nan")
        for line in agg.log_path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("msg") == "round closed":
                aggregate_s = float(entry["aggregate_s"])
        return {
            "upload_to_closed": closed - min(s["upload"] for s in stamps),
            "join_to_closed": closed - min(s["join"] for s in stamps),
            "join_to_open": max(s["open"] for s in stamps) - min(s["join"] for s in stamps),
            "download": max(s["downloaded"] - s["open"] for s in stamps),
            "upload": max(s["acked"] - s["upload"] for s in stamps),
            "aggregate": aggregate_s,
        }
    finally:
        for h in helpers:
            h.stop()
        agg.stop()


def arguments() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line (and the hidden flags that start a helper process)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=80.0, help="adapter size in MB (sets the number of layers, "
                                                               f"at most {MAX_LAYERS})")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement (the median is shown)")
    parser.add_argument("--workdir", default=None, help="where the temporary directory goes (default: system temp)")
    parser.add_argument("--serve", choices=["grpc", "tcp"], help=argparse.SUPPRESS)
    parser.add_argument("--round-client", nargs=2, metavar=("TARGET", "CLIENT_ID"), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    return parser, parser.parse_args()


def print_transfers(sizes: dict[str, int], floors: dict, fed: dict) -> None:
    """The table of transfers: each path, direction and wire dtype, against the two floors."""
    rows: list[tuple[str, str, str, list[float]]] = []
    for direction in ("upload", "download"):
        for name in sizes:
            rows.append(("raw TCP floor", direction, name, floors["tcp"][name][direction]))
            rows.append(("gRPC floor", direction, name, floors["grpc"][name][direction]))
            rows.append(("fedse", direction, name, fed[(direction, name)]))
    print(f"{'path':<14} {'direction':<9} {'wire':<8} {'wire MB':>7} {'median s':>8} {'MB/s':>7} "
          f"{'x gRPC floor':>12} {'x TCP floor':>11}  runs s")
    for path_name, direction, name, times in rows:
        med = statistics.median(times)
        g = statistics.median(floors["grpc"][name][direction])
        t = statistics.median(floors["tcp"][name][direction])
        print(f"{path_name:<14} {direction:<9} {name:<8} {sizes[name] / 1e6:>7.1f} {med:>8.3f} "
              f"{sizes[name] / 1e6 / med:>7.0f} {med / g:>12.2f} {med / t:>11.2f}  "
              + " ".join(f"{x:.3f}" for x in times), flush=True)
    print("# fedse upload = FederationClient.upload until the ack: client sha256 + status call, chunks under 4 MiB "
          "checked (sha256, header, finite values) and written by the aggregator as they arrive, fsynced at the "
          "end, then committed as accepted (the received file renamed); a fresh client each run")
    print("# fedse download = FederationClient.download of phi_0 with its sha256 check (the aggregator "
          "serves it from memory; the first bf16 download also makes the bf16 variant)", flush=True)


def print_breakdown(steps: list[tuple[str, float, float]]) -> None:
    """The table of where an upload's time goes."""
    title = "where an upload's time goes (each step alone, median s)"
    print(f"\n{title:<56} {'fp32':>7} {'bf16':>7}")
    for name, fp32_s, bf16_s in steps:
        print(f"{name:<56} " + " ".join(f"{x:>7.3f}" if x == x else f"{'-':>7}" for x in (fp32_s, bf16_s)))
    counted = [(f, b) for n, f, b in steps if not n.startswith(" ") and "no fsync" not in n]
    print(f"{'sum of the steps above, without the two for scale':<56} "
          + " ".join(f"{sum(x for x in col if x == x):>7.3f}" for col in zip(*counted)), flush=True)


def print_rounds(rounds: list[dict[str, float]]) -> None:
    """The table of whole rounds, beside Flower's."""
    print(f"\n{'whole round (2 clients, fp32)':<36} {'median s':>8} {'Flower s':>8} {'x Flower':>8}  runs s")
    labels = {
        "join_to_closed": "first join -> both saw it closed",
        "upload_to_closed": "first upload -> both saw it closed",
        "join_to_open": "  first join -> both saw it open",
        "download": "  download of phi_0 (slower client)",
        "upload": "  upload until ack (slower client)",
        "aggregate": "  aggregation at the aggregator",
    }
    for key, label in labels.items():
        values = [r[key] for r in rounds]
        med = statistics.median(values)
        flower = f"{FLOWER_ROUND_S:>8.1f} {med / FLOWER_ROUND_S:>8.2f}" if key == "join_to_closed" \
            else f"{'':>8} {'':>8}"
        print(f"{label:<36} {med:>8.3f} {flower}  " + " ".join(f"{x:.3f}" for x in values), flush=True)
    print(f"# Flower 1.42 deployment runtime, same round on this machine: {FLOWER_ROUND_S} s (measured "
          "separately); ours: a fresh aggregator process, two client processes on loopback; the aggregator "
          "stores both uploads and phi_1 on disk, fsynced, before the round shows closed; "
          "the aggregation runs beside the last upload's ack; the first join makes and stores phi_0", flush=True)


def main() -> None:
    parser, args = arguments()
    if args.serve == "grpc":
        return serve_grpc(args.file)
    if args.serve == "tcp":
        return serve_tcp(args.file)
    if args.round_client:
        return round_client(*args.round_client, args.layers, args.seed)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    layers = layers_for(args.mb)
    adapter = adapter_of(layers, seed=0)
    data = ad.encode(adapter)
    data_bf16 = ad.encode_transport(adapter, "bfloat16")
    sizes = {"fp32": len(data), "bfloat16": len(data_bf16)}
    params = sum(t.numel() for t in adapter.values())
    print(f"# adapter: {layers} of {MAX_LAYERS} Llama-2-7B layers x {len(MODULES)} modules, r={RANK}: "
          f"{len(adapter)} tensors, {params:,} parameters; safetensors {len(data) / 1e6:.2f} MB fp32, "
          f"{len(data_bf16) / 1e6:.2f} MB bf16 (MB = 10^6 bytes); {CHUNK / 2**20:.2f} MiB chunks; loopback; "
          f"{os.cpu_count()} CPUs", flush=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="fedse-transferbench-", dir=args.workdir))
    helpers: list[Helper] = []
    try:
        path = work / "adapter.safetensors"
        path.write_bytes(data)
        floors: dict[str, dict[str, dict[str, list[float]]]] = {}
        for kind, measure in (("tcp", tcp_times), ("grpc", grpc_times)):
            say(f"  {kind} floor ...")
            helper = Helper("--serve", kind, "--file", str(path))
            helpers.append(helper)
            port = int(json.loads(helper.line())["port"])
            floors[kind] = {name: measure(port, data, size, args.repeats) for name, size in sizes.items()}
            helper.stop()
        print_transfers(sizes, floors, federation_times(work, adapter, data, args.repeats, say))

        say(f"  upload steps x{args.repeats} ...")
        print_breakdown(breakdown(work, adapter, data, args.repeats))

        say(f"  whole round x{args.repeats} ...")
        print_rounds([round_times(work, layers, i) for i in range(args.repeats)])
    finally:
        for h in helpers:
            h.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
