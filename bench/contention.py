"""How a client's training holds up beside other work on the same cores, by OpenMP wait policy.

A client trains its LoRA with torch's intra-op threads. Where another process computes on the same
cores (another client of a local federation, a test suite, a noisy neighbour in a pod), OpenMP's
default policy lets a thread that finished its share spin, waiting for the others, while the
thread it waits for is off its core: each parallel region can then cost a scheduler time slice.
This benchmark trains the tiny model's LoRA at the trainer's shapes (a forward and backward, as
bench/model_throughput.py does) in a fresh process for each case:

- threads: 1, or every core this process may run on;
- OMP_WAIT_POLICY: the runtime's default, or PASSIVE (a waiting thread sleeps);
- alone, or beside one neighbour process that computes without pause (a 1-thread matmul loop).

It prints tokens/s per case and the slowdown beside the neighbour.

    .venv/bin/python bench/contention.py [--seconds 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TRAIN = """
import sys, torch
sys.path[:0] = [{root!r}, {here!r}]
torch.set_num_threads({threads})
from fedse.model.pretrained import TINY_MODEL_NAME, load_base
from services.client_agent.model import loading as mdl
from model_throughput import plain_passes
model, _ = load_base(TINY_MODEL_NAME, "cpu")
rows = plain_passes(model, mdl.run_in("auto", model, torch.device("cpu")), torch.device("cpu"), {seconds})
print(rows[-1]["tokens_per_s"])
"""

NEIGHBOUR = """
import torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a)
"""


def measure(threads: int, policy: str, beside: bool, seconds: float) -> float:
    """Training tokens/s in a fresh process with these settings (policy: "default", or NAME=VALUE
    for the OpenMP runtime's environment), the neighbour running or not."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    if policy != "default":
        name, _, value = policy.partition("=")
        env[name] = value
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if beside else None
    try:
        if neighbour:
            time.sleep(1.0)  # computing before the measurement starts
        code = TRAIN.format(root=ROOT, here=HERE, threads=threads, seconds=seconds)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        return float(done.stdout.split()[-1])
    finally:
        if neighbour:
            neighbour.kill()
            neighbour.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="how long each measurement runs, at least")
    ap.add_argument("--policies", default="default,OMP_WAIT_POLICY=PASSIVE",
                    help="the OpenMP settings compared, comma-separated: default or NAME=VALUE (e.g. GOMP_SPINCOUNT=10000)")
    ap.add_argument("--json", default="", help="write the figures to this file")
    args = ap.parse_args(argv)
    sys.path[:0] = [ROOT]
    from fedse.machine import available_cores, describe_cpu

    cores = available_cores()
    print(f"{describe_cpu()}, {cores} cores to run on; the tiny model's LoRA training, forward + backward", flush=True)
    rows = []
    for threads in sorted({1, cores}):
        for policy in args.policies.split(","):
            alone = measure(threads, policy, False, args.seconds)
            beside = measure(threads, policy, True, args.seconds)
            rows.append({"threads": threads, "policy": policy, "alone": alone, "beside": beside})
            print(f"  {threads} thread(s), {policy}: alone {alone:,.0f} tokens/s, beside a busy "
                  f"neighbour {beside:,.0f} ({alone / beside:.1f}x slower)", flush=True)
    print("\n| threads | OpenMP | alone, tokens/s | beside a busy neighbour | slowdown |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['threads']} | {r['policy']} | {r['alone']:,.0f} | {r['beside']:,.0f} | "
              f"{r['alone'] / r['beside']:.1f}x |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": describe_cpu(), "cores": cores, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
