"""The aggregator's files: the run's state, every global adapter as a standard PEFT adapter
directory, every upload (partial and accepted), and the clients' reported metrics.

Layout under <state_dir>/<run_id>/ (a Kubernetes volume can hold it):
  run.json                                              the run: settings, schema, clients, round, nonce
  global/round_0003/adapter_model.safetensors + adapter_config.json   (phi_3, loadable by PEFT)
  uploads/round_0002/<client_id>.part + .part.json      bytes received so far of an unfinished upload
  uploads/round_0002/<client_id>.safetensors + .json    an accepted upload; the .json is its commit record
                                                        (.masked with secure aggregation, deleted once
                                                        its round is unmasked)
  metrics.jsonl                                         the clients' metrics reports, one a line
  selections.jsonl                                      the selector's choice of each round (--selector)

Every write that an acknowledgement depends on is fsynced and atomic (temp file, then rename), so
an aggregator killed at any point restarts with each acknowledged upload and round transition kept.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import threading
import time
from typing import Any

from fedse.model.adapter import CONFIG_NAME, WEIGHTS_NAME
from fedse.files import atomic_write, fsync_dir

STATE_NAME = "run.json"


class Store:
    def __init__(self, state_dir: pathlib.Path, run_id: str, masked: bool = False):
        """`masked`: uploads are masked vectors (secure aggregation), kept as <client_id>.masked."""
        self.root = pathlib.Path(state_dir) / run_id
        self.upload_suffix = ".masked" if masked else ".safetensors"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    # ---- run state ---------------------------------------------------------------------------
    def load_state(self) -> dict[str, Any] | None:
        path = self.root / STATE_NAME
        if not path.exists():
            return None
        return json.loads(path.read_text())

    def save_state(self, state: dict[str, Any]) -> None:
        atomic_write(self.root / STATE_NAME, json.dumps(state, indent=1, sort_keys=True).encode())

    # ---- global adapters ---------------------------------------------------------------------
    def global_dir(self, round_: int) -> pathlib.Path:
        return self.root / "global" / f"round_{round_:04d}"

    def global_path(self, round_: int) -> pathlib.Path:
        return self.global_dir(round_) / WEIGHTS_NAME

    def save_global(self, round_: int, data: bytes, adapter_config_json: str) -> pathlib.Path:
        path = self.global_dir(round_)
        write_peft_dir(path, data, adapter_config_json)
        return path

    def has_global(self, round_: int) -> bool:
        return self.global_path(round_).exists()

    def load_global(self, round_: int) -> bytes:
        return self.global_path(round_).read_bytes()

    # ---- uploads -----------------------------------------------------------------------------
    def upload_dir(self, round_: int) -> pathlib.Path:
        return self.root / "uploads" / f"round_{round_:04d}"

    def partial(self, round_: int, client_id: str) -> tuple[pathlib.Path, dict[str, Any] | None]:
        """The partial upload's data file and its header record (None if there is none)."""
        folder = self.upload_dir(round_)
        meta_path = folder / f"{client_id}.part.json"
        data_path = folder / f"{client_id}.part"
        if not meta_path.exists():
            return data_path, None
        return data_path, json.loads(meta_path.read_text())

    def partial_size(self, round_: int, client_id: str) -> int:
        data_path, meta = self.partial(round_, client_id)
        return data_path.stat().st_size if meta is not None and data_path.exists() else 0

    def start_partial(self, round_: int, client_id: str, header: dict[str, Any]) -> None:
        """Starts a new partial upload (dropping any other one of this client and round)."""
        folder = self.upload_dir(round_)
        folder.mkdir(parents=True, exist_ok=True)
        data_path = folder / f"{client_id}.part"
        self.drop_partial(round_, client_id)
        with open(data_path, "wb") as fh:
            os.fsync(fh.fileno())
        atomic_write(folder / f"{client_id}.part.json", json.dumps(header, sort_keys=True).encode())

    def append_partial(self, round_: int, client_id: str, offset: int, data: bytes) -> int:
        """Writes `data` at `offset` of the partial upload; returns the bytes now held. Writing at
        the offset (not appending) makes a chunk that was written but not counted before a crash
        harmless. Not fsynced chunk by chunk: a killed process loses nothing the OS holds, and
        `sync_partial` runs when the stream ends (a power cut may cost a resumed upload a restart,
        which its sha256 check detects)."""
        path = self.upload_dir(round_) / f"{client_id}.part"
        with open(path, "r+b") as fh:
            fh.seek(offset)
            fh.write(data)
            fh.truncate()
        return offset + len(data)

    def sync_partial(self, round_: int, client_id: str) -> None:
        path = self.upload_dir(round_) / f"{client_id}.part"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_partial(self, round_: int, client_id: str, size: int = -1) -> bytes:
        """The first `size` bytes held of a partial upload (-1: all of them)."""
        with open(self.upload_dir(round_) / f"{client_id}.part", "rb") as fh:
            return fh.read(size)

    def drop_partial(self, round_: int, client_id: str) -> None:
        folder = self.upload_dir(round_)
        for name in (f"{client_id}.part.json", f"{client_id}.part"):
            try:
                (folder / name).unlink()
            except FileNotFoundError:
                pass

    def accept_upload(self, round_: int, client_id: str, record: dict[str, Any]) -> pathlib.Path:
        """Stores an accepted upload: the partial file (fsynced by the caller) becomes the upload as
        it is, then the record that commits it is written."""
        folder = self.upload_dir(round_)
        path = folder / f"{client_id}{self.upload_suffix}"
        os.replace(folder / f"{client_id}.part", path)
        fsync_dir(folder)
        atomic_write(folder / f"{client_id}.json", json.dumps(record, sort_keys=True).encode())
        self.drop_partial(round_, client_id)
        return path

    def accepted_uploads(self, round_: int) -> dict[str, dict[str, Any]]:
        """client_id -> commit record of every accepted upload of the round."""
        folder = self.upload_dir(round_)
        out: dict[str, dict[str, Any]] = {}
        if not folder.exists():
            return out
        for meta in sorted(folder.glob("*.json")):
            if meta.name.endswith(".part.json"):
                continue
            client_id = meta.name.removesuffix(".json")
            if (folder / f"{client_id}{self.upload_suffix}").exists():
                out[client_id] = json.loads(meta.read_text())
        return out

    def drop_uploads(self, round_: int) -> None:
        """Deletes every upload of the round, partial or accepted (a secure attempt abandoned)."""
        shutil.rmtree(self.upload_dir(round_), ignore_errors=True)

    def upload_path(self, round_: int, client_id: str) -> pathlib.Path:
        return self.upload_dir(round_) / f"{client_id}{self.upload_suffix}"

    # ---- metrics -----------------------------------------------------------------------------
    def append_metrics(self, client_id: str, round_: int, metrics: dict[str, float]) -> None:
        self._append("metrics.jsonl", {"ts": time.time(), "client_id": client_id, "round": round_, "metrics": metrics})

    def append_selection(self, selection: dict[str, Any]) -> None:
        """Appends a round's selection (its record, `Selection.to_dict`) to selections.jsonl, the log of
        every choice the selector made (a round chosen again has two lines)."""
        self._append("selections.jsonl", {"ts": time.time(), **selection})

    def selections(self) -> list[dict[str, Any]]:
        """Every recorded selection, in order (a torn last line ignored)."""
        path = self.root / "selections.jsonl"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def _append(self, name: str, entry: dict[str, Any]) -> None:
        with self._lock, open(self.root / name, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def metrics_reports(self) -> list[tuple[str, int, dict[str, float]]]:
        """(client_id, round, metrics) of every recorded report in order (a torn last line ignored)."""
        path = self.root / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            out.append((str(entry["client_id"]), int(entry["round"]), entry["metrics"]))
        return out


def write_peft_dir(directory: pathlib.Path, data: bytes, adapter_config_json: str) -> None:
    """Writes a standard PEFT adapter directory atomically (temp dir, then rename)."""
    directory = pathlib.Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    (tmp / WEIGHTS_NAME).write_bytes(data)
    (tmp / CONFIG_NAME).write_text(adapter_config_json)
    for f in (tmp / WEIGHTS_NAME, tmp / CONFIG_NAME):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old")
        os.replace(directory, old)
        os.replace(tmp, directory)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        os.replace(tmp, directory)
    fsync_dir(directory.parent)


def config_with_base(adapter_config_json: str, base_model: str) -> str:
    """The adapter_config.json text with base_model_name_or_path set (for exported adapters)."""
    cfg = json.loads(adapter_config_json)
    cfg["base_model_name_or_path"] = base_model
    return json.dumps(cfg, indent=2, sort_keys=True)
