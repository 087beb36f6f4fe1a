"""The AgentGym bridge's HTTP transport (see agentgym.py): one episode's calls to an AgentGym env server,
with every failure mapped to fedse.env's exceptions, and the failures the bridge tells apart."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import requests

from fedse.env import EnvironmentFailed, EnvironmentUnavailable

if TYPE_CHECKING:
    from .agentgym import AgentGymEnvironment

# How much of a server's words an error message quotes.
MAX_QUOTE_CHARS = 300


# ---------------------------------------------------------------- errors

class NoRoute(EnvironmentFailed):
    """The server has no such route (HTTP 404 or 405): not this profile's server, or an older version."""


class HttpError(EnvironmentFailed):
    """The server answered an HTTP error status (webshop's way of failing)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class IdUnknown(EnvironmentFailed):
    """The server does not know the remote id (it restarted since, or the id was closed)."""


class TimedOut(EnvironmentUnavailable):
    """No answer within the timeout: the call may or may not have been applied."""


# How AgentGym's servers say they do not know an id: "The id 3 is not valid.", "The task with
# environment 3 has been deleted.", or a bare KeyError's text ("3").
_UNKNOWN_ID = re.compile(r"\bid -?\d+ is not valid|has been deleted|^\s*(KeyError:?\s*)?'?-?\d+'?\s*$", re.I)
_WHY = (re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)"), re.compile(r"RemoteDisconnected\('([^']+)'"),
        re.compile(r"(Connection (?:refused|reset by peer|aborted))"))


def quote(text: str) -> str:
    text = " ".join(str(text).split())
    return '"' + (text if len(text) <= MAX_QUOTE_CHARS else text[:MAX_QUOTE_CHARS - 3] + "...") + '"'


def _why(exc: BaseException) -> str:
    """A connection failure in a few words ("Connection refused"), not urllib3's paragraph."""
    text = str(exc)
    for pattern in _WHY:
        m = pattern.search(text)
        if m:
            return m[1].strip().rstrip(".")
    return type(exc).__name__


# ---------------------------------------------------------------- HTTP

class Remote:
    """HTTP calls to the server for one episode (one requests.Session, used under the episode's lock),
    with every failure mapped to the public exceptions."""

    def __init__(self, env: "AgentGymEnvironment"):
        self.env = env
        self.session = requests.Session()
        # A new connection a call: a kept-alive one the server drops while idle (uvicorn does after 5 s)
        # would fail a call as if the server had gone, and lose every episode.
        self.session.headers["Connection"] = "close"

    def post(self, path: str, body: dict[str, Any] | None, what: str) -> Any:
        return self.call("POST", path, what, body=body)

    def get(self, path: str, params: dict[str, Any] | None, what: str) -> Any:
        return self.call("GET", path, what, params=params)

    def call(self, method: str, path: str, what: str, body: dict[str, Any] | None = None,
             params: dict[str, Any] | None = None) -> Any:
        env = self.env
        route = env.profile.prefix + path
        try:
            resp = self.session.request(method, env.url + route, json=body, params=params,
                                        timeout=(env.timeout_s, env.timeout_s))
        except requests.ConnectTimeout:
            raise EnvironmentUnavailable(env.unreachable(f"no connection within {env.timeout_s:g} s")) from None
        except requests.ReadTimeout:
            raise TimedOut(f"{env.server} did not answer {what} ({method} {route}) within {env.timeout_s:g} s "
                            "(raise timeout_s if it is slow)") from None
        except requests.ConnectionError as exc:
            # It may be restarting: every episode begun before is treated as lost (see the module doc).
            env.lost_contact()
            raise EnvironmentUnavailable(env.unreachable(_why(exc))) from None
        except requests.RequestException as exc:
            raise EnvironmentFailed(f"{env.server}: {what} failed: {type(exc).__name__}: {quote(str(exc))}") from None
        status = resp.status_code
        if status in (404, 405):
            raise NoRoute(f"{env.server} has no route {method} {route} (HTTP {status}): is {env.url} an AgentGym "
                           f"{env.profile.name} server?")
        if status in (502, 503, 504):
            raise EnvironmentUnavailable(env.unreachable(f"it answered {what} with HTTP {status}"))
        if status != 200:
            raise HttpError(f"{env.server} refused {what}: HTTP {status}: {quote(resp.text)}", status)
        try:
            data = resp.json()
        except ValueError:
            raise EnvironmentFailed(f"{env.server} answered {what} with something that is not JSON: "
                                    f"{quote(resp.text)}") from None
        if isinstance(data, dict) and "error" in data:
            said = str(data["error"])
            kind = IdUnknown if _UNKNOWN_ID.search(said) else EnvironmentFailed
            raise kind(f"{env.server} refused {what}: {quote(said)}")
        return data

    def field(self, data: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
        """data[key], checked to be of `kind` (EnvironmentFailed naming what came instead)."""
        value = data.get(key) if isinstance(data, dict) else None
        if not isinstance(value, kind) or (kind in (int, (int, float)) and isinstance(value, bool)):
            raise EnvironmentFailed(f"{self.env.server} answered {what} without a valid {key!r} field: "
                                    f"{quote(json.dumps(data, default=str))}; is it an AgentGym "
                                    f"{self.env.profile.name} server?")
        return value

    def close(self) -> None:
        self.session.close()

