#!/bin/sh
# A base image for docker/Dockerfile made from Debian's packages alone, for machines that cannot
# pull python:3.11-slim-bookworm from Docker Hub: bookworm's minbase with python3 (3.11),
# python3-venv and ca-certificates, from bookworm, bookworm-updates and bookworm-security, built by
# mmdebstrap and imported as BASE_IMAGE (default localhost/fedse-base:bookworm).
#
#   scripts/debian-base-image.sh                 # then: make images PYTHON_IMAGE=localhost/fedse-base:bookworm
#
# Idempotent: does nothing when the image is already there (REBUILD=1 makes it again, e.g. for
# newer security updates). Needs mmdebstrap and root. Settings (environment): BASE_IMAGE, BUILDER
# (docker | podman | auto, as in scripts/build-image.sh), DEBIAN_MIRROR (default
# http://deb.debian.org/debian), DEBIAN_SECURITY_MIRROR (default http://deb.debian.org/debian-security).
set -eu

BASE_IMAGE=${BASE_IMAGE:-localhost/fedse-base:bookworm}
BUILDER=${BUILDER:-auto}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

if [ "$BUILDER" = auto ]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then BUILDER=docker; else BUILDER=podman; fi
fi
command -v "$BUILDER" >/dev/null 2>&1 || { echo "$0: $BUILDER is not installed" >&2; exit 1; }

OLD_ID=$("$BUILDER" image inspect --format '{{.Id}}' "$BASE_IMAGE" 2>/dev/null || true)
if [ "${REBUILD:-0}" != 1 ] && [ -n "$OLD_ID" ]; then
    exit 0
fi
if ! command -v mmdebstrap >/dev/null 2>&1; then
    echo "$0: mmdebstrap is not installed (Debian: apt-get install mmdebstrap)" >&2
    exit 1
fi

# The chroot is unpacked in memory where /dev/shm allows (dpkg is much faster without fsyncs).
TMP=${TMPDIR:-/tmp}
if [ -d /dev/shm ] && [ -w /dev/shm ]; then TMP=/dev/shm; fi
WORK=$(mktemp -d "$TMP/fedse-base.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# force-unsafe-io only while building; mmdebstrap would otherwise leave it in the image's dpkg config.
TMPDIR=$WORK mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    --dpkgopt=force-unsafe-io --customize-hook='rm -f "$1/etc/dpkg/dpkg.cfg.d/99mmdebstrap"' \
    --format=tar bookworm "$WORK/base.tar" \
    "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" "deb $SECURITY bookworm-security main"
QUIET=""
[ "$BUILDER" = podman ] && QUIET=--quiet  # docker import has no such flag (and shows no progress)
"$BUILDER" import $QUIET --change 'CMD ["python3"]' "$WORK/base.tar" "$BASE_IMAGE" >/dev/null
# A rebuild leaves the previous image untagged: removed unless something still uses it.
if [ -n "$OLD_ID" ] && [ "$OLD_ID" != "$("$BUILDER" image inspect --format '{{.Id}}' "$BASE_IMAGE")" ]; then
    "$BUILDER" rmi "$OLD_ID" >/dev/null 2>&1 || true
fi
echo "$0: built $BASE_IMAGE from Debian bookworm's packages" >&2
