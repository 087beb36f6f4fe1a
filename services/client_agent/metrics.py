"""The client agent's Prometheus metrics. Labels carry operator-chosen names (client id, environment)
and fixed words (phase, outcome) only, never trajectory text. Kept free of torch so that tools and
tests can list the metrics without loading a model."""

from __future__ import annotations

import prometheus_client

# The identity is a label set, not Info values: an Info without labels serves an unlabelled series
# until it is set, which then clashes with the labelled one in PromQL joins.
INFO = prometheus_client.Info(
    "fedse_client", "The client's identity: its id in the run and its environment (constant, value 1).",
    ["client_id", "env"])
ROUND = prometheus_client.Gauge("fedse_client_round", "The round the client is working on.")
STEPS = prometheus_client.Counter("fedse_client_rollout_steps", "Environment steps taken, by phase.", ["phase"])
EPISODES = prometheus_client.Counter("fedse_client_episodes", "Episodes finished, by phase and outcome.",
                                     ["phase", "outcome"])
KEPT = prometheus_client.Counter("fedse_client_successes_kept", "Successful trajectories added to the buffer.")
# D_0 apart from what exploration kept: where each environment's seed demonstrations came from.
DEMOS = prometheus_client.Gauge(
    "fedse_client_demonstrations",
    "Seed demonstrations (D_0) in the buffer, by environment and source: expert (the environment's expert) "
    "or file (--demos).", ["env", "source"])
# Environments that list no actions: the agent writes its action, parsed from its ReAct text.
WRITTEN = prometheus_client.Counter(
    "fedse_client_written_actions",
    "Actions the agent wrote itself (environments that list no actions), by phase (eval, explore) and "
    "outcome: parsed (the text named an action) or unparsed (it did not, and the model wrote the action "
    "line after the cue \"Action:\").",
    ["phase", "outcome"])
HEARTBEATS = prometheus_client.Counter(
    "fedse_client_heartbeats", "Heartbeats to the aggregator, by outcome: sent (acknowledged) or failed.",
    ["outcome"])
for _outcome in ("sent", "failed"):  # served from the start, 0 until the first beat
    HEARTBEATS.labels(_outcome)
BUFFER = prometheus_client.Gauge("fedse_client_buffer_trajectories", "Trajectories in the buffer.")
LOSS = prometheus_client.Gauge("fedse_client_train_loss", "Mean training loss of the last round.")
TRAIN_SECONDS = prometheus_client.Counter("fedse_client_train_seconds", "Seconds spent training the LoRA.")
TEST_SUCCESS = prometheus_client.Gauge(
    "fedse_client_test_success_ratio", "Held-out success rate of the latest global adapter, by environment.",
    ["env"])
# The client guardian (guardian.py): what it sized, and the rounds its privacy budget declined.
LORA_RANK = prometheus_client.Gauge("fedse_client_lora_rank", "The LoRA rank this client trains (its --lora-r, or "
                                                              "the guardian's choice).")
TRAIN_BATCH_TOKENS = prometheus_client.Gauge(
    "fedse_client_train_batch_tokens", "Tokens per training micro-batch (--train-batch-tokens, or the guardian's "
                                       "choice; 0 = the trainer's default).")
ROUNDS_DECLINED = prometheus_client.Counter(
    "fedse_client_rounds_declined", "Rounds this client declined because its privacy budget (--privacy-epsilon) "
                                    "would be exceeded.")
PRIVACY_EPSILON = prometheus_client.Gauge(
    "fedse_client_privacy_epsilon_spent", "The epsilon this client's uploads have spent of its privacy budget "
                                          "(at --privacy-delta; 0 without a budget).")
# The parts of a round as this client sees it: download the global adapter, evaluate it, explore,
# train, upload, then wait for the round to close (the other clients and the aggregation).
PHASES = ("download", "eval", "explore", "train", "upload", "wait")
PHASE_SECONDS = prometheus_client.Histogram(
    "fedse_client_phase_seconds",
    "Wall time of one phase of a round: download, eval, explore, train, upload, or wait (for the next round).",
    ["phase"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))

# The model's work (work.py): tokens per phase and kind, model FLOPs, and the share of this machine's
# measured matmul peak that they reached.
WORK_PHASES = ("eval", "explore", "train", "other")
TOKENS = prometheus_client.Counter(
    "fedse_client_model_tokens",
    "Tokens through the model, by phase (eval, explore, train, other) and kind: prompt (computed by scoring, "
    "or read by a generation before it writes), cached (served from a reused prefix cache, not computed), "
    "generated, train (forward and backward) and padding (positions computed that hold no token).",
    ["phase", "kind"])
FLOPS = prometheus_client.Counter(
    "fedse_client_model_flops", "Model FLOPs of the tokens computed (padding and recomputation not counted), by "
                                "phase.", ["phase"])
PEAK_FLOPS = prometheus_client.Gauge(
    "fedse_client_peak_flops", "This machine's measured matmul rate (FLOP/s) at the precision the model runs in: "
                               "what MFU is measured against.")
MFU = prometheus_client.Gauge(
    "fedse_client_mfu_ratio", "Model-FLOPs utilisation of the last round's phase: its model FLOPs per second over "
                              "the measured peak.", ["phase"])
for _phase in WORK_PHASES:
    FLOPS.labels(_phase)
    for _kind in ("prompt", "cached", "generated", "train", "padding"):
        TOKENS.labels(_phase, _kind)

for _phase in ("expert", "explore", "eval"):
    STEPS.labels(_phase)
    for _outcome in ("success", "failure"):
        EPISODES.labels(_phase, _outcome)
for _phase in PHASES:
    PHASE_SECONDS.labels(_phase)
for _phase in ("eval", "explore"):
    for _outcome in ("parsed", "unparsed"):
        WRITTEN.labels(_phase, _outcome)


# A client host (services.client_host) runs many clients in one process: the metrics above are then the
# host's (counters add up its members' work; a gauge of one client shows the member that set it last).
HOST_MEMBERS = prometheus_client.Gauge(
    "fedse_client_host_members", "A client host's members by outcome: running (not ended yet), done (their run "
                                 "finished) or failed (0 in a lone client agent).", ["outcome"])
for _outcome in ("running", "done", "failed"):
    HOST_MEMBERS.labels(_outcome)


def init_client(client_id: str, env: str) -> None:
    """Records the client's identity. (The success gauge is not created at zero here: it appears with
    the first evaluation, so a dashboard never shows a success rate nobody measured.)"""
    INFO.labels(client_id, env).info({})
