#!/bin/sh
# Builds docker/Dockerfile into NAME:TAG, with Docker where a daemon answers and with podman
# otherwise. `make images` calls it once for the CPU image and once for the GPU image.
#
#   scripts/build-image.sh fedse:0.1.0 cpu
#   scripts/build-image.sh fedse-gpu:0.1.0 gpu
#
# What differs between machines is set here, never in the Dockerfile (environment variables; the
# Makefile passes its variables of the same names):
#   BUILDER          docker | podman | auto (default: docker if `docker info` answers, else podman)
#   PYTHON_IMAGE     the base image of both stages; empty: the Dockerfile's python:3.11-slim-bookworm.
#                    scripts/debian-base-image.sh builds one from Debian's packages alone.
#   TORCH_INDEX_URL  where torch and its dependencies come from; empty: the Dockerfile's default
#                    (PyTorch's CPU index) for cpu, PyPI (torch's CUDA build) for gpu. `local`: the
#                    CPU wheel this machine's pip finds (torch==<requirements.txt's pin>+cpu, e.g. in
#                    its find-links folder) and its dependencies, served for the build's duration
#                    by an index on 127.0.0.1 (the build then uses the host's network); exit
#                    status 3 where this machine's pip has no such wheel.
#   CA_BUNDLE        a CA bundle pip inside the build trusts (where a proxy re-signs TLS): passed as
#                    the build secret ca.crt, with a pip.conf naming it as the secret pip.conf.
#   PIP_CONF         a pip.conf of your own for the build (secret pip.conf; a mirror, say). With
#                    CA_BUNDLE too, it should say `cert = /run/secrets/ca.crt`.
#   RUNTIME          podman's OCI runtime, e.g. runc (crun refuses cgroups in hybrid v1/v2 mode).
#   ULIMITS          resource limits for the build's containers, space-separated, e.g.
#                    "nofile=20000:20000 nproc=32768:32768" (where limits cannot be raised).
#   BUILD_FLAGS      anything else for `docker build` / `podman build` (e.g. --no-cache).
# Secrets are mounted only while pip runs and are never part of a layer.
set -eu

usage() { echo "usage: $0 NAME:TAG [cpu|gpu]" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
TAG=$1
VARIANT=${2:-cpu}
case $VARIANT in cpu|gpu) ;; *) usage ;; esac

cd "$(dirname "$0")/.."
BUILDER=${BUILDER:-auto}
PYTHON_IMAGE=${PYTHON_IMAGE:-}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
CA_BUNDLE=${CA_BUNDLE:-}
PIP_CONF=${PIP_CONF:-}
RUNTIME=${RUNTIME:-}
ULIMITS=${ULIMITS:-}
BUILD_FLAGS=${BUILD_FLAGS:-}

if [ "$BUILDER" = auto ]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        BUILDER=docker
    elif command -v podman >/dev/null 2>&1; then
        BUILDER=podman
    else
        echo "$0: no Docker daemon answers ('docker info' failed) and podman is not installed" \
             "(scripts/install-podman.sh installs Debian's)" >&2
        exit 1
    fi
fi
case $BUILDER in
    docker) set -- docker build ;;
    podman) if [ -n "$RUNTIME" ]; then set -- podman --runtime "$RUNTIME" build; else set -- podman build; fi ;;
    *) echo "$0: BUILDER must be docker, podman or auto, not '$BUILDER'" >&2; exit 2 ;;
esac
if [ "$BUILDER" = docker ] && [ -n "$RUNTIME" ]; then
    echo "$0: RUNTIME is podman's; Docker's daemon picks its own runtime" >&2
    exit 2
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/fedse-image.XXXXXX")
INDEX_PID=""
cleanup() {
    if [ -n "$INDEX_PID" ]; then kill "$INDEX_PID" 2>/dev/null || true; wait "$INDEX_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

set -- "$@" -f docker/Dockerfile -t "$TAG" --label "org.opencontainers.image.variant=$VARIANT"
# The image's version label: the package's (fedse/__init__.py, the one place it is written).
VERSION=$(sed -n 's/^__version__ = "\(.*\)".*/\1/p' fedse/__init__.py)
set -- "$@" --build-arg "VERSION=$VERSION"
[ -n "$PYTHON_IMAGE" ] && set -- "$@" --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE"
for u in $ULIMITS; do set -- "$@" --ulimit "$u"; done

if [ "$TORCH_INDEX_URL" = local ]; then
    if [ "$VARIANT" != cpu ]; then
        echo "$0: TORCH_INDEX_URL=local serves the CPU wheel; the GPU image wants PyPI's" >&2
        exit 2
    fi
    TORCH_PIN=$(grep -E '^torch==' requirements.txt)
    PY=$(command -v python3 || command -v python)
    # The CPU wheel alone first (no CUDA build of several GB by mistake), then what it depends on.
    if ! "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
            --dest "$WORK/wheels" "$TORCH_PIN+cpu" >"$WORK/pip.log" 2>&1; then
        cat "$WORK/pip.log" >&2
        echo "$0: TORCH_INDEX_URL=local: this machine's pip finds no $TORCH_PIN+cpu wheel" >&2
        exit 3
    fi
    "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
        --dest "$WORK/wheels" "$WORK"/wheels/torch-*.whl >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log" >&2; exit 1; }
    # A PEP 503 simple index: one folder per (normalised) project name holding its files.
    for whl in "$WORK"/wheels/*.whl; do
        project=$(basename "$whl" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
        mkdir -p "$WORK/simple/$project"
        mv "$whl" "$WORK/simple/$project/"
    done
    # The same port each time where it is free, so the URL (a build argument) keeps the build cache.
    PORT=$("$PY" -c '
import socket
s = socket.socket()
try:
    s.bind(("127.0.0.1", 3141))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
    "$PY" -m http.server --bind 127.0.0.1 --directory "$WORK/simple" "$PORT" >"$WORK/index.log" 2>&1 &
    INDEX_PID=$!
    i=0
    until "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/torch/', timeout=1)" 2>/dev/null; do
        i=$((i + 1))
        [ $i -lt 50 ] || { cat "$WORK/index.log" >&2; echo "$0: the local index did not start" >&2; exit 1; }
        sleep 0.1
    done
    TORCH_INDEX_URL=http://127.0.0.1:$PORT/
    set -- "$@" --network host
fi
if [ -n "$TORCH_INDEX_URL" ]; then
    set -- "$@" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"
elif [ "$VARIANT" = gpu ]; then
    set -- "$@" --build-arg "TORCH_INDEX_URL=https://pypi.org/simple"
fi

if [ -n "$PIP_CONF" ]; then
    set -- "$@" --secret "id=pip.conf,src=$PIP_CONF"
elif [ -n "$CA_BUNDLE" ]; then
    printf '[global]\ncert = /run/secrets/ca.crt\n' >"$WORK/pip.conf"
    set -- "$@" --secret "id=pip.conf,src=$WORK/pip.conf"
fi
[ -n "$CA_BUNDLE" ] && set -- "$@" --secret "id=ca.crt,src=$CA_BUNDLE"

# shellcheck disable=SC2086  # BUILD_FLAGS is a list of words
set -- "$@" $BUILD_FLAGS .
echo "+ $*" >&2
if [ "$BUILDER" = docker ]; then
    DOCKER_BUILDKIT=1 "$@"
else
    "$@"
fi
