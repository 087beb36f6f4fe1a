"""The streaming check of an upload: every byte checked as it arrives, so the aggregator accepts an
upload without reading it back and refuses a bad one at the chunk that shows it."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct

import numpy

from fedse.model.adapter import (
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    SAFETENSORS_NAMES,
    AdapterError,
    Schema,
    TensorSpec,
    check_tensors,
    parse_header,
    transport_dtype,
)
from fedse.transport.inputs import shown


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
        self._wire = None if wire is None else SAFETENSORS_NAMES[wire]
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
            return dataclasses.replace(spec, dtype=str(SAFETENSORS_DTYPES[spec.dtype]).removeprefix("torch."))

        check_tensors(self.schema, {name: as_torch(spec) for name, spec in specs.items()})
        base, at = len(self._head), 0
        for name in sorted(offsets, key=lambda n: offsets[n]):
            begin, end = offsets[name]
            spec = specs[name]
            width = SAFETENSORS_DTYPES[spec.dtype].itemsize
            if begin != at or end - begin != math.prod(spec.shape) * width:
                raise AdapterError(f"tensor {shown(name, 96)}'s data_offsets {[begin, end]} do not pack the tensors "
                                   "end to end: write the file with safetensors")
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
            width = SAFETENSORS_DTYPES[dtype].itemsize
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


class MaskedCheck:
    """The check of a masked upload (secure aggregation): its bytes are uniformly random to the
    aggregator, so all it can check is their count and their sha256."""

    def __init__(self, declared_size: int):
        self.size = declared_size
        self._digest = hashlib.sha256()
        self._pos = 0

    @property
    def received(self) -> int:
        return self._pos

    def update(self, data: bytes) -> None:
        if self._pos + len(data) > self.size:
            raise AdapterError(f"received more than the {self.size} bytes of a masked vector")
        self._digest.update(data)
        self._pos += len(data)

    def finish(self, sha256: str) -> None:
        if self._pos != self.size:
            raise AdapterError(f"received {self._pos} bytes of the {self.size} of a masked vector: upload again")
        actual = self._digest.hexdigest()
        if actual != sha256.lower():
            raise AdapterError(f"sha256 mismatch: header says {sha256}, the bytes hash to {actual}")


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
        raise AdapterError(f"tensor {shown(name, 96)} holds NaN or infinite values")


