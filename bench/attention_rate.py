"""How fast attention runs here, against the matmul peak: the kernel the client's passes use.

Attention is where a SmolLM2 training step and scoring pass fall furthest below the matmul peak on
a CPU (docs/results.md, "Where the time goes"). This measures, at SmolLM2-135M's heads (9 query
heads on 3 key and value heads, 64 wide) or the ones given:
- causal attention over L tokens, as training runs it: PyTorch's SDPA (on a CPU its flash kernel)
  forward, and forward plus backward, in bf16 and in fp32;
- the same forward written as matmuls and a softmax, tiled by 128 queries (bf16 matmuls, fp32
  softmax): what a hand-written attention on the machine's bf16 matmuls would give;
- masked attention as scoring runs it: Q new tokens a row on K keys, rows of 3 query heads packed
  onto their key head, with a mask of its own per row.

Each as GFLOP/s (4 x heads x head width x query-key pairs computed; backward counts 2.5x the
forward), as a share of the bf16 matmul peak (fp32 where the CPU has no native bf16), and, for a
bf16 forward, its largest difference from fp32 SDPA over the same (bf16-valued) inputs.

    .venv/bin/python bench/attention_rate.py [--lengths 256,512,1024,2048] [--heads 9 --kv-heads 3 --dim 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fedse.machine import cpu_has_native_bf16, describe_cpu, matmul_peak  # noqa: E402
from model_throughput import peak_sizes, timed  # noqa: E402


def tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Causal attention of q (1 x H x L x D) on k, v (1 x KV x L x D) as matmuls in q's dtype and an
    fp32 softmax, `block` queries at a time, each block's query heads packed onto their key head."""
    _, h, n, d = q.shape
    kv = k.shape[1]
    g = h // kv
    qg = q[0].reshape(kv, g, n, d)
    out = torch.empty(kv, g, n, d, dtype=q.dtype, device=q.device)
    for s in range(0, n, block):
        e = min(n, s + block)
        b = e - s
        scores = torch.bmm(qg[:, :, s:e].reshape(kv, g * b, d), k[0, :, :e].transpose(1, 2)).float() * d ** -0.5
        scores = scores.view(kv, g, b, e)
        scores[..., s:e].masked_fill_(torch.ones(b, b, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
        p = torch.softmax(scores, -1).to(q.dtype)
        out[:, :, s:e] = torch.bmm(p.view(kv, g * b, e), v[0, :, :e]).view(kv, g, b, d)
    return out.reshape(1, h, n, d)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="", help="cpu or cuda (default: cuda where one is)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--lengths", default="256,512,1024,2048", help="causal lengths, comma-separated")
    ap.add_argument("--scoring", default="4x16x600,4x64x1000,1x256x2000,8x32x1500",
                    help="masked passes as ROWSxNEWxKEYS, comma-separated")
    ap.add_argument("--seconds", type=float, default=1.0, help="how long each measurement runs, at least")
    args = ap.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    h, kv, d = args.heads, args.kv_heads, args.dim
    if h % kv:
        raise SystemExit(f"--heads {h} must be a multiple of --kv-heads {kv}")
    peak_dtype = "bf16" if dev.type == "cuda" or cpu_has_native_bf16() else "fp32"
    peak = matmul_peak(peak_dtype, dev, seconds=args.seconds / 2, sizes=peak_sizes(dev))
    machine = torch.cuda.get_device_name(dev) if dev.type == "cuda" else describe_cpu()
    print(f"{machine}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
          f"{h} query heads on {kv} key heads of {d}; matmul peak {peak_dtype} {peak / 1e9:,.0f} GFLOP/s\n", flush=True)
    print("| what | ms | GFLOP/s | % of peak | max difference from fp32 |")
    print("|---|---:|---:|---:|---:|")

    def row(what: str, fn, flops: float, diff: float | None = None) -> None:
        seconds = timed(fn, args.seconds, sync)
        r = flops / seconds
        print(f"| {what} | {seconds * 1e3:,.2f} | {r / 1e9:,.0f} | {100 * r / peak:.0f}% | "
              f"{'-' if diff is None else f'{diff:.1e}'} |", flush=True)

    gen = torch.Generator(device="cpu").manual_seed(0)
    dtypes = [("bf16", torch.bfloat16), ("fp32", torch.float32)]
    for n in [int(x) for x in args.lengths.split(",") if x.strip()]:
        # bf16 values, so that a difference from the fp32 reference is the computation's, not the inputs'
        q, k, v = (torch.randn(1, heads, n, d, generator=gen).bfloat16().float().to(dev) for heads in (h, kv, kv))
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        forward = 4 * h * d * n * (n + 1) / 2
        for name, dtype in dtypes:
            qt, kt, vt = (t.to(dtype).requires_grad_() for t in (q, k, v))

            def sdpa_forward(qt=qt, kt=kt, vt=vt):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

            def sdpa_backward(qt=qt, kt=kt, vt=vt):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).sum().backward()

            diff = (sdpa_forward().float() - reference).abs().max().item() if dtype != torch.float32 else None
            row(f"causal {n}, SDPA forward, {name}", sdpa_forward, forward, diff)
            row(f"causal {n}, SDPA forward + backward, {name}", sdpa_backward, 3.5 * forward)
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        with torch.no_grad():
            diff = (tiled(qb, kb, vb).float() - reference).abs().max().item()
            row(f"causal {n}, matmuls + softmax by 128 queries, bf16", lambda: tiled(qb, kb, vb), forward, diff)
    for spec in [s for s in args.scoring.split(",") if s.strip()]:
        rows, new, keys = (int(x) for x in spec.lower().split("x"))
        q = torch.randn(rows, kv, (h // kv) * new, d, generator=gen).bfloat16().float().to(dev)
        k, v = (torch.randn(rows, kv, keys, d, generator=gen).bfloat16().float().to(dev) for _ in range(2))
        allowed = (torch.rand(rows, 1, new, keys, generator=gen) > 0.3).to(dev)
        allowed[..., 0] = True  # every query sees a key
        mask = allowed.repeat(1, 1, h // kv, 1)
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for name, dtype in dtypes:
            qt, kt, vt = (t.to(dtype) for t in (q, k, v))
            bias = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill_(~mask, float("-inf"))

            def masked(qt=qt, kt=kt, vt=vt, bias=bias):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias)

            diff = (masked().float() - reference).abs().max().item() if dtype != torch.float32 else None
            row(f"scoring {rows} x {new} new on {keys} keys, masked SDPA, {name}", masked,
                4 * rows * h * d * new * keys, diff)


if __name__ == "__main__":
    main()
