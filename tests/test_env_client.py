"""The client's env server calls when the server goes away, against a real env server on port 0:
retries with backoff while it is unavailable (bounded in all), a session the server no longer holds
or an action applied twice ends the episodes (SessionLost) with nothing kept and the other sessions
closed. The whole agent against a SIGKILLed, restarted env server: tests/test_resilience.py."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from fedse.transport.serving import Service
from fedse.v1 import env_pb2_grpc
from services.client_agent.playing.envclient import EnvClient, Session, SessionLost
from services.client_agent.playing.rollout import run_episodes
from services.env_server.envs.maze import MazeEnv
from services.env_server.registry import make_environment
from services.env_server.servicer import SERVICE_NAME, EnvServicer
from services.env_server.sessions import SessionManager
from support import free_ports


class LoseReplies(grpc.ServerInterceptor):
    """Step calls are applied, then answered UNAVAILABLE, `count` times (a reply lost on the wire)."""

    def __init__(self, count: int):
        self.count = count

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if not details.method.endswith("/Step"):
            return handler

        def step(request, context):
            reply = handler.unary_unary(request, context)
            if self.count > 0:
                self.count -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset after the action was applied")
            return reply
        return grpc.unary_unary_rpc_method_handler(step, handler.request_deserializer, handler.response_serializer)


def serve(port: int = 0, lose: int = 0) -> tuple[Service, SessionManager]:
    """A maze env server on `port` whose Step replies are lost `lose` times."""
    manager = SessionManager({"maze": make_environment("maze", seed=0)})
    service = Service("env_server", f"127.0.0.1:{port}", interceptors=[LoseReplies(lose)] if lose else [])
    env_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(manager), service.server)
    service.start()
    service.ready([SERVICE_NAME])
    return service, manager


def first_moves(states):
    return [s.observation.actions[0] for s in states]


def test_an_action_retried_after_its_reply_was_lost_is_caught_and_nothing_is_kept():
    server, manager = serve(lose=1)
    env = EnvClient(f"127.0.0.1:{server.port}", "maze", retry_s=10, backoff_s=0.01)
    try:
        with pytest.raises(SessionLost, match="applied twice"):
            run_episodes(env, [0, 1, 2], first_moves, concurrency=3, round_=0, source="explore")
        assert manager.open_sessions == 0  # every live session was closed, none left to expire
        # Without lost replies the same episodes play to their end, two at a time, and after every step
        # the rollout tells how many turns were played and how many can be left at most.
        turns: list[tuple[int, int]] = []
        trajs = run_episodes(env, [0, 1, 2], first_moves, concurrency=2, round_=0, source="explore",
                             on_turns=lambda played, most_left: turns.append((played, most_left)))
        assert [t.task_id for t in trajs] and all(t.turns for t in trajs)
        limit = MazeEnv.max_turns
        assert turns[0] == (2, 2 * (limit - 1) + limit)  # two live episodes one turn in, one task to start
        assert turns[-1] == (sum(len(t.turns) for t in trajs), 0)
        assert all(b[0] > a[0] and b[1] < a[1] for a, b in zip(turns, turns[1:]))
    finally:
        env.close_channel()
        server.stop(0)


def test_a_session_the_server_lost_ends_the_episodes_and_closing_it_is_harmless():
    server, _ = serve()
    env = EnvClient(f"127.0.0.1:{server.port}", "maze", retry_s=10, backoff_s=0.01)
    try:
        gone = Session("0" * 32, 7, "", 15)
        with pytest.raises(SessionLost, match="NOT_FOUND"):
            env.step(gone, "move up")
        with pytest.raises(SessionLost):
            env.expert_action(gone)
        env.close(gone)  # closed already, as far as the client cares
    finally:
        env.close_channel()
        server.stop(0)


def test_calls_wait_for_a_server_that_comes_back_and_give_up_after_retry_s():
    (port,) = free_ports(1)
    env = EnvClient(f"127.0.0.1:{port}", "maze", retry_s=1.0, backoff_s=0.05, max_backoff_s=0.2)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        env.reset(0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and 1.0 <= time.monotonic() - started < 5.0
    env.close_channel()

    env = EnvClient(f"127.0.0.1:{port}", "maze", retry_s=30.0, backoff_s=0.05, max_backoff_s=0.5)
    servers = []
    timer = threading.Timer(1.5, lambda: servers.append(serve(port)[0]))
    timer.start()
    try:
        session, obs = env.reset(0)  # refused for 1.5 s, then served
        assert session.session_id and obs.actions
    finally:
        timer.join()
        env.close_channel()
        for s in servers:
            s.stop(0)
