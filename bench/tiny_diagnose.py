"""Where does the tiny model go wrong? Step-by-step agreement with the expert, in one process.

Trains a fresh LoRA on `--demos` expert demonstrations alone (`--epochs` epochs at full strength:
no exploration, no federation), then plays the first `--test` test tasks greedily beside the
expert and prints, for each turn, how many episodes still running chose the expert's action, and
the success rate; `--show N` also prints the first N episodes' steps (the chosen action, the
expert's, the three best-scored actions and, for the first turns, the window the model saw). An
upper bound on what a round of `make run` can teach an environment:

    .venv/bin/python bench/tiny_diagnose.py --env webshop --window 384 --scoring calibrated --demos 80 --epochs 8
    .venv/bin/python bench/tiny_diagnose.py --env textcraft --scoring sum --demos 40 --epochs 8 --per-byte
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import learning_curve  # noqa: E402
from tiny_envs import per_byte, tiny_client  # noqa: E402
from fedse.config import SCORINGS  # noqa: E402
from services.client_agent.playing.prompts import TINY_MAX_PROMPT_TOKENS  # noqa: E402
from services.client_agent.training.trainer import TINY_LR, train_lora  # noqa: E402
from services.env_server.envs import KNOWN_ENVS  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="webshop", choices=KNOWN_ENVS)
    ap.add_argument("--window", type=int, default=TINY_MAX_PROMPT_TOKENS, help="prompt window (bytes)")
    ap.add_argument("--scoring", choices=SCORINGS, default="calibrated")
    ap.add_argument("--per-byte", action="store_true", help="act on each action's score per byte")
    ap.add_argument("--demos", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--test", type=int, default=20, help="held-out test tasks (the first N)")
    ap.add_argument("--show", type=int, default=0, help="print the steps of the first N episodes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overrides", default="", help="JSON settings of the tiny model (e.g. a larger one)")
    a = ap.parse_args(argv)

    torch.set_num_threads(1)
    env, tok, model, fmt, scorer = tiny_client(a)
    demos = learning_curve.rollout(env, random.Random(a.seed).sample(env.tasks("train"), a.demos), None, 1, fmt=fmt)
    buffer = [s for t in demos if t.success for s in t.steps]
    stats = train_lora(model, tok, buffer, epochs=a.epochs, lr=TINY_LR, seed=a.seed + 1, max_prompt_tokens=a.window)
    scorer.forget()
    print(f"# {a.env}: {len(buffer)} demonstration steps, {a.epochs} epochs, loss {stats['loss']:.3f}", flush=True)

    test = env.tasks("test")[:a.test]

    def scored(prompts, cands) -> list[torch.Tensor]:
        scores = scorer.score(prompts, cands)
        return per_byte(fmt, scores, cands) if a.per_byte else scores

    def choose(prompts, cands) -> list[int]:
        return [int(torch.argmax(s)) for s in scored(prompts, cands)]

    for task in test[:a.show]:
        best: list[list[tuple[str, float]]] = []

        def shown(prompts, cands, best=best):
            (s,), (cs,) = scored(prompts, cands), cands
            best.append([(cs[j], round(float(s[j]), 1)) for j in torch.argsort(s, descending=True)[:3]])
            return [int(torch.argmax(s))]

        (traj,) = learning_curve.rollout(env, [task], shown, 1, fmt=fmt)
        for turn, ((prompt, action), agreed, top) in enumerate(zip(traj.steps, traj.agreed, best)):
            print(f"[task {task} turn {turn}] {'expert' if agreed else 'other '} {action!r}; best {top}")
            if turn < 3:
                print(f"    window: {tok.decode(tok(prompt, add_special_tokens=False)['input_ids'][-a.window:])!r}")
        print(f"[task {task}] success: {traj.success}")
    trajs = learning_curve.rollout(env, test, choose, 1, fmt=fmt)
    turns = max(len(t.steps) for t in trajs)
    per_turn = [(sum(t.agreed[k] for t in trajs if len(t.agreed) > k), sum(len(t.agreed) > k for t in trajs))
                for k in range(turns)]
    print("agreement with the expert by turn: " + ", ".join(f"{ok}/{n}" for ok, n in per_turn))
    print(f"held-out success {sum(t.success for t in trajs)}/{len(trajs)}")


if __name__ == "__main__":
    main()
