"""A client host's members at work: each member agent's run in a thread of its own (`Member`), and each
log line a member's threads write tagged with its client id (`tag_member_logs`)."""

from __future__ import annotations

import logging
import threading
import traceback

from fedse.transport.reach import Unreachable
from fedse.transport.serving import log_fields

from services.client_agent.federation.link import InsecureRun

log = logging.getLogger("client_host")

# The attribute of a thread that names the member it works for (set on a member's thread, and inherited
# by the threads it starts: its heartbeat, its progress lines).
MEMBER_ATTR = "fedse_client_id"


class Member:
    """One member agent and its thread: `start` runs agent.run() in it; `failure` says why it failed
    (None while it runs or once it finished its run)."""

    def __init__(self, client_id: str, agent=None, failure: str | None = None):
        self.client_id = client_id
        self.agent = agent
        self.failure = failure  # set where building the agent failed already
        self.done = False
        self.stopping = False  # the host closed its channels (SIGTERM): what fails after that is no failure
        self.thread = threading.Thread(target=self._run, name=f"member-{client_id}", daemon=True)
        setattr(self.thread, MEMBER_ATTR, client_id)

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def start(self) -> None:
        if self.agent is not None:
            self.thread.start()

    def _run(self) -> None:
        trace = None
        try:
            self.agent.run()
            self.done = True
            log.info("run complete")
        except Unreachable as exc:  # a channel that cannot be made: its reason and the flag to check
            self.failure = f"cannot connect: {exc.reason}"
        except InsecureRun as exc:  # this organisation's protection, not the aggregator's choice
            self.failure = f"refused: {exc}"
        except BaseException as exc:  # noqa: BLE001 - one member's failure must not end the others
            if not self.stopping:
                self.failure, trace = f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=8)
        finally:
            self.close()
        if self.failure is not None and not self.stopping:
            log.error("member failed; the others go on", extra=log_fields(reason=self.failure, trace=trace))

    def stop(self) -> None:
        """Closes a running member's channels: its run ends where it is (its state is on disk)."""
        self.stopping = True
        self.close()

    def close(self) -> None:
        if self.agent is not None:
            try:
                self.agent.close()
            except Exception as exc:  # noqa: BLE001 - closing channels at the end: nothing left to save
                log.warning("closing the member's channels failed", extra=log_fields(reason=str(exc)))


class _MemberTag(logging.Filter):
    """Adds `client_id` to a log line written by a member's thread (or one it started), unless the line
    names one already."""

    def filter(self, record: logging.LogRecord) -> bool:
        cid = getattr(threading.current_thread(), MEMBER_ATTR, None)
        if cid is not None:
            fields = getattr(record, "fields", None) or {}
            if "client_id" not in fields:
                record.fields = {"client_id": cid, **fields}
        return True


def tag_member_logs() -> None:
    """Every log line of this process that a member's threads write carries the member's client id: the
    root handlers get a filter, and a thread started by a member's thread (its heartbeat, its progress
    ticker) is marked as the member's, as the member's own thread is."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_MemberTag())
    if getattr(threading.Thread.__init__, "_fedse_members", False):
        return
    original = threading.Thread.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        cid = getattr(threading.current_thread(), MEMBER_ATTR, None)
        if cid is not None:
            setattr(self, MEMBER_ATTR, cid)

    init._fedse_members = True  # type: ignore[attr-defined]
    threading.Thread.__init__ = init  # type: ignore[method-assign]
