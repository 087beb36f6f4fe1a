"""Asynchronous rounds' rules (services.aggregator.buffer_rules) as an unlucky or self-serving member
meets them: a client that holds a slot and never uploads, a buffer below --min-clients, an upload
during the last fold, an upload without a slot, a second update from one version, and FedBuff's
server learning rate on hand-computed numbers. A hand-driven clock; one test over real gRPC."""

from __future__ import annotations

import threading

import pytest
import torch

from fedse.model import adapter as ad
from services.aggregator.errors import DuplicateUpload, NotSelected, RunFinished
from services.aggregator.state import State
from services.aggregator.store import Store
from services.aggregator.uploads import UploadHeader
from test_async_rounds import asynchronous, send, version
from test_rounds import A, B, Clock, adapter_bytes, join, settle


def alive(fed, clock, seconds: float, *clients: str) -> None:
    """`seconds` pass while `clients` send a heartbeat every 5 s (alive, never uploading)."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + 5)
        for c in clients:
            fed.seen(c, fed.status().round, "training")
    fed.tick()
    settle(fed)


def test_a_silent_client_holding_a_slot_loses_it_at_the_deadline_to_a_waiting_client(tmp_path):
    clock = Clock()  # round_deadline_s 100, heartbeat timeout 10
    fed = asynchronous(tmp_path, clock, start_clients=2, async_concurrency=1, async_buffer=1)
    join(fed, "a", "b")
    assert fed.status().selected == ("a",)
    alive(fed, clock, 95, "a", "b")
    assert fed.status().selected == ("a",)  # within its deadline a keeps it
    alive(fed, clock, 10, "a", "b")  # a is alive and silent past its deadline: the slot goes to b
    assert fed.status().selected == ("b",) and fed.run.members["a"].dropouts == 1
    with pytest.raises(NotSelected, match="holds no training slot .* wait until RoundStatus.selected names it"):
        send(fed, "a", 0, 1.0)  # too late: its slot is b's
    send(fed, "b", 0, 2.0)
    assert fed.status().round == 1 and torch.equal(version(tmp_path, 1)[A], torch.full((2, 3), 2.0))


def test_a_buffer_that_cannot_fill_folds_at_the_deadline_with_min_clients(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, min_clients=2, start_clients=3, async_concurrency=3, async_buffer=3)
    join(fed, "a", "b", "c")
    send(fed, "a", 0, 1.0)
    send(fed, "b", 0, 3.0)
    alive(fed, clock, 90, "a", "b", "c")  # c trains on, alive: the buffer waits for it
    assert fed.status().round == 0
    alive(fed, clock, 11, "a", "b", "c")  # the version's deadline: it folds what it has, as a sync round closes
    assert fed.status().round == 1 and torch.equal(version(tmp_path, 1)[A], torch.full((2, 3), 2.0))


def test_a_fold_waits_for_min_clients_updates(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, min_clients=2, start_clients=2, async_concurrency=2, async_buffer=1)
    join(fed, "a", "b")
    send(fed, "a", 0, 1.0)  # a buffer of one is full, but a fold needs two updates
    assert fed.status().round == 0
    alive(fed, clock, 200, "a")  # b died, the deadline passed: still one update, and no fold
    assert fed.status().round == 0 and fed.status().state is State.OPEN
    fed.seen("b", 0, "training")  # b is back, is given a slot again and uploads
    fed.tick()
    assert "b" in fed.status().selected
    send(fed, "b", 0, 3.0)
    assert fed.status().round == 1 and torch.equal(version(tmp_path, 1)[A], torch.full((2, 3), 2.0))


def test_min_clients_above_the_buffer_is_refused_at_start_up():
    from fedse.config import ConfigError
    from services.aggregator.server import AggregatorConfig

    with pytest.raises(ConfigError, match="--min-clients 3 is more than a buffer holds \\(2"):
        AggregatorConfig(mode="async", min_clients=3, async_concurrency=2)
    for lr in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--async-server-lr must be a positive number"):
            AggregatorConfig(mode="async", async_server_lr=lr)
    with pytest.raises(ConfigError, match="--async-server-lr 0.5 is FedBuff's, for --mode async"):
        AggregatorConfig(async_server_lr=0.5)
    assert AggregatorConfig(mode="async", async_server_lr=0.5).settings().async_server_lr == 0.5


def slow_fold(fed) -> tuple[threading.Event, threading.Event]:
    """Makes the keeper's next aggregation wait: (started, release)."""
    started, release = threading.Event(), threading.Event()
    real = fed._aggregate

    def waiting(*args):
        started.set()
        assert release.wait(30)
        return real(*args)
    fed._aggregate = waiting
    return started, release


def accept_from_a(fed) -> None:
    """Client a's update of version 0 accepted, without waiting for the fold it starts (slow_fold holds it)."""
    data = adapter_bytes(1.0)
    h = UploadHeader("a", 0, fed.status().round_nonce, ad.sha256_hex(data), len(data))
    _, _, gen = fed.begin_upload(h)
    fed.receive(h, gen, 0, data)
    fed.finish_upload(h, gen)


def test_an_upload_during_the_last_fold_is_refused_not_lost(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, num_rounds=1, start_clients=2, async_concurrency=2, async_buffer=1)
    join(fed, "a", "b")
    started, release = slow_fold(fed)
    accept_from_a(fed)  # the last version's fold starts beside the acknowledgement
    assert started.wait(30) and fed.status().state is State.AGGREGATING
    try:
        with pytest.raises(RunFinished, match="ends with version 1, which is being folded now: .* download the final"):
            send(fed, "b", 0, 3.0)
    finally:
        release.set()
    settle(fed)
    assert fed.status().state is State.FINISHED and "b" not in Store(tmp_path, "r").accepted_uploads(0)


def test_an_upload_during_an_earlier_fold_goes_into_the_next_buffer(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, num_rounds=3, start_clients=2, async_concurrency=2, async_buffer=1)
    join(fed, "a", "b")
    started, release = slow_fold(fed)
    accept_from_a(fed)
    assert started.wait(30)
    data_b = adapter_bytes(3.0)
    hb = UploadHeader("b", 0, fed.status().round_nonce, ad.sha256_hex(data_b), len(data_b))
    _, _, gen_b = fed.begin_upload(hb)
    fed.receive(hb, gen_b, 0, data_b)
    release.set()
    fed.finish_upload(hb, gen_b)  # accepted for version 1's buffer, which folds it
    settle(fed)
    settle(fed)
    assert fed.status().round == 2


def test_an_upload_from_a_client_holding_no_slot_is_refused(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, start_clients=2, async_concurrency=1, async_buffer=1)
    join(fed, "a", "b")
    assert fed.status().selected == ("a",)
    with pytest.raises(NotSelected, match="client b holds no training slot"):
        send(fed, "b", 0, 5.0)
    assert fed.status().round == 0 and not Store(tmp_path, "r").accepted_uploads(0)


def test_a_second_update_from_one_version_is_refused_and_the_first_is_kept(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, start_clients=2, async_concurrency=2, async_buffer=1)
    join(fed, "a", "b")
    send(fed, "a", 0, 1.0)  # version 1
    store = Store(tmp_path, "r")
    first, record = store.upload_path(0, "a").read_bytes(), store.accepted_uploads(0)["a"]
    assert "a" in fed.status().selected  # a slot for version 1
    for value in (2.0, 4.0):
        with pytest.raises(DuplicateUpload, match="already has an update trained from version 0 accepted"):
            send(fed, "a", 0, value)
    assert store.upload_path(0, "a").read_bytes() == first and store.accepted_uploads(0)["a"] == record
    assert fed.status().round == 1


def test_the_server_learning_rate_scales_the_buffers_mean_update(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, start_clients=2, async_concurrency=2, async_buffer=2, async_server_lr=0.5)
    join(fed, "a", "b")
    phi0 = version(tmp_path, 0)
    send(fed, "a", 0, 1.0)
    send(fed, "b", 0, 3.0)
    # Both fresh (weight 1): phi_1 = phi_0 + 0.5 * ((1 - phi_0) + (3 - phi_0)) / 2 = 0.5 phi_0 + 1.
    got = version(tmp_path, 1)
    for k in (A, B):
        assert torch.allclose(got[k].double(), 0.5 * phi0[k].double() + 1.0, atol=1e-6)


def test_over_grpc_an_upload_without_a_slot_and_a_second_from_one_version_are_refused(tmp_path):
    import grpc

    from fedse.v1 import federation_pb2 as fpb
    from services.client_agent.federation.link import FederationClient, upload_chunks
    from support import aggregator_in_process

    state = {A: torch.zeros(2, 3), B: torch.zeros(3, 2)}

    def raw_upload(c, base: int, value: float) -> None:
        data = adapter_bytes(value)
        header = fpb.AdapterHeader(round=base, client_id=c.client_id, round_nonce=c.status().round_nonce,
                                   sha256=ad.sha256_hex(data), size=len(data))
        c.stub.UploadAdapter(upload_chunks(header, data, c.chunk_bytes), timeout=30)

    with aggregator_in_process(tmp_path, min_clients=1, start_clients=2, rounds=3, mode="async", async_concurrency=1,
                               async_buffer=1) as (_agg, port, run_dir):
        x, y = (FederationClient(f"127.0.0.1:{port}", cid, retries=2, backoff_s=0.1) for cid in ("x", "y"))
        for c in (x, y):
            c.join("maze", "fedse-tiny", ad.Schema.of(state, '{"r": 2}'))
        assert list(x.status().selected) == ["x"]
        with pytest.raises(grpc.RpcError) as refused:
            raw_upload(y, 0, 5.0)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "client y holds no training slot" in refused.value.details()
        raw_upload(x, 0, 1.0)
        x.wait_until(lambda s: s.round >= 1, timeout_s=30)
        first = (run_dir / "uploads").glob("*/x.*")
        kept = {p.name: p.read_bytes() for p in first}
        with pytest.raises(grpc.RpcError) as again:
            raw_upload(x, 0, 2.0)
        assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "already has an update trained from version 0" in again.value.details()
        assert {p.name: p.read_bytes() for p in (run_dir / "uploads").glob("*/x.*")} == kept
        assert x.status().round == 1
        x.close(), y.close()
