"""The aggregator's round state machine: join, open, collect, close, aggregate, store, open next.

Pure Python and thread-safe; the servicer translates protobuf to calls here and maps the
exceptions of `errors` to gRPC status codes.

Round 0 opens once `start_clients` (0: `min_clients`) clients have joined. A round t starts from
the global adapter phi_t and closes as `closing` says; then phi_{t+1} = strategy(uploads of round
t). A client that missed a round catches up at the next one.

The round keeper holds the run's persisted state (`state.RunState`), the global adapters
(`global_adapters`) and the upload desk (`desk`), all under one lock. Everything an
acknowledgement depends on is in the Store before the call returns, so a restarted aggregator
resumes the same run at the same round with every acknowledged upload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import secrets
import threading
import time
from typing import Callable, Iterable, TypeVar

from fedse import adapter as ad
from fedse import ranks, secagg
from fedse.inputs import CLIENT_ID, CLIENT_ID_RULE, bounded, shown
from fedse.serving import log_fields

from . import metrics
from .adapter_files import AdapterFile, allocate, fresh
from .attempt import Attempt, Stage, mask_keys
from .buffer_rules import OpenBuffer, buffer_size, fold_reason, slot_expired
from .closing import OpenRound, Rule, close_reason
from .desk import UploadDesk
from .errors import NotAvailable, SchemaMismatch, StaleRound
from .global_adapters import GlobalAdapters
from .secure import SecureDesk
from .selection import All, ClientHistory, Selection, SelectionInput, top_up
from .selecting import Pending, Thinking, is_placeholder, model_agent, placeholder
from .state import UPLOAD_TIMES, Client, Member, RunSettings, State, buffered, restore
from .store import Store
from .tracking import Tracker
from .strategies import Update, aggregate, fedbuff, validate_params
from .uploads import Accepted, UploadHeader

log = logging.getLogger("aggregator.rounds")

MAX_METRICS = 256  # named values in one metrics report
MAX_METRIC_NAME_BYTES = 256  # a metric name in UTF-8 (every client's metrics are in GetRunStatus's reply)
T = TypeVar("T")


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


DECLINED = "declined"  # the heartbeat phase of a client that takes no part in the open round


class RoundKeeper:
    """The aggregator's run: who joined, the open round and its uploads, liveness, aggregation and
    what is persisted. Thread-safe; the servicer translates gRPC to its calls."""

    def __init__(self, settings: RunSettings, store: Store, clock: Callable[[], float] = time.time,
                 tracker: Tracker | None = None):
        validate_params(settings.strategy, settings.params)  # an unknown strategy too
        self.settings = settings
        self.store = store
        self.tracker = tracker
        self.clock = clock
        self._cond = threading.Condition()
        self._version = 0
        self._rule = Rule(settings.min_clients, settings.wait_after_min_s, settings.heartbeat_timeout_s)
        self._layout: secagg.Layout | None = None
        self.policy = settings.selection.policy() if settings.selection.selective else None
        # A selector that asks a model chooses outside the lock (selecting.Thinking); None for the others.
        self.thinking = Thinking(self._choose, self._chosen) if model_agent(self.policy) is not None else None
        self.run = restore(settings, store, clock())
        # At least two uploads close a secure round; min_clients close a plain one early.
        self._minimum = max(2, settings.min_clients) if settings.secure else settings.min_clients
        metrics.serve_privacy(self.privacy)
        self.globals = GlobalAdapters(store)
        # A secure round needs two uploads or more: the mean of one is that client's adapter.
        self.secure = SecureDesk(settings.run_id, settings.secure_threshold, settings.secure_stage_timeout_s,
                                 dataclasses.replace(self._rule, min_clients=max(2, settings.min_clients)),
                                 self._changed_locked, settings.secure_neighbours, settings.secure_ca,
                                 settings.secure_max_roster,
                                 (lambda cid: self.run.members[cid].lora_rank) if settings.max_lora_rank else None
                                 ) if settings.secure else None
        self.uploads = UploadDesk(settings, store, self.run, self._cond, clock, self._changed_locked, self.secure,
                                  (lambda: self.layout().nbytes) if settings.secure else None)
        if self.secure is not None and self.run.state is State.OPEN:
            with self._cond:  # keys and shares were only in memory: the round's secure stages start again
                if self.run.released == self.run.round and self.globals.has(self.run.round + 1):
                    # It stopped after saving the unmasked mean, before the next round opened: publish it.
                    self.secure.end()
                    self._close_locked(self.run.round, "the unmasked mean was saved before a restart", 0, 0.0)
                elif self.run.released == self.run.round:
                    # It stopped while unmasking: a new attempt would give a second sum of this round.
                    self._withhold_locked(self.run.round, "the aggregator restarted while unmasking the round")
                else:
                    self._new_attempt_locked("the aggregator restarted")
        # Every (client, round) reported: a round's metrics are recorded once, so a client that
        # repeats a report after a crash does not count twice.
        self._reported: set[tuple[str, int]] = set()
        for cid, r, m in store.metrics_reports():
            self._note_report_locked(cid, r, m)
        if self.run.state is State.OPEN and is_placeholder(self.run.selection):
            with self._cond:  # it stopped while the selector's model was choosing: choose again
                self._select_locked(self.run.round, "the aggregator restarted while the selector was choosing")

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
        thinking = self.thinking is not None and self.thinking.pending is not None and run.state is State.OPEN
        return Status(
            run_id=self.settings.run_id, round=run.round, state=State.AGGREGATING if thinking else run.state,
            num_rounds=self.settings.num_rounds,
            joined=tuple(sorted(run.members)), uploaded=tuple(run.uploaded()), deadline_unix=run.deadline,
            global_sha256=sha, version=self._version, round_nonce=run.nonce,
            secure_stage=self.secure.stage() if self.secure is not None and run.state is State.OPEN else None,
            selected=self._selected_locked(),
        )

    def _selected_locked(self) -> tuple[str, ...] | None:
        """Who takes part now: the chosen clients of a selective round, the slot holders of asynchronous
        rounds, None where every client does."""
        run = self.run
        if run.state is State.FINISHED:
            return None
        if self.settings.asynchronous:
            return tuple(sorted(cid for cid, m in run.members.items() if m.slot_since is not None))
        return run.selection.chosen if run.selection is not None else None

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
                                dict(m.metrics), self.secure.step_of(cid) if self.secure is not None else "",
                                *self._selected_view(cid), m.lora_rank)
                     for cid, m in sorted(self.run.members.items())]
            return self._status_locked(), views, list(self.run.round_seconds), self.run.base_model or ""

    def selection(self) -> tuple[Selection | None, int]:
        """The open round's selection (None in a run without one, or once it finished) and the selector's
        fallbacks so far."""
        with self._cond:
            run = self.run
            return (run.selection if run.state is not State.FINISHED else None), run.selector_fallbacks

    def _selected_view(self, client_id: str) -> tuple[bool, str]:
        run = self.run
        if run.state is State.FINISHED:
            return True, ""
        if self.settings.asynchronous:
            m = run.members[client_id]
            if m.slot_since is not None:
                return True, f"training from version {m.slot_version}"
            if m.accepted is not None:
                return False, f"its update from version {m.accepted.base} waits in the buffer"
            if m.phase == DECLINED:
                return False, "declines: its privacy budget is spent"
            if m.slot_lost == run.round:
                return False, "its slot was taken back (it stopped answering, or did not upload by its deadline)"
            return False, (f"trained from version {m.slot_version}; waits for the next" if m.slot_version >= run.round
                           else "waits for a free training slot")
        return run.selected(client_id), run.selection_reason(client_id)

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
        if self.settings.secure:
            secagg.Layout.of(schema, self.settings.strategy)  # a schema a masked vector can carry
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
                if self.settings.asynchronous:
                    self._grant_locked()  # a slot may be free for it
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
            if self.settings.asynchronous:
                m = self.run.members[h.client_id]
                if m.slot_since is not None:
                    m.slot_since = None  # its slot goes to a client waiting
                    self._grant_locked()
                    self._persist_locked()
                metrics.BUFFER_FILL.set(len(self._buffer_locked()))
            status = self._status_locked()
            due = self._due_locked() is not None
        if due:  # aggregate beside the acknowledgement, not before it
            threading.Thread(target=self.close_if_due, name="aggregate", daemon=True).start()
        return status

    def report_metrics(self, client_id: str, round_: int, values: dict[str, float]) -> None:
        """Records a client's metrics of a round: finite values of at most MAX_METRICS named metrics,
        for a round of the run that has opened (0..num_rounds; num_rounds is the final adapter's)."""
        if len(values) > MAX_METRICS:
            raise ValueError(f"{len(values)} metrics in one report, more than the limit of {MAX_METRICS}")
        for name, value in values.items():
            size = len(bounded("metric name", name).encode())
            if size > MAX_METRIC_NAME_BYTES:
                raise ValueError(f"metric name {shown(name)} is {size} bytes in UTF-8: give at most "
                                 f"{MAX_METRIC_NAME_BYTES}")
            if not math.isfinite(value):
                raise ValueError(f"metric {shown(name)} is {value}: report finite values only (leave out a metric "
                                 "that has no value)")
        if not 0 <= round_ <= self.settings.num_rounds:
            raise ValueError(f"metrics for round {round_}: this run's rounds are 0..{self.settings.num_rounds} "
                             f"(round {self.settings.num_rounds} evaluates the final adapter)")
        with self._cond:
            m = self.run.member(client_id)
            if round_ > self.run.round:
                raise StaleRound(f"metrics for round {round_}, which has not opened (round {self.run.round} is "
                                 "the latest): report a round's metrics once it is open")
            m.last_seen = self.clock()
            if (client_id, round_) in self._reported:
                log.info("repeated metrics report acknowledged, not recorded again",
                         extra=log_fields(client_id=client_id, round=round_))
                return
            self.store.append_metrics(client_id, round_, values)
            self._note_report_locked(client_id, round_, values)
            if self.tracker is not None:
                self.tracker.report(client_id, round_, values, len(self.run.members))
            self._changed_locked()

    def _note_report_locked(self, client_id: str, round_: int, values: dict[str, float]) -> None:
        self._reported.add((client_id, round_))
        m = self.run.members.get(client_id)
        if m is not None and round_ >= m.metrics_round:
            # The gain is measured from the latest report of a round it took part in (see _history_locked).
            if round_ > m.metrics_round and "test_success" in m.metrics and m.metrics_round in m.rounds_uploaded:
                m.previous_success = m.metrics["test_success"]
            m.metrics_round, m.metrics = round_, dict(values)

    def tick(self) -> None:
        """Closes the open round when due (called periodically; deadlines and liveness change with time)."""
        self.close_if_due()

    # ---- secure aggregation's stages (secure.SecureDesk holds them) ---------------------------------
    def layout(self) -> secagg.Layout:
        """The masked vector's layout (the run's schema must be fixed)."""
        assert self.run.schema is not None
        if self._layout is None:
            self._layout = secagg.Layout.of(self.run.schema, self.settings.strategy)
        return self._layout

    def secure_call(self, client_id: str, round_: int, nonce: str, call: Callable[[SecureDesk], T]) -> T:
        """Runs a stage call of the client on the current attempt (its round and nonce must be the
        attempt's); a call that makes a stage due closes it beside the answer."""
        with self._cond:
            if self.secure is None:
                raise StaleRound("this run does not use secure aggregation: upload the adapter itself")
            m = self.run.member(client_id)
            if self.run.state is not State.OPEN or round_ != self.run.round or nonce != self.run.nonce:
                raise StaleRound(f"a call for round {round_} with another round nonce: round {self.run.round} is "
                                 f"{self.run.state.value} with a new attempt; read RoundStatus and follow it")
            self.run.check_selected(client_id)
            m.last_seen = self.clock()
            out = call(self.secure)
            due = self._due_locked() is not None
        if due:
            threading.Thread(target=self.close_if_due, name="secure-stage", daemon=True).start()
        return out

    def _new_attempt_locked(self, reason: str) -> None:
        """Abandons the attempt of the open round (nothing of it is published; its masked uploads are
        deleted) and starts a new one, at key advertisement with a new round nonce."""
        assert self.secure is not None
        run = self.run
        log.warning("secure attempt abandoned: the round starts again at key advertisement",
                    extra=log_fields(round=run.round, reason=reason))
        for m in run.members.values():
            m.new_round()
        self.store.drop_uploads(run.round)
        run.state, run.nonce = State.OPEN, secrets.token_hex(16)
        self._persist_locked()
        self.secure.begin(run.round, run.nonce, self.clock())

    # ---- closing a round ---------------------------------------------------------------------
    def _due_locked(self) -> str | None:
        run = self.run
        if run.state is not State.OPEN:
            return None
        if self.settings.asynchronous:
            return self._fold_due_locked()
        if self.thinking is not None and self.thinking.pending is not None:
            return None  # the selector's model is choosing: the round has not begun for anyone
        now = self.clock()
        accepted = {cid: m.accepted.accepted_unix for cid, m in run.uploaded().items()}
        # A selective round is over its chosen clients alone: the others take no part in it; nor does a
        # client whose heartbeat declines the open round (its guardian's privacy budget is spent).
        last_seen = {cid: m.last_seen for cid, m in run.members.items()
                     if run.selected(cid) and not (m.phase == DECLINED and m.phase_round == run.round)}
        rule = self._rule
        if run.selection is not None:  # fewer chosen than min_clients: every one of them alive
            rule = dataclasses.replace(rule, min_clients=max(1, min(rule.min_clients, len(run.selection.chosen))))
        if self.secure is not None:
            busy = self.uploads.receiving() and now - self.uploads.progress_at <= self._rule.heartbeat_timeout_s
            return self.secure.due(last_seen, accepted, busy, run.deadline, now)
        return close_reason(rule, OpenRound(last_seen=last_seen, accepted=accepted,
                                                  receiving=self.uploads.receiving(),
                                                  progress_at=self.uploads.progress_at, deadline=run.deadline), now)

    def close_if_due(self) -> None:
        with self._cond:
            self._reselect_if_stalled_locked()
            if self.settings.asynchronous:
                self._grant_locked()
            if self._all_declined_locked():
                self._keep_locked(self.run.round, "every client declined the round")
                return
            reason = self._due_locked()
            if reason is None:
                return
            unmasking = None
            if self.secure is not None:
                stage = self.secure.stage()
                failed = self.secure.advance(list(self.run.uploaded()), self.clock())
                if failed is not None:
                    self._new_attempt_locked(failed)
                    return
                if stage is not Stage.UNMASKING:
                    return
                unmasking = self.secure.unmasking()
            self.run.state = State.AGGREGATING
            self._changed_locked()
            round_ = self.run.round
            records = [(cid, m.accepted) for cid, m in self._buffer_locked().items()] if self.settings.asynchronous \
                else [(cid, m.accepted) for cid, m in self.run.uploaded().items()]  # accepted: never None
        # Aggregating outside the lock: status, heartbeats and downloads go on meanwhile.
        started = time.perf_counter()
        if unmasking is not None:
            image = self._unmask_once(round_, unmasking)
            if image is None:
                return
        else:
            try:
                # A buffer of updates all trained from this version is a synchronous round's: the strategy.
                stale = [a.base for _, a in records if a.base not in (-1, round_)]
                folds = stale or (self.settings.asynchronous and self.settings.async_server_lr != 1.0)
                image = self._fold(round_, records) if folds else self._aggregate(round_, records)
                self.globals.save(round_ + 1, image, self.run.adapter_config())
            except Exception:  # noqa: BLE001 - a failed aggregation must not end the run
                with self._cond:
                    log.exception("aggregation failed; the round stays open", extra=log_fields(round=round_))
                    self.run.state = State.OPEN
                    self._changed_locked()
                return
        took = time.perf_counter() - started
        metrics.AGGREGATE_SECONDS.observe(took)
        with self._cond:
            self._close_locked(round_, reason, len(records), took)

    def _close_locked(self, round_: int, reason: str, uploads: int, took: float) -> None:
        """phi_{round+1} is saved: the round is over, the next one opens."""
        run = self.run
        folded = self._buffer_locked() if self.settings.asynchronous else run.uploaded()
        for cid, m in run.members.items():  # each member's record, which selectors read
            if cid in folded and m.accepted is not None:
                if self.settings.asynchronous:
                    metrics.ASYNC_STALENESS.observe(round_ - m.accepted.base)
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

    def _unmask_once(self, round_: int, u: Attempt) -> bytearray | None:
        """phi_{t+1}'s image from the attempt's masked uploads, saved; None where the round goes on
        otherwise. A failure before any mask is removed (a rebuilt seed that is not its owner's) starts a
        new attempt; from the moment the sum is unmasked the round is released and never tried again:
        a sum that does not decode closes it with phi_t unchanged."""
        try:
            keys = mask_keys(u)
        except Exception as exc:  # noqa: BLE001 - a bad share must not end the run
            with self._cond:
                self._new_attempt_locked(f"unmasking failed: {exc}")
                self._changed_locked()
            return None
        with self._cond:
            self.run.released = round_
            self._persist_locked()
        try:
            image = self._unmask(round_, u, keys)
            self.globals.save(round_ + 1, image, self.run.adapter_config())
        except Exception as exc:  # noqa: BLE001 - the round is released either way
            with self._cond:
                self._withhold_locked(round_, f"its unmasked sum cannot be used: {exc}")
            return None
        self.store.drop_uploads(round_)  # masked under keys that are gone: of no use to anyone
        return image

    def _all_declined_locked(self) -> bool:
        """A synchronous round with no upload that every alive client taking part declined (its heartbeat
        says "declined" for it; their guardians' privacy budgets are spent): nothing will come."""
        run = self.run
        if run.state is not State.OPEN or self.settings.asynchronous or run.uploaded():
            return False
        now = self.clock()
        alive = [m for cid, m in run.members.items() if run.selected(cid) and self._rule.alive(m.last_seen, now)]
        return bool(alive) and all(m.phase == DECLINED and m.phase_round == run.round for m in alive)

    def _keep_locked(self, round_: int, why: str) -> None:
        """Closes the round without an update: phi_{t+1} is phi_t."""
        log.warning("round closed without an update", extra=log_fields(round=round_, reason=why))
        self.globals.save(round_ + 1, self.globals.get(round_)[0], self.run.adapter_config())
        if self.secure is not None:
            self.secure.end()
        self._close_locked(round_, why, 0, 0.0)

    def _withhold_locked(self, round_: int, why: str) -> None:
        """Closes a secure round whose sum was (or may have been) unmasked without an update: phi_{t+1} is
        phi_t. Another attempt would give a second sum of the round over other clients."""
        log.error("secure round closed without an update: its sum is released once and not retried",
                  extra=log_fields(round=round_, reason=why))
        metrics.SECURE_ROUNDS_WITHHELD.inc()
        self.globals.save(round_ + 1, self.globals.get(round_)[0], self.run.adapter_config())
        self.store.drop_uploads(round_)
        if self.secure is not None:
            self.secure.end()
        self._close_locked(round_, "withheld: " + why, 0, 0.0)

    def _fold(self, version: int, records: list[tuple[str, Accepted]]) -> bytearray:
        """phi_{version+1}'s file image: the buffer's updates, each weighted by its staleness (FedBuff)."""
        assert self.run.schema is not None
        image, views = allocate(self.run.schema)
        updates = [(AdapterFile(self.store.upload_path(a.base, cid)), AdapterFile(self.store.global_path(a.base)),
                    version - a.base) for cid, a in records]
        fedbuff(AdapterFile(self.store.global_path(version)), updates, out=views, lr=self.settings.async_server_lr)
        return image

    def _aggregate(self, round_: int, records: list[tuple[str, Accepted]]) -> bytearray:
        """phi_{t+1}'s file image: the strategy over the round's accepted uploads."""
        updates = [Update(cid, AdapterFile(self.store.upload_path(round_, cid)), a.num_examples, a.num_successes,
                          self.run.members[cid].lora_scaling) for cid, a in records]
        assert self.run.schema is not None
        image, views = allocate(self.run.schema)  # phi_{t+1} is aggregated into its file image
        aggregate(self.settings.strategy, updates, AdapterFile(self.store.global_path(round_)),
                  self.settings.params, round_, out=views, out_scaling=ranks.RUN_SCALING)
        return image

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

    # ---- internals -----------------------------------------------------------------------
    def _changed_locked(self) -> None:
        self._version += 1
        self._cond.notify_all()

    def _persist_locked(self) -> None:
        self.store.save_state(self.run.to_dict(self.settings))

    def _open_locked(self, round_: int) -> None:
        run = self.run
        run.round = round_
        for m in run.members.values():
            if self.settings.asynchronous:
                m.accepted = None  # folded; a stream under way goes on into the next buffer
            else:
                m.new_round()
        run.opened_at = self.clock()
        if round_ >= self.settings.num_rounds:
            run.state, run.deadline, run.nonce = State.FINISHED, 0.0, ""
            for m in run.members.values():
                m.slot_since = None
            log.info("run finished", extra=log_fields(rounds=round_))
        else:
            run.state, run.deadline = State.OPEN, run.opened_at + self.settings.round_deadline_s
            # Asynchronous rounds keep the run's nonce: an upload may come from an earlier version.
            run.nonce = run.nonce if self.settings.asynchronous and run.nonce else secrets.token_hex(16)
            log.info("round opened", extra=log_fields(round=round_, clients=len(run.members)))
        if self.settings.asynchronous and run.state is State.OPEN:
            for cid, accepted in buffered(self.settings, self.store, round_).items():
                run.members[cid].accepted = accepted  # accepted while the previous buffer was folded
            self._grant_locked()
            metrics.BUFFER_FILL.set(len(self._buffer_locked()))
        run.selection = None
        if self.policy is not None and run.state is State.OPEN:
            self._select_locked(round_)
        if self.secure is not None:
            if run.state is State.OPEN:
                self.secure.begin(run.round, run.nonce, run.opened_at)
            else:
                self.secure.end()
        self._persist_locked()
        self._changed_locked()

    # ---- asynchronous rounds (settings.mode "async": FedBuff) ------------------------------------------
    def _buffer_locked(self) -> dict[str, Member]:
        """The members whose upload waits in the open version's buffer."""
        return {cid: m for cid, m in sorted(self.run.members.items())
                if m.accepted is not None and m.accepted.collected == self.run.round}

    def _fold_due_locked(self) -> str | None:
        """Why the open version's buffer folds now (buffer_rules.fold_reason), or None."""
        run, now = self.run, self.clock()
        training = any(m.slot_since is not None and self._rule.alive(m.last_seen, now) for m in run.members.values())
        uploading = self.uploads.receiving() and now - self.uploads.progress_at <= self._rule.heartbeat_timeout_s
        return fold_reason(self._rule, OpenBuffer(
            len(self._buffer_locked()), buffer_size(self.settings, len(run.members)), training,
            bool(self._eligible_locked(now)), uploading, run.deadline), now)

    def _eligible_locked(self, now: float) -> list[Member]:
        """Alive clients that may be given a slot: none held, nothing in the buffer, not yet trained
        from the open version, and not declining (its guardian's privacy budget is spent); the longest
        without a slot first. One that lost its slot at this version without uploading comes last."""
        run = self.run
        return sorted((m for m in run.members.values() if m.slot_since is None and m.accepted is None
                       and (m.slot_version < run.round or m.slot_lost == run.round)
                       and self._rule.alive(m.last_seen, now)
                       and m.phase != DECLINED),
                      key=lambda m: (m.slot_lost == run.round, m.slot_version, m.client.client_id))

    def _grant_locked(self) -> None:
        """Frees the slots of clients that died or decline (their heartbeat says "declined": a declined
        client trains no more, and its slot would keep the buffer from folding) or held theirs past the
        deadline without an upload (buffer_rules.slot_expired: alive and silent, it would hold the run),
        and gives the free slots (async_concurrency; every joined client when 0) to eligible clients."""
        run, now = self.run, self.clock()
        if run.state is not State.OPEN:
            return
        freed = False
        for m in run.members.values():
            dead = not self._rule.alive(m.last_seen, now)
            uploading = m.stream is not None and now - self.uploads.progress_at <= self._rule.heartbeat_timeout_s
            if slot_expired(m, now, self.settings.round_deadline_s, uploading) and not dead and m.phase != DECLINED:
                # Alive, and no upload by its deadline: another client trains in its place (it goes last).
                log.warning("training slot taken back at its deadline", extra=log_fields(
                    client=m.client.client_id, version=run.round, held_s=round(now - (m.slot_since or now), 1)))
                m.slot_since, m.slot_lost, freed = None, run.round, True
                m.dropouts += 1
            if m.slot_since is not None and (dead or m.phase == DECLINED):
                m.slot_since, m.slot_lost, freed = None, run.round, True
                m.dropouts += int(dead)
        held = sum(m.slot_since is not None for m in run.members.values())
        free = (self.settings.async_concurrency or len(run.members)) - held
        granted = self._eligible_locked(now)[:max(0, free)]
        for m in granted:
            m.slot_since = now
            if m.slot_lost != run.round:  # else it lost one at this version without uploading: it goes on
                m.slot_version = run.round
                m.rounds_selected.append(run.round)
        if granted or freed:
            self._changed_locked()
        metrics.SELECTED.set(held + len(granted))

    # ---- selection (settings.selection: who takes part in a round) -----------------------------------
    def _history_locked(self, now: float) -> list[ClientHistory]:
        """Each member's record as a selector reads it. What a client reported counts only for a round it
        took part in (chosen, where rounds are chosen, and its upload accepted): a client cannot steer
        selection with reports of rounds it sat out (ClientHistory range-checks the values)."""
        out = []
        for cid, m in self.run.members.items():
            reported = m.metrics if m.metrics_round in m.rounds_uploaded else {}
            success = reported.get("test_success")
            durations = [d for d in m.upload_seconds if d > 0]
            out.append(ClientHistory(
                cid, alive=self._rule.alive(m.last_seen, now), heartbeat_age_s=max(0.0, now - m.last_seen),
                rounds_selected=tuple(m.rounds_selected), rounds_uploaded=tuple(m.rounds_uploaded),
                last_success=success,
                success_gain=None if success is None or m.previous_success is None else success - m.previous_success,
                last_loss=reported.get("train_loss"),
                mean_round_s=sum(durations) / len(durations) if durations else None, dropouts=m.dropouts,
                buffer_size=int(reported["buffer"]) if math.isfinite(reported.get("buffer", math.nan)) else None))
        return out

    def _select_locked(self, round_: int, why: str = "") -> None:
        """Chooses who takes part in the open round (the policy's answer; every alive client where the
        policy fails, counted as a fallback) and records it: the run state, each member's record, the
        selections log and the metrics."""
        assert self.policy is not None
        run, now = self.run, self.clock()
        inp = SelectionInput(self.settings.run_id, round_, self.settings.seed, tuple(self._history_locked(now)),
                             minimum=self._minimum, memory=run.selector_memory, base_model=run.base_model or "")
        if self.thinking is not None:  # outside the lock: nobody is chosen until the model answered
            self.thinking.begin(inp, run.nonce, why)
            run.selection = placeholder(inp, self.policy.name)
            return
        self._record_locked(self._choose(inp), why)

    def _choose(self, inp: SelectionInput) -> Selection:
        """The policy's selection for `inp`; every alive client where the policy fails (a fallback)."""
        assert self.policy is not None
        try:
            return self.policy.select(inp)
        except Exception as exc:  # noqa: BLE001 - a selector that fails must not stop the run
            log.exception("the selector failed; every alive client takes part", extra=log_fields(round=inp.round))
            return dataclasses.replace(All().select(inp), fallback_reason=f"the selector failed: {exc}")

    def _chosen(self, pending: Pending, sel: Selection) -> None:
        """The selector's answer, chosen outside the lock: recorded if its round is still the open one (the
        round's clock starts then), else discarded."""
        with self._cond:
            run = self.run
            if not self.thinking or not self.thinking.current(pending, run.round, run.nonce, run.state is State.OPEN):
                log.info("the selector's answer came for a round that moved on; discarded",
                         extra=log_fields(round=pending.inp.round))
                return
            self.thinking.pending = None
            self._record_locked(sel, pending.why)
            run.opened_at, run.deadline = self.clock(), self.clock() + self.settings.round_deadline_s
            if self.secure is not None:
                self.secure.begin(run.round, run.nonce, run.opened_at)
            self._persist_locked()
            self._changed_locked()

    def _record_locked(self, sel: Selection, why: str) -> None:
        """Makes `sel` the open round's selection: the fallback count, the agent's memory, each member's
        record, the selections log, the metrics."""
        run, round_ = self.run, sel.round
        if sel.fallback_reason:
            run.selector_fallbacks += 1
            metrics.SELECTOR_FALLBACKS.inc()
        if why:
            sel = dataclasses.replace(sel, reasoning=(f"chosen again: {why}", *sel.reasoning))
        run.selection, run.selector_memory = sel, dict(sel.memory)
        for cid in sel.chosen:
            m = run.members[cid]
            if not m.rounds_selected or m.rounds_selected[-1] != round_:
                m.rounds_selected.append(round_)
        self.store.append_selection(sel.to_dict())
        metrics.SELECTED.set(len(sel.chosen))
        log.info("round selection", extra=log_fields(round=round_, policy=sel.policy, chosen=list(sel.chosen),
                                                     of=len(run.members), fallback=sel.fallback_reason or None))

    def _reselect_if_stalled_locked(self) -> None:
        """Chosen clients that died (heartbeat timed out) before uploading: every one of them, with no
        upload yet, and the policy chooses again; else each is replaced by an alive client not chosen
        (selection.top_up), the uploads already accepted kept. A dead chosen client would otherwise hold
        the round to its deadline, or for ever short of min_clients. A secure round starts a new attempt."""
        run, now = self.run, self.clock()
        if run.selection is None or run.state is not State.OPEN or self.uploads.receiving():
            return
        uploaded = run.uploaded()
        gone = {cid for cid in run.selection.chosen
                if cid not in uploaded and not self._rule.alive(run.members[cid].last_seen, now)}
        if not gone or not any(self._rule.alive(m.last_seen, now) for m in run.members.values()):
            return  # nobody gone, or nobody to choose
        if uploaded or gone != set(run.selection.chosen):
            inp = SelectionInput(self.settings.run_id, run.round, self.settings.seed,
                                 tuple(self._history_locked(now)), minimum=self._minimum)
            sel = top_up(run.selection, inp, gone)
            if sel is run.selection:
                return  # no alive client to take their places: they may come back
            gone -= set(sel.chosen)
            run.selection = sel
            for cid in sel.chosen:  # the clients topped up are chosen for this round too
                if run.round not in run.members[cid].rounds_selected:
                    run.members[cid].rounds_selected.append(run.round)
            self.store.append_selection(sel.to_dict())
            metrics.SELECTED.set(len(sel.chosen))
            log.info("round topped up", extra=log_fields(round=run.round, replaced=sorted(gone),
                                                         chosen=list(sel.chosen)))
        else:
            self._select_locked(run.round, "no chosen client was alive")
        for cid in gone:  # chosen, and gone without an upload
            run.members[cid].dropouts += 1
        if self.secure is not None:
            self._new_attempt_locked("the round's clients were chosen again")
        self._persist_locked()
        self._changed_locked()
