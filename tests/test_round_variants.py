"""The variants of Fed-SE's round that stay within the method (issue: does self-evolution act): more
tries per exploration task (--explore-tries), a learning rate per round (--round-lr) and a kept share
of the seed demonstrations (--expert-share) and a bound on what a round trains on
(--round-trajectories); each checked on its own, then together in a real client agent's rounds
against an in-process env server."""

from __future__ import annotations

import pytest

from fedse.config import ConfigError
from services.client_agent.config import ClientConfig
from services.client_agent.training.buffer import Buffer, Trajectory, capped, to_keep, with_expert_share
from services.client_agent.training.round_lr import round_lr_for
from support import FakeAggregator, env_server_in_process, serve_fake


def traj(task: int, success: bool, source: str = "explore", round_: int = 0, env: str = "maze") -> Trajectory:
    return Trajectory(env=env, task_id=task, instruction="go", turns=(("o", "a"),), success=success,
                      reward=float(success), source=source, round=round_ if source == "explore" else -1)


def test_round_rates():
    assert [round_lr_for("constant").rate(1e-3, r, 5) for r in range(5)] == [1e-3] * 5
    cosine = [round_lr_for("cosine").rate(1.0, r, 5) for r in range(5)]
    assert cosine[0] == pytest.approx(1.0) and cosine[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(cosine, cosine[1:]))
    assert round_lr_for("cosine").rate(1.0, 0, 1) == pytest.approx(1.0)  # one round: --lr
    assert [round_lr_for("halving:2").rate(8.0, r, 9) for r in range(6)] == [8, 8, 4, 4, 2, 2]
    for bad in ("linear", "halving:0", "halving:x", "halving"):
        with pytest.raises(ConfigError, match="'constant', 'cosine' or 'halving:K'"):
            round_lr_for(bad)


def test_the_first_success_of_a_task_tried_several_times_is_kept():
    explored = [traj(1, False), traj(1, True), traj(2, True), traj(1, True), traj(2, True, env="wordle"),
                traj(3, False)]
    assert to_keep(explored, "successes") == [explored[1], explored[2], explored[4]]
    assert to_keep(explored, "all") == explored
    assert to_keep([traj(1, True, round_=0), traj(1, True, round_=1)], "successes") == \
        [traj(1, True, round_=0), traj(1, True, round_=1)]  # another round's is another try


def test_the_seed_demonstrations_keep_their_share():
    demos = [traj(i, True, "expert") for i in range(2)]
    explored = [traj(10 + i, True) for i in range(10)]
    assert with_expert_share(demos + explored, 0.0) == demos + explored
    mixed = with_expert_share(demos + explored, 0.5)
    assert sum(t.source == "expert" for t in mixed) == 10 and len(mixed) == 20  # 5 copies of each demo
    assert mixed[:12] == demos + explored  # the buffer's own order first, then the copies
    assert with_expert_share(demos, 0.5) == demos and with_expert_share(explored, 0.5) == explored
    small = with_expert_share(demos * 5 + explored, 0.3)  # already 50%: nothing added
    assert len(small) == 20


def test_a_capped_round_keeps_every_demonstration_and_samples_the_rest():
    demos = [traj(i, True, "expert") for i in range(3)]
    explored = [traj(10 + i, True, round_=i % 4) for i in range(30)]
    buffer = demos[:1] + explored[:15] + demos[1:] + explored[15:]
    assert capped(buffer, 0, seed=1) == buffer and capped(buffer, 40, seed=1) == buffer  # 0: all; room for all
    first, again, other = capped(buffer, 10, seed=1), capped(buffer, 10, seed=1), capped(buffer, 10, seed=2)
    assert len(first) == 10 and all(d in first for d in demos)
    assert first == again and first != other  # a round's own sample: the same when retrained
    assert first == [t for t in buffer if any(t is c for c in first)]  # in buffer order
    assert capped(buffer, 2, seed=1) == demos  # no room left: the demonstrations, all of them


@pytest.mark.parametrize("kw,message", [({"explore_tries": 0}, "--explore-tries must be at least 1"),
                                        ({"expert_share": 1.0}, "--expert-share must be in"),
                                        ({"round_lr": "step"}, "--round-lr must be"),
                                        ({"round_trajectories": -1}, "--round-trajectories must be 0")])
def test_bad_settings_say_what_to_fix(kw, message):
    with pytest.raises(ConfigError, match=message):
        ClientConfig(**kw)


def test_a_client_with_the_variants_tries_each_task_keeps_first_successes_steps_its_rate_and_caps_its_round(tmp_path):
    """Two rounds of a real client (tiny model, the Maze) against a fake aggregator: its exploration
    plays each task 3 times, the buffer holds at most one success per task and round, and each
    round reports the rate the cosine schedule gives it and trains on at most 3 trajectories."""
    from services.client_agent.agent import ClientAgent

    agg = FakeAggregator(round_=0, num_rounds=2, advance=True)
    server, target = serve_fake(agg)
    with env_server_in_process() as env_target:
        cfg = ClientConfig(client_id="org-a", env="maze", env_server=env_target, aggregator=target,
                           state_dir=str(tmp_path), metrics_port=-1, expert_demos=2, explore_tasks=4, eval_tasks=2,
                           epochs=1, concurrency=6, torch_threads=1, round_timeout_s=60.0, lr=1e-2,
                           explore_tries=3, round_lr="cosine", expert_share=0.5, round_trajectories=3)
        agent = ClientAgent(cfg)
        try:
            history = agent.run()
        finally:
            agent.close()
            server.stop(0)
    trained = [h for h in history if "train_lr" in h]
    assert [h["train_lr"] for h in trained] == pytest.approx([1e-2, 1e-3])  # rounds 0 and 1 of 2
    explored = [t for t in Buffer(tmp_path / "org-a" / "buffer.jsonl").trajectories if t.source == "explore"]
    keys = [(t.task_id, t.round) for t in explored]
    assert len(keys) == len(set(keys)) and all(t.success for t in explored)
    assert [h["explored"] for h in trained] == [12.0, 12.0]  # 4 tasks, 3 times each, a round
    assert all(h["kept"] <= 4 for h in trained)
    # At most 3 trajectories a round: the 2 demonstrations and what room is left of those kept so far.
    kept_so_far = [sum(h["kept"] for h in trained[:i + 1]) for i in range(len(trained))]
    assert [h["train_trajectories"] for h in trained] == [min(3.0, 2 + k) for k in kept_so_far]
