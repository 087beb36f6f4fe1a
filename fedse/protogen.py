"""Generates fedse/v1/*_pb2.py, *_pb2_grpc.py and *.pyi from proto/ with the pinned grpcio-tools."""

from __future__ import annotations

import argparse
import pathlib
import sys

from grpc_tools import protoc
import grpc_tools

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    """Writes the generated modules under out_dir, mirroring proto/ (proto/fedse/v1 -> fedse/v1)."""
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=REPO)
    ns = parser.parse_args(argv)
    generate(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
