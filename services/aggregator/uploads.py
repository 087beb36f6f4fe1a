"""Uploads as the aggregator receives them: the header a client sends first, the stream that
carries the bytes (checked as they arrive), and the record that commits an accepted upload.

The protocol (resumable, idempotent, one stream per client at a time) is the UploadDesk's, which
holds these under the round keeper's lock; the Store keeps the bytes and the records on disk.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any

from fedse.model import adapter as ad
from fedse.transport.inputs import shown
from fedse.privacy.secagg import MASKED_DTYPE

from .upload_check import MaskedCheck, UploadCheck

SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class UploadHeader:
    client_id: str
    round: int
    round_nonce: str
    sha256: str
    size: int
    offset: int = 0
    transport: str = ""
    num_examples: int = 0
    num_successes: int = 0

    def check(self, max_bytes: int, masked_bytes: int | None = None) -> None:
        """Raises ValueError (AdapterError for the size) naming what is wrong with the header.
        `masked_bytes`: with secure aggregation, the size every masked upload has."""
        if not SHA256.match(self.sha256):
            raise ValueError(f"sha256 {shown(self.sha256)} is not 64 lowercase hex digits")
        if self.size <= 0:
            raise ValueError(f"the header declares {self.size} bytes: give the adapter's size")
        if self.num_examples < 0 or self.num_successes < 0:
            raise ValueError(f"the header counts {self.num_examples} examples and {self.num_successes} successes: "
                             "counts cannot be negative (send 0 when there are none)")
        if masked_bytes is not None:
            if self.transport != MASKED_DTYPE:
                raise ValueError(f"this run uses secure aggregation: upload the masked vector (transport_dtype "
                                 f"{MASKED_DTYPE!r}), never the adapter itself")
            if self.size != masked_bytes:
                raise ValueError(f"a masked upload of {self.size} bytes: this run's masked vectors are "
                                 f"{masked_bytes // 8} uint64 values ({masked_bytes} bytes)")
            if self.num_examples or self.num_successes:
                raise ValueError(f"the header of a masked upload counts {self.num_examples} examples and "
                                 f"{self.num_successes} successes: send 0 for both (a weight travels masked "
                                 "inside the vector; in the clear it would tell each client's weight)")
        elif self.transport == MASKED_DTYPE:
            raise ValueError("this run does not use secure aggregation: upload the adapter's safetensors bytes")
        else:
            if self.size > max_bytes:
                raise ad.AdapterError(f"adapter of {self.size} bytes exceeds the limit of {max_bytes} bytes")
            ad.transport_dtype(self.transport)
        if self.offset < 0 or self.offset > self.size:
            raise ValueError(f"offset {self.offset} is outside the adapter's {self.size} bytes")

    def partial_record(self) -> dict[str, Any]:
        """What identifies the upload a partial file holds (a resume must match it)."""
        return {"sha256": self.sha256, "size": self.size, "transport": self.transport,
                "round_nonce": self.round_nonce}


@dataclasses.dataclass(frozen=True)
class Accepted:
    """The record that commits an accepted upload (stored beside its bytes)."""

    sha256: str
    size: int
    transport: str
    num_examples: int
    num_successes: int
    accepted_unix: float
    # Asynchronous rounds only (-1 otherwise): the global version it was trained from (the header's
    # round) and the version whose buffer it went into (folded into the next one).
    base: int = -1
    collected: int = -1

    @staticmethod
    def of(h: UploadHeader, now: float, collected: int = -1) -> "Accepted":
        return Accepted(h.sha256, h.size, h.transport, int(h.num_examples), int(h.num_successes), now,
                        h.round if collected >= 0 else -1, collected)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.collected < 0:  # a synchronous round's record, as it always was
            del out["base"], out["collected"]
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Accepted":
        return Accepted(str(d["sha256"]), int(d["size"]), str(d.get("transport", "")), int(d["num_examples"]),
                        int(d["num_successes"]), float(d.get("accepted_unix", 0.0)), int(d.get("base", -1)),
                        int(d.get("collected", -1)))


@dataclasses.dataclass
class Stream:
    """The stream receiving a client's upload now: its generation (a newer stream supersedes it),
    the client's write lock (shared with the stream it superseded, so writes never interleave) and
    the check fed every byte in order from byte 0 (`check.received` is what is held)."""

    generation: int
    lock: threading.Lock
    check: UploadCheck | MaskedCheck
