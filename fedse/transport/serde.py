"""Conversions between protobuf messages and fedse's Python objects (one home for all services)."""

from __future__ import annotations

from fedse.model.adapter import Schema, TensorSpec, schema_dtype
from fedse.v1 import federation_pb2 as fpb


def schema_to_proto(schema: Schema) -> fpb.AdapterSchema:
    return fpb.AdapterSchema(
        tensors=[fpb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype) for s in schema.tensors],
        adapter_config_json=schema.adapter_config_json,
    )


def schema_from_proto(msg: fpb.AdapterSchema) -> Schema:
    """The schema a message carries, its dtypes in torch's spelling whichever of the two it used."""
    return Schema(
        tensors=tuple(TensorSpec(t.name, tuple(int(d) for d in t.shape), schema_dtype(t.dtype)) for t in msg.tensors),
        adapter_config_json=msg.adapter_config_json,
    )
