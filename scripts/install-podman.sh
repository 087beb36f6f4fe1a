#!/bin/sh
# Installs what tests/test_image.py builds and runs the container image with, from Debian's
# packages, unless it is already there: podman (with its CNI bridge networking), runc (crun, podman's
# usual runtime, refuses kernels whose cgroups mix v1 and v2) and mmdebstrap (the base image from
# Debian's packages, scripts/debian-base-image.sh). Idempotent and quiet: prints nothing when there
# is nothing to do.
#
# Where it cannot install (no apt-get, not root and no sudo) it says so and exits 0: the image test
# then skips, naming what is missing. A failed install is an error.
set -eu

if command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && command -v mmdebstrap >/dev/null 2>&1; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-podman.sh: no apt-get here; tests/test_image.py skips without podman, runc and mmdebstrap" >&2
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install-podman.sh: not root (and no password-less sudo): tests/test_image.py skips" >&2
        exit 0
    fi
fi

export DEBIAN_FRONTEND=noninteractive
install() {
    $SUDO apt-get install -y -qq --no-install-recommends podman runc mmdebstrap >/dev/null
}
# A fresh machine may have no package lists yet: update only when the install cannot proceed.
if ! install 2>/dev/null; then
    $SUDO apt-get update -qq >/dev/null
    install
fi

for tool in podman runc mmdebstrap; do
    command -v "$tool" >/dev/null 2>&1 || { echo "install-podman.sh: $tool still missing" >&2; exit 1; }
done
