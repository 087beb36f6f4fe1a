"""What the round keeper answers about the run: its status (RoundStatus) and each client's view
(ClientStatus); the servicer turns them into protobuf."""

from __future__ import annotations

import dataclasses

from .attempt import Stage
from .state import State


@dataclasses.dataclass(frozen=True)
class Status:
    run_id: str
    round: int
    state: State
    num_rounds: int
    joined: tuple[str, ...]
    uploaded: tuple[str, ...]
    deadline_unix: float
    global_sha256: str
    version: int
    round_nonce: str
    secure_stage: Stage | None = None
    selected: tuple[str, ...] | None = None  # who takes part in the open round (None: every client)


@dataclasses.dataclass(frozen=True)
class ClientView:
    client_id: str
    env: str
    uploaded: bool
    alive: bool
    last_seen_unix: float
    phase_round: int
    phase: str
    partial_upload_bytes: int
    metrics_round: int
    metrics: dict[str, float]
    secure_step: str = ""
    selected: bool = True
    selection_reason: str = ""
    lora_rank: int = 0
