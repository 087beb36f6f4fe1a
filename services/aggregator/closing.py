"""When the open round closes: a pure function of what the round keeper knows at one moment, so the
rule is tested without threads, clocks or files.

A round closes, with at least one upload, when
  - every joined client has uploaded, or
  - at least `min_clients` have, and every client still alive (heard from within the heartbeat
    timeout) has uploaded, or
  - at least `min_clients` have, and `wait_after_min_s` has passed since the min_clients-th upload, or
  - at least `min_clients` have, and the round's deadline has passed;
the last two wait while an upload is still making progress (bytes arrived within the heartbeat
timeout).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Rule:
    """The settings that decide when a round closes."""

    min_clients: int
    wait_after_min_s: float
    heartbeat_timeout_s: float

    def alive(self, last_seen: float, now: float) -> bool:
        """Whether a client last heard from at `last_seen` counts as alive at `now`."""
        return now - last_seen <= self.heartbeat_timeout_s


@dataclasses.dataclass(frozen=True)
class OpenRound:
    """The open round at one moment, as the rule sees it."""

    last_seen: Mapping[str, float]  # every joined client: when it was last heard from
    accepted: Mapping[str, float]  # every client whose upload is accepted: when it was
    receiving: bool  # an upload stream is open
    progress_at: float  # when upload bytes last arrived
    deadline: float  # when the round closes once min_clients have uploaded


def close_reason(rule: Rule, r: OpenRound, now: float) -> str | None:
    """Why the open round closes at `now` (see the module doc), or None while it stays open."""
    if not r.accepted:
        return None
    if set(r.accepted) >= set(r.last_seen):
        return "all uploaded"
    if len(r.accepted) < rule.min_clients:
        return None
    if not any(rule.alive(seen, now) for cid, seen in r.last_seen.items() if cid not in r.accepted):
        return "all alive clients uploaded"
    if r.receiving and now - r.progress_at <= rule.heartbeat_timeout_s:
        return None  # a transfer is making progress: wait for it
    if now >= sorted(r.accepted.values())[rule.min_clients - 1] + rule.wait_after_min_s:
        return "waited after quorum"
    if now >= r.deadline:
        return "deadline with quorum"
    return None
