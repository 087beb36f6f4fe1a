"""Files that survive a crash: atomic replacement and directory fsync, for everything a service
persists (the aggregator's run state and uploads, the client's progress and buffer)."""

from __future__ import annotations

import os
import pathlib


def atomic_write(path: pathlib.Path, data: bytes) -> None:
    """Writes a file so that a crash leaves either the old or the new content, never a torn one."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: pathlib.Path) -> None:
    """Makes a rename or a new file in `directory` survive a power cut."""
    fd = os.open(str(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

