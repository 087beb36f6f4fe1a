"""python -m services.aggregator: the Fed-SE aggregator (`--help` lists the flags, each also a FEDSE_* variable)."""

import sys

from .server import main

sys.exit(main())
