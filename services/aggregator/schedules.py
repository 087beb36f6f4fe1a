"""A run's round schedule, chosen by `RunSettings.mode` (`schedule_for`): synchronous rounds ("sync",
`SyncRounds`) or asynchronous buffered ones ("async", `FedBuff`). The round keeper runs the run and
asks its schedule everything that differs between the two: who takes part now, what a join and a
finished upload change, when the open round (or version's buffer) is due, which uploads it folds and
how, what closing it does to each member and what opening the next does to the members.

Synchronous rounds: every client (or the selector's choice) trains from phi_t, and the round closes as
`closing` says (through the run's release: `release`), unless every client taking part declined it.
FedBuff: `round` counts global versions; clients train in slots (at most async_concurrency at once)
from whatever version is newest, and a buffer folds as `buffer_rules` says, each update weighted by
its staleness (Nguyen et al. 2022).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from fedse.transport.serving import log_fields

from . import metrics
from .buffer_rules import OpenBuffer, buffer_size, check_upload, fold_reason, slot_expired
from .closing import OpenRound, Rule
from .errors import DuplicateUpload, StaleRound
from .release import Records, Release
from .state import Member, RunSettings, RunState, State
from .store import Store
from .uploads import Accepted

if TYPE_CHECKING:
    from .desk import UploadDesk

log = logging.getLogger("aggregator.rounds")

DECLINED = "declined"  # the heartbeat phase of a client that takes no part in the open round


class Schedule(abc.ABC):
    """The mode-specific part of the round keeper's run, under the keeper's lock. The keeper hands it
    the upload desk (`uploads`, which asks it about uploads) once that desk exists."""

    name: ClassVar[str]
    keeps_nonce: ClassVar[bool] = False  # whether a round that opens keeps the run's round nonce
    uploads: UploadDesk

    @staticmethod
    def check_settings(cfg: Any) -> None:
        """Refuses the aggregator's settings (server.AggregatorConfig) that this schedule cannot run
        with: ValueError saying which to change."""

    def __init__(self, settings: RunSettings, store: Store, run: RunState, rule: Rule, clock: Callable[[], float],
                 changed: Callable[[], None], persist: Callable[[], None], release: Release):
        self.settings, self.store, self.run, self._rule, self.clock = settings, store, run, rule, clock
        self._changed, self._persist, self.release = changed, persist, release

    @property
    def max_staleness(self) -> int:
        """How many versions behind an upload may be trained (0: it trains from the open round)."""
        return 0

    # ---- who takes part ----------------------------------------------------------------------
    def selected_locked(self) -> tuple[str, ...] | None:
        """Who takes part now (RoundStatus.selected); None where every client does, or the run finished."""
        return None if self.run.state is State.FINISHED else self._taking_part()

    def selected_view(self, client_id: str) -> tuple[bool, str]:
        """(takes part now, why) for a client (ClientStatus.selected and selection_reason)."""
        return (True, "") if self.run.state is State.FINISHED else self._part_of(client_id)

    @abc.abstractmethod
    def _taking_part(self) -> tuple[str, ...] | None: ...

    @abc.abstractmethod
    def _part_of(self, client_id: str) -> tuple[bool, str]: ...

    # ---- uploads -----------------------------------------------------------------------------
    @staticmethod
    @abc.abstractmethod
    def open_uploads(settings: RunSettings, store: Store, round_: int) -> dict[str, Accepted]:
        """The accepted uploads of the open round `round_` on disk, by client id (a restart reads them)."""

    @abc.abstractmethod
    def check_upload(self, client_id: str, round_: int, nonce: str) -> None:
        """Raises, saying what to do, unless an upload of the client for `round_` with `nonce` may land
        now (the run is open or aggregating, and the client joined)."""

    def collecting(self) -> int:
        """Where an upload accepted now is collected (Accepted.collected; -1: a synchronous round's)."""
        return -1

    def holds(self, round_: int) -> bool:
        """Whether an upload for `round_` may be held in the open round (GetUploadState)."""
        return round_ == self.run.round

    def joined_locked(self) -> None:
        """A client joined (or joined again) while the run was not waiting for round 0."""

    def uploaded_locked(self, client_id: str) -> None:
        """The client's upload was accepted (or acknowledged again)."""

    def tick_locked(self) -> None:
        """Before the keeper looks whether the open round is due."""

    # ---- closing -----------------------------------------------------------------------------
    @abc.abstractmethod
    def due_locked(self, choosing: bool) -> str | None:
        """Why the open round or buffer (state OPEN) closes now, or None. `choosing`: the selector's model
        is choosing its clients."""

    def all_declined_locked(self) -> bool:
        """Whether the open round closes without an update: every client taking part declined it."""
        return False

    @abc.abstractmethod
    def folding_locked(self) -> dict[str, Member]:
        """The members whose accepted upload the open round folds, by client id (sorted)."""

    def folds(self, round_: int, records: Records) -> bool:
        """Whether the records fold with their staleness (FedBuff) rather than by the strategy: an update
        trained from another version than `round_`."""
        return any(a.base not in (-1, round_) for _, a in records)

    def closed_member(self, round_: int, m: Member) -> None:
        """Round `round_` closed with the member's upload in it."""

    # ---- opening -----------------------------------------------------------------------------
    @abc.abstractmethod
    def reset_members_locked(self) -> None:
        """A round opens (or the run finishes): what the members keep of the last one."""

    def opened_locked(self) -> None:
        """The round opened (or the run finished), before its selection."""


class SyncRounds(Schedule):
    """Synchronous rounds: round t starts from phi_t and closes as `closing` says; each client takes part
    in the open round (where the selector chose it) with one upload."""

    name = "sync"

    @staticmethod
    def check_settings(cfg: Any) -> None:
        if cfg.async_server_lr != 1.0:
            raise ValueError(f"--async-server-lr {cfg.async_server_lr:g} is FedBuff's, for --mode async: leave it at "
                             "1 with --mode sync, or give --mode async")

    def _taking_part(self) -> tuple[str, ...] | None:
        return self.run.selection.chosen if self.run.selection is not None else None

    def _part_of(self, client_id: str) -> tuple[bool, str]:
        return self.run.selected(client_id), self.run.selection_reason(client_id)

    @staticmethod
    def open_uploads(settings: RunSettings, store: Store, round_: int) -> dict[str, Accepted]:
        return {cid: Accepted.from_dict(record) for cid, record in store.accepted_uploads(round_).items()}

    def check_upload(self, client_id: str, round_: int, nonce: str) -> None:
        run = self.run
        if round_ != run.round or run.state is State.AGGREGATING:
            nxt = run.round + 1 if run.state is State.AGGREGATING else run.round
            raise StaleRound(f"upload for round {round_}, but round {run.round} is "
                             f"{'being aggregated' if run.state is State.AGGREGATING else 'open'}: "
                             f"download the global adapter of round {nxt} and train from it")
        if nonce != run.nonce:
            raise StaleRound(f"the upload's round nonce does not match round {round_}'s: an upload is bound "
                             "to the run and round it was made for; take the nonce from the current RoundStatus")
        run.check_selected(client_id)
        self.release.check_upload(client_id)

    def due_locked(self, choosing: bool) -> str | None:
        if choosing:
            return None  # the selector's model is choosing: the round has not begun for anyone
        run, now = self.run, self.clock()
        accepted = {cid: m.accepted.accepted_unix for cid, m in run.uploaded().items()}
        # A selective round is over its chosen clients alone: the others take no part in it; nor does a
        # client whose heartbeat declines the open round (its guardian's privacy budget is spent).
        last_seen = {cid: m.last_seen for cid, m in run.members.items()
                     if run.selected(cid) and not (m.phase == DECLINED and m.phase_round == run.round)}
        rule = self._rule
        if run.selection is not None:  # fewer chosen than min_clients: every one of them alive
            rule = dataclasses.replace(rule, min_clients=max(1, min(rule.min_clients, len(run.selection.chosen))))
        return self.release.due(rule, OpenRound(last_seen=last_seen, accepted=accepted,
                                                receiving=self.uploads.receiving(),
                                                progress_at=self.uploads.progress_at, deadline=run.deadline), now)

    def all_declined_locked(self) -> bool:
        """A round with no upload that every alive client taking part declined (its heartbeat says
        "declined" for it; their guardians' privacy budgets are spent): nothing will come."""
        run = self.run
        if run.state is not State.OPEN or run.uploaded():
            return False
        now = self.clock()
        alive = [m for cid, m in run.members.items() if run.selected(cid) and self._rule.alive(m.last_seen, now)]
        return bool(alive) and all(m.phase == DECLINED and m.phase_round == run.round for m in alive)

    def folding_locked(self) -> dict[str, Member]:
        return self.run.uploaded()

    def reset_members_locked(self) -> None:
        for m in self.run.members.values():
            m.new_round()


class FedBuff(Schedule):
    """Asynchronous buffered rounds (settings.mode "async"): training slots, a buffer per version folded
    with each update's staleness (buffer_rules says when)."""

    name = "async"
    keeps_nonce = True  # an upload may come from an earlier version

    @staticmethod
    def check_settings(cfg: Any) -> None:
        """What buffered rounds can do: FedBuff's staleness-weighted mean of plain updates of one rank."""
        if cfg.max_lora_rank:
            raise ValueError("--mode async folds updates of one rank: leave --max-lora-rank at 0, or use --mode sync")
        if cfg.secure_aggregation:
            raise ValueError(
                "--mode async cannot work with --secure-aggregation: a buffer mixes updates trained from different "
                "versions, each weighted by its staleness, while a masked sum needs one cohort that advertises keys, "
                "shares seeds and uploads together for one version; use --mode sync with secure aggregation")
        if cfg.strategy != "fedavg":
            raise ValueError(f"--mode async folds updates with FedBuff's staleness-weighted mean: use --strategy "
                             f"fedavg, not {cfg.strategy}")
        if cfg.clip_norm > 0 or cfg.noise_multiplier > 0:
            raise ValueError("--mode async does not clip or add noise: leave --clip-norm and --noise-multiplier at 0, "
                             "or use --mode sync")
        if cfg.selector != "all":
            raise ValueError(f"--mode async gives training slots to clients as they free up (--async-concurrency); "
                             f"--selector {cfg.selector} chooses whole rounds: leave it at all, or use --mode sync")

    @property
    def max_staleness(self) -> int:
        return self.settings.async_max_staleness

    def _taking_part(self) -> tuple[str, ...] | None:
        return tuple(sorted(cid for cid, m in self.run.members.items() if m.slot_since is not None))

    def _part_of(self, client_id: str) -> tuple[bool, str]:
        run = self.run
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

    @staticmethod
    def open_uploads(settings: RunSettings, store: Store, round_: int) -> dict[str, Accepted]:
        """The uploads collected for version `round_`'s buffer (trained from any version it still takes),
        by client id, as their records on disk say."""
        out = {}
        for base in range(max(0, round_ - settings.async_max_staleness), round_ + 1):
            for cid, record in store.accepted_uploads(base).items():
                accepted = Accepted.from_dict(record)
                if accepted.collected == round_:
                    out[cid] = accepted
        return out

    def collecting(self) -> int:
        """The version whose buffer an upload accepted now goes into (the next one while the current
        buffer is being folded)."""
        return self.run.round + (1 if self.run.state is State.AGGREGATING else 0)

    def holds(self, round_: int) -> bool:
        return True  # an upload trained from any version it takes

    def check_upload(self, client_id: str, round_: int, nonce: str) -> None:
        """Raises unless an upload trained from version `round_` may land now."""
        run, stale, base = self.run, self.settings.async_max_staleness, round_
        if nonce != run.nonce:
            raise StaleRound("the upload's round nonce is not this run's: take it from the current RoundStatus")
        if base < 0:
            raise ValueError(f"an upload's round is the version it trained from, 0 to {run.round} here; {base} is "
                             "none: take it from the RoundStatus you downloaded")
        if base > run.round:
            raise StaleRound(f"an upload trained from version {base}, which is not published (version {run.round} "
                             "is the newest): download the newest and train from it")
        behind = self.collecting() - base
        if behind > stale:
            raise StaleRound(f"an upload trained from version {base} is {behind} versions behind the buffer it would "
                             f"join (version {self.collecting()}); this run takes updates at most {stale} behind "
                             f"(--async-max-staleness): download version {run.round} and train again")
        pending = run.members[client_id].accepted
        if pending is not None and pending.base != base:
            raise DuplicateUpload(f"client {client_id}'s upload trained from version {pending.base} is still in the "
                                  "buffer: one upload of a client is folded at a time; wait for the next version")
        check_upload(run, self.settings, self.store, client_id, base)  # a slot, once a version, a fold to come

    def joined_locked(self) -> None:
        self.grant_locked()  # a slot may be free for it

    def uploaded_locked(self, client_id: str) -> None:
        m = self.run.members[client_id]
        if m.slot_since is not None:
            m.slot_since = None  # its slot goes to a client waiting
            self.grant_locked()
            self._persist()
        metrics.BUFFER_FILL.set(len(self.folding_locked()))

    def tick_locked(self) -> None:
        self.grant_locked()

    def due_locked(self, choosing: bool) -> str | None:
        """Why the open version's buffer folds now (buffer_rules.fold_reason), or None."""
        run, now = self.run, self.clock()
        training = any(m.slot_since is not None and self._rule.alive(m.last_seen, now) for m in run.members.values())
        uploading = self.uploads.receiving() and now - self.uploads.progress_at <= self._rule.heartbeat_timeout_s
        return fold_reason(self._rule, OpenBuffer(
            len(self.folding_locked()), buffer_size(self.settings, len(run.members)), training,
            bool(self.eligible_locked(now)), uploading, run.deadline), now)

    def folding_locked(self) -> dict[str, Member]:
        """The members whose upload waits in the open version's buffer."""
        return {cid: m for cid, m in sorted(self.run.members.items())
                if m.accepted is not None and m.accepted.collected == self.run.round}

    def folds(self, round_: int, records: Records) -> bool:
        # A buffer of updates all trained from this version is a synchronous round's: the strategy, unless
        # the fold's server learning rate scales it.
        return super().folds(round_, records) or self.settings.async_server_lr != 1.0

    def closed_member(self, round_: int, m: Member) -> None:
        assert m.accepted is not None
        metrics.ASYNC_STALENESS.observe(round_ - m.accepted.base)

    def reset_members_locked(self) -> None:
        for m in self.run.members.values():
            m.accepted = None  # folded; a stream under way goes on into the next buffer

    def opened_locked(self) -> None:
        run = self.run
        if run.state is not State.OPEN:
            return
        for cid, accepted in self.open_uploads(self.settings, self.store, run.round).items():
            run.members[cid].accepted = accepted  # accepted while the previous buffer was folded
        self.grant_locked()
        metrics.BUFFER_FILL.set(len(self.folding_locked()))

    # ---- training slots ----------------------------------------------------------------------
    def eligible_locked(self, now: float) -> list[Member]:
        """Alive clients that may be given a slot: none held, nothing in the buffer, not yet trained
        from the open version, and not declining (its guardian's privacy budget is spent); the longest
        without a slot first. One that lost its slot at this version without uploading comes last."""
        run = self.run
        return sorted((m for m in run.members.values() if m.slot_since is None and m.accepted is None
                       and (m.slot_version < run.round or m.slot_lost == run.round)
                       and self._rule.alive(m.last_seen, now)
                       and m.phase != DECLINED),
                      key=lambda m: (m.slot_lost == run.round, m.slot_version, m.client.client_id))

    def grant_locked(self) -> None:
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
        granted = self.eligible_locked(now)[:max(0, free)]
        for m in granted:
            m.slot_since = now
            if m.slot_lost != run.round:  # else it lost one at this version without uploading: it goes on
                m.slot_version = run.round
                m.rounds_selected.append(run.round)
        if granted or freed:
            self._changed()
        metrics.SELECTED.set(held + len(granted))


SCHEDULES: dict[str, type[Schedule]] = {s.name: s for s in (SyncRounds, FedBuff)}


def schedule_for(mode: str) -> type[Schedule]:
    """The schedule named `mode` (RunSettings.mode); ValueError naming the modes for another name."""
    try:
        return SCHEDULES[mode]
    except KeyError:
        raise ValueError(f"mode {mode!r} is not a round schedule: give one of {', '.join(SCHEDULES)} "
                         "(sync: synchronous rounds; async: FedBuff's buffered asynchronous rounds)") from None
