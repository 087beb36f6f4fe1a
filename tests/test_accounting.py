"""The differential-privacy accountant: zCDP of the Gaussian mechanism (Bun and Steinke 2016) against
hand-computed values, its composition over rounds, the inputs it refuses, and what a real aggregator
reports over gRPC (RunStatus, `fedse status`) and as metrics before and after rounds close."""

from __future__ import annotations

import math

import prometheus_client
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from apps.cli import format_status
from fedse.model import adapter as ad
from fedse.privacy.accounting import epsilon, epsilons, zcdp_rho
from fedse.config import ConfigError
from fedse.v1 import federation_pb2 as fpb
from services.aggregator.server import AggregatorConfig
from services.client_agent.federation.link import FederationClient
from support import aggregator_in_process

LN_1E5 = 11.512925464970229  # ln(1e5)


def test_one_release_matches_the_hand_computed_value():
    assert zcdp_rho(1.0) == 0.5
    assert zcdp_rho(2.0) == 0.125
    # rho = 0.5, delta = 1e-5: 0.5 + 2 sqrt(0.5 ln 1e5) = 0.5 + 2 * 2.39926... = 5.29853
    assert epsilon(0.5, 1e-5) == pytest.approx(0.5 + 2 * math.sqrt(0.5 * LN_1E5), rel=1e-12)
    assert epsilon(0.5, 1e-5) == pytest.approx(5.2985259, abs=1e-6)
    assert epsilons(1.0, 1, 1e-5) == pytest.approx((5.2985259, 5.2985259), abs=1e-6)


def test_rounds_compose_by_adding_rho():
    for z in (0.5, 1.0, 3.0):
        per_round, _ = epsilons(z, 1, 1e-6)
        for r in (0, 1, 2, 10, 1000):
            assert epsilons(z, r, 1e-6) == pytest.approx((per_round, epsilon(r * zcdp_rho(z), 1e-6)), rel=1e-12)
    assert epsilons(1.0, 0, 1e-5)[1] == 0.0  # nothing released, nothing spent
    # Composition is sublinear in epsilon: 4 rounds cost less than 4 times one.
    assert epsilons(1.0, 4, 1e-5)[1] < 4 * epsilons(1.0, 1, 1e-5)[0]


def test_more_noise_fewer_rounds_or_a_larger_delta_cost_less():
    zs = [0.3, 0.5, 1.0, 2.0, 5.0, 20.0]
    per_round = [epsilons(z, 3, 1e-5)[0] for z in zs]
    total = [epsilons(z, 3, 1e-5)[1] for z in zs]
    assert per_round == sorted(per_round, reverse=True) and total == sorted(total, reverse=True)
    assert [epsilons(1.0, r, 1e-5)[1] for r in range(6)] == sorted(epsilons(1.0, r, 1e-5)[1] for r in range(6))
    assert epsilon(0.5, 1e-3) < epsilon(0.5, 1e-5) < epsilon(0.5, 1e-9)


def test_bad_inputs_are_refused():
    for delta in (0.0, 1.0, -1e-5, 1.5, math.nan):
        with pytest.raises(ValueError, match="delta"):
            epsilons(1.0, 1, delta)
    for z in (-1.0, math.nan):
        with pytest.raises(ValueError, match="noise multiplier"):
            zcdp_rho(z)
    with pytest.raises(ValueError, match="releases"):
        epsilons(1.0, -1, 1e-5)
    with pytest.raises(ValueError, match="rho"):
        epsilon(-0.1, 1e-5)
    assert zcdp_rho(0.0) == math.inf and epsilon(math.inf, 1e-5) == math.inf  # no noise: no privacy
    for delta in (0.0, 1.0, -0.5):
        with pytest.raises(ConfigError, match="--dp-delta"):
            AggregatorConfig(dp_delta=delta)


# ---- a real aggregator over gRPC ---------------------------------------------------------------------
CONFIG_JSON = '{"peft_type": "LORA", "r": 4}'
BASE = {f"base_model.model.layer{i}.lora_{ab}.weight": torch.zeros(4, 8) for i in range(2) for ab in "AB"}


def gauge(name: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name)


def run_status(client: FederationClient) -> fpb.RunStatus:
    return client.stub.GetRunStatus(fpb.RunStatusRequest(), timeout=10)


def play_round(clients: list[FederationClient], round_: int) -> None:
    for i, c in enumerate(clients):
        c.upload(round_, ad.encode({k: v + 0.01 * (i + 1) for k, v in BASE.items()}), num_examples=1, num_successes=1)
    clients[0].wait_until(lambda s: s.round > round_, timeout_s=30)


def joined(port: int) -> list[FederationClient]:
    clients = [FederationClient(f"127.0.0.1:{port}", cid) for cid in ("org-a", "org-b")]
    for c in clients:
        c.join("maze", "tiny", ad.Schema.of(BASE, CONFIG_JSON))
    return clients


def test_a_noisy_run_reports_its_epsilon_per_round_and_in_total(tmp_path):
    z, delta = 2.0, 1e-6
    settings = dict(strategy="fedavg", clip_norm=1.0, noise_multiplier=z, dp_delta=delta, round_deadline_s=60.0)
    per_round = epsilon(1 / (2 * z * z), delta)
    with aggregator_in_process(tmp_path, **settings) as (_agg, port, _run_dir):
        clients = joined(port)
        st = run_status(clients[0])
        assert (st.dp_accounted, st.dp_releases, st.dp_epsilon_total) == (True, 0, 0.0)
        assert st.dp_epsilon_round == pytest.approx(per_round) and st.config.dp_delta == delta
        assert (gauge("fedse_aggregator_dp_epsilon"), gauge("fedse_aggregator_dp_releases")) == (0.0, 0.0)
        assert gauge("fedse_aggregator_dp_epsilon_per_round") == pytest.approx(per_round)

        play_round(clients, 0)
        st = run_status(clients[0])
        assert (st.dp_releases, st.round.round) == (1, 1)
        assert st.dp_epsilon_total == pytest.approx(per_round)
        assert gauge("fedse_aggregator_dp_releases") == 1.0
        assert gauge("fedse_aggregator_dp_epsilon") == pytest.approx(per_round)

        play_round(clients, 1)
        st = run_status(clients[0])
        total = epsilon(2 / (2 * z * z), delta)
        assert st.round.state == fpb.ROUND_STATE_FINISHED and st.dp_releases == 2
        assert st.dp_epsilon_total == pytest.approx(total)
        assert gauge("fedse_aggregator_dp_epsilon") == pytest.approx(total)
        assert gauge("fedse_aggregator_dp_releases") == 2.0
        served = {s.name: s.value for f in text_string_to_metric_families(prometheus_client.generate_latest().decode())
                  for s in f.samples if s.name.startswith("fedse_aggregator_dp_")}
        assert served == pytest.approx({"fedse_aggregator_dp_epsilon": total, "fedse_aggregator_dp_releases": 2,
                                        "fedse_aggregator_dp_epsilon_per_round": per_round})
        assert f"privacy: epsilon {per_round:.3g} per round, {total:.3g} after 2 rounds (delta 1e-06)" \
            in format_status(st)
        for c in clients:
            c.close()
    # Restarted on its state directory, the aggregator counts the same releases.
    with aggregator_in_process(tmp_path, **settings) as (_agg, port, _run_dir):
        c = FederationClient(f"127.0.0.1:{port}", "operator")
        st = run_status(c)
        assert st.dp_releases == 2 and st.dp_epsilon_total == pytest.approx(total)
        assert gauge("fedse_aggregator_dp_releases") == 2.0
        c.close()


def test_a_run_without_noise_is_not_accounted(tmp_path):
    # Clipping alone bounds a client's influence but hides nothing: no privacy to report.
    with aggregator_in_process(tmp_path, clip_norm=1.0, round_deadline_s=60.0) as (_agg, port, _run_dir):
        clients = joined(port)
        play_round(clients, 0)
        st = run_status(clients[0])
        assert (st.dp_accounted, st.dp_releases, st.dp_epsilon_round, st.dp_epsilon_total) == (False, 0, 0.0, 0.0)
        assert "privacy" not in format_status(st)
        assert gauge("fedse_aggregator_dp_epsilon") == math.inf
        assert gauge("fedse_aggregator_dp_epsilon_per_round") == math.inf
        assert gauge("fedse_aggregator_dp_releases") == 1.0  # rounds completed, accounted or not
        for c in clients:
            c.close()
