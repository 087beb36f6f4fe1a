"""agent-llm's answers and latency, constrained against unconstrained, on made-up client histories.

Drives the policy directly (no aggregator): for each size (4, 20, 60 clients) a few selection
situations with seeded random histories (alive or not, rounds chosen and uploaded, success, loss,
round times, dropouts), asks the model with and without constrained decoding, and prints per size
and mode: how often the answer is valid JSON, how often it passes the policy's checks, how often
its choice differs from agent-tools', and a selection's p50 / p95 seconds.

    .venv/bin/python bench/selector_llm.py --model models/smollm2-135m-instruct --situations 6
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedse.agents.asking import json_object  # noqa: E402
from services.aggregator.selection.policies import ClientHistory, SelectionInput  # noqa: E402
from services.aggregator.selection.agents import LLMAgent, ToolAgent  # noqa: E402


def situation(n: int, seed: int) -> SelectionInput:
    rng = random.Random(seed * 1000 + n)
    round_ = rng.randint(3, 12)
    clients = []
    for i in range(n):
        tried = rng.random() < 0.8
        chosen = tuple(sorted(rng.sample(range(round_), rng.randint(1, round_)))) if tried else ()
        uploaded = tuple(r for r in chosen if rng.random() < 0.85)
        clients.append(ClientHistory(
            f"org-{i:03d}", alive=rng.random() < 0.9, heartbeat_age_s=rng.choice([1.0, 3.0, 6.0, 20.0]),
            rounds_selected=chosen, rounds_uploaded=uploaded,
            last_success=round(rng.random(), 2) if uploaded else None,
            success_gain=round(rng.uniform(-0.1, 0.3), 2) if uploaded else None,
            last_loss=round(rng.uniform(0.5, 3.0), 2) if uploaded else None,
            mean_round_s=round(rng.uniform(30, 300), 1) if uploaded else None,
            dropouts=len(chosen) - len(uploaded)))
    return SelectionInput("bench", round_, seed, tuple(clients))


def measure(model: str, sizes: list[int], situations: int, max_new_tokens: int) -> None:
    print(f"model {model}; {situations} situations per size; clients-per-round a quarter of the clients")
    print(f"{'clients':>7} {'mode':>13} {'json':>6} {'policy':>7} {'differs':>8} {'p50 s':>7} {'p95 s':>7}")
    for n in sizes:
        k = max(1, n // 4)
        for constrained in (False, True):
            agent = LLMAgent(clients_per_round=k, model=model, max_new_tokens=max_new_tokens, max_seconds=600,
                             constrained=constrained)
            agent.load()
            answers: list[str] = []
            ask = agent.generate
            agent.generate = lambda name, prompt, schema=None: answers.append(ask(name, prompt, schema)) or answers[-1]
            valid = passed = differs = 0
            seconds = []
            for s in range(situations):
                inp = situation(n, s)
                tools = ToolAgent(clients_per_round=k).select(inp)
                started = time.perf_counter()
                sel = agent.select(inp)
                seconds.append(time.perf_counter() - started)
                try:
                    json_object(answers[-1] if len(answers) > s else "")
                    valid += 1
                except Exception:  # noqa: BLE001 - not JSON
                    pass
                passed += not sel.fallback_reason
                differs += sel.chosen != tools.chosen
            seconds.sort()
            p95 = seconds[min(len(seconds) - 1, round(0.95 * (len(seconds) - 1)))]
            print(f"{n:>7} {'constrained' if constrained else 'free':>13} {valid:>3}/{situations:<2} "
                  f"{passed:>4}/{situations:<2} {differs:>5}/{situations:<2} {statistics.median(seconds):>7.2f} "
                  f"{p95:>7.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--sizes", default="4,20,60")
    parser.add_argument("--situations", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    measure(args.model, [int(x) for x in args.sizes.split(",")], args.situations, args.max_new_tokens)


if __name__ == "__main__":
    main()
