"""One round with secure aggregation beside the same round without it, for K clients and two adapter
sizes: SmolLM2-135M's LoRA (r = 8 on every linear layer of its 30 blocks, 9.8 MB in fp32) and an
80 MB one (Llama-2-7B's LoRA, r = 8, 32 blocks).

Each case starts a real aggregator process (`python -m services.aggregator`, --rounds 1,
--start-clients K, fedavg, or weighted with --strategy weighted) and K client processes. Each client
makes its adapter, joins, waits for the round to open, says ready; when all are ready they are told
to go at once, and each:
  plain   uploads its adapter (FederationClient.upload), then waits until the round closed;
  secure  takes part in the secure stages (services.client_agent.federation.secure.SecureRound: fresh keys,
          sealed shares, the masked vector of 8 bytes per value, the unmasking), then waits until
          the round closed.
The round's time is from the first client going to the last one seeing the round closed, so it holds
the aggregation (the mean, or the unmasking) and phi_1 written. The clients share this machine's
cores, as they would not in a federation. Printed apart: each client's masking (its K mask streams
added to its vector), the mean time from a client's shares sent to its masked upload acknowledged
(getting and opening the shares, encoding, masking, hashing and uploading 8 bytes per value), and
the aggregator's stages from its log (each stage from its opening to the next one's; "aggregate"
is the unmasking: the masked uploads summed, the masks rebuilt and removed, phi_1 written).

The same two rounds are timed again over mTLS, where secure aggregation signs its keys
(RunConfig.secure_signed: the aggregator has --tls-ca): a CA, the aggregator's certificate and one per
client are made at the start in a temporary directory (fedse.security.certs, as `fedse certs` makes them), and
  plain (mTLS)   uploads as plain, over mTLS;
  signed (mTLS)  takes part as secure, with its mTLS files as its protection (Protection.of): it
                 signs its keys, checks every roster member's certificate and signature, and, in the
                 consistency stage after the uploads, signs the uploader list and checks that at least
                 the threshold of its neighbours signed it before revealing its shares.
An unsigned secure round over mTLS cannot be had (mTLS turns signing on), so the signed round's cost is
read beside the plain one over mTLS (TLS's own cost is in both), and broken out: each signed client's
time in Signer.sign, Verifier.certificate and Verifier.signature (timed in the client processes as
Participant.mask is), and the aggregator's consistency stage (its opening to the unmasking's: every
uploader's signature received and checked by the aggregator).

    .venv/bin/python bench/secure_round.py [--ks 5,20] [--sizes smollm2,80mb] [--signed-sizes smollm2,80mb]
                                           [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.processes import Proc  # noqa: E402
from fedse.model import adapter as ad  # noqa: E402
from fedse.security import certs  # noqa: E402
from fedse.privacy import secagg  # noqa: E402
from fedse.security import signatures  # noqa: E402
from fedse.machine import describe_cpu  # noqa: E402
from fedse.security.admission import Security  # noqa: E402
from fedse.v1 import federation_pb2 as fpb  # noqa: E402
from services.client_agent.federation.link import FederationClient  # noqa: E402
from services.client_agent.federation.secure import Contribution, Protection, SecureRound  # noqa: E402

from llama_lora import RANK, schema as llama_schema  # noqa: E402  (bench/, beside this file)

CONFIG_JSON = json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 16})
SMOLLM2 = {"hidden": 576, "intermediate": 1536, "kv": 192, "layers": 30}  # SmolLM2-135M's config.json
START_S = 600.0
MODES = ("plain", "secure", "plain-mtls", "signed")  # signed: secure over mTLS (signed keys, consistency stage)


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
def client(target: str, client_id: str, size: str, seed: int, mode: str, pki: str, strategy: str) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"{client_id} %(message)s")
    torch.set_num_threads(1)  # as a client agent on a shared machine (--torch-threads): no OpenMP spinning
    secure, mtls = mode in ("secure", "signed"), mode in ("plain-mtls", "signed")
    gen = torch.Generator().manual_seed(seed)
    adapter = {n: torch.randn(s, generator=gen) * 0.01 for n, s in shapes(size).items()}
    schema = ad.Schema.of(adapter, CONFIG_JSON)
    data = None if secure else ad.encode(adapter)
    security = protection = None
    if mtls:
        files = (os.path.join(pki, certs.CA_CERT), os.path.join(pki, f"{client_id}.pem"),
                 os.path.join(pki, f"{client_id}-key.pem"))
        security = Security(tls_ca=files[0], tls_cert=files[1], tls_key=files[2])
        protection = Protection.of(0.5, *files) if secure else None
    fed = FederationClient(target, client_id, timeout_s=START_S, security=security)
    config = fed.join("bench", "bench-model", schema).config
    if mode == "signed" and not config.secure_signed:
        raise SystemExit(f"{client_id}: the run over mTLS does not sign keys (RunConfig.secure_signed is false)")
    st = fed.wait_until(lambda s: s.state == fpb.ROUND_STATE_OPEN, timeout_s=START_S)
    print("ready", flush=True)
    sys.stdin.readline()
    t = {"go": time.monotonic()}
    if secure:
        layout = secagg.Layout.of(schema, strategy)
        timing = _Timed()
        timing.wrap(secagg.Participant, "mask", "mask")
        timing.wrap(signatures.Signer, "sign", "sign")
        timing.wrap(signatures.Verifier, "certificate", "certificate")
        timing.wrap(signatures.Verifier, "signature", "signature", static=True)
        SecureRound(fed, config.run_id, config, layout, START_S, protection).take_part(
            st.round, Contribution(adapter, None, weight_of(seed, strategy)),
            lambda step: t.__setitem__(step, time.monotonic()))
        for name in timing.seconds:
            t[f"{name}_s"], t[f"{name}_n"] = timing.seconds[name], timing.calls[name]
    else:
        fed.upload(st.round, data, num_examples=1, num_successes=weight_of(seed, strategy),
                   adapter_config_json=CONFIG_JSON, round_nonce=st.round_nonce)
    fed.wait_until(lambda s: s.round > st.round or s.state == fpb.ROUND_STATE_FINISHED, timeout_s=START_S)
    t["closed"] = time.monotonic()
    fed.close()
    print(json.dumps(t), flush=True)


class _Timed:
    """Times methods in this process (the client's own costs): Participant.mask (its K mask streams),
    and with signed keys Signer.sign (its keys and the uploader list), Verifier.certificate (each
    roster member's certificate: CA signature, validity, identity) and Verifier.signature (each
    member's signature of its keys, each neighbour's of the uploader list)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, cls: type, method: str, name: str, static: bool = False) -> None:
        self.seconds[name], self.calls[name] = 0.0, 0
        original = getattr(cls, method)

        def timed(*args, **kw):
            started = time.perf_counter()
            try:
                return original(*args, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1
        setattr(cls, method, staticmethod(timed) if static else timed)


# ---- one case ----------------------------------------------------------------------------------
def make_pki(directory: pathlib.Path, clients: int) -> None:
    """The federation CA, the aggregator's certificate (127.0.0.1) and clients org-00.. in directory."""
    certs.init_ca(directory)
    certs.issue(directory, "server", ["localhost"], ["127.0.0.1"], directory)
    for i in range(clients):
        cid = f"org-{i:02d}"
        certs.request(cid, directory)
        certs.sign(directory, directory / f"{cid}.csr", directory / f"{cid}.pem")


def weight_of(seed: int, strategy: str) -> int:
    """A client's weight: 1 for fedavg; for weighted, its successes, 1 to 3 by client."""
    return 1 + seed % 3 if strategy == "weighted" else 1


def run_case(work: pathlib.Path, k: int, size: str, mode: str, pki: pathlib.Path, strategy: str = "fedavg") -> dict:
    secure, mtls = mode in ("secure", "signed"), mode in ("plain-mtls", "signed")
    state = work / f"{size}-{k}-{mode}"
    state.mkdir()
    argv = ["services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1", "--state-dir", str(state),
            "--run-id", "bench", "--rounds", "1", "--min-clients", "2", "--start-clients", str(k),
            "--heartbeat-timeout-s", "3600", "--wait-after-min-s", "3600", "--secure-stage-timeout-s", "3600",
            "--max-adapter-mb", "1024", "--strategy", strategy] + (["--secure-aggregation"] if secure else [])
    if mtls:
        argv += ["--tls-ca", str(pki / certs.CA_CERT), "--tls-cert", str(pki / "server.pem"),
                 "--tls-key", str(pki / "server-key.pem")]
    agg = Proc("aggregator", argv, state)
    clients: list[subprocess.Popen] = []
    try:
        target = f"127.0.0.1:{agg.port()}"
        clients = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client", target, f"org-{i:02d}",
                                     size, str(i + 1), mode, str(pki), strategy], stdin=subprocess.PIPE,
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
            out["client_upload_s"] = sum(s["uploaded"] - s["shared"] for s in stamps) / k
            for name in ("mask", "sign", "certificate", "signature"):  # per client: mean seconds and calls
                out[f"{name}_s"] = sum(s[f"{name}_s"] for s in stamps) / k
                out[f"{name}_n"] = sum(s[f"{name}_n"] for s in stamps) / k
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


STAGES = ("advertising", "sharing", "uploading", "consistency", "unmasking", "aggregate")


def detail(case: dict) -> str:
    return ", ".join(f"{n} {case[n + '_s']:.2f}" for n in STAGES if n + "_s" in case)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6], sys.argv[7], sys.argv[8])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", default="5,20")
    p.add_argument("--sizes", default="smollm2,80mb")
    p.add_argument("--signed-sizes", default="smollm2,80mb",
                   help="the sizes also timed over mTLS (plain and signed); the others are timed without TLS only")
    p.add_argument("--workdir", default=tempfile.gettempdir())
    p.add_argument("--strategy", default="fedavg", choices=("fedavg", "weighted"),
                   help="the aggregation (weighted: each client's weight 1-3, masked with its adapter)")
    a = p.parse_args()
    ks = [int(x) for x in a.ks.split(",")]
    signed_sizes = set(filter(None, a.signed_sizes.split(",")))
    work = pathlib.Path(tempfile.mkdtemp(dir=a.workdir, prefix="fedse-secure-bench-"))
    pki = work / "pki"
    pki.mkdir()
    make_pki(pki, max(ks))
    print(f"# {describe_cpu()}; --strategy {a.strategy}", flush=True)
    print("# secure: secure aggregation without TLS; signed: secure aggregation over mTLS (signed keys and the "
          "consistency stage); plain: plain uploads without TLS and over mTLS. One run each.")
    print(f"{'adapter':>8} {'K':>3} {'plain s':>8} {'secure s':>9} {'x plain':>8} {'mask/client s':>14} "
          f"{'shared->uploaded s':>19} {'plain mTLS s':>13} {'signed s':>9} {'x plain mTLS':>13} "
          f"{'sign/client ms':>15} {'verify/client ms':>17} {'consistency s':>14}  aggregator: secure stages (s)")
    breakdown = []
    try:
        for size in a.sizes.split(","):
            mb = sum(r * c for r, c in shapes(size).values()) * 4 / 1e6
            for k in ks:
                plain = run_case(work, k, size, "plain", pki, a.strategy)
                secure = run_case(work, k, size, "secure", pki, a.strategy)
                line = (f"{mb:6.1f}MB {k:>3} {plain['round_s']:>8.2f} {secure['round_s']:>9.2f} "
                        f"{secure['round_s'] / plain['round_s']:>7.2f}x {secure['mask_s']:>14.2f} "
                        f"{secure['client_upload_s']:>19.2f}")
                if size in signed_sizes:
                    plain_tls = run_case(work, k, size, "plain-mtls", pki, a.strategy)
                    signed = run_case(work, k, size, "signed", pki, a.strategy)
                    verify_ms = (signed["certificate_s"] + signed["signature_s"]) * 1e3
                    line += (f" {plain_tls['round_s']:>13.2f} {signed['round_s']:>9.2f} "
                             f"{signed['round_s'] / plain_tls['round_s']:>12.2f}x {signed['sign_s'] * 1e3:>15.1f} "
                             f"{verify_ms:>17.1f} {signed.get('consistency_s', float('nan')):>14.2f}"
                             f"  secure: {detail(secure)}; signed: {detail(signed)}")
                    breakdown.append((mb, k, signed))
                else:
                    line += f" {'-':>13} {'-':>9} {'-':>13} {'-':>15} {'-':>17} {'-':>14}  secure: {detail(secure)}"
                print(line, flush=True)
        skipped = [s for s in a.sizes.split(",") if s not in signed_sizes]
        if skipped:
            print(f"# not timed over mTLS (--signed-sizes): {', '.join(skipped)}")
        if breakdown:
            print("# signed, per client (mean over clients): calls and ms of Signer.sign, Verifier.certificate, "
                  "Verifier.signature; mask/client and shared->uploaded as above")
            for mb, k, sg in breakdown:
                print(f"{mb:6.1f}MB {k:>3}  sign {sg['sign_n']:.0f} x = {sg['sign_s'] * 1e3:.1f} ms, "
                      f"certificate {sg['certificate_n']:.0f} x = {sg['certificate_s'] * 1e3:.1f} ms, "
                      f"signature {sg['signature_n']:.0f} x = {sg['signature_s'] * 1e3:.1f} ms; "
                      f"mask {sg['mask_s']:.2f} s, shared->uploaded {sg['client_upload_s']:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
