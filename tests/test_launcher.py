"""What `fedse run` knows of its aggregators comes through their GetRunStatus: who joined (whether a
federation whose client died can still open round 0) and every round each client reported."""

from __future__ import annotations

import json

import grpc
import pytest
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from apps.launcher import unopenable
from apps.planning import Client, Federation
from apps.results import RunWatch
from fedse.model.tinymodel import TINY_MODEL_NAME, build_tiny_model
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from support import aggregator_in_process

FED = Federation("aggregator", "t", (Client("org-a", ("maze",)), Client("org-b", ("wordle",))))
NEVER = "org-b failed before joining, and aggregator opens round 0 only once every client has joined"


@pytest.fixture(scope="module")
def schema() -> fpb.AdapterSchema:
    """The tiny model's LoRA adapter schema, as a client written from proto/ sends it."""
    model = get_peft_model(build_tiny_model(seed=0)[0], LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    return fpb.AdapterSchema(
        adapter_config_json=json.dumps(model.peft_config["default"].to_dict(), default=list),
        tensors=[fpb.TensorSpec(name=k, shape=list(v.shape), dtype="float32") for k, v in state.items()])


def waiting(*joined: str) -> fpb.RunStatus:
    return fpb.RunStatus(round=fpb.RoundStatus(state=fpb.ROUND_STATE_WAITING_FOR_CLIENTS, joined=joined))


def test_a_federation_cannot_open_round_0_once_a_client_died_before_joining():
    assert unopenable(FED, None, {"org-b"}) == NEVER  # the aggregator has not answered yet: nobody joined
    assert unopenable(FED, waiting("org-a"), {"org-b"}) == NEVER
    assert unopenable(FED, waiting("org-a", "org-b"), {"org-b"}) == ""  # it joined, then died: round 0 can open
    assert unopenable(FED, waiting(), set()) == ""  # nobody died
    opened = fpb.RunStatus(round=fpb.RoundStatus(state=fpb.ROUND_STATE_OPEN, joined=["org-a"]))
    assert unopenable(FED, opened, {"org-b"}) == ""


def test_the_watch_keeps_every_report_and_the_joins_that_get_run_status_shows(tmp_path, schema):
    with aggregator_in_process(tmp_path, min_clients=1, start_clients=2) as (_agg, port, _run_dir):
        watch = RunWatch({"aggregator": f"127.0.0.1:{port}"})
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = fpb_grpc.FederationServiceStub(channel)

            def join(client: Client) -> None:
                stub.Join(fpb.JoinRequest(client_id=client.client_id, env=client.envs[0], base_model=TINY_MODEL_NAME,
                                          schema=schema), timeout=30)

            def report(client_id: str, success: float) -> None:
                stub.ReportMetrics(fpb.MetricsReport(client_id=client_id, round=0, metrics={
                    "test_success": success, "buffer": 4.0}), timeout=30)

            watch.refresh()
            assert unopenable(FED, watch.status["aggregator"], {"org-b"}) == NEVER
            join(FED.clients[0])
            watch.refresh()
            assert list(watch.status["aggregator"].round.joined) == ["org-a"]
            join(FED.clients[1])
            report("org-a", 0.5)
            watch.refresh()
            report("org-b", 0.25)
            watch.refresh()
            assert unopenable(FED, watch.status["aggregator"], {"org-b"}) == ""  # round 0 is open
    assert sorted(watch.reports(), key=lambda r: r["client_id"]) == [
        {"client_id": "org-a", "round": 0, "metrics": {"buffer": 4.0, "test_success": 0.5}},
        {"client_id": "org-b", "round": 0, "metrics": {"buffer": 4.0, "test_success": 0.25}}]
    watch.refresh()  # the aggregator is gone: what it showed last stands
    assert watch.status["aggregator"].round.state == fpb.ROUND_STATE_OPEN and len(watch.reports()) == 2
    watch.close()
