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


def _small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_auto_precision_follows_the_measured_speed_not_the_cpu_flag(monkeypatch, caplog):
    import torch

    from services.client_agent.model import loading as mdl

    cpu = torch.device("cpu")
    monkeypatch.setattr(mdl, "cpu_has_native_bf16", lambda: True)  # the flag is there either way
    slow_bf16 = {"fp32": 100e9, "bf16": 50e9}  # an AVX512-BF16 Xeon without AMX: half the rate
    fast_bf16 = {"fp32": 100e9, "bf16": 400e9}
    with caplog.at_level("INFO", logger="fedse.client.model"):
        assert mdl.pick_precision("auto", _small_llama(), cpu, measure=slow_bf16.get) == "fp32"
    assert mdl.pick_precision("auto", _small_llama(), cpu, measure=fast_bf16.get) == "bf16"
    record = next(r.fields for r in caplog.records if r.getMessage() == "precision measured")
    assert (record["fp32_gflops"], record["bf16_gflops"], record["precision"]) == (100.0, 50.0, "fp32")
    monkeypatch.setattr(mdl, "cpu_has_native_bf16", lambda: False)  # without it, bf16 is not even measured
    assert mdl.pick_precision("auto", _small_llama(), cpu, measure=fast_bf16.get) == "fp32"
    assert mdl.pick_precision("bf16", _small_llama(), cpu, measure=slow_bf16.get) == "bf16"  # pinned


def test_the_timer_decides_and_a_real_short_measurement_of_the_tiny_model_picks_one(monkeypatch, caplog):
    import time

    import torch

    from fedse.model.tinymodel import build_tiny_model
    from services.client_agent.model import loading as mdl

    shapes = mdl.linear_shapes(_small_llama())
    assert shapes and all(count >= 1 for count in shapes.values())
    # A clock on which every bf16 run takes 2 ms and every fp32 run 1 ms: bf16 measures at half the rate.

    def clock(step):
        now = [0.0]

        def timer():
            now[0] += step
            return now[0]
        return timer

    rates = {p: mdl.time_linears(shapes, p, torch.device("cpu"), tokens=16, seconds=0.01, timer=clock(step))
             for p, step in (("fp32", 0.001), ("bf16", 0.002))}
    assert rates["bf16"] == pytest.approx(rates["fp32"] / 2)
    model = build_tiny_model(seed=0)[0]
    mdl._FASTER.clear()
    with caplog.at_level("INFO", logger="fedse.client.model"):
        t0 = time.perf_counter()
        chosen = mdl.faster_precision(model, torch.device("cpu"))
        assert time.perf_counter() - t0 < 30  # bounded (a generous bound: shared cores)
    assert chosen in ("fp32", "bf16")
    record = next(r.fields for r in caplog.records if r.getMessage() == "precision measured")
    assert record["fp32_gflops"] > 0 and record["bf16_gflops"] > 0 and record["precision"] == chosen
    assert mdl.faster_precision(model, torch.device("cpu")) == chosen  # kept for the process: not measured again
    assert sum(r.getMessage() == "precision measured" for r in caplog.records) == 1
