"""Fixtures several test modules share, and how `make test` runs the suite on several workers
(pytest-xdist, `-n`): each worker holds its own share of the machine's cores, and the files that
take longest start first."""

from __future__ import annotations

import os
import pathlib

import pytest

# The files that take longest, in that order, run before the rest: with workers taking whole files
# (--dist loadfile) in collection order, a long file started last would run alone at the end.
LONGEST_FIRST = ("test_image.py", "test_docs.py", "test_experiment.py", "test_client_host.py", "test_real_model.py",
                 "test_resilience.py", "test_methods.py", "test_pretrained.py", "test_end_to_end.py", "test_manifests_run.py",
                 "test_learning.py", "test_secure_processes.py", "test_client_failure.py", "test_secure_lying.py",
                 "test_reach.py", "test_plugins.py", "test_mixed_ranks.py")


def pytest_configure(config: pytest.Config) -> None:
    """On a pytest-xdist worker: keep to this worker's share of the cores (worker i of n takes every
    n-th core from the i-th), so that the processes it starts size their threads to that share
    (fedse.machine.available_cores reads the affinity) instead of all of them contending for every
    core (torch's threads wait on each other at every parallel step: measured, a SmolLM2 test took
    135 s beside another worker against 28 s alone)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return
    share = cores[int(worker[2:]) % count::count]
    os.sched_setaffinity(0, share)
    import torch

    torch.set_num_threads(len(share))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A checked conversion of SmolLM2-135M-Instruct (134.5 M parameters, fp32), made once per test
    session by the same code as `fedse model smollm2` (about 25 s). FEDSE_SMOLLM2_DIR names a
    directory to keep it in between sessions: one already holding a checked conversion (e.g.
    models/smollm2-135m-instruct from `make model`) is used as it is, else it is converted there. The
    path is absolute, so it means the same in subprocesses and after a chdir. The workers of one
    pytest-xdist run share one conversion (under a lock: the first converts, the others wait)."""
    from filelock import FileLock

    from fedse.model import pretrained

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's directory, above each worker's own
    directory = pathlib.Path(os.environ.get("FEDSE_SMOLLM2_DIR") or shared / "models" / "smollm2-135m-instruct")
    directory = directory.absolute()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory) + ".lock"):
        return pretrained.prepare("smollm2", directory).directory
