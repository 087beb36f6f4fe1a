"""Where the client's training step and scoring pass spend their time, per step and per call.

Trains LoRA steps of one sequence (and of eight) with the client's trainer, then scores Maze
prompts with the client's scorer as its evaluation does (LoRA merged), each timed and then profiled
with torch's profiler: the wall time, the time the device computed (on a GPU), the kernels launched
and the ops that took the most CPU time. On a GPU, a wall time far above the device's time means the
work waits for the CPU that launches it.

With --compile MODE each decoder layer is compiled in place (torch.compile, static shapes) before
the warm-up, which then includes the compiling: on a GPU, "reduce-overhead" runs a layer's kernels
as CUDA graphs, launched once each, which is what a launch-bound step would gain.

    .venv/bin/python bench/step_profile.py [--base-model DIR] [--tokens 500] [--rows 20] [--compile MODE]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedse.model.pretrained import TINY_MODEL_NAME, load_base  # noqa: E402
from services.client_agent.model import loading as mdl  # noqa: E402
from services.client_agent.playing.policy import ActionScorer  # noqa: E402
from services.client_agent.playing.prompts import format_prompt  # noqa: E402
from services.client_agent.training.trainer import train_lora  # noqa: E402
from services.env_server.envs.maze import MazeEnv  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def profiled(fn, calls: int, cuda: bool, rows: int) -> None:
    """Profiles `calls` calls of fn; prints the device time and launches per call, and the top ops."""
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
    ka = prof.key_averages()
    if cuda:
        device_us = sum(e.self_device_time_total for e in ka)
        launches = sum(e.count for e in ka if e.key in LAUNCHES)
        print(f"  per call: {device_us / 1e3 / calls:.1f} ms computed on the device, "
              f"{launches / calls:,.0f} kernel launches")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-model", default=TINY_MODEL_NAME)
    ap.add_argument("--tokens", type=int, default=500, help="tokens of each training sequence")
    ap.add_argument("--rows", type=int, default=20, help="ops listed per profile")
    ap.add_argument("--compile", default="", metavar="MODE",
                    help='compile each decoder layer in this torch.compile mode ("default", "reduce-overhead", '
                         '"max-autotune"); none by default')
    args = ap.parse_args(argv)

    model, tok = load_base(args.base_model)
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    precision = mdl.run_in("auto", model, dev)
    peft = mdl.add_lora(model)
    if args.compile:
        for layer in peft.get_base_model().get_decoder().layers:
            layer.compile(mode=args.compile, dynamic=False)
    print(f"{pathlib.Path(args.base_model).name} on {dev}, {precision}"
          + (f", decoder layers compiled ({args.compile})" if args.compile else ""), flush=True)

    words = "the agent moves up down left right to reach the goal in the maze and sees walls".split()
    gen = torch.Generator().manual_seed(0)
    text = " ".join(words[i] for i in torch.randint(len(words), (args.tokens,), generator=gen).tolist())
    pairs = [(text, "move up")] * 16

    def train(n: int, per_step: int) -> float:
        sync()
        t = time.perf_counter()
        train_lora(peft, tok, pairs[:n], epochs=1, batch_size=per_step, precision=precision, lr=1e-4)
        sync()
        return time.perf_counter() - t

    print(f"warm-up (compiling, if any): {train(2, 1) + train(8, 8):.1f} s", flush=True)
    print(f"training: {1000 * train(16, 1) / 16:.1f} ms a step of one sequence, "
          f"{1000 * train(16, 8) / 2:.1f} ms a step of eight", flush=True)
    profiled(lambda: train(1, 1), 4, cuda, args.rows)

    env = MazeEnv()
    prompts = [format_prompt(env.reset(t).instruction, [("The goal is at position 8, 6.", "move up")] * 3,
                             env.reset(t).observation, 3) for t in range(4)]
    cands = [["move up", "move down", "move left", "move right"]] * 4
    scorer = ActionScorer(peft, tok, precision=precision)
    with mdl.merged_lora(peft):
        t = time.perf_counter()
        scorer.score(prompts, cands)
        scorer.score(prompts, cands)  # the second call scores on the first's cached prompts
        print(f"scoring warm-up (compiling, if any): {time.perf_counter() - t:.1f} s", flush=True)
        sync()
        t = time.perf_counter()
        for _ in range(10):
            scorer.score(prompts, cands)
        sync()
        print(f"scoring 4 prompts x 4 actions: {100 * (time.perf_counter() - t):.1f} ms a call", flush=True)
        profiled(lambda: scorer.score(prompts, cands), 3, cuda, args.rows)


if __name__ == "__main__":
    main()
