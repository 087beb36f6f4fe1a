"""How long a run should take, said before it starts (apps.estimate): from the work planned and the
model's size, scaled by this machine's measured speed; `fedse experiment` says its total first."""

from __future__ import annotations

import io
import json

import pytest

import apps.estimate as est
import apps.experiment as ex
from apps.planning import RunConfig
from fedse.config import ALL

SPEED = est.REFERENCE_CORE_FLOPS  # the reference machine's


def seconds(cores: int = 2, speed: float = SPEED, **settings) -> float:
    return est.run_seconds(RunConfig(**{"envs": "maze,wordle", "rounds": 2, **settings}), speed, cores=cores)


def test_more_work_takes_longer_and_a_faster_machine_less():
    base = seconds()
    assert seconds(rounds=4) > base and seconds(envs="maze,wordle,babyai") > base
    assert seconds(eval_tasks=20) > seconds(eval_tasks=5) and seconds(explore_tasks=32) > seconds(explore_tasks=8)
    assert seconds(epochs=4) > base and seconds(expert_demos=40) > base
    assert seconds(speed=2 * SPEED) == pytest.approx(est.FIXED_S + (base - est.FIXED_S) / 2)
    assert seconds(cores=4) < base and seconds(cores=64) == seconds(cores=4)  # two clients: two pairs of cores at most


def test_all_test_tasks_count_each_built_in_environments_own():
    few, every = seconds(envs="maze", eval_tasks=5), seconds(envs="maze", eval_tasks=est.ALL_TEST_TASKS + 50)
    assert est.all_test_tasks("maze")["maze"] < est.ALL_TEST_TASKS
    assert seconds(envs="maze", eval_tasks=ALL) == every > few  # maze has fewer test tasks than either asks


def test_a_real_models_cost_grows_with_its_parameters(tmp_path):
    def model(name: str, params: float) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
        with open(folder / "model.safetensors", "wb") as fh:
            fh.truncate(int(2 * params))
        return str(folder)

    small, large = model("small", est.SMOLLM2_PARAMS), model("large", 10 * est.SMOLLM2_PARAMS)
    assert est.model_params(small) == est.SMOLLM2_PARAMS
    assert est.model_cost(small) == est.SMOLLM2 and est.model_cost("fedse-tiny") == est.TINY
    assert est.model_cost(large).episode_s == pytest.approx(10 * est.SMOLLM2.episode_s)
    assert seconds(base_model=large) > 5 * seconds(base_model=small) > 5 * seconds()


def test_the_machines_speed_is_measured_and_the_estimate_said_in_words():
    assert est.machine_speed(seconds=0.1) > 1e8
    assert est.words(45) == "about 45s" and est.words(8 * 60) == "about 8 minutes"
    assert est.words(3 * 3600) == "about 3.0 hours"
    line = est.estimate_line(8 * 60)
    assert line.startswith("this run: about 8 minutes expected on this machine") and "estimate" in line


def test_an_experiments_time_left_follows_how_its_finished_runs_compared_with_their_estimates():
    configs = [RunConfig(envs="maze", rounds=r) for r in (1, 2, 3)]
    f = est.Forecast(configs, speed=SPEED)
    assert f.left_s() == pytest.approx(sum(f.estimates))
    f.done(2 * f.estimates[0])  # the first run took twice its estimate: so will the others
    assert f.left_s() == pytest.approx(2 * sum(f.estimates[1:]))
    resumed = est.Forecast(configs, speed=SPEED)
    resumed.done(None)  # a resumed run did only its last rounds in this sitting: it rescales nothing
    assert resumed.left_s() == pytest.approx(sum(resumed.estimates[1:]))
    resumed.done(3 * resumed.estimates[1])
    assert resumed.after_current_s() == pytest.approx(0.0) and resumed.left_s() == pytest.approx(3 * resumed.estimates[2])


def test_an_experiment_says_its_total_before_its_first_run(tmp_path, monkeypatch):
    said: list[str] = []

    def stop(cfg, out, **_kw):  # the first run: what was said before it is all that is checked
        said.append("first run")
        raise KeyboardInterrupt

    monkeypatch.setattr(ex, "run_federation", stop)
    cfg = ex.ExperimentConfig(methods="fedse,local", envs="maze", seeds=1, rounds=1, results=str(tmp_path / "exp"))
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        ex.run(cfg, out=out)
    lines = out.getvalue().splitlines()
    assert lines[1:3] == ["runs done: 0", "runs to run: 2 (fedse-seed0, local-seed0)"]
    assert lines[3].startswith("2 of its 2 runs to run: about ") and "expected on this machine" in lines[3]
    assert "left in all" in lines[4] and said == ["first run"]


def test_a_client_that_takes_part_in_fewer_rounds_costs_less():
    """With a selector taking 2 of 8 members a round (or FedBuff folding 2 a version), each member plays
    about a quarter of the rounds: the run costs far less than every member playing every one."""
    every = RunConfig(envs="maze:8", rounds=8)
    few = RunConfig(envs="maze:8", rounds=8, selector="sample", clients_per_round=2)
    fedbuff = RunConfig(envs="maze:8", rounds=8, mode="async", async_buffer=2)
    assert est.taking_share(few, 8) == est.taking_share(fedbuff, 8) == 0.25 and est.taking_share(every, 8) == 1.0
    assert est.run_seconds(few, SPEED) < 0.5 * est.run_seconds(every, SPEED)
