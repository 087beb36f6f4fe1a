"""The clients' metrics reports: checked, recorded once for each (client, round) (a client that repeats
a report after a crash does not count twice), and noted on the member, whose record selectors read."""

from __future__ import annotations

import logging
import math

from fedse.transport.inputs import bounded, shown
from fedse.transport.serving import log_fields

from .state import RunState
from .store import Store
from .tracking import Tracker

log = logging.getLogger("aggregator.rounds")

MAX_METRICS = 256  # named values in one metrics report
MAX_METRIC_NAME_BYTES = 256  # a metric name in UTF-8 (every client's metrics are in GetRunStatus's reply)


def check_report(values: dict[str, float], round_: int, num_rounds: int) -> None:
    """Raises ValueError, saying what to send, unless `values` are finite values of at most MAX_METRICS
    named metrics, for one of the run's rounds (0..num_rounds; num_rounds is the final adapter's)."""
    if len(values) > MAX_METRICS:
        raise ValueError(f"{len(values)} metrics in one report, more than the limit of {MAX_METRICS}")
    for name, value in values.items():
        size = len(bounded("metric name", name).encode())
        if size > MAX_METRIC_NAME_BYTES:
            raise ValueError(f"metric name {shown(name)} is {size} bytes in UTF-8: give at most "
                             f"{MAX_METRIC_NAME_BYTES}")
        if not math.isfinite(value):
            raise ValueError(f"metric {shown(name)} is {value}: report finite values only (leave out a metric "
                             "that has no value)")
    if not 0 <= round_ <= num_rounds:
        raise ValueError(f"metrics for round {round_}: this run's rounds are 0..{num_rounds} "
                         f"(round {num_rounds} evaluates the final adapter)")


class MetricsReports:
    """Every (client, round) reported, on the round keeper's run, under its lock."""

    def __init__(self, store: Store, run: RunState, tracker: Tracker | None = None):
        self.store, self.run, self.tracker = store, run, tracker
        self._reported: set[tuple[str, int]] = set()

    def load(self) -> None:
        """Notes the reports the store holds (a restart)."""
        for cid, r, m in self.store.metrics_reports():
            self._note_locked(cid, r, m)

    def record_locked(self, client_id: str, round_: int, values: dict[str, float]) -> bool:
        """Records a checked report of a joined client for an opened round; False where it was recorded
        already (acknowledged, not recorded again)."""
        if (client_id, round_) in self._reported:
            log.info("repeated metrics report acknowledged, not recorded again",
                     extra=log_fields(client_id=client_id, round=round_))
            return False
        self.store.append_metrics(client_id, round_, values)
        self._note_locked(client_id, round_, values)
        if self.tracker is not None:
            self.tracker.report(client_id, round_, values, len(self.run.members))
        return True

    def _note_locked(self, client_id: str, round_: int, values: dict[str, float]) -> None:
        self._reported.add((client_id, round_))
        m = self.run.members.get(client_id)
        if m is not None and round_ >= m.metrics_round:
            # The gain is measured from the latest report of a round it took part in (see
            # RoundSelector.history_locked).
            if round_ > m.metrics_round and "test_success" in m.metrics and m.metrics_round in m.rounds_uploaded:
                m.previous_success = m.metrics["test_success"]
            m.metrics_round, m.metrics = round_, dict(values)
