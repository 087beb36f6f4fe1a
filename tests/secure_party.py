"""A secure-aggregation participant for tests: a real FederationClient with heartbeats that takes part
in a secure round with a given adapter (services.client_agent.federation.secure.SecureRound), in a thread or,
run as a script, in a process of its own that a test can kill at a chosen step.

    python tests/secure_party.py TARGET CLIENT_ID SEED [--hold-at STEP]

prints `AT <step>` as it passes each step; with --hold-at it stops there (and waits to be killed).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import threading
import time

import torch

from fedse.model import adapter as ad
from fedse.model import ranks
from fedse.privacy import secagg
from services.client_agent.federation.link import FederationClient
from services.client_agent.federation.heartbeat import Heartbeat
from fedse.security.admission import Security
from fedse.model.tinymodel import TINY_MODEL_NAME
from services.client_agent.federation.secure import Contribution, Protection, SecureRound

CONFIG_JSON = '{"peft_type": "LORA", "r": 4}'


def base_adapter() -> ad.Adapter:
    """phi_0's shapes: three LoRA pairs, A random, B zero (as PEFT initialises them)."""
    g = torch.Generator().manual_seed(1234)
    out = {f"base_model.model.layer{i}.lora_A.weight": torch.randn(4, 24, generator=g) * 0.05 for i in range(3)}
    out.update({f"base_model.model.layer{i}.lora_B.weight": torch.zeros(24, 4) for i in range(3)})
    return out


def trained(seed: int, base: ad.Adapter | None = None) -> ad.Adapter:
    """A client's adapter after its round: phi_0 (`base`, else base_adapter()) moved by a seeded step."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in (base or base_adapter()).items()}


SCHEMA = ad.Schema.of(base_adapter(), CONFIG_JSON)


class Miscounting(secagg.Layout):
    """A layout whose vectors count their client twice: the unmasked sum then does not decode."""

    def encode(self, adapter, weight):
        out = super().encode(adapter, weight)
        out[-1] += out[-1]  # the count, last in every layout
        return out


@dataclasses.dataclass
class Party:
    target: str
    client_id: str
    seed: int
    successes: int = 1
    hold_at: str = ""  # a step to stop at (the party then goes silent, as if killed)
    result: object = None
    security: Security | None = None  # mTLS to the aggregator
    protection: Protection | None = None  # what the party requires (signed keys with its mTLS files)
    schema: ad.Schema | None = None  # the run's adapter schema and phi_0 (default: SCHEMA, base_adapter())
    base: ad.Adapter | None = None
    hold_if: object = None  # called with the party at each step: True stops it there, as hold_at does
    miscount: bool = False  # masks a vector whose count slot says 2, not 1 (a dishonest or broken client)

    def __post_init__(self):
        self.fed = FederationClient(self.target, self.client_id, retries=3, backoff_s=0.1, timeout_s=30,
                                    security=self.security)
        self.heartbeat = Heartbeat(self.fed, 0.3)
        self.schema, self.base = self.schema or SCHEMA, self.base or base_adapter()
        # Federations of 2 and 3 withstand no colluder: the tests' parties accept them unless told otherwise.
        self.protection = self.protection or Protection(min_colluders=0)
        self.adapter = trained(self.seed, self.base)
        self.steps: list[str] = []
        self._held = threading.Event()

    @classmethod
    def signed(cls, target: str, client_id: str, seed: int, pki, min_threshold: float = 0.5, cert_key=None,
               protect=None, **kw) -> "Party":
        """A party over mTLS with a certificate naming it (issued by `pki`, a support.Pki, unless `cert_key`
        gives the (certificate, key) files), that signs its keys and requires everyone's signed; `protect`:
        more Protection fields (min_colluders 0 unless given)."""
        cert, key = cert_key or pki.issue(pki.ca, client_id, client_id)
        sec = Security(tls_ca=pki.ca_pem, tls_cert=cert, tls_key=key)
        more = {"min_colluders": 0, **(protect or {})}
        return cls(target, client_id, seed, security=sec,
                   protection=Protection.of(min_threshold, pki.ca_pem, cert, key, **more), **kw)

    def join(self):
        self.config = self.fed.join("maze", TINY_MODEL_NAME, self.schema).config
        self.heartbeat.start()
        return self

    def take_part(self, round_: int = 0) -> bool:
        schema, values, previous, rank = self.schema, {k: v.double() for k, v in self.adapter.items()}, self.base, 0
        top = self.config.max_lora_rank
        if top:  # a mixed-rank run: the adapter zero-padded to the run's rank, as the client agent masks it
            rank, schema = ranks.rank_of(self.schema), ranks.run_schema(self.schema, top)
            values = ranks.padded(values, top, ranks.scaling(self.schema.adapter_config_json) / ranks.RUN_SCALING)
            previous = ad.decode(self.fed.download(round_).data)
        layout = secagg.Layout.of(schema, self.config.strategy)
        if self.miscount:
            layout = Miscounting(layout.names, layout.shapes, layout.weighted)
        weight = self.successes if self.config.strategy == "weighted" else 1
        c = Contribution(values, previous, weight, rank)
        return SecureRound(self.fed, self.config.run_id, self.config, layout, 60, self.protection).take_part(
            round_, c, self._step)

    def _step(self, step: str) -> None:
        print(f"AT {step}", flush=True)
        self.steps.append(step)
        if step == self.hold_at or (self.hold_if is not None and self.hold_if(self, step)):
            self.heartbeat.stop(0.1)
            self._held.set()
            while True:  # silent from here on, as a client that died
                time.sleep(3600)

    def start(self, round_: int = 0) -> threading.Thread:
        def run():
            try:
                self.result = self.take_part(round_)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                self.result = exc
                self.heartbeat.stop(0.1)  # a party that refused goes quiet: the stage need not wait it out
        t = threading.Thread(target=run, daemon=True, name=f"party-{self.client_id}")
        t.start()
        return t

    def close(self):
        self.heartbeat.stop(0.1)
        self.fed.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("client_id")
    p.add_argument("seed", type=int)
    p.add_argument("--hold-at", default="")
    p.add_argument("--state-dir", default="", help="where the party keeps what it remembers across restarts")
    a = p.parse_args()
    protection = None
    if a.state_dir:
        from services.client_agent.federation.secure import ReleaseBook
        from services.client_agent.federation.secure_checks import SeenAttempts

        state = pathlib.Path(a.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        protection = Protection(book=ReleaseBook(state / "secure_released.json"), min_colluders=0,
                                attempts=SeenAttempts(state / "secure_attempts.txt"))
    party = Party(a.target, a.client_id, a.seed, hold_at=a.hold_at, protection=protection).join()
    try:
        ok = party.take_part(0)
    except secagg.SecureError as exc:
        print(f"REFUSED {exc}", flush=True)
        party.close()
        return 3
    print(f"DONE {ok}", flush=True)
    party.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ---- what a state directory or a log may not hold ----------------------------------------------------
def private_tensors(adapters: dict[str, ad.Adapter], base: ad.Adapter) -> list[tuple[str, str, torch.Tensor]]:
    """(client, name, tensor) of every client tensor that training changed (an unchanged one is phi_t's,
    which every party holds)."""
    return [(cid, name, t) for cid, a in adapters.items() for name, t in a.items() if not torch.equal(t, base[name])]


def close_to(x: torch.Tensor, t: torch.Tensor) -> bool:
    """Within the secure-aggregation bound of `t`: 1e-6 of its largest value."""
    return x.shape == t.shape and float((x.double() - t.double()).abs().max()) <= 1e-6 * float(t.abs().max())


def leaks(files: list, adapters: dict[str, ad.Adapter], base: ad.Adapter) -> list[str]:
    """Where `files` (paths) hold a client's tensor: its float32 bytes, a safetensors tensor within the bound
    of it, or a uint64 fixed-point vector within the bound of it."""
    from fedse.privacy import fixedpoint as fx

    private = private_tensors(adapters, base)
    found = []
    for path in files:
        data = path.read_bytes()
        for cid, name, t in private:
            for dtype in (torch.float32, torch.bfloat16, torch.float64):
                raw = t.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()
                if raw[:32] in data:
                    found.append(f"{path.name}: {cid}'s {name} as {dtype} bytes")
        try:
            tensors = ad.decode(data)
        except Exception:  # noqa: BLE001 - not a safetensors file
            tensors = {}
        for cid, name, t in private:
            if name in tensors and close_to(tensors[name], t):
                found.append(f"{path.name}: a tensor within the bound of {cid}'s {name}")
        if not tensors and len(data) % 8 == 0 and len(data) >= 8:
            import numpy as np
            values = torch.from_numpy(np.frombuffer(data, dtype="<i8").astype(np.float64) / fx.SCALE)
            at = 0
            for name in sorted(base):  # the masked layout: the schema's tensors in order
                n = base[name].numel()
                piece = values[at:at + n].reshape(base[name].shape) if at + n <= len(values) else None
                at += n
                for cid, pname, t in private:
                    if pname == name and piece is not None and close_to(piece, t):
                        found.append(f"{path.name}: fixed-point values within the bound of {cid}'s {name}")
    return found
