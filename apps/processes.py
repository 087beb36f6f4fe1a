"""The service processes of a local run: started with their logs in files, stopped together."""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import signal
import subprocess
import threading
import sys
import time
from typing import IO

SERVICE_START_S = 120.0
# Seconds a stopping process gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 10.0
# The launcher's pid, set in its services' environment: each dies with it (die_with_parent).
PARENT_ENV = "FEDSE_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Where the launcher started this process (PARENT_ENV), has Linux SIGKILL it when the launcher
    dies. The services run in their own sessions (a Ctrl-C reaches the launcher alone, which stops
    them in order), so a SIGKILL to the launcher's process group (a batch system's time limit) would
    otherwise leave them running, still writing to the run's state when the run is resumed. Set here
    rather than in a preexec_fn, which is unsafe in the launcher's threaded process."""
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(parent):  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


class Proc:
    """A service process whose stdout (JSON logs) goes to a file."""

    def __init__(self, name: str, argv: list[str], log_dir: pathlib.Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Linux signals a child when the *thread* that started it ends: only one started by the main
        # thread, which lives as long as the launcher, is tied to it.
        if threading.current_thread() is threading.main_thread():
            env[PARENT_ENV] = str(os.getpid())
        self.popen = subprocess.Popen([sys.executable, "-m", *argv], stdout=self._log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True)

    def port(self, timeout: float = SERVICE_START_S) -> int:
        """The gRPC port the service logged once serving (services bind port 0 here)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and "port" in entry:
                    return int(entry["port"])
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}; see {self.log_path}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not start within {timeout:.0f}s; see {self.log_path}")

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        stop_all([self], timeout)


def stop_all(procs: list[Proc], timeout: float = STOP_GRACE_S) -> None:
    """SIGTERM to every process at once, then at most `timeout` seconds for all of them together
    before SIGKILL: stopping a federation takes one grace period, not one per process."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
        p._log.close()


def exit_reason(returncode: int) -> str:
    """How a process ended, from its return code (negative: the signal that killed it)."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
