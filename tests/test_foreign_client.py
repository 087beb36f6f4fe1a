"""A client written from proto/ alone, against the real aggregator on port 0: it uses only grpc and
the generated stubs (and safetensors to make its adapter), and learns where to resume an upload
from GetUploadState, as federation.proto's comments say, never from a status message."""

import hashlib
import json

import grpc
import numpy
import pytest
from safetensors.numpy import save

from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from support import aggregator_in_process

A = "base_model.model.layers.0.q_proj.lora_A.weight"
B = "base_model.model.layers.0.q_proj.lora_B.weight"
CHUNK = 256


def test_a_client_from_the_proto_alone_resumes_an_interrupted_upload(tmp_path):
    rng = numpy.random.default_rng(0)
    data = save({A: rng.standard_normal((8, 64), dtype=numpy.float32),
                 B: rng.standard_normal((64, 8), dtype=numpy.float32)})
    sha = hashlib.sha256(data).hexdigest()
    assert len(data) > 12 * CHUNK
    with aggregator_in_process(tmp_path, min_clients=1, rounds=1) as (_agg, port, run_dir), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = fpb_grpc.FederationServiceStub(channel)
        schema = fpb.AdapterSchema(tensors=[fpb.TensorSpec(name=A, shape=[8, 64], dtype="F32"),
                                            fpb.TensorSpec(name=B, shape=[64, 8], dtype="F32")],
                                   adapter_config_json=json.dumps({"r": 8, "lora_alpha": 16}))
        joined = stub.Join(fpb.JoinRequest(client_id="org-x", env="maze", base_model="tiny", schema=schema),
                           timeout=10)
        assert joined.config.max_chunk_bytes >= CHUNK
        st = stub.GetRoundStatus(fpb.RoundStatusRequest(client_id="org-x"), timeout=10)
        assert st.state == fpb.ROUND_STATE_OPEN

        def stream(offset: int, end: int, dies: bool = False):
            yield fpb.AdapterChunk(header=fpb.AdapterHeader(
                client_id="org-x", round=st.round, round_nonce=st.round_nonce, sha256=sha, size=len(data),
                offset=offset, num_examples=3, num_successes=1))
            for start in range(offset, end, CHUNK):
                yield fpb.AdapterChunk(data=data[start:min(start + CHUNK, end)])
            if dies:
                raise RuntimeError("the client's connection dies mid-upload")

        def refused(offset: int, end: int, dies: bool = False) -> grpc.StatusCode:
            with pytest.raises(grpc.RpcError) as err:
                stub.UploadAdapter(stream(offset, end, dies), timeout=10)
            return err.value.code()

        def upload_state() -> tuple[int, bool]:
            state = stub.GetUploadState(fpb.UploadStateRequest(client_id="org-x", round=st.round, sha256=sha),
                                        timeout=10)
            return state.received_bytes, state.complete

        assert upload_state() == (0, False)  # nothing begun: start from byte 0
        # A stream that ends short is refused; what arrived is kept.
        assert refused(0, 3 * CHUNK) == grpc.StatusCode.FAILED_PRECONDITION
        assert upload_state() == (3 * CHUNK, False)
        # A stream that dies halfway keeps what arrived (how much of it got out is up to timing).
        refused(3 * CHUNK, 6 * CHUNK, dies=True)
        held, complete = upload_state()
        assert 3 * CHUNK <= held <= 6 * CHUNK and not complete
        # A header whose offset is past the bytes held is refused, and GetUploadState says where to go on.
        assert refused(10 * CHUNK, len(data)) == grpc.StatusCode.FAILED_PRECONDITION
        held, complete = upload_state()
        assert 3 * CHUNK <= held <= 6 * CHUNK and not complete
        # The rest, from there: acknowledged.
        ack = stub.UploadAdapter(stream(held, len(data)), timeout=10)
        assert (ack.round, ack.sha256, ack.size) == (st.round, sha, len(data))
        assert upload_state() == (len(data), True)
        assert (run_dir / "uploads" / "round_0000" / "org-x.safetensors").read_bytes() == data
        # Its only client uploaded: the round closes and the run, of one round, finishes. The accepted
        # upload still answers complete, and its header alone (offset = size) is acknowledged again.
        for st_now in stub.WatchRound(fpb.RoundStatusRequest(client_id="org-x"), timeout=30):
            if st_now.state == fpb.ROUND_STATE_FINISHED:
                break
        assert upload_state() == (len(data), True)
        assert stub.UploadAdapter(stream(len(data), len(data)), timeout=10).sha256 == sha
