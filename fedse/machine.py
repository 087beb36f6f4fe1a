"""What this machine offers a process: its CPU cores, whether the CPU computes bfloat16 natively, its
memory, and giving freed memory back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import pathlib


def available_cores() -> int:
    """The CPU cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota (a
    container's CPU limit), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = pathlib.Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def cpu() -> tuple[str, set[str]]:
    """The CPU's model name and flags, from /proc/cpuinfo ("", {} where it cannot be read)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("model name", ""), set(fields.get("flags", "").split())


def describe_cpu() -> str:
    """The CPU in one line, for the figures a benchmark prints: model, cores, vector units."""
    import os
    import platform

    model, flags = cpu()
    cap = isa_cap()
    return (f"{model or platform.machine()}, {os.cpu_count()} cores, "
            f"{'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'}"
            f"{' (bf16)' if 'avx512_bf16' in flags else ''}{', AMX' if 'amx_tile' in flags else ''}"
            f"{f', capped to {cap}' if cap else ''}")


# oneDNN's instruction-set caps (ONEDNN_MAX_CPU_ISA) under which it still computes bfloat16 natively.
_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10_1_512", "AVX10_2", "ALL",
              "DEFAULT")


def isa_cap() -> str:
    """The instruction set oneDNN (torch's bfloat16 matmuls) is capped to by ONEDNN_MAX_CPU_ISA (or
    its older name DNNL_MAX_CPU_ISA), upper case; "" where none is set."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bfloat16 natively (AMX or AVX512-BF16), where bf16 matmuls run
    several times faster than fp32, and oneDNN is not capped below it (isa_cap): capped to AVX2,
    a bf16 matmul falls back to reference code (measured: 0.9 against 430 GFLOP/s)."""
    flags = cpu()[1]
    cap = isa_cap()
    if cap and not cap.startswith(_BF16_ISAS):
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def release_free_memory() -> None:
    """Asks glibc to return freed heap memory to the system (malloc_trim). After a phase that
    allocated many tensors of many sizes (KV caches, training activations), freed memory otherwise
    stays in the process and counts against its memory limit; elsewhere this does nothing."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_bytes(path: str, field: str) -> int:
    """A "Field: N kB" line of a /proc file, in bytes; OSError where the file or the field is missing."""
    for line in pathlib.Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{path} has no {field}")


def resident_bytes(device=None) -> int:
    """What this process holds now: CUDA's allocated bytes on a CUDA device, else its resident set (RSS)."""
    if device is not None and getattr(device, "type", "") == "cuda":
        import torch

        return int(torch.cuda.memory_allocated(device))
    try:
        return _proc_bytes("/proc/self/status", "VmRSS")
    except (OSError, ValueError):
        return 0


def reset_peak_resident() -> bool:
    """Resets this process's peak resident set (VmHWM) to what it holds now, so that peak_resident_bytes
    then tells the peak of what runs next (Linux 4.0+: "5" written to /proc/self/clear_refs); False
    where it cannot be reset (the peak is then the process's lifetime peak)."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_resident_bytes() -> int:
    """The most this process has held resident (VmHWM) since it started or reset_peak_resident; 0 where
    it cannot be read."""
    try:
        return _proc_bytes("/proc/self/status", "VmHWM")
    except (OSError, ValueError):
        return 0


def available_memory_bytes(device=None) -> int:
    """The most this process may hold: on a CUDA device what is free there plus what this process
    holds (other processes sharing the card keep theirs); on a CPU its cgroup's memory limit (a
    container's) where one is set, else what the machine has available plus what the process holds."""
    if device is not None and getattr(device, "type", "") == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device))
    try:
        text = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text != "max":
            return int(text)
    except (OSError, ValueError):
        pass
    try:
        return _proc_bytes("/proc/meminfo", "MemAvailable") + resident_bytes()
    except (OSError, ValueError):
        return 0


_PEAKS: dict[tuple[str, str, int], float] = {}


def matmul_peak(dtype: str = "fp32", device=None, seconds: float = 0.2, sizes: tuple[int, ...] | None = None,
                again: bool = False) -> float:
    """This machine's matmul rate in FLOP/s: square matrix products of `dtype` ("fp32" or "bf16") on
    `device` (default the CPU), with the process's torch threads, each size run for about `seconds`
    after a warm-up, the best size's rate. What model-FLOPs utilisation (MFU) is measured against:
    the rate a model's own matmuls could reach here, not a datasheet's. Remembered per process for
    the default size (1,024 on a CPU, 8,192 on a GPU: a client measures it once, in about half a
    second; `make bench-model` tries more sizes, for longer). `again`: measure the default size anew,
    keeping the better of both (a first measurement taken while other processes held the cores)."""
    import time

    import torch

    dev = torch.device(device or "cpu")
    key = (dtype, str(dev), torch.get_num_threads())
    if sizes is None and key in _PEAKS and not again:
        return _PEAKS[key]
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    best = 0.0
    for n in sizes or ((8192,) if dev.type == "cuda" else (1024,)):
        a = torch.randn(n, n, device=dev).to(torch_dtype)
        b = torch.randn(n, n, device=dev).to(torch_dtype)
        torch.mm(a, b)  # warm-up: kernels chosen, memory touched
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        runs, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            runs += 1
            if runs % 4 == 0 or dev.type != "cuda":
                sync()
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds:
                    break
        best = max(best, 2.0 * n ** 3 * runs / elapsed)
    if sizes is None:
        best = _PEAKS[key] = max(best, _PEAKS.get(key, 0.0))
    return best


def gpu_state(index: int = 0) -> dict[str, float | str]:
    """What a GPU is doing now, from NVIDIA's management library (the `gpu` extra installs its
    bindings, nvidia-ml-py): its name, SM clock and the most it can reach (MHz), power draw (W),
    utilisation (%) and memory in use by every process on it (MB). A benchmark records it beside its
    figures, since a card that is throttled or shared gives lower ones. Empty where the bindings or
    a driver are missing."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(h)
        return {"name": name.decode() if isinstance(name, bytes) else name,
                "sm_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                "max_sm_clock_mhz": float(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "utilisation_pct": float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
                "memory_used_mb": pynvml.nvmlDeviceGetMemoryInfo(h).used / 2 ** 20}
    except pynvml.NVMLError:
        return {}
    finally:
        pynvml.nvmlShutdown()
