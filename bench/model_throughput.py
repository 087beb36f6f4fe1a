"""How fast the client's model runs on this machine, in tokens/s and as a fraction of its matmul peak.

In one run (`make bench-model`, or with SmolLM2 `make bench-model ARGS="--base-model
models/smollm2-135m-instruct"`):
1. the matmul peak: square products in fp32, and in bf16 where the machine computes it natively
   (a CPU with AVX512-BF16 or AMX, a GPU);
2. the base model alone at the shapes the client uses (its prompt window, the scorer's and the
   trainer's tokens per pass): a plain forward (transformers' own call, no cache), and a forward
   plus backward with a LoRA on it, as the trainer runs it (without checkpointing, and for a real
   model also with every layer checkpointed: the trainer checkpoints what memory needs);
3. the client's own work on each environment: a whole local federation of one client per
   environment (`fedse run --rounds 1`: real env server, aggregator and client agent processes),
   whose round-0 report says the tokens it computed per second in each phase, their MFU, the
   padding share and the prompt tokens a prefix cache served.

Each row prints tokens/s and the fraction of the peak at the precision the model runs in (model
FLOPs as services/client_agent/model/work.py counts them). `--json PATH` writes the figures, `--plot PATH`
draws the fractions. On a GPU, with the `gpu` extra installed, it also records the card's clocks,
power, utilisation and memory in use right after measuring the peak.

    .venv/bin/python bench/model_throughput.py [--base-model DIR] [--envs maze,wordle] [--skip-client]

Where a model's weights cannot be copied to the machine measured, `bench/random_weights.py` writes a
stand-in of its shape with random weights: the same speed per token, other episodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fedse.machine import cpu_has_native_bf16, describe_cpu, gpu_state, matmul_peak  # noqa: E402
from fedse.model.pretrained import TINY_MODEL_NAME, load_base, pick_device  # noqa: E402
from services.client_agent.model import loading as mdl  # noqa: E402
from services.client_agent.playing.prompts import default_max_prompt_tokens, is_tiny  # noqa: E402
from services.client_agent.training.trainer import DEFAULT_TRAIN_BATCH_TOKENS, checkpointing_on  # noqa: E402
from services.client_agent.model.work import ModelShape, causal_context  # noqa: E402
from real_round import one_round  # noqa: E402

PHASES = ("eval", "explore", "train")


def timed(fn, seconds: float, sync) -> float:
    """Seconds per call of fn, after one warm-up call, over at least `seconds` (and 2 calls)."""
    fn()
    sync()
    runs, t0 = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and runs >= 2:
            return elapsed / runs


def peak_sizes(device: torch.device) -> tuple[int, ...]:
    """The square matmul sizes whose best rate is taken as the device's peak."""
    return (4096, 8192) if device.type == "cuda" else (512, 1024, 2048)


def plain_passes(model, precision: str, device: torch.device, seconds: float) -> list[dict]:
    """A plain forward of the base model, and a forward plus backward with a LoRA (the trainer's
    precision; without checkpointing, then for a real model with every layer checkpointed), at the
    client's shapes: rows x its prompt window,
    as many rows as the scorer's (forward) and the trainer's (backward) token budgets hold."""
    window = min(512, default_max_prompt_tokens(model))
    fwd_tokens = 4096 if device.type == "cpu" else 65536
    train_tokens = DEFAULT_TRAIN_BATCH_TOKENS if device.type == "cpu" else 32768
    shape = ModelShape.of(model)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab = model.config.vocab_size
    out = []
    gen = torch.Generator().manual_seed(0)

    rows = max(1, fwd_tokens // window)
    ids = torch.randint(3, vocab, (rows, window), generator=gen).to(device)

    def forward():
        with torch.no_grad(), mdl.autocast(precision, device):
            model(input_ids=ids, use_cache=False)

    s = timed(forward, seconds, sync)
    n = rows * window
    # transformers' forward runs the output layer on every position.
    flops = shape.forward_flops(n, causal_context([window] * rows)) + shape.head_flops(n)
    out.append({"what": f"plain forward, {rows} x {window} tokens", "tokens_per_s": n / s, "flops_per_s": flops / s})

    peft_model = mdl.add_lora(model)
    rows = max(1, train_tokens // window)
    ids = torch.randint(3, vocab, (rows, window), generator=gen).to(device)
    inner = peft_model.get_base_model()
    peft_model.train()

    def forward_backward():
        with mdl.autocast(precision, device):
            hidden = inner.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        head = inner.get_output_embeddings()
        logits = head(hidden[:, :-1].to(head.weight.dtype)).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        peft_model.zero_grad(set_to_none=True)

    # The client checkpoints only the layers a micro-batch needs to fit its memory: both ends measured.
    n = rows * window
    flops = shape.forward_flops(n, causal_context([window] * rows), train=True) + shape.head_flops(n, train=True)
    for checkpointing in (False, True) if not is_tiny(model) else (False,):
        with contextlib.ExitStack() as passes:  # as the trainer runs its passes
            passes.enter_context(mdl.lora_input_as_is(peft_model, precision))
            if checkpointing:
                passes.enter_context(checkpointing_on(inner, {"use_reentrant": False}))
            s = timed(forward_backward, seconds, sync)
        out.append({"what": f"forward + backward (LoRA{', every layer checkpointed' if checkpointing else ''}), "
                            f"{rows} x {window} tokens", "tokens_per_s": n / s, "flops_per_s": flops / s})
    peft_model.unload()  # the base model as it was
    return out


def client_rounds(base_model: str, envs: list[str], args: argparse.Namespace) -> list[dict]:
    """One `fedse run --rounds 1` per environment; each client's round-0 work metrics."""
    rows = []
    for env in envs:
        try:
            (r0, *_), wall, _ = one_round(env, base_model, [
                "--explore-tasks", str(args.explore_tasks), "--eval-tasks", str(args.eval_tasks),
                "--expert-demos", str(args.expert_demos), *args.extra], prefix="fedse-bench-model")
        except SystemExit as failed:  # the other environments' figures still count
            print(failed, flush=True)
            rows.append({"what": f"client, {env}: failed", "env": env, "failed": str(failed)})
            continue
        print(f"[{env}] done in {wall:.0f} s", flush=True)
        for phase in PHASES:
            if f"{phase}_tokens_per_s" not in r0:
                continue
            rows.append({"what": f"client {phase}, {env}", "env": env, "phase": phase,
                         "tokens_per_s": r0[f"{phase}_tokens_per_s"], "mfu_client": r0.get(f"{phase}_mfu"),
                         "client_peak": r0.get("peak_flops"), "seconds": r0.get(f"{phase}_s"),
                         "tokens": r0[f"{phase}_tokens"], "padding": r0.get(f"{phase}_padding", 0.0),
                         "cached": r0.get(f"{phase}_cached", 0.0), "generated": r0.get(f"{phase}_generated", 0.0)})
    return rows


def plot(figures: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figures["rows"]
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(rows) + 1.4))
    ax.barh([r["what"] for r in rows][::-1], [100 * (r.get("fraction") or 0) for r in rows][::-1])
    ax.set_xlabel(f"% of the measured {figures['precision']} matmul peak ({figures['peak_gflops']:.0f} GFLOP/s)")
    ax.set_title(f"{figures['model']}, {figures['precision']}\n{figures['machine']}", fontsize=9)
    ax.set_xlim(0, 100)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the long row labels whole
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-model", default=TINY_MODEL_NAME, help="the tiny model (default) or a model directory")
    ap.add_argument("--device", default="", help="cpu or cuda (default: cuda where one is, else cpu)")
    ap.add_argument("--envs", default="maze,wordle,babyai,textcraft,webshop")
    ap.add_argument("--explore-tasks", type=int, default=8)
    ap.add_argument("--eval-tasks", type=int, default=5)
    ap.add_argument("--expert-demos", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0, help="how long each measurement runs, at least")
    ap.add_argument("--skip-client", action="store_true", help="only the peak and the plain passes")
    ap.add_argument("--json", default="", help="write the figures to this file")
    ap.add_argument("--plot", default="", help="draw the fractions of the peak to this PNG")
    ap.add_argument("extra", nargs="*", help="more `fedse run` flags, after --")
    args = ap.parse_args(argv)

    device = pick_device(args.device or None)
    model, _ = load_base(args.base_model, str(device))
    precision = mdl.run_in("auto", model, device)
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda" else describe_cpu()) + \
        f", {torch.get_num_threads()} torch threads"
    name = pathlib.Path(args.base_model).name
    print(f"{name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters), {precision}, on {machine}",
          flush=True)

    sizes = peak_sizes(device)
    peaks = {"fp32": matmul_peak("fp32", device, seconds=args.seconds / 2, sizes=sizes)}
    if device.type == "cuda" or cpu_has_native_bf16():
        peaks["bf16"] = matmul_peak("bf16", device, seconds=args.seconds / 2, sizes=sizes)
    for dtype, rate in peaks.items():
        print(f"matmul peak {dtype}: {rate / 1e9:,.1f} GFLOP/s", flush=True)
    # Right after the peak: whether the card ran at its clock, alone (the gpu extra's NVML bindings).
    gpu = gpu_state(device.index or 0) if device.type == "cuda" else {}
    if gpu:
        print("gpu: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in gpu.items()),
              flush=True)
    peak = peaks.get(precision, peaks["fp32"])

    rows = plain_passes(model, precision, device, args.seconds)
    for r in rows:
        r["fraction"] = r["flops_per_s"] / peak
        print(f"{r['what']}: {r['tokens_per_s']:,.0f} tokens/s, {100 * r['fraction']:.0f}% of peak", flush=True)
    del model
    if device.type == "cuda":  # the clients below count what the card has free
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    if not args.skip_client:
        envs = [e.strip() for e in args.envs.split(",") if e.strip()]
        for r in client_rounds(args.base_model, envs, args):
            # The client measured its own peak (shorter, one size); against this run's, like the rows above.
            if r.get("mfu_client") is not None and r.get("client_peak"):
                r["fraction"] = r["mfu_client"] * r["client_peak"] / peak
            rows.append(r)

    print(f"\n{name}, {precision}; {machine}; matmul peak " +
          ", ".join(f"{d} {v / 1e9:,.1f} GFLOP/s" for d, v in peaks.items()) + "\n")
    print("| what | tokens/s | % of peak | padding | cached | generated |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['what']} | - | - | - | - | - |")
            continue
        frac = f"{100 * r['fraction']:.0f}%" if r.get("fraction") is not None else "-"
        pad = f"{100 * r['padding']:.0f}%" if "padding" in r else "-"
        cached = f"{r['cached']:,.0f}" if r.get("cached") else "-"
        generated = f"{r['generated']:,.0f}" if r.get("generated") else "-"
        print(f"| {r['what']} | {r['tokens_per_s']:,.0f} | {frac} | {pad} | {cached} | {generated} |")
    figures = {"model": name, "precision": precision, "machine": machine, "gpu": gpu,
               "peaks": peaks, "peak_gflops": peak / 1e9, "rows": rows}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=1))
    if args.plot:
        plot(figures, args.plot)
    failed = [r["env"] for r in rows if "failed" in r]
    if failed:
        raise SystemExit(f"fedse run failed for {', '.join(failed)} (above)")


if __name__ == "__main__":
    main()
