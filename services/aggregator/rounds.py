"""The aggregator's round state machine: join, open, collect, close, aggregate, store, open next.

Pure Python and thread-safe; the servicer translates protobuf to calls here and maps the
exceptions below to gRPC status codes. A round t starts from the global adapter phi_t and
closes when every joined client has uploaded, or when at least `min_clients` have and the
round's deadline has passed; then phi_{t+1} = strategy(uploads of round t).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
import threading
import time
from typing import Callable

from fedse import adapter as ad
from fedse.serving import log_fields

from .store import Store
from .strategies import STRATEGIES, Update

log = logging.getLogger("aggregator.rounds")

CLIENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class FederationError(Exception):
    """Base class; the message tells the caller what to do."""


class NotJoined(FederationError):
    pass


class StaleRound(FederationError):
    pass


class SchemaMismatch(FederationError):
    pass


class RunFinished(FederationError):
    pass


class NotAvailable(FederationError):
    pass


class DuplicateUpload(FederationError):
    pass


class State(enum.Enum):
    WAITING_FOR_CLIENTS = "waiting_for_clients"
    OPEN = "open"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    run_id: str
    num_rounds: int
    min_clients: int
    round_deadline_s: float
    strategy: str
    max_adapter_bytes: int
    seed: int = 0


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


@dataclasses.dataclass(frozen=True)
class Client:
    client_id: str
    env: str
    base_model: str


class Federation:
    def __init__(self, settings: RunSettings, store: Store, clock: Callable[[], float] = time.time):
        if settings.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {settings.strategy!r}")
        self.settings = settings
        self.store = store
        self.clock = clock
        self._cond = threading.Condition()
        self._clients: dict[str, Client] = {}
        self._schema: ad.Schema | None = None
        self._base_model: str | None = None
        self._round = 0
        self._state = State.WAITING_FOR_CLIENTS
        self._uploads: dict[str, Update] = {}
        self._upload_sha: dict[str, str] = {}
        self._deadline = 0.0
        self._global: dict[int, tuple[bytes, str]] = {}  # round -> (safetensors bytes, sha256)
        self._version = 0

    # ---- queries -------------------------------------------------------------------------
    def status(self) -> Status:
        with self._cond:
            return self._status_locked()

    def _status_locked(self) -> Status:
        sha = self._global[self._round][1] if self._round in self._global else ""
        return Status(
            run_id=self.settings.run_id, round=self._round, state=self._state,
            num_rounds=self.settings.num_rounds, joined=tuple(sorted(self._clients)),
            uploaded=tuple(sorted(self._uploads)), deadline_unix=self._deadline,
            global_sha256=sha, version=self._version,
        )

    def wait_for_change(self, version: int, timeout: float) -> Status:
        """Blocks until the status version differs from `version` or the timeout passes."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout=timeout)
            return self._status_locked()

    def global_adapter(self, round_: int) -> tuple[bytes, str, str]:
        """(bytes, sha256, adapter_config_json) of phi_round; round -1 means the latest."""
        with self._cond:
            if self._schema is None:
                raise NotAvailable("no adapter yet: the first client to join fixes the run's adapter schema")
            if round_ < 0:
                round_ = max(self._global)
            if round_ not in self._global:
                raise NotAvailable(f"no global adapter for round {round_}: rounds 0..{max(self._global)} exist")
            data, sha = self._global[round_]
            return data, sha, self._schema.adapter_config_json

    # ---- commands -------------------------------------------------------------------------
    def join(self, client_id: str, env: str, base_model: str, schema: ad.Schema) -> Status:
        if not CLIENT_ID.match(client_id):
            raise ValueError(f"client_id {client_id!r} is not valid: use 1-63 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit")
        if not schema.tensors:
            raise ValueError("the adapter schema lists no tensors: send the LoRA adapter's tensor specs")
        with self._cond:
            if self._schema is None:
                self._schema = schema
                self._base_model = base_model
                data = ad.encode(ad.fresh(schema, self.settings.seed))
                self._store_global_locked(0, data)
                log.info("run schema fixed", extra=log_fields(client=client_id, tensors=len(schema.tensors),
                                                                base_model=base_model))
            else:
                if base_model != self._base_model:
                    raise SchemaMismatch(f"this run federates base model {self._base_model!r}, "
                                         f"client {client_id} has {base_model!r}")
                try:
                    self._schema.check_compatible(schema)
                except ad.AdapterError as exc:
                    raise SchemaMismatch(f"client {client_id}'s adapter does not fit the run: {exc}") from None
            known = client_id in self._clients
            self._clients[client_id] = Client(client_id, env, base_model)
            if not known:
                log.info("client joined", extra=log_fields(client=client_id, env=env, joined=len(self._clients)))
            if self._state is State.WAITING_FOR_CLIENTS and len(self._clients) >= self.settings.min_clients:
                self._open_locked(0)
            self._changed_locked()
            return self._status_locked()

    def precheck_upload(self, client_id: str, round_: int, size: int) -> None:
        """Refuses an upload from its header alone, before its bytes are received."""
        with self._cond:
            self._precheck_locked(client_id, round_)
        if size > self.settings.max_adapter_bytes:
            raise ad.AdapterError(f"adapter of {size} bytes exceeds the limit of {self.settings.max_adapter_bytes} bytes")

    def submit(self, client_id: str, round_: int, data: bytes, sha256: str, size: int,
               num_examples: int, num_successes: int) -> Status:
        """Validates and records an upload for the open round; may close the round."""
        with self._cond:
            self._precheck_locked(client_id, round_)
            if client_id in self._uploads:
                if self._upload_sha[client_id] == sha256:
                    return self._status_locked()  # a retry of the same upload: acknowledged once
                raise DuplicateUpload(f"client {client_id} already uploaded a different adapter for round {round_}")
            assert self._schema is not None
        # Decoding and hashing outside the lock: other clients' calls are not held up.
        adapter = ad.validate(self._schema, data, sha256, size, self.settings.max_adapter_bytes)
        with self._cond:
            if self._state is not State.OPEN or round_ != self._round:
                raise StaleRound(f"round {round_} closed while the upload was checked; round {self._round} is open")
            if client_id in self._uploads:
                return self._status_locked()
            self.store.save_upload(round_, client_id, data)
            self._uploads[client_id] = Update(client_id, adapter, int(num_examples), int(num_successes))
            self._upload_sha[client_id] = sha256
            log.info("upload accepted", extra=log_fields(client=client_id, round=round_, bytes=len(data),
                                                           uploaded=len(self._uploads), joined=len(self._clients)))
            self._changed_locked()
            self._maybe_close_locked()
            return self._status_locked()

    def _precheck_locked(self, client_id: str, round_: int) -> None:
        if client_id not in self._clients:
            raise NotJoined(f"client {client_id!r} has not joined this run: call Join first")
        if self._state is State.FINISHED:
            raise RunFinished(f"run {self.settings.run_id} finished after {self.settings.num_rounds} rounds")
        if self._state is not State.OPEN:
            raise StaleRound("round 0 has not opened yet: wait for the round status to show OPEN")
        if round_ != self._round:
            raise StaleRound(f"upload for round {round_}, but round {self._round} is open: "
                             f"download the global adapter of round {self._round} and train from it")

    def report_metrics(self, client_id: str, round_: int, metrics: dict[str, float]) -> None:
        with self._cond:
            if client_id not in self._clients:
                raise NotJoined(f"client {client_id!r} has not joined this run: call Join first")
            self.store.append_metrics(client_id, round_, metrics)
            self._changed_locked()

    def tick(self) -> None:
        """Closes the open round if its deadline has passed with enough uploads (called periodically)."""
        with self._cond:
            self._maybe_close_locked()

    # ---- internals -----------------------------------------------------------------------
    def _changed_locked(self) -> None:
        self._version += 1
        self._cond.notify_all()

    def _open_locked(self, round_: int) -> None:
        self._round = round_
        self._uploads = {}
        self._upload_sha = {}
        if round_ >= self.settings.num_rounds:
            self._state = State.FINISHED
            self._deadline = 0.0
            log.info("run finished", extra=log_fields(rounds=round_))
        else:
            self._state = State.OPEN
            self._deadline = self.clock() + self.settings.round_deadline_s
            log.info("round opened", extra=log_fields(round=round_, clients=len(self._clients)))
        self._changed_locked()

    def _maybe_close_locked(self) -> None:
        if self._state is not State.OPEN:
            return
        n = len(self._uploads)
        everyone = n > 0 and set(self._uploads) >= set(self._clients)
        quorum_at_deadline = n >= self.settings.min_clients and self.clock() >= self._deadline
        if not (everyone or quorum_at_deadline):
            return
        started = time.perf_counter()
        updates = [self._uploads[c] for c in sorted(self._uploads)]
        merged = STRATEGIES[self.settings.strategy](updates)
        data = ad.encode(merged)
        self._store_global_locked(self._round + 1, data)
        log.info("round closed", extra=log_fields(
            round=self._round, uploads=n, reason="all uploaded" if everyone else "deadline with quorum",
            aggregate_s=round(time.perf_counter() - started, 4)))
        self._open_locked(self._round + 1)

    def _store_global_locked(self, round_: int, data: bytes) -> None:
        assert self._schema is not None and self._base_model is not None
        sha = ad.sha256_hex(data)
        self.store.save_global(round_, data, ad.config_with_base(self._schema.adapter_config_json, self._base_model))
        self._global[round_] = (data, sha)
