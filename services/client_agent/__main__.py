"""python -m services.client_agent: one organisation's Fed-SE client agent (`--help` lists the flags, each also a FEDSE_* variable)."""

import sys

from services.client_agent.server import main

sys.exit(main())
