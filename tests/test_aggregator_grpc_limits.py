"""The aggregator over real gRPC on port 0, at its limits: megabyte ids and metric names get short
refusals a default client reads, metrics reports are checked and recorded once, WatchRound streams
cannot starve joins or be held by one client, and a run status too large for a default client says
what it leaves out."""

import json
import time

import grpc
import pytest

from aggregator_support import _join_raw, aggregator, join_two, peft_model  # noqa: F401 - fixtures
from fedse.model import adapter as ad
from fedse.model.tinymodel import TINY_MODEL_NAME
from fedse.transport import serde
from fedse.transport.inputs import MAX_STATUS_CHARS
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from support import aggregator_in_process
from services.client_agent.federation.link import FederationClient


def test_megabyte_ids_get_a_short_refusal_that_a_client_with_default_limits_reads(aggregator, peft_model):
    """Every id a call carries (client, env, base model, tensor names, run, nonce, sha256, transport dtype,
    phase) is bounded up front: a 1 MB one is INVALID_ARGUMENT with a message well under gRPC's 8 KB
    metadata default, never RESOURCE_EXHAUSTED "Stream removed"; the aggregator goes on serving."""
    _agg, target, _ = aggregator
    _pm, state, config_json = peft_model
    huge = "x" * 1_000_000
    schema = ad.Schema.of(state, config_json)
    c1, c2 = join_two(target, state, config_json)
    nonce = c1.status().round_nonce
    good = ad.encode(state)

    def join(**kw):
        req = fpb.JoinRequest(client_id="org-c", env="maze", base_model=TINY_MODEL_NAME,
                              schema=serde.schema_to_proto(schema))
        for k, v in kw.items():
            setattr(req, k, v)
        return lambda stub: stub.Join(req, timeout=30)

    def upload(**kw):
        header = fpb.AdapterHeader(**{"client_id": "org-a", "round": 0, "round_nonce": nonce,
                                      "sha256": ad.sha256_hex(good), "size": len(good), **kw})
        return lambda stub: stub.UploadAdapter(iter([fpb.AdapterChunk(header=header), fpb.AdapterChunk(data=good)]),
                                               timeout=30)

    named = fpb.AdapterSchema(adapter_config_json=config_json,
                              tensors=[fpb.TensorSpec(name=huge, shape=[2], dtype="float32")])
    calls = {
        "Join client_id": join(client_id=huge), "Join env": join(env=huge), "Join base_model": join(base_model=huge),
        "Join tensor name": lambda stub: stub.Join(fpb.JoinRequest(client_id="org-c", env="maze",
                                                                   base_model=TINY_MODEL_NAME, schema=named)),
        "GetRoundStatus": lambda stub: stub.GetRoundStatus(fpb.RoundStatusRequest(client_id=huge)),
        "WatchRound": lambda stub: next(stub.WatchRound(fpb.RoundStatusRequest(client_id=huge), timeout=30)),
        "Heartbeat client_id": lambda stub: stub.Heartbeat(fpb.HeartbeatRequest(client_id=huge, phase="waiting")),
        "Heartbeat phase": lambda stub: stub.Heartbeat(fpb.HeartbeatRequest(client_id="org-a", phase=huge)),
        "ReportMetrics": lambda stub: stub.ReportMetrics(fpb.MetricsReport(client_id=huge, round=0)),
        "GetUploadState client_id": lambda stub: stub.GetUploadState(fpb.UploadStateRequest(client_id=huge)),
        "GetUploadState sha256": lambda stub: stub.GetUploadState(fpb.UploadStateRequest(client_id="org-a",
                                                                                        sha256=huge)),
        "DownloadAdapter sha256": lambda stub: next(stub.DownloadAdapter(fpb.DownloadRequest(round=0, sha256=huge))),
        "DownloadAdapter transport": lambda stub: next(stub.DownloadAdapter(
            fpb.DownloadRequest(round=0, transport_dtype=huge))),
        "Upload client_id": upload(client_id=huge), "Upload run_id": upload(run_id=huge),
        "Upload round_nonce": upload(round_nonce=huge), "Upload sha256": upload(sha256=huge),
        "Upload transport": upload(transport_dtype=huge),
    }
    with grpc.insecure_channel(target) as channel:  # every gRPC default
        stub = fpb_grpc.FederationServiceStub(channel)
        for what, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call(stub)
            code, details = err.value.code(), err.value.details()
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details[:200])
            assert "1000000 characters" in details and len(details) <= MAX_STATUS_CHARS, (what, details[:300])
            assert "x" * 100 not in details, what
        # Nothing was let in: the round goes on with its two clients.
        st = stub.GetRoundStatus(fpb.RoundStatusRequest(client_id="org-a"), timeout=30)
        assert list(st.joined) == ["org-a", "org-b"] and list(st.uploaded) == [] and st.round == 0
    c1.close(), c2.close()


def test_report_metrics_refuses_non_finite_values_and_rounds_outside_the_run(aggregator, peft_model):
    """NaN and a round far past the run (123456 of 2) used to land in metrics.jsonl and the operator view."""
    _agg, target, run_dir = aggregator
    _pm, state, config_json = peft_model
    c1, c2 = join_two(target, state, config_json)
    bad = {
        "NaN": (0, {"test_success": float("nan")}), "+inf": (0, {"train_loss": float("inf")}),
        "-inf": (0, {"train_loss": float("-inf")}), "round far past the run": (123456, {"test_success": 0.5}),
        "round after the final one": (3, {"test_success": 0.5}), "negative round": (-1, {"test_success": 0.5}),
        "1 MB metric name": (0, {"m" * 1_000_000: 1.0}), "too many metrics": (0, {f"m{i}": 1.0 for i in range(300)}),
    }
    for what, (round_, metrics) in bad.items():
        with pytest.raises(grpc.RpcError) as err:
            c1.stub.ReportMetrics(fpb.MetricsReport(client_id="org-a", round=round_, metrics=metrics), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.value.details())
    # Round 1 of 2 is in the run but has not opened yet.
    with pytest.raises(grpc.RpcError) as err:
        c1.stub.ReportMetrics(fpb.MetricsReport(client_id="org-a", round=1, metrics={"x": 1.0}), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "has not opened" in err.value.details()
    c1.report(0, {"test_success": 0.5})
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["client_id"], r["round"], r["metrics"]) for r in lines] == [("org-a", 0, {"test_success": 0.5})]
    view = {c.client_id: c for c in c1.stub.GetRunStatus(fpb.RunStatusRequest(), timeout=10).clients}
    assert (view["org-a"].metrics_round, dict(view["org-a"].metrics)) == (0, {"test_success": 0.5})
    c1.close(), c2.close()


def test_a_repeated_metrics_report_is_acknowledged_and_recorded_once_even_across_a_restart(tmp_path, peft_model):
    """A client killed between reporting a round and saving that it had, reports the round again
    when it restarts; that used to put the round in metrics.jsonl twice."""
    _pm, state, config_json = peft_model

    def recorded(run_dir):
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["client_id"], r["round"], r["metrics"]) for r in lines]

    with aggregator_in_process(tmp_path) as (_agg, port, run_dir):
        c1, c2 = join_two(f"127.0.0.1:{port}", state, config_json)
        c1.report(0, {"test_success": 0.5})
        c1.report(0, {"test_success": 0.75})  # acknowledged: no error
        c2.report(0, {"test_success": 0.25})
        assert recorded(run_dir) == [("org-a", 0, {"test_success": 0.5}), ("org-b", 0, {"test_success": 0.25})]
        c1.close(), c2.close()
    with aggregator_in_process(tmp_path) as (_agg, port, run_dir):
        c1 = FederationClient(f"127.0.0.1:{port}", "org-a")
        c1.join("maze", TINY_MODEL_NAME, ad.Schema.of(state, config_json))
        c1.report(0, {"test_success": 1.0})
        assert recorded(run_dir) == [("org-a", 0, {"test_success": 0.5}), ("org-b", 0, {"test_success": 0.25})]
        view = {c.client_id: c for c in c1.stub.GetRunStatus(fpb.RunStatusRequest(), timeout=10).clients}
        assert (view["org-a"].metrics_round, dict(view["org-a"].metrics)) == (0, {"test_success": 0.5})
        c1.close()


def test_clients_waiting_on_watch_round_do_not_starve_the_next_join(tmp_path, peft_model):
    """40 clients wait on WatchRound (a server thread each); a 41st still joins, and the round opens."""
    _, state, config_json = peft_model
    schema = ad.Schema.of(state, config_json)
    with aggregator_in_process(tmp_path, start_clients=41) as (_agg, port, _):
        target = f"127.0.0.1:{port}"
        clients = [FederationClient(target, f"org-{i:02d}", retries=0, timeout_s=10) for i in range(41)]
        watchers = []
        try:
            for c in clients[:40]:
                c.join("maze", TINY_MODEL_NAME, schema)
                watchers.append(c.stub.WatchRound(fpb.RoundStatusRequest(client_id=c.client_id), timeout=60))
                next(watchers[-1])  # the stream is open and holds its server thread
            clients[40].join("maze", TINY_MODEL_NAME, schema)  # waited forever with a 16-thread pool
            assert clients[40].status().state == fpb.ROUND_STATE_OPEN
        finally:
            for w in watchers:
                w.cancel()
            for c in clients:
                c.close()


def test_one_client_cannot_hold_every_watch_round_thread(tmp_path):
    """Each WatchRound holds a server thread: one client id may hold 8 at once; a 9th is refused with
    RESOURCE_EXHAUSTED and a reason, another client is not affected, and a stream closed frees its place."""
    from services.aggregator.servicer import WATCHES_PER_CLIENT

    with aggregator_in_process(tmp_path) as (_agg, port, _), grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = fpb_grpc.FederationServiceStub(ch)

        def watch(cid):
            stream = stub.WatchRound(fpb.RoundStatusRequest(client_id=cid), timeout=30)
            next(stream)  # open, and holding its server thread
            return stream

        held = [watch("org-a") for _ in range(WATCHES_PER_CLIENT)]
        with pytest.raises(grpc.RpcError) as err:
            watch("org-a")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"already holds {WATCHES_PER_CLIENT} WatchRound streams" in err.value.details()
        other = watch("org-b")
        held.pop().cancel()
        deadline = time.monotonic() + 10
        while True:  # the server notices the cancel within its 1 s poll
            try:
                held.append(watch("org-a"))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.2)
        for s in held + [other]:
            s.cancel()


def test_ids_that_have_not_joined_share_a_few_watch_round_streams(tmp_path):
    """Each WatchRound holds a server thread: made-up ids (8 streams each) could hold the whole pool.
    Ids that have not joined share WATCHES_NOT_JOINED streams; a member still watches."""
    from services.aggregator.servicer import WATCHES_NOT_JOINED

    with aggregator_in_process(tmp_path) as (_agg, port, _), grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = fpb_grpc.FederationServiceStub(ch)

        def watch(cid):
            stream = stub.WatchRound(fpb.RoundStatusRequest(client_id=cid), timeout=30)
            next(stream)
            return stream

        held = [watch(f"made-up-{i}") for i in range(WATCHES_NOT_JOINED)]
        try:
            with pytest.raises(grpc.RpcError) as err:
                watch("made-up-more")
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "have not joined" in err.value.details()
            _join_raw(stub, "org-a")
            held.append(watch("org-a"))
        finally:
            for s in held:
                s.cancel()


def test_a_run_status_too_large_for_a_default_client_leaves_out_the_last_clients_metrics_and_says_so():
    """64 clients with 256 metrics of 256-byte names: GetRunStatus keeps every client's entry, leaves the
    metrics of the last ones out until the reply fits what a default client receives, and fedse
    status says how many."""
    from apps.cli import format_status
    from services.aggregator.rounds import MAX_METRIC_NAME_BYTES, MAX_METRICS
    from services.aggregator.servicer import RUN_STATUS_BYTES, within_reply_budget

    metrics = {f"{j:04d}".ljust(MAX_METRIC_NAME_BYTES, "m"): 0.5 for j in range(MAX_METRICS)}
    reply = fpb.RunStatus(config=fpb.RunConfig(run_id="t", num_rounds=2), round=fpb.RoundStatus(run_id="t"),
                          clients=[fpb.ClientStatus(client_id=f"org-{i:02d}", env="maze", metrics_round=0,
                                                    metrics=metrics) for i in range(64)])
    assert reply.ByteSize() > 4 * 1024 * 1024
    trimmed = within_reply_budget(reply)
    assert trimmed.ByteSize() <= RUN_STATUS_BYTES
    assert len(trimmed.clients) == 64 and 0 < trimmed.clients_without_metrics < 64
    kept = [bool(c.metrics) for c in trimmed.clients]
    assert kept == sorted(kept, reverse=True) and sum(kept) == 64 - trimmed.clients_without_metrics
    shown = format_status(trimmed)
    assert f"{trimmed.clients_without_metrics} of the last clients shown without their metrics" in shown


def test_a_metric_name_over_its_byte_limit_is_refused(aggregator, peft_model):
    _, state, config_json = peft_model
    _agg, target, _ = aggregator
    c1, c2 = join_two(target, state, config_json)
    try:
        with pytest.raises(grpc.RpcError) as err:
            c1.stub.ReportMetrics(fpb.MetricsReport(client_id="org-a", round=0, metrics={"\U0001F600" * 100: 1.0}),
                                  timeout=10)  # 100 characters, 400 bytes
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bytes in UTF-8" in err.value.details()
    finally:
        c1.close()
        c2.close()


def test_a_refusal_that_repeats_characters_outside_ascii_keeps_its_status(tmp_path):
    """gRPC sends a status message percent-encoded in a header of at most 8 KB: a base model of 1,024
    emoji repeated in a refusal took 12 KB there, and the client got RESOURCE_EXHAUSTED instead of
    the refusal. Messages go in ASCII, escaped and bounded."""
    emoji = "\U0001F600"
    with aggregator_in_process(tmp_path, min_clients=1) as (_agg, port, _), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = fpb_grpc.FederationServiceStub(ch)
        _join_raw(stub, "org-a", base_model=emoji * 1024)
        with pytest.raises(grpc.RpcError) as err:
            _join_raw(stub, "org-b", base_model="another-model" + emoji * 1000)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()[:200]
        details = err.value.details()
        assert details.isascii() and len(details) <= MAX_STATUS_CHARS and "\\U0001f600" in details
