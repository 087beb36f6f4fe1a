"""A client agent made FACTOR times slower, for benchmarks only: after it trains a round, it waits
(FACTOR - 1) times as long as the round took so far, before it uploads. Started as the launcher starts
`fedse client`, with the factor first:

    python bench/slow_client.py 3 --client-id org-maze --env maze ...
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.cli import main  # noqa: E402
from services.client_agent.agent import ClientAgent  # noqa: E402


def slowed(factor: float) -> None:
    """Patches ClientAgent: each round's work up to its upload takes `factor` times as long."""
    play_round, train = ClientAgent.play_round, ClientAgent.train

    def timed_round(self, round_, done, final, tasks):
        self._bench_started = time.monotonic()
        return play_round(self, round_, done, final, tasks)

    def slow_train(self, round_):
        out = train(self, round_)
        time.sleep((factor - 1) * (time.monotonic() - getattr(self, "_bench_started", time.monotonic())))
        return out

    ClientAgent.play_round, ClientAgent.train = timed_round, slow_train


if __name__ == "__main__":
    slowed(float(sys.argv[1]))
    sys.exit(main(["client", *sys.argv[2:]]))
