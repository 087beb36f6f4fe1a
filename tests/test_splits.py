"""The members of one environment share its training tasks (fedse.splits): iid and Dirichlet shares
are disjoint, cover every task, follow the seed, and Dirichlet's skew by task type follows alpha;
the client's --task-share and --task-split are checked; `fedse run --envs NAME:N` and --clients plan
the members (and nothing else changes without them); members of a real env server's environment
hold disjoint shares of its training tasks and the same test tasks."""

from __future__ import annotations

import collections
import pathlib
import statistics

import pytest

from fedse.config import ConfigError
from fedse.splits import (BABYAI_LEVELS, TYPE_BUCKETS, DirichletSplit, IIDSplit, split_for, split_members,
                          task_type, task_types)
from services.client_agent.config import ClientConfig

# BabyAI's default training tasks look like these: 27 of the 40 levels, 30 tasks each.
BABYAI_IDS = [i for i in range(90, 2000) if i % BABYAI_LEVELS < 27][:810]
SPLITS = ("iid", "dirichlet:0.1", "dirichlet:0.5", "dirichlet:100")


def shares(name: str, members: int, seed: int = 0, ids=BABYAI_IDS, env: str = "babyai") -> list[list[int]]:
    split = split_for(name)
    return [split.share(ids, task_types(env, ids), members, m, seed) for m in range(members)]


def skew(parts: list[list[int]], env: str = "babyai") -> float:
    """The members' mean total-variation distance between their task-type mix and the whole's."""
    whole = collections.Counter(task_types(env, [i for p in parts for i in p]))
    total = sum(whole.values())

    def tv(part: list[int]) -> float:
        mine = collections.Counter(task_types(env, part))
        return 0.5 * sum(abs(mine[t] / len(part) - whole[t] / total) for t in whole)
    return statistics.mean(tv(p) for p in parts if p)


@pytest.mark.parametrize("name", SPLITS)
@pytest.mark.parametrize("members", [1, 3, 7, 40])
def test_shares_are_disjoint_and_together_every_task(name, members):
    parts = shares(name, members)
    flat = [i for p in parts for i in p]
    assert sorted(flat) == sorted(BABYAI_IDS) and len(set(flat)) == len(flat)
    assert all(parts), "every member holds a task where there are enough"
    assert all(p == [i for i in BABYAI_IDS if i in set(p)] for p in parts), "in the order listed"


def test_iid_shares_are_even():
    assert {len(p) for p in shares("iid", 7)} == {810 // 7, 810 // 7 + 1}


@pytest.mark.parametrize("name", SPLITS)
def test_shares_follow_the_seed(name):
    assert shares(name, 5, seed=3) == shares(name, 5, seed=3)
    assert shares(name, 5, seed=3) != shares(name, 5, seed=4)


def test_dirichlet_skews_by_type_as_alpha_says():
    """A member's mix of types is far from the whole's for a small alpha (a few types of 27, mostly its
    own), as close as rounding allows for a large one; an iid deal of 162 tasks strays by chance."""
    small, mid, large, iid = (skew(shares(n, 5)) for n in ("dirichlet:0.1", "dirichlet:1", "dirichlet:1000", "iid"))
    assert small > 0.5 and small > mid > 0.2 > iid > large
    assert large < 0.05 and iid < 0.2
    sizes = [len(p) for p in shares("dirichlet:1000", 10)]
    assert max(sizes) - min(sizes) < 20, "a large alpha is close to iid in size too"


def test_every_member_gets_a_task_where_there_are_enough():
    ids = list(range(60))
    for seed in range(5):
        parts = shares("dirichlet:0.01", 50, seed, ids, env="maze")
        assert all(parts) and sorted(i for p in parts for i in p) == ids
    few = shares("dirichlet:0.5", 8, 0, [1, 2, 3], env="maze")  # fewer tasks than members: some hold none
    assert sorted(i for p in few for i in p) == [1, 2, 3]


def test_task_types():
    babyai = pytest.importorskip("services.env_server.envs.babyai")
    assert BABYAI_LEVELS == len(babyai.AGENTGYM_LEVELS)
    env = babyai.BabyAIEnv()
    for i in env.tasks("train")[:50]:
        assert task_type("babyai", i) == f"level{babyai.AGENTGYM_LEVELS.index(env.task(i)[0])}"
    buckets = {task_type("maze", i) for i in range(1000)}
    assert buckets == {f"bucket{b}" for b in range(TYPE_BUCKETS)}
    assert task_type("wordle", 123) == task_type("wordle", 123) == task_type("maze", 123)


@pytest.mark.parametrize("name", ["", "random", "dirichlet", "dirichlet:", "dirichlet:0", "dirichlet:-1",
                                  "dirichlet:abc", "dirichlet:nan", "dirichlet:inf", "iid:2"])
def test_bad_split_names_name_the_choices(name):
    with pytest.raises(ConfigError, match="'iid' or 'dirichlet:ALPHA'"):
        split_for(name)


def test_split_names():
    assert isinstance(split_for("iid"), IIDSplit)
    assert isinstance(split_for(" dirichlet:0.5 "), DirichletSplit) and split_for("dirichlet:0.5").alpha == 0.5
    assert repr(split_for("dirichlet:0.50")) == "dirichlet:0.5"
    with pytest.raises(ConfigError):
        IIDSplit().share([1, 2], ["a", "a"], 2, 2, 0)


def test_client_config_checks_the_share_and_split():
    assert ClientConfig(task_share="2/3", task_split="dirichlet:0.5").task_share == "2/3"
    assert ClientConfig().task_share == "" and ClientConfig().task_split == "iid"
    for share in ("3/3", "0/0", "1", "a/b", "-1/2", "1/2/3"):
        with pytest.raises(ConfigError, match="--task-share"):
            ClientConfig(task_share=share)
    with pytest.raises(ConfigError, match="--task-split.*'iid' or 'dirichlet:ALPHA'"):
        ClientConfig(task_split="skewed")


def test_members_in_env_specs():
    assert split_members("babyai:40") == ("babyai", 40)
    assert split_members(" wordle?vocab_size=30:4 ") == ("wordle?vocab_size=30", 4)
    assert split_members("wordle?vocab_size=30") == ("wordle?vocab_size=30", 0)
    assert split_members("mine=pkg.mod:factory") == ("mine=pkg.mod:factory", 0)
    assert split_members("tc=agentgym:textcraft@http://127.0.0.1:36001") == (
        "tc=agentgym:textcraft@http://127.0.0.1:36001", 0)
    assert split_members("tc=agentgym:textcraft@http://127.0.0.1:36001:3") == (
        "tc=agentgym:textcraft@http://127.0.0.1:36001", 3)
    with pytest.raises(ConfigError, match="at least 1"):
        split_members("maze:0")


def planned(**settings) -> list[tuple[str, str, str]]:
    from apps.planning import RunConfig, plan

    return [(c.client_id, "+".join(c.envs), c.share) for f in plan(RunConfig(**settings)) for c in f.clients]


def test_fedse_run_plans_members():
    expected = [("org-babyai-00", "babyai", "0/3"), ("org-babyai-01", "babyai", "1/3"),
                ("org-babyai-02", "babyai", "2/3"), ("org-maze-00", "maze", "0/2"), ("org-maze-01", "maze", "1/2")]
    assert planned(envs="babyai:3,maze:2") == expected
    assert planned(envs="babyai,maze", clients=5) == expected
    assert planned(envs="maze,wordle?vocab_size=30:2") == [("org-maze", "maze", ""), ("org-wordle-00", "wordle", "0/2"),
                                                          ("org-wordle-01", "wordle", "1/2")]
    assert [c for c, _, _ in planned(envs="maze:12")][-2:] == ["org-maze-10", "org-maze-11"]
    assert planned(envs="maze:1,wordle", clients=0) == [("org-maze", "maze", ""), ("org-wordle", "wordle", "")]


def test_fedse_run_without_members_plans_as_before():
    assert planned(envs="maze,wordle") == [("org-maze", "maze", ""), ("org-wordle", "wordle", "")]
    assert planned(envs="maze,wordle", topology="local") == [("org-maze", "maze", ""), ("org-wordle", "wordle", "")]
    assert planned(envs="maze,wordle", topology="centralized") == [("org-central", "maze+wordle", "")]


@pytest.mark.parametrize("settings, message", [
    ({"envs": "maze:2", "topology": "local"}, "--topology federated"),
    ({"envs": "maze", "clients": 2, "topology": "centralized"}, "--topology federated"),
    ({"envs": "maze:2,wordle", "clients": 3}, "not both"),
    ({"envs": "maze,wordle", "clients": 1}, "fewer than the 2 environments"),
    ({"envs": "maze", "clients": -1}, "--clients"),
    ({"envs": "maze:2", "task_split": "dirichlet:x"}, "--task-split"),
])
def test_fedse_run_refuses_members_it_cannot_plan(settings, message):
    from apps.planning import RunConfig

    with pytest.raises(ConfigError, match=message):
        RunConfig(**settings)


def test_the_run_records_each_members_share_and_split():
    from apps.planning import LOOPBACK, RunConfig, client_config, client_settings, plan

    cfg = RunConfig(envs="maze:2,wordle", task_split="dirichlet:0.5", seed=7)
    recorded = client_settings(cfg)
    assert {k: (v["task_share"], v["task_split"], v["seed"]) for k, v in recorded.items()} == {
        "org-maze-00": ("0/2", "dirichlet:0.5", 7), "org-maze-01": ("1/2", "dirichlet:0.5", 7),
        "org-wordle": ("", "dirichlet:0.5", 7)}
    member = plan(cfg)[0].clients[1]
    assert member.label == "maze-01"
    assert client_config(cfg, member, LOOPBACK, LOOPBACK, pathlib.Path("s"), 1).task_share == "1/2"


@pytest.mark.parametrize("split", ["iid", "dirichlet:0.5"])
def test_members_of_a_real_env_server_hold_disjoint_shares(split):
    from services.client_agent.playing.envclient import EnvClient
    from services.client_agent.playing.tasks import env_tasks
    from support import env_server_in_process

    with env_server_in_process("babyai") as target:
        env = EnvClient(target, "babyai", timeout_s=10, retry_s=10)
        try:
            whole = env_tasks(env, 5)
            members = [env_tasks(env, 5, share=f"{k}/3", split=split, seed=1) for k in range(3)]
        finally:
            env.close_channel()
    assert len(whole.train_ids) == 810
    flat = [i for m in members for i in m.train_ids]
    assert sorted(flat) == sorted(whole.train_ids) and len(set(flat)) == len(flat) and all(m.train_ids for m in members)
    assert all(m.test_ids == whole.test_ids for m in members), "every member evaluates the same test tasks"
