"""What a bf16 model pass of a new length leaves behind on a CPU, and what bucket lengths change.

Under bf16 on a CPU, PyTorch's matmuls run on oneDNN, which compiles a kernel for every row count it
meets and keeps it. A client agent meets a new length with nearly every prompt and training batch,
so it grew with the work done until its passes were padded to bucket lengths
(services/client_agent/model.bucket_length). This runs `--lengths` passes of distinct lengths
through one bf16 linear layer of SmolLM2's MLP shape, each way, in a fresh process, and prints the
heap in use that stays behind and the seconds taken (twice: the second pass meets no new length).

    .venv/bin/python bench/kernel_lengths.py
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=64 .venv/bin/python bench/kernel_lengths.py
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def heap_in_use_mb() -> float:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2), in MB."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def measure(way: str, first: int, count: int) -> None:
    import torch

    from services.client_agent.model.loading import bucket_length

    torch.set_num_threads(1)
    layer = torch.nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    lengths = [bucket_length(n) if way == "buckets" else n for n in range(first, first + count)]
    with torch.no_grad():
        layer(torch.randn(8, 576, dtype=torch.bfloat16))
        before = heap_in_use_mb()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            for n in lengths:
                layer(torch.randn(n, 576, dtype=torch.bfloat16))
            times.append(time.perf_counter() - t0)
    print(f"{way:>8} {len(set(lengths)):>8} {heap_in_use_mb() - before:>10.0f} {times[0]:>8.2f} {times[1]:>8.2f}",
          flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--first", type=int, default=100, help="shortest length")
    ap.add_argument("--lengths", type=int, default=300, help="distinct lengths passed")
    ap.add_argument("--way", choices=["exact", "buckets"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.way:
        measure(args.way, args.first, args.lengths)
        return
    print(f"# lengths {args.first}..{args.first + args.lengths - 1}, one 576 x 1536 bf16 layer, 1 thread, "
          f"ONEDNN_PRIMITIVE_CACHE_CAPACITY={os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY', 'default')}")
    print(f"{'passes':>8} {'shapes':>8} {'kept MB':>10} {'first s':>8} {'again s':>8}", flush=True)
    for way in ("exact", "buckets"):
        subprocess.run([sys.executable, os.path.abspath(__file__), "--way", way, "--first", str(args.first),
                        "--lengths", str(args.lengths)], check=True)


if __name__ == "__main__":
    main()
