"""Memory of a client host (`fedse client-host`) against separate client processes: the peak resident
memory of a host whose N members (1, 20, 100 by default) have joined a run and wait for its first
round, and of one plain `fedse client` that has joined and waits (N separate clients hold about N
times that). Real processes: an env server and an aggregator whose round 0 never opens (it waits for
more clients than join), the tiny model or --base-model.

    python bench/client_host.py [--members 1,20,100] [--base-model models/smollm2-135m-instruct] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.processes import Proc, stop_all  # noqa: E402


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MB."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def joined(proc: Proc) -> int:
    """How many members the process's log says joined."""
    return proc.log_path.read_text(errors="replace").count('"msg": "joined"')


def waiting(root: pathlib.Path, service: str, argv: list[str], members: int, base_model: str,
            timeout: float = 600.0) -> float:
    """Starts an env server, an aggregator that never opens round 0 and the service (`argv`); once all
    `members` joined and a few heartbeats passed, the service's peak RSS in MB."""
    logs = root / "logs"
    logs.mkdir(parents=True)
    env = Proc("env_server", ["services.env_server", "--address", "127.0.0.1:0", "--envs", "maze",
                              "--metrics-port", "-1"], logs)
    agg = Proc("aggregator", ["services.aggregator", "--address", "127.0.0.1:0", "--metrics-port", "-1",
                              "--state-dir", str(root / "aggregator"), "--run-id", "r", "--rounds", "1",
                              "--start-clients", str(members + 1)], logs)
    procs = [env, agg]
    try:
        common = ["--env", "maze", "--env-server", f"127.0.0.1:{env.port()}", "--aggregator", f"127.0.0.1:{agg.port()}",
                  "--address", "127.0.0.1:0", "--metrics-port", "-1", "--state-dir", str(root / "clients"),
                  "--expert-demos", "2", "--torch-threads", "1", "--heartbeat-interval-s", "1", "--base-model", base_model]
        proc = Proc(service, [f"services.{service}", *argv, *common], logs)
        procs.append(proc)
        deadline = time.monotonic() + timeout
        while joined(proc) < members:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{service} exited with {proc.popen.returncode}; see {proc.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {joined(proc)} of {members} joined; see {proc.log_path}")
            time.sleep(0.2)
        time.sleep(3.0)  # a few heartbeats while they wait
        return peak_rss_mb(proc.popen.pid)
    finally:
        stop_all(procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="1,20,100", help="member counts of the hosts measured")
    parser.add_argument("--out", default="", help="where the runs' files go (default: a temporary directory)")
    parser.add_argument("--base-model", default="fedse-tiny", help="'fedse-tiny' or a model directory "
                                                                   "(models/smollm2-135m-instruct)")
    args = parser.parse_args()
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="client-host-bench-"))
    cpu = next((line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"machine: {cpu}, {os.cpu_count()} cores; {args.base_model}, maze; files under {out}")
    one = waiting(out / "client", "client_agent", ["--client-id", "org-0"], 1, args.base_model)
    print(f"one plain client process:  peak RSS {one:8.1f} MB")
    first: tuple[int, float] | None = None
    for n in sorted(int(x) for x in args.members.split(",")):
        t0 = time.monotonic()
        rss = waiting(out / f"host-{n}", "client_host", ["--client-id", "org", "--members", str(n)], n, args.base_model)
        # What each member beyond the smallest host's adds (the model and the runtime are paid once).
        extra = f"; {(rss - first[1]) / (n - first[0]):.2f} MB a member more" if first and n > first[0] else ""
        first = first or (n, rss)
        print(f"client host, {n:4d} members: peak RSS {rss:8.1f} MB ({n} separate clients ~ {n * one:8.1f} MB{extra}; "
              f"all joined in {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
