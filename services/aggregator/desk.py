"""The upload desk: receives the clients' uploads of the open round.

Uploads are resumable (a stream may start at any offset up to the bytes held; offset 0 always
starts over), idempotent (an accepted upload, same sha256, is acknowledged again) and one stream
per client at a time (a newer stream supersedes the one still registered). Every byte is checked
as it arrives and written at its offset; an accepted upload is on disk before it is acknowledged.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from fedse.model import adapter as ad
from fedse.transport.serving import log_fields

from .errors import DuplicateUpload, ResumeMismatch, RunFinished, StaleRound, Superseded
from .state import Member, RunSettings, RunState, State
from .store import Store
from .upload_check import MaskedCheck, UploadCheck
from .uploads import Accepted, Stream, UploadHeader

log = logging.getLogger("aggregator.rounds")


class UploadRules(Protocol):
    """What the run's schedule (schedules.Schedule) says about uploads."""

    def check_upload(self, client_id: str, round_: int, nonce: str) -> None: ...

    def collecting(self) -> int: ...

    def holds(self, round_: int) -> bool: ...


class UploadDesk:
    """Works on the round keeper's RunState under the keeper's lock (`lock`, re-entrant) and calls
    `changed()`, with that lock held, when what a round status shows has changed. A stream's
    chunks are written under its own lock, never while holding the keeper's."""

    def __init__(self, settings: RunSettings, store: Store, run: RunState, lock: threading.Condition,
                 clock: Callable[[], float], changed: Callable[[], None], rules: UploadRules,
                 masked_bytes: Callable[[], int] | None = None):
        """`rules`: the run's schedule (which uploads may land, where they are collected); `masked_bytes`:
        with secure aggregation, the size of the run's masked vectors."""
        self.settings = settings
        self.rules = rules
        self.masked_bytes = masked_bytes
        self.store = store
        self.run = run
        self._lock = lock
        self.clock = clock
        self._changed = changed
        self._generation = 0
        self.progress_at = 0.0  # when upload bytes last arrived (a transfer making progress holds a round)

    def receiving(self) -> bool:
        """Whether a stream is receiving an upload now (call with the lock held)."""
        return any(m.stream is not None for m in self.run.members.values())

    def partial_bytes(self, m: Member) -> int:
        """The bytes held of the member's unfinished upload of the open round (call with the lock held)."""
        if m.stream is None and (self.run.state is not State.OPEN or m.accepted is not None):
            return 0
        return self._held(m, self.run.round)

    def _held(self, m: Member, round_: int) -> int:
        return m.stream.check.received if m.stream else self.store.partial_size(round_, m.client.client_id)

    def begin(self, h: UploadHeader) -> tuple[bool, int, int]:
        """Checks an upload's header; returns (already accepted, offset to receive from, generation).

        An accepted upload with the same sha256 is acknowledged again (idempotent); a partial one
        continues from any offset up to the bytes held; offset 0 always starts over."""
        masked = self.masked_bytes() if self.masked_bytes is not None and self.run.schema is not None else None
        h.check(self.settings.max_adapter_bytes, masked)
        self._settle(h.client_id)
        with self._lock:
            if self._accepted_earlier(h.client_id, h.round, h.sha256) is not None:
                return True, h.size, 0  # its acknowledgement was lost when that round closed
            self._check_round(h.client_id, h.round, h.round_nonce)
            record = self.run.members[h.client_id].accepted
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
            assert self.run.schema is not None
            check = MaskedCheck(h.size) if masked is not None else \
                UploadCheck(self.run.member_schema(h.client_id), h.size, self.settings.max_adapter_bytes, h.transport)
            if held:  # a resumed upload: the check reads what is held, then goes on with the stream
                try:
                    check.update(self.store.read_partial(h.round, h.client_id, held))
                except ad.AdapterError:
                    self.store.drop_partial(h.round, h.client_id)
                    raise
            self._generation += 1
            m = self.run.members[h.client_id]
            # A new stream supersedes one still registered (its connection may be half-dead);
            # both share the client's write lock so their writes never interleave.
            lock = m.stream.lock if m.stream is not None else threading.Lock()
            m.stream = Stream(self._generation, lock, check)
            self._heard(h.client_id)
            return False, held, self._generation

    def receive(self, h: UploadHeader, generation: int, offset: int, data: bytes) -> int:
        """Checks and stores the bytes at `offset` (fsynced when the stream ends); returns the bytes
        now held. Bytes that fail the check (a bad header, a NaN) drop the partial upload."""
        with self._lock:
            rec = self._stream(h.client_id, generation)
        with rec.lock:
            with self._lock:
                self._stream(h.client_id, generation)
            if offset != rec.check.received:
                raise ValueError(f"chunk at offset {offset}, but the stream is at byte {rec.check.received}")
            try:
                rec.check.update(data)
            except ad.AdapterError:
                self.store.drop_partial(h.round, h.client_id)  # a bad upload leaves nothing behind
                raise
            held = self.store.append_partial(h.round, h.client_id, offset, data)
        with self._lock:
            self._heard(h.client_id)
        return held

    def end(self, h: UploadHeader, generation: int) -> None:
        """The stream `generation` ended (however it ended): what it wrote is fsynced."""
        self.store.sync_partial(h.round, h.client_id)
        with self._lock:
            m = self.run.members.get(h.client_id)
            if m is not None and m.stream is not None and m.stream.generation == generation:
                m.stream = None
                self._changed()

    def state(self, client_id: str, round_: int, sha256: str) -> tuple[int, bool]:
        """(bytes held, complete) of an upload, for a client resuming one."""
        self._settle(client_id)
        with self._lock:
            m = self.run.member(client_id)
            m.last_seen = self.clock()
            earlier = self._accepted_earlier(client_id, round_, sha256)
            if earlier is not None:
                return earlier.size, True
            if self.rules.holds(round_):
                if m.accepted is not None and m.accepted.sha256 == sha256:
                    return m.accepted.size, True
                _, meta = self.store.partial(round_, client_id)
                if meta is not None and meta["sha256"] == sha256:
                    return self._held(m, round_), False
            return 0, False

    def finish(self, h: UploadHeader, generation: int) -> None:
        """Completes the upload that stream `generation` carried: its check must pass (every byte,
        the sha256), then it is stored as accepted before this returns."""
        with self._lock:
            self._check_round(h.client_id, h.round, h.round_nonce)
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
        with self._lock:
            self._check_round(h.client_id, h.round, h.round_nonce)
            m = self.run.members[h.client_id]
            if m.accepted is None:
                record = Accepted.of(h, self.clock(), self.rules.collecting())
                self.store.accept_upload(h.round, h.client_id, record.to_dict())
                m.accepted = record
                log.info("upload accepted", extra=log_fields(client=h.client_id, round=h.round, bytes=h.size,
                                                               uploaded=len(self.run.uploaded()),
                                                               joined=len(self.run.members)))
                self._changed()

    # ---- internals -----------------------------------------------------------------------
    def _heard(self, client_id: str) -> None:
        """Bytes or a header arrived from the client: progress, and a sign of life."""
        self.progress_at = self.run.members[client_id].last_seen = self.clock()

    def _stream(self, client_id: str, generation: int) -> Stream:
        m = self.run.members.get(client_id)
        if m is None or m.stream is None or m.stream.generation != generation:
            raise Superseded(f"a newer upload stream from {client_id} took over this one")
        return m.stream

    def _settle(self, client_id: str) -> None:
        """Waits for a chunk being written by this client's current stream (if any) to land, so that
        the bytes held are read after it; later chunks of a dead stream are superseded."""
        with self._lock:
            m = self.run.members.get(client_id)
            rec = m.stream if m is not None else None
        if rec is not None:
            with rec.lock:
                pass

    def _accepted_earlier(self, client_id: str, round_: int, sha256: str) -> Accepted | None:
        """The record of this upload if a round closed before accepted it, else None."""
        if not 0 <= round_ < self.run.round:
            return None
        record = self.store.accepted_uploads(round_).get(client_id)
        return Accepted.from_dict(record) if record is not None and record["sha256"] == sha256 else None

    def _check_round(self, client_id: str, round_: int, nonce: str) -> None:
        """Raises unless an upload of `client_id` for `round_` with `nonce` may land now."""
        self.run.member(client_id)
        run = self.run
        if run.state is State.FINISHED:
            raise RunFinished(f"run {self.settings.run_id} finished after {self.settings.num_rounds} rounds")
        if run.state is State.WAITING_FOR_CLIENTS:
            raise StaleRound("round 0 has not opened yet: wait for the round status to show OPEN")
        self.rules.check_upload(client_id, round_, nonce)
