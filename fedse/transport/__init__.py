"""Serving and talking over gRPC: servers with health, metrics and JSON logs (serving), why a
channel cannot be made (reach), protobuf conversions (serde) and bounds on what callers send
(inputs)."""
