"""Adapter files as the aggregator reads and makes them: a lazy view of an upload's or a global
adapter's safetensors file (AdapterFile), a zeroed file image with a writable view of each tensor
(allocate: aggregation writes phi_{t+1} into it), and phi_0 (fresh)."""

from __future__ import annotations

import math
import os
import pathlib
import struct
from typing import Iterator, Mapping

import torch

from fedse.model.adapter import SAFETENSORS_DTYPES, Adapter, AdapterError, Schema, parse_header, safetensors_header


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
        dtype = SAFETENSORS_DTYPES[spec["dtype"]]
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


def allocate(schema: Schema) -> tuple[bytearray, Adapter]:
    """A zeroed adapter_model.safetensors image laid out as `encode` lays out the schema's tensors,
    and a writable view of each tensor in it: what is written into the views is the file, with no
    encoding copy (phi_0 and aggregation results are made this way)."""
    specs = [(s.name, getattr(torch, s.dtype), s.shape) for s in sorted(schema.tensors, key=lambda s: s.name)]
    head = safetensors_header(specs)
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


