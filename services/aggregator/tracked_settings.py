"""The settings a tracked run records (--track): what tells one run from another.

The aggregator records its own settings under their names (strategy, rounds, ...). --run-settings
FILE adds the settings of the run the aggregator is part of, which only its launcher knows: FILE is
a JSON object whose "config" holds the run's settings, recorded as run/NAME (run/lr, run/lora_r),
and whose "clients" holds each client's, {client id: settings}, recorded as client/ID/NAME
(client/org-maze/lora_r). `fedse run` passes its run.json, which has that shape. The clients send
none of this: it is what the launcher gave them.

Values keep their type (numbers stay numbers, booleans booleans; a list becomes its items joined by
commas), and nothing secret is recorded: a setting whose name says it holds or points to a secret
(token, key, secret, password, credential) is left out, wherever it stands, and a URI's
user:password@ is masked.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Union

from fedse.config import plain

Value = Union[bool, int, float, str]

SECRET_WORDS = ("token", "key", "secret", "password", "credential")  # settings never sent, whatever they hold
USERINFO = re.compile(r"(?<=://)[^/@\s]+@")  # the user:password@ of a URI
GROUPS = {"config": "run", "clients": "client"}  # --run-settings' objects, and the prefix each is recorded under


def is_secret(name: str) -> bool:
    return any(word in name.lower() for word in SECRET_WORDS)


def typed(value: Any) -> Value:
    """A setting's value as the trackers take it: bool, int, float or str."""
    value = plain(value)  # a Count's ALL says "all", not the 0 it equals
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value
    if isinstance(value, (tuple, list)):
        return ",".join(str(typed(v)) for v in value)
    return "" if value is None else USERINFO.sub("***@", str(value))


def public_settings(settings: dict[str, Any], prefix: str = "") -> dict[str, Value]:
    """The settings typed and flat (a nested object's entries as NAME/KEY), less any whose name says
    it holds or points to a secret."""
    out: dict[str, Value] = {}
    for name, value in sorted(settings.items()):
        if isinstance(value, dict):
            out.update(public_settings(value, f"{prefix}{name}/"))
        elif not is_secret(name):
            out[prefix + name] = typed(value)
    return out


def read_run_settings(path: str) -> dict[str, dict[str, Any]]:
    """--run-settings FILE as it is recorded: {"run": the run's settings, "client": {client id:
    settings}}. ValueError, saying what to fix, for a file that cannot be read or has another shape."""
    shape = ('a JSON object with "config" (the run\'s settings) and "clients" ({client id: its settings}), '
             "as fedse run's run.json")
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--run-settings {path} cannot be read ({exc.strerror or exc}): give {shape}") from None
    except ValueError as exc:
        raise ValueError(f"--run-settings {path} is not JSON ({exc}): give {shape}") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k, {}), dict) for k in GROUPS) \
            or not all(isinstance(v, dict) for v in data.get("clients", {}).values()):
        raise ValueError(f"--run-settings {path}: give {shape}")
    return {prefix: data.get(key, {}) for key, prefix in GROUPS.items()}


def recorded_settings(settings: dict[str, Any]) -> dict[str, Value]:
    """What a run records: the aggregator's `settings` (its config's fields), with the run's and its
    clients' from the file its run_settings names; ValueError for a file that cannot be read."""
    extra = read_run_settings(settings["run_settings"]) if settings.get("run_settings") else {}
    return public_settings({**settings, **extra})


def path_name(name: str) -> str:
    """`name` as one folder's name: any character but letters, digits and _.,=+- becomes _."""
    return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", name) or "run"
