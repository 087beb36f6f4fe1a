#!/bin/sh
# What a new user does with the package: a fresh virtualenv, `pip install .`, then `fedse --version` and
# a one-round federation, in a scratch directory. `make package-check` runs it (about 1.5 minutes on
# 2 cores: the install is most of it).
set -eu
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m venv "$WORK/venv"
echo "installing fedse into a fresh virtualenv ($WORK/venv) ..."
"$WORK/venv/bin/pip" install --quiet "$REPO"
cd "$WORK"
"$WORK/venv/bin/fedse" --version
"$WORK/venv/bin/fedse" run --rounds 1 --envs maze
echo "package check: ok"
