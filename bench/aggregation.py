"""Aggregator memory and time: `aggregate` over K adapters on disk beside loading them all first.

Writes K safetensors adapters of a Llama-2-7B-shaped LoRA (r = 8 on q, k, v, o, gate, up, down of
every layer; 32 layers in fp32 are about 80 MB) into a temporary directory, once for the largest K.
Then, for each K, in a fresh process each:
  fedse: `aggregate(strategy, ...)` over `services.aggregator.adapter_files.AdapterFile` views (lazy:
         one tensor per lookup), as the aggregator runs it; timed from the first read to the finished output.
  floor: every adapter read and decoded into memory first, then a plain in-process torch sum over
         clients per tensor, divided by K (float32); "floor s" is the time of that sum alone, the
         loading is shown apart ("floor load s"), since fedse's time includes its reads.
Peak MB is the process's peak RSS (VmHWM, reset through /proc/self/clear_refs once imports are done)
minus its RSS at that moment, in 10^6 bytes: it includes the loaded adapters (floor), the output
adapter (both), and for fedse the file pages mapped while a tensor is read. The files are fresh in
the page cache, so reads come from memory, not disk. Both sides run with --threads torch threads
(default 1: on a small shared machine, OpenMP threads fighting other processes for the cores slowed
elementwise ops up to 100x). The temporary directory is removed at the end.

    .venv/bin/python bench/aggregation.py [--ks 5,20,50] [--mb 80] [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedse.model.adapter import decode, encode  # noqa: E402
from services.aggregator.adapter_files import AdapterFile  # noqa: E402
from services.aggregator.strategies import STRATEGIES, Update, aggregate  # noqa: E402

from llama_lora import BYTES_PER_LAYER, MODULES, RANK, schema  # noqa: E402  (bench/, beside this file)



def write_adapters(directory: str, shapes: dict[str, tuple[int, int]], count: int) -> None:
    """previous.safetensors (phi_t) and client_<k>.safetensors = phi_t + a client's own change."""
    gen = torch.Generator().manual_seed(0)
    previous = {n: torch.randn(s, generator=gen) * 0.01 for n, s in shapes.items()}
    with open(os.path.join(directory, "previous.safetensors"), "wb") as f:
        f.write(encode(previous))
    for k in range(count):
        adapter = {n: t + torch.randn(t.shape, generator=gen) * 0.001 for n, t in previous.items()}
        with open(os.path.join(directory, f"client_{k}.safetensors"), "wb") as f:
            f.write(encode(adapter))
        del adapter
        print(f"  wrote adapter {k + 1}/{count}", file=sys.stderr, flush=True)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kib * 1024 / 1e6


def start_peak() -> float:
    """Resets the peak-RSS mark (Linux clear_refs) and returns the RSS it now starts from."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def child(mode: str, strategy: str, k: int, directory: str) -> dict:
    """One measurement in this (fresh) process: seconds, and peak RSS above the RSS before the work."""
    paths = [os.path.join(directory, f"client_{i}.safetensors") for i in range(k)]
    if mode == "fedse":
        updates = [Update(f"c{i}", AdapterFile(p), num_examples=1, num_successes=1) for i, p in enumerate(paths)]
        previous = AdapterFile(os.path.join(directory, "previous.safetensors"))
        baseline = start_peak()
        start = time.perf_counter()
        out = aggregate(strategy, updates, previous)
        seconds = time.perf_counter() - start
    else:
        baseline = start_peak()
        start = time.perf_counter()
        adapters = [decode(pathlib.Path(p).read_bytes()) for p in paths]  # all in memory first
        load_seconds = time.perf_counter() - start
        start = time.perf_counter()
        out = {name: sum(a[name] for a in adapters) / k for name in adapters[0]}
        seconds = time.perf_counter() - start
    assert len(out) > 0
    result = {"seconds": seconds, "peak_mb": _status_mb("VmHWM") - baseline}
    return result if mode == "fedse" else {**result, "load_seconds": load_seconds}


def measure(mode: str, strategy: str, k: int, directory: str, threads: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--strategy", strategy,
           "--k", str(k), "--workdir", directory, "--threads", str(threads)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="5,20,50", help="numbers of clients K")
    parser.add_argument("--mb", type=float, default=80.0, help="adapter size in MB (sets the number of layers)")
    parser.add_argument("--workdir", default=None, help="where the temporary directory goes (default: system temp)")
    parser.add_argument("--extra", default="median,exact", help="strategies also timed, for --extra-ks")
    parser.add_argument("--extra-ks", default="5", help="K values for the --extra strategies")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each measuring process")
    parser.add_argument("--child", choices=["fedse", "floor"], help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="fedavg", choices=list(STRATEGIES), help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(args.threads)
        print(json.dumps(child(args.child, args.strategy, args.k, args.workdir)), flush=True)
        return

    ks = [int(k) for k in args.ks.split(",") if k]
    extra = [s for s in args.extra.split(",") if s]
    extra_ks = [int(k) for k in args.extra_ks.split(",") if k]
    layers = max(1, round(args.mb * 1e6 / BYTES_PER_LAYER))
    shapes = schema(layers)
    adapter_mb = layers * BYTES_PER_LAYER / 1e6
    print(f"# adapter: {layers} layers x {len(MODULES)} modules, r={RANK}, fp32: {len(shapes)} tensors, "
          f"{layers * BYTES_PER_LAYER // 4:,} parameters, {adapter_mb:.1f} MB", flush=True)
    directory = tempfile.mkdtemp(prefix="fedse-aggbench-", dir=args.workdir)
    try:
        print(f"writing {max(ks + extra_ks)} adapters to {directory}", file=sys.stderr, flush=True)
        write_adapters(directory, shapes, max(ks + extra_ks))
        print(f"{'strategy':<13} {'K':>3} {'adapter MB':>10} {'fedse s':>8} {'fedse peak MB':>13} "
              f"{'floor s':>8} {'floor peak MB':>13} {'time x':>7} {'floor load s':>12}", flush=True)
        floors: dict[int, dict] = {}
        rows = [("fedavg", k) for k in ks] + [(s, k) for s in extra for k in extra_ks]
        for strategy, k in rows:
            if k not in floors:
                print(f"  floor, K={k} ...", file=sys.stderr, flush=True)
                floors[k] = measure("floor", "fedavg", k, directory, args.threads)
            print(f"  {strategy}, K={k} ...", file=sys.stderr, flush=True)
            ours, floor = measure("fedse", strategy, k, directory, args.threads), floors[k]
            print(f"{strategy:<13} {k:>3} {adapter_mb:>10.1f} {ours['seconds']:>8.2f} {ours['peak_mb']:>13.0f} "
                  f"{floor['seconds']:>8.2f} {floor['peak_mb']:>13.0f} {ours['seconds'] / floor['seconds']:>7.1f} "
                  f"{floor['load_seconds']:>12.2f}",
                  flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
