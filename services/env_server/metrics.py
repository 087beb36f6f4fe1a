"""Prometheus metrics of the env server. Labels carry environment names only, never episode text."""

from __future__ import annotations

import prometheus_client

OPEN_SESSIONS = prometheus_client.Gauge(
    "fedse_env_open_sessions", "Sessions open now (finished but not yet closed ones included), by environment.",
    ["env"],
)
STEPS = prometheus_client.Counter(
    "fedse_env_steps", "Actions taken, by environment.", ["env"],
)
INVALID_ACTIONS = prometheus_client.Counter(
    "fedse_env_invalid_actions", "Actions that were not admissible (the turn was still used), by environment.",
    ["env"],
)
EPISODES_FINISHED = prometheus_client.Counter(
    "fedse_env_episodes_finished",
    "Episodes that ended, by environment and outcome (success, failure, truncated at the turn limit).",
    ["env", "outcome"],
)
SESSIONS_EXPIRED = prometheus_client.Counter(
    "fedse_env_sessions_expired", "Sessions closed by the server after idling past the TTL, by environment.",
    ["env"],
)


def init_env(env: str, outcomes: tuple[str, ...]) -> None:
    """Creates every series of an environment at zero, so dashboards and rate() see it from the start."""
    OPEN_SESSIONS.labels(env)
    STEPS.labels(env)
    INVALID_ACTIONS.labels(env)
    SESSIONS_EXPIRED.labels(env)
    for outcome in outcomes:
        EPISODES_FINISHED.labels(env, outcome)
