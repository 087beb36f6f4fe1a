"""What `fedse run` shows while its federation runs: the table of held-out success per environment
and round, and what each client agent is doing.

On a terminal (out.isatty()) the table and the clients' progress beneath it are one block, drawn
once and then redrawn in place: ANSI escape codes move the cursor up to the block's first line
(CSI n A), clear each line before it is written again (CSI 2K) and clear what is left below
(CSI J), so the screen holds one table that fills in. Messages (a client that failed) go above the
block. Anywhere else (a file, a pipe, `fedse experiment`'s progress.log) lines are only ever
appended: the table's title and head once, each round's row once, when every environment whose
client still runs has reported that round (or a later one), and the progress lines that changed, at
most every PROGRESS_EVERY_S; close() appends the rows left (those of a run that ended early).
"""

from __future__ import annotations

import shutil
import time
from typing import IO, Any, Iterable

from fedse.progress import EVERY_S as PROGRESS_EVERY_S
from apps.results import table_lines

TITLE = "held-out success per environment and round"
UP = "\x1b[{}A"  # cursor up that many lines
CLEAR_LINE = "\x1b[2K"
CLEAR_BELOW = "\x1b[J"
TTY_PROGRESS_S = 1.0  # how often a terminal's progress lines are read anew


def is_terminal(out: IO[str]) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Display:
    """The run's table (`table`), its clients' progress (`progress`) and messages (`say`) on `out`."""

    def __init__(self, out: IO[str], envs: Iterable[str], rounds: int, started: float | None = None):
        self.out, self.envs, self.rounds = out, sorted(envs), rounds
        self.started = time.monotonic() if started is None else started
        self.tty = is_terminal(out)
        self.progress_every_s = TTY_PROGRESS_S if self.tty else PROGRESS_EVERY_S
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self.lost: set[str] = set()  # environments whose client failed
        self.notes: list[str] = []  # lines beneath a terminal's table (the clients that failed)
        self.texts: dict[str, str] = {}  # client id -> what it is doing, as last shown
        self.heading = ""
        self.drawn: list[str] = []  # the block on a terminal's screen, as written
        self.appended = 0  # elsewhere: the rows appended (rounds 0 .. appended - 1)

    def when(self) -> str:
        return f"[{time.monotonic() - self.started:6.1f}s]"

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def say(self, msg: str) -> None:
        """A message, above a terminal's table."""
        if self.tty and self.drawn:
            self._write(UP.format(len(self.drawn)) + "\r" + CLEAR_BELOW + msg + "\n")
            self.drawn = []
            self._redraw()
        else:
            self._write(msg + "\n")

    def table(self, rows: dict[str, list[dict[str, Any]]], lost: Iterable[str] = (),
              notes: Iterable[str] = ()) -> None:
        """The rows reported so far (results.env_rows), the environments whose client failed, and, on
        a terminal, lines to show beneath the table."""
        self.rows, self.lost, self.notes = rows, set(lost), list(notes)
        if self.tty:
            self.heading = f"{self.when()} {TITLE}"
            self._redraw()
        else:
            self._append_rows(final=False)

    def progress(self, texts: dict[str, str]) -> None:
        """What each running client is doing (logs.progress_texts): beneath a terminal's table, else
        the lines that changed since last shown."""
        if self.tty:
            if texts != self.texts:
                self.texts = dict(texts)
                self._redraw()
            return
        new = [f"{cid}: {text}" for cid, text in texts.items() if self.texts.get(cid) != text]
        self.texts.update(texts)
        if new:
            self._write(f"{self.when()} " + "\n          ".join(new) + "\n")

    def close(self) -> None:
        """The table as it ends: a terminal's block stays on screen; elsewhere the rows not yet
        appended (a run that ended early) are."""
        if self.tty:
            self.texts = {}
            self._redraw()
            self.drawn = []
        else:
            self._append_rows(final=True)

    def _append_rows(self, final: bool) -> None:
        last = {env: max((r["round"] for r in rows), default=-1) for env, rows in self.rows.items()}
        live = [e for e in self.envs if e not in self.lost]
        if final:
            ready = max(last.values(), default=-1) + 1
        else:
            ready = min((last.get(e, -1) for e in live), default=-1) + 1  # every live environment is past it
        head, lines = table_lines(self.rows, self.envs, self.rounds)
        if ready <= self.appended:
            return
        if self.appended == 0:
            self._write(f"\n{self.when()} {TITLE}\n" + "\n".join(head) + "\n")
        self._write("".join(line + "\n" for line in lines[self.appended:ready]))
        self.appended = ready

    def _redraw(self) -> None:
        head, lines = table_lines(self.rows, self.envs, self.rounds)
        width = max(20, shutil.get_terminal_size((120, 24)).columns - 1)  # a wrapped line would count as two
        block = [line[:width] for line in ["", self.heading, *head, *lines, *self.notes,
                                           *(f"{cid}: {text}" for cid, text in self.texts.items())]]
        if block == self.drawn:
            return
        up = UP.format(len(self.drawn)) + "\r" if self.drawn else ""
        self._write(up + "".join(CLEAR_LINE + line + "\n" for line in block) + CLEAR_BELOW)
        self.drawn = block
