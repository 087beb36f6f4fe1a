"""What an organisation has released in secure aggregation (`ReleaseBook`), kept in its client's state
directory across restarts and across runs: the aggregator chooses run ids, and may lie about them.

- **Revealed rounds** (secure_released.json): every (run, round) in which this client revealed shares for
  an unmasked sum. It takes part in no other attempt of such a round, whatever run id it is told
  later: a second sum over other clients would give their difference. Every pair ever revealed is
  kept, so that switching a client between run ids A -> B -> A does not make it reveal again.
- **Noise draws**: each release's differential-privacy noise is drawn once per (round, adapter) and is
  the same after a restart. Its ChaCha20 key is derived (HKDF-SHA256) from a per-organisation secret
  and the release's identity (`secagg.release_digest`: the round's adapter, the global adapter it was
  clipped against, the clip norm and noise multiplier), so a restarted client masks byte-identical
  values, and another adapter or round gets an independent draw. The threshold the noise was drawn
  for is kept beside the revealed rounds: an attempt with a lower threshold is refused across
  restarts too (re-scaling the same draw by another std would reveal the values).

The secret is 32 random bytes in `secure_noise.key` beside the book, made once with mode 0600 (like a
TLS key) and never logged; whoever holds it and the noised values could take the noise off, so it
stays in the client's own state directory. A book without a path keeps everything in memory only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import stat

from fedse.privacy import masking
from fedse.files import atomic_write

KEY_NAME = "secure_noise.key"
FORMAT = 2  # secure_released.json's "version"; version 1 was {"run_id", "rounds"}: one run only


@dataclasses.dataclass(frozen=True)
class Draw:
    """One release's noise: the threshold it was first drawn for, and the ChaCha20 key it is drawn from
    (never shown in a repr or a log)."""

    threshold: int
    key: bytes = dataclasses.field(repr=False)


class ReleaseBook:
    """The (run, round) pairs this organisation revealed shares in, and its noise draws (see the module
    doc). Kept in `path` (None: in memory only) so that a restarted client remembers."""

    def __init__(self, path: pathlib.Path | None = None):
        self.path = path
        self._revealed: set[tuple[str, int]] = set()
        self._draws: dict[str, int] = {}  # draw id (derived from the secret: reveals nothing) -> threshold
        self._secret: bytes | None = None if path is not None else os.urandom(masking.KEY_BYTES)
        if path is not None and path.exists():
            self._read(json.loads(path.read_text()))

    def _read(self, saved: dict) -> None:
        if "revealed" in saved:
            self._revealed = {(str(run), int(r)) for run, r in saved["revealed"]}
            self._draws = {str(k): int(t) for k, t in saved.get("draws", {}).items()}
        else:  # version 1: the rounds of one run
            self._revealed = {(str(saved.get("run_id", "")), int(r)) for r in saved.get("rounds", [])}

    def has(self, run_id: str, round_: int) -> bool:
        return (run_id, round_) in self._revealed

    def mark(self, run_id: str, round_: int) -> None:
        """Records a reveal, saved before the first share leaves."""
        self._revealed.add((run_id, round_))
        self._save()

    def draw(self, round_: int, release: bytes, threshold: int) -> Draw:
        """The noise of the release `release` (secagg.release_digest) in `round_`: the threshold it was
        first drawn for (`threshold` at the first call, recorded before it is used) and its key."""
        secret = self._key()
        ident = masking.derive(secret, "dp noise id", str(round_), release, length=16).hex()
        if ident not in self._draws:
            self._draws[ident] = int(threshold)
            self._save()
        return Draw(self._draws[ident], masking.derive(secret, "dp noise", str(round_), release))

    def _key(self) -> bytes:
        """The organisation's noise secret: read from its file, or made there once (mode 0600)."""
        if self._secret is not None:
            return self._secret
        assert self.path is not None
        path = self.path.with_name(KEY_NAME)
        if not path.exists():
            atomic_write(path, os.urandom(masking.KEY_BYTES), mode=0o600)
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            os.chmod(path, 0o600)  # readable by others: made private again
        secret = path.read_bytes()
        if len(secret) != masking.KEY_BYTES:
            raise ValueError(f"{path} holds {len(secret)} bytes, not the {masking.KEY_BYTES} of a noise secret: "
                             "restore it from a backup of this state directory, or move it aside to make a new one "
                             "(a new one draws new noise for a round already masked)")
        self._secret = secret
        return secret

    def _save(self) -> None:
        if self.path is None:
            return
        atomic_write(self.path, json.dumps({"version": FORMAT, "revealed": sorted(self._revealed),
                                            "draws": self._draws}).encode())
