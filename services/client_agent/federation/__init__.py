"""Talking to the federation: joining, following rounds and resumable adapter transfers (link),
heartbeats (heartbeat), the adapters it downloads and uploads, at its own rank and the run's
(exchange), the client's part in secure aggregation (secure), what it checks of an attempt before
taking part (secure_checks) and what it has released (releases)."""
