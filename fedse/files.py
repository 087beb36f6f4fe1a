"""Files that survive a crash: atomic replacement and directory fsync, for everything a service
persists (the aggregator's run state and uploads, the client's progress and buffer)."""

from __future__ import annotations

import contextlib
import os
import pathlib


def atomic_write(path: pathlib.Path, data: bytes, mode: int | None = None) -> None:
    """Writes a file so that a crash leaves either the old or the new content, never a torn one.
    With `mode` (e.g. 0o600 for a private key) the file has exactly that mode, whatever the umask,
    and is never readable more widely while it is written."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if mode is not None:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a leftover of a crash may have wider permissions
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is not None else 0o666)
    with os.fdopen(fd, "wb") as fh:
        if mode is not None:
            os.fchmod(fh.fileno(), mode)
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

