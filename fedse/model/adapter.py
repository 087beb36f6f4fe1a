"""LoRA adapters on the wire: PEFT safetensors bytes, schemas, hashing, chunking, transport dtypes and
the checks every side makes (the aggregator's streaming check of uploads and its adapter files live
in services/aggregator; files that survive a crash in fedse.files).

An adapter is a flat dict of tensors keyed as `peft.get_peft_model_state_dict` names them
(`base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`) plus the text of its
`adapter_config.json`. On the wire and on disk it is exactly the bytes of
`adapter_model.safetensors`, so any PEFT tool can read what fedse writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import struct
from typing import Iterator, Mapping

import torch
from safetensors.torch import load as st_load

from fedse.transport.inputs import MAX_NAME_CHARS, shown

# gRPC's default limit on a message received, in every implementation: a client or server that keeps
# its defaults refuses anything larger.
GRPC_DEFAULT_MESSAGE_BYTES = 4 * 1024 * 1024
# Data bytes in one adapter chunk, both directions (RunConfig.max_chunk_bytes): with its protobuf framing
# (5 bytes for AdapterChunk.data) a chunk stays well under gRPC's default limit, so a client that keeps
# every gRPC default downloads adapters of any size, and a server that does receives them.
CHUNK_BYTES = GRPC_DEFAULT_MESSAGE_BYTES - 64 * 1024
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"

Adapter = dict[str, torch.Tensor]

# What a safetensors header may be before it is parsed. A header is a flat JSON object of tensor
# entries ({"name": {"dtype", "shape": [...], "data_offsets": [...]}, "__metadata__": {...}}: 3
# levels deep, about 150 bytes per tensor), so a LoRA adapter's is a few KB to a few hundred KB.
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_HEADER_DEPTH = 8
# What an adapter schema (Join) may be.
MAX_SCHEMA_TENSORS = 100_000
MAX_SCHEMA_DIMS = 8
# The largest dimension a schema may give (a zero-size tensor holds no bytes, whatever its others).
MAX_SCHEMA_DIM = 2**31 - 1
MAX_CONFIG_BYTES = 64 * 1024


class AdapterError(ValueError):
    """An adapter that does not fit the run's schema or is not a valid safetensors file."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class Schema:
    """The tensors of an adapter (names, shapes, dtypes) and its adapter_config.json text."""

    tensors: tuple[TensorSpec, ...]
    adapter_config_json: str

    @staticmethod
    def of(adapter: Mapping[str, torch.Tensor], adapter_config_json: str) -> "Schema":
        specs = tuple(
            TensorSpec(name, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in sorted(adapter.items())
        )
        return Schema(specs, adapter_config_json)

    def by_name(self) -> dict[str, TensorSpec]:
        return {spec.name: spec for spec in self.tensors}

    def to_dict(self) -> dict:
        return {"tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors],
                "adapter_config_json": self.adapter_config_json}

    @staticmethod
    def from_dict(d: Mapping) -> "Schema":
        return Schema(tuple(TensorSpec(n, tuple(int(x) for x in shape), dt) for n, shape, dt in d["tensors"]),
                      d["adapter_config_json"])

    def check(self, max_bytes: int) -> None:
        """Raises AdapterError saying what to fix unless this is a schema an adapter can have: at least
        one tensor, unique names of at most MAX_NAME_CHARS characters, at most MAX_SCHEMA_DIMS
        dimensions of 0 to MAX_SCHEMA_DIM (LoRA factors at least two, none 0), a dtype fedse reads, at
        most `max_bytes` in all, and an adapter_config.json (a JSON object) of at most MAX_CONFIG_BYTES."""
        if not self.tensors:
            raise AdapterError("the adapter schema lists no tensors: send the LoRA adapter's tensor specs")
        if len(self.tensors) > MAX_SCHEMA_TENSORS:
            raise AdapterError(f"the adapter schema lists {len(self.tensors)} tensors, more than the limit of "
                               f"{MAX_SCHEMA_TENSORS}")
        seen: set[str] = set()
        total = 0
        for spec in self.tensors:
            if not spec.name or len(spec.name) > MAX_NAME_CHARS or spec.name == "__metadata__":
                raise AdapterError(f"tensor name {shown(spec.name)} is not valid: give a name of 1 to "
                                   f"{MAX_NAME_CHARS} characters, as PEFT names the adapter's tensors")
            if spec.name in seen:
                raise AdapterError(f"tensor {shown(spec.name, 96)} is listed twice in the adapter schema")
            seen.add(spec.name)
            if len(spec.shape) > MAX_SCHEMA_DIMS or any(not 0 <= d <= MAX_SCHEMA_DIM for d in spec.shape):
                raise AdapterError(f"tensor {shown(spec.name, 96)} has shape {shown(list(spec.shape))}: give at most "
                                   f"{MAX_SCHEMA_DIMS} dimensions, each 0 to {MAX_SCHEMA_DIM}")
            if (".lora_A." in spec.name or ".lora_B." in spec.name) and (len(spec.shape) < 2 or 0 in spec.shape):
                raise AdapterError(f"tensor {shown(spec.name, 96)} has shape {shown(list(spec.shape))}: a LoRA factor "
                                   "has two dimensions or more (lora_A rank x in, lora_B out x rank), none 0")
            if spec.dtype not in _TORCH_DTYPES:
                raise AdapterError(f"tensor {shown(spec.name, 96)} has dtype {shown(spec.dtype)}: use one of "
                                   f"{', '.join(f'{t} ({SAFETENSORS_NAMES[d]})' for t, d in _TORCH_DTYPES.items())}")
            total += math.prod(spec.shape) * _TORCH_DTYPES[spec.dtype].itemsize
            if total > max_bytes:
                raise AdapterError(f"the adapter schema's tensors hold more than the limit of {max_bytes} bytes")
        if len(self.adapter_config_json) > MAX_CONFIG_BYTES:
            raise AdapterError(f"adapter_config_json is {len(self.adapter_config_json)} characters, more than the "
                               f"limit of {MAX_CONFIG_BYTES}: send the adapter's adapter_config.json")
        try:
            if not json_depth_within(self.adapter_config_json.encode(), MAX_HEADER_DEPTH):
                raise ValueError("nested too deep")
            if not isinstance(json.loads(self.adapter_config_json), dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError) as exc:
            raise AdapterError(f"adapter_config_json is not a JSON object ({exc}): send the adapter's "
                               "adapter_config.json") from None

    def check_compatible(self, other: "Schema") -> None:
        """Raises AdapterError naming the first difference in tensors (the config text may differ)."""
        check_tensors(self, {s.name: s for s in other.tensors})


def clip_factor(squared_norm: float, clip_norm: float) -> float:
    """min(1, clip_norm / ||update||): what an update of that squared L2 norm is scaled by to be clipped to
    clip_norm (1 for a zero update). The aggregator clips each upload with it, and so does a client that
    clips its own (secure aggregation)."""
    return min(1.0, clip_norm / math.sqrt(squared_norm)) if squared_norm > 0 else 1.0


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(adapter: Mapping[str, torch.Tensor]) -> bytes:
    """The bytes of adapter_model.safetensors for the adapter (tensors in name order).

    Written here rather than with `safetensors.torch.save`, which copies every tensor twice (to
    Python bytes, then into the file image): the format is an 8-byte little-endian header length,
    a JSON header padded to 8 bytes, then the raw tensors, so one join copies each tensor once.
    `decode`, the aggregator's AdapterFile, safetensors and PEFT all read the result."""
    tensors = {name: adapter[name].detach().to("cpu").contiguous() for name in sorted(adapter)}
    head = safetensors_header([(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()])
    return b"".join([head, *(t.reshape(-1).view(torch.uint8).numpy() for t in tensors.values() if t.numel())])


def safetensors_header(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `specs` packed in that order."""
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in SAFETENSORS_NAMES:
            raise AdapterError(f"tensor {name} has dtype {dtype}, which safetensors cannot hold")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def decode(data: bytes | bytearray) -> Adapter:
    try:
        return dict(st_load(bytes(data)))  # bytes(b) is b itself; a bytearray (allocate's image) is copied
    except Exception as exc:  # safetensors raises its own error types
        raise AdapterError(f"not a valid safetensors file ({exc})") from None


def chunks(data: bytes | bytearray, size: int = CHUNK_BYTES, offset: int = 0) -> Iterator[bytes]:
    """data[offset:] as consecutive bytes objects of at most `size` bytes: the one way adapters are
    cut for the wire, uploads and downloads alike (a bytearray image is copied chunk by chunk)."""
    if size < 1:
        raise ValueError(f"chunk size must be positive, got {size}")
    if not 0 <= offset <= len(data):
        raise ValueError(f"offset {offset} is outside the {len(data)} bytes")
    view = memoryview(data)  # checked above at the call, not at the first chunk
    return (bytes(view[start:start + size]) for start in range(offset, len(data), size))


def check_tensors(schema: Schema, tensors: Mapping[str, object], dtypes: bool = True,
                  expected_by: str = "the run") -> None:
    """Keys, shapes and (unless dtypes=False) dtypes of `tensors` (tensors or TensorSpecs) must equal
    the schema's; `expected_by` names whose schema it is in the error."""
    expected = schema.by_name()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise AdapterError(
            f"adapter keys differ from {expected_by}'s: {len(missing)} missing (first: "
            f"{', '.join(shown(n, 96) for n in missing[:2])}), {len(unexpected)} unexpected (first: "
            f"{', '.join(shown(n, 96) for n in unexpected[:2])}); train with the run's LoRA settings")
    for name, spec in expected.items():
        t = tensors[name]
        shape = tuple(int(d) for d in t.shape)
        dtype = t.dtype if isinstance(t, TensorSpec) else str(t.dtype).removeprefix("torch.")
        if shape != spec.shape:
            raise AdapterError(f"tensor {shown(name, 96)} has shape {shown(list(shape))}, {expected_by} expects "
                               f"{list(spec.shape)}")
        if dtypes and dtype != spec.dtype:
            raise AdapterError(f"tensor {shown(name, 96)} has dtype {shown(dtype)}, {expected_by} expects {spec.dtype}")


TRANSPORT_DTYPES = {"": None, "bfloat16": torch.bfloat16}


def transport_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a transport dtype name ("" = each tensor's own dtype)."""
    if name not in TRANSPORT_DTYPES:
        raise AdapterError(f"transport dtype {shown(name)} is unknown: use '' (the schema's dtypes) or 'bfloat16'")
    return TRANSPORT_DTYPES[name]


def cast(adapter: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> Adapter:
    """Every floating tensor cast to dtype (None: unchanged)."""
    if dtype is None:
        return dict(adapter)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in adapter.items()}


def check_transport_dtype(name: str) -> str:
    """The name itself if it is a transport dtype ('' or 'bfloat16'); AdapterError (a ValueError) if not."""
    transport_dtype(name)
    return name


def encode_transport(adapter: Mapping[str, torch.Tensor], transport: str = "") -> bytes:
    """The wire form of an adapter, both directions: safetensors bytes with the floating tensors cast
    to the transport dtype ("" = as they are)."""
    return encode(cast(adapter, transport_dtype(transport)))


def decode_transport(data: bytes | bytearray, dtype: torch.dtype = torch.float32) -> Adapter:
    """The tensors of an adapter's bytes in any transport dtype, the floating ones cast to `dtype`."""
    return cast(decode(data), dtype)


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# The schema's spelling: torch's names ("float32").
_TORCH_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in SAFETENSORS_DTYPES.values()}


def schema_dtype(name: str) -> str:
    """The schema's spelling (torch's: "float32") of a dtype given in it or in safetensors' ("F32");
    any other name as it is (Schema.check refuses it)."""
    dtype = SAFETENSORS_DTYPES.get(name)
    return str(dtype).removeprefix("torch.") if dtype is not None else name


# A JSON string, or an unterminated one up to the end; possessive, so no input makes it backtrack.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\[\s\S])*+"?')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth_within(text: bytes, limit: int) -> bool:
    """Whether the arrays and objects of JSON `text` nest at most `limit` deep (unbalanced brackets
    count as too deep). Linear passes at C speed, no recursion: the strings are blanked, everything
    but brackets dropped, then innermost pairs removed once per level."""
    skeleton = _JSON_STRING.sub(b"", text).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        if not skeleton:
            return True
        skeleton = skeleton.replace(b"[]", b"").replace(b"{}", b"")
    return not skeleton


def parse_header(text: bytes, source: str) -> dict[str, dict]:
    """The tensor entries of a safetensors JSON header, {name: {"dtype", "shape", "data_offsets"}}
    with integer shapes and offsets and a dtype fedse reads; AdapterError naming `source` if not.
    The header's size and nesting are bounded before it is parsed."""
    if len(text) > MAX_HEADER_BYTES:
        raise AdapterError(f"{source} is not a valid adapter: its safetensors header is {len(text)} bytes, more "
                           f"than the limit of {MAX_HEADER_BYTES}")
    if not json_depth_within(text, MAX_HEADER_DEPTH):
        raise AdapterError(f"{source} is not a valid safetensors file: its header nests deeper than "
                           f"{MAX_HEADER_DEPTH} levels (or its brackets do not balance); a safetensors header is "
                           "a flat object of tensor entries")
    def ints(value, count: int | None = None) -> list[int]:  # a JSON list of integers, as safetensors writes
        if not isinstance(value, list) or (count is not None and len(value) != count) or \
                not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
            raise ValueError("not a list of integers")
        return value

    def string(value) -> str:
        if not isinstance(value, str):
            raise ValueError("not a string")
        return value

    try:
        header = json.loads(text)
        entries = {name: {"dtype": string(v["dtype"]), "shape": ints(v["shape"]),
                          "data_offsets": ints(v["data_offsets"], 2)}
                   for name, v in header.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError):
        raise AdapterError(f"{source} is not a valid safetensors file (bad header)") from None
    for name, e in entries.items():
        if e["dtype"] not in SAFETENSORS_DTYPES:
            raise AdapterError(f"tensor {shown(name, 96)} in {source} has dtype {shown(e['dtype'])}, which fedse "
                               "does not read")
    return entries

