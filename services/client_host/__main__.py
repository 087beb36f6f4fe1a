"""python -m services.client_host: many client agents in one process over one base model (`--help` lists the flags, each also a FEDSE_* variable)."""

import sys

from services.client_host.server import main

sys.exit(main())
