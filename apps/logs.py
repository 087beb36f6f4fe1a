"""What a service's log says: its last lines and last error (a failed client's), and what a
running client agent is doing (its last progress line)."""

from __future__ import annotations

import json
import pathlib
import re

from fedse.progress import describe, last_progress, tail_lines
from apps.planning import Client
from apps.processes import Proc

LOG_TAIL_BYTES = 64 * 1024  # how much of a failed client's log is read for its last lines

EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")
TRACEBACK_HEADERS = ("Traceback (most recent call last)", "During handling of the above", "The above exception was")
LOG_KEYS = ("ts", "level", "service", "logger", "msg", "exc")


def condense(lines: list[str]) -> list[str]:
    """Text that is not a JSON log line (what Python printed on its way out, mostly tracebacks) as
    the lines worth showing: a traceback's frames are left out and its exception line kept, with
    the lines that carry on its message (a gRPC error's status and details) joined to it."""
    out: list[str] = []
    carry = False
    for line in lines:
        if not line.strip() or line.startswith(TRACEBACK_HEADERS):
            carry = False
        elif carry:
            out[-1] += " " + line.strip()
        elif not line[0].isspace():
            out.append(line.strip())
            carry = bool(EXCEPTION_LINE.match(line))
    return out


def log_summary(path: pathlib.Path, lines: int = 3, width: int = 160) -> tuple[tuple[str, ...], str]:
    """(the last `lines` meaningful lines, the last error) of a service's log, each at most `width`
    characters. JSON log lines are shown as "level: msg key=value ... (exception)", other text as
    condense() leaves it. The error is the last error-level entry, entry with an exception, or
    exception line ("" if none)."""
    text = tail_lines(path, LOG_TAIL_BYTES)
    if text is None:
        return (), ""
    items: list[tuple[str, bool]] = []  # (line to show, whether it is an error)
    block: list[str] = []  # consecutive lines that are not JSON

    def flush() -> None:
        items.extend((t, bool(EXCEPTION_LINE.match(t))) for t in condense(block))
        block.clear()

    for line in text:
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if not isinstance(entry, dict):
            block.append(line)
            continue
        flush()
        extra = "".join(f" {k}={v}" for k, v in entry.items() if k not in LOG_KEYS)
        exc = condense(str(entry.get("exc", "")).splitlines())
        items.append((f"{entry.get('level', '?')}: {entry.get('msg', '')}{extra}" + (f" ({exc[-1]})" if exc else ""),
                      entry.get("level") in ("error", "critical") or bool(exc)))
    flush()
    error = next((t for t, is_error in reversed(items) if is_error), "")

    def cut(text: str) -> str:
        return text if len(text) <= width else text[: width - 3] + "..."

    return tuple(cut(t) for t, _ in items[-lines:]), cut(error)


def progress_texts(clients: dict[Client, Proc]) -> dict[str, str]:
    """What each running client agent is doing, by client id, from the last progress line of its log
    (clients without one, or no longer running, are left out)."""
    texts, serving = {}, {}
    for c, p in clients.items():
        serving.setdefault(p, []).append(c)
    for p, held in serving.items():  # a client host's one log: its line under the host's name
        entry = last_progress(p.log_path) if p.popen.poll() is None else None
        if entry:
            texts[held[0].client_id if len(held) == 1 else p.name] = describe(entry)
    return texts

