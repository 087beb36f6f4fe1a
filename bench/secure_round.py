"""One round with secure aggregation beside the same round without it, for K clients and two adapter
sizes: SmolLM2-135M's LoRA (r = 8 on every linear layer of its 30 blocks, 9.8 MB in fp32) and an
80 MB one (Llama-2-7B's LoRA, r = 8, 32 blocks).

Each case starts a real aggregator process (`python -m services.aggregator`, --num-rounds 1,
--start-clients K, fedavg) and K client processes. Each client makes its adapter, joins, waits for
the round to open, says ready; when all are ready they are told to go at once, and each:
  plain   uploads its adapter (FederationClient.upload), then waits until the round closed;
  secure  takes part in the secure stages (services.client_agent.secure.SecureRound: fresh keys,
          sealed shares, the masked vector of 8 bytes per value, the unmasking), then waits until
          the round closed.
The round's time is from the first client going to the last one seeing the round closed, so it holds
the aggregation (the mean, or the unmasking) and phi_1 written. The clients share this machine's
cores, as they would not in a federation. Printed apart: each client's masking (its K mask streams
added to its vector), the mean time from a client's shares sent to its masked upload acknowledged
(getting and opening the shares, encoding, masking, hashing and uploading 8 bytes per value), and
the aggregator's stages from its log (each stage from its opening to the next one's; "aggregate"
is the unmasking: the masked uploads summed, the masks rebuilt and removed, phi_1 written).

    .venv/bin/python bench/secure_round.py [--ks 5,20] [--sizes smollm2,80mb] [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.processes import Proc  # noqa: E402
from fedse import adapter as ad  # noqa: E402
from fedse import secagg  # noqa: E402
from fedse.machine import cpu  # noqa: E402
from fedse.v1 import federation_pb2 as fpb  # noqa: E402
from services.client_agent.federation import FederationClient  # noqa: E402
from services.client_agent.secure import Contribution, SecureRound  # noqa: E402

from llama_lora import RANK, schema as llama_schema  # noqa: E402  (bench/, beside this file)

CONFIG_JSON = json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 16})
SMOLLM2 = {"hidden": 576, "intermediate": 1536, "kv": 192, "layers": 30}  # SmolLM2-135M's config.json
START_S = 600.0


def shapes(size: str) -> dict[str, tuple[int, int]]:
    if size == "80mb":
        return llama_schema(32)
    h, i, kv = SMOLLM2["hidden"], SMOLLM2["intermediate"], SMOLLM2["kv"]
    modules = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
               "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}
    out = {}
    for layer in range(SMOLLM2["layers"]):
        for module, (fan_in, fan_out) in modules.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = (RANK, fan_in)
            out[f"{prefix}.lora_B.weight"] = (fan_out, RANK)
    return out


# ---- a client process (this file run with --client) ---------------------------------------------
def client(target: str, client_id: str, size: str, seed: int, secure: bool) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"{client_id} %(message)s")
    torch.set_num_threads(1)  # as a client agent on a shared machine (--torch-threads): no OpenMP spinning
    gen = torch.Generator().manual_seed(seed)
    adapter = {n: torch.randn(s, generator=gen) * 0.01 for n, s in shapes(size).items()}
    schema = ad.Schema.of(adapter, CONFIG_JSON)
    data = None if secure else ad.encode(adapter)
    fed = FederationClient(target, client_id, timeout_s=START_S)
    config = fed.join("bench", "bench-model", schema).config
    st = fed.wait_until(lambda s: s.state == fpb.ROUND_STATE_OPEN, timeout_s=START_S)
    print("ready", flush=True)
    sys.stdin.readline()
    t = {"go": time.monotonic()}
    if secure:
        layout = secagg.Layout.of(schema, "fedavg")
        timing = _timed_masking()
        SecureRound(fed, config.run_id, config, layout, START_S).take_part(
            st.round, Contribution(adapter, None, 1, 1, 1), lambda step: t.__setitem__(step, time.monotonic()))
        t["mask_s"] = timing.seconds
    else:
        fed.upload(st.round, data, num_examples=1, num_successes=1, adapter_config_json=CONFIG_JSON,
                   round_nonce=st.round_nonce)
    fed.wait_until(lambda s: s.round > st.round or s.state == fpb.ROUND_STATE_FINISHED, timeout_s=START_S)
    t["closed"] = time.monotonic()
    fed.close()
    print(json.dumps(t), flush=True)


class _timed_masking:
    """Times Participant.mask in this process (the client's own cost: its K mask streams)."""

    def __init__(self):
        self.seconds = 0.0
        original = secagg.Participant.mask

        def mask(participant, vector, peers):
            started = time.perf_counter()
            try:
                return original(participant, vector, peers)
            finally:
                self.seconds += time.perf_counter() - started
        secagg.Participant.mask = mask


# ---- one case ----------------------------------------------------------------------------------
def run_case(work: pathlib.Path, k: int, size: str, secure: bool) -> dict:
    state = work / f"{size}-{k}-{'secure' if secure else 'plain'}"
    state.mkdir()
    argv = ["services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1", "--state-dir", str(state),
            "--run-id", "bench", "--num-rounds", "1", "--min-clients", "2", "--start-clients", str(k),
            "--heartbeat-timeout-s", "3600", "--wait-after-min-s", "3600", "--secure-stage-timeout-s", "3600",
            "--max-adapter-mb", "1024"] + (["--secure-aggregation"] if secure else [])
    agg = Proc("aggregator", argv, state)
    clients: list[subprocess.Popen] = []
    try:
        target = f"127.0.0.1:{agg.port()}"
        clients = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client", target, f"org-{i:02d}",
                                     size, str(i + 1), "1" if secure else "0"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for i in range(k)]
        for c in clients:
            if c.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client did not get ready (exit {c.wait()})")
        for c in clients:
            c.stdin.write("go\n")
            c.stdin.flush()
        stamps = [json.loads(c.stdout.readline()) for c in clients]
        out = {"round_s": max(s["closed"] for s in stamps) - min(s["go"] for s in stamps)}
        if secure:
            out["mask_s"] = sum(s["mask_s"] for s in stamps) / k
            out["client_upload_s"] = sum(s["uploaded"] - s["shared"] for s in stamps) / k
        out.update(stages(agg.log_path))
        return out
    finally:
        for c in clients:
            c.kill()
            c.wait()
        agg.stop()
        shutil.rmtree(state, ignore_errors=True)


def stages(log: pathlib.Path) -> dict[str, float]:
    """Seconds between the aggregator's logged steps: each secure stage's opening, then the unmasked sum
    (or the plain aggregation)."""
    marks, out = [], {}
    for line in log.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("msg") == "secure stage opened":
            marks.append((e["stage"], e["ts"]))
        elif e.get("msg") == "round closed":
            out["aggregate_s"] = float(e["aggregate_s"])
            marks.append(("closed", e["ts"]))
    for (name, t0), (_, t1) in zip(marks, marks[1:]):
        out[f"{name}_s"] = t1 - t0
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1")
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", default="5,20")
    p.add_argument("--sizes", default="smollm2,80mb")
    p.add_argument("--workdir", default=tempfile.gettempdir())
    a = p.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(dir=a.workdir, prefix="fedse-secure-bench-"))
    model, flags = cpu()
    print(f"# {model or platform.machine()}, {os.cpu_count()} cores, "
          f"{'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'}", flush=True)
    print(f"{'adapter':>8} {'K':>3} {'plain s':>8} {'secure s':>9} {'x plain':>8} {'mask/client s':>14} "
          f"{'shared->uploaded s':>19}  aggregator: secure stages (s)")
    try:
        for size in a.sizes.split(","):
            mb = sum(r * c for r, c in shapes(size).values()) * 4 / 1e6
            for k in (int(x) for x in a.ks.split(",")):
                plain = run_case(work, k, size, secure=False)
                secure = run_case(work, k, size, secure=True)
                detail = ", ".join(f"{n.removesuffix('_s')} {v:.2f}" for n, v in secure.items()
                                   if n not in ("round_s", "mask_s", "client_upload_s"))
                print(f"{mb:6.1f}MB {k:>3} {plain['round_s']:>8.2f} {secure['round_s']:>9.2f} "
                      f"{secure['round_s'] / plain['round_s']:>7.2f}x {secure['mask_s']:>14.2f} "
                      f"{secure['client_upload_s']:>19.2f}  {detail}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
