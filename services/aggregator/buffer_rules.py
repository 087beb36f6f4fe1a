"""Asynchronous rounds' rules (--mode async, FedBuff), the counterpart of `closing` for a buffer: when
the open version's buffer folds, when a training slot is taken back, and which uploads a buffer takes.

A buffer folds, with at least `min_clients` updates (as a synchronous round needs to close), when
  - it holds the buffer's size of updates, or
  - no client could add to it (no alive client holds a slot, none could be given one, no upload is
    making progress), or
  - the version's deadline has passed and no upload is making progress;
below `min_clients` it waits, as a synchronous round does. A slot held for `round_deadline_s` by a
client whose upload is not making progress is taken back and given to a waiting client, so a client
that stays alive and never uploads cannot hold the run.

An upload lands only where it will be folded: from a client holding a slot, trained from the version
the slot was given for or a newer one, one update a client per version it trained from, and never
while the last version is being folded (the run ends with that fold).
"""

from __future__ import annotations

import dataclasses

from .closing import Rule
from .errors import DuplicateUpload, NotSelected, RunFinished
from .state import Member, RunSettings, RunState, State
from .store import Store


@dataclasses.dataclass(frozen=True)
class OpenBuffer:
    """The open version's buffer at one moment, as the rule sees it."""

    pending: int  # updates in it
    size: int  # updates that fill it (buffer_size)
    training: bool  # an alive client holds a slot
    eligible: bool  # an alive client could be given a slot
    uploading: bool  # an upload stream is making progress
    deadline: float  # the version's deadline (opened + round_deadline_s)


def buffer_size(settings: RunSettings, joined: int) -> int:
    """The updates that fill a buffer: --async-buffer, else --async-concurrency, else every joined client;
    never fewer than --min-clients (a fold needs that many)."""
    size = settings.async_buffer or settings.async_concurrency or max(1, joined)
    return max(size, settings.min_clients)


def fold_reason(rule: Rule, b: OpenBuffer, now: float) -> str | None:
    """Why the open version's buffer folds at `now` (see the module doc), or None while it waits."""
    if b.pending < max(1, rule.min_clients):
        return None
    if b.pending >= b.size:
        return "buffer full"
    if b.uploading:
        return None  # a transfer is making progress: wait for it
    if not b.training and not b.eligible:
        return "no client left to fill the buffer"
    if now >= b.deadline:
        return "deadline with quorum"
    return None


def slot_expired(m: Member, now: float, deadline_s: float, uploading: bool) -> bool:
    """Whether the member's slot is taken back: held `deadline_s` or longer without an upload making
    progress (a synchronous round's deadline, applied to each slot)."""
    return m.slot_since is not None and not uploading and now >= m.slot_since + deadline_s


def check_upload(run: RunState, settings: RunSettings, store: Store, client_id: str, base: int) -> None:
    """Raises, saying what to do, unless the client's update trained from version `base` may go into a
    buffer now (its staleness and nonce are checked before this)."""
    if run.state is State.AGGREGATING and run.round + 1 >= settings.num_rounds:
        raise RunFinished(f"run {settings.run_id} ends with version {run.round + 1}, which is being folded now: "
                          "no later buffer will be folded, so no upload is taken; download the final version")
    m = run.members[client_id]
    if m.accepted is not None:
        return  # its update waits in the buffer: the same one is acknowledged again, another refused
    earlier = store.accepted_uploads(base).get(client_id)
    if earlier is not None:
        raise DuplicateUpload(f"client {client_id} already has an update trained from version {base} accepted "
                              f"({str(earlier.get('sha256', ''))[:12]}...): one update a client per version; wait "
                              f"for a training slot, download version {run.round} and train from it")
    if m.slot_since is None:
        raise NotSelected(f"client {client_id} holds no training slot (taken back at its deadline, or never given): "
                          "wait until RoundStatus.selected names it, then download the newest version and train "
                          "from it")
    if base < m.slot_version:
        raise NotSelected(f"client {client_id}'s training slot was given at version {m.slot_version}, and this "
                          f"update trained from version {base}: download version {run.round} and train from it")
