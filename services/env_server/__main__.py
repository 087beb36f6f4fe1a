"""`python -m services.env_server --help` lists the flags (each also an FEDSE_* variable)."""

from .server import main

main()
