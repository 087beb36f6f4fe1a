"""Choosing a round's clients outside the round keeper's lock, for a selector that asks a language model
(agent-llm, under its fairness floor or not).

A model takes seconds to answer (SmolLM2-135M on two CPU cores: 7-42 s with 4-120 clients). Held under
the round keeper's lock, that blocked every heartbeat, status call and upload refusal meanwhile; clients
timed out, and live ones were counted as dropouts. So the round keeper takes a snapshot of the
selection's input under its lock, records a placeholder selection that chooses nobody yet (clients see
that they are not chosen and wait; their heartbeats and calls go on), and `Thinking` runs the policy
on the snapshot in a worker thread (policies are pure: the snapshot is all they read). The round keeper
then re-takes its lock and applies the answer only if the round it was made for is still the open
one, with the same nonce, and no later selection began (`current`); else it is discarded. The model's
own deadline (agent-llm's max_seconds, which covers the load, the prompt and the answer) bounds the
wait: past it, the tools' plan is chosen, counted as a fallback.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable

from fedse.transport.serving import log_fields

from .policies import FairnessFloor, Policy, Selection, SelectionInput, _dead
from .agents import LLMAgent

log = logging.getLogger("aggregator.selection")

THINKING = "the selector's model is choosing this round's clients; wait"  # the placeholder's first step


def model_agent(policy: Policy | None) -> LLMAgent | None:
    """The agent-llm inside `policy` (under a fairness floor or not), or None."""
    inner = policy.policy if isinstance(policy, FairnessFloor) else policy
    return inner if isinstance(inner, LLMAgent) else None


def placeholder(inp: SelectionInput, policy: str) -> Selection:
    """The open round's selection while the model thinks: nobody chosen yet."""
    reasons = {c.client_id: ("waiting for the selector's model" if c.alive else _dead(c)) for c in inp.clients}
    return Selection(inp.round, (), reasons, policy, (THINKING,))


def is_placeholder(sel: Selection | None) -> bool:
    return sel is not None and not sel.chosen and sel.reasoning[:1] == (THINKING,)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A selection being chosen: for which round and nonce, from which input, and why again (if so)."""

    inp: SelectionInput
    nonce: str
    why: str = ""


class Thinking:
    """Runs `choose` (the policy on a snapshot; no lock) in a worker thread, then `apply` (which takes the
    round keeper's lock and checks `current`). One selection is pending at a time: a newer one makes
    the older one stale."""

    def __init__(self, choose: Callable[[SelectionInput], Selection],
                 apply: Callable[[Pending, Selection], None]) -> None:
        self._choose, self._apply = choose, apply
        self.pending: Pending | None = None  # read and written under the round keeper's lock
        self._idle = threading.Condition()
        self._running = 0

    def begin(self, inp: SelectionInput, nonce: str, why: str = "") -> Pending:
        """Starts choosing for `inp` (call under the round keeper's lock)."""
        pending = self.pending = Pending(inp, nonce, why)
        with self._idle:
            self._running += 1
        threading.Thread(target=self._run, args=(pending,), name=f"selector-round-{inp.round}", daemon=True).start()
        return pending

    def current(self, pending: Pending, round_: int, nonce: str, open_: bool) -> bool:
        """Whether `pending`'s answer still fits the run (call under the round keeper's lock)."""
        return self.pending is pending and open_ and pending.inp.round == round_ and pending.nonce == nonce

    def _run(self, pending: Pending) -> None:
        try:
            self._apply(pending, self._choose(pending.inp))
        except Exception:  # noqa: BLE001 - a worker must not die silently
            log.exception("applying the selector's choice failed", extra=log_fields(round=pending.inp.round))
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def wait(self, timeout: float = 30.0) -> bool:
        """Blocks until no selection is being chosen (for tests and an orderly stop); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout=timeout)
