"""The aggregator's round state machine: join, open, collect, close, aggregate, store, open next.

Pure Python and thread-safe; the servicer translates protobuf to calls here and maps the
exceptions of `errors` to gRPC status codes.

Round 0 opens once `start_clients` (0: `min_clients`) clients have joined. The run's schedule
(`schedules`, by RunSettings.mode: synchronous rounds or FedBuff) says who takes part and when the
open round is due; its release (`release`: as they are, or secure aggregation's attempts) makes
phi_{t+1} of the round's uploads; the selector (`round_selection`) chooses a selective run's clients.

The round keeper holds the run's persisted state (`state.RunState`), the global adapters
(`global_adapters`), the upload desk (`desk`) and those three, all under one lock. Everything an
acknowledgement depends on is in the Store before the call returns, so a restarted aggregator
resumes the same run at the same round with every acknowledged upload.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from typing import Callable, Iterable, TypeVar

from fedse.model import adapter as ad
from fedse.model import ranks
from fedse.transport.inputs import CLIENT_ID, CLIENT_ID_RULE, shown
from fedse.transport.serving import log_fields

from . import metrics
from .adapter_files import fresh
from .closing import Rule
from .desk import UploadDesk
from .errors import NotAvailable, SchemaMismatch, StaleRound
from .global_adapters import GlobalAdapters
from .reports import MAX_METRIC_NAME_BYTES, MAX_METRICS, MetricsReports, check_report
from .release import Records, fold_image, release_for, strategy_image
from .selection.keeper import RoundSelector
from .schedules import DECLINED, schedule_for
from .secure import SecureDesk
from .selection.policies import Policy, Selection
from .selection.thinking import Thinking, is_placeholder
from .state import UPLOAD_TIMES, Client, Member, RunSettings, State, restore
from .store import Store
from .tracking import Tracker
from .strategies import validate_params
from .uploads import UploadHeader
from .views import ClientView, Status

log = logging.getLogger("aggregator.rounds")

T = TypeVar("T")
# Re-exported: what callers of the round keeper name.
__all__ = ["DECLINED", "MAX_METRICS", "MAX_METRIC_NAME_BYTES", "ClientView", "RoundKeeper", "Status"]


def new_nonce() -> str:
    """A new round nonce (a round, or a secure round's attempt, binds its uploads to it)."""
    return secrets.token_hex(16)


class RoundKeeper:
    """The aggregator's run: who joined, the open round and its uploads, liveness, aggregation and
    what is persisted. Thread-safe; the servicer translates gRPC to its calls."""

    def __init__(self, settings: RunSettings, store: Store, clock: Callable[[], float] = time.time,
                 tracker: Tracker | None = None):
        validate_params(settings.strategy, settings.params)  # an unknown strategy too
        kind = schedule_for(settings.mode)  # an unknown mode too
        self.settings = settings
        self.store = store
        self.tracker = tracker
        self.clock = clock
        self._cond = threading.Condition()
        self._version = 0
        self._rule = Rule(settings.min_clients, settings.wait_after_min_s, settings.heartbeat_timeout_s)
        policy = settings.selection.policy() if settings.selection.selective else None
        self.run = restore(settings, store, clock(), kind.open_uploads)
        metrics.serve_privacy(self.privacy)
        self.globals = GlobalAdapters(store)
        # How the closed round's uploads are released (secure aggregation's attempts, or as they are).
        self.release = release_for(settings)(settings, store, self.run, self.globals, self._cond, self._rule, clock,
                                             self._changed_locked, self._persist_locked, self._close_locked,
                                             new_nonce)
        self.secure: SecureDesk | None = self.release.secure
        self.schedule = kind(settings, store, self.run, self._rule, clock, self._changed_locked, self._persist_locked,
                             self.release)
        self.uploads = UploadDesk(settings, store, self.run, self._cond, clock, self._changed_locked, self.schedule,
                                  self.release.masked_bytes)
        self.schedule.uploads = self.uploads
        # At least two uploads close a secure round; min_clients close a plain one early.
        self.selector = RoundSelector(policy, settings, store, self.run, self._rule, clock, self._cond,
                                      self.release.minimum, self._began_locked)
        with self._cond:  # a secure round's keys and shares were only in memory: its stages start again
            self.release.resume_locked()
        self.reports = MetricsReports(store, self.run, tracker)
        self.reports.load()
        if self.run.state is State.OPEN and is_placeholder(self.run.selection):
            with self._cond:  # it stopped while the selector's model was choosing: choose again
                self.selector.select_locked(self.run.round, "the aggregator restarted while the selector was choosing")

    @property
    def policy(self) -> Policy | None:
        """The selector's policy (None in a run without selection)."""
        return self.selector.policy

    @policy.setter
    def policy(self, policy: Policy | None) -> None:
        self.selector.policy = policy

    @property
    def thinking(self) -> Thinking | None:
        """The selector's model choosing outside the lock (None for the other selectors)."""
        return self.selector.thinking

    # ---- queries -------------------------------------------------------------------------
    def joined(self, client_ids: Iterable[str]) -> set[str]:
        """Which of `client_ids` have joined the run."""
        with self._cond:
            return {c for c in client_ids if c in self.run.members}

    def status(self) -> Status:
        with self._cond:
            return self._status_locked()

    def _status_locked(self) -> Status:
        run = self.run
        # phi_round exists once the schema is fixed: phi_0 is written at the first join, and
        # phi_{t+1} before round t+1 opens.
        sha = self.globals.get(run.round)[1] if run.schema is not None else ""
        # While the selector's model chooses, clients see the round as not open yet, and wait for it.
        thinking = self.selector.choosing and run.state is State.OPEN
        return Status(
            run_id=self.settings.run_id, round=run.round, state=State.AGGREGATING if thinking else run.state,
            num_rounds=self.settings.num_rounds,
            joined=tuple(sorted(run.members)), uploaded=tuple(run.uploaded()), deadline_unix=run.deadline,
            global_sha256=sha, version=self._version, round_nonce=run.nonce,
            secure_stage=self.release.stage() if run.state is State.OPEN else None,
            selected=self.schedule.selected_locked(),
        )

    def privacy(self) -> tuple[float, float, int]:
        """(epsilon of one round, epsilon so far, releases) at the run's delta; the epsilons are +Inf where
        the run is not differentially private. Every completed round is one release. Read without the
        lock (for a scrape too): a list's length is read atomically."""
        releases = len(self.run.round_seconds)
        return (*(self.settings.dp_epsilons(releases) or (math.inf, math.inf)), releases)

    def wait_for_change(self, version: int, timeout: float) -> Status:
        """Blocks until the status version differs from `version` or the timeout passes."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout=timeout)
            return self._status_locked()

    def global_adapter(self, round_: int, transport: str = "") -> tuple[int, bytes | bytearray, str, str]:
        """(round, bytes, sha256, adapter_config_json) of phi_round in the transport dtype; -1 = latest."""
        wire = ad.transport_dtype(transport)
        if round_ < -1:
            raise ValueError(f"round {round_} is none: ask for a published round, or -1 for the newest")
        with self._cond:
            if self.run.schema is None:
                raise NotAvailable("no adapter yet: the first client to join fixes the run's adapter schema")
            latest = self.run.round if self.globals.has(self.run.round) else self.run.round - 1
            if round_ < 0:
                round_ = latest
            if round_ > latest or not self.globals.has(round_):
                raise NotAvailable(f"no global adapter for round {round_}: rounds 0..{latest} exist")
            data, sha = self.globals.get(round_, transport if wire is not None else "")
            return round_, data, sha, self.run.adapter_config()

    def run_view(self) -> tuple[Status, list[ClientView], list[float], str]:
        """The operator's view: status, each client's state, round durations and the base model."""
        with self._cond:
            now = self.clock()
            views = [ClientView(cid, m.client.env, m.accepted is not None, self._rule.alive(m.last_seen, now),
                                m.last_seen, m.phase_round, m.phase, self.uploads.partial_bytes(m), m.metrics_round,
                                dict(m.metrics), self.release.step_of(cid), *self.schedule.selected_view(cid),
                                m.lora_rank)
                     for cid, m in sorted(self.run.members.items())]
            return self._status_locked(), views, list(self.run.round_seconds), self.run.base_model or ""

    def selection(self) -> tuple[Selection | None, int]:
        """The open round's selection (None in a run without one, or once it finished) and the selector's
        fallbacks so far."""
        with self._cond:
            run = self.run
            return (run.selection if run.state is not State.FINISHED else None), run.selector_fallbacks

    def clients_alive(self) -> int:
        with self._cond:
            now = self.clock()
            return sum(self._rule.alive(m.last_seen, now) for m in self.run.members.values())

    # ---- commands -------------------------------------------------------------------------
    def seen(self, client_id: str, round_: int | None = None, phase: str | None = None) -> None:
        """Records a sign of life (any call from a joined client, or a heartbeat, which says its phase)."""
        with self._cond:
            m = self.run.member(client_id) if phase is not None else self.run.members.get(client_id)
            if m is None:
                return
            m.last_seen = self.clock()
            if phase is not None:
                m.phase = phase[:64]
                m.phase_round = int(round_ if round_ is not None else -1)

    def join(self, client_id: str, env: str, base_model: str, schema: ad.Schema) -> Status:
        if not CLIENT_ID.match(client_id):
            raise ValueError(f"client_id {shown(client_id)} is not valid: {CLIENT_ID_RULE}")
        schema.check(self.settings.max_adapter_bytes)
        self.release.check_schema(schema)
        lora_rank, lora_scaling = self._lora(client_id, schema)
        with self._cond:
            run = self.run
            if run.schema is None:
                top = self.settings.max_lora_rank
                first = ranks.run_schema(schema, top) if top else schema
                image = fresh(first, self.settings.seed)[0]  # before the run takes it: a failure leaves none
                run.schema, run.base_model = first, base_model
                try:
                    self.globals.save(0, image, run.adapter_config())
                except BaseException:
                    run.schema = run.base_model = None
                    raise
                log.info("run schema fixed", extra=log_fields(client=client_id, tensors=len(schema.tensors),
                                                                base_model=base_model, max_lora_rank=top or None))
            elif base_model != run.base_model:
                raise SchemaMismatch(f"this run federates base model {shown(run.base_model, 96)}, "
                                     f"client {client_id} has {shown(base_model)}")
            try:
                if self.settings.max_lora_rank:
                    ranks.check_fits(run.schema, schema, self.settings.max_lora_rank)
                else:
                    run.schema.check_compatible(schema)
            except ad.AdapterError as exc:
                raise SchemaMismatch(f"client {client_id}'s adapter does not fit the run: {exc}") from None
            client = Client(client_id, env, base_model)
            m = run.members.get(client_id)
            changed = m is None or m.client != client or (m.lora_rank, m.lora_scaling) != (lora_rank, lora_scaling)
            # An accepted upload is aggregated at the rank and scaling its client has when the round closes:
            # a rejoin may not change them before then (the upload was trained at the ones it had).
            if m is not None and m.accepted is not None and (m.lora_rank, m.lora_scaling) != (lora_rank, lora_scaling):
                raise SchemaMismatch(f"client {client_id} joined at LoRA rank {m.lora_rank}, scaling "
                                     f"{m.lora_scaling:g} (lora_alpha / r), and its upload of round {run.round} is "
                                     f"accepted at those, not rank {lora_rank}, scaling {lora_scaling:g}: rejoin with "
                                     f"--lora-r {m.lora_rank} and the --lora-alpha it had, or after the round closed")
            if m is None:
                m = run.members[client_id] = Member(client)
            m.client, m.last_seen = client, self.clock()
            m.lora_rank, m.lora_scaling = lora_rank, lora_scaling
            metrics.CLIENT_LORA_RANK.labels(client_id).set(lora_rank)
            if changed:
                log.info("client joined", extra=log_fields(client=client_id, env=env, joined=len(run.members)))
            if run.state is State.WAITING_FOR_CLIENTS and \
                    len(run.members) >= (self.settings.start_clients or self.settings.min_clients):
                self._open_locked(0)
            else:
                self.schedule.joined_locked()
                self._persist_locked()
            self._changed_locked()
            return self._status_locked()

    def _lora(self, client_id: str, schema: ad.Schema) -> tuple[int, float]:
        """The client's LoRA rank (0 where its factors do not say one) and scaling, which the mixed-rank
        strategies need its adapter_config.json to give; SchemaMismatch saying what to fix if not."""
        if not self.settings.max_lora_rank:
            return ranks.rank_or_zero(schema), 1.0
        try:
            return ranks.rank_of(schema), ranks.scaling(schema.adapter_config_json)
        except ad.AdapterError as exc:
            raise SchemaMismatch(f"client {client_id}'s adapter does not fit a run with --strategy "
                                 f"{self.settings.strategy}: {exc}") from None

    # ---- uploads (the desk receives them; an accepted one may close the round) -----------------
    def begin_upload(self, h: UploadHeader) -> tuple[bool, int, int]:
        return self.uploads.begin(h)

    def receive(self, h: UploadHeader, generation: int, offset: int, data: bytes) -> int:
        return self.uploads.receive(h, generation, offset, data)

    def end_stream(self, h: UploadHeader, generation: int) -> None:
        self.uploads.end(h, generation)

    def upload_state(self, client_id: str, round_: int, sha256: str) -> tuple[int, bool]:
        return self.uploads.state(client_id, round_, sha256)

    def finish_upload(self, h: UploadHeader, generation: int) -> Status:
        """Completes and stores the upload (UploadDesk.finish); the round closes if that made it due."""
        self.uploads.finish(h, generation)
        with self._cond:
            self.schedule.uploaded_locked(h.client_id)
            status = self._status_locked()
            due = self._due_locked() is not None
        if due:  # aggregate beside the acknowledgement, not before it
            threading.Thread(target=self.close_if_due, name="aggregate", daemon=True).start()
        return status

    def report_metrics(self, client_id: str, round_: int, values: dict[str, float]) -> None:
        """Records a client's metrics of a round: finite values of at most MAX_METRICS named metrics,
        for a round of the run that has opened (0..num_rounds; num_rounds is the final adapter's)."""
        check_report(values, round_, self.settings.num_rounds)
        with self._cond:
            m = self.run.member(client_id)
            if round_ > self.run.round:
                raise StaleRound(f"metrics for round {round_}, which has not opened (round {self.run.round} is "
                                 "the latest): report a round's metrics once it is open")
            m.last_seen = self.clock()
            if self.reports.record_locked(client_id, round_, values):
                self._changed_locked()

    def tick(self) -> None:
        """Closes the open round when due (called periodically; deadlines and liveness change with time)."""
        self.close_if_due()

    # ---- secure aggregation's stages (release.SecureRelease holds them) ------------------------------
    def secure_call(self, client_id: str, round_: int, nonce: str, call: Callable[[SecureDesk], T]) -> T:
        """Runs a stage call of the client on the current attempt (its round and nonce must be the
        attempt's); a call that makes a stage due closes it beside the answer."""
        with self._cond:
            desk = self.release.desk()  # StaleRound in a run without secure aggregation
            m = self.run.member(client_id)
            if self.run.state is not State.OPEN or round_ != self.run.round or nonce != self.run.nonce:
                raise StaleRound(f"a call for round {round_} with another round nonce: round {self.run.round} is "
                                 f"{self.run.state.value} with a new attempt; read RoundStatus and follow it")
            self.run.check_selected(client_id)
            m.last_seen = self.clock()
            out = call(desk)
            due = self._due_locked() is not None
        if due:
            threading.Thread(target=self.close_if_due, name="secure-stage", daemon=True).start()
        return out

    def _new_attempt_locked(self, reason: str) -> None:
        """A secure round's attempt is abandoned and a new one starts (SecureRelease.restart_locked)."""
        self.release.restart_locked(reason)

    # ---- closing a round ---------------------------------------------------------------------
    def _due_locked(self) -> str | None:
        if self.run.state is not State.OPEN:
            return None
        return self.schedule.due_locked(self.selector.choosing)

    def close_if_due(self) -> None:
        with self._cond:
            if self.selector.reselect_if_stalled_locked(self.uploads.receiving()):
                self.release.restart_locked("the round's clients were chosen again")
                self._persist_locked()
                self._changed_locked()
            self.schedule.tick_locked()
            if self.schedule.all_declined_locked():
                self._keep_locked(self.run.round, "every client declined the round")
                return
            reason = self._due_locked()
            if reason is None:
                return
            make = self.release.ready_locked(list(self.run.uploaded()))
            if make is None:
                return
            self.run.state = State.AGGREGATING
            self._changed_locked()
            round_ = self.run.round
            records = [(cid, m.accepted) for cid, m in self.schedule.folding_locked().items()]  # never None
        # Aggregating outside the lock: status, heartbeats and downloads go on meanwhile.
        started = time.perf_counter()
        image = make(round_, records, self._aggregate)
        if image is None:
            return
        took = time.perf_counter() - started
        metrics.AGGREGATE_SECONDS.observe(took)
        with self._cond:
            self._close_locked(round_, reason, len(records), took)

    def _aggregate(self, round_: int, records: Records) -> bytearray:
        """phi_{t+1}'s file image of uploads released as they are: folded with their staleness where the
        schedule says (FedBuff), else the strategy over them."""
        made = fold_image if self.schedule.folds(round_, records) else strategy_image
        return made(self.settings, self.store, self.run, round_, records)

    def _close_locked(self, round_: int, reason: str, uploads: int, took: float) -> None:
        """phi_{round+1} is saved: the round is over, the next one opens."""
        run = self.run
        folded = self.schedule.folding_locked()
        for cid, m in run.members.items():  # each member's record, which selectors read
            if cid in folded and m.accepted is not None:
                self.schedule.closed_member(round_, m)
                m.rounds_uploaded.append(round_)
                m.upload_seconds = (m.upload_seconds + [round(max(0.0, m.accepted.accepted_unix - run.opened_at),
                                                              3)])[-UPLOAD_TIMES:]
            elif run.selection is not None and cid in run.selection.chosen:
                m.dropouts += 1
        duration = self.clock() - self.run.opened_at
        self.run.round_seconds.append(round(duration, 3))
        metrics.ROUND_SECONDS.observe(duration)
        log.info("round closed", extra=log_fields(round=round_, uploads=uploads, reason=reason,
                                                  aggregate_s=round(took, 4), round_s=round(duration, 2)))
        if self.tracker is not None:
            self.tracker.round_closed(round_, uploads, duration, took)
        self._open_locked(round_ + 1)
        self._changed_locked()

    def _keep_locked(self, round_: int, why: str) -> None:
        """Closes the round without an update: phi_{t+1} is phi_t."""
        log.warning("round closed without an update", extra=log_fields(round=round_, reason=why))
        self.globals.save(round_ + 1, self.globals.get(round_)[0], self.run.adapter_config())
        self.release.ended_locked()
        self._close_locked(round_, why, 0, 0.0)

    # ---- internals -----------------------------------------------------------------------
    def _changed_locked(self) -> None:
        self._version += 1
        self._cond.notify_all()

    def _persist_locked(self) -> None:
        self.store.save_state(self.run.to_dict(self.settings))

    def _open_locked(self, round_: int) -> None:
        run = self.run
        run.round = round_
        self.schedule.reset_members_locked()
        run.opened_at = self.clock()
        if round_ >= self.settings.num_rounds:
            run.state, run.deadline, run.nonce = State.FINISHED, 0.0, ""
            for m in run.members.values():
                m.slot_since = None
            log.info("run finished", extra=log_fields(rounds=round_))
        else:
            run.state, run.deadline = State.OPEN, run.opened_at + self.settings.round_deadline_s
            run.nonce = run.nonce if self.schedule.keeps_nonce and run.nonce else new_nonce()
            log.info("round opened", extra=log_fields(round=round_, clients=len(run.members)))
        self.schedule.opened_locked()
        self.selector.opened_locked(round_)
        self.release.opened_locked()
        self._persist_locked()
        self._changed_locked()

    def _began_locked(self) -> None:
        """The selector's model answered: the open round's clock started, its secure attempt begins."""
        self.release.began_locked()
        self._persist_locked()
        self._changed_locked()

    # ---- what tests and tools reach (the schedule's and the selector's) -------------------------------
    def _buffer_locked(self) -> dict[str, Member]:
        """The members whose accepted upload the open round (or version's buffer) folds."""
        return self.schedule.folding_locked()

    def _select_locked(self, round_: int, why: str = "") -> None:
        """Chooses the open round's clients again (RoundSelector.select_locked)."""
        self.selector.select_locked(round_, why)
