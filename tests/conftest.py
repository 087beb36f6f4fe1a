"""Fixtures several test modules share."""

from __future__ import annotations

import os
import pathlib

import pytest


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A checked conversion of SmolLM2-135M-Instruct (134.5 M parameters, fp32), made once per test
    session by the same code as `fedse model smollm2` (about 25 s). FEDSE_SMOLLM2_DIR names a
    directory to keep it in between sessions: one already holding a checked conversion (e.g.
    models/smollm2-135m-instruct from `make model`) is used as it is, else it is converted there. The
    path is absolute, so it means the same in subprocesses and after a chdir."""
    from fedse import pretrained

    directory = os.environ.get("FEDSE_SMOLLM2_DIR") or tmp_path_factory.mktemp("models") / "smollm2-135m-instruct"
    return pretrained.prepare("smollm2", pathlib.Path(directory).absolute()).directory
