"""What a process learns about its machine: its cores (affinity, cgroup quota) and native bf16."""

import os
import subprocess
import sys

import pytest

from fedse.machine import available_cores, gpu_state


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux to pin a process to one core")
def test_available_cores_follows_the_process_affinity():
    # Under `make test` a worker holds its share of the cores (tests/conftest.py): fewer than the machine's.
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


def test_a_onednn_cap_below_bf16_means_no_native_bf16(monkeypatch):
    from fedse import machine

    monkeypatch.setattr(machine, "cpu", lambda: ("a CPU", {"avx2", "avx512f", "avx512_bf16"}))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert machine.cpu_has_native_bf16()
    for cap, native in (("AVX2", False), ("avx512_core", False), ("AVX512_CORE_BF16", True),
                        ("AVX512_CORE_AMX", True), ("DEFAULT", True)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert machine.cpu_has_native_bf16() is native, cap
        assert f"capped to {cap.upper()}" in machine.describe_cpu()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    assert not machine.cpu_has_native_bf16()
    monkeypatch.setattr(machine, "cpu", lambda: ("a CPU", {"avx2"}))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    assert not machine.cpu_has_native_bf16()
