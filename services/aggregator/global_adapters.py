"""The global adapters phi_t: written by the Store as standard PEFT directories, and the latest
round's bytes and sha256 kept in memory, per transport dtype, for downloads."""

from __future__ import annotations

import hashlib
import threading

from fedse.model import adapter as ad

from .store import Store


class GlobalAdapters:
    """Thread-safe. The bytes of the round last saved or asked for are cached: old rounds are
    rarely asked for again."""

    def __init__(self, store: Store):
        self.store = store
        self._lock = threading.Lock()
        # (round, transport) -> (the adapter file's bytes, sha256); phi made here is a bytearray image
        self._cache: dict[tuple[int, str], tuple[bytes | bytearray, str]] = {}

    def has(self, round_: int) -> bool:
        return self.store.has_global(round_)

    def save(self, round_: int, data: bytes | bytearray, adapter_config_json: str) -> None:
        """Writes phi_round as a PEFT directory and keeps its bytes and hash for downloads."""
        digest = hashlib.sha256()
        hashing = threading.Thread(target=digest.update, args=(data,), name="hash-global")
        hashing.start()  # beside the write: hashlib lets go of the GIL over large buffers
        try:
            self.store.save_global(round_, data, adapter_config_json)
        finally:
            hashing.join()
        with self._lock:
            self._keep_locked(round_, "", data, digest.hexdigest())

    def get(self, round_: int, transport: str = "") -> tuple[bytes | bytearray, str]:
        """(bytes, sha256) of phi_round in the transport dtype ("" = as stored); it must exist."""
        with self._lock:
            key = (round_, transport)
            if key not in self._cache:
                data = self.store.load_global(round_)
                if transport:
                    data = ad.encode_transport(ad.decode(data), transport)
                self._keep_locked(round_, transport, data, ad.sha256_hex(data))
            return self._cache[key]

    def _keep_locked(self, round_: int, transport: str, data: bytes | bytearray, sha: str) -> None:
        for old in [k for k in self._cache if k[0] != round_]:  # the current round's variants only
            del self._cache[old]
        self._cache[(round_, transport)] = (data, sha)
