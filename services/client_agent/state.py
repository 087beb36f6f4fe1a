"""A client's state directory (`--state-dir/<client id>`): its progress (progress.json, resume.py),
its trajectory buffer (buffer.jsonl) and the adapter it trained and has yet to see acknowledged
(upload.safetensors); set aside, never deleted, when it belongs to another run. The organisation's
files (`ORGANISATION`: its privacy ledger, what it revealed in secure rounds, its noise secret) stay
where they are: they span runs, whose ids the aggregator chooses."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import time

from fedse.model import adapter as ad
from fedse.files import atomic_write, fsync_dir
from fedse.transport.serving import log_fields

from services.client_agent.resume import PROGRESS_NAME, Progress, ProgressError, read_progress, write_progress

log = logging.getLogger("client_agent")

UPLOAD_NAME = "upload.safetensors"
BUFFER_NAME = "buffer.jsonl"
# What belongs to the organisation, not to a run (privacy.py, releases.py, secure_checks.py): never set aside.
ORGANISATION = ("privacy.json", "secure_released.json", "secure_noise.key", "secure_attempts.txt")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:64] or "unknown"


class StateDir:
    """The state directory of one client (made where missing)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def buffer_path(self) -> pathlib.Path:
        return self.path / BUFFER_NAME

    def write_progress(self, progress: Progress) -> None:
        write_progress(self.path / PROGRESS_NAME, progress)

    def read_progress(self) -> Progress | None:
        """The recorded progress; None where there is none or it is unreadable (logged)."""
        try:
            return read_progress(self.path / PROGRESS_NAME)
        except ProgressError as exc:
            log.warning("progress file unreadable; starting this run afresh",
                        extra=log_fields(path=str(self.path / PROGRESS_NAME), error=str(exc)))
            return None

    def set_aside(self, old: Progress | None) -> bool:
        """Moves the run's files aside, into a directory beside this one (never deletes them), and keeps
        the organisation's here (ORGANISATION); False where it held nothing to keep (it stays as it is).
        progress.json moves last: a crash part-way leaves it naming the old run, and the next start
        sets the rest aside too."""
        names = (BUFFER_NAME, PROGRESS_NAME, UPLOAD_NAME)
        if not any((self.path / n).exists() and (self.path / n).stat().st_size for n in names):
            return False
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        base = f"{self.path.name}.aside-{_slug(old.run_id if old else 'unknown')}-{stamp}"
        target = self.path.with_name(base)
        n = 1
        while target.exists():
            target, n = self.path.with_name(f"{base}-{n}"), n + 1
        target.mkdir()
        fsync_dir(self.path.parent)
        for entry in sorted(self.path.iterdir(), key=lambda e: e.name == PROGRESS_NAME):
            if entry.name not in ORGANISATION:
                os.replace(entry, target / entry.name)
        fsync_dir(target)
        fsync_dir(self.path)
        log.warning("previous client state set aside", extra=log_fields(moved_to=str(target)))
        return True

    def save_upload(self, data: bytes) -> None:
        atomic_write(self.path / UPLOAD_NAME, data)

    def saved_upload(self, p: Progress) -> bytes | None:
        """The saved adapter `p` recorded (its sha256); None where it is missing or damaged (logged)."""
        try:
            data = (self.path / UPLOAD_NAME).read_bytes()
        except FileNotFoundError:
            data = b""
        if ad.sha256_hex(data) != p.sha256:
            log.error("saved adapter missing or damaged; training the round again",
                      extra=log_fields(round=p.round, path=str(self.path / UPLOAD_NAME)))
            return None
        return data
