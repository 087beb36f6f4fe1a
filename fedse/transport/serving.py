"""What every fedse service shares: JSON logs, gRPC server with health and metrics, clean shutdown."""

from __future__ import annotations

import errno
import functools
import json
import logging
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator, NoReturn, Sequence, TypeVar

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedse import __version__
from fedse.config import ConfigError
from fedse.transport.inputs import status_message

R = TypeVar("R")

RPC_SECONDS = prometheus_client.Histogram(
    "grpc_server_handling_seconds",
    "Time to handle a gRPC call, by service, method and status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RPC_HANDLED = prometheus_client.Counter(
    "grpc_server_handled", "gRPC calls completed, by service, method and status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
)

# Servers: messages up to 8 MiB, so that an upload chunk over the stated limit (RunConfig.max_chunk_bytes,
# under 4 MiB) is answered by the aggregator's INVALID_ARGUMENT naming the limit rather than by gRPC's size
# check. Clients keep gRPC's default message limits (4 MiB received): every message fedse sends fits them,
# so fedse's own clients see what a client in any language with stock settings sees.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# No SO_REUSEPORT (gRPC sets it by default on Linux): with it a second server on a taken port binds too,
# and the kernel shares the connections between the two (two aggregators, each with half the clients).
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
# Clients: a channel whose server went away tries to reconnect at least every 5 s (gRPC's backoff grows
# to 120 s), so calls retried while a server restarts find it soon after it is back.
CLIENT_OPTIONS = [("grpc.max_reconnect_backoff_ms", 5000)]


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if extra:
            entry.update(extra)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(service: str, level: str = "INFO") -> None:
    """JSON lines on stdout, the first of them saying which fedse this is."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("fedse").info("starting", extra=log_fields(version=__version__))


def log_fields(**fields: Any) -> dict[str, Any]:
    """`log.info("msg", extra=log_fields(round=3))` adds structured fields to the JSON line."""
    return {"fields": fields}


def _split_method(full: str) -> tuple[str, str]:
    _, service, method = full.split("/", 2)
    return service, method


def _non_blocking(handler: grpc.RpcMethodHandler) -> bool:
    """Whether the method answers through a callback instead of holding a server thread while its
    stream lasts (grpc.health.v1's Watch): a wrapper around it would drop that, and a few Watch
    streams would then hold every thread of the server (its health checks too)."""
    return any(getattr(behavior, "experimental_non_blocking", False)
               for behavior in (handler.unary_stream, handler.stream_stream))


class MetricsInterceptor(grpc.ServerInterceptor):
    """Records latency and outcome of every call, streaming ones included (but a non-blocking
    stream's, passed as it is: _non_blocking)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or _non_blocking(handler):
            return handler
        service, method = _split_method(handler_call_details.method)

        def observe(context: grpc.ServicerContext, start: float, failed: bool) -> None:
            code = context.code() if hasattr(context, "code") else None
            if code is None:
                code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
            name = code.name
            RPC_SECONDS.labels(service, method, name).observe(time.perf_counter() - start)
            RPC_HANDLED.labels(service, method, name).inc()

        def wrap_unary(behavior: Callable) -> Callable:
            def wrapped(request_or_iterator, context):
                start = time.perf_counter()
                try:
                    result = behavior(request_or_iterator, context)
                except BaseException:
                    observe(context, start, True)
                    raise
                observe(context, start, False)
                return result
            return wrapped

        def wrap_stream(behavior: Callable) -> Callable:
            def wrapped(request_or_iterator, context) -> Iterator:
                start = time.perf_counter()
                try:
                    yield from behavior(request_or_iterator, context)
                except BaseException:
                    observe(context, start, True)
                    raise
                observe(context, start, False)
            return wrapped

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            wrap_stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer)


class _Undecodable:
    """What a request that does not parse is decoded to, so the method can refuse it itself."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


class RequestDecoding(grpc.ServerInterceptor):
    """Refuses a request that is not a valid protobuf message of the method's type with INVALID_ARGUMENT
    (gRPC itself answers INTERNAL "Exception deserializing request!", which reads as the server's fault);
    the metrics interceptor counts it."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or _non_blocking(handler):
            return handler
        decode = handler.request_deserializer
        method = handler_call_details.method

        def lenient(data: bytes):
            try:
                return decode(data)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and whatever else parsing raises
                return _Undecodable(exc)

        def checked(request, context):
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the request to {method} is not a valid protobuf message of its type "
                              f"({type(request.error).__name__}): encode it from proto/")
            return request

        def unary(behavior: Callable) -> Callable:
            return lambda request, context: behavior(checked(request, context), context)

        def stream(behavior: Callable) -> Callable:
            return lambda requests, context: behavior((checked(r, context) for r in requests), context)

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                unary(handler.unary_unary), lenient, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                unary(handler.unary_stream), lenient, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                stream(handler.stream_unary), lenient, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            stream(handler.stream_stream), lenient, handler.response_serializer)


class StatusMap:
    """Which gRPC status a domain error gets: the code of the first rule whose kind the error is an
    instance of (list specific kinds before general ones), with the error's text, bounded, as the
    message. Anything else is re-raised (gRPC answers UNKNOWN and logs it). One map per server."""

    def __init__(self, rules: Sequence[tuple[type[BaseException], grpc.StatusCode]]):
        self.rules = list(rules)

    def rule(self, exc: BaseException) -> tuple[type[BaseException], grpc.StatusCode] | None:
        """(kind, status code) of the first rule `exc` falls under, None if none."""
        return next(((kind, code) for kind, code in self.rules if isinstance(exc, kind)), None)

    def abort(self, context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
        rule = self.rule(exc)
        if rule is not None:
            context.abort(rule[1], status_message(str(exc)))
        raise exc

    def wrap(self, method: Callable[..., R]) -> Callable[..., R]:
        """Decorates a unary servicer method: errors it raises are mapped by abort()."""
        @functools.wraps(method)
        def wrapped(servicer, request, context: grpc.ServicerContext) -> R:
            try:
                return method(servicer, request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status or re-raised
                self.abort(context, exc)
        return wrapped


def _bind(server: grpc.Server, address: str, flag: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Adds `address` to the server and returns its bound port; an address another process listens on
    (found first, before gRPC tries and logs its own error lines), or that cannot be bound, raises
    ConfigError naming `flag`."""
    host, _, port = address.rpartition(":")
    if port.isdigit() and int(port) != 0:  # port 0 is always free; a malformed address is gRPC's to refuse
        try:
            resolved = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                          flags=socket.AI_PASSIVE)
        except OSError:
            resolved = []
        for family, kind, proto, _name, where in resolved:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a port in TIME_WAIT is free
                try:
                    probe.bind(where)
                except OSError as exc:
                    if exc.errno == errno.EADDRINUSE:
                        raise ConfigError(f"{flag} {address} cannot be served: another process has its port; give "
                                          "a free port, or port 0 to pick one") from None
    try:
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError:  # grpcio refuses a port it cannot bind (older versions return 0)
        bound = 0
    if bound == 0:
        tls = " (and is --tls-key the private key of --tls-cert?)" if credentials is not None else ""
        raise ConfigError(f"{flag} {address} cannot be served: another process has its port, or it is not "
                          f"host:port{tls}; give a free port, or port 0 to pick one")
    return bound


class HealthServicer(health.HealthServicer):
    """grpc.health.v1 as grpcio-health-checking serves it, except that a Watch stream's end does not
    wait for the servicer's lock.

    The library's `set` holds that lock while it sends each Watch stream the new status and waits
    for each send to complete; a stream's end runs its callback on the gRPC server's one event
    thread, the thread that reports those completions, and the library's callback takes the lock:
    a Watch ending while the status changed (a client cancelling its Watch as the server stopped)
    left both waiting for ever (one stop in four, measured). Here a stream's end removes its
    sender without the lock, and `set` sends to a copy of the senders."""

    def _on_close_callback(self, send_response_callback, service):
        def callback():
            self._send_response_callbacks.get(service, set()).discard(send_response_callback)
            send_response_callback(None)

        return callback

    def set(self, service, status):
        with self._lock:
            if self._gracefully_shutting_down:
                return
            self._server_status[service] = status
            for send in list(self._send_response_callbacks.get(service, ())):
                send(health_pb2.HealthCheckResponse(status=status))


# How often a waiting main thread wakes to run the handlers of signals other threads took.
WAKE_S = 0.5


class Service:
    """A gRPC server with the standard health service and Prometheus interceptor.

    Health starts NOT_SERVING; call `ready()` once the servicers can answer.
    credentials: serve TLS (see fedse.security.admission.server_credentials) instead of plain gRPC.
    interceptors: run after the metrics interceptor, so calls they refuse are still counted.
    A request that does not parse as its method's message is refused with INVALID_ARGUMENT. An
    address that cannot be bound (in use, malformed) raises ConfigError naming the flag.
    health_address: also serve the health service alone, plain, on this address (for Kubernetes'
    native gRPC probes, which cannot speak TLS); `health_port` is its bound port, -1 when unset.
    """

    def __init__(self, name: str, address: str, max_workers: int = 16,
                 credentials: grpc.ServerCredentials | None = None,
                 interceptors: Sequence[grpc.ServerInterceptor] = (), health_address: str = ""):
        self.name = name
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
            interceptors=[MetricsInterceptor(), RequestDecoding(), *interceptors],
            options=GRPC_OPTIONS,
        )
        self.health = HealthServicer()
        # grpc's servicer answers SERVING for "" until told otherwise: not before ready().
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = _bind(self.server, address, "--address", credentials)
        self.health_server: grpc.Server | None = None
        self.health_port = -1
        if health_address:
            self.health_server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{name}-health"),
                interceptors=[MetricsInterceptor()], options=GRPC_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = _bind(self.health_server, health_address, "--health-address")
        self._stopped = threading.Event()

    def start(self) -> None:
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()

    def ready(self, service_names: list[str]) -> None:
        for name in ["", *service_names]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.health_server is not None:
            self.health_server.stop(0).wait()
        self._stopped.set()

    def stop_on_signals(self, grace: float = 5.0) -> None:
        """SIGTERM or SIGINT from now on stops the server gracefully (health goes NOT_SERVING first).
        Entry points call it before they announce their port: a signal sent the moment a process says it
        serves (a supervisor, a test) must find the handler there, not the default action."""

        def on_signal(signum, _frame):
            logging.getLogger(self.name).info("shutting down", extra=log_fields(signal=signum))
            threading.Thread(target=self.stop, args=(grace,), daemon=True).start()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def wait_for_termination(self) -> None:
        """Blocks until the server has stopped (after a signal, with stop_on_signals, or stop()).

        Waits in slices: Python runs a signal's handler in the main thread, and a main thread blocked
        in one untimed wait is woken only if the kernel hands the signal to it; a process-wide signal
        taken by another of the process's threads (gRPC's, on a busy core) leaves it blocked, and the
        process deaf to SIGTERM until SIGKILL (seen once: an env server that never logged "shutting
        down" in 10 s while its core ran another test's processes)."""
        while not self._stopped.wait(WAKE_S):
            pass


# Which fedse a process is: fedse_build_info{version="..."} 1 on every service's /metrics.
BUILD = prometheus_client.Info("fedse_build", "The fedse version this process runs.")
BUILD.info({"version": __version__})


def start_metrics(port: int, address: str = "0.0.0.0") -> int:
    """Serves Prometheus /metrics on port (0 picks one); returns the bound port, or -1 if disabled.
    For entry points: a port that cannot be bound (another service on this machine has it) stops the
    process with one line on stderr saying what to give instead."""
    if port < 0:
        return -1
    try:
        server, _thread = prometheus_client.start_http_server(port, addr=address)
    except OSError as exc:
        print(f"configuration error: --metrics-port {port} cannot be served on {address} ({exc.strerror or exc}): "
              "another process has it (each service on one machine needs its own); give another port, 0 to pick "
              "a free one, or -1 for no metrics", file=sys.stderr)
        raise SystemExit(2) from None
    return server.server_port


def insecure_channel(target: str) -> grpc.Channel:
    """A plain channel with gRPC's default message limits (4 MiB received) and CLIENT_OPTIONS."""
    return grpc.insecure_channel(target, options=CLIENT_OPTIONS)


def secure_channel(target: str, credentials: grpc.ChannelCredentials, target_name_override: str = "") -> grpc.Channel:
    """A TLS channel (credentials from fedse.security.admission.channel_credentials); target_name_override is the
    name to expect in the server's certificate when it differs from the host in target. gRPC's default
    message limits and CLIENT_OPTIONS, as insecure_channel."""
    options = list(CLIENT_OPTIONS)
    if target_name_override:
        options.append(("grpc.ssl_target_name_override", target_name_override))
    return grpc.secure_channel(target, credentials, options=options)
