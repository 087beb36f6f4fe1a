"""Bounds on what a caller sends, and on how much of it an error may repeat (every service).

A status message travels in the reply's trailing metadata, which gRPC clients cap at 8 KB by default:
a refusal that repeated a 1 MB id would reach the caller as RESOURCE_EXHAUSTED ("Stream removed")
instead of the status meant for it. So every identifier a request carries is bounded up front
(`bounded`), and a message that names an input shows only a short prefix of it (`shown`).
"""

from __future__ import annotations

import re

# A client id, as the aggregator admits it and a client certificate names it (its first subject
# alternative name, its common name): also a file name.
CLIENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
CLIENT_ID_RULE = "use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
# Ids and names: client, session, environment, run, round nonce, sha256, phase, metric names.
MAX_ID_CHARS = 256
# Longer names: a base model may be a directory path; tensor names are module paths.
MAX_NAME_CHARS = 1024
# How much of an input an error message repeats.
ECHO_CHARS = 48
# The most a status message says, whatever it quotes (well under gRPC's 8 KB metadata default).
MAX_STATUS_CHARS = 2048


class InputError(ValueError):
    """A request field outside its bounds; servers answer INVALID_ARGUMENT with the message."""


def shown(value: object, limit: int = ECHO_CHARS) -> str:
    """`value` for an error message (a string quoted, anything else as str() writes it), cut to its
    first `limit` characters with its length when longer."""
    text = value if isinstance(value, str) else str(value)
    cut = text[:limit]
    out = repr(cut) if isinstance(value, str) else cut
    return out if len(text) <= limit else f"{out}... ({len(text)} characters)"


def bounded(field: str, value: str, limit: int = MAX_ID_CHARS) -> str:
    """`value` if it has at most `limit` characters; InputError naming the field and the limit if not."""
    if len(value) > limit:
        raise InputError(f"{field} is {len(value)} characters long, more than the limit of {limit}: "
                         f"{shown(value)}")
    return value


def status_message(text: str) -> str:
    """A status message in ASCII (other characters escaped, as \\u00e9), cut to MAX_STATUS_CHARS (the
    last guard: inputs are bounded and shown short). gRPC sends the message percent-encoded in a
    header of at most 8 KB: a character outside ASCII takes up to 12 bytes there, so a message of
    such characters would be refused whole and its status lost."""
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= MAX_STATUS_CHARS else text[:MAX_STATUS_CHARS - 3] + "..."
