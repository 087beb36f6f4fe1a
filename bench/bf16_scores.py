"""How far bfloat16 autocast moves a real model's action scores from fp32, per environment.

For every environment, plays the expert on a few test tasks and, at every step, scores all
admissible actions with the client's scorer in fp32 and under bf16 autocast (same prompts, the chat
format, an untrained adapter). Prints the mean and largest absolute difference of the summed
log-likelihoods, how often the greedy choice (evaluation) agrees, the total variation distance of
the sampling distributions (exploration at temperature 1), and the time of each:

    .venv/bin/python bench/bf16_scores.py [--base-model models/smollm2-135m-instruct] [--tasks 3]
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch

from services.client_agent.model.loading import add_lora, load_base
from services.client_agent.playing.policy import ActionScorer
from services.client_agent.playing.prompts import make_format
from services.env_server.envs import KNOWN_ENVS
from services.env_server.registry import make_environment

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--envs", default=",".join(KNOWN_ENVS))
    ap.add_argument("--tasks", type=int, default=3, help="test tasks per environment")
    ap.add_argument("--steps", type=int, default=6, help="most steps per task")
    args = ap.parse_args()
    model, tok = load_base(args.base_model)
    model = add_lora(model)
    fmt = make_format(model, tok)
    print("| env | steps | mean abs diff (nats) | max abs diff | greedy agrees | sampling TV distance "
          "| fp32 s | bf16 s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.envs.split(","):
        env = make_environment(name)
        prompts, cands = [], []
        for task in env.tasks("test")[: args.tasks]:
            ep = env.reset(task)
            turns = []
            for _ in range(args.steps):
                prompts.append(fmt.prompt(ep.instruction, turns, ep.observation))
                cands.append(ep.available_actions())
                action = ep.expert_action()
                turns.append((ep.observation, action))
                result = ep.step(action)
                if result.done:
                    break
                ep.observation = result.observation
        scores, seconds = {}, {}
        for precision in ("fp32", "bf16"):
            scorer = ActionScorer(model, tok, fmt=fmt, precision=precision)
            t0 = time.perf_counter()
            scores[precision] = [scorer.score([p], [c])[0] for p, c in zip(prompts, cands)]
            seconds[precision] = time.perf_counter() - t0
        diffs = torch.cat([(a - b).abs() for a, b in zip(scores["fp32"], scores["bf16"])])
        agree = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(scores["fp32"], scores["bf16"]))
        tv = [0.5 * float((torch.softmax(a.double(), 0) - torch.softmax(b.double(), 0)).abs().sum())
              for a, b in zip(scores["fp32"], scores["bf16"])]
        print(f"| {name} | {len(prompts)} | {float(diffs.mean()):.3f} | {float(diffs.max()):.3f} "
              f"| {agree}/{len(prompts)} | {sum(tv) / len(tv):.3f} | {seconds['fp32']:.1f} | {seconds['bf16']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
