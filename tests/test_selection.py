"""Client-selection policies on a scripted history (Prepare / Execute / Assert); pure, no gRPC."""

from __future__ import annotations

import collections
import dataclasses
import json
import random

import pytest

from services.aggregator.selection.policies import (
    POLICIES,
    All,
    Available,
    ClientHistory,
    FairnessFloor,
    Policy,
    Sample,
    Selection,
    SelectionInput,
    Utility,
    make_policy,
)

ROUND = 5


def history() -> tuple[ClientHistory, ...]:
    """Six clients at round 5, each with one trait; selected every round so far unless said."""
    every = tuple(range(ROUND))
    return (
        ClientHistory("steady", True, 2.0, every, every, last_success=0.40, success_gain=0.05,
                      last_loss=0.8, mean_round_s=60.0),
        ClientHistory("gainer", True, 1.0, every, every, last_success=0.55, success_gain=0.30,
                      last_loss=0.9, mean_round_s=50.0),
        # As useful as gainer by its gain, but four times slower than the median round.
        ClientHistory("slow", True, 3.0, every, every, last_success=0.50, success_gain=0.30,
                      last_loss=1.0, mean_round_s=240.0),
        ClientHistory("late", True, 25.0, every, every, last_success=0.35, success_gain=0.10,
                      last_loss=0.7, mean_round_s=70.0),
        ClientHistory("newcomer", True, 1.0),  # never tried
        # The most useful of all, but its heartbeats stopped: nothing may choose it.
        ClientHistory("gone", False, 120.0, every, (0, 1, 2), last_success=0.6, success_gain=0.5,
                      last_loss=2.0, mean_round_s=50.0, dropouts=2),
    )


ALIVE = {"steady", "gainer", "slow", "late", "newcomer"}


def inp(round_: int = ROUND, seed: int = 7, clients: tuple[ClientHistory, ...] | None = None,
        run_id: str = "run-1") -> SelectionInput:
    return SelectionInput(run_id, round_, seed, history() if clients is None else clients)


def check(sel: Selection, given: SelectionInput) -> None:
    """What every selection owes: a reason for every client, no one chosen who is not alive, someone
    chosen when anyone is alive, sorted ids, and a JSON round trip to itself."""
    alive = {c.client_id for c in given.clients if c.alive}
    assert set(sel.reasons) == {c.client_id for c in given.clients}
    assert all(isinstance(r, str) and r for r in sel.reasons.values())
    assert set(sel.chosen) <= alive
    assert bool(sel.chosen) == bool(alive)
    assert list(sel.chosen) == sorted(sel.chosen)
    assert sel.round == given.round
    assert Selection.from_dict(json.loads(json.dumps(sel.to_dict()))) == sel


# ---- all --------------------------------------------------------------------------------------

def test_all_chooses_every_alive_client_and_says_who_is_not():
    given = inp()
    sel = All().select(given)
    check(sel, given)
    assert set(sel.chosen) == ALIVE
    assert sel.reasons["gone"] == "not alive (heard 120 s ago)"
    assert sel.reasons["late"] == "alive"
    assert sel.policy == "all" and make_policy().config() == {"name": "all"}


def test_the_order_of_the_clients_does_not_matter():
    shuffled = list(history())
    random.Random(3).shuffle(shuffled)
    for policy in (All(), Sample(clients_per_round=2), Available(), Utility(clients_per_round=3)):
        assert policy.select(inp(clients=tuple(shuffled))) == policy.select(inp())


# ---- sample -----------------------------------------------------------------------------------

def test_sample_draws_m_alive_clients_reproducibly_even_after_a_restart():
    given = inp()
    sel = Sample(clients_per_round=2).select(given)
    check(sel, given)
    assert len(sel.chosen) == 2 and set(sel.chosen) <= ALIVE
    saved = json.dumps(sel.to_dict())  # the run state on disk
    # A restarted aggregator: a fresh policy object, the same input, and the saved record.
    again = make_policy("sample", clients_per_round=2).select(inp())
    assert again == sel == Selection.from_dict(json.loads(saved))
    for cid in ALIVE:
        assert sel.reasons[cid] == ("sampled, 2 of 5 alive" if cid in sel.chosen else "not sampled, 2 of 5 alive")
    assert sel.reasons["gone"].startswith("not alive")


def test_sample_differs_across_rounds_seeds_and_runs():
    policy = Sample(clients_per_round=2)
    by_round = {policy.select(inp(round_=r)).chosen for r in range(20)}
    assert len(by_round) >= 5  # 10 possible pairs; a fixed draw would give one
    assert len({policy.select(inp(seed=s)).chosen for s in range(20)}) >= 5
    assert len({policy.select(inp(run_id=f"run-{i}")).chosen for i in range(20)}) >= 5


def test_sample_is_roughly_uniform_over_many_rounds():
    policy = Sample(clients_per_round=2)
    rounds = 3000
    counts = collections.Counter(cid for r in range(rounds) for cid in policy.select(inp(round_=r)).chosen)
    expected = rounds * 2 / 5  # 1200; the binomial std is about 27
    assert set(counts) == ALIVE
    for cid in ALIVE:
        assert abs(counts[cid] - expected) < 120, counts


def test_sample_by_fraction_and_more_than_alive():
    given = inp()
    assert len(Sample(fraction=0.5).select(given).chosen) == 3  # ceil(0.5 * 5)
    assert len(Sample(fraction=0.01).select(given).chosen) == 1  # never zero
    sel = Sample(clients_per_round=9).select(given)
    check(sel, given)
    assert set(sel.chosen) == ALIVE
    assert sel.reasons["steady"] == "sampled, 5 of 5 alive"


# ---- available --------------------------------------------------------------------------------

def test_available_leaves_out_the_late_heartbeat_and_says_how_late():
    given = inp()
    sel = Available(late_after_s=15).select(given)
    check(sel, given)
    assert set(sel.chosen) == ALIVE - {"late"}
    assert sel.reasons["late"] == "heartbeat late (25 s)"
    assert sel.reasons["steady"] == "heartbeat 2 s ago"
    assert sel.reasons["gone"].startswith("not alive")
    assert "late" in Available(late_after_s=30).select(given).chosen


def test_available_chooses_every_alive_client_when_none_is_on_time():
    clients = tuple(dataclasses.replace(c, heartbeat_age_s=20.0 + i) for i, c in enumerate(history()))
    given = inp(clients=clients)
    sel = Available(late_after_s=15).select(given)
    check(sel, given)
    assert set(sel.chosen) == ALIVE
    assert sel.reasons["late"] == "heartbeat late (23 s), chosen: no alive client is on time"


# ---- utility ----------------------------------------------------------------------------------

def test_utility_prefers_useful_and_fast_clients_and_explores_the_untried_one():
    given = inp()
    policy = Utility(clients_per_round=3)  # round(0.2 * 3) = 1 slot explores, 2 exploit
    sel = policy.select(given)
    check(sel, given)
    assert set(sel.chosen) == {"gainer", "late", "newcomer"}
    util = {cid: value for cid, (value, _) in policy.utilities(given).items()}
    assert set(util) == ALIVE - {"newcomer"}  # only alive, tried clients are ranked
    # Gains count by their rank among the alive clients' (gone's 0.5 does not count): steady 0.05 is
    # 1/4, late 0.10 is 2/4, gainer and slow share ranks 3 and 4 (3.5/4). The median of the alive
    # clients' durations (50, 60, 70, 240 s) is 65 s, and anyone slower is scaled by (65 / d)^2.
    assert util["gainer"] == pytest.approx(0.875)
    assert util["slow"] == pytest.approx(0.875 * (65 / 240) ** 2)  # gainer's gain, but 3.7 times slower
    assert util["late"] == pytest.approx(0.5 * (65 / 70) ** 2)
    assert util["steady"] == pytest.approx(0.25)
    # A claimed gain above 1 (impossible for a change of a ratio) is no report: steady's loss ranks it.
    boasting = tuple(dataclasses.replace(c, success_gain=50.0) if c.client_id == "steady" else c for c in history())
    boasted = policy.utilities(inp(clients=boasting))
    assert boasted["steady"][0] == pytest.approx(0.5) and boasted["gainer"][0] == pytest.approx(2.5 / 3)
    assert sel.reasons["gainer"] == "utility 0.88, 0 rounds out, rank 1 of 4; top 2 taken"
    assert sel.reasons["late"] == "utility 0.43 (slow: 70 s, median 65 s), 0 rounds out, rank 2 of 4; top 2 taken"
    assert sel.reasons["steady"] == "utility 0.25, 0 rounds out, rank 3 of 4; top 2 taken"
    assert sel.reasons["slow"] == "utility 0.06 (slow: 240 s, median 65 s), 0 rounds out, rank 4 of 4; top 2 taken"
    assert sel.reasons["newcomer"] == "exploring: never tried"
    assert sel.reasons["gone"].startswith("not alive")
    assert policy.select(inp()) == sel  # reproducible
    assert Utility(clients_per_round=3, alpha=0).select(given).chosen == ("gainer", "newcomer", "slow")


def test_utility_falls_back_to_loss_and_fills_slots_across_groups():
    # No one has a gain yet: the training loss ranks them (gone's 2.0 is not alive and does not count).
    clients = tuple(dataclasses.replace(c, success_gain=None) for c in history())
    given = inp(clients=clients)
    util = {cid: v for cid, (v, _) in Utility(clients_per_round=2).utilities(given).items()}
    assert util == pytest.approx({"steady": 0.5, "gainer": 0.75, "slow": (65 / 240) ** 2,
                                  "late": 0.25 * (65 / 70) ** 2})
    # epsilon 0: no exploration; epsilon 1: all slots explore, the one untried client and then the one
    # longest unchosen (all were chosen last round: the seeded order decides).
    assert "newcomer" not in Utility(clients_per_round=2, epsilon=0).select(given).chosen
    sel = Utility(clients_per_round=2, epsilon=1).select(given)
    check(sel, given)
    assert "newcomer" in sel.chosen and any(r.startswith("exploring: not chosen for 0") for r in sel.reasons.values())
    # More slots than alive clients: everyone alive.
    assert set(Utility(fraction=1.0).select(given).chosen) == ALIVE
    # Selected before but never reported: tried, so it does not explore; it dropped both its rounds.
    silent = inp(clients=clients + (ClientHistory("silent", True, 1.0, (3, 4), dropouts=2),))
    sel = Utility(clients_per_round=2, epsilon=0).select(silent)
    assert sel.reasons["silent"] == "utility unknown (nothing reported), 0 rounds out, rank 5 of 5; top 2 taken"


def test_utility_draws_explorers_reproducibly_and_leaves_the_others_a_reason():
    clients = history() + tuple(ClientHistory(f"new-{i}", True, 1.0) for i in range(4))
    policy = Utility(clients_per_round=5)  # 1 explores, 4 exploit
    sels = [policy.select(inp(round_=r, clients=clients)) for r in range(30)]
    for sel in sels:
        check(sel, inp(clients=clients, round_=sel.round))
        explorers = [c for c in sel.chosen if c.startswith("new")]
        assert len(explorers) == 1 and sel.reasons[explorers[0]] == "exploring: never tried"
        left = [c for c in ("newcomer", "new-0", "new-1", "new-2", "new-3") if c not in sel.chosen]
        assert all(sel.reasons[c] == "never tried, not drawn to explore (1 explore)" for c in left)
    assert len({s.chosen for s in sels}) == 5  # every untried client gets its turn across rounds
    assert policy.select(inp(round_=3, clients=clients)) == sels[3]


# ---- fairness floor ---------------------------------------------------------------------------

def test_fairness_floor_forces_in_a_client_left_out_for_f_rounds():
    clients = (
        ClientHistory("favourite", True, 1.0, (0, 1, 2, 3, 4), success_gain=0.3),
        ClientHistory("ignored", True, 1.0, (0, 1), success_gain=0.0),  # last chosen in round 1
        ClientHistory("recent", True, 1.0, (0, 3), success_gain=0.0),
        ClientHistory("joined-late", True, 1.0),
        ClientHistory("gone", False, 99.0, (0,)),
    )
    given = inp(round_=5, clients=clients)

    class Favourite(Policy):  # a policy with a favourite, whatever else it is told
        name = "favourite"

        def _choose(self, inp):
            return {"favourite"}, {c.client_id: "favourite" if c.client_id == "favourite" else "not it"
                                   for c in inp.clients}
    inner = Favourite()
    assert inner.select(given).chosen == ("favourite",)
    sel = FairnessFloor(inner, every_f_rounds=3).select(given)
    check(sel, given)
    # ignored: not in rounds 2, 3, 4; joined-late: never, and 5 >= 3 rounds have passed.
    assert sel.chosen == ("favourite", "ignored", "joined-late")
    assert sel.reasons["ignored"] == "fairness floor: not chosen for 3 rounds"
    assert sel.reasons["joined-late"] == "fairness floor: never chosen in 5 rounds"
    assert sel.reasons["recent"] == "not it"
    assert sel.policy == "favourite+fairness_floor"
    # Before round F a client never chosen is not forced in yet.
    early = FairnessFloor(inner, every_f_rounds=3).select(inp(round_=2, clients=clients))
    assert "joined-late" not in early.chosen
    # F = 1: everyone alive not chosen in the round before (4) comes in.
    every_round = FairnessFloor(Sample(clients_per_round=1), every_f_rounds=1).select(given)
    assert {"ignored", "recent", "joined-late"} <= set(every_round.chosen)


def test_make_policy_rebuilds_a_policy_from_its_config():
    for policy in (make_policy("all"), make_policy("sample", fraction=0.5), make_policy("available", late_after_s=9),
                   make_policy("utility", clients_per_round=2, epsilon=0.5, alpha=1),
                   make_policy("sample", clients_per_round=2, every_f_rounds=4),
                   make_policy("agent-tools", clients_per_round=3), make_policy("agent-tools", every_f_rounds=2),
                   make_policy("agent-llm", fraction=0.5)):
        config = json.loads(json.dumps(policy.config()))
        again = make_policy(**config)
        assert type(again) is type(policy) and again.config() == config
        assert again.select(inp()) == policy.select(inp())
    assert set(POLICIES) == {"all", "sample", "available", "utility", "agent-tools", "agent-llm"}
    assert all(POLICIES.values())


# ---- nobody not alive, never nobody -----------------------------------------------------------

@pytest.mark.parametrize("config", [
    {"name": "all"}, {"name": "sample", "clients_per_round": 1}, {"name": "sample", "fraction": 1.0},
    {"name": "available"}, {"name": "utility", "clients_per_round": 2},
    {"name": "utility", "fraction": 0.2, "epsilon": 1.0},
    {"name": "sample", "clients_per_round": 1, "every_f_rounds": 2},
    {"name": "agent-tools"}, {"name": "agent-tools", "clients_per_round": 2},
    {"name": "agent-llm", "fraction": 0.5},  # no base model in the input: the tools' plan, a fallback
])
def test_no_policy_chooses_a_client_not_alive_nor_nobody(config):
    policy = make_policy(**config)
    rng = random.Random(11)
    for trial in range(200):
        clients = tuple(
            ClientHistory(f"c{i}", rng.random() < 0.6, rng.choice([0.5, 12.0, 40.0, 300.0]),
                          tuple(r for r in range(trial % 7) if rng.random() < 0.5),
                          success_gain=rng.choice([None, -0.2, 0.0, 0.1, 0.4]),
                          last_loss=rng.choice([None, 0.3, 1.5]),
                          mean_round_s=rng.choice([None, 30.0, 90.0, 400.0]))
            for i in range(rng.randint(0, 7)))
        given = inp(round_=trial % 7, seed=trial, clients=clients)
        check(policy.select(given), given)


def test_nobody_alive_gives_an_empty_selection_with_reasons():
    clients = tuple(dataclasses.replace(c, alive=False) for c in history())
    given = inp(clients=clients)
    for name, params in (("all", {}), ("sample", {"clients_per_round": 2}), ("available", {}),
                         ("utility", {"fraction": 0.5})):
        sel = make_policy(name, **params).select(given)
        check(sel, given)
        assert sel.chosen == () and all(r.startswith("not alive") for r in sel.reasons.values())


# ---- bad parameters and inputs ----------------------------------------------------------------

@pytest.mark.parametrize("name, params, message", [
    ("random", {}, "unknown selection policy 'random': use one of all, sample, available, utility"),
    ("all", {"fraction": 0.5}, "selection policy 'all' does not take fraction: it takes no parameters"),
    ("sample", {"clients": 3}, "does not take clients: it takes clients_per_round, fraction"),
    ("sample", {}, "needs exactly one of clients_per_round"),
    ("sample", {"clients_per_round": 2, "fraction": 0.5}, "needs exactly one of clients_per_round"),
    ("sample", {"clients_per_round": 0}, "clients_per_round must be an integer >= 1, got 0"),
    ("sample", {"clients_per_round": 2.5}, "clients_per_round must be an integer >= 1, got 2.5"),
    ("sample", {"clients_per_round": True}, "clients_per_round must be an integer >= 1, got True"),
    ("sample", {"fraction": 0}, "fraction must be in (0, 1]"),
    ("sample", {"fraction": 1.5}, "fraction must be in (0, 1]"),
    ("available", {"late_after_s": 0}, "late_after_s must be a finite number of seconds > 0, got 0"),
    ("available", {"late_after_s": float("inf")}, "late_after_s must be a finite number of seconds > 0"),
    ("utility", {"clients_per_round": 2, "epsilon": 1.2}, "epsilon must be in [0, 1]"),
    ("utility", {"clients_per_round": 2, "epsilon": float("nan")}, "epsilon must be in [0, 1]"),
    ("utility", {"clients_per_round": 2, "alpha": -1}, "alpha must be a finite number >= 0"),
    ("sample", {"clients_per_round": 2, "every_f_rounds": -1}, "every_f_rounds must be an integer >= 0, got -1"),
])
def test_bad_parameters_are_refused_saying_what_to_fix(name, params, message):
    with pytest.raises(ValueError) as e:
        make_policy(name, **params)
    assert message in str(e.value)


def test_bad_inputs_are_refused():
    twice = history() + (ClientHistory("steady", True, 0.0),)
    with pytest.raises(ValueError, match="client ids must be unique in a selection input, got steady twice"):
        inp(clients=twice)
    with pytest.raises(ValueError, match="round must be >= 0"):
        inp(round_=-1)
    with pytest.raises(ValueError, match="mean_round_s must be a finite number > 0 or None"):
        ClientHistory("x", True, 1.0, mean_round_s=0.0)
    with pytest.raises(ValueError, match="heartbeat_age_s must be >= 0"):
        ClientHistory("x", True, -1.0)
    # A client's reports are untrusted: non-finite values count as no report.
    odd = ClientHistory("x", True, 1.0, success_gain=float("nan"), last_loss=float("inf"), last_success=float("nan"))
    assert odd.success_gain is None and odd.last_loss is None and odd.last_success is None and not odd.tried
    with pytest.raises(ValueError, match="already under a fairness floor"):
        FairnessFloor(FairnessFloor(All(), 2), 3)


# ---- nobody starved: exploration, staleness, the floor on by default ----------------------------

def simulate(policy, clients: tuple[ClientHistory, ...], rounds: int) -> dict[str, list[int]]:
    """`policy` over `rounds` rounds, each chosen client's rounds_selected growing: the rounds each
    client was chosen in."""
    hist = {c.client_id: c for c in clients}
    for r in range(rounds):
        for cid in policy.select(SelectionInput("run-1", r, 7, tuple(hist.values()))).chosen:
            hist[cid] = dataclasses.replace(hist[cid], rounds_selected=(*hist[cid].rounds_selected, r))
    return {cid: list(c.rounds_selected) for cid, c in hist.items()}


REPORTED = tuple(ClientHistory(f"hi-{i}", True, 1.0, success_gain=0.3 + 0.01 * i, last_loss=1.0)
                 for i in range(3)) + tuple(ClientHistory(f"lo-{i}", True, 1.0, success_gain=0.0, last_loss=0.1)
                                            for i in range(3))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_utility_never_shuts_out_a_low_utility_client(k):
    # Everyone reported once (tried), three learn and three do not; their reports never change.
    rounds = simulate(Utility(clients_per_round=k), REPORTED, 24)
    for cid, chosen in rounds.items():
        assert any(r > 3 for r in chosen), (cid, rounds)
    # The one place at K = 1 explores with probability epsilon; at K >= 2 one place always explores.
    assert Utility(clients_per_round=2).explorers(inp(), 2) == 1
    assert Utility(clients_per_round=1, epsilon=0.2).explorers(inp(), 1) in (0, 1)
    assert sum(Utility(clients_per_round=1).explorers(inp(round_=r), 1) for r in range(200)) in range(20, 61)


def test_the_fairness_floor_is_on_by_default_and_agent_tools_obeys_it():
    from services.aggregator.selection.policies import SelectionSettings

    floor = SelectionSettings("sample", clients_per_round=1).policy()
    assert isinstance(floor, FairnessFloor) and floor.every_f_rounds == 0 and floor.rounds(4) == 5  # ceil(4/1)+1
    assert isinstance(SelectionSettings("sample", clients_per_round=1, fairness_rounds=-1).policy(), Sample)
    assert not isinstance(SelectionSettings("all").policy(), FairnessFloor)
    with pytest.raises(ValueError, match="--fairness-rounds must be -1"):
        SelectionSettings("sample", clients_per_round=1, fairness_rounds=-2).policy()
    # agent-tools leaves a once-slow client out as a straggler; the floor brings it back every few rounds.
    clients = tuple(ClientHistory(f"c{i}", True, 1.0, success_gain=0.1, mean_round_s=50.0) for i in range(3)) + \
        (ClientHistory("once-slow", True, 1.0, success_gain=0.1, mean_round_s=500.0),)
    rounds = simulate(SelectionSettings("agent-tools").policy(), clients, 10)
    assert len(rounds["once-slow"]) >= 2, rounds  # F = ceil(4/4) + 1 = 2: at least every third round


def test_reported_values_out_of_range_are_no_report_and_a_huge_loss_is_clipped():
    c = ClientHistory("x", True, 1.0, last_success=1.5, success_gain=-2.0, last_loss=1e30, buffer_size=-3)
    assert c.last_success is None and c.success_gain is None and c.buffer_size is None
    assert c.last_loss == 1e3
    assert ClientHistory("y", True, 1.0, last_loss=-1.0, buffer_size=10 ** 12).last_loss is None
    # One outlier weighs what the top honest value weighs: utility ranks the signal.
    liar = ClientHistory("liar", True, 1.0, (0,), last_loss=1e30)
    honest = tuple(ClientHistory(f"h{i}", True, 1.0, (0,), last_loss=0.5 + 0.1 * i) for i in range(3))
    util = Utility(clients_per_round=1).utilities(inp(round_=1, clients=(liar, *honest)))
    assert util["liar"][0] == pytest.approx(1.0) and util["h2"][0] == pytest.approx(0.75)
