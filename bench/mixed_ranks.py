"""Aggregation of mixed LoRA ranks: time and peak memory for K clients at ranks 4, 8 and 16 against K
clients all at rank 8, on Llama-2-7B-shaped modules (q, k, v, o, gate, up, down of --layers blocks).

Writes K adapters at one rank and K at mixed ranks (4, 8, 16, in turn) as safetensors files in a
temporary directory, then measures each row in a fresh process, reading the uploads through
`AdapterFile` (one tensor per lookup) as the aggregator does:
  one rank:   fedavg (the factors' mean), exact (the products' mean, QR and a small SVD), hlora
  mixed:      zero-pad (the zero-padding baseline: padded factors' mean), hlora (QR and a small SVD
              over the stacked factors, never a dense matrix), flexlora (the same by examples), and
              with --dense FlexLoRA as published (the dense out x in sum, then a full SVD: minutes
              and gigabytes per 7B block), which flexlora computed before it worked from the factors
The run's rank is 16 for the mixed rows and 8 for the others. Peak MB is the process's peak RSS above
its RSS once imports are done (Linux VmHWM after clear_refs), in 10^6 bytes. --threads torch threads
in each measuring process (default 1, as the aggregator runs).

    .venv/bin/python bench/mixed_ranks.py [--k 20] [--layers 1] [--threads 1] [--dense]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedse.model.adapter import encode  # noqa: E402
from fedse.machine import describe_cpu  # noqa: E402
from fedse.model import ranks as rank_ops  # noqa: E402
from services.aggregator.adapter_files import AdapterFile  # noqa: E402
from services.aggregator.strategies import Update, aggregate  # noqa: E402

from aggregation import _status_mb, start_peak  # noqa: E402  (bench/, beside this file)
from llama_lora import MODULES, schema as shapes  # noqa: E402

MIXED = (4, 8, 16)
ONE = 8
DENSE = "flexlora, dense SVD"  # the --dense row's name


def write(directory: str, name: str, layout: dict[str, tuple[int, int]], gen: torch.Generator) -> None:
    with open(os.path.join(directory, f"{name}.safetensors"), "wb") as f:
        f.write(encode({n: torch.randn(s, generator=gen) * 0.01 for n, s in layout.items()}))


def dense_flexlora(updates: list[Update], previous, out_scaling: float) -> dict[str, torch.Tensor]:
    """FlexLoRA as published, for the --dense row: per module the dense sum of p_k s_k B_k A_k (p_k ~
    examples), float64, and a full SVD of it cut to the run's rank (what flexlora did before)."""
    total = float(sum(u.num_examples for u in updates))
    out = {}
    for a, b in rank_ops.pairs(list(previous)):
        delta = torch.zeros((previous[b].shape[0], previous[a].shape[1]), dtype=torch.float64)
        for u in updates:
            delta.addmm_(u.adapter[b].double(), u.adapter[a].double(), alpha=u.num_examples / total * u.scaling)
        u_, s, vh = torch.linalg.svd(delta, full_matrices=False)
        out[b], out[a], _ = rank_ops.svd_factors(u_, s, vh, previous[a].shape[0], out_scaling, max(delta.shape))
    return out


def child(strategy: str, kind: str, k: int, directory: str) -> dict:
    ranks = [MIXED[i % len(MIXED)] if kind == "mixed" else ONE for i in range(k)]
    updates = [Update(f"c{i}", AdapterFile(os.path.join(directory, f"{kind}_{i}.safetensors")), 1 + i, 1,
                      scaling=2.0) for i, r in enumerate(ranks)]
    previous = AdapterFile(os.path.join(directory, f"previous_{kind}.safetensors"))
    baseline = start_peak()
    start = time.perf_counter()
    out_scaling = 1.0 if kind == "mixed" else 2.0
    out = dense_flexlora(updates, previous, out_scaling) if strategy == DENSE else \
        aggregate(strategy, updates, previous, out_scaling=out_scaling)
    seconds = time.perf_counter() - start
    assert out
    return {"seconds": seconds, "peak_mb": _status_mb("VmHWM") - baseline}


def measure(strategy: str, kind: str, k: int, directory: str, threads: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", strategy, "--kind", kind, "--k", str(k),
           "--workdir", directory, "--threads", str(threads)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=20, help="clients K")
    parser.add_argument("--layers", type=int, default=1, help="Llama-2-7B blocks whose seven modules carry LoRA")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each measuring process")
    parser.add_argument("--dense", action="store_true",
                        help="also FlexLoRA as published (dense sum, full SVD), which takes minutes per block")
    parser.add_argument("--workdir", default=None, help="where the temporary directory goes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(args.threads)
        print(json.dumps(child(args.child, args.kind, args.k, args.workdir)), flush=True)
        return

    print(f"# {describe_cpu()}; K={args.k}; {args.layers} Llama-2-7B block(s), {len(MODULES)} modules each; "
          f"{args.threads} torch thread(s)", flush=True)
    directory = tempfile.mkdtemp(prefix="fedse-mixedbench-", dir=args.workdir)
    try:
        gen = torch.Generator().manual_seed(0)
        write(directory, "previous_one", shapes(args.layers, ONE), gen)
        write(directory, "previous_mixed", shapes(args.layers, max(MIXED)), gen)
        for i in range(args.k):
            write(directory, f"one_{i}", shapes(args.layers, ONE), gen)
            write(directory, f"mixed_{i}", shapes(args.layers, MIXED[i % len(MIXED)]), gen)
            print(f"  wrote the adapters of client {i + 1}/{args.k}", file=sys.stderr, flush=True)
        rows = [("fedavg", "one"), ("exact", "one"), ("hlora", "one"), ("zero-pad", "mixed"), ("hlora", "mixed"),
                ("flexlora", "mixed")]
        if args.dense:
            rows.append((DENSE, "mixed"))
        print(f"{'strategy':<20} {'ranks':<9} {'run rank':>8} {'seconds':>8} {'peak MB':>8}", flush=True)
        for strategy, kind in rows:
            print(f"  {strategy}, {kind} ...", file=sys.stderr, flush=True)
            got = measure(strategy, kind, args.k, directory, args.threads)
            label = "4/8/16" if kind == "mixed" else f"all {ONE}"
            print(f"{strategy:<20} {label:<9} {max(MIXED) if kind == 'mixed' else ONE:>8} {got['seconds']:>8.2f} "
                  f"{got['peak_mb']:>8.0f}", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
