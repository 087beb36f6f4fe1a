"""Who takes part in a selective run's rounds (settings.selection): the round keeper's selector. It asks
the run's policy when a round opens (a model-backed one outside the keeper's lock: `selecting.Thinking`),
records the answer (the run state, each member's record, the selections log, the metrics), and chooses
again, or tops the round up, when chosen clients die before uploading.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import Callable

from fedse.transport.serving import log_fields

from .. import metrics
from ..closing import Rule
from .policies import All, ClientHistory, Policy, Selection, SelectionInput, top_up
from .thinking import Pending, Thinking, model_agent, placeholder
from ..state import RunSettings, RunState, State
from ..store import Store

log = logging.getLogger("aggregator.rounds")


class RoundSelector:
    """Chooses the open round's clients under the round keeper's lock (`lock`). `began()`, called with
    the lock held, is the keeper's: a model's answer came, the round's clock started again (the release
    begins its attempt, the run is saved, the change shown)."""

    def __init__(self, policy: Policy | None, settings: RunSettings, store: Store, run: RunState, rule: Rule,
                 clock: Callable[[], float], lock: threading.Condition, minimum: int, began: Callable[[], None]):
        self.policy = policy
        self.settings, self.store, self.run, self._rule, self.clock = settings, store, run, rule, clock
        self._lock, self._minimum, self._began = lock, minimum, began
        # A selector that asks a model chooses outside the lock (selecting.Thinking); None for the others.
        self.thinking = Thinking(self._choose, self._chosen) if model_agent(policy) is not None else None

    @property
    def choosing(self) -> bool:
        """Whether the selector's model is choosing the open round's clients."""
        return self.thinking is not None and self.thinking.pending is not None

    def opened_locked(self, round_: int) -> None:
        """Round `round_` opened (or the run finished): its selection starts empty, then is chosen."""
        self.run.selection = None
        if self.policy is not None and self.run.state is State.OPEN:
            self.select_locked(round_)

    def history_locked(self, now: float) -> list[ClientHistory]:
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

    def select_locked(self, round_: int, why: str = "") -> None:
        """Chooses who takes part in the open round (the policy's answer; every alive client where the
        policy fails, counted as a fallback) and records it: the run state, each member's record, the
        selections log and the metrics."""
        assert self.policy is not None
        run, now = self.run, self.clock()
        inp = SelectionInput(self.settings.run_id, round_, self.settings.seed, tuple(self.history_locked(now)),
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
        with self._lock:
            run = self.run
            if not self.thinking or not self.thinking.current(pending, run.round, run.nonce, run.state is State.OPEN):
                log.info("the selector's answer came for a round that moved on; discarded",
                         extra=log_fields(round=pending.inp.round))
                return
            self.thinking.pending = None
            self._record_locked(sel, pending.why)
            run.opened_at, run.deadline = self.clock(), self.clock() + self.settings.round_deadline_s
            self._began()

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

    def reselect_if_stalled_locked(self, receiving: bool) -> bool:
        """Chosen clients that died (heartbeat timed out) before uploading: every one of them, with no
        upload yet, and the policy chooses again; else each is replaced by an alive client not chosen
        (selection.top_up), the uploads already accepted kept. A dead chosen client would otherwise hold
        the round to its deadline, or for ever short of min_clients. `receiving`: an upload stream is
        open (nothing changes meanwhile). Returns whether the round's clients changed (the keeper then
        starts a new secure attempt, saves the run and shows the change)."""
        run, now = self.run, self.clock()
        if run.selection is None or run.state is not State.OPEN or receiving:
            return False
        uploaded = run.uploaded()
        gone = {cid for cid in run.selection.chosen
                if cid not in uploaded and not self._rule.alive(run.members[cid].last_seen, now)}
        if not gone or not any(self._rule.alive(m.last_seen, now) for m in run.members.values()):
            return False  # nobody gone, or nobody to choose
        if uploaded or gone != set(run.selection.chosen):
            inp = SelectionInput(self.settings.run_id, run.round, self.settings.seed,
                                 tuple(self.history_locked(now)), minimum=self._minimum)
            sel = top_up(run.selection, inp, gone)
            if sel is run.selection:
                return False  # no alive client to take their places: they may come back
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
            self.select_locked(run.round, "no chosen client was alive")
        for cid in gone:  # chosen, and gone without an upload
            run.members[cid].dropouts += 1
        return True
