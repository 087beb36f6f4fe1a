"""The adapter codec: safetensors bytes round trip, hashing, chunking, validation, fresh init."""

import json
import struct

import pytest
import torch

from fedse.model import adapter as ad
from fedse.transport import serde
from services.aggregator.adapter_files import AdapterFile, fresh
from services.aggregator.store import write_peft_dir
from services.aggregator.upload_check import UploadCheck


def sample_adapter() -> ad.Adapter:
    g = torch.Generator().manual_seed(1)
    return {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(8, 16, generator=g),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(16, 8, generator=g),
    }


def test_round_trip_through_safetensors_bytes_is_exact():
    a = sample_adapter()
    data = ad.encode(a)
    b = ad.decode(data)
    assert set(b) == set(a)
    for k in a:
        assert torch.equal(a[k], b[k])
    # The same tensors always give the same bytes, so sha256 identifies an adapter.
    assert ad.sha256_hex(ad.encode(b)) == ad.sha256_hex(data)


def test_chunks_reassemble_and_respect_the_limit():
    data = bytes(range(256)) * 1000
    for source in (data, bytearray(data)):
        parts = list(ad.chunks(source, 1000))
        assert all(len(p) <= 1000 and type(p) is bytes for p in parts)
        assert b"".join(parts) == data
    assert b"".join(ad.chunks(data, 999, offset=5000)) == data[5000:]
    assert list(ad.chunks(data, 10, offset=len(data))) == []
    with pytest.raises(ValueError, match="outside"):
        list(ad.chunks(data, 10, offset=len(data) + 1))
    with pytest.raises(ValueError, match="positive"):
        list(ad.chunks(data, 0))


def validate(schema, data, sha256, declared_size, max_bytes, transport=""):
    """The aggregator's streaming check (UploadCheck) over a whole adapter at once."""
    check = UploadCheck(schema, declared_size, max_bytes, transport)
    check.update(data)
    check.finish(sha256)


def test_validate_refuses_each_kind_of_bad_adapter():
    a = sample_adapter()
    schema = ad.Schema.of(a, "{}")
    data = ad.encode(a)
    sha = ad.sha256_hex(data)
    validate(schema, data, sha, len(data), 1 << 20)  # a good one passes
    with pytest.raises(ad.AdapterError, match="sha256"):
        validate(schema, data, "0" * 64, len(data), 1 << 20)
    with pytest.raises(ad.AdapterError, match="cut short"):
        validate(schema, data[:-10], sha, len(data), 1 << 20)
    with pytest.raises(ad.AdapterError, match="limit"):
        validate(schema, data, sha, len(data), 100)
    wrong_shape = dict(a)
    wrong_shape["base_model.model.layers.0.q_proj.lora_A.weight"] = torch.zeros(4, 16)
    d = ad.encode(wrong_shape)
    with pytest.raises(ad.AdapterError, match="shape"):
        validate(schema, d, ad.sha256_hex(d), len(d), 1 << 20)
    nan = dict(a)
    nan["base_model.model.layers.0.q_proj.lora_B.weight"] = torch.full((16, 8), float("nan"))
    d = ad.encode(nan)
    with pytest.raises(ad.AdapterError, match="NaN"):
        validate(schema, d, ad.sha256_hex(d), len(d), 1 << 20)
    missing = {"base_model.model.layers.0.q_proj.lora_A.weight": a["base_model.model.layers.0.q_proj.lora_A.weight"]}
    d = ad.encode(missing)
    with pytest.raises(ad.AdapterError, match="1 missing"):
        validate(schema, d, ad.sha256_hex(d), len(d), 1 << 20)
    with pytest.raises(ad.AdapterError, match="safetensors"):
        validate(schema, b"garbage!", ad.sha256_hex(b"garbage!"), 8, 1 << 20)


def test_fresh_adapter_is_deterministic_with_zero_b():
    schema = ad.Schema.of(sample_adapter(), "{}")
    (image, one), (image2, two) = fresh(schema, seed=3), fresh(schema, seed=3)
    assert image == image2
    for k in one:
        assert torch.equal(one[k], two[k])
    assert torch.count_nonzero(one["base_model.model.layers.0.q_proj.lora_B.weight"]) == 0
    a = one["base_model.model.layers.0.q_proj.lora_A.weight"]
    assert a.abs().max() <= 1 / 16 ** 0.5 and a.std() > 0
    assert not torch.equal(a, fresh(schema, seed=4)[1]["base_model.model.layers.0.q_proj.lora_A.weight"])
    # The image is the safetensors file of those tensors, as encode would write it.
    assert bytes(image) == ad.encode(one)
    assert all(torch.equal(v, one[k]) for k, v in ad.decode(bytes(image)).items())


def test_schema_proto_round_trip():
    schema = ad.Schema.of(sample_adapter(), json.dumps({"r": 8}))
    assert serde.schema_from_proto(serde.schema_to_proto(schema)) == schema


def test_peft_dir_is_written_atomically_and_replaced(tmp_path):
    data = ad.encode(sample_adapter())
    target = tmp_path / "round_0001"
    write_peft_dir(target, data, '{"r": 8}')
    write_peft_dir(target, data + b"", '{"r": 4}')
    got, cfg = (target / ad.WEIGHTS_NAME).read_bytes(), (target / ad.CONFIG_NAME).read_text()
    assert got == data and json.loads(cfg) == {"r": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_0001"]


def test_adapter_file_reads_each_tensor_as_saved_and_refuses_a_truncated_file(tmp_path):
    saved = {"a.lora_A.weight": torch.randn(3, 5), "a.lora_B.weight": torch.randn(5, 3).to(torch.bfloat16),
             "steps": torch.arange(4)}
    path = tmp_path / "x.safetensors"
    path.write_bytes(ad.encode(saved))
    view = AdapterFile(path)
    assert sorted(view) == sorted(saved) and len(view) == 3
    for name, t in saved.items():
        assert view[name].dtype == t.dtype and torch.equal(view[name], t)
    with pytest.raises(KeyError):
        view["missing"]
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ad.AdapterError, match="truncated"):
        AdapterFile(path)[max(saved, key=lambda n: AdapterFile(path)._specs[n]["data_offsets"][1])]
    path.write_bytes(b"\x01")
    with pytest.raises(ad.AdapterError, match="not a safetensors file"):
        AdapterFile(path)


def test_the_finite_check_is_exact_even_when_the_sum_overflows():
    """The upload check proves finiteness by a finite sum, element by element only when the sum
    is not finite: overflow must not refuse finite values, and NaN or inf must never pass."""
    name = "base_model.model.layers.0.q_proj.lora_A.weight"
    schema = ad.Schema.of({name: torch.zeros(4)}, "{}")

    def check(values: torch.Tensor) -> None:
        data = ad.encode({name: values})
        validate(schema, data, ad.sha256_hex(data), len(data), 1 << 20)

    check(torch.randn(4))
    big = torch.full((4,), 3e38)  # finite elements whose float32 sum overflows to inf
    assert not torch.isfinite(big.sum())
    check(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(4)
        t[2] = bad
        with pytest.raises(ad.AdapterError, match="NaN or infinite"):
            check(t)
    with pytest.raises(ad.AdapterError, match="NaN or infinite"):
        check(torch.tensor([float("inf"), float("-inf"), 1.0, 2.0]))  # sums to NaN


def feed(check: UploadCheck, data: bytes, step: int) -> None:
    for start in range(0, len(data), step):
        check.update(data[start:start + step])


@pytest.mark.parametrize("step", [1, 3, 7, 64, 1 << 20])
def test_upload_check_reads_any_split_of_the_stream(step):
    a = sample_adapter()
    schema = ad.Schema.of(a, "{}")
    data = ad.encode(a)
    check = UploadCheck(schema, len(data), 1 << 20)
    feed(check, data, step)
    check.finish(ad.sha256_hex(data))
    # A NaN whose bytes straddle two pieces is still found.
    nan = dict(a)
    nan["base_model.model.layers.0.q_proj.lora_B.weight"] = a["base_model.model.layers.0.q_proj.lora_B.weight"].clone()
    nan["base_model.model.layers.0.q_proj.lora_B.weight"][3, 5] = float("inf")
    d = ad.encode(nan)
    with pytest.raises(ad.AdapterError, match="lora_B.weight' holds NaN or infinite"):
        feed(UploadCheck(schema, len(d), 1 << 20), d, step)


def test_upload_check_refuses_a_bad_header_at_its_first_chunk():
    a = sample_adapter()
    schema = ad.Schema.of(a, "{}")
    wrong = ad.encode({k: torch.zeros(2, 2) for k in a})
    check = UploadCheck(schema, len(wrong) + 10_000, 1 << 20)  # more bytes announced than will ever come
    with pytest.raises(ad.AdapterError, match="shape"):
        check.update(wrong[:-16])  # the header and half the values
    assert check.received == len(wrong) - 16
    # Declared sizes that disagree with the header's tensors are refused too.
    data = ad.encode(a)
    with pytest.raises(ad.AdapterError, match="declares"):
        UploadCheck(schema, len(data) + 4, 1 << 20).update(data)


def test_upload_check_bounds_the_header_before_parsing_it():
    schema = ad.Schema.of(sample_adapter(), "{}")
    deep = b"[" * 200_000  # json.loads would raise RecursionError
    data = struct.pack("<Q", len(deep)) + deep
    with pytest.raises(ad.AdapterError, match="nests deeper than 8 levels"):
        validate(schema, data, ad.sha256_hex(data), len(data), 1 << 20)
    # Deep nesting hidden in strings is text, not nesting; a closed but deep structure is refused.
    text = b'{"a[[[[\\\\": "]]]]\\"[[[["}'  # a key ending in a backslash, a value holding a quote
    assert json.loads(text) and ad.json_depth_within(text, 1)
    assert not ad.json_depth_within(b'{"a": ' + b"[" * 9 + b"]" * 9 + b"}", 8)
    # A header longer than the limit is refused at its length prefix, before its bytes are held.
    check = UploadCheck(schema, 1 << 30, 1 << 30)
    with pytest.raises(ad.AdapterError, match="header claims .* more than the limit"):
        check.update(struct.pack("<Q", ad.MAX_HEADER_BYTES + 1))
    with pytest.raises(ad.AdapterError, match="more than the limit"):
        ad.parse_header(b" " * (ad.MAX_HEADER_BYTES + 1), "the upload")


def test_upload_check_takes_bf16_on_the_wire_only_when_the_header_says_so():
    a = sample_adapter()
    schema = ad.Schema.of(a, "{}")
    bf16 = ad.encode(ad.cast(a, torch.bfloat16))
    validate(schema, bf16, ad.sha256_hex(bf16), len(bf16), 1 << 20, "bfloat16")
    with pytest.raises(ad.AdapterError, match="dtype"):
        validate(schema, bf16, ad.sha256_hex(bf16), len(bf16), 1 << 20)
    fp32 = ad.encode(a)
    with pytest.raises(ad.AdapterError, match="transport dtype is bfloat16"):
        validate(schema, fp32, ad.sha256_hex(fp32), len(fp32), 1 << 20, "bfloat16")
    wrong_shape = ad.encode({k: torch.zeros(4, 4, dtype=torch.bfloat16) for k in a})
    with pytest.raises(ad.AdapterError, match="shape"):
        validate(schema, wrong_shape, ad.sha256_hex(wrong_shape), len(wrong_shape), 1 << 20, "bfloat16")
    inf = ad.cast(a, torch.bfloat16)
    inf["base_model.model.layers.0.q_proj.lora_A.weight"][0, 0] = float("-inf")
    d = ad.encode(inf)
    with pytest.raises(ad.AdapterError, match="NaN or infinite"):
        validate(schema, d, ad.sha256_hex(d), len(d), 1 << 20, "bfloat16")


@pytest.mark.parametrize("tensors, config, message", [
    ((), "{}", "lists no tensors"),
    ((ad.TensorSpec("", (2,), "float32"),), "{}", "name .* is not valid"),
    ((ad.TensorSpec("t" * 2000, (2,), "float32"),), "{}", r"\(2000 characters\) is not valid"),
    ((ad.TensorSpec("a", (2,), "float32"), ad.TensorSpec("a", (2,), "float32")), "{}", "listed twice"),
    ((ad.TensorSpec("a", (2, -1), "float32"),), "{}", "each 0 to"),
    ((ad.TensorSpec("a", (1,) * 9, "float32"),), "{}", "at most 8 dimensions"),
    ((ad.TensorSpec("a", (2**62, 2**62, 0), "float32"),), "{}", "each 0 to 2147483647"),
    ((ad.TensorSpec("m.lora_A.weight", (8,), "float32"),), "{}", "a LoRA factor has two dimensions or more"),
    ((ad.TensorSpec("m.lora_B.weight", (8, 0), "float32"),), "{}", "a LoRA factor has two dimensions or more"),
    ((ad.TensorSpec("a", (2,), "banana"),), "{}", "dtype 'banana': use one of"),
    ((ad.TensorSpec("a", (1 << 30, 1 << 10), "float32"),), "{}", "more than the limit"),
    ((ad.TensorSpec("a", (2,), "float32"),), "not json", "not a JSON object"),
    ((ad.TensorSpec("a", (2,), "float32"),), "[1]", "not a JSON object"),
    ((ad.TensorSpec("a", (2,), "float32"),), "[" * 10_000, "not a JSON object"),
    ((ad.TensorSpec("a", (2,), "float32"),), '{"a": "' + "x" * 70_000 + '"}', "more than the limit of 65536"),
])
def test_schema_check_refuses_what_no_adapter_has(tensors, config, message):
    with pytest.raises(ad.AdapterError, match=message):
        ad.Schema(tensors, config).check(1 << 20)
    ad.Schema((ad.TensorSpec("a", (2, 3), "float32"),), '{"r": 2}').check(1 << 20)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": "28", "data_offsets": [0, 64]},  # a string: read as [2, 8]
    {"dtype": "F32", "shape": [2.0, 8], "data_offsets": [0, 64]},
    {"dtype": "F32", "shape": [True, 8], "data_offsets": [0, 64]},
    {"dtype": "F32", "shape": [2, 8], "data_offsets": [0, 64, 128]},
    {"dtype": "F32", "shape": [2, 8], "data_offsets": "064"},
    {"dtype": ["F32"], "shape": [2, 8], "data_offsets": [0, 64]},
], ids=["string-shape", "float-dim", "bool-dim", "three-offsets", "string-offsets", "list-dtype"])
def test_a_header_entry_that_safetensors_would_not_write_is_refused(entry):
    import json

    with pytest.raises(ad.AdapterError, match="the upload is not a valid safetensors file|does not read"):
        ad.parse_header(json.dumps({"m.lora_A.weight": entry}).encode(), "the upload")
