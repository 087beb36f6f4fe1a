"""The organisation's privacy budget (--privacy-epsilon E, --privacy-delta D): a ledger of every release
of its data, over every run it takes part in, kept in its client's state directory (privacy.json).

Each round this client uploads to is one release of the Gaussian mechanism over its data, with the
noise this client adds itself under secure aggregation (RunConfig.noise_multiplier z), so the budget
never rests on the aggregator's word: a run without that noise is refused at Join (UnaccountedRun).
A release is rho = 1/(2 z^2) zero-concentrated DP at the z of its run (fedse.privacy.accounting); the ledger
adds up the rho of all its releases, whatever run they were in, and its epsilon is that total's at D.
Before each round it would upload to, the client books the release (written before the upload, so a
restart spends nothing twice); where the total would exceed E, it declines the round instead.

The ledger belongs to the organisation, not to a run: the aggregator chooses run ids, and a new one
starts nothing afresh. It is reset only by the organisation: `fedse client --reset-privacy-ledger`
(with the client's --state-dir and --client-id) moves privacy.json aside, to
privacy.reset-<UTC time>.json beside it (kept, never deleted), and exits; the next start begins from
zero. A ledger that cannot be read stops the client (LedgerError) rather than start from zero.

Ledgers written before it spanned runs ({"run_id", "rounds", "declined"}) did not record z: their
releases count at the z of the first run the client then joins (exact where it is the same run).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time

from fedse.privacy import accounting
from fedse.config import ConfigError
from fedse.files import atomic_write, fsync_dir
from fedse.transport.serving import log_fields

from services.client_agent.federation.link import InsecureRun

log = logging.getLogger("fedse.client.guardian")

LEDGER_NAME = "privacy.json"  # in the client's state directory (--state-dir/<client id>)
FORMAT = 2  # privacy.json's "version"; version 1 held one run's rounds


class UnaccountedRun(InsecureRun):
    """A run whose noise this client cannot account for, where the organisation keeps a privacy budget."""

    def __init__(self, run_id: str, epsilon: float):  # noqa: D107 - the message says it
        RuntimeError.__init__(
            self, f"this client keeps a privacy budget of epsilon {epsilon:g} (--privacy-epsilon), and the aggregator's "
                  f"run {run_id} adds no noise this client adds itself (that needs secure aggregation with "
                  "--clip-norm and --noise-multiplier): its rounds would spend an unbounded epsilon; nothing was "
                  "uploaded")


class LedgerError(ConfigError):
    """The privacy ledger cannot be read: the client does not start from zero on its own."""


class PrivacyBudget:
    """The organisation's (epsilon, delta) over every run, and its ledger in `path` (see the module doc):
    `releases`, each (run id, round, noise multiplier), and the rounds it `declined`, each (run id, round)."""

    def __init__(self, epsilon: float, delta: float, path: pathlib.Path):
        self.epsilon, self.delta, self.path = epsilon, delta, path
        self.run_id, self.noise_multiplier = "", 0.0
        self.releases: list[tuple[str, int, float | None]] = []  # None: an old ledger's, z not recorded
        self.declined: list[tuple[str, int]] = []
        if self.active and path.exists():
            try:
                self._read(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise LedgerError(f"the privacy ledger {path} cannot be read ({exc}): restore it from a backup, or "
                                  "reset it with --reset-privacy-ledger (that spends the budget afresh)") from None

    def _read(self, saved: dict) -> None:
        if "releases" in saved:
            self.releases = [(str(run), int(r), None if z is None else float(z)) for run, r, z in saved["releases"]]
            self.declined = [(str(run), int(r)) for run, r in saved.get("declined", [])]
        else:  # version 1: one run's rounds, without their noise multiplier
            run = str(saved["run_id"])
            self.releases = [(run, int(r), None) for r in saved["rounds"]]
            self.declined = [(run, int(r)) for r in saved.get("declined", [])]

    @property
    def active(self) -> bool:
        return self.epsilon > 0

    @property
    def rounds(self) -> list[int]:
        """The rounds of the current run that took a release."""
        return [r for run, r, _ in self.releases if run == self.run_id]

    def start(self, run) -> None:
        """Checks the run (a RunConfig) before anything is trained: UnaccountedRun unless this client adds
        the noise itself. The ledger goes on from where it stands, whatever the run id."""
        if not self.active:
            return
        if not (run.secure_aggregation and run.noise_multiplier > 0 and run.clip_norm > 0):
            raise UnaccountedRun(run.run_id, self.epsilon)
        self.run_id, self.noise_multiplier = run.run_id, float(run.noise_multiplier)
        unknown = [(r, n) for r, n, z in self.releases if z is None]
        if unknown:
            if any(r != run.run_id for r, _ in unknown):
                log.warning("the privacy ledger's older releases did not record their noise multiplier; they count "
                            "at this run's", extra=log_fields(releases=len(unknown),
                                                              noise_multiplier=run.noise_multiplier))
            self.releases = [(r, n, self.noise_multiplier if z is None else z) for r, n, z in self.releases]
            self._save()

    def rho(self) -> float:
        """The zCDP rho of every release in the ledger, each at its own noise multiplier."""
        return sum(accounting.zcdp_rho(z) for _, _, z in self.releases if z is not None)

    def spent(self, more_rho: float = 0.0) -> float:
        """The epsilon (at delta) of the ledger's releases, plus `more_rho`."""
        total = self.rho() + more_rho
        return accounting.epsilon(total, self.delta) if total > 0 else 0.0

    def take(self, round_: int) -> str | None:
        """None where the client may upload to `round_` of the current run (the release is booked now,
        before the upload; a round booked already costs nothing more); else why it declines."""
        if not self.active or any(run == self.run_id and r == round_ for run, r, _ in self.releases):
            return None
        after = self.spent(accounting.zcdp_rho(self.noise_multiplier))
        if after > self.epsilon:
            if (self.run_id, round_) not in self.declined:
                self.declined.append((self.run_id, round_))
                self._save()
            runs = len({run for run, _, _ in self.releases})
            return (f"round {round_} would bring epsilon to {after:.3g} (delta {self.delta:g}) over the budget of "
                    f"{self.epsilon:g}; {len(self.releases)} release(s) taken over {runs} run(s), epsilon "
                    f"{self.spent():.3g} (the organisation resets it with --reset-privacy-ledger)")
        self.releases.append((self.run_id, round_, self.noise_multiplier))
        self._save()
        return None

    def metrics(self) -> dict[str, float]:
        if not self.active:
            return {}
        return {"privacy_epsilon_spent": self.spent(), "privacy_epsilon_limit": self.epsilon,
                "rounds_declined": float(len(self.declined))}

    def _save(self) -> None:
        atomic_write(self.path, json.dumps({"version": FORMAT, "releases": self.releases, "declined": self.declined,
                                            "epsilon": self.epsilon, "delta": self.delta,
                                            "saved_unix": time.time()}).encode())


def reset_ledger(path: pathlib.Path) -> pathlib.Path | None:
    """The organisation's reset (--reset-privacy-ledger): moves the ledger aside, beside it as
    privacy.reset-<UTC time>.json (never deleted), so that the next start spends from zero. The path
    it was moved to; None where there was no ledger."""
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = path.with_name(f"{path.stem}.reset-{stamp}{path.suffix}"), 1
    while target.exists():
        target, n = path.with_name(f"{path.stem}.reset-{stamp}-{n}{path.suffix}"), n + 1
    os.replace(path, target)
    fsync_dir(path.parent)
    log.warning("privacy ledger reset by the organisation", extra=log_fields(kept_as=str(target)))
    return target
