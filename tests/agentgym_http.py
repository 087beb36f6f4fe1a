"""The HTTP plumbing of the small AgentGym-like env servers (agentgym_servers.py): a server on
127.0.0.1 in a thread, its routes with FastAPI-like validation (404 for a route it lacks, 422 for a
body without a field the route requires), errors as AgentGym's servers give them, `restart()` (a fresh
"process" on the same port) and `stop()`, and every call recorded (`calls`), two calls on one id at
once in `overlaps`.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


class Raw:
    """A non-JSON answer (webshop's "Internal Server Error")."""

    def __init__(self, status: int, text: str):
        self.status, self.text = status, text


class Route:
    def __init__(self, handler: Callable[..., Any], fields: tuple[str, ...] = (), ints: tuple[str, ...] = (),
                 optional: dict[str, Any] | None = None, body: bool = True):
        self.handler = handler
        self.fields = fields            # required, in the body (POST) or the query (GET)
        self.ints = ints                # those that must be integers
        self.optional = optional or {}  # with their defaults
        self.body = body                # a POST whose model needs a JSON object body


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    app: "AgentGymServer"

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up waiting (a timeout test) is no error of the server's


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.server.app.handle(self, "GET")  # type: ignore[attr-defined]

    def do_POST(self) -> None:  # noqa: N802
        self.server.app.handle(self, "POST")  # type: ignore[attr-defined]


class AgentGymServer:
    """The HTTP plumbing: routes, FastAPI-like validation, the calls and overlaps recorded."""

    id_field = "id"
    prefix = ""

    def __init__(self, delay_s: float = 0.0):
        self.port = 0
        self.delay_s = delay_s          # each call on an id takes at least this long (to provoke overlaps)
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.overlaps: list[tuple[str, int]] = []
        self.closed: list[int] = []
        self._lock = threading.Lock()
        self._busy: dict[tuple[str, int], int] = {}
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.fresh()

    # -- life

    def fresh(self) -> None:
        """The state of a just-started server process."""
        self.envs: dict[int, dict[str, Any]] = {}
        self.next_id = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "AgentGymServer":
        httpd = _HTTPServer(("127.0.0.1", self.port), _Handler)
        httpd.app = self
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join()
            self._httpd = None

    def restart(self) -> None:
        """A new server process on the same port: nothing of the old one's environments survives."""
        self.stop()
        self.fresh()
        self.start()

    def __enter__(self) -> "AgentGymServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def routes(self) -> dict[tuple[str, str], Route]:
        raise NotImplementedError

    def count(self, path: str) -> int:
        return sum(1 for _, p, _ in self.calls if p == self.prefix + path)

    # -- requests

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        parsed = urllib.parse.urlsplit(h.path)
        path = parsed.path
        args: dict[str, Any] = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query).items()}
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0)) if method == "POST" else b""
        routes = self.routes()
        route = routes.get((method, path))
        if route is None:
            self.calls.append((method, path, {}))
            if any(p == path for _, p in routes):
                return self._send(h, 405, {"detail": "Method Not Allowed"})
            return self._send(h, 404, {"detail": "Not Found"})
        if method == "POST" and (raw or route.body):
            try:
                body = json.loads(raw or b"null")
            except ValueError:
                return self._send(h, 422, {"detail": [{"loc": ["body"], "msg": "invalid JSON"}]})
            if not isinstance(body, dict):
                return self._send(h, 422, {"detail": [{"loc": ["body"], "msg": "field required"}]})
            args = body
        for name in route.fields:
            if name not in args:
                where = "body" if method == "POST" else "query"
                return self._send(h, 422, {"detail": [{"loc": [where, name], "msg": "field required"}]})
        for name in route.ints:
            try:
                args[name] = int(args[name]) if not isinstance(args[name], bool) else None
            except (TypeError, ValueError):
                args[name] = None
            if args[name] is None:
                return self._send(h, 422, {"detail": [{"loc": [name], "msg": "value is not a valid integer"}]})
        for name, default in route.optional.items():
            args.setdefault(name, default)
        self.calls.append((method, path, dict(args)))
        rid = args.get(self.id_field) if self.id_field in route.fields else None
        key = (path.rsplit("/", 1)[0], rid)  # lmrlgym: maze and wordle number their ids apart
        if rid is not None:
            with self._lock:
                if self._busy.get(key):
                    self.overlaps.append((path, rid))
                self._busy[key] = self._busy.get(key, 0) + 1
        try:
            if self.delay_s and rid is not None:
                time.sleep(self.delay_s)
            try:
                result = route.handler(**{k: v for k, v in args.items()
                                          if k in route.fields or k in route.optional})
            except Exception:  # noqa: BLE001 - an unhandled error: a wordless 500, as uvicorn answers
                result = Raw(500, "Internal Server Error")
        finally:
            if rid is not None:
                with self._lock:
                    self._busy[key] -= 1
        if isinstance(result, Raw):
            return self._send(h, result.status, result.text)
        self._send(h, 200, result)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
        if isinstance(payload, str) and status != 200:
            data, kind = payload.encode(), "text/plain; charset=utf-8"
        else:
            data, kind = json.dumps(payload).encode(), "application/json"
        h.send_response(status)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    # -- AgentGym's usual bookkeeping

    def new_id(self) -> int:
        with self._lock:
            rid = self.next_id
            self.next_id += 1
        return rid

    def check(self, rid: int, resetting: bool = False, refuse_done: bool = True) -> dict[str, Any]:
        """AgentGym's _check_id: raises what its servers then answer as {"error": ...}."""
        if rid not in self.envs:
            raise ValueError(f"The id {rid} is not valid.")
        env = self.envs[rid]
        if env.get("deleted"):
            raise ValueError(f"The task with environment {rid} has been deleted.")
        if refuse_done and not resetting and env.get("done"):
            raise ValueError(f"The task with environment {rid} has finished.")
        return env

    def guarded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Errors as HTTP 200 {"error": "..."}, as AgentGym's servers answer them."""
        def wrapped(**kwargs: Any) -> Any:
            try:
                return fn(**kwargs)
            except Exception as exc:  # noqa: BLE001
                return {"error": str(exc)}
        return wrapped

    def create(self) -> Any:
        """POST /create as babyai, sciworld and alfworld answer it: a new id and nothing else."""
        rid = self.new_id()
        self.envs[rid] = {"deleted": False, "done": False}
        return {"id": rid}

    def close_env(self, id: int) -> Any:  # noqa: A002 - AgentGym's field name
        env = self.check(id, resetting=True)
        env["deleted"] = True
        self.closed.append(id)
        return {"closed": True}
