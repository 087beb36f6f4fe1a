"""The aggregator's round state machine: join, open, collect, close, aggregate, store, open next.

Pure Python and thread-safe; the servicer translates protobuf to calls here and maps the
exceptions below to gRPC status codes.

Round 0 opens once `start_clients` (0: `min_clients`) clients have joined. A round t starts from
the global adapter phi_t and closes, with at least one upload, when
  - every joined client has uploaded, or
  - at least `min_clients` have, and every client still alive (heard from within the heartbeat
    timeout) has uploaded, or
  - at least `min_clients` have, and `wait_after_min_s` has passed since the min_clients-th upload, or
  - at least `min_clients` have, and the round's deadline has passed;
the last two wait while an upload is still making progress. Then phi_{t+1} = strategy(uploads of
round t). A client that missed a round catches up at the next one.

Everything an acknowledgement depends on is in the Store before the call returns, so a restarted
aggregator resumes the same run at the same round with every acknowledged upload.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import math
import re
import secrets
import threading
import time
from typing import Any, Callable

from fedse import adapter as ad
from fedse.inputs import bounded, shown
from fedse.serving import log_fields

from . import metrics
from .store import Store
from .strategies import STRATEGIES, StrategyParams, Update, aggregate, validate_params
from .uploads import Accepted, Stream, UploadHeader

log = logging.getLogger("aggregator.rounds")

CLIENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
STATE_VERSION = 1
MAX_METRICS = 256  # named values in one metrics report


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


class ResumeMismatch(FederationError):
    """An upload or download resumed from an offset that does not match what is held."""


class Superseded(FederationError):
    """A newer stream of the same upload took over; this one stops."""


class State(enum.Enum):
    WAITING_FOR_CLIENTS = "waiting_for_clients"
    OPEN = "open"
    AGGREGATING = "aggregating"
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
    wait_after_min_s: float = 900.0
    heartbeat_timeout_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    params: StrategyParams = StrategyParams()
    start_clients: int = 0  # clients that open round 0 (0 = min_clients)

    def fingerprint(self) -> dict[str, Any]:
        """The settings that decide a run's result: a restart must not change them."""
        return {"num_rounds": self.num_rounds, "strategy": self.strategy, "seed": self.seed,
                "params": dataclasses.asdict(self.params)}


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


@dataclasses.dataclass(frozen=True)
class Client:
    client_id: str
    env: str
    base_model: str


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


@dataclasses.dataclass
class Member:
    """A joined client and its part in the run: when it was last heard from and what it said it was
    doing, its upload of the open round (a stream receiving it, then the accepted upload) and its
    latest metrics."""

    client: Client
    last_seen: float = 0.0
    phase_round: int = -1
    phase: str = ""
    stream: Stream | None = None  # receiving its upload now
    accepted: Accepted | None = None  # its upload of the open round, accepted
    metrics_round: int = -1
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def new_round(self) -> None:
        self.stream = self.accepted = None


class RoundKeeper:
    """The aggregator's run: who joined, the open round and its uploads, liveness, aggregation and
    what is persisted. Thread-safe; the servicer translates gRPC to its calls."""

    def __init__(self, settings: RunSettings, store: Store, clock: Callable[[], float] = time.time):
        if settings.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {settings.strategy!r}")
        validate_params(settings.strategy, settings.params)
        self.settings = settings
        self.store = store
        self.clock = clock
        self._cond = threading.Condition()
        self._members: dict[str, Member] = {}
        self._schema: ad.Schema | None = None
        self._base_model: str | None = None
        self._round = 0
        self._state = State.WAITING_FOR_CLIENTS
        self._nonce = ""
        self._deadline = 0.0
        self._opened_at = 0.0
        self._round_seconds: list[float] = []
        self._generation = 0
        self._progress_at = 0.0
        self._version = 0
        # (round, transport) -> (the adapter file's bytes, sha256); phi made here is a bytearray image
        self._cache: dict[tuple[int, str], tuple[bytes | bytearray, str]] = {}
        # Every (client, round) reported: a round's metrics are recorded once, so a client that
        # repeats a report after a crash does not count twice.
        self._reported: set[tuple[str, int]] = set()
        self._restore()
        for cid, r, m in store.metrics_reports():
            self._note_report_locked(cid, r, m)

    # ---- persistence ---------------------------------------------------------------------
    def _persist_locked(self) -> None:
        self.store.save_state({
            "version": STATE_VERSION, "run_id": self.settings.run_id, "settings": self.settings.fingerprint(),
            "schema": self._schema.to_dict() if self._schema else None, "base_model": self._base_model,
            "clients": {cid: {"env": m.client.env, "base_model": m.client.base_model}
                        for cid, m in self._members.items()},
            "round": self._round, "state": self._state.value if self._state is not State.AGGREGATING else "open",
            "round_nonce": self._nonce, "deadline_unix": self._deadline, "opened_unix": self._opened_at,
            "round_seconds": self._round_seconds,
        })

    def _restore(self) -> None:
        saved = self.store.load_state()
        if saved is None:
            return
        if saved.get("settings") != self.settings.fingerprint():
            raise ValueError(
                f"the state directory {self.store.root} holds run {self.settings.run_id!r} with settings "
                f"{saved.get('settings')}, not {self.settings.fingerprint()}: restart with the same settings "
                "to resume it, or give a new --run-id")
        now = self.clock()
        self._schema = ad.Schema.from_dict(saved["schema"]) if saved.get("schema") else None
        self._base_model = saved.get("base_model")
        # A restart is not the clients' fault: everyone known counts as alive until proven otherwise.
        self._members = {cid: Member(Client(cid, c["env"], c["base_model"]), last_seen=now)
                         for cid, c in saved["clients"].items()}
        self._round = int(saved["round"])
        self._state = State(saved["state"])
        self._nonce = saved.get("round_nonce", "")
        self._deadline = float(saved.get("deadline_unix", 0.0))
        self._opened_at = float(saved.get("opened_unix", now))
        self._round_seconds = list(saved.get("round_seconds", []))
        if self._state is State.OPEN:
            for cid, record in self.store.accepted_uploads(self._round).items():
                self._members[cid].accepted = Accepted.from_dict(record)
        log.info("run resumed", extra=log_fields(run_id=self.settings.run_id, round=self._round,
                                                 state=self._state.value, clients=len(self._members),
                                                 uploads=len(self._uploaded_locked())))

    def _uploaded_locked(self) -> dict[str, Member]:
        """The members whose upload of the open round is accepted, by client id (sorted)."""
        return {cid: m for cid, m in sorted(self._members.items()) if m.accepted is not None}

    # ---- queries -------------------------------------------------------------------------
    def status(self) -> Status:
        with self._cond:
            return self._status_locked()

    def _status_locked(self) -> Status:
        # phi_round exists once the schema is fixed: phi_0 is written at the first join, and
        # phi_{t+1} before round t+1 opens.
        sha = self._global_locked(self._round, "")[1] if self._schema is not None else ""
        return Status(
            run_id=self.settings.run_id, round=self._round, state=self._state,
            num_rounds=self.settings.num_rounds, joined=tuple(sorted(self._members)),
            uploaded=tuple(self._uploaded_locked()), deadline_unix=self._deadline,
            global_sha256=sha, version=self._version, round_nonce=self._nonce,
        )

    def wait_for_change(self, version: int, timeout: float) -> Status:
        """Blocks until the status version differs from `version` or the timeout passes."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout=timeout)
            return self._status_locked()

    def global_adapter(self, round_: int, transport: str = "") -> tuple[int, bytes | bytearray, str, str]:
        """(round, bytes, sha256, adapter_config_json) of phi_round in the transport dtype; -1 = latest."""
        wire = ad.transport_dtype(transport)
        with self._cond:
            if self._schema is None:
                raise NotAvailable("no adapter yet: the first client to join fixes the run's adapter schema")
            latest = self._round if self.store.has_global(self._round) else self._round - 1
            if round_ < 0:
                round_ = latest
            if round_ > latest or not self.store.has_global(round_):
                raise NotAvailable(f"no global adapter for round {round_}: rounds 0..{latest} exist")
            data, sha = self._global_locked(round_, transport if wire is not None else "")
            return round_, data, sha, ad.config_with_base(self._schema.adapter_config_json, self._base_model or "")

    def _save_global(self, round_: int, data: bytes | bytearray) -> None:
        """Writes phi_round as a PEFT directory and keeps its bytes and hash for downloads (the
        lock, re-entrant, is taken only for the cache)."""
        assert self._schema is not None
        digest = hashlib.sha256()
        hashing = threading.Thread(target=digest.update, args=(data,), name="hash-global")
        hashing.start()  # beside the write: hashlib lets go of the GIL over large buffers
        try:
            self.store.save_global(round_, data, ad.config_with_base(self._schema.adapter_config_json,
                                                                     self._base_model or ""))
        finally:
            hashing.join()
        sha = digest.hexdigest()
        with self._cond:
            for old in [k for k in self._cache if k[0] != round_]:
                del self._cache[old]
            self._cache[(round_, "")] = (data, sha)

    def _global_locked(self, round_: int, transport: str) -> tuple[bytes, str]:
        key = (round_, transport)
        if key not in self._cache:
            data = self.store.load_global(round_)
            if transport:
                data = ad.encode_transport(ad.decode(data), transport)
            # Keep the current round's variants only: old rounds are rarely asked for again.
            for old in [k for k in self._cache if k[0] != round_]:
                del self._cache[old]
            self._cache[key] = (data, ad.sha256_hex(data))
        return self._cache[key]

    def run_view(self) -> tuple[Status, list[ClientView], list[float], str]:
        """The operator's view: status, each client's state, round durations and the base model."""
        with self._cond:
            now = self.clock()
            views = []
            for cid, m in sorted(self._members.items()):
                partial = m.stream.check.received if m.stream else (
                    self.store.partial_size(self._round, cid) if self._state is State.OPEN and m.accepted is None else 0)
                views.append(ClientView(cid, m.client.env, m.accepted is not None, self._alive_locked(cid, now),
                                        m.last_seen, m.phase_round, m.phase, partial, m.metrics_round,
                                        dict(m.metrics)))
            return self._status_locked(), views, list(self._round_seconds), self._base_model or ""

    def clients_alive(self) -> int:
        with self._cond:
            now = self.clock()
            return sum(self._alive_locked(c, now) for c in self._members)

    def _alive_locked(self, client_id: str, now: float) -> bool:
        m = self._members.get(client_id)
        return m is not None and now - m.last_seen <= self.settings.heartbeat_timeout_s

    # ---- commands -------------------------------------------------------------------------
    def seen(self, client_id: str, round_: int | None = None, phase: str | None = None) -> None:
        """Records a sign of life (any call from a joined client, or a heartbeat)."""
        with self._cond:
            m = self._members.get(client_id)
            if m is None:
                if phase is not None:
                    raise NotJoined(f"client {shown(client_id)} has not joined this run: call Join first")
                return
            m.last_seen = self.clock()
            if phase is not None:
                m.phase = phase[:64]
                m.phase_round = int(round_ if round_ is not None else -1)

    def join(self, client_id: str, env: str, base_model: str, schema: ad.Schema) -> Status:
        if not CLIENT_ID.match(client_id):
            raise ValueError(f"client_id {shown(client_id)} is not valid: use 1-63 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit")
        schema.check(self.settings.max_adapter_bytes)
        with self._cond:
            if self._schema is None:
                self._schema = schema
                self._base_model = base_model
                self._save_global(0, ad.fresh(schema, self.settings.seed)[0])
                log.info("run schema fixed", extra=log_fields(client=client_id, tensors=len(schema.tensors),
                                                                base_model=base_model))
            else:
                if base_model != self._base_model:
                    raise SchemaMismatch(f"this run federates base model {self._base_model!r}, "
                                         f"client {client_id} has {shown(base_model)}")
                try:
                    self._schema.check_compatible(schema)
                except ad.AdapterError as exc:
                    raise SchemaMismatch(f"client {client_id}'s adapter does not fit the run: {exc}") from None
            client = Client(client_id, env, base_model)
            m = self._members.get(client_id)
            changed = m is None or m.client != client
            if m is None:
                m = self._members[client_id] = Member(client)
            m.client, m.last_seen = client, self.clock()
            if changed:
                log.info("client joined", extra=log_fields(client=client_id, env=env, joined=len(self._members)))
            if self._state is State.WAITING_FOR_CLIENTS and \
                    len(self._members) >= (self.settings.start_clients or self.settings.min_clients):
                self._open_locked(0)
            else:
                self._persist_locked()
            self._changed_locked()
            return self._status_locked()

    # ---- uploads: begin, receive chunks, finish ---------------------------------------------
    def begin_upload(self, h: UploadHeader) -> tuple[bool, int, int]:
        """Checks an upload's header; returns (already accepted, offset to receive from, generation).

        An accepted upload with the same sha256 is acknowledged again (idempotent); a partial one
        continues from any offset up to the bytes held; offset 0 always starts over."""
        h.check(self.settings.max_adapter_bytes)
        self._settle_stream(h.client_id)
        with self._cond:
            if self._accepted_earlier_locked(h.client_id, h.round, h.sha256) is not None:
                return True, h.size, 0  # its acknowledgement was lost when that round closed
            self._check_round_locked(h.client_id, h.round, h.round_nonce)
            record = self._members[h.client_id].accepted
            if record is not None:
                if record.sha256 == h.sha256:
                    return True, h.size, 0
                raise DuplicateUpload(f"client {h.client_id} already uploaded a different adapter "
                                      f"({record.sha256[:12]}...) for round {h.round}")
            header = h.partial_record()
            _, meta = self.store.partial(h.round, h.client_id)
            same = meta is not None and meta == header
            held = self.store.partial_size(h.round, h.client_id) if same else 0
            if h.offset == 0:
                self.store.start_partial(h.round, h.client_id, header)
                held = 0
            elif not same or h.offset > held:
                raise ResumeMismatch(f"upload {h.sha256[:12]}... of round {h.round}: the aggregator holds {held} "
                                     f"bytes of it; resume from offset {held}")
            else:
                held = h.offset  # resuming before the end of what is held is safe: writes go to their offsets
            assert self._schema is not None
            check = ad.UploadCheck(self._schema, h.size, self.settings.max_adapter_bytes, h.transport)
            if held:  # a resumed upload: the check reads what is held, then goes on with the stream
                try:
                    check.update(self.store.read_partial(h.round, h.client_id, held))
                except ad.AdapterError:
                    self.store.drop_partial(h.round, h.client_id)
                    raise
            self._generation += 1
            m = self._members[h.client_id]
            # A new stream supersedes one still registered (its connection may be half-dead);
            # both share the client's write lock so their writes never interleave.
            lock = m.stream.lock if m.stream is not None else threading.Lock()
            m.stream = Stream(self._generation, lock, check)
            self._progress_at = self.clock()
            self._seen_locked(h.client_id)
            return False, held, self._generation

    def _stream_of_locked(self, client_id: str) -> Stream | None:
        m = self._members.get(client_id)
        return m.stream if m is not None else None

    def _stream(self, client_id: str, generation: int) -> Stream:
        rec = self._stream_of_locked(client_id)
        if rec is None or rec.generation != generation:
            raise Superseded(f"a newer upload stream from {client_id} took over this one")
        return rec

    def receive(self, h: UploadHeader, generation: int, offset: int, data: bytes) -> int:
        """Checks and stores the bytes at `offset` (fsynced when the stream ends); returns the bytes
        now held. Bytes that fail the check (a bad header, a NaN) drop the partial upload."""
        with self._cond:
            rec = self._stream(h.client_id, generation)
        with rec.lock:
            with self._cond:
                self._stream(h.client_id, generation)
            if offset != rec.check.received:
                raise ValueError(f"chunk at offset {offset}, but the stream is at byte {rec.check.received}")
            try:
                rec.check.update(data)
            except ad.AdapterError:
                self.store.drop_partial(h.round, h.client_id)  # a bad upload leaves nothing behind
                raise
            held = self.store.append_partial(h.round, h.client_id, offset, data)
        with self._cond:
            self._progress_at = self.clock()
            self._seen_locked(h.client_id)
        return held

    def end_stream(self, h: UploadHeader, generation: int) -> None:
        self.store.sync_partial(h.round, h.client_id)
        with self._cond:
            rec = self._stream_of_locked(h.client_id)
            if rec is not None and rec.generation == generation:
                self._members[h.client_id].stream = None
                self._changed_locked()

    def _settle_stream(self, client_id: str) -> None:
        """Waits for a chunk being written by this client's current stream (if any) to land, so that
        the bytes held are read after it; later chunks of a dead stream are superseded."""
        with self._cond:
            rec = self._stream_of_locked(client_id)
        if rec is not None:
            with rec.lock:
                pass

    def _accepted_earlier_locked(self, client_id: str, round_: int, sha256: str) -> Accepted | None:
        """The record of this upload if a round closed before accepted it, else None."""
        if not 0 <= round_ < self._round:
            return None
        record = self.store.accepted_uploads(round_).get(client_id)
        return Accepted.from_dict(record) if record is not None and record["sha256"] == sha256 else None

    def upload_state(self, client_id: str, round_: int, sha256: str) -> tuple[int, bool]:
        """(bytes held, complete) of an upload, for a client resuming one."""
        self._settle_stream(client_id)
        with self._cond:
            m = self._members.get(client_id)
            if m is None:
                raise NotJoined(f"client {shown(client_id)} has not joined this run: call Join first")
            self._seen_locked(client_id)
            earlier = self._accepted_earlier_locked(client_id, round_, sha256)
            if earlier is not None:
                return earlier.size, True
            if round_ == self._round:
                if m.accepted is not None and m.accepted.sha256 == sha256:
                    return m.accepted.size, True
                _, meta = self.store.partial(round_, client_id)
                if meta is not None and meta["sha256"] == sha256:
                    return (m.stream.check.received if m.stream else self.store.partial_size(round_, client_id)), False
            return 0, False

    def finish_upload(self, h: UploadHeader, generation: int) -> Status:
        """Completes the upload that stream `generation` carried: its check must pass (every byte,
        the sha256), then it is stored as accepted (before returning) and may close the round."""
        with self._cond:
            self._check_round_locked(h.client_id, h.round, h.round_nonce)
            rec = self._stream(h.client_id, generation)
        with rec.lock:
            if rec.check.received < h.size:
                raise ResumeMismatch(f"upload {h.sha256[:12]}... of round {h.round}: the aggregator holds "
                                     f"{rec.check.received} of its {h.size} bytes; resume from offset "
                                     f"{rec.check.received}")
            try:
                rec.check.finish(h.sha256)
            except ad.AdapterError:
                self.store.drop_partial(h.round, h.client_id)  # a bad upload leaves nothing behind
                raise
        # Stored as received, also in a transport dtype: aggregation reads every upload in float64
        # and writes phi_{t+1} in the schema's dtypes.
        self.store.sync_partial(h.round, h.client_id)
        with self._cond:
            self._check_round_locked(h.client_id, h.round, h.round_nonce)
            if self._members[h.client_id].accepted is None:
                record = Accepted.of(h, self.clock())
                self.store.accept_upload(h.round, h.client_id, record.to_dict())
                self._members[h.client_id].accepted = record
                log.info("upload accepted", extra=log_fields(client=h.client_id, round=h.round, bytes=h.size,
                                                               uploaded=len(self._uploaded_locked()),
                                                               joined=len(self._members)))
                self._changed_locked()
            status = self._status_locked()
            due = self._due_locked() is not None
        if due:  # aggregate beside the acknowledgement, not before it
            threading.Thread(target=self.close_if_due, name="aggregate", daemon=True).start()
        return status

    def _check_round_locked(self, client_id: str, round_: int, nonce: str) -> None:
        if client_id not in self._members:
            raise NotJoined(f"client {shown(client_id)} has not joined this run: call Join first")
        if self._state is State.FINISHED:
            raise RunFinished(f"run {self.settings.run_id} finished after {self.settings.num_rounds} rounds")
        if self._state is State.WAITING_FOR_CLIENTS:
            raise StaleRound("round 0 has not opened yet: wait for the round status to show OPEN")
        if round_ != self._round or self._state is State.AGGREGATING:
            nxt = self._round + 1 if self._state is State.AGGREGATING else self._round
            raise StaleRound(f"upload for round {round_}, but round {self._round} is "
                             f"{'being aggregated' if self._state is State.AGGREGATING else 'open'}: "
                             f"download the global adapter of round {nxt} and train from it")
        if nonce != self._nonce:
            raise StaleRound(f"the upload's round nonce does not match round {round_}'s: an upload is bound "
                             "to the run and round it was made for; take the nonce from the current RoundStatus")

    def report_metrics(self, client_id: str, round_: int, values: dict[str, float]) -> None:
        """Records a client's metrics of a round: finite values of at most MAX_METRICS named metrics,
        for a round of the run that has opened (0..num_rounds; num_rounds is the final adapter's)."""
        if len(values) > MAX_METRICS:
            raise ValueError(f"{len(values)} metrics in one report, more than the limit of {MAX_METRICS}")
        for name, value in values.items():
            bounded("metric name", name)
            if not math.isfinite(value):
                raise ValueError(f"metric {shown(name)} is {value}: report finite values only (leave out a metric "
                                 "that has no value)")
        if not 0 <= round_ <= self.settings.num_rounds:
            raise ValueError(f"metrics for round {round_}: this run's rounds are 0..{self.settings.num_rounds} "
                             f"(round {self.settings.num_rounds} evaluates the final adapter)")
        with self._cond:
            if client_id not in self._members:
                raise NotJoined(f"client {shown(client_id)} has not joined this run: call Join first")
            if round_ > self._round:
                raise StaleRound(f"metrics for round {round_}, which has not opened (round {self._round} is the "
                                 "latest): report a round's metrics once it is open")
            self._seen_locked(client_id)
            if (client_id, round_) in self._reported:
                log.info("repeated metrics report acknowledged, not recorded again",
                         extra=log_fields(client_id=client_id, round=round_))
                return
            self.store.append_metrics(client_id, round_, values)
            self._note_report_locked(client_id, round_, values)
            self._changed_locked()

    def _note_report_locked(self, client_id: str, round_: int, values: dict[str, float]) -> None:
        self._reported.add((client_id, round_))
        m = self._members.get(client_id)
        if m is not None and round_ >= m.metrics_round:
            m.metrics_round, m.metrics = round_, dict(values)

    def tick(self) -> None:
        """Closes the open round when due (called periodically; deadlines and liveness change with time)."""
        self.close_if_due()

    # ---- closing a round ---------------------------------------------------------------------
    def _due_locked(self) -> str | None:
        members = self._uploaded_locked()
        if self._state is not State.OPEN or not members:
            return None
        now = self.clock()
        uploaded = set(members)
        if uploaded >= set(self._members):
            return "all uploaded"
        if len(uploaded) < self.settings.min_clients:
            return None
        if not any(self._alive_locked(c, now) for c in set(self._members) - uploaded):
            return "all alive clients uploaded"
        receiving = any(m.stream is not None for m in self._members.values())
        if receiving and now - self._progress_at <= self.settings.heartbeat_timeout_s:
            return None  # a transfer is making progress: wait for it
        accepted = sorted(m.accepted.accepted_unix for m in members.values())
        if now >= accepted[self.settings.min_clients - 1] + self.settings.wait_after_min_s:
            return "waited after quorum"
        if now >= self._deadline:
            return "deadline with quorum"
        return None

    def close_if_due(self) -> None:
        with self._cond:
            reason = self._due_locked()
            if reason is None:
                return
            self._state = State.AGGREGATING
            self._changed_locked()
            round_ = self._round
            records = [(cid, m.accepted) for cid, m in self._uploaded_locked().items()]  # accepted: never None
        # Aggregating outside the lock: status, heartbeats and downloads go on meanwhile.
        started = time.perf_counter()
        try:
            updates = [Update(cid, ad.AdapterFile(self.store.upload_path(round_, cid)), a.num_examples,
                              a.num_successes) for cid, a in records]
            assert self._schema is not None
            image, views = ad.allocate(self._schema)  # phi_{t+1} is aggregated into its file image
            aggregate(self.settings.strategy, updates, ad.AdapterFile(self.store.global_path(round_)),
                      self.settings.params, round_, out=views)
            del views
            self._save_global(round_ + 1, image)
        except Exception:  # noqa: BLE001 - a failed aggregation must not end the run; the round stays open
            log.exception("aggregation failed; the round stays open", extra=log_fields(round=round_))
            with self._cond:
                self._state = State.OPEN
                self._changed_locked()
            return
        took = time.perf_counter() - started
        metrics.AGGREGATE_SECONDS.observe(took)
        with self._cond:
            duration = self.clock() - self._opened_at
            self._round_seconds.append(round(duration, 3))
            metrics.ROUND_SECONDS.observe(duration)
            log.info("round closed", extra=log_fields(round=round_, uploads=len(updates), reason=reason,
                                                      aggregate_s=round(took, 4), round_s=round(duration, 2)))
            self._open_locked(round_ + 1)
            self._changed_locked()

    # ---- internals -----------------------------------------------------------------------
    def _seen_locked(self, client_id: str) -> None:
        self._members[client_id].last_seen = self.clock()

    def _changed_locked(self) -> None:
        self._version += 1
        self._cond.notify_all()

    def _open_locked(self, round_: int) -> None:
        self._round = round_
        for m in self._members.values():
            m.new_round()
        self._opened_at = self.clock()
        if round_ >= self.settings.num_rounds:
            self._state = State.FINISHED
            self._deadline = 0.0
            self._nonce = ""
            log.info("run finished", extra=log_fields(rounds=round_))
        else:
            self._state = State.OPEN
            self._deadline = self._opened_at + self.settings.round_deadline_s
            self._nonce = secrets.token_hex(16)
            log.info("round opened", extra=log_fields(round=round_, clients=len(self._members)))
        self._persist_locked()
        self._changed_locked()
