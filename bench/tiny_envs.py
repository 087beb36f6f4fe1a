"""The tiny model's Fed-SE loop in one process, in any environment, as a client agent acts.

One client, no gRPC, the client's own prompt format (the tiny model's 160-byte window), scorer and
trainer:
  round 0:      greedy held-out success of the fresh adapter (the untrained base);
  D_0:          `--demos` expert demonstrations on training tasks;
  round t >= 1: explore `--explore` training tasks at temperature 1.0, keep the successes, train
                the LoRA `--epochs` epochs on the whole buffer, evaluate greedily on `--test` tasks.
`--diluted` also evaluates each round's adapter with its B matrices scaled by 1/5: roughly what one
client's update is worth in the mean of a 5-client federation (mean(B) mean(A), A barely moved).
`--per-byte` acts on each action's mean log-likelihood per byte (lm-eval's acc_norm) instead of its sum;
`--scoring calibrated` on its log-likelihood less that after the content-free prompt (the client's
--scoring). `--window` sets the prompt window (bytes).
`--overrides` builds another tiny model (e.g. '{"copy_circuit": false, "rope_theta": 10000.0,
"num_hidden_layers": 4}' is the model before its copy circuit).

    .venv/bin/python bench/tiny_envs.py --env babyai --demos 60 --explore 0 --epochs 3
    .venv/bin/python bench/tiny_envs.py --env maze --explore 32 --test 25 --rounds 3
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import learning_curve  # noqa: E402
from fedse.config import SCORINGS  # noqa: E402
from fedse.model.tinymodel import build_tiny_model  # noqa: E402
from services.client_agent.model.loading import add_lora  # noqa: E402
from services.client_agent.playing.policy import ActionScorer  # noqa: E402
from services.client_agent.playing.prompts import TINY_MAX_PROMPT_TOKENS, PlainFormat  # noqa: E402
from services.client_agent.training.trainer import TINY_LR, train_lora  # noqa: E402
from services.env_server.envs import KNOWN_ENVS  # noqa: E402
from services.env_server.registry import make_environment  # noqa: E402


def per_byte(fmt, scores, candidates) -> list[torch.Tensor]:
    """Each candidate's score divided by its agent text's bytes (lm-eval's acc_norm)."""
    return [s / torch.tensor([len(fmt.target(c).encode()) for c in cands], dtype=s.dtype)
            for s, cands in zip(scores, candidates)]


def tiny_client(a: argparse.Namespace) -> tuple:
    """One tiny-model client as a's --env, --overrides, --seed, --window and --scoring ask: (the
    environment, the tokenizer, the model with a fresh LoRA, the client's prompt format, its scorer).
    a.model_seed, where given, is a run's --seed: its tiny model and its environment's task splits."""
    run_seed = getattr(a, "model_seed", 0)
    env = make_environment(a.env, seed=run_seed)
    base, tok = build_tiny_model(run_seed, **(json.loads(a.overrides) if a.overrides else {}))
    for p in base.parameters():
        p.requires_grad_(False)
    model = add_lora(base, seed=a.seed)
    fmt = PlainFormat(1, a.window)
    return env, tok, model, fmt, ActionScorer(model, tok, "cpu", max_prompt_tokens=a.window, fmt=fmt, scoring=a.scoring)


def arguments(argv=None) -> argparse.Namespace:
    """The command line: the environment, the run's sizes and what the model acts on."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="babyai", choices=KNOWN_ENVS)
    ap.add_argument("--demos", type=int, default=20)
    ap.add_argument("--explore", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--test", type=int, default=20, help="held-out test tasks (the first N)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=TINY_LR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overrides", default="", help="JSON settings of the tiny model")
    ap.add_argument("--diluted", action="store_true", help="also evaluate with B x 1/5 (see above)")
    ap.add_argument("--per-byte", action="store_true",
                    help="act on each action's mean log-likelihood per byte instead of its sum (acc_norm)")
    ap.add_argument("--scoring", choices=SCORINGS, default="sum", help="what ranks actions (the client's --scoring)")
    ap.add_argument("--window", type=int, default=TINY_MAX_PROMPT_TOKENS, help="prompt window (bytes)")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = arguments(argv)

    torch.set_num_threads(a.threads)
    env, tok, model, fmt, scorer = tiny_client(a)
    gen = torch.Generator().manual_seed(a.seed)

    if a.per_byte:
        summed = scorer.score
        scorer.score = lambda prompts, candidates: per_byte(fmt, summed(prompts, candidates), candidates)

    def greedy(prompts, cands):
        return scorer.choose(prompts, cands, greedy=True)

    def sample(prompts, cands):
        return scorer.choose(prompts, cands, greedy=False, generator=gen)

    def rollout(task_ids, choose):
        """(one [(prompt, action)] list per task, successes); choose None: the expert."""
        trajs = learning_curve.rollout(env, task_ids, choose, 1, fmt=fmt)
        return [t.steps for t in trajs], [t.success for t in trajs]

    def rate(success) -> float:
        return sum(success) / max(len(success), 1)

    def diluted_success(test) -> float:
        lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
        saved = {n: p.detach().clone() for n, p in lora_b.items()}
        with torch.no_grad():
            for p in lora_b.values():
                p.mul_(0.2)
        scorer.forget()
        try:
            return rate(rollout(test, greedy)[1])
        finally:
            with torch.no_grad():
                for n, p in lora_b.items():
                    p.copy_(saved[n])
            scorer.forget()

    test = env.tasks("test")[:a.test]
    train = env.tasks("train")
    rng = random.Random(a.seed)
    t0 = time.perf_counter()
    print(f"# {a.env}: round 0 held-out success {rate(rollout(test, greedy)[1]):.2f} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    demos, ok = rollout(rng.sample(train, a.demos), None)
    buffer = [s for traj, good in zip(demos, ok) if good for s in traj]
    print(f"# D_0: {sum(ok)} successful demonstrations, {len(buffer)} steps", flush=True)
    print(f"{'round':>5} {'test':>5} {'diluted':>7} {'explore':>7} {'buffer':>6} {'loss':>6} {'steps':>5} "
          f"{'explore_s':>9} {'train_s':>7} {'eval_s':>6}", flush=True)
    for rnd in range(1, a.rounds + 1):
        t1 = time.perf_counter()
        explored, found = rollout(rng.sample(train, a.explore), sample) if a.explore else ([], [])
        buffer += [s for traj, good in zip(explored, found) if good for s in traj]
        t2 = time.perf_counter()
        stats = train_lora(model, tok, buffer, epochs=a.epochs, lr=a.lr, seed=a.seed + rnd,
                           max_prompt_tokens=a.window)
        scorer.forget()
        t3 = time.perf_counter()
        success = rate(rollout(test, greedy)[1])
        t4 = time.perf_counter()
        diluted = f"{diluted_success(test):7.2f}" if a.diluted else f"{'':>7}"
        print(f"{rnd:>5} {success:5.2f} {diluted} {rate(found):7.2f} {len(buffer):>6} {stats['loss']:6.3f} "
              f"{stats['steps']:>5} {t2 - t1:9.1f} {t3 - t2:7.1f} {t4 - t3:6.1f}", flush=True)


if __name__ == "__main__":
    main()
