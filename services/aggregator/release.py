"""How the closed round's uploads are released as phi_{t+1}: as they are (`PlainRelease`: the strategy,
or FedBuff's fold where the schedule says) or through secure aggregation's attempts (`SecureRelease`:
the stages of `secure.SecureDesk`, the mask keys rebuilt, the sum unmasked once, withheld where it
cannot be used, a new attempt where a stage fails). The round keeper picks one by whether the run is
secure (`release_for`) and asks it, under its lock, whether the open round is due and ready, then,
outside the lock, for phi_{t+1}'s image.

A released round is never released twice: `SecureRelease` saves the round as released before it
unmasks the sum, and a restart that finds it so publishes the saved mean or closes the round with
phi_t unchanged (`resume_locked`).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import threading
from typing import Callable

from fedse.model import adapter as ad
from fedse.model import ranks
from fedse.privacy import secagg
from fedse.transport.serving import log_fields

from . import metrics
from .adapter_files import AdapterFile, allocate
from .attempt import Attempt, Stage, mask_keys
from .closing import OpenRound, Rule, close_reason
from .errors import StaleRound
from .global_adapters import GlobalAdapters
from .secure import SecureDesk
from .state import RunSettings, RunState, State
from .store import Store
from .strategies import Update, aggregate, fedbuff
from .uploads import Accepted

log = logging.getLogger("aggregator.rounds")

Records = list[tuple[str, Accepted]]
# Makes phi_{t+1}'s image outside the lock, saved: (round, records, plain image maker) -> image, or None
# where the round goes on otherwise (the maker: the round keeper's, the strategy or the fold).
Maker = Callable[[int, Records, Callable[[int, Records], bytearray]], "bytearray | None"]


def strategy_image(settings: RunSettings, store: Store, run: RunState, round_: int, records: Records) -> bytearray:
    """phi_{t+1}'s file image: the strategy over the round's accepted uploads."""
    updates = [Update(cid, AdapterFile(store.upload_path(round_, cid)), a.num_examples, a.num_successes,
                      run.members[cid].lora_scaling) for cid, a in records]
    assert run.schema is not None
    image, views = allocate(run.schema)  # phi_{t+1} is aggregated into its file image
    aggregate(settings.strategy, updates, AdapterFile(store.global_path(round_)),
              settings.params, round_, out=views, out_scaling=ranks.RUN_SCALING)
    return image


def fold_image(settings: RunSettings, store: Store, run: RunState, version: int, records: Records) -> bytearray:
    """phi_{version+1}'s file image: the buffer's updates, each weighted by its staleness (FedBuff)."""
    assert run.schema is not None
    image, views = allocate(run.schema)
    updates = [(AdapterFile(store.upload_path(a.base, cid)), AdapterFile(store.global_path(a.base)),
                version - a.base) for cid, a in records]
    fedbuff(AdapterFile(store.global_path(version)), updates, out=views, lr=settings.async_server_lr)
    return image


class Release(abc.ABC):
    """How a closed round's uploads become phi_{t+1}. Works on the round keeper's run under its lock;
    `close(round, reason, uploads, took)` is the keeper's (phi_{t+1} saved: the next round opens), and
    `nonce()` mints a round nonce as the keeper does."""

    secure: SecureDesk | None = None  # the stages' desk (secure runs only)
    masked_bytes: Callable[[], int] | None = None  # the size of a masked upload (secure runs only)

    def __init__(self, settings: RunSettings, store: Store, run: RunState, globals_: GlobalAdapters,
                 lock: threading.Condition, rule: Rule, clock: Callable[[], float], changed: Callable[[], None],
                 persist: Callable[[], None], close: Callable[[int, str, int, float], None], nonce: Callable[[], str]):
        self.settings, self.store, self.run, self.globals = settings, store, run, globals_
        self._lock, self._rule, self.clock = lock, rule, clock
        self._changed, self._persist, self._close, self._nonce = changed, persist, close, nonce

    @abc.abstractmethod
    def due(self, rule: Rule, r: OpenRound, now: float) -> str | None:
        """Why the open synchronous round (or its stage) closes now, or None."""

    @abc.abstractmethod
    def ready_locked(self, uploaded: list[str]) -> Maker | None:
        """The round is due: what makes phi_{t+1} now, or None where it goes on (a stage closed)."""

    @property
    def minimum(self) -> int:
        """The fewest uploads that close a round early (a selector chooses at least as many if it can)."""
        return self.settings.min_clients

    def check_schema(self, schema: ad.Schema) -> None:
        """Raises unless a joining client's adapter schema can be released (secure runs: masked)."""

    def check_upload(self, client_id: str) -> None:
        """Raises unless the client may upload in the open round's stage now (secure runs)."""

    def desk(self) -> SecureDesk:
        """The desk whose stages a client calls; StaleRound in a run without secure aggregation."""
        raise StaleRound("this run does not use secure aggregation: upload the adapter itself")

    def opened_locked(self) -> None:
        """A round opened, or the run finished."""

    def began_locked(self) -> None:
        """The open round's clock started again (its clients were chosen)."""

    def ended_locked(self) -> None:
        """The round closes without an update."""

    def restart_locked(self, reason: str) -> None:
        """The round's clients changed: a secure round starts a new attempt."""

    def resume_locked(self) -> None:
        """After a restart, with the run as it was saved."""

    def stage(self) -> Stage | None:
        return None

    def step_of(self, client_id: str) -> str:
        return ""


class PlainRelease(Release):
    """The uploads as they are: phi_{t+1} = the strategy (or FedBuff's fold) of them."""

    def due(self, rule: Rule, r: OpenRound, now: float) -> str | None:
        return close_reason(rule, r, now)

    def ready_locked(self, uploaded: list[str]) -> Maker | None:
        return self._made

    def _made(self, round_: int, records: Records, plain: Callable[[int, Records], bytearray]) -> bytearray | None:
        try:
            image = plain(round_, records)
            self.globals.save(round_ + 1, image, self.run.adapter_config())
        except Exception:  # noqa: BLE001 - a failed aggregation must not end the run
            with self._lock:
                log.exception("aggregation failed; the round stays open", extra=log_fields(round=round_))
                self.run.state = State.OPEN
                self._changed()
            return None
        return image


class SecureRelease(Release):
    """Secure aggregation's attempts: the round closes once an attempt's unmasking closed, and its sum is
    unmasked once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self.settings
        self._layout: secagg.Layout | None = None
        # A secure round needs two uploads or more: the mean of one is that client's adapter.
        self.secure = SecureDesk(s.run_id, s.secure_threshold, s.secure_stage_timeout_s,
                                 dataclasses.replace(self._rule, min_clients=max(2, s.min_clients)),
                                 self._changed, s.secure_neighbours, s.secure_ca, s.secure_max_roster,
                                 (lambda cid: self.run.members[cid].lora_rank) if s.max_lora_rank else None)
        self.masked_bytes = lambda: self.layout().nbytes

    def layout(self) -> secagg.Layout:
        """The masked vector's layout (the run's schema must be fixed)."""
        assert self.run.schema is not None
        if self._layout is None:
            self._layout = secagg.Layout.of(self.run.schema, self.settings.strategy)
        return self._layout

    @property
    def minimum(self) -> int:
        return max(2, self.settings.min_clients)  # the mean of one upload is that client's adapter

    def check_schema(self, schema: ad.Schema) -> None:
        secagg.Layout.of(schema, self.settings.strategy)  # a schema a masked vector can carry

    def due(self, rule: Rule, r: OpenRound, now: float) -> str | None:
        busy = r.receiving and now - r.progress_at <= rule.heartbeat_timeout_s
        return self.secure.due(r.last_seen, r.accepted, busy, r.deadline, now)

    def ready_locked(self, uploaded: list[str]) -> Maker | None:
        stage = self.secure.stage()
        failed = self.secure.advance(uploaded, self.clock())
        if failed is not None:
            self.restart_locked(failed)
            return None
        if stage is not Stage.UNMASKING:
            return None
        unmasking = self.secure.unmasking()
        return lambda round_, records, plain: self._unmask_once(round_, unmasking)

    def check_upload(self, client_id: str) -> None:
        self.secure.check_upload(client_id)

    def desk(self) -> SecureDesk:
        return self.secure

    def opened_locked(self) -> None:
        if self.run.state is State.OPEN:
            self.began_locked()
        else:
            self.secure.end()

    def began_locked(self) -> None:
        self.secure.begin(self.run.round, self.run.nonce, self.run.opened_at)

    def ended_locked(self) -> None:
        self.secure.end()

    def stage(self) -> Stage | None:
        return self.secure.stage()

    def step_of(self, client_id: str) -> str:
        return self.secure.step_of(client_id)

    def resume_locked(self) -> None:
        """Keys and shares were only in memory: the round's secure stages start again."""
        run = self.run
        if run.state is not State.OPEN:
            return
        if run.released == run.round and self.globals.has(run.round + 1):
            # It stopped after saving the unmasked mean, before the next round opened: publish it.
            self.secure.end()
            self._close(run.round, "the unmasked mean was saved before a restart", 0, 0.0)
        elif run.released == run.round:
            # It stopped while unmasking: a new attempt would give a second sum of this round.
            self._withhold_locked(run.round, "the aggregator restarted while unmasking the round")
        else:
            self.restart_locked("the aggregator restarted")

    def restart_locked(self, reason: str) -> None:
        """Abandons the attempt of the open round (nothing of it is published; its masked uploads are
        deleted) and starts a new one, at key advertisement with a new round nonce."""
        run = self.run
        log.warning("secure attempt abandoned: the round starts again at key advertisement",
                    extra=log_fields(round=run.round, reason=reason))
        for m in run.members.values():
            m.new_round()
        self.store.drop_uploads(run.round)
        run.state, run.nonce = State.OPEN, self._nonce()
        self._persist()
        self.secure.begin(run.round, run.nonce, self.clock())

    def _unmask_once(self, round_: int, u: Attempt) -> bytearray | None:
        """phi_{t+1}'s image from the attempt's masked uploads, saved; None where the round goes on
        otherwise. A failure before any mask is removed (a rebuilt seed that is not its owner's) starts a
        new attempt; from the moment the sum is unmasked the round is released and never tried again:
        a sum that does not decode closes it with phi_t unchanged."""
        try:
            keys = mask_keys(u)
        except Exception as exc:  # noqa: BLE001 - a bad share must not end the run
            with self._lock:
                self.restart_locked(f"unmasking failed: {exc}")
                self._changed()
            return None
        with self._lock:
            self.run.released = round_
            self._persist()
        try:
            image = self._unmask(round_, u, keys)
            self.globals.save(round_ + 1, image, self.run.adapter_config())
        except Exception as exc:  # noqa: BLE001 - the round is released either way
            with self._lock:
                self._withhold_locked(round_, f"its unmasked sum cannot be used: {exc}")
            return None
        self.store.drop_uploads(round_)  # masked under keys that are gone: of no use to anyone
        return image

    def _withhold_locked(self, round_: int, why: str) -> None:
        """Closes a secure round whose sum was (or may have been) unmasked without an update: phi_{t+1} is
        phi_t. Another attempt would give a second sum of the round over other clients."""
        log.error("secure round closed without an update: its sum is released once and not retried",
                  extra=log_fields(round=round_, reason=why))
        metrics.SECURE_ROUNDS_WITHHELD.inc()
        self.globals.save(round_ + 1, self.globals.get(round_)[0], self.run.adapter_config())
        self.store.drop_uploads(round_)
        self.secure.end()
        self._close(round_, "withheld: " + why, 0, 0.0)

    def _unmask(self, round_: int, u: Attempt, keys: tuple[list[bytes], list[tuple[bytes, int]]]) -> bytearray:
        """phi_{t+1}'s file image: the mean of the masked uploads, their masks (`keys`) removed."""
        layout = self.layout()
        with contextlib.ExitStack() as files:
            uploads = [files.enter_context(open(self.store.upload_path(round_, cid), "rb")) for cid in u.uploaded]
            total = secagg.unmasked_sum(uploads, layout.length, *keys)
        mean = layout.decode_mean(total, len(u.uploaded))
        assert self.run.schema is not None
        image, views = allocate(self.run.schema)
        for name, view in views.items():
            view.copy_(mean[name].to(view.dtype))
        dropped = len(u.shared) - len(u.uploaded)
        metrics.SECURE_DROPOUTS_RECOVERED.inc(dropped)
        log.info("secure round unmasked", extra=log_fields(round=round_, uploads=len(u.uploaded), dropped=dropped,
                                                           unmasked_by=len(u.revealed), threshold=u.threshold))
        return image


def release_for(settings: RunSettings) -> type[Release]:
    """The release of a run: secure aggregation's attempts where the run is secure, else the plain one."""
    return SecureRelease if settings.secure else PlainRelease
