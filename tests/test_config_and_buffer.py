"""Configuration from flags and environment; the persisted trajectory buffer."""

import copy
import dataclasses
import json
import os

import pytest

from fedse.config import ALL, ConfigError, parse, plain, to_argv
from services.aggregator.server import AggregatorConfig
from services.client_agent.training.buffer import Buffer, Trajectory
from services.client_agent.config import ClientConfig


def test_flags_win_over_environment_and_defaults_fill_the_rest():
    cfg = parse(AggregatorConfig, ["--rounds", "7"], environ={"FEDSE_ROUNDS": "3", "FEDSE_STRATEGY": "weighted"})
    assert cfg.rounds == 7 and cfg.strategy == "weighted" and cfg.min_clients == 1
    assert parse(AggregatorConfig, to_argv(cfg), environ={}) == cfg


@pytest.mark.parametrize("argv,environ,match", [
    (["--rounds", "zero"], {}, "--rounds: expected int"),
    (["--strategy", "mode"], {}, "strategy 'mode' is unknown"),
    ([], {"FEDSE_MIN_CLIENTS": "0"}, "min-clients must be at least 1"),
])
def test_bad_settings_say_which_and_what_is_expected(argv, environ, match):
    with pytest.raises(ConfigError, match=match):
        parse(AggregatorConfig, argv, environ=environ)


def test_client_config_validation():
    with pytest.raises(ConfigError, match="--policy"):
        ClientConfig(policy="magic")
    assert ClientConfig(target_modules="q_proj, v_proj").lora_targets() == ["q_proj", "v_proj"]


def traj(i: int, success: bool = True) -> Trajectory:
    return Trajectory(env="maze", task_id=i, instruction="go", turns=(("at 1, 1", "move up"), ("at 0, 1", "move left")),
                      success=success, reward=1.0 if success else 0.0, source="explore", round=0)


def test_eval_tasks_takes_a_number_or_all_and_refuses_a_zero_that_reads_as_none():
    base = ["--client-id", "c", "--env", "maze", "--env-server", "e:1", "--aggregator", "a:1"]
    every = parse(ClientConfig, [*base, "--eval-tasks", "all"], environ={})
    assert every.eval_tasks is ALL and every.eval_tasks == 0  # all test tasks: tasks[:n] if n else tasks
    assert parse(ClientConfig, base, environ={}).eval_tasks is ALL  # the default
    assert parse(ClientConfig, [*base, "--eval-tasks", "7"], environ={}).eval_tasks == 7
    # A process started with another's flags gets the same setting: ALL travels as "all".
    assert parse(ClientConfig, to_argv(every), environ={}).eval_tasks is ALL
    # Copied (dataclasses.asdict copies deeply) it stays ALL, and JSON records it as "all", not as the 0
    # it equals, which would read as none.
    assert copy.deepcopy(every).eval_tasks is ALL and dataclasses.asdict(every)["eval_tasks"] is ALL
    assert json.loads(json.dumps(plain({"eval_tasks": ALL, "n": [ALL, 3]}))) == {"eval_tasks": "all", "n": ["all", 3]}
    with pytest.raises(ConfigError, match="--eval-tasks 0 would mean no test task evaluated: give how many, or 'all'"):
        parse(ClientConfig, [*base, "--eval-tasks", "0"], environ={})
    with pytest.raises(ConfigError, match="FEDSE_EVAL_TASKS: expected a number or 'all', got 'most'"):
        parse(ClientConfig, base, environ={"FEDSE_EVAL_TASKS": "most"})


def test_buffer_persists_and_survives_a_torn_last_line(tmp_path):
    path = tmp_path / "buffer.jsonl"
    b = Buffer(path)
    b.extend([traj(1), traj(2)])
    with open(path, "a") as fh:
        fh.write('{"env": "maze", "task_id": 3, "instr')  # a crash mid-write
    again = Buffer(path)
    assert [t.task_id for t in again.trajectories] == [1, 2]
    assert again.trajectories[0] == traj(1)
    again.extend([traj(4)])
    assert [t.task_id for t in Buffer(path).trajectories] == [1, 2, 4]


def test_a_list_valued_setting_takes_repeated_flags_or_one_variable_of_paths():
    assert ClientConfig().demos == ()
    cfg = parse(ClientConfig, ["--demos", "a.json", "--demos", "b.jsonl"], environ={"FEDSE_DEMOS": "x.json"})
    assert cfg.demos == ("a.json", "b.jsonl")  # flags replace the variable's items
    both = os.pathsep.join(["x.json", "", "dir/y.jsonl"])
    assert parse(ClientConfig, [], environ={"FEDSE_DEMOS": both}).demos == ("x.json", "dir/y.jsonl")
    assert parse(ClientConfig, to_argv(cfg), environ={}) == cfg
    argv = to_argv(cfg)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--demos"] == ["a.json", "b.jsonl"]
    assert "--demos" not in to_argv(ClientConfig())  # an empty list: no flag at all
    with pytest.raises(ConfigError, match="--demos names an empty path"):
        parse(ClientConfig, ["--demos", " "], environ={})
    with pytest.raises(ConfigError, match="--max-new-tokens must be at least 1"):
        ClientConfig(max_new_tokens=0)


def test_buffer_lines_from_before_texts_still_load_and_texts_round_trip(tmp_path):
    old = ('{"env": "maze", "task_id": 1, "instruction": "go", "turns": [["at 1, 1", "move up"]], "success": true, '
           '"reward": 1.0, "source": "expert", "round": -1}')
    t = Trajectory.from_json(old)
    assert t.texts == () and t.turns == (("at 1, 1", "move up"),)
    assert "texts" not in t.to_json()  # a trajectory without texts writes the line it always did
    written = Trajectory(env="say", task_id=4, instruction="say it", turns=(("The word is amber.", "amber"),),
                         success=True, reward=1.0, source="file", round=-1,
                         texts=("Thought:\nI say it.\n\nAction:\namber",))
    path = tmp_path / "buffer.jsonl"
    path.write_text(old + "\n")
    Buffer(path).extend([written])
    assert Buffer(path).trajectories == [t, written]
    with pytest.raises(ValueError, match="one per turn"):
        Trajectory(env="say", task_id=4, instruction="", turns=(("o", "a"),), success=True, reward=1.0,
                   source="file", round=-1, texts=("a", "b"))


def test_an_old_setting_name_still_works_for_a_release_with_a_warning(capsys):
    # --num-rounds became --rounds (fedse run's name); the old flag and variable still work, and say so.
    assert parse(AggregatorConfig, ["--num-rounds", "4"], environ={}).rounds == 4
    assert capsys.readouterr().err == "warning: --num-rounds is deprecated and goes in the next release: use --rounds\n"
    assert parse(AggregatorConfig, [], environ={"FEDSE_NUM_ROUNDS": "6"}).rounds == 6
    assert "FEDSE_NUM_ROUNDS is deprecated and goes in the next release: set FEDSE_ROUNDS" in capsys.readouterr().err
    # The new name wins over the old; the old one never shows in --help.
    assert parse(AggregatorConfig, ["--rounds", "2", "--num-rounds", "9"], environ={}).rounds == 2
    assert parse(AggregatorConfig, [], environ={"FEDSE_ROUNDS": "3", "FEDSE_NUM_ROUNDS": "9"}).rounds == 3
    with pytest.raises(SystemExit):
        parse(AggregatorConfig, ["--help"], environ={})
    out = capsys.readouterr().out
    assert "--rounds ROUNDS" in out and "--num-rounds" not in out
