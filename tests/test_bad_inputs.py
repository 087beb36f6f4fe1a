"""Bad inputs against real processes, from a client that keeps every gRPC default (as one written in
another language from proto/ alone): every kind below is refused with the status that names the
caller's mistake and a short message, both servers stay up and serving, nothing is let in, and a
valid round completes after all of them.

Each case is one kind of bad input; the test ids name the call, the input and the status expected.
The faults (processes SIGKILLed and restarted, connections cut mid-transfer) are in
test_resilience.py, test_client_failure.py and test_transfers.py.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, Callable

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedse.model import adapter as ad
from fedse.transport import serde
from fedse.transport.inputs import MAX_STATUS_CHARS
from apps.processes import Proc
from fedse.v1 import env_pb2 as epb
from fedse.v1 import env_pb2_grpc as epb_grpc
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from services.client_agent.federation.link import FederationClient

pytestmark = pytest.mark.slow

MB = "x" * 1_000_000  # a 1 MB id
A, B = "base_model.model.m.lora_A.weight", "base_model.model.m.lora_B.weight"
SCHEMA = ad.Schema.of({A: torch.zeros(2, 8), B: torch.zeros(8, 2)}, '{"r": 2, "peft_type": "LORA"}')
INVALID, NOT_FOUND, PRECONDITION = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                    grpc.StatusCode.FAILED_PRECONDITION)


def adapter_bytes(value: float = 0.1, **replace: torch.Tensor) -> bytes:
    tensors = {A: torch.full((2, 8), value), B: torch.full((8, 2), value), **replace}
    return ad.encode(tensors)


def raw_header(text: bytes) -> bytes:
    """A safetensors file whose header is `text` (no tensors after it)."""
    return struct.pack("<Q", len(text)) + text


@dataclasses.dataclass
class World:
    env: epb_grpc.EnvServiceStub
    agg: fpb_grpc.FederationServiceStub
    env_channel: grpc.Channel
    agg_channel: grpc.Channel
    nonce: str
    clients: list[FederationClient]

    def session(self) -> str:
        return self.env.Reset(epb.ResetRequest(env="maze", task_id=0), timeout=30).session_id

    def finished_session(self) -> str:
        sid = self.session()
        done = False
        while not done:
            action = self.env.ExpertAction(epb.ExpertActionRequest(session_id=sid), timeout=30).action
            done = self.env.Step(epb.StepRequest(session_id=sid, action=action), timeout=30).done
        return sid

    def join(self, client_id: str = "org-c", env: str = "maze", base_model: str = "fedse-tiny",
             schema: fpb.AdapterSchema | None = None) -> Any:
        return self.agg.Join(fpb.JoinRequest(client_id=client_id, env=env, base_model=base_model,
                                             schema=schema or serde.schema_to_proto(SCHEMA)), timeout=30)

    def upload(self, data: bytes = b"", chunks: list[fpb.AdapterChunk] | None = None, **header: Any) -> Any:
        """An upload from org-a for the open round: a header for `data` (fields overridden by `header`),
        then `data` in one chunk, unless `chunks` are given."""
        data = data or adapter_bytes()
        fields = {"client_id": "org-a", "round": 0, "round_nonce": self.nonce, "sha256": ad.sha256_hex(data),
                  "size": len(data), "num_examples": 1, "num_successes": 1, **header}
        stream = [fpb.AdapterChunk(header=fpb.AdapterHeader(**fields))]
        stream += chunks if chunks is not None else [fpb.AdapterChunk(data=data)]
        return self.agg.UploadAdapter(iter(stream), timeout=60)

    def download(self, **request: Any) -> list:
        return list(self.agg.DownloadAdapter(fpb.DownloadRequest(**request), timeout=60))

    def raw(self, channel: grpc.Channel, method: str, data: bytes, stream: bool = False) -> Any:
        if stream:
            call = channel.stream_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            return call(iter([data]), timeout=30)
        call = channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return call(data, timeout=30)


def schema(*specs: tuple[str, list[int], str], config: str = '{"r": 2}') -> fpb.AdapterSchema:
    return fpb.AdapterSchema(adapter_config_json=config,
                             tensors=[fpb.TensorSpec(name=n, shape=s, dtype=d) for n, s, d in specs])


GOOD_SPECS = [(A, [2, 8], "float32"), (B, [8, 2], "float32")]
Call = Callable[[World], Any]
CASES: list[tuple[str, grpc.StatusCode, Call]] = [
    # ---- env server -----------------------------------------------------------------------------
    ("env ListTasks unknown env", NOT_FOUND,
     lambda w: w.env.ListTasks(epb.ListTasksRequest(env="chess", split="train"))),
    ("env ListTasks 1 MB env", INVALID, lambda w: w.env.ListTasks(epb.ListTasksRequest(env=MB, split="train"))),
    ("env ListTasks unknown split", INVALID, lambda w: w.env.ListTasks(epb.ListTasksRequest(env="maze", split="dev"))),
    ("env ListTasks 1 MB split", INVALID, lambda w: w.env.ListTasks(epb.ListTasksRequest(env="maze", split=MB))),
    ("env Reset unknown env", NOT_FOUND, lambda w: w.env.Reset(epb.ResetRequest(env="chess", task_id=0))),
    ("env Reset 1 MB env", INVALID, lambda w: w.env.Reset(epb.ResetRequest(env=MB, task_id=0))),
    ("env Reset task id past the last", NOT_FOUND, lambda w: w.env.Reset(epb.ResetRequest(env="maze", task_id=2**62))),
    ("env Reset negative task id", NOT_FOUND, lambda w: w.env.Reset(epb.ResetRequest(env="maze", task_id=-1))),
    ("env Step unknown session", NOT_FOUND, lambda w: w.env.Step(epb.StepRequest(session_id="feed", action="move up"))),
    ("env Step 1 MB session id", INVALID, lambda w: w.env.Step(epb.StepRequest(session_id=MB, action="move up"))),
    ("env Step empty action", INVALID, lambda w: w.env.Step(epb.StepRequest(session_id=w.session(), action=""))),
    ("env Step blank action", INVALID, lambda w: w.env.Step(epb.StepRequest(session_id=w.session(), action=" \n"))),
    ("env Step 1 MB action", INVALID, lambda w: w.env.Step(epb.StepRequest(session_id=w.session(), action=MB))),
    ("env Step after the episode ended", PRECONDITION,
     lambda w: w.env.Step(epb.StepRequest(session_id=w.finished_session(), action="move up"))),
    ("env ExpertAction unknown session", NOT_FOUND,
     lambda w: w.env.ExpertAction(epb.ExpertActionRequest(session_id="feed"))),
    ("env ExpertAction 1 MB session id", INVALID,
     lambda w: w.env.ExpertAction(epb.ExpertActionRequest(session_id=MB))),
    ("env Close unknown session", NOT_FOUND, lambda w: w.env.Close(epb.CloseRequest(session_id="feed"))),
    ("env Close 1 MB session id", INVALID, lambda w: w.env.Close(epb.CloseRequest(session_id=MB))),
    ("env Close twice", NOT_FOUND,
     lambda w: [w.env.Close(epb.CloseRequest(session_id=s)) for s in [w.session()] * 2]),
    ("env Step undecodable bytes", INVALID, lambda w: w.raw(w.env_channel, "/fedse.v1.EnvService/Step", b"\xff\xff")),
    ("env Reset env name not UTF-8", INVALID,
     lambda w: w.raw(w.env_channel, "/fedse.v1.EnvService/Reset", b"\x0a\x02\xff\xfe")),
    # ---- aggregator: Join -----------------------------------------------------------------------
    ("agg Join 1 MB client id", INVALID, lambda w: w.join(client_id=MB)),
    ("agg Join client id with a slash", INVALID, lambda w: w.join(client_id="../evil")),
    ("agg Join empty client id", INVALID, lambda w: w.join(client_id="")),
    ("agg Join 1 MB env", INVALID, lambda w: w.join(env=MB)),
    ("agg Join 1 MB base model", INVALID, lambda w: w.join(base_model=MB)),
    ("agg Join another base model", PRECONDITION, lambda w: w.join(base_model="other-model")),
    ("agg Join schema without tensors", INVALID, lambda w: w.join(schema=schema())),
    ("agg Join schema unknown dtype", INVALID, lambda w: w.join(schema=schema((A, [2, 8], "F33"), GOOD_SPECS[1]))),
    ("agg Join schema dtype of another run", PRECONDITION,
     lambda w: w.join(schema=schema((A, [2, 8], "BF16"), GOOD_SPECS[1]))),
    ("agg Join schema of 2^40 floats", INVALID, lambda w: w.join(schema=schema((A, [2**20, 2**20], "float32")))),
    ("agg Join schema negative dimension", INVALID, lambda w: w.join(schema=schema((A, [2, -8], "float32")))),
    ("agg Join schema 9 dimensions", INVALID, lambda w: w.join(schema=schema((A, [1] * 9, "float32")))),
    ("agg Join schema duplicate names", INVALID, lambda w: w.join(schema=schema(GOOD_SPECS[0], GOOD_SPECS[0]))),
    ("agg Join schema 1 MB tensor name", INVALID, lambda w: w.join(schema=schema((MB, [2], "float32")))),
    ("agg Join schema other shapes", PRECONDITION, lambda w: w.join(schema=schema((A, [4, 8], "float32"),
                                                                                  (B, [8, 4], "float32")))),
    ("agg Join config not JSON", INVALID, lambda w: w.join(schema=schema(*GOOD_SPECS, config="{r: 2"))),
    ("agg Join config nested 60,000 deep", INVALID, lambda w: w.join(schema=schema(*GOOD_SPECS, config="[" * 60_000))),
    ("agg Join config of 1 MB", INVALID, lambda w: w.join(schema=schema(*GOOD_SPECS, config=json.dumps({"a": MB})))),
    ("agg Join undecodable bytes", INVALID, lambda w: w.raw(w.agg_channel, "/fedse.v1.FederationService/Join",
                                                            b"\x22\xff\xff\xff\xff\x0f")),
    # ---- aggregator: status, heartbeats, metrics ------------------------------------------------
    ("agg GetRoundStatus 1 MB client id", INVALID,
     lambda w: w.agg.GetRoundStatus(fpb.RoundStatusRequest(client_id=MB))),
    ("agg WatchRound 1 MB client id", INVALID,
     lambda w: next(w.agg.WatchRound(fpb.RoundStatusRequest(client_id=MB), timeout=30))),
    ("agg Heartbeat client not joined", PRECONDITION,
     lambda w: w.agg.Heartbeat(fpb.HeartbeatRequest(client_id="stranger", phase="waiting"))),
    ("agg Heartbeat 1 MB client id", INVALID, lambda w: w.agg.Heartbeat(fpb.HeartbeatRequest(client_id=MB))),
    ("agg Heartbeat 1 MB phase", INVALID, lambda w: w.agg.Heartbeat(fpb.HeartbeatRequest(client_id="org-a", phase=MB))),
    ("agg ReportMetrics NaN", INVALID, lambda w: w.agg.ReportMetrics(
        fpb.MetricsReport(client_id="org-a", round=0, metrics={"test_success": float("nan")}))),
    ("agg ReportMetrics infinity", INVALID, lambda w: w.agg.ReportMetrics(
        fpb.MetricsReport(client_id="org-a", round=0, metrics={"train_loss": float("-inf")}))),
    ("agg ReportMetrics round 123456 of 2", INVALID, lambda w: w.agg.ReportMetrics(
        fpb.MetricsReport(client_id="org-a", round=123456, metrics={"test_success": 0.5}))),
    ("agg ReportMetrics round -1", INVALID, lambda w: w.agg.ReportMetrics(
        fpb.MetricsReport(client_id="org-a", round=-1, metrics={"test_success": 0.5}))),
    ("agg ReportMetrics round not opened yet", PRECONDITION, lambda w: w.agg.ReportMetrics(
        fpb.MetricsReport(client_id="org-a", round=2, metrics={"test_success": 0.5}))),
    ("agg ReportMetrics 1 MB metric name", INVALID, lambda w: w.agg.ReportMetrics(
        fpb.MetricsReport(client_id="org-a", round=0, metrics={MB: 1.0}))),
    ("agg ReportMetrics 10,000 metrics", INVALID, lambda w: w.agg.ReportMetrics(
        fpb.MetricsReport(client_id="org-a", round=0, metrics={f"m{i}": 1.0 for i in range(10_000)}))),
    ("agg ReportMetrics client not joined", PRECONDITION, lambda w: w.agg.ReportMetrics(
        fpb.MetricsReport(client_id="stranger", round=0, metrics={"x": 1.0}))),
    ("agg ReportMetrics 1 MB client id", INVALID, lambda w: w.agg.ReportMetrics(fpb.MetricsReport(client_id=MB))),
    # ---- aggregator: transfers ------------------------------------------------------------------
    ("agg GetUploadState 1 MB sha256", INVALID,
     lambda w: w.agg.GetUploadState(fpb.UploadStateRequest(client_id="org-a", sha256=MB))),
    ("agg GetUploadState client not joined", PRECONDITION,
     lambda w: w.agg.GetUploadState(fpb.UploadStateRequest(client_id="stranger", sha256="ab" * 32))),
    ("agg DownloadAdapter round not made yet", NOT_FOUND, lambda w: w.download(round=5)),
    ("agg DownloadAdapter round below -1 (the newest)", INVALID, lambda w: w.download(round=-7)),
    ("agg DownloadAdapter negative offset", INVALID, lambda w: w.download(round=0, offset=-1)),
    ("agg DownloadAdapter offset past the end", INVALID, lambda w: w.download(round=0, offset=10**9)),
    ("agg DownloadAdapter unknown transport dtype", INVALID, lambda w: w.download(round=0, transport_dtype="int4")),
    ("agg DownloadAdapter 1 MB transport dtype", INVALID, lambda w: w.download(round=0, transport_dtype=MB)),
    ("agg DownloadAdapter resume of another sha256", PRECONDITION,
     lambda w: w.download(round=0, offset=8, sha256="ab" * 32)),
    ("agg DownloadAdapter 1 MB sha256", INVALID, lambda w: w.download(round=0, sha256=MB)),
    ("agg UploadAdapter empty stream", INVALID, lambda w: w.agg.UploadAdapter(iter([]), timeout=30)),
    ("agg UploadAdapter data before the header", INVALID,
     lambda w: w.agg.UploadAdapter(iter([fpb.AdapterChunk(data=b"x")]), timeout=30)),
    ("agg UploadAdapter a second header", INVALID,
     lambda w: w.upload(chunks=[fpb.AdapterChunk(header=fpb.AdapterHeader(client_id="org-a"))])),
    ("agg UploadAdapter 1 MB client id", INVALID, lambda w: w.upload(client_id=MB)),
    ("agg UploadAdapter 1 MB run id", INVALID, lambda w: w.upload(run_id=MB)),
    ("agg UploadAdapter 1 MB round nonce", INVALID, lambda w: w.upload(round_nonce=MB)),
    ("agg UploadAdapter 1 MB sha256", INVALID, lambda w: w.upload(sha256=MB)),
    ("agg UploadAdapter sha256 not hex", INVALID, lambda w: w.upload(sha256="not-a-hash")),
    ("agg UploadAdapter negative size", INVALID, lambda w: w.upload(size=-5)),
    ("agg UploadAdapter size over the limit", INVALID, lambda w: w.upload(size=10**12)),
    ("agg UploadAdapter negative successes", INVALID, lambda w: w.upload(num_successes=-3)),
    ("agg UploadAdapter negative examples", INVALID, lambda w: w.upload(num_examples=-1)),
    ("agg UploadAdapter round not open", PRECONDITION, lambda w: w.upload(round=1)),
    ("agg UploadAdapter wrong round nonce", PRECONDITION, lambda w: w.upload(round_nonce="0" * 32)),
    ("agg UploadAdapter another run", PRECONDITION, lambda w: w.upload(run_id="another-run")),
    ("agg UploadAdapter client not joined", PRECONDITION, lambda w: w.upload(client_id="stranger")),
    ("agg UploadAdapter unknown transport dtype", INVALID, lambda w: w.upload(transport_dtype="int4")),
    ("agg UploadAdapter negative offset", INVALID, lambda w: w.upload(offset=-1)),
    ("agg UploadAdapter resume past the bytes held", PRECONDITION,
     lambda w: w.upload(offset=16, chunks=[fpb.AdapterChunk(data=adapter_bytes()[16:])])),
    ("agg UploadAdapter chunk over max_chunk_bytes", INVALID, lambda w: w.upload(
        data=adapter_bytes(), chunks=[fpb.AdapterChunk(data=bytes(ad.CHUNK_BYTES + 1))], size=ad.CHUNK_BYTES + 1)),
    ("agg UploadAdapter header nested 200,000 deep", INVALID, lambda w: w.upload(raw_header(b"[" * 200_000))),
    ("agg UploadAdapter header over 16 MiB", INVALID,
     lambda w: w.upload(struct.pack("<Q", 17 << 20), size=(17 << 20) + 8, sha256="ab" * 32)),
    ("agg UploadAdapter header not JSON", INVALID, lambda w: w.upload(raw_header(b"{not json}      "))),
    ("agg UploadAdapter header of a list", INVALID, lambda w: w.upload(raw_header(b"[1, 2, 3]       "))),
    ("agg UploadAdapter header with a 1 MB tensor name", INVALID,
     lambda w: w.upload(raw_header(json.dumps({MB: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()))),
    ("agg UploadAdapter header unknown dtype", INVALID, lambda w: w.upload(raw_header(json.dumps(
        {A: {"dtype": "F33", "shape": [2, 8], "data_offsets": [0, 64]}}).encode()))),
    ("agg UploadAdapter wrong shapes", INVALID,
     lambda w: w.upload(adapter_bytes(**{A: torch.zeros(3, 8)}))),
    ("agg UploadAdapter missing tensor", INVALID, lambda w: w.upload(ad.encode({A: torch.zeros(2, 8)}))),
    ("agg UploadAdapter extra tensor", INVALID, lambda w: w.upload(adapter_bytes(**{"extra": torch.zeros(1)}))),
    ("agg UploadAdapter bf16 without saying so", INVALID,
     lambda w: w.upload(ad.encode(ad.cast(ad.decode(adapter_bytes()), torch.bfloat16)))),
    ("agg UploadAdapter overlapping data offsets", INVALID, lambda w: w.upload(
        raw_header(json.dumps({A: {"dtype": "F32", "shape": [2, 8], "data_offsets": [0, 64]},
                               B: {"dtype": "F32", "shape": [8, 2], "data_offsets": [0, 64]}}).encode()) + bytes(64))),
    ("agg UploadAdapter NaN values", INVALID,
     lambda w: w.upload(adapter_bytes(**{B: torch.full((8, 2), float("nan"))}))),
    ("agg UploadAdapter infinite values", INVALID,
     lambda w: w.upload(adapter_bytes(**{A: torch.full((2, 8), float("inf"))}))),
    ("agg UploadAdapter sha256 of other bytes", INVALID, lambda w: w.upload(sha256="ab" * 32)),
    ("agg UploadAdapter more bytes than declared", INVALID,
     lambda w: w.upload(size=len(adapter_bytes()) - 8)),
    ("agg UploadAdapter stream ends early", PRECONDITION,
     lambda w: w.upload(chunks=[fpb.AdapterChunk(data=adapter_bytes()[:100])])),
    ("agg UploadAdapter undecodable chunk", INVALID, lambda w: w.raw(
        w.agg_channel, "/fedse.v1.FederationService/UploadAdapter", b"\x12\xff\xff\xff\xff\x0f", stream=True)),
]


def _code(case: tuple[str, grpc.StatusCode, Call]) -> str:
    return f"{case[0]} -> {case[1].name}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    env = Proc("env_server", ["services.env_server", "--address", "127.0.0.1:0", "--envs", "maze",
                              "--metrics-port", "-1"], root)
    agg = Proc("aggregator", ["services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1",
                              "--state-dir", str(root / "state"), "--run-id", "r", "--rounds", "2",
                              "--min-clients", "2", "--round-deadline-s", "600", "--max-adapter-mb", "64"], root)
    try:
        env_target, agg_target = f"127.0.0.1:{env.port()}", f"127.0.0.1:{agg.port()}"
        clients = [FederationClient(agg_target, cid) for cid in ("org-a", "org-b")]
        for c in clients:
            c.join("maze", "fedse-tiny", SCHEMA)
        # Channels with every gRPC default, as a client written from proto/ alone would have.
        with grpc.insecure_channel(env_target) as env_channel, grpc.insecure_channel(agg_target) as agg_channel:
            w = World(epb_grpc.EnvServiceStub(env_channel), fpb_grpc.FederationServiceStub(agg_channel),
                      env_channel, agg_channel, clients[0].status().round_nonce, clients)
            yield w, (env, agg), root
        for c in clients:
            c.close()
    finally:
        agg.stop()
        env.stop()


OUTCOMES: dict[str, str] = {}


@pytest.mark.parametrize("case", CASES, ids=_code)
def test_bad_input_is_refused_with_a_clear_status(world, case):
    w, procs, _ = world
    name, expected, call = case
    with pytest.raises(grpc.RpcError) as err:
        call(w)
    code, details = err.value.code(), err.value.details() or ""
    OUTCOMES[name] = code.name
    assert code == expected, f"{name}: {code.name} {details[:300]}"
    assert details and len(details) <= MAX_STATUS_CHARS and "x" * 100 not in details, (name, details[:300])
    assert all(p.popen.poll() is None for p in procs), f"a server died on {name}"


def test_after_every_bad_input_the_servers_serve_and_a_valid_round_completes(world):
    w, procs, root = world
    assert all(p.popen.poll() is None for p in procs)
    for channel in (w.env_channel, w.agg_channel):
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # Nothing was let in: the same two clients, no upload, no metrics.
    st = w.agg.GetRoundStatus(fpb.RoundStatusRequest(), timeout=10)
    assert (list(st.joined), list(st.uploaded), st.round) == (["org-a", "org-b"], [], 0)
    assert not (root / "state" / "r" / "metrics.jsonl").exists()
    # A valid round: both upload, the round closes, phi_1 (their mean) comes down the stock channel.
    a, b = w.clients
    a.upload(0, adapter_bytes(0.25), num_examples=3, num_successes=1)
    b.upload(0, adapter_bytes(0.75), num_examples=3, num_successes=1)
    a.report(0, {"test_success": 0.5})
    a.wait_until(lambda s: s.round >= 1, timeout_s=60)
    chunks = w.download(round=1)
    phi = ad.decode(b"".join(c.data for c in chunks[1:]))
    assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in phi.values())
    # The env server plays an episode to its end.
    sid = w.finished_session()
    w.env.Close(epb.CloseRequest(session_id=sid), timeout=10)
    by_code: dict[str, int] = {}
    for code in OUTCOMES.values():
        by_code[code] = by_code.get(code, 0) + 1
    print(f"\n{len(OUTCOMES)} kinds of bad input tried, refused with {by_code}; both servers alive and serving; "
          "a valid round completed after")
