"""Is it the client or the average? One environment's held-out success under the adapter its client
uploaded in round t (trained on its own buffer, at full strength) beside the global adapter the
aggregator made from every client's upload of that round.

A run of `fedse run` or `fedse experiment` with the tiny model keeps both: each round's uploads and
global adapters under state/aggregator/local/. Where the client's own adapter is good and the
global one is not, averaging loses the update; where the client's own is bad too, its data or its
training does. Plays the first `--test` test tasks greedily, as the client evaluates (one process,
no gRPC, the run's seed for the model and the tasks); `--norms` adds each client's update norm:

    .venv/bin/python bench/own_vs_global.py results/long/runs/fedse-seed0 results/long/runs/fedit-seed0
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import learning_curve  # noqa: E402
from tiny_envs import tiny_client  # noqa: E402
from fedse.config import SCORINGS  # noqa: E402
from services.client_agent.model.loading import set_adapter_state  # noqa: E402
from services.client_agent.playing.prompts import TINY_MAX_PROMPT_TOKENS  # noqa: E402


def success(env, fmt, scorer, model, test: list[int], adapter: pathlib.Path) -> float:
    """Greedy held-out success of `adapter` on the test tasks."""
    set_adapter_state(model, load_file(str(adapter)))
    scorer.forget()
    played = learning_curve.rollout(env, test, lambda p, c: scorer.choose(p, c, greedy=True), 1, fmt=fmt)
    return learning_curve.success_rate(played)


def success_row(run: pathlib.Path, a: argparse.Namespace, rounds: list[int]) -> list[str]:
    """"own / global" held-out success for each round, "-" where the run kept no such adapters."""
    seed = json.loads((run / "run.json").read_text())["config"]["seed"]
    client = argparse.Namespace(env=a.env, overrides="", seed=seed, window=TINY_MAX_PROMPT_TOKENS,
                                scoring=a.scoring, model_seed=seed)
    env, _, model, fmt, scorer = tiny_client(client)
    test = env.tasks("test")[:a.test]
    state = run / "state" / "aggregator" / "local"
    cells = []
    for r in rounds:
        own = state / "uploads" / f"round_{r:04d}" / f"org-{a.env}.safetensors"
        averaged = state / "global" / f"round_{r + 1:04d}" / "adapter_model.safetensors"
        if not own.exists() or not averaged.exists():
            cells.append("-")
            continue
        cells.append(f"{100 * success(env, fmt, scorer, model, test, own):.0f} / "
                     f"{100 * success(env, fmt, scorer, model, test, averaged):.0f}")
    return cells


def update_norms(state: pathlib.Path, round_: int) -> dict[str, float]:
    """Each client's update in round t, ||phi_k - phi_t|| over all its tensors (phi_t: the global
    adapter the round started from)."""
    start = load_file(str(state / "global" / f"round_{round_:04d}" / "adapter_model.safetensors"))
    norms = {}
    for upload in sorted((state / "uploads" / f"round_{round_:04d}").glob("*.safetensors")):
        tensors = load_file(str(upload))
        norms[upload.stem] = sum(float((tensors[k].float() - v.float()).pow(2).sum()) for k, v in start.items()) ** 0.5
    return norms


def print_norms(runs: list[pathlib.Path], rounds: list[int]) -> None:
    """The clients' update norms, one row per run and client."""
    print("\nupdate norm ||phi_k - phi_t|| of each client's upload in round t")
    print("| run | client | " + " | ".join(str(r) for r in rounds) + " |")
    print("|---|---|" + "---:|" * len(rounds))
    for run in runs:
        state = run / "state" / "aggregator" / "local"
        per_round = [update_norms(state, r) if (state / "uploads" / f"round_{r:04d}").is_dir() else {} for r in rounds]
        for client in sorted({c for norms in per_round for c in norms}):
            cells = [f"{norms[client]:.2f}" if client in norms else "-" for norms in per_round]
            print(f"| {run.name} | {client} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=pathlib.Path, help="run folders (each with run.json and state/)")
    ap.add_argument("--env", default="maze", help="the environment, and so the client (org-ENV)")
    ap.add_argument("--rounds", default="2,4,6,8,10,12,14,16,18", help="the rounds whose uploads to play")
    ap.add_argument("--test", type=int, default=20, help="held-out test tasks (the first N; 0: update norms only)")
    ap.add_argument("--scoring", choices=SCORINGS, default="sum", help="the client's --scoring (BabyAI: calibrated)")
    ap.add_argument("--norms", action="store_true", help="also print each client's update norm per round")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rounds = [int(r) for r in a.rounds.split(",")]
    if a.test > 0:
        print(f"{a.env}: held-out success (%) of the client's own upload in round t / the global adapter averaged "
              "from that round's uploads")
        print("| run | " + " | ".join(str(r) for r in rounds) + " |")
        print("|---|" + "---:|" * len(rounds))
        for run in a.runs:
            print(f"| {run.name} | " + " | ".join(success_row(run, a, rounds)) + " |", flush=True)
    if a.norms or a.test <= 0:
        print_norms(a.runs, rounds)


if __name__ == "__main__":
    main()
