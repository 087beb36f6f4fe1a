#!/bin/sh
# Installs Debian's prometheus package (the Prometheus server and promtool) unless both are
# already on PATH. Idempotent and quiet: prints nothing when there is nothing to do.
# The tests use promtool (`promtool check metrics` on every service's /metrics) and a real
# Prometheus server (tests/test_observability.py). Debian/Ubuntu only; needs root or sudo.
set -eu

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-prometheus.sh: no apt-get here; install Prometheus (prometheus and promtool) by hand" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-prometheus.sh: run as root (or install sudo) to install Debian's prometheus package" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
install() {
    $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
}
# A fresh machine may have no package lists yet: update only when the install cannot proceed.
if ! install 2>/dev/null; then
    $SUDO apt-get update -qq >/dev/null
    install
fi

# The package's own service (if the machine runs an init system) is not ours: the tests start
# their own server on a free port with a temporary data directory.
command -v promtool >/dev/null 2>&1 || { echo "install-prometheus.sh: promtool still missing" >&2; exit 1; }
command -v prometheus >/dev/null 2>&1 || { echo "install-prometheus.sh: prometheus still missing" >&2; exit 1; }
