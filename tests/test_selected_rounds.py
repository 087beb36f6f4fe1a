"""Rounds that take only the clients a selector chose (--selector), on a hand-driven clock: who may
upload, when such a round closes, what is recorded and what a restart keeps."""

from __future__ import annotations

import collections
import json

import pytest

from fedse.model import adapter as ad
from services.aggregator.errors import NotSelected
from services.aggregator.rounds import RoundKeeper
from services.aggregator.selection.policies import SelectionSettings
from services.aggregator.state import State
from services.aggregator.store import Store
from services.aggregator.uploads import UploadHeader
from test_rounds import Clock, adapter_bytes, federation, join, settings, upload

CLIENTS = ("a", "b", "c", "d")


def sampled(tmp_path, clock, k=2, **kw) -> RoundKeeper:
    return federation(tmp_path, clock, selection=SelectionSettings("sample", clients_per_round=k), **kw)


def try_upload(fed: RoundKeeper, client: str) -> None:
    data = adapter_bytes(1.0)
    st = fed.status()
    fed.begin_upload(UploadHeader(client, st.round, st.round_nonce, ad.sha256_hex(data), len(data)))


def test_only_the_chosen_clients_take_part_and_close_the_round(tmp_path):
    clock = Clock()
    fed = sampled(tmp_path, clock, start_clients=4)
    join(fed, *CLIENTS)
    st = fed.status()
    assert st.state is State.OPEN and st.selected is not None and len(st.selected) == 2
    left_out = sorted(set(CLIENTS) - set(st.selected))
    with pytest.raises(NotSelected, match=f"client {left_out[0]} does not take part in round 0 \\(not sampled"):
        try_upload(fed, left_out[0])
    upload(fed, st.selected[0], 1.0)
    assert fed.status().round == 0  # the other chosen client is alive: wait for it, not for the others
    upload(fed, st.selected[1], 3.0)
    after = fed.status()
    assert after.round == 1 and after.selected is not None and len(after.selected) == 2
    # Every member's record: the rounds it was chosen for and uploaded in, and how long it took.
    for cid in st.selected:
        m = fed.run.members[cid]
        assert m.rounds_uploaded == [0] and m.upload_seconds == [0.0] and 0 in m.rounds_selected
    assert all(0 not in fed.run.members[c].rounds_selected for c in left_out)
    # Every choice is logged, with a reason for each client.
    log = Store(tmp_path, "r").selections()
    assert [e["round"] for e in log] == [0, 1] and log[0]["chosen"] == list(st.selected)
    assert set(log[0]["reasons"]) == set(CLIENTS)
    _, views, _, _ = fed.run_view()
    assert sum(v.selected for v in views) == 2 and all(v.selection_reason for v in views)


def test_a_restart_keeps_the_open_rounds_choice(tmp_path):
    clock = Clock()
    fed = sampled(tmp_path, clock, start_clients=4)
    join(fed, *CLIENTS)
    upload(fed, fed.status().selected[0], 1.0)
    upload(fed, fed.status().selected[1], 1.0)
    chosen = fed.status().selected
    again = RoundKeeper(settings(selection=SelectionSettings("sample", clients_per_round=2), start_clients=4),
                        Store(tmp_path, "r"), clock=clock)
    assert again.status().round == 1 and again.status().selected == chosen
    assert again.run.members[chosen[0]].rounds_uploaded == fed.run.members[chosen[0]].rounds_uploaded
    # Another selector, or another count, is another run: refused, saying what to do.
    with pytest.raises(ValueError, match="restart with the same settings"):
        RoundKeeper(settings(selection=SelectionSettings("sample", clients_per_round=3), start_clients=4),
                    Store(tmp_path, "r"), clock=clock)


def test_the_round_takes_at_least_min_clients(tmp_path):
    clock = Clock()
    fed = sampled(tmp_path, clock, k=1, min_clients=3, start_clients=4)
    join(fed, *CLIENTS)
    sel = fed.run.selection
    assert len(sel.chosen) == 3 and sum("the round needs 3 clients" in sel.reasons[c] for c in sel.chosen) == 2


def test_chosen_clients_that_died_are_replaced(tmp_path):
    clock = Clock()
    fed = sampled(tmp_path, clock, k=2, start_clients=4)
    join(fed, *CLIENTS)
    chosen = fed.status().selected
    others = sorted(set(CLIENTS) - set(chosen))
    clock.now += 11  # every client silent past the 10 s timeout, but the two left out beat again
    for cid in others:
        fed.seen(cid, 0, "not selected")
    fed.tick()
    st = fed.status()
    assert st.round == 0 and sorted(st.selected) == others
    assert fed.run.selection.reasoning[0] == "chosen again: no chosen client was alive"
    upload(fed, others[0], 1.0)
    upload(fed, others[1], 1.0)
    assert fed.status().round == 1
    # The two that died were chosen and did not upload: each counts a dropout.
    assert [fed.run.members[c].dropouts for c in chosen] == [1, 1]


def test_a_failing_selector_falls_back_to_every_alive_client(tmp_path):
    clock = Clock()
    fed = sampled(tmp_path, clock, start_clients=2)

    class Broken:
        def select(self, inp):
            raise RuntimeError("out of ideas")
    fed.policy = Broken()
    join(fed, "a", "b")
    sel, fallbacks = fed.selection()
    assert sel.chosen == ("a", "b") and fallbacks == 1
    assert sel.fallback_reason == "the selector failed: out of ideas"


def test_without_a_selector_nothing_changes(tmp_path):
    clock = Clock()
    fed = federation(tmp_path, clock, start_clients=2)
    join(fed, "a", "b")
    assert fed.status().selected is None and fed.selection() == (None, 0)
    upload(fed, "a", 1.0)
    upload(fed, "b", 1.0)
    saved = json.loads((tmp_path / "r" / "run.json").read_text())
    assert saved["selection"] is None and "selection" not in saved["settings"]
    assert not (tmp_path / "r" / "selections.jsonl").exists()


def test_over_grpc_the_status_names_the_chosen_and_a_left_out_upload_is_refused(tmp_path):
    import grpc
    import torch

    from fedse.model.tinymodel import TINY_MODEL_NAME
    from fedse.v1 import federation_pb2 as fpb
    from services.client_agent.federation.link import FederationClient, NotSelected as ClientNotSelected
    from support import aggregator_in_process

    state = {"m.lora_A.weight": torch.zeros(2, 3), "m.lora_B.weight": torch.zeros(3, 2)}
    schema = ad.Schema.of(state, '{"r": 2}')
    with aggregator_in_process(tmp_path, min_clients=1, start_clients=3, selector="sample",
                               clients_per_round=1) as (_agg, port, _):
        target = f"127.0.0.1:{port}"
        clients = {cid: FederationClient(target, cid, retries=2, backoff_s=0.1) for cid in ("x", "y", "z")}
        for cid, c in clients.items():
            joined = c.join("maze", TINY_MODEL_NAME, schema)
        assert joined.config.selector == "sample" and joined.config.clients_per_round == 1
        st = clients["x"].status()
        assert st.state == fpb.ROUND_STATE_OPEN and st.selective and len(st.selected) == 1
        chosen = st.selected[0]
        out = next(cid for cid in clients if cid != chosen)
        data = ad.encode(state)
        with pytest.raises(ClientNotSelected, match="chose 1 other client"):
            clients[out].upload(0, data, num_examples=1, num_successes=1)  # it reads the status first
        header = fpb.AdapterHeader(run_id="t", round=0, client_id=out, round_nonce=st.round_nonce,
                                   sha256=ad.sha256_hex(data), size=len(data))
        with pytest.raises(grpc.RpcError) as refused:  # a client that sends anyway
            clients[out].stub.UploadAdapter(iter([fpb.AdapterChunk(header=header), fpb.AdapterChunk(data=data)]))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"client {out} does not take part in round 0 (not sampled, 1 of 3 alive)" in refused.value.details()
        run = clients[out].stub.GetRunStatus(fpb.RunStatusRequest())
        assert run.selection.round == 0 and list(run.selection.chosen) == [chosen]
        assert run.selection.policy == "sample+fairness_floor" and run.selector_fallbacks == 0  # the floor: default
        assert {c.client_id: c.selected for c in run.clients} == {cid: cid == chosen for cid in clients}
        assert all(c.selection_reason.startswith("sampled" if c.selected else "not sampled") for c in run.clients)
        from apps.cli import format_status
        shown = format_status(run)  # what fedse status prints
        assert f"selection (sample) of round 0: {chosen} by sample+fairness_floor" in shown
        assert shown.count("not chosen: not sampled, 1 of 3 alive") == 2
        clients[chosen].upload(0, data, num_examples=1, num_successes=1)
        assert clients[out].wait_until(lambda s: s.round == 1, timeout_s=10).selective
        for c in clients.values():
            c.close()


def _seed_where(run_id: str, first: str, then: str, ids=("org-a", "org-b")) -> int:
    """A seed whose `sample` of one client picks `first` in round 0 and `then` in round 1."""
    from services.aggregator.selection.policies import ClientHistory, Sample, SelectionInput

    for seed in range(200):
        picks = [Sample(clients_per_round=1).select(SelectionInput(
            run_id, r, seed, tuple(ClientHistory(c, True, 0.0) for c in ids))).chosen for r in (0, 1)]
        if picks == [(first,), (then,)]:
            return seed
    raise AssertionError("no such seed")


def test_a_client_agent_sits_out_a_round_it_was_not_chosen_for_even_across_a_restart(tmp_path):
    """A real client agent (org-a) and a scripted client (org-b), one client a round: org-b in round 0,
    org-a in round 1. org-a is killed while it sits round 0 out; started again, it sits it out again,
    then plays round 1 and evaluates the final adapter."""
    import threading

    from services.client_agent.agent import ClientAgent
    from services.client_agent.federation.link import FederationClient
    from services.client_agent.federation.heartbeat import RoundPhase
    from support import aggregator_in_process, env_server_in_process, join_with_phi0
    from test_client_progress import Crash, agent_config

    seed = _seed_where("t", "org-b", "org-a")
    with env_server_in_process() as env_target, aggregator_in_process(
            tmp_path / "agg", min_clients=1, start_clients=2, selector="sample", clients_per_round=1,
            seed=seed) as (_agg, port, run_dir):
        target = f"127.0.0.1:{port}"
        cfg = agent_config(env_target, target, tmp_path / "clients", explore_tasks=2, eval_tasks=1, expert_demos=2,
                           seed=seed)
        runs: list = []

        def run(crash: bool) -> threading.Thread:
            agent = ClientAgent(cfg)
            if crash:  # killed the moment it starts sitting a round out
                real = agent.heartbeat.set

                def set_phase(phase, round_=None):
                    if phase is RoundPhase.NOT_SELECTED:
                        raise Crash("sitting out")
                    return real(phase, round_)
                agent.heartbeat.set = set_phase

            def go():
                try:
                    runs.append(agent.run())
                except Crash:
                    runs.append(None)
                finally:
                    agent.close()
            thread = threading.Thread(target=go)
            thread.start()
            return thread

        first = run(crash=True)
        b = FederationClient(target, "org-b", retries=2, backoff_s=0.1)
        phi0 = join_with_phi0(b, "maze", cfg.base_model)  # org-a joined first
        first.join(timeout=60)
        assert runs == [None]  # killed while sitting round 0 out
        second = run(crash=False)  # it sits round 0 out again: no upload nor report of round 0 below
        b.upload(0, phi0.data, num_examples=1, num_successes=1)
        second.join(timeout=120)
        history = runs[1]
        assert [int(r["round"]) for r in history] == [1, 2]  # round 0 sat out; round 1 played; phi_2 evaluated
        assert "train_loss" in history[0]
        reports = {(e["client_id"], e["round"]) for e in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                                               .splitlines())}
        assert reports == {("org-a", 1), ("org-a", 2)}
        assert [e["chosen"] for e in Store(tmp_path / "agg", "t").selections()] == [["org-b"], ["org-a"]]
        b.close()


def test_over_grpc_a_chosen_client_that_dies_is_replaced_and_the_accepted_upload_kept(tmp_path):
    """sample K = 2, --min-clients 2, four clients heartbeating over gRPC: one chosen client uploads,
    the other's heartbeat stops. An alive client left out takes its place at once, the upload already
    accepted counts, and the round closes long before its deadline."""
    import threading
    import time

    import torch

    from fedse.model.tinymodel import TINY_MODEL_NAME
    from services.client_agent.federation.link import FederationClient
    from support import aggregator_in_process

    state = {"m.lora_A.weight": torch.zeros(2, 3), "m.lora_B.weight": torch.zeros(3, 2)}
    schema, data = ad.Schema.of(state, '{"r": 2}'), ad.encode(state)
    with aggregator_in_process(tmp_path, rounds=1, min_clients=2, start_clients=4, selector="sample",
                               clients_per_round=2, heartbeat_timeout_s=1.0, round_deadline_s=60.0,
                               wait_after_min_s=60.0) as (agg, port, run_dir):
        clients = {cid: FederationClient(f"127.0.0.1:{port}", cid, retries=2, backoff_s=0.1) for cid in CLIENTS}
        for c in clients.values():
            c.join("maze", TINY_MODEL_NAME, schema)
        beating = {cid: threading.Event() for cid in CLIENTS}
        for e in beating.values():
            e.set()

        def beat(cid: str) -> None:
            while beating[cid].is_set():
                clients[cid].heartbeat(0, "training")
                time.sleep(0.2)
        threads = [threading.Thread(target=beat, args=(cid,), daemon=True) for cid in CLIENTS]
        for t in threads:
            t.start()
        first, dying = clients["a"].status().selected
        clients[first].upload(0, data, num_examples=1, num_successes=1)
        beating[dying].clear()  # it dies: no heartbeat, no upload
        died = time.monotonic()
        st = clients[first].wait_until(lambda s: dying not in s.selected, timeout_s=8)
        assert time.monotonic() - died < 5  # the heartbeat timeout (1 s) and a tick, not the deadline (60 s)
        (new,) = set(st.selected) - {first}
        assert new != dying and st.round == 0
        clients[new].upload(0, data, num_examples=1, num_successes=1)
        clients[first].wait_until(lambda s: s.round == 1, timeout_s=10)
        for e in beating.values():
            e.clear()
        sel = Store(tmp_path, "t").selections()[-1]
        assert sorted(sel["chosen"]) == sorted([first, new]) and sel["reasoning"][0] == f"topped up: {new} for {dying}"
        assert sel["reasons"][new] == f"topped up: replaces {dying} (not alive)"
        members = agg.federation.run.members
        assert members[first].rounds_uploaded == [0] and members[new].rounds_uploaded == [0]  # both folded
        assert members[dying].dropouts == 1 and members[dying].rounds_uploaded == []
        for t in threads:
            t.join(timeout=2)
        for c in clients.values():
            c.close()


@pytest.mark.parametrize("with_success", [False, True])
def test_a_liar_reporting_loss_1e30_and_success_1_gets_no_more_than_its_share(tmp_path, with_success):
    """utility, two places among four clients for ten rounds. Every client reports every round, chosen or
    not; the liar claims a loss of 1e30 (and a success of 1.0), the honest ones ordinary values. Ranks,
    reports counted only for rounds taken part in, and the staleness bonus hold the liar to its share
    (10 * 2 / 4 = 5 places, one more at most for the round-0 draw)."""
    clock = Clock()
    fed = federation(tmp_path, clock, num_rounds=10, start_clients=4,
                     selection=SelectionSettings("utility", clients_per_round=2))
    join(fed, "liar", "b", "c", "d")
    honest = {"b": (0.9, 0.30), "c": (0.8, 0.35), "d": (0.7, 0.40)}
    places = collections.Counter()
    for r in range(10):
        st = fed.status()
        assert st.round == r
        for cid in CLIENTS_WITH_LIAR:
            loss, success = (1e30, 1.0) if cid == "liar" else (honest[cid][0] - 0.01 * r, honest[cid][1] + 0.02 * r)
            fed.report_metrics(cid, r, {"train_loss": loss, **({"test_success": success} if with_success else {})})
        places.update(st.selected)
        for cid in st.selected:
            upload(fed, cid, 1.0)
        clock.now += 1
    assert places["liar"] <= 6, places
    assert all(places[c] >= 4 for c in honest), places  # nobody starved


CLIENTS_WITH_LIAR = ("liar", "b", "c", "d")
