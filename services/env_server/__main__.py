"""python -m services.env_server: the environments' gRPC server (`--help` lists the flags, each also a FEDSE_* variable)."""

import sys

from .server import main

sys.exit(main())
