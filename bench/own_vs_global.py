"""Is it the client or the average? One environment's held-out success under the adapter its client
uploaded in round t (trained on its own buffer, at full strength) beside the global adapter the
aggregator made from every client's upload of that round.

A run of `fedse run` or `fedse experiment` with the tiny model keeps both: each round's uploads and
global adapters under state/aggregator/local/. Where the client's own adapter is good and the
global one is not, averaging loses the update; where the client's own is bad too, its data or its
training does. Plays the first `--test` test tasks greedily, as the client evaluates (one process,
no gRPC, the run's seed for the model and the tasks). `--alone` also plays the client's update
alone at the strength the mean gives it, phi_t + (phi_k - phi_t) / K: bad too, the short step is
what fails; good, the others' updates undo it. `--norms` adds each client's update norm, and
`--kept` the share of the client's weight update dW = B'A' - BA that the global step keeps (the
mean of K clients whose updates share nothing keeps 1/K; the others' updates undoing it, less):

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


def global_file(state: pathlib.Path, round_: int) -> pathlib.Path:
    """phi_round, the global adapter round `round_` started from."""
    return state / "global" / f"round_{round_:04d}" / "adapter_model.safetensors"


def upload_files(state: pathlib.Path, round_: int) -> list[pathlib.Path]:
    """The clients' uploads of round `round_`, by name (org-ENV.safetensors)."""
    return sorted((state / "uploads" / f"round_{round_:04d}").glob("*.safetensors"))


class Player:
    """A run's tiny model and environment, as its client built them: plays adapters on the test tasks."""

    def __init__(self, run: pathlib.Path, a: argparse.Namespace):
        seed = json.loads((run / "run.json").read_text())["config"]["seed"]
        self.env, _, self.model, self.fmt, self.scorer = tiny_client(argparse.Namespace(
            env=a.env, overrides="", seed=seed, window=TINY_MAX_PROMPT_TOKENS, scoring=a.scoring, model_seed=seed))
        self.test = self.env.tasks("test")[:a.test]

    def success(self, adapter: dict[str, torch.Tensor]) -> float:
        """Greedy held-out success (%) of the adapter's tensors on the test tasks."""
        set_adapter_state(self.model, adapter)
        self.scorer.forget()
        played = learning_curve.rollout(self.env, self.test, lambda p, c: self.scorer.choose(p, c, greedy=True), 1,
                                        fmt=self.fmt)
        return 100 * learning_curve.success_rate(played)


def step(start: dict[str, torch.Tensor], updates: list[dict[str, torch.Tensor]], k: int) -> dict[str, torch.Tensor]:
    """phi_t + (sum of the given clients' phi_i - phi_t) / K: the global step had the round's other
    clients sent phi_t back."""
    return {n: w + sum(u[n] - w for u in updates) / k for n, w in start.items()}


def without_each(run: pathlib.Path, a: argparse.Namespace, rounds: list[int]) -> None:
    """For each round and each other client j: held-out success of the global step without j's
    update, phi_t + (sum of the others' dphi_i) / K (the client's own at the mean's strength): which
    client's update, taken out, lets the client's own through."""
    player, state = Player(run, a), run / "state" / "aggregator" / "local"
    for r in rounds:
        uploads = {u.stem: load_file(str(u)) for u in upload_files(state, r)}
        if f"org-{a.env}" not in uploads:
            continue
        start = load_file(str(global_file(state, r)))
        others = [name for name in uploads if name != f"org-{a.env}"]
        cells = [f"{j}: {player.success(step(start, [t for n, t in uploads.items() if n != j], len(uploads))):.0f}"
                 for j in others]
        print(f"| {run.name} | {r} | " + " | ".join(cells) + " |", flush=True)


def success_row(run: pathlib.Path, a: argparse.Namespace, rounds: list[int]) -> list[str]:
    """"own / global" (--alone: "own / alone / global") held-out success for each round, "-" where the
    run kept no such adapters; alone is the client's update at the strength the mean gives it."""
    player, state = Player(run, a), run / "state" / "aggregator" / "local"
    cells = []
    for r in rounds:
        own = state / "uploads" / f"round_{r:04d}" / f"org-{a.env}.safetensors"
        averaged = global_file(state, r + 1)
        if not own.exists() or not averaged.exists():
            cells.append("-")
            continue
        mine = load_file(str(own))
        alone = [step(load_file(str(global_file(state, r))), [mine], len(upload_files(state, r)))] if a.alone else []
        cells.append(" / ".join(f"{player.success(t):.0f}" for t in [mine, *alone, load_file(str(averaged))]))
    return cells


def update_norms(state: pathlib.Path, round_: int) -> dict[str, float]:
    """Each client's update in round t, ||phi_k - phi_t|| over all its tensors (phi_t: the global
    adapter the round started from)."""
    start = load_file(str(global_file(state, round_)))
    norms = {}
    for upload in upload_files(state, round_):
        tensors = load_file(str(upload))
        norms[upload.stem] = sum(float((tensors[k].float() - v.float()).pow(2).sum()) for k, v in start.items()) ** 0.5
    return norms


def products(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each LoRA module's B @ A (its weight update, less the constant alpha / r)."""
    return {k[:-len("lora_A.weight")]: tensors[k[:-len("lora_A.weight")] + "lora_B.weight"].float() @ v.float()
            for k, v in tensors.items() if k.endswith("lora_A.weight")}


def kept_shares(state: pathlib.Path, round_: int, env: str) -> tuple[float, float] | None:
    """Of client org-`env`'s weight update in round t (dW_env, summed over modules), the share
    <dW_global, dW_env> / ||dW_env||^2 that the global step phi_t -> phi_t+1 keeps, and the share the
    exact mean of the clients' dW would keep; None where the round's files are missing."""
    paths = [global_file(state, r) for r in (round_, round_ + 1)]
    uploads = upload_files(state, round_)
    own = [u for u in uploads if u.stem == f"org-{env}"]
    if not own or not all(p.exists() for p in paths):
        return None
    start, after = (products(load_file(str(p))) for p in paths)
    deltas = {u.stem: {m: w - start[m] for m, w in products(load_file(str(u))).items()} for u in uploads}
    mine = deltas[own[0].stem]
    dot = lambda a, b: sum(float((a[m] * b[m]).sum()) for m in a)  # noqa: E731
    norm2 = dot(mine, mine) or float("nan")
    kept = dot({m: after[m] - start[m] for m in mine}, mine) / norm2
    exact = sum(dot(d, mine) for d in deltas.values()) / len(deltas) / norm2
    return kept, exact


def print_kept(runs: list[pathlib.Path], rounds: list[int], env: str) -> None:
    """The share of the `env` client's weight update each round's global step keeps, per run."""
    print(f"\nshare of org-{env}'s weight update dW = B'A' - BA that the global step keeps (the averaged A and B / "
          "the exact mean of the clients' dW; 1/K if the others' updates share nothing with it)")
    print("| run | " + " | ".join(str(r) for r in rounds) + " |")
    print("|---|" + "---:|" * len(rounds))
    for run in runs:
        state = run / "state" / "aggregator" / "local"
        shares = [kept_shares(state, r, env) for r in rounds]
        print(f"| {run.name} | " + " | ".join("-" if s is None else f"{s[0]:.2f} / {s[1]:.2f}" for s in shares)
              + " |", flush=True)


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
    ap.add_argument("--test", type=int, default=20, help="held-out test tasks (the first N; 0: play none, "
                                                             "print the weight tables only)")
    ap.add_argument("--scoring", choices=SCORINGS, default="sum", help="the client's --scoring (BabyAI: calibrated)")
    ap.add_argument("--norms", action="store_true", help="also print each client's update norm per round")
    ap.add_argument("--alone", action="store_true", help="also play the client's update alone at the mean's "
                                                          "strength, phi_t + (phi_k - phi_t) / K")
    ap.add_argument("--without-each", action="store_true", help="also play the global step without each other "
                                                                 "client's update in turn")
    ap.add_argument("--kept", action="store_true", help="also print the share of the client's weight update that "
                                                         "the global step keeps")
    a = ap.parse_args(argv)
    if a.without_each and a.test <= 0:
        ap.error("--without-each plays test tasks: give --test 1 or more")
    torch.set_num_threads(1)
    rounds = [int(r) for r in a.rounds.split(",")]
    if a.test > 0:
        print(f"{a.env}: held-out success (%) of the client's own upload in round t / "
              + ("its update alone at 1/K / " if a.alone else "")
              + "the global adapter averaged from that round's uploads")
        print("| run | " + " | ".join(str(r) for r in rounds) + " |")
        print("|---|" + "---:|" * len(rounds))
        for run in a.runs:
            print(f"| {run.name} | " + " | ".join(success_row(run, a, rounds)) + " |", flush=True)
    if a.norms or (a.test <= 0 and not a.kept):
        print_norms(a.runs, rounds)
    if a.kept:
        print_kept(a.runs, rounds, a.env)
    if a.without_each:
        print(f"\n{a.env}: held-out success (%) of the global step without client j's update, for each j")
        for run in a.runs:
            without_each(run, a, rounds)


if __name__ == "__main__":
    main()
