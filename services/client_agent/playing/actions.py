"""Action text: matching a generated text to an admissible action, where an action line ends, and
the turn the agent wrote where an environment lists no actions (prompts.parse_react reads those)."""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Sequence

_ACTION_RE = re.compile(r"Action\s*:\s*(.+)", re.IGNORECASE)
# A complete action line: "Action: <action>\n" or AgentGym's "Action:\n<action>\n".
ACTION_LINE = re.compile(r"(?<![A-Za-z])Action\s*:[ \t]*\n?[ \t]*\S[^\n]*\n", re.IGNORECASE)
# The action line after prompts.ACTION_CUE, which already said "Action:": any complete non-empty line.
CUED_ACTION_LINE = re.compile(r"[ \t]*\S[^\n]*\n")


@dataclasses.dataclass(frozen=True)
class Written:
    """One turn the agent wrote: the action sent, the whole text it came from, and whether the model
    named the action by itself (`parsed`; else it wrote its action line after prompts.ACTION_CUE, or,
    where that line is empty, fallback_action's guess was sent)."""

    action: str
    text: str
    parsed: bool


def _normalise(text: str) -> str:
    return " ".join(text.strip().strip("`'\"[]().").lower().split())


def parse_action(text: str, candidates: Sequence[str]) -> str | None:
    """The admissible action a generated ReAct text names, or None.

    Takes the first line after "Action:" (the whole text when there is none), then tries in order:
    an exact match ignoring case, quotes, brackets and a final period; the longest candidate that the
    line contains as whole words; a close spelling (difflib ratio >= 0.85).
    """
    if not candidates:
        return None
    m = _ACTION_RE.search(text)
    line = m.group(1).splitlines()[0] if m else text.strip().splitlines()[0] if text.strip() else ""
    said = _normalise(line)
    if not said:
        return None
    by_norm = {}
    for c in candidates:
        by_norm.setdefault(_normalise(c), c)
    if said in by_norm:
        return by_norm[said]
    contained = [c for n, c in by_norm.items() if n and re.search(r"(?<!\w)" + re.escape(n) + r"(?!\w)", said)]
    if contained:
        return max(contained, key=len)
    close = difflib.get_close_matches(said, list(by_norm), n=1, cutoff=0.85)
    return by_norm[close[0]] if close else None


def has_action_line(text: str, line: re.Pattern = ACTION_LINE) -> bool:
    """Whether the text holds a complete action line ending in a newline: "Action: <action>\\n", or
    AgentGym's "Action:\\n<action>\\n" (`line` CUED_ACTION_LINE: any non-empty line)."""
    return bool(line.search(text))


def cut_after_action(text: str, line: re.Pattern = ACTION_LINE) -> str:
    """The text up to and with the end of its first complete action line ("Action: x\\n" or
    "Action:\\nx\\n"; `line` as in has_action_line); all of it where it has none."""
    m = line.search(text)
    return text[:m.end()] if m else text

