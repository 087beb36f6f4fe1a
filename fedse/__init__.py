"""fedse: federated self-evolution of LLM agents over gRPC (shared code of all services)."""

import os as _os

__version__ = "0.1.0"  # the one place the version is written: the package, `fedse --version`, logs, /metrics, images

# fedse never downloads models: base models are the embedded tiny model or a local path.
_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# gRPC's own log lines only for errors, unless the user asks for more (GRPC_VERBOSITY=INFO or DEBUG):
# otherwise a client retrying a TLS handshake against a plain server writes a line for every try.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
