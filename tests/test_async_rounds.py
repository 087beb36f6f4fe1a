"""Asynchronous buffered rounds (--mode async, FedBuff) on a hand-driven clock: training slots, the
buffer folding into versions, staleness weights and refusals, a restart, and K = B = every client
giving the synchronous result byte for byte."""

from __future__ import annotations

import math

import pytest
import torch

from fedse.model import adapter as ad
from fedse.v1 import federation_pb2 as fpb
from services.aggregator.errors import StaleRound
from services.aggregator.rounds import RoundKeeper
from services.aggregator.state import State
from services.aggregator.store import Store
from services.aggregator.uploads import UploadHeader
from test_rounds import A, B, Clock, adapter_bytes, federation, join, settings, settle


def asynchronous(tmp_path, clock, **kw) -> RoundKeeper:
    return federation(tmp_path, clock, mode="async", **kw)


def send(fed: RoundKeeper, client: str, base: int, value: float) -> None:
    """`client` uploads an adapter of `value`s trained from version `base`."""
    data = adapter_bytes(value)
    h = UploadHeader(client, base, fed.status().round_nonce, ad.sha256_hex(data), len(data))
    done, _, gen = fed.begin_upload(h)
    if not done:
        fed.receive(h, gen, 0, data)
        fed.finish_upload(h, gen)
        fed.end_stream(h, gen)
    settle(fed)


def version(tmp_path, v: int) -> dict[str, torch.Tensor]:
    return ad.decode(Store(tmp_path, "r").load_global(v))


def test_every_client_every_version_is_the_synchronous_run_byte_for_byte(tmp_path):
    clients = ("a", "b", "c")
    values = {0: (1.0, 2.0, 4.0), 1: (-1.0, 0.5, 3.0), 2: (0.25, 0.125, 8.0)}
    runs = {}
    for mode in ("sync", "async"):
        clock = Clock()
        fed = federation(tmp_path / mode, clock, mode=mode, start_clients=3)
        join(fed, *clients)
        for v, vals in values.items():
            assert fed.status().round == v
            for cid, value in zip(clients, vals):
                send(fed, cid, v, value)
        assert fed.status().state is State.FINISHED
        runs[mode] = [Store(tmp_path / mode, "r").load_global(v) for v in range(4)]
    assert runs["async"] == runs["sync"]


def test_slots_go_to_waiting_clients_and_a_client_trains_once_from_a_version(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, start_clients=3, async_concurrency=2, async_buffer=2)
    join(fed, "a", "b", "c")
    assert fed.status().selected == ("a", "b")  # two slots: the first two in order
    send(fed, "a", 0, 1.0)
    assert fed.status().selected == ("b", "c")  # a's slot went to c; a waits for a newer version
    _, views, _, _ = fed.run_view()
    assert {v.client_id: v.selection_reason for v in views}["a"] == "its update from version 0 waits in the buffer"
    send(fed, "c", 0, 3.0)  # the buffer of two is full: version 1, and a is given a slot again
    st = fed.status()
    assert st.round == 1 and st.selected == ("a", "b")  # b still trains from version 0; a waited longest
    assert torch.equal(version(tmp_path, 1)[A], torch.full((2, 3), 2.0))  # every update from version 0: the mean


def test_a_stale_update_is_weighted_down_and_one_too_stale_is_refused(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, start_clients=3, async_concurrency=3, async_buffer=1, async_max_staleness=1)
    join(fed, "a", "b", "c")
    phi0 = version(tmp_path, 0)
    send(fed, "a", 0, 1.0)  # version 1 = a's adapter
    send(fed, "b", 0, 3.0)  # one version behind: version 2 = phi_1 + (x_b - phi_0) / sqrt(2)
    assert fed.status().round == 2
    expected = {k: (version(tmp_path, 1)[k].double() + (torch.full_like(phi0[k], 3.0).double() - phi0[k].double())
                    / math.sqrt(2)).float() for k in (A, B)}
    got = version(tmp_path, 2)
    assert all(torch.allclose(got[k], expected[k]) for k in (A, B))
    with pytest.raises(StaleRound, match="trained from version 0 is 2 versions behind .* at most 1 behind "
                                         "\\(--async-max-staleness\\): download version 2 and train again"):
        send(fed, "c", 0, 5.0)
    assert fed.status().round == 2  # nothing folded


def test_a_restart_keeps_the_buffer_and_the_slots(tmp_path):
    clock = Clock()
    kw = dict(mode="async", start_clients=3, async_concurrency=3, async_buffer=2)
    fed = federation(tmp_path, clock, **kw)
    join(fed, "a", "b", "c")
    send(fed, "a", 0, 1.0)
    again = RoundKeeper(settings(**kw), Store(tmp_path, "r"), clock=clock)
    assert again.status().selected == ("b", "c") and "a" in again._buffer_locked()
    send(again, "a", 0, 1.0)  # a repeated upload is acknowledged, not counted twice
    assert again.status().round == 0
    send(again, "b", 0, 3.0)
    assert again.status().round == 1 and torch.equal(version(tmp_path, 1)[A], torch.full((2, 3), 2.0))


def test_a_buffer_nobody_can_fill_folds_with_what_it_has(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, start_clients=2, async_concurrency=2, async_buffer=2)
    join(fed, "a", "b")
    send(fed, "a", 0, 1.0)
    clock.now += 11  # b stops answering (10 s timeout); a has no newer version to train from
    fed.seen("a", 0, "waiting")
    fed.tick()
    settle(fed)
    assert fed.status().round == 1 and fed.run.members["b"].dropouts == 1


@pytest.mark.parametrize("flags,message", [
    (dict(secure_aggregation=True), "--mode async cannot work with --secure-aggregation: a buffer mixes updates"),
    (dict(strategy="median"), "use --strategy fedavg, not median"),
    (dict(selector="sample", clients_per_round=2), "leave it at all, or use --mode sync"),
    (dict(async_concurrency=2, async_buffer=3), "--async-buffer 3 is more than --async-concurrency 2"),
    (dict(clip_norm=1.0), "does not clip or add noise"),
])
def test_what_async_rounds_cannot_do_is_refused_at_start_up(flags, message):
    from fedse.config import ConfigError
    from services.aggregator.server import AggregatorConfig

    with pytest.raises(ConfigError, match=message):
        AggregatorConfig(mode="async", **flags)


def test_a_client_agent_whose_update_went_stale_trains_again_from_the_newest_version(tmp_path):
    """A real client agent (org-a) and a scripted client (org-b), buffers of one, no staleness allowed:
    org-b's upload makes version 1 while org-a trains from version 0, so org-a's upload is refused as
    stale; org-a trains again from version 1, and its upload makes the final version 2."""
    import json
    import threading

    from services.client_agent.agent import ClientAgent
    from services.client_agent.federation.link import FederationClient
    from support import aggregator_in_process, env_server_in_process, join_with_phi0
    from test_client_progress import agent_config

    with env_server_in_process() as env_target, aggregator_in_process(
            tmp_path / "agg", min_clients=1, start_clients=2, mode="async", async_concurrency=2, async_buffer=1,
            async_max_staleness=0) as (_agg, port, run_dir):
        target = f"127.0.0.1:{port}"
        agent = ClientAgent(agent_config(env_target, target, tmp_path / "clients", explore_tasks=2, eval_tasks=1,
                                         expert_demos=2))
        b = FederationClient(target, "org-b", retries=2, backoff_s=0.1)
        real_train, training = agent.train, threading.Event()

        def train(round_):  # version 0's training ends after org-b's upload made version 1
            if round_ == 0:
                training.set()
                b.wait_until(lambda s: s.round >= 1, timeout_s=60)
            return real_train(round_)
        agent.train = train
        out: list = []
        runner = threading.Thread(target=lambda: out.append(agent.run()))
        runner.start()
        phi0 = join_with_phi0(b, "maze", agent.cfg.base_model)  # org-a joined first
        assert training.wait(60)
        b.upload(0, phi0.data, num_examples=1, num_successes=1)
        runner.join(timeout=120)
        agent.close()
        history = out[0]
        assert [int(r["round"]) for r in history] == [0, 1, 2]
        assert history[0]["upload_stale"] == 1.0 and "upload_stale" not in history[1]
        assert b.status().state == fpb.ROUND_STATE_FINISHED
        accepted = {(json.loads(p.read_text())["base"], p.stem) for p in run_dir.glob("uploads/*/*.json")
                    if not p.name.endswith(".part.json")}
        assert accepted == {(0, "org-b"), (1, "org-a")}
        b.close()


def test_over_grpc_the_run_says_who_trains_and_fedse_status_shows_it(tmp_path):
    from apps.cli import format_status
    from services.client_agent.federation.link import FederationClient
    from support import aggregator_in_process

    state = {A: torch.zeros(2, 3), B: torch.zeros(3, 2)}
    with aggregator_in_process(tmp_path, min_clients=1, start_clients=3, mode="async", async_concurrency=2,
                               async_buffer=2, async_max_staleness=3) as (_agg, port, _):
        clients = [FederationClient(f"127.0.0.1:{port}", cid, retries=2, backoff_s=0.1) for cid in ("x", "y", "z")]
        for c in clients:
            joined = c.join("maze", "fedse-tiny", ad.Schema.of(state, '{"r": 2}'))
        assert (joined.config.mode, joined.config.async_concurrency, joined.config.async_buffer,
                joined.config.async_max_staleness) == ("async", 2, 2, 3)
        st = clients[0].status()
        assert st.selective and list(st.selected) == ["x", "y"]
        shown = format_status(clients[0].stub.GetRunStatus(fpb.RunStatusRequest()))
        assert "asynchronous rounds: version 0; training: x, y; a buffer of 2 uploads makes the next version" in shown
        assert "not chosen: waits for a free training slot" in shown
        for c in clients:
            c.close()


def test_a_client_that_declines_gives_its_slot_back_and_is_given_none(tmp_path):
    clock = Clock()
    fed = asynchronous(tmp_path, clock, start_clients=2, async_concurrency=1, async_buffer=1)
    join(fed, "a", "b")
    assert fed.status().selected == ("a",)  # one slot
    fed.seen("a", 0, "declined")  # a's guardian declines: its privacy budget is spent
    fed.tick()
    assert fed.status().selected == ("b",)  # the slot went to b: the run goes on without a
    send(fed, "b", 0, 1.0)
    st = fed.status()
    assert st.round == 1 and st.selected == ("b",) and fed.run.members["a"].dropouts == 0
    _, views, _, _ = fed.run_view()
    assert {v.client_id: v.selection_reason for v in views}["a"] == "declines: its privacy budget is spent"


def test_async_uploads_take_from_the_privacy_budget_and_a_declined_client_stops_training(tmp_path):
    """The client agent's asynchronous loop over real gRPC, its phases standing in for by a plain upload
    of phi_0: each version it trains takes a release from its budget first; the budget (one release)
    declines its second, and the run, one slot wide, finishes with org-b alone."""
    import contextlib
    import threading

    from fedse.privacy import accounting
    from services.client_agent.training import guardian
    from services.client_agent.agent import ClientAgent
    from services.client_agent.config import ClientConfig
    from services.client_agent.federation.link import FederationClient
    from services.client_agent.federation.link import StaleRound as StaleClientRound
    from services.client_agent.federation.heartbeat import Heartbeat
    from services.client_agent.metrics import ROUNDS_DECLINED
    from support import aggregator_in_process, join_with_phi0

    state = {A: torch.zeros(2, 3), B: torch.zeros(3, 2)}
    z, delta = 2.0, 1e-5
    limit = (accounting.epsilons(z, 1, delta)[1] + accounting.epsilons(z, 2, delta)[1]) / 2  # one fits, two do not
    with aggregator_in_process(tmp_path / "agg", min_clients=1, start_clients=2, rounds=3, mode="async",
                               async_concurrency=1, async_buffer=1, heartbeat_timeout_s=600.0) as (_agg, port, _):
        target = f"127.0.0.1:{port}"
        agent = ClientAgent.__new__(ClientAgent)  # the loop alone: no model, no environments
        agent.cfg = ClientConfig(client_id="org-a", privacy_epsilon=limit, round_timeout_s=60.0)
        agent.fed = FederationClient(target, "org-a", retries=2, backoff_s=0.1)
        agent.run_config = agent.fed.join("maze", "fedse-tiny", ad.Schema.of(state, '{"r": 2}')).config
        agent.fed.max_staleness = agent.run_config.async_max_staleness  # as run() sets it
        agent.heartbeat = Heartbeat(agent.fed, 0.2)
        agent.heartbeat.start()
        agent.budget = guardian.PrivacyBudget(limit, delta, tmp_path / "privacy.json")
        # As an aggregator that lies would say it: a secure run with noise (async runs have neither).
        agent.budget.start(fpb.RunConfig(run_id="t", secure_aggregation=True, clip_norm=1.0, noise_multiplier=z))
        played, declined_before = [], ROUNDS_DECLINED._value.get()

        def play_round(round_, done, final, tasks):
            played.append((round_, final, list(agent.budget.rounds)))
            if not final:
                agent.fed.upload(round_, ad.encode(state), num_examples=1, num_successes=1)
        agent.play_round = play_round
        b = FederationClient(target, "org-b", retries=2, backoff_s=0.1)
        join_with_phi0(b, "maze", "fedse-tiny")
        b.max_staleness = agent.run_config.async_max_staleness

        def org_b():
            last = -1
            while True:
                st = b.wait_until(lambda s: s.state == fpb.ROUND_STATE_OPEN and s.round > last
                                  and "org-b" in s.selected, timeout_s=60)
                if st.state == fpb.ROUND_STATE_FINISHED:
                    return
                with contextlib.suppress(StaleClientRound):  # the version folded first: train from the next
                    b.upload(st.round, ad.encode(state), num_examples=1, num_successes=1)
                last = st.round
        threading.Thread(target=org_b, daemon=True).start()
        agent.run_async(0, "", [])
        agent.heartbeat.stop(0.1)
        assert [(r, final) for r, final, _ in played] == [(0, False), (3, True)]
        assert played[0][2] == [0]  # booked before the version was played
        # The one release it took; the first version it was given next (1 or 2, as org-b's slot fell) declined.
        assert agent.budget.rounds == [0] and len(agent.budget.declined) == 1
        assert agent.budget.declined[0] in (("t", 1), ("t", 2))
        assert ROUNDS_DECLINED._value.get() == declined_before + 1
        assert b.status().state == fpb.ROUND_STATE_FINISHED
        agent.fed.close(), b.close()
