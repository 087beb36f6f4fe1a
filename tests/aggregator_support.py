"""What the tests of the aggregator over real gRPC (tests/test_aggregator_grpc*.py) share: a tiny
model's LoRA adapter (made once per module), an aggregator on port 0, two clients joined, raw
uploads, and joins as a client written from proto/ alone sends them."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from fedse.model import adapter as ad
from fedse.model.tinymodel import TINY_MODEL_NAME, build_tiny_model
from fedse.v1 import federation_pb2 as fpb
from support import aggregator_in_process
from services.client_agent.federation.link import FederationClient


@pytest.fixture(scope="module")
def peft_model():
    model, _tok = build_tiny_model(seed=0)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    pm = get_peft_model(model, cfg)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(pm, save_embedding_layers=False).items()}
    config_json = json.dumps(pm.peft_config["default"].to_dict(), default=list)
    return pm, state, config_json


def perturbed(state: ad.Adapter, seed: int, scale: float = 0.01) -> ad.Adapter:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


@pytest.fixture
def aggregator(tmp_path):
    with aggregator_in_process(tmp_path, round_deadline_s=60.0) as (agg, port, run_dir):
        yield agg, f"127.0.0.1:{port}", run_dir


def join_two(target, state, config_json):
    schema = ad.Schema.of(state, config_json)
    c1, c2 = FederationClient(target, "org-a"), FederationClient(target, "org-b")
    r1 = c1.join("maze", TINY_MODEL_NAME, schema)
    assert r1.current_round == 0 and r1.config.num_rounds == 2
    assert c1.status().state == fpb.ROUND_STATE_WAITING_FOR_CLIENTS
    c2.join("wordle", TINY_MODEL_NAME, schema)
    assert c1.status().state == fpb.ROUND_STATE_OPEN
    return c1, c2


def raw_upload(client: FederationClient, header: fpb.AdapterHeader, parts: list[bytes]):
    msgs = [fpb.AdapterChunk(header=header)] + [fpb.AdapterChunk(data=p) for p in parts]
    return client.stub.UploadAdapter(iter(msgs), timeout=10)


A_NAME, B_NAME = "base_model.model.m.lora_A.weight", "base_model.model.m.lora_B.weight"
RANK_2 = [(A_NAME, [2, 8]), (B_NAME, [8, 2])]


def _join_raw(stub, cid, tensors=RANK_2, base_model=TINY_MODEL_NAME):
    """Join as a client written from proto/ alone sends it: fp32 tensors of these names and shapes."""
    return stub.Join(fpb.JoinRequest(client_id=cid, env="maze", base_model=base_model, schema=fpb.AdapterSchema(
        adapter_config_json='{"r": 2, "lora_alpha": 4}',
        tensors=[fpb.TensorSpec(name=n, shape=shape, dtype="float32") for n, shape in tensors])), timeout=10)
