"""The applications built on fedse and the services: the `fedse` command (cli), a whole federation
run locally (launcher) and the paper's comparison (experiment)."""
