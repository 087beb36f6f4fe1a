"""Does filtered self-imitation with LoRA raise held-out success? In-process, no gRPC.

One client, one environment, the Fed-SE local loop:
  round 0 (pre):  greedy success of the fresh adapter (= the frozen random base) on the test tasks;
  D_0:            expert demonstrations on `--demos` training tasks;
  round t >= 1:   explore `--explore` training tasks at temperature 1.0 with the current adapter, keep
                  the successful trajectories, D_t = D_{t-1} + successes, train the LoRA 2 epochs on
                  all of D_t (continuing from the current adapter), evaluate greedily on the test tasks.
Prints one table row per round: test success, exploration success, buffer size, loss, seconds.

    .venv/bin/python bench/learning_curve.py --rounds 5 --demos 10 --explore 32
    .venv/bin/python bench/learning_curve.py --env wordle --demos 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from lockstep import Played, play_side_by_side  # noqa: E402  (tests/lockstep.py)
from services.client_agent.model.loading import add_lora, load_base  # noqa: E402
from services.client_agent.playing.policy import ActionScorer  # noqa: E402
from services.client_agent.playing.prompts import TINY_MAX_PROMPT_TOKENS, format_prompt  # noqa: E402
from services.client_agent.training.trainer import TINY_LR, train_lora  # noqa: E402


def make_env(name: str):
    if name == "maze":
        from services.env_server.envs.maze import MazeEnv
        return MazeEnv()
    if name == "wordle":
        from services.env_server.envs.wordle import WordleEnv
        return WordleEnv()
    raise SystemExit(f"unknown env {name!r}")


def rollout(env, task_ids, choose, max_history: int, max_turns: int | None = None, fmt=None) -> list[Played]:
    """Plays all tasks in lock step (`play_side_by_side`); `choose(prompts, candidate lists) -> indices`, or
    None for the expert. Prompts are format_prompt's with `max_history` turns, or `fmt.prompt`'s where a
    prompts.PromptFormat is given (the client's)."""
    prompt = fmt.prompt if fmt else (lambda instruction, turns, obs: format_prompt(instruction, turns, obs, max_history))
    return play_side_by_side(env, task_ids, choose, prompt, max_turns)


def success_rate(trajs: list[Played]) -> float:
    return sum(t.success for t in trajs) / max(len(trajs), 1)


def agreement(trajs: list[Played]) -> float:
    return sum(t.agree for t in trajs) / max(sum(len(t.steps) for t in trajs), 1)


def maze_wrong_cells(trajs: list[Played]) -> list:
    """Diagnostic: the test starts whose first greedy action is not the expert's."""
    from services.env_server.envs.maze import STARTS, shortest_path_actions
    return [STARTS[t.task_id] for t in trajs if t.steps and t.steps[0][1] != shortest_path_actions(STARTS[t.task_id])[0]]


def run(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    env = make_env(args.env)
    overrides = json.loads(args.model_overrides) if args.model_overrides else {}
    if args.model == "fedse-tiny" and overrides:
        from fedse.model.tinymodel import build_tiny_model
        base, tok = build_tiny_model(args.model_seed, **overrides)
        for p in base.parameters():
            p.requires_grad_(False)
    else:
        base, tok = load_base(args.model, "cpu", seed=args.model_seed)
    model = add_lora(base, r=args.r, alpha=args.alpha, seed=args.seed)
    scorer = ActionScorer(model, tok, "cpu", max_prompt_tokens=args.max_prompt_tokens)
    gen = torch.Generator().manual_seed(args.seed)

    def greedy(prompts, cands):
        return scorer.choose(prompts, cands, greedy=True)

    def sample(prompts, cands):
        return scorer.choose(prompts, cands, greedy=False, generator=gen, temperature=args.temperature)

    test_tasks = env.tasks("test")[: args.test_tasks or None]
    train_tasks = env.tasks("train")
    rng = random.Random(args.seed)
    rows = []
    t0 = time.perf_counter()
    pre = rollout(env, test_tasks, greedy, args.max_history)
    first_actions = {}
    for t in pre:
        if t.steps:
            first_actions[t.steps[0][1]] = first_actions.get(t.steps[0][1], 0) + 1
    rows.append({"round": 0, "test": success_rate(pre), "explore": float("nan"), "new": 0, "buffer": 0,
                 "loss": float("nan"), "steps": 0, "train_s": 0.0, "seconds": time.perf_counter() - t0})
    print(f"# env={args.env} pre-training greedy first actions on test: {first_actions}", flush=True)

    demo_tasks = rng.sample(train_tasks, args.demos)
    demos = rollout(env, demo_tasks, None, args.max_history)
    buffer: list[tuple[str, str]] = [s for t in demos if t.success for s in t.steps]
    print(f"# D_0: {len(demos)} expert demonstrations, {sum(t.success for t in demos)} successful, "
          f"{len(buffer)} steps", flush=True)
    header = f"{'round':>5} {'test':>6} {'agree':>5} {'explore':>7} {'new':>4} {'buffer':>6} {'loss':>7} {'steps':>5} " \
             f"{'explore_s':>9} {'train_s':>7} {'eval_s':>6} {'round_s':>7}"
    print(header, flush=True)
    r0 = rows[0]
    print(f"{0:>5} {r0['test']:>6.2f} {agreement(pre):>5.2f} {'':>7} {'':>4} {'':>6} {'':>7} {'':>5} {'':>9} {'':>7} "
          f"{r0['seconds']:>6.1f} {'':>7}", flush=True)
    for rnd in range(1, args.rounds + 1):
        t_round = time.perf_counter()
        tasks = rng.sample(train_tasks, min(args.explore, len(train_tasks))) if args.explore else []
        explored = rollout(env, tasks, sample, args.max_history) if tasks else []
        new = [s for t in explored if t.success for s in t.steps]
        buffer.extend(new)
        explore_s = time.perf_counter() - t_round
        stats = train_lora(model, tok, buffer, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                           seed=args.seed + rnd, max_prompt_tokens=args.max_prompt_tokens)
        t_eval = time.perf_counter()
        test = rollout(env, test_tasks, greedy, args.max_history)
        eval_s = time.perf_counter() - t_eval
        row = {"round": rnd, "test": success_rate(test), "agree": agreement(test), "explore": success_rate(explored),
               "new_traj": sum(t.success for t in explored), "new": len(new), "buffer": len(buffer),
               "loss": stats["loss"], "steps": stats["steps"], "explore_s": explore_s,
               "train_s": stats["seconds"], "eval_s": eval_s, "seconds": time.perf_counter() - t_round}
        rows.append(row)
        if args.diag and args.env == "maze":
            print("#   wrong cells (first step from each test start):", maze_wrong_cells(test), flush=True)
        print(f"{rnd:>5} {row['test']:>6.2f} {row['agree']:>5.2f} {row['explore']:>7.2f} {row['new_traj']:>4} {row['buffer']:>6} "
              f"{row['loss']:>7.3f} {row['steps']:>5} {explore_s:>9.1f} {row['train_s']:>7.1f} {eval_s:>6.1f} "
              f"{row['seconds']:>7.1f}", flush=True)
    return rows


def scoring_speed(args) -> None:
    """Times one batched choose() over B concurrent sessions (first step of test tasks, one turn of
    history), for each environment and scoring method."""
    torch.set_num_threads(args.threads)
    base, tok = load_base(args.model, "cpu", seed=args.model_seed)
    model = add_lora(base, r=args.r, alpha=args.alpha, seed=args.seed)
    for env_name in ("maze", "wordle"):
        try:
            env = make_env(env_name)
        except ImportError:
            print(f"# {env_name}: not available")
            continue
        for method in ("packed", "cached"):
            scorer = ActionScorer(model, tok, "cpu", max_prompt_tokens=args.max_prompt_tokens, method=method)
            for batch in (1, 8, 32):
                tasks = (env.tasks("test") * 2)[:batch]
                eps = [env.reset(t) for t in tasks]
                prev = [(e.observation, e.available_actions()[0]) for e in eps]
                prompts = [format_prompt(e.instruction, [p], e.observation, args.max_history) for e, p in zip(eps, prev)]
                cands = [e.available_actions() for e in eps]
                scorer.choose(prompts, cands, greedy=False)  # warm-up
                reps = 3
                t0 = time.perf_counter()
                for _ in range(reps):
                    scorer.choose(prompts, cands, greedy=False)
                dt = (time.perf_counter() - t0) / reps
                print(f"{env_name:>6} {method:>6}: {batch:>2} sessions x {len(cands[0]):>3} candidates: "
                      f"{dt * 1000:7.1f} ms per step ({dt / batch * 1000:6.1f} ms per session)", flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="maze", choices=["maze", "wordle"])
    ap.add_argument("--model", default="fedse-tiny")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--model-overrides", default="", help='JSON, e.g. {"hidden_size": 96}')
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--lr", type=float, default=TINY_LR)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-history", type=int, default=1)
    ap.add_argument("--max-prompt-tokens", type=int, default=TINY_MAX_PROMPT_TOKENS)
    ap.add_argument("--demos", type=int, default=20)
    ap.add_argument("--explore", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--test-tasks", type=int, default=0, help="0: all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--diag", action="store_true", help="maze: print the test starts whose first action is wrong")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--speed", action="store_true", help="only time action scoring (maze and wordle)")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.speed:
        scoring_speed(args)
        return
    rows = run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
