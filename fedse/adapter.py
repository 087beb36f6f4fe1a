"""LoRA adapters on the wire: PEFT safetensors bytes, schemas, hashing, chunking, validation.

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
import os
import pathlib
import re
import struct
import tempfile
from typing import Iterator, Mapping

import numpy
import torch
from safetensors.torch import load as st_load

from fedse.inputs import MAX_NAME_CHARS, shown

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
        non-negative dimensions, a dtype fedse reads, at most `max_bytes` in all, and an
        adapter_config.json (a JSON object) of at most MAX_CONFIG_BYTES."""
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
            if len(spec.shape) > MAX_SCHEMA_DIMS or any(d < 0 for d in spec.shape):
                raise AdapterError(f"tensor {shown(spec.name, 96)} has shape {shown(list(spec.shape))}: give at most "
                                   f"{MAX_SCHEMA_DIMS} dimensions, none negative")
            if spec.dtype not in _TORCH_DTYPES:
                raise AdapterError(f"tensor {shown(spec.name, 96)} has dtype {shown(spec.dtype)}: use one of "
                                   f"{', '.join(f'{t} ({_SAFETENSORS_NAMES[d]})' for t, d in _TORCH_DTYPES.items())}")
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


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(adapter: Mapping[str, torch.Tensor]) -> bytes:
    """The bytes of adapter_model.safetensors for the adapter (tensors in name order).

    Written here rather than with `safetensors.torch.save`, which copies every tensor twice (to
    Python bytes, then into the file image): the format is an 8-byte little-endian header length,
    a JSON header padded to 8 bytes, then the raw tensors, so one join copies each tensor once.
    `decode`, AdapterFile, safetensors and PEFT all read the result."""
    tensors = {name: adapter[name].detach().to("cpu").contiguous() for name in sorted(adapter)}
    head = _header([(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()])
    return b"".join([head, *(t.reshape(-1).view(torch.uint8).numpy() for t in tensors.values() if t.numel())])


def allocate(schema: Schema) -> tuple[bytearray, Adapter]:
    """A zeroed adapter_model.safetensors image laid out as `encode` lays out the schema's tensors,
    and a writable view of each tensor in it: what is written into the views is the file, with no
    encoding copy (phi_0 and aggregation results are made this way)."""
    specs = [(s.name, getattr(torch, s.dtype), s.shape) for s in sorted(schema.tensors, key=lambda s: s.name)]
    head = _header(specs)
    image = bytearray(len(head) + sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in specs))
    image[:len(head)] = head
    views: Adapter = {}
    offset = len(head)
    for name, dtype, shape in specs:
        count = math.prod(shape)
        views[name] = torch.frombuffer(image, dtype=dtype, count=count, offset=offset).view(shape) if count \
            else torch.empty(shape, dtype=dtype)
        offset += count * dtype.itemsize
    return image, views


def _header(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `specs` packed in that order."""
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in _SAFETENSORS_NAMES:
            raise AdapterError(f"tensor {name} has dtype {dtype}, which safetensors cannot hold")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape),
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
            raise AdapterError(f"tensor {name} has shape {shown(list(shape))}, {expected_by} expects {list(spec.shape)}")
        if dtypes and dtype != spec.dtype:
            raise AdapterError(f"tensor {name} has dtype {shown(dtype)}, {expected_by} expects {spec.dtype}")


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


class UploadCheck:
    """Checks an upload as its bytes arrive, so the aggregator can accept it without reading it back.

    Fed the bytes in order (`update`), it hashes them, reads the safetensors header as soon as it
    is complete and checks it against the run's schema (names, shapes, dtypes: the schema's, or
    the transport dtype's when one is given; tensors packed end to end filling exactly the declared
    size), then checks that every floating value is finite, piece by piece as the data passes. A bad
    header fails at the chunk that completes it, not after the whole upload. `finish(sha256)`
    checks that all bytes came and that they hash to the header's sha256. Every failure raises
    AdapterError saying what is wrong."""

    def __init__(self, schema: Schema, declared_size: int, max_bytes: int, transport: str = ""):
        wire = transport_dtype(transport)
        if declared_size > max_bytes:
            raise AdapterError(f"adapter of {declared_size} bytes exceeds the limit of {max_bytes} bytes")
        self.schema = schema
        self.size = declared_size
        self.transport = transport
        self._wire = None if wire is None else _SAFETENSORS_NAMES[wire]
        self._digest = hashlib.sha256()
        self._pos = 0
        self._head = bytearray()  # the header's bytes until it is complete
        self._regions: list[tuple[str, int, int, str]] = []  # (name, begin, end, dtype), file positions
        self._region = 0
        self._carry = b""  # the start of a value split between two pieces

    @property
    def received(self) -> int:
        return self._pos

    def update(self, data: bytes) -> None:
        if self._pos + len(data) > self.size:
            raise AdapterError(f"received more than the {self.size} bytes the header declared")
        self._digest.update(data)
        view, pos = memoryview(data), self._pos
        self._pos += len(data)
        while not self._regions and view.nbytes:  # the header, first its length, then its JSON
            take = min(self._header_end() - len(self._head), view.nbytes)
            self._head += view[:take]
            view, pos = view[take:], pos + take
            if len(self._head) >= 8 and len(self._head) == self._header_end():
                self._read_header()
        if view.nbytes:
            self._scan(view, pos)

    def finish(self, sha256: str) -> None:
        if self._pos != self.size:
            raise AdapterError(f"received {self._pos} bytes but the header declared {self.size}: "
                               "the stream was cut short; upload again")
        if not self._regions:
            raise AdapterError("not a valid safetensors file (its header is cut short)")
        actual = self._digest.hexdigest()
        if actual != sha256.lower():
            raise AdapterError(f"sha256 mismatch: header says {sha256}, the bytes hash to {actual}")

    # ---- the header ---------------------------------------------------------------------------
    def _header_end(self) -> int:
        if len(self._head) < 8:
            return 8
        (n,) = struct.unpack("<Q", self._head[:8])
        if n > MAX_HEADER_BYTES:
            raise AdapterError(f"not a valid adapter: its safetensors header claims {n} bytes, more than the "
                               f"limit of {MAX_HEADER_BYTES} (a LoRA adapter's header is a few KB)")
        if 8 + n > self.size:
            raise AdapterError(f"not a valid safetensors file (its header claims {n} bytes of the "
                               f"{self.size} declared)")
        return 8 + n

    def _read_header(self) -> None:
        entries = parse_header(bytes(self._head[8:]), "the upload")
        specs = {name: TensorSpec(name, tuple(e["shape"]), e["dtype"]) for name, e in entries.items()}
        offsets = {name: tuple(e["data_offsets"]) for name, e in entries.items()}
        if self._wire is not None:
            wrong = next((s for s in specs.values() if s.dtype != self._wire), None)
            if wrong is not None:
                raise AdapterError(f"tensor {shown(wrong.name, 96)} has dtype {wrong.dtype}, but the header's "
                                   f"transport dtype is {self.transport}")
        expected = self.schema.by_name()

        def as_torch(spec: TensorSpec) -> TensorSpec:
            if self._wire is not None and spec.name in expected:  # the wire dtype, checked above, stands in
                return dataclasses.replace(spec, dtype=expected[spec.name].dtype)
            return dataclasses.replace(spec, dtype=str(_SAFETENSORS_DTYPES[spec.dtype]).removeprefix("torch."))

        check_tensors(self.schema, {name: as_torch(spec) for name, spec in specs.items()})
        base, at = len(self._head), 0
        for name in sorted(offsets, key=lambda n: offsets[n]):
            begin, end = offsets[name]
            spec = specs[name]
            width = _SAFETENSORS_DTYPES[spec.dtype].itemsize
            if begin != at or end - begin != math.prod(spec.shape) * width:
                raise AdapterError(f"tensor {name}'s data_offsets {[begin, end]} do not pack the tensors end to "
                                   "end: write the file with safetensors")
            self._regions.append((name, base + begin, base + end, spec.dtype))
            at = end
        if base + at != self.size:
            raise AdapterError(f"the header's tensors end at byte {base + at}, but the upload declares "
                               f"{self.size} bytes")

    # ---- the values ---------------------------------------------------------------------------
    def _scan(self, view: memoryview, pos: int) -> None:
        """Checks the values in `view`, which holds the bytes from file position `pos` on."""
        while view.nbytes:
            name, begin, end, dtype = self._regions[self._region]
            take = min(view.nbytes, end - pos)
            piece, view, pos = view[:take], view[take:], pos + take
            width = _SAFETENSORS_DTYPES[dtype].itemsize
            if self._carry:
                need = width - len(self._carry)
                self._carry += bytes(piece[:need])
                piece = piece[need:]
                if len(self._carry) == width:
                    _check_finite(name, self._carry, dtype)
                    self._carry = b""
            whole = piece.nbytes - piece.nbytes % width
            _check_finite(name, piece[:whole], dtype)
            self._carry += bytes(piece[whole:])
            if pos == end:
                self._region += 1


_NUMPY_FLOATS = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}


def _check_finite(name: str, raw: bytes | memoryview, dtype: str) -> None:
    """Raises AdapterError if the little-endian values in `raw` hold a NaN or an infinity."""
    if not len(raw) or dtype not in (*_NUMPY_FLOATS, "BF16"):
        return
    if dtype == "BF16":  # no numpy bfloat16: a bf16 value is not finite when its 8 exponent bits are all set
        bits = numpy.frombuffer(raw, dtype="<u2")
        finite = not bool(numpy.any((bits & 0x7F80) == 0x7F80))
    else:
        values = numpy.frombuffer(raw, dtype=_NUMPY_FLOATS[dtype])
        with numpy.errstate(over="ignore", invalid="ignore"):
            # A finite sum proves every value finite, at a fraction of isfinite's cost; only a
            # non-finite sum, which overflow can also cause, needs the element-wise check.
            finite = bool(numpy.isfinite(values.sum())) or bool(numpy.isfinite(values).all())
    if not finite:
        raise AdapterError(f"tensor {name} holds NaN or infinite values")


def atomic_write(path: pathlib.Path, data: bytes) -> None:
    """Writes a file so that a crash leaves either the old or the new content, never a torn one."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: pathlib.Path) -> None:
    """Makes a rename or a new file in `directory` survive a power cut."""
    fd = os.open(str(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kaiming_uniform_a(shape: tuple[int, ...], generator: torch.Generator,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """PEFT's default lora_A init: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    float32, drawn into `out` when given."""
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.empty(shape) if out is None else out).uniform_(-bound, bound, generator=generator)


def fresh(schema: Schema, seed: int) -> tuple[bytearray, Adapter]:
    """A deterministic fresh LoRA for round 0: A as PEFT initialises it (seeded), B = 0, so the
    adapted model equals the base model. Its safetensors image and the tensors (views into it)."""
    gen = torch.Generator().manual_seed(seed)
    image, views = allocate(schema)
    for spec in schema.tensors:
        view = views[spec.name]
        if ".lora_A." in spec.name and view.dtype == torch.float32:
            kaiming_uniform_a(spec.shape, gen, out=view)
        elif ".lora_A." in spec.name:
            view.copy_(kaiming_uniform_a(spec.shape, gen))
    return image, views


def write_peft_dir(directory: pathlib.Path, data: bytes, adapter_config_json: str) -> None:
    """Writes a standard PEFT adapter directory atomically (temp dir, then rename)."""
    directory = pathlib.Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    (tmp / WEIGHTS_NAME).write_bytes(data)
    (tmp / CONFIG_NAME).write_text(adapter_config_json)
    for f in (tmp / WEIGHTS_NAME, tmp / CONFIG_NAME):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old")
        os.replace(directory, old)
        os.replace(tmp, directory)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        os.replace(tmp, directory)
    fsync_dir(directory.parent)


def config_with_base(adapter_config_json: str, base_model: str) -> str:
    """The adapter_config.json text with base_model_name_or_path set (for exported adapters)."""
    cfg = json.loads(adapter_config_json)
    cfg["base_model_name_or_path"] = base_model
    return json.dumps(cfg, indent=2, sort_keys=True)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
# The schema's spelling: torch's names ("float32").
_TORCH_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in _SAFETENSORS_DTYPES.values()}


def schema_dtype(name: str) -> str:
    """The schema's spelling (torch's: "float32") of a dtype given in it or in safetensors' ("F32");
    any other name as it is (Schema.check refuses it)."""
    dtype = _SAFETENSORS_DTYPES.get(name)
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
    try:
        header = json.loads(text)
        entries = {name: {"dtype": str(v["dtype"]), "shape": [int(d) for d in v["shape"]],
                          "data_offsets": [int(v["data_offsets"][0]), int(v["data_offsets"][1])]}
                   for name, v in header.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError):
        raise AdapterError(f"{source} is not a valid safetensors file (bad header)") from None
    for name, e in entries.items():
        if e["dtype"] not in _SAFETENSORS_DTYPES:
            raise AdapterError(f"tensor {shown(name, 96)} in {source} has dtype {shown(e['dtype'])}, which fedse "
                               "does not read")
    return entries


class AdapterFile(Mapping[str, torch.Tensor]):
    """A read-only view of an adapter's safetensors file that reads one tensor per lookup.

    Aggregation walks tensor by tensor across clients, so with K uploads on disk it holds K copies
    of one tensor at a time, not K adapters. Tensors are read with pread into fresh buffers (the
    file layout: an 8-byte little-endian header length, a JSON header of dtype, shape and byte
    offsets, then the data), not memory-mapped: mapped pages would stay resident and count against
    the process for every file touched.
    """

    def __init__(self, path: pathlib.Path | str):
        self.path = pathlib.Path(path)
        self._fd: int | None = None
        with open(self.path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise AdapterError(f"{self.path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            self._specs = parse_header(fh.read(n), str(self.path))
        self._base = 8 + n

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self._specs[name]
        begin, end = spec["data_offsets"]
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        buf = bytearray(end - begin)
        if buf and os.preadv(self._fd, [buf], self._base + begin) != len(buf):
            raise AdapterError(f"{self.path} is truncated: tensor {name} is cut short")
        dtype = _SAFETENSORS_DTYPES[spec["dtype"]]
        if not buf:
            return torch.empty(spec["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(spec["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()
