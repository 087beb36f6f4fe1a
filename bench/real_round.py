"""One Fed-SE round of a real model on this machine, per phase and per environment.

For each environment, a whole local federation of one client (`fedse run`: real env server,
aggregator and client agent processes over gRPC) plays one round: evaluate phi_0 on the held-out
test tasks, explore training tasks, train on the buffer (expert demonstrations plus kept
successes, 2 epochs), upload; then evaluates phi_1. Prints the seconds of each phase of round 0,
the examples trained on and the client's peak resident memory, per environment:

    make model   # once: models/smollm2-135m-instruct
    .venv/bin/python bench/real_round.py [--envs maze] [--explore-tasks 16] [--eval-tasks 10] [-- extra fedse run flags]

docs/results.md ("One round on this CPU") has its figures. `make bench-model` runs the same kind of
round and reports the model's tokens per second in each phase instead.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def one_round(env: str, base_model: str, flags: list[str], prefix: str = "fedse-bench") -> tuple[list[dict], float, pathlib.Path]:
    """`fedse run --envs ENV --rounds 1` of `base_model` with more `flags`, in a results folder of
    its own: (the client's rows of results.json, one per round, the run's wall seconds, the folder).
    Stops the bench with the run's output where it fails."""
    out = pathlib.Path(tempfile.mkdtemp(prefix=f"{prefix}-{env}-"))
    cmd = [sys.executable, "-m", "apps.cli", "run", "--envs", env, "--rounds", "1", "--base-model", base_model,
           *flags, "--results", str(out)]
    print(f"[{env}] fedse {' '.join(cmd[3:])}", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        print(proc.stdout[-3000:])
        raise SystemExit(f"[{env}] fedse run failed ({proc.returncode}); logs in {out}/logs")
    return json.loads((out / "results.json").read_text())["envs"][env], wall, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--envs", default="maze")
    ap.add_argument("--explore-tasks", type=int, default=16)
    ap.add_argument("--eval-tasks", type=int, default=10)
    ap.add_argument("--expert-demos", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--keep", action="store_true", help="keep each run's results folder (printed)")
    ap.add_argument("extra", nargs="*", help="more `fedse run` flags, after --")
    args = ap.parse_args()
    rows = []
    for env in [e.strip() for e in args.envs.split(",") if e.strip()]:
        (r0, r1, *_), wall, out = one_round(env, args.base_model, [
            "--explore-tasks", str(args.explore_tasks), "--eval-tasks", str(args.eval_tasks),
            "--expert-demos", str(args.expert_demos), "--lr", str(args.lr), *args.extra])
        rows.append({"env": env, "wall": wall, **{k: r0.get(k, float("nan")) for k in (
            "eval_s", "explore_s", "train_s", "examples", "sequences", "kept", "explore_success")},
            "round": r0["eval_s"] + r0["explore_s"] + r0["train_s"], "test_0": r0["test_success"],
            "test_1": r1["test_success"], "peak_rss_mb": max(r0["peak_rss_mb"], r1["peak_rss_mb"])})
        print(f"[{env}] done in {wall:.0f}s" + (f"; results in {out}" if args.keep else ""), flush=True)
    print(f"\nOne round per environment: {args.explore_tasks} explorations, {args.eval_tasks} test tasks, "
          f"{args.expert_demos} expert demonstrations, 2 epochs ({pathlib.Path(args.base_model).name})\n")
    print("| env | evaluate s | explore s | train s | round s | turns trained | sequences | peak RSS MB "
          "| success r0 -> r1 | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['env']} | {r['eval_s']:.0f} | {r['explore_s']:.0f} | {r['train_s']:.0f} | {r['round']:.0f} "
              f"| {r['examples']:.0f} | {r['sequences']:.0f} | {r['peak_rss_mb']:.0f} "
              f"| {100 * r['test_0']:.0f}% -> {100 * r['test_1']:.0f}% | {r['wall']:.0f} |")


if __name__ == "__main__":
    main()
