"""What the paper's methods change, and that every topology runs: the success filter (--keep), the
history (--history), no exploration (--explore-tasks 0, FedIT / Local / Centralized), a client
holding several environments (Centralized), each client alone with its own aggregator (Local),
and the LoRA rank. Real processes through `launcher.run` where the wiring matters."""

from __future__ import annotations

import dataclasses
import io
import json
import random

import pytest

from fedse.model import adapter as ad
from fedse.config import ConfigError, parse, to_argv
from apps.launcher import run
from apps.planning import (LOCAL_DEFAULTS, RunConfig, aggregator_config, client_config, env_server_config, plan,
                           scoring_for)
from apps.results import collect
from services.aggregator.server import AggregatorConfig
from services.client_agent.training.buffer import Buffer, Trajectory, to_keep, training_set
from services.client_agent.config import ClientConfig

TINY = dict(rounds=1, expert_demos=4, explore_tasks=4, eval_tasks=4, epochs=1)


def traj(task_id: int, round_: int, success: bool = True, source: str = "explore", env: str = "maze") -> Trajectory:
    return Trajectory(env=env, task_id=task_id, instruction="go", turns=(("at 1, 1", "move up"),), success=success,
                      reward=float(success), source=source, round=round_)


# ---- what goes into the buffer, what a round trains on ---------------------------------------------
def test_keep_successes_filters_failures_and_keep_all_keeps_them():
    explored = [traj(1, 0), traj(2, 0, success=False), traj(3, 0)]
    assert [t.task_id for t in to_keep(explored, "successes")] == [1, 3]
    assert [t.task_id for t in to_keep(explored, "all")] == [1, 2, 3]


BUFFER = [traj(1, -1, source="expert"), traj(2, -1, source="expert"), traj(10, 0), traj(11, 0, success=False),
          traj(20, 1), traj(30, 2)]


@pytest.mark.parametrize("history,round_,trained", [
    ("cumulative", 0, [1, 2, 10, 11]),  # D_0 = D_{-1} plus round 0's kept
    ("cumulative", 1, [1, 2, 10, 11, 20]),  # D_1 = D_0 plus round 1's kept
    ("cumulative", 2, [1, 2, 10, 11, 20, 30]),
    ("round", 0, [1, 2, 10, 11]),
    ("round", 1, [1, 2, 20]),  # expert demonstrations plus this round's only
    ("round", 2, [1, 2, 30]),
])
def test_training_set_per_history(history, round_, trained):
    assert [t.task_id for t in training_set(BUFFER, history, round_)] == trained


def test_shortest_history_trains_on_each_tasks_shortest_success_so_far():
    def walk(task_id: int, round_: int, steps: int, source: str = "explore", env: str = "maze") -> Trajectory:
        return Trajectory(env=env, task_id=task_id, instruction="go", turns=(("at", "move up"),) * steps,
                          success=True, reward=1.0, source=source, round=round_)
    demo, detour, short = walk(1, -1, 9, source="expert"), walk(1, 0, 12), walk(1, 1, 8)
    other_env = walk(1, 1, 3, env="wordle")
    tie, longer, later = walk(2, 0, 5), walk(2, 1, 5), walk(2, 2, 4)
    buffer = [demo, walk(2, -1, 20, source="file"), detour, tie, short, other_env, longer, later]
    ids = lambda ts: [buffer.index(t) for t in ts]  # noqa: E731
    assert ids(training_set(buffer, "shortest", 0)) == [0, 1, 2, 3]  # the only successes so far, demos all kept
    # Round 1: task 1's 8 steps replace its 12; task 2's equal 5 keeps the earlier; tasks count per environment.
    assert ids(training_set(buffer, "shortest", 1)) == [0, 1, 3, 4, 5]
    assert ids(training_set(buffer, "shortest", 2)) == [0, 1, 4, 5, 7]
    assert ids(training_set(buffer, "cumulative", 2)) == list(range(8))
    with pytest.raises(ConfigError, match="--history must be .*'shortest'"):
        ClientConfig(history="best")


# ---- configuration ---------------------------------------------------------------------------------
def test_client_config_accepts_the_methods_settings():
    cfg = ClientConfig(env=" maze, wordle ", keep="all", history="round", explore_tasks=0)
    assert cfg.env_list() == ["maze", "wordle"]
    assert ClientConfig().env_list() == ["maze"]


@pytest.mark.parametrize("kw,match", [
    (dict(keep="failures"), "--keep must be 'successes'"),
    (dict(history="none"), "--history must be one of 'cumulative', 'round', 'shortest'"),
    (dict(explore_tasks=-1), "--explore-tasks must not be negative"),
    (dict(env=" , "), "--env is empty"),
    (dict(env="maze,wordle,maze"), "names an environment twice"),
    (dict(scoring="pmi"), "--scoring 'pmi': 'pmi' is not a rule; use one of sum, calibrated"),
    (dict(scoring="sum,babyai=pmi"), "'pmi' is not a rule"),
])
def test_client_config_says_what_to_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        ClientConfig(**kw)


@pytest.mark.parametrize("kw,match", [
    (dict(topology="star"), "--topology must be one of federated, local, centralized"),
    (dict(explore_tasks=-1), "--explore-tasks must not be negative"),
    (dict(scoring="pmi"), "'pmi' is not a rule; use one of sum, calibrated"),
    (dict(scoring="babyai=pmi"), "'pmi' is not a rule"),
    (dict(scoring="babyai:calibrated,=sum"), "write one rule .* or env=rule pairs"),
    (dict(scoring="chess=calibrated"), "--scoring names chess: environments are maze, wordle"),
    (dict(keep="failures"), "--keep must be 'successes'"),  # the client's settings, checked as a client does
    (dict(strategy="mean"), "--strategy 'mean' is unknown"),  # the aggregator's, as the aggregator does
])
def test_run_config_says_what_to_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(**kw)


def test_run_config_passes_on_the_services_settings_with_their_defaults_but_the_local_ones():
    cfg = RunConfig(envs="maze")
    for service in (ClientConfig, AggregatorConfig):
        defaults = {f.name: f.default for f in dataclasses.fields(service)}
        for name, value in cfg.passed_on(service).items():
            assert value == LOCAL_DEFAULTS.get(name, defaults[name]), name
    assert cfg.explore_tasks == 16 != ClientConfig().explore_tasks  # a local run's, stated in LOCAL_DEFAULTS
    assert set(cfg.passed_on(ClientConfig)) >= {"base_model", "explore_tasks", "eval_tasks", "keep", "history", "lr"}
    assert cfg.passed_on(AggregatorConfig) == {
        "rounds": 5, "strategy": "fedavg", "secure_aggregation": False, "round_deadline_s": 1800.0,
        "clip_norm": 0.0, "noise_multiplier": 0.0,
        "selector": "all", "clients_per_round": 0, "selection_fraction": 0.0, "fairness_rounds": 0,
        "selector_model": "", "mode": "sync", "async_concurrency": 0, "async_buffer": 0, "async_max_staleness": 8,
        "track": ()}


def test_each_topology_plans_its_aggregators_and_clients():
    def shape(topology):
        return [(f.name, f.run_id, [(c.client_id, c.envs) for c in f.clients])
                for f in plan(RunConfig(envs="maze,wordle", topology=topology))]
    assert shape("federated") == [("aggregator", "local", [("org-maze", ("maze",)), ("org-wordle", ("wordle",))])]
    assert shape("local") == [("aggregator-maze", "local-maze", [("org-maze", ("maze",))]),
                              ("aggregator-wordle", "local-wordle", [("org-wordle", ("wordle",))])]
    assert shape("centralized") == [("aggregator", "local", [("org-central", ("maze", "wordle"))])]


def test_each_process_is_planned_as_a_config_whose_flags_rebuild_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSE_BATCH_SIZE", "4")  # a client setting fedse run leaves alone: as the process would read it
    monkeypatch.setenv("FEDSE_EXPLORE_TASKS", "99")  # one it sets: its value wins, as its flag would
    demo = tmp_path / "wordle.json"
    demo.write_text('[{"item_id": "wordle_0", "conversations": [{"from": "human", "value": "guess"}, '
                    '{"from": "gpt", "value": "Action: crane"}]}]')
    cfg = RunConfig(envs="maze,wordle?vocab_size=30", topology="centralized", demos=f"wordle={demo}", **TINY)
    [fed] = plan(cfg)
    client = client_config(cfg, fed.clients[0], "127.0.0.1:1", "127.0.0.1:2", tmp_path / "state", threads=3)
    assert (client.client_id, client.env, client.batch_size, client.explore_tasks, client.torch_threads) == \
        ("org-central", "maze,wordle", 4, 4, 3)
    assert client.demos == (str(demo),) and client.state_dir == str(tmp_path / "state" / "clients")
    env_server = env_server_config(cfg, fed.clients[0])
    aggregator = aggregator_config(cfg, fed, tmp_path / "state")
    assert env_server.envs == "maze,wordle?vocab_size=30" and env_server.metrics_port == -1
    assert (aggregator.rounds, aggregator.start_clients, aggregator.min_clients) == (1, 1, 1)
    for config in (client, env_server, aggregator):  # what the process is started with
        assert parse(type(config), to_argv(config), environ={}) == config


def test_scoring_is_set_per_environment_and_a_client_of_several_gets_theirs_when_they_agree(tmp_path):
    assert RunConfig().scoring == "auto"
    assert scoring_for("auto", ("babyai",)) == "calibrated"  # the default run's BabyAI client (tiny model)
    assert scoring_for("auto", ("maze",)) == "sum"
    assert scoring_for("auto", ("babyai",), base_model="models/smollm2-135m-instruct") == "sum"
    # The tiny model exported as a directory is still the tiny model; another model's directory is not.
    from fedse.model.tinymodel import export_tiny_model, tiny_config

    assert scoring_for("auto", ("babyai",), base_model=export_tiny_model(str(tmp_path / "tiny"))) == "calibrated"
    (tmp_path / "other").mkdir()
    tiny_config().to_json_file(str(tmp_path / "other" / "config.json"))
    assert scoring_for("auto", ("babyai",), base_model=str(tmp_path / "other")) == "sum"
    assert scoring_for("calibrated", ("maze", "wordle")) == "calibrated"
    assert scoring_for("babyai=calibrated,webshop=calibrated", ("babyai", "webshop")) == "calibrated"
    # A client of several environments that disagree scores each by its own rule (the Centralized client
    # scores BabyAI as BabyAI's federated client does).
    spec = scoring_for("babyai=calibrated", ("maze", "babyai"))
    assert spec == "maze=sum,babyai=calibrated" and scoring_for("auto", ("maze", "babyai")) == spec
    central = ClientConfig(env="maze,babyai", scoring=spec)
    assert (central.scoring_of("maze"), central.scoring_of("babyai"), central.scoring_of("")) == ("sum", "calibrated",
                                                                                                 "sum")
    assert ClientConfig(scoring="calibrated,maze=sum").scoring_of("wordle") == "calibrated"


def test_results_split_a_clients_report_per_environment_and_micro_average():
    reports = [  # a Centralized client: maze 1 of 4 test tasks, wordle 2 of 8, then maze 4 of 4, wordle 0 of 8
        {"client_id": "org-central", "round": 0, "metrics": {
            "test_success": 3 / 12, "test_success/maze": 0.25, "test_tasks/maze": 4.0, "test_success/wordle": 0.25,
            "test_tasks/wordle": 8.0, "upload_bytes": 1000.0, "train_loss": 2.0}},
        {"client_id": "org-central", "round": 1, "metrics": {
            "test_success": 4 / 12, "test_success/maze": 1.0, "test_tasks/maze": 4.0, "test_success/wordle": 0.0,
            "test_tasks/wordle": 8.0}},
        {"client_id": "someone-else", "round": 0, "metrics": {"test_success": 1.0}},
    ]
    cfg = RunConfig(envs="maze,wordle?vocab_size=30", topology="centralized", rounds=1)
    results = collect(reports, {"org-central": ("maze", "wordle")}, cfg, 1.0)
    assert results["topology"] == "centralized"
    assert results["envs"]["maze"] == [
        {"round": 0, "test_success": 0.25, "test_tasks": 4.0, "upload_bytes": 1000.0, "train_loss": 2.0},
        {"round": 1, "test_success": 1.0, "test_tasks": 4.0}]
    assert [r["test_success"] for r in results["envs"]["wordle"]] == [0.25, 0.0]
    assert results["mean_test_success"] == [3 / 12, 4 / 12]  # over tasks, not the mean of the two rates


# ---- one client, two environments, keep all, history round (in process) ----------------------------
def test_a_client_holding_two_environments_keeps_all_and_trains_on_the_round(tmp_path):
    from services.client_agent.agent import ClientAgent
    from services.env_server.server import EnvServerConfig, create_server
    from support import FakeAggregator, serve_fake

    env_server, env_port = create_server(EnvServerConfig(address="127.0.0.1:0", envs="maze,wordle?vocab_size=30",
                                                         metrics_port=-1))
    env_server.start()
    agg = FakeAggregator(round_=0, num_rounds=2, advance=True)
    server, target = serve_fake(agg)
    cfg = ClientConfig(client_id="org-central", env="maze,wordle", env_server=f"127.0.0.1:{env_port}",
                       aggregator=target, state_dir=str(tmp_path), metrics_port=-1, expert_demos=3, explore_tasks=3,
                       eval_tasks=2, epochs=1, torch_threads=1, keep="all", history="round", round_timeout_s=60.0)
    agent = ClientAgent(cfg)
    try:
        agent.run()
        train_ids = {t.name: t.train_ids for t in map(agent.env_tasks, agent.envs)}
    finally:
        agent.close()
        server.stop(0)
        env_server.stop(0)
    assert [r for r, _ in agg.reports] == [0, 1, 2]
    for _, m in agg.reports:
        assert m["test_tasks/maze"] == m["test_tasks/wordle"] == 2
        assert m["test_success"] == pytest.approx((m["test_success/maze"] + m["test_success/wordle"]) / 2)
    buffer = Buffer(tmp_path / "org-central" / "buffer.jsonl").trajectories
    # D_0 of each environment is the one a client holding it alone draws (sampled from --seed).
    for env in ("maze", "wordle"):
        demos = [t.task_id for t in buffer if t.source == "expert" and t.env == env]
        assert sorted(demos) == sorted(random.Random(0).sample(train_ids[env], 3)), env
    explored = [t for t in buffer if t.source == "explore"]
    assert [t.round for t in explored] == [0] * 6 + [1] * 6  # --keep all: every exploration, 3 per env
    assert agg.reports[0][1]["kept"] == agg.reports[1][1]["kept"] == 6
    assert {t.env for t in explored} == {"maze", "wordle"}
    # --history round: round 1 trained on D_0 and round 1's trajectories, not on round 0's.
    round_1 = [t for t in buffer if t.source == "expert" or t.round == 1]
    # "examples" counts the agent turns trained on.
    assert agg.reports[1][1]["examples"] == sum(len(t.turns) for t in round_1)
    assert agg.reports[1][1]["examples"] < sum(len(t.turns) for t in buffer)


# ---- real processes: every topology through launcher.run ---------------------------------------------
def check_rows(results, envs, rounds=1):
    assert sorted(results["envs"]) == sorted(envs)
    for env, rows in results["envs"].items():
        assert [r["round"] for r in rows] == list(range(rounds + 1)), env
        assert all(r["test_tasks"] == 4 and 0 <= r["test_success"] <= 1 for r in rows), env
        assert all(r["upload_bytes"] > 0 for r in rows[:-1]) and "upload_bytes" not in rows[-1], env
    assert len(results["mean_test_success"]) == rounds + 1


@pytest.mark.slow
def test_centralized_one_client_reports_every_environment(tmp_path):
    results = run(RunConfig(envs="maze,wordle", topology="centralized", results=str(tmp_path), **TINY),
                  out=io.StringIO())
    assert results["topology"] == "centralized"
    check_rows(results, ["maze", "wordle"])
    maze, wordle = results["envs"]["maze"], results["envs"]["wordle"]
    # One client trained on the pooled buffer: D_0 of both environments, one upload shared by both rows.
    assert maze[0]["upload_bytes"] == wordle[0]["upload_bytes"] and maze[0]["examples"] == wordle[0]["examples"]
    assert maze[0]["buffer"] >= 8
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["aggregator.log", "client_agent-maze+wordle.log", "env_server-maze+wordle.log"]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    results = run(RunConfig(envs="maze,wordle?vocab_size=30", topology="local", results=str(out), **TINY), out=io.StringIO())
    return out, results


@pytest.mark.slow
def test_local_each_client_alone_with_its_own_aggregator(local_run):
    out, results = local_run
    assert results["topology"] == "local"
    check_rows(results, ["maze", "wordle"])
    for env in ("maze", "wordle"):
        run_dir = out / "state" / f"aggregator-{env}" / f"local-{env}"
        reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert {r["client_id"] for r in reports} == {f"org-{env}"}
        # Nothing averaged across clients: the next global adapter is this client's own upload.
        upload = ad.decode((out / "state" / "clients" / f"org-{env}" / "upload.safetensors").read_bytes())
        glob = ad.decode((run_dir / "global" / "round_0001" / "adapter_model.safetensors").read_bytes())
        assert upload.keys() == glob.keys() and all(upload[k].equal(glob[k]) for k in upload), env


@pytest.mark.slow
def test_federated_without_exploration_and_a_smaller_rank(tmp_path, local_run):
    cfg = RunConfig(envs="maze", results=str(tmp_path), lora_r=2, lora_alpha=4, **{**TINY, "explore_tasks": 0})
    results = run(cfg, out=io.StringIO())
    check_rows(results, ["maze"])
    first = results["envs"]["maze"][0]
    # FedIT: no exploration; round 0 trained on the 4 expert demonstrations alone.
    assert first["kept"] == 0 and first["buffer"] == 4 and "explore_success" not in first
    # Rank 2 sends about a quarter of rank 8's bytes (the local run's maze client, same model).
    rank8 = local_run[1]["envs"]["maze"][0]["upload_bytes"]
    assert first["upload_bytes"] < 0.3 * rank8
