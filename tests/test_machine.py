"""What a process learns about its machine: its cores (affinity, cgroup quota) and native bf16."""

import os
import subprocess
import sys

import pytest

from fedse.machine import available_cores, gpu_state


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores to pin a process to one")
def test_available_cores_follows_the_process_affinity():
    assert available_cores() == len(os.sched_getaffinity(0))
    one = next(iter(os.sched_getaffinity(0)))
    out = subprocess.run([sys.executable, "-c", "from fedse.machine import available_cores; print(available_cores())"],
                         capture_output=True, text=True, check=True, preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert out.stdout.strip() == "1"


def test_gpu_state_is_empty_without_nvidias_library_or_a_driver():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU answers here")
    # Whether or not the gpu extra's bindings are installed, no driver answers on this machine.
    assert gpu_state() == {}
