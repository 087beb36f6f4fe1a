"""python -m services.aggregator: the Fed-SE aggregator."""

from __future__ import annotations

import logging
import sys

from fedse.config import parse_or_exit
from fedse.serving import log_fields, setup_logging, start_metrics

from .server import AggregatorConfig, create_server


def main(argv: list[str] | None = None) -> int:
    config = parse_or_exit(AggregatorConfig, argv)
    setup_logging("aggregator", config.log_level)
    log = logging.getLogger("aggregator")
    metrics_port = start_metrics(config.metrics_port)
    agg, port = create_server(config)
    agg.start()
    log.info("serving", extra=log_fields(port=port, metrics_port=metrics_port, run_id=config.run_id,
                                         num_rounds=config.num_rounds, min_clients=config.min_clients,
                                         strategy=config.strategy))
    agg.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
