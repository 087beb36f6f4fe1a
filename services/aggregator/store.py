"""The aggregator's files: every global adapter as a standard PEFT adapter directory, every
accepted upload, and the clients' reported metrics.

Layout under <state_dir>/<run_id>/:
  global/round_0003/adapter_model.safetensors + adapter_config.json   (phi_3, loadable by PEFT)
  uploads/round_0002/<client_id>.safetensors
  metrics.jsonl
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time

from fedse import adapter as ad


class Store:
    def __init__(self, state_dir: pathlib.Path, run_id: str):
        self.root = pathlib.Path(state_dir) / run_id
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def global_dir(self, round_: int) -> pathlib.Path:
        return self.root / "global" / f"round_{round_:04d}"

    def save_global(self, round_: int, data: bytes, adapter_config_json: str) -> pathlib.Path:
        path = self.global_dir(round_)
        ad.write_peft_dir(path, data, adapter_config_json)
        return path

    def save_upload(self, round_: int, client_id: str, data: bytes) -> pathlib.Path:
        folder = self.root / "uploads" / f"round_{round_:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{client_id}.safetensors"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return path

    def append_metrics(self, client_id: str, round_: int, metrics: dict[str, float]) -> None:
        line = json.dumps({"ts": time.time(), "client_id": client_id, "round": round_, "metrics": metrics})
        with self._lock, open(self.root / "metrics.jsonl", "a") as fh:
            fh.write(line + "\n")
