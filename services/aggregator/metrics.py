"""The aggregator's Prometheus metrics (RPC latency and counts come from fedse.transport.serving's interceptor)."""

from __future__ import annotations

import math
from typing import Callable

import prometheus_client

UPLOADS = prometheus_client.Counter(
    "fedse_aggregator_uploads", "Adapter uploads, by outcome (accepted or the refusal's reason).", ["outcome"])
BYTES_RECEIVED = prometheus_client.Counter("fedse_aggregator_received_bytes", "Adapter bytes received.")
BYTES_SENT = prometheus_client.Counter("fedse_aggregator_sent_bytes", "Adapter bytes sent.")
ROUND = prometheus_client.Gauge("fedse_aggregator_round", "The open round (num_rounds once the run is finished).")
CLIENTS = prometheus_client.Gauge("fedse_aggregator_clients_joined", "Clients that joined the run.")
CLIENTS_ALIVE = prometheus_client.Gauge(
    "fedse_aggregator_clients_alive", "Joined clients heard from within the heartbeat timeout.")
ROUND_SECONDS = prometheus_client.Histogram(
    "fedse_aggregator_round_duration_seconds", "Wall time of a round, from opening to the next round opening.",
    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200))
AGGREGATE_SECONDS = prometheus_client.Histogram(
    "fedse_aggregator_aggregation_seconds", "Time to aggregate a round's uploads and store the global adapter.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
SECURE_STAGE_SECONDS = prometheus_client.Histogram(
    "fedse_aggregator_secure_stage_seconds", "How long each secure-aggregation stage of an attempt stayed open.",
    ["stage"], buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))
SECURE_DROPOUTS_RECOVERED = prometheus_client.Counter(
    "fedse_aggregator_secure_dropouts_recovered",
    "Clients that shared keys but did not upload, whose pairwise masks were rebuilt and removed.")
SECURE_ATTEMPTS_ABORTED = prometheus_client.Counter(
    "fedse_aggregator_secure_attempts_aborted",
    "Secure attempts of a round abandoned because fewer than the threshold took part in a stage (the round "
    "starts again at key advertisement).", ["stage"])
SECURE_ROUNDS_WITHHELD = prometheus_client.Counter(
    "fedse_aggregator_secure_rounds_withheld",
    "Secure rounds closed without an update after their sum was unmasked (it did not decode, with weighted no "
    "uploader succeeded, or the aggregator restarted while unmasking): a round's sum is released once and never "
    "tried again.")
SELECTED = prometheus_client.Gauge(
    "fedse_aggregator_selected_clients",
    "Clients chosen to take part in the open round (--selector other than all; every client otherwise).")
ASYNC_STALENESS = prometheus_client.Histogram(
    "fedse_aggregator_async_staleness",
    "Asynchronous rounds: how many versions behind each folded update was trained (0 = from the version "
    "it was folded into).", buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32))
BUFFER_FILL = prometheus_client.Gauge(
    "fedse_aggregator_async_buffer_fill",
    "Asynchronous rounds: the updates waiting in the open version's buffer (it folds at --async-buffer).")
SELECTOR_FALLBACKS = prometheus_client.Counter(
    "fedse_aggregator_selector_fallbacks",
    "Rounds whose selection is not the selector's own answer (an agent's answer failed its check, or the "
    "selector failed): its fallback chose instead.")
CLIENT_LORA_RANK = prometheus_client.Gauge(
    "fedse_aggregator_client_lora_rank",
    "Each joined client's LoRA rank, as its Join said (mixed ranks: any rank up to --max-lora-rank).",
    ["client_id"])
for _stage in ("advertising", "sharing", "uploading", "consistency", "unmasking"):
    SECURE_STAGE_SECONDS.labels(_stage)
    SECURE_ATTEMPTS_ABORTED.labels(_stage)

# Differential privacy (fedse.privacy.accounting): two names, not a label, since a round's epsilon and the
# total are not parts of one sum.
DP_EPSILON = prometheus_client.Gauge(
    "fedse_aggregator_dp_epsilon",
    "Differential privacy spent: epsilon, at the run's delta, of every round completed so far (+Inf without "
    "clip-norm and noise-multiplier).")
DP_EPSILON_ROUND = prometheus_client.Gauge(
    "fedse_aggregator_dp_epsilon_per_round",
    "Differential privacy of one round: epsilon at the run's delta (+Inf without clip-norm and noise-multiplier).")
DP_RELEASES = prometheus_client.Gauge(
    "fedse_aggregator_dp_releases", "Rounds completed, each one release that the privacy accounting counts.")
DP_EPSILON.set(math.inf)
DP_EPSILON_ROUND.set(math.inf)


def serve_privacy(account: Callable[[], tuple[float, float, int]]) -> None:
    """Serves the privacy gauges from `account()` = (epsilon of a round, epsilon in total, releases), called
    at each scrape: they follow the run without anyone setting them when a round closes."""
    DP_EPSILON_ROUND.set_function(lambda: account()[0])
    DP_EPSILON.set_function(lambda: account()[1])
    DP_RELEASES.set_function(lambda: account()[2])
